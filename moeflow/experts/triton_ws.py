"""Host side of the warp-specialised gate_up and down GEMMs (moeflow/kernels/moe_gemm_ws.py, Gluon, Hopper).

Legend as in moeflow/experts/triton.py: P padded pair positions, N pairs, H hidden, I intermediate,
BM / BN / BK tile sizes.

`moeflow.experts.triton.WS_DOWN` / `WS_GATE_UP` (off by default) route the bf16 / fp16 TMA down /
gate_up GEMM here where `ws_down_tiles` / `ws_gate_up_tiles` accept the shape. The kernels give the
Triton kernels' bits: every output element sums the same products in the same K order (k16 wgmma
steps, one split), whatever BM / BN / BK and however the tiles are scheduled. So this module picks
its own tiles from the plan's (down; gate_up: ws_gate_up_tiles):
    BM  the alignment's block (act_PI is padded per expert to BM rows), 64 or 128; a consumer tile
        is 64 rows (a warp group's wgmma M), so a block is BM / 64 tiles and a tile of padding
        only (the second half of a block with <= 64 pairs) is skipped
    BN  the plan's down BN, at most 256 (one wgmma's N; one consumer's f32 accumulator is then
        64 * BN / 128 <= ACC_REGS registers a thread)
    BK  the plan's down BK
    STAGES as many ring stages of (64 + BN) x BK operands as fit SMEM_BYTES, at most MAX_STAGES.

Importing this module imports neither Triton nor Gluon (they load at the first launch).
"""

from __future__ import annotations

from functools import lru_cache

import torch

# One consumer warp group's accumulator: at most this many f32 registers a thread (of its 232).
ACC_REGS = 128
# Rows of a consumer tile (moe_gemm_ws.TILE_M).
TILE_M = 64
# Shared memory the ring may take (Hopper: 227 KB a block; the rest holds the barriers and the
# compiler's own scratch) and the deepest ring worth having.
SMEM_BYTES = 200 * 1024
MAX_STAGES = 6


def ws_down_tiles(block_m: int, block_n: int, block_k: int, H: int, I: int, dtype: torch.dtype
                  ) -> tuple[int, int, int, int] | None:
    """(BM, BN, BK, STAGES) of the warp-specialised down GEMM for the plan's tiles, or None when it
    does not serve the shape (BM not 64 / 128, BN or BK not dividing H / I, a dtype without wgmma)."""
    if dtype not in (torch.bfloat16, torch.float16) or block_m not in (64, 128):
        return None
    bn = min(block_n, 256, ACC_REGS * 128 // TILE_M)
    if bn < 8 or bn % 8 or H % bn or I % block_k or block_k % 16:
        return None
    stage_bytes = (TILE_M + bn) * block_k * 2
    stages = min(MAX_STAGES, SMEM_BYTES // stage_bytes)
    if stages < 2:
        return None
    return block_m, bn, block_k, stages


# gate_up: the same 64-row tiles (its accumulator [64, 2BN] holds BN registers a thread), the ring's
# stages hold the rows and the gate and up boxes; at least GU_MIN_STAGES stages
# (moe_gemm_ws.GU_COPY_DEPTH stages of row copies in flight, plus the one the wgmmas read, plus one).
GU_MIN_STAGES = 4
_WS_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_clamp": 2}


def ws_gate_up_tiles(block_m: int, block_n: int, block_k: int, H: int, I: int, dtype: torch.dtype,
                     activation: str) -> tuple[int, int, int, int] | None:
    """(BM, BN, BK, STAGES) of the warp-specialised gate_up for the plan's tiles, or None where it does not
    serve: BM the alignment's block (64 / 128), BN the plan's narrowed to <= ACC_REGS, BK the plan's when
    GU_MIN_STAGES stages fit, else 64 (BK changes no bits: every product joins the accumulator in the same
    k16 order), activations with a Gluon form (moe_gemm_ws._ws_activate)."""
    if dtype not in (torch.bfloat16, torch.float16) or block_m not in (64, 128) or activation not in _WS_ACTIVATIONS:
        return None
    bn = min(block_n, ACC_REGS)
    if bn < 8 or bn % 8 or I % bn:
        return None
    for bk in dict.fromkeys((block_k, 64)):
        stages = min(MAX_STAGES, SMEM_BYTES // ((TILE_M + 2 * bn) * bk * 2))
        if H % bk == 0 and bk % 16 == 0 and 32 % (bk // 8) == 0 and stages >= GU_MIN_STAGES:
            return block_m, bn, bk, stages
    return None


@lru_cache(maxsize=8)
def _device_ok(index: int) -> bool:
    """Hopper or newer, and this Triton ships Gluon's Hopper warp specialisation."""
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


def ws_device_ok(act_PI: torch.Tensor) -> bool:
    """Whether this device runs the Gluon kernel (CUDA, sm_90+, Gluon importable)."""
    dev = act_PI.device
    return dev.type == "cuda" and _device_ok(dev.index if dev.index is not None else torch.cuda.current_device())


def launch_down_ws(act_PI: torch.Tensor, W_EHI: torch.Tensor, y_NH: torch.Tensor, sorted_P: torch.Tensor,
                   block_expert_B: torch.Tensor, num_pairs: int, max_blocks: int, tiles: tuple[int, int, int, int],
                   group_m: int, num_programs: int) -> None:
    """y_NH[pair] = act_PI[p] @ W_EHI[e(p)]^T for every placed pair (moe_gemm_ws.moe_down_ws_kernel).

    act_PI [P, I] and W_EHI [E, H, I] (linear layout, contiguous) in bf16 / fp16; y_NH [N, H] (row
    stride y_NH.stride(0), unit column stride); sorted_P / block_expert_B the alignment's int32
    buffers; tiles from ws_down_tiles; num_programs the device's SM count (one CTA an SM).
    """
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.moe_gemm_ws import CONSUMER_WARPS, moe_down_ws_kernel

    BM, BN, BK, stages = tiles
    E, H, I = W_EHI.shape
    P = act_PI.shape[0]
    el = gl.bfloat16 if act_PI.dtype == torch.bfloat16 else gl.float16
    ad = TensorDescriptor(act_PI, [P, I], [I, 1], [TILE_M, BK],
                          gl.NVMMASharedLayout.get_default_for([TILE_M, BK], el))
    wd = TensorDescriptor(W_EHI.view(E * H, I), [E * H, I], [I, 1], [BN, BK],
                          gl.NVMMASharedLayout.get_default_for([BN, BK], el))
    moe_down_ws_kernel[(num_programs,)](
        ad, wd, y_NH, sorted_P, block_expert_B, num_pairs, H, I, max_blocks, y_NH.stride(0),
        BLOCK_M=BM, NUM_PROGS=num_programs, GROUP_M=group_m, STAGES=stages, num_warps=CONSUMER_WARPS.value,
    )


def launch_gate_up_ws(x_rows: torch.Tensor, W_E2IH: torch.Tensor, act_PI: torch.Tensor, sorted_P: torch.Tensor,
                      block_expert_B: torch.Tensor, num_pairs: int, top_k_div: int, max_blocks: int,
                      tiles: tuple[int, int, int, int], activation: str, limit: float, group_m: int,
                      num_programs: int) -> None:
    """act_PI[p] = act(x_rows[pair(p) // top_k_div] @ W_E2IH[e(p)]^T) for every placed pair
    (moe_gemm_ws.moe_gate_up_ws_kernel).

    x_rows [M, H] (unit column stride, 16-byte aligned rows), W_E2IH [E, 2I, H] (gate rows then up rows,
    contiguous) and act_PI [P, I] in one dtype (bf16 / fp16); tiles from ws_gate_up_tiles.
    """
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.moe_gemm_ws import CONSUMER_WARPS, moe_gate_up_ws_kernel

    BM, BN, BK, stages = tiles
    E, I2, H = W_E2IH.shape
    el = gl.bfloat16 if W_E2IH.dtype == torch.bfloat16 else gl.float16
    wd = TensorDescriptor(W_E2IH.view(E * I2, H), [E * I2, H], [H, 1], [BN, BK],
                          gl.NVMMASharedLayout.get_default_for([BN, BK], el))
    moe_gate_up_ws_kernel[(num_programs,)](
        x_rows, wd, act_PI, sorted_P, block_expert_B, num_pairs, H, I2 // 2, top_k_div, max_blocks,
        x_rows.stride(0), act_PI.stride(0), float(limit),
        ACT=_WS_ACTIVATIONS[activation], BLOCK_M=BM, NUM_PROGS=num_programs, GROUP_M=group_m, STAGES=stages,
        num_warps=CONSUMER_WARPS.value,
    )


def ws_rows_ok(x_rows: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the gate_up's cp.async row copies can read x_rows: the weights' dtype, unit column
    stride, 16-byte aligned rows."""
    el = x_rows.element_size()
    return (x_rows.dtype == dtype and x_rows.stride(1) == 1 and (x_rows.stride(0) * el) % 16 == 0
            and x_rows.data_ptr() % 16 == 0)
