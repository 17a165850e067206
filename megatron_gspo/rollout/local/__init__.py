"""The in-process rollout engine: generation with the trainer's own model (KV-cached, batched), no server."""

from megatron_gspo.rollout.local.engine import LocalEngine

__all__ = ["LocalEngine"]
