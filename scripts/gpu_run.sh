#!/usr/bin/env bash
# GPU work for one device call; logs and results under $OUT (the device tool's folder).
# Use through the kit: bash .gpu/b/stage2.sh bash scripts/gpu_run.sh STEP [STEP ...]
#   tests        all @pytest.mark.gpu tests (core, torch, jax, cold start)
#   tests-core   the core kernel tests only
#   tests-list   the @pytest.mark.gpu tests of the files or node ids in GPU_TESTS (space-separated), in one process
#   fuzz-shards-FE  the GPU fuzz of front end FE (jax, torch, core, ...) in FUZZ_SHARDS processes side by side
#                (default 6; XATTN_FUZZ_SHARD=i/k each, XATTN_FUZZ_START/_N honoured; FUZZ_SHARD_STARTS=s0,s1,...
#                gives each shard its own start, "-" skips one: a cut-short run resumes where each shard stopped), merged into
#                $OUT/results/fuzz_h200.json (python -m tests.fuzz.results merge); logs in $OUT/gpu_tests.log
#   bench        core suite -> $OUT/results/core_h200.json
#   cold         cold vs warm start -> $OUT/results/cold_start_h200.json
#   full-PART    benchmarks/full.py --part PART (d512, small, hf, sliding, varlen, host, peak), appended to
#                $OUT/results/full_h200.json, continuing benchmarks/results/full_h200.json if committed
#                (rows of the part already measured are kept: a part cut short resumes)
#   redo-PART    the same, but the part's earlier rows are dropped and measured anew
#   split-kernels  benchmarks/tools/split_kv_probe.py kernels (CUDA time per kernel of one split-KV call; SPLIT_PROBE_SHAPES)
#   split-host   benchmarks/tools/split_host_probe.py (host time of a decode call, where it goes; SPLIT_HOST_SHAPES,
#                SPLIT_HOST_CALLS, SPLIT_HOST_PROFILE=1 for the cProfile / torch.profiler tables,
#                SPLIT_HOST_PATTERNS=1 for host time by pattern)
#   tile-probe   benchmarks/tools/decode_tile_probe.py (FA4 split-KV decode tiles and a PDL combine vs SDPA at d128;
#                TILE_PROBE_ARGS) -> $OUT/probe.log
#   probe        benchmarks/tools/host_overhead_probe.py (where the host time of a call goes)
#   timing       benchmarks/tools/timing_method_probe.py (torch paths under do_bench and the JAX loop)
#   e2e-PART     benchmarks/e2e_gemma4.py --parts PART (torch or jax) -> $OUT/results/e2e_gemma4_h200.json, continuing
#                benchmarks/results/e2e_gemma4_h200.json (E2E_SEQLENS, E2E_IMPLS narrow it; E2E_TIMEOUT: seconds per
#                (impl, N) process, default 240)
#   packed       benchmarks/packed.py (packed d512 fwd+bwd vs the same documents unpacked; PACKED_FRAMEWORKS,
#                PACKED_DOCS) -> $OUT/results/packed_h200.json, continuing benchmarks/results/packed_h200.json
#   e2e-packed-PART / e2e-check  benchmarks/e2e_gemma4.py --packed (--check: ffpa/flex loss and grads vs sdpa)
#   bwd-routes   benchmarks/bwd_routes.py (d512 backward: FFPA vs chunked GEMM; BWD_SEQLENS, BWD_FRAMEWORKS, BWD_DTYPES,
#                BWD_ROUTES, BWD_SHAPES) -> $OUT/results/bwd_routes_h200.json
#   packed-layouts  benchmarks/tools/packed_layouts.py (torch's packed GEMM backward, groups vs segments, on the same
#                out/lse; PACKED_DOCS) -> $OUT/results/packed_layouts_h200.json
#   packed-profile  benchmarks/tools/packed_profile.py (CUDA time per kernel, packed vs dense backward; PACKED_DOCS)
#   diag-probe   benchmarks/tools/diag_pieces_probe.py (causal GEMM backward per diagonal block plan; DIAG_SEQLENS,
#                DIAG_SHAPES, DIAG_VARIANTS, DIAG_REPEATS)
#   aliased-probe[-CHECK]  benchmarks/tools/aliased_varlen_gemm_probe.py (the varlen GEMM ingredients of the packed
#                backward under jit, checked vs torch; CHECK one of aliased, table, keys, dq (default all); ALIASED_DOCS,
#                ALIASED_KEYS; docs/design.md, the open #23 design)
#   bwd-profile  benchmarks/tools/gemm_bwd_profile.py (CUDA time per kernel of the GEMM backward; never autotune on the device)
#   e2e-profile  benchmarks/tools/e2e_profile.py (CUDA time per kernel of the torch e2e step, ffpa vs none; E2E_PROFILE_N)
#   decode       benchmarks/decode.py (greedy decode ms/token, eager and CUDA graphs; DECODE_IMPLS, DECODE_MODES,
#                DECODE_PROMPT, DECODE_ROUNDS, DECODE_REPEATS, DECODE_TIMEOUT) -> $OUT/results/decode_h200.json, continuing benchmarks/results/decode_h200.json
#   cb           benchmarks/continuous_batching.py (HF generate_batch tokens/s, ffpa vs sdpa; CB_REQUESTS, CB_PROMPT)
#                -> $OUT/results/continuous_batching_h200.json
#   decode-attn  benchmarks/decode_attention.py (one decoding attention call: ms, HBM share; DECODE_ATTN_ARGS)
#                -> $OUT/results/decode_attention_h200.json
#   paged-jax    benchmarks/paged_jax.py (xattn.jax.paged_attention vs Pallas' GPU paged_attention; PAGED_JAX_ARGS)
#                -> $OUT/results/paged_jax_h200.json
#   decode-profile  benchmarks/tools/decode_profile.py (host time of a decode step by module, syncs by call site;
#                DECODE_PROFILE_IMPL, DECODE_PROFILE_MODE, DECODE_PROFILE_LABEL) -> $OUT/results/decode_profile_h200.json (continuing)
#   host-cost    benchmarks/tools/host_cost.py (host µs per call, torch and JAX, real kernels) -> $OUT/results/
#                host_cost_h200.json, continuing benchmarks/results/; with .gpu/before.tar (an older tree's xattn/,
#                carried; HOST_COST_BEFORE names its commit) the same tool first runs on that tree, label "before"
#   memory       benchmarks/memory_growth.py (1,000 mixed calls in one process) -> $OUT/results/memory_growth_h200.json
#   jax-probe    benchmarks/tools/jax_two_gpu_probe.py (2 GPUs; native stacks of a hang when .gpu/tools/py-spy.xz
#                is carried) -> $OUT/probe.log
#   ring-PART    benchmarks/ring.py --parts PART (torch, jax or gemma; 2 GPUs) -> $OUT/results/ring_h200x2.json,
#                continuing benchmarks/results/ring_h200x2.json (the other parts' rows are kept)
# Steps run in order; the whole call stops before the device tool's 600 s limit (BUDGET_S); STEP_S caps
# each step (a step that may hang cannot eat the steps after it).
# At most 8 files come back from $OUT: info.txt, gpu_tests.log, steps.log, probe.log, cache_list.txt,
# results/*.json.
# A kernel cache filled on the CPU machine (scripts/prefill_gpu_cache.py -> .gpu/kc, carried)
# is unpacked into $XATTN_CACHE_DIR first.
set -uo pipefail
OUT=${OUT:-/tmp/xattn-out}
BUDGET_S=${BUDGET_S:-575}
mkdir -p "$OUT/results"
[ $# -gt 0 ] || { echo "usage: gpu_run.sh STEP [STEP ...]" >&2; exit 2; }
if [ -f .gpu/kc/kernels.tar.xz ] && [ -n "${XATTN_CACHE_DIR:-}" ] && [ ! -f "$XATTN_CACHE_DIR/.prefilled" ]; then
  mkdir -p "$XATTN_CACHE_DIR" && tar xJf .gpu/kc/kernels.tar.xz -C "$XATTN_CACHE_DIR" && touch "$XATTN_CACHE_DIR/.prefilled"
  echo "gpu_run: unpacked $(ls "$XATTN_CACHE_DIR"/*.o | wc -l) prefilled kernel-cache entries"
fi
python -c "import sys, torch, transformers; from xattn.core.info import report; print(sys.version.split()[0], \"torch\", torch.__version__, \"transformers\", transformers.__version__); print(report())" | tee "$OUT/info.txt"
[ -f benchmarks/results/full_h200.json ] && [ ! -f "$OUT/results/full_h200.json" ] \
  && cp benchmarks/results/full_h200.json "$OUT/results/full_h200.json"
left() { echo $(( BUDGET_S - SECONDS )); }
for step in "$@"; do
  t=$(left)
  [ -n "${STEP_S:-}" ] && [ "$STEP_S" -lt "$t" ] && t=$STEP_S
  if [ "$t" -lt 20 ]; then echo "gpu_run: no time left for $step" | tee -a "$OUT/steps.log"; continue; fi
  echo "=== $step (${t} s left) ===" | tee -a "$OUT/steps.log"
  case "$step" in
    tests) timeout "$t" python -m pytest -m gpu -q -rP -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -30 ;;
    tests-core) timeout "$t" python -m pytest -m gpu -q -rP -p no:cacheprovider tests/core 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    tests-list) timeout "$t" python -m pytest -m gpu -q -rP -p no:cacheprovider --durations=15 ${GPU_TESTS:?GPU_TESTS names the tests} 2>&1 \
              | tee -a "$OUT/gpu_tests.log" | tail -40 ;;
    fuzz-shards-*) fe=${step#fuzz-shards-}; k=${FUZZ_SHARDS:-6}; dir=/var/tmp/xattn-fuzz; rm -rf "$dir"; mkdir -p "$dir"
            IFS=, read -ra starts <<< "${FUZZ_SHARD_STARTS:-}"
            for i in $(seq 0 $((k - 1))); do
              start=${starts[$i]:-${XATTN_FUZZ_START:-0}}; [ "$start" = "-" ] && continue
              XATTN_FUZZ_START="$start" XATTN_FUZZ_SHARD="$i/$k" XATTN_FUZZ_OUT="$dir/shard_$i.json" timeout "$((t - 15))" python -m pytest -m fuzz -q \
                -p no:cacheprovider "tests/fuzz/test_fuzz_${fe//-/_}.py" > "$dir/shard_$i.log" 2>&1 &
            done
            wait
            for f in "$dir"/shard_*.log; do echo "--- $f"; tail -4 "$f"; done >> "$OUT/gpu_tests.log"
            if ls "$dir"/shard_*.json > /dev/null 2>&1; then
              python -m tests.fuzz.results merge --out "$OUT/results/fuzz_h200.json" --note "$k shards side by side" \
                "$dir"/shard_*.json 2>&1 | tee -a "$OUT/gpu_tests.log"
            else echo "fuzz-shards: no shard wrote results" | tee -a "$OUT/gpu_tests.log"; fi ;;
    tests-*) timeout "$t" python -m pytest -m gpu -q -rP -p no:cacheprovider "tests/${step#tests-}" 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -30 ;;
    bench) timeout "$t" python benchmarks/bench.py --out "$OUT/results/core_h200.json" 2>&1 | tee -a "$OUT/steps.log" | tail -30 ;;
    cold) timeout "$t" python benchmarks/cold_start.py --out "$OUT/results/cold_start_h200.json" 2>&1 | tee -a "$OUT/steps.log" | tail -20 ;;
    redo-*) timeout "$t" python benchmarks/full.py --part "${step#redo-}" --append --redo --out "$OUT/results/full_h200.json" \
              2>&1 | tee -a "$OUT/steps.log" | tail -12 ;;
    cb) timeout "$t" python benchmarks/continuous_batching.py --requests "${CB_REQUESTS:-8,32,64}" --prompt "${CB_PROMPT:-8192}" \
              --out "$OUT/results/continuous_batching_h200.json" 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -20 ;;
    split-kernels) timeout "$t" python benchmarks/tools/split_kv_probe.py kernels 2>&1 | grep --line-buffered -v Warning \
              | tee -a "$OUT/steps.log" | tail -60 ;;
    split-host) timeout "$t" python benchmarks/tools/split_host_probe.py ${SPLIT_HOST_SHAPES:+--shapes "$SPLIT_HOST_SHAPES"} \
              ${SPLIT_HOST_CALLS:+--calls "$SPLIT_HOST_CALLS"} ${SPLIT_HOST_PROFILE:+--profile} ${SPLIT_HOST_PATTERNS:+--patterns} 2>&1 \
              | grep --line-buffered -v Warning | tee -a "$OUT/probe.log" | tail -20 ;;
    tile-probe) timeout "$t" python benchmarks/tools/decode_tile_probe.py ${TILE_PROBE_ARGS:-} 2>&1 \
              | grep --line-buffered -v Warning | tee -a "$OUT/probe.log" | tail -80 ;;
    probe) timeout "$t" python benchmarks/tools/host_overhead_probe.py 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -25 ;;
    e2e-profile) timeout "$t" python benchmarks/tools/e2e_profile.py --seqlen "${E2E_PROFILE_N:-8192}" 2>&1 | grep --line-buffered -v Warning \
              | tee -a "$OUT/steps.log" | tail -70 ;;
    packed) [ -f benchmarks/results/packed_h200.json ] && [ ! -f "$OUT/results/packed_h200.json" ] \
              && cp benchmarks/results/packed_h200.json "$OUT/results/packed_h200.json"
            timeout "$t" python benchmarks/packed.py --frameworks "${PACKED_FRAMEWORKS:-torch,jax}" \
              ${PACKED_DOCS:+--docs "$PACKED_DOCS"} --out "$OUT/results/packed_h200.json" 2>&1 | grep --line-buffered -v Warning \
              | tee -a "$OUT/steps.log" | tail -16 ;;
    decode) [ -f benchmarks/results/decode_h200.json ] && [ ! -f "$OUT/results/decode_h200.json" ] \
              && cp benchmarks/results/decode_h200.json "$OUT/results/decode_h200.json"
            timeout "$t" python benchmarks/decode.py --impls "${DECODE_IMPLS:-ffpa,sdpa,flash_attention_2}" \
              --modes "${DECODE_MODES:-eager,graphs}" --prompt "${DECODE_PROMPT:-8192}" --rounds "${DECODE_ROUNDS:-1}" \
              --repeats "${DECODE_REPEATS:-5}" ${DECODE_TIMEOUT:+--timeout "$DECODE_TIMEOUT"} \
              --out "$OUT/results/decode_h200.json" 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -12 ;;
    decode-attn) timeout "$t" python benchmarks/decode_attention.py --out "$OUT/results/decode_attention_h200.json" \
              ${DECODE_ATTN_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -60 ;;
    paged-jax) timeout "$t" python benchmarks/paged_jax.py --out "$OUT/results/paged_jax_h200.json" \
              ${PAGED_JAX_ARGS:-} 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -40 ;;
    decode-profile) [ -f benchmarks/results/decode_profile_h200.json ] && [ ! -f "$OUT/results/decode_profile_h200.json" ] \
              && cp benchmarks/results/decode_profile_h200.json "$OUT/results/decode_profile_h200.json"
            timeout "$t" python benchmarks/tools/decode_profile.py --mode "${DECODE_PROFILE_MODE:-eager}" --impl "${DECODE_PROFILE_IMPL:-ffpa}" \
              --label "${DECODE_PROFILE_LABEL:-}" --out "$OUT/results/decode_profile_h200.json" 2>&1 \
              | grep --line-buffered -v Warning | tee -a "$OUT/probe.log" | tail -60 ;;
    e2e-packed-*|e2e-check) [ -f benchmarks/results/e2e_gemma4_h200.json ] && [ ! -f "$OUT/results/e2e_gemma4_h200.json" ] \
              && cp benchmarks/results/e2e_gemma4_h200.json "$OUT/results/e2e_gemma4_h200.json"
            part=${step#e2e-packed-}; extra="--packed"
            [ "$step" = e2e-check ] && part=torch && extra="--packed --check"
            timeout "$t" python benchmarks/e2e_gemma4.py --parts "$part" --seqlens "${E2E_SEQLENS:-16384}" $extra \
              ${E2E_IMPLS:+--impls "$E2E_IMPLS"} ${E2E_TIMEOUT:+--timeout "$E2E_TIMEOUT"} --out "$OUT/results/e2e_gemma4_h200.json" 2>&1 | grep --line-buffered -v Warning \
              | tee -a "$OUT/steps.log" | tail -16 ;;
    e2e-*) [ -f benchmarks/results/e2e_gemma4_h200.json ] && [ ! -f "$OUT/results/e2e_gemma4_h200.json" ] \
              && cp benchmarks/results/e2e_gemma4_h200.json "$OUT/results/e2e_gemma4_h200.json"
            timeout "$t" python benchmarks/e2e_gemma4.py --parts "${step#e2e-}" --seqlens "${E2E_SEQLENS:-8192,16384,32768}" \
              ${E2E_IMPLS:+--impls "$E2E_IMPLS"} ${E2E_TIMEOUT:+--timeout "$E2E_TIMEOUT"} --out "$OUT/results/e2e_gemma4_h200.json" 2>&1 | grep --line-buffered -v Warning \
              | tee -a "$OUT/steps.log" | tail -16 ;;
    bwd-routes) timeout "$t" python benchmarks/bwd_routes.py --seqlens "${BWD_SEQLENS:-8192,16384}" \
              --frameworks "${BWD_FRAMEWORKS:-torch,jax}" --dtypes "${BWD_DTYPES:-bfloat16,float16}" --routes "${BWD_ROUTES:-ffpa,gemm}" --shapes "${BWD_SHAPES:-32/4/causal,16/16/full,16/16/causal}" \
              --out "$OUT/results/bwd_routes_h200.json" 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -40 ;;
    packed-layouts) timeout "$t" python benchmarks/tools/packed_layouts.py ${PACKED_DOCS:+--docs "$PACKED_DOCS"} \
              --out "$OUT/results/packed_layouts_h200.json" 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -12 ;;
    packed-profile) timeout "$t" python benchmarks/tools/packed_profile.py ${PACKED_DOCS:+--docs "$PACKED_DOCS"} \
              ${PACKED_PASSES:+--passes "$PACKED_PASSES"} 2>&1 \
              | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -120 ;;
    diag-probe) timeout "$t" python benchmarks/tools/diag_pieces_probe.py ${DIAG_SEQLENS:+--seqlens "$DIAG_SEQLENS"} \
              ${DIAG_SHAPES:+--shapes "$DIAG_SHAPES"} ${DIAG_VARIANTS:+--variants "$DIAG_VARIANTS"} \
              ${DIAG_REPEATS:+--repeats "$DIAG_REPEATS"} 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -40 ;;
    aliased-probe*) checks=${step#aliased-probe}; timeout "$t" python -u benchmarks/tools/aliased_varlen_gemm_probe.py \
              ${checks:+--checks "${checks#-}"} ${ALIASED_DOCS:+--docs "$ALIASED_DOCS"} \
              ${ALIASED_KEYS:+--keys "$ALIASED_KEYS"} 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -20 ;;
    bwd-profile) timeout "$t" python benchmarks/tools/gemm_bwd_profile.py 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -80 ;;
    host-cost) [ -f benchmarks/results/host_cost_h200.json ] && [ ! -f "$OUT/results/host_cost_h200.json" ] \
              && cp benchmarks/results/host_cost_h200.json "$OUT/results/host_cost_h200.json"
            [ -f .gpu/before.tar ] && rm -rf /var/tmp/before && mkdir -p /var/tmp/before \
              && cp -r benchmarks /var/tmp/before/ && tar xf .gpu/before.tar -C /var/tmp/before
            for round in $(seq "${HOST_COST_ROUNDS:-2}"); do  # before and after alternate: the host's speed drifts
              if [ -f .gpu/before.tar ]; then  # the tools put their repo first on sys.path: run from a copy
                (cd /var/tmp/before && timeout "$(left)" python benchmarks/tools/host_cost.py --label before \
                  --commit "${HOST_COST_BEFORE:-before}" --out "$OUT/results/host_cost_h200.json") 2>&1 \
                  | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | grep " us " ; fi
              timeout "$(left)" python benchmarks/tools/host_cost.py --label after ${HOST_COST_AFTER:+--commit "$HOST_COST_AFTER"} --out "$OUT/results/host_cost_h200.json" \
                2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | grep " us "
            done ;;
    memory) timeout "$t" python benchmarks/memory_growth.py --out "$OUT/results/memory_growth_h200.json" 2>&1 \
              | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -20 ;;
    jax-probe) spy=""
            if [ -f .gpu/tools/py-spy.xz ]; then xz -dc .gpu/tools/py-spy.xz > /var/tmp/py-spy && chmod +x /var/tmp/py-spy \
              && spy="--py-spy /var/tmp/py-spy"; fi
            timeout "$t" python benchmarks/tools/jax_two_gpu_probe.py --timeout "${PROBE_TIMEOUT:-45}" $spy --repeat "${PROBE_REPEAT:-1}" ${PROBE_CASES:-} 2>&1 \
              | grep --line-buffered -v Warning > "$OUT/probe.log"; grep "probe" "$OUT/probe.log" | tail -20 ;;
    timing) timeout "$t" python benchmarks/tools/timing_method_probe.py 2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -20 ;;
    ring-*) [ -f benchmarks/results/ring_h200x2.json ] && [ ! -f "$OUT/results/ring_h200x2.json" ] \
              && cp benchmarks/results/ring_h200x2.json "$OUT/results/ring_h200x2.json"
            timeout "$t" python benchmarks/ring.py --parts "${step#ring-}" --out "$OUT/results/ring_h200x2.json" \
              2>&1 | grep --line-buffered -v Warning | tee -a "$OUT/steps.log" | tail -12 ;;
    full-*) timeout "$t" python benchmarks/full.py --part "${step#full-}" --append --out "$OUT/results/full_h200.json" \
              2>&1 | tee -a "$OUT/steps.log" | tail -12 ;;
    *) echo "unknown step $step" >&2 ;;
  esac
done
python -m xattn cache list > "$OUT/cache_list.txt" 2>&1
echo "gpu_run: done in ${SECONDS} s"
