"""The trainer's policy-gradient pass gives the full-minibatch gradient whatever the micro-batch size and the
data-parallel split (loss normalised by the global number of units), and it is not zero; also with the router's
load-balancing loss on (aux > 0, as in the Qwen3-30B recipes), for losses counting sequences and tokens."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.policy_ranks import policy_grads

KEYS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.gate.weight", "lm_head.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.3.mlp.gate.weight")
AUX = 0.1
# (algorithm, aux): GSPO and GRPO seq-mean-token-mean count sequences, GRPO token-mean counts tokens.
VARIANTS = [("gspo", 0.0), ("grpo", 0.0), ("gspo", AUX), ("grpo_token_mean", AUX)]
SINGLE = [(a, mbs, aux) for a, aux in VARIANTS for mbs in (8, 2)] + [("gspo", 4, 0.0), ("gspo_token", 4, 0.0),
                                                                    ("gspo_token_turns", 4, 0.0)]
DP = [(a, 2, aux) for a, aux in VARIANTS]


@pytest.fixture(scope="module")
def single():
    return run_distributed(policy_grads, {}, SINGLE, world_size=1)[0]


@pytest.fixture(scope="module")
def data_parallel():
    return run_distributed(policy_grads, {"ep": 2}, DP, world_size=2)


@pytest.mark.parametrize("algorithm, aux", VARIANTS)
def test_micro_batches_and_data_parallel_ranks_sum_to_the_full_batch(single, data_parallel, algorithm, aux):
    full, micro = single[(algorithm, 8, aux)], single[(algorithm, 2, aux)]
    assert full["metrics"]["num_sequences"] == 8
    for key in KEYS:
        assert full["grads"][key].abs().max() > 1e-6, key
        torch.testing.assert_close(micro["grads"][key], full["grads"][key], atol=1e-7, rtol=1e-5)
        for r in data_parallel:
            torch.testing.assert_close(r[(algorithm, 2, aux)]["grads"][key], full["grads"][key], atol=1e-7, rtol=1e-5)
    if algorithm == "gspo":
        # The shifted old policy makes the paper's narrow range clip some sequences but not all.
        frac = full["metrics"]["clip_frac_low_seq"] + full["metrics"]["clip_frac_high_seq"]
        assert 0 < frac < 1


def test_gspo_token_update_equals_gspo_update(single):
    """Paper Eq.13-17: with A_i,t = A_i, GSPO-token has GSPO's objective, clipping and gradient (through the
    trainer's per-token path vs GSPO's per-sequence-sums path)."""
    gspo = single[("gspo", 4, 0.0)]
    # gspo_token_turns: the advantages given per token (`extra['token_advantages_NS']`, as multi-turn per-turn
    # advantages are packed) with the row advantages zeroed: the forward step must train on the per-token ones.
    for token in (single[("gspo_token", 4, 0.0)], single[("gspo_token_turns", 4, 0.0)]):
        for key in KEYS:
            torch.testing.assert_close(token["grads"][key], gspo["grads"][key], atol=1e-7, rtol=1e-5)
        for key in ("clip_frac_low_seq", "clip_frac_high_seq", "seq_ratio_mean"):
            assert token["metrics"][key] == pytest.approx(gspo["metrics"][key], abs=1e-6)
