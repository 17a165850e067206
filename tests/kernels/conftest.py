"""Fixtures for the kernel tests: the Triton interpreter, switched on per test (never for the whole session).

`triton.jit` reads TRITON_INTERPRET when it wraps a kernel, and our kernels are wrapped lazily per
interpreter mode at their first launch, so setting the variable for the duration of a test is enough (even
when megatron.core imported triton earlier in the session); other test packages keep "auto" -> torch on CPU.
"""

import pytest


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Runs the test with TRITON_INTERPRET=1 (Triton kernels execute on CPU tensors)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Both backends; "triton" runs in the interpreter."""
    if request.param == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param
