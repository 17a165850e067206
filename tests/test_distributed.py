"""tests/distributed.py: ranks forked from the fork server look like spawned ones where the tests depend on it."""

import os

import pytest

from tests.distributed import run_distributed
from tests.distributed_ranks import rendezvous_on_a_held_port, what_a_rank_sees


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_ranks_get_the_callers_environment_fresh_rng_seeds_and_run_their_atexit_handlers(
    tmp_path, monkeypatch, start_method
):
    monkeypatch.setenv("MG_HELPER_PROBE", "set by this test")  # after the fork server started
    monkeypatch.chdir(tmp_path)
    first = run_distributed(what_a_rank_sees, str(tmp_path), world_size=2, start_method=start_method)
    second = run_distributed(what_a_rank_sees, str(tmp_path), world_size=2, start_method=start_method)
    outs = first + second
    assert [o["rank"] for o in outs] == [0, 1, 0, 1]
    assert all(o["env"] == "set by this test" and o["cwd"] == str(tmp_path) for o in outs)
    assert len({o["torch_seed"] for o in outs}) == 4 and len({o["numpy_draw"] for o in outs}) == 4
    assert sorted(os.listdir(tmp_path)) == ["atexit_0", "atexit_1"]


def test_ranks_rendezvous_on_a_port_held_for_them():
    # A port picked free, released and bound later by rank 0 could be taken in between by another job on the host
    # (EADDRINUSE, as beside other torchrun jobs on a shared node): the ranks rendezvous on a store this process
    # holds, as torchrun's workers do on the agent's.
    assert run_distributed(rendezvous_on_a_held_port, world_size=2) == [(True, 2.0), (True, 2.0)]
