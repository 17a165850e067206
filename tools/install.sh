#!/usr/bin/env bash
# Creates .venv and installs everything megatron-gspo needs. Idempotent: a second run only re-installs the
# package itself when setup.py changed (the Makefile tracks that).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q torch          # CUDA build on GPU machines
  else
    # Unpinned torch pulls a multi-GB CUDA build; the CPU build is what a CPU machine needs.
    $PIP install -q torch==2.13.0
  fi
fi
$PIP install -q -e ".[test]"
touch .venv/.installed
