"""Step metrics cover the whole rollout batch on 2 data-parallel ranks: the train / rollout mismatch, expert
drift and routing mismatch equal the combination of both ranks' shares (not rank 0's), reward errors and dropped
groups count every scoring round of every rank, and a skipped minibatch step is counted, not averaged in."""

import math

import pytest
import torch

from megatron_gspo.algorithms import combine_metrics
from tests.distributed import run_distributed
from tests.training.trainer_ranks import data_parallel_step_metrics


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(data_parallel_step_metrics, str(tmp_path_factory.mktemp("dp") / "run"), world_size=2)


def test_every_rank_reports_the_same_step(ranks):
    steady = [{k: v for k, v in r["metrics"].items() if not k.startswith(("time_", "tokens_per_s"))} for r in ranks]
    assert steady[0] == steady[1]


def test_mismatch_is_the_combination_of_both_ranks_shares(ranks):
    metrics = ranks[0]["metrics"]
    shares = [r["local"]["mismatch"][0] for r in ranks]
    assert shares[0]["num_tokens"] != metrics["mismatch_num_tokens"]
    expected = combine_metrics([{k: torch.tensor(v) for k, v in s.items()} for s in shares])
    for key, value in expected.items():
        name = key if key.startswith("mismatch") else f"mismatch_{key}"
        assert metrics[name] == pytest.approx(float(value), rel=1e-6, abs=1e-12), name


@pytest.mark.parametrize("prefix", ["expert_drift", "routing_mismatch"])
def test_route_statistics_combine_both_ranks_tokens(ranks, prefix):
    metrics = ranks[0]["metrics"]
    shares = [next(d for d in r["local"]["drift"] if prefix in d) for r in ranks]
    n = [s[f"{prefix}_num_tokens"] for s in shares]
    assert min(n) > 0 and metrics[f"{prefix}_num_tokens"] == sum(n)
    layers = [k for k in shares[0] if k.startswith(f"{prefix}_layer")]
    assert len(layers) == 4
    for key in layers + [k.replace("_layer", "_tokens_changed_layer") for k in layers] + [f"{prefix}_tokens_changed"]:
        # Per layer the drift is 1 - overlap / (k * tokens): token-weighted over the ranks' shares.
        assert metrics[key] == pytest.approx(sum(s[key] * c for s, c in zip(shares, n)) / sum(n), abs=1e-12), key
    assert metrics[prefix] == pytest.approx(sum(metrics[k] for k in layers) / len(layers), abs=1e-12)


def test_reward_errors_and_dropped_groups_count_every_round_of_every_rank(ranks):
    metrics = ranks[0]["metrics"]
    errors = [sum(s["errors"] for s in r["local"]["scores"]) for r in ranks]
    assert max(len(r["local"]["scores"]) for r in ranks) > 1, "no top-up round: the test checks nothing"
    assert any(s["errors"] > 0 for r in ranks for s in r["local"]["scores"][1:])
    assert metrics["reward_errors"] == sum(errors)
    dropped = kept_flat = 0
    for r in ranks:
        flat = sum(int((s["rewards"].amax(-1) == s["rewards"].amin(-1)).sum()) for s in r["local"]["scores"])
        informative = sum(len(s["rewards"]) for s in r["local"]["scores"]) - flat
        kept_flat += r["want"] - informative
        dropped += flat - (r["want"] - informative)
    assert metrics["groups_dropped"] == dropped and metrics["groups_zero_variance_kept"] == kept_flat


def test_a_skipped_minibatch_step_is_counted_not_averaged(ranks):
    metrics = ranks[0]["metrics"]
    norms = ranks[0]["local"]["norms"]
    assert len(norms) == 3 and all(math.isfinite(x) for x in norms) and max(norms) > 0
    assert metrics["skipped_steps"] == 1
    assert metrics["grad_norm"] == pytest.approx(sum(norms) / 3, rel=1e-9)
