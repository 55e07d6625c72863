"""tools/sass_mix.py: offline sm_90 compile of a moeflow kernel and the opcode mix of its loop (CPU only).

Also the properties of compiled kernels that the tool reads: the FP4 GEMV's loop, and the bf16 flat
persistent down (variant tma_flat) fusing its tile and K loops."""

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
    from moeflow.kernels.moe_gemm_quant import moe_down_w4_gemv_kernel
    from tools.sass_mix import compile_kernel, longest_loop, opcode_mix, sass_text

    consts = dict(stride_sk=1, FMT=1, G=32, HAS_BIAS=True, BLOCK_N=16, BLOCK_K=512, ASM=True)
    k = compile_kernel(moe_down_w4_gemv_kernel, GEMV_TYPES, consts, num_warps=8, div16=GEMV_DIV16)
    loop = opcode_mix(longest_loop(sass_text(k)))
    values_per_thread = 16 * 512 // (32 * 8)
    n = sum(loop.values())
    assert n > 0
    assert loop["FFMA"] + loop["FMUL"] >= values_per_thread, loop  # the fma chains: one product a value
    assert not any(op.startswith("SHFL") for op in loop), loop
    # a per-value decode in Triton (no PTX dot8) compiles to 8.2 instructions a value: this bound tells them apart
    assert n / values_per_thread < 7.0, (n, loop)


@needs_tools
def test_unknown_parameter_is_named():
    from moeflow.kernels.moe_gemm_quant import moe_down_w4_gemv_kernel
    from tools.sass_mix import compile_kernel

    with pytest.raises(ValueError, match="no_such_param"):
        compile_kernel(moe_down_w4_gemv_kernel, dict(GEMV_TYPES, no_such_param="*u8"), {})


def _flat_case(flat: bool):
    """(K-loop lines, (registers, spill bytes)) of the persistent bf16 TMA down at a prefill tile (BM 128 x
    BN 256 x BK 64, qwen3 T = 8192's table), FLAT on or off."""
    from moeflow.kernels.moe_gemm_tma import moe_down_tma_kernel as fn
    from tools.sass_mix import compile_kernel, gmma_loop, register_usage, sass_text

    types = dict(sorted_ptr="*i32", block_expert_ptr="*i32", ad="tensordesc<bf16[128,64]>",
                 ad_half="tensordesc<bf16[64,64]>", wd="tensordesc<bf16[256,64]>", y_ptr="*bf16")
    consts = dict(WS=False, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, HALF_TAIL=False)
    warps, stages, div16 = 8, 3, ("H", "I", "stride_yn")
    consts.update(PERSISTENT=True, NUM_PROGS=132, GROUP_M=8, PDL=True, FLAT=flat)
    k = compile_kernel(fn, types, consts, num_warps=warps, num_stages=stages, div16=div16)
    return gmma_loop(sass_text(k)), register_usage(k)


@needs_tools
def test_flat_persistent_down_is_one_loop_with_its_epilogue():
    """FLAT (moe_gemm_tma._down_flat, variant tma_flat): Triton fuses the tile loop and the K loop into one (the
    epilogue's stores sit in the wgmma loop, under a branch), which the plain persistent form does not; the
    same wgmmas a K step, no spill. A change that puts an `if` around the K loop (or makes its bounds depend
    on the tile) stops the fusion silently: this fails."""
    tiled, (_, spill_tiled) = _flat_case(False)
    flat, (regs, spill) = _flat_case(True)

    def count(lines, what):
        return sum(what in line for line in lines)

    assert count(tiled, "STG") == 0 and count(flat, "STG") > 0, "\n".join(flat)
    assert count(flat, "GMMA") == count(tiled, "GMMA") > 0, "\n".join(flat)
    assert count(flat, "UTMALDG") == count(tiled, "UTMALDG") > 0
    assert spill == 0 == spill_tiled and regs <= 255, (regs, spill)
