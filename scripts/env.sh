#!/usr/bin/env bash
# Create (or refresh) .venv with xattn and its pinned kernel stack. Idempotent and quick
# when already set up. Torch comes first, pinned to the CPU wheel this kind of machine
# keeps on disk: a bare `torch` requirement would pull a multi-GB CUDA build.
# The rest is installed with `-c constraints.txt`: the versions the tests pass on.
# XATTN_UNPINNED=1: without it, each dependency upgraded to its newest (torch stays).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.xattn-installed
if [ "${XATTN_UNPINNED:-0}" = 1 ]; then mode=unpinned; else mode=pinned; fi
# What the install depends on: a changed pyproject.toml or constraints.txt, or the other mode, reinstalls.
want="$mode $(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[env] installing torch (CPU) and xattn[test] ($mode) into .venv ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q torch
  if [ "$mode" = pinned ]; then
    .venv/bin/python -m pip install -q -e ".[test]" -c constraints.txt
  else  # the newest of everything but torch, which stays the one installed above
    .venv/bin/python -c 'import torch; print("torch==" + torch.__version__)' >.venv/.xattn-torch-pin.txt
    .venv/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]" -c .venv/.xattn-torch-pin.txt
  fi
  echo "$want" >"$stamp"
fi
echo "[env] ready ($mode): $(.venv/bin/python -c 'import xattn, torch, jax; print("xattn", xattn.__version__, "torch", torch.__version__, "jax", jax.__version__)')" >&2
