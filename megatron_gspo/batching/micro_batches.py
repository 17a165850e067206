"""Splits a (mini)batch into the micro-batches one `forward_backward` runs, with their model inputs.

- Which sequences go together: `micro_batch_size` consecutive sequences, or, with a token budget
  (`trainer.max_tokens_per_micro_batch`, the role of slime's max-tokens-per-gpu and verl's dynamic batch size),
  balanced bins of at most that many input tokens (batching/bin_packing.py). The loss stays the full-minibatch
  loss for any grouping: the losses return per-unit sums and megatron divides by the global unit count
  (training/engine.py).
- How they are fed: padded rows (the reference) or one packed THD row each (batching/inputs.py), padded to the
  sequence-parallel multiple.
- What must agree across ranks: every data-parallel rank runs the same number of micro-batches under a token
  budget (one all-reduce of the count; the MoE dispatcher's collectives and the aux-loss weight need it), and
  shapes where a collective or p2p needs fixed ones: with megatron's allgather token dispatcher (the CPU one) and
  EP > 1 the ranks of an expert group gather equal token counts, so pack j has the same length on every
  data-parallel rank; with pipeline parallelism and fixed p2p shapes (`variable_seq_lengths=False`, required by
  the allgather dispatcher) all packs of the call share one length. On GPU (alltoall, `variable_seq_lengths`)
  packs keep their own lengths.
The pipeline stages of one replica hold the same data and so compute the same plan without communicating.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.batching.batch import RolloutBatch
from megatron_gspo.batching.bin_packing import refine_bins, token_budget_bins
from megatron_gspo.batching.inputs import input_lengths, packed_inputs, packed_length, padded_inputs

BATCH_LAYOUTS = ("packed", "padded")


@dataclass
class MicroBatcher:
    """How this rank cuts batches into micro-batches (build with `MicroBatcher.for_model`)."""

    layout: str = "packed"
    """packed (THD) | padded."""
    micro_batch_size: int = 1
    """Sequences per micro-batch without a token budget."""
    max_tokens: int = 0
    """Token budget per micro-batch (input tokens, before padding to the SP multiple); 0 = micro_batch_size."""
    pad_multiple: int = 1
    """Pack lengths are multiples of it (the sequence-parallel split)."""
    uniform_length: bool = False
    """All packs of a call get one length (pipeline p2p with fixed shapes)."""
    align_lengths: bool = False
    """Pack j gets the same length on every data-parallel rank (allgather dispatcher with EP > 1)."""
    dp_group: object = None
    """Data-parallel group (None: one replica)."""
    device: torch.device | None = None
    """Where the all-reduce buffers live (the model's device)."""

    def __post_init__(self) -> None:
        if self.layout not in BATCH_LAYOUTS:
            raise ValueError(f"trainer.batch_layout={self.layout!r} must be one of {BATCH_LAYOUTS}")
        if self.max_tokens < 0:
            raise ValueError(f"trainer.max_tokens_per_micro_batch={self.max_tokens} must be >= 0 (0 = off)")
        if self.max_tokens and self.layout != "packed":
            raise ValueError("trainer.max_tokens_per_micro_batch needs trainer.batch_layout=packed")

    @classmethod
    def for_model(cls, config, *, layout: str, micro_batch_size: int, max_tokens: int = 0) -> MicroBatcher:
        """The micro-batcher for a model with megatron TransformerConfig `config` in the current parallel state."""
        from megatron.core import parallel_state as ps

        dp = ps.get_data_parallel_world_size()
        return cls(
            layout=layout,
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens,
            pad_multiple=config.tensor_model_parallel_size if config.sequence_parallel else 1,
            uniform_length=config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths,
            align_lengths=config.moe_token_dispatcher_type == "allgather"
            and (config.expert_model_parallel_size or 1) > 1,
            dp_group=ps.get_data_parallel_group() if dp > 1 else None,
            device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
        )

    # ---- planning -------------------------------------------------------------------------------------------
    def plan(self, batch: RolloutBatch) -> list[list[int]]:
        """Row indices of each micro-batch (ascending within one)."""
        n = batch.num_sequences
        if not self.max_tokens:
            size = min(self.micro_batch_size, n)
            if n % size:
                raise ValueError(f"{n} sequences do not split into micro-batches of trainer.micro_batch_size={size}")
            return [list(range(i, i + size)) for i in range(0, n, size)]
        lengths = input_lengths(batch)
        bins = token_budget_bins(lengths, self.max_tokens)
        count = self._max_over_replicas(torch.tensor([len(bins)]))[0]
        return refine_bins(lengths, bins, count, self.max_tokens) if count > len(bins) else bins

    def _max_over_replicas(self, values: torch.Tensor) -> list[int]:
        if self.dp_group is None:
            return [int(v) for v in values.tolist()]
        buf = values.to(dtype=torch.int64, device=self.device or "cpu")
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.dp_group)
        return [int(v) for v in buf.tolist()]

    def minibatches(self, batch: RolloutBatch, count: int) -> Iterator[tuple[RolloutBatch, list[RolloutBatch]]]:
        """The `count` contiguous, equal minibatches of a rollout batch (paper §5.1: one optimizer step each), each
        with its micro-batches. A minibatch is planned when it is reached, so the plan's all-reduce over replicas
        runs in the same order as the steps' other collectives on every rank."""
        for minibatch in batch.split(count):
            yield minibatch, self(minibatch)

    def __call__(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The micro-batches of `batch` (each a RolloutBatch of its rows with `inputs` set), in `plan` order."""
        return self.build(batch, self.plan(batch))

    def build(self, batch: RolloutBatch, groups: list[list[int]]) -> list[RolloutBatch]:
        """The micro-batches of the given row groups, with their model inputs."""
        device = batch.tokens_NL.device
        micro = [batch.rows(torch.tensor(g, dtype=torch.long, device=device)) for g in groups]
        if self.layout == "padded":
            for mb in micro:
                mb.inputs = padded_inputs(mb)
            return micro
        lengths = [packed_length(input_lengths(mb), self.pad_multiple) for mb in micro]
        if self.uniform_length:
            lengths = [max(lengths)] * len(lengths)
        if self.align_lengths:
            lengths = self._max_over_replicas(torch.tensor(lengths))
            if self.uniform_length:
                lengths = [max(lengths)] * len(lengths)
        for mb, length in zip(micro, lengths):
            mb.inputs = packed_inputs(mb, multiple=self.pad_multiple, length=length)
        return micro
