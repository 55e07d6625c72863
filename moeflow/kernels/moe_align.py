"""Private Triton kernels: group (token, slot) pairs by expert into BLOCK_M-padded blocks.

Legend: N pairs (T tokens x K slots, flattened row-major: pair n = t * K + k),
E experts, E_PAD a power of two > E (one spare bin for out-of-range ids),
BM = BLOCK_M rows per block, B = max_blocks (a bound that needs no host sync).

Output layout (what the GEMM kernels read):
    sorted_P       int32 [B * BM]   pair index at each padded position; N at a padding slot.
                                    Inside one expert, pairs keep their input order
                                    (stable), so the layout is a pure function of ids.
    block_expert_B int32 [B]        the expert of each block; -1 past the last used block.

Why a fixed bound B = ceil(N / BM) + min(N, E): each used expert wastes < BM slots, at most
min(N, E) experts are used, so the padded length never exceeds it. The grid of every kernel
downstream is sized by B on the host, which is what keeps the pipeline sync-free and
capturable in a CUDA graph (blocks past the end read block_expert = -1 and return).

Ids outside [0, E) go to the spare bin E and are never placed: the GEMMs skip them and
the combine pass writes NaN for them (loud, never a silent clamp).

Three schedules, same results bit for bit:
  * N <= ALIGN_SMALL_MAX: one program ranks the pairs by [N, N] comparisons (decode);
  * N <= ALIGN_FUSED_MAX: one program does count, scan and scatter (one launch);
  * larger N: count per chunk (grid) -> place per chunk (grid: each program sums the chunk
    histograms itself, places its chunk's pairs and writes its share of the blocks),
    chunks of align_chunk(N) pairs.
Counting uses integer histograms, so results never depend on thread timing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton import interpreted
from .launch import FastKernel, fast_kernel
from .pdl import pdl_trigger, pdl_wait

# The largest N done in one program, and the multi-kernel schedule's smallest chunk and most
# chunks. H200, CUDA graph replays (`python tools/diag_align.py`: its "one" and "multi" variants):
# the one program's serial scatter (N / SUB steps) takes 145 us at N = 2048 where the multi-kernel
# schedule with 256-pair chunks takes 33 us (46 vs 31 us at N = 512; 6.4 vs 10 us at N = 8, where the
# launches dominate); 256-pair chunks are fastest up to N = 16384 (52 vs 93 us with 1024), 512-pair
# ones at 49152-65536.
ALIGN_FUSED_MAX = 256
# Up to this many pairs the small kernel (pairwise comparisons, no E-wide histogram) places them:
# at decode the fused kernel's one program is a chain of dependent steps over E_PAD bins (~100 active
# cycles at qwen3 / deepseek-v3 T = 1). H200, graph replay us (`python tools/diag_align.py`:
# "default" against "no-small"): the small kernel 4.1-4.7 against the fused kernel's 6.2-8.4 at
# N = 4..32, 6.4 against 11.3-14.9 at N = 64.
ALIGN_SMALL_MAX = 64
# The small kernel's (warps, elements of its [BB, NP] block-owner matrix a step: BB = elements // NP) by
# NP, the pairs padded to a power of two >= 16. H200, graph us with the replay's overhead
# (`python tools/diag_align.py`: its "small w* bb*" variants): NP = 64 8.0 us at (4, 2048), 6.4 at
# (8, 8192) (its [NP, NP] matrices hold 167 registers a thread with 4 warps, 96 with 8); NP <= 32 best
# at (4, 2048) (4.1-4.3 us, the others 4.3-5.2).
ALIGN_SMALL_LAUNCH = {16: (4, 2048), 32: (4, 2048), 64: (8, 8192)}
ALIGN_CHUNK = 256
ALIGN_MAX_CHUNKS = 128
# Pairs handled together inside the scatter loop ([SUB, E_PAD] one-hot matrix).
ALIGN_SUB = 32
# Blocks handled together when writing block_expert ([BLOCKS, E_PAD] comparison).
ALIGN_BLOCKS = 16
# Chunk histograms summed together by the place kernel ([ROWS, E_PAD] loads).
ALIGN_ROWS = 16


@triton.jit
def _load_ids(ids_ptr, offs, n_end, E):
    """Expert id of each pair at `offs` (int32); masked-out or out-of-range ids -> E."""
    ids = tl.load(ids_ptr + offs, mask=offs < n_end, other=E).to(tl.int32)
    ok = (ids >= 0) & (ids < E)
    return tl.where(ok, ids, E)


@triton.jit
def _count_range(ids_ptr, n_lo, n_hi, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Histogram [E_PAD] of the ids in pairs [n_lo, n_hi) (bin E holds the invalid ones)."""
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(n_lo, n_hi, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = _load_ids(ids_ptr, offs, n_hi, E)
        counts += tl.histogram(ids, E_PAD).to(tl.int32)
    return counts


@triton.jit
def _scatter_range(ids_ptr, sorted_ptr, run, n_lo, n_hi, E, SUB: tl.constexpr, E_PAD: tl.constexpr):
    """Place pairs [n_lo, n_hi) at run[e] + (stable rank among earlier pairs of e in the range).

    run: int32 [E_PAD], the first free padded position of each expert for this range.
    """
    e_idx = tl.arange(0, E_PAD)
    for s0 in range(n_lo, n_hi, SUB):
        offs = s0 + tl.arange(0, SUB)
        ids = _load_ids(ids_ptr, offs, n_hi, E)
        onehot = (ids[:, None] == e_idx[None, :]).to(tl.int32)  # [SUB, E_PAD]
        # rank of each pair among the pairs of its expert earlier in this sub-chunk
        before = tl.cumsum(onehot, 0) - onehot
        rank = tl.sum(onehot * before, 1)
        base = tl.sum(onehot * run[None, :], 1)
        tl.store(sorted_ptr + base + rank, offs, mask=(offs < n_hi) & (ids < E))
        run += tl.sum(onehot, 0)
    return run


@triton.jit
def _scatter_sorted(ids_ptr, sorted_ptr, run, n_lo, n_hi, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """_scatter_range's result for one range of at most CHUNK pairs, with no serial loop.

    Sorting key = id * CHUNK + position groups the pairs by expert and keeps their order inside
    one (stable, as the layout requires); a pair's rank among its expert's pairs is its sorted
    position minus the number of pairs of smaller ids (the exclusive cumsum of the range's
    histogram). Invalid / masked-out pairs carry id E (the spare bin) and are not stored.
    """
    pos = tl.arange(0, CHUNK)
    ids = _load_ids(ids_ptr, n_lo + pos, n_hi, E)
    sk = tl.sort(ids * CHUNK + pos)
    sid = sk // CHUNK
    src = n_lo + sk % CHUNK
    hist = tl.histogram(ids, E_PAD).to(tl.int32)
    first = tl.cumsum(hist, 0) - hist
    dest = tl.gather(run, sid, 0) + pos - tl.gather(first, sid, 0)
    tl.store(sorted_ptr + dest, src, mask=sid < E)


@triton.jit
def _write_blocks(sorted_ptr, block_expert_ptr, start, count, N, E, max_blocks, b_lo, b_hi,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCKS: tl.constexpr):
    """block_expert for blocks [b_lo, min(b_hi, max_blocks)), and the N sentinel at their padding slots.

    start/count: int32 [E_PAD] padded start and pair count of each expert (0 for e >= E).
    """
    e_idx = tl.arange(0, E_PAD)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = start + padded
    total = tl.sum(padded, 0)
    fill_end = start + count
    b_end = tl.minimum(b_hi, max_blocks)
    for b0 in range(b_lo, b_end, BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        p = b * BLOCK_M
        # owner of the block = the first expert whose padded range ends after p
        owner = tl.sum((end[None, :] <= p[:, None]).to(tl.int32), 1)
        used = (p < total) & (b < b_end)
        tl.store(block_expert_ptr + b, tl.where(used, owner, -1), mask=b < b_end)
        own_fill_end = tl.sum(tl.where(e_idx[None, :] == owner[:, None], fill_end[None, :], 0), 1)
        pos = p[:, None] + tl.arange(0, BLOCK_M)[None, :]  # [BLOCKS, BM]
        pad = used[:, None] & (pos >= own_fill_end[:, None])
        tl.store(sorted_ptr + pos, tl.full([BLOCKS, BLOCK_M], 0, tl.int32) + N, mask=pad)


@triton.jit
def _padded_starts(count, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    e_idx = tl.arange(0, E_PAD)
    count = tl.where(e_idx < E, count, 0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, 0) - padded
    return count, start


@fast_kernel
@triton.jit(do_not_specialize=["N", "max_blocks"])
def moe_align_small_kernel(ids_ptr, sorted_ptr, block_expert_ptr, N, E, max_blocks,
                           BLOCK_M: tl.constexpr, NP: tl.constexpr, FB: tl.constexpr, BB: tl.constexpr,
                           PDL: tl.constexpr = False):
    """One program, N <= NP pairs: the same layout as the fused kernel, from [NP, NP] comparisons
    instead of histograms over E_PAD bins, a scan and a serial (or sorted) scatter.

    For pair n of expert e (valid: 0 <= e < E): rank = its earlier pairs of e, count = e's pairs,
    start = sum of ceil(count / BM) over the used experts with smaller ids (their blocks come
    first), position start * BM + rank. The used blocks' slots are first filled with N (padding,
    FB slots a step), then, after a barrier, each valid pair stores its index at its position;
    blocks are written from a [BB, NP] comparison. Why fill-then-scatter: a [slots, NP] search
    for each slot's pair costs (N + E) * BM / NP steps.
    """
    pdl_wait(PDL)
    pdl_trigger(PDL)
    n = tl.arange(0, NP)
    ok = n < N
    ids = tl.load(ids_ptr + n, mask=ok, other=-1)
    valid = ok & (ids >= 0) & (ids < E)
    same = (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]   # [n, m]
    rank = tl.sum((same & (n[None, :] < n[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    first = valid & (rank == 0)
    nblk = (count + BLOCK_M - 1) // BLOCK_M
    before = first[None, :] & (ids[None, :] < ids[:, None])                  # m's expert precedes n's
    start = tl.sum(tl.where(before, nblk[None, :], 0), axis=1)
    used_slots = tl.sum(tl.where(first, nblk, 0), axis=0) * BLOCK_M
    pad = tl.full([FB], 0, tl.int32) + N
    for p0 in range(0, used_slots, FB):
        p = p0 + tl.arange(0, FB)
        tl.store(sorted_ptr + p, pad, mask=p < used_slots)
    # The pairs overwrite some of those slots: the padding stores of every thread must land first.
    tl.debug_barrier()
    tl.store(sorted_ptr + start * BLOCK_M + rank, n, mask=valid)
    for b0 in range(0, max_blocks, BB):
        b = b0 + tl.arange(0, BB)
        owns = first[None, :] & (start[None, :] <= b[:, None]) & (b[:, None] < start[None, :] + nblk[None, :])
        e = tl.max(tl.where(owns, ids[None, :], -1), axis=1)
        tl.store(block_expert_ptr + b, e, mask=b < max_blocks)


@fast_kernel
@triton.jit(do_not_specialize=["N", "max_blocks"])
def moe_align_fused_kernel(ids_ptr, sorted_ptr, block_expert_ptr, N, E, max_blocks,
                           BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                           SUB: tl.constexpr, BLOCKS: tl.constexpr, SORTED: tl.constexpr, PDL: tl.constexpr = False):
    """One program: count, scan, scatter. For N <= ALIGN_FUSED_MAX (decode)."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    count = _count_range(ids_ptr, 0, N, E, CHUNK, E_PAD)
    count, start = _padded_starts(count, E, BLOCK_M, E_PAD)
    _write_blocks(sorted_ptr, block_expert_ptr, start, count, N, E, max_blocks, 0, max_blocks, BLOCK_M, E_PAD,
                  BLOCKS)
    if SORTED:  # CHUNK >= N here (the launcher's choice)
        _scatter_sorted(ids_ptr, sorted_ptr, start, 0, N, E, CHUNK, E_PAD)
    else:
        _scatter_range(ids_ptr, sorted_ptr, start, 0, N, E, SUB, E_PAD)


@fast_kernel
@triton.jit(do_not_specialize=["N"])
def moe_align_count_kernel(ids_ptr, counts_ptr, N, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Grid (num_chunks,): counts_CE[c] = histogram of chunk c."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    c = tl.program_id(0)
    n_lo = c * CHUNK
    n_hi = tl.minimum(n_lo + CHUNK, N)
    counts = _count_range(ids_ptr, n_lo, n_hi, E, CHUNK, E_PAD)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)


@fast_kernel
@triton.jit(do_not_specialize=["N", "num_chunks", "max_blocks"])
def moe_align_place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, N, E, num_chunks, max_blocks,
                           BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                           BLOCKS: tl.constexpr, ROWS: tl.constexpr, SORTED: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Grid (num_chunks,): program c sums the chunk histograms (all of them, and those before c,
    ROWS at a time), places chunk c's pairs from there, and writes its share of the blocks.

    Every program computes the same totals from the same integers, so the layout equals the
    one-program schedule's; no scan program, no third launch.
    """
    pdl_wait(PDL)
    pdl_trigger(PDL)
    c = tl.program_id(0)
    e_idx = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    before = tl.zeros([E_PAD], dtype=tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        blk = tl.load(counts_ptr + rows[:, None] * E_PAD + e_idx[None, :], mask=(rows < num_chunks)[:, None],
                      other=0)
        total += tl.sum(blk, 0)
        before += tl.sum(tl.where((rows < c)[:, None], blk, 0), 0)
    count, start = _padded_starts(total, E, BLOCK_M, E_PAD)
    per = tl.cdiv(max_blocks, num_chunks)
    _write_blocks(sorted_ptr, block_expert_ptr, start, count, N, E, max_blocks, c * per, c * per + per,
                  BLOCK_M, E_PAD, BLOCKS)
    n_lo = c * CHUNK
    n_hi = tl.minimum(n_lo + CHUNK, N)
    if SORTED:
        _scatter_sorted(ids_ptr, sorted_ptr, start + before, n_lo, n_hi, E, CHUNK, E_PAD)
    else:
        _scatter_range(ids_ptr, sorted_ptr, start + before, n_lo, n_hi, E, SUB, E_PAD)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def align_chunk(n: int) -> int:
    """Pairs per chunk of the multi-kernel schedule for N = n: ALIGN_CHUNK, doubled until at most
    ALIGN_MAX_CHUNKS chunks (a power of two, so few compiles)."""
    return max(ALIGN_CHUNK, _next_pow2(-(-n // ALIGN_MAX_CHUNKS)))


def align_launch(ids_N, num_experts: int, block_m: int, sorted_P, block_expert_B, scratch=None, *,
                 pdl: bool = False, fast: bool = True) -> None:
    """Fill sorted_P and block_expert_B (preallocated, see module docstring) from ids_N.

    ids_N: int32 [N] contiguous, on the GPU. No host sync; capturable in a CUDA graph.
    scratch: int32 [>= num_chunks * E_PAD] for the multi-kernel schedule's chunk histograms
        (allocated if None).
    pdl: launch with programmatic dependent launch (moeflow/kernels/pdl.py; the kernel plan decided it).
    fast: launch through the cached launchers (moeflow.kernels.launch); False: Triton's JIT binder.

    A chunk's pairs are placed by one sort (tl.sort + tl.gather: SORTED) on the GPU and by CHUNK / SUB
    serial one-hot steps under the Triton interpreter, whose tl.sort is ~7x slower there than the steps;
    the layout is the same either way.
    """
    import torch

    def k(kernel):
        return kernel.fn if not fast and isinstance(kernel, FastKernel) else kernel

    sort = not interpreted()
    n = ids_N.numel()
    max_blocks = block_expert_B.numel()
    e_pad = _next_pow2(num_experts + 1)
    # Registers for the [BLOCKS, E_PAD] and [SUB, E_PAD] matrices: keep ~32 ints a thread.
    warps = 4 if e_pad <= 256 else 8
    if n <= ALIGN_SMALL_MAX:
        # decode: no histogram over E, one [NP, NP] comparison (moe_align_small_kernel)
        np_ = max(16, _next_pow2(n))
        warps, bb_elems = ALIGN_SMALL_LAUNCH.get(np_, (8, 8192))
        k(moe_align_small_kernel)[(1,)](ids_N, sorted_P, block_expert_B, n, num_experts, max_blocks,
                                     BLOCK_M=block_m, NP=np_, FB=1024, BB=max(16, bb_elems // np_),
                                     num_warps=warps, PDL=pdl, launch_pdl=pdl)
        return
    if n <= ALIGN_FUSED_MAX:
        # decode: a histogram as wide as the pairs (a few buckets, few compiles); the sorted
        # placement (SORTED) sorts all pairs at once, so only where they fit one chunk
        chunk = 64 if n <= 64 else min(_next_pow2(n), 4096)
        k(moe_align_fused_kernel)[(1,)](
            ids_N, sorted_P, block_expert_B, n, num_experts, max_blocks,
            BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, SUB=ALIGN_SUB, BLOCKS=ALIGN_BLOCKS,
            SORTED=sort and chunk >= n, num_warps=warps, PDL=pdl, launch_pdl=pdl,
        )
        return
    chunk = align_chunk(n)
    num_chunks = triton.cdiv(n, chunk)
    if scratch is None:
        counts = torch.empty(num_chunks * e_pad, dtype=torch.int32, device=ids_N.device)
    else:
        counts = scratch[: num_chunks * e_pad]
    k(moe_align_count_kernel)[(num_chunks,)](ids_N, counts, n, num_experts, CHUNK=chunk, E_PAD=e_pad, num_warps=4,
                                          PDL=pdl, launch_pdl=pdl)
    k(moe_align_place_kernel)[(num_chunks,)](ids_N, counts, sorted_P, block_expert_B, n, num_experts, num_chunks,
                                          max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, SUB=ALIGN_SUB,
                                          BLOCKS=ALIGN_BLOCKS, ROWS=ALIGN_ROWS, SORTED=sort,
                                          num_warps=warps, PDL=pdl, launch_pdl=pdl)
