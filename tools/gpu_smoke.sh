#!/usr/bin/env bash
# megatron-gspo GPU smoke test: what CPU CI cannot check, as ONE command with a 9-minute plan for ONE H200 (the
# machine sometimes lent to sessions: no network there, the local spec because TE does not fit the ~64 MiB of
# carried files; on a cluster node with TE the same script checks the TE spec).
#
#   GPU_SMOKE_SKIP_INSTALL=1 PYTHON=python bash tools/gpu_smoke.sh     # the lent H200 (no network: no install)
#   SGLANG_PYTHON=/opt/sglang-venv/bin/python bash tools/gpu_smoke.sh  # a cluster node: also the SGLang parts
#   GPU_SMOKE_CPU=1 bash tools/gpu_smoke.sh                            # CPU dry mode: the plumbing of every part
#                                                                      # that has a CPU form (CPU caps, 30 min budget)
# Kernel benchmarks are a separate command: python tools/bench_logprob.py --device cuda.
#
# The plan, in order of evidence per minute; each part has a hard cap (timeout; the caps sum to 540 s), ends PASS,
# FAIL or SKIP and puts a figure in the summary table:
#   env          (20 s)  torch, CUDA, NCCL, Triton, TE versions; tools/gpu_env_check.py: NCCL works, Triton
#                        compiles and runs a kernel (libcuda found), TE in megatron-core's range (when installed)
#                        and the weight sync's agreement (all_ranks_ok, all_gather_object) over NCCL from two threads
#   overlap      (60 s)  issue 25 item 1 on CUDA: fused LM-head log-probs with overlap_grad_reduce +
#                        overlap_param_gather, the LM head in its own bucket, 4 steps; its weights equal the masters
#                        (relies on megatron-core 0.16.1 distributed/distributed_data_parallel.py:384-418, the
#                        forward pre-hook, and distributed/param_and_grad_buffer.py:270, the assertion it avoids)
#   packed       (75 s)  tools/gpu_packed_check.py: THD packs on the machine's spec vs padded rows (old log-probs
#                        within 3e-3, R2 update, optimizer step) and the negative control (one segment per pack)
#                        that must fail (TE: TEDotProductAttention's THD path, megatron-core 0.16.1
#                        extensions/transformer_engine.py; local: models/attention.py)
#   shapes      (120 s)  tools/gpu_shapes_check.py: 2 layers of the 30B recipe (hidden 2048, 128 experts top-8,
#                        head_dim 128, GQA 32/4, V=151936) in bf16 with the distributed optimizer, one packed R2
#                        update; fused vs logits log-probs and gradients, peak memory, tokens/s
#   kernels     (100 s)  pytest -m gpu tests/kernels: the Triton kernels compiled for the device at N=16384 x
#                        V=151936 bf16 (past 2**31 elements; in-place d logits; the fixed row config), forward-only,
#                        the fused LM head, the fp32 CUDA addmm (torch's addmm out_dtype), TP=2 with >= 2 GPUs
#   resume      (110 s)  tiny model, bf16, NCCL: 2 GSPO steps with the overlap flags and a background checkpoint
#                        after each (trainer.async_save: the device -> host staging before megatron's writer
#                        forks, dist_checkpointing/strategies/async_utils.py), then --resume for a third step
#   colocated-memory (55 s)  pytest -m gpu tests/training/test_offload.py: optimizer state, main grads and masters
#                        leave device memory (allocated bytes drop by what moved) and come back bit-exactly
# Then, while the budget (GPU_SMOKE_BUDGET_S) lasts -- on a cluster node, give it 900 s or more:
#   train-no-te  1 bf16 RL step with transformer-engine hidden (local spec on CUDA, megatron's router without
#                te_general_gemm, selective recompute, aux loss on); the TE import error must be reported
#   bf16-load    pytest -m gpu tests/training/test_mixed_precision.py (a checkpoint loaded into a bf16 run)
#   async-save   pytest -m gpu tests/checkpoint/test_async_checkpoint.py (an update during the write stays out)
#   device-1gpu  tools/gpu_device_check.py: every model input of an RL and an SFT step is on CUDA
#   train-2gpu / device-2gpu  torchrun on 2 GPUs, tp=2 (sequence parallel) [+ ep=2]   (needs >= 2 GPUs)
#   sglang-*     SGLang rollouts (needs SGLANG_PYTHON: an environment where `import sglang` works):
#                sglang-sft, sglang-hf (convert), sglang-rl (2 RL steps; weights over NCCL from trainer rank 0
#                with >= 2 GPUs -- NCCL refuses two ranks on one GPU, "Duplicate GPU detected" -- else as files),
#                sglang-r3 (routed-experts replay; SGLang >= 0.5.10)
# Without an NVIDIA GPU (and without GPU_SMOKE_CPU=1) every part is skipped and the script exits 0.
#
# Variables:
#   PYTHON                  trainer interpreter (default .venv/bin/python, after `make install`)
#   GPU_SMOKE_SKIP_INSTALL  1: never run `make install` (use PYTHON, else .venv/bin/python, else python3)
#   GPU_SMOKE_CPU           1: CPU dry mode (no GPU needed; GPU-only parts are skipped; implies no install)
#   SGLANG_PYTHON           interpreter of the SGLang environment (unset: the sglang parts are skipped)
#   GPU_SMOKE_DIR           work directory (default: a new temporary directory; logs of every part go there)
#   GPU_SMOKE_BUDGET_S      wall-clock budget of the checks after install (default 540 s; 1800 s in the CPU dry
#                           mode, whose caps are a CPU's); each part's time limit
#                           is cut to what is left, and parts that would start with < 30 s left are skipped
# Exit status: 1 when any part failed, else 0. Installs nothing beyond `make install`; the SGLang environment is
# yours to provide (it pins its own torch / transformers: REFERENCE.md §6).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
CPU_MODE="${GPU_SMOKE_CPU:-0}"
# The CPU dry mode checks the plumbing, not the GPU's times: a CPU takes minutes where the GPU takes seconds.
if [[ "$CPU_MODE" == 1 ]]; then BUDGET="${GPU_SMOKE_BUDGET_S:-1800}"; else BUDGET="${GPU_SMOKE_BUDGET_S:-540}"; fi
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
# --expect REGEX (the output matches), --reject REGEX (the output does not match). --figure REGEX: the last output
# line matching it is the part's figure in the summary (cut to 200 characters).
run_part() {
    local name="$1" limit="$2" rows_dir="" rows_min=0 expect="" reject="" figure=""
    shift 2
    while true; do
        case "${1:-}" in
        --rows) rows_dir="$2" rows_min="$3"; shift 3 ;;
        --figure) figure="$2"; shift 2 ;;
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
    local dt=$((SECONDS - t0)) fig=""
    [[ -z "$figure" ]] || fig="$(grep -E -- "$figure" "$WORK/$name.log" | tail -n 1 | cut -c1-200)"
    if ((rc == 0)); then
        record "$name" PASS "$dt" "${fig:+$fig; }log $WORK/$name.log"
        return 0
    fi
    tail -n 30 "$WORK/$name.log" | sed 's/^/    | /'
    record "$name" FAIL "$dt" "$why${fig:+; $fig}; log $WORK/$name.log"
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

GPU_PARTS=(env overlap packed shapes kernels resume colocated-memory train-no-te bf16-load async-save device-1gpu
    train-2gpu device-2gpu sglang-sft sglang-hf sglang-rl sglang-r3)
skip_rest() {  # reason, parts...
    local reason="$1" p
    shift
    for p in "$@"; do skip "$p" "$reason"; done
}

# ---- GPU present? ---------------------------------------------------------------------------------------------
if [[ "$CPU_MODE" == 1 ]]; then
    echo "CPU dry mode (GPU_SMOKE_CPU=1): the CPU form of each part that has one; GPU-only parts are skipped"
    GPU_SMOKE_SKIP_INSTALL=1
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    skip install "no NVIDIA GPU (nvidia-smi -L fails): nothing to install for the GPU checks"
    skip_rest "no NVIDIA GPU (nvidia-smi -L fails)" "${GPU_PARTS[@]}"
    summary
fi
[[ "$CPU_MODE" == 1 ]] || nvidia-smi -L
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
# One line of versions: torch, CUDA, CUDA available, GPUs, TE importable, NCCL, Triton, TE version.
if ! info="$("$PYTHON" - 2>"$WORK/env.log" <<'EOF' | tail -n 1
import torch

import megatron_gspo  # noqa: F401
from megatron_gspo.models.spec import HAVE_TE

try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:  # a torch without NCCL
    nccl = "none"
try:
    import triton

    triton_version = triton.__version__
except ImportError:
    triton_version = "none"
try:
    import transformer_engine

    te = transformer_engine.__version__
except Exception:
    te = "none"
print(torch.__version__, torch.version.cuda, int(torch.cuda.is_available()), torch.cuda.device_count(), int(HAVE_TE),
      nccl, triton_version, te)
EOF
)"; then
    tail -n 20 "$WORK/env.log" | sed 's/^/    | /'
    record env FAIL $((SECONDS - t0)) "$PYTHON cannot import torch / megatron_gspo; log $WORK/env.log"
    skip_rest "env failed" "${GPU_PARTS[@]:1}"
    summary
fi
read -r TORCH_VERSION TORCH_CUDA HAS_CUDA NGPU HAVE_TE NCCL_VERSION TRITON_VERSION TE_VERSION <<<"$info"
VERSIONS="torch $TORCH_VERSION, CUDA $TORCH_CUDA, NCCL ${NCCL_VERSION:-?}, Triton ${TRITON_VERSION:-?}, TE ${TE_VERSION:-?}"
if [[ "$CPU_MODE" == 1 ]]; then
    record env PASS $((SECONDS - t0)) "CPU dry mode: $VERSIONS"
elif [[ "$HAS_CUDA" != 1 ]]; then
    record env FAIL $((SECONDS - t0)) "torch $TORCH_VERSION of $PYTHON sees no CUDA device although nvidia-smi does (a CPU build? rm -rf .venv && make install)"
    skip_rest "env failed" "${GPU_PARTS[@]:1}"
    summary
else
    if [[ "$HAVE_TE" == 1 ]]; then SPEC="TE layer spec"; else SPEC="local layer spec (transformer-engine not importable)"; fi
    ENV_CHECK=(tools/gpu_env_check.py)
    [[ "$HAVE_TE" == 1 ]] || ENV_CHECK+=(--skip te)
    # NCCL, Triton (libcuda + a compiled kernel) and TE: each failure is one `gpu env: FAIL` line in the log.
    if timeout -k 5 20 "$PYTHON" "${ENV_CHECK[@]}" >"$WORK/env-check.log" 2>&1; then
        record env PASS $((SECONDS - t0)) "$VERSIONS, $NGPU GPU(s), $SPEC"
    else
        grep -E '^gpu env: FAIL' "$WORK/env-check.log" | sed 's/^/    | /'
        record env FAIL $((SECONDS - t0)) "$VERSIONS: $(grep -Ec '^gpu env: FAIL' "$WORK/env-check.log") check(s) failed or timed out; log $WORK/env-check.log"
    fi
fi

# ---- the plan: evidence per minute ------------------------------------------------------------------------------
PASSED='[0-9]+ passed'
if [[ "$CPU_MODE" == 1 ]]; then
    # The CPU forms: gloo instead of NCCL, the Triton interpreter, the tiny preset for the 30B shapes.
    run_part overlap 300 --expect "$PASSED" --figure "$PASSED" \
        "$PYTHON" -m pytest -q -rs tests/training/test_overlap_fused.py
    run_part packed 400 --expect '^packed check: OK' --figure '^packed check:' "$PYTHON" tools/gpu_packed_check.py
    run_part shapes 300 --expect '^shapes check: OK' --figure '^shapes check:' \
        "$PYTHON" tools/gpu_shapes_check.py --preset tiny --prompt 8 --max-response 120 --max-tokens 512
    run_part kernels 300 --expect "$PASSED" --figure "$PASSED" \
        "$PYTHON" -m pytest -q -rs tests/kernels/test_triton_kernels.py
else
    run_part overlap 60 --expect "$PASSED" --reject '[0-9]+ skipped' --figure "$PASSED" \
        "$PYTHON" -m pytest -q -rs -m gpu tests/training/test_overlap_fused.py
    run_part packed 75 --expect '^packed check: OK' --figure '^packed check:' "$PYTHON" tools/gpu_packed_check.py
    run_part shapes 120 --expect '^shapes check: OK' --figure '^shapes check:' "$PYTHON" tools/gpu_shapes_check.py
    KERNEL_TESTS=(tests/kernels)
    ((NGPU >= 2)) || KERNEL_TESTS+=(-k "not tp2")  # the 2-GPU TP test is not a skip to hide on a 1-GPU node
    run_part kernels 100 --expect "$PASSED" --reject '[0-9]+ skipped' --figure "$PASSED" \
        "$PYTHON" -m pytest -q -rs -m gpu "${KERNEL_TESTS[@]}"
fi

# A tiny run with the GPU recommendations: overlap flags (small buckets, so several), a background checkpoint after
# step 1 and the final one after step 2 (periodic checkpoints skip the last step), then a
# resume from the last one. bf16 on the GPU (NCCL); fp32 in the CPU dry mode (gloo).
SMALL=(trainer.progress=false trainer.save_final=false eval.max_prompts=64)
[[ "$CPU_MODE" == 1 ]] || SMALL+=(model.dtype=bf16)
RESUME_RUN=("$PYTHON" -m megatron_gspo.cli.main train --config "$TINY" "trainer.run_dir=$WORK/resume" "${SMALL[@]}"
    optim.overlap_grad_reduce=true optim.overlap_param_gather=true optim.bucket_size=8192
    trainer.ckpt_every=1 trainer.async_save=true trainer.prompts_per_step=16 trainer.save_final=true)
RESUME_CAP=110
[[ "$CPU_MODE" == 1 ]] && RESUME_CAP=600
run_part resume "$RESUME_CAP" --rows "$WORK/resume" 3 --figure 'checkpoint iter_[0-9]+ complete' \
    bash -c '"$@" trainer.steps=2 && "$@" trainer.steps=3 --resume' resume "${RESUME_RUN[@]}"
if [[ "$CPU_MODE" == 1 ]]; then
    skip colocated-memory "GPU only (device memory)"
    skip_rest "GPU only (CPU dry mode)" train-no-te bf16-load async-save device-1gpu train-2gpu device-2gpu \
        sglang-sft sglang-hf sglang-rl sglang-r3
    summary
fi
run_part colocated-memory 55 --expect "$PASSED" --reject '[0-9]+ skipped' --figure "$PASSED" \
    "$PYTHON" -m pytest -q -rs -m gpu tests/training/test_offload.py

# ---- beyond the 9-minute plan, while the budget lasts ---------------------------------------------------------
# sys.modules[name] = None makes `import transformer_engine` raise ImportError, whether or not TE is installed.
NO_TE='import runpy, sys; sys.modules["transformer_engine"] = None; runpy.run_module("megatron_gspo.cli.main", run_name="__main__")'
run_part train-no-te 150 --rows "$WORK/train-no-te" 1 --expect 'transformer-engine does not import' \
    "$PYTHON" -c "$NO_TE" train --config "$TINY" trainer.steps=1 "trainer.run_dir=$WORK/train-no-te" "${SMALL[@]}" \
    model.recompute=selective model.overrides.router_aux_loss_coef=0.001
run_part bf16-load 180 --expect "$PASSED" --reject '[0-9]+ skipped' --figure "$PASSED" \
    "$PYTHON" -m pytest -q -rs -m gpu tests/training/test_mixed_precision.py
run_part async-save 120 --expect "$PASSED" --reject '[0-9]+ skipped' --figure "$PASSED" \
    "$PYTHON" -m pytest -q -rs -m gpu tests/checkpoint/test_async_checkpoint.py
# Device discipline on CUDA: no model input from the host (the CPU proof: tests/training/test_device_placement.py).
DEVICE_CHECK=(tools/gpu_device_check.py model.dtype=bf16)
run_part device-1gpu 150 --expect '^device check: OK' --figure '^device check:' \
    "$PYTHON" "${DEVICE_CHECK[@]}" --run-dir "$WORK/device-1gpu"
if ((NGPU >= 2)); then
    run_part train-2gpu 180 --rows "$WORK/train-2gpu" 3 \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 -m megatron_gspo.cli.main train \
        --config "$TINY" trainer.steps=3 "trainer.run_dir=$WORK/train-2gpu" "${SMALL[@]}" \
        parallel.tp=2 parallel.sequence_parallel=true parallel.ep=2
    run_part device-2gpu 180 --expect '^device check: OK' --figure '^device check:' \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 "${DEVICE_CHECK[@]}" \
        --run-dir "$WORK/device-2gpu" parallel.tp=2 parallel.sequence_parallel=true
else
    skip train-2gpu "needs >= 2 GPUs (found $NGPU)"
    skip device-2gpu "needs >= 2 GPUs (found $NGPU)"
fi

# ---- (c) SGLang rollouts ---------------------------------------------------------------------------------------
# Not run here (GPU-only, unverified on CPU): a trainer killed with kill -9 while attached (rollout/sglang/engine.py
# `_undo_dead_trainer`, tests/rollout/sglang/test_dead_trainer.py against fakes). To check by hand on SGLang
# 0.5.23 with weight_sync=distributed: SIGKILL the trainer between syncs, then mid-broadcast, and resume on the same
# servers. Expected from its source: the destroy of the held group answers 200 (model_runner_components/
# weight_updater.py:146-153) and the next init works; whether torch's destroy_process_group (ProcessGroupNCCL
# shutdown) of a communicator whose peer died returns or blocks the scheduler is not known; after a kill
# mid-broadcast the scheduler's NCCL receive (weight_updater.py:282-297: async, then wait) is ended only by NCCL's
# watchdog at the group's timeout (SGLang passes none: utils/common.py:2894-2895, torch's 30 min), and the
# paused update holds the tokenizer's pause lock (managers/tokenizer_control_mixin.py:516-520) meanwhile.
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
