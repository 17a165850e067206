"""megatron-gspo's weight transfer inside a vLLM worker: safetensors directories written by the trainer (in
/dev/shm or on disk, server/transport.py) loaded into the running model. Imported by vLLM only (plugin.py).

vLLM's RL endpoints drive it: `/start_weight_update` (layer-wise reload set up), `/update_weights {update_info:
{"path": DIR}}` (the directory's tensors through the model's `load_weights`, checkpoint names), and
`/finish_weight_update {weight_version}` (layer-wise reload finalised, then the CPU MoE repack below).

vLLM 0.32 CPU bug, read in its source (model_executor/layers/fused_moe/unquantized_fused_moe_method.py,
`UnquantizedFusedMoEMethod._setup_kernel`): on a weight update (`self.moe_kernel is not None`) it copies the new
expert weights into the existing parameters and skips `moe_kernel.fused_experts.process_weights_after_loading`,
which on CPU (`experts/cpu_moe.py`) prepacks w13 / w2 into the grouped-GEMM layout. The reloaded experts then sit
in the parameters unpacked while the kernel reads them as packed: log-probs were 0.08-0.3 off after an update
(REFERENCE.md §9). `repack_cpu_moe` re-runs that prepack after every update, for the vLLM versions in
`REPACK_VERSIONS` (where the skip was read); any other version is refused on CPU until its source is checked.

R3 on a CPU server (`RoutingCaptureExtension`, `--worker-extension-cls`): vLLM returns routed experts only from its
model runner V2, which needs Triton (REFERENCE.md §9). A forward hook on every MoE gate (`FusedMoE`'s runner calls
`self.gate(hidden_states)`, model_executor/layers/fused_moe/runner/moe_runner.py) records the top-k of the router
logits per forwarded token; the worker's `execute_model` is wrapped to split each step's tokens by request, in the
input batch's order with the scheduler's token counts (how the V1 runner flattens them). Prefix caching must be off
(cached tokens are never forwarded).

Rows are stored by absolute token position, from the scheduler's `num_computed_tokens` of each scheduled request
(`scheduled_new_reqs[i].num_computed_tokens`, `scheduled_cached_reqs.num_computed_tokens[i]`: where this step's
tokens start). A request preempted for KV blocks (or by `/reset_prefix_cache?reset_running_requests=true`, which
the engine's partial rollouts use after a weight update) is reset to 0 computed tokens by the scheduler
(`Scheduler._preempt_request`) and forwarded again from token 0 when it resumes. The recomputed positions keep
their first rows: the first forward of position p is the one whose logits sampled token p + 1 (and whose log-prob
the response reports); the recompute only rebuilds KV, under the new weights after an update, and taking its rows
would pair the old version's tokens with the new version's routes (the versioned-R3 bug). Positions past the
recorded ones are appended. Only a (chunked) prompt prefill interrupted before it sampled anything has its rows
replaced: they routed no token, the recompute's route the first one. Appending every step's rows instead gave the
recomputed prefix twice and routes shifted against the tokens (11 of 12 samples wrong under KV pressure). This
holds because the CPU platform runs the synchronous scheduler (vLLM 0.32 platforms/cpu.py sets
`async_scheduling = False`): a preemption never drops a token already forwarded, so a position's first forward
always had the token it finally holds.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from dataclasses import dataclass

import numpy as np
import torch
import vllm
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_gspo.rollout.server.transport import read_checkpoint_dir

logger = logging.getLogger(__name__)

REPACK_VERSIONS = ("0.32.0",)
"""vLLM releases whose CPU MoE weight update skips the expert prepack (read in their source)."""


@dataclass
class SafetensorsInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine {init_info}`: nothing to set up (the files carry everything)."""


@dataclass
class SafetensorsUpdateInfo(WeightTransferUpdateInfo):
    """`/update_weights {update_info}`: one version directory written by server/transport.py."""

    path: str
    """Directory with safetensors shards + model.safetensors.index.json."""


def repack_cpu_moe(model: torch.nn.Module, version: str = vllm.__version__) -> int:
    """Re-runs the CPU expert prepack that vLLM skips on a weight update; returns the MoE layers repacked."""
    repacked = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or type(experts).__module__.split(".")[-1] != "cpu_moe":
            continue
        if version not in REPACK_VERSIONS:
            raise RuntimeError(
                f"vLLM {version}: megatron-gspo's CPU weight update was written for vLLM {REPACK_VERSIONS}, which "
                "skip the MoE expert prepack on reload (UnquantizedFusedMoEMethod._setup_kernel); check that "
                "method in this version and extend rollout/vllm/worker.py REPACK_VERSIONS"
            )
        experts.process_weights_after_loading(module)
        repacked += 1
    return repacked


class SafetensorsWeightTransferEngine(WeightTransferEngine[SafetensorsInitInfo, SafetensorsUpdateInfo]):
    """vLLM weight-transfer backend `megatron_gspo`: loads a safetensors directory per update."""

    init_info_cls = SafetensorsInitInfo
    update_info_cls = SafetensorsUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SafetensorsInitInfo) -> None:
        """Nothing to join: the trainer writes files."""

    def start_weight_update(self) -> None:
        """vLLM's layer-wise reload: parameters are rebuilt from the loaded checkpoint tensors."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: SafetensorsUpdateInfo) -> None:
        """Feeds the directory's tensors (Hugging Face names) through the model's own weight loaders."""
        loaded = self.model.load_weights(
            (name, tensor.to(self.device)) for name, tensor in read_checkpoint_dir(update_info.path)
        )
        logger.info("megatron_gspo weight transfer: %d tensors from %s", len(loaded or ()), update_info.path)

    def finish_weight_update(self) -> None:
        """Finalises the reload, then repacks CPU MoE experts (the vLLM bug in the module docstring)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if self.device.type == "cpu":
            repack_cpu_moe(self.model)

    def update_weights(self, update_info: dict) -> None:
        """Parses and loads one update; no accelerator synchronisation is needed for file-backed weights."""
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        """Nothing held between updates."""


class RoutingCaptureExtension:
    """Worker extension: each request's routed experts, recorded by hooks on the MoE gates (CPU R3).

    Methods are called through `/collective_rpc` (string arguments): `gspo_enable_routing(topk)` once,
    `gspo_pop_routes(json {"want": [request-id prefixes], "forget": prefix})` after generation -> {prefix: base64
    .npy int16 [T, L, K]} (T = the positions forwarded; never-forwarded positions are -1), and every other request
    whose id starts with `forget` is dropped (aborted or retried attempts: nobody pops them).
    """

    def gspo_enable_routing(self, topk: str) -> str:
        """Installs the gate hooks and the per-step split; returns the number of MoE layers hooked."""
        if getattr(self, "_gspo_routes", None) is not None:
            return str(len(self._gspo_gates))
        runner = self.model_runner  # type: ignore[attr-defined]
        k = int(topk)
        self._gspo_routes: dict[str, tuple[np.ndarray, int]] = {}
        """request id -> (rows by token position [capacity, L, K], positions recorded)"""
        self._gspo_step: list[torch.Tensor] = []
        self._gspo_prompt_len: dict[str, int] = {}
        """request id -> prompt tokens (a request has sampled a token once position prompt - 1 was forwarded)"""
        self._gspo_gates = [
            m.gate for m in runner.get_model().modules() if hasattr(m, "gate") and hasattr(m, "experts")
        ]

        def record(module: torch.nn.Module, args: tuple, output: object) -> None:
            logits = output[0] if isinstance(output, tuple) else output
            self._gspo_step.append(torch.topk(logits.float(), k, dim=-1).indices)

        for gate in self._gspo_gates:
            gate.register_forward_hook(record)
        execute = runner.execute_model

        def execute_and_split(scheduler_output, *args, **kwargs):
            self._gspo_step.clear()
            out = execute(scheduler_output, *args, **kwargs)
            if self._gspo_step and len(self._gspo_step) == len(self._gspo_gates):
                ids_TLK = torch.stack(self._gspo_step, dim=1).to(torch.int16).cpu().numpy()
                starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
                for r in scheduler_output.scheduled_new_reqs:
                    if r.prompt_token_ids is not None:
                        self._gspo_prompt_len.setdefault(r.req_id, len(r.prompt_token_ids))
                cached = scheduler_output.scheduled_cached_reqs
                starts.update(zip(cached.req_ids, cached.num_computed_tokens))
                offset = 0
                for rid in runner.input_batch.req_ids:
                    n = scheduler_output.num_scheduled_tokens.get(rid, 0)
                    if n:
                        self._gspo_store(rid, starts[rid], ids_TLK[offset : offset + n])
                        offset += n
            self._gspo_step.clear()
            return out

        runner.execute_model = execute_and_split
        return str(len(self._gspo_gates))

    def _gspo_store(self, rid: str, start: int, rows: np.ndarray) -> None:
        """Rows of positions [start, start + n); positions recorded before keep their first rows (a recompute
        after a preemption, module docstring)."""
        buf, length = self._gspo_routes.get(rid, (None, 0))
        if start < length < self._gspo_prompt_len.get(rid, 0):
            length = start  # a prompt prefill that sampled nothing before it was preempted
        end = start + len(rows)
        if end <= length:
            return
        if buf is None or end > len(buf):
            capacity = max(end, 2 * (0 if buf is None else len(buf)), 64)
            grown = np.full((capacity, *rows.shape[1:]), -1, np.int16)
            if buf is not None:
                grown[:length] = buf[:length]
            buf = grown
        if start > length:
            buf[length:start] = -1  # never forwarded (e.g. a prefix-cache hit): the pop reports them
        fresh = max(start, length)
        buf[fresh:end] = rows[fresh - start :]
        self._gspo_routes[rid] = (buf, end)

    def gspo_pop_routes(self, request: str) -> dict:
        """Routes of the requests whose ids are one of the wanted prefixes (vLLM appends `-<random>`), which are
        forgotten, as is every other request whose id starts with `forget`."""
        spec = json.loads(request)
        wanted, forget = spec["want"], spec["forget"]
        out = {}
        for rid in list(self._gspo_routes):
            match = next((p for p in wanted if rid == p or rid.startswith(p + "-")), None)
            if match is not None:
                buf, length = self._gspo_routes.pop(rid)
                self._gspo_prompt_len.pop(rid, None)
                encoded = io.BytesIO()
                np.save(encoded, buf[:length])
                out[match] = base64.b64encode(encoded.getvalue()).decode("ascii")
            elif rid.startswith(forget):
                del self._gspo_routes[rid]
                self._gspo_prompt_len.pop(rid, None)
        return out
