"""SGLang's server and router command lines (launch mode); processes are supervised by server/process.py."""

from __future__ import annotations

from megatron_gspo.rollout.sglang.config import SGLangConfig


def router_url(cfg: SGLangConfig) -> str:
    """Base URL of the launched router."""
    return f"http://{cfg.host}:{cfg.router_port}"


def server_command(cfg: SGLangConfig, index: int) -> list[str]:
    """Command line of launched server `index` (token ids in and out: no tokenizer in the server)."""
    if not 0 <= index < cfg.num_servers:
        raise ValueError(f"server index {index} outside 0..sglang.num_servers-1={cfg.num_servers - 1}")
    cmd = [
        cfg.python,
        "-m",
        cfg.server_module,
        "--model-path",
        cfg.model_path,
        "--host",
        cfg.host,
        "--port",
        str(cfg.server_port(index)),
        "--tp-size",
        str(cfg.tp_size),
        "--base-gpu-id",
        str(cfg.base_gpu_id + index * cfg.tp_size),
        "--mem-fraction-static",
        f"{cfg.mem_fraction:g}",
        "--skip-tokenizer-init",
    ]
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.colocated:
        cmd.append("--enable-memory-saver")
    return cmd + list(cfg.extra_server_args)


def router_command(cfg: SGLangConfig, worker_urls: list[str]) -> list[str]:
    """Command line of the sglang-router in front of `worker_urls`."""
    return [
        cfg.python,
        "-m",
        cfg.router_module,
        "--worker-urls",
        *worker_urls,
        "--host",
        cfg.host,
        "--port",
        str(cfg.router_port),
    ]
