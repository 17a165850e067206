#!/bin/bash
# megatron-gspo pretraining-to-RL pipeline, one step after the other:
#   convert     HF checkpoint -> Megatron          megatron-gspo convert hf-to-megatron --hf --out --tp --pp --ep
#   sft         SFT cold start                     megatron-gspo sft --config SFT_CONFIG --out  (launch/train.sbatch)
#   sft_export  SFT model -> HF                    the weights the SGLang rollout servers start from
#   rl          RL with GSPO                       megatron-gspo train --config RL_CONFIG       (launch/train.sbatch)
#   export      newest RL checkpoint -> HF         megatron-gspo convert megatron-to-hf --ckpt --out
#
#   HF_MODEL=/models/Qwen3-30B-A3B-Base SFT_CONFIG=sft.yaml RL_CONFIG=gspo.yaml SGLANG_PYTHON=/opt/sglang/bin/python \
#       bash launch/pipeline.sh
#
# PIPELINE_MODE=sbatch (default) submits one job per step, each depending on the previous one (afterok);
# PIPELINE_MODE=local runs the steps here in turn (inside an salloc allocation, or on one node). STEPS picks steps.
# DRY_RUN=1 prints every command (and, in local mode, what train.sbatch would run) without running anything.
set -euo pipefail

LAUNCH_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
export LAUNCH_DIR
# shellcheck source=launch/common.sh
source "$LAUNCH_DIR/common.sh"

PIPELINE_MODE="${PIPELINE_MODE:-sbatch}"
STEPS="${STEPS:-convert sft sft_export rl export}"
WORK_DIR="${WORK_DIR:-$PWD/pipeline}"
PYTHON="${PYTHON:-python}"
TP="${TP:-1}" PP="${PP:-1}" EP="${EP:-8}"
SFT_NODES="${SFT_NODES:-1}"
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
case "$PIPELINE_MODE" in sbatch | local) ;; *) mg_die "PIPELINE_MODE=$PIPELINE_MODE must be sbatch or local" ;; esac

for step in $STEPS; do
    case "$step" in
    convert) [[ -n "${HF_MODEL:-}" ]] || mg_die "HF_MODEL is not set (the Hugging Face checkpoint to start from)" ;;
    sft) [[ -n "${SFT_CONFIG:-}" ]] || mg_die "SFT_CONFIG is not set" ;;
    rl) [[ -n "${RL_CONFIG:-}" ]] || mg_die "RL_CONFIG is not set" ;;
    sft_export | export) ;;
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
mg_print_vars HF_MODEL WORK_DIR TP PP EP SFT_CONFIG SFT_NODES RL_CONFIG RL_NODES RL_ROLLOUT_MODE RL_ROLLOUT_NODES
mg_run mkdir -p "$WORK_DIR/logs"
total=$(wc -w <<<"$STEPS")
n=0
for step in $STEPS; do
    n=$((n + 1))
    case "$step" in
    convert)
        echo "## step $n/$total convert: HF -> Megatron ($HF_MODEL -> $BASE_CKPT)"
        submit convert 1 cmd "${MG[@]}" convert hf-to-megatron --hf "$HF_MODEL" --out "$BASE_CKPT" \
            --tp "$TP" --pp "$PP" --ep "$EP"
        ;;
    sft)
        echo "## step $n/$total sft: SFT cold start ($SFT_CONFIG, $SFT_NODES node(s))"
        submit sft "$SFT_NODES" train MG_SUBCOMMAND=sft CONFIG="$SFT_CONFIG" ROLLOUT_MODE=none ROLLOUT_NODES=0 \
            RUN_DIR="$SFT_RUN" SFT_OUT="$SFT_MODEL" -- "model.load=$BASE_CKPT"
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
