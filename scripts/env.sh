#!/usr/bin/env bash
# Create (or refresh) .venv with xattn and its pinned kernel stack. Idempotent and quick
# when already set up. Torch comes first, pinned to the CPU wheel this kind of machine
# keeps on disk: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.xattn-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "[env] installing torch (CPU) and xattn[test] into .venv ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch
  .venv/bin/python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
echo "[env] ready: $(.venv/bin/python -c 'import xattn, torch, jax; print("xattn", xattn.__version__, "torch", torch.__version__, "jax", jax.__version__)')" >&2
