#!/usr/bin/env bash
# Creates .venv and installs everything megatron-gspo needs. Idempotent: a second run only re-installs the
# package itself when setup.py changed (the Makefile tracks that).
#
# GPU hosts (nvidia-smi lists a GPU; GSPO_DEVICE=gpu|cpu overrides the detection) get the configuration the GPU
# path is written for, not whatever pip resolves:
#   - torch pinned to the rollout engine's own pin, because NCCL refuses a weight-sync group across NCCL releases
#     (rollout/server/nccl_versions.py checks it before the first sync). GSPO_ROLLOUT_ENGINE picks it:
#       sglang (default): SGLang 0.5.23 pins torch 2.14.1 (NCCL 2.30.7)
#       vllm:             vLLM 0.32 pins torch 2.13.0 (NCCL 2.29.7)
#     (PyPI's Linux torch wheels are the CUDA builds; GSPO_TORCH_INDEX_URL names another index, e.g. a CUDA
#     variant from download.pytorch.org.)
#   - transformer-engine in megatron-core 0.16.1's range (setup.py's `gpu` extra), built against that torch
#     (--no-build-isolation): without it megatron-gspo builds the local spec and trains without TE;
#   - then tools/gpu_env_check.py: TE, Triton (compiler and libcuda) and NCCL, one line per failure; a failure
#     fails the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=${GSPO_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP="$VPY -m pip"

device=${GSPO_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
case "$device" in
  gpu | cpu) ;;
  *) echo "install: GSPO_DEVICE=$device must be gpu or cpu" >&2; exit 2 ;;
esac
engine=${GSPO_ROLLOUT_ENGINE:-sglang}
case "$engine" in
  sglang) gpu_torch=2.14.1 ;;
  vllm) gpu_torch=2.13.0 ;;
  *) echo "install: GSPO_ROLLOUT_ENGINE=$engine must be sglang or vllm (the rollout engine whose torch, and so NCCL, the trainer must share)" >&2; exit 2 ;;
esac

$PIP install -q --upgrade pip setuptools wheel
if [ "$device" = gpu ]; then
  # "<version> <cuda>" of the torch installed now ("" when none): replaced unless it is the pinned CUDA build.
  have=$("$VPY" -c "import torch; print(torch.__version__.split('+')[0], torch.version.cuda or 'cpu')" 2>/dev/null || true)
  if [ "${have%% *}" != "$gpu_torch" ] || [ "${have##* }" = cpu ]; then
    $PIP install -q ${GSPO_TORCH_INDEX_URL:+--index-url "$GSPO_TORCH_INDEX_URL"} "torch==$gpu_torch"
  fi
  $PIP install -q -e ".[test]"
  $PIP install -q --no-build-isolation -e ".[gpu]"
  "$VPY" tools/gpu_env_check.py
else
  if ! "$VPY" -c "import torch" 2>/dev/null; then
    # Unpinned torch pulls a multi-GB CUDA build; the CPU build is what a CPU machine needs.
    $PIP install -q torch==2.13.0
  fi
  $PIP install -q -e ".[test]"
fi
touch "$VENV/.installed"
