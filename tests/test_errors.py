"""errors.describe: one line for any error, a full disk said as such even when the ENOSPC itself was lost."""

import errno
import pickle
import shutil

import pytest

from megatron_gspo import errors
from megatron_gspo.errors import RankFailed, describe


def test_an_enospc_anywhere_in_the_chain_is_a_full_disk():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as err:
        assert describe(err) == "No space left on device (OSError: [Errno 28] No space left on device)"


@pytest.mark.parametrize("nearly_full", [True, False])
def test_a_chainless_error_on_a_nearly_full_file_system_says_so(tmp_path, monkeypatch, nearly_full):
    """What megatron's writer processes return: the ENOSPC dropped by pickling. The file system of the written
    path (its nearest existing parent) decides."""
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(errors, "NEARLY_FULL_BYTES", free + (1 << 30) if nearly_full else 0)
    written = tmp_path / "iter_0000002.tmp" / "optimizer"  # not created yet
    line = describe(RuntimeError("unexpected pos 704 vs 598\nmore"), written)
    if nearly_full:
        assert line.startswith("No space left on device? (") and "MiB free on the file system of" in line
        assert str(written) in line and line.endswith("; RuntimeError: unexpected pos 704 vs 598)")
    else:
        assert line == "RuntimeError: unexpected pos 704 vs 598"
    assert describe(RuntimeError("x")) == "RuntimeError: x"  # no path: no guess


def test_another_ranks_failure_keeps_its_rank_and_line_through_pickling():
    err = pickle.loads(pickle.dumps(RankFailed("writing /ckpt/model", 0, "OSError: [Errno 5] Input/output error")))
    assert (err.rank, err.line) == (0, "OSError: [Errno 5] Input/output error")
    assert describe(err) == "RankFailed: writing /ckpt/model failed on rank 0: OSError: [Errno 5] Input/output error"
