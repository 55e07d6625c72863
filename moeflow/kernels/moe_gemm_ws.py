"""Gluon kernels (Hopper): the aligned gate_up and down GEMMs, warp-specialised (issue 16 item 1):
cooperative or ping-pong.

Why Gluon: the Triton kernels of moe_gemm_tma.py leave the tensor pipe 65-76% busy at prefill
(ncu, RESULTS.md 2026-12-04): one 8-warp CTA per SM both issues the copies and runs the wgmmas,
and a tile's epilogue (convert, scatter the rows to y by pair) is not overlapped with any MMA.
Triton 3.6's automatic warp specialisation crashed or gained <= 2% (sixth session). Gluon, the
explicit-layout dialect Triton ships (triton.experimental.gluon), lets a kernel say which warps
do what: this is CUTLASS's "ping-pong" schedule written in it.

Layouts: the weights linear ([E, N, K], K contiguous: mixtral, qwen3, deepseek) or matmul ([E, K, N],
N contiguous) with gate/up interleaved column by column and biases (gpt-oss). The weight box is
[BN, BK] (linear; the wgmma reads it transposed) or [BK, BN] (matmul); the Triton TMA kernels serve
the linear layout only, so for gpt-oss these replace pointer kernels.

Schedule of the down GEMM (gate_up: the same with the differences listed at its kernels below; one
CTA per SM, persistent over the (64-row tile, column tile) work of the used blocks in
moe_gemm._tile_ids's grouped order, as moe_gemm_tma._down_flat walks blocks):
    tiles      64 rows (one warp group's wgmma M): an alignment block of BM = 64 / 128 rows is
               BM / 64 tiles; a tile whose first row is padding is all padding (an expert's rows
               come first in its block) and every partition skips it, so a block with <= 64 pairs
               costs one tile (the Triton kernels' half tiles, here for free)
    producer   1 warp: for each of this CTA's live tiles in order, for each K step, wait until the
               ring stage is free, then TMA the act box [64, BK] and the weight box [BN, BK]
               into it (STAGES stages, an mbarrier pair per stage: ready / empty)
    consumer 0 4 warps (one warp group, the default partition): this CTA's even live tiles
    consumer 1 4 warps (a worker partition): its odd live tiles
Each consumer owns whole tiles: its wgmmas (m64 x BN x k16, BN <= 256) read the ring stage by
stage in the producer's order, then it converts its accumulator and stores the rows by pair
while the other consumer's tile is in the tensor core.

Why an ordering barrier between the consumers (order[0], order[1]): a ring stage's "ready"
mbarrier is waited by parity, which tells "this fill" from "the previous fill" only while the
waiter is at most one lap of the ring ahead of the fills. Consumer 1's first tile starts k_tiles
positions into the ring: waiting there at kernel start, a fresh barrier's parity would let it
through before any data came. So a consumer starts a tile's main loop only once the other has
passed every wait of the tile before (it arrives on order[WHICH] after its last wait): all fills
before this tile are then done. This is CUTLASS's ping-pong order: the main loops alternate, each
epilogue overlaps the other consumer's main loop.

Numerics: each output element is the sum of the same products in the same K order (k16 wgmma steps
chained on one accumulator), then the same bias addition and activation, as the Triton kernels
(moe_gemm_tma._down_rows / _down_flat, moe_gemm.gate_up_rows / _down_block), whatever the tile
shapes: the same bits (the GPU test compares them bit for bit). One split.

Gluon detail: a constexpr reaches a worker partition as a constexpr only when written inline in its
argument tuple (a tuple bound to a name first turns it into a runtime value): the calls below spell
their arguments out.

The cooperative schedule (COOP; a 128-row tile, BM 128 plans): the producer fills a stage with the
tile's 128 act rows and the weight box; both consumers read every stage, consumer WHICH the rows
[WHICH * 64, WHICH * 64 + 64), so a weight box serves 128 rows as in the Triton kernels' 8 warps; the
"empty" barriers count both consumers' arrivals and there are no turns (both start at ring position
0). A block whose second 64 rows are padding: consumer 1 issues no wgmma but still waits for each of
the tile's stages before freeing it (an earlier arrival would count towards a phase consumer 0 has not
freed). Ping-pong reads each weight box for 64 rows: twice the weight traffic a FLOP. On the H100
(2026-12-05, benchmarks/RESULTS.md) ping-pong ran at 0.33-0.53x the Triton kernels' speed, DRAM-bound;
cooperative at 0.62-1.10x.

PACE (cooperative only; experts.triton.WS_PACE): consumer 1 computes a padding second half too (its
stores masked) instead of skipping it. Why (ncu, H100 2026-12-06, benchmarks/RESULTS.md): with balanced
routing (every expert two full 128-row blocks) the cooperative gate_up read each weight once (15.4 GB)
and ran 7% faster than the Triton kernel; with uniform routing (half the experts a third, mostly
padding block) it read them 2.4 times (36.4 GB). The cause: a CTA on a half-padding block runs ahead
of the CTAs that share its weight box (half the wgmmas a K step), so they stop finding the box in L2.
Paced, every tile of a block takes a full tile's time, as in the Triton persistent kernels (whose
in-kernel half tiles also lost there, 2026-12-04). Confirmed on the H100 (2026-12-06, ncu): paced,
the gate_up read 19.7 GB instead of 36.6 and ran 7.4 ms instead of 12.6 (tensor pipe 80% against 37%).
The down read 19 GB either way: its re-reads have another cause. On by default (WS_PACE).

Status: the same bits as the Triton kernels on the H100 (tests/test_experts_triton.py
::test_gpu_ws_kernels_equal_the_triton_kernels_bitwise, both schedules, graph replay); compiled
offline for sm_90a in the CPU suite (tests/test_gluon_ws.py); the synchronisation model-checked
(tests/test_ws_protocol.py). Slower than the Triton kernels at most prefill points, so nothing
launches them by default (moeflow.experts.triton: WS_DOWN, WS_GATE_UP, WS_COOP).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .moe_gemm import _activate, _tile_ids

# Warps of each consumer (one warp group: a wgmma's unit) and of the down's producer.
CONSUMER_WARPS = gl.constexpr(4)
PRODUCER_WARPS = gl.constexpr(1)
# Registers per thread asked for the worker partitions (setmaxnreg): the second consumer holds a
# 64 x N f32 accumulator (N / 2 registers a thread), the producer only scalars.
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
# Rows of a consumer tile: one warp group's wgmma M. An alignment block (BM 64 or 128) is BM / 64 tiles.
TILE_M = gl.constexpr(64)
# Blocks counted per step when the kernel finds how many blocks are used.
_COUNT_BLOCK = gl.constexpr(1024)


# moe_gemm._tile_ids (grouped order: GROUP_M row blocks share a weight column tile), compiled as Gluon.
_ws_tile_ids = gluon.jit(_tile_ids.fn)


@gluon.jit
def _ws_used_blocks(block_expert_ptr, num_m, num_warps: gl.constexpr):
    """Blocks with an expert (block_expert >= 0): a prefix, as moe_gemm_tma._used_blocks."""
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
    used = 0
    for b0 in range(0, num_m, _COUNT_BLOCK):
        offs = b0 + gl.arange(0, _COUNT_BLOCK, layout=layout)
        e = gl.load(block_expert_ptr + offs, mask=offs < num_m, other=-1)
        used += gl.sum((e >= 0).to(gl.int32), axis=0)
    return used


@gluon.jit
def _ws_live(sorted_ptr, first_row, num_pairs):
    """Whether the rows from first_row (a tile's, or a cooperative consumer's half) hold a pair: an
    expert's rows come first in its block, so rows whose first is padding are all padding (the second
    half of a block with <= 64 pairs): skipped."""
    return gl.load(sorted_ptr + first_row) < num_pairs


@gluon.jit
def _ws_consume_tile(a_bufs, b_bufs, ready, empty, order, i, j, k_tiles, WHICH: gl.constexpr,
                     B_MN: gl.constexpr, COOP: gl.constexpr):
    """Consumer WHICH's i-th tile, the CTA's j-th live tile: returns its f32 accumulator [64, N] (wgmma
    m64 x N x k16 chains; N the stage's weight columns: b_bufs [S, N, BK], or [S, BK, N] when B_MN).

    Ping-pong (not COOP): its turn first: wait until the other consumer has passed every wait of the
    tile before (module docstring; the other's arrivals on order[1 - WHICH] so far: i + WHICH, consumer
    0 going first). Cooperative (COOP): no turns; the stage's act rows [WHICH * 64, WHICH * 64 + 64)
    are this consumer's. Then the K loop from ring position j * k_tiles: wait for the stage, issue its
    wgmmas, keep them in flight and free the stage before. Then (ping-pong) hand the turn over, wait
    for the last wgmmas, free the last stage.
    """
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    N: gl.constexpr = b_bufs.type.shape[2] if B_MN else b_bufs.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, N, 16])
    if not COOP:
        if (WHICH == 1) | (i > 0):
            mbarrier.wait(order.index(1 - WHICH), (i + WHICH - 1) & 1)
    acc = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    c = j * k_tiles
    for kt in range(k_tiles):
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        if B_MN:
            b = b_bufs.index(s)
        else:
            b = b_bufs.index(s).permute((1, 0))
        if COOP:
            a = a_bufs.index(s).slice(WHICH * TILE_M, TILE_M)
        else:
            a = a_bufs.index(s)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        # keep this step's wgmmas in flight; the step before is done, so its stage is free
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1, pred=kt > 0)
        c += 1
    if not COOP:
        mbarrier.arrive(order.index(WHICH), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), count=1)
    return acc


@gluon.jit
def _ws_claim(sorted_ptr, a_bufs, ready, empty, pid_r, j, k_tiles, num_pairs, WHICH: gl.constexpr,
              PACE: gl.constexpr):
    """(first row, mine) of consumer WHICH in the CTA's j-th live tile pid_r (a_bufs' ROWS rows):
    ping-pong (ROWS 64) the whole tile, its own when j % 2 == WHICH; cooperative (ROWS 128) rows
    [WHICH * 64, WHICH * 64 + 64), its own when they hold a pair; when they do not, the consumer
    passes the tile's stages here (_ws_skip_tile). PACE (cooperative): always its own, padding rows
    included (their wgmmas run, their stores are masked), so that every tile of a block takes a full
    tile's time (module docstring: why)."""
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    if ROWS == TILE_M:
        row0 = pid_r * ROWS
        mine = j % 2 == WHICH
    else:
        row0 = pid_r * ROWS + WHICH * TILE_M
        if PACE:
            mine = True
        else:
            mine = _ws_live(sorted_ptr, row0, num_pairs)
            if not mine:
                _ws_skip_tile(a_bufs, ready, empty, j, k_tiles)
    return row0, mine


@gluon.jit
def _ws_skip_tile(a_bufs, ready, empty, j, k_tiles):
    """Cooperative consumer 1 on a block whose second 64 rows are padding: no wgmma, but the ring's
    protocol kept: wait for each stage (its fill implies the stage's previous use was freed by both
    consumers: an arrival before it would count towards that earlier phase) and free it."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    c = j * k_tiles
    for _kt in range(k_tiles):
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        mbarrier.arrive(empty.index(s), count=1)
        c += 1


@gluon.jit
def _ws_init_barriers(STAGES: gl.constexpr, READY_COUNT: gl.constexpr, EMPTY_COUNT: gl.constexpr):
    """(ready, empty, order): the ring's mbarrier pair per stage (empty: EMPTY_COUNT consumers free each
    stage: 1 ping-pong, 2 cooperative) and the ping-pong consumers' two ordering barriers."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_COUNT)
        mbarrier.init(empty.index(i), count=EMPTY_COUNT)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    return ready, empty, order


# ---------------------------------------------------------------------------------------------- down
@gluon.jit
def _ws_down_load(ad, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H, I,
                  SUB: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr, MATMUL: gl.constexpr):
    """Producer: the TMA copies of every K step of this CTA's live tiles (ROWS rows: 64 ping-pong, 128
    cooperative), in order, into the ring."""
    ROWS: gl.constexpr = ad.block_type.shape[0]
    BLOCK_K: gl.constexpr = ad.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd.block_type.shape[1] if MATMUL else wd.block_type.shape[0]
    n_n = gl.cdiv(H, BLOCK_N)
    k_tiles = gl.cdiv(I, BLOCK_K)
    c = 0
    for tile in range(gl.program_id(0), used * SUB * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used * SUB, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * ROWS, num_pairs):
            e = gl.load(block_expert_ptr + pid_r // SUB)
            c = _ws_down_load_tile(ad, wd, a_bufs, b_bufs, ready, empty, c, e, pid_r, pid_n, H, I, k_tiles, MATMUL)


@gluon.jit
def _ws_down_load_tile(ad, wd, a_bufs, b_bufs, ready, empty, c, e, pid_r, pid_n, H, I, k_tiles,
                       MATMUL: gl.constexpr):
    """Producer: one live tile's TMA copies (act rows pid_r * ROWS.., expert e's weight columns pid_n * BN..),
    K step by K step into the ring from position c; returns the position after them."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS: gl.constexpr = ad.block_type.shape[0]
    BLOCK_K: gl.constexpr = ad.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd.block_type.shape[1] if MATMUL else wd.block_type.shape[0]
    for kt in range(k_tiles):
        s = c % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first
        # pass over the ring waits on parity 1 and goes straight through
        mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, ad.block_type.nbytes + wd.block_type.nbytes)
        tma.async_copy_global_to_shared(ad, [pid_r * ROWS, kt * BLOCK_K], bar, a_bufs.index(s))
        if MATMUL:  # down [E, I, H] viewed [E * I, H]
            tma.async_copy_global_to_shared(wd, [e * I + kt * BLOCK_K, pid_n * BLOCK_N], bar, b_bufs.index(s))
        else:  # down [E, H, I] viewed [E * H, I]
            tma.async_copy_global_to_shared(wd, [e * H + pid_n * BLOCK_N, kt * BLOCK_K], bar, b_bufs.index(s))
        c += 1
    return c


@gluon.jit
def _ws_down_mma(a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr, block_expert_ptr, used, num_pairs,
                 H, I, stride_yn, stride_be, SUB: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
                 WHICH: gl.constexpr, MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr, PACE: gl.constexpr):
    """Consumer WHICH (0 or 1): the wgmmas and the epilogue (bias, then the rows stored by pair) of this
    CTA's live tiles j with j % 2 == WHICH (ping-pong), or of the rows [WHICH * 64, WHICH * 64 + 64) of
    every live 128-row tile (cooperative: the stage's act box holds 128 rows)."""
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    COOP: gl.constexpr = ROWS != TILE_M
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if MATMUL else b_bufs.type.shape[1]
    n_n = gl.cdiv(H, BLOCK_N)
    k_tiles = gl.cdiv(I, BLOCK_K)
    i = 0  # this consumer's tiles so far
    j = 0  # the CTA's live tiles so far (both consumers'): the producer's order
    for tile in range(gl.program_id(0), used * SUB * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used * SUB, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * ROWS, num_pairs):
            row0, mine = _ws_claim(sorted_ptr, a_bufs, ready, empty, pid_r, j, k_tiles, num_pairs, WHICH, PACE)
            if mine:
                acc = _ws_consume_tile(a_bufs, b_bufs, ready, empty, order, i, j, k_tiles, WHICH, MATMUL, COOP)
                i += 1
                row_layout: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
                col_layout: gl.constexpr = gl.SliceLayout(0, acc.type.layout)
                offs_h = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                if HAS_BIAS:  # moe_gemm._down_block: the bias joins the f32 sum before the rounding
                    e = gl.load(block_expert_ptr + pid_r // SUB).to(gl.int64)
                    bias = gl.load(b_ptr + e * stride_be + offs_h, mask=offs_h < H, other=0.0)
                    acc += gl.expand_dims(bias.to(gl.float32), 0)
                offs_p = row0 + gl.arange(0, TILE_M, layout=row_layout)
                pair = gl.load(sorted_ptr + offs_p)
                row_ok = pair < num_pairs
                y_ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_yn, 1) + gl.expand_dims(offs_h, 0)
                mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_h < H, 0)
                gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
            j += 1


# Worker partitions: one argument list for every worker (Gluon's rule), so each takes all of both roles'.
@gluon.jit
def _ws_down_mma_worker(ad, wd, a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr, block_expert_ptr,
                        used, num_pairs, H, I, stride_yn, stride_be, SUB: gl.constexpr, NUM_PROGS: gl.constexpr,
                        GROUP_M: gl.constexpr, MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr, PACE: gl.constexpr):
    """Consumer 1 (a worker partition: the odd live tiles)."""
    _ws_down_mma(a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr, block_expert_ptr, used, num_pairs,
                 H, I, stride_yn, stride_be, SUB, NUM_PROGS, GROUP_M, 1, MATMUL, HAS_BIAS, PACE)


@gluon.jit
def _ws_down_load_worker(ad, wd, a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr, block_expert_ptr,
                         used, num_pairs, H, I, stride_yn, stride_be, SUB: gl.constexpr, NUM_PROGS: gl.constexpr,
                         GROUP_M: gl.constexpr, MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr, PACE: gl.constexpr):
    """The producer (a worker partition)."""
    _ws_down_load(ad, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, SUB,
                  NUM_PROGS, GROUP_M, MATMUL)


@gluon.jit
def moe_down_ws_kernel(ad, wd, y_ptr, b_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, I, num_m, stride_yn,
                       stride_be, BLOCK_M: gl.constexpr, MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr,
                       NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PACE: gl.constexpr,
                       num_warps: gl.constexpr):
    """y_NH[pair] = act_PI[p] @ W_d[e(p)] (+ b_d[e(p)]) like moe_gemm_tma.moe_down_tma_kernel / moe_gemm's
    moe_down_kernel with one split.

    ad: Gluon TensorDescriptor over act_PI [P, I], block [ROWS, BK] (ROWS 64: ping-pong; 128: cooperative,
    BLOCK_M 128 only); wd: over down viewed [E * H, I],
    block [BN, BK] (linear), or viewed [E * I, H], block [BK, BN] (MATMUL) (NVMMASharedLayout.get_default_for
    their block, bf16 / fp16); y_ptr: y_NH [N, H] rows by pair (stride_yn); b_ptr: b_d [E, H] (HAS_BIAS;
    else any pointer). BLOCK_M the alignment's block (64 or 128: BLOCK_M / ROWS tiles; all-padding tiles skipped,
    and in the cooperative schedule all-padding 64-row halves too unless PACE). Grid (NUM_PROGS,), num_warps = CONSUMER_WARPS (the default partition);
    the workers add CONSUMER_WARPS + PRODUCER_WARPS. BN <= 256 (one wgmma's N), BK | I; BN | H in the
    linear layout (MATMUL: the last column tile may run past H: TMA fills zeros, the store is masked).
    """
    gl.static_assert(num_warps == CONSUMER_WARPS, "the default partition is one consumer warp group")
    ROWS: gl.constexpr = ad.block_type.shape[0]  # a tile: 64 rows (ping-pong) or 128 (cooperative)
    gl.static_assert((ROWS == TILE_M) | (ROWS == 2 * TILE_M), "a tile is one or two warp groups' wgmma M")
    gl.static_assert(BLOCK_M % ROWS == 0, "an alignment block is whole tiles")
    BLOCK_K: gl.constexpr = ad.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd.block_type.shape[1] if MATMUL else wd.block_type.shape[0]
    W_K: gl.constexpr = wd.block_type.shape[0] if MATMUL else wd.block_type.shape[1]
    gl.static_assert(W_K == BLOCK_K, "act and weight boxes share BK")
    gl.static_assert(BLOCK_N <= 256 and BLOCK_N % 8 == 0, "one wgmma spans the tile's columns")
    a_bufs = gl.allocate_shared_memory(ad.dtype, [STAGES, ROWS, BLOCK_K], ad.layout)
    b_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES] + wd.block_type.shape, wd.layout)
    ready, empty, order = _ws_init_barriers(STAGES, 1, ROWS // TILE_M)
    used = _ws_used_blocks(block_expert_ptr, num_m, num_warps)
    gl.warp_specialize([
        (_ws_down_mma, (a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr, block_expert_ptr, used,
                        num_pairs, H, I, stride_yn, stride_be, BLOCK_M // ROWS, NUM_PROGS, GROUP_M, 0, MATMUL,
                        HAS_BIAS, PACE)),
        (_ws_down_mma_worker, (ad, wd, a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr,
                               block_expert_ptr, used, num_pairs, H, I, stride_yn, stride_be, BLOCK_M // ROWS,
                               NUM_PROGS, GROUP_M, MATMUL, HAS_BIAS, PACE)),
        (_ws_down_load_worker, (ad, wd, a_bufs, b_bufs, ready, empty, order, y_ptr, b_ptr, sorted_ptr,
                                block_expert_ptr, used, num_pairs, H, I, stride_yn, stride_be, BLOCK_M // ROWS,
                                NUM_PROGS, GROUP_M, MATMUL, HAS_BIAS, PACE)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------- gate_up
# The gate_up GEMM in the same schedule (moe_gate_up_ws_kernel). Its activation rows are gathered
# by token (x[pair // top_k]): Hopper's TMA has no gather, so the producer is a whole warp group
# issuing cp.async copies of the rows (GU_PRODUCER_WARPS) next to the TMA copies of the weight boxes.
# cp.async writes shared memory through the generic proxy and wgmma reads it through the async proxy,
# so the producer hands a stage over only once its own copies of it are complete (cp.async.wait_group),
# after a proxy fence: it keeps GU_COPY_DEPTH stages of row copies in flight and arrives on a stage's
# "ready" barrier (count 2: this arrival and the weight copies' expect) GU_COPY_DEPTH stages later.
# A stage holds a tile's gate and up columns side by side, so a K step is one chain of m64 x 2BN x k16
# wgmmas (as the Triton kernels' fused form: the A tile read once, half the instructions):
#     linear     gate box [BN, BK] and up box [BN, BK] (rows n0 and I + n0 of [E * 2I, H]) in the two
#                halves of a [2BN, BK] stage: accumulator columns [0, BN) gate, [BN, 2BN) up
#     matmul     gpt-oss's interleaved columns (gate 2j, up 2j + 1): one box [BK, 2BN] at column
#                2 * n0 of [E * H, 2I]; the bias [2BN] joins the accumulator before the split, as in
#                moe_gemm.gate_up_rows
# In the accumulator layout a thread holds the same columns of both halves and both of each (even, odd)
# pair, so splitting gate from up is a register renaming either way.
GU_PRODUCER_WARPS = gl.constexpr(4)
GU_PRODUCER_REGS = gl.constexpr(56)
GU_CONSUMER_REGS = gl.constexpr(224)
GU_COPY_DEPTH = gl.constexpr(2)


# moe_gemm._activate (ACT 0 silu, 1 gelu_tanh, 2 swiglu_clamp, 3 gptoss) compiled as Gluon: the same
# source, so the same operations in the same order, so the same bits.
_ws_activate = gluon.jit(_activate.fn)


@gluon.jit
def _ws_gate_up_load(x_ptr, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H, I,
                     top_k, stride_xt, SUB: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
                     MATMUL: gl.constexpr):
    """Producer (a warp group): per K step of this CTA's live tiles, the weight boxes by TMA and the tile's
    ROWS activation rows (64 ping-pong, 128 cooperative) by cp.async (x[token of each row], zeros for
    padding rows)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = wd.block_type.shape[1] // 2 if MATMUL else wd.block_type.shape[0]
    TPW_K: gl.constexpr = BLOCK_K // 8
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [GU_PRODUCER_WARPS, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, copy_layout)
    cols: gl.constexpr = gl.SliceLayout(0, copy_layout)
    n_n = gl.cdiv(I, BLOCK_N)
    k_tiles = gl.cdiv(H, BLOCK_K)
    offs_k = gl.arange(0, BLOCK_K, layout=cols)
    c = 0
    for tile in range(gl.program_id(0), used * SUB * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used * SUB, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * ROWS, num_pairs):
            e = gl.load(block_expert_ptr + pid_r // SUB)
            pair = gl.load(sorted_ptr + pid_r * ROWS + gl.arange(0, ROWS, layout=rows))
            row_ok = pair < num_pairs
            tok = gl.where(row_ok, pair // top_k, 0).to(gl.int64)
            a_ptrs = x_ptr + gl.expand_dims(tok * stride_xt, 1) + gl.expand_dims(offs_k, 0)
            a_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_k < BLOCK_K, 0)
            for kt in range(k_tiles):
                s = c % STAGES
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, wd.block_type.nbytes * (1 if MATMUL else 2))
                b = b_bufs.index(s)
                if MATMUL:  # gate_up [E, H, 2I] viewed [E * H, 2I], gate / up interleaved
                    tma.async_copy_global_to_shared(wd, [e * H + kt * BLOCK_K, pid_n * (2 * BLOCK_N)], bar, b)
                else:  # gate_up [E, 2I, H] viewed [E * 2I, H]: gate rows, then up rows
                    row_g = e * (2 * I) + pid_n * BLOCK_N
                    tma.async_copy_global_to_shared(wd, [row_g, kt * BLOCK_K], bar, b.slice(0, BLOCK_N))
                    tma.async_copy_global_to_shared(wd, [row_g + I, kt * BLOCK_K], bar, b.slice(BLOCK_N, BLOCK_N))
                async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + kt * BLOCK_K, mask=a_mask)
                _ws_rows_hand_over(ready, c, STAGES)
                c += 1
    _ws_rows_drain(ready, c, STAGES)


@gluon.jit
def _ws_rows_hand_over(ready, c, STAGES: gl.constexpr):
    """After ring position c's row copies are issued: commit them; those of GU_COPY_DEPTH positions ago are
    then complete, so fence them into the async proxy and hand that stage over (its "ready" arrival)."""
    async_copy.commit_group()
    async_copy.wait_group(GU_COPY_DEPTH)
    fence_async_shared()
    gl.thread_barrier()  # every thread's fence before the one arrival (made by one thread)
    done = c - GU_COPY_DEPTH
    mbarrier.arrive(ready.index((done + STAGES) % STAGES), count=1, pred=done >= 0)


@gluon.jit
def _ws_rows_drain(ready, c, STAGES: gl.constexpr):
    """After the last position c - 1: complete, fence and hand over the stages still in flight."""
    async_copy.wait_group(0)
    fence_async_shared()
    gl.thread_barrier()
    for d in gl.static_range(GU_COPY_DEPTH):
        done = c - GU_COPY_DEPTH + d
        mbarrier.arrive(ready.index((done + STAGES) % STAGES), count=1, pred=done >= 0)


@gluon.jit
def _ws_gate_up_mma(a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr, block_expert_ptr, used,
                    num_pairs, H, I, stride_ap, stride_be, limit, alpha, SUB: gl.constexpr, NUM_PROGS: gl.constexpr,
                    GROUP_M: gl.constexpr, WHICH: gl.constexpr, MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr,
                    ACT: gl.constexpr, PACE: gl.constexpr):
    """Consumer WHICH: one m64 x 2BN wgmma chain a K step over its 64 rows of the live tiles (ping-pong:
    the tiles j with j % 2 == WHICH; cooperative: rows [WHICH * 64, WHICH * 64 + 64) of every 128-row
    tile), then (bias,) the split into gate and up, act(g, u), stored by row."""
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    COOP: gl.constexpr = ROWS != TILE_M
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = (b_bufs.type.shape[2] if MATMUL else b_bufs.type.shape[1]) // 2
    n_n = gl.cdiv(I, BLOCK_N)
    k_tiles = gl.cdiv(H, BLOCK_K)
    i = 0  # this consumer's tiles so far
    j = 0  # the CTA's live tiles so far (both consumers'): the producer's order
    for tile in range(gl.program_id(0), used * SUB * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used * SUB, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * ROWS, num_pairs):
            row0, mine = _ws_claim(sorted_ptr, a_bufs, ready, empty, pid_r, j, k_tiles, num_pairs, WHICH, PACE)
            if mine:
                acc = _ws_consume_tile(a_bufs, b_bufs, ready, empty, order, i, j, k_tiles, WHICH, MATMUL, COOP)
                i += 1
                if MATMUL:
                    if HAS_BIAS:  # the interleaved bias joins the accumulator before the split
                        e = gl.load(block_expert_ptr + pid_r // SUB).to(gl.int64)
                        offs_c = pid_n * (2 * BLOCK_N) + gl.arange(0, 2 * BLOCK_N,
                                                                   layout=gl.SliceLayout(0, acc.type.layout))
                        bias = gl.load(b_ptr + e * stride_be + offs_c, mask=offs_c < 2 * I, other=0.0)
                        acc += gl.expand_dims(bias.to(gl.float32), 0)
                    g, u = gl.split(gl.reshape(acc, [TILE_M, BLOCK_N, 2]))
                else:
                    g, u = gl.split(gl.permute(gl.reshape(acc, [TILE_M, 2, BLOCK_N]), [0, 2, 1]))
                out = _ws_activate(g, u, limit, alpha, ACT)
                row_layout: gl.constexpr = gl.SliceLayout(1, out.type.layout)
                col_layout: gl.constexpr = gl.SliceLayout(0, out.type.layout)
                offs_p = row0 + gl.arange(0, TILE_M, layout=row_layout)
                row_ok = gl.load(sorted_ptr + offs_p) < num_pairs
                offs_j = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                act_ptrs = act_ptr + gl.expand_dims(offs_p.to(gl.int64) * stride_ap, 1) + gl.expand_dims(offs_j, 0)
                mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_j < I, 0)
                gl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=mask)
            j += 1


@gluon.jit
def _ws_gate_up_mma_worker(x_ptr, wd, a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr,
                           block_expert_ptr, used, num_pairs, H, I, top_k, stride_xt, stride_ap, stride_be, limit,
                           alpha, SUB: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
                           MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr, PACE: gl.constexpr):
    """Consumer 1 (a worker partition: the odd live tiles)."""
    _ws_gate_up_mma(a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr, block_expert_ptr, used,
                    num_pairs, H, I, stride_ap, stride_be, limit, alpha, SUB, NUM_PROGS, GROUP_M, 1, MATMUL,
                    HAS_BIAS, ACT, PACE)


@gluon.jit
def _ws_gate_up_load_worker(x_ptr, wd, a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr,
                            block_expert_ptr, used, num_pairs, H, I, top_k, stride_xt, stride_ap, stride_be, limit,
                            alpha, SUB: gl.constexpr, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr,
                            MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr, ACT: gl.constexpr, PACE: gl.constexpr):
    """The producer (a worker partition)."""
    _ws_gate_up_load(x_ptr, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H, I,
                     top_k, stride_xt, SUB, NUM_PROGS, GROUP_M, MATMUL)


@gluon.jit
def moe_gate_up_ws_kernel(x_ptr, wd, act_ptr, b_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, I, top_k, num_m,
                          stride_xt, stride_ap, stride_be, limit, alpha,
                          ACT: gl.constexpr, BLOCK_M: gl.constexpr, MATMUL: gl.constexpr, HAS_BIAS: gl.constexpr,
                          NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                          COOP: gl.constexpr, PACE: gl.constexpr, num_warps: gl.constexpr):
    """act_PI[p, j] = act(x[tok(p)] @ W_gu[e(p)] (+ b_gu[e(p)])) like moe_gemm_tma.moe_gate_up_tma_kernel
    (linear) / moe_gemm.moe_gate_up_kernel (MATMUL, interleaved, HAS_BIAS: gpt-oss).

    wd: Gluon TensorDescriptor over gate_up viewed [E * 2I, H] (gate rows then up rows), block [BN, BK]; or
    (MATMUL) over gate_up [E, H, 2I] (gate / up columns interleaved) viewed [E * H, 2I], block [BK, 2BN];
    x_ptr [*, H] rows of the tokens (unit column stride, 16-byte aligned rows: cp.async), act_ptr act_PI
    [P, I], b_ptr b_gu [E, 2I] (HAS_BIAS, interleaved; else any pointer); BLOCK_M the alignment's block
    (64 or 128); COOP: the cooperative schedule (128-row tiles, BLOCK_M 128), else ping-pong (64-row
    tiles). Grid (NUM_PROGS,), num_warps = CONSUMER_WARPS.
    """
    gl.static_assert(num_warps == CONSUMER_WARPS, "the default partition is one consumer warp group")
    ROWS: gl.constexpr = TILE_M * (2 if COOP else 1)  # a tile: 64 rows (ping-pong) or 128 (cooperative)
    gl.static_assert(BLOCK_M % ROWS == 0, "an alignment block is whole tiles")
    gl.static_assert(MATMUL or not HAS_BIAS, "a bias only with gpt-oss's interleaved matmul layout")
    BLOCK_K: gl.constexpr = wd.block_type.shape[0] if MATMUL else wd.block_type.shape[1]
    N2: gl.constexpr = wd.block_type.shape[1] if MATMUL else 2 * wd.block_type.shape[0]
    gl.static_assert(N2 <= 256 and N2 % 16 == 0, "one wgmma spans the gate and up columns (2BN <= 256)")
    gl.static_assert(BLOCK_K % 8 == 0 and BLOCK_K <= 256, "the row copies are 8-element chunks")
    gl.static_assert(STAGES > GU_COPY_DEPTH + 1, "the ring holds the copies in flight and the wgmma's stage")
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_K], wd.dtype)
    a_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, ROWS, BLOCK_K], a_layout)
    if MATMUL:
        b_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, BLOCK_K, N2], wd.layout)
    else:
        b_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, N2, BLOCK_K], wd.layout)
    # ready: the weight copies' expect + the producer's row hand-over
    ready, empty, order = _ws_init_barriers(STAGES, 2, ROWS // TILE_M)
    used = _ws_used_blocks(block_expert_ptr, num_m, num_warps)
    gl.warp_specialize([
        (_ws_gate_up_mma, (a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr, block_expert_ptr, used,
                           num_pairs, H, I, stride_ap, stride_be, limit, alpha, BLOCK_M // ROWS, NUM_PROGS,
                           GROUP_M, 0, MATMUL, HAS_BIAS, ACT, PACE)),
        (_ws_gate_up_mma_worker, (x_ptr, wd, a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr,
                                  block_expert_ptr, used, num_pairs, H, I, top_k, stride_xt, stride_ap, stride_be,
                                  limit, alpha, BLOCK_M // ROWS, NUM_PROGS, GROUP_M, MATMUL, HAS_BIAS, ACT, PACE)),
        (_ws_gate_up_load_worker, (x_ptr, wd, a_bufs, b_bufs, ready, empty, order, act_ptr, b_ptr, sorted_ptr,
                                   block_expert_ptr, used, num_pairs, H, I, top_k, stride_xt, stride_ap, stride_be,
                                   limit, alpha, BLOCK_M // ROWS, NUM_PROGS, GROUP_M, MATMUL, HAS_BIAS, ACT, PACE)),
    ], [CONSUMER_WARPS, GU_PRODUCER_WARPS], [GU_CONSUMER_REGS, GU_PRODUCER_REGS])
