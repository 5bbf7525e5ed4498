#!/usr/bin/env bash
# One device call's worth of GPU work, logs and results under $OUT (the device tool's folder).
# Use through the kit: bash .gpu/b/stage2.sh bash scripts/gpu_run.sh STEP
#   tests        all @pytest.mark.gpu tests (core, torch, jax, cold start)       ~8-10 min cold cache
#   tests-core   the core kernel tests only                                        ~5.5 min cold cache
#   bench        core suite + cold/warm start -> $OUT/results/{core,cold_start}_h200.json
#   full-PART    benchmarks/full.py --part PART (d512, small, sliding, varlen, host, peak), appended
#                to $OUT/results/full_h200.json, continuing benchmarks/results/full_h200.json if committed
set -uo pipefail
OUT=${OUT:-/tmp/xattn-out}
mkdir -p "$OUT/results"
step=${1:?usage: gpu_run.sh tests|tests-core|bench|full-PART}
python -c "from xattn.core.info import report; print(report())" | tee "$OUT/info.txt"
case "$step" in
  tests) timeout 570 python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
  tests-core) timeout 570 python -m pytest -m gpu -q -p no:cacheprovider tests/core 2>&1 | tee "$OUT/gpu_tests_core.log" | tail -25 ;;
  bench)
    timeout 300 python benchmarks/bench.py --out "$OUT/results/core_h200.json" 2>&1 | tee "$OUT/bench.log" | tail -30
    timeout 240 python benchmarks/cold_start.py --out "$OUT/results/cold_start_h200.json" 2>&1 | tail -30 ;;
  full-*)
    part=${step#full-}
    # continue the committed file, so parts from several calls end in one JSON
    [ -f benchmarks/results/full_h200.json ] && cp benchmarks/results/full_h200.json "$OUT/results/full_h200.json"
    timeout 570 python benchmarks/full.py --part "$part" --append --out "$OUT/results/full_h200.json" 2>&1 | tail -40 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
