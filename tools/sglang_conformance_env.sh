#!/usr/bin/env bash
# Builds .venv-sglang-conformance: the SGLang releases the engine is tested against (rollout/sglang/versions.py),
# importable on a CPU without their GPU dependencies, for tests/rollout/sglang/test_conformance.py (which checks
# our requests, command lines and response parsing against SGLang's own code; sglang_harness.py runs in it).
#
#   venv/                  python venv: torch and triton as the trainer's .venv has them (CPU builds here), and the
#                          pure-Python / CPU packages SGLang's request types, argument parser and tokenizer manager
#                          import (pinned below: the checks must not move when an unrelated package releases)
#   sglang-<version>/      `pip install --no-deps --target` of that release, plus the packages it pins itself whose
#                          version its imports depend on (transformers with its dependencies, openai,
#                          compressed-tensors, xgrammar), read from the release's own metadata
#   sglang-router-<v>/     the router wheel (its Rust binary runs on a CPU: the test starts it for real)
# GPU-only modules (sgl_kernel, torchvision's CUDA build, tvm_ffi kernels) are not installed: the harness stubs them.
# Idempotent and cached: a part that exists is kept (the Makefile re-runs this when it or versions.py changed).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=${SGLANG_CONFORMANCE_ENV:-.venv-sglang-conformance}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
TRAINER_PY=${TRAINER_PYTHON:-.venv/bin/python}
start=$(date +%s)

read -r TESTED ROUTER < <("$PY" - <<'PY'
ns = {}
exec(open("megatron_gspo/rollout/sglang/versions.py").read(), ns)
print(",".join(ns["TESTED_SGLANG"]), ns["SGLANG_ROUTER"])
PY
)
TESTED=${TESTED//,/ }
TORCH_VERSION=$("$TRAINER_PY" -c 'import torch; print(torch.__version__.split("+")[0])')
TRITON_VERSION=$("$TRAINER_PY" -c 'import triton; print(triton.__version__)')
BASE=(
    "pydantic==2.14.4" "fastapi==0.165.0" "msgspec==0.23.0" "pyzmq==27.3.0" "orjson==3.13.0" "pybase64==1.5.1"
    "numpy==2.4.6" "requests==2.34.2" "psutil==7.2.2" "setproctitle==1.3.8" "uvicorn==0.54.0" "uvloop==0.23.0"
    "aiohttp==3.14.5" "ipython==9.18.1" "gguf==0.19.0" "safetensors==0.8.0" "pyyaml==6.0.4" "tqdm==4.70.1"
    "regex==2026.11.19" "pillow==13.0.0" "dill==0.4.1" "sentencepiece==0.2.3" "loguru==0.7.3"
    "partial-json-parser==0.2.1.1.post7" "httpx==0.28.1" "anyio==4.16.0" "distro==1.9.0" "jiter==0.19.0"
    "sniffio==1.3.1" "einops==0.8.2" "jsonschema==4.26.0" "opentelemetry-api==1.45.2" "interegular"
    "apache-tvm-ffi==0.1.15.post2"
)
# Packages a release pins itself and imports with: installed into its directory at its own pin.
RELEASE_PINNED="transformers openai compressed-tensors xgrammar"

mkdir -p "$ENV_DIR"
VENV="$ENV_DIR/venv"
PIP=("$VENV/bin/python" -m pip)
# The trainer's torch / triton versions: the same CPU wheels it was installed from, no CUDA packages.
BASE=("torch==$TORCH_VERSION" "triton==$TRITON_VERSION" "${BASE[@]}")
if [[ "$(cat "$VENV/.base-installed" 2>/dev/null)" != "${BASE[*]}" ]]; then  # missing, or another list
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "${PIP[@]}" install -q --upgrade pip
    "${PIP[@]}" install -q "${BASE[@]}"
    echo "${BASE[*]}" >"$VENV/.base-installed"
fi

for version in $TESTED; do
    dir="$ENV_DIR/sglang-$version"
    [[ -f "$dir/.installed" ]] && continue
    rm -rf "$dir"
    "${PIP[@]}" install -q --no-deps --target "$dir" "sglang==$version"
    mapfile -t pins < <("$VENV/bin/python" - "$dir" "$version" "$RELEASE_PINNED" <<'PY'
import re, sys
from pathlib import Path

directory, version, wanted = sys.argv[1], sys.argv[2], sys.argv[3].split()
meta = (Path(directory) / f"sglang-{version}.dist-info" / "METADATA").read_text()
for line in meta.splitlines():
    m = re.match(r"Requires-Dist: ([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(==[^;\s]+)?\s*(;.*)?$", line)
    if m and m.group(1).lower().replace("_", "-") in wanted and not (m.group(4) or "").strip():
        print(m.group(1) + (m.group(3) or ""))
PY
    )
    for pin in "${pins[@]}"; do
        case "$pin" in
        transformers*) "${PIP[@]}" install -q --target "$dir" "$pin" ;;  # with its tokenizers / hub pins
        *) "${PIP[@]}" install -q --no-deps --target "$dir" "$pin" ;;
        esac
    done
    echo "sglang $version: ${pins[*]}" >"$dir/.installed"
done

router_dir="$ENV_DIR/sglang-router-$ROUTER"
if [[ ! -f "$router_dir/.installed" ]]; then
    rm -rf "$router_dir"
    "${PIP[@]}" install -q --no-deps --target "$router_dir" "sglang-router==$ROUTER"
    touch "$router_dir/.installed"
fi
echo "$TESTED router $ROUTER" >"$ENV_DIR/.installed"
echo "SGLang conformance env ready in $(($(date +%s) - start)) s: $ENV_DIR (sglang $TESTED, sglang-router $ROUTER)"
