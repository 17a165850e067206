"""The collapse drivers as cells of overrides, the screening tool's early stop, rows and resumption, and the R3
paper's metrics (k3 train / inference KL, F(tau = 2), router flips per layer) against formulas written here."""

import datetime
import json
import math
import sys
import textwrap

import pytest
import torch

from megatron_gspo.benchmarks.stability.benchmark import variant_overrides
from megatron_gspo.benchmarks.stability.drivers import DRIVERS, SCREEN_CELLS, cell_overrides, model_cell
from megatron_gspo.benchmarks.stability.screen import (
    ScreenPlan,
    certain_collapse,
    config_digest,
    last_rows,
    parse_stop_at,
    run_screen,
    watch_run,
)
from megatron_gspo.training.config import load_run_config

CONFIG = "examples/stability_moe.yaml"


# ---- drivers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cell", SCREEN_CELLS)
def test_every_screen_cell_is_a_valid_config_for_grpo_and_gspo(cell):
    for variant in ("grpo", "gspo"):
        base = load_run_config(CONFIG, cell_overrides(cell))
        load_run_config(CONFIG, [*cell_overrides(cell), *variant_overrides(variant, base)])
    # and its prompts can be drawn (long_answers' count2 has ~4000 distinct train prompts: the preset's 8192 failed
    # at the run's start, not at config load)
    from megatron_gspo.data.dataset import load_datasets

    train, heldout = load_datasets(base.data)
    assert len(train) == base.data.train_size and len(heldout) == base.data.heldout_size


def test_driver_knobs_reach_the_config():
    def cfg(cell):
        return load_run_config(CONFIG, cell_overrides(cell))

    assert cfg("baseline").rollout.local.torch_dtype() is None  # the engine is the trainer
    assert cfg("engine_bf16").rollout.local.torch_dtype() is torch.bfloat16 and cfg("engine_bf16").model.dtype == "fp32"
    assert cfg("engine_fp16").rollout.local.torch_dtype() is torch.float16
    assert cfg("engine_hf_fp32").rollout.local.backend == "hf" and cfg("engine_hf_fp32").rollout.local.dtype is None
    assert [cfg(k).trainer.minibatches for k in ("k1", "k2", "k8")] == [1, 2, 8]
    assert cfg("experts128").model.model_config().num_experts == 128
    assert cfg("lr_1e-4").optim.lr == 1e-4
    both = cfg("bf16_both")
    assert both.model.dtype == "bf16" and both.rollout.local.backend == "hf"
    assert cfg("pi_old_engine_bf16").rollout.old_logprobs == "engine"
    assert cfg("k16").trainer.minibatches == 16 and cfg("k16").optim.warmup_steps == 16
    assert cfg("lr_6e-4").optim.lr == 6e-4 and cfg("lr_3.75e-4").optim.lr == 3.75e-4
    assert cfg("aux_off").model.model_config().router_aux_loss_coef == 0
    assert cfg("top2").model.model_config().num_experts_per_tok == 2
    long = cfg("long_answers")
    assert long.data.train == "task:count2" and long.rollout.max_new_tokens == 256
    combined = cfg("engine_bf16+k8")
    assert combined.rollout.local.dtype == "bf16" and combined.trainer.minibatches == 8
    assert model_cell("engine_bf16+top2") == "top2" and model_cell("engine_bf16+k8") == "preset"
    assert model_cell("top2+long_answers") == "top2+long_answers"
    assert {d.mechanism for d in DRIVERS.values()} == {"none", "mismatch", "pi_old", "staleness", "lr", "router", "length"}


@pytest.mark.parametrize(
    "cell, message",
    [
        ("engine_bf16+nope", r"unknown driver 'nope'"),
        ("k8+k16", r"drivers k8 and k16 both set trainer\.minibatches"),
        ("k8+k8", r"names a driver twice"),
        ("", r"must be driver names joined by '\+'"),
    ],
)
def test_bad_cells_are_named(cell, message):
    with pytest.raises(ValueError, match=message):
        cell_overrides(cell)


def test_screen_plan_is_validated_before_anything_runs():
    with pytest.raises(ValueError, match=r"unknown driver"):
        ScreenPlan(config=CONFIG, cells=["k3"])
    with pytest.raises(ValueError, match=r"--variants: unknown variant \['ppo'\]"):
        ScreenPlan(config=CONFIG, variants=["ppo"])
    with pytest.raises(ValueError, match=r"--steps=4 must be >= 10"):
        ScreenPlan(config=CONFIG, steps=4)
    with pytest.raises(ValueError, match=r"--stop-at='soon' must be HH:MM"):
        parse_stop_at("soon")
    now = datetime.datetime(2026, 12, 2, 13, 0, tzinfo=datetime.timezone.utc)
    assert parse_stop_at("15:30", now) == now.replace(hour=15, minute=30)
    # Past midnight: the next 01:05, not today's (which had passed: the screen stopped before its first run).
    late = datetime.datetime(2026, 12, 2, 22, 53, tzinfo=datetime.timezone.utc)
    assert parse_stop_at("01:05", late) == datetime.datetime(2026, 12, 3, 1, 5, tzinfo=datetime.timezone.utc)


def test_the_digest_is_of_the_resolved_config():
    a = config_digest(CONFIG, ["optim.lr=3e-4", "trainer.steps=30"])
    assert a == config_digest(CONFIG, ["trainer.steps=30", "optim.lr=0.0003"])
    assert a != config_digest(CONFIG, ["trainer.steps=31"])


# ---- early stop ------------------------------------------------------------------------------------------
def test_a_collapse_is_certain_only_after_a_learned_run_scores_zero_for_a_whole_window():
    learned = [0.2, 0.3, 0.3, 0.3, 0.3]
    assert certain_collapse(learned + [0.0] * 5)
    assert not certain_collapse(learned + [0.0] * 4)  # one window short
    assert not certain_collapse(learned + [0.0, 0.0, 0.01, 0.0, 0.0])  # a correct answer in the window
    assert not certain_collapse([0.05] * 5 + [0.0] * 5)  # never reached the floor: no collapse by the rule
    assert not certain_collapse([0.0] * 5)


_FAKE_TRAIN = textwrap.dedent(
    """
    import json, signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    run_dir, rewards = sys.argv[1], [float(x) for x in sys.argv[2].split(",")]
    for step, r in enumerate(rewards, start=1):
        with open(run_dir + "/metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "reward_mean": r}) + "\\n")
        time.sleep(0.05)
        if stop:
            sys.exit(75)
    time.sleep(30)  # a run that would go on
    """
)


def test_watch_run_stops_a_real_process_once_the_collapse_is_certain(tmp_path):
    """A stand-in train process (a real child with a SIGTERM handler, as the trainer's) writes a collapsing reward
    curve; the watcher sends SIGTERM within a poll of the certain step instead of waiting 30 s."""
    script = tmp_path / "fake_train.py"
    script.write_text(_FAKE_TRAIN)
    curve = ",".join(["0.3"] * 6 + ["0.0"] * 6)
    status, seconds = watch_run(
        [sys.executable, str(script), str(tmp_path), curve], tmp_path, tmp_path / "log", stop_at=None,
        run_minutes=5, poll_s=0.1,
    )
    assert status == "early_stop" and seconds < 20
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    (tmp_path / "metrics.jsonl").unlink()
    status, seconds = watch_run(
        [sys.executable, str(script), str(tmp_path), "0.3,0.3"], tmp_path, tmp_path / "log", stop_at=past,
        run_minutes=5, poll_s=0.1,
    )
    assert status == "cut" and seconds < 20
    # The stop is the trainer's SIGTERM (a checkpoint, exit 75), not a kill: the stand-in exits only through it.


# ---- rows and resumption ---------------------------------------------------------------------------------
def _fake_runner(statuses, calls):
    """Stands in for a train run (tested above with a real process): writes the metrics of a run that learns
    and collapses, and returns the next status."""

    def run(cmd, run_dir, log_path, *, stop_at, run_minutes):
        calls.append(cmd)
        rows = [0.3] * 6 + [0.0] * 6
        with open(run_dir / "metrics.jsonl", "w") as f:
            for step, r in enumerate(rows, start=1):
                f.write(json.dumps({"step": step, "reward_mean": r, "mismatch_kl": 1e-5 * step,
                                    "routing_mismatch_tokens_changed_layer0": 0.1,
                                    "routing_mismatch_tokens_changed_layer1": 0.3}) + "\n")
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 0, "eval_accuracy": 0.2}) + "\n")
        return statuses.pop(0), 1.5

    return run


def test_rows_are_appended_with_verdict_metrics_and_code_and_a_resumed_screen_reruns_only_what_is_not_done(tmp_path):
    plan = ScreenPlan(config=CONFIG, overrides=[f"model.load={tmp_path}"], cells=["baseline", "k8"],
                      variants=["grpo"], steps=12, out=str(tmp_path / "runs"), rows=str(tmp_path / "screen.jsonl"))
    calls = []
    rows = run_screen(plan, runner=_fake_runner(["early_stop", "cut"], calls))
    assert [(r["cell"], r["status"]) for r in rows] == [("baseline", "early_stop"), ("k8", "cut")]
    row = rows[0]
    assert row["verdict"] == "collapsed@9 (reward)" and row["collapsed"] and row["collapse_step"] == 9
    assert row["mismatch_kl"] == pytest.approx(1e-5 * 6.5) and row["mismatch_kl_max"] == pytest.approx(1.2e-4)
    assert row["router_flips_per_layer"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.3)}
    assert "commit" in row["code"] and row["command"] and "loss.algorithm=grpo" in row["run_command"]
    assert "trainer.minibatches=8" in calls[1] and "trainer.steps=12" in calls[1]
    assert row["run_dir"].endswith(f"baseline/grpo/seed1234_{row['config_digest']}")
    assert last_rows(tmp_path / "screen.jsonl").keys() == {("baseline", "grpo", 1234), ("k8", "grpo", 1234)}
    calls.clear()
    again = run_screen(plan, runner=_fake_runner(["finished"], calls))
    assert [(r["cell"], r["status"]) for r in again] == [("k8", "finished")]  # the cut run only
    assert len((tmp_path / "screen.jsonl").read_text().splitlines()) == 3
    table = (tmp_path / "screen.md").read_text().splitlines()
    assert table[0] == "# Collapse-driver runs (screen.jsonl: 2 runs; cells baseline, k8; seeds 1234)"
    assert table[-2].startswith("| baseline | grpo | 1234 | early_stop | 12/12 | collapsed@9 (reward) | 0.300 |")
    assert table[-1].startswith("| k8 | grpo | 1234 | finished |")
    assert "| 10.0 / 30.0 |" not in table[-1] and "| - / 30.0 |" in table[-1]  # no any-layer key; max layer 0.3


# ---- the R3 paper's metrics ------------------------------------------------------------------------------
def test_k3_kl_and_f2_against_the_formulas():
    from megatron_gspo.algorithms.correction import rollout_correction

    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(3, 7, generator=g, dtype=torch.float64) * 3
    train = rollout + torch.randn(3, 7, generator=g, dtype=torch.float64)  # ratios well beyond 2 and below 1/2
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = False
    _, m = rollout_correction(train, rollout, mask, level="off")
    d = [float(train[i, t] - rollout[i, t]) for i in range(3) for t in range(7) if mask[i, t]]
    k3 = sum(math.exp(x) - 1 - x for x in d) / len(d)
    f2 = sum(math.exp(x) > 2 for x in d) / len(d)
    f2_both = sum(math.exp(x) > 2 or math.exp(x) < 0.5 for x in d) / len(d)
    assert 0 < f2 < f2_both < 1
    assert float(m["mismatch_kl"]) == pytest.approx(k3, rel=1e-6)
    assert float(m["mismatch_frac_ratio_above_2"]) == pytest.approx(f2)
    assert float(m["mismatch_frac_ratio_outside_2"]) == pytest.approx(f2_both)


def test_router_flips_per_layer_against_sets():
    """R3 paper: the share of routers (a token in a layer) whose top-k set differs between engine and trainer;
    order within the top-k does not count."""
    from megatron_gspo.moe.stability import route_change

    g = torch.Generator().manual_seed(1)
    engine = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40 * 3)]).view(40, 3, 2)
    trainer = engine.clone()
    flip = torch.rand(40, 3, generator=g) < 0.3
    trainer[flip] = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(int(flip.sum()))])
    trainer[:5] = trainer[:5].flip(-1)  # same sets, other order
    mask = torch.rand(40, generator=g) < 0.8
    out = route_change(engine, trainer, mask, prefix="routing_mismatch")
    tokens = [t for t in range(40) if mask[t]]
    for layer in range(3):
        differs = [set(engine[t, layer].tolist()) != set(trainer[t, layer].tolist()) for t in tokens]
        assert float(out["routing_mismatch_tokens_changed_per_layer"][layer]) == pytest.approx(sum(differs) / len(tokens))
    any_layer = [any(set(engine[t, x].tolist()) != set(trainer[t, x].tolist()) for x in range(3)) for t in tokens]
    assert float(out["routing_mismatch_tokens_changed"]) == pytest.approx(sum(any_layer) / len(tokens))


def test_stability_cell_option_puts_the_cells_overrides_before_the_users(monkeypatch, tmp_path):
    from megatron_gspo.benchmarks.stability import benchmark
    from megatron_gspo.cli.main import main

    seen = {}

    # Stands in for the benchmark's runs (minutes of training each; a real two-step benchmark is
    # tests/benchmarks/stability/test_benchmark.py): this test is only about the order of the overrides it gets.
    def fake_run_stability(config, overrides, out, variants, **kwargs):
        seen.update(config=config, overrides=overrides, note=kwargs.get("note"))
        return benchmark.BenchmarkResult(report=tmp_path / "none.md")

    monkeypatch.setattr(benchmark, "run_stability", fake_run_stability)
    assert main(["stability", "--cell", "k8", "--out", str(tmp_path), "optim.lr=1e-4"]) == 0
    assert seen["overrides"] == [*cell_overrides("k8"), "optim.lr=1e-4"]
    assert seen["config"].endswith("stability_moe.yaml") and seen["note"] is None
    # No --cell on the CPU preset: the map's most discriminating cell, at the steps it was measured with, labelled.
    assert main(["stability", "--out", str(tmp_path), "optim.lr=1e-4"]) == 0
    assert seen["overrides"] == [*cell_overrides("engine_bf16+k8"), "trainer.steps=20", "optim.lr=1e-4"]
    assert "most discriminating setting the CPU map found" in seen["note"] and "short of issue 29's bar" in seen["note"]
    assert main(["stability", "--cell", "baseline", "--out", str(tmp_path)]) == 0
    assert seen["overrides"] == [] and seen["note"] is None
    # A config of the user's own gets no cell unless asked for.
    assert main(["stability", "--config", seen["config"], "--out", str(tmp_path)]) == 0
    assert seen["overrides"] == [] and seen["note"] is None


def test_a_row_names_the_weights_and_code_of_its_sft_model(tmp_path):
    """The shared SFT model outlives code versions (reused while its settings match): a row records the sha256 of
    its weight files and the code that trained it."""
    import hashlib

    from megatron_gspo.benchmarks.stability.benchmark import sft_fingerprint

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "b.distcp").write_bytes(b"second")
    (tmp_path / "model" / "a.pt").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")  # not the checkpoint
    expected = hashlib.sha256(b"a.pt" + b"first" + b"b.distcp" + b"second").hexdigest()
    assert sft_fingerprint(tmp_path) == {"dir": str(tmp_path), "weights_sha256": expected, "trained_at": None}
    (tmp_path / "sft_code.json").write_text(json.dumps({"commit": "abc", "dirty": False}))
    (tmp_path / "model" / "b.distcp").write_bytes(b"changed")
    fp = sft_fingerprint(tmp_path)
    assert fp["weights_sha256"] != expected and fp["trained_at"] == {"commit": "abc", "dirty": False}
