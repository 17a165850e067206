"""launch/ under a real Slurm (tests/launch/slurm.py: slurmctld + slurmd + munged on loopback, one host): the real
train.sbatch submitted with sbatch, signalled with scancel, waited on through the scheduler, end states read from
`scontrol show job` and the job-completion log. The tiny config, 2 ranks, a handful of steps.

The jobs run side by side (the configuration declares 4 CPUs; each job asks for 2): every scenario runs in a thread
started by one module fixture, and each test asserts on what its scenario saw. Fakes remain only where one host
cannot express a case (multi-node rank arithmetic: the DRY_RUN tests in test_scripts.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MINI = (
    "trainer.prompts_per_step=8 trainer.micro_batch_size=8 trainer.progress=false rollout.group_size=4 "
    "rollout.max_new_tokens=5 data.train_size=256 data.heldout_size=16 eval.max_prompts=16 eval.n=2"
)
JOB_TIMEOUT = 420  # seconds a scenario may take in all (two starts of a job on a busy 2-core machine)


def _env(run_dir: Path, launcher: str, overrides: str) -> dict:
    # The job runs this checkout's code (PYTHONPATH: not whatever the environment's editable install points at).
    return dict(
        PYTHONPATH=str(ROOT),
        PYTHON=sys.executable,
        CONFIG=str(ROOT / "examples/tiny_moe_gspo.yaml"),
        LAUNCH_DIR=str(ROOT / "launch"),
        RUN_DIR=str(run_dir),
        GPUS_PER_NODE="2",
        LAUNCHER=launcher,
        TRAIN_OVERRIDES=f"{MINI} {overrides}",
    )


def _sbatch_args(launcher: str) -> list[str]:
    # --exclusive=user: the script's --exclusive would run the jobs one after the other; 2 CPUs per job.
    per = ["--cpus-per-task=2"] if launcher == "torchrun" else ["--ntasks-per-node=2", "--cpus-per-task=1"]
    return ["--exclusive=user", *per]


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _job_processes(job_id: str) -> dict[str, str]:
    """pid -> command line of every live process of the job (found by SLURM_JOB_ID in its environment)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or _environ(proc.name).get("SLURM_JOB_ID") != job_id:
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[proc.name] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
    return found


def _rank_pid(job_id: str, rank: int) -> int | None:
    for pid, cmd in _job_processes(job_id).items():
        if "megatron_gspo.cli.main" in cmd and "torch.distributed.run" not in cmd and "task.sh" not in cmd:
            if _environ(pid).get("RANK") == str(rank):
                return int(pid)
    return None


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return [r for r in rows if "step" in r]


def _latest(run_dir: Path) -> tuple[str, int] | None:
    """(name, step) of the checkpoint `checkpoints/latest` names, when it is complete."""
    ckpts = run_dir / "checkpoints"
    try:
        name = (ckpts / "latest").read_text().strip()
        return name, json.loads((ckpts / name / "trainer_state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


class Scenario:
    """One job driven in a thread: submitted at once, then signalled when its condition holds; `seen` collects
    what happened (job records, logs, metrics, timings) for the test to check."""

    def __init__(self, cluster, base: Path, name: str, launcher: str, overrides: str, drive):
        self.cluster, self.name, self.launcher, self.drive = cluster, name, launcher, drive
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.run_dir = self.dir / "run"
        self.job = cluster.sbatch(
            ROOT / "launch/train.sbatch",
            *_sbatch_args(launcher),
            env=_env(self.run_dir, launcher, overrides),
            cwd=self.dir,
        )
        self.seen: dict = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def until(self, what: str, cond, timeout: float = JOB_TIMEOUT, poll: float = 0.2):
        """Polls cond() until it returns something truthy; returns it (fails after timeout)."""
        deadline = time.time() + timeout
        while True:
            got = cond()
            if got:
                return got
            if time.time() > deadline:
                raise AssertionError(
                    f"{self.name} (job {self.job}): no {what} after {timeout}s: "
                    f"{self.cluster.job(self.job)}\n{self.output()}"
                )
            time.sleep(poll)

    def output(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.dir.glob("*.out"))
        )

    def logs(self) -> str:
        logs = sorted((self.run_dir / "logs").glob("train-*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in logs)

    def _run(self):
        try:
            self.drive(self)
            self.seen["job"] = self.cluster.job(self.job)
            self.seen["completions"] = self.cluster.completions(self.job)
            self.seen["out"] = self.output()
            self.seen["logs"] = self.logs()
            self.seen["rows"] = _rows(self.run_dir)
            self.seen["left"] = _job_processes(self.job)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test
            self.error = err
            self.cluster.run("scancel", "--full", self.job, check=False)

    def result(self) -> dict:
        self.thread.join(JOB_TIMEOUT + 60)
        if self.error is not None:
            raise self.error
        assert not self.thread.is_alive(), f"{self.name}: scenario still running"
        return self.seen


def _usr1_requeue(how: str):
    """Signal SIGUSR1 after the first step (`scancel --signal=USR1 --batch|--full`), then follow the job through
    its checkpoint, its requeue and its resumed start to its end, timing the checkpoint and the resume."""

    def drive(s: Scenario):
        s.until("first step", lambda: _rows(s.run_dir))
        t_signal = time.time()
        s.cluster.run("scancel", "--signal=USR1", f"--{how}", s.job)
        s.seen["checkpoint"] = s.until("stop checkpoint", lambda: _latest(s.run_dir), poll=0.05)
        s.seen["signal_to_checkpoint_s"] = time.time() - t_signal
        s.until("requeue", lambda: int(s.cluster.job(s.job).get("Restarts", "0")) >= 1, poll=0.1)
        t_requeue = time.time()
        step = s.seen["checkpoint"][1]
        s.until("resumed step", lambda: any(r["step"] > step for r in _rows(s.run_dir)), poll=0.1)
        s.seen["requeue_to_resumed_step_s"] = time.time() - t_requeue
        s.cluster.wait(s.job, timeout=JOB_TIMEOUT)

    return drive


def _kill_rank(s: Scenario):
    """SIGKILL rank 1 once a checkpoint is complete; the job must fail on its own, quickly."""
    s.seen["checkpoint"] = s.until("first checkpoint", lambda: _latest(s.run_dir))
    pid = s.until("rank 1", lambda: _rank_pid(s.job, 1))
    os.kill(pid, 9)
    s.seen["end"] = s.cluster.wait(s.job, timeout=120)


@pytest.fixture(scope="module")
def scenarios(slurm_cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("slurm-jobs")
    base.chmod(0o755)
    started = {}
    try:
        # Two ends for each launcher; the requeue scenarios first (they take longest).
        started["usr1_batch_torchrun"] = Scenario(
            slurm_cluster,
            base,
            "usr1-batch-torchrun",
            "torchrun",
            "trainer.steps=4 trainer.ckpt_every=0",
            _usr1_requeue("batch"),
        )
        started["usr1_full_srun"] = Scenario(
            slurm_cluster,
            base,
            "usr1-full-srun",
            "srun",
            "trainer.steps=4 trainer.ckpt_every=0",
            _usr1_requeue("full"),
        )
        started["kill_torchrun"] = Scenario(
            slurm_cluster,
            base,
            "kill-torchrun",
            "torchrun",
            "trainer.steps=50 trainer.ckpt_every=1",
            _kill_rank,
        )
        started["kill_srun"] = Scenario(
            slurm_cluster, base, "kill-srun", "srun", "trainer.steps=50 trainer.ckpt_every=1", _kill_rank
        )
        yield started
    finally:
        for s in started.values():
            slurm_cluster.run("scancel", "--full", s.job, check=False)


@pytest.mark.parametrize("name", ["usr1_batch_torchrun", "usr1_full_srun"])
def test_usr1_checkpoints_exits_75_requeues_and_resumes(scenarios, name):
    # The time-limit path (#SBATCH --signal=B:USR1@600), sent at once with scancel: --batch reaches the batch
    # shell only, --full every process of every step (torchrun included, which must not die of it).
    s = scenarios[name]
    seen = s.result()
    ctx = f"{seen['out']}\n{seen['logs']}"
    assert seen["job"]["JobState"] == "COMPLETED" and seen["job"]["Restarts"] == "1", (seen["job"], ctx)
    # The job-completion log: the first start's end (logged as the requeued job's state then) and the last.
    states = [c["JobState"] for c in seen["completions"]]
    assert len(states) == 2 and states[0] in ("REQUEUED", "PENDING") and states[1] == "COMPLETED", seen[
        "completions"
    ]
    # The first start stopped with a checkpoint (every rank recorded 75) and requeued itself.
    assert f"requeueing job {s.job}" in seen["out"], ctx
    # Both starts' output kept (--open-mode=append), in order.
    assert seen["out"].index(f"job {s.job}, start 1") < seen["out"].index(f"job {s.job}, start 2"), ctx
    assert seen["logs"].count("training node 0") + seen["logs"].count("training rank 0 ") == 2, ctx
    # Resumed at the checkpoint's step: every step once, in order (the stop step is not repeated or skipped).
    _, step = seen["checkpoint"]
    print(
        f"{name}: SIGUSR1 -> stop checkpoint {seen['signal_to_checkpoint_s']:.1f} s, requeue -> first resumed step "
        f"{seen['requeue_to_resumed_step_s']:.1f} s (checkpoint at step {step})"
    )
    # (The trainer notices a signal at a point of its step: it stops after that step or the next one.)
    assert [r["step"] for r in seen["rows"]] == [1, 2, 3, 4], (seen["rows"], ctx)
    assert 1 <= step < 4, seen["checkpoint"]
    assert "OMP_NUM_THREADS=1" in seen["out"]  # 2 CPUs granted, 2 ranks
    assert not seen["left"], seen["left"]


@pytest.mark.parametrize("name", ["kill_torchrun", "kill_srun"])
def test_a_killed_rank_fails_the_job(scenarios, name):
    s = scenarios[name]
    seen = s.result()
    ctx = f"{seen['out']}\n{seen['logs']}"
    assert seen["job"]["JobState"] == "FAILED" and seen["job"]["Restarts"] == "0", (seen["job"], ctx)
    assert [c["JobState"] for c in seen["completions"]] == ["FAILED"], seen["completions"]
    lines = [line for line in seen["out"].splitlines() if "training failed" in line]
    assert len(lines) == 1 and "rank 1" in lines[0], ctx
    print(f"{name}: {lines[0]}")
    if s.launcher == "srun":  # the task saw its rank die of the signal
        assert "rank 1 (SIGKILL)" in lines[0], lines
    else:  # torchrun names it in its own one line
        assert "exitcode: -9" in seen["logs"], ctx
    # The last complete checkpoint is untouched: `latest` still names a complete one.
    assert _latest(s.run_dir) is not None and _latest(s.run_dir)[1] >= seen["checkpoint"][1]
    assert not seen["left"], seen["left"]
