"""The local spec's MoE experts with megatron's per-expert math and none of its per-expert module machinery.

megatron-core 0.16.1's local spec runs the experts with `SequentialMLP`: for each local expert, an `MLP` module
call (ColumnParallelLinear -> GLU -> per-token probability scale -> RowParallelLinear), each linear an autograd
Function with its tensor-parallel plumbing (and, in RowParallelLinear, a deprecation `warnings.warn` per call
because it passes `tp_group=None`). On the CPU's tiny models that plumbing costs more than the GEMMs: a profile of
one small RL step (tools/profile_step.py) had the expert loop as the largest single layer of the stack.

megatron's grouped paths do not run here: `GroupedMLP` needs the CUDA `grouped_gemm` package and bf16
(experts.py asserts both) and `TEGroupedMLP` needs transformer-engine; both also store the experts' weights in
another layout ([E * ...] flat tensors), which would change checkpoints and the HF mapping.

`ExpertLoop` keeps `SequentialMLP`'s modules, parameters, state dicts and sharded state dicts (checkpoints and
models/hf_state.py see the same `local_experts.E.linear_fc{1,2}.weight`) and, when the experts are plain
unsplit SwiGLU / activation MLPs with no bias (expert tensor parallelism 1, no fp8 / fp4, no fused or TE
activation), computes the same thing with the same torch ops on the same tensors, all experts in one autograd
Function per linear layer:
- fc1 / fc2: per expert e, out_e = x_e @ W_e^T (megatron's `torch.matmul(input, weight.t())`); backward
  grad_x_e = g_e @ W_e and grad_W_e = g_e^T @ x_e (megatron's `LinearWithGradAccumulationAndAsyncCommunication`
  without gradient-accumulation fusion, which the local spec never uses). An expert with no tokens gets a zero
  weight gradient, as with megatron's loop, so every expert weight gets a gradient in every backward.
- GLU, the activation and the probability scale are row-wise elementwise ops: run once over all experts' rows
  they give each row what the per-expert calls gave it (megatron's `MLP.forward` order: glu, then
  `* per_token_scale[:, None]`, cast back to the activation dtype).
tests/models/test_experts.py compares forward outputs and every gradient with megatron's own `SequentialMLP`
bit for bit. Any other configuration, or experts whose modules carry forward hooks (DDP overlap_param_gather),
runs megatron's loop unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP


class _ExpertLinears(torch.autograd.Function):
    """out = cat_e(x_e @ W_e^T) over row blocks x_e of `counts[e]` rows: every local expert's linear layer."""

    @staticmethod
    def forward(ctx, x_RI, counts: list[int], *weights_OI):
        ctx.counts = counts
        ctx.save_for_backward(x_RI, *weights_OI)
        blocks = torch.split(x_RI, counts)
        return torch.cat([torch.matmul(x, w.t()) for x, w in zip(blocks, weights_OI)], dim=0)

    @staticmethod
    def backward(ctx, grad_RO):
        x_RI, *weights_OI = ctx.saved_tensors
        grads = torch.split(grad_RO.contiguous(), ctx.counts)
        blocks = torch.split(x_RI, ctx.counts)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([g.matmul(w) for g, w in zip(grads, weights_OI)], dim=0)
        grad_w = [g.t().matmul(x) if need else None
                  for g, x, need in zip(grads, blocks, ctx.needs_input_grad[2:])]
        return (grad_x, None, *grad_w)


class ExpertLoop(SequentialMLP):
    """megatron's SequentialMLP (same modules and parameters), its per-expert math run without the per-expert
    module calls when the experts are plain unsplit MLPs; see the module docstring."""

    def _lean(self) -> bool:
        c = self.config
        fc1 = self.local_experts[0].linear_fc1 if len(self.local_experts) else None
        return (
            fc1 is not None
            and self.tp_group.size() == 1
            and not c.add_bias_linear
            and not (c.fp8 or c.fp4)
            and not c.moe_apply_probs_on_input
            and not c.bias_activation_fusion
            and not c.use_te_activation_func
            and not c.gradient_accumulation_fusion
            and c.activation_func_clamp_value is None
            and c.glu_linear_offset == 0.0
            and c._cpu_offloading_context is None
            and not getattr(c, "delay_wgrad_compute", False)
            and type(fc1).__name__ == "ColumnParallelLinear"
            and type(self.local_experts[0].linear_fc2).__name__ == "RowParallelLinear"
            and not self._expert_module_hooks()
        )

    def _expert_module_hooks(self) -> bool:
        """Whether a module inside the experts carries forward hooks: megatron's DDP with overlap_param_gather
        registers a forward pre-hook on every module to finish its bucket's parameter all-gather (and start the
        next) in forward order; skipping the per-expert module calls would skip those hooks and break the
        gather order (`assert self.param_gather_handle is None` in param_and_grad_buffer.start_param_sync)."""
        # The hooks are looked at on every forward (DDP registers them after the model is built), the module
        # tree once: the recursive walk over every expert's modules cost more than the check.
        modules = self.__dict__.get("_expert_submodules")
        if modules is None:
            modules = self.__dict__["_expert_submodules"] = tuple(m for e in self.local_experts for m in e.modules())
        return any(m._forward_pre_hooks or m._forward_hooks for m in modules)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._lean():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = tokens_per_expert.tolist()
        fc1 = [e.linear_fc1.weight for e in self.local_experts]
        fc2 = [e.linear_fc2.weight for e in self.local_experts]
        h = _ExpertLinears.apply(permuted_local_hidden_states, counts, *fc1)
        if self.config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            h = self.config.activation_func(x_glu) * x_linear
        else:
            h = self.config.activation_func(h)
        dtype = h.dtype
        h = (h * permuted_probs.unsqueeze(-1)).to(dtype)
        return _ExpertLinears.apply(h, counts, *fc2), None


__all__ = ["ExpertLoop"]
