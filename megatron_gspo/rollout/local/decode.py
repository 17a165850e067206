"""The backend-independent part of local generation: batch planning and the batched prefill + decode loop.

A backend is a `Stepper` (Megatron with its static inference context, or a transformers replica with its
DynamicCache). The loop is the same for both, so both return identical data structures.

Legend: U = unique prompts in a batch, B = sample rows, A = rows still generating, L = prompt length,
N = max new tokens, X = MoE layers, K = experts per token (top-k), V = vocabulary.

How a batch runs:
1. Every prompt of a batch has the same length L (prompts are bucketed by length), so no position is padding:
   nothing is masked and no pad token is ever fed, attended to, sampled or returned.
2. Prefill runs once per *unique* prompt ([U, L]); the KV cache rows are then copied to the n samples of each
   prompt ([B, ...]), so a group of n samples costs one prefill.
3. Decode feeds the last sampled token of every active row ([A, 1]). A row that produces a stop token is
   finished: it leaves the batch (its KV-cache row is dropped) and its response stops growing. The batch ends
   when no row is active or after max_new_tokens.
Outputs are written into preallocated [B, ...] buffers by row index; there is no Python loop over samples
inside the decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_gspo.rollout.local.sampling import sample_tokens
from megatron_gspo.rollout.types import Rollout, SamplingParams


class Stepper(Protocol):
    """One backend's forward passes over a batch with a KV cache (created by `prefill`)."""

    def prefill(self, ids_UL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encodes the prompts: (last-position logits [U, V>=vocab], top-k expert ids [U, L, X, K] or None)."""
        ...

    def select_rows(self, index_R: torch.Tensor) -> None:
        """Rebuilds the cache batch: new row i = old row index_R[i] (repeats expand, omissions drop)."""
        ...

    def decode(self, tokens_A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feeds one token per active row: (logits [A, V>=vocab], top-k expert ids [A, X, K] or None)."""
        ...


@dataclass
class BatchPlan:
    """Rows of one forward batch: `counts[j]` samples of prompt `prompt_indices[j]`, all prompts equally long."""

    prompt_indices: list[int]
    counts: list[int]

    @property
    def rows(self) -> int:
        return sum(self.counts)


def plan_batches(prompts: list[list[int]], n: int, max_batch_size: int) -> list[BatchPlan]:
    """Buckets the n * len(prompts) sample rows by prompt length, in prompt order, at most `max_batch_size` rows
    per batch. A prompt's n samples stay in one batch when they fit, else they continue in the next one."""
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    plans: list[BatchPlan] = []
    for indices in by_length.values():
        current = BatchPlan([], [])
        for i in indices:
            left = n
            while left:
                room = max_batch_size - current.rows
                if room == 0:
                    plans.append(current)
                    current = BatchPlan([], [])
                    room = max_batch_size
                take = min(left, room)
                current.prompt_indices.append(i)
                current.counts.append(take)
                left -= take
        if current.rows:
            plans.append(current)
    return plans


@torch.no_grad()
def generate_batch(
    stepper: Stepper,
    prompts: list[list[int]],
    plan: BatchPlan,
    sampling: SamplingParams,
    *,
    vocab_size: int,
    expert_dtype: torch.dtype,
    generator: torch.Generator,
    device: torch.device,
    fill_id: int = 0,
) -> list[Rollout]:
    """Generates the rows of `plan` (samples of one prompt contiguous); weight_version is left to the caller."""
    ids_UL = torch.tensor([prompts[i] for i in plan.prompt_indices], dtype=torch.long, device=device)
    counts_U = torch.tensor(plan.counts, dtype=torch.long, device=device)
    length = ids_UL.shape[1]
    max_new = sampling.max_new_tokens
    rows = plan.rows
    stop_ids = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=device)

    logits_UV, experts_ULXK = stepper.prefill(ids_UL)
    source_B = torch.repeat_interleave(torch.arange(len(plan.counts), device=device), counts_U)
    stepper.select_rows(source_B)
    logits_AV = logits_UV[source_B]

    tokens_BN = torch.full((rows, max_new), fill_id, dtype=torch.long, device=device)
    logprobs_BN = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
    lengths_B = torch.zeros(rows, dtype=torch.long, device=device)
    experts_BTXK = None
    if experts_ULXK is not None:
        x, k = experts_ULXK.shape[-2:]
        experts_BTXK = torch.zeros((rows, length + max_new - 1, x, k), dtype=expert_dtype, device=device)
        experts_BTXK[:, :length] = experts_ULXK[source_B].to(expert_dtype)

    active_A = torch.arange(rows, device=device)
    for step in range(max_new):
        tok_A, logp_A = sample_tokens(
            logits_AV[:, :vocab_size],
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            generator=generator,
        )
        tokens_BN[active_A, step] = tok_A
        logprobs_BN[active_A, step] = logp_A
        lengths_B[active_A] = step + 1
        if step == max_new - 1:
            break
        going_A = ~torch.isin(tok_A, stop_ids) if stop_ids.numel() else None
        if going_A is not None and not bool(going_A.all()):
            if not bool(going_A.any()):
                break
            keep = going_A.nonzero().squeeze(-1)
            stepper.select_rows(keep)
            active_A, tok_A = active_A[keep], tok_A[keep]
        logits_AV, experts_AXK = stepper.decode(tok_A)
        if experts_BTXK is not None:
            experts_BTXK[active_A, length + step] = experts_AXK.to(expert_dtype)

    return _to_rollouts(prompts, plan, tokens_BN, logprobs_BN, lengths_B, experts_BTXK, stop_ids, length)


def _to_rollouts(
    prompts, plan, tokens_BN, logprobs_BN, lengths_B, experts_BTXK, stop_ids, length
) -> list[Rollout]:
    tokens, logprobs, lengths = tokens_BN.cpu().tolist(), logprobs_BN.cpu().tolist(), lengths_B.cpu().tolist()
    stops = set(stop_ids.cpu().tolist())
    experts = experts_BTXK.cpu() if experts_BTXK is not None else None
    out: list[Rollout] = []
    row = 0
    for prompt_index, count in zip(plan.prompt_indices, plan.counts):
        for _ in range(count):
            n = lengths[row]
            response = tokens[row][:n]
            out.append(
                Rollout(
                    prompt_ids=list(prompts[prompt_index]),
                    response_ids=response,
                    logprobs=logprobs[row][:n],
                    finish_reason="stop" if response[-1] in stops else "length",
                    prompt_index=prompt_index,
                    # rows are tokens fed to the model: the prompt and every response token but the last
                    routed_experts=experts[row, : length + n - 1].clone() if experts is not None else None,
                )
            )
            row += 1
    return out
