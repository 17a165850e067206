"""In-process rollout engine: generates with the trainer's model (KV-cached, batched), no server needed.

`LocalEngine` implements the `RolloutEngine` protocol (rollout/types.py) like the SGLang engine does, and returns
what SGLang returns: response ids, per-token log-probs (of the temperature-scaled, untruncated distribution; see
rollout/local/sampling.py), finish reasons and the top-k experts of every fed token (R3 routing replay).

Backends (`backend=`):
- "megatron": the trainer's GPTModel itself with megatron-core's StaticInferenceContext (rollout/local/megatron.py).
  Needs an unsplit model on this rank (tp = pp = ep = cp = 1); data-parallel ranks each generate their prompts.
  It shares the trainer's parameters, so `update_weights` only records the version.
- "hf": a transformers replica (rollout/local/hf.py) refreshed from the Megatron shards on `update_weights`
  (a collective: every rank calls it, and the constructor). Rank 0 of each model-parallel group generates for
  the prompts *it* was given and broadcasts the rollouts to its group, so every rank returns the same list
  (the other ranks of the group wait). A CPU / debugging path: the replica holds the full, unsharded model.
- "auto": "megatron" when the model is not split and `dtype` is the trainer's, else "hf".

`dtype` (rollout.local.dtype): the precision the engine samples in. Unset, it is the trainer's, and the "megatron"
backend samples with the trainer's own parameters: the engine IS the trainer, so the train / inference mismatch
that production pairs (vLLM or SGLang in bf16, Megatron with fp32 masters) show is absent (a k3 KL of ~1e-13). Set
to another precision, the "hf" replica holds the trainer's weights rounded to it and samples with its own kernels:
a second implementation in a second precision, the mismatch the R3 paper measures (arXiv:2510.11370 §3).

Prompts of different lengths go to different batches (bucketed by length; see rollout/local/decode.py), so no
position is ever padding. Sampling randomness comes from a private torch.Generator: with `sampling.seed` set, a
call is reproducible on its own; with seed None the engine's `seed` and a per-engine call counter are used, so a
run is reproducible as a whole. The data-parallel rank is mixed into the seed, so DP replicas draw different streams.
The global RNG streams are left untouched.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_gspo.models.config import ModelConfig
from megatron_gspo.rollout.local.decode import generate_batch, plan_batches
from megatron_gspo.rollout.local.hf import HFReplica, HFStepper
from megatron_gspo.rollout.local.megatron import MegatronStepper, inference_mode, new_context
from megatron_gspo.rollout.types import Rollout, SamplingParams, compact_expert_dtype

log = logging.getLogger(__name__)

BACKENDS = ("auto", "megatron", "hf")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _unwrap(chunk):
    while hasattr(chunk, "module") and not hasattr(chunk, "model_config"):
        chunk = chunk.module
    return chunk


def _layout() -> dict[str, int]:
    """Model-parallel sizes of this rank (all 1 when megatron's groups are not initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(tp=1, pp=1, ep=1, cp=1)
    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
    )


def _data_parallel_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _stream_seed(base: int, call: int, dp_rank: int) -> int:
    """A 63-bit seed from (base seed, call number, data-parallel rank); distinct inputs give distinct streams."""
    mixed = (base * 0x9E3779B97F4A7C15 + call * 0xBF58476D1CE4E5B9 + dp_rank * 0x94D049BB133111EB) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


class LocalEngine:
    """Batched, KV-cached generation with the trainer's model; see the module docstring."""

    def __init__(
        self,
        model_chunks,
        model_config: ModelConfig,
        *,
        max_batch_size: int = 512,
        pad_id: int = 0,
        backend: str = "auto",
        seed: int = 0,
        record_routing: bool = True,
        dtype: torch.dtype | None = None,
    ):
        """
        Args:
            model_chunks: this rank's GPTModel chunks (DDP-wrapped or not) from `build_model` / `build_ddp_model`.
            model_config: the architecture (vocabulary, experts, top-k, max positions).
            max_batch_size: most sample rows in one forward batch (prompt groups are split across batches
                when needed); also bounds the KV cache.
            pad_id: filler of internal token buffers only. It is never fed to the model, never masked out of the
                sampling distribution (it may equal eos) and never returned: finished samples stop growing.
            backend: "auto", "megatron" or "hf" (module docstring).
            seed: base of the sampling streams of calls whose `SamplingParams.seed` is None.
            record_routing: record each fed token's top-k experts into `Rollout.routed_experts`.
            dtype: precision of the engine (module docstring); None = the trainer's parameters' dtype.
        """
        if backend not in BACKENDS:
            raise ValueError(f"rollout.local.backend={backend!r} must be one of {BACKENDS}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"rollout.max_batch_size={max_batch_size!r} must be a positive integer")
        self.config = model_config
        self.max_batch_size = max_batch_size
        self.pad_id = int(pad_id)
        self.seed = int(seed)
        self.record_routing = record_routing
        self.weight_version = 0
        self._calls = 0
        self._closed = False
        self._context = None
        self._replica: HFReplica | None = None
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self._chunks = [_unwrap(c) for c in chunks]
        layout = _layout()
        split = any(v > 1 for v in layout.values()) or len(self._chunks) > 1
        if backend == "megatron" and split:
            raise ValueError(
                "rollout.local.backend=megatron needs an unsplit model on this rank (tp=pp=ep=cp=1, one chunk), got "
                + ", ".join(f"{k}={v}" for k, v in layout.items())
                + "; use rollout.local.backend=hf or auto"
            )
        param = next(self._chunks[0].parameters())
        self.device, self.dtype = param.device, (param.dtype if dtype is None else dtype)
        own = self.dtype == param.dtype
        if backend == "megatron" and not own:
            raise ValueError(
                f"rollout.local.dtype={_DTYPE_NAMES.get(self.dtype, self.dtype)} differs from the trainer's "
                f"{_DTYPE_NAMES.get(param.dtype, param.dtype)}, but rollout.local.backend=megatron samples with the "
                "trainer's own parameters; use rollout.local.backend=hf or auto"
            )
        self.backend = backend if backend != "auto" else ("hf" if split or not own else "megatron")
        if self.backend == "hf":
            self._group, self._leader = self._model_parallel_group()
            self._replica = HFReplica(
                model_config, keep=_global_rank() == self._leader, dtype=self.dtype, device=self.device
            )
            self._replica.refresh(self._chunks)

    # ---- RolloutEngine ---------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Rollout]:
        """`sampling.n` rollouts per prompt, grouped contiguously in prompt order (prompt_index set)."""
        if self._closed:
            raise RuntimeError("LocalEngine.generate called after close()")
        self._check_prompts(prompts, sampling)
        call = self._calls
        self._calls += 1
        if self.backend == "megatron":
            rollouts = self._generate_local(prompts, sampling, call)
        else:
            rollouts = self._generate_hf(prompts, sampling, call)
        for r in rollouts:
            r.weight_version = self.weight_version
        return rollouts

    def update_weights(self, model_chunks, version: int) -> None:
        """Samples from `model_chunks` from now on, tagged `version`. "hf": a collective (every rank calls it)."""
        if self._closed:
            raise RuntimeError("LocalEngine.update_weights called after close()")
        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        self._chunks = [_unwrap(c) for c in chunks]
        if self._context is not None:
            # no cached keys outlive a batch (each prefill rewrites what it reads); reset the offsets anyway
            self._context.reset()
        if self._replica is not None:
            self._replica.refresh(self._chunks)
        self.weight_version = int(version)

    def close(self) -> None:
        """Drops the KV cache and the replica; safe to call twice."""
        self._context = None
        if self._replica is not None:
            self._replica.release()
            self._replica = None
        self._closed = True

    # ---- internals -------------------------------------------------------------------------------------------
    def _check_prompts(self, prompts: list[list[int]], sampling: SamplingParams) -> None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        vocab, limit = self.config.vocab_size, self.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if len(p) + sampling.max_new_tokens > limit:
                raise ValueError(
                    f"prompt {i} ({len(p)} tokens) + rollout.max_new_tokens={sampling.max_new_tokens} exceeds "
                    f"model.max_position_embeddings={limit}"
                )

    def _generator(self, sampling: SamplingParams, call: int) -> torch.Generator:
        base, index = (sampling.seed, 0) if sampling.seed is not None else (self.seed, call)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(_stream_seed(base, index, _data_parallel_rank()))
        return generator

    def _run(self, stepper, prompts: list[list[int]], sampling: SamplingParams, call: int) -> list[Rollout]:
        plans = plan_batches(prompts, sampling.n, self.max_batch_size)
        generator = self._generator(sampling, call)
        expert_dtype = compact_expert_dtype(self.config.num_experts)
        groups: list[list[Rollout]] = [[] for _ in prompts]
        for plan in plans:
            batch = iter(
                generate_batch(
                    stepper,
                    prompts,
                    plan,
                    sampling,
                    vocab_size=self.config.vocab_size,
                    expert_dtype=expert_dtype,
                    generator=generator,
                    device=self.device,
                    fill_id=self.pad_id,
                )
            )
            for prompt_index, count in zip(plan.prompt_indices, plan.counts):
                groups[prompt_index].extend(next(batch) for _ in range(count))
        return [r for group in groups for r in group]

    def _generate_local(self, prompts, sampling, call) -> list[Rollout]:
        if not prompts:
            return []
        model = self._chunks[0]
        rows = min(self.max_batch_size, sampling.n * len(prompts))
        seq = max((len(p) for p in prompts), default=0) + sampling.max_new_tokens
        ctx = self._context
        if ctx is None or ctx.max_batch_size < rows or ctx.max_sequence_length < seq:
            ctx = self._context = new_context(rows, seq)
        with inference_mode(model):
            stepper = MegatronStepper(
                model, ctx, topk=self.config.num_experts_per_tok, record_routing=self.record_routing
            )
            try:
                return self._run(stepper, prompts, sampling, call)
            finally:
                stepper.remove_hooks()

    def _generate_hf(self, prompts, sampling, call) -> list[Rollout]:
        payload: list = [None]
        if _global_rank() == self._leader:
            stepper = HFStepper(
                self._replica.model, topk=self.config.num_experts_per_tok, record_routing=self.record_routing
            )
            try:
                with torch.no_grad():
                    payload[0] = ("ok", self._run(stepper, prompts, sampling, call))
            except Exception as err:  # noqa: BLE001 - peers must learn about it instead of waiting forever
                payload[0] = ("error", f"{type(err).__name__}: {err}")
                log.exception("local hf generation failed")
            finally:
                stepper.remove_hooks()
                stepper.release()
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.broadcast_object_list(payload, src=self._leader, group=self._group)
        status, value = payload[0]
        if status != "ok":
            raise RuntimeError(f"local rollout generation failed on rank {self._leader}: {value}")
        return value

    @staticmethod
    def _model_parallel_group():
        """(this rank's model-parallel group, its global rank 0): the group one hf replica serves."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None, _global_rank()
        group = ps.get_model_parallel_group()
        return group, dist.get_global_rank(group, 0)
