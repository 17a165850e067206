"""A trainer killed with kill -9 while attached to SGLang servers, and the run that resumes on the same servers.

The servers are fake (tests/rollout/sglang/fake_server.py: SGLang's server needs a GPU); what they keep after the
trainer dies is what SGLang 0.5.23 keeps (read in its source, cited in rollout/sglang/engine.py
`_undo_dead_trainer`): the weight-update group by name (a second init of that name answers 400), an open
weight-update session (a second /begin_weight_update answers 400) and the pause (health checks answer 503). The
trainer is a real process, killed with SIGKILL between two buckets of a sync; the weight broadcasts are real (gloo
for NCCL, tests/rollout/sglang/gloo_group.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.sglang import SGLangConfig, SGLangError
from megatron_gspo.rollout.types import SamplingParams
from tests.rollout.server.test_transport import MB, named_weights
from tests.rollout.sglang.fake_server import ATTACH
from tests.rollout.sglang.gloo_group import join_gloo_group

ROOT = Path(__file__).resolve().parents[3]

TRAINER = textwrap.dedent(
    """
    import sys, time
    from megatron_gspo.rollout.sglang import SGLangConfig, SGLangEngine
    from tests.rollout.server.test_transport import MB, named_weights
    from tests.rollout.sglang.gloo_group import join_gloo_group

    cfg = SGLangConfig(mode="attach", urls=sys.argv[1:], backoff_s=0.01, max_retries=1, request_timeout_s=20,
                       bucket_mb=100 / MB, weight_sync_timeout_s=20)
    engine = SGLangEngine(cfg, group_factory=join_gloo_group)
    weights = named_weights()
    engine.push_weights(iter(weights), version=1)

    def stalls_after_three():
        for i, item in enumerate(weights):
            if i == 3:  # bucket 1 is broadcast by now (the buckets are read one ahead)
                print("mid-sync", flush=True)
                time.sleep(600)
            yield item

    engine.push_weights(stalls_after_three(), version=2)
    """
)


def start_trainer(urls: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-c", TRAINER, *urls]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_resumed_run_recovers_the_servers_a_killed_trainer_left_mid_sync(fake_servers, attach, caplog):
    """Before the fix the resumed run never got past attach: the paused servers fail every health check (503)
    until startup_timeout_s; unpaused, its first sync's init answered 400 ("The specified group name has already
    been created") at every resume, and a session left open refused /begin_weight_update."""
    servers = fake_servers(2, version="0.5.23")
    trainer = start_trainer([s.url for s in servers])
    try:
        line = trainer.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "mid-sync", trainer.stderr.read()[-3000:]  # type: ignore[union-attr]
        for server in servers:  # what the killed trainer leaves behind
            assert server.paused and server.session_open and server.groups == {SGLangConfig.group_name}
        first_bucket = named_weights()[0]
        assert torch.equal(servers[0].weights[first_bucket[0]], first_bucket[1])
        os.kill(trainer.pid, signal.SIGKILL)
        assert trainer.wait(timeout=30) == -signal.SIGKILL
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        trainer.stdout.close()  # type: ignore[union-attr]
        trainer.stderr.close()  # type: ignore[union-attr]

    caplog.set_level(logging.WARNING, logger="megatron_gspo.rollout.sglang.engine")
    engine = attach(servers, group_factory=join_gloo_group, bucket_mb=100 / MB, weight_sync_timeout_s=20,
                    startup_timeout_s=5, recover_timeout_s=5)  # fmt: skip
    changed = [(name, tensor * 2 + 1) for name, tensor in named_weights()]
    engine.push_weights(iter(changed), version=3)
    for server in servers:
        assert server.attach_paths() == list(ATTACH)
        assert server.weight_version == "3" and not server.paused and not server.session_open
        for name, tensor in changed:
            assert server.weights[name].dtype == tensor.dtype and torch.equal(server.weights[name], tensor)
    undone = sorted(r.getMessage().split(": ")[1] for r in caplog.records if "trainer that died" in r.getMessage())
    assert undone == ["/destroy_weights_update_group undid what a trainer that died left"] * 2 + [
        "/end_weight_update undid what a trainer that died left"
    ] * 2
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].weight_version == 3


@pytest.mark.parametrize("version, sent", [("0.5.9", ATTACH[::2]), ("0.5.23", ATTACH)])
def test_nothing_left_is_nothing_undone(fake_servers, attach, caplog, version, sent):
    """Servers no trainer used: the destroy and the session's end are refused (400: none held; 0.5.9 has no
    sessions, 404) and nothing is logged; the first sync then inits the group."""
    servers = fake_servers(2, version=version)
    caplog.set_level(logging.WARNING, logger="megatron_gspo.rollout.sglang.engine")
    engine = attach(servers, group_factory=join_gloo_group, weight_sync_timeout_s=20)
    for server in servers:
        assert server.attach_paths() == list(sent)
    assert not [r for r in caplog.records if "trainer that died" in r.getMessage()]
    engine.push_weights(iter(named_weights()), version=1)
    assert all(s.weight_version == "1" and s.groups == {SGLangConfig.group_name} for s in servers)


def test_server_stuck_in_a_dead_trainers_broadcast_is_one_line_not_a_hang(fake_servers, attach):
    """A server whose scheduler waits in a receive from the dead trainer answers nothing that reaches it (a real
    one until NCCL's watchdog, 30 min by default, tears it down): the run stops after recover_timeout_s and says to
    restart the servers. The fake's `stuck` stands in for that scheduler (it needs NCCL and a dead GPU peer)."""
    good, stuck = fake_servers(2)
    stuck.stuck = True
    started = time.monotonic()
    with pytest.raises(SGLangError) as raised:
        attach([good, stuck], recover_timeout_s=0.5)
    assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "\n" not in message and stuck.url in message and good.url not in message
    assert "/destroy_weights_update_group within sglang.recover_timeout_s=0.5 s" in message
    assert "restart the SGLang servers" in message


def test_recover_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"^sglang.recover_timeout_s=0 must be > 0$"):
        SGLangConfig(mode="attach", urls=["http://127.0.0.1:1"], recover_timeout_s=0)
