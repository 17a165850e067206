"""Parameter counts of a Qwen3-MoE model, per component, with the counting conventions spelled out.

Conventions (all counts are of the unpadded Hugging Face model; Megatron's vocabulary padding is a memory matter,
see `memory.py`):

- ``total``: every parameter, i.e. ``sum(p.numel() for p in Qwen3MoeForCausalLM(cfg).parameters())``.
- ``active``: parameters a token touches in one forward pass: attention, norms, router, the top-k experts of every
  layer, plus the input embedding table and the LM head, each counted in full (the convention of
  `ModelConfig.num_parameters()`, and of "numel of the sub-network one token uses"). Qwen3-30B-A3B: 3.353B. Qwen
  does not publish how its card's "3.3B activated" is counted; 3.353B is the nearest natural count (+1.6%), so the
  card's figure reads as this number cut, not rounded, to one decimal. No natural convention lands within 1% of
  3.300B: ``active_compute`` is 3.042B (-7.8%) and ``non_embedding_active`` 2.731B (-17%).
- ``active_compute``: ``active`` without the input embedding table, which is a row lookup, not a matrix product. This
  is the N of the usual ``6 * N * tokens`` FLOP estimate (3.042B for Qwen3-30B-A3B). With tied embeddings the table
  is the LM head's matrix, so nothing is removed.
- ``non_embedding`` / ``non_embedding_active``: without the embedding table and the LM head (Qwen's
  "Non-Embedding" line: 29.9B total for Qwen3-30B-A3B; 2.73B active).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.models.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts per component; per-layer fields are for ONE decoder layer."""

    vocab_size: int
    """Unpadded vocabulary."""
    hidden_size: int
    """Residual width."""
    num_layers: int
    """Decoder layers (all MoE)."""
    embedding: int
    """Input embedding table (vocab x hidden)."""
    lm_head: int
    """Output projection (0 when tied to the embedding)."""
    final_norm: int
    """Final RMSNorm weight."""
    attention: int
    """Per layer: q, k, v, o projection weights (no biases in Qwen3-MoE)."""
    qk_norm: int
    """Per layer: q_norm and k_norm weights (RMSNorm over head_dim)."""
    layer_norms: int
    """Per layer: input_layernorm + post_attention_layernorm weights."""
    router: int
    """Per layer: router (gate) weight, hidden x num_experts."""
    expert: int
    """ONE expert: gate, up and down projections."""
    num_experts: int
    """Routed experts per layer."""
    topk: int
    """Experts per token."""

    # ---- per layer ------------------------------------------------------------------------------------------
    @property
    def layer_dense(self) -> int:
        """Per layer, everything but the experts (attention, qk-norm, layer norms, router)."""
        return self.attention + self.qk_norm + self.layer_norms + self.router

    @property
    def layer_experts(self) -> int:
        """Per layer, all routed experts."""
        return self.num_experts * self.expert

    @property
    def layer_total(self) -> int:
        """Per layer, all parameters."""
        return self.layer_dense + self.layer_experts

    @property
    def layer_active(self) -> int:
        """Per layer, parameters one token touches (top-k experts)."""
        return self.layer_dense + self.topk * self.expert

    # ---- whole model ----------------------------------------------------------------------------------------
    @property
    def total(self) -> int:
        """All parameters (equals the transformers model's numel)."""
        return self.embedding + self.lm_head + self.final_norm + self.num_layers * self.layer_total

    @property
    def active(self) -> int:
        """Parameters touched per token, embedding table and LM head counted in full (module docstring)."""
        return self.embedding + self.lm_head + self.final_norm + self.num_layers * self.layer_active

    @property
    def active_compute(self) -> int:
        """`active` without the input embedding lookup: the N of `6 * N * tokens` training FLOPs."""
        return self.active - (self.embedding if self.lm_head else 0)

    @property
    def non_embedding(self) -> int:
        """All parameters but the embedding table and LM head."""
        return self.total - self.embedding - self.lm_head

    @property
    def non_embedding_active(self) -> int:
        """Active parameters but the embedding table and LM head."""
        return self.active - self.embedding - self.lm_head

    @property
    def expert_total(self) -> int:
        """All routed-expert parameters of the model (the part expert parallelism splits)."""
        return self.num_layers * self.layer_experts

    @property
    def dense_total(self) -> int:
        """Everything but the routed experts (the part tensor parallelism splits or replicates)."""
        return self.total - self.expert_total


def count_parameters(model: ModelConfig) -> ParamCounts:
    """Per-component parameter counts of the Hugging Face `Qwen3MoeForCausalLM` built from `model`."""
    h, hd = model.hidden_size, model.head_dim
    q_out = model.num_attention_heads * hd
    kv_out = model.num_key_value_heads * hd
    return ParamCounts(
        vocab_size=model.vocab_size,
        hidden_size=h,
        num_layers=model.num_hidden_layers,
        embedding=model.vocab_size * h,
        lm_head=0 if model.tie_word_embeddings else model.vocab_size * h,
        final_norm=h,
        attention=h * q_out + 2 * h * kv_out + q_out * h,
        qk_norm=2 * hd,
        layer_norms=2 * h,
        router=h * model.num_experts,
        expert=3 * h * model.moe_intermediate_size,
        num_experts=model.num_experts,
        topk=model.num_experts_per_tok,
    )


def format_count(n: float) -> str:
    """12_345_678_901 -> '12.35B'; 1_783_168 -> '1.78M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(int(n))
