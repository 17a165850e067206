"""A background checkpoint whose writer deadlocks (issue 25, item 8).

megatron's writer waits for its per-file processes forever; one that neither ends nor dies (here: stopped with
SIGSTOP) gave no sign, and the trainer's final wait never returned. With a writer timeout the rank whose writer
is overdue kills it, and the checkpoint fails on every rank in one line naming that rank and the timeout; the
next checkpoint is written, and no stopped process is left. Both ways the trainer finishes a checkpoint: the
blocking wait (the final checkpoint) and the non-blocking polls at step boundaries. 2 gloo ranks."""

import pytest

from tests.checkpoint.writer_timeout_ranks import save_with_a_stopped_writer
from tests.distributed import run_distributed

TIMEOUT_S = 3.0


@pytest.mark.parametrize("poll", [False, True], ids=["wait", "poll"])
def test_a_deadlocked_writer_fails_every_rank_in_one_line(tmp_path, poll):
    ranks = run_distributed(
        save_with_a_stopped_writer, str(tmp_path / "ckpt"), TIMEOUT_S, 1, poll, world_size=2, timeout=120
    )
    for r in ranks:
        error = r["error"]
        assert error is not None and error.startswith("checkpoint iter_0000001 not written"), error
        assert "rank 1:" in error and "rank 0:" not in error and "\n" not in error, error
        assert f"did not finish within {TIMEOUT_S:g} s" in error, error
        assert r["next"].endswith("iter_0000002")
        assert r["stopped_left"] == []


def test_the_writer_timeout_must_be_positive():
    from megatron_gspo.checkpoint.async_writes import AsyncWrites

    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        AsyncWrites(0)
