"""Stop signals and Ctrl-C in real `megatron-gspo train` processes: SIGTERM / SIGUSR1 finish the step, write a
checkpoint and exit 75 with one line; under torchrun a signal reaching one rank stops every rank after the same
step, and --resume then continues exactly; Ctrl-C is one line, exit 130."""

import os
import signal
import time
from pathlib import Path

import pytest

from tests.training.test_end_to_end import VOLATILE, _rows, _train

STEPS = ["trainer.steps=8", "trainer.save_final=false"]


def _wait_for_step(proc, run: Path, step: int, timeout: float = 400) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} before exit / timeout: {proc.stdout.read()[-3000:] if proc.stdout else ''}")


def _rank_pids(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (from /proc: their parent and RANK)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            ranks[int(env["RANK"])] = int(entry.name)
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_finishes_the_step_writes_a_checkpoint_and_exits_75(tmp_path, sig):
    run = tmp_path / "run"
    proc = _train(run, STEPS, popen=True)
    _wait_for_step(proc, run, 1)
    os.kill(proc.pid, sig)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 75, out[-3000:]
    assert "Traceback" not in out
    last = out.strip().splitlines()[-1]
    step = int(last.split("after step ")[1].split()[0])
    assert last == (f"megatron-gspo: stopped by {sig.name} after step {step} of 8: checkpoint "
                    f"{run / 'checkpoints' / f'iter_{step:07d}'} written; continue with --resume")
    assert 1 <= step < 8
    assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{step:07d}"
    assert sorted(_rows(run)) == list(range(1, step + 1))


@pytest.mark.slow
def test_ctrl_c_is_one_line(tmp_path):
    run = tmp_path / "run"
    proc = _train(run, STEPS, popen=True)
    _wait_for_step(proc, run, 1)
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert out.strip().splitlines()[-1].startswith("megatron-gspo: interrupted (Ctrl-C)")


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_stops_all_after_the_same_step_and_resume_is_exact(tmp_path):
    # Four steps, not eight: the signal lands during step 1 or 2, and three two-rank runs of eight steps made this
    # the suite's slowest test.
    two = ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.steps=4", "trainer.save_final=false"]
    _train(tmp_path / "full", two, nproc=2)
    full = _rows(tmp_path / "full")

    run = tmp_path / "stopped"
    proc = _train(run, two, nproc=2, popen=True)
    _wait_for_step(proc, run, 1)
    ranks = _rank_pids(proc.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGTERM)  # the signal reaches one rank only
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "megatron-gspo: stopped by SIGTERM after step" in line]
    assert len(lines) == 2, out[-4000:]  # both ranks, the same step
    step = int(lines[0].split("after step ")[1].split()[0])
    assert all(f"after step {step} of 4" in line for line in lines) and 1 <= step < 4
    assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{step:07d}"

    _train(run, two, nproc=2, resume=True)
    again = _rows(run)
    assert sorted(again) == list(range(1, 5))
    for s in range(step + 1, 5):
        for key, value in full[s].items():
            if not key.startswith(VOLATILE):
                assert again[s][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (s, key)
