"""Durable writes: fsync files and directories so that what a rename makes visible survives a crash.

A rename is atomic but not durable until its directory is fsynced, and a renamed directory's files are durable only
once they were fsynced themselves: trainer checkpoints (checkpoint/manager.py) and model / HF checkpoints
(`hf_io.replace_dir`) sync their tree before the rename and the parent directory after it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some file systems cannot fsync a directory; the data files were synced by their writers.
        if not (path.is_dir() and err.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> int:
    """fsync every file and directory under `root` (directories after their contents); returns the files' bytes."""
    size = 0
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(dirpath) / name)
            size += (Path(dirpath) / name).stat().st_size
        fsync_path(Path(dirpath))
    return size


def write_durably(path: Path, text: str) -> None:
    """Writes `text` to `path` through `path.tmp`: flushed, fsynced, renamed, directory fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
