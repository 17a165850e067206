#!/bin/bash
# The MoE stability benchmark (GSPO vs GRPO vs GRPO + R2 / R3) at the GSPO paper's scale: Qwen3-30B-A3B, one
# Slurm job per (variant, seed) through launch/train.sbatch, then one report of them all. The CPU map (README "MoE
# stability benchmark", issue 29) found no setting of a 6-layer tiny MoE where GRPO collapses and GSPO does not:
# the drivers the sources name need this scale (48 layers, 128 experts top-8, thousands of response tokens, a bf16
# inference engine beside the trainer). This script puts them on the real thing:
#   - train / inference mismatch: SGLang servers in bf16 beside the bf16 trainer with fp32 masters (the configs'
#     default; the R3 paper measures train / infer KL 1.5e-3 and ~10% of routers flipped on this model);
#   - answer length: rollout.max_new_tokens 8192 (the configs' default);
#   - staleness: K = trainer.minibatches optimizer steps per rollout batch (paper §5.1: 4; the CPU map: K >= 8 and
#     lr >= 4.5e-4 collapse GRPO and GSPO alike, K <= 4 neither) -- DRIVERS="trainer.minibatches=8" for the cell
#     beyond the paper's;
#   - pi_old from the engine: DRIVERS="rollout.old_logprobs=engine" (the mismatch enters the ratio itself; R2
#     still recomputes pi_old, as it must to record the routes it replays).
#
#     bash examples/qwen3_30b_a3b_stability.sh                  # 4 variants x 3 seeds = 12 jobs, then the report
#     DRIVERS="trainer.minibatches=8" OUT=$PWD/runs/stability_k8 bash examples/qwen3_30b_a3b_stability.sh
#     DRY_RUN=1 bash examples/qwen3_30b_a3b_stability.sh       # print the sbatch commands, submit nothing
#
# Each job is `CONFIG=... RUN_DIR=<OUT>/<variant>/seed<N> TRAIN_OVERRIDES="<DRIVERS> <the run's overrides>" sbatch
# launch/train.sbatch` with the launch variables you export (ROLLOUT_MODE, ROLLOUT_NODES, SGLANG_TP, ... as for
# examples/qwen3_30b_a3b_gspo.yaml: launch/README.md); the run's overrides (algorithm, routing replay, seed, run
# directory) come from `megatron-gspo stability --print-runs`, the same list the CPU benchmark trains. A preempted
# job requeues and resumes like any training job. The report job depends on all of them (afterany: a crashed run
# is reported as unfinished, not silently dropped) and runs `megatron-gspo stability --report-only --out OUT` on
# one CPU. Variables:
#   CONFIG     the RL config (default examples/qwen3_30b_a3b_gspo.yaml: its model.load / data / SGLang paths are
#              placeholders to edit); every variant overrides loss.algorithm and moe.routing_replay
#   OUT        run directories and report (default $PWD/runs/stability_qwen3_30b_a3b)
#   VARIANTS   default gspo,grpo,grpo_r2,grpo_r3      SEEDS  count or comma list (default 3)
#   DRIVERS    extra overrides applied to every run (default none: the paper's setting)
#   NODES      nodes per job (default 4: the configs' training layout; add ROLLOUT_NODES for dedicated servers)
#   PYTHON     interpreter with megatron-gspo installed (default python)
#   DRY_RUN    1: print the sbatch commands instead of submitting
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONFIG="${CONFIG:-$REPO_DIR/examples/qwen3_30b_a3b_gspo.yaml}"
OUT="${OUT:-$PWD/runs/stability_qwen3_30b_a3b}"
VARIANTS="${VARIANTS:-gspo,grpo,grpo_r2,grpo_r3}"
SEEDS="${SEEDS:-3}"
DRIVERS="${DRIVERS:-}"
NODES="${NODES:-4}"
PYTHON="${PYTHON:-python}"
DRY_RUN="${DRY_RUN:-0}"

# shellcheck disable=SC2086  # DRIVERS is a space-separated list of key=value overrides
runs="$("$PYTHON" -m megatron_gspo.cli.main stability --print-runs --config "$CONFIG" --out "$OUT" \
    --variants "$VARIANTS" --seeds "$SEEDS" $DRIVERS)" || { echo "stability: --print-runs failed (above)" >&2; exit 2; }

submit() {  # submit [VAR=value ...] -- sbatch-args...: prints the job id (in a dry run: the command, and a count)
    local envs=()
    while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
    shift
    if [[ "$DRY_RUN" == 1 ]]; then
        printf 'env' >&2; printf ' %q' "${envs[@]}" sbatch "$@" >&2; printf '\n' >&2
        echo "$((${#jobs[@]} + 1))"
    else
        env "${envs[@]}" sbatch --parsable "$@" | cut -d';' -f1
    fi
}

jobs=()
while IFS=$'\t' read -r variant seed run_dir overrides; do
    jobs+=("$(submit "CONFIG=$CONFIG" "RUN_DIR=$run_dir" "TRAIN_OVERRIDES=${DRIVERS:+$DRIVERS }$overrides" -- \
        --export=ALL --nodes="$NODES" --job-name="stability-$variant-$seed" "$REPO_DIR/launch/train.sbatch")")
done <<<"$runs"
deps="$(IFS=:; echo "${jobs[*]}")"
submit -- --dependency="afterany:$deps" --nodes=1 --ntasks=1 --job-name=stability-report \
    --wrap="$(printf '%q ' "$PYTHON" -m megatron_gspo.cli.main stability --report-only --out "$OUT")" >/dev/null
echo "stability: ${#jobs[@]} runs and the report job submitted; report: $OUT/report.md" >&2
