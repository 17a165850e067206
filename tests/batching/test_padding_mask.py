"""Pads stay out of the router (megatron-core 0.16 `padding_mask`): with router aux loss > 0, the same sequences
padded to a longer batch give the same load-balancing loss and the same gradients, router included, as without
any padding, in the RL update and in SFT, on one process and under TP=2 + sequence parallelism."""

import pytest
import torch

from megatron_gspo.batching.inputs import padding_mask, sequence_parallel_slice
from tests.batching.padding_ranks import INPUT, aux_grads
from tests.distributed import run_distributed

ROUTERS = [f"model.layers.{i}.mlp.gate.weight" for i in range(4)]
OTHERS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.experts.1.up_proj.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def unpadded():
    """The oracle: the sequences exactly as long as the batch (no pad position anywhere)."""
    return {kind: run_distributed(aux_grads, {}, INPUT, kind, world_size=1)[0] for kind in ("policy", "sft")}


@pytest.mark.parametrize("kind", ["policy", "sft"])
def test_padded_batch_has_the_aux_loss_and_gradients_of_the_unpadded_one(unpadded, kind):
    padded = run_distributed(aux_grads, {}, INPUT + 4, kind, world_size=1)[0]
    ref = unpadded[kind]
    assert ref["aux"] is not None and (ref["aux"] > 0).all()
    torch.testing.assert_close(padded["aux"], ref["aux"], atol=1e-7, rtol=1e-6)
    for key in ROUTERS + list(OTHERS):
        assert ref["grads"][key].abs().max() > 1e-6, key
        torch.testing.assert_close(padded["grads"][key], ref["grads"][key], atol=1e-7, rtol=1e-5, msg=key)


def test_the_aux_loss_reaches_the_router_gradient(unpadded):
    """Guards the test above: without the aux loss the router gradient is another one, so equal gradients there
    mean equal aux-loss gradients."""
    free = run_distributed(aux_grads, {}, INPUT, "policy", 0.0, world_size=1)[0]
    for key in ROUTERS:
        assert (free["grads"][key] - unpadded["policy"]["grads"][key]).abs().max() > 1e-5, key


def test_tensor_parallel_padded_batch_matches_the_unpadded_single_process(unpadded):
    ranks = run_distributed(aux_grads, {"tp": 2, "sequence_parallel": True}, INPUT + 4, "policy", world_size=2)
    for r in ranks:
        for key in ROUTERS + list(OTHERS):
            torch.testing.assert_close(r["grads"][key], unpadded["policy"]["grads"][key], atol=1e-7, rtol=1e-5,
                                       msg=key)


def test_padding_mask_marks_positions_after_the_last_input_token():
    tokens = torch.zeros(2, 7, dtype=torch.long)
    mask = padding_mask(tokens, torch.tensor([4, 6]))
    assert mask.tolist() == [[False] * 4 + [True] * 2, [False] * 6]
    assert padding_mask(tokens, None) is None
    # A later pipeline stage under sequence parallelism gets its TP rank's slice of the positions.
    assert sequence_parallel_slice(mask, 1, 2).tolist() == [[False, True, True], [False, False, False]]
    with pytest.raises(ValueError, match="does not split over 4"):
        sequence_parallel_slice(mask, 0, 4)
