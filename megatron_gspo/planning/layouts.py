"""Layout validation, a communication / step-time proxy, and layout suggestions.

Placement follows megatron-core's default rank order (tp-cp-ep-dp-pp, tensor-parallel ranks innermost; expert
layout etp-ep-edp-pp): a TP group is intra-node when tp <= gpus_per_node, an EP group when etp*ep <= gpus_per_node,
data-parallel groups when a whole pipeline stage (world/pp ranks) fits in one node.

Step-time proxy per optimizer step on one GPU (used only to rank layouts; not a performance prediction; it ignores
communication/compute overlap, GEMM efficiency of small per-expert batches and kernel details):
    stage   = s*b/(tp*cp) * (L/pp * (6*N_layer_active + 6*s*a*d) + 6*V*h) / (peak * mfu): one micro-batch on the
              slowest stage (the last one, which also runs the LM head; x4/3 per layer with full recompute)
    compute = micro_batches * stage;  bubble = (pp - 1) / vpp * stage                  (1F1B / interleaved)
    comm    = intra-node bytes / intra BW + inter-node bytes / inter BW, no overlap assumed, from
      TP (sequence parallel): 4 ring collectives of [T, h] bf16 per layer and micro-batch (+2 with full recompute)
      EP (alltoall): dispatch + combine, forward and backward, of Ts*k*h bf16 per layer and micro-batch
      CP (ring attention): 3*(cp-1) exchanges of the local K, V per layer and micro-batch
      PP: activation + gradient of [Ts, h] per micro-batch
      DP (distributed optimizer): reduce-scatter fp32 grads + all-gather bf16 params once per step, dense over dp*cp,
      experts over the expert-data-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megatron_gspo.models.config import ModelConfig
from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.planning.memory import (
    GiB,
    Layout,
    MemoryAssumptions,
    MemoryEstimate,
    Workload,
    estimate_memory,
    estimate_stage_memory,
)
from megatron_gspo.planning.params import count_parameters


@dataclass(frozen=True)
class Cluster:
    """The GPUs a run gets."""

    nodes: int = 1
    """Nodes in the allocation (training ranks only)."""
    gpus_per_node: int = 8
    """GPUs per node."""
    gpu_memory_gib: float = 80.0
    """Usable memory of one GPU in GiB."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not self.gpu_memory_gib > 0:
            raise ValueError(f"gpu_memory_gb={self.gpu_memory_gib!r} must be > 0")

    @property
    def world_size(self) -> int:
        """Total GPUs."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class CommAssumptions:
    """Constants of the step-time proxy (module docstring)."""

    intra_node_gbps: float = 300.0
    """GB/s per GPU inside a node (NVLink, NCCL algorithm bandwidth)."""
    inter_node_gbps: float = 40.0
    """GB/s per GPU between nodes (one 400 Gb/s NIC per GPU at ~80%)."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one GPU (H100 / H200)."""
    mfu: float = 0.4
    """Achieved fraction of the peak for the compute term."""


@dataclass(frozen=True)
class StepEstimate:
    """Per-GPU communication volume and step-time proxy of one optimizer step."""

    intra_bytes: float
    """Bytes sent over intra-node links."""
    inter_bytes: float
    """Bytes sent over inter-node links."""
    comm_s: float
    """Communication time, no overlap assumed."""
    compute_s: float
    """Compute time at the assumed MFU."""
    bubble_s: float
    """Pipeline bubble."""

    @property
    def step_s(self) -> float:
        """Proxy step time: compute + bubble + communication."""
        return self.compute_s + self.bubble_s + self.comm_s


@dataclass(frozen=True)
class LayoutPlan:
    """A validated layout with its memory and step-time estimates."""

    layout: Layout
    """The layout."""
    memory: MemoryEstimate
    """Peak-stage memory per GPU."""
    step: StepEstimate
    """Communication and step-time proxy."""
    gpu_memory_gib: float
    """Capacity it is checked against."""
    last_stage: MemoryEstimate
    """Memory of the last pipeline stage (the one with the logits; equals `memory` when it is the peak)."""

    @property
    def fits(self) -> bool:
        """Whether the peak-stage estimate fits in one GPU."""
        return self.memory.total <= self.gpu_memory_gib * GiB

    @property
    def headroom_gib(self) -> float:
        """Capacity minus estimate (negative: does not fit)."""
        return self.gpu_memory_gib - self.memory.total / GiB


class LayoutError(ValueError):
    """An invalid layout; `problems` holds one message per violated rule, each naming its config key."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid layout: " + "; ".join(self.problems))


def validate_layout(
    model: ModelConfig,
    parallel: ParallelConfig,
    cluster: Cluster,
    workload: Workload | None = None,
    *,
    check_global_batch: bool = False,
) -> Layout:
    """Check `parallel` against the model and the cluster; the complete Layout, or LayoutError naming the keys."""
    p, world = parallel, cluster.world_size
    problems: list[str] = []
    model_parallel = p.tp * p.pp * p.cp
    if world % model_parallel:
        problems.append(
            f"parallel.tp*pp*cp={p.tp}*{p.pp}*{p.cp}={model_parallel} does not divide the world size {world} "
            f"({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs)"
        )
    elif (world // p.pp) % (p.ep * p.etp):
        problems.append(f"parallel.ep*etp={p.ep}*{p.etp} does not divide world_size/pp={world // p.pp}")
    if model.num_attention_heads % p.tp:
        problems.append(f"parallel.tp={p.tp} does not divide model.num_attention_heads={model.num_attention_heads}")
    kv = model.num_key_value_heads
    if kv % p.tp and p.tp % kv:
        problems.append(f"parallel.tp={p.tp} and model.num_key_value_heads={kv}: one must divide the other")
    if model.num_experts % p.ep:
        problems.append(f"parallel.ep={p.ep} does not divide model.num_experts={model.num_experts}")
    if model.moe_intermediate_size % p.etp:
        problems.append(
            f"parallel.etp={p.etp} does not divide model.moe_intermediate_size={model.moe_intermediate_size}"
        )
    if model.num_hidden_layers % p.pp:
        problems.append(f"parallel.pp={p.pp} does not divide model.num_hidden_layers={model.num_hidden_layers}")
    elif p.virtual_pp and model.num_hidden_layers % (p.pp * p.virtual_pp):
        problems.append(
            f"parallel.virtual_pp={p.virtual_pp}: pp*virtual_pp={p.pp * p.virtual_pp} does not divide "
            f"model.num_hidden_layers={model.num_hidden_layers}"
        )
    if p.tp > 1 and not p.sequence_parallel:
        problems.append(
            f"parallel.sequence_parallel must be true with parallel.tp={p.tp} (Megatron MoE training with TP needs it)"
        )
    if check_global_batch and workload is not None and not world % model_parallel:
        dp = world // model_parallel
        unit = workload.micro_batch_size * dp
        if workload.global_batch_size % unit:
            problems.append(
                f"trainer.global_batch_size={workload.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp={workload.micro_batch_size}*{dp}={unit}"
            )
    if problems:
        raise LayoutError(problems)
    return Layout(
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        etp=p.etp,
        cp=p.cp,
        dp=world // model_parallel,
        vpp=p.virtual_pp,
    )


def _ring(message: float, group: int) -> float:
    """Bytes one rank sends in a ring all-gather / reduce-scatter of a `message`-byte tensor."""
    return message * (group - 1) / group


def estimate_step(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    workload: Workload,
    memory: MemoryEstimate,
    comm: CommAssumptions | None = None,
) -> StepEstimate:
    """Communication volume and step-time proxy of one optimizer step on one GPU (module docstring)."""
    comm = comm or CommAssumptions()
    gpn = cluster.gpus_per_node
    nmb = workload.micro_batches(layout.dp)
    layers = model.num_hidden_layers // layout.pp
    s, h, k = workload.seq_len, model.hidden_size, model.num_experts_per_tok
    T = s * workload.micro_batch_size / layout.cp
    Ts = T / layout.tp
    extra_fwd = 2 if workload.recompute == "full" else 0
    intra = inter = 0.0

    def add(nbytes: float, local: bool) -> None:
        nonlocal intra, inter
        if local:
            intra += nbytes
        else:
            inter += nbytes

    per_layer_steps = layers * nmb
    if layout.tp > 1:
        local = layout.tp <= gpn and gpn % layout.tp == 0
        add(per_layer_steps * (4 + extra_fwd) * _ring(T * h * 2, layout.tp), local)
    if layout.etp > 1:
        local = layout.etp <= gpn and gpn % layout.etp == 0
        add(per_layer_steps * (4 + extra_fwd) * Ts * k * h * 2 * (layout.etp - 1), local)
    if layout.ep > 1:
        span = layout.ep * layout.etp
        peers = layout.ep if span <= gpn else max(1, gpn // layout.etp)
        sent = per_layer_steps * (4 + extra_fwd) * Ts * k * h * 2 * layout.etp
        add(sent * (peers - 1) / layout.ep, True)
        add(sent * (layout.ep - peers) / layout.ep, False)
    if layout.cp > 1:
        kv_local = max(model.num_key_value_heads / layout.tp, 1.0)
        kv_bytes = 2 * T * kv_local * model.head_dim * 2
        local = layout.tp * layout.cp <= gpn
        add(per_layer_steps * (3 + extra_fwd // 2) * (layout.cp - 1) * kv_bytes, local)
    stage_span = layout.world_size // layout.pp
    if layout.pp > 1:
        add(nmb * 2 * Ts * h * 2, layout.world_size <= gpn)
    dense_group = layout.dp * layout.cp
    if dense_group > 1:
        add(6 * _ring(memory.dense_params, dense_group), stage_span <= gpn)
    if layout.expert_dp > 1:
        add(6 * _ring(memory.expert_params, layout.expert_dp), stage_span <= gpn)
    comm_s = intra / (comm.intra_node_gbps * 1e9) + inter / (comm.inter_node_gbps * 1e9)

    counts = count_parameters(model)
    attn_flops = 6 * s * model.num_attention_heads * model.head_dim  # causal QK^T and AV, fwd + bwd, per layer
    layer_flops = 6 * counts.layer_active + attn_flops
    if workload.recompute == "full":
        layer_flops *= 4 / 3
    elif workload.recompute == "selective":
        layer_flops += attn_flops / 3
    head_flops = 6 * model.vocab_size * model.hidden_size
    slowest_stage = layers * layer_flops + head_flops  # the last stage also runs the LM head
    tokens_per_rank = s * workload.micro_batch_size / (layout.tp * layout.cp)
    stage_s = tokens_per_rank * slowest_stage / (comm.peak_tflops * 1e12 * comm.mfu)
    compute_s = nmb * stage_s
    bubble_s = stage_s * (layout.pp - 1) / (layout.vpp or 1)
    return StepEstimate(intra, inter, comm_s, compute_s, bubble_s)


def plan_layout(
    model: ModelConfig,
    parallel: ParallelConfig,
    cluster: Cluster,
    workload: Workload,
    assumptions: MemoryAssumptions | None = None,
    comm: CommAssumptions | None = None,
    *,
    check_global_batch: bool = False,
) -> LayoutPlan:
    """Validate one layout and estimate its memory and step time."""
    layout = validate_layout(model, parallel, cluster, workload, check_global_batch=check_global_batch)
    memory = estimate_memory(model, layout, workload, assumptions)
    last = estimate_stage_memory(model, layout, workload, layout.pp - 1, assumptions)
    step = estimate_step(model, layout, cluster, workload, memory, comm)
    return LayoutPlan(layout, memory, step, cluster.gpu_memory_gib, last)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidate_layouts(model: ModelConfig, cluster: Cluster, cp: int = 1, max_pp: int = 16) -> Iterator[ParallelConfig]:
    """tp in {1,2,4,8}, pp a divisor of the layers up to max_pp, ep a divisor of the experts, etp=1, the given cp."""
    world = cluster.world_size
    for tp in (1, 2, 4, 8):
        for pp in _divisors(model.num_hidden_layers, max_pp):
            if tp * pp * cp > world:
                continue
            for ep in _divisors(model.num_experts, world // pp):
                yield ParallelConfig(tp=tp, pp=pp, ep=ep, etp=1, cp=cp, sequence_parallel=tp > 1)


def suggest_layouts(
    model: ModelConfig,
    cluster: Cluster,
    workload: Workload,
    assumptions: MemoryAssumptions | None = None,
    comm: CommAssumptions | None = None,
    *,
    top: int = 5,
    cp: int = 1,
    check_global_batch: bool = False,
) -> list[LayoutPlan]:
    """The `top` valid layouts: those that fit first, by step-time proxy; if none fits, the smallest ones."""
    plans = []
    for parallel in candidate_layouts(model, cluster, cp=cp):
        try:
            plans.append(
                plan_layout(
                    model, parallel, cluster, workload, assumptions, comm, check_global_batch=check_global_batch
                )
            )
        except LayoutError:
            continue
    fitting = sorted((p for p in plans if p.fits), key=lambda p: (p.step.step_s, p.memory.total))
    if fitting:
        return fitting[:top]
    return sorted(plans, key=lambda p: p.memory.total)[:top]

