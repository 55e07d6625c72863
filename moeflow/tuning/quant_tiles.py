"""Tile configurations of the quantized expert kernels: heuristics (no tuned tables for them yet).

Legend: T tokens, K slots, E experts, H hidden, I intermediate per expert, G the quantization group
along a GEMM's reduction axis (fp8_block: the weight block's bk; mxfp4 32; nvfp4 16), BM/BN/BK tiles,
S split-K parts of the down GEMM. Pure Python: the CPU suite tests it.
"""

from __future__ import annotations

import math

from . import GemmTile, MoETileConfig


def quant_group(spec) -> int:
    """G: the scale group along the reduction axis (fp8_block: bk; mxfp4 32; nvfp4 16)."""
    return spec.block[1] if spec.format == "fp8_block" else {"mxfp4": 32, "nvfp4": 16}[spec.format]


def _split_for(active_blocks: int, n_tiles: int, k_tiles: int, sm_count: int) -> int:
    """Smallest split of the down GEMM giving >= 2 programs per SM, keeping >= 2 K tiles per split."""
    split = 1
    while active_blocks * n_tiles * split < 2 * sm_count and split < 8 and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def quant_tile_config(fmt: str, group: int, num_experts: int, hidden_size: int, intermediate_size: int,
                      top_k: int, num_tokens: int, *, batch_invariant: bool = False, sm_count: int = 132,
                      small: bool = False) -> MoETileConfig:
    """The tile configuration of the quantized kernels (pure Python heuristics).

    fp8_block: BK = G for both GEMMs (one scale a tile) and gate_up BN = G (the epilogue
    quantizes whole groups of I), or a divisor of G at decode when G-wide tiles give too few
    programs (a separate pass then quantizes the activation). FP4: BK a multiple of G and >= 32
    (16-byte packed loads).
    Regimes follow rows per used expert ~ T*K / min(T*K, E), as moeflow.tuning.default_config:
    decode tiles (BM = 16, split-K down GEMM so the weight stream covers every SM), then wider
    tiles. batch_invariant: one configuration whatever T, no split-K. small: the interpreter /
    CPU path (one stage, narrow tiles).
    """
    E, H, I, K = num_experts, hidden_size, intermediate_size, top_k
    fp8 = fmt == "fp8_block"
    if small:
        bk = group if fp8 else max(32, group)
        gu = GemmTile(block_n=group if fp8 else 16, block_k=bk, num_warps=4, num_stages=1)
        dn = GemmTile(block_n=16, block_k=bk, num_warps=4, num_stages=1, split_k=1 if batch_invariant else 2)
        return MoETileConfig(block_m=16, gate_up=gu, down=dn)
    if batch_invariant:
        if fp8:
            gu = GemmTile(block_n=group, block_k=group, num_warps=8, num_stages=3)
            dn = GemmTile(block_n=128, block_k=group, num_warps=8, num_stages=4)
        else:
            gu = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
            dn = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
        return MoETileConfig(block_m=64, gate_up=gu, down=dn)
    n_pairs = max(1, num_tokens) * K
    used = min(n_pairs, E)
    rows = n_pairs / used
    if rows <= 16:
        bk = group if fp8 else 128
        if fp8:
            # Narrower than a group only when whole groups give less than one program per SM (the
            # activation is then quantized by a separate pass). deepseek-v3 on the H200
            # (a tile sweep: TritonQuantExperts(tile_config=...) per candidate, CUDA graph): T = 1 (8 experts x 16 tiles of 128 = 128
            # programs) BN 64 127 us, BN 32 136, BN 128 135; T = 2 (256 programs) BN 128 214 us, 64 229.
            widths = [bn for bn in (group, 64, 32) if bn <= group and group % bn == 0]
            bn_gu = next((bn for bn in widths if used * math.ceil(I / bn) >= sm_count), widths[-1])
            gu = GemmTile(block_n=bn_gu, block_k=bk, num_warps=4, num_stages=4)
        else:
            bn_gu = 64 if used * math.ceil(I / 64) >= 2 * sm_count else 32
            gu = GemmTile(block_n=bn_gu, block_k=bk, num_warps=4, num_stages=4)
        bn_d = 64 if used * math.ceil(H / 64) >= sm_count else 32
        split = _split_for(used, math.ceil(H / bn_d), math.ceil(I / bk), sm_count)
        if fp8 and split == 1 and math.ceil(I / bk) >= 8:
            # Two K halves even with enough programs: deepseek-v3 T = 1 (896 programs of BN 64)
            # 119 us at S = 2 against 136 at S = 1; T = 2 224 vs 229, T = 4 equal (same run as above).
            split = 2
        dn = GemmTile(block_n=bn_d, block_k=bk, num_warps=4, num_stages=4, split_k=split)
        return MoETileConfig(block_m=16, gate_up=gu, down=dn)
    if fp8:
        # gate_up holds two f32 accumulators (gate, up) and a fresh per-tile dot result of each:
        # BM = 128 spills at any warp count (sm_90 compile, 255 registers); BM = 64 with 8 warps
        # (two warpgroups splitting N) is the widest tile that nearly fits (48 B of stack).
        if rows <= 32:
            gu = GemmTile(block_n=group, block_k=group, num_warps=4, num_stages=3)
            dn = GemmTile(block_n=64, block_k=group, num_warps=4, num_stages=4)
            return MoETileConfig(block_m=32, gate_up=gu, down=dn)
        # BM 64 (the TMA kernels on Hopper, moeflow.kernels.moe_gemm_fp8_tma). Round-robin on the H200
        # (a tile sweep: TritonQuantExperts(tile_config=...) per candidate, CUDA graph): gate_up 4 stages, GROUP_M 16 and a 4-warp
        # down (BN 128) against 3 stages, GROUP_M 8 and 8 warps: deepseek-v3 T = 2048 3722 vs 4135 us,
        # T = 8192 9751 vs 11363; qwen3-30b-a3b-fp8 T = 2048 382 vs 406, T = 8192 1208 vs 1231.
        gu = GemmTile(block_n=group, block_k=group, num_warps=8, num_stages=4, group_m=16)
        dn = GemmTile(block_n=128, block_k=group, num_warps=4, num_stages=4, group_m=16)
        return MoETileConfig(block_m=64, gate_up=gu, down=dn)
    if rows <= 64:
        bm = 32 if rows <= 32 else 64
        gu = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
        dn = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
        return MoETileConfig(block_m=bm, gate_up=gu, down=dn)
    bm = 128 if rows >= 128 else 64
    gu = GemmTile(block_n=64, block_k=64, num_warps=8 if bm == 128 else 4, num_stages=3)
    dn = GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=3)
    return MoETileConfig(block_m=bm, gate_up=gu, down=dn)


def check_tile_config(cfg: MoETileConfig, fmt: str, group: int) -> None:
    """ValueError naming the field when a tile configuration cannot run format `fmt` (group G)."""
    if cfg.half_tail:
        raise ValueError("MoETileConfig.half_tail=True: the quantized kernels have no half-height tiles "
                         "(expected False)")
    if fmt == "fp8_block":
        for name, t in (("gate_up", cfg.gate_up), ("down", cfg.down)):
            if t.block_k != group:
                raise ValueError(f"MoETileConfig.{name}.block_k={t.block_k}: fp8_block needs block_k == the "
                                 f"scale block bk = {group} (one scale a K tile)")
        bn = cfg.gate_up.block_n
        if bn % group and group % bn:
            raise ValueError(f"MoETileConfig.gate_up.block_n={bn}: fp8_block needs a multiple of bk = {group} "
                             f"(the epilogue quantizes whole groups of I) or a divisor of it (a separate pass "
                             f"quantizes)")
        return
    for name, t in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        if t.block_k % group or t.block_k < 32:
            raise ValueError(f"MoETileConfig.{name}.block_k={t.block_k}: {fmt} needs a multiple of its group "
                             f"{group} and >= 32")
