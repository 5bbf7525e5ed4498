"""HF continuous batching on the H200 with the real kernels (issue #44, item 3): ``"ffpa_flash"`` against fp32
of the same weights teacher-forced on the generated tokens, next to transformers' own bf16 sdpa continuous
batching (the yardstick); FA4 (head dim 256, sliding and full layers) and FFPA (512, full layers), with and
without CB's CUDA graphs (a "flash" name turns them on by default on CUDA: the attention call must not sync)."""

import pytest
import torch

pytest.importorskip("transformers")

from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import continuous_batching as cb  # noqa: E402

from . import test_hf_continuous_batching as cpu  # noqa: E402
from .hf_gpu import hf_gpu  # noqa: E402,F401  (autouse: skips without the kernels)

pytestmark = pytest.mark.gpu


def _run(net, graphs: bool):
    from transformers import GenerationConfig

    config = cb.batching_config(page_size=256, num_blocks=32, max_batch_tokens=16, return_logprobs=True,
                                use_cuda_graph=graphs)
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = net.generate_batch(cpu.PROMPTS, generation_config=gen, continuous_batching_config=config)
    assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
    return [(r.generated_tokens, r.logprobs) for r in sorted(out.values(), key=lambda r: int(r.request_id[4:]))]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("head_dim", [256, 512])
def test_generate_batch_on_the_kernels_vs_fp32(head_dim, graphs):
    if cb.unsupported_reason():
        pytest.skip(cb.unsupported_reason())
    sliding = head_dim <= 256  # FFPA has no window: d512 sliding layers would run on the fallback
    net = cpu._model(head_dim, 2, sliding).to(device="cuda", dtype=torch.bfloat16)
    truth = cpu._model(head_dim, 2, sliding)
    truth.load_state_dict({k: v.float().cpu() for k, v in net.state_dict().items()})
    sdpa = _run(net, graphs)
    cb.enable_continuous_batching(net)
    ours = _run(net, graphs)
    assert not fa._FALLBACK_WARNED, fa._FALLBACK_WARNED
    err, yardstick = cpu._err(ours, cpu._teacher_forced(truth, ours)), cpu._err(sdpa, cpu._teacher_forced(truth, sdpa))
    assert err <= 1.5 * yardstick + 0.02, (err, yardstick)


@pytest.mark.parametrize("d, ps, window", [(512, 64, None), (512, 256, None), (256, 16, 5), (128, 128, None)])
def test_block_table_decode_on_the_kernels(d, ps, window):
    """HF's decode fast path through the adapter on the paged kernels (bf16) against fp64 of the gathered keys."""
    from tests.reference import rel_err

    out, refs, _ = cpu.block_table_decode(d, ps, window, device="cuda", dtype=torch.bfloat16)
    for i, (want, appended) in enumerate(refs):
        assert appended, i
        assert rel_err(out[:, i:i + 1], want) < 1e-2, i
