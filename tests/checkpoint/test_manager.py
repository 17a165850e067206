"""The checkpoint protocol (checkpoint/manager.py): durable before it is visible, nothing left by a failed write,
the newest complete checkpoint found without `latest`, only the run's own checkpoints pruned."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.checkpoint_ranks import disk_full_on_one_rank, save_events
from tests.distributed import run_distributed
from tests.training.test_end_to_end import MINI, ROOT, _env


def test_files_and_directories_are_fsynced_before_the_rename_and_before_latest(tmp_path):
    out = run_distributed(save_events, str(tmp_path / "run"), world_size=1)[0]
    final = Path(out["path"])
    root = final.parent
    tmp = str(final) + ".tmp"
    events = out["events"]
    (rename,) = [i for i, e in enumerate(events) if e == ("replace", tmp, str(final))]
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    for entry in out["entries"]:  # every file and directory of the checkpoint, under its temporary name
        assert f"{tmp}/{entry}" in synced_before, entry
    assert tmp in synced_before
    (pointer,) = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "latest")]
    assert rename < pointer
    assert ("fsync", str(root)) in events[rename:pointer]  # the rename is durable before latest names it
    assert ("fsync", str(root / "latest.tmp")) in events[rename:pointer]
    assert events[pointer + 1 :].count(("fsync", str(root))) >= 1
    assert (root / "latest").read_text().strip() == final.name


TP2 = ("parallel.tp=2", "parallel.sequence_parallel=true")  # so that rank 1 owns model shards (DCP files)


@pytest.mark.parametrize(
    "fragment, rank_full, extra",
    [("rng", 1, ()), (".distcp", 1, TP2), ("optimizer", 0, ()), ("trainer_state", 0, ()), ("model/metadata.json", 0, TP2)],
    ids=["torch.save", "dist_checkpointing", "optimizer-dist_checkpointing", "rank0-json", "rank0-megatron-metadata"],
)
def test_a_full_disk_on_one_rank_fails_every_rank_and_leaves_nothing(tmp_path, fragment, rank_full, extra):
    outs = run_distributed(disk_full_on_one_rank, str(tmp_path / "run"), fragment, rank_full, extra, world_size=2)
    for out in outs:
        assert out["error"] is not None and "No space left on device" in out["error"], out["error"]
        assert out["error"].startswith("checkpoint iter_0000002 not")
        # named once, on the rank it happened on (not also as each other rank's report of it)
        assert f"rank {rank_full}: " in out["error"] and f"rank {1 - rank_full}:" not in out["error"], out["error"]
        assert "\n" not in out["error"]
        assert out["entries"] == ["iter_0000001", "latest"]  # no .tmp, no .trash
        assert out["latest"] == "iter_0000001" and out["state"] == 1


def _reports(*per_rank):
    from megatron_gspo.checkpoint.manager import _attributed, _origin

    return _attributed([None if e is None else _origin(e, Path("/ckpt/iter_0000002.tmp")) for e in per_rank])


def test_each_failure_is_named_once_on_the_rank_it_happened_on():
    """What each rank's exception says, as torch and megatron-core 0.16.1 raise them (real CheckpointException
    objects): a failure relayed by other ranks is theirs to report, every failing rank is named."""
    import errno

    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.api import _wrap_exception

    from megatron_gspo.checkpoint.manager import _AS_RANK0
    from megatron_gspo.errors import RankFailed

    full = _wrap_exception(OSError(errno.ENOSPC, "No space left on device"))
    worker = _wrap_exception(RuntimeError("Worker failure: x"))
    enospc = "No space left on device (OSError: [Errno 28] No space left on device)"
    # torch.distributed.checkpoint (a synchronous save): every rank raises every rank's failures
    both = CheckpointException("write", {0: worker, 1: full})
    assert _reports(both, both) == [(0, "RuntimeError: Worker failure: x"), (1, enospc)]
    # megatron's finalize: rank 0 holds its writers' failures, the others only know that they failed
    async_ = CheckpointException("write", {1: worker, 2: _wrap_exception(PermissionError(13, "Permission denied"))})
    assert _reports(async_, _AS_RANK0, _AS_RANK0) == [(1, "RuntimeError: Worker failure: x"),
                                                      (2, "PermissionError: [Errno 13] Permission denied")]
    assert _reports(_AS_RANK0, _AS_RANK0) == [(0, "megatron reports the details on rank 0")]
    # a rank's own failure wrapping another's; dist_io.rank0's relay; a rank that failed alone
    try:
        raise RuntimeError("the checkpoint writer process (pid 5) was killed by SIGKILL") from CheckpointException(
            "write", {1: full})
    except RuntimeError as err:
        killed = err
    assert _reports(killed, _AS_RANK0) == [(0, "RuntimeError: the checkpoint writer process (pid 5) was killed by "
                                               "SIGKILL"), (1, enospc)]
    relay = RankFailed("writing /ckpt/model", 0, "OSError: [Errno 5] Input/output error")
    assert _reports(OSError(5, "Input/output error"), relay) == [(0, "OSError: [Errno 5] Input/output error")]
    assert _reports(None, ValueError("bad")) == [(1, "ValueError: bad")]
    assert _reports(None, None) == []


def _state(path: Path, step: int, run_id: str) -> None:
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step, "run_id": run_id, "world_size": 1}))


def test_the_newest_complete_checkpoint_is_found_without_latest(tmp_path, caplog):
    from megatron_gspo.checkpoint.manager import CheckpointManager

    root = tmp_path / "checkpoints"
    _state(root / "iter_0000002", 2, "a")
    _state(root / "iter_0000004", 4, "a")
    (root / "iter_0000006").mkdir()  # never completed (no trainer_state.json)
    (root / "iter_0000008.tmp").mkdir()
    _state(root / "iter_0000005.tmp", 5, "a")
    manager = CheckpointManager(root)
    assert manager.find_latest()[0].name == "iter_0000004"  # latest missing
    assert "is missing: using the newest complete checkpoint, iter_0000004" in caplog.text
    (root / "latest").write_text("iter_0000006\n")
    assert manager.find_latest()[0].name == "iter_0000004"  # latest names an incomplete one
    (root / "latest").write_bytes(b"\xff\xfe")
    assert manager.find_latest()[0].name == "iter_0000004"  # latest is garbage
    (root / "latest").write_text("iter_0000002\n")
    assert manager.find_latest()[0].name == "iter_0000004"  # killed between the rename and the latest update
    _state(root / "iter_0000009", 9, "b")  # another run's: newer, but latest names this run's
    assert manager.find_latest()[0].name == "iter_0000004"
    assert CheckpointManager(tmp_path / "nothing").find_latest() is None


def test_resume_without_latest_continues_and_prunes_only_its_own_checkpoints(tmp_path):
    """18.3: the pointer gone, --resume continued from step 0 and keep-last pruning deleted both checkpoints."""
    run = tmp_path / "run"
    steps = ["trainer.steps=2", "trainer.ckpt_every=1", "trainer.keep_last=1", "trainer.save_final=false"]
    _cli(["train", "--config", "examples/tiny_moe_gspo.yaml", *MINI, f"trainer.run_dir={run}", *steps])
    ckpts = run / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["iter_0000001", "latest"]
    (ckpts / "latest").unlink()
    foreign = ckpts / "iter_0000000"
    _state(foreign, 0, "someone-else")
    res = _cli(["train", "--config", "examples/tiny_moe_gspo.yaml", *MINI, f"trainer.run_dir={run}", *steps,
                "trainer.steps=3", "--resume"])
    assert "using the newest complete checkpoint, iter_0000001" in res.stderr
    assert "resumed from" in res.stderr and "at step 1" in res.stderr
    rows = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]
    assert sorted(os.listdir(ckpts)) == ["iter_0000000", "iter_0000002", "latest"]  # the foreign one stays
    assert foreign.is_dir() and "not pruned" in res.stderr


def _cli(args, ok=True, wrapper=()):
    cmd = [sys.executable, "-m", *(wrapper or ["megatron_gspo.cli.main"]), *args]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    if ok:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def test_a_full_disk_is_one_line_and_leaves_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    res = _cli(["iter_0000002.tmp/optimizer", "--", "train", "--config", "examples/tiny_moe_gspo.yaml", *MINI,
                f"trainer.run_dir={run}", "trainer.ckpt_every=1"], ok=False, wrapper=["tests.checkpoint.full_disk"])
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-gspo: error: checkpoint iter_0000002 not written (iter_0000002.tmp removed)")
    assert "No space left on device" in last and "Traceback" not in res.stderr
    assert sorted(os.listdir(run / "checkpoints")) == ["iter_0000001", "latest"]


def _in_a_small_file_system(size: str, script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs a bash `script` with $FS a fresh tmpfs of `size` (a private mount namespace: nothing outside sees it,
    and it is gone when the script ends)."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:  # CI's machines have one (root, util-linux): there it fails instead
        why = f"no private mount namespace here (unshare -rm: {probe.stderr.strip()})"
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    fs = tmp_path / "fs"
    fs.mkdir()
    full = f"set -eu\nmount -t tmpfs -o size={size} tmpfs {fs}\nFS={fs}\n{script}"
    return subprocess.run(["unshare", "-rm", "bash", "-c", full], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=600)


CLUSTER = "model.dtype=bf16 model.overrides.router_aux_loss_coef=0.001 trainer.async_save=true"  # + DP=2, dist. opt.


@pytest.mark.parametrize("size, steps, written, nproc, extra", [
    ("20m", 1, "iter_0000001", 1, ""),  # the first checkpoint does not fit: megatron's writer process fails
    ("45m", 2, "iter_0000002", 2, CLUSTER),  # the second one, written in the background by 2 ranks
], ids=["sync-first", "async-second-dp2-bf16"])
def test_a_really_full_file_system_is_one_line_and_the_run_resumes(tmp_path, size, steps, written, nproc, extra):
    """A real full file system (a tmpfs of `size`; a checkpoint of the tiny model is 25-29 MB), not a patched open:
    megatron's per-file writer processes return their exception through a queue, which drops the ENOSPC under
    torch's "unexpected pos" error; the line still says the disk is full. Then the run resumes from the last
    checkpoint on the same file system."""
    launch = [sys.executable, "-m", "megatron_gspo.cli.main"]
    if nproc > 1:
        # --standalone: torchrun binds a port of the kernel's choosing itself (a port picked here and bound later
        # by torchrun can be taken in between by another job on the host: EADDRINUSE).
        launch[2:2] = ["torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m"]
    args = " ".join(["--config examples/tiny_moe_gspo.yaml", *MINI[1:], "trainer.run_dir=$FS/run", extra])
    train = f"{' '.join(launch)} train {args}"
    out = tmp_path / "out"
    script = f"""mkdir {out}
{train} trainer.steps={steps} trainer.ckpt_every=1 2> {out}/first.err && exit 3 || echo $? > {out}/first.rc
ls $FS/run/checkpoints > {out}/entries
if [ {steps} = 2 ]; then {train} trainer.steps=2 trainer.ckpt_every=5 trainer.save_final=false --resume; fi
"""
    res = _in_a_small_file_system(size, script, tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    err = (out / "first.err").read_text()
    assert (out / "first.rc").read_text().strip() == "1", err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("megatron-gspo: error:")]
    assert len(ours) == nproc, err[-3000:]  # one line per rank (torchrun reports the exit codes after them)
    for line in ours:
        assert line.startswith(f"megatron-gspo: error: checkpoint {written} not written"), line
        # One rank named, the one whose write met the full disk: every data-parallel rank writes its own optimizer
        # shard (checkpoint/optimizer_shards.py), so which rank runs out first is the file system's order.
        assert (": rank 0: " in line) != (": rank 1: " in line) and "No space left on device" in line, line
    assert f"({written}.tmp removed): rank " in ours[0] or f"({written}.tmp removed): rank " in ours[-1]
    assert "megatron_gspo/" not in err and "megatron/core/" not in err, err[-3000:]  # no traceback of ours
    entries = (out / "entries").read_text().split()
    if steps == 1:
        assert entries == []
        assert "may not fit" not in err  # nothing to go by before the first checkpoint
    else:
        assert entries == ["iter_0000001", "latest"]
        assert "resumed from" in res.stderr and "iter_0000001 at step 1" in res.stderr, res.stderr[-3000:]
        # warned before it was written: ~25 MB, ~21 MB free
        warning = next(line for line in err.splitlines() if "may not fit" in line)
        assert re.search(r"checkpoint iter_0000002 may not fit: the last one took 0\.0\d GiB, 0\.0\d GiB", warning)


def _fake_save(root: str) -> dict:
    """Saves through CheckpointManager with a trivial writer: replaces this run's own step, never another run's,
    and removes a killed run's unfinished directory."""
    from megatron_gspo.checkpoint.manager import CheckpointManager, CheckpointWriteError
    from megatron_gspo.parallel import initialize
    from megatron_gspo.parallel.config import ParallelConfig

    initialize(ParallelConfig())
    manager = CheckpointManager(Path(root), keep_last=5, run_id="mine")
    (Path(root) / "iter_0000002.tmp" / "model").mkdir(parents=True)  # a killed run's unfinished write

    def write(tmp):
        (tmp / "data.txt").write_text("new")

    manager.save(3, write, {"step": 3})
    manager.save(3, write, {"step": 3})  # again: replaced
    _state(Path(root) / "iter_0000004", 4, "theirs")
    try:
        manager.save(4, write, {"step": 4})
        error = None
    except CheckpointWriteError as err:
        error = str(err)
    return dict(error=error, entries=sorted(os.listdir(root)))


def test_a_save_replaces_its_own_step_but_never_another_runs_and_removes_unfinished_ones(tmp_path):
    out = run_distributed(_fake_save, str(tmp_path / "c"), world_size=1)[0]
    assert "belongs to another run (run id theirs): move it away" in out["error"]
    assert out["entries"] == ["iter_0000003", "iter_0000004", "latest"]
    assert json.loads((tmp_path / "c" / "iter_0000004" / "trainer_state.json").read_text())["run_id"] == "theirs"


def test_a_kill_while_the_replaced_copy_of_a_step_is_deleted_leaves_that_step_complete(tmp_path):
    # The old iter_5 goes to trash, the new one is renamed into place and named by `latest`, and only then is the
    # trash deleted: a kill during the deletion (SIGKILL after KillWait) leaves the new iter_5, and the next save
    # removes the stale trash.
    from megatron_gspo.checkpoint.manager import CheckpointManager

    def phase(name):
        return subprocess.run([sys.executable, "-m", "tests.checkpoint.checkpoint_ranks", str(tmp_path), name],
                              cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)

    res = phase("kill")
    assert res.returncode == 137, res.stderr[-3000:]
    root = tmp_path / "checkpoints"
    assert any(p.name.endswith(".trash") for p in root.iterdir())  # killed mid-deletion, as intended
    path, state = CheckpointManager(root, keep_last=1, run_id="run").find_latest()
    assert path.name == "iter_0000005" and state["step"] == 5 and (root / "latest").read_text() == "iter_0000005\n"
    assert (path / "data.txt").read_text() == "five again"
    res = phase("next")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(os.listdir(root)) == ["iter_0000006", "latest"]
