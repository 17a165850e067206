"""The vLLM plugin of megatron-gspo (entry point `vllm.general_plugins: megatron_gspo`, setup.py).

It runs inside vLLM's own environment (REFERENCE.md §6, §9), never in the trainer's: vLLM calls `register` in each
of its processes, and it registers the `megatron_gspo` weight-transfer backend (rollout/vllm/worker.py, imported
lazily by vLLM's factory when a server starts with `--weight-transfer-config '{"backend": "megatron_gspo"}'`).
Install it with `pip install --no-deps megatron-gspo` into the vLLM environment (`make rollout-env` does).
"""

from __future__ import annotations

BACKEND = "megatron_gspo"
"""Name of the weight-transfer backend in vLLM's registry (`--weight-transfer-config`)."""


def register() -> None:
    """Registers the backend with vLLM's WeightTransferEngineFactory (idempotent: vLLM may call it twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "megatron_gspo.rollout.vllm.worker", "SafetensorsWeightTransferEngine"
        )
