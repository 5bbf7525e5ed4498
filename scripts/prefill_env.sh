#!/usr/bin/env bash
# A Python env with the GPU machine's Python minor (3.12; it is part of the kernel-cache key) and the
# GPU kit's kernel stack (../shared/gpu/wheels.txt), for scripts/prefill_gpu_cache.py. Idempotent.
#   bash scripts/prefill_env.sh && .venv312/bin/python scripts/prefill_gpu_cache.py
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON312:-}
if [ -z "$py" ]; then  # the first python3.12 that really runs (a pyenv shim may not)
  for c in $(command -v python3.12) $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null); do
    if "$c" --version >/dev/null 2>&1; then py=$c; break; fi
  done
fi
[ -n "$py" ] || { echo "prefill_env: no working python3.12 found (set PYTHON312)" >&2; exit 2; }
if [ ! -f .venv312/.ready ]; then
  "$py" -m venv .venv312
  .venv312/bin/python -m pip install -q "torch==2.13.0" numpy triton $(grep -v '^#' ../shared/gpu/wheels.txt)
  touch .venv312/.ready
fi
echo "prefill_env: $(.venv312/bin/python --version) ready in .venv312" >&2
