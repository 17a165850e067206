#!/bin/bash
# megatron-gspo pretraining-to-RL pipeline, one step after the other:
#   convert     HF checkpoint -> Megatron          megatron-gspo convert hf-to-megatron --hf --out --tp --pp --ep
#                                                  (under torchrun on one node when the layout has > 1 rank)
#   sft         SFT cold start                     megatron-gspo sft --config SFT_CONFIG --out  (launch/train.sbatch)
#   sft_export  SFT model -> HF                    the weights the SGLang rollout servers start from
#   rl          RL with GSPO                       megatron-gspo train --config RL_CONFIG       (launch/train.sbatch)
#   export      newest RL checkpoint -> HF         megatron-gspo convert megatron-to-hf --ckpt --out
#
#   HF_MODEL=/models/Qwen3-30B-A3B-Base SGLANG_PYTHON=/opt/sglang/bin/python bash launch/pipeline.sh
#
# SFT_CONFIG / RL_CONFIG default to examples/qwen3_30b_a3b_sft.yaml / examples/qwen3_30b_a3b_gspo.yaml (their
# model.load / data paths are placeholders: edit them, or pass your own configs). The SFT job gets SGLang servers
# too (SFT_ROLLOUT_MODE, default colocated) for its held-out checks; they start from HF_MODEL.
#
# PIPELINE_MODE=sbatch (default) submits one job per step, each depending on the previous one (afterok);
# PIPELINE_MODE=local runs the steps here in turn (inside an salloc allocation, or on one node). STEPS picks steps.
# DRY_RUN=1 prints every command (and, in local mode, what train.sbatch would run) without running anything.
set -euo pipefail

LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
export LAUNCH_DIR
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

REPO_DIR="$(cd "$LAUNCH_DIR/.." && pwd)"
PIPELINE_MODE="${PIPELINE_MODE:-sbatch}"
STEPS="${STEPS:-convert sft sft_export rl export}"
WORK_DIR="${WORK_DIR:-$PWD/pipeline}"
PYTHON="${PYTHON:-python}"
SFT_CONFIG="${SFT_CONFIG:-$REPO_DIR/examples/qwen3_30b_a3b_sft.yaml}"
RL_CONFIG="${RL_CONFIG:-$REPO_DIR/examples/qwen3_30b_a3b_gspo.yaml}"
TP="${TP:-1}" PP="${PP:-1}" EP="${EP:-8}"
SFT_NODES="${SFT_NODES:-1}"
SFT_ROLLOUT_MODE="${SFT_ROLLOUT_MODE:-colocated}"
SFT_ROLLOUT_NODES="${SFT_ROLLOUT_NODES:-0}"
RL_NODES="${RL_NODES:-1}"
RL_ROLLOUT_MODE="${RL_ROLLOUT_MODE:-colocated}"
RL_ROLLOUT_NODES="${RL_ROLLOUT_NODES:-0}"
BASE_CKPT="$WORK_DIR/megatron-base"
SFT_RUN="$WORK_DIR/sft"
SFT_MODEL="$WORK_DIR/sft-model"
SFT_HF="$WORK_DIR/sft-hf"
RL_RUN="$WORK_DIR/rl"
FINAL_HF="$WORK_DIR/final-hf"
MG=("$PYTHON" -m megatron_gspo.cli.main)
for v in TP PP EP; do mg_require_int "$v" "${!v}"; done
# hf-to-megatron builds the model in the TP/PP/EP layout: it needs a world size that fits it (a multiple of tp*pp
# and of ep*pp), i.e. one rank per GPU of the convert job's node; the checkpoint then loads into any layout.
gcd() { local a="$1" b="$2" r; while ((b)); do r=$((a % b)); a=$b; b=$r; done; echo "$a"; }
CONVERT_NPROC="${CONVERT_NPROC:-$(((TP * PP) * (EP * PP) / $(gcd $((TP * PP)) $((EP * PP)))))}"
mg_require_int CONVERT_NPROC "$CONVERT_NPROC"
if [[ " $STEPS " == *" convert "* && "$CONVERT_NPROC" -gt "${CONVERT_GPUS:-8}" ]]; then
    mg_die "TP=$TP PP=$PP EP=$EP needs $CONVERT_NPROC ranks to convert in, more than the CONVERT_GPUS=${CONVERT_GPUS:-8} GPUs of the convert job's node: pick a smaller layout (e.g. TP=1 PP=1 EP=8; the checkpoint loads into any layout)"
fi
if [[ "$CONVERT_NPROC" -gt 1 ]]; then
    CONVERT=("$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$CONVERT_NPROC" -m megatron_gspo.cli.main)
else
    CONVERT=("${MG[@]}")
fi
case "$PIPELINE_MODE" in sbatch | local) ;; *) mg_die "PIPELINE_MODE=$PIPELINE_MODE must be sbatch or local" ;; esac

for step in $STEPS; do
    case "$step" in
    convert) [[ -n "${HF_MODEL:-}" ]] || mg_die "HF_MODEL is not set (the Hugging Face checkpoint to start from)" ;;
    sft)
        if [[ "$SFT_ROLLOUT_MODE" != none && -z "${SFT_SGLANG_MODEL_PATH:-${HF_MODEL:-}}" ]]; then
            mg_die "the SFT job's SGLang servers (SFT_ROLLOUT_MODE=$SFT_ROLLOUT_MODE) need SFT_SGLANG_MODEL_PATH or HF_MODEL (the HF checkpoint they start from); SFT_ROLLOUT_MODE=none runs SFT without servers"
        fi
        ;;
    rl | sft_export | export) ;;
    *) mg_die "unknown step '$step' in STEPS (convert sft sft_export rl export)" ;;
    esac
done

# shellcheck disable=SC2206  # SBATCH_ARGS: extra sbatch flags (partition, account, time, gpus per node, ...)
sbatch_extra=(${SBATCH_ARGS:-})
prev_job=""

# Submit (sbatch mode) or run (local mode) one step. Arguments: name nodes kind, then for kind=cmd the command,
# for kind=shell one shell command line, for kind=train the env assignments, --, the train.sbatch arguments.
submit() {
    local name="$1" nodes="$2" kind="$3"
    shift 3
    local -a dep=()
    [[ -z "$prev_job" ]] || dep=(--dependency="afterok:$prev_job")
    if [[ "$PIPELINE_MODE" == local ]]; then
        if [[ "$kind" == cmd ]]; then
            mg_run "$@"
        elif [[ "$kind" == shell ]]; then
            mg_run bash -c "$1"
        else
            # "$@" = VAR=value ... -- train.sbatch args
            local -a envs=()
            while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
            shift
            if mg_is_dry; then
                mg_show env "${envs[@]}" bash "$LAUNCH_DIR/train.sbatch" "$@"
                env "${envs[@]}" bash "$LAUNCH_DIR/train.sbatch" "$@" | sed 's/^/    /'
            else
                env "${envs[@]}" bash "$LAUNCH_DIR/train.sbatch" "$@"
            fi
        fi
        return
    fi
    local -a cmd
    if [[ "$kind" == cmd || "$kind" == shell ]]; then
        local wrapped="$1"
        if [[ "$kind" == cmd ]]; then wrapped="$(mg_show "$@")" && wrapped="${wrapped#+ }"; fi
        cmd=(sbatch --parsable --job-name="mg-$name" --nodes="$nodes" --ntasks-per-node=1 "${dep[@]}" \
            "${sbatch_extra[@]}" --output="$WORK_DIR/logs/%x-%j.out" --wrap="$wrapped")
    else
        local -a envs=()
        while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
        shift
        cmd=(env "${envs[@]}" sbatch --parsable --job-name="mg-$name" --nodes="$nodes" "${dep[@]}" \
            "${sbatch_extra[@]}" --output="$WORK_DIR/logs/%x-%j.out" "$LAUNCH_DIR/train.sbatch" "$@")
    fi
    if mg_is_dry; then
        mg_show "${cmd[@]}"
        prev_job="<jobid:$name>"
    else
        prev_job="$("${cmd[@]}")"
        prev_job="${prev_job%%;*}"
        echo "submitted $name: job $prev_job"
    fi
}

mg_note "megatron-gspo pipeline ($PIPELINE_MODE): $STEPS"
mg_print_vars HF_MODEL WORK_DIR TP PP EP CONVERT_NPROC SFT_CONFIG SFT_NODES SFT_ROLLOUT_MODE SFT_ROLLOUT_NODES \
    RL_CONFIG RL_NODES RL_ROLLOUT_MODE RL_ROLLOUT_NODES
mg_run mkdir -p "$WORK_DIR/logs"
total=$(wc -w <<<"$STEPS")
n=0
for step in $STEPS; do
    n=$((n + 1))
    case "$step" in
    convert)
        echo "## step $n/$total convert: HF -> Megatron ($HF_MODEL -> $BASE_CKPT)"
        submit convert 1 cmd "${CONVERT[@]}" convert hf-to-megatron --hf "$HF_MODEL" --out "$BASE_CKPT" \
            --tp "$TP" --pp "$PP" --ep "$EP"
        ;;
    sft)
        echo "## step $n/$total sft: SFT cold start ($SFT_CONFIG, $SFT_NODES node(s), rollout $SFT_ROLLOUT_MODE)"
        sft_env=(MG_SUBCOMMAND=sft CONFIG="$SFT_CONFIG" ROLLOUT_MODE="$SFT_ROLLOUT_MODE" \
            ROLLOUT_NODES="$SFT_ROLLOUT_NODES" RUN_DIR="$SFT_RUN" SFT_OUT="$SFT_MODEL")
        [[ "$SFT_ROLLOUT_MODE" == none ]] || sft_env+=(SGLANG_MODEL_PATH="${SFT_SGLANG_MODEL_PATH:-$HF_MODEL}")
        submit sft "$SFT_NODES" train "${sft_env[@]}" -- "model.load=$BASE_CKPT"
        ;;
    sft_export)
        echo "## step $n/$total sft_export: SFT model -> HF ($SFT_HF, the rollout servers' starting weights)"
        submit sft_export 1 cmd "${MG[@]}" convert megatron-to-hf --ckpt "$SFT_MODEL" --out "$SFT_HF"
        ;;
    rl)
        echo "## step $n/$total rl: RL with GSPO ($RL_CONFIG, $RL_NODES node(s), rollout $RL_ROLLOUT_MODE)"
        submit rl "$RL_NODES" train MG_SUBCOMMAND=train CONFIG="$RL_CONFIG" ROLLOUT_MODE="$RL_ROLLOUT_MODE" \
            ROLLOUT_NODES="$RL_ROLLOUT_NODES" SGLANG_MODEL_PATH="$SFT_HF" RUN_DIR="$RL_RUN" \
            -- "model.load=$SFT_MODEL"
        ;;
    export)
        echo "## step $n/$total export: newest RL checkpoint -> HF ($FINAL_HF)"
        # The newest checkpoint is named in checkpoints/latest, known only once the RL job has run.
        ckpts="$(printf '%q' "$RL_RUN/checkpoints")"
        convert="$(mg_show "${MG[@]}" convert megatron-to-hf --out "$FINAL_HF")"
        submit export 1 shell "ckpt=$ckpts/\$(cat $ckpts/latest) && ${convert#+ } --ckpt \"\$ckpt\""
        ;;
    esac
done
