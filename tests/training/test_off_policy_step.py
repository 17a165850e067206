"""The trainer's off-policy path on 2 data-parallel ranks (real gloo, the real trainer): rollouts of mixed
staleness, a correction preset, loss.mask_truncated and DAPO's overlong penalty. The step metrics per staleness
bucket equal loops over what both ranks trained on; truncated rows trained with zero advantage; the penalty is
DAPO's."""

import pytest

from tests.distributed import run_distributed
from tests.training.off_policy_ranks import BUFFER, MAX_NEW, mixed_staleness_step

OVERRIDES = ["loss.algorithm=grpo", "rollout.correction.preset=grpo_icepop", "loss.mask_truncated=true",
             f"loss.overlong_buffer={BUFFER}"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(mixed_staleness_step, str(tmp_path_factory.mktemp("offp") / "run"), OVERRIDES,
                           world_size=2)


def _dapo(length):
    start = MAX_NEW - BUFFER
    return 0.0 if length <= start else (start - length) / BUFFER


def test_every_rank_reports_the_same_step(ranks):
    steady = [{k: v for k, v in r["metrics"].items() if not k.startswith(("time_", "tokens_per_s"))} for r in ranks]
    assert steady[0] == steady[1]


def test_overlong_penalty_is_added_to_the_reward(ranks):
    for r in ranks:
        seen = r["seen"]
        for raw, rewards, lens in zip(seen["raw_rewards"], seen["rewards"], seen["lens"]):
            for a, b, length in zip(raw.tolist(), rewards.tolist(), lens):
                assert b == pytest.approx(a + _dapo(length), abs=1e-6)
    metrics = ranks[0]["metrics"]
    lens = [n for r in ranks for batch in r["seen"]["lens"] for n in batch]
    assert metrics["overlong_penalty_mean"] == pytest.approx(sum(map(_dapo, lens)) / len(lens), abs=1e-6)
    assert metrics["overlong_penalized_frac"] == pytest.approx(sum(_dapo(n) < 0 for n in lens) / len(lens))


def test_truncated_rows_train_with_zero_advantage(ranks):
    trained = [r["seen"]["trained"][0] for r in ranks]
    truncated = sum(int(t["truncated_N"].sum()) for t in trained)
    total = sum(len(t["truncated_N"]) for t in trained)
    assert 0 < truncated < total
    for t in trained:
        assert (t["advantages_N"][t["truncated_N"]] == 0).all()
    assert any((t["advantages_N"][~t["truncated_N"]] != 0).any() for t in trained)
    assert ranks[0]["metrics"]["truncated_frac"] == pytest.approx(truncated / total)


def test_metrics_per_staleness_bucket_cover_both_ranks(ranks):
    metrics = ranks[0]["metrics"]
    trained = [r["seen"]["trained"][0] for r in ranks]
    buckets: dict = {}
    for t in trained:
        for version, reward, length, mask in zip(t["weight_version_N"].tolist(), t["rewards_N"].tolist(),
                                                 t["response_lens_N"].tolist(), t["loss_mask_NS"]):
            b = buckets.setdefault(0 - version, {"n": 0, "reward": 0.0, "length": 0, "tokens": 0})
            b["n"] += 1
            b["reward"] += reward
            b["length"] += length
            b["tokens"] += int(mask.sum())
    assert sorted(buckets) == [0, 1, 2]
    for s, b in buckets.items():
        key = f"staleness_{s}/"
        assert metrics[key + "samples"] == b["n"]
        assert metrics[key + "reward_mean"] == pytest.approx(b["reward"] / b["n"], abs=1e-6)
        assert metrics[key + "response_length"] == pytest.approx(b["length"] / b["n"], abs=1e-6)
        # The loss metrics of every minibatch and the train / rollout mismatch, per bucket.
        assert metrics[key + "num_sequences"] == b["n"]
        assert metrics[key + "num_tokens"] == b["tokens"]
        for name in ("clip_frac_low_tok", "clip_frac_high_seq", "seq_ratio_mean", "approx_kl", "mismatch_kl",
                     "mismatch_is_weight_mean", "mismatch_frac_ratio_above_2"):
            assert key + name in metrics, key + name
    assert sum(b["n"] for b in buckets.values()) == metrics["num_sequences"] == 8 * 4
    for name in ("mismatch_seq_weight_prod_mean", "mismatch_seq_weight_geo_mean", "mismatch_is_weight_frac_below"):
        assert name in metrics


def test_engine_logprobs_report_the_mismatch_per_bucket(tmp_path):
    """pi_old = the engine's log-probs: the mismatch is measured on the first minibatch, per staleness bucket too."""
    out = run_distributed(mixed_staleness_step, str(tmp_path / "engine"), ["rollout.old_logprobs=engine"],
                          world_size=1)[0]
    metrics = out["metrics"]
    versions = out["seen"]["trained"][0]["weight_version_N"].tolist()
    for s in sorted({-v for v in versions}):
        key = f"staleness_{s}/"
        assert metrics[key + "samples"] == sum(-v == s for v in versions)
        for name in ("mismatch_seq_ratio_mean", "mismatch_approx_kl", "clip_frac_high_seq", "reward_mean"):
            assert key + name in metrics, key + name
    assert not [k for k in metrics if k.endswith("/mismatch_kl")]  # no recompute pass: no k3 against it
