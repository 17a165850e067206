"""Rollout engines behind one protocol (`types.RolloutEngine`): the in-process `local.LocalEngine`, and the server
engines on the shared layer `server/` (HTTP client, retries, aborts, weight versions, process supervision, weight
buckets and transports, one generating rank per model replica): `vllm.engine.VLLMEngine` and
`sglang.engine.SGLangEngine`. Engines know no trainer; the trainer never imports a server's package."""

from megatron_gspo.rollout.types import Rollout, RolloutEngine, SamplingParams, compact_expert_dtype

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "compact_expert_dtype"]
