#!/usr/bin/env bash
# Builds .bench-env/: the separate environment of the TRL baseline of tools/bench_vs_trl.py (`make bench-env`).
# TRL pulls accelerate / datasets and must never enter the trainer's .venv. The versions are pinned so the
# figures in the README can be reproduced: torch and transformers are the trainer's own (the same kernels and the
# same Qwen3-MoE modelling code on both sides), TRL the release whose GRPOTrainer the benchmark was written
# against (its num_iterations / steps_per_generation semantics are read from that source). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${BENCH_ENV:-.bench-env}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
PIP="$ENV/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU torch build (an unpinned torch pulls a multi-GB CUDA build), as tools/install.sh does.
$PIP install -q torch==2.13.0
$PIP install -q transformers==5.24.0 trl==1.16.0 "accelerate>=1.10.1" "datasets>=4.7.0"
"$ENV/bin/python" -c "import trl, transformers, torch; print('bench env:', 'trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
