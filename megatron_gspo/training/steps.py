"""The forward steps megatron's schedule calls per micro-batch (training/engine.py `forward_backward`): the model's
forward on a micro-batch's inputs (batching/inputs.py) and the reduction of its output to response-token log-probs
(batching/logprobs.py) and, in a policy update, to the policy loss (algorithms/).

Legend: N sequences, L = seq_len + 1 token columns, S = seq_len label columns (batching/batch.py).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps

from megatron_gspo.algorithms import by_staleness
from megatron_gspo.batching.batch import RolloutBatch
from megatron_gspo.batching.inputs import (
    ModelInputs,
    micro_batch_inputs,
    padding_mask,
    sequence_parallel_slice,
)
from megatron_gspo.batching.logprobs import response_logprobs, scatter_to_rows
from megatron_gspo.training.engine import unwrap


def _stage_padding_mask(mask_NS: torch.Tensor | None, model) -> torch.Tensor | None:
    """The mask a pipeline stage's GPTModel expects. Only the first stage scatters the mask over the sequence-
    parallel ranks (megatron-core 0.16 `_preprocess`); later stages receive their TP rank's slice of the sequence
    from the previous stage, so they are given the same slice of the mask."""
    if mask_NS is None:
        return None
    gpt = unwrap(model)
    if gpt.pre_process or not gpt.config.sequence_parallel:
        return mask_NS
    return sequence_parallel_slice(
        mask_NS, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    )


def model_forward(model, tokens_NL: torch.Tensor, input_lens_N: torch.Tensor | None):
    """The model's forward on padded rows (SFT; the RL passes use `forward_inputs`).

    Inputs are tokens_NL[:, :-1] with position ids 0..S-1 and the padding mask, all on the tokens' device (the
    model's, once the batch was moved there). Returns the model output (LM-head logits on the last stage).
    """
    ids_NS = tokens_NL[:, :-1]
    positions_NS = torch.arange(ids_NS.shape[1], device=ids_NS.device).unsqueeze(0).expand(ids_NS.shape[0], -1)
    mask_NS = _stage_padding_mask(padding_mask(tokens_NL, input_lens_N), model)
    return model(ids_NS, positions_NS, None, padding_mask=mask_NS)


def forward_inputs(model, inputs: ModelInputs, *, hidden_states: bool = False):
    """The model's forward on a micro-batch's `ModelInputs` (every RL training and old-log-prob forward).

    Packed inputs pass their THD `packed_seq_params`; `hidden_states=True` makes the last stage return the final
    hidden states [P(/TP), B, H] instead of logits [B, P, V_local] (models/gpt.py).
    """
    kwargs = {"padding_mask": _stage_padding_mask(inputs.padding_mask_BP, model)}
    if inputs.packed_seq_params is not None:
        kwargs["packed_seq_params"] = inputs.packed_seq_params
    if hidden_states:
        kwargs["output_hidden_states"] = True
    return model(inputs.input_ids_BP, inputs.position_ids_BP, None, **kwargs)


def policy_units(loss_fn):
    """`units_of(micro_batch)` of a policy loss: its loss tokens (GRPO token-mean) or its sequences (all others)."""
    if getattr(loss_fn, "aggregation", None) == "token-mean":
        return lambda mb: int(mb.loss_mask_NS.sum())
    return lambda mb: mb.num_sequences


def policy_forward_step(
    loss_fn,
    vocab_size: int,
    temperature: float,
    before_forward=None,
    *,
    logprob_path: str = "logits",
    consumer_version: int | None = None,
):
    """The forward step megatron's schedule calls per micro-batch during a policy update.

    Its loss function returns (sum of per-unit losses, number of units, metrics), the unit being what the
    objective averages over: sequences (GSPO, GSPO-token, GRPO seq-mean-token-mean) or tokens (GRPO token-mean).
    With `calculate_per_token_loss` megatron divides the gradient by the global number of units, so the update is
    exactly that of the full minibatch's mean loss (training/engine.py). `before_forward(mb)` runs right before
    each micro-batch's model forward (routing replay selects that micro-batch's routes there). `logprob_path`:
    fused (hidden states -> response-token log-probs) or logits (batching/logprobs.py). With `consumer_version`
    (the weight version being trained) and rows that carry their weight version, the loss metrics are also
    reported per staleness bucket (algorithms/staleness.py), from the same log-probs, detached.
    """
    units_of = policy_units(loss_fn)

    def forward_step(mb: RolloutBatch, model):
        inputs = micro_batch_inputs(mb)
        if before_forward is not None:
            before_forward(mb)
        out = forward_inputs(model, inputs, hidden_states=logprob_path == "fused")

        def reduce(output):
            lp = response_logprobs(
                output, inputs, unwrap(model), path=logprob_path, vocab_size=vocab_size, temperature=temperature
            )
            if loss_fn.sequence_level:
                old_sum = (mb.old_logprobs_NS * mb.loss_mask_NS).sum(-1)
                call, args = loss_fn.from_sums, (lp.seq_sum, old_sum, lp.seq_count, mb.advantages_N)
                kwargs = {"num_sequences": 1}
            else:
                # Multi-turn per-turn advantages (A_i,t, Eq.13-14) where the batch has them, else A_i per row.
                adv = mb.extra.get("token_advantages_NS", mb.advantages_N)
                if mb.extra.get("token_weights_NS") is not None:
                    adv = (adv if adv.dim() == 2 else adv[:, None]) * mb.extra["token_weights_NS"]
                token_NS = scatter_to_rows(lp.token_logprobs, mb.loss_mask_NS)
                call, args = loss_fn, (token_NS, mb.old_logprobs_NS, adv, mb.loss_mask_NS)
                kwargs = {"num_sequences": 1, "num_tokens": 1}

            def loss_of(rows=slice(None), detach=False):
                # args[0] holds the differentiable log-probs; a metrics-only pass (staleness buckets) detaches them.
                first = args[0].detach() if detach else args[0]
                return call(first[rows], *(a[rows] for a in args[1:]), **kwargs)

            res = loss_of()
            metrics = {k: v.detach() for k, v in res.metrics.items()}
            if consumer_version is not None and mb.weight_version_N is not None:
                with torch.no_grad():
                    metrics.update(by_staleness(consumer_version - mb.weight_version_N,
                                                lambda rows: loss_of(rows, detach=True).metrics, whole=metrics))
            units = torch.tensor(units_of(mb), dtype=torch.int, device=mb.tokens_NL.device)
            return res.loss, units, metrics

        return out, reduce

    return forward_step


def logprob_forward_step(vocab_size: int, temperature: float, before_forward=None, *, logprob_path: str = "logits"):
    """The forward-only step of the old-policy (and drift) pass: per-token log-probs [n, S] of each micro-batch
    (no autograd: the fused path then keeps no hidden states, lse or logits)."""
    def forward_step(mb: RolloutBatch, model):
        inputs = micro_batch_inputs(mb)
        if before_forward is not None:
            before_forward(mb)
        out = forward_inputs(model, inputs, hidden_states=logprob_path == "fused")

        def reduce(output):
            lp = response_logprobs(
                output, inputs, unwrap(model), path=logprob_path, vocab_size=vocab_size, temperature=temperature
            )
            token_NS = scatter_to_rows(lp.token_logprobs.detach(), mb.loss_mask_NS)
            return output.sum() * 0.0, {"token_logprobs": token_NS}

        return out, reduce

    return forward_step
