"""A frozen rank, in spawned gloo ranks: the watchdog names the phase the waiting rank is in, and the process group's
timeout (parallel.timeout_s) ends the wait with an error instead of a hang."""

from __future__ import annotations

import logging
import time


def frozen_peer(timeout_s: float, warn_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_gspo.cli.main import _is_collective_error
    from megatron_gspo.lifecycle.watchdog import PhaseWatchdog
    from megatron_gspo.parallel import initialize, shutdown
    from megatron_gspo.parallel.config import ParallelConfig

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("megatron_gspo.lifecycle.watchdog").addHandler(Keep())
    # The timeout bounds the rendezvous too: do the slow imports (megatron) before it, so neither rank waits long.
    from megatron.core import parallel_state, tensor_parallel  # noqa: F401

    initialize(ParallelConfig(timeout_s=timeout_s))
    rank = dist.get_rank()
    dog = PhaseWatchdog(warn_s, rank=rank, timeout_s=timeout_s)
    x = torch.ones(1)
    # 1. rank 1 is slow to reach the collective: rank 0 waits in it and says where.
    if rank == 1:
        time.sleep(warn_s * 6)
    with dog.phase("update"):
        dist.all_reduce(x)
    total = float(x.item())
    # 2. rank 1 never comes: rank 0's collective fails after the timeout.
    error, collective = None, False
    if rank == 0:
        try:
            with dog.phase("old_logprobs"):
                dist.all_reduce(x)
        except Exception as err:  # noqa: BLE001 - what the CLI would see
            error, collective = f"{type(err).__name__}: {err}".splitlines()[0], _is_collective_error(err)
    else:
        time.sleep(timeout_s + 1)  # past rank 0's timeout
    dog.close()
    try:
        shutdown()
    except Exception:  # noqa: BLE001 - a group that timed out may not tear down cleanly
        pass
    return dict(records=records, error=error, collective=collective, sum=total)
