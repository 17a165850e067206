"""vLLM's server command line and environment (launch mode); processes are supervised by server/process.py."""

from __future__ import annotations

import json
import os

from megatron_gspo.rollout.vllm.config import EXECUTOR_FLAG, VLLMConfig
from megatron_gspo.rollout.vllm.plugin import BACKEND, BUSY_LOOP_ENV

CAPTURE_EXTENSION = "megatron_gspo.rollout.vllm.worker.RoutingCaptureExtension"
IN_PROCESS_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"
"""vLLM's single-worker executor by import path (`vllm.worker_in_engine_core`). Not 'uni': vLLM 0.32's CPU
platform turns 'uni' into 'mp' while V1 multiprocessing is on (platforms/cpu.py:334-341, CpuPlatform.
check_and_update_config, for OpenMP binding) and only compares the string, whereas an import path is resolved
as is (v1/executor/abstract.py Executor.get_class). On GPU at tp_size 1 'uni' is vLLM's default
(config/parallel.py:1079-1080): the same class. Left out when vllm.extra_server_args names an executor."""


def server_command(cfg: VLLMConfig, index: int, model_path: str | None = None) -> list[str]:
    """Command line of launched server `index`: token ids in and out (no tokenizer), the RL token API
    (`--enable-scale-out`), and the weight-transfer backend of `cfg.weight_transport`."""
    if not 0 <= index < cfg.num_servers:
        raise ValueError(f"server index {index} outside 0..vllm.num_servers-1={cfg.num_servers - 1}")
    backend = "nccl" if cfg.weight_transport == "nccl" else BACKEND
    cmd = [
        cfg.python, "-m", cfg.server_module,
        "--model", model_path or cfg.model_path,
        "--host", cfg.host,
        "--port", str(cfg.server_port(index)),
        "--dtype", cfg.dtype,
        "--seed", str(cfg.seed),
        "--tensor-parallel-size", str(cfg.tp_size),
        "--skip-tokenizer-init",
        "--enable-scale-out",
        "--logprobs-mode", cfg.logprobs_mode,
        "--weight-transfer-config", json.dumps({"backend": backend}),
    ]  # fmt: skip
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", str(cfg.kv_cache_memory_bytes)]
    if cfg.gpu_memory_utilization:
        cmd += ["--gpu-memory-utilization", f"{cfg.gpu_memory_utilization:g}"]
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.capture_routes:
        cmd += ["--worker-extension-cls", CAPTURE_EXTENSION, "--no-enable-prefix-caching"]
    if cfg.in_process_worker:
        cmd += [EXECUTOR_FLAG, IN_PROCESS_EXECUTOR]
    if cfg.unchunked_prefill:
        # A partial rollout's re-prefill after a sync (prompt + answer so far) longer than a step's token budget
        # (2048 on CPU) is chunked; vLLM then moves the request's seeded generator with `set_offset`, which a CPU
        # torch.Generator refuses ("CPU Generator does not use offset", v1/worker/gpu_model_runner.py), and the
        # engine core dies. Unchunked, vLLM raises max-num-batched-tokens to max-model-len (arg_utils.py).
        cmd.append("--no-enable-chunked-prefill")
    return cmd + list(cfg.extra_server_args)


def server_env(cfg: VLLMConfig) -> dict[str, str | None]:
    """Environment of a launched server on top of the trainer's (None unsets a variable)."""
    env: dict[str, str | None] = {
        "VLLM_SERVER_DEV_MODE": "1",  # the RL endpoints (/pause, /start_weight_update, ...) and /reset_prefix_cache
        "VLLM_CPU_OMP_THREADS_BIND": cfg.cpu_threads_bind,
    }
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") == "":
        env["VLLM_CPU_KVCACHE_SPACE"] = None  # an empty value crashes vLLM's CPU backend (int(""))
    if cfg.cpu_threads:
        env["OMP_NUM_THREADS"] = str(cfg.cpu_threads)
    if cfg.shm_busy_loop_s is not None:
        env[BUSY_LOOP_ENV] = repr(float(cfg.shm_busy_loop_s))
    env.update(cfg.server_env)
    return env
