"""launch/ under a real Slurm (tests/launch/slurm.py: slurmctld + slurmd + munged on loopback, one host): the real
train.sbatch submitted with sbatch, signalled with scancel, waited on through the scheduler, end states read from
`scontrol show job` and the job-completion log. The tiny config, 2 ranks, a handful of steps.

The jobs run side by side (the configuration declares 4 CPUs; each job asks for 2): every scenario runs in a thread
started by one module fixture, and each test asserts on what its scenario saw. Fakes remain only where one host
cannot express a case (multi-node rank arithmetic: the DRY_RUN tests in test_scripts.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.launch.slurm import QUEUE_ALLOWANCE, _environ, _seconds

ROOT = Path(__file__).resolve().parents[2]
MINI = (
    "trainer.prompts_per_step=8 trainer.micro_batch_size=8 trainer.progress=false rollout.group_size=4 "
    "rollout.max_new_tokens=5 data.train_size=256 data.heldout_size=16 eval.max_prompts=16 eval.n=2"
)
JOB_TIMEOUT = 420  # seconds a scenario may take in all (two starts of a job on a busy 2-core machine)


def _env(run_dir: Path, launcher: str, overrides: str, ranks: int = 2, **extra: str) -> dict:
    # The job runs this checkout's code (PYTHONPATH: not whatever the environment's editable install points at).
    return dict(
        extra,
        PYTHONPATH=str(ROOT),
        PYTHON=sys.executable,
        CONFIG=str(ROOT / "examples/tiny_moe_gspo.yaml"),
        LAUNCH_DIR=str(ROOT / "launch"),
        RUN_DIR=str(run_dir),
        GPUS_PER_NODE=str(ranks),
        LAUNCHER=launcher,
        TRAIN_OVERRIDES=f"{MINI} {overrides}",
    )


def _sbatch_args(launcher: str, ranks: int = 2) -> list[str]:
    # --exclusive=user: the script's --exclusive would run the jobs one after the other; one CPU per rank.
    per = (
        [f"--cpus-per-task={ranks}"]
        if launcher == "torchrun"
        else [f"--ntasks-per-node={ranks}", "--cpus-per-task=1"]
    )
    return ["--exclusive=user", *per]


def _rank_pid(cluster, job_id: str, rank: int) -> int | None:
    for pid, cmd in cluster.processes(job_id).items():
        if "megatron_gspo.cli.main" in cmd and "torch.distributed.run" not in cmd and "task.sh" not in cmd:
            if _environ(Path(f"/proc/{pid}")).get("RANK") == str(rank):
                return pid
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

    def __init__(
        self,
        cluster,
        base: Path,
        name: str,
        launcher: str,
        overrides: str,
        drive,
        ranks: int = 2,
        sbatch: tuple[str, ...] = (),
        **env: str,
    ):
        self.cluster, self.name, self.launcher, self.drive = cluster, name, launcher, drive
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.run_dir = self.dir / "run"
        self.job = cluster.sbatch(
            ROOT / "launch/train.sbatch",
            *_sbatch_args(launcher, ranks),
            *sbatch,
            env=_env(self.run_dir, launcher, overrides, ranks, **env),
            cwd=self.dir,
        )
        self.seen: dict = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def cancel(self):
        self.cluster.run("scancel", "--full", self.job, check=False)

    def job_ids(self) -> list[str]:
        return [self.job]

    def until(self, what: str, cond, timeout: float = JOB_TIMEOUT, poll: float = 0.2):
        """Polls cond() until it returns something truthy; returns it (fails after timeout; the time the job spends
        queued does not count: SlurmCluster.extend)."""
        deadline = time.time() + timeout
        hard = deadline + QUEUE_ALLOWANCE
        while True:
            got = cond()
            if got:
                return got
            if time.time() > deadline:
                deadline = self.cluster.extend(self.job, timeout, hard)
            if deadline is None:
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
            self.seen["left"] = self.cluster.processes(self.job)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test
            self.error = err
            self.cluster.run("scancel", "--full", self.job, check=False)

    def result(self) -> dict:
        self.thread.join(JOB_TIMEOUT + QUEUE_ALLOWANCE + 60)
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


def _signal_time(out: str, sig: str = "USR1") -> float | None:
    """When the batch shell got `sig` (its `# SIGUSR1 at <UTC time>: passing it ...` line)."""
    found = re.search(rf"# SIG{sig} at (\S+Z): passing it", out)
    if not found:
        return None
    return datetime.strptime(found.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _time_limit(s: Scenario):
    """The time limit, with train.sbatch's own `#SBATCH --signal=B:USR1@600`. Submitted with `--time=60`; once the
    first step is logged the limit is cut to the minutes the job has run plus 10 (`scontrol update TimeLimit`): the
    early signal is then due at once, slurmctld sends it at its next limit check (every 30 s), and the limit itself
    is at least 9 minutes away. As soon as the job is requeued the limit goes back to 60 minutes, before the new start
    (held `cred_expire` + 1 s) could be signalled again. The resumed start is stopped once it logged a step (the
    run has 1000 steps: the first start must still be training when the signal comes) with `scancel --signal=TERM`,
    which signals the job's steps but not the batch shell: a stop for SIGTERM, which must not requeue the job."""
    s.until("first step", lambda: _rows(s.run_dir))
    ran = _seconds(s.cluster.job(s.job)["RunTime"])
    s.cluster.scontrol("update", f"JobId={s.job}", f"TimeLimit={ran // 60 + 10}")
    s.seen["limit_cut"] = time.time()
    s.until("requeue", lambda: int(s.cluster.job(s.job).get("Restarts", "0")) >= 1, timeout=180, poll=0.1)
    t_requeue = time.time()
    s.cluster.scontrol("update", f"JobId={s.job}", "TimeLimit=60")
    s.seen["checkpoint"] = s.until("stop checkpoint", lambda: _latest(s.run_dir))
    s.seen["checkpoint_written"] = (s.run_dir / "checkpoints" / "latest").stat().st_mtime
    step = s.seen["checkpoint"][1]
    s.until("resumed step", lambda: any(r["step"] > step for r in _rows(s.run_dir)), poll=0.1)
    s.seen["requeue_to_resumed_step_s"] = time.time() - t_requeue
    s.cluster.run("scancel", "--signal=TERM", s.job)
    s.seen["end"] = s.cluster.wait(s.job, timeout=120)
    _gone(s)


def _kill_rank(s: Scenario):
    """SIGKILL rank 1 once a checkpoint is complete; the job must fail on its own, quickly."""
    s.seen["checkpoint"] = s.until("first checkpoint", lambda: _latest(s.run_dir))
    pid = s.until("rank 1", lambda: _rank_pid(s.cluster, s.job, 1))
    os.kill(pid, 9)
    killed = time.time()
    s.seen["end"] = s.cluster.wait(s.job, timeout=120)
    s.seen["kill_to_end_s"] = time.time() - killed


def _gone(s: Scenario, timeout: float = 90):
    """Waits until no process of the job is left (a cancelled job's state is final while its processes still end)."""
    try:
        s.until("end of the job's processes", lambda: not s.cluster.processes(s.job), timeout=timeout)
    except AssertionError:
        pass  # not a pass: each test then asserts `not seen["left"]`, listing the processes still alive


def _scancel_term(s: Scenario):
    """Plain `scancel <job>` (SIGTERM to every process of the job) after the first step: the trainer checkpoints and
    exits, the job ends CANCELLED and is not requeued."""
    s.until("first step", lambda: _rows(s.run_dir))
    s.cluster.run("scancel", s.job)
    s.seen["end"] = s.cluster.wait(s.job, timeout=120)
    _gone(s)
    s.seen["checkpoint"] = _latest(s.run_dir)


def _scontrol_requeue(s: Scenario):
    """`scontrol requeue <job>` of the running job after the first step (Slurm terminates it with SIGTERM and
    queues it again): the first start checkpoints, the second resumes from it (SLURM_RESTART_COUNT -> --resume)."""
    s.until("first step", lambda: _rows(s.run_dir))
    s.cluster.run("scontrol", "requeue", s.job)
    s.until("requeue", lambda: int(s.cluster.job(s.job).get("Restarts", "0")) >= 1, poll=0.1)
    s.seen["checkpoint"] = s.until("stop checkpoint", lambda: _latest(s.run_dir), timeout=120)
    s.cluster.wait(s.job, timeout=JOB_TIMEOUT)
    _gone(s)


def _to_the_end(s: Scenario):
    s.seen["end"] = s.cluster.wait(s.job, timeout=JOB_TIMEOUT)
    _gone(s)


HF_TINY = """
import sys, torch
from transformers import Qwen3MoeForCausalLM
from megatron_gspo.models.config import preset
torch.manual_seed(0)
Qwen3MoeForCausalLM(preset("tiny", vocab_size=16).to_hf_config()).save_pretrained(sys.argv[1], max_shard_size="1MB")
"""


class Pipeline(Scenario):
    """launch/pipeline.sh (PIPELINE_MODE=sbatch) from a random tiny HF Qwen3-MoE: convert -> sft -> sft_export -> rl
    -> export, five jobs chained with afterok, each followed to its end state."""

    def __init__(self, cluster, base: Path, name: str):
        self.cluster, self.name, self.launcher = cluster, name, "torchrun"
        self.dir = base / name
        self.dir.mkdir(parents=True)
        self.run_dir = self.dir / "work" / "rl"
        self.job, self.jobs = "pipeline", {}
        self.seen, self.error = {}, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def output(self) -> str:
        logs = sorted((self.dir / "work" / "logs").glob("*.out"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in logs)

    def cancel(self):
        for job in self.jobs.values():
            self.cluster.run("scancel", "--full", job, check=False)

    def job_ids(self) -> list[str]:
        return list(self.jobs.values())

    def _run(self):
        try:
            hf = self.dir / "tiny-hf"
            env = {**self.cluster.env, "PYTHONPATH": str(ROOT)}
            res = subprocess.run(
                [sys.executable, "-c", HF_TINY, str(hf)], env=env, capture_output=True, text=True, timeout=300
            )
            assert res.returncode == 0, res.stderr[-3000:]
            config = str(ROOT / "examples/tiny_moe_gspo.yaml")
            res = self.cluster.run(
                "bash",
                str(ROOT / "launch/pipeline.sh"),
                cwd=self.dir,
                env={
                    **env,
                    "PYTHON": sys.executable,
                    "LAUNCH_DIR": str(ROOT / "launch"),
                    "HF_MODEL": str(hf),
                    "WORK_DIR": str(self.dir / "work"),
                    "SFT_CONFIG": config,
                    "RL_CONFIG": config,
                    "EP": "1",
                    "CONVERT_GPUS": "1",
                    "SFT_ROLLOUT_MODE": "none",
                    "RL_ROLLOUT_MODE": "none",
                    "GPUS_PER_NODE": "1",
                    "LAUNCHER": "torchrun",
                    # --priority=TOP: the chain of five jobs is the module's longest; each starts at the first
                    # free CPU instead of queueing behind the other scenarios' jobs.
                    "SBATCH_ARGS": "--exclusive=user --cpus-per-task=1 --priority=TOP",
                    "TRAIN_OVERRIDES": f"{MINI} trainer.steps=2 sft.max_steps=2 sft.eval_every=2 "
                    "sft.eval_prompts=4 sft.batch_size=8",
                },
            )
            self.seen["submit"] = res.stdout + res.stderr
            for line in res.stdout.splitlines():
                if line.startswith("submitted "):
                    step, job = line[len("submitted ") :].split(": job ")
                    self.jobs[step] = job.strip()
            ends = {}
            for step, job in self.jobs.items():  # in order: each waits on the one before (afterok)
                ends[step] = self.cluster.wait(job, timeout=JOB_TIMEOUT)
            self.seen["ends"] = ends
            self.seen["completions"] = {
                step: self.cluster.completions(job) for step, job in self.jobs.items()
            }
            self.seen["out"] = self.output()
            left = {job: self.cluster.processes(job) for job in self.jobs.values()}
            self.seen["left"] = {job: procs for job, procs in left.items() if procs}
        except BaseException as err:  # noqa: BLE001 - re-raised in the test
            self.error = err
            self.cancel()


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
        started["time_limit_torchrun1"] = Scenario(
            slurm_cluster,
            base,
            "time-limit-torchrun1",
            "torchrun",
            "trainer.steps=1000 trainer.ckpt_every=0",
            _time_limit,
            ranks=1,
            sbatch=("--time=60",),
        )
        started["usr1_full_srun"] = Scenario(
            slurm_cluster,
            base,
            "usr1-full-srun",
            "srun",
            "trainer.steps=4 trainer.ckpt_every=0",
            _usr1_requeue("full"),
        )
        started["scontrol_requeue_srun"] = Scenario(
            slurm_cluster,
            base,
            "scontrol-requeue-srun",
            "srun",
            "trainer.steps=4 trainer.ckpt_every=0",
            _scontrol_requeue,
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
        # One-rank torchrun jobs (1 CPU each): RL stopped by a plain scancel, and SFT (MG_SUBCOMMAND=sft) to its end.
        started["scancel_term_torchrun1"] = Scenario(
            slurm_cluster,
            base,
            "scancel-term-torchrun1",
            "torchrun",
            "trainer.steps=50 trainer.ckpt_every=0",
            _scancel_term,
            ranks=1,
        )
        started["sft_torchrun1"] = Scenario(
            slurm_cluster,
            base,
            "sft-torchrun1",
            "torchrun",
            "sft.max_steps=2 sft.eval_every=2 sft.eval_prompts=4 sft.batch_size=8",
            _to_the_end,
            ranks=1,
            MG_SUBCOMMAND="sft",
        )
        started["pipeline"] = Pipeline(slurm_cluster, base, "pipeline")
        yield started
    finally:
        # Nothing of these jobs outlives the module: each is cancelled (a no-op once it ended) and waited for until
        # it is in a final state with no process left (SIGKILLed by PID after a minute).
        for s in started.values():
            s.cancel()
        left = slurm_cluster.wait_gone([j for s in started.values() for j in s.job_ids()], timeout=60)
        assert not left, f"processes of the test jobs still running a minute after scancel (killed): {left}"


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


def test_time_limit_signal_checkpoints_exits_75_requeues_and_resumes(scenarios):
    # `#SBATCH --signal=B:USR1@600` reaching its time limit for real (the other requeue tests send SIGUSR1 with
    # scancel): checkpoint, 75, requeue by the script, resume at the next step; both starts' logs kept.
    # The second start, stopped by a SIGTERM to its steps alone, ends with the ranks' 75 (FAILED, exit 75) and
    # without a second requeue: the batch shell got no signal, the ranks' records say SIGTERM.
    s = scenarios["time_limit_torchrun1"]
    seen = s.result()
    ctx = f"{seen['out']}\n{seen['logs']}"
    end = seen["end"]
    assert end["JobState"] == "FAILED" and end["ExitCode"] == "75:0" and end["Restarts"] == "1", (end, ctx)
    states = [c["JobState"] for c in seen["completions"]]
    assert len(states) == 2 and states[0] in ("REQUEUED", "PENDING") and states[1] == "FAILED", seen[
        "completions"
    ]
    assert seen["out"].count("# SIGUSR1 at ") == 1 and seen["out"].count(f"requeueing job {s.job}") == 1, ctx
    assert "# SIGTERM at " not in seen["out"], ctx  # the batch shell did not get the second stop
    assert seen["out"].index(f"job {s.job}, start 1") < seen["out"].index(f"job {s.job}, start 2"), ctx
    assert seen["logs"].count("training node 0") == 2, ctx
    signalled = _signal_time(seen["out"])
    _, step = seen["checkpoint"]
    print(
        f"time limit: SIGUSR1 {signalled - seen['limit_cut']:.0f} s after the limit was cut, stop checkpoint "
        f"{seen['checkpoint_written'] - signalled:.0f} s after it (1 s resolution), requeue -> first resumed step "
        f"{seen['requeue_to_resumed_step_s']:.1f} s (checkpoint at step {step})"
    )
    # Every step once, in order, across both starts (the second start's SIGTERM adds its own stop checkpoint).
    steps = [r["step"] for r in seen["rows"]]
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] > step >= 1, (steps, ctx)
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
    print(f"{name}: FAILED {seen['kill_to_end_s']:.1f} s after the SIGKILL: {lines[0]}")
    # The signal: the srun task saw its rank die of it; torchrun's failure report in the node log names it.
    assert "rank 1 (SIGKILL)" in lines[0], lines
    # The last complete checkpoint is untouched: `latest` still names a complete one.
    assert _latest(s.run_dir) is not None and _latest(s.run_dir)[1] >= seen["checkpoint"][1]
    assert not seen["left"], seen["left"]


def test_scontrol_requeue_restarts_and_resumes(scenarios):
    s = scenarios["scontrol_requeue_srun"]
    seen = s.result()
    ctx = f"{seen['out']}\n{seen['logs']}"
    assert seen["job"]["JobState"] == "COMPLETED" and seen["job"]["Restarts"] == "1", (seen["job"], ctx)
    states = [c["JobState"] for c in seen["completions"]]
    assert len(states) == 2 and states[0] in ("REQUEUED", "PENDING") and states[1] == "COMPLETED", seen[
        "completions"
    ]
    # Slurm requeued it (SIGTERM): the batch script must not requeue it a second time itself.
    assert f"requeueing job {s.job}" not in seen["out"], ctx
    assert seen["out"].index(f"job {s.job}, start 1") < seen["out"].index(f"job {s.job}, start 2"), ctx
    assert seen["logs"].count("training rank 0 ") == 2, ctx
    _, step = seen["checkpoint"]
    assert 1 <= step < 4, seen["checkpoint"]
    # Resumed from the SIGTERM checkpoint (no periodic ones: ckpt_every=0): every step once, in order.
    assert [r["step"] for r in seen["rows"]] == [1, 2, 3, 4], (seen["rows"], ctx)
    assert not seen["left"], seen["left"]


def test_plain_scancel_checkpoints_and_cancels_without_requeue(scenarios):
    s = scenarios["scancel_term_torchrun1"]
    seen = s.result()
    ctx = f"{seen['out']}\n{seen['logs']}"
    assert seen["job"]["JobState"] == "CANCELLED" and seen["job"]["Restarts"] == "0", (seen["job"], ctx)
    assert [c["JobState"] for c in seen["completions"]] == ["CANCELLED"], seen["completions"]
    assert f"requeueing job {s.job}" not in seen["out"], ctx
    # The stop checkpoint (ckpt_every=0: the only one) is complete and at a step the metrics reached.
    assert seen["checkpoint"] is not None, ctx
    steps = [r["step"] for r in seen["rows"]]
    assert steps == list(range(1, len(steps) + 1)) and 1 <= seen["checkpoint"][1] <= steps[-1] < 50, (
        steps,
        ctx,
    )
    assert not seen["left"], seen["left"]


def test_sft_under_torchrun_one_rank_completes(scenarios):
    s = scenarios["sft_torchrun1"]
    seen = s.result()
    ctx = f"{seen['out']}\n{seen['logs']}"
    assert seen["job"]["JobState"] == "COMPLETED" and seen["job"]["Restarts"] == "0", (seen["job"], ctx)
    assert [c["JobState"] for c in seen["completions"]] == ["COMPLETED"], seen["completions"]
    assert "megatron-gspo sft: 1 training node(s) x 1 GPUs" in seen["out"], ctx
    assert (s.run_dir / "sft_model" / "config.json").is_file(), ctx
    assert "OMP_NUM_THREADS=1" in seen["out"], ctx
    assert not seen["left"], seen["left"]


def test_pipeline_chain_of_jobs_completes(scenarios):
    s = scenarios["pipeline"]
    seen = s.result()
    ctx = f"{seen['submit']}\n{seen['out']}"
    assert list(s.jobs) == ["convert", "sft", "sft_export", "rl", "export"], ctx
    for step, end in seen["ends"].items():
        assert end["JobState"] == "COMPLETED" and end["Restarts"] == "0", (step, end, ctx)
        assert [c["JobState"] for c in seen["completions"][step]] == ["COMPLETED"], (
            step,
            seen["completions"],
        )
    work = s.dir / "work"
    for model in ("megatron-base", "sft-model", "sft-hf", "final-hf"):
        assert (work / model / "config.json").is_file(), (model, ctx)
    assert _latest(work / "rl") is not None and _latest(work / "rl")[1] == 2, ctx
    assert not seen["left"], seen["left"]
