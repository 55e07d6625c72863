"""Gluon kernels (Hopper): the FP8 block-scaled (W8A8) down and gate_up GEMMs, warp-specialised (issue 15
item 6).

Why: the Triton fp8 GEMMs (moe_gemm_fp8_tma.py) leave the tensor pipe 33-43% busy at prefill (ncu, H100,
benchmarks/RESULTS.md 2026-12-06 thirteenth session). Each K step of 128 (one scale group) is a fresh wgmma
chain whose product is scaled into the f32 sum: the warps wait for the wgmmas, pass a CTA barrier, then
scale with FFMAs, all warp groups in lock step, so the tensor pipe idles while they scale. DeepGEMM's cure:
a producer warp feeds a TMA ring and two consumer warp groups share each tile, each waiting only for its own
wgmmas and mbarriers, never a CTA barrier, so they drift out of phase and one's scaling overlaps the other's
wgmmas.

    y_NH[pair(p)] = sum_kt (aq_PI[p, kt] @ Wq[e(p)][:, kt]^T) * (as_PG[p, kt] * ws[e(p), n // sbn, kt])

the same products, scaled and summed in the same K order, as moe_gemm_fp8_tma._fp8_down_rows
(acc + dot * (sa * sw), one fused multiply-add an element): the same bits, checked on the GPU by
tests/test_experts_triton_quant.py::test_gpu_fp8_ws_kernels_equal_the_tma_kernels_bitwise.

Tiles (the Triton fp8 kernels' BLOCK_M 64 plans): 64 rows (one warp group's wgmma M) x 2BN columns, split
between the consumers by columns (BN <= 128 each: the sum and one product take BN registers a thread) x BK =
the scale group (128). The 64 act rows of a stage serve both consumers, so act and weight traffic are the
Triton kernels' (a BN-wide tile each) or less. f32 weight scales only (UE8M0 bytes: the host keeps the
Triton kernel).

History: the first version (2026-12-06, fourteenth session) ran ping-pong (CUTLASS's schedule: the consumers
alternate whole tiles, only epilogues overlap) and gave the same bits, but no speed: ping-pong serialises
the main loops, so the scaling never overlapped a wgmma, and its gate_up ran a tile's two column halves one
after the other, gathering the act rows twice (ncu: deepseek-v3 T=8192 gate_up 10.5 ms, 28 GB from DRAM and
an L2 hit rate of 30%, against the Triton kernel's 5.5 ms, 11 GB, 56%).

The gate_up (below): its rows gathered by a producer warp group (cp.async), 64-row tiles of one 128-column
quantization group, the group's columns split between the consumers.

Status: the same bits as the Triton TMA kernels on the H100 (2026-12-06, the GPU test above, graph replay) and
compiled offline for sm_90a in the CPU suite (tests/test_gluon_ws.py); nothing launches them by default
(experts.triton_quant.FP8_WS_DOWN / FP8_WS_GATE_UP, off): slower than the Triton kernels but at qwen3's gate_up
(benchmarks/RESULTS.md, fourteenth session). ncu, deepseek-v3 T=8192: the gate_up reads 27.3 GB from DRAM (the
Triton kernel 10.8), the down 10.5 GB (5.7): the re-reads of the bf16 Gluon kernels, not the scaling.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .moe_gemm_quant import FP8_MAX
from .moe_gemm_ws import (
    CONSUMER_REGS,
    CONSUMER_WARPS,
    GU_CONSUMER_REGS,
    GU_COPY_DEPTH,
    GU_PRODUCER_REGS,
    GU_PRODUCER_WARPS,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    TILE_M,
    _ws_activate,
    _ws_down_load,
    _ws_down_load_tile,
    _ws_init_barriers,
    _ws_live,
    _ws_rows_drain,
    _ws_rows_hand_over,
    _ws_tile_ids,
    _ws_used_blocks,
)


@gluon.jit
def _fp8_ws_down_tile(a_bufs, b_bufs, ready, empty, j, k_tiles, sa_ptrs, sw_ptr, stride_wsk, row_ok,
                      WHICH: gl.constexpr):
    """Consumer WHICH's columns of the CTA's j-th live tile: its f32 sum [64, N] (N = half the stage's weight
    rows: consumer WHICH reads rows [WHICH * N, WHICH * N + N) of the box). Per K step: the step's scales loaded
    before the stage's wait (their latency hides behind it), one fresh m64 x N x k32 wgmma chain, its wait, the
    stage freed (one of its two arrivals), then sum + product * (sa * sw)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    N: gl.constexpr = b_bufs.type.shape[1] // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, N, 32])
    acc = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    zero = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    c = j * k_tiles
    for kt in range(k_tiles):
        s = c % STAGES
        sc = gl.load(sa_ptrs + kt, mask=row_ok, other=0.0) * gl.load(sw_ptr + kt * stride_wsk)
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        b = b_bufs.index(s).slice(WHICH * N, N).permute((1, 0))
        prod = warpgroup_mma(a_bufs.index(s), b, zero, use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + prod * gl.expand_dims(sc, 1)
        c += 1
    return acc


@gluon.jit
def _fp8_ws_down_one(a_bufs, b_bufs, ready, empty, j, k_tiles, pid_r, pid_n, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                     block_expert_ptr, num_pairs, H, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                     WHICH: gl.constexpr):
    """Consumer WHICH's columns of the CTA's j-th live tile (row block pid_r, column tile pid_n of 2BN): its
    wgmmas and scaling (_fp8_ws_down_tile), then its rows stored by pair."""
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1] // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    offs_p = pid_r * TILE_M + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, mma_layout))
    pair = gl.load(sorted_ptr + offs_p)
    row_ok = pair < num_pairs
    e = gl.load(block_expert_ptr + pid_r).to(gl.int64)
    col0 = pid_n * (2 * BLOCK_N) + WHICH * BLOCK_N
    sa_ptrs = as_ptr + offs_p.to(gl.int64) * stride_as
    sw_ptr = ws_ptr + e * stride_wse + (col0 // sbn) * stride_wsn
    acc = _fp8_ws_down_tile(a_bufs, b_bufs, ready, empty, j, k_tiles, sa_ptrs, sw_ptr, stride_wsk, row_ok, WHICH)
    offs_h = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
    y_ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_yn, 1) + gl.expand_dims(offs_h, 0)
    mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_h < H, 0)
    gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _fp8_ws_down_mma(a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used,
                     num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                     NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH (0 or 1): columns [WHICH * BN, WHICH * BN + BN) of every live 64 x 2BN tile of this CTA."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    n_n = gl.cdiv(H, b_bufs.type.shape[1])
    k_tiles = gl.cdiv(I, BLOCK_K)
    j = 0  # the CTA's live tiles so far: the producer's order
    for tile in range(gl.program_id(0), used * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * TILE_M, num_pairs):
            _fp8_ws_down_one(a_bufs, b_bufs, ready, empty, j, k_tiles, pid_r, pid_n, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                             block_expert_ptr, num_pairs, H, sbn, stride_as, stride_wse, stride_wsn, stride_wsk,
                             stride_yn, WHICH)
            j += 1


@gluon.jit
def _fp8_ws_down_mma_worker(ad, wd, a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                            block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                            stride_wsk, stride_yn, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """Consumer 1 (a worker partition: the right half of every tile's columns)."""
    _fp8_ws_down_mma(a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used,
                     num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, NUM_PROGS,
                     GROUP_M, 1)


@gluon.jit
def _fp8_ws_down_load_worker(ad, wd, a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                             block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                             stride_wsk, stride_yn, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer (a worker partition): moe_gemm_ws._ws_down_load's TMA ring, 64-row tiles, the weight box
    [2BN, BK] both consumers' columns."""
    _ws_down_load(ad, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, 1,
                  NUM_PROGS, GROUP_M, False)


@gluon.jit
def _fp8_down_ring(ad, wd, STAGES: gl.constexpr):
    """(a_bufs, b_bufs): the fp8 down's ring in shared memory, STAGES act boxes [64, BK] (ad's block) and weight
    boxes [2BN, BK] (wd's block), after the checks both down kernels (static and dynamic tiles) need of them."""
    gl.static_assert(ad.block_type.shape[0] == TILE_M, "64-row tiles")
    BLOCK_K: gl.constexpr = ad.block_type.shape[1]
    BOX_N: gl.constexpr = wd.block_type.shape[0]
    gl.static_assert(wd.block_type.shape[1] == BLOCK_K, "act and weight boxes share BK")
    gl.static_assert(BOX_N <= 256 and BOX_N % 32 == 0, "two consumers' columns, each's sum and product in registers")
    gl.static_assert(BLOCK_K % 32 == 0, "fp8 wgmma steps of k32")
    a_bufs = gl.allocate_shared_memory(ad.dtype, [STAGES, TILE_M, BLOCK_K], ad.layout)
    b_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, BOX_N, BLOCK_K], wd.layout)
    return a_bufs, b_bufs


@gluon.jit
def moe_down_fp8_ws_kernel(ad, wd, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, I, num_m, sbn,
                           stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, NUM_PROGS: gl.constexpr,
                           GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """y_NH[pair] like moe_gemm_fp8_tma.moe_down_fp8_tma_kernel (one split, BLOCK_M 64, f32 weight scales).

    ad: Gluon TensorDescriptor over aq_PI [P, I] e4m3, block [64, BK]; wd: over the e4m3 down weights viewed
    [E * H, I], block [2BN, BK] (a consumer's BN <= 128, 2BN | H, BN | sbn, BK = the scale group, BK | I); as_ptr:
    as_PG [P, I / BK] f32; ws_ptr: ws [E, ceil(H / sbn), I / BK] f32; y_ptr: y_NH [N, H] rows by pair. Grid
    (NUM_PROGS,), num_warps = CONSUMER_WARPS (the default partition).
    """
    gl.static_assert(num_warps == CONSUMER_WARPS, "the default partition is one consumer warp group")
    a_bufs, b_bufs = _fp8_down_ring(ad, wd, STAGES)
    ready, empty, order = _ws_init_barriers(STAGES, 1, 2)  # no turns: order stays unused
    used = _ws_used_blocks(block_expert_ptr, num_m, num_warps)
    gl.warp_specialize([
        (_fp8_ws_down_mma, (a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr,
                            used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                            NUM_PROGS, GROUP_M, 0)),
        (_fp8_ws_down_mma_worker, (ad, wd, a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                                   block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                                   stride_wsk, stride_yn, NUM_PROGS, GROUP_M)),
        (_fp8_ws_down_load_worker, (ad, wd, a_bufs, b_bufs, ready, empty, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                                    block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                                    stride_wsk, stride_yn, NUM_PROGS, GROUP_M)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------- gate_up
# The fp8 gate_up in the same schedule. A tile is 64 rows x G = 128 columns of I (one quantization group: the
# epilogue quantizes whole groups, as moe_gemm_fp8_tma's). Its gate and up sums of 128 columns each would not
# fit one consumer's registers, so each consumer takes half of the group's columns: a stage holds the tile's 64
# activation rows and the weight rows [gate n0 .. n0 + 64 | up n0 .. | gate n0 + 64 .. | up n0 + 64 ..]
# ([256, BK]); consumer h reads rows [128h, 128h + 128): one m64 x 128 x k32 wgmma chain a K step, columns
# [0, 64) gate, [64, 128) up. The group's row maxima need both halves: each consumer leaves its 64 maxima in
# shared memory and meets the other at an mbarrier (count 2, one phase a tile; two slots by the tile's parity,
# so a slot is rewritten only after the other consumer has read it), then both have the group's scale and
# quantize their own 64 columns.


@gluon.jit
def _fp8_ws_gate_up_load(xq_ptr, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H,
                         I, top_k, stride_xq, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """Producer (a warp group): for each live tile, each K step, the four 64-row weight boxes by TMA and the
    tile's 64 activation rows by cp.async (xq[token of each row], zeros for padding rows), handed over
    GU_COPY_DEPTH stages later behind a proxy fence (moe_gemm_ws._ws_gate_up_load)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = wd.block_type.shape[0]
    TPW_K: gl.constexpr = BLOCK_K // 16  # 16-byte chunks of e4m3: 16 values
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_K, TPW_K], [GU_PRODUCER_WARPS, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
    cols: gl.constexpr = gl.SliceLayout(0, copy_layout)
    n_n = gl.cdiv(I, 2 * HALF)
    k_tiles = gl.cdiv(H, BLOCK_K)
    offs_k = gl.arange(0, BLOCK_K, layout=cols)
    c = 0
    for tile in range(gl.program_id(0), used * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * TILE_M, num_pairs):
            e = gl.load(block_expert_ptr + pid_r)
            pair = gl.load(sorted_ptr + pid_r * TILE_M + gl.arange(0, TILE_M, layout=rows))
            row_ok = pair < num_pairs
            tok = gl.where(row_ok, pair // top_k, 0).to(gl.int64)
            a_ptrs = xq_ptr + gl.expand_dims(tok * stride_xq, 1) + gl.expand_dims(offs_k, 0)
            a_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_k < BLOCK_K, 0)
            row_g = e * (2 * I) + pid_n * (2 * HALF)
            for kt in range(k_tiles):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 4 * wd.block_type.nbytes)
                b = b_bufs.index(s)
                for h in gl.static_range(2):
                    tma.async_copy_global_to_shared(wd, [row_g + h * HALF, kt * BLOCK_K], bar,
                                                    b.slice(2 * h * HALF, HALF))
                    tma.async_copy_global_to_shared(wd, [row_g + I + h * HALF, kt * BLOCK_K], bar,
                                                    b.slice((2 * h + 1) * HALF, HALF))
                async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + kt * BLOCK_K, mask=a_mask)
                _ws_rows_hand_over(ready, c, STAGES)
                c += 1
    _ws_rows_drain(ready, c, STAGES)


@gluon.jit
def _fp8_ws_gate_up_half(a_bufs, b_bufs, ready, empty, c, k_tiles, sa_ptrs, sg_ptr, su_ptr, stride_wsk, row_ok,
                         WHICH: gl.constexpr):
    """Consumer WHICH's half of a tile from ring position c: its f32 sums [64, 128] (gate columns, then up), per K
    step sum + product * (sa * sw_gate | sa * sw_up) as moe_gemm_fp8_tma's fused form."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    N: gl.constexpr = b_bufs.type.shape[1] // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, N, 32])
    is_g = gl.expand_dims(gl.arange(0, N, layout=gl.SliceLayout(0, mma_layout)) < N // 2, 0)
    acc = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    zero = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    for kt in range(k_tiles):
        s = c % STAGES
        sa = gl.load(sa_ptrs + kt, mask=row_ok, other=0.0)
        cg = gl.expand_dims(sa * gl.load(sg_ptr + kt * stride_wsk), 1)
        cu = gl.expand_dims(sa * gl.load(su_ptr + kt * stride_wsk), 1)
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        b = b_bufs.index(s).slice(WHICH * N, N).permute((1, 0))
        prod = warpgroup_mma(a_bufs.index(s), b, zero, use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + prod * gl.where(is_g, cg, cu)
        c += 1
    return acc


@gluon.jit
def _fp8_ws_quant_half(out, amax_s, offs_p, row_ok, offs_j, aq_ptr, stride_aq):
    """Store one half's e4m3 codes: out / s clamped to +-448 (IEEE division, round to nearest even)."""
    out, s = gl.broadcast(out, gl.expand_dims(amax_s, 1))
    q = gl.div_rn(out, s)
    q = gl.minimum(gl.maximum(q, -FP8_MAX), FP8_MAX)
    ptrs = aq_ptr + gl.expand_dims(offs_p.to(gl.int64) * stride_aq, 1) + gl.expand_dims(offs_j, 0)
    gl.store(ptrs, q.to(aq_ptr.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))


@gluon.jit
def _fp8_ws_group_amax(amax_own, xbuf, xchg, j, WHICH: gl.constexpr):
    """The group's row maxima [64] from this consumer's (its 64 columns) and the other's, met in shared memory:
    this one's into slot (j parity, WHICH), an arrival on xchg (the one thread's arrival after every thread's
    store), the wait for tile j's phase (both arrived), the other's slot read."""
    slot = (j & 1) * 2
    xbuf.index(slot + WHICH).store(amax_own)
    gl.thread_barrier()
    mbarrier.arrive(xchg.index(0), count=1)
    mbarrier.wait(xchg.index(0), j & 1)
    other = xbuf.index(slot + 1 - WHICH).load(amax_own.type.layout)
    return gl.maximum(amax_own, other)


@gluon.jit
def _fp8_ws_gate_up_mma(a_bufs, b_bufs, ready, empty, xbuf, xchg, xs_ptr, ws_ptr, aq_ptr, as_ptr, sorted_ptr,
                        block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows, stride_xs, stride_wse,
                        stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha, ACT: gl.constexpr,
                        NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH: its half of every live tile, act(g, u), the group's scale (_fp8_ws_group_amax), its 64
    columns quantized (moe_gemm_quant._fp8_quant_store's numbers) and stored by row; consumer 0 stores the
    scale."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    N: gl.constexpr = b_bufs.type.shape[1] // 2
    HALF: gl.constexpr = N // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, N, 32])
    n_n = gl.cdiv(I, N)
    k_tiles = gl.cdiv(H, BLOCK_K)
    j = 0
    for tile in range(gl.program_id(0), used * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * TILE_M, num_pairs):
            offs_p = pid_r * TILE_M + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, mma_layout))
            pair = gl.load(sorted_ptr + offs_p)
            row_ok = pair < num_pairs
            tok = gl.where(row_ok, pair // top_k, 0).to(gl.int64)
            sa_ptrs = xs_ptr + tok * stride_xs
            e = gl.load(block_expert_ptr + pid_r).to(gl.int64)
            sg_ptr = ws_ptr + e * stride_wse + ((pid_n * N) // sbn) * stride_wsn
            su_ptr = sg_ptr + g_rows * stride_wsn
            acc = _fp8_ws_gate_up_half(a_bufs, b_bufs, ready, empty, j * k_tiles, k_tiles, sa_ptrs, sg_ptr, su_ptr,
                                       stride_wsk, row_ok, WHICH)
            g, u = gl.split(gl.permute(gl.reshape(acc, [TILE_M, 2, HALF]), [0, 2, 1]))
            out = _ws_activate(g, u, limit, alpha, ACT)
            amax = _fp8_ws_group_amax(gl.max(gl.abs(out), axis=1), xbuf, xchg, j, WHICH)
            scale = gl.where(amax > 0, gl.div_rn(amax, gl.full(amax.shape, FP8_MAX, gl.float32, amax.type.layout)),
                             1.0)
            offs_q = gl.convert_layout(offs_p, gl.SliceLayout(1, out.type.layout))
            ok_q = gl.convert_layout(row_ok, gl.SliceLayout(1, out.type.layout))
            offs_j = pid_n * N + WHICH * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, out.type.layout))
            _fp8_ws_quant_half(out, scale, offs_q, ok_q, offs_j, aq_ptr, stride_aq)
            if WHICH == 0:
                gl.store(as_ptr + offs_q.to(gl.int64) * stride_as + pid_n, scale, mask=ok_q)
            j += 1


@gluon.jit
def _fp8_ws_gate_up_mma_worker(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, a_bufs, b_bufs, ready, empty, xbuf, xchg,
                               sorted_ptr, block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows, stride_xq,
                               stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha,
                               ACT: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """Consumer 1 (a worker partition: the second half of every tile's group)."""
    _fp8_ws_gate_up_mma(a_bufs, b_bufs, ready, empty, xbuf, xchg, xs_ptr, ws_ptr, aq_ptr, as_ptr, sorted_ptr,
                        block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows, stride_xs, stride_wse, stride_wsn,
                        stride_wsk, stride_aq, stride_as, limit, alpha, ACT, NUM_PROGS, GROUP_M, 1)


@gluon.jit
def _fp8_ws_gate_up_load_worker(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, a_bufs, b_bufs, ready, empty, xbuf, xchg,
                                sorted_ptr, block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows, stride_xq,
                                stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha,
                                ACT: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer (a worker partition)."""
    _fp8_ws_gate_up_load(xq_ptr, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H,
                         I, top_k, stride_xq, NUM_PROGS, GROUP_M)


@gluon.jit
def moe_gate_up_fp8_ws_kernel(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, block_expert_ptr, num_pairs, H,
                              I, top_k, num_m, sbn, g_rows, stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk,
                              stride_aq, stride_as, limit, alpha, ACT: gl.constexpr, NUM_PROGS: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """aq_PI / as_PG like moe_gemm_fp8_tma.moe_gate_up_fp8_tma_kernel (BLOCK_M 64, BN = BK = the group 128,
    f32 weight scales, the linear layout [E, 2I, H]).

    xq_ptr [*, H] e4m3 token rows (unit column stride, 16-byte aligned rows), xs_ptr [*, H / BK] f32; wd: Gluon
    TensorDescriptor over the e4m3 gate_up viewed [E * 2I, H], block [64, BK] (64 gate or up rows);
    ws_ptr [E, ceil(2I / sbn), H / BK] f32 (g_rows = ceil(I / sbn): the up rows' first scale block); aq_ptr
    aq_PI [P, I] e4m3, as_ptr as_PG [P, I / 128] f32. Grid (NUM_PROGS,), num_warps = CONSUMER_WARPS.
    """
    gl.static_assert(num_warps == CONSUMER_WARPS, "the default partition is one consumer warp group")
    HALF: gl.constexpr = wd.block_type.shape[0]
    BLOCK_K: gl.constexpr = wd.block_type.shape[1]
    gl.static_assert(HALF == 64, "a consumer's half is 64 columns of gate and 64 of up: one m64 x 128 wgmma")
    gl.static_assert(BLOCK_K % 32 == 0 and BLOCK_K <= 256, "fp8 wgmma k32 steps; 16-byte row chunks")
    gl.static_assert(STAGES > GU_COPY_DEPTH + 1, "the ring holds the copies in flight and the wgmma's stage")
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_M, BLOCK_K], wd.dtype)
    a_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, TILE_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, 4 * HALF, BLOCK_K], wd.layout)
    # the consumers' row maxima: [tile parity * 2 + consumer, row]
    xbuf = gl.allocate_shared_memory(gl.float32, [4, TILE_M], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    xchg = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(xchg.index(0), count=2)
    ready, empty, order = _ws_init_barriers(STAGES, 2, 2)  # no turns: order stays unused
    used = _ws_used_blocks(block_expert_ptr, num_m, num_warps)
    gl.warp_specialize([
        (_fp8_ws_gate_up_mma, (a_bufs, b_bufs, ready, empty, xbuf, xchg, xs_ptr, ws_ptr, aq_ptr, as_ptr, sorted_ptr,
                               block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows, stride_xs, stride_wse,
                               stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha, ACT, NUM_PROGS, GROUP_M,
                               0)),
        (_fp8_ws_gate_up_mma_worker, (xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, a_bufs, b_bufs, ready, empty, xbuf,
                                      xchg, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows,
                                      stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as,
                                      limit, alpha, ACT, NUM_PROGS, GROUP_M)),
        (_fp8_ws_gate_up_load_worker, (xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, a_bufs, b_bufs, ready, empty, xbuf,
                                       xchg, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, top_k, sbn, g_rows,
                                       stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as,
                                       limit, alpha, ACT, NUM_PROGS, GROUP_M)),
    ], [CONSUMER_WARPS, GU_PRODUCER_WARPS], [GU_CONSUMER_REGS, GU_PRODUCER_REGS])


# ------------------------------------------------------------------------------ down, dynamic tiles
# The same down GEMM with its tiles handed out at run time: the producer claims the next tile of the grouped
# order from a global counter (one atomic a tile, the counter zeroed by the host before the launch) and passes
# each live tile's id to both consumers through a small shared-memory ring (TID_SLOTS slots, an mbarrier pair a
# slot); -1 ends them. Why (benchmarks/RESULTS.md, fourteenth session): with tiles assigned statically (CTA p
# takes p, p + NUM_PROGS, ...), CTAs that fall behind by whole rounds no longer share their weight boxes in L2
# with the CTAs of their round; claimed in order, the tiles in flight stay one contiguous window of the order,
# as with a grid of one CTA a tile, while each CTA keeps its ring full across tiles.
TID_SLOTS = gl.constexpr(4)


# a tile id as a [1] tensor in the producer's (one warp) and in a consumer's (one warp group) registers
_TID_PRODUCER = gl.constexpr(gl.BlockedLayout([1], [32], [PRODUCER_WARPS], [0]))
_TID_CONSUMER = gl.constexpr(gl.BlockedLayout([1], [32], [CONSUMER_WARPS], [0]))


@gluon.jit
def _ws_tid_put(tids, tid_ready, tid_empty, j, tile):
    """Producer: the j-th live tile's id (or -1: no more) into slot j % TID_SLOTS, once both consumers freed it."""
    slot = j % TID_SLOTS
    mbarrier.wait(tid_empty.index(slot), ((j // TID_SLOTS) & 1) ^ 1)
    tids.index(slot).store(gl.full([1], tile, gl.int32, _TID_PRODUCER))
    gl.thread_barrier()  # every thread's store before the one arrival
    mbarrier.arrive(tid_ready.index(slot), count=1)


@gluon.jit
def _ws_tid_get(tids, tid_ready, tid_empty, j):
    """Consumer: the j-th live tile's id (-1: no more); the slot freed at once (the id is in registers)."""
    slot = j % TID_SLOTS
    mbarrier.wait(tid_ready.index(slot), (j // TID_SLOTS) & 1)
    tile = gl.max(tids.index(slot).load(_TID_CONSUMER), axis=0)
    mbarrier.arrive(tid_empty.index(slot), count=1)
    return tile


@gluon.jit
def _fp8_ws_dyn_down_load(ad, wd, a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, counter_ptr, sorted_ptr,
                          block_expert_ptr, used, num_pairs, H, I, GROUP_M: gl.constexpr):
    """Producer: claim tiles in order until none is left; for each live one, its id to the consumers, then its
    K steps' TMA copies into the ring (moe_gemm_ws._ws_down_load_tile, as the static producer)."""
    BLOCK_K: gl.constexpr = ad.block_type.shape[1]
    BOX_N: gl.constexpr = wd.block_type.shape[0]
    n_n = gl.cdiv(H, BOX_N)
    k_tiles = gl.cdiv(I, BLOCK_K)
    total = used * n_n
    c = 0
    j = 0
    tile = gl.atomic_add(counter_ptr, 1)
    while tile < total:
        pid_r, pid_n = _ws_tile_ids(tile, used, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * TILE_M, num_pairs):
            _ws_tid_put(tids, tid_ready, tid_empty, j, tile)
            e = gl.load(block_expert_ptr + pid_r)
            c = _ws_down_load_tile(ad, wd, a_bufs, b_bufs, ready, empty, c, e, pid_r, pid_n, H, I, k_tiles, False)
            j += 1
        tile = gl.atomic_add(counter_ptr, 1)
    _ws_tid_put(tids, tid_ready, tid_empty, j, -1)


@gluon.jit
def _fp8_ws_dyn_down_mma(a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                         block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk,
                         stride_yn, GROUP_M: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH: the producer's live tiles in its order (_ws_tid_get), columns [WHICH * BN, WHICH * BN + BN)
    of each (_fp8_ws_down_one)."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    n_n = gl.cdiv(H, b_bufs.type.shape[1])
    k_tiles = gl.cdiv(I, BLOCK_K)
    j = 0
    tile = _ws_tid_get(tids, tid_ready, tid_empty, j)
    while tile >= 0:
        pid_r, pid_n = _ws_tile_ids(tile, used, n_n, GROUP_M)
        _fp8_ws_down_one(a_bufs, b_bufs, ready, empty, j, k_tiles, pid_r, pid_n, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                         block_expert_ptr, num_pairs, H, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                         WHICH)
        j += 1
        tile = _ws_tid_get(tids, tid_ready, tid_empty, j)


@gluon.jit
def _fp8_ws_dyn_down_mma_worker(ad, wd, a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, counter_ptr, as_ptr,
                                ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, sbn, stride_as,
                                stride_wse, stride_wsn, stride_wsk, stride_yn, GROUP_M: gl.constexpr):
    """Consumer 1 (a worker partition)."""
    _fp8_ws_dyn_down_mma(a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                         block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk,
                         stride_yn, GROUP_M, 1)


@gluon.jit
def _fp8_ws_dyn_down_load_worker(ad, wd, a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, counter_ptr, as_ptr,
                                 ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, sbn, stride_as,
                                 stride_wse, stride_wsn, stride_wsk, stride_yn, GROUP_M: gl.constexpr):
    """The producer (a worker partition)."""
    _fp8_ws_dyn_down_load(ad, wd, a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, counter_ptr, sorted_ptr,
                          block_expert_ptr, used, num_pairs, H, I, GROUP_M)


@gluon.jit
def moe_down_fp8_ws_dyn_kernel(ad, wd, counter_ptr, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, H,
                               I, num_m, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                               GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """moe_down_fp8_ws_kernel with tiles claimed at run time (counter_ptr: int32 [1], zero at launch); the same
    arguments otherwise, and the same bits. Grid: one CTA an SM (any number works)."""
    gl.static_assert(num_warps == CONSUMER_WARPS, "the default partition is one consumer warp group")
    a_bufs, b_bufs = _fp8_down_ring(ad, wd, STAGES)
    tids = gl.allocate_shared_memory(gl.int32, [TID_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    tid_ready = gl.allocate_shared_memory(gl.int64, [TID_SLOTS, 1], mbarrier.MBarrierLayout())
    tid_empty = gl.allocate_shared_memory(gl.int64, [TID_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(TID_SLOTS):
        mbarrier.init(tid_ready.index(i), count=1)
        mbarrier.init(tid_empty.index(i), count=2)
    ready, empty, order = _ws_init_barriers(STAGES, 1, 2)  # no turns: order stays unused
    used = _ws_used_blocks(block_expert_ptr, num_m, num_warps)
    gl.warp_specialize([
        (_fp8_ws_dyn_down_mma, (a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, as_ptr, ws_ptr, y_ptr,
                                sorted_ptr, block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse,
                                stride_wsn, stride_wsk, stride_yn, GROUP_M, 0)),
        (_fp8_ws_dyn_down_mma_worker, (ad, wd, a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, counter_ptr,
                                       as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, sbn,
                                       stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, GROUP_M)),
        (_fp8_ws_dyn_down_load_worker, (ad, wd, a_bufs, b_bufs, ready, empty, tids, tid_ready, tid_empty, counter_ptr,
                                        as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, sbn,
                                        stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, GROUP_M)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
