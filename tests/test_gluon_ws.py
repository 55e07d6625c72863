"""The warp-specialised Gluon gate_up and down GEMMs (moeflow/kernels/moe_gemm_ws.py; issue 16 item 1).

CPU: their tile choice, and an offline sm_90a compile (Triton's bundled ptxas / nvdisasm): three
partitions with their register budgets, the consumers' K loop (one ring wait, the wgmmas, one
release), the gate_up producer's row copies handed over after a proxy fence, no spills. The GPU test
(the experts step with them against the Triton TMA kernels, bit for bit, and under CUDA-graph replay)
is tests/test_experts_triton.py::test_gpu_ws_kernels_equal_the_triton_kernels_bitwise.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _gluon_tools() -> bool:
    if not HAS_TRITON:
        return False
    try:
        from triton.backends.nvidia import compiler as nvc
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    bin_dir = os.path.join(os.path.dirname(nvc.__file__), "bin")
    return all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "nvdisasm"))


needs_gluon = pytest.mark.skipif(not _gluon_tools(), reason="triton with Gluon and its bundled ptxas / nvdisasm "
                                                             "not installed")


def test_tiles_follow_the_plan_within_the_accumulator_budget():
    from moeflow.experts.triton_ws import ws_down_tiles

    bf16 = torch.bfloat16
    # qwen3 down (H 2048, I 768), the plan's BM 128 x BN 256: 64-row tiles of BN 256 (128 f32 a thread);
    # a stage is (64 + 256) x 64 x 2 bytes = 40 KB: 5 stages in 200 KB
    assert ws_down_tiles(128, 256, 64, 2048, 768, bf16) == (128, 256, 64, 5)
    assert ws_down_tiles(64, 256, 64, 7168, 2048, bf16) == (64, 256, 64, 5)
    assert ws_down_tiles(128, 64, 128, 4096, 14336, torch.float16) == (128, 64, 128, 6)  # 32 KB a stage
    # gpt-oss (matmul, H 2880): the plan's BN 128, the last of 23 tiles running past H (TMA fills zeros)
    assert ws_down_tiles(128, 128, 64, 2880, 2880, bf16, "matmul") == (128, 128, 64, 6)
    # linear, the same H: tiles must divide it (the view runs on into the next expert): 64 does
    assert ws_down_tiles(128, 128, 64, 2880, 2880, bf16, "linear") == (128, 64, 64, 6)
    # refused: decode tiles, no column tile dividing H, neither BK nor 64 dividing I, f32 (no bf16 wgmma)
    assert ws_down_tiles(16, 64, 256, 2048, 768, bf16) is None
    assert ws_down_tiles(128, 128, 64, 2888, 768, bf16) is None
    assert ws_down_tiles(128, 128, 64, 2048, 712, bf16) is None
    # the plan's BK 128 does not divide gpt-oss's I 2880: BK 64 does (the same bits)
    assert ws_down_tiles(64, 128, 128, 2880, 2880, bf16, "matmul") == (64, 128, 64, 6)
    assert ws_down_tiles(128, 128, 128, 2048, 704, bf16) == (128, 128, 64, 6)
    assert ws_down_tiles(128, 128, 64, 2048, 768, torch.float32) is None


def test_gate_up_tiles():
    from moeflow.experts.triton_ws import ws_gate_up_tiles

    bf16 = torch.bfloat16
    # a stage: 64 rows + gate and up boxes of BN 128, BK 64: 40 KB, 5 in 200 KB
    assert ws_gate_up_tiles(128, 128, 64, 2048, 768, bf16, "silu") == (128, 128, 64, 5)
    # BK 128 would leave 2 stages: BK 64 instead (the same bits); BN 256 narrowed to 128
    assert ws_gate_up_tiles(128, 256, 128, 7168, 2048, bf16, "silu") == (128, 128, 64, 5)
    assert ws_gate_up_tiles(64, 64, 128, 4096, 14336, bf16, "gelu_tanh") == (64, 64, 128, 4)  # 48 KB a stage
    # gpt-oss: matmul layout, interleaved gate / up; BN 128 (one m64 x 256 wgmma chain), 23 column tiles
    assert ws_gate_up_tiles(128, 128, 64, 2880, 2880, bf16, "gptoss", "matmul", True) == (128, 128, 64, 5)
    # refused: matmul without the interleave, linear with it, decode tiles, no column tile dividing I
    assert ws_gate_up_tiles(128, 128, 64, 2880, 2880, bf16, "gptoss", "matmul", False) is None
    assert ws_gate_up_tiles(128, 128, 64, 2048, 768, bf16, "silu", "linear", True) is None
    assert ws_gate_up_tiles(16, 64, 128, 2048, 768, bf16, "silu") is None
    assert ws_gate_up_tiles(128, 128, 64, 2048, 708, bf16, "silu") is None


def test_cooperative_tiles():
    """The cooperative schedule: a stage holds 128 act rows (fewer stages), BM 128 plans only."""
    from moeflow.experts.triton_ws import ws_down_tiles, ws_gate_up_tiles

    bf16 = torch.bfloat16
    # (128 + 256) x 64 x 2 bytes = 48 KB a stage: 4 in 200 KB
    assert ws_down_tiles(128, 256, 64, 2048, 768, bf16, coop=True) == (128, 256, 64, 4)
    assert ws_gate_up_tiles(128, 128, 64, 2048, 768, bf16, "silu", coop=True) == (128, 128, 64, 4)
    assert ws_down_tiles(64, 256, 64, 2048, 768, bf16, coop=True) is None
    assert ws_gate_up_tiles(64, 128, 64, 2048, 768, bf16, "silu", coop=True) is None


def test_off_by_default_and_never_on_cpu_tensors():
    import moeflow.experts.triton as TE
    from moeflow.experts.triton_ws import ws_device_ok, ws_rows_ok

    # slower than the Triton kernels at most prefill points (H100): nothing launches them by default
    assert TE.WS_DOWN is False and TE.WS_GATE_UP is False
    assert ws_rows_ok(torch.empty(4, 64, dtype=torch.bfloat16), torch.bfloat16)
    assert not ws_rows_ok(torch.empty(4, 60, dtype=torch.bfloat16), torch.bfloat16)  # 120-byte rows
    assert not ws_rows_ok(torch.empty(4, 64), torch.bfloat16)
    assert ws_device_ok(torch.empty(4, 4)) is False  # the interpreter never gets a Gluon launch


def _compile(bm: int, bn: int, bk: int, stages: int, matmul: bool, coop: bool = False, pace: bool = False):
    from benchmarks.sass_mix import compile_kernel, gluon_desc_type
    from moeflow.kernels.moe_gemm_ws import moe_down_ws_kernel

    types = dict(ad=gluon_desc_type("bf16", [128 if coop else 64, bk]), wd=gluon_desc_type("bf16", [bk, bn] if matmul else [bn, bk]),
                 y_ptr="*bf16", b_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32")
    consts = dict(BLOCK_M=bm, MATMUL=matmul, HAS_BIAS=matmul, NUM_PROGS=132, GROUP_M=8, STAGES=stages, PACE=pace,
                  num_warps=4)
    return compile_kernel(moe_down_ws_kernel, types, consts, num_warps=4, div16=("H", "I", "stride_yn"))


@needs_gluon
@pytest.mark.parametrize("bm,bn,bk,stages,matmul,coop,pace", [
    (128, 256, 64, 5, False, False, False), (64, 128, 64, 6, False, False, False), (128, 128, 64, 6, True, False, False),
    (128, 256, 64, 4, False, True, False), (128, 128, 64, 5, True, True, False), (128, 256, 64, 4, False, True, True)])
def test_ws_down_compiles_to_three_partitions_with_a_lean_k_loop(bm, bn, bk, stages, matmul, coop, pace):
    from benchmarks.sass_mix import gmma_loop, opcode_mix, sass_text

    k = _compile(bm, bn, bk, stages, matmul, coop, pace)
    sass = sass_text(k)
    ptx = k.asm["ptx"]
    # 4 consumer warps + 4 consumer warps + 1 producer warp, padded to whole warp groups
    assert ".reqntid 384" in ptx, ptx[:2000]
    # CUTLASS's register split: both consumer warp groups at 232, the producer's at 40
    assert "setmaxnreg.dec.sync.aligned.u32 \t40;" in ptx
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t232;") >= 1
    assert "setmaxnreg.dec.sync.aligned.u32 \t232;" in ptx  # the default partition, from its parent region
    assert "STL" not in sass and "LDL" not in sass  # no spills
    lines = gmma_loop(sass)
    loop = opcode_mix(lines)
    # one consumer's K step on its 64 rows (ping-pong: a tile; cooperative: half the stage's 128 rows):
    # m64 x BN x k16 wgmmas, BK / 16 deep, and no other shape
    assert sum(f"HGMMA.64x{bn}x16.F32.BF16 " in ln for ln in lines) == bk // 16, loop
    assert sum("GMMA." in ln for ln in lines) == bk // 16, loop
    assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1, loop  # the ring stage's "ready" wait
    assert loop["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, loop  # the previous stage's release
    assert sum(loop.values()) < 100, loop
    # the producer's TMA copies a stage: the act box, and the weight box in copies of at most 128 bytes of
    # inner dimension (the 128-byte swizzle's width: the matmul box [BK, BN] has 2 * BN bytes a row)
    copies = ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes")
    assert copies == 1 + (2 * bn // 128 if matmul else 1), copies


@needs_gluon
@pytest.mark.parametrize("bm,bn,bk,stages,act,matmul,coop,pace", [
    (128, 128, 64, 5, 0, False, False, False), (64, 64, 128, 4, 1, False, False, False),
    (128, 128, 64, 5, 3, True, False, False), (128, 128, 64, 4, 0, False, True, False),
    (128, 128, 64, 4, 3, True, True, False), (128, 128, 64, 4, 0, False, True, True)])
def test_ws_gate_up_compiles_with_fenced_row_copies(bm, bn, bk, stages, act, matmul, coop, pace):
    from benchmarks.sass_mix import compile_kernel, gluon_desc_type, gmma_loop, opcode_mix, sass_text
    from moeflow.kernels.moe_gemm_ws import moe_gate_up_ws_kernel

    box = [bk, 2 * bn] if matmul else [bn, bk]  # gpt-oss: one interleaved box; linear: gate and up boxes
    types = dict(x_ptr="*bf16", wd=gluon_desc_type("bf16", box), act_ptr="*bf16", b_ptr="*bf16", sorted_ptr="*i32",
                 block_expert_ptr="*i32", limit="fp32", alpha="fp32")
    consts = dict(ACT=act, BLOCK_M=bm, MATMUL=matmul, HAS_BIAS=matmul, NUM_PROGS=132, GROUP_M=8, STAGES=stages,
                  COOP=coop, PACE=pace, num_warps=4)
    k = compile_kernel(moe_gate_up_ws_kernel, types, consts, num_warps=4,
                       div16=("H", "I", "stride_xt", "stride_ap"))
    sass, ptx = sass_text(k), k.asm["ptx"]
    assert ".reqntid 384" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t56;" in ptx  # the producer warp group
    assert "setmaxnreg.inc.sync.aligned.u32 \t224;" in ptx and "setmaxnreg.dec.sync.aligned.u32 \t224;" in ptx
    assert "STL" not in sass and "LDL" not in sass
    lines = gmma_loop(sass)
    loop = opcode_mix(lines)
    # a consumer's K step: one chain of m64 x 2BN x k16 wgmmas over the gate and up halves, BK / 16 deep
    assert sum(f"HGMMA.64x{2 * bn}x16.F32.BF16 " in ln for ln in lines) == bk // 16, loop
    assert sum("GMMA." in ln for ln in lines) == bk // 16, loop
    # splitting gate from up is a register renaming: the consumers' epilogues touch no shared memory
    # (the only STS / LDS: the parent region's block count and the partitions' captured arguments)
    assert sass.count("STS") + sass.count("LDS ") + sass.count("LDS.") < 30
    assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and loop["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, loop
    # the producer: 16-byte row copies, then wait for the copies of two stages ago, fence them into the
    # async proxy on every thread, and only then the one arrival
    rows_per_thread = (128 if coop else 64) * bk // (128 * 8)
    assert ptx.count("cp.async.cg.shared.global") == rows_per_thread, ptx.count("cp.async.cg.shared.global")
    i = ptx.index("cp.async.wait_group \t2;")
    tail = ptx[i:ptx.index("mbarrier.arrive.shared::cta.b64", i)]
    assert tail.index("fence.proxy.async.shared::cta") < tail.rindex("bar.sync"), tail
    # the weight copies: a gate and an up box (linear); gpt-oss's one [BK, 2BN] box goes as 128-byte-wide
    # sub-boxes, which Triton spreads over the producer's 4 warps (one copy instruction, a warp's offset each)
    tma_copies = ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes")
    assert tma_copies == (1 if matmul else 2), tma_copies


def test_fp8_ws_down_tiles():
    from moeflow.experts.triton_ws import fp8_ws_down_tiles

    # deepseek-v3: a consumer's 128 columns, tiles of 64 x 256, 5 stages of 40 KB
    assert fp8_ws_down_tiles(64, 128, 128, 7168, 2048, 128) == (128, 128, 5)
    assert fp8_ws_down_tiles(64, 256, 128, 2048, 768, 128) == (128, 128, 5)  # BN capped at 128 (registers)
    assert fp8_ws_down_tiles(128, 128, 128, 7168, 2048, 128) is None  # BM 128 plans keep the Triton kernel
    assert fp8_ws_down_tiles(64, 128, 128, 7168, 2000, 128) is None  # BK does not divide I
    assert fp8_ws_down_tiles(64, 128, 128, 96, 2048, 128) == (16, 128, 6)  # H 96: the widest 2BN dividing it


def _compile_fp8_down(bn: int, bk: int, stages: int, dynamic: bool):
    """moe_gemm_fp8_ws's down kernel compiled offline for sm_90a: 64-row act box, weight box [2BN, BK];
    dynamic: moe_down_fp8_ws_dyn_kernel (tiles claimed from a counter), else moe_down_fp8_ws_kernel."""
    from benchmarks.sass_mix import compile_kernel, gluon_desc_type
    from moeflow.kernels.moe_gemm_fp8_ws import moe_down_fp8_ws_dyn_kernel, moe_down_fp8_ws_kernel

    types = dict(ad=gluon_desc_type("fp8e4nv", [64, bk]), wd=gluon_desc_type("fp8e4nv", [2 * bn, bk]), as_ptr="*fp32",
                 ws_ptr="*fp32", y_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32")
    consts = dict(GROUP_M=8, STAGES=stages, num_warps=4)
    if dynamic:
        kernel, types["counter_ptr"] = moe_down_fp8_ws_dyn_kernel, "*i32"
    else:
        kernel, consts["NUM_PROGS"] = moe_down_fp8_ws_kernel, 132
    return compile_kernel(kernel, types, consts, num_warps=4, div16=("H", "I", "stride_yn", "stride_as"))


@needs_gluon
@pytest.mark.parametrize("bn,stages", [(128, 5), (64, 6)])
def test_fp8_ws_down_compiles_with_the_scaling_off_the_other_consumer(bn, stages):
    """moe_gemm_fp8_ws.moe_down_fp8_ws_kernel (sm_90a, offline; weight box [2BN, BK], a consumer's BN columns):
    three partitions with CUTLASS's register split, no spill; a consumer's K step is one ring wait, BK / 32
    m64 x BN x k32 e4m3 wgmmas, their wait, one release and BN / 2 FFMAs (product x scale into the sum); its
    only barrier is its own warp group's (128 threads), never the CTA's, so the other consumer's wgmmas run
    during the scaling."""
    from benchmarks.sass_mix import gmma_loop, opcode_mix, sass_text

    bk = 128
    k = _compile_fp8_down(bn, bk, stages, dynamic=False)
    ptx, sass = k.asm["ptx"], sass_text(k)
    assert ".reqntid 384" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t40;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t232;" in ptx
    assert "STL" not in sass and "LDL" not in sass
    lines = gmma_loop(sass)
    loop = opcode_mix(lines)
    assert sum(f"QGMMA.64x{bn}x32.F32.E4M3.E4M3 " in ln for ln in lines) == bk // 32, loop
    assert sum("GMMA." in ln for ln in lines) == bk // 32, loop
    assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and loop["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, loop
    assert loop["WARPGROUP.DEPBAR.LE"] == 1, loop
    assert loop["FFMA"] == bn // 2, loop
    bars = [ln for ln in lines if "BAR.SYNC" in ln]
    assert all(", 0x80" in ln for ln in bars), bars  # warp-group barriers (128 threads) only


def test_fp8_ws_gate_up_stages():
    from moeflow.experts.triton_ws import fp8_ws_gate_up_stages

    assert fp8_ws_gate_up_stages(64, 128, 128, 7168, 2048, 128, "silu") == 5  # 5 stages of 40 KB
    assert fp8_ws_gate_up_stages(64, 64, 128, 7168, 2048, 128, "silu") is None  # a tile is one 128-column group
    assert fp8_ws_gate_up_stages(128, 128, 128, 7168, 2048, 128, "silu") is None  # BM 64 plans only
    assert fp8_ws_gate_up_stages(64, 128, 128, 7168, 2048, 128, "relu2") is None  # no Gluon form of it


@needs_gluon
@pytest.mark.parametrize("act", [0, 2])
def test_fp8_ws_gate_up_compiles_with_the_scaling_off_the_other_consumer(act):
    """moe_gemm_fp8_ws.moe_gate_up_fp8_ws_kernel (sm_90a, offline): no spill; a K step of a half is one ring
    wait, 4 m64 x 128 x k32 e4m3 wgmmas (gate 64 | up 64 columns), their wait, one release and 64 FFMAs with no
    select left (the gate / up scale is static per register), warp-group barriers only; the producer warp
    group's row copies are fenced before the hand-over."""
    from benchmarks.sass_mix import compile_kernel, gluon_desc_type, gmma_loop, opcode_mix, sass_text
    from moeflow.kernels.moe_gemm_fp8_ws import moe_gate_up_fp8_ws_kernel

    types = dict(xq_ptr="*fp8e4nv", xs_ptr="*fp32", wd=gluon_desc_type("fp8e4nv", [64, 128]), ws_ptr="*fp32",
                 aq_ptr="*fp8e4nv", as_ptr="*fp32", sorted_ptr="*i32", block_expert_ptr="*i32", limit="fp32",
                 alpha="fp32")
    k = compile_kernel(moe_gate_up_fp8_ws_kernel, types, dict(ACT=act, NUM_PROGS=132, GROUP_M=8, STAGES=5,
                                                              num_warps=4),
                       num_warps=4, div16=("H", "I", "stride_xq", "stride_aq"))
    ptx, sass = k.asm["ptx"], sass_text(k)
    assert "STL" not in sass and "LDL" not in sass
    assert "fence.proxy.async.shared::cta" in ptx  # the row copies handed to the async proxy
    lines = gmma_loop(sass)
    loop = opcode_mix(lines)
    assert sum("QGMMA.64x128x32.F32.E4M3.E4M3 " in ln for ln in lines) == 4, loop
    assert sum("GMMA." in ln for ln in lines) == 4, loop
    assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and loop["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, loop
    assert loop["FFMA"] == 64 and not any(op.startswith(("FSEL", "SEL")) for op in loop), loop
    bars = [ln for ln in lines if "BAR.SYNC" in ln]
    assert all(", 0x80" in ln for ln in bars), bars


@needs_gluon
@pytest.mark.parametrize("grid", [False, True])
def test_ws_tile_grid_launches_one_cta_a_tile(grid, monkeypatch):
    """triton_ws.WS_TILE_GRID: the Gluon launchers' grid (and NUM_PROGS, the kernels' tile stride) is every tile
    the used blocks could have (max_blocks x row tiles a block x column tiles), else the SM count; recorded from
    the launch (the kernels replaced by a recorder: no GPU here)."""
    import moeflow.experts.triton_ws as TW
    import moeflow.kernels.moe_gemm_fp8_ws as K8
    import moeflow.kernels.moe_gemm_ws as KW

    launches = []

    class Recorder:
        def __getitem__(self, grid_):
            def launch(*args, **kw):
                launches.append((grid_, kw["NUM_PROGS"]))
            return launch

    for mod, name in ((K8, "moe_down_fp8_ws_kernel"), (K8, "moe_gate_up_fp8_ws_kernel"), (KW, "moe_down_ws_kernel"),
                      (KW, "moe_gate_up_ws_kernel")):
        monkeypatch.setattr(mod, name, Recorder())
    monkeypatch.setattr(TW, "WS_TILE_GRID", grid)
    E, H, I, P, N, max_blocks, sms = 4, 512, 256, 640, 600, 10, 132
    f8, bf = torch.float8_e4m3fn, torch.bfloat16
    i32 = torch.zeros(P, dtype=torch.int32)
    # fp8 down: tiles 64 x 2BN, BN 128 -> 512 / 256 = 2 column tiles a block
    TW.launch_down_fp8_ws(torch.zeros(P, I, dtype=f8), torch.zeros(P, I // 128), torch.zeros(E, H, I, dtype=f8),
                          torch.zeros(E, H // 128, I // 128), torch.zeros(N, H, dtype=bf), i32, i32, N, max_blocks,
                          128, (128, 128, 5), 8, sms)
    # fp8 gate_up: one 128-column group a tile -> 256 / 128 = 2
    TW.launch_gate_up_fp8_ws(torch.zeros(N, H, dtype=f8), torch.zeros(N, H // 128), torch.zeros(E, 2 * I, H, dtype=f8),
                             torch.zeros(E, 2 * I // 128, H // 128), torch.zeros(P, I, dtype=f8),
                             torch.zeros(P, I // 128), i32, i32, N, 1, max_blocks, 128, 128, 5, "silu", 0.0, 1.0, 8,
                             sms)
    # bf16 down, ping-pong BM 128 (two 64-row tiles a block), BN 128 -> 4 column tiles
    TW.launch_down_ws(torch.zeros(P, I, dtype=bf), torch.zeros(E, H, I, dtype=bf), None, torch.zeros(N, H, dtype=bf),
                      i32, i32, N, max_blocks, (128, 128, 64, 4), "linear", 8, sms)
    # bf16 gate_up, cooperative BM 128 (one tile a block), BN 64 -> 4 column tiles
    TW.launch_gate_up_ws(torch.zeros(N, H, dtype=bf), torch.zeros(E, 2 * I, H, dtype=bf), None,
                         torch.zeros(P, I, dtype=bf), i32, i32, N, 1, max_blocks, (128, 64, 64, 4), "linear", "silu",
                         0.0, 1.0, 8, sms, coop=True)
    want = [max_blocks * 2, max_blocks * 2, max_blocks * 2 * 4, max_blocks * 4] if grid else [sms] * 4
    assert [g[0] for g, _ in launches] == want, launches
    assert [n for _, n in launches] == want, launches


@needs_gluon
def test_fp8_ws_dynamic_down_compiles():
    """moe_gemm_fp8_ws.moe_down_fp8_ws_dyn_kernel (sm_90a, offline): no spill; the producer claims tiles with one
    global atomic (one thread's) each; the consumers' K step is the static kernel's (one ring wait, BK / 32
    wgmmas, one release, BN / 2 FFMAs, warp-group barriers only)."""
    from benchmarks.sass_mix import gmma_loop, opcode_mix, sass_text

    bk, bn = 128, 128
    sass = sass_text(_compile_fp8_down(bn, bk, 5, dynamic=True))
    assert "STL" not in sass and "LDL" not in sass
    atoms = [ln for ln in sass.splitlines() if "ATOMG.E.ADD" in ln]
    assert len(atoms) == 2 and all(ln.strip().split()[1].startswith("@P") for ln in atoms), atoms  # first, next
    lines = gmma_loop(sass)
    loop = opcode_mix(lines)
    assert sum(f"QGMMA.64x{bn}x32.F32.E4M3.E4M3 " in ln for ln in lines) == bk // 32, loop
    assert loop["SYNCS.PHASECHK.TRANS64.TRYWAIT"] == 1 and loop["SYNCS.ARRIVE.TRANS64.A1T0"] == 1, loop
    assert loop["FFMA"] == bn // 2, loop
    assert all(", 0x80" in ln for ln in lines if "BAR.SYNC" in ln)
