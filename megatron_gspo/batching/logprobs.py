"""Log-probs of a micro-batch's response tokens from the last pipeline stage's output.

    logp_t = logits_t[y_t] / T - logsumexp(logits_t / T)          (REFERENCE.md §5; feeds GSPO Eq. 7)

Two paths (`trainer.logprob_path`):
- `fused` (default): the model returns its final hidden states (models/gpt.py); only the rows of response tokens
  are taken, and `kernels.linear_sequence_logprobs` computes their log-probs from those rows and the LM-head
  weight without materialising [tokens, vocab] logits. Prompt and padding rows never reach the LM-head GEMM.
- `logits` (the reference): megatron's output layer materialises logits for every position; the response rows
  of the logits go to `kernels.sequence_logprobs`.

Tensor parallelism: the decoder output is sequence-split over the TP ranks (sequence parallelism, required with
MoE). `gather_from_sequence_parallel_region` all-gathers it (forward) and reduce-scatters its gradient (backward);
the fused kernel's d hidden is each rank's partial sum d logits_local @ W_local (kernels/chunked_linear.py), so the
reduce-scatter sums the partials over the vocabulary shards -- what megatron's column-parallel output layer does
with its own input. Each rank uses its vocab shard of the weight without the padding rows (`valid_vocab_rows`);
the kernel combines (lse, target logit) over TP in one collective.

Legend: A response tokens, n sequences, S label columns, P positions per row, B rows, H hidden, V vocab rows.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megatron_gspo.batching.inputs import ModelInputs
from megatron_gspo.kernels import SequenceLogprobs, linear_sequence_logprobs, sequence_logprobs

LOGPROB_PATHS = ("fused", "logits")


def valid_vocab_rows(v_local: int, vocab_size: int) -> tuple[int, int]:
    """(first global id, number of real vocabulary rows) of this TP rank's shard of a padded vocabulary."""
    start = ps.get_tensor_model_parallel_rank() * v_local
    valid = max(0, min(v_local, vocab_size - start))
    if valid == 0:
        raise ValueError(f"TP rank holds vocabulary rows [{start}, {start + v_local}) past vocab_size={vocab_size}")
    return start, valid


def _tp_group():
    return ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None


def full_hidden_states(hidden_PBH: torch.Tensor, config) -> torch.Tensor:
    """The decoder output over all positions on every TP rank (gradient: the sum over TP ranks, scattered back)."""
    if config.sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden_PBH, tensor_parallel_output_grad=True)
    if ps.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.copy_to_tensor_model_parallel_region(hidden_PBH)
    return hidden_PBH


def response_logprobs(
    output: torch.Tensor, inputs: ModelInputs, gpt, *, path: str, vocab_size: int, temperature: float
) -> SequenceLogprobs:
    """Per-response-token log-probs [A] (in loss_mask order), per-sequence sums and counts [n].

    `output`: logits [B, P, V_local] (path "logits") or hidden states [P(/TP), B, H] (path "fused") of the
    model `gpt` (the unwrapped last-stage GPTModel) for `inputs`.
    """
    if path == "fused":
        hidden_PBH = full_hidden_states(output, gpt.config)
        hidden_AH = hidden_PBH.reshape(-1, hidden_PBH.shape[-1]).index_select(0, inputs.hidden_index_A)
        weight_VH = gpt.output_layer.weight
        start, valid = valid_vocab_rows(weight_VH.shape[0], vocab_size)
        return linear_sequence_logprobs(
            hidden_AH,
            weight_VH[:valid],
            inputs.targets_A,
            inputs.response_cu_B1,
            temperature=temperature,
            tp_group=_tp_group(),
            vocab_start_index=start,
        )
    if path == "logits":
        logits_AV = output.reshape(-1, output.shape[-1]).index_select(0, inputs.response_index_A)
        start, valid = valid_vocab_rows(output.shape[-1], vocab_size)
        return sequence_logprobs(
            logits_AV[:, :valid],
            inputs.targets_A,
            inputs.response_cu_B1,
            temperature=temperature,
            tp_group=_tp_group(),
            vocab_start_index=start,
        )
    raise ValueError(f"trainer.logprob_path={path!r} must be one of {LOGPROB_PATHS}")


def scatter_to_rows(token_A: torch.Tensor, loss_mask_NS: torch.Tensor) -> torch.Tensor:
    """Response-token values [A] (loss_mask_NS row-major order) as fp32 [n, S], 0 elsewhere (differentiable)."""
    out = torch.zeros(loss_mask_NS.shape, dtype=token_A.dtype, device=token_A.device)
    return out.masked_scatter(loss_mask_NS, token_A)


def token_logprobs_from_logits(
    logits_BSV: torch.Tensor, labels_BS: torch.Tensor, mask_BS: torch.Tensor, vocab_size: int, temperature: float
):
    """Per-token and per-sequence log-probs of `labels` from (vocab-parallel) LM-head logits.

    Uses the log-prob kernel (`megatron_gspo.kernels`): under TP each rank passes its vocabulary slice and the
    kernel combines (lse, target logit) in one collective. Vocabulary padding columns are cut off first so they
    never enter the softmax. Returns the kernel's `SequenceLogprobs` with token_logprobs reshaped to [B, S].
    """
    b, s, v_local = logits_BSV.shape
    tp = ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * v_local
    valid = max(0, min(v_local, vocab_size - start))
    logits_NV = logits_BSV.reshape(b * s, v_local)
    if valid < v_local:  # even a full-width slice puts a SliceBackward ([N, V] zeros + copy) under the grad
        logits_NV = logits_NV[:, :valid]
    cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=logits_BSV.device)
    out = sequence_logprobs(
        logits_NV,
        labels_BS.reshape(-1),
        cu_seqlens,
        mask_BS.reshape(-1),
        temperature=temperature,
        tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
        vocab_start_index=start,
    )
    return out._replace(token_logprobs=out.token_logprobs.reshape(b, s))
