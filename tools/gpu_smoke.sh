#!/usr/bin/env bash
# megatron-gspo GPU smoke test: what CPU CI cannot check, in one script (about 7-10 minutes on one H200).
#
#   bash tools/gpu_smoke.sh                                          # from anywhere in the repository
#   SGLANG_PYTHON=/opt/sglang-venv/bin/python bash tools/gpu_smoke.sh  # also the SGLang rollout path
#
# Parts (each ends PASS, FAIL or SKIP with its reason; a summary table closes the run):
#   install      `make install` (CUDA torch when nvidia-smi works), unless GPU_SMOKE_SKIP_INSTALL=1
#   env          the trainer's python sees CUDA; notes torch / CUDA versions, GPUs, transformer-engine
#   kernels      pytest -m gpu tests/kernels: the Triton log-prob kernels compiled for the real device at
#                N=16384 x V=151936 bf16 (past 2**31 elements; in-place d logits; the fixed row config), forward-only, the
#                fused LM head, the fp32 CUDA addmm, and vocab-parallel TP=2 over NCCL (with >= 2 GPUs)
#   bench        tools/bench_logprob.py --device cuda: fused vs materialised-logits log-probs (prints ratios)
#   train-1gpu   tiny Qwen3-MoE, 3 GSPO steps, bf16, NCCL, TE layer spec when transformer-engine imports
#   bf16-load    pytest -m gpu tests/training/test_mixed_precision.py: a checkpoint loaded into a bf16 run (fp32
#                masters) keeps its weights through an SFT and an RL step at a tiny learning rate; exact resume
#   colocated-memory  pytest -m gpu tests/training/test_offload.py: the optimizer state, main-grad buffers and fp32
#                masters leave device memory (allocated bytes drop by what was moved) and come back bit-exactly
#   async-save   pytest -m gpu tests/training/test_async_checkpoint.py: a background checkpoint (trainer.async_save)
#                stages the tensors device -> host before megatron's writer forks; an update during the write does
#                not reach it, it becomes `latest` only once written, and a resume restores the saved state exactly
#   train-no-te  1 bf16 RL step with transformer-engine hidden from the trainer (its import fails, as on a GPU
#                node without TE): local spec on CUDA, megatron's router without te_general_gemm, selective
#                recompute, aux loss on; the TE import error must be reported
#   train-2gpu   the same under torchrun on 2 GPUs with tp=2 (sequence parallel) and ep=2   (needs >= 2 GPUs)
#   device-1gpu  tools/gpu_device_check.py: one RL step and one SFT step (bf16) with every model input checked to be
#                on CUDA (fails on any tensor reaching the model from the host)
#   device-2gpu  the same under torchrun on 2 GPUs with tp=2 (sequence parallel): the RL step of a TP=2 model  (>= 2 GPUs)
#   packed       tools/gpu_packed_check.py: packed THD micro-batches on the machine's spec (TE: TEDotProductAttention
#                THD) vs padded rows: cu_seqlens int32 on the GPU, old log-probs and one R2 RL update (packed + fused
#                log-probs vs padded + logits, bf16), an optimizer step
#   sglang-*     SGLang rollouts (needs SGLANG_PYTHON: an environment where `import sglang` works, e.g.
#                `pip install "megatron-gspo[rollout]"`; rollout/sglang/versions.py lists the tested releases):
#                sglang-sft (a few SFT steps -> model checkpoint), sglang-hf (convert megatron-to-hf),
#                sglang-rl (2 RL steps with rollout.engine=sglang: one server launched by the trainer with
#                --skip-tokenizer-init; the weight-update protocol follows the server's /server_info release, with
#                /begin_weight_update ... /end_weight_update from 0.5.21). With >= 2 GPUs the server runs on GPU 1
#                and the weights go over NCCL from trainer rank 0 on GPU 0. With one GPU that is impossible: NCCL
#                refuses a group whose two ranks share a GPU ("Duplicate GPU detected"), so the weights go as files,
#                the colocated transport), sglang-r3 (1 RL step replaying the server's routed experts, R3: needs
#                SGLang >= 0.5.10, skipped on older releases, which cannot return them)
# Without an NVIDIA GPU every GPU part is skipped and the script exits 0.
#
# Variables:
#   PYTHON                  trainer interpreter (default .venv/bin/python, after `make install`)
#   GPU_SMOKE_SKIP_INSTALL  1: never run `make install` (use PYTHON, else .venv/bin/python, else python3)
#   SGLANG_PYTHON           interpreter of the SGLang environment (unset: the sglang parts are skipped)
#   GPU_SMOKE_DIR           work directory (default: a new temporary directory; logs of every part go there)
#   GPU_SMOKE_BUDGET_S      wall-clock budget of the checks after install (default 470 s); each part's time limit
#                           is cut to what is left, and parts that would start with < 30 s left are skipped
#   GPU_SMOKE_BENCH_ARGS    extra arguments of tools/bench_logprob.py (e.g. "--variants fused,naive --iters 2")
# Exit status: 1 when any part failed, else 0. Installs nothing beyond `make install`; the SGLang environment is
# yours to provide (it pins its own torch / transformers: REFERENCE.md §6).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
BUDGET="${GPU_SMOKE_BUDGET_S:-470}"
WORK=""  # created once a GPU is found
TINY="$ROOT/examples/tiny_moe_gspo.yaml"
START=$SECONDS

NAMES=() STATES=() TIMES=() NOTES=()
record() {  # name status seconds note
    NAMES+=("$1") STATES+=("$2") TIMES+=("$3") NOTES+=("$4")
    echo "$2 $1${4:+: $4}"
}
skip() { record "$1" SKIP 0 "$2"; }

# run_part NAME LIMIT_S [CHECKS] CMD...: runs CMD under `timeout` (capped by the budget; timeout signals the whole
# process group, and the trainer stops the SGLang servers it launched on SIGTERM), output to $WORK/NAME.log.
# CHECKS, applied when CMD exits 0: --rows RUN_DIR N (RUN_DIR/metrics.jsonl holds >= N rows, one per RL step),
# --expect REGEX (the output matches), --reject REGEX (the output does not match).
run_part() {
    local name="$1" limit="$2" rows_dir="" rows_min=0 expect="" reject=""
    shift 2
    while true; do
        case "${1:-}" in
        --rows) rows_dir="$2" rows_min="$3"; shift 3 ;;
        --expect) expect="$2"; shift 2 ;;
        --reject) reject="$2"; shift 2 ;;
        *) break ;;
        esac
    done
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 30)); then
        skip "$name" "time budget spent (GPU_SMOKE_BUDGET_S=$BUDGET)"
        return 1
    fi
    ((limit <= left)) || limit=$left
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS rc=0 why
    timeout -k 20 "$limit" "$@" >"$WORK/$name.log" 2>&1 || rc=$?
    why="exit $rc"
    ((rc != 124 && rc != 137)) || why="timed out after ${limit}s"
    if ((rc == 0)) && [[ -n "$rows_dir" ]]; then
        local rows
        rows=$(wc -l <"$rows_dir/metrics.jsonl" 2>/dev/null || echo 0)
        ((rows >= rows_min)) || { rc=1; why="$rows_dir/metrics.jsonl has $rows rows, expected $rows_min"; }
    fi
    if ((rc == 0)) && [[ -n "$expect" ]] && ! grep -Eq -- "$expect" "$WORK/$name.log"; then
        rc=1 why="exit 0 but the output lacks /$expect/"
    fi
    if ((rc == 0)) && [[ -n "$reject" ]] && grep -Eq -- "$reject" "$WORK/$name.log"; then
        rc=1 why="exit 0 but the output has /$reject/: $(grep -Em1 -- "$reject" "$WORK/$name.log" | cut -c1-160)"
    fi
    local dt=$((SECONDS - t0))
    if ((rc == 0)); then
        record "$name" PASS "$dt" "log $WORK/$name.log"
        return 0
    fi
    tail -n 30 "$WORK/$name.log" | sed 's/^/    | /'
    record "$name" FAIL "$dt" "$why; log $WORK/$name.log"
    return 1
}

summary() {
    local failed=0 i
    echo
    echo "gpu_smoke summary${WORK:+ (logs in $WORK)}"
    printf '  %-12s %-6s %7s  %s\n' part status seconds note
    for i in "${!NAMES[@]}"; do
        printf '  %-12s %-6s %7s  %s\n' "${NAMES[i]}" "${STATES[i]}" "${TIMES[i]}" "${NOTES[i]}"
        [[ "${STATES[i]}" != FAIL ]] || failed=1
    done
    if ((failed)); then echo "gpu_smoke: FAILED"; else echo "gpu_smoke: OK (no part failed)"; fi
    exit "$failed"
}

GPU_PARTS=(env kernels bench train-1gpu bf16-load colocated-memory async-save train-no-te train-2gpu device-1gpu device-2gpu packed sglang-sft sglang-hf
    sglang-rl sglang-r3)
skip_rest() {  # reason, parts...
    local reason="$1" p
    shift
    for p in "$@"; do skip "$p" "$reason"; done
}

# ---- GPU present? ---------------------------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    skip install "no NVIDIA GPU (nvidia-smi -L fails): nothing to install for the GPU checks"
    skip_rest "no NVIDIA GPU (nvidia-smi -L fails)" "${GPU_PARTS[@]}"
    summary
fi
nvidia-smi -L
WORK="${GPU_SMOKE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_smoke.XXXXXX")}"
mkdir -p "$WORK" || exit 1

# ---- environment ----------------------------------------------------------------------------------------------
if [[ "${GPU_SMOKE_SKIP_INSTALL:-0}" == 1 ]]; then
    skip install "GPU_SMOKE_SKIP_INSTALL=1"
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
    fi
else
    t0=$SECONDS
    if make install >"$WORK/install.log" 2>&1; then
        record install PASS $((SECONDS - t0)) "log $WORK/install.log"
    else
        tail -n 30 "$WORK/install.log" | sed 's/^/    | /'
        record install FAIL $((SECONDS - t0)) "make install failed; log $WORK/install.log"
        skip_rest "install failed" "${GPU_PARTS[@]}"
        summary
    fi
    PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
    START=$SECONDS  # the budget covers the checks, not the installation
fi

t0=$SECONDS
if ! info="$("$PYTHON" - 2>"$WORK/env.log" <<'EOF' | tail -n 1
import torch

import megatron_gspo  # noqa: F401
from megatron_gspo.models.spec import HAVE_TE

print(torch.__version__, torch.version.cuda, int(torch.cuda.is_available()), torch.cuda.device_count(), int(HAVE_TE))
EOF
)"; then
    tail -n 20 "$WORK/env.log" | sed 's/^/    | /'
    record env FAIL $((SECONDS - t0)) "$PYTHON cannot import torch / megatron_gspo; log $WORK/env.log"
    skip_rest "env failed" "${GPU_PARTS[@]:1}"
    summary
fi
read -r TORCH_VERSION TORCH_CUDA HAS_CUDA NGPU HAVE_TE <<<"$info"
if [[ "$HAS_CUDA" != 1 ]]; then
    record env FAIL $((SECONDS - t0)) "torch $TORCH_VERSION of $PYTHON sees no CUDA device although nvidia-smi does (a CPU build? rm -rf .venv && make install)"
    skip_rest "env failed" "${GPU_PARTS[@]:1}"
    summary
fi
if [[ "$HAVE_TE" == 1 ]]; then SPEC="TE layer spec"; else SPEC="local layer spec (transformer-engine not importable)"; fi
record env PASS $((SECONDS - t0)) "torch $TORCH_VERSION, CUDA $TORCH_CUDA, $NGPU GPU(s), $SPEC"

# ---- (a) kernels compiled for the device -------------------------------------------------------------------------
KERNEL_TESTS=(tests/kernels)
((NGPU >= 2)) || KERNEL_TESTS+=(-k "not tp2")  # the 2-GPU TP test is not a skip to hide on a 1-GPU node
run_part kernels 240 --expect '[0-9]+ passed' --reject '[0-9]+ skipped' \
    "$PYTHON" -m pytest -q -rs -m gpu "${KERNEL_TESTS[@]}"
# shellcheck disable=SC2206  # GPU_SMOKE_BENCH_ARGS is a space-separated list of flags
bench_args=(${GPU_SMOKE_BENCH_ARGS:-})
run_part bench 180 --reject '\| failed: ' "$PYTHON" tools/bench_logprob.py --device cuda "${bench_args[@]}"

# ---- (b) tiny model training: NCCL, bf16, TE spec when installed ----------------------------------------------------
SMALL=(model.dtype=bf16 trainer.progress=false trainer.save_final=false eval.max_prompts=64)
run_part train-1gpu 150 --rows "$WORK/train-1gpu" 3 \
    "$PYTHON" -m megatron_gspo.cli.main train --config "$TINY" trainer.steps=3 "trainer.run_dir=$WORK/train-1gpu" \
    "${SMALL[@]}"
run_part bf16-load 180 --expect '[0-9]+ passed' --reject '[0-9]+ skipped' \
    "$PYTHON" -m pytest -q -rs -m gpu tests/training/test_mixed_precision.py
run_part colocated-memory 120 --expect '[0-9]+ passed' --reject '[0-9]+ skipped' \
    "$PYTHON" -m pytest -q -rs -m gpu tests/training/test_offload.py
run_part async-save 120 --expect '[0-9]+ passed' --reject '[0-9]+ skipped' \
    "$PYTHON" -m pytest -q -rs -m gpu tests/training/test_async_checkpoint.py
# sys.modules[name] = None makes `import transformer_engine` raise ImportError, whether or not TE is installed.
NO_TE='import runpy, sys; sys.modules["transformer_engine"] = None; runpy.run_module("megatron_gspo.cli.main", run_name="__main__")'
run_part train-no-te 150 --rows "$WORK/train-no-te" 1 --expect 'transformer-engine does not import' \
    "$PYTHON" -c "$NO_TE" train --config "$TINY" trainer.steps=1 "trainer.run_dir=$WORK/train-no-te" "${SMALL[@]}" \
    model.recompute=selective model.overrides.router_aux_loss_coef=0.001
if ((NGPU >= 2)); then
    run_part train-2gpu 180 --rows "$WORK/train-2gpu" 3 \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 -m megatron_gspo.cli.main train \
        --config "$TINY" trainer.steps=3 "trainer.run_dir=$WORK/train-2gpu" "${SMALL[@]}" \
        parallel.tp=2 parallel.sequence_parallel=true parallel.ep=2
else
    skip train-2gpu "needs >= 2 GPUs (found $NGPU)"
fi

# ---- (b') device discipline on CUDA: no model input from the host (the CPU proof: tests/training/test_device_placement.py)
DEVICE_CHECK=(tools/gpu_device_check.py model.dtype=bf16)
run_part device-1gpu 150 --expect '^device check: OK' \
    "$PYTHON" "${DEVICE_CHECK[@]}" --run-dir "$WORK/device-1gpu"
if ((NGPU >= 2)); then
    run_part device-2gpu 180 --expect '^device check: OK' \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 "${DEVICE_CHECK[@]}" \
        --run-dir "$WORK/device-2gpu" parallel.tp=2 parallel.sequence_parallel=true
else
    skip device-2gpu "needs >= 2 GPUs (found $NGPU)"
fi

# ---- (b'') packed THD micro-batches on the GPU spec (the CPU proof: tests/training/test_packed_update.py) ---------
run_part packed 150 --expect '^packed check: OK' "$PYTHON" tools/gpu_packed_check.py

# ---- (c) SGLang rollouts ---------------------------------------------------------------------------------------
SGLANG_PARTS=(sglang-sft sglang-hf sglang-rl sglang-r3)
if [[ -z "${SGLANG_PYTHON:-}" ]]; then
    skip_rest "SGLANG_PYTHON is not set (the interpreter of an environment with sglang)" "${SGLANG_PARTS[@]}"
    summary
fi
if ! "$SGLANG_PYTHON" -c "import sglang" >"$WORK/sglang-import.log" 2>&1; then
    skip_rest "sglang is not importable by SGLANG_PYTHON=$SGLANG_PYTHON (log $WORK/sglang-import.log)" \
        "${SGLANG_PARTS[@]}"
    summary
fi
# The tiny model as an HF checkpoint for the server: a few SFT steps (a model checkpoint), then megatron-to-hf.
run_part sglang-sft 120 "$PYTHON" -m megatron_gspo.cli.main sft --config "$TINY" --out "$WORK/sft-model" \
    model.dtype=bf16 sft.max_steps=10 sft.eval_every=10 sft.eval_prompts=32 "trainer.run_dir=$WORK/sft-run" ||
    { skip_rest "sglang-sft failed" sglang-hf sglang-rl sglang-r3; summary; }
run_part sglang-hf 90 "$PYTHON" -m megatron_gspo.cli.main convert megatron-to-hf --ckpt "$WORK/sft-model" \
    --out "$WORK/sft-hf" --no-progress || { skip_rest "sglang-hf failed" sglang-rl sglang-r3; summary; }

free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if ((NGPU >= 2)); then  # the server on GPU 1: weights go over NCCL (two ranks of one NCCL group need two GPUs)
    SYNC=(sglang.base_gpu_id=1 sglang.weight_sync=distributed)
else  # one GPU: trainer and server share it, as colocated runs do; NCCL refuses that, files work
    SYNC=(sglang.base_gpu_id=0 sglang.weight_sync=disk "sglang.weight_sync_dir=$WORK/weight-sync")
fi
# The tiny model (head_dim 32, 16-token vocabulary) on the Triton attention backend; no CUDA graphs (start-up time).
SGLANG_RUN=("${SMALL[@]}" "model.load=$WORK/sft-model" rollout.engine=sglang sglang.mode=launch
    "sglang.python=$SGLANG_PYTHON" "sglang.model_path=$WORK/sft-hf" sglang.mem_fraction=0.3
    sglang.startup_timeout_s=200 "${SYNC[@]}"
    "sglang.extra_server_args=[--attention-backend,triton,--disable-cuda-graph,--dtype,bfloat16]")
run_part sglang-rl 240 --rows "$WORK/sglang-rl" 2 \
    "$PYTHON" -m megatron_gspo.cli.main train --config "$TINY" trainer.steps=2 "trainer.run_dir=$WORK/sglang-rl" \
    "${SGLANG_RUN[@]}" "sglang.port_base=$(free_port)" "sglang.log_dir=$WORK/sglang-logs"
SGLANG_VERSION="$("$SGLANG_PYTHON" -c 'import sglang; print(sglang.__version__)' 2>/dev/null | tail -n 1)"
if [[ -z "$SGLANG_VERSION" ]]; then
    skip sglang-r3 "could not read the SGLang version of $SGLANG_PYTHON"
elif ! "$PYTHON" -c 'import sys; v = tuple(int(x) for x in sys.argv[1].split(".")[:3]); sys.exit(v < (0, 5, 10))' \
    "$SGLANG_VERSION" 2>/dev/null; then
    skip sglang-r3 "SGLang $SGLANG_VERSION returns no routed experts with --skip-tokenizer-init (needs >= 0.5.10)"
else
    run_part sglang-r3 180 --rows "$WORK/sglang-r3" 1 \
        "$PYTHON" -m megatron_gspo.cli.main train --config "$TINY" trainer.steps=1 "trainer.run_dir=$WORK/sglang-r3" \
        "${SGLANG_RUN[@]}" "sglang.port_base=$(free_port)" "sglang.log_dir=$WORK/sglang-r3-logs" \
        moe.routing_replay=r3 sglang.return_routed_experts=true
fi
summary
