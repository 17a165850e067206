"""The stability report: collapse detection and the table/plots from hand-written run directories."""

import json

import pytest

from megatron_gspo.training.stability_benchmark import steps_to_collapse, summarise, write_report


def test_collapse_is_detected_only_after_a_real_drop():
    assert steps_to_collapse([0.2] * 10 + [0.5] * 10) is None
    rewards = [0.4] * 10 + [0.05] * 10
    step = steps_to_collapse(rewards)
    assert step is not None and 10 < step <= 15
    assert steps_to_collapse([0.02, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0]) is None  # never learned: no collapse


def _fake_run(path, rewards, drift):
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for i, (r, d) in enumerate(zip(rewards, drift), start=1):
            f.write(json.dumps({"step": i, "reward_mean": r, "expert_drift": d, "expert_drift_tokens_changed": 2 * d,
                                "clip_frac_low_tok": 0.01, "clip_frac_high_tok": 0.02, "clip_frac_low_seq": 0.1,
                                "clip_frac_high_seq": 0.2, "seq_ratio_mean": 1.0, "approx_kl": 1e-4}) + "\n")
    (path / "summary.json").write_text(json.dumps({"eval_accuracy_before": 0.2, "eval_accuracy_after": 0.4,
                                                   "wall_seconds": 12.0}))


def test_report_table_and_plots(tmp_path):
    _fake_run(tmp_path / "gspo", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.1] * 6)
    _fake_run(tmp_path / "grpo", [0.1, 0.2, 0.1, 0.2, 0.1, 0.2], [0.3] * 6)
    row = summarise(tmp_path / "gspo")
    assert row["final_reward"] == pytest.approx(sum([0.2, 0.3, 0.4, 0.5, 0.6]) / 5)
    assert row["best_reward"] == 0.6 and row["expert_drift"] == pytest.approx(0.1)
    assert row["clip_seq"] == pytest.approx(0.3)
    report = write_report(tmp_path, ["gspo", "grpo"]).read_text()
    assert "| gspo | 0.400 | 0.600 | 0.200 -> 0.400 | 0.1000 |" in report
    assert "| grpo |" in report
    for name in ("reward", "expert_drift", "clip_fraction", "sequence_ratio", "kl"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
