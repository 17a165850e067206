import os
import shutil

import pytest


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-host Slurm (munged, slurmctld, slurmd) for the whole session, shared by every real-Slurm test;
    stopped by PID at the end (tests/launch/slurm.py). Needs root and Debian's slurm-wlm + munge (`make test`
    installs them: tools/slurm_env.sh); without root it skips with one line, under CI=true it must run."""
    from tests.launch.slurm import SlurmCluster, missing_programs

    ci = os.environ.get("CI") == "true"
    why = None
    if os.geteuid() != 0:
        why = "the real-Slurm tests need root (slurmd runs jobs as root here); CI runs them"
    elif missing_programs():
        why = f"{', '.join(missing_programs())} not installed: run tools/slurm_env.sh (make test does)"
    if why:
        if ci:
            pytest.fail(f"CI=true: {why}")
        pytest.skip(why)
    cluster = SlurmCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.dir, ignore_errors=True)  # its configuration, state and daemon logs
