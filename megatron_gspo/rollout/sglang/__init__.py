"""Rollouts from SGLang servers (GPU clusters): SGLang's native HTTP API on top of the shared server layer."""

from megatron_gspo.rollout.sglang.config import SGLangConfig
from megatron_gspo.rollout.sglang.engine import (
    SGLangEngine,
    SGLangError,
    SGLangGenerateError,
    StaleWeightsError,
    make_sglang_engine,
)

__all__ = ["SGLangConfig", "SGLangEngine", "SGLangError", "SGLangGenerateError", "StaleWeightsError", "make_sglang_engine"]
