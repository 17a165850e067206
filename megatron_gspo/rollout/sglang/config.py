"""Configuration of the SGLang rollout engine: which servers, how to talk to them, how weights reach them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

MODES = ("launch", "attach")
WEIGHT_SYNC_MODES = ("distributed", "disk")
GROUP_BACKENDS = ("nccl", "gloo")


@dataclass
class SGLangConfig:
    """SGLang servers used for rollouts (REFERENCE.md §4); SGLang lives in a separate environment (§6)."""

    mode: str = "launch"
    """'launch': start `num_servers` servers (and stop them); 'attach': use running servers at `urls`."""
    urls: list[str] = field(default_factory=list)
    """Attach mode: base URLs of the SGLang servers (http://10.0.0.5:30000); weight sync talks to each."""
    router_url: str | None = None
    """Attach mode: URL of an sglang-router in front of `urls`; generation goes there when set."""
    num_servers: int = 1
    """Launch mode: number of SGLang servers (each uses `tp_size` GPUs)."""
    python: str = "python"
    """Interpreter of the separate SGLang environment that launches servers and the router."""
    server_module: str = "sglang.launch_server"
    """Module run with `python -m` to start one server (tests substitute a fake server module)."""
    router_module: str = "sglang_router.launch_router"
    """Module run with `python -m` to start the router."""
    model_path: str = ""
    """Hugging Face checkpoint directory (or hub id) the servers load at start."""
    tp_size: int = 1
    """Tensor-parallel size of every server (GPUs per server)."""
    base_gpu_id: int = 0
    """First GPU of server 0; server i uses GPUs base_gpu_id + i * tp_size ... + tp_size - 1."""
    mem_fraction: float = 0.8
    """Fraction of GPU memory SGLang reserves for weights + KV cache (`--mem-fraction-static`)."""
    host: str = "127.0.0.1"
    """Address servers and router bind to (launch mode)."""
    port_base: int = 30000
    """HTTP port of server 0; server i listens on port_base + i."""
    router: bool = False
    """Launch mode: start an sglang-router in front of the servers and send generation through it."""
    router_port: int = 29000
    """HTTP port of the router (launch mode)."""
    colocated: bool = False
    """Servers share GPUs with the trainer: start them with `--enable-memory-saver`."""
    return_routed_experts: bool = False
    """Ask servers for the experts they routed each token to (R3 routing replay)."""
    num_experts: int | None = None
    """Routed experts per MoE layer; required with return_routed_experts (checks ids, picks the dtype)."""
    num_moe_layers: int | None = None
    """MoE layers of the model; required with return_routed_experts (shape of the routing record)."""
    moe_topk: int | None = None
    """Experts per token; required with return_routed_experts (shape of the routing record)."""
    max_concurrency: int = 256
    """Most `/generate` requests in flight at once, over all servers."""
    request_timeout_s: float = 600.0
    """Time limit of one HTTP request (a whole generation)."""
    max_retries: int = 3
    """Retries of one sample after connection errors, 5xx, aborts or stale weights, before a clear error."""
    backoff_s: float = 1.0
    """First retry delay; it doubles per retry (capped at 30 s)."""
    startup_timeout_s: float = 900.0
    """How long to wait for `/health_generate` to answer 200 (model loading included)."""
    weight_sync: str = "distributed"
    """'distributed': NCCL broadcast from the trainer into the servers; 'disk': safetensors + reload."""
    weight_sync_dir: str | None = None
    """Disk mode: directory (shared with the servers) where each version's safetensors are written."""
    weight_sync_timeout_s: float = 1800.0
    """Time limit of one weight-sync HTTP request (a bucket load, a disk reload, the group join)."""
    bucket_mb: float = 512.0
    """Largest bucket of tensors sent per weight-update request (a larger tensor travels alone)."""
    master_address: str = "127.0.0.1"
    """Distributed mode: address of the trainer's rendezvous store, reachable from the servers."""
    master_port: int = 0
    """Distributed mode: port of the rendezvous store (0 = pick a free port)."""
    group_name: str = "weight_update_group"
    """Distributed mode: name of the trainer + servers weight-update process group."""
    group_backend: str = "nccl"
    """Distributed mode: collective backend ('nccl' on GPUs; 'gloo' only for CPU tests)."""
    extra_server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments appended to every server command."""
    server_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the launched servers and router."""
    log_dir: str | None = None
    """Launch mode: write each server's / the router's output to files here (None: inherit stdout/stderr)."""
    stop_grace_s: float = 10.0
    """How long a stopped server gets after SIGTERM before SIGKILL."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"sglang.mode={self.mode!r} must be one of {MODES}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"sglang.weight_sync={self.weight_sync!r} must be one of {WEIGHT_SYNC_MODES}")
        if self.group_backend not in GROUP_BACKENDS:
            raise ValueError(f"sglang.group_backend={self.group_backend!r} must be one of {GROUP_BACKENDS}")
        self.urls = [str(u).rstrip("/") for u in self.urls]
        if self.router_url is not None:
            self.router_url = self.router_url.rstrip("/")
        if self.mode == "attach":
            if not self.urls:
                raise ValueError("sglang.urls is empty: attach mode needs the URL of every SGLang server")
            for url in self.urls + ([self.router_url] if self.router_url else []):
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"sglang.urls entry {url!r} must start with http:// or https://")
            if self.router:
                raise ValueError(
                    "sglang.router=true starts a router (launch mode); in attach mode set sglang.router_url"
                )
        else:
            if not self.model_path:
                raise ValueError("sglang.model_path is empty: launch mode needs the checkpoint to serve")
            if self.router_url is not None:
                raise ValueError("sglang.router_url is for attach mode; launch mode uses sglang.router=true")
        for name in ("num_servers", "tp_size", "max_concurrency"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"sglang.{name}={value!r} must be an integer >= 1")
        for name in ("base_gpu_id", "max_retries", "master_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"sglang.{name}={value!r} must be an integer >= 0")
        for name in ("port_base", "router_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 65535:
                raise ValueError(f"sglang.{name}={value!r} must be a TCP port in 1..65535")
        if self.mode == "launch" and self.port_base + self.num_servers - 1 > 65535:
            raise ValueError(
                f"sglang.port_base={self.port_base} + sglang.num_servers={self.num_servers} exceeds 65535"
            )
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"sglang.mem_fraction={self.mem_fraction} must be in (0, 1]")
        for name in (
            "request_timeout_s",
            "startup_timeout_s",
            "weight_sync_timeout_s",
            "bucket_mb",
            "stop_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"sglang.{name}={getattr(self, name)} must be > 0")
        if self.backoff_s < 0:
            raise ValueError(f"sglang.backoff_s={self.backoff_s} must be >= 0")
        if self.weight_sync == "disk" and not self.weight_sync_dir:
            raise ValueError("sglang.weight_sync=disk needs sglang.weight_sync_dir (readable by the servers)")
        if self.return_routed_experts:
            for name in ("num_experts", "num_moe_layers", "moe_topk"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(
                        f"sglang.{name}={value!r} must be a positive integer "
                        "when sglang.return_routed_experts=true"
                    )
            if self.moe_topk > self.num_experts:  # type: ignore[operator]
                raise ValueError(
                    f"sglang.moe_topk={self.moe_topk} exceeds sglang.num_experts={self.num_experts}"
                )
        self.extra_server_args = [str(a) for a in self.extra_server_args]
        self.server_env = {str(k): str(v) for k, v in self.server_env.items()}

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SGLangConfig:
        """From a plain mapping (the run config's `sglang:` section); an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown option sglang.{unknown[0]}; known options: {', '.join(sorted(known))}")
        return cls(**options)

    @property
    def server_count(self) -> int:
        """Number of servers the engine talks to (launched or attached)."""
        return self.num_servers if self.mode == "launch" else len(self.urls)

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes."""
        return max(1, int(self.bucket_mb * 1024 * 1024))
