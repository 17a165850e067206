"""A fake SGLang server for tests: SGLang 0.5.x's native HTTP shapes (REFERENCE.md §4) and its failure modes.

A stand-in because SGLang's server cannot run on this CPU host (it needs CUDA; REFERENCE.md §4, §6): what of SGLang can
run here runs for real in test_conformance.py (its request types, tokenizer manager and init_custom_process_group
over gloo, from .venv-sglang-conformance); this fake serves the HTTP side around them.

In-process: `FakeSGLang(...).start()` serves an aiohttp app from a background thread (own event loop) on
127.0.0.1:<free port>, behaving as a server started with --skip-tokenizer-init --enable-return-routed-experts
--enable-memory-saver --enable-deterministic-inference of release `version`. As a subprocess (launch-mode tests):
`python -m tests.rollout.sglang.fake_server --host H --port P [SGLang's flags] [--fake-* knobs]`, where those
SGLang flags mean what they mean to SGLang (off unless given).

What SGLang does and the fake copies (read in SGLang 0.5.9 / 0.5.23's source; rollout/sglang/versions.py):
- `sampling_seed` is used only with deterministic inference; otherwise every request samples afresh;
- from 0.5.21, /update_weights_from_distributed outside /begin_weight_update ... /end_weight_update answers 400
  without joining the broadcast (older releases have no such endpoints: 404);
- 0.5.9 with --skip-tokenizer-init returns routed experts as `{}`;
- /release_memory_occupation asserts that the server is idle: a release while requests run kills the scheduler
  (recorded in `release_violations`; the fake then answers 500), as does generating on released memory;
- prompt + max_new_tokens >= context length answers 400.

Generation is deterministic when seeded: tokens come from an LCG seeded by the prompt and `sampling_seed`, so tests
can recompute what a request must return (`fake_tokens`, `fake_logprob`, `fake_routed_experts`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web


def fake_tokens(
    input_ids: list[int], seed: int | None, max_new_tokens: int, stop_ids: list[int], vocab: int
) -> list[int]:
    """The response the fake returns for a prompt (stop token included when hit)."""
    state = (sum((i + 1) * t for i, t in enumerate(input_ids)) * 1_000_003 + (seed or 0)) % 2**31
    out: list[int] = []
    for _ in range(max_new_tokens):
        state = (state * 1_103_515_245 + 12_345) % 2**31
        tok = (state >> 8) % vocab
        out.append(tok)
        if tok in stop_ids:
            break
    return out


def fake_logprob(token: int) -> float:
    """The log-prob the fake reports for a sampled token."""
    return -((token % 7) + 1) / 8


def fake_routed_experts(num_tokens: int, num_layers: int, topk: int, num_experts: int) -> np.ndarray:
    """int32 [num_tokens, num_layers, topk] routing record the fake returns."""
    t, l, k = np.meshgrid(np.arange(num_tokens), np.arange(num_layers), np.arange(topk), indexing="ij")
    return ((t * 3 + l * 5 + k) % num_experts).astype(np.int32)


ATTACH = ("/destroy_weights_update_group", "/ready", "/end_weight_update", "/continue_generation")
"""What a resumed engine sends each paused server (distributed sync) before its health check (engine.py
`_undo_dead_trainer`)."""


class FakeSGLang:
    """One fake server. Its attributes are knobs tests set (before or between requests) and records."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        vocab_size: int = 97,
        num_layers: int = 2,
        topk: int = 2,
        num_experts: int = 8,
        model_path: str = "fake-model",
        version: str = "0.5.23",
        deterministic_inference: bool = True,
        return_routed_experts: bool = True,
        memory_saver: bool = True,
        skip_tokenizer_init: bool = True,
        context_length: int | None = None,
    ):
        self.host, self.port = host, port
        self.vocab_size, self.num_layers = vocab_size, num_layers
        self.topk, self.num_experts = topk, num_experts
        self.model_path = model_path
        # what the server was started as (its /server_info)
        self.version = version
        """SGLang release the fake behaves as."""
        self.deterministic_inference = deterministic_inference
        """--enable-deterministic-inference: only then is sampling_seed used."""
        self.return_routed_experts = return_routed_experts
        """--enable-return-routed-experts."""
        self.memory_saver = memory_saver
        """--enable-memory-saver."""
        self.skip_tokenizer_init = skip_tokenizer_init
        """--skip-tokenizer-init."""
        self.context_length = context_length
        """--context-length; None: no limit (the fake has no model config to derive one from)."""
        # failure knobs
        self.health_503 = 0
        """The first k /health_generate (and /health) calls answer 503 (server starting)."""
        self.fail_generate: set[int] = set()
        """1-based /generate request numbers answered with HTTP 500."""
        self.malformed_json = 0
        """The next k /generate answers are truncated JSON."""
        self.abort_next = 0
        """The next k /generate answers finish with {"type": "abort"}."""
        self.die_after: int | None = None
        """After this many /generate requests, every connection drops and the server stops listening."""
        self.flush_busy = 0
        """The first k /flush_cache calls answer 400 (requests still running)."""
        self.generate_delay_s = 0.0
        """Time each /generate takes."""
        self.report_version: str | None = None
        """Reported as meta_info.weight_version instead of the real one (a server that missed an update)."""
        self.join_groups = True
        """Really join the weight-update group (gloo) on /init_weights_update_group; False: only record."""
        self.fail_update = False
        """/update_weights_from_* answer 400 {"success": false}."""
        self.drop_fields: set[str] = set()
        """meta_info keys left out of /generate answers (an incompatible server version)."""
        self.stuck = False
        """Weight-update and pause endpoints never answer: a stand-in for a server whose scheduler is blocked in a
        broadcast receive from a trainer that died mid-sync (a real one needs NCCL and a dead GPU peer)."""
        self.dp_size = 1
        """Data-parallel replicas of the server: with more than one, /destroy_weights_update_group answers 500
        (SGLang 0.5.23 asserts dp_size == 1 there, tokenizer_control_mixin.py:464, before looking for the group)."""
        self.vary_per_request = False
        """Mix the request number into the tokens: the same request twice gets different answers (a server that
        is not batch-invariant)."""
        # records
        self.weight_version = "default"
        self.calls: list[tuple[str, Any]] = []
        self.generate_count = 0
        self.health_count = 0
        self.flush_count = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.aborted_rids: list[str] = []
        self.weights: dict[str, Any] = {}
        self.paused = False
        self.dead = False
        self.session_open = False
        """A weight-update session is open (SGLang >= 0.5.21)."""
        self.released = False
        """GPU memory released (/release_memory_occupation) and not resumed yet."""
        self.release_violations: list[str] = []
        """What would have killed a real SGLang scheduler: a release while requests ran, a generation while
        released."""
        self.writer_lock_waits: list[int] = []
        """/end_weight_update calls on an unpaused server, each with the generations running then: SGLang takes
        its model-update writer lock for them (tokenizer_control_mixin.py:471-483 in 0.5.23), which waits for the
        running generations and holds every new one until then (utils/aio_rwlock.py): every client stalls."""
        self.groups: set[str] = set()
        """Names of the weight-update groups the server holds (SGLang keys them by name; a second init of a held
        name is refused, an unknown name's destroy too)."""
        self._group: Any = None
        self._store: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def release(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.version.split("."))

    def paths(self) -> list[str]:
        """Paths of the calls received, in order; left out: health checks, /server_info, and what an attaching
        engine sends before its first health check (undoing a dead trainer's state: `attach_paths`)."""
        health = ("/health_generate", "/health")
        first = next((i for i, (p, _) in enumerate(self.calls) if p in health), 0)
        left_out = ("/server_info", "/model_info", *health)
        kept = [(i, p) for i, (p, _) in enumerate(self.calls) if p not in left_out]
        return [p for i, p in kept if i >= first or p not in ATTACH]

    def attach_paths(self, since: int = 0) -> list[str]:
        """What was sent from call `since` on before the next health check (an attaching engine's clean-up),
        /model_info left out."""
        health = ("/health_generate", "/health")
        calls = self.calls[since:]
        first = next((i for i, (p, _) in enumerate(calls) if p in health), len(calls))
        return [p for p, _ in calls[:first] if p != "/model_info"]

    # ---------------------------------------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application()
        r = app.router
        r.add_post("/generate", self.generate)
        for path in ("/health_generate", "/health"):
            r.add_get(path, self.health)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        if self.release >= (0, 5, 23):  # read in 0.5.23 (http_server.py:714-718); 0.5.9 has none (404)
            r.add_get("/ready", self.ready)
        if self.release >= (0, 5, 21):  # the endpoints exist from 0.5.21 on (404 before, as any unknown path)
            r.add_post("/begin_weight_update", self.begin_update)
            r.add_post("/end_weight_update", self.end_update)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/abort_request", self.abort_request)
        for path in ("/pause_generation", "/continue_generation"):
            r.add_route("*", path, self.control)
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            r.add_route("*", path, self.control)
        return app

    async def _payload(self, request: web.Request) -> Any:
        raw = await request.read()
        payload = json.loads(raw) if raw.strip() else None
        self.calls.append((request.path, payload))
        return payload

    async def _die(self, request: web.Request) -> None:
        self.dead = True
        if self._site is not None:
            await self._site.stop()
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError

    async def _admit(self, request: web.Request) -> tuple[Any, int, web.Response | None]:
        """(body, request number, a failure answer or None): the failure knobs every fake's generate obeys."""
        body = await self._payload(request)
        self.generate_count += 1
        number = self.generate_count
        if self.dead or (self.die_after is not None and number > self.die_after):
            await self._die(request)
        if number in self.fail_generate:
            error = {"object": "error", "message": "Internal server error", "code": 500}
            return body, number, web.json_response(error, status=500)
        return body, number, None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body, number, failure = await self._admit(request)
        if failure is not None:
            return failure
        if self.released or self.release_violations:
            self.release_violations.append(f"/generate {body.get('rid')} while the memory was released")
            return web.json_response({"error": {"message": "scheduler died"}}, status=500)
        params = body.get("sampling_params") or {}
        if self.context_length is not None:
            total = len(body["input_ids"]) + int(params.get("max_new_tokens", 128))
            if total >= self.context_length:
                message = (
                    "Requested token count exceeds the model's maximum context length of "
                    f"{self.context_length} tokens. You requested a total of {total} tokens"
                )
                return web.json_response({"error": {"message": message}}, status=400)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.generate_delay_s:
                await asyncio.sleep(self.generate_delay_s)
            if self.dead:
                await self._die(request)
        finally:
            self.in_flight -= 1
        if self.malformed_json > 0:
            self.malformed_json -= 1
            return web.Response(body=b'{"text": "", "output_ids": [1, 2', content_type="application/json")
        prompt = body["input_ids"]
        stop_ids = list(params.get("stop_token_ids") or [])
        max_new = int(params.get("max_new_tokens", 128))
        seed = params.get("sampling_seed")
        if not self.deterministic_inference:  # SGLang ignores sampling_seed then: every request samples afresh
            seed = random.randrange(2**31)
        if self.vary_per_request:
            seed = (seed or 0) + 7919 * number
        tokens = fake_tokens(prompt, seed, max_new, stop_ids, self.vocab_size)
        aborted = self.abort_next > 0 or body.get("rid") in self.aborted_rids
        if aborted:
            self.abort_next = max(0, self.abort_next - 1)
            tokens = tokens[: len(tokens) // 2]
            finish: dict[str, Any] = {"type": "abort", "message": "Abort before prefill"}
        elif tokens and tokens[-1] in stop_ids:
            finish = {"type": "stop", "matched": tokens[-1]}
        else:
            finish = {"type": "length", "length": len(tokens)}
        meta: dict[str, Any] = {
            "id": body.get("rid"),
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "weight_version": self.report_version or self.weight_version,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[fake_logprob(t), t, None] for t in tokens]
        if body.get("return_routed_experts") and self.return_routed_experts:
            num_tokens = len(prompt) + len(tokens) - 1
            rows = fake_routed_experts(num_tokens, self.num_layers, self.topk, self.num_experts)
            if self.skip_tokenizer_init and self.release < (0, 5, 10):
                meta["routed_experts"] = {}  # 0.5.9: the raw tensor through FastAPI's encoder
            else:
                meta["routed_experts"] = base64.b64encode(rows.tobytes()).decode("ascii")
        for key in self.drop_fields:
            meta.pop(key, None)
        return web.json_response({"text": "", "output_ids": tokens, "meta_info": meta})

    async def health(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, None))
        self.health_count += 1
        # SGLang's health check generates one token, which waits while paused (tokenizer_manager.py:938-939 in
        # 0.5.23): 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s); the fake answers it at once.
        starting = self.health_count <= self.health_503
        return web.Response(status=503 if starting or self.paused else 200)

    async def ready(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, None))
        return web.Response(status=503 if self.paused or self.dead else 200)  # tokenizer_manager.py:732-734

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self._payload(request)
        self.flush_count += 1
        if self.flush_count <= self.flush_busy:
            return web.Response(status=400, text="Cache not flushed: requests are running or waiting.\n")
        return web.Response(text="Cache flushed.\n")

    async def _hang_if_stuck(self) -> None:
        if self.stuck:
            # cancelled when the client gives up (connection closed) or at stop()
            await asyncio.Event().wait()

    async def control(self, request: web.Request) -> web.Response:
        await self._payload(request)
        if request.path in ("/pause_generation", "/continue_generation"):
            await self._hang_if_stuck()
        if request.path == "/pause_generation":
            self.paused = True
        elif request.path == "/continue_generation":
            self.paused = False
        elif request.path == "/release_memory_occupation":
            if self.in_flight:  # SGLang: assert self.is_fully_idle(): the scheduler process dies
                self.release_violations.append(f"release with {self.in_flight} request(s) running")
                return web.json_response({"error": {"message": "scheduler died"}}, status=500)
            self.released = True
            return web.Response(status=200)
        elif request.path == "/resume_memory_occupation":
            self.released = False
            return web.Response(status=200)
        return web.json_response({"message": "ok", "status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, None))
        info = {
            "version": self.version,
            "model_path": self.model_path,
            "skip_tokenizer_init": self.skip_tokenizer_init,
            "enable_return_routed_experts": self.return_routed_experts,
            "enable_memory_saver": self.memory_saver,
            "enable_deterministic_inference": self.deterministic_inference,
            "context_length": self.context_length,
            "weight_version": self.weight_version,
        }
        return web.json_response(info)

    async def begin_update(self, request: web.Request) -> web.Response:
        await self._payload(request)
        if self.session_open:
            message = "a weight-update session is already open; call end_weight_update() first"
            return web.json_response({"success": False, "message": message}, status=400)
        self.session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_update(self, request: web.Request) -> web.Response:
        await self._payload(request)
        await self._hang_if_stuck()
        if not self.paused:
            self.writer_lock_waits.append(self.in_flight)
        if not self.session_open:
            message = "no weight-update session is open; call begin_weight_update() first"
            return web.json_response({"success": False, "message": message}, status=400)
        self.session_open = False
        return web.json_response({"success": True, "message": "Success"})

    async def model_info(self, request: web.Request) -> web.Response:
        info = {"model_path": self.model_path, "is_generation": True, "weight_version": self.weight_version}
        return web.json_response(info)

    async def abort_request(self, request: web.Request) -> web.Response:
        payload = await self._payload(request)
        self.aborted_rids.append(payload.get("rid"))
        return web.Response(status=200)

    def _refuse(self) -> web.Response | None:
        if self.fail_update:
            return web.json_response({"success": False, "message": "fake failure"}, status=400)
        return None

    async def update_from_disk(self, request: web.Request) -> web.Response:
        payload = await self._payload(request)
        if (refused := self._refuse()) is not None:
            return refused
        from safetensors.torch import load_file

        directory = Path(payload["model_path"])
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        loaded: dict[str, Any] = {}
        for shard in sorted(directory.glob("*.safetensors")):
            loaded.update(load_file(str(shard)))
        if sorted(loaded) != sorted(index["weight_map"]):
            return web.json_response({"success": False, "message": "index and shards disagree"}, status=400)
        self.weights = loaded
        if payload.get("weight_version") is not None:
            self.weight_version = payload["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded.", "num_paused_requests": 0})

    async def init_group(self, request: web.Request) -> web.Response:
        p = await self._payload(request)
        if p["group_name"] in self.groups:  # torch refuses the name after the rendezvous (SGLang 0.5.23's
            # model_runner_components/weight_updater.py:130-144 catches it; distributed_c10d.py's
            # _new_process_group_helper raises it)
            message = (
                "Failed to initialize custom process group: The specified group name has already been created, "
                "please use a different group name."
            )
            return web.json_response({"success": False, "message": message}, status=400)
        self.groups.add(p["group_name"])
        if not self.join_groups:
            return web.json_response({"success": True, "message": "recorded"})
        # A real server joins with the requested backend (NCCL); the fake, on a CPU, joins with gloo (the tests'
        # trainer side does too: tests/rollout/sglang/gloo_group.py).
        await asyncio.to_thread(self._join, p)
        return web.json_response({"success": True, "message": "Succeeded to initialize the group."})

    def _join(self, p: dict) -> None:
        """The server side of SGLang's init_custom_process_group, for one rank (tp_size 1)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore(p["master_address"], p["master_port"], p["world_size"], False, timeout)
        name = p["group_name"]
        prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self._store = store
        self._group = dist.ProcessGroupGloo(prefixed, p["rank_offset"], p["world_size"], opts)

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        p = await self._payload(request)
        await self._hang_if_stuck()
        if (refused := self._refuse()) is not None:
            return refused
        if self.release >= (0, 5, 21) and not self.session_open:  # refused before joining the broadcast
            message = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            return web.json_response({"success": False, "message": message}, status=400)
        if self._group is not None:
            self.weights.update(await asyncio.to_thread(self._receive, p))
        if p.get("weight_version") is not None:
            self.weight_version = p["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    def _receive(self, p: dict) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        out = {}
        for name, dtype, shape in zip(p["names"], p["dtypes"], p["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._group.broadcast([tensor], opts).wait()
            out[name] = tensor
        return out

    async def destroy_group(self, request: web.Request) -> web.Response:
        p = await self._payload(request)
        await self._hang_if_stuck()
        if self.dp_size > 1:
            return web.Response(status=500, text="Internal Server Error")
        if p["group_name"] not in self.groups:  # SGLang 0.5.23 weight_updater.py:146-153
            message = "The group to be destroyed does not exist."
            return web.json_response({"success": False, "message": message}, status=400)
        self.groups.discard(p["group_name"])
        self._group = self._store = None
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    # ---------------------------------------------------------------------------------------------- running
    async def _serve(self, ready: threading.Event) -> None:
        self._runner = web.AppRunner(self.app(), handle_signals=False, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.host, self.port)
        await self._site.start()
        self.port = self._site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()

    def start(self) -> FakeSGLang:
        """Serves from a background thread; returns once the port is open."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.create_task(self._serve(ready))  # type: ignore[union-attr]
            self._loop.run_forever()  # type: ignore[union-attr]

        self._thread = threading.Thread(target=run, name=f"fake-sglang-{id(self)}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake SGLang server did not start")
        return self

    def stop(self) -> None:
        """Stops serving and joins the thread (idempotent)."""
        if self._loop is None or self._thread is None:
            return
        loop, self._loop = self._loop, None

        async def shutdown() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            # handlers still sleeping (their clients gave up) are cancelled rather than left pending
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        self._thread.join(10)
        loop.close()
        self._thread = None


def main(argv: list[str] | None = None) -> None:
    """Subprocess entry point: accepts SGLang's launch flags (unknown ones ignored) plus --fake-* knobs."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", default="fake-model")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--fake-version", default="0.5.23")
    parser.add_argument("--fake-health-503", type=int, default=0)
    parser.add_argument("--fake-exit-code", type=int, default=None, help="exit at once with this code")
    parser.add_argument("--fake-child-pid-file", default=None, help="spawn a child (like SGLang's scheduler)")
    args, _ = parser.parse_known_args(argv)
    if args.fake_exit_code is not None:
        print("fake SGLang: failing on purpose", file=sys.stderr)
        sys.exit(args.fake_exit_code)
    if args.fake_child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        tmp = args.fake_child_pid_file + ".tmp"
        Path(tmp).write_text(f"{os.getpid()} {child.pid}")
        os.replace(tmp, args.fake_child_pid_file)
    server = FakeSGLang(
        host=args.host,
        port=args.port,
        model_path=args.model_path,
        version=args.fake_version,
        deterministic_inference=args.enable_deterministic_inference,
        return_routed_experts=args.enable_return_routed_experts,
        memory_saver=args.enable_memory_saver,
        skip_tokenizer_init=args.skip_tokenizer_init,
        context_length=args.context_length,
    )
    server.health_503 = args.fake_health_503
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
