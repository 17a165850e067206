"""The part of a `RolloutEngine` over HTTP servers that SGLang and vLLM share (REFERENCE.md §4, §9).

The trainer never imports the server's package (§6): servers are started from their own environment (launch
mode) or used as they run (attach mode), and spoken to over HTTP. A subclass supplies the protocol: the command
line, the request body and its decoding, aborts, and how weights get into the servers (`_push`).

    engine = VLLMEngine(VLLMConfig(model_path=...), exporter=iter_hf_tensors)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))  # grouped per prompt
    engine.update_weights(model_chunks, version=step)                             # after each optimizer step
    engine.close()

`generate` is synchronous: it waits until the engine's event loop (its own thread) has every sample back. Each of
the n samples of a prompt is its own request (its own seed, derived from `sampling.seed`, the sample's index and
the data-parallel rank; retried on its own) and all of them go to the same server (its prefix cache holds the
prompt). A sample is retried on connection errors, 5xx, malformed JSON, abort, or weights older than the engine's
`weight_version` when it was sent; after `max_retries` the whole call raises: it never returns fewer rollouts than
asked for.

Threads: every method may be called from any thread, and `generate` and `update_weights` concurrently (a producer
thread generating while the trainer thread syncs): both only submit coroutines to the loop thread and wait. What
happens to samples in flight during a sync is the protocol's (`supports_partial_rollouts`: continued under the new
weights, vllm/engine.py; otherwise aborted and retried from scratch, or the caller waits for call boundaries).

With a `ReplicaGroup` (server/replicas.py), only one rank of each model replica (its TP x PP ranks) talks to the
servers; it broadcasts the rollouts to the others, so every rank of a replica trains on the same samples.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from megatron_gspo.rollout.server.buckets import NamedTensor
from megatron_gspo.rollout.server.client import HTTPClient, backoff_delay
from megatron_gspo.rollout.server.concurrency import gather_or_cancel
from megatron_gspo.rollout.server.config import ServerConfig
from megatron_gspo.rollout.server.errors import (
    GenerateError,
    ServerConnectionError,
    ServerError,
    ServerHTTPError,
    StaleWeightsError,
    parse_json_body,
)
from megatron_gspo.rollout.server.process import ManagedProcess, ProcessSupervisor, check_python, port_in_use
from megatron_gspo.rollout.server.replicas import ReplicaGroup
from megatron_gspo.rollout.server.seeds import derive_sampling_seed
from megatron_gspo.rollout.types import Rollout, SamplingParams

logger = logging.getLogger(__name__)

Exporter = Callable[[list], Iterable[NamedTensor] | Mapping[str, Any]]
"""model chunks -> (HF name, full tensor) pairs, streamed (models.hf_state.iter_hf_tensors) or a dict."""

T = TypeVar("T")


class ServerEngine:
    """RolloutEngine backed by HTTP servers (launched here or attached to); see the module docstring."""

    kind: ClassVar[str] = "rollout"
    """Names the engine in messages ('SGLang', 'vLLM')."""
    health_path: ClassVar[str] = "/health"
    """GET path that answers 200 once a server can generate."""
    generate_path: ClassVar[str] = "/generate"
    """POST path of one generation request."""
    abort_timeout_s: ClassVar[float] = 2.0
    supports_partial_rollouts: bool = False
    """Whether `update_weights` may run while `generate` is in flight, continuing its samples under the new
    weights (RolloutEngine); a protocol that does so says True."""

    def __init__(
        self,
        config: ServerConfig,
        exporter: Exporter | None = None,
        *,
        initial_version: int = 0,
        leader: bool = True,
        barrier: Callable[..., bool] | None = None,
        replica: ReplicaGroup | None = None,
    ):
        """Starts (launch mode) or checks (attach mode) the servers and waits until all are healthy.

        `exporter` turns the trainer's model chunks into named HF tensors for `update_weights`;
        `initial_version` is the version of the weights the servers hold at start (e.g. a resumed step).
        A follower (`leader=False`, attach mode: the leader's URLs) only generates; its `update_weights` runs the
        exporter for its collectives. `barrier(ok) -> whether every rank was ok` (all trainer ranks; `ok`
        defaults to True) ends every `update_weights`: a follower takes the new version only once the leader's
        push succeeded (`all_ranks_ok`, server/factory.py). `replica`: this rank's model replica, whose one
        source rank generates for all (None: this rank generates for itself).
        """
        if not leader and config.mode != "attach":
            raise ValueError(
                f"a follower {type(self).__name__} attaches to the leader's servers ({config.section}.mode=attach)"
            )
        self.config = config
        self.leader = leader
        self.replica = replica
        self._barrier = barrier
        self.weight_version = int(initial_version)
        self._exporter = exporter
        self._failed_version: int | None = None
        """Version of the last weight sync that failed (generation is refused until one succeeds)."""
        self._pushing: int | None = None
        """Version of the weight sync in progress (servers may already report it)."""
        self._update_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name=f"{self.kind}-engine-loop", daemon=True
        )
        self._loop_thread.start()
        self._client = HTTPClient(
            timeout_s=config.request_timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            max_connections=config.max_concurrency,
            kind=self.kind,
        )
        self._supervisor: ProcessSupervisor | None = None
        self._process_of: dict[str, ManagedProcess] = {}
        self._inflight: dict[str, str] = {}
        self._limit: asyncio.Semaphore | None = None
        """Bounds the generation requests of every call together to max_concurrency (created on the loop)."""
        self._run_id = uuid.uuid4().hex[:8]
        self._call_ids = itertools.count(1)
        self._closed = False
        self.server_urls: list[str] = []
        """Every server (weight sync and health go to each)."""
        self.generate_urls: list[str] = []
        """Where generation requests go: a router when there is one, else the servers."""
        try:
            if config.mode == "launch":
                self._launch()
            else:
                self._attach()
        except BaseException:
            self.close()
            raise

    @classmethod
    def follower_config(
        cls, cfg: ServerConfig, server_urls: list[str], generate_urls: list[str]
    ) -> ServerConfig:
        """The attach-mode config of a non-leader rank, from the URLs the leader shares."""
        import dataclasses

        return dataclasses.replace(cfg, mode="attach", urls=server_urls)

    # ---------------------------------------------------------------------------------------------- lifecycle

    def server_command(self, index: int) -> list[str]:
        """Command line of launched server `index` (the protocol's subclass)."""
        raise NotImplementedError

    def server_env(self, index: int) -> dict[str, str]:
        """Environment of launched server `index` on top of the trainer's (default: `server_env`)."""
        return dict(self.config.server_env)

    def _launch_ports(self) -> list[tuple[str, int]]:
        """(what, port) of every process this engine will start."""
        return [
            (f"{self.kind} server {i}", self.config.server_port(i)) for i in range(self.config.num_servers)
        ]

    def _launch(self) -> None:
        cfg = self.config
        check_python(cfg)
        for what, port in self._launch_ports():
            if port_in_use(cfg.host, port):
                raise RuntimeError(
                    f"port {port} for {what} is already in use (a server left from an earlier run?); "
                    f"stop it or choose another {cfg.section}.port_base"
                )
        self._supervisor = ProcessSupervisor(cfg.stop_grace_s)
        for i in range(cfg.num_servers):
            url = cfg.server_url(i)
            self._process_of[url] = self._start_process(
                f"{self.kind} server {i}",
                self.server_command(i),
                self.server_env(i),
                f"{self.kind.lower()}_server_{i}.log",
            )
            self.server_urls.append(url)
        self._run(gather_or_cancel(*(self._healthy(url, self.health_path) for url in self.server_urls)))
        self.generate_urls = list(self.server_urls)

    def _start_process(
        self, name: str, command: list[str], env: dict[str, str], log_name: str
    ) -> ManagedProcess:
        assert self._supervisor is not None
        log_dir = Path(self.config.log_dir) if self.config.log_dir else None
        return self._supervisor.start(
            name, command, env=env, log_path=log_dir / log_name if log_dir else None
        )

    def _attach(self) -> None:
        self.server_urls = list(self.config.urls)
        self.generate_urls = list(self.config.urls)
        if self.leader:  # followers use the servers the leader checked
            self._run(gather_or_cancel(*(self._healthy(url, self.health_path) for url in self.server_urls)))

    async def _healthy(self, url: str, path: str) -> None:
        proc = self._process_of.get(url)
        await self._client.wait_until_healthy(
            url,
            path=path,
            timeout_s=self.config.startup_timeout_s,
            poll_s=min(0.5, max(0.01, self.config.backoff_s)),
            check_alive=proc.exit_message if proc else None,
        )

    async def _release(self) -> None:
        """Protocol-specific clean-up at close (e.g. leaving a weight-update group); default: nothing."""

    def close(self) -> None:
        """Aborts running requests, releases protocol state, stops the servers started here (idempotent).

        A `generate` still waiting in another thread ends with an error (its samples are cancelled)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop_thread.is_alive() and threading.current_thread() is not self._loop_thread:
                try:
                    self._run(self._shut_down(), closing=True)
                finally:
                    self._loop.call_soon_threadsafe(self._loop.stop)
                    self._loop_thread.join(timeout=30)
        finally:
            if self._supervisor is not None:
                self._supervisor.close()
            if not self._loop.is_running():
                self._loop.close()

    async def _shut_down(self) -> None:
        """Cancels whatever other threads still wait for, aborts its requests, then releases protocol state."""
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._inflight:
            await self._abort_inflight()
        await self._release()
        await self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _run(self, coro: Coroutine[Any, Any, T], *, closing: bool = False) -> T:
        """Runs `coro` on the engine's loop thread and waits for it (several threads may wait at once); on an
        interrupt of the waiting thread (e.g. Ctrl-C) the coroutine is cancelled, waited for, then re-raised.
        Once `close` began (other than its own shut-down, `closing`), it fails with the closed error."""
        closed = RuntimeError(f"{type(self).__name__} is closed")
        if threading.current_thread() is self._loop_thread:
            coro.close()
            raise RuntimeError(f"{type(self).__name__} methods are synchronous and not re-entrant")
        if not self._loop_thread.is_alive():
            coro.close()
            raise closed
        started: concurrent.futures.Future[asyncio.Task] = concurrent.futures.Future()
        finished = threading.Event()

        def start() -> None:
            if self._closed and not closing:  # queued after close's shut-down, which cancels what it finds
                coro.close()
                started.set_exception(closed)
                return
            task = self._loop.create_task(coro)
            task.add_done_callback(lambda _: finished.set())
            started.set_result(task)

        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # close() ended the loop since the check above
            coro.close()
            raise closed from None
        while True:
            try:
                task = started.result(timeout=1.0)
                break
            except concurrent.futures.TimeoutError:
                if not self._loop_thread.is_alive():  # the loop stopped before running `start`
                    coro.close()
                    raise closed from None
        try:
            finished.wait()
        except BaseException:
            self._loop.call_soon_threadsafe(task.cancel)
            finished.wait()
            raise
        if task.cancelled() and self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed while this call waited for it")
        return task.result()

    # --------------------------------------------------------------------------------------------- generation

    def build_request(
        self, prompt: list[int], sampling: SamplingParams, *, rid: str, seed: int | None
    ) -> dict[str, Any]:
        """JSON body of one request: one sample of one prompt (the protocol's subclass)."""
        raise NotImplementedError

    def decode_response(self, body: Any, *, url: str, prompt: list[int], prompt_index: int) -> Rollout:
        """One response body -> Rollout (the protocol's subclass); raises ServerResponseError on bad shapes."""
        raise NotImplementedError

    def abort_requests(self, requests: dict[str, str]) -> list[Coroutine[Any, Any, Any]]:
        """Calls that abort these requests (request id -> URL it went to) on the servers (the subclass)."""
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` rollouts per prompt, grouped contiguously in prompt order (`prompt_index` set)."""
        self._check_open()
        for i, prompt in enumerate(prompts):
            if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
                raise ValueError(f"prompt {i} must be a non-empty list of token ids (ints >= 0)")
        if self.replica is not None:
            return self.replica.share(lambda: self._generate_here(prompts, sampling))
        return self._generate_here(prompts, sampling)

    def _check_weights(self) -> None:
        if self._failed_version is not None:
            raise ServerError(
                f"the weight sync to version {self._failed_version} failed, so the {self.kind} servers hold "
                "unknown weights; call update_weights again before generating"
            )

    def _generate_here(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        self._check_weights()
        if not prompts:
            return []
        call = next(self._call_ids)
        try:
            return self._run(self._generate(prompts, sampling, call))
        except BaseException:
            if not self._closed:
                self._run(self._abort_call(call))
            raise

    async def _generate(self, prompts: list[list[int]], sampling: SamplingParams, call: int) -> list[Rollout]:
        # One limit shared by all calls in flight (async producer): a limit per call would let N calls send
        # N x max_concurrency requests, whose excess waits for a pooled connection with its timeout running
        # and takes the connections the client keeps free for control calls. Made on the loop that awaits it.
        if self._limit is None:
            self._limit = asyncio.Semaphore(self.config.max_concurrency)
        limit = self._limit
        rollouts = await gather_or_cancel(
            *(
                self._sample(limit, call, p, s, prompt, sampling)
                for p, prompt in enumerate(prompts)
                for s in range(sampling.n)
            )
        )
        await self._after_generate(rollouts)
        return rollouts

    def _request_id(self, call: int, p: int, s: int, attempt: int) -> str:
        return f"{self._run_id}-{call}-{p}-{s}-{attempt}"

    async def _abort_call(self, call: int) -> None:
        """Aborts the requests of one `generate` call still running on the servers (another thread's stay)."""
        prefix = f"{self._run_id}-{call}-"
        mine = {rid: url for rid, url in self._inflight.items() if rid.startswith(prefix)}
        for rid in mine:
            self._inflight.pop(rid, None)
        if mine:
            await self._abort(mine)

    async def _after_generate(self, rollouts: list[Rollout]) -> None:
        """Protocol step once every sample is back (e.g. fetching recorded routes); default: nothing."""

    def _live_urls(self) -> list[str]:
        procs = self._process_of
        live = [u for u in self.generate_urls if u not in procs or procs[u].popen.poll() is None]
        if not live:
            deaths = "; ".join(filter(None, (self._process_of[u].exit_message() for u in self.generate_urls)))
            raise GenerateError(f"every {self.kind} server has exited: {deaths}")
        return live

    def _pick_url(self, prompt_index: int, attempt: int, excluded: set[str]) -> str:
        live = self._live_urls()
        usable = [u for u in live if u not in excluded] or live
        return usable[(prompt_index + attempt) % len(usable)]

    def sample_seed(self, sampling: SamplingParams, index: int) -> int | None:
        """Seed of request `index` of this call: the call's seed, the index and this replica's DP rank mixed."""
        if sampling.seed is None:
            return None
        stream = self.replica.dp_rank if self.replica is not None else 0
        return derive_sampling_seed(sampling.seed, index, stream=stream)

    async def _sample(
        self, limit: asyncio.Semaphore, call: int, p: int, s: int, prompt: list[int], sampling: SamplingParams
    ) -> Rollout:
        """One rollout of prompt `p` (sample `s`), retried up to max_retries times.

        Its tokens must come from weights at least as new as the engine's when the request was sent (older: a
        server missed an update, retried), and at most the version being synced (newer: another trainer)."""
        cfg = self.config
        seed = self.sample_seed(sampling, p * sampling.n + s)
        excluded: set[str] = set()
        last_error: object = None
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                delay = backoff_delay(cfg.backoff_s, attempt - 1)
                logger.warning("prompt %d sample %d: %s; retry %d in %.2fs", p, s, last_error, attempt, delay)
                await asyncio.sleep(delay)
            self._check_weights()
            url = self._pick_url(p, attempt, excluded)
            rid = self._request_id(call, p, s, attempt)
            payload = self.build_request(prompt, sampling, rid=rid, seed=seed)
            try:
                async with limit:
                    floor = self.weight_version
                    body = await self._post_generate(url, rid, payload)
                rollout = self.decode_response(body, url=url, prompt=prompt, prompt_index=p)
            except ServerError as e:
                if not e.retryable:
                    raise GenerateError(f"prompt {p} sample {s}: {e}") from e
                if isinstance(e, ServerConnectionError):
                    excluded.add(url)  # try another server next (all of them again once each failed)
                last_error = e
                continue
            if rollout.finish_reason == "abort":
                last_error = f"server {url} aborted the request: {rollout.extra.get('abort_reason')}"
                continue
            if rollout.weight_version < floor:
                last_error = StaleWeightsError(
                    f"server {url} sampled with weight_version {rollout.weight_version}, "
                    f"but the engine is at {floor}"
                )
                continue
            newest = max(rollout.versions, default=rollout.weight_version)
            if newest > max(self.weight_version, self._pushing if self._pushing is not None else -1):
                raise GenerateError(
                    f"server {url} reports weight_version {newest}, newer than this engine's "
                    f"{self.weight_version}: is another trainer updating it?"
                )
            rollout.extra.pop("abort_reason", None)
            rollout.extra.update(rid=rid, attempts=attempt + 1, sampling_seed=seed)
            return rollout
        error = StaleWeightsError if isinstance(last_error, StaleWeightsError) else GenerateError
        raise error(
            f"prompt {p} sample {s}: no rollout after {cfg.max_retries + 1} attempt(s) "
            f"({cfg.section}.max_retries={cfg.max_retries}); last error: {last_error}"
        )

    async def _post_generate(self, url: str, rid: str, payload: dict) -> Any:
        path = self.generate_path
        self._inflight[rid] = url  # kept on cancellation, so that close()/errors abort it on the server
        try:
            status, raw = await self._client.request_once(url, path, payload)
        except ServerConnectionError as e:
            self._inflight.pop(rid, None)
            if e.timed_out:  # the server may still be generating it
                await self._abort({rid: url})
            raise
        self._inflight.pop(rid, None)
        if not 200 <= status < 300:
            raise ServerHTTPError(url, path, status, raw.decode("utf-8", "replace"), kind=self.kind)
        return parse_json_body(raw, url, path, kind=self.kind)

    async def _abort_inflight(self) -> None:
        inflight, self._inflight = dict(self._inflight), {}
        await self._abort(inflight)

    async def _abort(self, requests: dict[str, str]) -> None:
        """Best-effort abort of each request id on the server it went to."""
        results = await asyncio.gather(*self.abort_requests(requests), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("could not abort %d request(s): %s", len(failed), failed[0])

    # -------------------------------------------------------------------------------------------- weight sync

    def update_weights(self, model_chunks: list, version: int) -> None:
        """Exports the model chunks with the exporter and pushes them to every server as `version` (one sync at
        a time; a `generate` may be in flight in another thread, module docstring)."""
        self._check_open()
        if self._exporter is None:
            raise RuntimeError(
                f"{type(self).__name__} has no exporter; build it with exporter=iter_hf_tensors"
            )
        with self._update_lock:
            self._check_version(version)  # before the exporter starts its collectives on every rank
            named_tensors = self._exporter(model_chunks)
            if self.leader:
                ok = False
                try:
                    try:
                        self._push_weights(named_tensors, version)
                    except Exception:
                        drain(named_tensors)  # keep the other ranks' collectives matched before the barrier
                        raise
                    ok = True
                finally:
                    if self._barrier is not None:
                        self._barrier(ok)
                return
            self._follow_push(named_tensors, version)

    def _follow_push(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        """A follower's side of a weight sync: the exporter run for its collectives, then the barrier, which ends
        after the leader's push. Only then is `version` this engine's: a follower whose exporter ends first (a
        pure data-parallel rank exports nothing) would otherwise count its samples sent meanwhile against weights
        the servers do not hold yet (retried as stale), and its partial rollouts continuing under `version`
        before the push ended are allowed by `_pushing`, as on the leader."""
        self._pushing = version
        try:
            ok = False
            try:
                for _ in named_tensors:  # the exporter's collectives need every rank
                    pass
                ok = True
            finally:
                agreed = self._barrier(ok) if self._barrier is not None else ok
            if not agreed:
                raise ServerError(
                    f"the weight sync to version {version} failed on another rank (its error says why); "
                    f"the {self.kind} servers hold unknown weights"
                )
            self.weight_version = version  # before `_pushing` is cleared, as in `_push_weights`
            self._failed_version = None
        except BaseException:
            self._failed_version = version  # generation refused until a sync succeeds, as on the leader
            raise
        finally:
            self._pushing = None

    def _check_version(self, version: int) -> None:
        if not isinstance(version, int) or version < self.weight_version:
            raise ValueError(f"weight version {version!r} must be an int >= current {self.weight_version}")

    def push_weights(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        """Sends the tensors to every server as `version` (`_push`, the protocol); then `weight_version =
        version`. On failure generation is refused until a sync succeeds."""
        with self._update_lock:
            self._push_weights(named_tensors, version)

    def _push_weights(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        self._check_open()
        if not self.leader:
            raise RuntimeError(f"only the leader {type(self).__name__} (global rank 0) pushes weights")
        self._check_version(version)
        self._pushing = version
        try:
            self._run(self._push(named_tensors, version))
            # Before `_pushing` is cleared: a sample finishing in between must not see a version newer than both.
            self.weight_version = version
            self._failed_version = None
        except BaseException:
            self._failed_version = version
            if not self._closed:
                self._run(self._after_failed_push_all())
            raise
        finally:
            self._pushing = None

    async def _push(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        """The protocol's weight update of every server (the subclass)."""
        raise NotImplementedError

    async def _after_failed_push_all(self) -> None:
        # Requests still running (or held by a paused server) would never finish on unknown weights: abort them,
        # so that a `generate` in another thread fails now (its retries see the failed sync) instead of at its
        # request timeout.
        await self._abort_inflight()
        await self._after_failed_push()

    async def _after_failed_push(self) -> None:
        """Protocol clean-up after a failed `_push` (e.g. drop a half-used NCCL group); default: nothing."""

    async def _call_all(self, path: str, payload: Any = None, **kwargs: Any) -> list[Any]:
        """The same call to every server, concurrently (retried as the client retries)."""
        return await gather_or_cancel(
            *(self._client.call(u, path, payload, **kwargs) for u in self.server_urls)
        )


def drain(items: Iterable[Any]) -> None:
    """Runs an (exporter) iterable to its end, ignoring what it yields."""
    try:
        for _ in items:
            pass
    except Exception:  # noqa: BLE001 - the caller is already reporting the first error
        logger.exception("weight exporter failed while draining after an error")
