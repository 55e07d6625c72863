"""The warp-specialised Gluon fp8 gate_up GEMM (moeflow/kernels/moe_gemm_fp8_gluon.py).

CPU: its stage choice, the launcher's grid, and an offline sm_90a compile (Triton's bundled ptxas /
nvdisasm): no spills, a consumer's K step of one ring wait, the wgmmas, one release and the scaling FFMAs,
warp-group barriers only, the producer's row copies fenced before the hand-over. The GPU test (against the
Triton TMA kernel, bit for bit) is
tests/test_experts_triton_quant.py::test_gpu_fp8_ws_kernels_equal_the_tma_kernels_bitwise; its
synchronisation is model-checked in tests/test_ws_protocol.py.
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


def _dsv3_fp8(T: int = 8192, **kw):
    from moeflow.experts.plan import StepShape

    return StepShape(fmt="fp8_block", dtype="bfloat16", num_experts=256, tiling_experts=256, hidden_size=7168,
                     intermediate_size=2048, top_k=8, tokens=T, pairs=T * 8, group=128, scale_block_n=128, **kw)


def _gluon_tiles():
    from moeflow.tuning import GemmTile, MoETileConfig

    return MoETileConfig(block_m=64, gate_up=GemmTile(block_n=128, block_k=128, num_warps=8, num_stages=4, group_m=16),
                         down=GemmTile(block_n=128, block_k=128, num_warps=4, num_stages=4, group_m=16))


def test_where_the_plan_runs_it():
    """The plan's fp8_gluon variant: Hopper with Gluon, f32 scales, 16-byte rows for the producer's cp.async,
    never the batch-invariant mode or the interpreter; on an H100 at deepseek-v3 T = 8192 the rule takes it."""
    import dataclasses

    from moeflow.experts.plan import NAMED_DEVICES, plan_step

    h100 = NAMED_DEVICES["h100"]

    def gate_up(shape, device=h100):
        p = plan_step(shape, device, tile_config=_gluon_tiles())
        return p.stage("gate_up").variant, dict(((st, n), w) for st, n, w in p.refused)

    assert gate_up(_dsv3_fp8())[0] == "fp8_gluon"
    v, why = gate_up(_dsv3_fp8(scale_f32=False))
    assert v == "fp8_tma" and why[("gate_up", "fp8_gluon")] == "UE8M0 weight scales"
    v, why = gate_up(dataclasses.replace(_dsv3_fp8(), hidden_size=7168 + 16))  # BK 128 must divide H
    assert v != "fp8_gluon" and "BK" in why[("gate_up", "fp8_gluon")]
    v, why = gate_up(_dsv3_fp8(batch_invariant=True))
    assert v != "fp8_gluon" and "batch-invariant" in why[("gate_up", "fp8_gluon")]
    for dev in (NAMED_DEVICES["a100"], NAMED_DEVICES["cpu"]):  # no Gluon launch before sm_90 or in the interpreter
        v, why = gate_up(_dsv3_fp8(), dev)
        assert v != "fp8_gluon" and "sm_90" in why[("gate_up", "fp8_gluon")]


def test_fp8_gluon_gate_up_stages():
    import dataclasses

    from moeflow.experts.options import KernelOptions
    from moeflow.experts.plan import NAMED_DEVICES, Ctx, gluon_gate_up_stages
    from moeflow.tuning.rules import load_rules

    def stages(tiles, shape=None):
        return gluon_gate_up_stages(Ctx(shape or _dsv3_fp8(), NAMED_DEVICES["h100"], KernelOptions(), tiles,
                                        load_rules()))

    t = _gluon_tiles()
    assert stages(t) == 5  # 5 stages of (64 + 256) x 128 bytes in 200 KB
    assert stages(dataclasses.replace(t, gate_up=dataclasses.replace(t.gate_up, block_n=64))) is None  # one group
    assert stages(dataclasses.replace(t, block_m=128)) is None  # BM 64 plans only
    assert stages(t, dataclasses.replace(_dsv3_fp8(), scale_block_n=64)) is None  # 128 | bn


@needs_gluon
@pytest.mark.parametrize("act", [0, 2])
def test_fp8_ws_gate_up_compiles_with_the_scaling_off_the_other_consumer(act):
    """moe_gemm_fp8_gluon.moe_gate_up_fp8_ws_kernel (sm_90a, offline): no spill; a K step of a half is one ring
    wait, 4 m64 x 128 x k32 e4m3 wgmmas (gate 64 | up 64 columns), their wait, one release and 64 FFMAs with no
    select left (the gate / up scale is static per register), warp-group barriers only; the producer warp
    group's row copies are fenced before the hand-over."""
    from moeflow.kernels.moe_gemm_fp8_gluon import moe_gate_up_fp8_ws_kernel
    from tools.sass_mix import compile_kernel, gluon_desc_type, gmma_loop, opcode_mix, sass_text

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
def test_the_launcher_runs_one_cta_a_tile(monkeypatch):
    """The launcher's grid (and NUM_PROGS, the kernel's tile stride) is every tile the used blocks could have
    (max_blocks x 128-column groups), so the hardware hands tiles out in order as CTAs finish and the CTAs sharing a
    weight box run together; recorded from the launch (the kernel replaced by a recorder: no GPU here)."""
    import dataclasses

    import moeflow.experts.fused as F
    import moeflow.kernels.moe_gemm_fp8_gluon as K8
    from moeflow.experts.plan import NAMED_DEVICES, StepShape, plan_step
    from moeflow.tuning.rules import load_rules

    launches = []

    class Recorder:
        def __getitem__(self, grid_):
            def launch(*args, **kw):
                launches.append((grid_, kw["NUM_PROGS"], kw["STAGES"]))
            return launch

    monkeypatch.setattr(K8, "moe_gate_up_fp8_ws_kernel", Recorder())
    E, H, I, K, T = 4, 512, 256, 2, 300
    shape = StepShape(fmt="fp8_block", dtype="bfloat16", num_experts=E, tiling_experts=E, hidden_size=H,
                      intermediate_size=I, top_k=K, tokens=T, pairs=T * K, group=128, scale_block_n=128)
    rules = dataclasses.replace(load_rules(), fp8_gluon_gate_up_min_hidden=512)  # the rule at this small H
    plan = plan_step(shape, NAMED_DEVICES["h100"], tile_config=_gluon_tiles(), rules=rules)
    st = plan.stage("gate_up")
    assert st.variant == "fp8_gluon"
    f8 = torch.float8_e4m3fn

    class B:  # the step's buffers the launcher reads
        xq, xs = torch.zeros(T, H, dtype=f8), torch.zeros(T, H // 128)
        aq_PI, as_PG = torch.zeros(plan.padded, I, dtype=f8), torch.zeros(plan.padded, I // 128)
        sorted_P = block_expert_B = torch.zeros(plan.padded, dtype=torch.int32)
        N, top_k_div = T * K, K

    class W:
        gate_up, gate_up_scale = torch.zeros(E, 2 * I, H, dtype=f8), torch.zeros(E, 2 * I // 128, H // 128)

        class quant:
            block = (128, 128)

    class C:
        swiglu_limit, gptoss_alpha, activation = None, 1.702, "silu"

    F.launch_gate_up_fp8_gluon(plan, st, B, W, C)
    want = plan.max_blocks * (I // 128)
    assert launches == [((want,), want, st.get("stages"))], launches
