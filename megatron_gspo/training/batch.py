"""Rollouts as padded training tensors, the model inputs of a padded micro-batch, and the per-token log-probs of
the model's LM-head output.

Legend: N sequences, L = seq_len + 1 token columns (inputs are tokens[:, :-1], labels tokens[:, 1:]), S = seq_len.
A label position t (0-based over S) is a response token when t >= len(prompt) - 1 and t < len(prompt) - 1 +
len(response): every generated token up to and including the first stop token counts; padding never does.
Input position t is a real token fed for a prediction when t < len(prompt) + len(response) - 1 (the last sampled
token predicts nothing); later positions are padding, kept out of the router's statistics (`model_forward`).

Devices: `pack_rollouts` builds the batch on the host (from Python lists); `RolloutBatch.to(device)` moves it to
the model's device once, and everything the forward passes make from it (position ids, padding mask, labels)
follows the tokens' device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_gspo.rollout.types import Rollout


@dataclass
class RolloutBatch:
    """A rollout batch (this data-parallel rank's share) in training layout."""

    tokens_NL: torch.Tensor
    """Prompt + response ids, right-padded with pad_id."""
    loss_mask_NS: torch.Tensor
    """True at label positions that are response tokens."""
    engine_logprobs_NS: torch.Tensor
    """The rollout engine's log-probs at response positions (0 elsewhere)."""
    rewards_N: torch.Tensor
    advantages_N: torch.Tensor
    old_logprobs_NS: torch.Tensor | None = None
    """Old-policy per-token log-probs (recomputed or the engine's)."""
    prompt_lens_N: torch.Tensor | None = None
    response_lens_N: torch.Tensor | None = None
    seq_index_N: torch.Tensor | None = None
    """Index of each row in the rollout batch (routing replay looks routes up by it)."""
    extra: dict = field(default_factory=dict)
    rollouts: list | None = None
    """The Rollout objects of the whole batch, in row order (not carried into sub-batches)."""

    @property
    def num_sequences(self) -> int:
        return self.tokens_NL.shape[0]

    @property
    def input_lens_N(self) -> torch.Tensor | None:
        """Input positions holding real tokens per row (prompt + response - 1); None when the lengths are unknown
        (every position then counts as a real token)."""
        if self.prompt_lens_N is None or self.response_lens_N is None:
            return None
        return self.prompt_lens_N + self.response_lens_N - 1

    def to(self, device: torch.device) -> RolloutBatch:
        """The batch with every tensor on `device` (the model's: `Runtime.device`); `rollouts` are kept."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return RolloutBatch(
            tokens_NL=move(self.tokens_NL),
            loss_mask_NS=move(self.loss_mask_NS),
            engine_logprobs_NS=move(self.engine_logprobs_NS),
            rewards_N=move(self.rewards_N),
            advantages_N=move(self.advantages_N),
            old_logprobs_NS=move(self.old_logprobs_NS),
            prompt_lens_N=move(self.prompt_lens_N),
            response_lens_N=move(self.response_lens_N),
            seq_index_N=move(self.seq_index_N),
            extra={k: move(v) for k, v in self.extra.items()},
            rollouts=self.rollouts,
        )

    def rows(self, idx: torch.Tensor | slice) -> RolloutBatch:
        """The sub-batch of the given rows (a minibatch or micro-batch)."""

        def pick(t):
            return None if t is None else t[idx]

        return RolloutBatch(
            tokens_NL=self.tokens_NL[idx],
            loss_mask_NS=self.loss_mask_NS[idx],
            engine_logprobs_NS=self.engine_logprobs_NS[idx],
            rewards_N=self.rewards_N[idx],
            advantages_N=self.advantages_N[idx],
            old_logprobs_NS=pick(self.old_logprobs_NS),
            prompt_lens_N=pick(self.prompt_lens_N),
            response_lens_N=pick(self.response_lens_N),
            seq_index_N=pick(self.seq_index_N),
            extra={k: v[idx] for k, v in self.extra.items()},
        )

    def split(self, parts: int) -> list[RolloutBatch]:
        """`parts` contiguous, equally sized pieces (N must be divisible)."""
        n = self.num_sequences
        if n % parts:
            raise ValueError(f"{n} sequences do not split into {parts} equal parts")
        size = n // parts
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(parts)]


def minibatch_group_order(num_informative: int, num_groups: int, minibatches: int, seed) -> list[int]:
    """The order of a rollout batch's groups, of which the first `num_informative` have reward variance (the rest
    zero advantage), such that the `minibatches` contiguous minibatches hold whole groups in a random order and
    the informative groups are dealt evenly over them (each minibatch gets floor or ceil of num_informative / K).

    Deterministic in `seed` (any value numpy's SeedSequence takes): every rank of a model-parallel group, which
    holds the same groups, gets the same order. When the groups do not divide into the minibatches (a group then
    spans two of them) the order is just a seeded permutation.
    """
    if not 0 <= num_informative <= num_groups:
        raise ValueError(f"num_informative={num_informative} must be in [0, num_groups={num_groups}]")
    perm = [int(i) for i in np.random.default_rng(seed).permutation(num_groups)]
    if num_groups % minibatches:
        return perm
    per = num_groups // minibatches
    slots: list[list[int]] = [[] for _ in range(minibatches)]
    informative = [i for i in perm if i < num_informative]
    for j, i in enumerate(informative):
        slots[j % minibatches].append(i)
    flat = iter(i for i in perm if i >= num_informative)
    for slot in slots:
        slot.extend(next(flat) for _ in range(per - len(slot)))
    return [i for slot in slots for i in slot]


def pack_rollouts(
    rollouts: list[Rollout], seq_len: int, pad_id: int, rewards: torch.Tensor, advantages: torch.Tensor
) -> RolloutBatch:
    """Pads rollouts to `seq_len` + 1 columns (fixed shapes keep pipeline p2p shapes static on CPU)."""
    n = len(rollouts)
    tokens = torch.full((n, seq_len + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((n, seq_len), dtype=torch.bool)
    engine_lp = torch.zeros((n, seq_len), dtype=torch.float32)
    p_lens = torch.zeros(n, dtype=torch.long)
    r_lens = torch.zeros(n, dtype=torch.long)
    for i, r in enumerate(rollouts):
        seq = list(r.prompt_ids) + list(r.response_ids)
        if len(seq) > seq_len + 1:
            raise ValueError(
                f"rollout {i} has {len(seq)} tokens but the batch holds {seq_len + 1}; raise rollout.max_new_tokens "
                "or shorten prompts"
            )
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        start = len(r.prompt_ids) - 1
        mask[i, start : start + len(r.response_ids)] = True
        engine_lp[i, start : start + len(r.response_ids)] = torch.tensor(r.logprobs, dtype=torch.float32)
        p_lens[i], r_lens[i] = len(r.prompt_ids), len(r.response_ids)
    return RolloutBatch(
        tokens_NL=tokens,
        loss_mask_NS=mask,
        engine_logprobs_NS=engine_lp,
        rewards_N=rewards.float(),
        advantages_N=advantages.float(),
        prompt_lens_N=p_lens,
        response_lens_N=r_lens,
        seq_index_N=torch.arange(n),
        rollouts=list(rollouts),
    )


def padding_mask(tokens_NL: torch.Tensor, input_lens_N: torch.Tensor | None) -> torch.Tensor | None:
    """megatron-core 0.16's `padding_mask` for the inputs tokens_NL[:, :-1]: bool [N, S], True at padding.

    The contract is the router's code (not its docstrings, which say the opposite): `compute_routing_scores_for_
    aux_loss`, `z_loss_func` and the expert-bias update all use `~padding_mask` as the valid tokens, and
    `GPTModel.forward` documents "True = padding (exclude)". Pads are then left out of the load-balancing counts,
    the probabilities the aux loss averages, its token count and the z-loss. None when the lengths are unknown.
    """
    if input_lens_N is None:
        return None
    positions_S = torch.arange(tokens_NL.shape[1] - 1, device=tokens_NL.device)
    return positions_S[None, :] >= input_lens_N.to(tokens_NL.device)[:, None]


def _stage_padding_mask(mask_NS: torch.Tensor | None, model) -> torch.Tensor | None:
    """The mask a pipeline stage's GPTModel expects. Only the first stage scatters the mask over the sequence-
    parallel ranks (megatron-core 0.16 `_preprocess`); later stages receive their TP rank's slice of the sequence
    from the previous stage, so they are given the same slice of the mask."""
    if mask_NS is None:
        return None
    from megatron.core import parallel_state as ps

    from megatron_gspo.training.engine import unwrap

    gpt = unwrap(model)
    if gpt.pre_process or not gpt.config.sequence_parallel:
        return mask_NS
    return sequence_parallel_slice(
        mask_NS, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    )


def sequence_parallel_slice(mask_NS: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Columns [rank * S / tp, (rank + 1) * S / tp) of an [N, S] mask: the positions a sequence-parallel rank holds."""
    s = mask_NS.shape[1]
    if s % tp_size:
        raise ValueError(f"sequence length {s} does not split over {tp_size} sequence-parallel ranks")
    part = s // tp_size
    return mask_NS[:, tp_rank * part : (tp_rank + 1) * part].contiguous()


def model_forward(model, tokens_NL: torch.Tensor, input_lens_N: torch.Tensor | None):
    """The model's forward on a padded micro-batch (every training, old-log-prob and SFT forward goes here).

    Inputs are tokens_NL[:, :-1] with position ids 0..S-1 and the padding mask, all on the tokens' device (the
    model's, once the batch was moved there). Returns the model output (LM-head logits on the last stage).
    """
    ids_NS = tokens_NL[:, :-1]
    positions_NS = torch.arange(ids_NS.shape[1], device=ids_NS.device).unsqueeze(0).expand(ids_NS.shape[0], -1)
    mask_NS = _stage_padding_mask(padding_mask(tokens_NL, input_lens_N), model)
    return model(ids_NS, positions_NS, None, padding_mask=mask_NS)


def token_logprobs_from_logits(
    logits_BSV: torch.Tensor, labels_BS: torch.Tensor, mask_BS: torch.Tensor, vocab_size: int, temperature: float
):
    """Per-token and per-sequence log-probs of `labels` from (vocab-parallel) LM-head logits.

    Uses the log-prob kernel (`megatron_gspo.kernels`): under TP each rank passes its vocabulary slice and the
    kernel combines (lse, target logit) in one collective. Vocabulary padding columns are cut off first so they
    never enter the softmax. Returns the kernel's `SequenceLogprobs` with token_logprobs reshaped to [B, S].
    """
    from megatron.core import parallel_state as ps

    from megatron_gspo.kernels import sequence_logprobs

    b, s, v_local = logits_BSV.shape
    tp = ps.get_tensor_model_parallel_world_size()
    start = ps.get_tensor_model_parallel_rank() * v_local
    valid = max(0, min(v_local, vocab_size - start))
    logits_NV = logits_BSV.reshape(b * s, v_local)[:, :valid]
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


def policy_units(loss_fn):
    """`units_of(micro_batch)` of a policy loss: its loss tokens (GRPO token-mean) or its sequences (all others)."""
    if getattr(loss_fn, "aggregation", None) == "token-mean":
        return lambda mb: int(mb.loss_mask_NS.sum())
    return lambda mb: mb.num_sequences


def policy_forward_step(loss_fn, vocab_size: int, temperature: float, before_forward=None):
    """The forward step megatron's schedule calls per micro-batch during a policy update.

    Its loss function returns (sum of per-unit losses, number of units, metrics), the unit being what the
    objective averages over: sequences (GSPO, GSPO-token, GRPO seq-mean-token-mean) or tokens (GRPO token-mean).
    With `calculate_per_token_loss` megatron divides the gradient by the global number of units, so the update is
    exactly that of the full minibatch's mean loss (training/engine.py). `before_forward(mb)` runs right before
    each micro-batch's model forward (routing replay selects that micro-batch's routes there).
    """
    units_of = policy_units(loss_fn)

    def forward_step(mb: RolloutBatch, model):
        labels = mb.tokens_NL[:, 1:]
        if before_forward is not None:
            before_forward(mb)
        out = model_forward(model, mb.tokens_NL, mb.input_lens_N)

        def reduce(logits):
            lp = token_logprobs_from_logits(logits, labels, mb.loss_mask_NS, vocab_size, temperature)
            if loss_fn.sequence_level:
                old_sum = (mb.old_logprobs_NS * mb.loss_mask_NS).sum(-1)
                res = loss_fn.from_sums(lp.seq_sum, old_sum, lp.seq_count, mb.advantages_N, num_sequences=1)
            else:
                adv = mb.advantages_N
                if mb.extra.get("token_weights_NS") is not None:
                    adv = adv[:, None] * mb.extra["token_weights_NS"]
                res = loss_fn(
                    lp.token_logprobs, mb.old_logprobs_NS, adv, mb.loss_mask_NS, num_sequences=1, num_tokens=1
                )
            units = torch.tensor(units_of(mb), dtype=torch.int, device=labels.device)
            return res.loss, units, {k: v.detach() for k, v in res.metrics.items()}

        return out, reduce

    return forward_step
