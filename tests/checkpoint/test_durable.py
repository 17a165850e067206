"""Model / HF checkpoint directories are fsynced before the rename that makes them visible (hf_io.replace_dir)."""

import os

from megatron_gspo.checkpoint.hf_io import replace_dir


def test_replace_dir_syncs_the_tree_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    src, dst = tmp_path / ".new", tmp_path / "out"
    (src / "model").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model" / "a.safetensors").write_bytes(b"x" * 10)
    dst.mkdir()
    (dst / "old.txt").write_text("old")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    replace_dir(src, dst)
    (rename,) = [i for i, e in enumerate(events) if e[:2] == ("replace", str(src))]
    before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    real = os.path.realpath
    assert {real(src), real(src / "model"), real(src / "config.json"), real(src / "model" / "a.safetensors")} <= before
    assert ("fsync", real(tmp_path)) in events[rename:]
    assert (dst / "config.json").is_file() and not (dst / "old.txt").exists()
