"""Trainer checkpoints on disk: how each one is made atomic and durable, how the newest complete one is found, and
which ones are pruned. What a checkpoint holds is written by a callback (trainer_contents.py), so the format
inside can change without touching this protocol.

Layout of `checkpoints/`:
  iter_0000012/                 a complete checkpoint; `trainer_state.json` in it is written last (step, run id,
                                world size, loop state), before the directory is renamed from `iter_0000012.tmp`
  latest                        the name of the newest complete checkpoint, replaced atomically after the rename
  iter_*.tmp, *.trash           being written / being deleted: never read, removed by the next save

A save: every rank writes its files into `iter_N.tmp` (fsynced by their writers); all ranks agree that every rank
succeeded; rank 0 writes trainer_state.json, fsyncs every file and directory of the tree, renames it to `iter_N`,
fsyncs `checkpoints/`, then writes `latest` the same way. A failure on any rank (a full disk, a killed process)
leaves no `iter_N` and removes `iter_N.tmp`. An asynchronous save (trainer.async_save) does the same in two
halves: `save` writes what is small and starts megatron's writer processes for the tensors (a snapshot of them;
checkpoint/async_writes.py), training goes on, and the `poll` after a later step (or `wait`) that finds every
rank's writes done does the agreement, rename and `latest`; a kill before that leaves the previous checkpoint as
the newest, and the unfinished `iter_N.tmp` for the next save to remove. Replacing or pruning a directory renames it to `*.trash` first, so a
kill mid-deletion never leaves a half-deleted `iter_N` behind; a replaced copy of the same step is deleted only
after the new one is renamed into place and `latest` names it.

Each run has a random run id, kept across resumes: pruning deletes only this run's checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from megatron_gspo.checkpoint.async_writes import AsyncWrites
from megatron_gspo.checkpoint.durable import fsync_path, fsync_tree, write_durably
from megatron_gspo.checkpoint.integrity import (
    CheckpointDamaged,
    record_common_files,
    record_rank_files,
    verify,
)
from megatron_gspo.errors import RankFailed, RunFailure, describe, rank_failures

log = logging.getLogger(__name__)

_ITER = "iter_{:07d}"
_ITER_RE = re.compile(r"iter_(\d+)")
STATE = "trainer_state.json"
LATEST = "latest"


_AS_RANK0 = RankFailed("the checkpoint writers", 0, "megatron reports the details on rank 0")


class CheckpointWriteError(RunFailure):
    """A checkpoint could not be written (on any rank); nothing of it is left behind."""


def new_run_id() -> str:
    """A fresh run id (names the checkpoints a run owns)."""
    return uuid.uuid4().hex[:12]


# ---------------------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------------------
class CheckpointManager:
    """Saves / finds / prunes trainer checkpoints under `root`, keeping this run's last `keep_last`."""

    def __init__(self, root: Path, keep_last: int = 2, run_id: str | None = None,
                 writer_timeout_s: float | None = None):
        """`writer_timeout_s`: how long an asynchronous save's writer may run before it is killed and the
        checkpoint fails on every rank (None: no limit; checkpoint/async_writes.py)."""
        self.root = Path(root)
        self.keep_last = keep_last
        self.run_id = run_id
        self._warned_foreign = False
        self._writes = AsyncWrites(writer_timeout_s)
        self._pending: tuple | None = None  # (step, final, tmp, trainer_state text, start time) while in flight
        self._last_bytes: int | None = None  # the size of the last checkpoint this manager completed (rank 0)

    # ---- reading -------------------------------------------------------------------------------------
    def read_state(self, path: Path) -> dict | None:
        """The trainer state of a complete checkpoint directory, or None when `path` is not one."""
        if not _ITER_RE.fullmatch(path.name) or not path.is_dir():
            return None
        try:
            state = json.loads((path / STATE).read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) and isinstance(state.get("step"), int) else None

    def checkpoints(self) -> list[tuple[Path, dict]]:
        """Every complete checkpoint under root, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(p, self.read_state(p)) for p in self.root.iterdir() if _ITER_RE.fullmatch(p.name)]
        return sorted(((p, s) for p, s in found if s is not None), key=lambda x: x[1]["step"])

    def intact(
        self, point: tuple[Path, dict] | None, accept: Callable[[Path, dict], tuple[Path, dict]]
    ) -> tuple[Path, dict] | None:
        """`point`, or, when one of its files fails the integrity record (integrity.py; all ranks check a share),
        the newest earlier checkpoint whose files pass, with a warning naming the damaged file, as for a missing
        `latest`. Each earlier candidate goes through `accept` (raises when this run may not continue it). With no
        intact checkpoint left the damage is the error (CheckpointDamaged, exit 2).

        The damaged checkpoints passed over are set aside as `iter_N.damaged` (kept for inspection, never read or
        pruned): left in place they would count as this run's newest checkpoints, so pruning after the next save
        would delete that save and keep them, and a later save of the same step would collide with them."""
        damaged: list[Path] = []
        while point is not None:
            try:
                verify(point[0])
                break
            except CheckpointDamaged as err:
                older = [c for c in self.checkpoints() if c[1]["step"] < point[1]["step"]]
                if not older:
                    raise
                log.warning("%s: resuming from the checkpoint before it, %s", err, older[-1][0].name)
                damaged.append(point[0])
                point = accept(*older[-1])
        if damaged:
            self._set_aside(damaged)
        return point

    def _set_aside(self, paths: list[Path]) -> None:
        """Renames damaged checkpoints to `iter_N.damaged` (rank 0; every rank waits for it)."""
        if not dist.is_initialized() or dist.get_rank() == 0:
            for path in paths:
                target = path.with_name(f"{path.name}.damaged")
                n = 1
                while target.exists():
                    target, n = path.with_name(f"{path.name}.damaged{n}"), n + 1
                os.replace(path, target)
                fsync_path(self.root)
                log.warning("%s set aside as %s (damaged)", path, target.name)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def find_latest(self) -> tuple[Path, dict] | None:
        """The newest complete checkpoint and its trainer state (None when there is none).

        `latest` names it; when `latest` is missing, damaged or names an incomplete directory, or a complete
        checkpoint of the same run is newer (a kill between the rename and the `latest` update), the directories
        themselves decide, with a warning. Every rank finds the same one (they read the same files)."""
        done = self.checkpoints()
        marker = self.root / LATEST
        named = None
        if marker.is_file():
            try:
                named = self.root / marker.read_text().strip()
            except (OSError, UnicodeDecodeError):
                named = None
        pointed = next(((p, s) for p, s in done if p == named), None)
        if pointed is not None:
            same_run = [(p, s) for p, s in done if s.get("run_id") == pointed[1].get("run_id")]
            if same_run[-1][1]["step"] > pointed[1]["step"]:
                log.warning("%s names %s, but %s of the same run is newer and complete: using it", marker,
                            pointed[0].name, same_run[-1][0].name)
                return same_run[-1]
            return pointed
        if not done:
            if marker.exists() or (self.root.is_dir() and any(self.root.glob("iter_*"))):
                log.warning("%s holds no complete checkpoint (only unfinished or damaged ones)", self.root)
            return None
        if not marker.exists():
            why = "is missing"
        else:
            why = f"names {named.name if named else 'nothing readable'}, which is not a complete checkpoint"
        log.warning("%s %s: using the newest complete checkpoint, %s", marker, why, done[-1][0].name)
        return done[-1]

    # ---- writing (collective) --------------------------------------------------------------------------
    def save(
        self, step: int, write_contents: Callable[[Path], list | None], trainer_state: dict, *, asynchronous: bool = False
    ) -> Path:
        """Writes checkpoint `iter_<step>` (all ranks call): `write_contents(tmp_dir)` runs on every rank, then the
        protocol above. Raises CheckpointWriteError on every rank when any rank failed, leaving nothing behind.

        `asynchronous`: `write_contents` returns the AsyncRequests of the parts it left to megatron's writers
        (checkpoint/async_writes.py); they are started and `save` returns the path the checkpoint will have. It
        becomes `iter_<step>` (the rename, `latest`, pruning) only when `poll` or `wait` finds every rank's writes
        done; until then `latest` names the previous one, which a kill leaves as the newest. A save first waits
        for the one in flight."""
        self.wait()
        rank = dist.get_rank()
        final = self.root / _ITER.format(step)
        tmp = self.root / (final.name + ".tmp")
        state = {**trainer_state, "step": step, "run_id": self.run_id, "world_size": dist.get_world_size()}
        state_text = json.dumps(state, indent=2, default=_json_default)  # fails early, on every rank

        def prepare() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._discard(tmp)
            tmp.mkdir()
            fsync_path(self.root)
            self._warn_if_it_may_not_fit(final)

        self._collective(prepare if rank == 0 else None, f"checkpoint {final}: cannot create {tmp}", tmp)
        error = None
        try:
            requests = write_contents(tmp)
            # Each rank hashes the files it wrote (checkpoint/integrity.py): the background writer does, after
            # writing them, for an asynchronous save.
            if asynchronous:
                self._writes.start(requests or [], after=partial(record_rank_files, tmp, rank, in_background=True))
            else:
                record_rank_files(tmp, rank)
        except (KeyboardInterrupt, SystemExit):
            self._writes.abort()
            if rank == 0:
                self._discard(tmp)
            raise
        except BaseException as err:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            error = err
        self._agree(error, f"checkpoint {final.name} not written", tmp, on_failure=self._writes.abort)
        if asynchronous:
            self._pending = (step, final, tmp, state_text, time.monotonic())
            return final
        self._complete(final, tmp, state_text)
        return final

    def poll(self) -> Path | None:
        """Completes the checkpoint in flight if every rank's writes are done (all ranks call, at the same point:
        one all-reduce); returns its path then, else None."""
        return self._finish_pending(blocking=False)

    def wait(self) -> Path | None:
        """Waits for the checkpoint in flight and completes it (all ranks call); its path, or None if none was."""
        return self._finish_pending(blocking=True)

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint whose writes are in flight (None: none is)."""
        return None if self._pending is None else self._pending[0]

    def close(self) -> None:
        """Abandons a checkpoint in flight (no collective: for a run going down; its `.tmp` is removed by the next
        save). A run that ends normally `wait`s instead."""
        if self._pending is not None:
            log.warning("checkpoint %s abandoned while it was written", self._pending[1].name)
        self._writes.close()
        self._pending = None

    def _finish_pending(self, blocking: bool) -> Path | None:
        if self._pending is None:
            return None
        step, final, tmp, state_text, started = self._pending
        error = None
        try:
            if not self._writes.finish(blocking):
                return None
        except (KeyboardInterrupt, SystemExit):
            self.close()
            raise
        except BaseException as err:  # noqa: BLE001 - megatron's CheckpointException (raised on every rank)
            error = err
            if dist.get_rank() != 0 and isinstance(err, CheckpointException) and not err.failures:
                # megatron's finalize raises on every rank when any writer failed, with the details on its
                # coordinator (rank 0) only: the others have nothing of their own to report.
                error = _AS_RANK0
        self._pending = None
        self._agree(error, f"checkpoint {final.name} not written", tmp, on_failure=self._writes.abort)
        self._complete(final, tmp, state_text)
        log.info("checkpoint %s complete (written in the background for %.1f s)", final.name, time.monotonic() - started)
        return final

    def _complete(self, final: Path, tmp: Path, state_text: str) -> None:
        """trainer_state.json, fsync of the tree, rename, `latest`, pruning (rank 0; every rank learns the outcome)."""

        def finish() -> None:
            record_common_files(tmp, dist.get_world_size())
            with open(tmp / STATE, "w") as fh:
                fh.write(state_text)
                fh.flush()
                os.fsync(fh.fileno())
            self._last_bytes = fsync_tree(tmp)
            replaced = None
            if final.exists():  # the same step from an earlier attempt of this run; never another run's
                owner = (self.read_state(final) or {}).get("run_id", self.run_id)
                if owner != self.run_id:
                    raise FileExistsError(f"{final} belongs to another run (run id {owner}): move it away")
                replaced = self._to_trash(final)
            # The new copy is in place and named before the old one is deleted: a kill while it is deleted
            # (which takes long for a large checkpoint) leaves a complete iter_N, and the trash for the next save.
            try:
                os.replace(tmp, final)
            except BaseException:
                if replaced is not None:  # put the old copy back: it is still complete
                    os.replace(replaced, final)
                raise
            fsync_path(self.root)
            write_durably(self.root / LATEST, final.name + "\n")
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._prune()

        self._collective(finish if dist.get_rank() == 0 else None, f"checkpoint {final.name} not completed", tmp)

    def _warn_if_it_may_not_fit(self, final: Path) -> None:
        """A warning when the file system has less room than the last checkpoint took (the older ones are pruned
        only after the new one is complete): the write would fail on every rank and the run end there."""
        if self._last_bytes is None:
            return
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:  # a warning only: the write itself says what is wrong
            return
        if free < self._last_bytes:
            log.warning("checkpoint %s may not fit: the last one took %.2f GiB, %.2f GiB are free on the file system "
                        "of %s", final.name, self._last_bytes / 2**30, free / 2**30, self.root)

    def _collective(self, action: Callable[[], None] | None, what: str, tmp: Path) -> None:
        """Runs `action` (rank 0 passes one) and makes every rank raise if it failed."""
        error = None
        if action is not None:
            try:
                action()
            except (KeyboardInterrupt, SystemExit):
                self._discard(tmp)
                raise
            except BaseException as err:  # noqa: BLE001
                error = err
        self._agree(error, what, tmp)

    def _agree(
        self, error: BaseException | None, what: str, tmp: Path, on_failure: Callable[[], None] | None = None
    ) -> None:
        """Every rank learns which ranks failed; all run `on_failure` and raise CheckpointWriteError naming them
        (rank 0 cleans up)."""
        mine = None if error is None else _origin(error, tmp)
        if dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        failed = _attributed(everyone)
        if not failed:
            return
        if on_failure is not None:
            on_failure()
        cleaned = ""
        if dist.get_rank() == 0 and tmp.exists():
            try:
                self._discard(tmp)
                cleaned = f" ({tmp.name} removed)"
            except OSError as err:
                cleaned = f" (could not remove {tmp}: {err})"
        where = "; ".join(f"rank {r}: {m}" for r, m in failed[:4])
        more = f"; and {len(failed) - 4} more ranks" if len(failed) > 4 else ""
        raise CheckpointWriteError(f"{what}{cleaned}: {where}{more}") from error

    def _discard(self, path: Path) -> None:
        """Removes a directory by renaming it to *.trash first (atomic), then deleting it."""
        trash = self._to_trash(path)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    @staticmethod
    def _to_trash(path: Path) -> Path | None:
        """Renames a directory to a fresh `*.trash` name (never read; deleted by the caller or the next save)."""
        if not path.exists():
            return None
        trash = path.with_name(f"{path.name}.{uuid.uuid4().hex[:6]}.trash")
        os.replace(path, trash)
        return trash

    # ---- pruning (rank 0, inside save) -----------------------------------------------------------------
    def _prune(self) -> None:
        mine, foreign = [], []
        for path, state in self.checkpoints():
            (mine if state.get("run_id") == self.run_id else foreign).append(path)
        for old in mine[: -self.keep_last]:
            self._discard(old)
        # A killed run's unfinished directories too (nothing of this run is in flight now; two runs writing into
        # one run directory at once are not supported: the trainer refuses a directory that holds a run).
        for stale in [*self.root.glob("*.trash"), *self.root.glob("iter_*.tmp")]:
            shutil.rmtree(stale, ignore_errors=True)
        if foreign and not self._warned_foreign:
            self._warned_foreign = True
            log.warning("%s holds %d checkpoint(s) of another run (%s): not pruned", self.root, len(foreign),
                        ", ".join(p.name for p in foreign[:3]))


def _origin(error: BaseException, written: Path) -> list[tuple[int | None, str]]:
    """What this rank reports of `error`: (None, line) for its own failure, (K, line) for each rank K's failure it
    only relays: torch.distributed.checkpoint raises every rank's failures on every rank, megatron's finalize holds
    its writers' failures on its coordinator (rank 0; the others get `_AS_RANK0`), dist_io.rank0 relays rank 0's
    (RankFailed). A rank whose own failure wraps a CheckpointException (a killed writer) reports both."""
    reports: list[tuple[int | None, str]] = []
    if not getattr(error, "failures", None):
        reports.append((error.rank, error.line) if isinstance(error, RankFailed) else (None, describe(error, written)))
    reports += [(rank, describe(exc, written)) for rank, exc in rank_failures(error)]
    return reports


def _attributed(everyone: list[list[tuple[int | None, str]] | None]) -> list[tuple[int, str]]:
    """(rank, line) for each rank that failed, from what each rank reported (`_origin`; None: nothing): a failure
    is named once, on the rank it happened on, in that rank's own words when it gave them."""
    reported = [(r, r if origin is None else origin, line)
                for r, got in enumerate(everyone) if got is not None for origin, line in got]
    lines: dict[int, str] = {}
    for own in (True, False):  # a rank's own words first; the first of them is its direct cause
        for r, origin, line in reported:
            if (origin == r) == own and line != _AS_RANK0.line:
                lines.setdefault(origin, line)
    if reported and not lines:  # megatron's finalize failed on every rank, and rank 0 could not say why
        lines[0] = _AS_RANK0.line
    return sorted(lines.items())


def _json_default(obj):
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__} in trainer state")
