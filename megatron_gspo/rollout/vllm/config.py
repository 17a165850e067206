"""Configuration of the vLLM rollout engine: the shared server fields (server/config.py) plus vLLM's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_gspo.rollout.server.config import ServerConfig, check_ints, check_port
from megatron_gspo.rollout.types import RoutingSpec

WEIGHT_TRANSPORTS = ("shm", "disk", "nccl")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
TRAINER_WEIGHTS = "trainer"
EXECUTOR_FLAG = "--distributed-executor-backend"
WORKER_LAYOUT_FLAGS = (EXECUTOR_FLAG, "--config", "-tp", "--tensor-parallel-size", "-pp",
                       "--pipeline-parallel-size", "-dp", "--data-parallel-size")
"""Server arguments that choose the executor or the worker count themselves (a `--config` file may hold either,
and vLLM puts its arguments before the command line's): a server given any of them keeps vLLM's own executor."""


def engine_logprobs_problem(logprobs_mode: str, temperature: float, top_p: float, top_k: int) -> str | None:
    """Why vLLM's sample log-probs cannot be pi_old here (rollout.old_logprobs=engine), or None.

    The trainer's pi_old / pi_theta is the full softmax of logits / rollout.temperature (batching/logprobs.py).
    vLLM 0.32 (v1/sample/sampler.py `Sampler.forward`, config/model.py `logprobs_mode`): 'processed_logprobs' are
    taken after temperature *and* top-k / top-p, i.e. renormalised over the kept tokens; 'raw_logprobs' are the
    full softmax at temperature 1. (SGLang 0.5.9 / 0.5.23 report log softmax(logits / T) before top-k / top-p,
    layers/sampler.py: the trainer's distribution, so it needs no such check.)
    """
    filtered = top_p < 1.0 or top_k > 0
    if logprobs_mode == "processed_logprobs" and filtered:
        return (
            f"rollout.old_logprobs=engine with vllm.logprobs_mode=processed_logprobs and rollout.top_p={top_p:g} / "
            f"rollout.top_k={top_k}: vLLM's processed_logprobs are renormalised over the top-k / top-p tokens, "
            "not the full softmax the trainer computes; use rollout.old_logprobs=recompute, rollout.top_p=1 and rollout.top_k=0, or "
            "vllm.logprobs_mode=raw_logprobs with rollout.temperature=1"
        )
    if logprobs_mode == "raw_logprobs" and temperature != 1.0:
        return (
            f"rollout.old_logprobs=engine with vllm.logprobs_mode=raw_logprobs: vLLM reports log-probs at "
            f"temperature 1, the trainer's are at rollout.temperature={temperature:g}; use "
            "vllm.logprobs_mode=processed_logprobs (with rollout.top_p=1, rollout.top_k=0) or "
            "rollout.old_logprobs=recompute"
        )
    return None


@dataclass
class VLLMConfig(ServerConfig):
    """vLLM servers used for rollouts (REFERENCE.md §9); vLLM lives in its own environment (`make rollout-env`)."""

    section: ClassVar[str] = "vllm"

    model_path: str = TRAINER_WEIGHTS
    """HF checkpoint directory the servers load at start; 'trainer': the trainer's own initial weights, exported
    by megatron-gspo into a directory under the weight root (launch mode; no conversion step needed)."""
    python: str = ".venv-vllm/bin/python"
    """Interpreter of the vLLM environment (`make rollout-env` builds .venv-vllm)."""
    server_module: str = "vllm.entrypoints.openai.api_server"
    """Module run with `python -m` to start one server."""
    port_base: int = 8100
    """HTTP port of server 0; server i listens on port_base + i."""
    dtype: str = "auto"
    """Server compute dtype (`--dtype`; 'float32' on CPU makes engine log-probs match the fp32 trainer)."""
    max_model_len: int = 0
    """Context length of the servers (`--max-model-len`; 0: the model's max_position_embeddings)."""
    kv_cache_memory_bytes: int = 0
    """KV-cache size per server (`--kv-cache-memory-bytes`; 0: vLLM's default share of memory)."""
    seed: int = 0
    """Server seed (`--seed`); each request also carries its own seed."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (`--enforce-eager`); required on CPU, faster start on GPU."""
    tp_size: int = 1
    """Tensor-parallel size of every server (`--tensor-parallel-size`)."""
    gpu_memory_utilization: float = 0.0
    """GPU: fraction of memory vLLM may take (0: vLLM's default)."""
    logprobs_mode: str = "processed_logprobs"
    """Which log-probs the server reports: 'processed_logprobs' = after temperature (and top-k / top-p, which
    renormalise); 'raw_logprobs' = temperature 1. With rollout.old_logprobs=engine the run config refuses the
    combinations that are not the trainer's distribution (engine_logprobs_problem)."""
    weight_transport: str = "shm"
    """How weights reach the servers after each step: 'shm' (safetensors in /dev/shm, servers on this host),
    'disk' (safetensors under weight_sync_dir, a file system the servers read) — both through megatron-gspo's
    vLLM plugin — or 'nccl' (vLLM's NCCL weight transfer, GPU)."""
    weight_sync_dir: str | None = None
    """Disk transport: directory (readable by the servers) where each version is written."""
    master_address: str = "127.0.0.1"
    """NCCL transport: this trainer's address as the servers reach it (unused by the file transports)."""
    cpu_threads_bind: str = "nobind"
    """CPU servers: VLLM_CPU_OMP_THREADS_BIND ('auto', 'nobind', or core ids such as '0-1'); 'nobind' with
    `cpu_threads` leaves core placement to the OS (what a machine shared with the trainer wants)."""
    cpu_threads: int = 0
    """CPU servers: OpenMP threads (OMP_NUM_THREADS; 0: vLLM / OpenMP default)."""
    shm_busy_loop_s: float | None = None
    """Seconds a vLLM process keeps spinning (sched_yield) for the next shared-memory message after a read before
    it sleeps on a socket; null: vLLM 0.32's hard-coded 1 s. With vLLM's multiprocess executor (tp_size > 1,
    a CPU thread binding, or worker_in_engine_core false), while the Worker generates, its EngineCore spins
    there (about 0.45 core on a CPU host shared with the trainer); 0 stops that at a wake-up latency per
    engine step, a few ms keep most of the speed. Launch mode: the plugin applies it in the servers
    (plugin.py), vLLM 0.32 only."""

    worker_in_engine_core: bool = True
    """Launched servers at tp_size 1 with cpu_threads_bind 'nobind': the model's worker runs inside vLLM's
    EngineCore process (vLLM's UniProcExecutor, named by import path in `--distributed-executor-backend`), so
    no shared-memory queue links them and nothing spins on it: a one-thread CPU server takes ~1 core while it
    generates instead of ~1.5 (launch.py says why the import path). GPU servers at tp_size 1 already run that
    executor (vLLM's default); false keeps vLLM's own choice (on CPU its multiprocess executor)."""

    capture_routes: bool = False
    """R3 on CPU servers (which return no routes): record them with megatron-gspo's hooks on the MoE gates
    (rollout/vllm/worker.py RoutingCaptureExtension; prefix caching off). GPU servers: return_routed_experts."""

    def __post_init__(self) -> None:
        if self.capture_routes and self.return_routed_experts:
            raise ValueError(
                "vllm.capture_routes and vllm.return_routed_experts both ask for routes: pick one"
            )
        super().__post_init__()
        if self.weight_transport not in WEIGHT_TRANSPORTS:
            raise ValueError(
                f"vllm.weight_transport={self.weight_transport!r} must be one of {WEIGHT_TRANSPORTS}"
            )
        if self.weight_transport == "disk" and not self.weight_sync_dir:
            raise ValueError(
                "vllm.weight_transport=disk needs vllm.weight_sync_dir (readable by the servers)"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"vllm.dtype={self.dtype!r} must be one of {DTYPES}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"vllm.logprobs_mode={self.logprobs_mode!r} must be one of {LOGPROBS_MODES}")
        if self.mode == "attach" and self.model_path == TRAINER_WEIGHTS:
            self.model_path = (
                ""  # attached servers already hold weights; the first sync makes them the trainer's
            )
        if self.unchunked_prefill and "--enable-chunked-prefill" in self.extra_server_args:
            raise ValueError(
                "vllm.extra_server_args has --enable-chunked-prefill: a chunked re-prefill after a weight sync "
                "crashes a CPU vLLM server with vllm.partial_rollouts=true (seeded generators cannot be offset on "
                "CPU); remove the flag or set vllm.partial_rollouts=false"
            )
        if self.shm_busy_loop_s is not None and (isinstance(self.shm_busy_loop_s, bool) or not (
                isinstance(self.shm_busy_loop_s, (int, float)) and self.shm_busy_loop_s >= 0)):
            raise ValueError(
                f"vllm.shm_busy_loop_s={self.shm_busy_loop_s!r} must be seconds >= 0 (null: vLLM's 1 s)"
            )
        if self.mode == "attach" and self.shm_busy_loop_s is not None:
            raise ValueError(  # it reaches only launched servers: attached ones would silently keep spinning
                f"vllm.shm_busy_loop_s={self.shm_busy_loop_s!r} applies only to servers the trainer "
                "launches: remove it with vllm.mode=attach"
            )
        if not isinstance(self.worker_in_engine_core, bool):
            raise ValueError(
                f"vllm.worker_in_engine_core={self.worker_in_engine_core!r} must be true or false"
            )
        check_ints(self, ("max_model_len", "kv_cache_memory_bytes", "seed", "cpu_threads"), minimum=0)
        check_ints(self, ("tp_size",), minimum=1)
        check_port(self, "port_base")
        if not 0 <= self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization={self.gpu_memory_utilization} must be in [0, 1]")

    def routes_flag(self) -> str | None:
        return "capture_routes" if self.capture_routes else super().routes_flag()

    @property
    def unchunked_prefill(self) -> bool:
        """Whether the servers run without chunked prefill (launch.py says why): partial rollouts (pause
        mode=keep) on servers that may be CPU ones (any transport but NCCL, which needs GPUs)."""
        return self.partial_rollouts and not self.return_routed_experts and self.weight_transport != "nccl"

    @property
    def in_process_worker(self) -> bool:
        """Whether launched servers get the in-process executor (worker_in_engine_core): one worker
        (tp_size 1), no CPU thread binding (which only vLLM's multiprocess executor applies, by setting
        OpenMP's environment before it starts the worker: v1/executor/multiproc_executor.py,
        OMPProcessManager; `server_env` may set it too), and no executor or worker count of the user's own in
        extra_server_args (WORKER_LAYOUT_FLAGS: UniProcExecutor would start only rank 0 of a -tp 2)."""
        bind = self.server_env.get("VLLM_CPU_OMP_THREADS_BIND", self.cpu_threads_bind)
        return (self.worker_in_engine_core and self.tp_size == 1 and bind == "nobind"
                and not any(a.split("=", 1)[0] in WORKER_LAYOUT_FLAGS for a in self.extra_server_args))

    @property
    def capture_spec(self) -> RoutingSpec | None:
        """Shape of the routes the gate hooks record (None without capture_routes)."""
        return self.routes_spec() if self.capture_routes else None

    @property
    def serves_trainer_weights(self) -> bool:
        """Launch mode with model_path 'trainer': the engine exports the trainer's weights to start from."""
        return self.mode == "launch" and self.model_path == TRAINER_WEIGHTS
