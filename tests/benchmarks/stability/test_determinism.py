"""Determinism on CPU: the same seed and config give bitwise-identical metrics, so that an A/B difference of the
stability benchmark is the algorithm's and not the run's (issue 29). The two runs go one after another in one
fresh interpreter, as the benchmark runs them (state one run leaves behind would show as a difference)."""

import math

import pytest

from tests.benchmarks.stability.determinism_ranks import metrics_of_runs
from tests.distributed import run_distributed
from tests.training.test_end_to_end import MINI, VOLATILE

# GRPO with the engine in bf16 beside the fp32 trainer: sampling, the hf replica and its weight syncs, the
# mismatch metrics, routing statistics and K = 2 optimizer steps per rollout batch all take part.
OVERRIDES = [*MINI, "trainer.steps=2", "trainer.minibatches=2", "trainer.save_final=false", "loss.algorithm=grpo",
             "rollout.local.dtype=bf16", "eval.max_prompts=4", "eval.n=1",
             "data.reward=tests.training.rewards:contains_one"]  # rewards that vary from the first step: updates


def _values(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "wall_seconds"} for r in rows]


def _same(a, b) -> bool:
    """Bitwise equality of two metric rows (NaN equals NaN: the same computation gave it)."""
    if a.keys() != b.keys():
        return False
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in
               ((a[k], b[k]) for k in a))


@pytest.mark.slow
def test_same_seed_and_config_give_bitwise_identical_metrics(tmp_path):
    first, again = run_distributed(metrics_of_runs, str(tmp_path), OVERRIDES, [7, 7], world_size=1,
                                   start_method="spawn")[0]
    a, b = _values(first), _values(again)
    assert len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b)), [
        (k, x[k], y[k]) for x, y in zip(a, b) for k in x if x[k] != y.get(k)
    ][:5]
    assert a[0]["mismatch_kl"] > 0 and "routing_mismatch" in a[0]  # the engine is not the trainer here
    # Not a comparison of constants: the two steps' metrics differ (the second trains on other samples).
    assert [r["step"] for r in a[:2]] == [1, 2] and 0 < a[0]["grad_norm"] != a[1]["grad_norm"]


@pytest.mark.slow
def test_the_rollout_batch_drift_forward_changes_no_training_metric(tmp_path):
    """`megatron-gspo stability` turns moe.drift_rollout on (benchmark.plan_runs: its report's drift per rollout
    batch) where the screen and the 3-seed passes ran without it: the extra forward after the last optimizer step
    must leave the run itself bitwise the same, or the default would not reproduce the committed rows."""
    runs = run_distributed(metrics_of_runs, str(tmp_path), OVERRIDES, [7, 7],
                           [["moe.drift_rollout=false"], ["moe.drift_rollout=true"]], world_size=1,
                           start_method="spawn")[0]
    off, on = _values(runs[0]), _values(runs[1])
    added = [k for k in on[0] if k not in off[0]]
    assert added and all(k.startswith("expert_drift_rollout") for k in added)
    on = [{k: v for k, v in r.items() if k in off[i]} for i, r in enumerate(on)]
    assert len(off) == len(on) and all(_same(x, y) for x, y in zip(off, on)), [
        (k, x[k], y[k]) for x, y in zip(off, on) for k in x if x[k] != y.get(k)
    ][:5]
