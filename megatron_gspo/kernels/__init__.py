"""Per-token / per-sequence log-prob kernels (Triton, vocab-parallel, fwd + bwd) with an fp32 torch fallback.

No megatron import: usable and tested on its own (DESIGN.md). `api` holds the contract; REFERENCE.md §5 the
targets.
"""

from megatron_gspo.kernels.api import SequenceLogprobs, linear_sequence_logprobs, sequence_logprobs
from megatron_gspo.kernels.reference import reference_sequence_logprobs

__all__ = ["SequenceLogprobs", "linear_sequence_logprobs", "reference_sequence_logprobs", "sequence_logprobs"]
