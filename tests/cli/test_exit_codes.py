"""How a subcommand ends: one line on stderr and an exit code for every expected way (cli/main.py run_command)."""

import errno

import pytest
from torch.distributed.checkpoint import CheckpointException

from megatron_gspo.cli.main import run_command
from megatron_gspo.errors import RunFailure, StopRequested


def _raise(exc):
    def command(args):
        raise exc

    return command


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (StopRequested("stopped by SIGTERM after step 3 of 9: ...", "SIGTERM", 3), 75,
         "megatron-gspo: stopped by SIGTERM after step 3 of 9: ..."),
        (KeyboardInterrupt(), 130, "megatron-gspo: interrupted (Ctrl-C); the checkpoints written so far are complete"),
        (ValueError("trainer.steps=0 must be >= 1"), 2, "megatron-gspo: error: trainer.steps=0 must be >= 1"),
        (FileExistsError("--out x already exists"), 2, "megatron-gspo: error: --out x already exists"),
        (RunFailure("step 2: 32 of 32 reward calls failed"), 1, "megatron-gspo: error: step 2: 32 of 32 reward"),
        (OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl"), 1,
         "megatron-gspo: error: No space left on device (OSError: [Errno 28] No space left on device: 'runs/x/"),
        (RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms"), 1,
         "megatron-gspo: error: a collective failed (RuntimeError: [third_party/gloo"),
        (CheckpointException("write", {1: (OSError(errno.ENOSPC, "No space left on device"), None)}), 1,
         "megatron-gspo: error: CheckpointException on rank 1: No space left on device (OSError: [Errno 28] No "),
    ],
)
def test_each_ending_is_one_line_and_an_exit_code(capsys, exc, code, line):
    assert run_command(_raise(exc), None) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err


def test_bugs_still_raise():
    with pytest.raises(ZeroDivisionError):
        run_command(_raise(ZeroDivisionError("a bug")), None)
    with pytest.raises(SystemExit):
        run_command(_raise(SystemExit(2)), None)  # argparse's own exits pass through


def test_each_rank_records_its_exit_code_for_the_launch_scripts(tmp_path, monkeypatch):
    # launch/common.sh mg_step_status reads these: torchrun turns a worker's 75 into 1, srun reports the highest.
    from megatron_gspo.cli.main import main

    monkeypatch.setenv("MG_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    assert main(["plot", str(tmp_path / "no_such_run")]) == 2
    assert (tmp_path / "rank-3").read_text() == "2\n"
    monkeypatch.delenv("MG_STATUS_DIR")
    (tmp_path / "rank-3").unlink()
    assert main(["plot", str(tmp_path / "no_such_run")]) == 2 and not (tmp_path / "rank-3").exists()


def test_a_stop_with_a_checkpoint_records_its_signal(tmp_path, monkeypatch):
    # launch/common.sh requeues a job whose ranks stopped with 75 only when the signal was not SIGTERM: the batch
    # shell does not see a SIGTERM sent to the job's steps alone, so the record says which signal it was.
    from megatron_gspo.cli.main import _record_exit
    from megatron_gspo.errors import StopRequested

    monkeypatch.setenv("MG_STATUS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    for name in ("SIGTERM", "SIGUSR1"):
        assert _record_exit(run_command(_raise(StopRequested("stopped", name, 3)), None)) == 75
        assert (tmp_path / "rank-1").read_text() == f"75 {name}\n"
