"""Routed-expert storage for a rollout batch, and the token order in which megatron's routers see a micro-batch.

Pure PyTorch (no megatron import): the conversions here are tested on their own.

Legend: T = tokens fed to the model for one sequence (prompt + response - 1: the last sampled token is never an
input), L = MoE layers, K = top-k, S = sequence length of the model input, B = rows of a micro-batch,
E = experts. Suffixes name shapes: `routes_TLK`, `grid_SBLK`.

Storage (shared with the rollout engines, `megatron_gspo.rollout.types`): per sequence a [T, L, K] tensor of
expert ids in the compact dtype `compact_expert_dtype(E)` (uint8 for E <= 256, else int16); row t is the routing
of input position t (SGLang's `routed_experts` convention). A `RouteStore` keeps these for a rollout batch, keyed
by sequence index, for a set of global layer indices (all layers for R3 routes from the engine; this pipeline
stage's layers for routes recorded by the trainer).

Token order seen by a router (megatron-core 0.16): hidden states are [S, B, H], so the router's logits are
[S * B, E] with token index s * B + b (sequence-major). Under sequence parallelism TP rank r holds the contiguous
rows s in [r * S / tp, (r + 1) * S / tp), i.e. its tokens are indices r * (S / tp) * B ... of the full order.
A micro-batch is described by a `TokenLayout`: which row b and which positions [start, start + T) each sequence
occupies (padded batches: one sequence per row from position 0; packed batches: B = 1, sequences concatenated).
Positions no sequence occupies (padding) get `pad_expert_ids`: K distinct experts per token, never duplicates
(a duplicate id would break the alltoall dispatcher's token counts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron_gspo.rollout.types import compact_expert_dtype


def pad_expert_ids(
    num_tokens: int, topk: int, num_experts: int, *, dtype: torch.dtype = torch.int64, device=None
) -> torch.Tensor:
    """[num_tokens, topk] ids for padding tokens: token i gets (i * K + j) % E, j < K — distinct within a token
    (K <= E) and spread evenly over the experts."""
    if topk > num_experts:
        raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
    tok = torch.arange(num_tokens, device=device, dtype=torch.int64)
    ids = (tok[:, None] * topk + torch.arange(topk, device=device, dtype=torch.int64)[None, :]) % num_experts
    return ids.to(dtype)


@dataclass(frozen=True)
class TokenLayout:
    """Where the sequences of one micro-batch sit in the model input [B, S] (the router sees it as [S, B])."""

    seq_length: int
    """S: positions per row of the model input."""
    micro_batch_size: int
    """B: rows of the model input."""
    rows: tuple[int, ...]
    """Row of each sequence."""
    starts: tuple[int, ...]
    """First position of each sequence in its row."""
    lengths: tuple[int, ...]
    """Tokens of each sequence fed to the model (prompt + response - 1)."""

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if len(self.rows) != n or len(self.starts) != n:
            raise ValueError(f"layout has {len(self.rows)} rows, {len(self.starts)} starts and {n} lengths")
        if self.seq_length <= 0 or self.micro_batch_size <= 0:
            raise ValueError(f"layout needs seq_length > 0 and micro_batch_size > 0, got {self.seq_length}, "
                             f"{self.micro_batch_size}")
        spans: dict[int, list[tuple[int, int]]] = {}
        for i, (row, start, length) in enumerate(zip(self.rows, self.starts, self.lengths)):
            if not 0 <= row < self.micro_batch_size:
                raise ValueError(f"sequence {i} is in row {row} of a micro-batch with {self.micro_batch_size} rows")
            if length <= 0 or start < 0 or start + length > self.seq_length:
                raise ValueError(
                    f"sequence {i} occupies positions [{start}, {start + length}) outside [0, {self.seq_length})"
                )
            spans.setdefault(row, []).append((start, start + length))
        for row, row_spans in spans.items():
            row_spans.sort()
            for (_, end), (start, _) in zip(row_spans, row_spans[1:]):
                if start < end:
                    raise ValueError(f"sequences overlap in row {row} of the layout")

    @classmethod
    def padded(cls, lengths: Iterable[int], seq_length: int | None = None) -> TokenLayout:
        """One sequence per row, starting at position 0, right-padded to `seq_length` (default: the longest)."""
        lengths = tuple(int(x) for x in lengths)
        if not lengths:
            raise ValueError("a micro-batch layout needs at least one sequence")
        seq_length = max(lengths) if seq_length is None else int(seq_length)
        return cls(seq_length, len(lengths), tuple(range(len(lengths))), (0,) * len(lengths), lengths)

    @classmethod
    def packed(
        cls, lengths: Iterable[int], seq_length: int | None = None, *, starts: Iterable[int] | None = None
    ) -> TokenLayout:
        """All sequences in one row (THD / packed): back to back, or at `starts` (e.g. padded cu_seqlens[:-1])."""
        lengths = tuple(int(x) for x in lengths)
        if not lengths:
            raise ValueError("a micro-batch layout needs at least one sequence")
        if starts is None:
            offsets, pos = [], 0
            for length in lengths:
                offsets.append(pos)
                pos += length
            starts = offsets
        starts = tuple(int(x) for x in starts)
        if seq_length is None:
            seq_length = max(s + n for s, n in zip(starts, lengths))
        return cls(int(seq_length), 1, (0,) * len(lengths), starts, lengths)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        """S * B: tokens the routers of one full (unsplit) micro-batch see, padding included."""
        return self.seq_length * self.micro_batch_size

    def local_tokens(self, token_split: int) -> int:
        """Tokens one router sees when the sequence dimension is split `token_split` ways (sequence parallel)."""
        self.check_split(token_split)
        return self.num_tokens // token_split

    def check_split(self, token_split: int) -> None:
        """Raises when S does not divide into `token_split` equal slices (megatron's sequence-parallel split)."""
        if self.seq_length % token_split:
            raise ValueError(
                f"micro-batch seq_length={self.seq_length} is not divisible by the sequence-parallel size "
                f"{token_split}; pad the batch to a multiple of parallel.tp"
            )


def scatter_to_grid(
    routes: Sequence[torch.Tensor], layout: TokenLayout, num_experts: int, *, s_range: tuple[int, int] | None = None
) -> torch.Tensor:
    """Per-sequence [T_i, L, K] routes into the router's grid [S', B, L, K] (S' = the rows of `s_range`, default
    all S), padding positions filled with `pad_expert_ids` of their full-grid token index s * B + b."""
    if len(routes) != layout.num_sequences:
        raise ValueError(f"{len(routes)} route tensors for a layout of {layout.num_sequences} sequences")
    first = routes[0]
    n_layers, topk = first.shape[1], first.shape[2]
    s0, s1 = s_range or (0, layout.seq_length)
    b = layout.micro_batch_size
    pad = pad_expert_ids(layout.num_tokens, topk, num_experts, dtype=first.dtype, device=first.device)
    grid = pad.view(layout.seq_length, b, 1, topk)[s0:s1].expand(s1 - s0, b, n_layers, topk).clone()
    for i, (routes_TLK, row, start, length) in enumerate(zip(routes, layout.rows, layout.starts, layout.lengths)):
        if routes_TLK.shape[0] != length:
            raise ValueError(
                f"sequence {i} of the micro-batch feeds {length} tokens but its routes cover {routes_TLK.shape[0]} "
                "(routes have one row per input token: prompt + response - 1)"
            )
        lo, hi = max(start, s0), min(start + length, s1)
        if lo < hi:
            grid[lo - s0 : hi - s0, row] = routes_TLK[lo - start : hi - start]
    return grid


def gather_from_grid(grid_SBLK: torch.Tensor, layout: TokenLayout) -> list[torch.Tensor]:
    """The inverse of `scatter_to_grid` over the full S: per-sequence [T_i, L, K] routes (copies)."""
    if grid_SBLK.shape[:2] != (layout.seq_length, layout.micro_batch_size):
        raise ValueError(
            f"routing grid {tuple(grid_SBLK.shape[:2])} does not match the layout "
            f"[{layout.seq_length}, {layout.micro_batch_size}]"
        )
    return [
        grid_SBLK[start : start + length, row].clone()
        for row, start, length in zip(layout.rows, layout.starts, layout.lengths)
    ]


CHECK_CHUNK_IDS = 1 << 22
"""Expert ids checked at once by RouteStore.from_sequences (32 MiB as int64)."""

class RouteStore:
    """Routes of a rollout batch: per sequence index a [T, L, K] compact tensor for the global MoE layers
    `layer_ids` (ascending)."""

    def __init__(self, num_experts: int, topk: int, layer_ids: Iterable[int]):
        self.num_experts = int(num_experts)
        self.topk = int(topk)
        self.layer_ids = tuple(int(x) for x in layer_ids)
        if list(self.layer_ids) != sorted(set(self.layer_ids)):
            raise ValueError(f"layer_ids {self.layer_ids} must be distinct and ascending")
        if not 0 < self.topk <= self.num_experts:
            raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
        self.dtype = compact_expert_dtype(self.num_experts)
        self._routes: dict[int, torch.Tensor] = {}

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_sequences(
        cls,
        routes: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
        num_experts: int,
        *,
        layer_ids: Iterable[int] | None = None,
    ) -> RouteStore:
        """From per-sequence [T, L, K] tensors (a mapping by sequence index, or a list indexed 0..n-1); layers
        default to 0..L-1 (every MoE layer in global order, as engines return them)."""
        items = list(routes.items()) if isinstance(routes, Mapping) else list(enumerate(routes))
        if not items:
            raise ValueError("no routes given")
        first = items[0][1]
        if first.dim() != 3:
            raise ValueError(f"routes must be [tokens, layers, topk], got shape {tuple(first.shape)}")
        store = cls(num_experts, first.shape[2], range(first.shape[1]) if layer_ids is None else layer_ids)
        # The ids of all sequences are checked at once (the checks are per token); only when that finds a fault
        # does `add` check sequence by sequence, which raises the error naming the first faulty one.
        valid = store._all_valid([r for _, r in items])
        for index, routes_TLK in items:
            store.add(index, routes_TLK, validate=not valid)
        return store

    def _all_valid(self, routes: list[torch.Tensor]) -> bool:
        """Whether every tensor passes `add`'s checks: shape, integer dtype, ids in range, distinct per token."""
        shape = (len(self.layer_ids), self.topk)
        if any(r.dim() != 3 or r.shape[1:] != shape or r.dtype.is_floating_point or r.dtype == torch.bool
               for r in routes) or len({r.device for r in routes}) > 1:
            return False
        # In chunks of ~CHECK_CHUNK_IDS ids: the int64 copy and its sort of a whole batch's routes would be ~3x 8
        # bytes per id at once (512 sequences x 4k tokens x 48 layers x top-8: ~19 GB; found in review).
        chunk: list[torch.Tensor] = []
        size = 0
        for i, r in enumerate(routes):
            chunk.append(r)
            size += r.numel()
            if size >= CHECK_CHUNK_IDS or i == len(routes) - 1:
                if not self._chunk_valid(torch.cat([c.to(torch.int64) for c in chunk])):
                    return False
                chunk, size = [], 0
        return True

    def _chunk_valid(self, ids: torch.Tensor) -> bool:
        if not ids.numel():
            return True
        if int(ids.min()) < 0 or int(ids.max()) >= self.num_experts:
            return False
        ordered = ids.sort(dim=-1).values
        return not (self.topk > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()))

    @classmethod
    def from_rollouts(cls, rollouts: Sequence, num_experts: int, *, first_index: int = 0) -> RouteStore:
        """R3: the `routed_experts` of rollouts (rollout i gets sequence index first_index + i)."""
        missing = [i for i, r in enumerate(rollouts) if r.routed_experts is None]
        if missing:
            raise ValueError(
                f"moe.routing_replay=r3 needs routed experts from the rollout engine, but rollout {missing[0]} has "
                "none (enable rollout routing capture: SGLang --enable-return-routed-experts)"
            )
        return cls.from_sequences(
            {first_index + i: r.routed_experts for i, r in enumerate(rollouts)}, num_experts
        )

    def add(self, index: int, routes_TLK: torch.Tensor, *, validate: bool = True) -> None:
        """Adds the routes of sequence `index` (converted to the compact dtype; ids checked when `validate`)."""
        index = int(index)
        if index in self._routes:
            raise ValueError(f"routes of sequence {index} are already stored")
        if routes_TLK.dim() != 3 or routes_TLK.shape[1:] != (len(self.layer_ids), self.topk):
            raise ValueError(
                f"routes of sequence {index} have shape {tuple(routes_TLK.shape)}; expected "
                f"[tokens, {len(self.layer_ids)} layers, topk={self.topk}]"
            )
        if routes_TLK.dtype.is_floating_point or routes_TLK.dtype == torch.bool:
            raise ValueError(f"routes of sequence {index} must be integer expert ids, got {routes_TLK.dtype}")
        if validate and routes_TLK.numel():
            ids = routes_TLK.to(torch.int64)
            if int(ids.min()) < 0 or int(ids.max()) >= self.num_experts:
                raise ValueError(
                    f"routes of sequence {index} hold expert ids outside [0, {self.num_experts})"
                )
            ordered = ids.sort(dim=-1).values
            if self.topk > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                raise ValueError(f"routes of sequence {index} repeat an expert within a token's top-{self.topk}")
        self._routes[index] = routes_TLK.to(self.dtype).contiguous()

    # ---- access ------------------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> torch.Tensor:
        try:
            return self._routes[int(index)]
        except KeyError:
            raise KeyError(f"no routes stored for sequence {index}") from None

    def __contains__(self, index: object) -> bool:
        return index in self._routes

    def __len__(self) -> int:
        return len(self._routes)

    @property
    def seq_indices(self) -> list[int]:
        """Stored sequence indices, ascending."""
        return sorted(self._routes)

    def num_tokens(self) -> int:
        return sum(t.shape[0] for t in self._routes.values())

    def memory_bytes(self) -> int:
        """Bytes held by the stored routes (the `routes_memory_bytes` metric)."""
        return sum(t.numel() * t.element_size() for t in self._routes.values())

    def to(self, device) -> RouteStore:
        """A store with the same routes on `device`."""
        out = RouteStore(self.num_experts, self.topk, self.layer_ids)
        out._routes = {i: t.to(device) for i, t in self._routes.items()}
        return out

    def select_layers(self, layer_ids: Iterable[int]) -> RouteStore:
        """A store with only the given global layers (views of this one's tensors where possible)."""
        layer_ids = tuple(int(x) for x in layer_ids)
        pos = self._positions(layer_ids)
        out = RouteStore(self.num_experts, self.topk, layer_ids)
        if pos == list(range(len(self.layer_ids))):
            out._routes = dict(self._routes)
        else:
            index = torch.tensor(pos, dtype=torch.long)
            out._routes = {i: t.index_select(1, index.to(t.device)) for i, t in self._routes.items()}
        return out

    def _positions(self, layer_ids: Sequence[int]) -> list[int]:
        where = {layer: p for p, layer in enumerate(self.layer_ids)}
        missing = [layer for layer in layer_ids if layer not in where]
        if missing:
            raise ValueError(f"routes hold layers {list(self.layer_ids)} but layer {missing[0]} was asked for")
        return [where[layer] for layer in layer_ids]

    # ---- replay ------------------------------------------------------------------------------------------
    def routes_for_microbatch(
        self,
        seq_indices: Sequence[int],
        layout: TokenLayout,
        *,
        layer_ids: Sequence[int] | None = None,
        split_rank: int = 0,
        split_size: int = 1,
        device=None,
    ) -> list[torch.Tensor]:
        """What RouterReplay needs for one micro-batch: per layer of `layer_ids` (default: all stored), an int64
        [S * B / split_size, K] tensor in the router's token order, for the slice `split_rank` of a sequence
        dimension split `split_size` ways (sequence parallel: split = TP size, rank = TP rank)."""
        if len(seq_indices) != layout.num_sequences:
            raise ValueError(
                f"{len(seq_indices)} sequence indices for a micro-batch layout of {layout.num_sequences} sequences"
            )
        layer_ids = self.layer_ids if layer_ids is None else tuple(layer_ids)
        layout.check_split(split_size)
        pos = self._positions(layer_ids)
        rows = layout.seq_length // split_size
        per_seq = []
        for index in seq_indices:
            routes_TLK = self[index]
            if pos != list(range(len(self.layer_ids))):
                routes_TLK = routes_TLK[:, pos]
            per_seq.append(routes_TLK)
        grid = scatter_to_grid(per_seq, layout, self.num_experts, s_range=(split_rank * rows, (split_rank + 1) * rows))
        if device is not None:
            grid = grid.to(device, non_blocking=True)
        flat_NLK = grid.reshape(rows * layout.micro_batch_size, len(layer_ids), self.topk)
        return [flat_NLK[:, j].to(torch.int64).contiguous() for j in range(len(layer_ids))]
