"""A trainer checkpoint resumes in another layout (2 gloo ranks): saved with TP=2 (DP=1) and resumed with DP=2,
saved with EP=2 and resumed with EP=1, saved with PP=2 and resumed with PP=1 (DP=2); with the plain optimizer too, TP=2
to DP=2.

The resumed state is the saved one, gathered to one layout: weights, fp32 master weights and Adam moments
(bit-equal: resharding moves values, it does not compute them), Adam's step, the LR schedule and the sampler
position. The next optimizer step on the same rollout batch gives the loss metrics, grad norm and weights that
continuing in the original layout gives, to fp32 rounding of the other layout's reductions. The resume says in
one line what changed.
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.resume_layout_ranks import resume_in_other_layouts

PLAIN = {"optim.distributed": False}
PAIRS = {
    "tp2_to_dp2": (dict(tp=2, sequence_parallel=True), {}),
    "ep2_to_ep1": (dict(ep=2), {}),
    "pp2_to_pp1": (dict(pp=2), {}),
    # The plain optimizer (optim.distributed=false: every DP rank holds the whole state) reshards over TP too; an
    # EP change is refused for it (tests/lifecycle/test_run_dir.py).
    "plain_tp2_to_dp2": (dict(tp=2, sequence_parallel=True, **PLAIN), PLAIN),
}
CHANGED = {"tp2_to_dp2": "tp 2 -> 1", "ep2_to_ep1": "ep 2 -> 1", "pp2_to_pp1": "pp 2 -> 1", "plain_tp2_to_dp2": "tp 2 -> 1"}
LOSS_METRICS = ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max", "approx_kl", "num_sequences", "num_tokens")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(resume_in_other_layouts, str(tmp_path_factory.mktemp("layouts")), PAIRS, world_size=2,
                           timeout=900)


def _combined(ranks: list, which: str) -> dict:
    from megatron_gspo.algorithms import combine_metrics

    parts = [r[which]["parts"] for r in ranks if r[which]["parts"] is not None]
    return {k: float(v) for k, v in combine_metrics(parts).items()}


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_resumed_state_is_the_saved_state(results, pair):
    for rank in results:
        saved, resumed = rank[pair]["saved"], rank[pair]["resumed"]
        assert resumed["step"] == saved["step"] == 1
        assert resumed["sampler"] == saved["sampler"] and saved["sampler"]["position"] > 0
        assert resumed["scheduler"] == saved["scheduler"] and resumed["lr"] == saved["lr"] > 0
        assert resumed["optimizer"]["step"] == saved["optimizer"]["step"] == [1]
        for name, value in saved["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert any(v.abs().max() > 0 for v in saved["optimizer"][key].values()), key
            for name, value in saved["optimizer"][key].items():
                assert torch.equal(resumed["optimizer"][key][name], value), (key, name)
    changed = [line for line in results[0][pair]["log"] if "layout changed" in line]
    assert len(changed) == 1 and CHANGED[pair] in changed[0], results[0][pair]["log"]


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_next_step_after_the_resume_equals_continuing_in_the_saved_layout(results, pair):
    ranks = [r[pair] for r in results]
    continued, resumed = _combined(ranks, "continued"), _combined(ranks, "after_resume")
    for key in LOSS_METRICS:
        assert resumed[key] == pytest.approx(continued[key], rel=1e-5, abs=1e-7), key
    for r in ranks:
        assert r["after_resume"]["skipped"] == r["continued"]["skipped"] == 0
        assert r["after_resume"]["grad_norm"] == pytest.approx(r["continued"]["grad_norm"], rel=1e-5)
        moved = max((r["continued"]["weights"][k] - v).abs().max().item() for k, v in r["saved"]["weights"].items())
        assert moved > 1e-4
        worst = max((r["after_resume"]["weights"][k] - v).abs().max().item() for k, v in r["continued"]["weights"].items())
        assert worst < 1e-6, worst
