"""A fake vLLM 0.32 server for protocol tests: `/inference/v1/generate` and the RL endpoints, shaped as vLLM's own
(REFERENCE.md §9; vllm/entrypoints/scale_out/token_in_token_out/protocol.py, vllm/entrypoints/rl/online).

It reuses the fake SGLang server's machinery (background aiohttp thread, failure knobs, call records) and its
deterministic token stream (`fake_tokens` from prompt and seed), with vLLM's routes and body shapes.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from megatron_gspo.rollout.server.transport import read_checkpoint_dir
from tests.rollout.sglang.fake_server import FakeSGLang, fake_logprob, fake_tokens


class FakeVLLM(FakeSGLang):
    """One fake vLLM server; knobs and records as FakeSGLang's, plus `update_active`."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.update_active = False
        self.weight_version = "default"
        self.routes: dict[str, int] | None = None
        """Set to {} to record routes (vllm.capture_routes): vLLM request id -> rows recorded so far. Stands in
        for the gate hooks of worker.py (which need a vLLM model runner); the store rule is the worker's own,
        tested on the real server in test_partial_rollouts.py."""

    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_post("/inference/v1/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/collective_rpc", self.pop_routes)
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/start_weight_update", "/finish_weight_update",
                     "/update_weights", "/abort_requests"):  # fmt: skip
            r.add_post(path, self.rl_call)
        return app

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body, number, failure = await self._admit(request)
        if failure is not None:
            return failure
        if self.malformed_json > 0:
            self.malformed_json -= 1
            return web.Response(body=b'{"choices": [{"token_ids": [1, 2', content_type="application/json")
        vllm_id = f"generate-tokens-{body['request_id']}-0"  # vLLM appends a random suffix
        if self.routes is not None:
            self.routes[vllm_id] = len(body["token_ids"])  # the prefill's rows, recorded as the request runs
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.generate_delay_s:
                import asyncio

                await asyncio.sleep(self.generate_delay_s)
        finally:
            self.in_flight -= 1
        params = body["sampling_params"]
        seed = params.get("seed")
        if self.vary_per_request:
            seed = (seed or 0) + 7919 * number
        stop = list(params.get("stop_token_ids") or [])
        tokens = fake_tokens(body["token_ids"], seed, int(params["max_tokens"]), stop, self.vocab_size)
        finish = "stop" if tokens and tokens[-1] in stop else "length"
        if self.abort_next > 0:
            self.abort_next -= 1
            finish = "abort"
        choice = {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": tokens[-1] if finish == "stop" else None,
            "token_ids": tokens,
            "logprobs": {"content": [{"token_id": t, "logprob": fake_logprob(t), "rank": 1} for t in tokens]},
            "routed_experts": None,
            "weight_versions": [
                {"version": self.report_version or self.weight_version, "start": 0, "end": len(tokens)}
            ],
        }
        for key in self.drop_fields:
            choice.pop(key, None)
        if self.routes is not None and vllm_id in self.routes:  # a forgotten request is not recorded again
            self.routes[vllm_id] += len(tokens) - 1
        return web.json_response({"request_id": "generate-tokens-" + body["request_id"], "choices": [choice]})

    async def weight_info(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, None))
        return web.json_response({"weight_version": self.report_version or self.weight_version})

    async def rl_call(self, request: web.Request) -> web.Response:
        payload = await self._payload(request)
        path = request.path
        if path == "/start_weight_update":
            if self.update_active:
                return web.json_response({"error": "a weight update is already active"}, status=500)
            self.update_active = True
        elif path == "/update_weights":
            if self.fail_update or not self.update_active:
                return web.json_response({"error": "start_weight_update must be called first"}, status=500)
            self.weights = dict(read_checkpoint_dir(payload["update_info"]["path"]))
        elif path == "/finish_weight_update":
            self.update_active = False
            self.weight_version = payload["weight_version"]
        elif path == "/pause":
            self.paused = True
        elif path == "/resume":
            self.paused = False
        elif path == "/abort_requests":
            self.aborted_rids.extend(payload["request_ids"])
        return web.json_response({"message": "ok"})

    async def pop_routes(self, request: web.Request) -> web.Response:
        """`gspo_pop_routes` (worker.py's rule): the wanted requests' routes, popped; others under `forget` dropped.
        Every row routes to experts 0..topk-1 (L=2 layers, top-2 here)."""
        import base64
        import io
        import json

        import numpy as np

        payload = await self._payload(request)
        spec = json.loads(payload["args"][0])
        out = {}
        for rid in list(self.routes or {}):
            match = next((p for p in spec["want"] if rid.startswith(p + "-")), None)
            if match is not None:
                encoded = io.BytesIO()
                np.save(encoded, np.tile(np.arange(2, dtype=np.int32), (self.routes.pop(rid), 2, 1)))
                out[match] = base64.b64encode(encoded.getvalue()).decode("ascii")
            elif rid.startswith(spec["forget"]):
                del self.routes[rid]
        return web.json_response({"results": [out]})
