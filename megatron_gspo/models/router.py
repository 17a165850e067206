"""The MoE router of our layer specs: megatron's TopKRouter with the load-balancing loss weighted for our losses.

Loss normalisation (training/engine.py): the loss functions return (sum of per-unit losses, number of units) and,
with `calculate_per_token_loss=True`, megatron divides every gradient by the global number of units U once all
micro-batches are done. The unit is what the objective averages over: sequences (GSPO, GSPO-token, GRPO
seq-mean-token-mean) or loss tokens (GRPO token-mean, SFT).

The auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021, Eq. 4-6, top-k form as in megatron's
`switch_load_balancing_loss_func`) of micro-batch m is aux_m = coef * E * sum_i f_i P_i over that micro-batch's
tokens. Megatron's intended gradient is that of the mean over micro-batches and data-parallel ranks,
coef-scaled: (1 / (M * DP)) * sum_m grad aux_m (its comment in `attach_and_log_load_balancing_loss`; its
non-per-token path does exactly this). Under `calculate_per_token_loss` megatron instead attaches aux_m * T_m, T_m
the tokens this router sees in the micro-batch (mbs * seq_len / TP under sequence parallelism), relying on U being
the same token count, which our units are not: with sequences as units the gradient would come out as
(seq_len / TP) * mean, with loss tokens as units as (all tokens / loss tokens) / TP * mean. This router attaches
aux_m * w with w = U / (M * DP) (set by `engine.forward_backward` from the units it is given; M * DP is the number of
micro-batches of all data-parallel ranks, summed when token-budget micro-batching gives ranks different counts),
so that after the division by U the gradient is the mean over micro-batches whatever the micro-batch size, the
unit or the layout.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from megatron.core.transformer.moe.router import TopKRouter


class MicroBatchMeanAuxRouter(TopKRouter):
    """TopKRouter whose load-balancing loss gradient is the mean over micro-batches and data-parallel ranks."""

    aux_loss_weight: float | None = None
    """w = U / (M * DP) of the current forward/backward (None outside one: a training forward with the aux loss
    enabled then raises instead of guessing the scale)."""

    def attach_and_log_load_balancing_loss(
        self,
        activation,
        aux_loss_coeff,
        aux_loss,
        aux_loss_name,
        reduce_group,
        reduce_group_has_dp=False,
        valid_token_count=None,
    ):
        """megatron's attach-and-log with the per-micro-batch weight w in place of its token count.

        With `calculate_per_token_loss` (always on here) megatron attaches `aux_loss * valid_token_count`; the
        tracker logging (aux_loss / coeff) is unchanged.
        """
        if self.aux_loss_weight is None:
            raise RuntimeError(
                "the MoE load-balancing loss is on (model.router_aux_loss_coef > 0) but this training forward does "
                "not know its weight: run it through training.engine.forward_backward(..., units_of=...)"
            )
        if not self.calculate_per_token_loss:
            raise RuntimeError("MicroBatchMeanAuxRouter needs TransformerConfig.calculate_per_token_loss=True")
        return super().attach_and_log_load_balancing_loss(
            activation,
            aux_loss_coeff,
            aux_loss,
            aux_loss_name,
            reduce_group,
            reduce_group_has_dp=reduce_group_has_dp,
            valid_token_count=self.aux_loss_weight,
        )


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _routers(chunk) -> list[MicroBatchMeanAuxRouter]:
    """The chunk's routers, found once: a walk over every module (~1000 in the tiny model) twice per minibatch
    update was a measurable part of a small RL step (tools/profile_step.py). Layer specs build them once; nothing
    adds or swaps routers later."""
    found = _ROUTERS.get(chunk)
    if found is None:
        found = _ROUTERS[chunk] = [m for m in chunk.modules() if isinstance(m, MicroBatchMeanAuxRouter)]
    return found


def set_aux_loss_weight(chunks: Iterable, weight: float | None) -> None:
    """Sets w on every MicroBatchMeanAuxRouter of the model chunks (None clears it)."""
    for chunk in chunks:
        for module in _routers(chunk):
            module.aux_loss_weight = weight
