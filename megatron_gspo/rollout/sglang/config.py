"""Configuration of the SGLang rollout engine: the shared server fields (server/config.py) plus SGLang's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_gspo.rollout.server.config import ServerConfig, check_ints, check_port, check_url
from megatron_gspo.rollout.sglang.versions import SGLANG_ROUTER

WEIGHT_SYNC_MODES = ("distributed", "disk", "shm")


@dataclass
class SGLangConfig(ServerConfig):
    """SGLang servers used for rollouts (REFERENCE.md §4); SGLang lives in a separate environment (§6)."""

    section: ClassVar[str] = "sglang"

    router_url: str | None = None
    """Attach mode: URL of an sglang-router in front of `urls`; generation goes there when set."""
    server_module: str = "sglang.launch_server"
    """Module run with `python -m` to start one server (tests substitute a fake server module)."""
    router_module: str = "sglang_router.launch_router"
    """Module run with `python -m` to start the router."""
    tp_size: int = 1
    """Tensor-parallel size of every server (GPUs per server)."""
    base_gpu_id: int = 0
    """First GPU of server 0; server i uses GPUs base_gpu_id + i * tp_size ... + tp_size - 1."""
    mem_fraction: float = 0.8
    """Fraction of GPU memory SGLang reserves for weights + KV cache (`--mem-fraction-static`)."""
    router: bool = False
    """Launch mode: start an sglang-router in front of the servers and send generation through it."""
    router_port: int = 29000
    """HTTP port of the router (launch mode)."""
    colocated: bool = False
    """Servers share GPUs with the trainer: start them with `--enable-memory-saver`; they release their memory
    after every rank's generation and take it back before the weight sync. Needs a file weight sync ('disk' or
    'shm'): an NCCL group with a trainer rank and a server rank on one GPU is refused by NCCL."""
    offload_masters: bool = False
    """Colocated mode: besides Adam's moments and the main-grad buffers, move the fp32 master weights to host
    memory while the servers generate (training/offload.py)."""
    weight_sync: str = "distributed"
    """'distributed': NCCL broadcast from trainer rank 0 into the servers (their GPUs must differ from rank 0's);
    'disk': safetensors under weight_sync_dir + `/update_weights_from_disk`; 'shm': the same under /dev/shm
    (RAM; servers on trainer rank 0's host only)."""
    weight_sync_dir: str | None = None
    """Disk mode: directory (shared with the servers) where each version's safetensors are written."""
    deterministic_inference: bool = False
    """Start the servers with `--enable-deterministic-inference` (attach mode: require that they run with it). Only
    then does SGLang use each request's `sampling_seed`, i.e. are rollouts reproducible from trainer.seed. Cost
    (SGLang's server_args.py): batch-invariant kernels, the pytorch sampling backend, attention limited to
    flashinfer / fa3 / triton (flashinfer also turns the radix cache off) and, with tp_size > 1, NCCL tree
    all-reduce without custom all-reduce: slower rollouts."""
    context_length: int | None = None
    """Context length of the servers (`--context-length`); the trainer fills in the model's
    max_position_embeddings, which is what SGLang derives from config.json. SGLang refuses a request whose prompt
    + max_new_tokens reaches it, so prompt + rollout.max_new_tokens must stay below it (checked before sending)."""
    master_address: str = "127.0.0.1"
    """Distributed mode: address of the trainer's rendezvous store, reachable from the servers."""
    master_port: int = 0
    """Distributed mode: port of the rendezvous store (0 = the OS picks one when the trainer binds the store)."""
    group_name: str = "weight_update_group"
    """Distributed mode: name of the trainer + servers weight-update process group (always NCCL)."""
    recover_timeout_s: float = 60.0
    """Attach mode, --resume: how long each server may take to undo what the run's trainer killed with kill -9 left
    (its group, its weight-update session, its pause; engine.py `_undo_dead_trainer`) before the run stops, telling
    to restart the servers: a server that does not answer is stuck in a broadcast from that trainer."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"sglang.weight_sync={self.weight_sync!r} must be one of {WEIGHT_SYNC_MODES}")
        if self.colocated and self.weight_sync == "distributed":
            raise ValueError(
                "sglang.colocated=true with sglang.weight_sync=distributed puts trainer rank 0 and a server rank on "
                "one GPU in one NCCL group, which NCCL refuses (duplicate GPU); use sglang.weight_sync=disk with "
                "sglang.weight_sync_dir on a file system the servers read (or shm when they all run on rank 0's host)"
            )
        if self.return_routed_experts and (self.router or self.router_url):
            key = "sglang.router=true" if self.router else "sglang.router_url"
            raise ValueError(
                f"sglang.return_routed_experts=true with {key}: sglang-router {SGLANG_ROUTER} re-sends /generate "
                "without return_routed_experts, so no response would carry routed experts; leave the router out "
                "(the engine spreads prompts over the servers itself)"
            )
        if self.router_url is not None:
            self.router_url = self.router_url.rstrip("/")
        if self.mode == "attach":
            if self.router_url:
                check_url(self.router_url, "sglang.router_url")
            if self.router:
                raise ValueError(
                    "sglang.router=true starts a router (launch mode); in attach mode set sglang.router_url"
                )
        elif self.router_url is not None:
            raise ValueError("sglang.router_url is for attach mode; launch mode uses sglang.router=true")
        check_ints(self, ("tp_size",), minimum=1)
        check_ints(self, ("base_gpu_id", "master_port"), minimum=0)
        if self.context_length is not None:
            check_ints(self, ("context_length",), minimum=2)
        check_port(self, "router_port")
        if not self.recover_timeout_s > 0:
            raise ValueError(f"sglang.recover_timeout_s={self.recover_timeout_s} must be > 0")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"sglang.mem_fraction={self.mem_fraction} must be in (0, 1]")
        if self.weight_sync == "disk" and not self.weight_sync_dir:
            raise ValueError("sglang.weight_sync=disk needs sglang.weight_sync_dir (readable by the servers)")

    @classmethod
    def from_run_config(cls, options: dict[str, Any], model_config: Any):
        """As ServerConfig's, plus the servers' context length from the model (SGLang derives the same)."""
        options = dict(options)
        if options.get("context_length") is None and model_config is not None:
            options["context_length"] = model_config.max_position_embeddings
        return super().from_run_config(options, model_config)
