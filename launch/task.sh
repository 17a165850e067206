#!/bin/bash
# megatron-gspo: what ONE Slurm task runs (started by `srun` from train.sbatch / rollout_servers.sbatch).
#   task.sh train [key=value ...]   a training node (LAUNCHER=torchrun: one task per node) or rank (LAUNCHER=srun)
#   task.sh rollout                 one rollout node: SGLang servers (+ the router on the first rollout node)
# Reads the variables train.sbatch exported (MASTER_ADDR, WORLD_SIZE, TRAIN_HOSTS, ...) and SLURM_NODEID /
# SLURM_PROCID / SLURM_LOCALID; computes the missing cluster ones itself when run on its own.
set -euo pipefail

MG_TASK_DIR="${LAUNCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}"
# shellcheck source=launch/common.sh
source "$MG_TASK_DIR/common.sh"

# The trainer's command line after the interpreter (MG_ARGS): module, subcommand, config, then the overrides this
# script sets (run-config keys, megatron_gspo/training/config.py), TRAIN_OVERRIDES and "$@" (those win).
mg_trainer_args() {
    [[ -n "${CONFIG:-}" ]] || mg_die "CONFIG is not set (the run config YAML)"
    local sub="${MG_SUBCOMMAND:-train}"
    MG_ARGS=(-m megatron_gspo.cli.main "$sub" --config "$CONFIG")
    if [[ "$sub" == sft ]]; then
        MG_ARGS+=(--out "${SFT_OUT:-$RUN_DIR/sft_model}")
    elif [[ "${RESUME:-0}" == 1 || "${SLURM_RESTART_COUNT:-0}" -ge 1 ]]; then
        MG_ARGS+=(--resume)  # asked for, or a requeued job (it continues from its checkpoint)
    fi
    MG_ARGS+=("trainer.run_dir=$RUN_DIR")
    if [[ -n "${ROLLOUT_URLS:-}" ]]; then
        # The servers run already: the trainer (RL, or SFT for its held-out checks) attaches to them
        # (SGLangConfig: mode, urls, router_url, colocated). Weight sync needs each server's GPU count (the size
        # of the NCCL group) and an address of trainer rank 0 that the servers reach (its rendezvous store).
        MG_ARGS+=(rollout.engine=sglang sglang.mode=attach "sglang.urls=[${ROLLOUT_URLS// /,}]")
        if [[ -n "${ROUTER_URL:-}" && "${ROUTING_REPLAY:-}" == r3 && "$sub" == train ]]; then
            # sglang-router re-sends /generate without return_routed_experts: R3 generates on the servers directly.
            mg_note "ROUTING_REPLAY=r3: generation goes to the servers, not the router $ROUTER_URL"
        elif [[ -n "${ROUTER_URL:-}" ]]; then
            MG_ARGS+=("sglang.router_url=$ROUTER_URL")
        fi
        if [[ "${ROLLOUT_MODE:-none}" == colocated ]]; then
            # A server and trainer rank 0 share a GPU: no NCCL group between them; weights travel as files on a
            # file system every node reads (the run directory's).
            MG_ARGS+=(sglang.colocated=true sglang.weight_sync=disk "sglang.weight_sync_dir=${WEIGHT_SYNC_DIR:-$RUN_DIR/weight_sync}")
        fi
        [[ "${SGLANG_DETERMINISTIC:-0}" != 1 ]] || MG_ARGS+=(sglang.deterministic_inference=true)
        [[ -z "${SGLANG_TP:-}" ]] || MG_ARGS+=("sglang.tp_size=$SGLANG_TP")
        local sync_addr="${WEIGHT_SYNC_ADDR:-${MASTER_ADDR:-}}"
        [[ -z "$sync_addr" ]] || MG_ARGS+=("sglang.master_address=$sync_addr")
    fi
    if [[ "$sub" == train && -n "${ROUTING_REPLAY:-}" ]]; then
        MG_ARGS+=("moe.routing_replay=$ROUTING_REPLAY")
        [[ "$ROUTING_REPLAY" != r3 || -z "${ROLLOUT_URLS:-}" ]] || MG_ARGS+=(sglang.return_routed_experts=true)
    fi
    # shellcheck disable=SC2206  # TRAIN_OVERRIDES is a space-separated list of key=value
    [[ -z "${TRAIN_OVERRIDES:-}" ]] || MG_ARGS+=(${TRAIN_OVERRIDES})
    MG_ARGS+=("$@")
}

# Signals the trainer honours: `train` stops after the step with a checkpoint on both; `sft` cannot resume, so it
# keeps running through the early USR1 (the job then ends at its time limit).
mg_stop_signals() {
    if [[ "${MG_SUBCOMMAND:-train}" == train ]]; then echo "USR1 TERM"; else echo "TERM"; fi
}

mg_task_train() {
    [[ -n "${WORLD_SIZE:-}" && -n "${MASTER_ADDR:-}" && -n "${TRAIN_HOSTS:-}" ]] || mg_setup_cluster
    mg_setup_env
    mg_setup_dirs
    local -a hosts
    read -r -a hosts <<<"$TRAIN_HOSTS"
    NODE_RANK="${SLURM_NODEID:?SLURM_NODEID is not set: run under srun}"
    (( NODE_RANK < ${#hosts[@]} )) || mg_die "SLURM_NODEID=$NODE_RANK but there are ${#hosts[@]} training nodes"
    local host="${hosts[NODE_RANK]}" python="${PYTHON:-python}"
    mg_trainer_args "$@"
    case "${LAUNCHER:-torchrun}" in
    torchrun)
        export NODE_RANK
        mg_note "training node $NODE_RANK ($host): ranks $((NODE_RANK * GPUS_PER_NODE))..$(((NODE_RANK + 1) * GPUS_PER_NODE - 1))"
        mg_print_vars NODE_RANK MASTER_ADDR MASTER_PORT WORLD_SIZE
        if [[ "${ROLLOUT_MODE:-none}" == colocated ]]; then
            # While the colocated servers start (up to minutes), this task too rides out a SIGUSR1 (it reaches every
            # process of the step); the trainer, started below, is what answers it.
            trap '' USR1
            mg_is_dry || mg_cleanup_on_exit
            mg_sglang_defaults
            mg_start_sglang_node "$host" 1
            mg_wait_healthy "$(mg_sglang_urls "$host")"
            trap - USR1
        fi
        # shellcheck disable=SC2206  # TORCHRUN may hold an interpreter and a module
        local -a torchrun=(${TORCHRUN:-$python -m torch.distributed.run})
        local status=0
        local -a rendezvous=(--node-rank="$NODE_RANK" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT")
        if [[ "$TRAIN_NODES" == 1 && "${MG_PORT_GIVEN:-0}" != 1 ]]; then
            # One node: torchrun binds a port of the kernel's choosing itself (a port fixed in advance can be
            # taken by another job on a shared node: EADDRINUSE). MASTER_PORT=... pins one.
            rendezvous=(--standalone)
        fi
        mg_run_trainer step "$(mg_stop_signals)" "${torchrun[@]}" --nnodes="$TRAIN_NODES" \
            --nproc-per-node="$GPUS_PER_NODE" "${rendezvous[@]}" "${MG_ARGS[@]}" || status=$?
        mg_stop_bg
        mg_is_dry || status="$(mg_task_status "$status" $((NODE_RANK * GPUS_PER_NODE)) "$GPUS_PER_NODE")"
        return "$status"
        ;;
    srun)
        [[ "${ROLLOUT_MODE:-none}" != colocated ]] || mg_die "ROLLOUT_MODE=colocated needs LAUNCHER=torchrun (one task per node starts the node's servers)"
        RANK="${SLURM_PROCID:?SLURM_PROCID is not set: run under srun}"
        LOCAL_RANK="${SLURM_LOCALID:?SLURM_LOCALID is not set: run under srun}"
        LOCAL_WORLD_SIZE="$GPUS_PER_NODE"
        [[ -z "${SLURM_NTASKS:-}" || "$SLURM_NTASKS" -eq "$WORLD_SIZE" ]] || mg_die "SLURM_NTASKS=$SLURM_NTASKS but WORLD_SIZE=$WORLD_SIZE"
        (( RANK == NODE_RANK * GPUS_PER_NODE + LOCAL_RANK )) || mg_die "SLURM_PROCID=$RANK is not node $NODE_RANK x $GPUS_PER_NODE + local $LOCAL_RANK: use --ntasks-per-node=$GPUS_PER_NODE with block distribution"
        export RANK LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK
        mg_note "training rank $RANK on node $NODE_RANK ($host)"
        mg_print_vars RANK LOCAL_RANK NODE_RANK WORLD_SIZE MASTER_ADDR MASTER_PORT
        local status=0
        mg_run_trainer step "$(mg_stop_signals)" "$python" "${MG_ARGS[@]}" || status=$?
        mg_is_dry || status="$(mg_task_status "$status" "$RANK" 1)"
        return "$status"
        ;;
    *) mg_die "LAUNCHER=${LAUNCHER} must be torchrun or srun" ;;
    esac
}

mg_task_rollout() {
    [[ -n "${ROLLOUT_HOSTS:-}" ]] || mg_die "ROLLOUT_HOSTS is not set (train.sbatch / rollout_servers.sbatch set it)"
    GPUS_PER_NODE="${GPUS_PER_NODE:-$(mg_gpus_per_node)}"
    mg_sglang_defaults
    mg_setup_dirs
    local -a hosts
    read -r -a hosts <<<"$ROLLOUT_HOSTS"
    local idx="${SLURM_NODEID:?SLURM_NODEID is not set: run under srun}"
    (( idx < ${#hosts[@]} )) || mg_die "SLURM_NODEID=$idx but there are ${#hosts[@]} rollout nodes"
    local host="${hosts[idx]}" urls
    urls="$(mg_sglang_urls "$ROLLOUT_HOSTS")"
    ROLLOUT_NODE_RANK="$idx"
    mg_note "rollout node $idx ($host): $SERVERS_PER_NODE SGLang server(s) of tp=$SGLANG_TP"
    mg_print_vars ROLLOUT_NODE_RANK SERVERS_PER_NODE
    mg_start_sglang_node "$host" 0
    if [[ "$SGLANG_ROUTER" == 1 && "$idx" == 0 ]]; then
        mg_wait_healthy "$urls"
        mg_router_cmd "$urls"
        mg_run_bg "$LOG_DIR/sglang-router.log" "${MG_CMD[@]}"
    fi
    mg_is_dry && return 0
    mg_cleanup_on_exit
    local pid
    while true; do  # serve until a process dies or the step is cancelled
        for pid in "${MG_BG_PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || mg_die "an SGLang process (pid $pid) on $host exited; see $LOG_DIR"
        done
        sleep 30 &
        wait $! || true
    done
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    role="${1:-}"
    shift || true
    case "$role" in
    train) mg_task_train "$@" ;;
    rollout) mg_task_rollout ;;
    *) mg_die "usage: task.sh train [key=value ...] | task.sh rollout" ;;
    esac
fi
