"""SGLang weight sync against fake servers: the file protocol (disk, shm) and the distributed (NCCL-shaped) one,
in both of SGLang's weight-update protocols (with and without /begin_weight_update, versions.py). Fake servers
because SGLang's server needs a GPU (tests/rollout/sglang/fake_server.py says what they copy from its source)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from megatron_gspo.rollout.sglang import SGLangError
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import free_port
from tests.rollout.server.test_transport import MB, named_weights
from tests.rollout.sglang.gloo_group import join_gloo_group


def test_disk_sync_content_version_and_order_of_calls(fake_servers, attach, tmp_path):
    servers = fake_servers(2)
    servers[0].flush_busy = 2  # /flush_cache answers 400 while busy: retried
    weights = named_weights()
    exporter = lambda chunks: iter(weights)  # noqa: E731
    engine = attach(servers, exporter=exporter, weight_sync="disk", weight_sync_dir=str(tmp_path))
    engine.update_weights(["chunk"], version=1)
    assert engine.weight_version == 1
    for server in servers:
        assert server.weight_version == "1"
        assert sorted(server.weights) == sorted(n for n, _ in weights)
        for name, tensor in weights:
            assert server.weights[name].dtype == tensor.dtype and torch.equal(server.weights[name], tensor)
        paths = server.paths()
        assert paths[0] == "/pause_generation" and paths[1] == "/update_weights_from_disk"
        assert paths[-1] == "/continue_generation" and paths[-2] == "/flush_cache"
        loads = [p for path, p in server.calls if path == "/update_weights_from_disk"]
        assert loads == [{"model_path": str(tmp_path / "weights-v1"), "weight_version": "1", "flush_cache": False}]
    assert servers[0].flush_count == 3
    # rollouts now carry the new version; the previous version's directory is removed at the next sync
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].weight_version == 1
    engine.push_weights(iter(weights), version=2)
    assert [p.name for p in tmp_path.iterdir()] == ["weights-v2"]
    with pytest.raises(ValueError, match="must be an int >= current 2"):
        engine.push_weights(iter(weights), version=1)


def test_failed_sync_refuses_generation_until_a_sync_succeeds(fake_servers, attach, tmp_path):
    (server,) = fake_servers(1)
    engine = attach([server], weight_sync="disk", weight_sync_dir=str(tmp_path))
    server.fail_update = True
    with pytest.raises(SGLangError, match="update_weights_from_disk answered HTTP 400: .*fake failure"):
        engine.push_weights(iter(named_weights()), version=1)
    assert engine.weight_version == 0
    with pytest.raises(SGLangError, match="weight sync to version 1 failed"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    server.fail_update = False
    engine.push_weights(iter(named_weights()), version=1)
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].weight_version == 1


class RecordingGroup:
    """Stands in for the NCCL group: records the broadcasts."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.sent: list[torch.Tensor] = []
        self.closed = False

    def broadcast(self, tensor):
        self.sent.append(tensor)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_distributed_protocol_calls_and_broadcast_order(fake_servers, attach, version):
    """Issue 16 item 1: from SGLang 0.5.21 the updates go between /begin_weight_update and /end_weight_update
    (0.5.23 refuses them outside); 0.5.9 has neither endpoint."""
    servers = fake_servers(2, version=version)
    for s in servers:
        s.join_groups = False
    groups: list[RecordingGroup] = []

    def factory(**kwargs):
        groups.append(RecordingGroup(**kwargs))
        return groups[-1]

    weights = named_weights()
    port = free_port()  # configured explicitly: bound as configured
    engine = attach(servers, group_factory=factory, tp_size=2, bucket_mb=300 / MB, master_port=port)
    assert {info.version for info in engine.server_info.values()} == {version}
    engine.push_weights(iter(weights), version=1)
    engine.push_weights(iter(weights), version=2)
    assert len(groups) == 1  # the group is created once
    (group,) = groups
    assert group.kwargs["world_size"] == 5 and group.kwargs["store"].port == port
    assert group.kwargs["group_name"] == "weight_update_group" and "backend" not in group.kwargs
    assert [t is w for t, (_, w) in zip(group.sent, weights + weights)] == [True] * 12  # list order, twice
    session = version == "0.5.23"
    for i, server in enumerate(servers):
        init = [p for path, p in server.calls if path == "/init_weights_update_group"]
        assert init == [
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1 + 2 * i,
                "world_size": 5,
                "group_name": "weight_update_group",
                "backend": "nccl",  # issue 16 item 8: what the server joins is NCCL
            }
        ]
        updates = [p for path, p in server.calls if path == "/update_weights_from_distributed"]
        names = [n for p in updates for n in p["names"]]
        assert names == [n for n, _ in weights] * 2
        first = updates[0]
        assert first["dtypes"] == ["bfloat16"] * len(first["names"])
        assert first["shapes"][0] == [16, 8] and first["flush_cache"] is False
        versions = [p.get("weight_version") for p in updates]
        assert versions.count("1") == 1 and versions.count("2") == 1 and versions[-1] == "2"
        paths = server.paths()
        per_sync = len(updates) // 2
        one_sync = (
            ["/pause_generation"]
            + (["/begin_weight_update"] if session else [])
            + ["/update_weights_from_distributed"] * per_sync
            + (["/end_weight_update"] if session else [])
            + ["/flush_cache", "/continue_generation"]
        )
        assert paths == [one_sync[0], "/init_weights_update_group", *one_sync[1:], *one_sync]
        assert server.weight_version == "2" and not server.session_open


@pytest.mark.parametrize("version", ["0.5.9", "0.5.23"])
def test_distributed_sync_over_a_real_gloo_group(fake_servers, attach, version):
    """The trainer joins as rank 0 the way SGLang servers join (TCP store + prefixes); broadcasts are real. On main
    the 0.5.23 server refuses the update without joining the broadcast, and the trainer's broadcast hangs until
    the group's timeout (issue 16 item 1)."""
    servers = fake_servers(2, version=version)
    weights = named_weights()
    engine = attach(
        servers, group_factory=join_gloo_group, bucket_mb=600 / MB, weight_sync_timeout_s=20
    )
    engine.push_weights(iter(weights), version=1)
    changed = [(n, t + 1) for n, t in weights]
    engine.push_weights(iter(changed), version=2)
    for server in servers:
        assert server.weight_version == "2"
        for name, tensor in changed:
            assert server.weights[name].dtype == tensor.dtype and torch.equal(server.weights[name], tensor)
    engine.close()


def test_unconfigured_port_is_bound_before_the_servers_hear_it(fake_servers, attach, monkeypatch):
    """Issue 24: with sglang.master_port=0 the trainer used to pick a free port, release it and bind it later, in
    the factory; another process could take it in between (EADDRINUSE). A listening socket on the picked port
    stands in for that process (the old pick, engine._free_port, is pointed at it; the race itself cannot be
    timed in a test). Now the store binds a port the OS picks and the servers are told that port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        monkeypatch.setattr("megatron_gspo.rollout.sglang.engine._free_port", lambda: held, raising=False)
        servers = fake_servers(2)
        bound: list[int] = []

        def factory(**kwargs):
            store = kwargs.get("store")
            bound.append(store.port if store is not None else kwargs["master_port"])
            return join_gloo_group(**kwargs)

        engine = attach(servers, group_factory=factory, weight_sync_timeout_s=20)
        weights = named_weights()
        engine.push_weights(iter(weights), version=1)
    (port,) = bound
    assert port != held
    for server in servers:
        (init,) = [p for path, p in server.calls if path == "/init_weights_update_group"]
        assert init["master_port"] == port
        assert server.weight_version == "1"
        for name, tensor in weights:
            assert torch.equal(server.weights[name], tensor)
    engine.close()


def test_configured_port_in_use_is_a_one_line_error(fake_servers, attach):
    """An explicitly configured sglang.master_port is bound as configured; taken, it fails before any server is
    asked to join (nothing waits on a store that does not exist)."""
    (server,) = fake_servers(1)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        engine = attach([server], group_factory=join_gloo_group, master_port=held, weight_sync_timeout_s=5)
        with pytest.raises(RuntimeError, match=f"sglang.master_port={held}, .*: cannot host the weight-update store"):
            engine.push_weights(iter(named_weights()), version=1)
    assert "/init_weights_update_group" not in server.paths()
    engine.close()


def test_failed_distributed_sync_drops_the_group_and_the_next_sync_rebuilds_it(fake_servers, attach):
    servers = fake_servers(2)  # 0.5.23: the failed sync's session must be closed too, or the next begin is refused
    for s in servers:
        s.join_groups = False
    groups: list[RecordingGroup] = []

    def factory(**kwargs):
        groups.append(RecordingGroup(**kwargs))
        return groups[-1]

    engine = attach(servers, group_factory=factory)
    servers[1].fail_update = True
    with pytest.raises(SGLangError, match="update_weights_from_distributed answered HTTP 400"):
        engine.push_weights(iter(named_weights()), version=1)
    assert groups[0].closed and engine.weight_version == 0
    assert all("/destroy_weights_update_group" in s.paths() for s in servers)
    assert not any(s.session_open for s in servers)
    servers[1].fail_update = False
    engine.push_weights(iter(named_weights()), version=1)
    assert len(groups) == 2 and not groups[1].closed and engine.weight_version == 1
    engine.close()  # attached servers leave the group, so a later trainer can create it again
    assert groups[1].closed and all(s.paths().count("/destroy_weights_update_group") == 2 for s in servers)


def test_trainer_side_of_the_group_is_nccl(fake_servers, attach):
    """Issue 16 item 8: without an injected factory the trainer joins with NCCL, which needs rank 0 on CUDA; on a
    CPU that is a clear error (never a gloo group that a real server, joining NCCL, would leave hanging)."""
    (server,) = fake_servers(1)
    server.join_groups = False
    engine = attach([server], weight_sync_timeout_s=5)
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(RuntimeError, match="needs trainer rank 0 on a CUDA device"):
        engine.push_weights(iter(named_weights()), version=1)


def test_shm_sync_writes_under_dev_shm_and_frees_it_at_close(fake_servers, attach):
    """Item 4's colocated transport on one host: safetensors in RAM (/dev/shm), removed when the engine closes."""
    (server,) = fake_servers(1)
    engine = attach([server], colocated=True, weight_sync="shm")
    engine.push_weights(iter(named_weights()), version=1)
    (load,) = [p for path, p in server.calls if path == "/update_weights_from_disk"]
    path = Path(load["model_path"])
    assert path.parent.parent == Path("/dev/shm") and path.name == "weights-v1"
    assert sorted(server.weights) == sorted(n for n, _ in named_weights())
    engine.close()
    assert not path.parent.exists()


def test_memory_saver_calls(fake_servers, attach):
    servers = fake_servers(2)
    engine = attach(servers, colocated=True, weight_sync="shm")
    engine.release_memory(["kv_cache", "weights"])
    engine.resume_memory()
    for s in servers:
        assert s.calls[-2:] == [
            ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
            ("/resume_memory_occupation", {"tags": None}),
        ]


@pytest.mark.parametrize(
    "version, overrides, mode",
    [
        ("0.5.23", {}, "retract"),  # per-token versions: samples in flight continue under the new weights
        ("0.5.9", {}, "abort"),  # one version per sample: a continued sample could not say which tokens are new
        ("0.5.23", {"partial_rollouts": False}, "abort"),
    ],
)
def test_partial_rollouts_retract_only_where_tokens_carry_versions(fake_servers, attach, tmp_path, version,
                                                                  overrides, mode):
    (server,) = fake_servers(1, version=version)
    engine = attach([server], weight_sync="disk", weight_sync_dir=str(tmp_path), **overrides)
    assert engine.supports_partial_rollouts == (mode == "retract")
    engine.push_weights(iter(named_weights()), version=1)
    assert [p for path, p in server.calls if path == "/pause_generation"] == [{"mode": mode}]
