"""benchmarks/sass_mix.py: offline sm_90 compile of a moeflow kernel and the opcode mix of its loop (CPU only)."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _tools_present() -> bool:
    if not HAS_TRITON:
        return False
    from triton.backends.nvidia import compiler as nvc

    bin_dir = os.path.join(os.path.dirname(nvc.__file__), "bin")
    return all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "nvdisasm"))


needs_tools = pytest.mark.skipif(not _tools_present(), reason="triton with its bundled ptxas / nvdisasm not installed")

GEMV_TYPES = dict(act_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", s2_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16",
                  ids_ptr="*i32")
GEMV_DIV16 = ("H", "I", "stride_an", "stride_we", "stride_wn", "stride_se", "stride_be", "stride_yn")


@needs_tools
def test_gemv_loop_runs_the_dot8_asm_and_no_shuffles():
    """The FP4 GEMV's K loop, as compiled for sm_90: packed words through the PTX dot8 (f16 -> f32
    conversions and fma chains), activations in registers (no per-step cross-thread shuffles)."""
    from benchmarks.sass_mix import compile_kernel, longest_loop, opcode_mix, sass_text
    from moeflow.kernels.moe_gemm_quant import moe_down_w4_gemv_kernel

    consts = dict(stride_sk=1, FMT=1, G=32, HAS_BIAS=True, BLOCK_N=16, BLOCK_K=512, ASM=True)
    k = compile_kernel(moe_down_w4_gemv_kernel, GEMV_TYPES, consts, num_warps=8, div16=GEMV_DIV16)
    loop = opcode_mix(longest_loop(sass_text(k)))
    values_per_thread = 16 * 512 // (32 * 8)
    n = sum(loop.values())
    assert n > 0
    assert loop["FFMA"] + loop["FMUL"] >= values_per_thread, loop  # the fma chains: one product a value
    assert not any(op.startswith("SHFL") for op in loop), loop
    # 8.2 instructions a value before the rewrite (RESULTS.md, 2026-12-03 seventh session)
    assert n / values_per_thread < 7.0, (n, loop)


@needs_tools
def test_unknown_parameter_is_named():
    from benchmarks.sass_mix import compile_kernel
    from moeflow.kernels.moe_gemm_quant import moe_down_w4_gemv_kernel

    with pytest.raises(ValueError, match="no_such_param"):
        compile_kernel(moe_down_w4_gemv_kernel, dict(GEMV_TYPES, no_such_param="*u8"), {})
