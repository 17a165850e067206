"""What every server engine's config section holds (SGLang's and vLLM's extend it): which servers, how to reach
them, retries, time limits, how weights are bucketed. Validated in `__post_init__`; errors name `<section>.<key>`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from megatron_gspo.rollout.types import RoutingSpec

MODES = ("launch", "attach")


@dataclass
class ServerConfig:
    """Servers used for rollouts: launched by the engine or attached to (their own environment, REFERENCE.md §6)."""

    section: ClassVar[str] = "server"
    """Name of the run-config section (error messages say `<section>.<key>`)."""

    mode: str = "launch"
    """'launch': start `num_servers` servers (and stop them); 'attach': use running servers at `urls`."""
    urls: list[str] = field(default_factory=list)
    """Attach mode: base URLs of the servers (http://10.0.0.5:30000); weight sync talks to each."""
    num_servers: int = 1
    """Launch mode: number of servers."""
    python: str = "python"
    """Interpreter of the server's separate environment (launch mode)."""
    model_path: str = ""
    """Hugging Face checkpoint directory the servers load at start."""
    host: str = "127.0.0.1"
    """Address launched servers bind to."""
    port_base: int = 30000
    """HTTP port of server 0; server i listens on port_base + i."""
    max_concurrency: int = 256
    """Most generation requests in flight at once, over all servers."""
    request_timeout_s: float = 600.0
    """Time limit of one HTTP request (a whole generation)."""
    max_retries: int = 3
    """Retries of one sample after connection errors, 5xx, aborts or stale weights, before a clear error."""
    backoff_s: float = 1.0
    """First retry delay; it doubles per retry (capped at 30 s)."""
    startup_timeout_s: float = 900.0
    """How long to wait for the health check to answer 200 (model loading included)."""
    weight_sync_timeout_s: float = 1800.0
    """Time limit of one weight-sync HTTP request (a bucket load, a disk reload, the group join)."""
    bucket_mb: float = 512.0
    """Largest bucket of tensors sent per weight-update request (a larger tensor travels alone)."""
    extra_server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments appended to every server command."""
    server_env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the launched servers."""
    log_dir: str | None = None
    """Launch mode: write each server's output to files here (None: inherit stdout/stderr)."""
    stop_grace_s: float = 10.0
    """How long a stopped server gets after SIGTERM before SIGKILL."""
    partial_rollouts: bool = True
    """A weight sync during generation continues the samples in flight under the new weights, each token tagged
    with the version that sampled it (`engine.supports_partial_rollouts` says whether the servers can: vllm/ and
    sglang/engine.py); false, or servers that cannot: they are aborted and sampled again from scratch. Not with
    the servers' own return_routed_experts, which keep only the routes of a sample's last prefill (the prefix
    recomputed under the new weights; vLLM's capture_routes keeps the routes that sampled each token)."""
    return_routed_experts: bool = False
    """Ask servers for the experts they routed each token to (R3 routing replay)."""
    num_experts: int | None = None
    """Routed experts per MoE layer; required with return_routed_experts (filled from the model by the trainer)."""
    num_moe_layers: int | None = None
    """MoE layers of the model; required with return_routed_experts (shape of the routing record)."""
    moe_topk: int | None = None
    """Experts per token; required with return_routed_experts (shape of the routing record)."""

    def __post_init__(self) -> None:
        s = self.section
        if self.mode not in MODES:
            raise ValueError(f"{s}.mode={self.mode!r} must be one of {MODES}")
        self.urls = [str(u).rstrip("/") for u in self.urls]
        if self.mode == "attach":
            if not self.urls:
                raise ValueError(f"{s}.urls is empty: attach mode needs the URL of every server")
            for url in self.urls:
                check_url(url, f"{s}.urls")
        elif not self.model_path:
            raise ValueError(f"{s}.model_path is empty: launch mode needs the checkpoint to serve")
        check_ints(self, ("num_servers", "max_concurrency"), minimum=1)
        check_ints(self, ("max_retries",), minimum=0)
        check_port(self, "port_base")
        if self.mode == "launch" and self.port_base + self.num_servers - 1 > 65535:
            raise ValueError(
                f"{s}.port_base={self.port_base} + {s}.num_servers={self.num_servers} exceeds 65535"
            )
        for name in (
            "request_timeout_s",
            "startup_timeout_s",
            "weight_sync_timeout_s",
            "bucket_mb",
            "stop_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{s}.{name}={getattr(self, name)} must be > 0")
        if self.backoff_s < 0:
            raise ValueError(f"{s}.backoff_s={self.backoff_s} must be >= 0")
        self.extra_server_args = [str(a) for a in self.extra_server_args]
        self.server_env = {str(k): str(v) for k, v in self.server_env.items()}
        if (flag := self.routes_flag()) is not None:
            for name in ("num_experts", "num_moe_layers", "moe_topk"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{s}.{name}={value!r} must be a positive integer when {s}.{flag}=true")
            if self.moe_topk > self.num_experts:  # type: ignore[operator]
                raise ValueError(f"{s}.moe_topk={self.moe_topk} exceeds {s}.num_experts={self.num_experts}")

    def routes_flag(self) -> str | None:
        """The option that asks for routed experts (R3), if any (engines with other ways to get them extend it)."""
        return "return_routed_experts" if self.return_routed_experts else None

    def routes_spec(self) -> RoutingSpec | None:
        """Shape of the routed-experts records (None when no option asks for them)."""
        if self.routes_flag() is None:
            return None
        return RoutingSpec(self.num_moe_layers, self.moe_topk, self.num_experts)  # type: ignore[arg-type]

    @property
    def routing(self) -> RoutingSpec | None:
        """Shape of the routed-experts record servers return in their responses (None without
        return_routed_experts)."""
        return self.routes_spec() if self.return_routed_experts else None

    @classmethod
    def from_run_config(cls, options: dict[str, Any], model_config: Any):
        """From the run config's section; the routing shape is filled from the model when R3 asks for it."""
        options = dict(options)
        if any(options.get(flag) for flag in ("return_routed_experts", "capture_routes")):
            options.setdefault("num_experts", model_config.num_experts)
            options.setdefault("num_moe_layers", model_config.num_hidden_layers)
            options.setdefault("moe_topk", model_config.num_experts_per_tok)
        return cls.from_dict(options)

    @classmethod
    def from_dict(cls, options: dict[str, Any]):
        """From a plain mapping (the run config's section); an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown option {cls.section}.{unknown[0]}; known options: {', '.join(sorted(known))}"
            )
        return cls(**options)

    @property
    def server_count(self) -> int:
        """Number of servers the engine talks to (launched or attached)."""
        return self.num_servers if self.mode == "launch" else len(self.urls)

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes."""
        return max(1, int(self.bucket_mb * 1024 * 1024))

    def server_port(self, index: int) -> int:
        """HTTP port of launched server `index`."""
        return self.port_base + index

    def server_url(self, index: int) -> str:
        """Base URL of launched server `index`."""
        return f"http://{self.host}:{self.server_port(index)}"


def check_url(url: str, key: str) -> None:
    """URLs must name their scheme (a bare host:port is a common slip)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{key} entry {url!r} must start with http:// or https://")


def check_ints(cfg: Any, names: tuple[str, ...], *, minimum: int) -> None:
    """Every named field is an int (not a bool) >= minimum."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{cfg.section}.{name}={value!r} must be an integer >= {minimum}")


def check_port(cfg: Any, name: str) -> None:
    """The named field is a TCP port."""
    value = getattr(cfg, name)
    if not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{cfg.section}.{name}={value!r} must be a TCP port in 1..65535")
