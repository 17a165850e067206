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


def rendezvous_on_a_held_port() -> tuple[bool, float]:
    """Whether MASTER_PORT was bound already before this rank bound anything (by the test process, which holds the
    store: another job on the host cannot take it between a pick and a bind), and a gloo all-reduce through it."""
    import socket

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            held = False
        except OSError:
            held = True
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return held, float(t)
