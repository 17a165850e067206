"""Rollout engines behind one protocol (`types.RolloutEngine`): the in-process `local.LocalEngine` and the
SGLang engine (`sglang.SGLangEngine`)."""

from megatron_gspo.rollout.types import Rollout, RolloutEngine, SamplingParams, compact_expert_dtype

__all__ = ["Rollout", "RolloutEngine", "SamplingParams", "compact_expert_dtype"]
