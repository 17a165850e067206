"""Rollouts from SGLang servers: SGLang's native API (REFERENCE.md §4) on the shared server engine.

    engine = SGLangEngine(SGLangConfig(model_path=..., num_servers=2), exporter=iter_hf_tensors)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))  # grouped per prompt
    engine.update_weights(model_chunks, version=step)                             # after each optimizer step

What SGLang adds to server/engine.py: its command lines and optional sglang-router (sglang/launch.py), what each
server is (`/server_info`: release and flags, sglang/server_info.py; the protocol follows the release), the
`/generate` bodies (sglang/protocol.py), `/abort_request`, and weight sync by NCCL broadcast or safetensors files
around `/pause_generation` ... `/flush_cache` ... `/continue_generation` (sglang/weight_sync.py); colocated
servers release and resume their GPU memory. Partial rollouts (`sglang.partial_rollouts`, servers >= 0.5.23, no
R3 from the servers): the pause retracts the running requests instead of aborting them, and they continue under
the new weights with per-token versions (`supports_partial_rollouts`, `_continues_in_flight`). Read in SGLang's
source and checked by the conformance harness; not run against a real SGLang server (GPU only).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from collections.abc import Awaitable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from megatron_gspo.rollout.server import nccl_versions
from megatron_gspo.rollout.server.buckets import NamedTensor, iter_buckets
from megatron_gspo.rollout.server.concurrency import gather_or_cancel
from megatron_gspo.rollout.server.engine import Exporter, ServerEngine
from megatron_gspo.rollout.server.errors import (
    RETRYABLE_STATUSES,
    ServerConnectionError,
    ServerHTTPError,
    StaleWeightsError,
)
from megatron_gspo.rollout.server.errors import GenerateError as SGLangGenerateError
from megatron_gspo.rollout.server.errors import ServerError as SGLangError
from megatron_gspo.rollout.server.factory import make_server_engine
from megatron_gspo.rollout.server.transport import transport_root
from megatron_gspo.rollout.sglang.config import SGLangConfig
from megatron_gspo.rollout.sglang.launch import router_command, router_url, server_command
from megatron_gspo.rollout.sglang.protocol import (
    KIND,
    build_generate_payload,
    decode_generate_response,
)
from megatron_gspo.rollout.sglang.server_info import ServerInfo, check_server
from megatron_gspo.rollout.sglang.versions import PER_TOKEN_VERSIONS_FROM
from megatron_gspo.rollout.sglang.weight_sync import (
    GroupFactory,
    UpdateGroup,
    init_update_group,
    join_update_group,
    push_disk,
    push_distributed,
)
from megatron_gspo.rollout.types import Rollout, SamplingParams

__all__ = ["SGLangEngine", "SGLangError", "SGLangGenerateError", "StaleWeightsError", "make_sglang_engine"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SGLangEngine(ServerEngine):
    """RolloutEngine backed by SGLang servers (launched here or attached to)."""

    kind = KIND
    health_path = "/health_generate"
    generate_path = "/generate"

    def __init__(
        self,
        config: SGLangConfig,
        exporter: Exporter | None = None,
        *,
        group_factory: GroupFactory = join_update_group,
        resumed: bool = False,
        **kwargs: Any,
    ):
        """See ServerEngine; `group_factory` joins the distributed weight-update group (replaced in tests);
        `resumed`: the run continues one whose trainer may have been killed (the trainer's --resume): attaching
        undoes what it left on the servers (`_undo_dead_trainer`)."""
        self._group_factory = group_factory
        self._resumed = resumed
        self._group: UpdateGroup | None = None
        self._disk_path: Path | None = None
        self._routing = config.routing
        self._seed_warned = False
        self.server_info: dict[str, ServerInfo] = {}
        """URL -> what that server is (read by the leader at start; empty on followers)."""
        super().__init__(config, exporter, **kwargs)

    @classmethod
    def follower_config(
        cls, cfg: SGLangConfig, server_urls: list[str], generate_urls: list[str]
    ) -> SGLangConfig:
        router = generate_urls[0] if generate_urls != server_urls else None
        return dataclasses.replace(cfg, mode="attach", urls=server_urls, router=False, router_url=router)

    # ---------------------------------------------------------------------------------------------- lifecycle

    def server_command(self, index: int) -> list[str]:
        return server_command(self.config, index)

    def _launch_ports(self) -> list[tuple[str, int]]:
        ports = super()._launch_ports()
        return ports + ([("sglang-router", self.config.router_port)] if self.config.router else [])

    def _launch(self) -> None:
        super()._launch()
        cfg = self.config
        if cfg.router:
            url = router_url(cfg)
            self._process_of[url] = self._start_process(
                "sglang-router",
                router_command(cfg, self.server_urls),
                dict(cfg.server_env),
                "sglang_router.log",
            )
            self._run(self._healthy(url, "/health"))
            self.generate_urls = [url]
        self._run(self._read_server_info())

    def _attach(self) -> None:
        if self.leader and self._resumed:
            self._run(gather_or_cancel(*(self._undo_dead_trainer(url) for url in self.config.urls)))
        super()._attach()
        cfg = self.config
        if cfg.router_url:
            self.generate_urls = [cfg.router_url]
            if self.leader:
                self._run(self._healthy(cfg.router_url, "/health"))
        if self.leader:
            self._run(self._read_server_info())

    async def _undo_dead_trainer(self, url: str) -> None:
        """A resumed run (`resumed`) undoes what its trainer, killed with kill -9 (no close), left on an attached
        server, before the health check. Only a resume: the servers cannot tell a dead trainer's state from a live
        one's, and undoing a live run's sync (another run, or a requeued job whose predecessor still lives) would
        resume its retracted requests on half-loaded weights; a fresh run meets a held group as a one-line error
        at its first sync (`_held_group`).

        Read in SGLang 0.5.23's source: the server keeps the group by name (model_runner_components/
        weight_updater.py:130-139), and a second init of that name fails after the rendezvous (torch's
        `_new_process_group_helper`: "The specified group name has already been created") with 400; a session
        left open refuses /begin_weight_update (scheduler_components/weight_updater.py:311-316); a pause left on
        holds every generation, so /health_generate answers 503 (tokenizer_manager.py:938-939, http_server.py:
        779-799) until startup_timeout_s. So, in distributed mode only: destroy our group name (400 "does not
        exist" when there is none; the destroy asserts dp_size == 1, tokenizer_control_mixin.py:464, a 500 on a
        DP server that has no group to destroy with disk / shm sync). Then `GET /ready`, 503 exactly when paused or
        unhealthy (http_server.py:714-718, tokenizer_manager.py:732-734): only then end the session (400 when none;
        404 before 0.5.21) and continue. Our sessions open only while paused (`_push`), and on an unpaused server
        /end_weight_update takes the model-update writer lock (tokenizer_control_mixin.py:471-483), which waits
        for every running generation (each holds the reader lock throughout, tokenizer_manager.py:941) while
        blocking every new one (utils/aio_rwlock.py:45-47, 59-70): every client would stall. A release without
        /ready (404, e.g. 0.5.9) gets /continue_generation only, which takes no lock (tokenizer_manager.py:
        2282-2286). A server that does not answer is stuck in a broadcast from the dead trainer (an update holds
        the pause lock while its scheduler waits, tokenizer_control_mixin.py:516-520); only NCCL's watchdog ends
        that (SGLang gives the group torch's 30-min default timeout, utils/common.py:2894-2895), so the run stops
        with one line instead."""
        cfg = self.config
        await self._healthy(url, "/model_info")  # the HTTP side only: answers while paused or stuck
        if cfg.weight_sync == "distributed":
            group = {"group_name": cfg.group_name}
            await self._undo(url, "/destroy_weights_update_group", group, "does not exist")
        ready = self._client.request_once(url, "/ready", method="GET", timeout_s=cfg.recover_timeout_s)
        status, _ = await self._recover_step(url, "/ready", ready)
        if status == 404:
            await self._undo(url, "/continue_generation", {}, None)
        elif status == 503:
            await self._undo(url, "/end_weight_update", {}, "no weight-update session is open")
            await self._undo(url, "/continue_generation", {}, None)

    async def _undo(self, url: str, path: str, payload: dict, none_left: str | None) -> None:
        """One step of `_undo_dead_trainer`; 404 (a release without the endpoint) or 400 naming `none_left`:
        nothing of that kind was left."""
        cfg = self.config
        call = self._client.call(url, path, payload, timeout_s=cfg.recover_timeout_s, retries=0)
        try:
            await self._recover_step(url, path, call)
        except ServerHTTPError as e:
            if e.status == 404 or (none_left is not None and e.status == 400 and none_left in e.body):
                return
            raise
        if path != "/continue_generation":
            logger.warning("SGLang server %s: %s undid what a trainer that died left", url, path)

    async def _recover_step(self, url: str, path: str, call: Awaitable[T]) -> T:
        """`call` (made with timeout_s=recover_timeout_s); no answer in time is one line saying to restart."""
        try:
            return await call
        except ServerConnectionError as e:
            if not e.timed_out:
                raise
            raise SGLangError(
                f"SGLang server {url} did not answer {path} within sglang.recover_timeout_s="
                f"{self.config.recover_timeout_s:g} s: it is stuck in a weight update from a trainer that died "
                "mid-sync (kill -9); restart the SGLang servers (launch/rollout_servers.sbatch), then resume"
            ) from None

    async def _read_server_info(self) -> None:
        """`GET /server_info` of every server: its release picks the protocol; what it cannot serve is refused."""
        bodies = await asyncio.gather(*(self._client.call(u, "/server_info", method="GET") for u in self.server_urls))
        for url, body in zip(self.server_urls, bodies):
            info = ServerInfo.from_json(url, body)
            check_server(info, self.config)
            self.server_info[url] = info
            protocol = "inside /begin_weight_update ... /end_weight_update" if info.weight_update_session else "direct"
            logger.info(
                "SGLang %s at %s: weight updates %s, deterministic inference %s",
                info.version, url, protocol, "on" if info.deterministic_inference else "off",
            )

    async def _release(self) -> None:
        if self._group is not None:  # attached servers must be able to join a later trainer's group
            await self._drop_group()
        if self.config.weight_sync == "shm" and self._disk_path is not None:  # RAM, not a disk: free it
            shutil.rmtree(self._disk_path.parent, ignore_errors=True)

    # --------------------------------------------------------------------------------------------- generation

    @property
    def supports_partial_rollouts(self) -> bool:  # type: ignore[override]
        """Whether a sync continues the samples in flight (`_continues_in_flight`) and may run while this rank's
        `generate` does (not for a replica of several ranks: its `generate` broadcasts over the model-parallel
        group, which the sync's exporter uses from another thread)."""
        alone = self.replica is None or self.replica.size == 1
        return self._continues_in_flight() and alone

    def _continues_in_flight(self) -> bool:
        """`/pause_generation {mode: retract}` (SGLang's scheduler moves the running requests back to its waiting
        queue with their output so far; `/flush_cache` drops their KV while paused, 0.5.23 `flush_cache`
        `ignore_waiting`, and `/continue_generation` prefills them again under the new weights) when every server
        reports per-token weight versions (versions.py); without R3 from the servers (their capture of a
        retracted request is its last prefill's) and not colocated (memory released between calls)."""
        cfg = self.config
        infos = list(self.server_info.values())
        spans = bool(infos) and all(i.release >= PER_TOKEN_VERSIONS_FROM for i in infos)
        return cfg.partial_rollouts and spans and not cfg.return_routed_experts and not cfg.colocated

    @property
    def seeds_honoured(self) -> bool:
        """Whether the servers use each request's `sampling_seed` (only with --enable-deterministic-inference)."""
        infos = list(self.server_info.values())
        return self.config.deterministic_inference or bool(infos and all(i.deterministic_inference for i in infos))

    def _generate_here(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        limit = self.config.context_length
        if limit is not None:
            for i, prompt in enumerate(prompts):
                if len(prompt) + sampling.max_new_tokens >= limit:
                    raise ValueError(
                        f"prompt {i} has {len(prompt)} tokens + rollout.max_new_tokens={sampling.max_new_tokens} "
                        f"= {len(prompt) + sampling.max_new_tokens}, not below the SGLang servers' context length "
                        f"{limit} (sglang.context_length; SGLang refuses prompt + max_new_tokens >= context length): "
                        "lower rollout.max_new_tokens or shorten the prompts"
                    )
        if sampling.seed is not None and not self.seeds_honoured and not self._seed_warned:
            self._seed_warned = True
            logger.warning(
                "SGLang ignores sampling_seed unless its servers run with --enable-deterministic-inference: these "
                "rollouts are not reproducible from the trainer's seed (sglang.deterministic_inference=true makes "
                "them so, at a speed cost)"
            )
        return super()._generate_here(prompts, sampling)

    def build_request(
        self, prompt: list[int], sampling: SamplingParams, *, rid: str, seed: int | None
    ) -> dict:
        return build_generate_payload(
            prompt,
            sampling,
            rid=rid,
            sampling_seed=seed,
            return_routed_experts=self.config.return_routed_experts,
        )

    def decode_response(self, body: Any, *, url: str, prompt: list[int], prompt_index: int) -> Rollout:
        return decode_generate_response(
            body, url=url, prompt_ids=prompt, prompt_index=prompt_index, routing=self._routing
        )

    def abort_requests(self, requests: dict[str, str]) -> list:
        """`/abort_request` per request id (to every server when a router hid where it went)."""
        calls = []
        for rid, url in requests.items():
            targets = self.server_urls if url not in self.server_urls else [url]
            payload = {"rid": rid, "abort_all": False}
            calls += [
                self._client.request(u, "/abort_request", payload, timeout_s=self.abort_timeout_s, retries=0)
                for u in targets
            ]
        return calls

    # -------------------------------------------------------------------------------------------- weight sync

    async def _push(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        """Pauses generation, sends the tensors (bucketed, in order), flushes the cache, continues."""
        cfg = self.config
        urls = self.server_urls
        mode = "retract" if self._continues_in_flight() else "abort"
        await self._call_all("/pause_generation", {"mode": mode})
        buckets = iter_buckets(named_tensors, cfg.bucket_bytes)
        if cfg.weight_sync in ("disk", "shm"):

            async def post_disk(url: str, path: str, payload: dict) -> Any:
                return await self._client.call(url, path, payload, timeout_s=cfg.weight_sync_timeout_s)

            directory = transport_root(cfg.weight_sync, cfg.weight_sync_dir, self._run_id)
            path = await push_disk(post_disk, urls, buckets, directory=directory, version=version)
            if self._disk_path is not None and self._disk_path != path:
                shutil.rmtree(self._disk_path, ignore_errors=True)
            self._disk_path = path
        else:
            if self._group is None:
                # Both sides' NCCL before anything joins (rollout/server/nccl_versions.py): one line, not a hang.
                await asyncio.to_thread(nccl_versions.preflight, cfg, setting="sglang.weight_sync=distributed",
                                        file_transports="sglang.weight_sync=disk (or shm)")
                try:
                    self._group = await init_update_group(
                        self._post_once,
                        urls,
                        factory=self._group_factory,
                        master_address=cfg.master_address,
                        master_port=cfg.master_port,
                        gpus_per_server=cfg.tp_size,
                        group_name=cfg.group_name,
                        timeout_s=cfg.weight_sync_timeout_s,
                    )
                except ServerHTTPError as e:
                    if e.status == 400 and "already been created" in e.body:
                        raise self._held_group(e.url) from None
                    raise
            sessions = [u for u, info in self.server_info.items() if info.weight_update_session]
            await push_distributed(
                self._post_once,
                urls,
                buckets,
                group=self._group,
                group_name=cfg.group_name,
                version=version,
                session_urls=sessions,
            )
        await asyncio.gather(*(self._flush_cache(u) for u in urls))
        await self._call_all("/continue_generation", {})

    def _held_group(self, url: str) -> SGLangError:
        """A server refused our group name as held (model_runner_components/weight_updater.py:130-139 in 0.5.23):
        another trainer's group, live or killed with kill -9, which only a resumed run may destroy."""
        name = self.config.group_name
        return SGLangError(
            f"SGLang server {url} already holds the weight-update group {name!r} (sglang.group_name) of another "
            "trainer, live or killed with kill -9: restart the SGLang servers (launch/rollout_servers.sbatch), or "
            "run with --resume if that trainer was this run's (the resumed run destroys its group first)"
        )

    async def _after_failed_push(self) -> None:
        if self._group is not None:
            await self._drop_group()

    async def _post_once(self, url: str, path: str, payload: dict) -> Any:
        """Weight-update calls paired with collectives are never retried (the broadcasts would not match)."""
        timeout_s = self.config.weight_sync_timeout_s
        return await self._client.call(url, path, payload, timeout_s=timeout_s, retries=0)

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
        """Colocated mode, called on every trainer rank: once all of them are past their generation (the
        engine's barrier), the leader asks the servers to free GPU memory (tags 'weights', 'kv_cache'; None =
        all) for training. SGLang asserts that a server is idle when the release arrives (its scheduler dies
        otherwise), and any rank's rollouts may still be running until every rank has returned from generate."""
        self._check_open()
        if self._barrier is not None:
            self._barrier()
        if self.leader:
            self._run(self._call_all("/release_memory_occupation", {"tags": tags}))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Colocated mode, called on every trainer rank: the leader has the servers take their GPU memory back
        before the weight sync (which every rank joins, and which ends in the barrier)."""
        self._check_open()
        if self.leader:
            self._run(self._call_all("/resume_memory_occupation", {"tags": tags}))


def make_sglang_engine(runtime: Any, *, exporter: Exporter | None = None) -> SGLangEngine:
    """The engine of a training run with rollout.engine=sglang, on every trainer rank (server/factory.py).

    `runtime` provides `cfg.sglang` (the options of SGLangConfig), `model_config` (fills the routing shape
    when return_routed_experts is set), `dtype` (of the exported weights) and `resume` (the trainer's --resume:
    attaching undoes what the killed trainer of this run left, `SGLangEngine._undo_dead_trainer`).
    """
    cfg = SGLangConfig.from_run_config(runtime.cfg.sglang, runtime.model_config)
    resumed = bool(getattr(runtime, "resume", False))
    engine = make_server_engine(SGLangEngine, cfg, runtime, exporter=exporter, resumed=resumed)
    return engine  # type: ignore[return-value]
