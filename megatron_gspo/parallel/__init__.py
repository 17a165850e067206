"""torch.distributed and megatron-core parallel-state set-up; the CPU backend for megatron-core."""

from megatron_gspo.parallel.config import ParallelConfig
from megatron_gspo.parallel.initialize import initialize, seed_everything, shutdown

__all__ = ["ParallelConfig", "initialize", "seed_everything", "shutdown"]
