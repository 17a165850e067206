import os

import pytest
import torch

# Two cores on CI: keep intra-op threads low so spawned ranks do not oversubscribe. Under pytest-xdist (`make test`
# runs one worker per core) each worker gets one thread: two workers with two threads each would oversubscribe the
# cores. (Not through OMP_NUM_THREADS: the launch tests check what the scripts derive when it is unset.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not `item.keywords`: keywords hold the names of the item's parent directories too, so a
        # checkout in a folder named "gpu" would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    # The multi-rank tests' fork server (tests/distributed.py), started before any test can change what it
    # inherits, and inside pytest's output capture (a session hook runs outside it): the ranks' output then
    # appears with the test that failed, not on the terminal.
    from tests.distributed import start_fork_server

    start_fork_server()
