"""Builds the Qwen3-MoE architecture as megatron-core GPTModel chunks for the current parallel layout.

This is the one place where our `ModelConfig` becomes megatron's `TransformerConfig`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from megatron_gspo.models import spec
from megatron_gspo.models.config import ModelConfig
from megatron_gspo.models.gpt import Qwen3MoEModel
from megatron_gspo.models.spec import qwen3_moe_block_spec
from megatron_gspo.parallel.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    """How the model is instantiated (beyond architecture and layout)."""

    dtype: torch.dtype = torch.float32
    """Parameter / compute dtype (bf16 on GPU clusters, fp32 on CPU)."""
    recompute: str = "none"
    """Activation recompute: none | selective | full."""
    routing_replay: bool = False
    """Build routers with megatron's RouterReplay enabled (R2 / R3)."""
    use_te: bool | None = None
    """Transformer-engine layer spec; None = when CUDA is present and TE imports (a warning names the import
    error when CUDA is present but TE does not import)."""
    init_std: float = 0.02
    """Std of the random initialisation (weights are usually loaded from a checkpoint)."""

    def __post_init__(self) -> None:
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"model.recompute={self.recompute!r} must be none, selective or full")
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"model dtype {self.dtype} must be float32, bfloat16 or float16")


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp (the LM head and embedding are split by rows over TP).

    Padding is kept minimal on purpose: padded rows would otherwise enter the softmax of the log-prob kernel;
    the trainer slices them off (see `valid_vocab_range`).
    """
    return -(-vocab_size // tp) * tp


def validate_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int | None = None) -> None:
    """Raises ValueError naming the keys when `parallel` cannot split `model`."""
    tp = parallel.tp
    if model.num_attention_heads % tp:
        raise ValueError(
            f"parallel.tp={tp} does not divide model.num_attention_heads={model.num_attention_heads}"
        )
    if model.num_key_value_heads % tp:
        raise ValueError(
            f"parallel.tp={tp} does not divide model.num_key_value_heads={model.num_key_value_heads}; "
            "use a tp that divides the KV heads"
        )
    if model.num_experts % parallel.ep:
        raise ValueError(f"parallel.ep={parallel.ep} does not divide model.num_experts={model.num_experts}")
    if model.moe_intermediate_size % parallel.etp:
        raise ValueError(
            f"parallel.etp={parallel.etp} does not divide model.moe_intermediate_size={model.moe_intermediate_size}"
        )
    chunks = parallel.pp * (parallel.virtual_pp or 1)
    if model.num_hidden_layers % chunks:
        raise ValueError(
            f"parallel.pp={parallel.pp} (x virtual_pp={parallel.virtual_pp or 1}) does not divide "
            f"model.num_hidden_layers={model.num_hidden_layers}"
        )
    if tp > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"parallel.tp={tp} with MoE layers requires parallel.sequence_parallel=true (megatron-core)"
        )
    if model.tie_word_embeddings:
        raise ValueError("model.tie_word_embeddings=true is not supported: Qwen3-MoE checkpoints are untied")
    if world_size is not None:
        parallel.data_parallel_size(world_size)


def selective_recompute_modules(use_te: bool) -> list[str]:
    """megatron `recompute_modules` of `model.recompute=selective` for a layer spec.

    The local spec: core attention (its unfused attention keeps the [s, s] probabilities; its SequentialMLP
    experts keep their activations: "moe" would recompute the whole MoE layer, token dispatch included, a
    different trade-off than "selective" stands for). The TE spec: the MoE expert activation ("moe_act", which
    megatron allows only with its grouped-GEMM experts) and not core attention -- TE's fused attention keeps no
    [s, s] matrix, so recomputing it buys nothing for a second attention forward (megatron-core 0.16
    transformer_config.py warns "you have no need to set 'core_attn' to recompute" with TE).
    """
    return ["moe_act"] if use_te else ["core_attn"]


def te_fusions(use_te: bool) -> dict:
    """The fused kernels megatron uses with transformer-engine, all off for the local spec (whose behaviour stays
    the reference's):

    - apply_rope_fusion: TE's fused RoPE; for packed (THD) input megatron's unfused path splits the sequences by
      `cu_seqlens` on the host in every layer (a device sync per layer); the fused one takes cu_seqlens as is.
    - moe_permute_fusion: TE's fused token permute / unpermute in the token dispatcher.
    - bias_activation_fusion: megatron's fused (bias +) SwiGLU of the experts' and MLPs' fc1 output.
    - gradient_accumulation_fusion: weight gradients accumulated straight into the fp32 main_grad buffer. TE's
      layers do it themselves, but the output layer is megatron's ColumnParallelLinear in every spec, which
      refuses the flag without apex's `fused_weight_gradient_mlp_cuda` (tensor_parallel/layers.py): on only when
      that extension imports too.
    """
    if not use_te:
        return dict(apply_rope_fusion=False, moe_permute_fusion=False, bias_activation_fusion=False,
                    gradient_accumulation_fusion=False)
    return dict(apply_rope_fusion=True, moe_permute_fusion=True, bias_activation_fusion=True,
                gradient_accumulation_fusion=importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)


def transformer_config(
    model: ModelConfig, parallel: ParallelConfig, options: BuildOptions, use_te: bool | None = None
) -> TransformerConfig:
    """megatron TransformerConfig for Qwen3-MoE (REFERENCE.md §3); `use_te` as resolved by `resolve_use_te`."""
    on_cpu = not torch.cuda.is_available()
    if use_te is None:
        use_te = resolve_use_te(options)
    recompute = {}
    if options.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif options.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=selective_recompute_modules(use_te))
    aux = model.router_aux_loss_coef
    return TransformerConfig(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.moe_intermediate_size,
        moe_ffn_hidden_size=model.moe_intermediate_size,
        num_moe_experts=model.num_experts,
        moe_router_topk=model.num_experts_per_tok,
        moe_router_score_function="softmax",
        # top-k of the logits then softmax over the k equals softmax-then-renormalise (norm_topk_prob).
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux > 0 else "none",
        moe_aux_loss_coeff=aux,
        # Losses are normalised by the global number of units (training/engine.py). Set here, before the build:
        # each TopKRouter copies it at construction, and DDP reads it for its gradient scaling.
        calculate_per_token_loss=True,
        moe_token_dispatcher_type="allgather" if on_cpu else "alltoall",
        moe_grouped_gemm=use_te,
        # Router fusion stays off: it bypasses routing replay (REFERENCE.md §2).
        moe_router_fusion=False,
        moe_enable_routing_replay=options.routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=options.init_std,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        **te_fusions(use_te),
        # Same full-matrix init on every rank, then split: initial weights do not depend on the layout.
        use_cpu_initialization=on_cpu,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=options.dtype,
        pipeline_dtype=options.dtype,
        bf16=options.dtype == torch.bfloat16,
        fp16=options.dtype == torch.float16,
        # Pipeline p2p shapes: the allgather dispatcher (CPU) needs fixed shapes per step; alltoall allows variable.
        variable_seq_lengths=not on_cpu,
        deallocate_pipeline_outputs=False,
        **recompute,
    )


def resolve_use_te(options: BuildOptions) -> bool:
    """Whether to build the transformer-engine layer spec (fused kernels, grouped-GEMM experts).

    `use_te=None` means: on a CUDA machine, when TE imports. A CUDA machine whose TE import fails (not installed,
    or installed but broken, e.g. built for another torch / CUDA) gets the local spec, with a warning that names
    the import error: set model.use_te=false to choose the local spec without it.
    """
    if options.use_te is None:
        if not torch.cuda.is_available():
            return False
        if not spec.HAVE_TE:
            log.warning(
                "CUDA is available but transformer-engine does not import (%s): building the local layer spec "
                "(no fused kernels, no grouped-GEMM experts). Install a working transformer-engine "
                "(pip install 'megatron-gspo[gpu]') or set model.use_te=false to choose the local spec",
                spec.TE_IMPORT_ERROR,
            )
        return spec.HAVE_TE
    if options.use_te and not spec.HAVE_TE:
        raise ValueError(
            f"model.use_te=true but transformer-engine does not import ({spec.TE_IMPORT_ERROR}); "
            "install the 'gpu' extra (pip install 'megatron-gspo[gpu]') or set model.use_te=false"
        )
    return options.use_te


def build_model(
    model: ModelConfig, parallel: ParallelConfig, options: BuildOptions | None = None
) -> list[Qwen3MoEModel]:
    """GPTModel chunks (`Qwen3MoEModel`: hidden states on request) of this rank (one per virtual pipeline stage)
    with the Qwen3-MoE architecture.

    Requires `megatron_gspo.parallel.initialize` to have set up the process groups for `parallel`.
    """
    options = options or BuildOptions()
    validate_layout(model, parallel, torch.distributed.get_world_size())
    use_te = resolve_use_te(options)
    config = transformer_config(model, parallel, options, use_te)
    vpp = parallel.virtual_pp
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        n_local = get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)
        spec = qwen3_moe_block_spec(model.num_experts, n_local, use_te)
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        chunk = Qwen3MoEModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(model.vocab_size, parallel.tp),
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=int(model.rope_theta),
            vp_stage=stage,
        )
        chunk.model_config = model
        chunk.parallel_config = parallel
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks
