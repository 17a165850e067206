"""The MoE load-balancing (aux) loss gradient of the trainer's policy pass follows megatron's semantics: the mean
over micro-batches (and data-parallel ranks) of each micro-batch's aux loss, whatever the micro-batch size and
whether the loss counts sequences (GSPO) or tokens (GRPO token-mean).

The expected value is computed here, independently of megatron and of our router, from the Switch Transformer
load-balancing loss (Fedus et al. 2021, Eq. 4-6, top-k form): for a micro-batch of T tokens with router
probabilities p_t = softmax(x_t W^T) over E experts and top-k routing, f_i = (tokens routed to i) / (T k),
P_i = (1/T) sum_t p_t,i, aux = coef * E * sum_i f_i P_i, with f_i constant (no gradient through the top-k).
"""

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.aux_loss_ranks import COEF, LAST_ROUTER, aux_gradients

CASES = [(algorithm, mbs) for algorithm in ("gspo", "grpo_token_mean") for mbs in (1, 2, 8)]


def expected_router_grad(weight: torch.Tensor, micro_inputs: list[torch.Tensor], topk: int) -> torch.Tensor:
    """d/dW of (1/M) sum_m aux_m for the router weight W [E, H] and the router inputs x_m [T_m, H]."""
    w = weight.double().requires_grad_(True)
    num_experts = w.shape[0]
    total = 0.0
    for x in micro_inputs:
        probs = torch.softmax(x.double() @ w.T, dim=-1)  # [T, E]
        chosen = probs.detach().topk(topk, dim=-1).indices
        counts = torch.zeros(num_experts, dtype=torch.float64).scatter_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=torch.float64)
        )
        tokens = x.shape[0]
        f = counts / (tokens * topk)
        p = probs.sum(0) / tokens
        total = total + COEF * num_experts * (f * p).sum()
    (total / len(micro_inputs)).backward()
    return w.grad.float()


@pytest.fixture(scope="module")
def runs():
    return {
        "random": run_distributed(aux_gradients, CASES, world_size=1)[0],
        "identical": run_distributed(aux_gradients, [("gspo", 1), ("gspo", 8), ("grpo_token_mean", 2)],
                                     identical_rows=True, world_size=1)[0],
    }


@pytest.mark.parametrize("algorithm, mbs", CASES)
def test_aux_gradient_is_the_mean_over_micro_batches(runs, algorithm, mbs):
    out = runs["random"]
    micro = out["inputs"][(algorithm, mbs)]
    assert len(micro) == 8 // mbs and micro[0].shape[0] == mbs * 12  # micro-batches of mbs rows of SEQ tokens
    expected = expected_router_grad(out["router_weight"], micro, out["topk"])
    got = out["aux"][(algorithm, mbs)][LAST_ROUTER]
    assert expected.abs().max() > 1e-4
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-7)


def test_aux_gradient_does_not_depend_on_the_loss_unit(runs):
    aux = runs["random"]["aux"]
    for mbs in (1, 2, 8):
        for name, value in aux[("gspo", mbs)].items():
            torch.testing.assert_close(aux[("grpo_token_mean", mbs)][name], value, rtol=1e-4, atol=1e-8, msg=name)


def test_same_statistics_per_micro_batch_give_the_same_aux_gradient_for_any_micro_batch_size(runs):
    """With every row the same sequence each micro-batch has the same aux loss, so the mean over micro-batches (and
    its gradient on every router, through every layer) is the same for micro-batch sizes 1 and 8 and both units."""
    aux = runs["identical"]["aux"]
    ref = aux[("gspo", 1)]
    assert all(v.abs().max() > 1e-5 for v in ref.values())
    for case in (("gspo", 8), ("grpo_token_mean", 2)):
        for name, value in ref.items():
            torch.testing.assert_close(aux[case][name], value, rtol=1e-4, atol=1e-8, msg=f"{case}: {name}")
