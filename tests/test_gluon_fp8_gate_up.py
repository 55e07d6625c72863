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


def test_rows_and_devices_it_serves():
    from moeflow.experts.triton_ws import ws_device_ok, ws_rows_ok

    assert ws_rows_ok(torch.empty(4, 64, dtype=torch.bfloat16), torch.bfloat16)
    assert not ws_rows_ok(torch.empty(4, 60, dtype=torch.bfloat16), torch.bfloat16)  # 120-byte rows
    assert not ws_rows_ok(torch.empty(4, 64), torch.bfloat16)
    assert ws_device_ok(torch.empty(4, 4)) is False  # the interpreter never gets a Gluon launch


def test_fp8_ws_gate_up_stages():
    from moeflow.experts.triton_ws import fp8_ws_gate_up_stages

    assert fp8_ws_gate_up_stages(64, 128, 128, 7168, 2048, 128, "silu") == 5  # 5 stages of 40 KB
    assert fp8_ws_gate_up_stages(64, 64, 128, 7168, 2048, 128, "silu") is None  # a tile is one 128-column group
    assert fp8_ws_gate_up_stages(128, 128, 128, 7168, 2048, 128, "silu") is None  # BM 64 plans only
    assert fp8_ws_gate_up_stages(64, 128, 128, 7168, 2048, 128, "relu2") is None  # no Gluon form of it


@needs_gluon
@pytest.mark.parametrize("act", [0, 2])
def test_fp8_ws_gate_up_compiles_with_the_scaling_off_the_other_consumer(act):
    """moe_gemm_fp8_gluon.moe_gate_up_fp8_ws_kernel (sm_90a, offline): no spill; a K step of a half is one ring
    wait, 4 m64 x 128 x k32 e4m3 wgmmas (gate 64 | up 64 columns), their wait, one release and 64 FFMAs with no
    select left (the gate / up scale is static per register), warp-group barriers only; the producer warp
    group's row copies are fenced before the hand-over."""
    from benchmarks.sass_mix import compile_kernel, gluon_desc_type, gmma_loop, opcode_mix, sass_text
    from moeflow.kernels.moe_gemm_fp8_gluon import moe_gate_up_fp8_ws_kernel

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
    """triton_ws.WS_TILE_GRID: the launcher's grid (and NUM_PROGS, the kernel's tile stride) is every tile the
    used blocks could have (max_blocks x column tiles), else the SM count; recorded from the launch (the kernel
    replaced by a recorder: no GPU here)."""
    import moeflow.experts.triton_ws as TW
    import moeflow.kernels.moe_gemm_fp8_gluon as K8

    launches = []

    class Recorder:
        def __getitem__(self, grid_):
            def launch(*args, **kw):
                launches.append((grid_, kw["NUM_PROGS"]))
            return launch

    monkeypatch.setattr(K8, "moe_gate_up_fp8_ws_kernel", Recorder())
    monkeypatch.setattr(TW, "WS_TILE_GRID", grid)
    E, H, I, P, N, max_blocks, sms = 4, 512, 256, 640, 600, 10, 132
    f8 = torch.float8_e4m3fn
    i32 = torch.zeros(P, dtype=torch.int32)
    # one 128-column group a tile -> 256 / 128 = 2 column tiles a block
    TW.launch_gate_up_fp8_ws(torch.zeros(N, H, dtype=f8), torch.zeros(N, H // 128), torch.zeros(E, 2 * I, H, dtype=f8),
                             torch.zeros(E, 2 * I // 128, H // 128), torch.zeros(P, I, dtype=f8),
                             torch.zeros(P, I // 128), i32, i32, N, 1, max_blocks, 128, 128, 5, "silu", 0.0, 1.0, 8,
                             sms)
    want = [max_blocks * 2] if grid else [sms]
    assert [g[0] for g, _ in launches] == want, launches
    assert [n for _, n in launches] == want, launches
