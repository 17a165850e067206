"""A full disk, simulated: files opened for writing whose path contains a given fragment raise ENOSPC on write.

Patches `open` (builtins and io: pathlib and torch.distributed.checkpoint's writer open through io.open), so
every writer in the process is exercised exactly as a full file system would: torch.save, DCP, json files.

    python -m tests.checkpoint.full_disk FRAGMENT -- megatron-gspo arguments...
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import sys

_real_open = io.open


class _FullDiskFile:
    """A real file whose writes fail with ENOSPC (what a full file system answers)."""

    def __init__(self, fh):
        self._fh = fh

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._fh.name)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()
        return False


def fill_disk(fragment: str) -> None:
    """From now on, writes to files whose path contains `fragment` fail with ENOSPC."""

    def full_open(file, mode="r", *args, **kwargs):
        fh = _real_open(file, mode, *args, **kwargs)
        path = os.fspath(file) if isinstance(file, (str, os.PathLike)) else ""
        if any(m in mode for m in "wax+") and fragment in path:
            return _FullDiskFile(fh)
        return fh

    builtins.open = full_open
    io.open = full_open


def free_disk() -> None:
    builtins.open = _real_open
    io.open = _real_open


if __name__ == "__main__":
    split = sys.argv.index("--")
    fill_disk(sys.argv[1])
    from megatron_gspo.cli.main import main

    sys.exit(main(sys.argv[split + 1 :]))
