"""Rank functions of tests/test_distributed.py (the multi-rank test helper itself)."""

from __future__ import annotations

import atexit
import os


def what_a_rank_sees(marker: str) -> dict:
    import numpy
    import torch

    path = os.path.join(marker, f"atexit_{os.environ['RANK']}")
    atexit.register(lambda: open(path, "w").close())
    return dict(torch_seed=torch.initial_seed(), numpy_draw=float(numpy.random.random()),
                env=os.environ.get("MG_HELPER_PROBE"), rank=int(os.environ["RANK"]), cwd=os.getcwd())
