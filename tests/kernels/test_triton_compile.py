"""The kernels compile in Triton's compiled mode for an H100/H200 (sm_90) target -- no GPU needed.

The interpreter tests check the math; this checks that the same kernels are valid compiled Triton (types,
int64 offsets, the reduce combine functions), down to PTX and a cubin.
"""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from megatron_gspo.kernels import triton_logprob

# With TRITON_INTERPRET=1 set before triton was imported, triton's own library functions (the reduce combine
# functions our kernels call) exist only in their interpreted form: nothing can be compiled in this process.
pytestmark = pytest.mark.skipif(
    not isinstance(tl.standard._sum_combine, JITFunction),
    reason="triton was imported with TRITON_INTERPRET=1: compiled mode unavailable in this process",
)

_COMMON = {
    "targets_ptr": "*i64",
    "V": "i32",
    "vocab_start": "i32",
    "inv_temperature": "fp32",
    "BLOCK_V": "constexpr",
}
SIGNATURES = {
    "row_stats": lambda dt: {
        "logits_ptr": dt,
        "stride_logits": "i64",
        "active_ptr": "*u8",
        "lse_ptr": "*fp32",
        "target_logit_ptr": "*fp32",
        **_COMMON,
    },
    "dlogits": lambda dt: {
        "logits_ptr": dt,
        "stride_logits": "i64",
        "dlogits_ptr": dt,
        "stride_dlogits": "i64",
        "grad_ptr": "*fp32",
        "lse_ptr": "*fp32",
        **_COMMON,
    },
}


@pytest.mark.parametrize("kernel", list(SIGNATURES))
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_compiles_for_sm90(kernel, dtype, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    fn = getattr(triton_logprob._kernels(False), kernel)
    sig = SIGNATURES[kernel](dtype)
    compiled = triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs={"BLOCK_V": 4096}),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 16, "enable_fp_fusion": True},
    )
    assert compiled.asm["cubin"]


def test_segment_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    sig = {
        "values_ptr": "*fp32",
        "active_ptr": "*u8",
        "cu_seqlens_ptr": "*i32",
        "sums_ptr": "*fp32",
        "counts_ptr": "*i64",
        "BLOCK": "constexpr",
    }
    compiled = triton.compile(
        ASTSource(fn=triton_logprob._kernels(False).segment_sums, signature=sig, constexprs={"BLOCK": 1024}),
        target=GPUTarget("cuda", 90, 32),
        options={"enable_fp_fusion": True},
    )
    assert compiled.asm["cubin"]
