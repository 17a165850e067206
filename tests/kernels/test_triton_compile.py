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
# Strides as triton types them at a launch: i32 when they fit (151936 does), i64 beyond.
SIGNATURES = {
    "row_stats": lambda dt, stride="i32": {
        "logits_ptr": dt,
        "stride_logits": stride,
        "active_ptr": "*u8",
        "lse_ptr": "*fp32",
        "target_logit_ptr": "*fp32",
        **_COMMON,
    },
    "dlogits": lambda dt, stride="i32": {
        "logits_ptr": dt,
        "stride_logits": stride,
        "dlogits_ptr": dt,
        "stride_dlogits": stride,
        "grad_ptr": "*fp32",
        "lse_ptr": "*fp32",
        **_COMMON,
    },
}


def _compile(fn, signature, constexprs, options, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"enable_fp_fusion": True, **options},
    )


_CONFIGS = [(block, warps) for _, block, warps in triton_logprob.ROW_CONFIGS]


@pytest.mark.parametrize("kernel", list(SIGNATURES))
@pytest.mark.parametrize("block_v, num_warps", _CONFIGS)
def test_every_row_config_compiles_for_sm90(kernel, block_v, num_warps, monkeypatch, tmp_path):
    """Each config of ROW_CONFIGS is valid compiled Triton for bf16 logits (registers included)."""
    kernels = triton_logprob._kernels(False)
    fn = kernels.row_stats if kernel == "row_stats" else kernels.dlogits
    compiled = _compile(
        fn, SIGNATURES[kernel]("*bf16"), {"BLOCK_V": block_v}, {"num_warps": num_warps}, tmp_path, monkeypatch
    )
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("kernel", list(SIGNATURES))
def test_fp32_logits_compile_for_sm90(kernel, monkeypatch, tmp_path):
    kernels = triton_logprob._kernels(False)
    fn = kernels.row_stats if kernel == "row_stats" else kernels.dlogits
    compiled = _compile(
        fn, SIGNATURES[kernel]("*fp32", "i64"), {"BLOCK_V": 4096}, {"num_warps": 16}, tmp_path, monkeypatch
    )
    assert compiled.asm["cubin"]


def test_segment_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    sig = {
        "values_ptr": "*fp32",
        "active_ptr": "*u8",
        "cu_seqlens_ptr": "*i32",
        "sums_ptr": "*fp32",
        "counts_ptr": "*i64",
        "BLOCK": "constexpr",
    }
    fn = triton_logprob._kernels(False).segment_sums
    assert _compile(fn, sig, {"BLOCK": 1024}, {}, tmp_path, monkeypatch).asm["cubin"]
