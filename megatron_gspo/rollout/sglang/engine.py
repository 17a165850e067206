"""Rollouts from SGLang servers: the `RolloutEngine` used on GPU clusters.

The trainer never imports sglang (REFERENCE.md §6): it starts servers from SGLang's own environment
(launch mode) or uses running ones (attach mode) and talks to them over HTTP; weights travel by NCCL
broadcast or by disk.

    engine = SGLangEngine(SGLangConfig(model_path=..., num_servers=2), exporter=iter_hf_tensors)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))  # grouped per prompt
    engine.update_weights(model_chunks, version=step)                             # after each optimizer step
    engine.close()

With several trainer ranks (`make_sglang_engine`), global rank 0 is the leader: it launches / checks the
servers and pushes weights; every rank generates its own prompts over HTTP, and all ranks run the exporter
(it holds collectives) and meet at a barrier after each sync.

`generate` is synchronous: it runs the engine's private event loop until every sample is back. Each of the n
samples of a prompt is its own request (its own seed derived from `sampling.seed`, retried on its own) and all
of them go to the same server (its prefix cache holds the prompt). A sample is retried on connection errors,
5xx, malformed JSON, abort, or weights older than `weight_version`; after `max_retries` the whole call raises:
it never returns fewer rollouts than asked for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import socket
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from megatron_gspo.rollout.server.client import SGLangClient, backoff_delay
from megatron_gspo.rollout.sglang.config import SGLangConfig
from megatron_gspo.rollout.sglang.protocol import (
    RETRYABLE_STATUSES,
    RoutingSpec,
    SGLangConnectionError,
    SGLangError,
    SGLangGenerateError,
    SGLangHTTPError,
    StaleWeightsError,
    build_generate_payload,
    decode_generate_response,
    derive_sampling_seed,
    parse_json_body,
)
from megatron_gspo.rollout.server.process import (
    ManagedProcess,
    ProcessSupervisor,
    port_in_use,
    router_command,
    router_url,
    server_command,
    server_port,
    server_url,
)
from megatron_gspo.rollout.types import Rollout, SamplingParams
from megatron_gspo.rollout.server.weight_sync import (
    GroupFactory,
    NamedTensor,
    UpdateGroup,
    init_update_group,
    iter_buckets,
    join_update_group,
    push_disk,
    push_distributed,
)

__all__ = [
    "SGLangConfig",
    "SGLangEngine",
    "SGLangError",
    "SGLangGenerateError",
    "StaleWeightsError",
    "make_sglang_engine",
]

logger = logging.getLogger(__name__)

Exporter = Callable[[list], Iterable[NamedTensor] | Mapping[str, Any]]
"""model chunks -> (HF name, full tensor) pairs, streamed (models.hf_state.iter_hf_tensors) or a dict."""

T = TypeVar("T")

_ABORT_TIMEOUT_S = 2.0


class SGLangEngine:
    """RolloutEngine backed by SGLang servers (launched here or attached to)."""

    def __init__(
        self,
        config: SGLangConfig,
        exporter: Exporter | None = None,
        *,
        group_factory: GroupFactory = join_update_group,
        initial_version: int = 0,
        leader: bool = True,
        barrier: Callable[[], None] | None = None,
    ):
        """Starts (launch mode) or checks (attach mode) the servers and waits until all are healthy.

        `exporter` turns the trainer's model chunks into named HF tensors for `update_weights`;
        `group_factory` joins the distributed weight-update group (replaced in tests); `initial_version` is
        the version of the weights the servers hold at start (e.g. the step of a resumed checkpoint).
        A follower (`leader=False`, attach mode: the leader's URLs) only generates; its `update_weights`
        runs the exporter for its collectives. `barrier` (all trainer ranks) ends every `update_weights`.
        """
        if not leader and config.mode != "attach":
            raise ValueError("a follower SGLangEngine attaches to the leader's servers (sglang.mode=attach)")
        self.config = config
        self.leader = leader
        self._barrier = barrier
        self.weight_version = int(initial_version)
        self._exporter = exporter
        self._group_factory = group_factory
        self._group: UpdateGroup | None = None
        self._weights_ok = True
        self._failed_version: int | None = None
        self._disk_path: Path | None = None
        self._routing = (
            RoutingSpec(config.num_moe_layers, config.moe_topk, config.num_experts)  # type: ignore[arg-type]
            if config.return_routed_experts
            else None
        )
        self._loop = asyncio.new_event_loop()
        self._client = SGLangClient(
            timeout_s=config.request_timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            max_connections=config.max_concurrency,
        )
        self._supervisor: ProcessSupervisor | None = None
        self._process_of: dict[str, ManagedProcess] = {}
        self._inflight: dict[str, str] = {}
        self._run_id = uuid.uuid4().hex[:8]
        self._calls = 0
        self._closed = False
        self.server_urls: list[str] = []
        """Every server (weight sync and health go to each)."""
        self.generate_urls: list[str] = []
        """Where `/generate` goes: the router when there is one, else the servers."""
        try:
            if config.mode == "launch":
                self._launch()
            else:
                self.server_urls = list(config.urls)
                self.generate_urls = [config.router_url] if config.router_url else list(config.urls)
                if not leader:
                    return  # the leader checked them
                health = [self._healthy(url, "/health_generate") for url in self.server_urls]
                if config.router_url:
                    health.append(self._healthy(config.router_url, "/health"))
                self._run(_gather(*health))
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------------------- lifecycle

    def _launch(self) -> None:
        cfg = self.config
        ports = [("SGLang server", i, server_port(cfg, i)) for i in range(cfg.num_servers)]
        ports += [("sglang-router", 0, cfg.router_port)] if cfg.router else []
        for what, i, port in ports:
            if port_in_use(cfg.host, port):
                raise RuntimeError(
                    f"port {port} for {what} {i} is already in use (a server left from an earlier run?); "
                    "stop it or choose another sglang.port_base / sglang.router_port"
                )
        self._supervisor = ProcessSupervisor(cfg.stop_grace_s)
        log_dir = Path(cfg.log_dir) if cfg.log_dir else None
        for i in range(cfg.num_servers):
            proc = self._supervisor.start(
                f"SGLang server {i}",
                server_command(cfg, i),
                env=cfg.server_env,
                log_path=log_dir / f"sglang_server_{i}.log" if log_dir else None,
            )
            self.server_urls.append(server_url(cfg, i))
            self._process_of[self.server_urls[-1]] = proc
        self._run(_gather(*(self._healthy(url, "/health_generate") for url in self.server_urls)))
        if cfg.router:
            url = router_url(cfg)
            self._process_of[url] = self._supervisor.start(
                "sglang-router",
                router_command(cfg, self.server_urls),
                env=cfg.server_env,
                log_path=log_dir / "sglang_router.log" if log_dir else None,
            )
            self._run(self._healthy(url, "/health"))
            self.generate_urls = [url]
        else:
            self.generate_urls = list(self.server_urls)

    async def _healthy(self, url: str, path: str) -> None:
        proc = self._process_of.get(url)
        await self._client.wait_until_healthy(
            url,
            path=path,
            timeout_s=self.config.startup_timeout_s,
            poll_s=min(0.5, max(0.01, self.config.backoff_s)),
            check_alive=proc.exit_message if proc else None,
        )

    def close(self) -> None:
        """Aborts running requests, leaves the update group, stops the servers started here (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._loop.is_running():
                if self._inflight:
                    self._loop.run_until_complete(self._abort_inflight())
                if self._group is not None:  # attached servers must be able to join a later trainer's group
                    self._loop.run_until_complete(self._drop_group())
                self._loop.run_until_complete(self._client.close())
        finally:
            if self._supervisor is not None:
                self._supervisor.close()
            if not self._loop.is_running():
                self._loop.close()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the private loop; on an interrupt (e.g. Ctrl-C) it is cancelled, then re-raised."""
        if self._loop.is_running():
            raise RuntimeError("SGLangEngine methods are synchronous and not re-entrant")
        task = self._loop.create_task(coro)
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                self._loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            raise

    # --------------------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` rollouts per prompt, grouped contiguously in prompt order (`prompt_index` set)."""
        self._check_open()
        if not self._weights_ok:
            raise SGLangError(
                f"the weight sync to version {self._failed_version} failed, so the servers hold unknown "
                "weights; call update_weights again before generating"
            )
        for i, prompt in enumerate(prompts):
            if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
                raise ValueError(f"prompt {i} must be a non-empty list of token ids (ints >= 0)")
        if not prompts:
            return []
        self._calls += 1
        try:
            return self._run(self._generate(prompts, sampling))
        except BaseException:
            if self._inflight and not self._loop.is_closed():
                self._run(self._abort_inflight())
            raise

    async def _generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        limit = asyncio.Semaphore(self.config.max_concurrency)
        return await _gather(
            *(
                self._sample(limit, p, s, prompt, sampling)
                for p, prompt in enumerate(prompts)
                for s in range(sampling.n)
            )
        )

    def _live_urls(self) -> list[str]:
        procs = self._process_of
        live = [u for u in self.generate_urls if u not in procs or procs[u].popen.poll() is None]
        if not live:
            deaths = "; ".join(filter(None, (self._process_of[u].exit_message() for u in self.generate_urls)))
            raise SGLangGenerateError(f"every SGLang server has exited: {deaths}")
        return live

    def _pick_url(self, prompt_index: int, attempt: int, excluded: set[str]) -> str:
        live = self._live_urls()
        usable = [u for u in live if u not in excluded] or live
        return usable[(prompt_index + attempt) % len(usable)]

    async def _sample(
        self, limit: asyncio.Semaphore, p: int, s: int, prompt: list[int], sampling: SamplingParams
    ) -> Rollout:
        """One rollout of prompt `p` (sample `s`), retried up to max_retries times."""
        cfg = self.config
        seed = None if sampling.seed is None else derive_sampling_seed(sampling.seed, p * sampling.n + s)
        excluded: set[str] = set()
        last_error: object = None
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                delay = backoff_delay(cfg.backoff_s, attempt - 1)
                logger.warning("prompt %d sample %d: %s; retry %d in %.2fs", p, s, last_error, attempt, delay)
                await asyncio.sleep(delay)
            url = self._pick_url(p, attempt, excluded)
            rid = f"{self._run_id}-{self._calls}-{p}-{s}-{attempt}"
            payload = build_generate_payload(
                prompt, sampling, rid=rid, sampling_seed=seed, return_routed_experts=cfg.return_routed_experts
            )
            try:
                async with limit:
                    body = await self._post_generate(url, rid, payload)
                rollout = decode_generate_response(
                    body, url=url, prompt_ids=prompt, prompt_index=p, routing=self._routing
                )
            except SGLangError as e:
                if not e.retryable:
                    raise SGLangGenerateError(f"prompt {p} sample {s}: {e}") from e
                if isinstance(e, SGLangConnectionError):
                    excluded.add(url)  # try another server next (all of them again once each failed)
                last_error = e
                continue
            if rollout.finish_reason == "abort":
                last_error = f"server {url} aborted the request: {body['meta_info'].get('finish_reason')}"
                continue
            if rollout.weight_version < self.weight_version:
                last_error = StaleWeightsError(
                    f"server {url} sampled with weight_version {rollout.weight_version}, "
                    f"but the engine is at {self.weight_version}"
                )
                continue
            if rollout.weight_version > self.weight_version:
                raise SGLangGenerateError(
                    f"server {url} reports weight_version {rollout.weight_version}, newer than this engine's "
                    f"{self.weight_version}: is another trainer updating it?"
                )
            rollout.extra.update(rid=rid, attempts=attempt + 1, sampling_seed=seed)
            return rollout
        error = StaleWeightsError if isinstance(last_error, StaleWeightsError) else SGLangGenerateError
        raise error(
            f"prompt {p} sample {s}: no rollout after {cfg.max_retries + 1} attempt(s) "
            f"(sglang.max_retries={cfg.max_retries}); last error: {last_error}"
        )

    async def _post_generate(self, url: str, rid: str, payload: dict) -> Any:
        self._inflight[rid] = url  # kept on cancellation, so that close()/errors abort it on the server
        try:
            status, raw = await self._client.request_once(url, "/generate", payload)
        except SGLangConnectionError as e:
            self._inflight.pop(rid, None)
            if e.timed_out:  # the server may still be generating it
                await self._abort({rid: url})
            raise
        self._inflight.pop(rid, None)
        if not 200 <= status < 300:
            raise SGLangHTTPError(url, "/generate", status, raw.decode("utf-8", "replace"))
        return parse_json_body(raw, url, "/generate")

    async def _abort_inflight(self) -> None:
        inflight, self._inflight = dict(self._inflight), {}
        await self._abort(inflight)

    async def _abort(self, requests: dict[str, str]) -> None:
        """Best-effort `/abort_request` per request id (to every server when a router hid where it went)."""
        calls = []
        for rid, url in requests.items():
            targets = self.server_urls if url not in self.server_urls else [url]
            payload = {"rid": rid, "abort_all": False}
            calls += [
                self._client.request(u, "/abort_request", payload, timeout_s=_ABORT_TIMEOUT_S, retries=0)
                for u in targets
            ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("could not abort %d request(s): %s", len(failed), failed[0])

    # -------------------------------------------------------------------------------------------- weight sync

    def update_weights(self, model_chunks: list, version: int) -> None:
        """Exports the model chunks with the exporter and pushes them to every server as `version`."""
        self._check_open()
        if self._exporter is None:
            raise RuntimeError("SGLangEngine has no exporter; build it with exporter=iter_hf_tensors")
        self._check_version(version)  # before the exporter starts its collectives on every rank
        named_tensors = self._exporter(model_chunks)
        try:
            if self.leader:
                try:
                    self.push_weights(named_tensors, version)
                except Exception:
                    _drain(named_tensors)  # keep the other ranks' collectives matched before the barrier
                    raise
            else:
                for _ in named_tensors:  # the exporter's collectives need every rank
                    pass
                self.weight_version = version
        finally:
            if self._barrier is not None:
                self._barrier()

    def _check_version(self, version: int) -> None:
        if not isinstance(version, int) or version < self.weight_version:
            raise ValueError(f"weight version {version!r} must be an int >= current {self.weight_version}")

    def push_weights(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        """Pauses generation, sends the tensors (bucketed, in order), flushes the cache, continues; then
        `weight_version = version`. On failure generation is refused until a sync succeeds."""
        self._check_open()
        if not self.leader:
            raise RuntimeError("only the leader SGLangEngine (global rank 0) pushes weights")
        self._check_version(version)
        self._weights_ok = False
        self._failed_version = version
        try:
            self._run(self._push(named_tensors, version))
        except BaseException:
            if self._group is not None and not self._loop.is_closed():
                self._run(self._drop_group())
            raise
        self.weight_version = version
        self._weights_ok = True
        self._failed_version = None

    async def _push(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        cfg = self.config
        urls = self.server_urls
        await self._control_all("/pause_generation", {"mode": "abort"})
        buckets = iter_buckets(named_tensors, cfg.bucket_bytes)
        if cfg.weight_sync == "disk":

            async def post_disk(url: str, path: str, payload: dict) -> Any:
                return await self._client.call(url, path, payload, timeout_s=cfg.weight_sync_timeout_s)

            directory = Path(cfg.weight_sync_dir or ".")
            path = await push_disk(post_disk, urls, buckets, directory=directory, version=version)
            if self._disk_path is not None and self._disk_path != path:
                shutil.rmtree(self._disk_path, ignore_errors=True)
            self._disk_path = path
        else:
            if self._group is None:
                self._group = await init_update_group(
                    self._post_once,
                    urls,
                    factory=self._group_factory,
                    master_address=cfg.master_address,
                    master_port=cfg.master_port or _free_port(),
                    gpus_per_server=cfg.tp_size,
                    group_name=cfg.group_name,
                    backend=cfg.group_backend,
                    timeout_s=cfg.weight_sync_timeout_s,
                )
            await push_distributed(
                self._post_once, urls, buckets, group=self._group, group_name=cfg.group_name, version=version
            )
        await _gather(*(self._flush_cache(u) for u in urls))
        await self._control_all("/continue_generation", {})

    async def _post_once(self, url: str, path: str, payload: dict) -> Any:
        """Weight-update calls paired with collectives are never retried (the broadcasts would not match)."""
        timeout_s = self.config.weight_sync_timeout_s
        return await self._client.call(url, path, payload, timeout_s=timeout_s, retries=0)

    async def _control(self, url: str, path: str, payload: dict | None) -> Any:
        return await self._client.call(url, path, payload)

    async def _flush_cache(self, url: str) -> None:
        """`/flush_cache` answers 400 while requests are still running: retried."""
        retries = max(10, self.config.max_retries)
        busy_ok = RETRYABLE_STATUSES | {400}
        await self._client.call(url, "/flush_cache", retries=retries, retry_statuses=busy_ok)

    async def _drop_group(self) -> None:
        """A failed distributed sync may leave the group mid-collective: drop it (the next sync makes one)."""
        group, self._group = self._group, None
        payload = {"group_name": self.config.group_name}
        path = "/destroy_weights_update_group"
        destroy = [self._client.call(u, path, payload, retries=0) for u in self.server_urls]
        await asyncio.gather(*destroy, return_exceptions=True)
        if group is not None:
            group.close()

    # ------------------------------------------------------------------------------------------- memory saver

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Colocated mode: servers free GPU memory (tags 'weights', 'kv_cache'; None = all) for training."""
        self._check_open()
        self._run(self._control_all("/release_memory_occupation", {"tags": tags}))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Colocated mode: servers take their GPU memory back before a weight sync / generation."""
        self._check_open()
        self._run(self._control_all("/resume_memory_occupation", {"tags": tags}))

    async def _control_all(self, path: str, payload: dict | None) -> None:
        await _gather(*(self._control(u, path, payload) for u in self.server_urls))


def make_sglang_engine(runtime: Any, *, exporter: Exporter | None = None) -> SGLangEngine:
    """The engine of a training run with rollout.engine=sglang, on every trainer rank.

    `runtime` provides `cfg.sglang` (the options of SGLangConfig), `model_config` (fills the routing shape
    when return_routed_experts is set) and `dtype` (of the exported weights). Rank 0 leads; the other ranks
    attach to the URLs it shares (a failure on rank 0 is reported on every rank instead of hanging them).
    `exporter` defaults to the foundation's streaming HF export (tensors gathered to rank 0 only).
    """
    import torch.distributed as dist

    options = dict(runtime.cfg.sglang)
    if options.get("return_routed_experts"):
        mc = runtime.model_config
        options.setdefault("num_experts", mc.num_experts)
        options.setdefault("num_moe_layers", mc.num_hidden_layers)
        options.setdefault("moe_topk", mc.num_experts_per_tok)
    cfg = SGLangConfig.from_dict(options)
    many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if exporter is None:
        from megatron_gspo.models.hf_state import iter_hf_tensors

        dst, dtype = (0 if many else None), runtime.dtype

        def export(chunks: list) -> Iterable[NamedTensor]:
            return iter_hf_tensors(chunks, dst=dst, dtype=dtype)

        exporter = export
    if not many:
        return SGLangEngine(cfg, exporter)
    shared: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            engine = SGLangEngine(cfg, exporter, barrier=dist.barrier)
        except BaseException as e:
            dist.broadcast_object_list([f"{type(e).__name__}: {e}"], src=0)
            raise
        shared = [(_reachable(engine.server_urls), _reachable(engine.generate_urls))]
        dist.broadcast_object_list(shared, src=0)
        return engine
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], str):
        raise RuntimeError(f"rank 0 could not start the SGLang engine: {shared[0]}")
    server_urls, generate_urls = shared[0]
    router = generate_urls[0] if generate_urls != server_urls else None
    follower = dataclasses.replace(cfg, mode="attach", urls=server_urls, router=False, router_url=router)
    return SGLangEngine(follower, exporter, leader=False, barrier=dist.barrier)


def _drain(items: Iterable[Any]) -> None:
    """Runs an (exporter) iterable to its end, ignoring what it yields."""
    try:
        for _ in items:
            pass
    except Exception:  # noqa: BLE001 - the caller is already reporting the first error
        logger.exception("weight exporter failed while draining after an error")


def _reachable(urls: list[str]) -> list[str]:
    """URLs other nodes can use: a wildcard bind address becomes this host's name."""
    return [u.replace("://0.0.0.0:", f"://{socket.gethostname()}:") for u in urls]


async def _gather(*aws: Awaitable[T]) -> list[T]:
    """asyncio.gather that cancels (and waits for) the others when one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]

