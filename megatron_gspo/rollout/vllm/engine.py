"""Rollouts from vLLM servers: vLLM's token API and RL endpoints (REFERENCE.md §9) on the shared server engine.

    engine = VLLMEngine(VLLMConfig(model_path=HF_DIR), exporter=iter_hf_tensors)
    rollouts = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))  # grouped per prompt
    engine.update_weights(model_chunks, version=step)                             # after each optimizer step

What vLLM adds to server/engine.py: its command line (vllm/launch.py), `/inference/v1/generate` bodies
(vllm/protocol.py: token ids, the sampled tokens' log-probs, per-token weight versions, routed experts), and a
weight update between `/pause` and `/resume`:

    /pause?mode=keep&clear_cache=false -> /start_weight_update -> /update_weights {update_info}
    -> /finish_weight_update {weight_version} -> /reset_prefix_cache?reset_running_requests=true -> /resume
    -> GET /weight_info == version on every server

Partial rollouts (`vllm.partial_rollouts`, the default), from vLLM 0.32's source: `/pause?mode=keep` freezes the
scheduler (`PauseState.PAUSED_ALL`: no step runs, requests stay queued; v1/engine/core.py `pause_scheduler`) after
the step in progress, so no token is lost or sampled twice. After the update, `/reset_prefix_cache` with
`reset_running_requests=true` preempts every running request (v1/core/sched/scheduler.py `reset_prefix_cache` ->
`_preempt_request`: KV blocks freed, `num_computed_tokens = 0`), so that on `/resume` each one is prefilled again,
prompt + the tokens it has so far, under the new weights, and continues decoding as the same request (its seeded
generator and sampling settings kept). KV computed with the old weights is never reused (it was 0.32 off, §9):
the tokens sampled after the update have the new weights' log-probs of the whole sequence. The engine core labels
each step's output with the weight version it ran under (`_attach_weight_version`); the response's spans give every
token's version (`Rollout.token_versions`). With capture_routes the gate hooks keep the routes of each position's
first forward, the one that sampled the next token (vllm/worker.py), not the recomputed prefix's: versioned R3.
`vllm.partial_rollouts=false` (or vLLM's own return_routed_experts, whose capture a preemption resets to the last
prefill's routes) pauses with `mode=abort` instead: samples in flight come back aborted and are sampled again.

`update_info` depends on `vllm.weight_transport`: 'shm' / 'disk' write the version as a safetensors directory
(server/transport.py) that megatron-gspo's vLLM plugin (vllm/plugin.py, vllm/worker.py) loads; 'nccl' uses
vLLM's own NCCL engine (vllm/nccl.py is the trainer's end). The trainer never imports vllm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.rollout.server import nccl_versions
from megatron_gspo.rollout.server.buckets import NamedTensor, dtype_name, iter_buckets, with_last
from megatron_gspo.rollout.server.concurrency import all_or_first_error, gather_or_cancel, in_daemon_thread
from megatron_gspo.rollout.server.engine import Exporter, ServerEngine, drain
from megatron_gspo.rollout.server.errors import RETRYABLE_STATUSES, ServerHTTPError, ServerResponseError
from megatron_gspo.rollout.server.factory import default_exporter, make_server_engine
from megatron_gspo.rollout.server.transport import SHM_ROOT, remove_dir, transport_root, write_checkpoint_dir
from megatron_gspo.rollout.types import Rollout, SamplingParams
from megatron_gspo.rollout.vllm.config import VLLMConfig
from megatron_gspo.rollout.vllm.launch import server_command, server_env
from megatron_gspo.rollout.vllm.nccl import NcclWeightSender
from megatron_gspo.rollout.vllm.protocol import (
    KIND,
    REQUEST_ID_PREFIX,
    build_generate_request,
    decode_generate_response,
    decode_prompt_logprobs,
    decode_routed_experts,
    parse_weight_version,
)

logger = logging.getLogger(__name__)


class VLLMEngine(ServerEngine):
    """RolloutEngine backed by vLLM servers (launched here or attached to)."""

    kind = KIND
    health_path = "/health"
    generate_path = "/inference/v1/generate"

    def __init__(
        self,
        config: VLLMConfig,
        exporter: Exporter | None = None,
        *,
        weight_root: Path | None = None,
        **kwargs: Any,
    ):
        """See ServerEngine. `weight_root`: where the file transports write versions (default: /dev/shm/... for
        shm, `weight_sync_dir` for disk); a shared-memory root is removed at close by the leader. Launch mode with
        `model_path='trainer'` needs `make_vllm_engine` (it exports the trainer's weights to start from)."""
        if config.serves_trainer_weights:
            raise ValueError(
                "vllm.model_path='trainer' is resolved by make_vllm_engine (it exports the trainer's weights); "
                "give VLLMEngine an HF checkpoint directory"
            )
        self._routing = config.routing
        self._root: Path | None = weight_root
        self._version_dir: Path | None = None
        self._sender: NcclWeightSender | None = None
        super().__init__(config, exporter, **kwargs)

    @classmethod
    def follower_config(cls, cfg: VLLMConfig, server_urls: list[str], generate_urls: list[str]) -> VLLMConfig:
        # The leader launched the servers with shm_busy_loop_s; attach mode refuses the launch-only key.
        return dataclasses.replace(cfg, mode="attach", urls=server_urls, shm_busy_loop_s=None)

    # ---------------------------------------------------------------------------------------------- lifecycle

    @property
    def supports_partial_rollouts(self) -> bool:  # type: ignore[override]
        """Whether a sync continues samples in flight (module docstring). Not for a replica of several ranks: its
        `generate` broadcasts over the model-parallel group, which the sync's exporter uses from another thread."""
        alone = self.replica is None or self.replica.size == 1
        return self._continues_in_flight() and alone

    def _continues_in_flight(self) -> bool:
        """Whether a sync pauses with mode=keep (samples continue) rather than mode=abort."""
        return self.config.partial_rollouts and not self.config.return_routed_experts

    def server_command(self, index: int) -> list[str]:
        return server_command(self.config, index)

    def server_env(self, index: int) -> dict[str, str | None]:  # type: ignore[override]
        return server_env(self.config)

    def _launch(self) -> None:
        super()._launch()
        self._enable_capture()

    def _attach(self) -> None:
        super()._attach()
        self._enable_capture()

    def _enable_capture(self) -> None:
        """capture_routes: installs the gate hooks in every server before anything is generated (idempotent)."""
        spec = self.config.capture_spec
        if spec is not None:
            self._run(self._call_all("/collective_rpc", {"method": "gspo_enable_routing", "args": [str(spec.topk)]}))

    async def _release(self) -> None:
        if self._sender is not None:
            await asyncio.gather(
                *(
                    self._client.call(u, "/shutdown_weight_transfer_engine", retries=0)
                    for u in self.server_urls
                ),
                return_exceptions=True,
            )
            self._sender.close()
            self._sender = None
        remove_dir(self._version_dir)
        self._version_dir = None
        if self.leader and self._root is not None and self._root.parent == SHM_ROOT:
            remove_dir(self._root)  # RAM: nothing of a finished run stays in /dev/shm

    # --------------------------------------------------------------------------------------------- generation

    def build_request(
        self, prompt: list[int], sampling: SamplingParams, *, rid: str, seed: int | None
    ) -> dict:
        return build_generate_request(prompt, sampling, rid=rid, seed=seed)

    def decode_response(self, body: Any, *, url: str, prompt: list[int], prompt_index: int) -> Rollout:
        return decode_generate_response(
            body, url=url, prompt_ids=prompt, prompt_index=prompt_index, routing=self._routing
        )

    def abort_requests(self, requests: dict[str, str]) -> list:
        """`/abort_requests {request_ids}` (vLLM's external ids carry the generate endpoint's prefix)."""
        by_url: dict[str, list[str]] = {}
        for rid, url in requests.items():
            by_url.setdefault(url, []).append(REQUEST_ID_PREFIX + rid)
        return [
            self._client.request(
                url, "/abort_requests", {"request_ids": ids}, timeout_s=self.abort_timeout_s, retries=0
            )
            for url, ids in by_url.items()
        ]

    def sequence_logprobs(self, token_ids: list[int], server: int = 0) -> list[float]:
        """Log-probs the server's current weights give tokens 1.. of `token_ids` (each given the ones before;
        temperature 1): the check that a weight sync made the server's policy the trainer's."""
        self._check_open()
        url = self.server_urls[server]
        body = {
            "token_ids": [int(t) for t in token_ids],
            "sampling_params": {
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 0,
                "detokenize": False,
            },
        }
        answer = self._run(self._client.call(url, self.generate_path, body))
        return decode_prompt_logprobs(answer, token_ids, url)

    async def _after_generate(self, rollouts: list[Rollout]) -> None:
        """With capture_routes: every sample's routes from the gate hooks of the server that generated it; the
        routes of this call's other requests (aborted or retried attempts) are dropped there (on a server this call
        did not use they stay, a few rows per retried attempt, until the server restarts)."""
        spec = self.config.capture_spec
        if spec is None or not rollouts:
            return
        by_url: dict[str, list[Rollout]] = {}
        for r in rollouts:
            by_url.setdefault(r.extra["server"], []).append(r)
        # Only this call's leftovers: another thread's `generate` may still be running (partial rollouts), and its
        # requests' routes must stay until it pops them. (rid = run-call-prompt-sample-attempt.)
        run, call = rollouts[0].extra["rid"].split("-")[:2]
        forget = f"{REQUEST_ID_PREFIX}{run}-{call}-"
        for url, group in by_url.items():
            prefixes = [REQUEST_ID_PREFIX + r.extra["rid"] for r in group]
            request = json.dumps({"want": prefixes, "forget": forget})
            body = {"method": "gspo_pop_routes", "args": [request]}
            answer = await self._client.call(url, "/collective_rpc", body)
            routes = (answer or {}).get("results", [None])[0] or {}
            for prefix, r in zip(prefixes, group):
                rows = len(r.prompt_ids) + len(r.response_ids) - 1
                r.routed_experts = decode_routed_experts(
                    routes.get(prefix), rows, spec, url, where=f"captured routes of {prefix}"
                )

    # -------------------------------------------------------------------------------------------- weight sync

    def weight_versions(self) -> list[int]:
        """GET /weight_info of every server, as versions (0 = never updated)."""
        self._check_open()
        return self._run(self._weight_versions())

    async def _weight_versions(self) -> list[int]:
        answers = await self._call_all("/weight_info", method="GET")
        versions = []
        for url, answer in zip(self.server_urls, answers):
            if not isinstance(answer, dict) or "weight_version" not in answer:
                raise ServerResponseError(url, f"/weight_info answered {answer!r}", kind=self.kind)
            versions.append(parse_weight_version(answer["weight_version"], url))
        return versions

    def weight_root(self) -> Path:
        """Where the file transports write versions (created on first use)."""
        if self._root is None:
            cfg = self.config
            self._root = transport_root(cfg.weight_transport, cfg.weight_sync_dir, self._run_id)
        return self._root

    async def _push(self, named_tensors: Iterable[NamedTensor] | Mapping[str, Any], version: int) -> None:
        cfg = self.config
        wait = {"timeout_s": cfg.weight_sync_timeout_s}
        buckets = iter_buckets(named_tensors, cfg.bucket_bytes)
        previous = self._version_dir
        if cfg.weight_transport != "nccl":
            # Written before pausing (the exporter's collectives run here, on the caller's thread): a failure
            # leaves the servers untouched and generating.
            target = self.weight_root() / f"weights-v{version}"
            write_checkpoint_dir(buckets, target)
            self._version_dir = target
        keep = self._continues_in_flight()
        pause = "/pause?mode=keep&clear_cache=false" if keep else "/pause?mode=abort&clear_cache=true"
        await self._call_all(pause)
        await gather_or_cancel(*(self._start_weight_update(url) for url in self.server_urls))
        if cfg.weight_transport == "nccl":
            await self._push_nccl(buckets)
        else:
            await self._call_all("/update_weights", {"update_info": {"path": str(self._version_dir)}}, **wait)
        await self._call_all("/finish_weight_update", {"weight_version": str(version)}, **wait)
        # Kept requests are preempted here: on /resume they recompute their KV under the new weights.
        answers = await self._call_all("/reset_prefix_cache?reset_running_requests=true")
        for url, answer in zip(self.server_urls, answers):
            if isinstance(answer, dict) and answer.get("success") is False:
                problem = "/reset_prefix_cache failed: KV of the old weights could be reused"
                raise ServerResponseError(url, problem, kind=self.kind)
        await self._call_all("/resume")
        versions = await self._weight_versions()
        if any(v != version for v in versions):
            raise ServerResponseError(
                self.server_urls[versions.index(next(v for v in versions if v != version))],
                f"reports weight_version {versions} after the update to {version}",
                kind=self.kind,
            )
        if previous is not None and previous != self._version_dir:
            remove_dir(previous)

    async def _start_weight_update(self, url: str) -> None:
        """/start_weight_update on one server. A trainer killed between /start_weight_update and
        /finish_weight_update (kill -9, preemption) leaves an attached server inside that update, and vLLM refuses a
        new one ('already active'; gpu_worker.py `_start_weight_update`): the resumed run's first sync would fail.
        That update is finished first (its version label is not set); whatever it loaded is overwritten by this
        push, which sends every tensor, before the servers resume."""
        wait = {"timeout_s": self.config.weight_sync_timeout_s}
        try:
            # vLLM answers a worker's refusal with 500: not retried (the other transient statuses are)
            await self._client.call(url, "/start_weight_update", retry_statuses=RETRYABLE_STATUSES - {500}, **wait)
            return
        except ServerHTTPError as e:
            if "already active" not in e.body:
                raise
        logger.warning("%s was left inside a weight update (a trainer killed mid-sync?): finishing it first", url)
        await self._client.call(url, "/finish_weight_update", {}, **wait)
        await self._client.call(url, "/start_weight_update", **wait)

    async def _push_nccl(self, buckets: Iterable[list[NamedTensor]]) -> None:
        """vLLM's NCCL engine: per bucket one /update_weights while the tensors are broadcast from rank 0."""
        cfg = self.config
        if self._sender is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
            # Both sides' NCCL before anything joins (rollout/server/nccl_versions.py): one line, not a hang.
            await asyncio.to_thread(nccl_versions.preflight, cfg, setting="vllm.weight_transport=nccl",
                                    file_transports="vllm.weight_transport=shm (or disk)")
            sender = NcclWeightSender(1 + cfg.tp_size * len(self.server_urls), device)
            inits = [
                asyncio.ensure_future(
                    self._client.call(
                        url,
                        "/init_weight_transfer_engine",
                        sender.init_info(1 + i * cfg.tp_size),
                        timeout_s=cfg.weight_sync_timeout_s,
                        retries=0,
                    )
                )
                for i, url in enumerate(self.server_urls)
            ]
            await all_or_first_error([asyncio.ensure_future(in_daemon_thread(sender.join)), *inits])
            self._sender = sender
        sender = self._sender
        sent = 0
        for bucket, _ in with_last(buckets):
            info = {
                "update_info": {
                    "names": [n for n, _ in bucket],
                    "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                }
            }
            calls = [
                asyncio.ensure_future(
                    self._client.call(
                        u, "/update_weights", info, timeout_s=cfg.weight_sync_timeout_s, retries=0
                    )
                )
                for u in self.server_urls
            ]

            def send(bucket: list[NamedTensor] = bucket) -> None:
                for _, tensor in bucket:
                    sender.broadcast(tensor)

            await all_or_first_error([asyncio.ensure_future(in_daemon_thread(send)), *calls])
            sent += len(bucket)
        if not sent:
            raise ValueError("weight exporter yielded no tensors")

    async def _after_failed_push(self) -> None:
        """A broken NCCL round leaves the group unusable: drop it (the next sync joins a new one)."""
        if self._sender is not None:
            await self._release()


def make_vllm_engine(runtime: Any, *, exporter: Exporter | None = None) -> VLLMEngine:
    """The engine of a training run with rollout.engine=vllm, on every trainer rank (server/factory.py).

    `runtime` provides `cfg.vllm` (the options of VLLMConfig), `model_config` (routing shape; the config.json of
    `model_path: trainer`), `models` (the trainer's weights for `model_path: trainer`) and `dtype`. With
    `model_path: trainer` (the default) every rank runs the exporter once and rank 0 writes the trainer's
    weights as an HF directory for the servers to start from.
    """
    import torch.distributed as dist

    cfg = VLLMConfig.from_run_config(runtime.cfg.vllm, runtime.model_config)
    many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    exporter = exporter or default_exporter(runtime, many)
    root = None
    if cfg.weight_transport != "nccl":
        root = transport_root(cfg.weight_transport, cfg.weight_sync_dir, f"{uuid.uuid4().hex[:8]}")
    if cfg.serves_trainer_weights:
        start = (root or Path(runtime.cfg.trainer.run_dir) / "vllm_weights") / "initial"
        write = not many or dist.get_rank() == 0
        export_hf_directory(
            exporter(runtime.models), runtime.model_config, start, dtype=runtime.dtype, write=write
        )
        cfg = dataclasses.replace(cfg, model_path=str(start))
    return make_server_engine(VLLMEngine, cfg, runtime, exporter=exporter, weight_root=root)  # type: ignore[return-value]


def export_hf_directory(
    named_tensors: Iterable[NamedTensor], model_config: Any, path: Path, *, dtype: torch.dtype, write: bool
) -> None:
    """The exported tensors as an HF checkpoint directory (safetensors + config.json) vLLM can serve.

    A collective when the exporter is one: every rank iterates, only `write` ranks write.
    """
    if not write:
        drain(named_tensors)
        return
    write_checkpoint_dir(iter_buckets(named_tensors, 512 * 1024 * 1024), path)
    hf = model_config.to_hf_config().to_dict()
    hf["architectures"] = ["Qwen3MoeForCausalLM"]
    hf["dtype"] = dtype_name(dtype)  # what vllm.dtype=auto serves
    (path / "config.json").write_text(json.dumps(hf, indent=1, sort_keys=True))
