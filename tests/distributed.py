"""Test helper: run a function in N processes with a gloo process group on loopback.

Used by every multi-rank test (TP / EP / PP invariance against the single-process result). Results travel back
as `torch.save` bytes so tensors survive the child process exiting.

Without CUDA the ranks are forked from a `forkserver` that has imported torch and megatron-core once: importing
them costs a spawned rank ~3.7 s of CPU, and on 2 cores the suite took 16 min with spawned ranks, about 11 min
forked. A forked rank is made to look like a spawned one where it can: it gets the caller's environment at the
call before its function's module is imported (unpickled), fresh torch / numpy RNG seeds, and the atexit handlers
registered in it run at its end (a fork server's child leaves through os._exit). The server starts in a session
fixture (tests/conftest.py), inside pytest's capture, so what it inherits (stdout / stderr, umask, the
environment its imports read) is the session's, not one test's; it runs one thread. What a fork cannot differ in
is the string-hash seed: every forked rank has the same one, while torchrun's ranks each have their own;
`start_method="spawn"` runs a test's ranks as torchrun would (the torchrun end-to-end tests run them so anyway).
With CUDA the ranks are always spawned: a process that imported megatron may have initialised CUDA, and a fork of
it cannot use the device.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing.forkserver
import os
import pickle
import random
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free at the moment of the call (for servers that take a port number; racy by nature: the port is
    released before the server binds it. The ranks of run_distributed do not use it: see held_stores)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Consecutive rendezvous stores run_distributed holds for its ranks: a test whose ranks start one process group
# after another moves to MASTER_PORT + 1, + 2, ... (a new group cannot reuse a destroyed group's store).
STORES = 8


def held_stores(count: int = STORES) -> list:
    """`count` TCPStore servers on consecutive loopback ports, bound here and held until the caller drops them.

    The ranks connect to them as clients (TORCHELASTIC_USE_AGENT_STORE=True: what torchrun's workers do with the
    agent's store), so no port is ever picked, released and bound again later: a test beside other jobs on the same
    host (another test session, a torchrun job) cannot lose its rendezvous port to them (EADDRINUSE)."""
    from torch.distributed import TCPStore

    rng = random.Random()
    for _ in range(200):
        # Below the kernel's ephemeral range (32768-60999): outgoing connections never take these on their own.
        base = rng.randrange(10000, 32000 - count)
        stores = []
        try:
            for port in range(base, base + count):
                stores.append(TCPStore("127.0.0.1", port, None, True, timedelta(seconds=300), wait_for_workers=False))
            return stores
        except (RuntimeError, OSError):  # taken: try elsewhere (what was bound is released with the list)
            del stores
    raise RuntimeError(f"no {count} consecutive free ports in 10000..32000 for the ranks' rendezvous")


# What a forked rank needs anyway: importing it once in the fork server saves it in every rank.
_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
            "megatron.core.dist_checkpointing", "megatron.core.distributed"]


def start_fork_server() -> None:
    """Starts the fork server the ranks are forked from (a no-op with CUDA, or once it runs)."""
    if not torch.cuda.is_available():
        mp.set_forkserver_preload(_PRELOAD)
        # No thread pool in the server (numpy's OpenBLAS starts one at import): a fork copies only the forking
        # thread, and a rank forked from a process with other threads inherits whatever state they held.
        saved = os.environ.get("OPENBLAS_NUM_THREADS")
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OPENBLAS_NUM_THREADS"]
            else:
                os.environ["OPENBLAS_NUM_THREADS"] = saved


def _context(start_method: str | None):
    if start_method == "spawn" or torch.cuda.is_available():
        return mp.get_context("spawn")
    if start_method not in (None, "forkserver"):
        raise ValueError(f"start_method={start_method!r}: use 'spawn' or None (forked from the fork server)")
    start_fork_server()
    return mp.get_context("forkserver")


def _child(rank: int, world_size: int, port: int, environ: dict, call: bytes, forked: bool, queue) -> None:
    # The caller's environment, as a spawned process gets it (a fork server's children get the server's), set
    # before the function's module is imported by unpickling it.
    os.environ.clear()
    os.environ.update(environ)
    if forked:  # a spawned process seeds its RNGs from the OS; forks would share the server's states
        import numpy

        torch.seed()
        numpy.random.seed()
        # The server's own exit handlers (torch's C++ cleanups among them) are not this rank's to run: only the
        # ones registered in the rank run at its end, as they would at a spawned rank's exit.
        atexit._clear()
    fn, args, kwargs = pickle.loads(call)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the parent holds the store on MASTER_PORT (held_stores)
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises with the child's traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        if forked:  # a fork server's child ends in os._exit: what a spawned one's interpreter exit would run
            atexit._run_exitfuncs()


def run_distributed(
    fn: Callable, *args: Any, world_size: int = 2, timeout: float = 300.0, start_method: str | None = None, **kwargs: Any
) -> list:
    """Runs `fn(*args, **kwargs)` on `world_size` ranks; returns the per-rank results in rank order.
    `start_method="spawn"`: fresh interpreters (each with its own string-hash seed), as under torchrun.

    `fn` must be importable (module level). The ranks see the usual torchrun environment variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so production code initialises exactly as under torchrun; as
    under torchrun the rendezvous store is held by the launcher (here, this process: held_stores), not rank 0.
    """
    ctx = _context(start_method)
    forked = ctx.get_start_method() == "forkserver"
    queue = ctx.Queue()
    stores = held_stores()  # dropped (closed) when this call returns, after every rank has ended
    port = stores[0].port
    call = pickle.dumps((fn, args, kwargs))
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, environ, call, forked, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
