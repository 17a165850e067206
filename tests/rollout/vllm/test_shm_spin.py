"""`vllm.shm_busy_loop_s`: the key's checks, the launched server's environment, and, in vLLM's own environment
(.venv-vllm, vLLM 0.32's shm_broadcast), that the plugin makes SpinCondition readers (those made before it
loads too) spin that long and no longer, leaves vLLM's 1 s alone when unset, and refuses another vLLM in one
line."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_gspo.rollout.vllm.config import VLLMConfig
from megatron_gspo.rollout.vllm.engine import VLLMEngine
from megatron_gspo.rollout.vllm.launch import server_env
from megatron_gspo.rollout.vllm.plugin import BUSY_LOOP_ENV
from tests.rollout.vllm.test_end_to_end import ROOT, VLLM_PYTHON

READERS = """
import json, os, sys, time
import zmq
import vllm
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from megatron_gspo.rollout.vllm import plugin

ctx, addr = zmq.Context(), "ipc://" + sys.argv[1]
writer = SpinCondition(False, ctx, addr)

def idle_wait(reader):
    # 20 ms after its last read, no message coming: a reader still in its busy loop returns at once,
    # one past it sleeps on the socket until the 300 ms timeout
    reader.record_read()
    time.sleep(0.02)
    t0 = time.monotonic()
    reader.wait(timeout_ms=300)
    return time.monotonic() - t0

out = {}
os.environ.pop(plugin.BUSY_LOOP_ENV, None)
plugin.register()
default = SpinCondition(True, ctx, addr)
out["unset"] = [default.busy_loop_s, idle_wait(default)]
before = SpinCondition(True, ctx, addr)  # made before the plugin applies the key (a Worker's queues are)
os.environ[plugin.BUSY_LOOP_ENV] = "0.005"
plugin.register()
after = SpinCondition(True, ctx, addr)
out["set"] = [before.busy_loop_s, after.busy_loop_s, idle_wait(before), idle_wait(after)]
vllm.__version__ = "0.33.0"
try:
    plugin.limit_shm_spin(0.005)
except RuntimeError as err:
    out["other_vllm"] = str(err)
print(json.dumps(out))
"""


@pytest.mark.slow  # imports vLLM: ~10 s
@pytest.mark.skipif(not VLLM_PYTHON.exists() and not os.environ.get("CI"),
                    reason="no .venv-vllm: run `make rollout-env` (in CI this test never skips)")
def test_the_plugin_limits_every_spin_condition_reader_of_vllm_032_and_refuses_another_vllm(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([str(VLLM_PYTHON), "-c", READERS, str(tmp_path / "notify")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    busy, waited = out["unset"]
    assert busy == 1 and waited < 0.15  # vLLM's own: still spinning 20 ms after a read
    before, after, waited_before, waited_after = out["set"]
    assert before == after == 0.005
    assert waited_before >= 0.25 and waited_after >= 0.25  # past 5 ms: asleep on the socket
    message = out["other_vllm"]
    assert "\n" not in message and "vLLM 0.33.0" in message and "remove vllm.shm_busy_loop_s" in message


def test_the_key_reaches_the_server_environment_only_when_set():
    assert server_env(VLLMConfig(model_path="m", shm_busy_loop_s=0.002))[BUSY_LOOP_ENV] == "0.002"
    assert server_env(VLLMConfig(model_path="m", shm_busy_loop_s=0))[BUSY_LOOP_ENV] == "0.0"
    assert BUSY_LOOP_ENV not in server_env(VLLMConfig(model_path="m"))


@pytest.mark.parametrize("value", [-0.001, "fast", True])
def test_a_bad_busy_loop_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"vllm\.shm_busy_loop_s=.* must be seconds >= 0"):
        VLLMConfig(model_path="m", shm_busy_loop_s=value)


def test_the_key_is_refused_with_attached_servers_and_dropped_for_followers():
    with pytest.raises(ValueError, match=r"^vllm\.shm_busy_loop_s=0\.002 applies only to servers the trainer "
                                         r"launches: remove it with vllm\.mode=attach$"):
        VLLMConfig(mode="attach", urls=["http://127.0.0.1:1"], shm_busy_loop_s=0.002)
    leader = VLLMConfig(model_path="m", shm_busy_loop_s=0.002)  # the leader launches the servers with it
    follower = VLLMEngine.follower_config(leader, ["http://127.0.0.1:1"], ["http://127.0.0.1:1"])
    assert follower.mode == "attach" and follower.shm_busy_loop_s is None
