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


FP8_GU_TYPES = dict(xq_ptr="*fp8e4nv", xs_ptr="*fp32", ws_ptr="*fp32", aq_ptr="*fp8e4nv", as_ptr="*fp32",
                    sorted_ptr="*i32", block_expert_ptr="*i32", limit="fp32", alpha="fp32")
BF16_GU_TYPES = dict(x_ptr="*bf16", act_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32", limit="fp32",
                     alpha="fp32")


def _gate_up_loop(fused: bool, fp8: bool):
    """(K-loop lines, whole SASS, (registers, spill bytes)) of a TMA gate_up kernel at its prefill
    tiles: fp8 BM 64, BN 128, BK 128, 8 warps, 4 stages; bf16 BM 128, BN 128, BK 64, 8 warps, 4 stages."""
    from benchmarks.sass_mix import compile_kernel, gmma_loop, register_usage, sass_text

    if fp8:
        from moeflow.kernels.moe_gemm_fp8_tma import moe_gate_up_fp8_tma_kernel as fn

        bm, bn, bk, ty = 64, 128, 128, "fp8e4nv"
        types = dict(FP8_GU_TYPES)
        consts = dict(ACT=0, SCALE_E8M0=False, PERSISTENT=False, NUM_PROGS=1)
        div16 = ("H", "I", "stride_xq", "stride_aq")
    else:
        from moeflow.kernels.moe_gemm_tma import moe_gate_up_tma_kernel as fn

        bm, bn, bk, ty = 128, 128, 64, "bf16"
        types = dict(BF16_GU_TYPES)
        consts = dict(ACT=0, PERSISTENT=False, WS=False, NUM_PROGS=1, HALF_TAIL=False, xd=None, xd_half=None)
        div16 = ("H", "I", "stride_xt", "stride_ap")
    types["wd"] = f"tensordesc<{ty}[1,{bn // 8},2,8,{bk}]>" if fused else f"tensordesc<{ty}[{bn},{bk}]>"
    consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PDL=True, FUSED=fused)
    k = compile_kernel(fn, types, consts, num_warps=8, num_stages=4, div16=div16)
    sass = sass_text(k)
    return gmma_loop(sass), sass, register_usage(k)


@needs_tools
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_fused_gate_up_issues_half_the_wgmmas_twice_as_wide(fp8):
    """moe_gemm_tma.py FUSED: one [BM, 2BN] dot a K step compiles (sm_90a) to half as many wgmmas of
    twice the N, no more waits (fp8: one a step instead of two), no spill, no select or shared-memory traffic added to the K loop,
    and an epilogue split without a shared-memory round trip (as many STS as the two-dot form)."""
    two, sass_two, (regs_two, spill_two) = _gate_up_loop(False, fp8)
    one, sass_one, (regs_one, spill_one) = _gate_up_loop(True, fp8)
    wide, narrow = (("QGMMA.64x128x32", "QGMMA.64x64x32") if fp8 else ("HGMMA.64x256x16", "HGMMA.64x128x16"))

    def count(lines, what):  # instructions in the loop whose text holds `what` (opcode and shape)
        return sum(what in line for line in lines)

    assert count(two, narrow) > 0 and count(two, wide) == 0, "\n".join(two)
    assert count(one, wide) == count(two, narrow) // 2 and count(one, narrow) == 0, "\n".join(one)
    # fp8 waits on each scaled product (two waits a step before); bf16's chained dots wait once either way
    waits_one, waits_two = count(one, "WARPGROUP.DEPBAR"), count(two, "WARPGROUP.DEPBAR")
    assert waits_one * 2 == waits_two if fp8 else waits_one <= waits_two, "\n".join(one)
    assert spill_one == 0 and spill_two == 0, (spill_one, spill_two)
    assert regs_one <= max(regs_two, 255), (regs_one, regs_two)
    for op in (" FSEL ", " STS", " LDS"):
        assert count(one, op) <= count(two, op), (op, "\n".join(one))
    assert sass_one.count("STS") == sass_two.count("STS"), "the fused epilogue's split went through shared memory"


def _flat_case(which: str, flat: bool):
    """(K-loop lines, (registers, spill bytes)) of a persistent TMA GEMM at its prefill tiles, FLAT on or off:
    bf16 down BM 128 x BN 256 x BK 64 (qwen3 T = 8192's table), fp8 down BM 64 x 128 x 128, fp8 fused
    gate_up BM 64 x 128 x 128 (quant_tile_config's prefill tiles)."""
    from benchmarks.sass_mix import compile_kernel, gmma_loop, register_usage, sass_text

    common = dict(sorted_ptr="*i32", block_expert_ptr="*i32")
    if which == "bf16_down":
        from moeflow.kernels.moe_gemm_tma import moe_down_tma_kernel as fn

        types = dict(common, ad="tensordesc<bf16[128,64]>", ad_half="tensordesc<bf16[64,64]>",
                     wd="tensordesc<bf16[256,64]>", y_ptr="*bf16")
        consts = dict(WS=False, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, HALF_TAIL=False)
        warps, stages, div16 = 8, 3, ("H", "I", "stride_yn")
    elif which == "fp8_down":
        from moeflow.kernels.moe_gemm_fp8_tma import moe_down_fp8_tma_kernel as fn

        types = dict(common, ad="tensordesc<fp8e4nv[64,128]>", wd="tensordesc<fp8e4nv[128,128]>", as_ptr="*fp32",
                     ws_ptr="*fp32", y_ptr="*bf16")
        consts = dict(SCALE_E8M0=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128)
        warps, stages, div16 = 4, 4, ("H", "I", "stride_yn")
    else:
        from moeflow.kernels.moe_gemm_fp8_tma import moe_gate_up_fp8_tma_kernel as fn

        types = dict(FP8_GU_TYPES, wd="tensordesc<fp8e4nv[1,16,2,8,128]>")
        consts = dict(ACT=0, SCALE_E8M0=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, FUSED=True)
        warps, stages, div16 = 8, 4, ("H", "I", "stride_xq", "stride_aq")
    consts.update(PERSISTENT=True, NUM_PROGS=132, GROUP_M=8, PDL=True, FLAT=flat)
    k = compile_kernel(fn, types, consts, num_warps=warps, num_stages=stages, div16=div16)
    return gmma_loop(sass_text(k)), register_usage(k)


@needs_tools
@pytest.mark.parametrize("which", ["bf16_down", "fp8_down", "fp8_gate_up"])
def test_flat_persistent_gemm_is_one_loop_with_its_epilogue(which):
    """FLAT (moe_gemm_tma._down_flat, moe_gemm_fp8_tma._fp8_down_flat / _fp8_gate_up_flat): Triton fuses the
    tile loop and the K loop into one (the epilogue's stores sit in the wgmma loop, under a branch), which
    the plain persistent form does not; the same wgmmas a K step, no spill. A change that puts an `if`
    around the K loop (or makes its bounds depend on the tile) stops the fusion silently: this fails."""
    tiled, (_, spill_tiled) = _flat_case(which, False)
    flat, (regs, spill) = _flat_case(which, True)

    def count(lines, what):
        return sum(what in line for line in lines)

    assert count(tiled, "STG") == 0 and count(flat, "STG") > 0, "\n".join(flat)
    assert count(flat, "GMMA") == count(tiled, "GMMA") > 0, "\n".join(flat)
    assert count(flat, "UTMALDG") == count(tiled, "UTMALDG") > 0
    assert spill == 0 == spill_tiled and regs <= 255, (regs, spill)
