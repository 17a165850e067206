"""The Triton release the kernels are written against, checked where Triton is first needed.

The kernels and their launchers use `triton.knobs` (the interpreter switch `knobs.runtime.interpret`, read per
launch), `tl.reduce` with `tl.standard._sum_combine` / `_elementwise_max`, and the `enable_fp_fusion` launch option.
`triton.knobs` is the newest of these: MIN_TRITON is the first release that has it (setup.py pins the same
lower bound). An older Triton fails here with one line naming the fix, not with an AttributeError from
inside a launch.
"""

from __future__ import annotations

from types import ModuleType

from packaging.version import Version

MIN_TRITON = "3.4.0"


def triton_problem(triton: ModuleType) -> str | None:
    """Why this `triton` module cannot run the kernels (None when it can)."""
    version = getattr(triton, "__version__", "0")
    if Version(version).release < Version(MIN_TRITON).release or not hasattr(triton, "knobs"):
        return (
            f"triton {version} is older than {MIN_TRITON}, the first release with the APIs megatron_gspo.kernels "
            f"uses (triton.knobs): pip install 'triton>={MIN_TRITON}', or use backend='torch'"
        )
    return None


def require_triton() -> ModuleType:
    """The `triton` module, or an ImportError naming the fix (not installed / older than MIN_TRITON)."""
    try:
        import triton
    except ImportError as err:
        raise ImportError(
            f"the Triton kernels need the triton package (>= {MIN_TRITON}): pip install 'triton>={MIN_TRITON}', "
            "or use backend='torch'"
        ) from err
    problem = triton_problem(triton)
    if problem is not None:
        raise ImportError(problem)
    return triton
