"""parallel.timeout_s bounds how long ranks wait for a frozen peer; the phase watchdog says where each one waits."""

import pytest

from megatron_gspo.parallel.config import ParallelConfig
from tests.distributed import run_distributed
from tests.parallel.timeout_ranks import frozen_peer


def test_a_frozen_rank_is_named_by_phase_and_the_collective_times_out():
    rank0, rank1 = run_distributed(frozen_peer, 5.0, 0.2, world_size=2, timeout=240)
    assert rank0["sum"] == rank1["sum"] == 2.0  # the slow all_reduce completed
    waiting = [m for m in rank0["records"] if "still in phase 'update'" in m]
    assert waiting and waiting[0].startswith("rank 0: still in phase 'update' after")
    assert "process group times out after 5 s" in waiting[0]
    assert not any("'update'" in m for m in rank1["records"])  # the slow rank was not waiting there
    assert rank0["error"] is not None and rank0["collective"], rank0["error"]
    assert any("still in phase 'old_logprobs'" in m for m in rank0["records"])


def test_timeout_is_validated():
    assert ParallelConfig().timeout_s == 1800.0
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="parallel.timeout_s"):
            ParallelConfig(timeout_s=bad)
