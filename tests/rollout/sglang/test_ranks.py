"""make_sglang_engine: the trainer-side factory, on one rank and on two gloo ranks sharing one fake server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.models.config import ModelConfig
from megatron_gspo.rollout.sglang import make_sglang_engine
from megatron_gspo.rollout.types import SamplingParams
from tests.distributed import run_distributed


def collective_exporter(chunks):
    """Like the foundation's export with dst=0: all ranks join the collectives, rank 0 gets the tensors."""
    import torch.distributed as dist

    many = dist.is_initialized() and dist.get_world_size() > 1
    for name, tensor in chunks:
        buf = tensor.clone()
        if many:
            dist.broadcast(buf, src=0)
        if not many or dist.get_rank() == 0:
            yield name, buf


def runtime(sglang: dict, model_config=None):
    return SimpleNamespace(cfg=SimpleNamespace(sglang=sglang), model_config=model_config, dtype=torch.float32)


def test_single_rank_fills_routing_shape_from_the_model(fake_servers, tmp_path):
    (server,) = fake_servers(1, num_layers=3, topk=2, num_experts=16)
    mc = ModelConfig(num_hidden_layers=3, num_experts=16, num_experts_per_tok=2)
    options = dict(mode="attach", urls=[server.url], return_routed_experts=True, weight_sync="disk")
    options["weight_sync_dir"] = str(tmp_path)
    engine = make_sglang_engine(runtime(options, mc), exporter=collective_exporter)
    try:
        (rollout,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        assert rollout.routed_experts.shape[1:] == (3, 2)
        engine.update_weights([("w", torch.ones(2))], version=1)
        assert server.weight_version == "1" and engine.leader
    finally:
        engine.close()
    with pytest.raises(ValueError, match="unknown option sglang.server_urls"):
        make_sglang_engine(runtime({"mode": "attach", "server_urls": [server.url]}), exporter=list)


def _rank_main(url: str, dead_url: str, sync_dir: str) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:  # only the leader checks the servers: its failure must reach the other rank, not leave it waiting
        unreachable = dict(mode="attach", urls=[dead_url], startup_timeout_s=0.2)
        make_sglang_engine(runtime(unreachable), exporter=list)
        error = ""
    except Exception as e:  # noqa: BLE001 - reported to the parent
        error = str(e)
    options = dict(mode="attach", urls=[url], weight_sync="disk", weight_sync_dir=sync_dir, backoff_s=0.01)
    engine = make_sglang_engine(runtime(options), exporter=collective_exporter)
    rank = dist.get_rank()
    before = engine.generate([[rank + 1, 2]], SamplingParams(max_new_tokens=3, n=2))
    engine.update_weights([("w", torch.full((2,), 3.0) if rank == 0 else torch.zeros(2))], version=1)
    after = engine.generate([[rank + 5, 6]], SamplingParams(max_new_tokens=3, n=2))
    versions = [r.weight_version for r in before + after]
    result = {"error": error, "leader": engine.leader, "versions": versions}
    engine.close()
    return result


def test_two_ranks_rank0_leads_every_rank_generates(fake_servers, tmp_path):
    server, dead = fake_servers(2)
    dead.stop()
    results = run_distributed(_rank_main, server.url, dead.url, str(tmp_path), world_size=2, timeout=120)
    assert [r["leader"] for r in results] == [True, False]
    assert all(r["versions"] == [0, 0, 1, 1] for r in results)
    assert server.generate_count == 8
    assert server.paths().count("/update_weights_from_disk") == 1  # only the leader pushed
    assert torch.equal(server.weights["w"], torch.full((2,), 3.0))
    assert f"SGLang server {dead.url} not healthy" in results[0]["error"]
    relayed = f"rank 0 could not start the SGLang engine: ServerError: SGLang server {dead.url}"
    assert results[1]["error"].startswith(relayed)


def _tensor_parallel_main(url: str, sync_dir: str) -> dict:
    """TP=2 (one model replica on both ranks): each rank builds the engine as the trainer does."""
    from megatron.core import parallel_state as ps

    from megatron_gspo.parallel import ParallelConfig, initialize

    initialize(ParallelConfig(tp=2, sequence_parallel=True), seed=5)
    options = dict(mode="attach", urls=[url], weight_sync="disk", weight_sync_dir=sync_dir, backoff_s=0.01)
    engine = make_sglang_engine(runtime(options), exporter=collective_exporter)
    try:
        rollouts = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=4, n=2, seed=11))
        seeds = [r.extra["sampling_seed"] for r in rollouts]
        return {
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "tokens": [r.response_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "seeds": seeds,
        }
    finally:
        engine.close()


def test_tensor_parallel_peers_train_on_identical_rollouts(fake_servers, tmp_path):
    """Issue 12 item 8: the server answers every request differently; both TP ranks must still see one set of
    rollouts (one rank per model-parallel group generates and broadcasts)."""
    (server,) = fake_servers(1)
    server.vary_per_request = True
    results = run_distributed(_tensor_parallel_main, server.url, str(tmp_path), world_size=2, timeout=180)
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert results[0]["tokens"] == results[1]["tokens"] and results[0]["logprobs"] == results[1]["logprobs"]
    assert results[0]["seeds"] == results[1]["seeds"]
    assert server.generate_count == 4  # generated once, by the replica's source rank


def _data_parallel_seeds(url: str) -> list[int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    engine = make_sglang_engine(runtime(dict(mode="attach", urls=[url], backoff_s=0.01)), exporter=collective_exporter)
    try:
        rollouts = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, n=2, seed=11))
        return [r.extra["sampling_seed"] for r in rollouts]
    finally:
        engine.close()


def test_request_seeds_include_the_data_parallel_rank(fake_servers):
    (server,) = fake_servers(1)
    rank0, rank1 = run_distributed(_data_parallel_seeds, server.url, world_size=2, timeout=120)
    assert len(set(rank0 + rank1)) == 4  # the same prompt on two DP replicas gets independent samples
