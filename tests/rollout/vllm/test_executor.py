"""`vllm.worker_in_engine_core`: which launched servers get vLLM's single-worker executor by import path (the
real server's process tree: test_end_to_end.py)."""

from __future__ import annotations

import pytest

from megatron_gspo.rollout.vllm.config import VLLMConfig
from megatron_gspo.rollout.vllm.launch import server_command

FLAG = ["--distributed-executor-backend", "vllm.v1.executor.uniproc_executor.UniProcExecutor"]


def _executor(cmd: list[str]) -> list[list[str]]:
    return [cmd[i:i + 2] for i, a in enumerate(cmd) if a.startswith("--distributed-executor-backend")]


def test_a_one_worker_unbound_server_runs_the_in_process_executor_by_default():
    assert _executor(server_command(VLLMConfig(model_path="m"), 0)) == [FLAG]


@pytest.mark.parametrize("change", [dict(worker_in_engine_core=False), dict(tp_size=2),
                                    dict(cpu_threads_bind="0-1"), dict(cpu_threads_bind="auto")])
def test_vllms_own_executor_otherwise(change):
    assert _executor(server_command(VLLMConfig(model_path="m", **change), 0)) == []


@pytest.mark.parametrize("change", [dict(extra_server_args=["-tp", "2"]),
                                    dict(extra_server_args=["--tensor-parallel-size=2"]),
                                    dict(extra_server_args=["--data-parallel-size", "2"]),
                                    dict(extra_server_args=["--config", "serve.yaml"]),
                                    dict(server_env={"VLLM_CPU_OMP_THREADS_BIND": "0-1"})])
def test_a_worker_count_or_binding_of_the_users_own_keeps_vllms_executor(change):
    """UniProcExecutor starts rank 0 only (a -tp 2 server would wait for a rank that never starts) and drops the
    thread binding that only the multiprocess executor applies (found in review)."""
    assert _executor(server_command(VLLMConfig(model_path="m", **change), 0)) == []


@pytest.mark.parametrize(
    "args", [["--distributed-executor-backend", "mp"], ["--distributed-executor-backend=ray"]]
)
def test_an_executor_in_extra_server_args_is_the_only_one(args):
    cmd = server_command(VLLMConfig(model_path="m", extra_server_args=args), 0)
    assert cmd[-len(args):] == args
    assert sum(a.startswith("--distributed-executor-backend") for a in cmd) == 1


def test_the_key_must_be_a_bool():
    with pytest.raises(ValueError, match=r"^vllm\.worker_in_engine_core='yes' must be true or false$"):
        VLLMConfig(model_path="m", worker_in_engine_core="yes")
