"""Parallel layout of a run: tensor / sequence / expert / pipeline / context parallel sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """How the model is split over ranks; the data-parallel size is what is left of the world size."""

    tp: int = 1
    """Tensor-parallel size (attention heads, expert FFN columns, vocabulary)."""
    pp: int = 1
    """Pipeline-parallel stages (layers split evenly)."""
    ep: int = 1
    """Expert-parallel size (experts split over ranks)."""
    etp: int | None = None
    """Expert tensor-parallel size; None means 1 when ep > 1, else tp (megatron's convention)."""
    cp: int = 1
    """Context-parallel size. Only 1: context parallelism is not implemented (see `__post_init__`)."""
    sequence_parallel: bool = False
    """Split activations along the sequence between TP ranks (required with tp > 1 for MoE training)."""
    virtual_pp: int | None = None
    """Model chunks per pipeline stage (interleaved schedule); None disables interleaving."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name}={value!r} must be an integer >= 1")
        if self.cp > 1:
            # megatron would accept it, but nothing here splits each sequence into its CP chunks (RoPE positions via
            # get_pos_emb_on_this_cp_rank), runs a CP-capable attention, or all-reduces per-sequence log-prob sums
            # over the CP group: RoPE, attention and the GSPO ratios would be silently wrong.
            raise ValueError(
                f"parallel.cp={self.cp} is not supported: context parallelism is not implemented; set parallel.cp=1 "
                "(split long sequences with parallel.tp + sequence_parallel instead)"
            )
        if self.etp is None:
            self.etp = 1 if self.ep > 1 else self.tp
        if not isinstance(self.etp, int) or self.etp < 1:
            raise ValueError(f"parallel.etp={self.etp!r} must be an integer >= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel=true needs parallel.tp > 1; set it to false for tp=1")
        if self.virtual_pp is not None and (self.virtual_pp < 1 or self.pp == 1):
            raise ValueError(f"parallel.virtual_pp={self.virtual_pp} needs parallel.pp > 1 and a value >= 1")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one copy of the dense model (tp * pp * cp)."""
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel size for `world_size` ranks; raises when the layout does not fit."""
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.tp*pp*cp="
                f"{self.tp}*{self.pp}*{self.cp}={self.model_parallel_size}"
            )
        dp = world_size // self.model_parallel_size
        expert_mp = self.ep * self.etp * self.pp
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not a multiple of parallel.ep*etp*pp={self.ep}*{self.etp}*{self.pp}"
            )
        return dp
