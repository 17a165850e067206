"""The stability benchmark's analysis: the collapse rule on synthetic curves, seed aggregation, the report from
hand-written run directories, and the run schedule (seeds, budget, reuse) with a stand-in runner."""

import json
import math
from pathlib import Path

import pytest
import yaml

from megatron_gspo.benchmarks.stability.benchmark import parse_seeds, run_stability, variant_overrides
from megatron_gspo.benchmarks.stability.curves import seed_band
from megatron_gspo.benchmarks.stability.report import (
    collapse_verdict,
    summarise_run,
    summarise_variant,
    write_report,
)
from megatron_gspo.training.config import dump_run_config, load_run_config

STEPS = list(range(1, 21))


# ---- collapse rule ----------------------------------------------------------------------------------------
def test_rising_and_never_learning_runs_are_stable():
    rising = [0.2 + 0.01 * i for i in range(20)]
    assert collapse_verdict(STEPS, rising, [(0, 0.3), (10, 0.35), (20, 0.4)]).label() == "stable"
    flat_low = [0.05, 0.0, 0.02, 0.0] * 5  # best moving average < 0.1: nothing learned, nothing to lose
    assert collapse_verdict(STEPS, flat_low, []).label() == "stable"


def test_reward_collapse_that_stays_is_a_collapse_at_the_first_low_step():
    rewards = [0.4] * 10 + [0.05] * 10
    # Moving averages (window 5): step 12 -> (3 * 0.4 + 2 * 0.05) / 5 = 0.26 >= 0.2; step 13 -> 0.19 < 0.2.
    verdict = collapse_verdict(STEPS, rewards, [])
    assert (verdict.collapsed, verdict.step, verdict.reason) == (True, 13, "reward")
    assert verdict.label() == "collapsed@13 (reward)"


def test_reward_drop_that_recovers_is_a_dip_not_a_collapse():
    rewards = [0.4] * 10 + [0.05] * 6 + [0.4] * 10
    verdict = collapse_verdict(list(range(1, 27)), rewards, [])
    assert not verdict.collapsed and verdict.label() == "dip@13"


def test_heldout_rule_needs_a_drop_beyond_the_margin_that_lasts_to_the_end():
    flat = [0.3] * 20
    falls = [(0, 0.30), (5, 0.32), (10, 0.22), (15, 0.20), (20, 0.21)]
    verdict = collapse_verdict(STEPS, flat, falls)
    assert (verdict.collapsed, verdict.step, verdict.reason) == (True, 10, "heldout")
    recovers = [(0, 0.30), (10, 0.20), (20, 0.31)]
    assert not collapse_verdict(STEPS, flat, recovers).collapsed
    within_margin = [(0, 0.30), (10, 0.27), (20, 0.26)]  # 4 points below: inside the 5-point margin
    assert not collapse_verdict(STEPS, flat, within_margin).collapsed
    came_back_then_fell = [(0, 0.30), (5, 0.20), (10, 0.31), (15, 0.2), (20, 0.19)]
    assert collapse_verdict(STEPS, flat, came_back_then_fell).step == 15


def test_the_earlier_of_the_two_rules_dates_the_collapse():
    rewards = [0.4] * 10 + [0.05] * 10  # reward collapse at 13
    evals = [(0, 0.3), (10, 0.1), (20, 0.05)]  # held-out collapse at 10
    verdict = collapse_verdict(STEPS, rewards, evals)
    assert (verdict.step, verdict.reason) == (10, "heldout")


# ---- seed aggregation -------------------------------------------------------------------------------------
def test_seed_band_aligns_curves_by_step_and_skips_missing_values():
    band = seed_band([[(1, 0.1), (2, 0.3)], [(1, 0.3), (2, 0.5), (3, 0.7)], [(2, None), (3, float("nan"))]])
    assert band.steps == [1, 2, 3]
    assert band.mean == pytest.approx([0.2, 0.4, 0.7])
    assert band.std == pytest.approx([math.sqrt(0.02), math.sqrt(0.02), 0.0])
    assert band.low == pytest.approx([0.1, 0.3, 0.7]) and band.high == pytest.approx([0.3, 0.5, 0.7])
    assert band.seeds == [2, 2, 1]


def _fake_run(path, rewards, drift, evals, *, warmup=0, minibatches=4, clip_high_tok=0.02):
    """A run directory as the trainer writes it (metrics.jsonl, eval.jsonl, summary.json, config.yaml)."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, (r, d) in enumerate(zip(rewards, drift), start=1):
            row = {
                "step": i,
                "reward_mean": r,
                "expert_drift": d,
                "expert_drift_tokens_changed": 2 * d,
                "expert_drift_layer0": d / 2,
                "expert_drift_layer1": 1.5 * d,
                "clip_frac_low_tok": 0.01,
                "clip_frac_high_tok": clip_high_tok,
                "clip_frac_low_seq": 0.1,
                "clip_frac_high_seq": 0.2,
                "mismatch_kl": 1e-9,
                "routing_mismatch": 0.0,
            }
            f.write(json.dumps(row) + "\n")
    with open(path / "eval.jsonl", "w") as f:
        for step, acc in evals:
            f.write(json.dumps({"step": step, "eval_accuracy": acc}) + "\n")
    (path / "summary.json").write_text(
        json.dumps(
            {
                "eval_accuracy_before": evals[0][1],
                "steps": len(rewards),
                "eval_accuracy_after": evals[-1][1],
                "wall_seconds": 12.0,
            }
        )
    )
    (path / "config.yaml").write_text(
        yaml.safe_dump({"optim": {"warmup_steps": warmup}, "trainer": {"minibatches": minibatches}})
    )


def test_run_summary_and_seed_aggregation(tmp_path):
    up = [0.2, 0.3, 0.4, 0.5, 0.6, 0.6]
    # warm-up of 4 optimizer steps = the first RL step: its drift (0) stays out of the mean.
    _fake_run(tmp_path / "a", up, [0.0, 0.02, 0.02, 0.04, 0.04, 0.02], [(0, 0.2), (6, 0.5)], warmup=4)
    row = summarise_run(tmp_path / "a")
    assert row["final_reward"] == pytest.approx((0.3 + 0.4 + 0.5 + 0.6 + 0.6) / 5)
    assert row["best_reward"] == pytest.approx(
        (0.3 + 0.4 + 0.5 + 0.6 + 0.6) / 5
    )  # best 5-step moving average
    assert row["expert_drift"] == pytest.approx(0.028) and row["tokens_changed"] == pytest.approx(0.056)
    assert row["eval_gain"] == pytest.approx(0.3) and row["verdict"].label() == "stable"
    _fake_run(tmp_path / "b", [0.4] * 10 + [0.0] * 10, [0.01] * 20, [(0, 0.2), (20, 0.1)])
    _fake_run(tmp_path / "c", up, [0.01] * 6, [(0, 0.2), (6, 0.4)])
    agg = summarise_variant([summarise_run(tmp_path / d) for d in "abc"])
    assert agg["collapsed"] == 1 and agg["runs"] == 3
    mean, std = agg["eval_after"]
    assert mean == pytest.approx((0.5 + 0.1 + 0.4) / 3)
    assert std == pytest.approx(math.sqrt(((0.5 - mean) ** 2 + (0.1 - mean) ** 2 + (0.4 - mean) ** 2) / 2))


def test_report_tables_and_figures(tmp_path):
    runs = {"gspo": {}, "grpo": {}}
    for seed in (1, 2):
        _fake_run(
            tmp_path / "gspo" / f"seed{seed}",
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
            [0.03] * 6,
            [(0, 0.2), (3, 0.3), (6, 0.4)],
            clip_high_tok=0.1 * seed,
        )
        runs["gspo"][seed] = tmp_path / "gspo" / f"seed{seed}"
        _fake_run(
            tmp_path / "grpo" / f"seed{seed}",
            [0.4] * 10 + [0.0] * 10,
            [0.05] * 20,
            [(0, 0.2), (10, 0.2), (20, 0.0)],
        )
        runs["grpo"][seed] = tmp_path / "grpo" / f"seed{seed}"
    report = write_report(tmp_path, runs, skipped=["grpo/seed3"], header=["HEADER LINE"]).read_text()
    assert "HEADER LINE" in report and "Not run (budget): grpo/seed3." in report
    assert report.splitlines()[0] == "# MoE RL stability: GSPO vs GRPO"  # the variants it holds, no others
    assert "| gspo | 2 | 0/2 | 0.400 ± 0.000 |" in report
    assert "| grpo | 2 | 2/2 |" in report
    assert "| 1.50e-01 ± 7.1e-02 |" in report  # clip high tok over seeds: 0.1 and 0.2
    assert "| grpo | 1 | collapsed@13 (reward) |" in report  # held-out only at 20: the reward rule is earlier
    assert "collapses" in report and "stays below it to the end" in report  # the rule is stated
    for name in (
        "reward",
        "heldout_accuracy",
        "expert_drift",
        "drift_per_layer",
        "clip_fractions",
        "train_inference_mismatch",
    ):
        assert f"(plots/{name}.png)" in report
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 5000
    # Strict JSON: metrics the runs did not log (here the per-rollout-batch drift) are null, not NaN.
    data = json.loads((tmp_path / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"JSON {c}"))
    assert data["gspo"]["aggregate"]["drift_rollout"] == [None, None]
    assert data["grpo"]["aggregate"]["collapsed"] == 2 and data["gspo"]["runs"]["1"]["verdict"] == "stable"


# ---- schedule -------------------------------------------------------------------------------------------
def test_seeds_are_a_count_or_a_list():
    assert parse_seeds("3", 1234) == [1234, 1235, 1236]
    assert parse_seeds("7,2", 1234) == [7, 2]
    for bad in ("0", "x", "1,1", "-1,"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad, 0)


def test_variants_set_algorithm_and_replay_and_r3_asks_servers_for_routes():
    local = load_run_config("examples/stability_moe.yaml")
    assert variant_overrides("grpo_r2", local) == [
        "loss.algorithm=grpo",
        "moe.routing_replay=r2",
        "rollout.old_logprobs=recompute",
    ]
    assert variant_overrides("grpo_r3", local) == ["loss.algorithm=grpo", "moe.routing_replay=r3"]
    sglang = load_run_config("examples/stability_moe.yaml", ["rollout.engine=sglang"])
    assert variant_overrides("grpo_r3", sglang)[2:] == ["sglang.return_routed_experts=true"]
    assert variant_overrides("gspo", sglang) == ["loss.algorithm=gspo", "moe.routing_replay=off"]
    asked = load_run_config("examples/stability_moe.yaml", ["rollout.engine=vllm", "vllm.capture_routes=true"])
    assert variant_overrides("grpo_r3", asked) == ["loss.algorithm=grpo", "moe.routing_replay=r3"]
    vllm = load_run_config("examples/stability_moe.yaml", ["rollout.engine=vllm"])
    with pytest.raises(ValueError, match="set vllm.capture_routes=true .CPU servers. or vllm.return_routed_experts"):
        variant_overrides("grpo_r3", vllm)
    with pytest.raises(ValueError, match="unknown stability variant 'dapo'"):
        variant_overrides("dapo", local)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_budget_stops_starting_runs_that_would_not_fit_and_reuse_costs_nothing(tmp_path):
    clock = _Clock()
    ran = []

    def runner(cfg):  # a 10-minute "run" that writes what the trainer would
        ran.append((cfg.loss.algorithm, cfg.moe["routing_replay"], cfg.trainer.seed))
        clock.now += 600
        run_dir = Path(cfg.trainer.run_dir)
        _fake_run(run_dir, [0.3] * 3, [0.01] * 3, [(0, 0.2), (3, 0.3)])
        dump_run_config(cfg, run_dir / "config.yaml")

    overrides = ["model.load=/nonexistent/sft", "trainer.steps=3"]
    result = run_stability(
        "examples/stability_moe.yaml",
        overrides,
        str(tmp_path / "out"),
        ["gspo", "grpo_r2"],
        seeds="2",
        budget_minutes=25,
        runner=runner,
        clock=clock,
    )
    # Seed-major: gspo/1234 at 0 min, grpo_r2/1234 at 10 (+10 <= 25), then 20 + 10 > 25: the rest is skipped.
    assert ran == [("gspo", "off", 1234), ("grpo", "r2", 1234)]
    assert result.skipped == ["gspo/seed1235", "grpo_r2/seed1235"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Not run (budget): gspo/seed1235, grpo_r2/seed1235." in report
    meta = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    assert [r["status"] for r in meta["runs"]] == ["ran", "ran", "skipped", "skipped"]
    # Again with a bigger budget: the finished runs are reused (no time), only the missing seed runs.
    ran.clear()
    result = run_stability(
        "examples/stability_moe.yaml",
        overrides,
        str(tmp_path / "out"),
        ["gspo", "grpo_r2"],
        seeds="2",
        budget_minutes=25,
        runner=runner,
        clock=clock,
        note="NOTE: what this setting is",
    )
    assert ran == [("gspo", "off", 1235), ("grpo", "r2", 1235)] and not result.skipped
    assert "NOTE: what this setting is" in (tmp_path / "out" / "report.md").read_text()
    with pytest.raises(ValueError, match="--budget-minutes=0 must be > 0"):
        run_stability(
            "examples/stability_moe.yaml", overrides, str(tmp_path / "x"), ["gspo"], budget_minutes=0
        )


def test_with_pi_old_from_the_engine_the_mismatch_is_the_first_minibatch_ratio(tmp_path):
    """rollout.old_logprobs=engine: the correction compares the engine's log-probs with themselves (KL 0, F(2) 0),
    which would read as "no mismatch"; the summary leaves them unmeasured and reports the first minibatch's KL."""
    run = tmp_path / "run"
    _fake_run(run, [0.3] * 6, [0.01] * 6, [(0, 0.2), (6, 0.3)])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    with open(run / "metrics.jsonl", "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({**r, "mismatch_kl": 0.0, "mismatch_frac_ratio_above_2": 0.0,
                                "mismatch_approx_kl": 1e-4 * (i + 1)}) + "\n")
    recompute = summarise_run(run)
    assert recompute["mismatch_kl"] == 0.0 and recompute["engine_ratio_kl"] == pytest.approx(3.5e-4)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "rollout": {"old_logprobs": "engine"}}))
    engine = summarise_run(run)
    assert math.isnan(engine["mismatch_kl"]) and math.isnan(engine["frac_ratio_above_2"])
    assert engine["engine_ratio_kl"] == pytest.approx(3.5e-4)


# ---- report of runs trained elsewhere (one cluster job per run) ------------------------------------------
def test_report_only_reports_the_finished_runs_it_finds_and_lists_the_rest(tmp_path, capsys):
    from megatron_gspo.cli.main import main

    for seed in (1, 2):
        _fake_run(tmp_path / "gspo" / f"seed{seed}", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.03] * 6, [(0, 0.2), (6, 0.4)])
    _fake_run(tmp_path / "grpo" / "seed1", [0.4] * 10 + [0.0] * 10, [0.05] * 20, [(0, 0.2), (20, 0.0)])
    (tmp_path / "grpo" / "seed2").mkdir()  # a job still running: no summary.json yet
    _fake_run(tmp_path / "notes" / "seed1", [0.1] * 6, [0.0] * 6, [(0, 0.1), (6, 0.1)])  # not a variant
    assert main(["stability", "--report-only", "--out", str(tmp_path)]) == 0  # report_from_runs, printed
    report = (tmp_path / "report.md").read_text()
    assert capsys.readouterr().out.strip() == report.strip()
    assert "Report of 3 finished run(s)" in report
    assert "Not reported (unfinished or not a variant): grpo/seed2, notes/seed1." in report
    assert "| gspo | 2 | 0/2 |" in report and "| grpo | 1 | 1/1 |" in report
    assert "| grpo | 1 | collapsed@13 (reward) |" in report


def test_report_only_without_runs_is_one_line(tmp_path, capsys):
    from megatron_gspo.cli.main import main

    (tmp_path / "empty").mkdir()
    assert main(["stability", "--report-only", "--out", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no finished run under" in err[0] and str(tmp_path / "empty") in err[0]
    assert main(["stability", "--report-only", "--out", str(tmp_path / "missing")]) == 2
    assert "is not a directory of stability runs" in capsys.readouterr().err
