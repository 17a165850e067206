"""A trainer killed with kill -9 while attached to SGLang servers, and the run that resumes on the same servers;
a fresh run and a live one on the same servers (only a resume undoes anything).

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
import threading
import time
import types
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
    before = [len(s.calls) for s in servers]
    assert all(s.attach_paths() == [] for s in servers)  # the killed trainer's own attach (fresh) undid nothing
    engine = attach(servers, group_factory=join_gloo_group, resumed=True, bucket_mb=100 / MB,
                    weight_sync_timeout_s=20, startup_timeout_s=5, recover_timeout_s=5)  # fmt: skip
    changed = [(name, tensor * 2 + 1) for name, tensor in named_weights()]
    engine.push_weights(iter(changed), version=3)
    for server, n in zip(servers, before):
        assert server.attach_paths(n) == list(ATTACH)
        assert server.weight_version == "3" and not server.paused and not server.session_open
        for name, tensor in changed:
            assert server.weights[name].dtype == tensor.dtype and torch.equal(server.weights[name], tensor)
    undone = sorted(r.getMessage().split(": ")[1] for r in caplog.records if "trainer that died" in r.getMessage())
    assert undone == ["/destroy_weights_update_group undid what a trainer that died left"] * 2 + [
        "/end_weight_update undid what a trainer that died left"
    ] * 2
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].weight_version == 3


@pytest.mark.parametrize(
    "version, sent",
    [
        # 0.5.9: no /ready (404): the continue, which takes no lock; no sessions to end
        ("0.5.9", ["/destroy_weights_update_group", "/continue_generation"]),  # the 404s are not recorded
        ("0.5.23", ["/destroy_weights_update_group", "/ready"]),  # not paused: no session, nothing to continue
    ],
)
def test_nothing_left_is_nothing_undone(fake_servers, attach, caplog, version, sent):
    """Servers no trainer used, resumed on: the destroy is refused (400: none held) and nothing is logged; the
    first sync then inits the group."""
    servers = fake_servers(2, version=version)
    caplog.set_level(logging.WARNING, logger="megatron_gspo.rollout.sglang.engine")
    engine = attach(servers, group_factory=join_gloo_group, resumed=True, weight_sync_timeout_s=20)
    for server in servers:
        assert server.attach_paths() == sent
    assert not [r for r in caplog.records if "trainer that died" in r.getMessage()]
    engine.push_weights(iter(named_weights()), version=1)
    assert all(s.weight_version == "1" and s.groups == {SGLangConfig.group_name} for s in servers)


def test_a_fresh_run_leaves_a_live_runs_sync_alone_and_its_held_group_is_one_line(fake_servers, attach):
    """A second run attaching (no --resume) to servers a live run is syncing: before the fix it destroyed the
    live run's group, ended its session and continued its pause (the live run's next broadcast then failed: no
    session). Now it sends nothing until the servers' health checks answer, the live sync completes, and the
    second run's first sync fails in one line naming the held group and both ways out."""
    servers = fake_servers(2, version="0.5.23")
    live = attach(servers, group_factory=join_gloo_group, bucket_mb=100 / MB, weight_sync_timeout_s=20)
    weights = named_weights()
    live.push_weights(iter(weights), version=1)
    go = threading.Event()

    def stalls_after_three():
        for i, item in enumerate(weights):
            if i == 3:
                go.wait(30)
            yield (item[0], item[1] + 1)

    syncing = threading.Thread(target=live.push_weights, args=(stalls_after_three(), 2))
    syncing.start()
    try:
        deadline = time.monotonic() + 20
        while not all(s.paused and s.session_open for s in servers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(s.paused and s.session_open for s in servers)
        before = [len(s.calls) for s in servers]
        attached: list = []
        second = threading.Thread(target=lambda: attached.append(
            attach(servers, group_factory=join_gloo_group, weight_sync_timeout_s=2, startup_timeout_s=20)))  # fmt: skip
        second.start()
        deadline = time.monotonic() + 20
        while not all(s.calls[n:] for s, n in zip(servers, before)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the old clean-up would have been sent by now
        for server, n in zip(servers, before):
            sent = {p for p, _ in server.calls[n:]}
            assert "/health_generate" in sent and not sent & set(ATTACH), sent  # (the live run's buckets may be)
            assert server.paused and server.session_open and server.groups == {SGLangConfig.group_name}
    finally:
        go.set()
        syncing.join(timeout=30)
    second.join(timeout=30)
    assert not syncing.is_alive() and not second.is_alive()
    for server in servers:
        assert server.weight_version == "2" and not server.paused and not server.session_open
        assert all(torch.equal(server.weights[name], tensor + 1) for name, tensor in weights)
    with pytest.raises(SGLangError) as raised:
        attached[0].push_weights(iter(weights), version=3)
    message = str(raised.value)
    assert "\n" not in message
    assert f"already holds the weight-update group {SGLangConfig.group_name!r}" in message
    assert "restart the SGLang servers" in message and "--resume" in message
    live.push_weights(iter(weights), version=4)  # the live run's group still works
    assert all(s.weight_version == "4" for s in servers)
    time.sleep(2.5)  # the refused run's own join (a daemon thread) gives up its rendezvous: not at interpreter exit


def test_a_resume_on_a_busy_unpaused_server_takes_no_writer_lock(fake_servers, attach):
    """A resumed run on servers that are generating for someone (not paused: no session of ours can be open):
    before the fix it sent /end_weight_update, for which SGLang takes its model-update writer lock and stalls
    every client until the running generations end (`writer_lock_waits`); now `GET /ready` answers 200 and the
    session and pause are left alone."""
    servers = fake_servers(2, version="0.5.23")
    for server in servers:
        server.generate_delay_s = 2.0
    client = attach(servers)
    generating = threading.Thread(target=client.generate, args=([[1, 2]] * 4, SamplingParams(max_new_tokens=2)))
    generating.start()
    try:
        deadline = time.monotonic() + 10
        while sum(s.in_flight for s in servers) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(s.in_flight for s in servers) == 4
        before = [len(s.calls) for s in servers]
        attach(servers, resumed=True)
        for server, n in zip(servers, before):
            assert server.attach_paths(n) == ["/destroy_weights_update_group", "/ready"]
            assert server.writer_lock_waits == []
    finally:
        generating.join(timeout=30)


@pytest.mark.parametrize("paused", [False, True])
def test_a_resume_with_file_sync_sends_no_destroy(fake_servers, attach, tmp_path, paused):
    """With disk (or shm) sync there is no group to destroy, and SGLang 0.5.23's destroy asserts dp_size == 1
    before looking (tokenizer_control_mixin.py:464): a 500 that stopped every resume on data-parallel servers
    before the fix. A dead trainer's pause is still continued."""
    servers = fake_servers(2, version="0.5.23")
    for server in servers:
        server.dp_size = 2
        server.paused = paused
    attach(servers, resumed=True, weight_sync="disk", weight_sync_dir=str(tmp_path), startup_timeout_s=5)
    for server in servers:
        tail = ["/end_weight_update", "/continue_generation"] if paused else []
        assert server.attach_paths() == ["/ready", *tail]
        assert not server.paused


@pytest.mark.parametrize("resume", [False, True])
def test_the_factory_hands_the_trainers_resume_to_the_engine(fake_servers, resume):
    """make_sglang_engine reads `runtime.resume` (the trainer's --resume; training/runtime.py): only then does
    attaching undo anything."""
    from megatron_gspo.rollout.sglang import make_sglang_engine

    servers = fake_servers(1, version="0.5.23")
    options = dict(mode="attach", urls=[servers[0].url], backoff_s=0.01, request_timeout_s=10)
    runtime = types.SimpleNamespace(cfg=types.SimpleNamespace(sglang=options), model_config=None,
                                    dtype=torch.float32, resume=resume)  # fmt: skip
    engine = make_sglang_engine(runtime)
    try:
        expected = ["/destroy_weights_update_group", "/ready"] if resume else []
        assert servers[0].attach_paths() == expected
    finally:
        engine.close()


def test_server_stuck_in_a_dead_trainers_broadcast_is_one_line_not_a_hang(fake_servers, attach):
    """A server whose scheduler waits in a receive from the dead trainer answers nothing that reaches it (a real
    one until NCCL's watchdog, 30 min by default, tears it down): the run stops after recover_timeout_s and says to
    restart the servers. The fake's `stuck` stands in for that scheduler (it needs NCCL and a dead GPU peer)."""
    good, stuck = fake_servers(2)
    stuck.stuck = True
    started = time.monotonic()
    with pytest.raises(SGLangError) as raised:
        attach([good, stuck], resumed=True, recover_timeout_s=0.5)
    assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "\n" not in message and stuck.url in message and good.url not in message
    assert "/destroy_weights_update_group within sglang.recover_timeout_s=0.5 s" in message
    assert "restart the SGLang servers" in message


def test_recover_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"^sglang.recover_timeout_s=0 must be > 0$"):
        SGLangConfig(mode="attach", urls=["http://127.0.0.1:1"], recover_timeout_s=0)


@pytest.mark.parametrize("resume", [False, True])
def test_the_trainer_hands_its_resume_to_the_runtime(monkeypatch, tmp_path, resume):
    """`train --resume` reaches `Runtime.resume`, which make_sglang_engine reads (the test above). The Runtime is
    replaced by a recorder that stops the trainer's set-up there: a real one builds the model and the engine."""
    from megatron_gspo.training import trainer as trainer_module
    from megatron_gspo.training.config import load_run_config

    class Built(Exception):
        pass

    seen: dict = {}

    def runtime(*args, **kwargs):
        seen.update(kwargs)
        raise Built

    monkeypatch.setattr(trainer_module, "Runtime", runtime)
    monkeypatch.setattr(trainer_module.GSPOTrainer, "_resume_point", lambda self, resume: None)
    cfg = load_run_config(ROOT / "examples/tiny_moe_gspo.yaml", [f"trainer.run_dir={tmp_path / 'run'}"])
    with pytest.raises(Built):
        trainer_module.GSPOTrainer(cfg, resume=resume)
    assert seen["resume"] is resume
