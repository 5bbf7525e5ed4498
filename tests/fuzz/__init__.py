"""GPU fuzzing against fp64 (issue #12 item 1): random configurations per front end, forward and backward.

Ahead of the GPU call, on the CPU (compiles the 60 launchers of the pool into the packed cache)::

    .venv312/bin/python scripts/prefill_gpu_cache.py --fuzz          # --fuzz --list: what it builds

On the GPU (300 configurations per front end; results -> benchmarks/results/fuzz_h200.json or
XATTN_FUZZ_OUT)::

    bash .gpu/b/stage2.sh env XATTN_FUZZ_OUT=$OUT/results/fuzz_h200.json bash scripts/gpu_run.sh tests-fuzz
    XATTN_FUZZ_SEED=20261201 XATTN_FUZZ_N=300 python -m pytest -m fuzz -q -p no:cacheprovider tests/fuzz
    XATTN_FUZZ_ONLY=<seed> python -m pytest -m fuzz -q tests/fuzz/test_fuzz_torch.py    # one configuration

The JAX front end spends ~2.4 s a configuration compiling under XLA (the kernels take milliseconds), so the
device call runs it in k processes side by side (``XATTN_FUZZ_SHARD=i/k`` each) and merges their rows::

    bash .gpu/b/stage2.sh env FUZZ_SHARDS=8 [XATTN_FUZZ_START=k] bash scripts/gpu_run.sh fuzz-shards-jax
    python -m tests.fuzz.results merge --out benchmarks/results/fuzz_h100.json PART.json ...   # parts -> one row

The CPU tests (``test_space``, ``test_tolerance``, ``test_results``, ``test_standin``) run in CI.
"""
