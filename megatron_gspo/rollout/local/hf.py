"""HF backend of the local engine: a transformers `Qwen3MoeForCausalLM` replica for split layouts.

When this rank's Megatron model is split (tp, pp, ep or cp > 1) its forward needs every peer rank in lock step,
which per-rank sampling cannot give. Instead the full weights are exported (`export`-style streaming through
`iter_hf_tensors`, a collective every rank joins) into a transformers replica on the generating ranks (rank 0
of each model-parallel group); it decodes with transformers' DynamicCache.

Routing capture: a forward hook on every layer's `mlp.gate` (transformers 5: Qwen3MoeTopKRouter.forward ->
(router_logits, top-k weights, top-k indices) over [b*s] b-major tokens). The indices are torch.topk of the
softmax, i.e. descending probability: the same order convention as the Megatron backend.
"""

from __future__ import annotations

import inspect
import re

import torch

from megatron_gspo.models.config import ModelConfig
from megatron_gspo.models.hf_state import hf_tensor_shapes, iter_hf_tensors

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFReplica:
    """The trainer's current weights in a transformers model (built on `keep` ranks only)."""

    def __init__(self, model_config: ModelConfig, *, keep: bool, dtype: torch.dtype, device: torch.device):
        self.config = model_config
        self.keep = keep
        self.dtype = dtype
        self.device = device
        self.model = None

    def _build(self):
        from transformers import Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(self.config.to_hf_config())
        return model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def refresh(self, chunks) -> None:
        """Streams the trainer's weights in. Collective: every rank of the job must call it."""
        if self.keep and self.model is None:
            self.model = self._build()
        params = dict(self.model.named_parameters()) if self.keep else {}
        written: set[str] = set()
        for name, tensor in iter_hf_tensors(chunks):
            if not self.keep:
                continue  # the tensor is dropped at once: only generating ranks hold a replica
            self._copy(params, name, tensor)
            written.add(name)
        if self.keep:
            missing = [n for n in hf_tensor_shapes(self.config) if n not in written]
            if missing:
                raise RuntimeError(f"weight export left {len(missing)} HF tensors unset (e.g. {missing[:3]})")

    def _copy(self, params: dict, name: str, tensor: torch.Tensor) -> None:
        m = _EXPERT.match(name)
        if m is None:
            if name not in params:
                raise RuntimeError(f"exported tensor {name} has no counterpart in the transformers model")
            params[name].copy_(tensor)
            return
        layer, expert, kind = m[1], int(m[2]), m[3]
        prefix = f"model.layers.{layer}.mlp.experts."
        inter = self.config.moe_intermediate_size
        if kind == "down_proj":
            params[prefix + "down_proj"][expert].copy_(tensor)
        else:  # transformers keeps experts fused in memory: gate_up_proj[e] = [gate; up]
            rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
            params[prefix + "gate_up_proj"][expert, rows].copy_(tensor)

    def release(self) -> None:
        self.model = None


class HFStepper:
    """Prefill / decode steps of one batch on the replica with a DynamicCache."""

    def __init__(self, model, *, topk: int, record_routing: bool = True):
        from transformers import DynamicCache

        self.model = model
        self.topk = topk
        self.cache = None
        self._cache_cls = DynamicCache
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: list[torch.Tensor] = []
        self._hooks = []
        if record_routing:
            for layer in model.model.layers:
                self._hooks.append(layer.mlp.gate.register_forward_hook(self._capture))

    def _capture(self, module, args, output) -> None:
        if isinstance(output, tuple) and len(output) >= 3:
            self._captured.append(output[2].long())
        else:  # a plain linear gate returning logits
            logits = output[0] if isinstance(output, tuple) else output
            self._captured.append(torch.topk(logits.float(), self.topk, dim=-1).indices)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _forward(self, ids_BS: torch.Tensor):
        b, s = ids_BS.shape
        self._captured.clear()
        out = self.model(input_ids=ids_BS, use_cache=True, logits_to_keep=1, **{self._cache_kw: self.cache})
        experts = None
        if self._hooks:
            # each capture is [b*s, K] b-major -> [b, s, X, K]
            experts = torch.stack(self._captured, dim=1).view(b, s, len(self._captured), self.topk)
            self._captured.clear()
        return out.logits[:, -1, :], experts

    def prefill(self, ids_UL: torch.Tensor):
        self.cache = self._cache_cls(config=self.model.config)
        return self._forward(ids_UL)

    def select_rows(self, index_R: torch.Tensor) -> None:
        self.cache.reorder_cache(index_R)

    def decode(self, tokens_A: torch.Tensor):
        logits_AV, experts_A1XK = self._forward(tokens_A[:, None])
        return logits_AV, (experts_A1XK[:, 0] if experts_A1XK is not None else None)

    def release(self) -> None:
        self.cache = None
