"""Megatron backend of the local engine: the trainer's own GPTModel with megatron-core's StaticInferenceContext.

Only for models that are not split on this rank (tp = pp = ep = cp = 1); data-parallel replicas each generate
their own prompts.

KV cache (megatron-core 0.16.1, `transformer/attention.py::_adjust_key_value_for_inference`): each attention
layer keeps [max_seq, max_batch, groups, head_dim] key / value buffers in `ctx.key_value_memory_dict`, writes the
new keys at [sequence_len_offset : +s, batch_size_offset : +b] and attends over [:sequence_len_offset + s]. RoPE
for the queries is sliced at the same offsets. Prefill (offset 0) uses the causal mask; once the offset is > 0
the mask is switched off, which is right for one-token decode steps. With `materialize_only_last_token_logits`
the model returns only the last position's logits. We advance `sequence_len_offset` ourselves after each forward
(as megatron's text-generation controller does) and keep `batch_size_offset` at 0: a batch always fills rows
0..b-1, and `select_rows` gathers the cache rows in place when samples are expanded or finish. (Keys are
cached before RoPE and rotated again at every step, as megatron's non-flash-decode path does: O(seq) per decode
step, not a re-run of the network over the prefix.)

Routing capture: a forward hook on every layer's `mlp.router` (TopKRouter.forward -> (probs [s*b, E] s-major,
routing_map [s*b, E])). The recorded ids are the routing map's selected experts in descending probability order
(the router's own top-k order; exact ties in arbitrary order); `set(ids)` is always exactly the routed set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_gspo.models.modes import set_training


def router_topk_ids(probs_TE: torch.Tensor, routing_map_TE: torch.Tensor, topk: int) -> torch.Tensor:
    """[tokens, topk] int64 expert ids selected by `routing_map`, ordered by probability (descending)."""
    masked_TE = probs_TE.float().masked_fill(~routing_map_TE.bool(), -1.0)
    return torch.topk(masked_TE, topk, dim=-1).indices


def moe_routers(model) -> list:
    """This chunk's TopKRouter modules in layer order."""
    routers = []
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            routers.append(router)
    return routers


@contextlib.contextmanager
def inference_mode(model) -> Iterator[None]:
    """eval() + no_grad, router replay paused (so rollouts route freely); everything restored afterwards."""
    was_training = model.training
    replays = [r.router_replay for r in moe_routers(model) if getattr(r, "router_replay", None) is not None]
    actions = [r.router_replay_action for r in replays]
    set_training(model, False)
    for r in replays:
        r.router_replay_action = None
    try:
        with torch.no_grad():
            yield
    finally:
        for r, a in zip(replays, actions):
            r.router_replay_action = a
        set_training(model, was_training)


class MegatronStepper:
    """Prefill / decode steps of one batch on a GPTModel with a (reused) StaticInferenceContext."""

    def __init__(self, model, context, *, topk: int, record_routing: bool = True):
        self.model = model
        self.ctx = context
        self.topk = topk
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks = []
        if record_routing:
            for router in moe_routers(model):
                self._hooks.append(router.register_forward_hook(self._capture))
        self.device = next(model.parameters()).device

    def _capture(self, module, args, output) -> None:
        probs, routing_map = output[0], output[1]
        self._captured.append(router_topk_ids(probs, routing_map, self.topk))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _forward(self, ids_BS: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, s = ids_BS.shape
        self._captured.clear()
        positions_BS = torch.arange(offset, offset + s, device=ids_BS.device).expand(b, s)
        logits_B1V = self.model(
            ids_BS, positions_BS, None, inference_context=self.ctx, runtime_gather_output=True
        )
        self.ctx.increment_sequence_len_offset(s)
        experts = None
        if self._hooks:
            # each capture is [s*b, K] s-major -> [b, s, X, K]
            experts = torch.stack(self._captured, dim=1).view(s, b, len(self._captured), self.topk)
            experts = experts.transpose(0, 1)
            self._captured.clear()
        return logits_B1V[:, -1, :], experts

    def prefill(self, ids_UL: torch.Tensor):
        self.ctx.reset()
        return self._forward(ids_UL, 0)

    def select_rows(self, index_R: torch.Tensor) -> None:
        seq, rows = self.ctx.sequence_len_offset, index_R.numel()
        for key_mem, value_mem in self.ctx.key_value_memory_dict.values():
            # advanced indexing copies first, so overlapping source / destination rows are safe
            key_mem[:seq, :rows] = key_mem[:seq, index_R]
            value_mem[:seq, :rows] = value_mem[:seq, index_R]

    def decode(self, tokens_A: torch.Tensor):
        self.ctx.enable_decode_mode()
        logits_AV, experts_A1XK = self._forward(tokens_A[:, None], self.ctx.sequence_len_offset)
        return logits_AV, (experts_A1XK[:, 0] if experts_A1XK is not None else None)


def new_context(max_batch_size: int, max_sequence_length: int):
    """A megatron StaticInferenceContext (KV buffers are allocated by the attention layers on first use)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(max_batch_size, max_sequence_length)
