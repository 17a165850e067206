"""The vLLM plugin of megatron-gspo (entry point `vllm.general_plugins: megatron_gspo`, setup.py).

It runs inside vLLM's own environment (REFERENCE.md §6, §9), never in the trainer's: vLLM calls `register` in each
of its processes, and it registers the `megatron_gspo` weight-transfer backend (rollout/vllm/worker.py, imported
lazily by vLLM's factory when a server starts with `--weight-transfer-config '{"backend": "megatron_gspo"}'`) and,
where the launcher asks for it (`vllm.shm_busy_loop_s`), shortens vLLM's busy wait on its shared-memory queues.
Install it with `pip install --no-deps megatron-gspo` into the vLLM environment (`make rollout-env` does).
"""

from __future__ import annotations

import os

BACKEND = "megatron_gspo"
"""Name of the weight-transfer backend in vLLM's registry (`--weight-transfer-config`)."""
BUSY_LOOP_ENV = "MEGATRON_GSPO_VLLM_SHM_BUSY_LOOP_S"
"""Seconds of `vllm.shm_busy_loop_s`, set in a launched server's environment (launch.py) only when configured."""
SPIN_VLLM = "0.32."
"""The vLLM release whose SpinCondition `limit_shm_spin` was written against (read in its shm_broadcast.py)."""


def register() -> None:
    """Registers the backend with vLLM's WeightTransferEngineFactory (idempotent: vLLM may call it twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "megatron_gspo.rollout.vllm.worker", "SafetensorsWeightTransferEngine"
        )
    if os.environ.get(BUSY_LOOP_ENV):
        limit_shm_spin(float(os.environ[BUSY_LOOP_ENV]))


def limit_shm_spin(busy_loop_s: float) -> None:
    """Every shared-memory queue reader of this process spins at most `busy_loop_s` after a read before sleeping.

    vLLM 0.32's MessageQueue readers (EngineCore waiting for its Worker and back) call sched_yield in a loop for a
    hard-coded 1 s after each read (SpinCondition.busy_loop_s): idle-waiting at full speed is CPU taken from the
    trainer on a shared CPU host. Patched on the class as a read-only property, because a data descriptor wins over
    the attribute SpinCondition.__init__ sets, so the queues made before vLLM loads this plugin (a Worker's) obey
    it too."""
    import vllm
    from vllm.distributed.device_communicators import shm_broadcast

    if not vllm.__version__.startswith(SPIN_VLLM):
        raise RuntimeError(f"vllm.shm_busy_loop_s patches vLLM {SPIN_VLLM}x's SpinCondition, this server runs "
                           f"vLLM {vllm.__version__}: remove vllm.shm_busy_loop_s from the config")
    shm_broadcast.SpinCondition.busy_loop_s = property(lambda self: busy_loop_s, lambda self, value: None)
