"""Config validation, server command lines, and launch mode with the fake server as a real subprocess."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.rollout.sglang import SGLangConfig, SGLangEngine
from megatron_gspo.rollout.sglang.launch import router_command, server_command
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import free_port

REPO = str(Path(__file__).resolve().parents[2])


def test_server_command_lines():
    cfg = SGLangConfig(
        python="/envs/sglang/bin/python",
        model_path="/ckpt/Qwen3-30B-A3B",
        num_servers=2,
        tp_size=4,
        mem_fraction=0.7,
        port_base=31000,
        host="0.0.0.0",
        return_routed_experts=True,
        num_experts=128,
        num_moe_layers=48,
        moe_topk=8,
        colocated=True,
        weight_sync="shm",
        deterministic_inference=True,
        context_length=9217,
        extra_server_args=["--dtype", "bfloat16"],
    )
    assert server_command(cfg, 1) == [
        "/envs/sglang/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/ckpt/Qwen3-30B-A3B",
        "--host", "0.0.0.0",
        "--port", "31001",
        "--tp-size", "4",
        "--base-gpu-id", "4",
        "--mem-fraction-static", "0.7",
        "--skip-tokenizer-init",
        "--context-length", "9217",
        "--enable-return-routed-experts",
        "--enable-memory-saver",
        "--enable-deterministic-inference",
        "--dtype", "bfloat16",
    ]  # fmt: skip
    plain = server_command(SGLangConfig(model_path="m"), 0)
    for flag in ("--enable-return-routed-experts", "--enable-memory-saver", "--enable-deterministic-inference"):
        assert flag not in plain
    assert "--context-length" not in plain
    with pytest.raises(ValueError, match="server index 2"):
        server_command(cfg, 2)
    assert router_command(cfg, ["http://a:1", "http://b:2"]) == [
        "/envs/sglang/bin/python", "-m", "sglang_router.launch_router",
        "--worker-urls", "http://a:1", "http://b:2",
        "--host", "0.0.0.0", "--port", "29000",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(mode="serve"), "sglang.mode='serve'"),
        (dict(mode="attach"), "sglang.urls is empty"),
        (dict(mode="attach", urls=["10.0.0.1:30000"]), "must start with http://"),
        (dict(model_path=""), "sglang.model_path is empty"),
        (dict(tp_size=0), "sglang.tp_size=0"),
        (dict(mem_fraction=1.5), "sglang.mem_fraction=1.5"),
        (dict(weight_sync="nfs"), "sglang.weight_sync='nfs'"),
        (dict(weight_sync="disk"), "needs sglang.weight_sync_dir"),
        (dict(return_routed_experts=True, num_experts=8, moe_topk=2), "sglang.num_moe_layers=None"),
        (dict(return_routed_experts=True, num_experts=8, num_moe_layers=2, moe_topk=9), "moe_topk=9 exceeds"),
        (dict(port_base=70000), "sglang.port_base=70000"),
        (dict(router_url="http://r:1"), "sglang.router_url is for attach mode"),
        (dict(context_length=1), "sglang.context_length=1"),
        # issue 16 item 4: NCCL refuses a group with a trainer rank and a server rank on one GPU
        (dict(colocated=True), "sglang.colocated=true with sglang.weight_sync=distributed .* NCCL refuses"),
        # issue 16 item 2: sglang-router 0.3.2 re-sends /generate without return_routed_experts
        (dict(router=True, return_routed_experts=True, num_experts=8, num_moe_layers=2, moe_topk=2),
         "sglang.return_routed_experts=true with sglang.router=true: sglang-router 0.3.2 re-sends"),
        (dict(mode="attach", urls=["http://s:1"], router_url="http://r:1", return_routed_experts=True,
              num_experts=8, num_moe_layers=2, moe_topk=2), "with sglang.router_url: sglang-router"),
        # issue 16 item 8: the weight-update group is NCCL against a real server; gloo is only the tests' factory
        (dict(group_backend="gloo"), "unknown option sglang.group_backend"),
    ],
)
def test_config_errors_name_the_key(fields, message):
    base = dict(model_path="m")
    base.update(fields)
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace("+", "\\+")):
        SGLangConfig.from_dict(base)


def launch_config(tmp_path, port: int, *extra: str) -> SGLangConfig:
    return SGLangConfig(
        python=sys.executable,
        server_module="tests.rollout.sglang.fake_server",
        model_path="fake-model",
        port_base=port,
        server_env={"PYTHONPATH": REPO},
        extra_server_args=list(extra),
        log_dir=str(tmp_path / "logs"),
        startup_timeout_s=60,
        backoff_s=0.05,
        stop_grace_s=5,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_launch_generate_and_clean_stop(tmp_path):
    pid_file = tmp_path / "pids"
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    extra = ("--fake-health-503", "2", "--fake-child-pid-file", str(pid_file))
    cfg = launch_config(tmp_path, free_port(), *extra)
    engine = SGLangEngine(cfg)
    try:
        assert signal.getsignal(signal.SIGTERM) != handlers[signal.SIGTERM]  # ours, while servers run
        server_pid, child_pid = map(int, pid_file.read_text().split())
        assert alive(server_pid) and alive(child_pid)
        rollouts = engine.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=3, n=2))
        assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
        assert all(r.extra["server"] == f"http://127.0.0.1:{cfg.port_base}" for r in rollouts)
    finally:
        engine.close()
    assert not alive(server_pid) and not alive(child_pid)  # the whole process group is gone
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert (tmp_path / "logs" / "sglang_server_0.log").exists()


def test_launch_failure_is_clear_and_leaves_nothing_running(tmp_path):
    cfg = launch_config(tmp_path, free_port(), "--fake-exit-code", "3")
    start = time.monotonic()
    expected = r"SGLang server 0 \(pid \d+\) exited with code 3; see .*sglang_server_0.log"
    with pytest.raises(Exception, match=expected):
        SGLangEngine(cfg)
    assert time.monotonic() - start < 30  # a dead server ends the wait at once, not at the timeout
    assert "failing on purpose" in (tmp_path / "logs" / "sglang_server_0.log").read_text()


def test_launch_with_router_sends_generation_through_it(tmp_path):
    cfg = launch_config(tmp_path, free_port())
    cfg.router, cfg.router_port, cfg.router_module = True, free_port(), "tests.rollout.sglang.fake_server"
    engine = SGLangEngine(cfg)
    try:
        procs = [p.popen for p in engine._supervisor.processes]
        assert [p.name for p in engine._supervisor.processes] == ["SGLang server 0", "sglang-router"]
        router = f"http://127.0.0.1:{cfg.router_port}"
        assert engine.generate_urls == [router]
        assert engine.server_urls == [f"http://127.0.0.1:{cfg.port_base}"]
        rollouts = engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, n=2))
        assert {r.extra["server"] for r in rollouts} == {router}
    finally:
        engine.close()
    assert all(p.poll() is not None for p in procs)


def test_launch_refuses_a_port_already_in_use(tmp_path, fake_servers):
    (squatter,) = fake_servers(1)
    with pytest.raises(RuntimeError, match=f"port {squatter.port} for SGLang server 0 is already in use"):
        SGLangEngine(launch_config(tmp_path, squatter.port))
    assert squatter.paths() == []  # never talked to: a stale server is not mistaken for ours


def test_launch_with_a_missing_interpreter_is_clear(tmp_path):
    cfg = launch_config(tmp_path, free_port())
    cfg.python = str(tmp_path / "no-such-env" / "bin" / "python")
    with pytest.raises(ValueError, match="sglang.python='.*no-such-env/bin/python' is not an executable file"):
        SGLangEngine(cfg)
