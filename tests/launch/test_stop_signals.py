"""launch/: stop signals and requeue, every combination of rank exit codes, against stand-ins that behave as the
real ones do (see SRUN below): `srun` runs the tasks locally, delivers a signal to every process of each task and
honours --kill-on-bad-exit; `python` plays torchrun (no SIGUSR1 handler) with one worker per GPU that records the
signals it gets and exits 75 (the trainer's "stopped with a checkpoint"; USR1_EXITS sets other codes per rank),
recording its code in $MG_STATUS_DIR as the trainer does; `scontrol` records requeue requests. The same paths under
a real Slurm: test_slurm_jobs.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.test_scripts import FOUR_NODES, LAUNCH, SCONTROL

# What a real srun / slurmstepd does, as observed under Slurm 22.05 (launch/README.md "Signals"): a signal srun
# receives goes to EVERY process of the step (each task's whole process tree, torchrun and its workers included),
# not only to the task's first process; with --kill-on-bad-exit=1 the first task that exits non-zero (75 included)
# gets the others killed. The real-Slurm tests (test_slurm_jobs.py) check the scripts under the real thing; these
# stand-ins stay for the cases those cannot reach quickly (every combination of rank exit codes).
SRUN = f"""#!{sys.executable}
import os, signal, subprocess, sys, time
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
current = []
def forward(sig, frame):  # to every process of the step: each task runs in a process group of its own
    for p in current:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGUSR1, forward)
signal.signal(signal.SIGTERM, forward)
nodes = int(opts.get("nodes", 1))
ntasks = int(opts.get("ntasks", nodes))
per_node = int(opts.get("ntasks-per-node", 1))
for task in range(ntasks):  # the tasks run side by side, as under Slurm
    env = dict(os.environ, SLURM_NODEID=str(task // per_node), SLURM_PROCID=str(task),
               SLURM_LOCALID=str(task % per_node), SLURM_NTASKS=str(ntasks))
    current.append(subprocess.Popen(args, env=env, process_group=0))
codes = {{}}
while len(codes) < len(current):
    for p in current:
        if p.pid not in codes and p.poll() is not None:
            codes[p.pid] = p.returncode if p.returncode >= 0 else 128 - p.returncode
            if codes[p.pid] != 0 and opts.get("kill-on-bad-exit") == "1":
                open(os.environ["LOG"], "a").write(f"srun killed the step: a task exited {{codes[p.pid]}}\\n")
                for q in current:
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
    time.sleep(0.02)
sys.exit(max(codes.values()))  # Slurm's srun: the highest exit code of its tasks
"""

WORKER = f"""#!{sys.executable}
# A training rank: stops "after the step" on USR1 / TERM with exit 75 (on USR1: the RANK-th code of USR1_EXITS,
# e.g. 1 for a full disk while writing the checkpoint, 0 for a run that ended anyway), recorded like the trainer.
# Python, like the trainer: it installs its handlers over an inherited ignore (a bash script cannot).
import os, signal, sys, time
rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
codes = os.environ.get("USR1_EXITS", "75 75").split()
def log(text):
    with open(os.environ["LOG"], "a") as f:
        f.write(text + "\\n")
def stop(name, code):
    log(f"worker {{rank}} got {{name}}")
    with open(os.path.join(os.environ["MG_STATUS_DIR"], f"rank-{{rank}}"), "w") as f:
        f.write(f"{{code}} SIG{{name}}\\n" if code == 75 else f"{{code}}\\n")  # as megatron_gspo/cli/main.py
    sys.exit(code)
sft = os.environ.get("MG_SUBCOMMAND", "train") == "sft"
if not sft:  # SFT installs no USR1 handler (what it inherited stays)
    signal.signal(signal.SIGUSR1, lambda *_: stop("USR1", int(codes[int(rank)])))
def term(*_):
    if sft:  # SFT has no stop handler: SIGTERM kills it
        log(f"worker {{rank}} got TERM")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    stop("TERM", 75)
signal.signal(signal.SIGTERM, term)
log(f"worker {{rank}} started")
while True:
    time.sleep(0.05)
"""

TORCHRUN = """#!/bin/bash
# Plays `python -m torch.distributed.run ...`: one worker per GPU (RANK set); a failed worker fails torchrun (exit 1).
# Like torchrun it has no SIGUSR1 handler: a SIGUSR1 that is not ignored kills it (the test then finds no "launcher
# exited" line).
echo "launcher $*" >> "$LOG"
trap 'echo "launcher got TERM" >> "$LOG"' TERM
nproc=1
for arg in "$@"; do [[ "$arg" != --nproc-per-node=* ]] || nproc="${arg#*=}"; done
pids=()
for ((r = 0; r < nproc; r++)); do RANK=$((SLURM_PROCID * nproc + r)) "$WORKER" & pids+=($!); done
failed=0
for pid in "${pids[@]}"; do
    status=0
    wait "$pid" || status=$?
    while (( status > 128 )) && kill -0 "$pid" 2>/dev/null; do status=0; wait "$pid" || status=$?; done
    (( status == 0 )) || failed=1
done
echo "launcher exited $failed" >> "$LOG"
exit "$failed"
"""


@pytest.fixture()
def job(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "events.log"
    log.touch()
    scontrol = SCONTROL.replace(
        'if sys.argv[1:3] != ["show", "hostnames"]',
        'import os\nif sys.argv[1:2] == ["requeue"]:\n    open(os.environ["LOG"], "a").write("scontrol " + " ".join(sys.argv[1:]) + "\\n")\n'
        '    sys.exit(0)\nif sys.argv[1:3] != ["show", "hostnames"]',
    )
    for name, text in {"scontrol": scontrol, "srun": SRUN, "worker": WORKER, "python-torchrun": TORCHRUN}.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "PYTHON": str(bindir / "python-torchrun"),
        "WORKER": str(bindir / "worker"),
        "LOG": str(log),
        "CONFIG": "c.yaml",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_NNODES": "1",
        "SLURM_GPUS_ON_NODE": "2",
    }

    def start(**extra):
        proc = subprocess.Popen(["bash", str(LAUNCH / "train.sbatch")], cwd=tmp_path, env={**env, **extra},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        ranks = 2  # SLURM_GPUS_ON_NODE: one rank per GPU under both launchers
        while log.read_text().count("started") < ranks:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
            time.sleep(0.05)
        return proc

    return start, log


def _finish(proc) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_usr1_before_the_time_limit_stops_the_ranks_and_requeues(job, launcher):
    start, log = job
    # LAUNCHER=srun: the task's python is the rank itself.
    proc = start(LAUNCHER=launcher, **({"PYTHON": "worker"} if launcher == "srun" else {}))
    proc.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@600` sends the batch script
    status, out = _finish(proc)
    events = log.read_text().splitlines()
    assert status == 75, out
    assert "worker 0 got USR1" in events and "worker 1 got USR1" in events  # one rank per GPU: both
    assert "launcher got TERM" not in events  # torchrun is left alone
    if launcher == "torchrun":  # it got the step's SIGUSR1 too, ignored it, and reported its workers' end
        assert "launcher exited 1" in events, events
    assert not any(e.startswith("srun killed") for e in events), events  # a 75 is not a bad exit
    assert "scontrol requeue 7" in events
    assert "requeueing job 7" in out


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
@pytest.mark.parametrize("exits, expected", [("0 0", 0), ("1 1", 1), ("75 1", 1), ("1 75", 1)])
def test_only_a_stop_with_a_checkpoint_on_every_rank_requeues(job, launcher, exits, expected):
    # After USR1 the ranks ended 0 (done anyway), 1 (e.g. the disk filled while writing the stop checkpoint), or
    # one stopped and the other failed: the job keeps that status and is not requeued (it would fail again, forever).
    start, log = job
    proc = start(LAUNCHER=launcher, USR1_EXITS=exits, **({"PYTHON": "worker"} if launcher == "srun" else {}))
    proc.send_signal(signal.SIGUSR1)
    status, out = _finish(proc)
    events = log.read_text().splitlines()
    # A rank that exits 1 first gets the other killed (--kill-on-bad-exit), maybe before it logged its USR1.
    assert "worker 0 got USR1" in events or "worker 1 got USR1" in events, out
    if expected:  # a failed rank gets the other one killed (srun --kill-on-bad-exit): 1, or srun's 137
        assert status not in (0, 75), out
    else:
        assert status == 0, out
    assert not any(e.startswith("scontrol") for e in events), out


def test_sigterm_stops_the_ranks_without_a_requeue(job):
    start, log = job
    proc = start()
    proc.send_signal(signal.SIGTERM)  # scancel
    status, out = _finish(proc)
    events = log.read_text().splitlines()
    assert status == 75 and "worker 0 got TERM" in events, out
    assert not any(e.startswith("scontrol") for e in events)


def test_sigterm_to_the_steps_only_stops_the_ranks_without_a_requeue(job):
    # `scancel --signal=TERM <job>` signals the job's steps, not the batch shell: the ranks stop with a checkpoint
    # for SIGTERM (recorded as "75 SIGTERM"), and the job must not requeue itself (it did: the batch shell, which got
    # no signal, took the 75 for the time limit's).
    start, log = job
    proc = start()
    srun = int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0])
    os.kill(srun, signal.SIGTERM)  # what slurmstepd does for the step
    status, out = _finish(proc)
    events = log.read_text().splitlines()
    assert status == 75 and "worker 0 got TERM" in events and "worker 1 got TERM" in events, out
    assert not any(e.startswith("scontrol") for e in events) and "requeueing" not in out, out


def test_sft_rides_out_usr1_and_stops_on_sigterm(job):
    start, log = job
    proc = start(MG_SUBCOMMAND="sft")
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    assert proc.poll() is None  # SFT cannot resume: it keeps going
    proc.send_signal(signal.SIGTERM)
    status, out = _finish(proc)
    events = log.read_text().splitlines()
    assert "ignoring SIGUSR1" in out and "worker 0 got USR1" not in events
    assert "worker 0 got TERM" in events and not any(e.startswith("scontrol") for e in events)
    assert status != 75, out  # SFT has no stop handler: it was killed, it did not stop with a checkpoint


def test_a_requeued_job_resumes(tmp_path):
    from tests.launch.test_scripts import DryRun

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(tmp_path),
           "CONFIG": "c.yaml", **FOUR_NODES, "SLURM_JOB_NODELIST": "a", "SLURM_NNODES": "1",
           "FAKE_HOSTNAMES": "a"}
    for sub, restarts, expected in (("train", "1", True), ("train", "0", False), ("sft", "2", False)):
        proc = subprocess.run(["bash", str(LAUNCH / "train.sbatch")], cwd=tmp_path, capture_output=True, text=True,
                              env={**env, "SLURM_RESTART_COUNT": restarts, "MG_SUBCOMMAND": sub}, timeout=60)
        assert proc.returncode == 0, proc.stderr
        (cmd,) = DryRun(proc).find("torch.distributed.run")
        assert ("--resume" in cmd) is expected, (sub, restarts, cmd)


def test_the_job_asks_for_the_early_signal_and_is_requeueable():
    header = [line for line in Path(LAUNCH / "train.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:USR1@600" in header and "#SBATCH --requeue" in header


def test_waiting_for_a_process_killed_by_a_signal_returns():
    # bash answers every later `wait $pid` of a signal-killed child with the same 128+N (never 127): mg_wait once
    # looped on that forever, and a LAUNCHER=srun rank that was OOM-killed or segfaulted hung its job.
    script = f"""source {LAUNCH}/common.sh
sleep 30 & pid=$!
kill -USR1 $pid
status=0; mg_wait $pid || status=$?
echo "status $status"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=20)
    assert proc.stdout.strip() == "status 138", proc.stdout + proc.stderr


def test_background_processes_ride_out_the_stop_signal():
    # Slurm signals every process of the step: colocated rollout servers and the router (started with mg_run_bg)
    # died of the SIGUSR1 meant for the trainer, failing the step instead of requeueing it.
    script = f"""source {LAUNCH}/common.sh
mg_run_bg /dev/null sleep 30
pid=${{MG_BG_PIDS[0]}}
sleep 0.5
kill -USR1 $pid
sleep 0.5
if kill -0 $pid 2>/dev/null; then echo alive; else echo dead; fi
kill $pid
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=20)
    assert proc.stdout.strip() == "alive", proc.stdout + proc.stderr


def test_waiting_through_a_trapped_signal_returns_the_exit_status():
    # The other side of mg_wait: a trap cutting the wait short (> 128 while the process runs on) is not its end.
    script = f"""source {LAUNCH}/common.sh
trap 'echo trapped' USR1
(sleep 1; exit 7) & pid=$!
(sleep 0.3; kill -USR1 $$) &
status=0; mg_wait $pid || status=$?
echo "status $status"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=20)
    assert proc.stdout.split() == ["trapped", "status", "7"], proc.stdout + proc.stderr


@pytest.mark.parametrize("cpus, gpus, expected", [("16", "8", "2"), ("2", "2", "1"), ("4", "8", "1"), (None, "1", None)])
def test_omp_threads_follow_the_cpus_slurm_granted(cpus, gpus, expected):
    # One share of the node's granted CPUs per rank (it was 8 whatever Slurm granted); a value set by the user wins.
    env = {"PATH": "/usr/bin:/bin", "GPUS_PER_NODE": gpus, **({"SLURM_CPUS_ON_NODE": cpus} if cpus else {})}
    if expected is None:  # outside Slurm: this machine's CPUs
        expected = str(max(1, (os.cpu_count() or 1) // int(gpus)))
    show = f"source {LAUNCH}/common.sh; mg_setup_env; echo $OMP_NUM_THREADS"
    got = subprocess.run(["bash", "-c", show], env=env, capture_output=True, text=True, timeout=20).stdout.strip()
    assert got == expected
    got = subprocess.run(["bash", "-c", show], env={**env, "OMP_NUM_THREADS": "3"}, capture_output=True, text=True,
                         timeout=20).stdout.strip()
    assert got == "3"


# slurmstepd signals every process of the step at once: the task (or the batch shell, under `--full`) and the rank
# it waits for. A `wait` cut short by a trap just as it reaps the rank loses the rank's status in bash 5.2 (the next
# `wait` answers -1: the task exited 255 and srun killed the step; about 1 run in 4 here). Each run below signals
# its whole process group, as slurmstepd does, the rank dying of it (step) or stopping cleanly with a record (direct).
RACE = f"""source {LAUNCH}/common.sh
export MG_STATUS_DIR=$(mktemp -d) WORLD_SIZE=1 LOG_DIR=/tmp
trap : TERM  # this shell outlives each signal (mg_run_trainer installs its own dispositions once its child runs)
for ((i = 0; i < 40; i++)); do
    rm -f "$MG_STATUS_DIR"/*
    MG_STATUS_LOST=0
    # The signal goes out once the child is ready (under load it may take a while to start).
    (until [[ -e "$MG_STATUS_DIR/ready" ]]; do sleep 0.01; done; kill -TERM -- -$$) &
    helper=$!
    status=0
    if [[ "$1" == step ]]; then
        mg_run_trainer step "USR1 TERM" bash -c 'touch "$MG_STATUS_DIR/ready"; exec sleep 5' >/dev/null || status=$?
    else
        mg_run_trainer direct "USR1 TERM" bash -c \\
            'trap "echo 0 > $MG_STATUS_DIR/rank-0; exit 0" TERM; touch "$MG_STATUS_DIR/ready"; sleep 5 & wait' \\
            >/dev/null || status=$?
        status="$(mg_step_status "$status")"
    fi
    wait "$helper" 2>/dev/null
    echo "$status"
done
rm -rf "$MG_STATUS_DIR"
"""


@pytest.mark.parametrize("mode, expected", [("step", "143"), ("direct", "0")])
def test_a_stop_signal_that_ends_the_rank_as_it_arrives_keeps_the_ranks_status(mode, expected):
    # step (task.sh): the rank died of SIGTERM: 143 every time (was 255 about one run in four: a task that exited
    # 255 got the step killed, the flake of test_only_a_stop_with_a_checkpoint_on_every_rank_requeues[0 0-0-srun]).
    # direct (train.sbatch, which must trap to pass signals on): when bash loses srun's status, the ranks' records
    # decide: 0 every time.
    proc = subprocess.run(["bash", "-c", RACE, "race", mode], capture_output=True, text=True, timeout=120,
                          start_new_session=True)
    statuses = proc.stdout.split()
    assert len(statuses) == 40 and set(statuses) == {expected}, proc.stdout + proc.stderr
