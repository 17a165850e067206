"""Layout and memory planner (`megatron-gspo plan`): parameter counts, per-GPU memory, layout suggestions.

Pure arithmetic over `ModelConfig` / `ParallelConfig`: importing it needs neither torch nor megatron.
"""

from megatron_gspo.planning.layouts import (
    Cluster,
    LayoutError,
    LayoutPlan,
    plan_layout,
    suggest_layouts,
    validate_layout,
)
from megatron_gspo.planning.memory import Layout, MemoryAssumptions, MemoryEstimate, Workload, estimate_memory
from megatron_gspo.planning.params import ParamCounts, count_parameters

__all__ = [
    "Cluster",
    "Layout",
    "LayoutError",
    "LayoutPlan",
    "MemoryAssumptions",
    "MemoryEstimate",
    "ParamCounts",
    "Workload",
    "count_parameters",
    "estimate_memory",
    "plan_layout",
    "suggest_layouts",
    "validate_layout",
]
