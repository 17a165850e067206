"""Per-GPU memory estimate of one training rank (Megatron-Core, bf16, distributed optimizer, MoE alltoall).

Legend: s = sequence length, b = micro-batch size, h = hidden, a / g = query / KV heads, d = head_dim, E = experts,
k = top-k, f = moe_intermediate_size, V = vocabulary padded by Megatron to a multiple of 128*tp, L = layers;
t, p, e, x, c = tp, pp, ep, etp, cp. T = s*b/c tokens of one micro-batch on a context-parallel rank; with sequence
parallelism (always on when t > 1) the [T, h] tensors are split by t: Ts = T/t.

Terms (bytes, for the pipeline stage that peaks; `estimate_memory` takes the max over stages):

- weights: 2 * params on the rank (bf16). Dense layer weights are split by t (norms and router are replicated),
  expert weights by e*x, layers by p; the embedding sits on the first stage, the LM head and final norm on the last,
  both split by t over the padded vocabulary.
- grads: 4 * params on the rank (Megatron DDP keeps fp32 main grads; the buffer is not sharded).
- optimizer: 12 * params / shards (fp32 master copy + Adam m and v, distributed optimizer): dense params shard over
  the dp*cp ranks that replicate them, expert params over the expert-data-parallel group world/(p*e*x).
- activations: per layer and micro-batch, what autograd keeps for backward (flash attention, so no s^2 term). This is
  the recipe of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", whose
  s*b*h*(34 + 5*a*s/h) for a dense GPT layer becomes s*b*h*34/t with sequence parallelism), redone for this layer:
  no dropout, GQA with qk-norm, a router and k SwiGLU experts per token:
    attention: 2*Ts*h (norm input) + 2*Ts*h (norm output = QKV input) + 2*T*(q + 2*gl)*d (QKV output, kept by the
               qk-norms) + 2*T*(q + 2*gl)*d (q, k, v into flash attention) + 2*T*q*d (attention output) + 4*T*q
               (softmax statistics), with q = a/t and gl = max(g/t, 1) local heads;
    MoE:       2*Ts*h (norm input) + 2*Ts*h (norm output) + Ts*(8*E + 12*k) (fp32 router scores, top-k ids and probs)
               + P*(2*h + 4*f/x + 2*f/x + 4) with P = Ts*k*x token-expert pairs on the rank (dispatched input,
               SwiGLU input, SwiGLU output, routing prob), times `MemoryAssumptions.moe_imbalance`.
  recompute="selective" is what the trainer gives megatron on the TE spec (models/build.py
  selective_recompute_modules): recompute_modules ["moe_act"], which drops the SwiGLU output (TE's fused attention
  keeps only its softmax statistics, not worth a second attention forward; both norm outputs stay: "layernorm" is
  not asked for). recompute="full" (uniform, 1 layer per checkpoint) keeps only
  the layer input 2*Ts*h. Stage j of a 1F1B pipeline holds min(p - j, micro-batches) micro-batches in flight (times
  1 + (p-1)/(p*v) with v interleaved chunks); backward needs one more layer's worth as working memory (two with full
  recompute: the recomputed layer and its gradients). The last stage adds the final-norm input and output.
- logits (last stage, one micro-batch, [T, V/t] elements): naive path = 12 bytes per element (the fp32 log-softmax
  kept for backward, its gradient and the logits gradient are alive together at the backward peak; the forward peak,
  bf16 logits + fp32 copy + fp32 log-softmax, is 10); fused log-prob kernel = 8 bytes per element of one chunk of
  `logprob_chunk_tokens` tokens (fp32 logits + probabilities) + 16 bytes per token of per-token outputs.
- routing replay (r2 / r3): the rollout batch's top-k ids for this rank's layers and tokens, 1 byte each (uint8, 2
  bytes when E > 256), counted on the GPU (conservative: it may live in host memory), plus the int64 ids that
  megatron's RouterReplay holds for every micro-batch in flight.
- overhead: fixed `overhead_gib` (CUDA context ~0.5-1 GiB, NCCL communicators and buffers 1-2 GiB, cuBLAS / TE
  workspaces, allocator fragmentation slack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from megatron_gspo.models.config import ModelConfig
from megatron_gspo.planning.params import count_parameters

GiB = 1024**3
RECOMPUTE_CHOICES = ("none", "selective", "full")
SELECTIVE_RECOMPUTE_MODULES = ("moe_act",)
"""megatron recompute_modules of recompute="selective" on the TE spec, as the trainer sets them (a test holds the
two equal: models/build.py selective_recompute_modules)."""
RECOMPUTED_BY = {
    "core_attn": ("softmax_stats",),
    "moe_act": ("swiglu_output",),
    "layernorm": ("attn_norm_output", "moe_norm_output"),
}
"""Saved activations (layer_activation_bytes parts) each megatron recompute module drops."""
REPLAY_CHOICES = ("off", "r2", "r3")
LOGPROB_CHOICES = ("fused", "naive")


@dataclass(frozen=True)
class Layout:
    """A complete parallel layout: the ParallelConfig sizes plus the data-parallel size they leave."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline stages."""
    ep: int = 1
    """Expert-parallel size."""
    etp: int = 1
    """Expert tensor-parallel size."""
    cp: int = 1
    """Context-parallel size."""
    dp: int = 1
    """Data-parallel size (world / (tp*pp*cp))."""
    vpp: int | None = None
    """Interleaved model chunks per stage (None: plain 1F1B)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp", "cp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{name}={value!r} must be an integer >= 1")
        if self.world_size % (self.pp * self.ep * self.etp):
            raise ValueError(
                f"parallel.ep*etp*pp={self.ep}*{self.etp}*{self.pp} does not divide the world size {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        """Ranks the layout uses."""
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts."""
        return self.world_size // (self.pp * self.ep * self.etp)

    def describe(self) -> str:
        """'tp=1 pp=2 ep=8 etp=1 cp=1 dp=8'."""
        text = f"tp={self.tp} pp={self.pp} ep={self.ep} etp={self.etp} cp={self.cp} dp={self.dp}"
        return text + (f" vpp={self.vpp}" if self.vpp else "")


@dataclass(frozen=True)
class Workload:
    """What one training step processes and how (the inputs of the activation terms)."""

    seq_len: int = 8192
    """Tokens per sequence (prompt + response; the packed length of a micro-batch row)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    global_batch_size: int = 256
    """Sequences per optimizer step (all data-parallel ranks together)."""
    rollout_batch_size: int | None = None
    """Sequences per rollout batch (the routing-replay cache); None: 4 * global_batch_size (paper §5.1)."""
    recompute: str = "selective"
    """Activation recomputation: none | selective | full."""
    routing_replay: str = "off"
    """Routing replay: off | r2 | r3."""
    logprob: str = "fused"
    """Log-prob path counted in the total: fused (chunked kernel) | naive (materialised fp32 logits)."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.rollout_batch_size is not None and self.rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size={self.rollout_batch_size!r} must be a positive integer")
        for name, choices in (
            ("recompute", RECOMPUTE_CHOICES),
            ("routing_replay", REPLAY_CHOICES),
            ("logprob", LOGPROB_CHOICES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {list(choices)}")

    @property
    def rollout_sequences(self) -> int:
        """Sequences whose routing a replay cache holds."""
        return self.rollout_batch_size or 4 * self.global_batch_size

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per optimizer step on one data-parallel rank."""
        return max(1, math.ceil(self.global_batch_size / (self.micro_batch_size * dp)))


@dataclass(frozen=True)
class MemoryAssumptions:
    """Constants of the memory model (module docstring)."""

    overhead_gib: float = 4.0
    """Fixed per-GPU overhead: CUDA context, NCCL buffers, workspaces, fragmentation slack."""
    logprob_chunk_tokens: int = 2048
    """Tokens per chunk of the fused log-prob kernel."""
    vocab_divisible_by: int = 1
    """The vocabulary is padded to a multiple of this times tp: 1 is the trainer's (models/build.py
    padded_vocab_size pads to a multiple of tp only, so no padded row enters the log-prob softmax); megatron-LM's
    `make_vocab_size_divisible_by` default is 128."""
    moe_imbalance: float = 1.0
    """Routed tokens on the busiest expert rank relative to perfect balance (>= 1)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU bytes of the pipeline stage that needs the most memory."""

    stage: int
    """Pipeline stage this estimate is for."""
    dense_params: int
    """Non-expert parameters on the rank (embedding / LM head included on their stages)."""
    expert_params: int
    """Routed-expert parameters on the rank."""
    inflight_microbatches: float
    """Micro-batches whose activations the stage holds at its peak."""
    weights: float
    """bf16 weights."""
    grads: float
    """fp32 main grads."""
    optimizer: float
    """fp32 master params + Adam m, v (sharded)."""
    activations: float
    """Saved activations of the in-flight micro-batches + backward working layer."""
    logits_naive: float
    """Log-prob working memory with materialised logits (last stage only)."""
    logits_fused: float
    """Log-prob working memory with the fused chunked kernel (last stage only)."""
    logits: float
    """The logits term counted in `total` (per `Workload.logprob`)."""
    routing_replay: float
    """Routing-replay id cache + in-flight int64 ids."""
    overhead: float
    """Fixed overhead."""

    @property
    def params(self) -> int:
        """All parameters on the rank."""
        return self.dense_params + self.expert_params

    @property
    def total(self) -> float:
        """Peak bytes of the stage."""
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + self.logits
            + self.routing_replay
            + self.overhead
        )

    def as_gib(self) -> dict[str, float]:
        """The byte terms (and total) in GiB."""
        skip = {"stage", "dense_params", "expert_params", "inflight_microbatches"}
        out = {f.name: getattr(self, f.name) / GiB for f in fields(self) if f.name not in skip}
        out["total"] = self.total / GiB
        return out


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_parameters(
    model: ModelConfig, layout: Layout, stage: int, assumptions: MemoryAssumptions | None = None
) -> tuple[int, int]:
    """(dense, expert) parameters held by one rank of pipeline stage `stage`."""
    assumptions = assumptions or MemoryAssumptions()
    counts = count_parameters(model)
    layers = model.num_hidden_layers // layout.pp
    dense_layer = counts.attention // layout.tp + counts.qk_norm + counts.layer_norms + counts.router
    dense = layers * dense_layer
    vocab_rows = padded_vocab(model.vocab_size, layout.tp, assumptions.vocab_divisible_by) // layout.tp
    first, last = stage == 0, stage == layout.pp - 1
    if first:
        dense += vocab_rows * model.hidden_size
    if last:
        dense += model.hidden_size  # final norm
        if not model.tie_word_embeddings or not first:
            # Untied LM head, or the copy of a tied embedding Megatron keeps on the last stage.
            dense += vocab_rows * model.hidden_size
    experts_local = model.num_experts // layout.ep
    expert = layers * experts_local * (counts.expert // layout.etp)
    return dense, expert


def layer_activation_bytes(
    model: ModelConfig, layout: Layout, workload: Workload, recompute: str, moe_imbalance: float = 1.0
) -> dict[str, float]:
    """Saved-activation bytes of ONE layer for ONE micro-batch, by component (module docstring formulas)."""
    t, x = layout.tp, layout.etp
    h, d, k, E = model.hidden_size, model.head_dim, model.num_experts_per_tok, model.num_experts
    f = model.moe_intermediate_size
    T = workload.seq_len * workload.micro_batch_size / layout.cp
    Ts = T / t
    q = model.num_attention_heads / t
    gl = max(model.num_key_value_heads / t, 1.0)
    if recompute == "full":
        return {"layer_input": 2 * Ts * h}
    pairs = Ts * k * x * moe_imbalance
    parts = {
        "attn_norm_input": 2 * Ts * h,
        "attn_norm_output": 2 * Ts * h,
        "qkv_output": 2 * T * (q + 2 * gl) * d,
        "qkv_attention_input": 2 * T * (q + 2 * gl) * d,
        "attention_output": 2 * T * q * d,
        "softmax_stats": 4 * T * q,
        "moe_norm_input": 2 * Ts * h,
        "moe_norm_output": 2 * Ts * h,
        "router": Ts * (8 * E + 12 * k),
        "expert_input": pairs * 2 * h,
        "swiglu_input": pairs * 4 * f / x,
        "swiglu_output": pairs * 2 * f / x,
        "routing_probs": pairs * 4,
    }
    if recompute == "selective":
        for module in SELECTIVE_RECOMPUTE_MODULES:
            for name in RECOMPUTED_BY[module]:
                parts.pop(name)
    elif recompute != "none":
        raise ValueError(f"recompute={recompute!r} must be one of {list(RECOMPUTE_CHOICES)}")
    return parts


def inflight_microbatches(layout: Layout, workload: Workload, stage: int) -> float:
    """Micro-batches whose activations stage `stage` holds at the 1F1B (or interleaved) peak."""
    n = min(layout.pp - stage, workload.micro_batches(layout.dp))
    if layout.vpp:
        n *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return float(n)


def logits_bytes(
    model: ModelConfig, layout: Layout, workload: Workload, assumptions: MemoryAssumptions
) -> tuple[float, float]:
    """(naive, fused) log-prob working memory of the last stage for one micro-batch."""
    T = workload.seq_len * workload.micro_batch_size / layout.cp
    vocab_local = padded_vocab(model.vocab_size, layout.tp, assumptions.vocab_divisible_by) / layout.tp
    naive = 12.0 * T * vocab_local
    fused = 8.0 * min(assumptions.logprob_chunk_tokens, T) * vocab_local + 16.0 * T
    return naive, fused


def routing_replay_bytes(model: ModelConfig, layout: Layout, workload: Workload, inflight: float) -> float:
    """Routing-replay cache (compact ids of the rollout batch) + int64 ids of in-flight micro-batches."""
    if workload.routing_replay == "off":
        return 0.0
    layers = model.num_hidden_layers // layout.pp
    k = model.num_experts_per_tok
    id_bytes = 1 if model.num_experts <= 256 else 2
    sequences = math.ceil(workload.rollout_sequences / layout.dp)
    tokens = sequences * workload.seq_len / (layout.cp * layout.tp)
    Ts = workload.seq_len * workload.micro_batch_size / (layout.cp * layout.tp)
    return tokens * layers * k * id_bytes + inflight * Ts * layers * k * 8


def estimate_stage_memory(
    model: ModelConfig,
    layout: Layout,
    workload: Workload,
    stage: int,
    assumptions: MemoryAssumptions | None = None,
) -> MemoryEstimate:
    """Memory of one rank of pipeline stage `stage`."""
    assumptions = assumptions or MemoryAssumptions()
    dense, expert = stage_parameters(model, layout, stage, assumptions)
    params = dense + expert
    optimizer = 12.0 * (dense / (layout.dp * layout.cp) + expert / layout.expert_dp)

    layers = model.num_hidden_layers // layout.pp
    inflight = inflight_microbatches(layout, workload, stage)
    imb = assumptions.moe_imbalance
    per_layer = sum(layer_activation_bytes(model, layout, workload, workload.recompute, imb).values())
    working = sum(layer_activation_bytes(model, layout, workload, "none", imb).values())
    activations = layers * inflight * per_layer + working * (2 if workload.recompute == "full" else 1)
    last = stage == layout.pp - 1
    naive = fused = 0.0
    if last:
        Ts = workload.seq_len * workload.micro_batch_size / (layout.cp * layout.tp)
        activations += 2 * 2 * Ts * model.hidden_size  # final norm input + output (LM head input)
        naive, fused = logits_bytes(model, layout, workload, assumptions)
    return MemoryEstimate(
        stage=stage,
        dense_params=dense,
        expert_params=expert,
        inflight_microbatches=inflight,
        weights=2.0 * params,
        grads=4.0 * params,
        optimizer=optimizer,
        activations=activations,
        logits_naive=naive,
        logits_fused=fused,
        logits=fused if workload.logprob == "fused" else naive,
        routing_replay=routing_replay_bytes(model, layout, workload, inflight),
        overhead=assumptions.overhead_gib * GiB,
    )


def estimate_memory(
    model: ModelConfig,
    layout: Layout,
    workload: Workload,
    assumptions: MemoryAssumptions | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of the pipeline stage with the largest total (the one that decides whether a layout fits)."""
    stages = (estimate_stage_memory(model, layout, workload, s, assumptions) for s in range(layout.pp))
    return max(stages, key=lambda m: m.total)

