"""End-to-end runs of `megatron-gspo train`: a mini single-process run, a 2-process TP=2 run, and the
SIGKILL / --resume equality test."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MINI = [
    "trainer.steps=3",
    "trainer.prompts_per_step=8",
    "trainer.micro_batch_size=8",
    "trainer.progress=false",
    "rollout.group_size=4",
    "rollout.max_new_tokens=5",
    "data.train_size=256",
    "data.heldout_size=16",
    "eval.max_prompts=16",
    "eval.n=2",
    "optim.lr=1e-3",
    "optim.warmup_steps=0",
]
VOLATILE = ("time_", "tokens_per_s")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _train(run_dir, extra=(), nproc=1, resume=False, popen=False, config="examples/tiny_moe_gspo.yaml", mini=MINI):
    base = [sys.executable, "-m", "megatron_gspo.cli.main"]
    if nproc > 1:
        # --standalone: torchrun binds a port of the kernel's choosing itself, so runs beside other jobs on the
        # host cannot collide on a port picked in advance (EADDRINUSE).
        base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
                "megatron_gspo.cli.main"]
    cmd = base + ["train", "--config", config, *mini, f"trainer.run_dir={run_dir}", *extra]
    if resume:
        cmd.append("--resume")
    if popen:
        # A session of its own: SIGKILL to the process group takes torchrun's workers down with it. SIGINT as in
        # a terminal: a shell without job control starts a background `make test &` with SIGINT ignored, which
        # every process inherits, and the Ctrl-C test's trainer would never see it.
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, preexec_fn=_default_sigint)
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in rows}  # last occurrence of each step wins


REQUIRED = (
    "reward_mean", "accuracy", "response_length", "clip_frac_low_tok", "clip_frac_high_tok", "clip_frac_low_seq",
    "clip_frac_high_seq", "seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "approx_kl", "grad_norm", "lr",
    "time_generate", "time_update", "tokens_per_s",
)


@pytest.mark.slow
def test_mini_run_writes_metrics_summary_and_checkpoint(tmp_path):
    _train(tmp_path / "run")
    rows = _rows(tmp_path / "run")
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, missing
        assert r["num_sequences"] == 8 * 4
        # Synchronous RL: every sample has staleness 0, so no per-bucket metrics (staleness_<s>/<name>); the
        # step's staleness summary says 0 and the off-policy metrics are there.
        assert not [k for k in r if k.startswith("staleness_") and "/" in k]
        assert r["staleness_mean"] == 0 and r["staleness_max"] == 0
        for key in ("mismatch_frac_ratio_above_2", "mismatch_seq_weight_prod_mean", "truncated_frac", "samples"):
            assert key in r, key
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("eval_accuracy_before", "eval_accuracy_after", "steps", "wall_seconds"):
        assert key in summary
    assert summary["steps"] == 3
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
    assert list((tmp_path / "run" / "tensorboard").iterdir())


@pytest.mark.slow
def test_two_process_tensor_parallel_run(tmp_path):
    _train(tmp_path / "tp2", ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.steps=2"], nproc=2)
    rows = _rows(tmp_path / "tp2")
    assert sorted(rows) == [1, 2]
    assert rows[1]["num_sequences"] == 8 * 4


@pytest.mark.slow
def test_bf16_run_with_load_balancing_loss(tmp_path):
    """The cluster's precision and aux loss: bf16 params with fp32 master params and grads, aux 0.001."""
    _train(tmp_path / "bf16", ["model.dtype=bf16", "model.overrides.router_aux_loss_coef=0.001", "trainer.steps=2",
                                "data.reward=tests.training.rewards:contains_one"])
    rows = _rows(tmp_path / "bf16")
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["num_sequences"] == 8 * 4 and r["skipped_steps"] == 0
        assert 0 < r["grad_norm"] < float("inf")
    info = json.loads((tmp_path / "bf16" / "checkpoints" / "iter_0000002" / "megatron_gspo.json").read_text())
    assert info["dtype"] == "bfloat16"


def _kill_and_resume(tmp_path, steps: list[str], last: int, kill_at: int, nproc: int = 1, ready=None,
                     **train) -> None:
    """A run killed (SIGKILL, every process) once checkpoint `kill_at` exists (and `ready()`, when given, says
    so), resumed with --resume, logs the same metrics as an uninterrupted run for every step after its last
    checkpoint. `train`: _train's config / mini."""
    _train(tmp_path / "full", steps, nproc=nproc, **train)
    full = _rows(tmp_path / "full")

    proc = _train(tmp_path / "killed", steps, nproc=nproc, popen=True, **train)
    latest = tmp_path / "killed" / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == f"iter_{kill_at:07d}" and (ready is None or ready()):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed: " + proc.stdout.read()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed_from = int(latest.read_text().strip().split("_")[1])
    assert resumed_from < last
    _train(tmp_path / "killed", steps, nproc=nproc, resume=True, **train)
    again = _rows(tmp_path / "killed")
    assert sorted(again) == list(range(1, last + 1))
    for step in range(resumed_from + 1, last + 1):
        for key, value in full[step].items():
            if key.startswith(VOLATILE):
                continue
            assert again[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.slow
def test_killed_run_resumes_exactly(tmp_path):
    _kill_and_resume(tmp_path, ["trainer.steps=4", "trainer.ckpt_every=1", "trainer.save_final=false"], 4, 2)


@pytest.mark.slow
def test_killed_run_with_background_checkpoints_resumes_exactly(tmp_path):
    """trainer.async_save: a checkpoint becomes `latest` a step after it was started (megatron's forked writers),
    the kill comes while the next one may be in flight, and the resumed run removes what that one left."""
    _kill_and_resume(tmp_path, ["trainer.steps=4", "trainer.ckpt_every=1", "trainer.save_final=false",
                                "trainer.async_save=true"], 4, 2)
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == [
        "iter_0000002", "iter_0000003", "latest"]  # keep_last=2; no iter_*.tmp of the killed run


@pytest.mark.slow
def test_killed_data_parallel_dynamic_sampling_run_resumes_exactly(tmp_path):
    """DP=2 with top-ups: the sampler position (global, the same on both ranks) and each rank's state resume; with
    token-budget micro-batches of re-dealt (balanced) sequences and R2 replay, as a cluster runs."""
    steps = ["trainer.steps=3", "trainer.ckpt_every=1", "trainer.save_final=false", "rollout.dynamic_sampling=true",
             "data.reward=tests.training.rewards:contains_one", "eval.max_prompts=4", "eval.n=1",
             "trainer.max_tokens_per_micro_batch=30", "moe.routing_replay=r2"]
    _kill_and_resume(tmp_path, steps, 3, 1, nproc=2)
    rows = _rows(tmp_path / "full")
    assert sum(r["topup_rounds"] for r in rows.values()) > 0, "no top-up: the resume of the sampler is untested"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "r2", "r3"])
def test_routing_replay_modes_run_and_report_drift(tmp_path, mode):
    run = tmp_path / mode
    _train(run, [f"moe.routing_replay={mode}", "trainer.steps=1", "optim.lr=0.05",
                 "data.reward=tests.training.rewards:contains_one", "trainer.save_final=false"])
    row = _rows(run)[1]
    assert row["grad_norm"] > 0
    assert 0 <= row["expert_drift"] <= 1 and "expert_drift_tokens_changed" in row
    assert "expert_drift_layer3" in row
    if mode == "off":
        assert row["expert_drift"] > 0, "a large step should change some routing"
    # The drift over the whole rollout batch costs one more forward: only when asked (the stability benchmark).
    assert not any(k.startswith("expert_drift_rollout") for k in row)
    if mode != "r3":
        # The local engine samples with the training model: its recorded routes are the trainer's routes.
        assert row["routing_mismatch"] == pytest.approx(0.0, abs=1e-6) and row["routing_mismatch_num_tokens"] > 0
    else:
        assert row["routes_memory_bytes"] > 0


def test_nonfinite_gradient_skips_the_step_and_training_continues(tmp_path):
    from tests.distributed import run_distributed
    from tests.training.trainer_ranks import nonfinite_gradient_is_skipped

    out = run_distributed(nonfinite_gradient_is_skipped, str(tmp_path / "nan"), world_size=1)[0]
    assert out["skipped"] == [False, False] and out["unchanged"]  # NaN in a dense, inf in an expert gradient
    assert out["ok"] is True and out["changed"] and out["norm"] > 0


@pytest.mark.parametrize("old_logprobs", ["recompute", "engine"])
def test_routing_statistics_only_on_drift_steps(tmp_path, old_logprobs):
    """moe.drift_every=2: step 1 records no routes and runs no forward for them (engine log-probs: no drift-sample
    pass at all); step 2 records pi_old's routes and measures drift and the routing mismatch."""
    from tests.distributed import run_distributed
    from tests.training.trainer_ranks import routing_statistics_follow_drift_every

    out = run_distributed(routing_statistics_follow_drift_every, str(tmp_path / "r"), old_logprobs, world_size=1)[0]
    first, second = out["steps"]
    recompute = old_logprobs == "recompute"
    assert first == dict(passes=1 if recompute else 0, recorded=False, keys=[])
    # (old log-probs or the record pass); no drift pass: the second minibatch's training forward gives the routes
    assert second["recorded"] and second["passes"] == 1
    assert "expert_drift" in second["keys"] and "routing_mismatch" in second["keys"]


@pytest.mark.slow
def test_grpo_token_mean_dynamic_sampling_engine_logprobs(tmp_path):
    _train(tmp_path / "dyn", ["loss.algorithm=grpo", "loss.grpo_aggregation=token-mean", "rollout.dynamic_sampling=true",
                              "data.reward=tests.training.rewards:contains_one", "trainer.steps=2",
                              "trainer.save_final=false", "rollout.old_logprobs=engine"])
    rows = _rows(tmp_path / "dyn")
    for r in rows.values():
        # Engine log-probs as pi_old (paper §5.4): the local engine samples with the training model itself, so the
        # measured train / inference mismatch is numerical noise.
        assert r["mismatch_seq_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert abs(r["mismatch_approx_kl"]) < 1e-5
        assert r["num_sequences"] == 8 * 4  # topped up or padded back to the configured batch
        assert "groups_dropped" in r
        assert r["clip_frac_low_tok"] >= 0


@pytest.mark.slow
def test_sft_then_eval_and_train_from_its_checkpoint(tmp_path):
    sft = [sys.executable, "-m", "megatron_gspo.cli.main", "sft", "--config", "examples/tiny_moe_gspo.yaml",
           "--out", str(tmp_path / "sft"), "sft.max_steps=3", "sft.eval_every=3", "sft.eval_prompts=8",
           "data.train_size=256", "data.heldout_size=16", "sft.batch_size=16", "trainer.micro_batch_size=16"]
    res = subprocess.run(sft, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "sft" / "config.json").is_file()
    ev = [sys.executable, "-m", "megatron_gspo.cli.main", "eval", "--config", "examples/tiny_moe_gspo.yaml",
          f"model.load={tmp_path / 'sft'}", "data.heldout_size=16", "eval.max_prompts=16", "eval.n=3"]
    res = subprocess.run(ev, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout[res.stdout.index("{"):])
    assert result["eval_prompts"] == 16 and result["eval_samples_per_prompt"] == 3
    assert 0 <= result["eval_pass@1"] <= result["eval_pass@3"] <= 1
    _train(tmp_path / "rl", [f"model.load={tmp_path / 'sft'}", "trainer.steps=1", "trainer.save_final=false"])


def test_bad_config_gives_a_one_line_error(tmp_path):
    cmd = [sys.executable, "-m", "megatron_gspo.cli.main", "train", "--config", "examples/tiny_moe_gspo.yaml",
           "trainer.stepz=3"]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("megatron-gspo: error: unknown config key trainer.stepz")
