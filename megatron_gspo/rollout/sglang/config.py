"""Configuration of the SGLang rollout engine: the shared server fields (server/config.py) plus SGLang's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_gspo.rollout.server.config import ServerConfig, check_ints, check_port, check_url

WEIGHT_SYNC_MODES = ("distributed", "disk")
GROUP_BACKENDS = ("nccl", "gloo")


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
    """Servers share GPUs with the trainer: start them with `--enable-memory-saver`."""
    weight_sync: str = "distributed"
    """'distributed': NCCL broadcast from the trainer into the servers; 'disk': safetensors + reload."""
    weight_sync_dir: str | None = None
    """Disk mode: directory (shared with the servers) where each version's safetensors are written."""
    master_address: str = "127.0.0.1"
    """Distributed mode: address of the trainer's rendezvous store, reachable from the servers."""
    master_port: int = 0
    """Distributed mode: port of the rendezvous store (0 = pick a free port)."""
    group_name: str = "weight_update_group"
    """Distributed mode: name of the trainer + servers weight-update process group."""
    group_backend: str = "nccl"
    """Distributed mode: collective backend ('nccl' on GPUs; 'gloo' only for CPU tests)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"sglang.weight_sync={self.weight_sync!r} must be one of {WEIGHT_SYNC_MODES}")
        if self.group_backend not in GROUP_BACKENDS:
            raise ValueError(f"sglang.group_backend={self.group_backend!r} must be one of {GROUP_BACKENDS}")
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
        check_port(self, "router_port")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"sglang.mem_fraction={self.mem_fraction} must be in (0, 1]")
        if self.weight_sync == "disk" and not self.weight_sync_dir:
            raise ValueError("sglang.weight_sync=disk needs sglang.weight_sync_dir (readable by the servers)")
