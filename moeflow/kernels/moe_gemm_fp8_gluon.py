"""Gluon kernel (Hopper): the FP8 block-scaled (W8A8) gate_up GEMM, warp-specialised.

Legend as in moe_gemm_quant.py: P padded pair positions, H hidden, I intermediate per expert, G = 128 the
quantization group (BK = G: one activation and one weight scale a K step), sbn the weight-scale block along
the output axis.

    g, u = sum_kt (xq[tok(p), kt] @ Wq[e(p)][gate | up rows, kt]^T) * (xs[tok(p), kt] * ws[e(p), blk, kt])
    aq_PI[p], as_PG[p] = e4m3 groups of act(g, u) and their scales

the same products, scaled and summed in the same K order (acc + dot * (sa * sw), one fused multiply-add an
element), the same activation and the same group quantization as moe_gemm_fp8_tma.moe_gate_up_fp8_tma_kernel:
the same bits, checked on the GPU by
tests/test_experts_triton_quant.py::test_gpu_fp8_ws_kernels_equal_the_tma_kernels_bitwise.

Why warp-specialised: in the Triton fp8 GEMMs each K step (one scale group) is a fresh wgmma chain whose
product is scaled into the f32 sum: the warps wait for the wgmmas, pass a CTA barrier, then scale with FFMAs,
all warp groups in lock step, so the tensor pipe idles while they scale (33-43% busy at prefill:
`bash tools/ncu_profile.sh OUT quant_fp8_prefill_t8192_deepseek_v3`). DeepGEMM's cure, written here: a
producer warp group fills a ring of shared-memory stages and two consumer warp groups share each tile, each
waiting only for its own wgmmas and mbarriers, never a CTA barrier, so they drift out of phase and one's
scaling overlaps the other's wgmmas. It pays where the K loop is long: deepseek-v3 (H = 7168, 56 K steps)
9226 against 9867 us for the whole fp8 layer at T = 8192 on the H100; at H = 2048 (qwen3-30b-a3b-fp8,
16 K steps) the per-tile prologue and epilogue weigh more and the Triton kernel is faster (1143 against
1181 us): `python benchmarks/bench_experts_quant.py --shapes deepseek-v3,qwen3-30b-a3b-fp8 --prefill 8192`.

Schedule: a tile is 64 rows (one warp group's wgmma M) x 128 columns of I (one quantization group: the
epilogue quantizes whole groups). The tiles are the used blocks' (block_expert >= 0, a prefix) in
moe_gemm._tile_ids's grouped order; CTA p takes tiles p, p + NUM_PROGS, ...; a tile whose first row is
padding is all padding (an expert's rows come first in its block) and every partition skips it.
    producer    a warp group: per K step, the tile's four 64-row weight boxes by TMA and its 64 activation
                rows by cp.async (gathered by token: Hopper's TMA has no gather), handed over GU_COPY_DEPTH
                stages later behind a proxy fence (cp.async writes through the generic proxy, wgmma reads
                through the async one)
    consumer h  a warp group (h = 0 the default partition, 1 a worker): half the group's columns, 64 of
                gate and 64 of up, one m64 x 128 x k32 wgmma chain a K step, scaled into its f32 sum
    epilogue    act(g, u); the group's row maxima need both halves: each consumer leaves its 64 maxima in
                shared memory and meets the other at an mbarrier (_fp8_ws_group_amax), then both have the
                group's scale and quantize their own 64 columns

Gluon detail: a constexpr reaches a worker partition as a constexpr only when written inline in its
argument tuple (a tuple bound to a name first turns it into a runtime value): the calls below spell their
arguments out.
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
from .moe_gemm_quant import FP8_MAX

# Warps of each consumer: one warp group, a wgmma's unit (the default partition's num_warps).
CONSUMER_WARPS = gl.constexpr(4)
# Rows of a tile: one warp group's wgmma M. An alignment block (BM 64) is one tile.
TILE_M = gl.constexpr(64)
# Blocks counted per step when the kernel finds how many blocks are used.
_COUNT_BLOCK = gl.constexpr(1024)
# The producer: a warp group (its row copies are 16-byte cp.async chunks spread over 128 threads).
GU_PRODUCER_WARPS = gl.constexpr(4)
# Registers per thread asked for the worker partitions (setmaxnreg): a consumer holds its 64 x 128 f32 sum
# and the K step's product (64 registers a thread each), the producer only addresses and masks.
GU_PRODUCER_REGS = gl.constexpr(56)
GU_CONSUMER_REGS = gl.constexpr(224)
# Stages of row copies in flight before the producer hands a stage over.
GU_COPY_DEPTH = gl.constexpr(2)


# moe_gemm._activate (ACT 0 silu, 1 gelu_tanh, 2 swiglu_clamp, 3 gptoss) compiled as Gluon: the same
# source, so the same operations in the same order, so the same bits.
_ws_activate = gluon.jit(_activate.fn)


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
    """Whether the tile whose rows start at first_row holds a pair: an expert's rows come first in its
    block, so a tile whose first row is padding is all padding: skipped."""
    return gl.load(sorted_ptr + first_row) < num_pairs


@gluon.jit
def _ws_init_barriers(STAGES: gl.constexpr, READY_COUNT: gl.constexpr, EMPTY_COUNT: gl.constexpr):
    """(ready, empty, order): the ring's mbarrier pair per stage (ready: READY_COUNT arrivals fill a stage;
    empty: EMPTY_COUNT consumers free it) and two barriers (order) that no partition waits on. Dropping
    them moves every shared-memory offset of the compiled kernel (its PTX changes), so they stay until a
    change that is allowed to change the binary."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=READY_COUNT)
        mbarrier.init(empty.index(i), count=EMPTY_COUNT)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    return ready, empty, order


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


# ------------------------------------------------------------------------------------------- gate_up
# A tile is 64 rows x G = 128 columns of I (one quantization group: the epilogue quantizes whole groups, as
# moe_gemm_fp8_tma's). Its gate and up sums of 128 columns each would not fit one consumer's registers, so
# each consumer takes half of the group's columns: a stage holds the tile's 64 activation rows and the weight
# rows [gate n0 .. n0 + 64 | up n0 .. | gate n0 + 64 .. | up n0 + 64 ..] ([256, BK]); consumer h reads rows
# [128h, 128h + 128): one m64 x 128 x k32 wgmma chain a K step, columns [0, 64) gate, [64, 128) up. The group's row maxima need both halves: each consumer leaves its 64 maxima in
# shared memory and meets the other at an mbarrier (count 2, one phase a tile; two slots by the tile's parity,
# so a slot is rewritten only after the other consumer has read it), then both have the group's scale and
# quantize their own 64 columns.


@gluon.jit
def _fp8_ws_gate_up_load(xq_ptr, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H,
                         I, top_k, stride_xq, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """Producer (a warp group): for each live tile, each K step, the four 64-row weight boxes by TMA and the
    tile's 64 activation rows by cp.async (xq[token of each row], zeros for padding rows), handed over
    GU_COPY_DEPTH stages later behind a proxy fence (_ws_rows_hand_over)."""
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
    ready, empty, order = _ws_init_barriers(STAGES, 2, 2)  # order: unused (_ws_init_barriers)
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

