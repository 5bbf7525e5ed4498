"""#12 item 4, torch: tensors on cuda:1 while cuda:0 is current run on their own device and on
that device's current stream, and give the same bits as on cuda:0 (forward and gradients);
mixing devices in one call is a named error, and the process keeps working afterwards."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention, rel_err

pytestmark = pytest.mark.gpu

CONFIGS = [pytest.param(512, 4, True, id="ffpa-d512-gqa4-causal"),
           pytest.param(128, 4, True, id="fa4-d128-gqa4-causal")]


@pytest.fixture(scope="module", autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")


def _inputs(d, g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    # B 2, Nq 333 != Nk 397, Hq 2g != N: a transposed layout cannot pass by accident.
    return mk(2, 333, 2 * g, d), mk(2, 397, 2, d), mk(2, 397, 2, d), mk(2, 333, 2 * g, d)


def _run(q, k, v, dout, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = xt.attention(q, k, v, causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("d, g, causal", CONFIGS)
def test_second_gpu_gives_first_gpus_bits(d, g, causal):
    host = _inputs(d, g)
    with torch.cuda.device(0):
        on0 = _run(*(t.to("cuda:0") for t in host), causal)
        on1 = _run(*(t.to("cuda:1") for t in host), causal)
        assert torch.cuda.current_device() == 0
    for name, a, b in zip(("out", "dq", "dk", "dv"), on0, on1):
        assert b.device == torch.device("cuda:1"), name
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: cuda:1 differs from cuda:0"
    ref, _ = ref_attention(*(t.double() for t in host[:3]), scale=d ** -0.5, causal=causal)
    assert rel_err(on1[0].cpu(), ref) < 1e-2  # and the bits are right, not merely equal


@pytest.mark.parametrize("d, g, causal", CONFIGS)
def test_second_gpu_runs_on_its_current_stream(d, g, causal):
    """Inputs written on a side stream of cuda:1 after a long sleep: a kernel enqueued anywhere but
    that stream would read them before they exist."""
    host = _inputs(d, g, seed=1)
    with torch.cuda.device(0):
        expect = _run(*(t.to("cuda:0") for t in host), causal)[0].cpu()
        side = torch.cuda.Stream(device="cuda:1")
        staged = [t.to("cuda:1") for t in host[:3]]
        torch.cuda.synchronize("cuda:1")
        with torch.cuda.stream(side):
            late = [torch.full_like(t, float("nan")) for t in staged]
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream only
            for dst, src in zip(late, staged):
                dst.copy_(src)
            out = xt.attention(*late, causal=causal)
        side.synchronize()
    assert torch.equal(out.cpu(), expect)


def test_mixed_devices_is_a_named_error_and_the_process_goes_on():
    q, k, v, _ = _inputs(128, 4)
    with pytest.raises(ValueError, match="cuda:1.*cuda:0|cuda:0.*cuda:1"):
        xt.attention(q.to("cuda:0"), k.to("cuda:1"), v.to("cuda:0"), causal=True)
    with pytest.raises(ValueError, match="cuda"):
        xt.attention(q.to("cuda:1"), k.to("cuda:1"), v.to("cuda:0"), causal=True)
    out = xt.attention(*(t.to("cuda:1") for t in (q, k, v)), causal=True)
    ref, _ = ref_attention(q.double(), k.double(), v.double(), scale=128 ** -0.5, causal=True)
    assert rel_err(out.cpu(), ref) < 1e-2
