# shellcheck shell=bash
# megatron-gspo launch helpers: Slurm node list and rank arithmetic, environment, SGLang server commands, dry run.
# Sourced by train.sbatch, rollout_servers.sbatch, task.sh and pipeline.sh; defines functions and MG_* defaults only.
# Every variable is documented in launch/README.md.

# ---- small helpers ---------------------------------------------------------------------------------------------
mg_die() { echo "megatron-gspo launch: error: $*" >&2; exit 1; }
mg_note() { echo "# $*"; }
mg_is_dry() { [[ "${DRY_RUN:-0}" == 1 ]]; }

# Print a command, shell-quoted, exactly as it would run.
mg_show() {
    local out="+" arg
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
            out+=" $arg"
        elif [[ "$arg" != *"'"* ]]; then
            out+=" '$arg'"
        else
            out+=" $(printf '%q' "$arg")"
        fi
    done
    echo "$out"
}

# Run a command, or print it under DRY_RUN=1.
mg_run() {
    if mg_is_dry; then mg_show "$@"; else "$@"; fi
}

# Start a command in the background (its pid is appended to MG_BG_PIDS), or print it with a trailing '&'.
# It starts with SIGUSR1 ignored: Slurm signals every process of the step (the early stop signal srun forwards,
# `scancel --signal=USR1 --full`), and a rollout server or router (SGLang has no SIGUSR1 handler) would die of the
# signal that asks the trainer to checkpoint, failing the step instead of requeueing it.
MG_BG_PIDS=()
mg_run_bg() {
    local log="$1"; shift
    if mg_is_dry; then
        echo "$(mg_show "$@") > $(printf '%q' "$log") 2>&1 &"
    else
        (trap '' USR1; exec "$@") >"$log" 2>&1 &
        MG_BG_PIDS+=("$!")
    fi
}

# Stop the background processes this script started (by pid, nothing else).
mg_stop_bg() {
    local pid
    for pid in "${MG_BG_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${MG_BG_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    MG_BG_PIDS=()
}

# Stop our background processes when the script exits, including on scancel's SIGTERM (bash skips EXIT traps on
# untrapped signals). $1: extra command to run first (optional).
mg_cleanup_on_exit() {
    # shellcheck disable=SC2064  # expand $1 now
    trap "${1:+$1; }mg_stop_bg" EXIT
    trap 'exit 143' TERM INT
}

# ---- stop signals ----------------------------------------------------------------------------------------------
# The trainer stops after the current RL step, writes a checkpoint and exits 75 on SIGUSR1 (what train.sbatch asks
# Slurm to send before the time limit) and SIGTERM (scancel, preemption). These helpers run a command in the
# background and pass those signals on while waiting for it (bash runs traps only between commands, and `wait` is
# interruptible where a foreground command is not).

# Wait for pid $1 through trapped signals; returns its exit status. A `wait` cut short by a trapped signal returns
# > 128 while the process runs on; so does a process killed by a signal, and bash then answers every later
# `wait $pid` with that same 128+N (never 127): so wait again only while the process still exists, and once it is
# gone ask one last time (bash keeps the status of a child it reaped while the trap ran). One case bash loses: a
# trapped signal that lands while `wait` is reaping the child (the same signal often ends both: slurmstepd signals
# the whole step) jumps out after the reap and before the status is stored; the next `wait` answers -1 (exit 255).
# Then MG_STATUS_LOST=1 and the status is 1; mg_step_status decides from what the ranks recorded instead.
MG_STATUS_LOST=0
mg_wait() {
    local pid="$1" status=0 again
    wait "$pid" || status=$?
    while (( status > 128 )) && mg_alive "$pid"; do
        status=0
        wait "$pid" || status=$?
    done
    if (( status > 128 )); then
        again=0
        wait "$pid" 2>/dev/null || again=$?
        (( again == 127 )) || status="$again"
    fi
    if (( status < 0 || status > 255 )); then
        MG_STATUS_LOST=1
        status=1
    fi
    return "$status"
}

# Whether process $1 exists and is not a zombie (a zombie still answers kill -0).
mg_alive() {
    local line
    line="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    line="${line##*) }"
    [[ "${line:0:1}" != Z ]]
}

# mg_run_trainer MODE SIGNALS command...: run the command and wait for it through each of SIGNALS (e.g. "USR1 TERM").
# MODE direct (the batch script, whose command is srun): pass each signal on to the command as it arrives; srun hands
# it to its step, where slurmstepd delivers it to every process: task.sh, torchrun, each rank. MODE step (task.sh
# inside that step): ride them out, ignored: the trainer got the signal from Slurm already (passing it on again would
# deliver it twice, the second copy maybe while a rank's interpreter is exiting, with its handlers gone), and a
# trapped signal would cut the wait short at the very moment the rank it stopped exits, where bash can lose the
# rank's exit status (mg_wait). Other stop signals are noted and ignored while it runs (direct) or ignored (step).
# Sets MG_STOP_SIGNAL to the first signal honoured (direct); returns the command's exit status as it is (whether
# the ranks stopped with a checkpoint, mg_step_status tells from what they recorded). Under DRY_RUN=1 it prints the
# command.
MG_STOP_SIGNAL=""
mg_run_trainer() {
    local mode="$1" signals="$2"
    shift 2
    if mg_is_dry; then
        mg_show "$@"
        return 0
    fi
    local saved sig status=0
    saved="$(trap -p USR1 TERM)"
    if [[ "$1" != srun ]]; then
        # torchrun, or a rank, starts with SIGUSR1 ignored: Slurm signals every process of the step (srun
        # forwarding a signal, `scancel --signal=USR1 --full`), and torchrun has no handler for it (nor has SFT),
        # so it would die at once, torchrun leaving its workers behind. The ignore survives exec; the workers
        # inherit it and `train` installs its own handler over it (SFT, which cannot resume, keeps ignoring it).
        # srun installs its own handlers (it forwards the signal to the step).
        (trap '' USR1; exec "$@") &
    else
        "$@" &
    fi
    MG_TRAINER_PID=$!
    # Set only now: the command keeps the dispositions it started with (SIGTERM: the default).
    for sig in USR1 TERM; do
        if [[ "$mode" == step ]]; then
            trap '' "$sig"
        elif [[ " $signals " == *" $sig "* ]]; then
            # shellcheck disable=SC2064  # expand now
            trap "mg_pass_signal $sig" "$sig"
        else
            # shellcheck disable=SC2064
            trap "mg_note 'ignoring SIG$sig: this job cannot stop early and resume'" "$sig"
        fi
    done
    mg_wait "$MG_TRAINER_PID" || status=$?
    # A stop request that arrives once the trainer has ended means nothing any more (Slurm signals every process
    # of the step, so copies of one request may still be on their way): ignored, it cannot kill the script
    # before it reports the trainer's status.
    trap '' USR1
    trap - TERM
    eval "$saved"
    return "$status"
}

mg_pass_signal() {  # signal
    [[ -n "$MG_STOP_SIGNAL" ]] || MG_STOP_SIGNAL="$1"
    mg_note "SIG$1 at $(date -u +%FT%TZ): passing it to the trainer (it stops after the current step with a checkpoint)"
    kill -s "$1" "$MG_TRAINER_PID" 2>/dev/null || true
}

# The exit code rank $1 recorded in MG_STATUS_DIR (nothing without a record). A stop with a checkpoint reads
# "75 SIGUSR1" or "75 SIGTERM" there: the signal the ranks agreed to stop for.
mg_rank_code() {
    local code="" signal=""
    { read -r code signal <"$MG_STATUS_DIR/rank-$1"; } 2>/dev/null || true
    echo "$code"
}

# Whether a rank recorded a stop for SIGTERM (it reached the ranks even when not the batch shell: `scancel
# --signal=TERM` signals only the job's steps).
mg_ranks_stopped_by_term() {
    local rank code signal
    for ((rank = 0; rank < WORLD_SIZE; rank++)); do
        code="" signal=""
        { read -r code signal <"$MG_STATUS_DIR/rank-$rank"; } 2>/dev/null || true
        [[ "$code $signal" != "75 SIGTERM" ]] || return 0
    done
    return 1
}

# A fresh MG_STATUS_DIR for the training step: each rank writes its exit code there (megatron_gspo/cli/main.py).
mg_new_status_dir() {
    MG_STATUS_DIR="$LOG_DIR/exit-status-${SLURM_JOB_ID:-local}"
    export MG_STATUS_DIR
    mg_is_dry || { rm -rf "$MG_STATUS_DIR" && mkdir -p "$MG_STATUS_DIR"; }
}

# The training step's status from its exit status $1 and what its WORLD_SIZE ranks recorded in MG_STATUS_DIR: 75
# (stopped for a signal with a checkpoint) only when every rank recorded 75. Each task reports such a stop to srun
# as 0 (mg_task_status: `--kill-on-bad-exit` counts 75 as bad and would kill the ranks still writing), and torchrun
# reports it as 1, so the ranks' own records decide; a 75 that not every rank confirms is a failure (srun reports the
# highest code of its tasks: one rank stopping while another failed writing its checkpoint reads 75), 1; any other
# status stays as it is. A failure is reported in one line naming the ranks that recorded no exit (killed) and the
# signal when a task saw it (LAUNCHER=srun) or torchrun's report in the node log names it (LAUNCHER=torchrun).
# When bash lost srun's status (MG_STATUS_LOST, mg_wait), every rank having recorded 0 makes it 0.
mg_step_status() {
    local status="$1" rank stopped=0 done=0 code
    local -a lost=()
    if [[ -n "${MG_STATUS_DIR:-}" ]] && ! mg_is_dry; then
        for ((rank = 0; rank < WORLD_SIZE; rank++)); do
            code="$(mg_rank_code "$rank")"
            if [[ "$code" == 75 ]]; then
                stopped=$((stopped + 1))
            elif [[ "$code" == 0 ]]; then
                done=$((done + 1))
            elif [[ -z "$code" ]]; then
                lost+=("rank $rank$(cat "$MG_STATUS_DIR/signal-$rank" 2>/dev/null || mg_torchrun_signal "$rank")")
            fi
        done
        if (( stopped == WORLD_SIZE )); then
            status=75
        elif (( done == WORLD_SIZE && MG_STATUS_LOST == 1 )); then
            status=0
        elif (( stopped > 0 && (status == 75 || status == 0) )); then
            mg_note "only $stopped of $WORLD_SIZE ranks stopped with a checkpoint (see $LOG_DIR): the step failed" >&2
            status=1
        fi
        if (( status != 0 && status != 75 && ${#lost[@]} > 0 )); then
            local names
            names="$(printf ', %s' "${lost[@]}")"
            echo "megatron-gspo launch: training failed (exit $status): ${names:2} ended without an exit status (killed by a signal or lost, e.g. out of memory; see $LOG_DIR)" >&2
        fi
    fi
    echo "$status"
}

# The signal torchrun recorded for global rank $1 in this job's node logs (its failure report: "rank : 1
# (local_rank: 1)" then "exitcode : -9 (pid: ...)"; the last report wins, as requeued starts append), printed as
# " (SIGKILL)"; nothing when there is none (LAUNCHER=srun: the task records the signal itself).
mg_torchrun_signal() {
    [[ "${LAUNCHER:-torchrun}" == torchrun ]] || return 1
    local sig
    sig="$(awk -v r="$1" '$1 == "rank" && $2 == ":" && $3 == r { hit = 1; next }
        hit && $1 == "exitcode" { sig = ($3 ~ /^-[0-9]+$/) ? -$3 : ""; hit = 0 }
        END { print sig }' "$LOG_DIR"/train-"${SLURM_JOB_ID:-local}"-node*.log 2>/dev/null)"
    [[ -n "$sig" ]] || return 1
    echo " (SIG$(kill -l "$sig" 2>/dev/null || echo "$sig"))"
}

# What a training task tells srun (LAUNCHER=torchrun: the node's GPUS_PER_NODE ranks; srun: rank RANK): 0 when every
# one of its ranks recorded 75 (stopped with a checkpoint), so that `--kill-on-bad-exit` does not kill the other
# tasks while they still write theirs (the batch script reads the 75s back in mg_step_status); otherwise $1. A rank
# the task saw die of a signal (LAUNCHER=srun) gets its signal recorded for mg_step_status's line.
mg_task_status() {
    local status="$1" first="$2" count="$3" rank
    [[ -n "${MG_STATUS_DIR:-}" ]] && ! mg_is_dry || { echo "$status"; return; }
    if (( status > 128 && count == 1 )) && [[ ! -e "$MG_STATUS_DIR/rank-$first" ]]; then
        echo " (SIG$(kill -l $((status - 128)) 2>/dev/null || echo $((status - 128))))" >"$MG_STATUS_DIR/signal-$first"
    fi
    (( status != 0 )) || { echo 0; return; }
    for ((rank = first; rank < first + count; rank++)); do
        [[ "$(mg_rank_code "$rank")" == 75 ]] || { echo "$status"; return; }
    done
    echo 0
}

# After the training step of a `train` job: requeue the job (scontrol requeue) when the trainer stopped with a
# checkpoint (status 75) for SIGUSR1 (the signal requested before the time limit, whether the batch shell or only
# the ranks got it), not for SIGTERM (scancel, `scancel --signal=TERM` to the steps alone; Slurm requeues preempted
# jobs itself): the batch shell's own signal and the ranks' records both count. Never on 0 (done) or a failure,
# e.g. a full disk while writing the stop checkpoint: that would requeue forever. The requeued job resumes
# (SLURM_RESTART_COUNT > 0 adds --resume). REQUEUE=0 turns it off. $1: the step's status (mg_step_status).
mg_requeue_if_stopped() {
    local status="$1"
    [[ "${REQUEUE:-1}" == 1 && "${MG_SUBCOMMAND:-train}" == train ]] || return 0
    if [[ "$status" == 75 && "$MG_STOP_SIGNAL" != TERM ]] && ! mg_ranks_stopped_by_term; then
        [[ -n "${SLURM_JOB_ID:-}" ]] || mg_die "stopped early but SLURM_JOB_ID is not set: cannot requeue"
        mg_note "training stopped before the time limit (exit $status): requeueing job $SLURM_JOB_ID; it resumes from the last checkpoint"
        scontrol requeue "$SLURM_JOB_ID"
    fi
}

mg_print_vars() {
    local name
    for name in "$@"; do echo "$name=${!name-}"; done
}

mg_require_int() {  # name value
    [[ "$2" =~ ^[0-9]+$ && "$2" -ge 1 ]] || mg_die "$1=$2 must be a positive integer"
}

# Directory of the launch scripts. Under sbatch, $0 is a spool copy, so fall back to the submit directory.
mg_launch_dir() {
    if [[ -n "${LAUNCH_DIR:-}" ]]; then
        echo "$LAUNCH_DIR"
    elif [[ -f "$(dirname "${BASH_SOURCE[0]}")/common.sh" ]]; then
        (cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    else
        echo "${SLURM_SUBMIT_DIR:-$PWD}/launch"
    fi
}

# ---- cluster arithmetic ----------------------------------------------------------------------------------------
# MG_HOSTS: the job's hosts, in Slurm order. FAKE_HOSTNAMES (space/comma separated) replaces scontrol in dry runs.
mg_hosts() {
    if [[ -n "${FAKE_HOSTNAMES:-}" ]]; then
        mg_is_dry || mg_die "FAKE_HOSTNAMES is for DRY_RUN=1 only"
        read -r -a MG_HOSTS <<<"${FAKE_HOSTNAMES//,/ }"
    else
        local nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
        [[ -n "$nodelist" ]] || mg_die "SLURM_JOB_NODELIST is not set: run inside a Slurm job (sbatch/salloc), or set DRY_RUN=1 with FAKE_HOSTNAMES"
        command -v scontrol >/dev/null || mg_die "scontrol not found on PATH"
        mapfile -t MG_HOSTS < <(scontrol show hostnames "$nodelist")
    fi
    [[ ${#MG_HOSTS[@]} -ge 1 ]] || mg_die "empty node list"
}

# GPUs per node: GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else the count in SLURM_GPUS_PER_NODE ("8" or "h100:8").
mg_gpus_per_node() {
    local n="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    if [[ -z "$n" && -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
        n="${SLURM_GPUS_PER_NODE##*:}"
        n="${n%%(*}"
    fi
    [[ -n "$n" ]] || mg_die "cannot tell the GPUs per node: set GPUS_PER_NODE or submit with --gpus-per-node"
    mg_require_int GPUS_PER_NODE "$n"
    echo "$n"
}

# Sets and exports: NNODES (all job nodes), GPUS_PER_NODE, TRAIN_NODES, ROLLOUT_NODES, TRAIN_HOSTS, ROLLOUT_HOSTS,
# MASTER_ADDR (first training host), MASTER_PORT, WORLD_SIZE (training ranks).
mg_setup_cluster() {
    mg_hosts
    NNODES="${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-${#MG_HOSTS[@]}}}"
    mg_require_int SLURM_NNODES "$NNODES"
    [[ "$NNODES" -eq ${#MG_HOSTS[@]} ]] || mg_die "SLURM_NNODES=$NNODES but the node list has ${#MG_HOSTS[@]} hosts (${MG_HOSTS[*]})"
    GPUS_PER_NODE="$(mg_gpus_per_node)" || exit 1
    ROLLOUT_NODES="${ROLLOUT_NODES:-0}"
    [[ "$ROLLOUT_NODES" =~ ^[0-9]+$ ]] || mg_die "ROLLOUT_NODES=$ROLLOUT_NODES must be an integer >= 0"
    TRAIN_NODES=$((NNODES - ROLLOUT_NODES))
    [[ "$TRAIN_NODES" -ge 1 ]] || mg_die "ROLLOUT_NODES=$ROLLOUT_NODES leaves no training node out of $NNODES"
    TRAIN_HOSTS="${MG_HOSTS[*]:0:TRAIN_NODES}"
    ROLLOUT_HOSTS="${MG_HOSTS[*]:TRAIN_NODES}"
    MASTER_ADDR="${MASTER_ADDR:-${MG_HOSTS[0]}}"
    # MG_PORT_GIVEN: whether MASTER_PORT came from the user (a one-node torchrun step then uses it; otherwise it
    # runs --standalone, where torchrun binds a port the kernel picks: no collision with other jobs on the node).
    if [[ -n "${MASTER_PORT:-}" && -z "${MG_PORT_GIVEN:-}" ]]; then MG_PORT_GIVEN=1; fi
    MG_PORT_GIVEN="${MG_PORT_GIVEN:-0}"
    MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
    WORLD_SIZE=$((TRAIN_NODES * GPUS_PER_NODE))
    export NNODES GPUS_PER_NODE ROLLOUT_NODES TRAIN_NODES TRAIN_HOSTS ROLLOUT_HOSTS MASTER_ADDR MASTER_PORT WORLD_SIZE \
        MG_PORT_GIVEN
}

# Environment for training ranks (NCCL/GLOO interfaces, Megatron's single CUDA connection for comm/compute ordering).
mg_setup_env() {
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    export PYTHONUNBUFFERED=1
    # One share of the CPUs Slurm granted on this node per rank (not a fixed 8: eight ranks x 8 threads on a node
    # granted 16 CPUs oversubscribe it four times); outside Slurm, of this machine's CPUs.
    if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
        local cpus="${SLURM_CPUS_ON_NODE:-$(nproc 2>/dev/null || echo 1)}" ranks="${GPUS_PER_NODE:-1}"
        [[ "$cpus" =~ ^[0-9]+$ ]] || cpus=1
        [[ "$ranks" =~ ^[0-9]+$ && "$ranks" -ge 1 ]] || ranks=1
        OMP_NUM_THREADS=$(( cpus / ranks > 0 ? cpus / ranks : 1 ))
    fi
    export OMP_NUM_THREADS
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    if [[ -n "${NET_IFACE:-}" ]]; then
        export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$NET_IFACE}"
        export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NET_IFACE}"
    fi
    [[ -z "${IB_HCA:-}" ]] || export NCCL_IB_HCA="${NCCL_IB_HCA:-$IB_HCA}"
}

mg_print_env() {
    mg_print_vars CUDA_DEVICE_MAX_CONNECTIONS NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_DEBUG OMP_NUM_THREADS
}

# ---- SGLang rollout servers -------------------------------------------------------------------------------------
# One server per SGLANG_TP GPUs of a node, on ports SGLANG_PORT, SGLANG_PORT+1, ...
mg_sglang_defaults() {
    SGLANG_PYTHON="${SGLANG_PYTHON:-python}"
    SGLANG_TP="${SGLANG_TP:-1}"
    SGLANG_PORT="${SGLANG_PORT:-30000}"
    ROUTER_PORT="${ROUTER_PORT:-29000}"
    SGLANG_ROUTER="${SGLANG_ROUTER:-0}"
    mg_require_int SGLANG_TP "$SGLANG_TP"
    (( GPUS_PER_NODE % SGLANG_TP == 0 )) || mg_die "SGLANG_TP=$SGLANG_TP does not divide GPUS_PER_NODE=$GPUS_PER_NODE"
    SERVERS_PER_NODE=$((GPUS_PER_NODE / SGLANG_TP))
    export SGLANG_PYTHON SGLANG_TP SGLANG_PORT ROUTER_PORT SGLANG_ROUTER SERVERS_PER_NODE
}

# Worker URLs of servers on the given hosts (space separated), in host order then port order.
mg_sglang_urls() {
    local host i urls=()
    for host in $1; do
        for ((i = 0; i < SERVERS_PER_NODE; i++)); do urls+=("http://$host:$((SGLANG_PORT + i))"); done
    done
    echo "${urls[*]}"
}

# The launch_server command of server $1 on this node (GPUs $1*SGLANG_TP ... ; colocated adds memory-saver flags).
mg_sglang_server_cmd() {
    local i="$1" colocated="${2:-0}" first gpus g
    first=$((i * SGLANG_TP))
    gpus="$first"
    for ((g = first + 1; g < first + SGLANG_TP; g++)); do gpus+=",$g"; done
    [[ -n "${SGLANG_MODEL_PATH:-}" ]] || mg_die "SGLANG_MODEL_PATH is not set (the HF checkpoint the rollout servers load)"
    MG_CMD=(env "CUDA_VISIBLE_DEVICES=$gpus" "$SGLANG_PYTHON" -m sglang.launch_server
        --model-path "$SGLANG_MODEL_PATH" --tp "$SGLANG_TP" --host 0.0.0.0 --port "$((SGLANG_PORT + i))"
        --skip-tokenizer-init)
    [[ "${ROUTING_REPLAY:-off}" != r3 ]] || MG_CMD+=(--enable-return-routed-experts)
    [[ "${SGLANG_DETERMINISTIC:-0}" != 1 ]] || MG_CMD+=(--enable-deterministic-inference)
    if [[ "$colocated" == 1 ]]; then
        MG_CMD+=(--enable-memory-saver --mem-fraction-static "${SGLANG_MEM_FRACTION:-0.4}")
    fi
    # shellcheck disable=SC2206  # word splitting of the extra flags is intended
    [[ -z "${SGLANG_EXTRA_ARGS:-}" ]] || MG_CMD+=(${SGLANG_EXTRA_ARGS})
}

mg_router_cmd() {  # worker URLs (space separated)
    # shellcheck disable=SC2206
    local urls=($1)
    MG_CMD=("$SGLANG_PYTHON" -m sglang_router.launch_router --host 0.0.0.0 --port "$ROUTER_PORT" --worker-urls "${urls[@]}")
}

# Start (or print) this node's servers; logs go to $LOG_DIR/sglang-<host>-<i>.log.
mg_start_sglang_node() {
    local host="$1" colocated="${2:-0}" i
    for ((i = 0; i < SERVERS_PER_NODE; i++)); do
        mg_sglang_server_cmd "$i" "$colocated"
        mg_run_bg "$LOG_DIR/sglang-$host-$i.log" "${MG_CMD[@]}"
    done
}

# Wait until every URL in $1 answers GET <url>$2 (default /health_generate; skipped in dry runs).
mg_wait_healthy() {
    local url path="${2:-/health_generate}" deadline=$((SECONDS + ${SGLANG_START_TIMEOUT:-1800}))
    if mg_is_dry; then
        mg_note "wait for $path on: $1"
        return 0
    fi
    for url in $1; do
        until curl -sf -o /dev/null "$url$path"; do
            (( SECONDS < deadline )) || mg_die "$url$path not healthy after ${SGLANG_START_TIMEOUT:-1800}s"
            sleep 10
        done
    done
}

# ---- run directories ---------------------------------------------------------------------------------------------
# RUN_DIR (the trainer's trainer.run_dir: metrics, plots, checkpoints/; default $SLURM_SUBMIT_DIR/runs/<job>-<id>)
# and LOG_DIR (the launcher's per-node / per-rank / SGLang logs).
mg_setup_dirs() {
    RUN_DIR="${RUN_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/runs/${RUN_NAME:-${SLURM_JOB_NAME:-megatron-gspo}-${SLURM_JOB_ID:-local}}}"
    LOG_DIR="${LOG_DIR:-$RUN_DIR/logs}"
    export RUN_DIR LOG_DIR
}
