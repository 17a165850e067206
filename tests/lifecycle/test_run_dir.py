"""What `train` does with a run directory: a new run refuses one that holds a run, a resumed run refuses config
changes it cannot honour and cuts its logs back to the checkpoint, damaged checkpoints and logs are one line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_integrity import overwrite_tensor_bytes
from tests.training.test_end_to_end import MINI, ROOT, _env

TRAIN = ["train", "--config", "examples/tiny_moe_gspo.yaml", *MINI]


def _cli(*args, ok=True):
    res = subprocess.run([sys.executable, "-m", "megatron_gspo.cli.main", *map(str, args)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=600)
    if ok:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return res


def _one_line_error(res, code=2) -> str:
    assert res.returncode == code, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron-gspo") and ": error: " in last, last
    return last


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """Three steps, a checkpoint after each (all kept)."""
    run = tmp_path_factory.mktemp("base") / "run"
    _cli(*TRAIN, f"trainer.run_dir={run}", "trainer.ckpt_every=1", "trainer.keep_last=3")
    return run


@pytest.fixture()
def run(base_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy)
    return copy


def _snapshot(run: Path) -> dict:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_new_run_refuses_a_directory_that_holds_a_run(run, tmp_path):
    before = _snapshot(run)
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "trainer.steps=2", ok=False))
    assert "already holds a run (metrics.jsonl, eval.jsonl, summary.json, checkpoints)" in line
    assert "pass --resume" in line
    assert _snapshot(run) == before
    (tmp_path / "afile").write_text("x")
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={tmp_path / 'afile'}", ok=False))
    assert "is a file, not a directory" in line
    logs_only = tmp_path / "fresh"
    (logs_only / "logs").mkdir(parents=True)  # what the Slurm scripts create before training starts
    _cli(*TRAIN, f"trainer.run_dir={logs_only}", "trainer.steps=1", "trainer.save_final=false")


def test_resume_refuses_config_changes_with_a_one_line_diff(run):
    config = (run / "config.yaml").read_bytes()
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "optim.lr=0.01", "loss.algorithm=grpo",
                                "--resume", ok=False))
    assert "keys a resumed run cannot change" in line
    assert "loss.algorithm: 'gspo' -> 'grpo'" in line and "optim.lr: 0.001 -> 0.01" in line
    assert "model.load=" in line and "iter_0000003" in line
    assert (run / "config.yaml").read_bytes() == config  # never rewritten to a config that did not run
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "trainer.steps=2", "--resume", ok=False))
    assert "trainer.steps=2 is below the step of" in line


def test_resume_cuts_the_logs_to_the_checkpoint_and_continues_exactly(run, base_run):
    """Killed during step 3 after its row (and half of another) was written: the resumed run redoes step 3 once."""
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "iter_0000003")
    (ckpts / "latest").write_text("iter_0000002\n")
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "reward_me')  # a partial last line
    res = _cli(*TRAIN, f"trainer.run_dir={run}", "trainer.steps=4", "eval.every=2", "--resume")
    assert "dropping an unreadable row (a partial last line)" in res.stderr
    rows = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    base = {r["step"]: r for r in _rows(base_run / "metrics.jsonl")}
    for key, value in base[3].items():  # step 3 again, from checkpoint 2: the same numbers
        if not key.startswith(("time_", "tokens_per_s")):
            assert rows[2][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    evals = [r["step"] for r in _rows(run / "eval.jsonl")]
    assert evals == [0, 4]  # before RL; base's step-3 "after" eval cut; eval.every=2 has no step < 4 left but 4
    assert "resume: eval.every: 0 -> 2" in res.stderr and "resume: trainer.steps: 3 -> 4" in res.stderr
    for state in (ckpts / "iter_0000002", ckpts / "iter_0000004"):  # the health streaks travel with the loop state
        health = json.loads((state / "trainer_state.json").read_text())["health"]
        assert set(health) == {"zero_grad_steps", "no_signal_steps"}, health


def test_plot_names_the_file_and_line_of_a_bad_row(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:-5] + lines[2]  # a row glued onto a partial one
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    line = _one_line_error(_cli("plot", run, ok=False))
    assert f"{run / 'metrics.jsonl'}:2: not a JSON row" in line


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 64] = b"\x00" * 64
    path.write_bytes(bytes(data[: len(data) * 2 // 3]))


def test_damaged_checkpoint_files_are_one_line_in_train_convert_and_model_load(run, tmp_path):
    """Checkpoints without an integrity record (an older version's): what the loaders themselves find."""
    for ckpt in (run / "checkpoints").glob("iter_*"):
        shutil.rmtree(ckpt / "integrity")
    ckpt = run / "checkpoints" / "iter_0000003"
    (distcp,) = (ckpt / "model").glob("*.distcp")
    _damage(distcp)
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "--resume", ok=False))
    assert f"model checkpoint {ckpt / 'model'} is unreadable or corrupt" in line
    line = _one_line_error(_cli("convert", "megatron-to-hf", "--ckpt", ckpt, "--out", tmp_path / "hf", ok=False))
    assert f"{ckpt / 'model'} is unreadable or corrupt" in line and not (tmp_path / "hf").exists()
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={tmp_path / 'new'}", f"model.load={ckpt}", ok=False))
    assert f"{ckpt / 'model'} is unreadable or corrupt" in line
    earlier = run / "checkpoints" / "iter_0000002"
    (optimizer,) = (earlier / "optimizer").glob("rank_*.pt")  # the distributed optimizer's shard (one rank)
    _damage(optimizer)
    (run / "checkpoints" / "latest").write_text("iter_0000002\n")
    shutil.rmtree(ckpt)
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "--resume", ok=False))
    assert f"optimizer checkpoint file {optimizer} is unreadable or corrupt" in line


def test_changed_bytes_in_model_and_optimizer_shards_are_refused_and_resume_falls_back(run, tmp_path):
    """4 KiB of zeros inside the model shard's tensor data and of 0xff inside the optimizer shard's (sizes unchanged;
    before the integrity record, zeros loaded and trained silently): every load names the file in one line, exit 2;
    --resume falls back to the newest checkpoint whose files are intact, warning about each damaged one.
    (One run with both patterns, not one per pattern: each run of this test is five CLI processes.)"""
    ckpts = run / "checkpoints"
    model_shard = ckpts / "iter_0000003" / "model" / "__0_0.distcp"
    optimizer_shard = ckpts / "iter_0000002" / "optimizer" / "rank_00000.pt"
    overwrite_tensor_bytes(model_shard, 0x00)
    overwrite_tensor_bytes(optimizer_shard, 0xFF)
    damaged = "is damaged: its bytes changed"
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={tmp_path / 'new'}", f"model.load={ckpts / 'iter_0000003'}",
                                ok=False))
    assert f"checkpoint file {model_shard} {damaged}" in line
    line = _one_line_error(_cli("convert", "megatron-to-hf", "--ckpt", ckpts / "iter_0000003", "--out",
                                tmp_path / "hf", ok=False))
    assert f"checkpoint file {model_shard} {damaged}" in line and not (tmp_path / "hf").exists()
    # No intact checkpoint left: the damage of the last one tried is the error.
    shutil.move(ckpts / "iter_0000001", tmp_path / "iter_0000001")
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "--resume", ok=False))
    assert f"checkpoint file {optimizer_shard} {damaged}" in line
    shutil.move(tmp_path / "iter_0000001", ckpts / "iter_0000001")
    res = _cli(*TRAIN, f"trainer.run_dir={run}", "--resume")
    warnings = [x for x in res.stderr.splitlines() if damaged in x]
    assert len(warnings) == 2, res.stderr[-3000:]
    assert str(model_shard) in warnings[0] and "resuming from the checkpoint before it, iter_0000002" in warnings[0]
    assert str(optimizer_shard) in warnings[1] and "resuming from the checkpoint before it, iter_0000001" in warnings[1]
    assert f"resumed from {ckpts / 'iter_0000001'} at step 1" in res.stderr
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2, 3]
    assert (ckpts / "latest").read_text().strip() == "iter_0000003"
    _cli("convert", "megatron-to-hf", "--ckpt", ckpts / "iter_0000003", "--out", tmp_path / "hf")  # rewritten, intact


def test_resume_of_a_checkpoint_in_the_old_per_rank_format_is_one_line(run):
    state = run / "checkpoints" / "iter_0000003" / "trainer_state.json"
    old = {k: v for k, v in json.loads(state.read_text()).items() if k not in ("format", "layout")}
    state.write_text(json.dumps(old))
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={run}", "--resume", ok=False))
    assert "written by an older megatron-gspo (per-rank optimizer files, checkpoint format 1)" in line
    assert f"model.load={state.parent}" in line


def test_resume_in_another_layout_says_in_one_line_what_changed(run):
    """The layout check compares what the state depends on (not only the world size); the run reshards and goes on.
    (The resumed state and next step in other layouts: tests/training/test_resume_layout.py.)"""
    state = run / "checkpoints" / "iter_0000003" / "trainer_state.json"
    saved = json.loads(state.read_text())
    assert saved["format"] == 2 and saved["layout"]["tp"] == 1 and saved["layout"]["distributed_optimizer"] is True
    state.write_text(json.dumps({**saved, "layout": {**saved["layout"], "tp": 2, "dp": 2, "world_size": 2}}))
    res = _cli(*TRAIN, f"trainer.run_dir={run}", "trainer.steps=4", "--resume")
    (line,) = [x for x in res.stderr.splitlines() if "layout changed" in x]
    assert "dp 2 -> 1, tp 2 -> 1, world_size 2 -> 1" in line and "resharded" in line


def test_sft_refuses_to_replace_an_existing_out_directory(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    res = _cli("sft", "--config", "examples/tiny_moe_gspo.yaml", "--out", out, "sft.max_steps=1", "sft.eval_every=1",
               "sft.eval_prompts=4", "data.train_size=64", "data.heldout_size=4", "sft.batch_size=8",
               "trainer.micro_batch_size=8", ok=False)
    line = _one_line_error(res)
    assert f"--out {out} already exists" in line and "--overwrite" in line
    assert (out / "keep.txt").read_text() == "precious"


def test_trim_log_keeps_whole_rows_up_to_the_step(tmp_path):
    from megatron_gspo.lifecycle.run_dir import trim_log

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 2, "x": 1{"step": 3}\n{"step": 3}\n{"step": 4}')
    assert trim_log(log, 3) == 2  # the glued row and step 4 (an unterminated but whole row)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    assert trim_log(log, 3) == 0
    log.write_text('{"step": 1}\n{"step": 2}')  # whole, just not terminated: kept, terminated
    assert trim_log(log, 5) == 0 and log.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert trim_log(log, -1) == 2 and log.read_text() == ""
    assert trim_log(tmp_path / "absent.jsonl", 3) == 0


def test_config_changes_compare_like_for_like():
    from megatron_gspo.lifecycle.run_dir import config_changes, resumable
    from megatron_gspo.training.config import load_run_config

    a = load_run_config("examples/tiny_moe_gspo.yaml").to_dict()
    b = load_run_config("examples/tiny_moe_gspo.yaml", ["moe.routing_replay=off", "sglang.urls=[http://x:1]"]).to_dict()
    assert config_changes(a, b) == [("sglang.urls", "<unset>", ["http://x:1"])]  # moe defaults filled in
    assert resumable("sglang.urls") and resumable("trainer.steps") and not resumable("optim.lr")
    assert resumable("vllm.urls") and resumable("vllm.port_base") and resumable("vllm.mode")  # a requeued job
    assert not resumable("vllm.logprobs_mode") and not resumable("vllm.capture_routes")  # what pi_old / R3 are
    assert not resumable("trainer.seed") and not resumable("moe.routing_replay")


def test_keys_added_since_the_checkpoint_read_as_their_defaults():
    """A checkpoint written before a config key existed ran with its default: resuming it with the default is no
    change, resuming it with another value is one (refused where the key may not change)."""
    import yaml

    from megatron_gspo.lifecycle.run_dir import check_resume_config
    from megatron_gspo.training.config import RunConfig, load_run_config

    current = load_run_config("examples/tiny_moe_gspo.yaml").to_dict()
    older = yaml.safe_load(yaml.safe_dump(current))
    del older["loss"]["mask_truncated"], older["rollout"]["correction"]["preset"]
    ckpt, defaults = "iter_0000003", RunConfig().to_dict()
    assert check_resume_config(yaml.safe_dump(older), current, ckpt, 3, defaults=defaults) == []
    with pytest.raises(ValueError, match=r"loss\.mask_truncated: '<unset>' -> False"):  # without the defaults
        check_resume_config(yaml.safe_dump(older), current, ckpt, 3)
    masked = load_run_config("examples/tiny_moe_gspo.yaml", ["loss.mask_truncated=true"]).to_dict()
    with pytest.raises(ValueError, match=r"loss\.mask_truncated: False -> True"):
        check_resume_config(yaml.safe_dump(older), masked, ckpt, 3, defaults=defaults)


def test_demo_refuses_a_previous_demo_without_overwrite(tmp_path):
    run = tmp_path / "demo"
    (run / "sft_model").mkdir(parents=True)
    (run / "sft_model" / "config.json").write_text("{}")
    res = _cli("demo", "--run-dir", run, "sft.max_steps=1", "sft.eval_every=1", "sft.eval_prompts=4",
               "data.train_size=64", "data.heldout_size=4", "sft.batch_size=8", "trainer.micro_batch_size=8",
               "trainer.steps=1", "trainer.prompts_per_step=2", "eval.max_prompts=4", ok=False)
    line = _one_line_error(res)
    assert "holds a previous demo: pass --overwrite" in line
    assert (run / "sft_model" / "config.json").read_text() == "{}"


def test_micro_batching_may_change_on_resume_only_without_the_load_balancing_loss(tmp_path):
    import yaml

    from megatron_gspo.lifecycle.run_dir import check_resume_config
    from megatron_gspo.training.config import load_run_config

    saved = load_run_config("examples/tiny_moe_gspo.yaml").to_dict()
    text = yaml.safe_dump(saved)
    smaller = load_run_config("examples/tiny_moe_gspo.yaml", ["trainer.micro_batch_size=4"]).to_dict()
    ckpt = tmp_path / "iter_0000003"
    assert check_resume_config(text, smaller, ckpt, 3, router_aux_loss_coef=0.0) == [
        "trainer.micro_batch_size: 128 -> 4"
    ]
    with pytest.raises(ValueError, match=r"trainer\.micro_batch_size: 128 -> 4 changes the load-balancing loss.*"
                                         r"router_aux_loss_coef=0\.001 > 0\): keep trainer\.micro_batch_size=128"):
        check_resume_config(text, smaller, ckpt, 3, router_aux_loss_coef=0.001)
    background = load_run_config("examples/tiny_moe_gspo.yaml", ["trainer.async_save=true"]).to_dict()
    assert check_resume_config(text, background, ckpt, 3, router_aux_loss_coef=0.001) == [
        "trainer.async_save: False -> True"  # the same files, written in the background
    ]
    packed = load_run_config("examples/tiny_moe_gspo.yaml", ["trainer.batch_layout=packed"]).to_dict()
    budget = load_run_config("examples/tiny_moe_gspo.yaml", ["trainer.batch_layout=packed",
                                                             "trainer.max_tokens_per_micro_batch=64"]).to_dict()
    with pytest.raises(ValueError, match=r"trainer\.max_tokens_per_micro_batch: 0 -> 64"):
        check_resume_config(yaml.safe_dump(packed), budget, ckpt, 3, router_aux_loss_coef=0.0)


def test_train_refuses_other_micro_batches_on_resume_with_the_load_balancing_loss(tmp_path):
    # The trainer passes the model's resolved coefficient (preset + overrides): a checkpoint of a run with
    # router_aux_loss_coef=0.001 (refused before any model is built, so a stand-in checkpoint is enough).
    import yaml

    from megatron_gspo.training.config import load_run_config

    aux = ["model.overrides={vocab_size: 16, router_aux_loss_coef: 0.001}"]
    saved = load_run_config("examples/tiny_moe_gspo.yaml", [*MINI, *aux]).to_dict()
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "run_id": "r", "world_size": 1, "format": 2}))
    (ckpt / "run_config.yaml").write_text(yaml.safe_dump({**saved, "trainer": {**saved["trainer"],
                                                                                "run_dir": str(tmp_path / "run")}}))
    (ckpt.parent / "latest").write_text("iter_0000002\n")
    line = _one_line_error(_cli(*TRAIN, *aux, f"trainer.run_dir={tmp_path / 'run'}", "trainer.micro_batch_size=4",
                                "--resume", ok=False))
    assert "trainer.micro_batch_size: 8 -> 4 changes the load-balancing loss" in line


def test_trim_log_and_latest_are_durable_and_a_stale_tmp_is_harmless(tmp_path, monkeypatch):
    import os

    from megatron_gspo.checkpoint.durable import write_durably
    from megatron_gspo.lifecycle.run_dir import trim_log

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    log = tmp_path / "metrics.jsonl"
    (tmp_path / "metrics.jsonl.tmp").write_text("left by a killed run")
    log.write_text('{"step": 1}\n{"step": 2}\n')
    assert trim_log(log, 1) == 1
    assert events.index(("replace", str(log))) < events.index(("fsync", str(tmp_path.resolve())))
    assert log.read_text() == '{"step": 1}\n' and not (tmp_path / "metrics.jsonl.tmp").exists()
    (tmp_path / "latest.tmp").write_text("iter_0000009 and garbage")  # a write of `latest` that failed
    events.clear()
    write_durably(tmp_path / "latest", "iter_0000002\n")
    assert events.index(("replace", str(tmp_path / "latest"))) < events.index(("fsync", str(tmp_path.resolve())))
    assert (tmp_path / "latest").read_text() == "iter_0000002\n" and not (tmp_path / "latest.tmp").exists()


def test_the_plain_optimizers_state_is_refused_with_another_expert_parallel_size(tmp_path):
    # Refused before any model is built (from trainer_state.json's layout), so a stand-in checkpoint is enough.
    ckpt = tmp_path / "run" / "checkpoints" / "iter_0000002"
    ckpt.mkdir(parents=True)
    layout = {"tp": 1, "pp": 1, "ep": 2, "dp": 1, "world_size": 2, "distributed_optimizer": False}
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "run_id": "r", "world_size": 2, "format": 2,
                                                         "layout": layout}))
    (ckpt.parent / "latest").write_text("iter_0000002\n")
    line = _one_line_error(_cli(*TRAIN, f"trainer.run_dir={tmp_path / 'run'}", "optim.distributed=false", "--resume",
                                ok=False))
    assert "holds the plain optimizer's state (optim.distributed=false), which does not resume with another" in line
    assert "(ep 2 -> 1): resume with parallel.ep=2" in line
