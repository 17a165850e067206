"""DP-size invariance of the corrected losses with a real 2-process gloo run: a batch split across 2 ranks (each
rank its own corrections, the loss with the global divisors, gradients and losses all-reduced, metrics gathered and
combined, per staleness bucket too) equals the single-process batch, for each correction preset family."""

import pytest
import torch

from megatron_gspo.algorithms import combine_metrics
from tests.algorithms import dp_ranks
from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(dp_ranks.data_parallel_losses, world_size=2)


@pytest.mark.parametrize("case", dp_ranks.CASES, ids=lambda c: str(c))
def test_two_ranks_equal_one_process(ranks, case):
    theta, prox, behav, mask, adv = dp_ranks.batch(case[3])
    all_rows = list(range(len(dp_ranks.LENGTHS)))
    loss, metrics, correction = dp_ranks.loss_and_metrics(*case, all_rows, theta, prox, behav, mask, adv)
    (grad,) = torch.autograd.grad(loss, theta)
    assert grad.abs().sum() > 0
    if case[1] in ("gspo_geo_band", "grpo_icepop"):  # the masks drop something here, whatever the split
        assert correction.get("geo_mask_frac", correction["is_weight_frac_above"]) > 0
    for r in ranks:
        got = r[case]
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got["grad"], grad, rtol=1e-12, atol=1e-14)
        full = combine_metrics([metrics])  # the same reduction path, one part
        assert got["metrics"].keys() == full.keys()
        assert any(k.startswith("staleness_1/") for k in full)
        for key, value in full.items():
            torch.testing.assert_close(got["metrics"][key], value, rtol=1e-5, atol=1e-7, msg=key)
        for key, value in correction.items():
            torch.testing.assert_close(got["correction"][key], value, rtol=1e-5, atol=1e-7, msg=key)
