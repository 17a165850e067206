"""A trainer SIGKILLed (as by the OOM killer) while it checkpoints in the background (trainer.async_save) leaves no
process behind: megatron's results-queue manager, the multiprocessing resource tracker, the writer and its
per-file processes all end with it, and the run's stdout / stderr see EOF (a `| tee` ends)."""

import subprocess
import sys
import time

import psutil

from tests.training.test_end_to_end import MINI, ROOT, _env

TRAIN = [
    sys.executable,
    "-m",
    "megatron_gspo.cli.main",
    "train",
    "--config",
    "examples/tiny_moe_gspo.yaml",
    *MINI,
]


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:160]}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_sigkill_during_a_background_checkpoint_leaves_no_process_and_closes_the_output(tmp_path):
    run = tmp_path / "run"
    trainer = subprocess.Popen(
        [
            *TRAIN,
            f"trainer.run_dir={run}",
            "trainer.steps=200",
            "trainer.async_save=true",
            "trainer.ckpt_every=1",
            "trainer.keep_last=1",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    me = psutil.Process(trainer.pid)
    try:
        children: dict[int, psutil.Process] = {}
        deadline = time.monotonic() + 500
        # Until the second background checkpoint is being written: its writer process is a child then.
        while time.monotonic() < deadline and trainer.poll() is None:
            for c in me.children(recursive=True):
                children.setdefault(c.pid, c)
            writing = any((run / "checkpoints").glob("iter_*.tmp")) and any(
                (run / "checkpoints").glob("iter_*[0-9]")
            )
            if writing and len(me.children(recursive=True)) >= 3:  # manager, tracker, writer
                break
            time.sleep(0.02)
        assert trainer.poll() is None, trainer.stderr.read().decode()[-3000:]
        children.update({c.pid: c for c in me.children(recursive=True)})
        names = [" ".join(c.cmdline()) for c in children.values() if c.is_running()]
        assert any("resource_tracker" in n for n in names), (
            names
        )  # the processes this test is about were there
        assert any("spawn_main" in n for n in names), names  # megatron's results-queue manager
        trainer.kill()
        # Every process the trainer started is gone within 5 s, and its output pipes reach EOF.
        end = time.monotonic() + 5
        while _alive(list(children.values())) and time.monotonic() < end:
            time.sleep(0.1)
        assert _alive(list(children.values())) == [], names
        out, err = trainer.communicate(timeout=30)  # returns only once no process holds the pipes
        assert trainer.returncode == -9
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for c in list(children.values()):
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass
