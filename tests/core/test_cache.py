"""The launcher cache compiles each key once, even when threads race for it."""

import threading
import time

import pytest

from xattn.core import cache
from xattn.core.spec import KernelSpec


@pytest.fixture
def recording_compiler():
    calls = []
    lock = threading.Lock()

    def compile_stub(spec):
        with lock:
            calls.append(spec)
        time.sleep(0.2)  # long enough for every thread to be waiting on the same key
        return object()

    cache.clear()
    cache.set_compiler(compile_stub)
    yield calls
    cache.set_compiler(None)
    cache.clear()


def _spec(**kw):
    return KernelSpec("ffpa", "fwd", "bfloat16", 512, 512, **kw)


def test_same_key_from_many_threads_compiles_once(recording_compiler):
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get_launcher(_spec()))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(recording_compiler) == 1
    assert len({id(r) for r in results}) == 1 and len(results) == 8
    assert results[0].seconds >= 0.2 and results[0].source == "compiled"


def test_different_keys_compile_in_parallel(recording_compiler):
    specs = [_spec(causal=c, qhead_per_kvhead=g) for c in (False, True) for g in (1, 2)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=cache.get_launcher, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(repr, recording_compiler)) == sorted(map(repr, specs))
    assert time.perf_counter() - t0 < 0.2 * len(specs)  # not serialised behind one lock
    assert set(cache.cached_specs()) == set(specs)


def test_unsupported_spec_never_reaches_the_compiler(recording_compiler):
    with pytest.raises(NotImplementedError, match="320-512"):
        cache.get_launcher(KernelSpec("ffpa", "fwd", "bfloat16", 128, 128))
    assert recording_compiler == []


def test_a_non_hopper_gpu_is_refused_before_any_compile(recording_compiler, monkeypatch):
    from xattn.core.device import GpuInfo

    monkeypatch.setattr(cache, "cuda_gpus", lambda: (GpuInfo(0, "NVIDIA B200", (10, 0), 148),))
    with pytest.raises(NotImplementedError, match=r"ships sm_90a kernels; this machine has NVIDIA B200 \(sm_100a\)"):
        cache.get_launcher(_spec())
    assert recording_compiler == []
