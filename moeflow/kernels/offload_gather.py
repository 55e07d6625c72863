"""Private Triton kernels of the sync-free offloaded step: remap ids to slots, stage the misses.

Legend: N (token, pick) pairs of one layer step (N <= NCAP), E routed experts of the layer,
Z cache slots, Q staging slots (after the Z cache slots; Q >= min(N, E)), P = Z + Q pool
rows, B bytes of one packed expert row (W = B / 4 int32 words), G copy programs in all.

Inputs (all device-addressable; the host store is pinned memory, which UVA maps into the
device's address space, so the kernel reads it straight over PCIe: no host in the loop):
    ids_N     int [N]        the step's expert ids
    lut_E     int32 [E]      expert -> cache slot of this layer, -1 = not resident
    host_EW   int32 [E, W]   the layer's packed experts (moeflow.offload.store, packed layout)
    pool_PW   int32 [P, W]   the device slot pool in the same layout
Outputs:
    remap_N   int32 [N]      the slot each pair reads: lut[e] when resident, else Z + r where
                             r is the rank of e among the step's missing experts ordered by
                             their first pair (owner = first pair using the expert: a fixed
                             rule, so the remap is a pure function of ids and lut); P for an id
                             outside [0, E) (the experts impl turns it into a NaN row: loud)
    jobs      int32 [1 + 2Q] jobs[0] = missing experts r_max; jobs[1 + r] = expert of rank r;
                             jobs[1 + Q + r] = the pool row it is copied into (Z + r when staged,
                             the victim cache slot under device admission)
    log_R     int32 [1 + 2*NCAP]  log[0] += 1 (a step counter the host compares), then the
                             ids and the remap of the step (-1 past N): what the lagged refill
                             reads back later with an event, never waiting.

Two launches, neither needs a host value: the remap (one program; [BLOCK, BLOCK] comparisons,
BLOCK = next power of two >= NCAP) and the copy (a fixed grid of Q x S programs, S ~ G / Q
per staging slot, each looping over a fixed count of chunks; the ranks past jobs[0] return at
once). Loop bounds are compile-time constants (fixed per model: one compile), which is also
what the Triton interpreter runs. Both capture in a CUDA graph.
moeflow.offload.graph.remap_torch / stage_torch are the same step in torch (CPU device).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel

# int32 words one copy iteration moves per program (8 KiB), and copy programs per SM.
COPY_BLOCK_WORDS = 2048
COPY_PROGRAMS_PER_SM = 4


@fast_kernel
@triton.jit
def offload_remap_kernel(ids_ptr, lut_ptr, remap_ptr, jobs_ptr, log_ptr, N, E, Z, P, Q,
                         NCAP: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (1,): remap_N, jobs and the log row of one layer step (module doc)."""
    n = tl.arange(0, BLOCK)
    valid = n < N
    ids = tl.load(ids_ptr + n, mask=valid, other=0).to(tl.int32)
    in_range = valid & (ids >= 0) & (ids < E)
    slot = tl.load(lut_ptr + ids, mask=in_range, other=-1)
    miss = in_range & (slot < 0)
    # owner: the first pair with the same id (ids past N never match: masked columns)
    same = (ids[:, None] == ids[None, :]) & valid[None, :]
    owner = tl.min(tl.where(same, n[None, :], BLOCK), axis=1)
    is_job = miss & (owner == n)
    job_i = is_job.to(tl.int32)
    before = tl.cumsum(job_i, 0) - job_i  # missing experts owned by earlier pairs
    owner_rank = tl.sum(tl.where(n[None, :] == owner[:, None], before[None, :], 0), axis=1)
    remap = tl.where(miss, Z + owner_rank, slot)
    remap = tl.where(in_range, remap, P)
    tl.store(remap_ptr + n, remap, mask=valid)
    tl.store(jobs_ptr + 1 + before, ids, mask=is_job)
    tl.store(jobs_ptr + 1 + Q + before, Z + before, mask=is_job)
    tl.store(jobs_ptr, tl.sum(job_i, 0))
    seq = tl.load(log_ptr)
    tl.store(log_ptr, seq + 1)
    cap = n < NCAP
    tl.store(log_ptr + 1 + n, tl.where(valid, ids, -1), mask=cap)
    tl.store(log_ptr + 1 + NCAP + n, tl.where(valid, remap, -1), mask=cap)


@fast_kernel
@triton.jit
def offload_copy_kernel(jobs_ptr, host_ptr, pool_ptr, Q, W, S, ITERS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Grid (Q, S): program (r, s) copies chunks s, s + S, ... of job r's row (int32 words: any dtype's bytes).

    pool[jobs[1 + Q + r]] = host[jobs[1 + r]] for r < jobs[0]; programs of ranks past jobs[0] return
    at once, so a step whose experts are all resident costs Q * S empty programs.
    """
    r = tl.program_id(0)
    s = tl.program_id(1)
    if r >= tl.load(jobs_ptr):
        return
    e = tl.load(jobs_ptr + 1 + r).to(tl.int64)
    src = host_ptr + e * W
    dst = pool_ptr + tl.load(jobs_ptr + 1 + Q + r).to(tl.int64) * W
    for it in range(ITERS):
        w = (s + it * S).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
        m = w < W
        tl.store(dst + w, tl.load(src + w, mask=m), mask=m)


@fast_kernel
@triton.jit
def offload_admit_kernel(ids_ptr, lut_ptr, slot_key_ptr, stamp_ptr, clock_ptr, remap_ptr, jobs_ptr, log_ptr,
                         N, E, Z, P, Q, key_base, advance, NCAP: tl.constexpr, BLOCK: tl.constexpr,
                         ZB: tl.constexpr):
    """Grid (1,): device admission of one layer step (least recently used victims; module doc).

    lut_ptr is the whole [L, E_max] table (key = key_base + e, key_base = layer * E_max);
    slot_key_Z int32 (key or -1), stamp_Z int64 (last step that used the slot), clock_1 int64.
    """
    n = tl.arange(0, BLOCK)
    valid = n < N
    ids = tl.load(ids_ptr + n, mask=valid, other=0).to(tl.int32)
    in_range = valid & (ids >= 0) & (ids < E)
    slot = tl.load(lut_ptr + key_base + ids, mask=in_range, other=-1)
    step = tl.load(clock_ptr) + advance
    hit = in_range & (slot >= 0)
    miss = in_range & (slot < 0)
    # the step's resident experts are used now: never a victim of this step
    tl.store(stamp_ptr + slot, tl.zeros([BLOCK], dtype=tl.int64) + step, mask=hit)
    same = (ids[:, None] == ids[None, :]) & valid[None, :]
    owner = tl.min(tl.where(same, n[None, :], BLOCK), axis=1)
    is_job = miss & (owner == n)
    job_i = is_job.to(tl.int32)
    before = tl.cumsum(job_i, 0) - job_i
    R = tl.sum(job_i, 0)
    tl.debug_barrier()  # the stamps above, visible to every thread before the victims are chosen
    z = tl.arange(0, ZB)
    zmask = z < Z
    victims = tl.zeros([BLOCK], dtype=tl.int32)
    for r in range(NCAP):
        if r < R:
            e_r = tl.sum(tl.where(is_job & (before == r), ids, 0), 0)
            st = tl.load(stamp_ptr + z, mask=zmask, other=0x3FFFFFFFFFFF, volatile=True)
            # the least recently used slot, ties to the lowest index: one min over (stamp, slot)
            v = (tl.min(st * ZB + z, 0) % ZB).to(tl.int32)
            old = tl.load(slot_key_ptr + v, volatile=True)
            if old >= 0:
                tl.store(lut_ptr + old, -1)
            tl.store(slot_key_ptr + v, key_base + e_r)
            tl.store(lut_ptr + key_base + e_r, v)
            tl.store(stamp_ptr + v, step)
            tl.store(jobs_ptr + 1 + r, e_r)
            tl.store(jobs_ptr + 1 + Q + r, v)
            victims = tl.where(n == r, v, victims)
            tl.debug_barrier()
    tl.store(clock_ptr, step)
    tl.store(jobs_ptr, R)
    owner_rank = tl.sum(tl.where(n[None, :] == owner[:, None], before[None, :], 0), axis=1)
    got = tl.sum(tl.where(n[None, :] == owner_rank[:, None], victims[None, :], 0), axis=1)
    remap = tl.where(miss, got, slot)
    remap = tl.where(in_range, remap, P)
    tl.store(remap_ptr + n, remap, mask=valid)
    seq = tl.load(log_ptr)
    tl.store(log_ptr, seq + 1)
    cap = n < NCAP
    tl.store(log_ptr + 1 + n, tl.where(valid, ids, -1), mask=cap)
    # admitted experts logged as -2 - slot: the host's stats tell a hit (>= 0) from a copy (<= -2)
    tl.store(log_ptr + 1 + NCAP + n, tl.where(valid, tl.where(miss, -2 - remap, remap), -1), mask=cap)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gather_launch(ids_N, lut_E, host_EW, pool_PW, remap_N, jobs, log_R, *, num_cache_slots: int,
                  ncap: int, programs: int) -> None:
    """Launch the remap and the copy of one layer step (shapes: module doc). No host sync.

    ids_N contiguous int32/int64 [N] with N <= ncap; host_EW / pool_PW int32 [*, W] views of the
    packed buffers (host_EW on pinned memory on CUDA); programs: G of the copy kernel.
    """
    N = int(ids_N.numel())
    E = int(host_EW.shape[0])
    W = int(host_EW.shape[1])
    P = int(pool_PW.shape[0])
    block = max(16, _next_pow2(ncap))
    Q = (int(jobs.numel()) - 1) // 2
    offload_remap_kernel[(1,)](ids_N, lut_E, remap_N, jobs, log_R, N, E, num_cache_slots, P, Q,
                               NCAP=ncap, BLOCK=block, num_warps=4 if block <= 64 else 8)
    _copy_launch(jobs, host_EW, pool_PW, Q, W, programs)


def admit_launch(ids_N, lut_LE, slot_key_Z, stamp_Z, clock_1, host_EW, pool_PW, remap_N, jobs, log_R, *, layer: int,
                 ncap: int, programs: int, advance: int = 1) -> None:
    """Device admission (LRU) and the copy of one layer step into the victim slots. No host sync.

    lut_LE int32 [L, E_max] (contiguous), slot_key_Z int32 [Z], stamp_Z / clock_1 int64; jobs int32
    [1 + 2Q] with Q >= the step's distinct experts; advance 0 keeps the clock (slices of one step).
    """
    N = int(ids_N.numel())
    E = int(host_EW.shape[0])
    W = int(host_EW.shape[1])
    Z = int(slot_key_Z.numel())
    P = int(pool_PW.shape[0])
    block = max(16, _next_pow2(ncap))
    Q = (int(jobs.numel()) - 1) // 2
    offload_admit_kernel[(1,)](ids_N, lut_LE, slot_key_Z, stamp_Z, clock_1, remap_N, jobs, log_R, N, E, Z, P, Q,
                               layer * int(lut_LE.shape[1]), advance, NCAP=ncap, BLOCK=block,
                               ZB=max(16, _next_pow2(Z)), num_warps=4 if max(block, Z) <= 256 else 8)
    _copy_launch(jobs, host_EW, pool_PW, Q, W, programs)


def _copy_launch(jobs, host_EW, pool_PW, Q: int, W: int, programs: int) -> None:
    chunks = triton.cdiv(W, COPY_BLOCK_WORDS)
    # programs per job: about `programs` in all when every staging slot is busy, never more than its chunks
    S = max(1, min(chunks, programs // max(1, Q)))
    offload_copy_kernel[(Q, S)](jobs, host_EW, pool_PW, Q, W, S, ITERS=triton.cdiv(chunks, S),
                                BLOCK_W=COPY_BLOCK_WORDS, num_warps=4)
