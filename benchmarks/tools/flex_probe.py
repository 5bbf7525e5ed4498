"""Does HF's own attn_implementation="flex_attention" train the tiny Gemma 4 of the packed tests (left-padded
B 3, sliding d256 GQA 2) at N 70 and N 150 on this GPU? (xattn's XATTN_SLIDING_BACKEND=flex calls the same
HF flex function with the same BlockMask.) Prints one line per N."""

import torch

from tests.torch import gemma_packed as gp

SIZES = dict(hidden=128, heads=8, kv_heads=4, vocab=256, sliding_window=16)
for n in (70, 150):
    state = gp.weights(torch.bfloat16, **SIZES)
    model = gp.build("flex_attention", state, "cuda", torch.bfloat16, **SIZES)
    ids = torch.randint(0, 256, (3, n), device="cuda")
    keep = torch.ones(3, n, dtype=torch.long, device="cuda")
    keep[1, :23] = 0
    try:
        model(input_ids=ids, attention_mask=keep).logits.float().square().mean().backward()
        print(f"HF flex_attention N={n}: ok")
    except Exception as exc:  # noqa: BLE001 - a probe: report whatever torch raises
        print(f"HF flex_attention N={n}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
