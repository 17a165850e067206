"""The trainer's policy-gradient pass gives the full-minibatch gradient whatever the micro-batch size and the
data-parallel split (loss normalised by the global number of sequences), and it is not zero."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.policy_ranks import policy_grads

KEYS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.gate.weight", "lm_head.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight")


@pytest.mark.parametrize("algorithm", ["gspo", "grpo"])
def test_micro_batches_and_data_parallel_ranks_sum_to_the_full_batch(algorithm):
    full = run_distributed(policy_grads, {}, algorithm, 8, world_size=1)[0]
    micro = run_distributed(policy_grads, {}, algorithm, 2, world_size=1)[0]
    dp = run_distributed(policy_grads, {"ep": 2}, algorithm, 2, world_size=2)
    assert full["metrics"]["num_sequences"] == 8
    for key in KEYS:
        assert full["grads"][key].abs().max() > 1e-6, key
        torch.testing.assert_close(micro["grads"][key], full["grads"][key], atol=1e-7, rtol=1e-5)
        for r in dp:
            torch.testing.assert_close(r["grads"][key], full["grads"][key], atol=1e-7, rtol=1e-5)
    if algorithm == "gspo":
        # The shifted old policy makes the paper's narrow range clip some sequences but not all.
        frac = full["metrics"]["clip_frac_low_seq"] + full["metrics"]["clip_frac_high_seq"]
        assert 0 < frac < 1


def test_gspo_token_update_equals_gspo_update():
    """Paper Eq.13-17: with A_i,t = A_i, GSPO-token has GSPO's objective, clipping and gradient (through the
    trainer's per-token path vs GSPO's per-sequence-sums path)."""
    gspo = run_distributed(policy_grads, {}, "gspo", 4, world_size=1)[0]
    token = run_distributed(policy_grads, {}, "gspo_token", 4, world_size=1)[0]
    for key in KEYS:
        torch.testing.assert_close(token["grads"][key], gspo["grads"][key], atol=1e-7, rtol=1e-5)
    for key in ("clip_frac_low_seq", "clip_frac_high_seq", "seq_ratio_mean"):
        assert token["metrics"][key] == pytest.approx(gspo["metrics"][key], abs=1e-6)
