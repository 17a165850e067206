"""Checks that a GPU install is the configuration megatron-gspo is written for (run by tools/install.sh on GPU hosts
and by tools/gpu_smoke.sh part `env`): transformer-engine imports and megatron-core sees it (else megatron builds the
local spec and trains without TE, silently), Triton can compile for this GPU (its compiler and libcuda), NCCL is in
torch and works (a one-rank group: the weight sync's agreement, `all_ranks_ok`, from two threads). Each failure is one line `gpu env: FAIL <what>: <why> -- <fix>`; exit status 1 when any failed.

    python tools/gpu_env_check.py [--skip te]

Each check takes what it probes as arguments (tests/launch/test_install.py passes stand-ins: no GPU there).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

TE_RANGE = (">=2.9.0a0", "<2.12.0")
"""megatron-core 0.16.1's own range (setup.py's `gpu` extra; tests/launch/test_install.py pins them equal)."""


def check_te(import_module: Callable = importlib.import_module) -> str:
    """transformer-engine imports, its release is in megatron-core's range, and megatron's TE extension loads."""
    from packaging.version import Version

    try:
        te = import_module("transformer_engine.pytorch")
        version = Version(str(getattr(import_module("transformer_engine"), "__version__", "0")))
    except Exception as err:  # noqa: BLE001 - an ImportError, or a CUDA / ABI error from its C++ extension
        raise RuntimeError(
            f"transformer-engine does not import ({type(err).__name__}: {_first_line(err)}) -- "
            "pip install 'transformer-engine[pytorch]>=2.9.0a0,<2.12.0' --no-build-isolation"
        ) from err
    if not Version("2.9.0a0") <= version < Version("2.12.0"):
        raise RuntimeError(
            f"transformer-engine {version} is outside megatron-core 0.16.1's range "
            f"{','.join(TE_RANGE)} -- install one inside it"
        )
    try:
        import_module("megatron.core.extensions.transformer_engine")
    except Exception as err:  # noqa: BLE001
        raise RuntimeError(
            f"megatron-core's TE extension does not load with TE {version} "
            f"({type(err).__name__}: {_first_line(err)}) -- reinstall TE against this torch"
        ) from err
    del te
    return f"transformer-engine {version}"


def check_triton(libcuda_dirs: Callable | None = None, compile_probe: Callable | None = None) -> str:
    """Triton finds libcuda (its driver loads it at the first launch) and compiles and runs a kernel here."""
    import triton

    if libcuda_dirs is None:
        from triton.backends.nvidia.driver import libcuda_dirs
    try:
        dirs = libcuda_dirs()
    except Exception as err:  # noqa: BLE001 - triton raises AssertionError / RuntimeError when it finds none
        raise RuntimeError(
            f"Triton finds no libcuda.so ({_first_line(err)}) -- install the NVIDIA driver's "
            "libcuda, or set TRITON_LIBCUDA_PATH to its directory"
        ) from err
    try:
        (compile_probe or _compile_and_run)()
    except Exception as err:  # noqa: BLE001 - ptxas / compiler / launch failures
        raise RuntimeError(
            f"Triton {triton.__version__} cannot compile and run a kernel on this GPU "
            f"({type(err).__name__}: {_first_line(err)}) -- check CUDA driver and ptxas"
        ) from err
    return f"triton {triton.__version__} (libcuda in {dirs[0] if dirs else '?'})"


def _compile_and_run() -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(8, device="cuda")
    add_one[(1,)](x, 8, BLOCK=8)
    torch.cuda.synchronize()
    if not bool((x == 1).all()):
        raise RuntimeError(f"a kernel adding 1 produced {x.tolist()}")


def check_nccl(torch_module=None) -> str:
    """torch has NCCL (version readable, ProcessGroupNCCL built) and a CUDA device to run it on."""
    torch = torch_module
    if torch is None:
        import torch
    if not torch.cuda.is_available():
        raise RuntimeError(
            "torch sees no CUDA device -- a CPU build of torch (reinstall the pinned CUDA build), "
            "or no driver"
        )
    try:
        version = torch.cuda.nccl.version()
    except Exception as err:  # noqa: BLE001
        raise RuntimeError(
            f"torch {torch.__version__} has no NCCL ({_first_line(err)}) -- install a CUDA build of torch"
        ) from err
    if not torch.distributed.is_nccl_available():
        raise RuntimeError(
            f"torch {torch.__version__} was built without ProcessGroupNCCL -- install a CUDA build"
        )
    text = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return f"torch {torch.__version__}, NCCL {text}"


def check_rank_agreement(backend: str = "nccl") -> str:
    """The weight sync's agreement step works on this backend (issue 27): `all_ranks_ok` (rollout/server/factory.py)
    is torch's all_gather_object, which on an NCCL group pickles into a tensor on the *current* CUDA device and
    gathers there (torch 2.13 torch/distributed/distributed_c10d.py all_gather_object, `current_device =
    _get_object_coll_device(group)` / `_object_to_tensor(obj, current_device, group)`); run from the main thread
    and from a thread that first sets the device, as the rollout producer thread does (training/producer.py
    RolloutProducer._run), over a one-rank group. `backend="gloo"` runs the same on CPU (tests)."""
    import threading

    import torch
    import torch.distributed as dist

    from megatron_gspo.rollout.server.factory import all_ranks_ok

    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        seen = [all_ranks_ok(True), all_ranks_ok(False)]

        def producer() -> None:
            if cuda:
                torch.cuda.set_device(0)  # a new thread starts on device 0 anyway; the producer sets its rank's
            seen.append(all_ranks_ok(True))

        thread = threading.Thread(target=producer, daemon=True)
        thread.start()
        thread.join(timeout=10)
        if thread.is_alive():
            raise RuntimeError(f"all_ranks_ok from a second thread did not return in 10 s over {backend}")
        if seen != [True, False, True]:
            raise RuntimeError(f"all_ranks_ok over {backend} answered {seen} for (True, False, True from a thread)")
    finally:
        dist.destroy_process_group()
    return f"all_ranks_ok over a one-rank {backend} group, main and second thread"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


CHECKS = {"nccl": check_nccl, "agreement": check_rank_agreement, "triton": check_triton, "te": check_te}


NEEDS = {"agreement": "nccl"}
"""A check that is not run when the check it needs failed (its line would repeat that cause)."""


def run(checks: dict[str, Callable[[], str]], out=print) -> int:
    """Runs each check; one line per check (PASS with what was found, FAIL with why and the fix)."""
    failed = 0
    failed_names: set[str] = set()
    for name, check in checks.items():
        if NEEDS.get(name) in failed_names:
            continue
        failed_names.add(name)
        try:
            out(f"gpu env: PASS {name}: {check()}")
            failed_names.discard(name)
        except Exception as err:  # noqa: BLE001 - every failure becomes its one line
            failed += 1
            out(f"gpu env: FAIL {name}: {_first_line(err)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=sorted(CHECKS),
        help="a check not to run (e.g. te on a machine without transformer-engine)",
    )
    args = parser.parse_args(argv)
    return run({k: v for k, v in CHECKS.items() if k not in args.skip})


if __name__ == "__main__":
    sys.exit(main())
