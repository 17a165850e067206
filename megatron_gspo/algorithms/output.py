"""The value every policy loss returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PolicyLossOutput:
    """A policy loss and its diagnostics.

    `loss` is the scalar to minimise, -J of the algorithm's objective, summed over the local sequences and
    divided by the (global) normaliser the caller passed; summing the `loss` of every micro-batch and
    data-parallel part gives the full-batch loss. `metrics` holds detached 0-dim fp32 tensors over the LOCAL
    part only; see `metrics.METRIC_REDUCTIONS` for their keys and `metrics.combine_metrics` for how parts
    combine.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
