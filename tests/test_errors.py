"""errors.describe: one line for any error, a full disk said as such even when the ENOSPC itself was lost."""

import errno
import pickle
import shutil

import pytest
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.api import _wrap_exception

from megatron_gspo import errors
from megatron_gspo.errors import RankFailed, describe

GiB = 1 << 30
LOST = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"  # what a full disk gives megatron


def test_an_enospc_or_quota_anywhere_in_the_chain_is_a_full_disk():
    for code, text in [(errno.ENOSPC, "No space left on device"), (errno.EDQUOT, "Disk quota exceeded")]:
        try:
            try:
                raise OSError(code, text)
            except OSError:
                raise RuntimeError(LOST)  # noqa: B904 - torch.save's own way
        except RuntimeError as err:
            assert describe(err) == f"{text} (OSError: [Errno {code}] {text})"


@pytest.mark.parametrize("total, free, error, hint", [
    (100 * GiB, 200 << 20, RuntimeError(LOST), True),  # nearly full, a write that lost its reason
    (100 * GiB, 200 << 20, RuntimeError(f"Worker failure: {LOST}"), True),
    (100 * GiB, 200 << 20, PermissionError(errno.EACCES, "Permission denied"), False),  # it says why
    (100 * GiB, 200 << 20, FileExistsError("iter_0000002 belongs to another run"), False),
    (100 * GiB, 50 * GiB, RuntimeError(LOST), False),  # room enough
    (500 << 20, 300 << 20, RuntimeError(LOST), False),  # a small file system (a tmpfs), not nearly full
    (500 << 20, 1 << 20, RuntimeError(LOST), True),
], ids=["lost", "lost-worker", "eacces", "other", "room", "small-fs", "small-fs-full"])
def test_a_write_error_without_its_reason_on_a_nearly_full_file_system_says_so(tmp_path, monkeypatch, total, free,
                                                                                error, hint):
    """The file system of the written path (its nearest existing parent: not created yet) decides, with the
    reading shutil.disk_usage gives set here; a real full one: tests/checkpoint/test_manager.py."""
    seen = []

    def usage(path):
        seen.append(path)
        return shutil._ntuple_diskusage(total, total - free, free)

    monkeypatch.setattr(errors.shutil, "disk_usage", usage)
    written = tmp_path / "iter_0000002.tmp" / "optimizer"
    line = describe(error, written)
    plain = describe(error)
    if hint:
        assert line == f"No space left on device? ({free / 2**20:.1f} MiB free on the file system of {written}; {plain})"
        assert seen == [tmp_path]
    else:
        assert line == plain


def test_a_checkpoint_exception_names_a_rank_and_prefers_a_full_disk():
    full = OSError(errno.ENOSPC, "No space left on device")
    exc = CheckpointException("write", {0: _wrap_exception(RuntimeError("Worker failure: x")), 1: _wrap_exception(full)})
    assert describe(exc) == "CheckpointException on rank 1: No space left on device (OSError: [Errno 28] No space left on device)"
    exc = CheckpointException("write", {2: _wrap_exception(PermissionError(13, "Permission denied"))})
    assert describe(exc) == "CheckpointException on rank 2: PermissionError: [Errno 13] Permission denied"


def test_another_ranks_failure_keeps_its_rank_and_line_through_pickling():
    err = pickle.loads(pickle.dumps(RankFailed("writing /ckpt/model", 0, "OSError: [Errno 5] Input/output error")))
    assert (err.rank, err.line) == (0, "OSError: [Errno 5] Input/output error")
    assert describe(err) == "RankFailed: writing /ckpt/model failed on rank 0: OSError: [Errno 5] Input/output error"
