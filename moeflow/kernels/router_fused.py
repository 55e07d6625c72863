"""Triton kernel of the single-launch router step (private; launcher in moeflow.routing.gpu).

Legend: T tokens, H hidden size, E logit columns of this layer's router (routed +
zero experts), F of the next layer's router (0 without a prediction), C = E + F
columns of the partial buffer, SPLIT the fixed H split, R rows selected at once.

One launch does what the two-kernel step (router_logits.py's GEMM, then
router_select.py's selection) does:

  1. Program (pid_e, pid_m, pid_s) computes its partial sums with `_logits_program`
     (the GEMM kernel's own code, launched with the same LogitsConfig: same tile, same
     BLOCK_K steps, same warps and stages) into part [SPLIT, T, C], as the GEMM kernel
     does when it splits H (here also for SPLIT == 1).
  2. It takes a ticket: an atomic add on the int32 counter of its row group
     (acq_rel, gpu scope) after a CTA barrier, so every thread's partial stores are
     ordered before the release. The program that draws the last ticket of its row
     group (cdiv(E, BLOCK_E) + cdiv(F, BLOCK_E) tiles x SPLIT programs) knows all of
     the group's partials are written.
  3. That program resets the counter to 0 (the buffer is persistent and needs no
     memset launch: CUDA-graph capturable, every replay leaves it at 0 again) and runs
     `_select_rows` on the group's rows, R at a time, reading the partials through L2
     (".cg" loads after the acquire): this layer's selection (summed logits written,
     weights, status) and, with a prediction, the next layer's ranking on columns E..

Bits: the partials come from the same instructions as the GEMM kernel's, the split sum
is the same left-to-right order (`_load_rows`), and `_select_rows` gives the same bits
whatever R, warp count or kernel (see router_select.py), so logits, ids, weights,
status and prediction keys equal the two-kernel path's bit for bit, for every T.

Concurrency: the counters are per device. Two fused steps may not run at the same
time on one device (unordered streams) -- one stream, or CUDA graphs replayed on one
stream, serialises them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel
from .router_logits import _logits_program
from .router_select import _select_rows


@fast_kernel
@triton.jit
def _router_fused_kernel(
    x_ptr,
    w_ptr,
    w2_ptr,
    part_ptr,
    tickets_ptr,
    T,
    E,
    F,
    H,
    stride_xt,
    stride_we,
    stride_w2e,
    stride_ps,
    # this layer's selection (A): pointers, then its integer / float arguments
    a_rbias_ptr,
    a_logits_ptr,
    a_bias_ptr,
    a_scale_ptr,
    a_iids_ptr,
    a_table_ptr,
    a_ids_ptr,
    a_weights_ptr,
    a_keys_ptr,
    a_status_ptr,
    a_S,
    a_E,
    a_V,
    a_stride_lo,
    a_stride_tv,
    a_layer,
    a_eps,
    a_scaling,
    # the next layer's prediction (B), read only with PREDICT
    b_rbias_ptr,
    b_logits_ptr,
    b_bias_ptr,
    b_scale_ptr,
    b_iids_ptr,
    b_table_ptr,
    b_ids_ptr,
    b_weights_ptr,
    b_keys_ptr,
    b_status_ptr,
    b_S,
    b_E,
    b_V,
    b_stride_lo,
    b_stride_tv,
    b_layer,
    b_eps,
    b_scaling,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AS_F32: tl.constexpr,
    ROWS: tl.constexpr,
    PREDICT: tl.constexpr,
    PRECISE: tl.constexpr,
    A_SCORE: tl.constexpr,
    A_K: tl.constexpr,
    A_KP: tl.constexpr,
    A_G: tl.constexpr,
    A_P: tl.constexpr,
    A_NGP: tl.constexpr,
    A_PP: tl.constexpr,
    A_TOPK_GROUP: tl.constexpr,
    A_GROUP_TOP2: tl.constexpr,
    A_HAS_RBIAS: tl.constexpr,
    A_WRITE_LOGITS: tl.constexpr,
    A_HAS_BIAS: tl.constexpr,
    A_HAS_SCALE: tl.constexpr,
    A_HASH: tl.constexpr,
    A_KT: tl.constexpr,
    A_SELECT: tl.constexpr,
    A_START: tl.constexpr,
    A_RENORM: tl.constexpr,
    A_HAS_SCALING: tl.constexpr,
    A_MASK_ZERO: tl.constexpr,
    A_WEIGHTS: tl.constexpr,
    A_KEYS: tl.constexpr,
    B_SCORE: tl.constexpr,
    B_K: tl.constexpr,
    B_KP: tl.constexpr,
    B_G: tl.constexpr,
    B_P: tl.constexpr,
    B_NGP: tl.constexpr,
    B_PP: tl.constexpr,
    B_TOPK_GROUP: tl.constexpr,
    B_GROUP_TOP2: tl.constexpr,
    B_HAS_RBIAS: tl.constexpr,
    B_WRITE_LOGITS: tl.constexpr,
    B_HAS_BIAS: tl.constexpr,
    B_HAS_SCALE: tl.constexpr,
    B_HASH: tl.constexpr,
    B_KT: tl.constexpr,
    B_SELECT: tl.constexpr,
    B_START: tl.constexpr,
    B_RENORM: tl.constexpr,
    B_HAS_SCALING: tl.constexpr,
    B_MASK_ZERO: tl.constexpr,
    B_WEIGHTS: tl.constexpr,
    B_KEYS: tl.constexpr,
):
    """Grid (cdiv(E, BLOCK_E) + cdiv(F, BLOCK_E), cdiv(T, BLOCK_M), SPLIT); tickets int32 [>= grid[1]], zero.

    A_* / B_* are the arguments of `_select_rows` for this layer's routing and the
    next layer's prediction (the selection kernel's names with a prefix).
    """
    pid_e = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    _logits_program(
        x_ptr, w_ptr, w2_ptr, part_ptr, part_ptr, part_ptr, T, E, F, H,
        stride_xt, stride_we, stride_w2e, 0, 0, stride_ps, pid_e, pid_m, pid_s,
        CHUNK, BLOCK_M, BLOCK_E, BLOCK_K, AS_F32, True,
    )
    # Every thread's partial stores happen before the release of the ticket below.
    tl.debug_barrier()
    total = tl.num_programs(0) * tl.num_programs(2)
    ticket = tl.atomic_add(tickets_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if ticket == total - 1:
        # The last program of the row group: all its partials are visible (acquire).
        # Leave the counter at 0 for the next launch (or graph replay): no memset needed.
        tl.atomic_xchg(tickets_ptr + pid_m, 0, sem="relaxed", scope="gpu")
        row0 = pid_m * BLOCK_M
        row_end = tl.minimum(T, row0 + BLOCK_M)
        # num_stages=1: no software pipelining of these loads ahead of the loop.
        for r0 in tl.range(row0, row_end, ROWS, num_stages=1):
            rows = r0 + tl.arange(0, ROWS)
            ok = rows < row_end
            _select_rows(
                part_ptr, a_rbias_ptr, a_logits_ptr, a_bias_ptr, a_scale_ptr, a_iids_ptr, a_table_ptr,
                a_ids_ptr, a_weights_ptr, a_keys_ptr, a_status_ptr, rows, ok,
                a_S, a_E, a_V, E + F, stride_ps, 0, a_stride_lo, a_stride_tv, a_layer, a_eps, a_scaling,
                ROWS, SPLIT, A_SCORE, A_K, A_KP, A_G, A_P, A_NGP, A_PP, A_TOPK_GROUP, A_GROUP_TOP2,
                A_HAS_RBIAS, A_WRITE_LOGITS, A_HAS_BIAS, A_HAS_SCALE, A_HASH, A_KT, A_SELECT, A_START,
                A_RENORM, A_HAS_SCALING, A_MASK_ZERO, A_WEIGHTS, A_KEYS, PRECISE, ".cg",
            )
            if PREDICT:
                _select_rows(
                    part_ptr, b_rbias_ptr, b_logits_ptr, b_bias_ptr, b_scale_ptr, b_iids_ptr, b_table_ptr,
                    b_ids_ptr, b_weights_ptr, b_keys_ptr, b_status_ptr, rows, ok,
                    b_S, b_E, b_V, E + F, stride_ps, E, b_stride_lo, b_stride_tv, b_layer, b_eps, b_scaling,
                    ROWS, SPLIT, B_SCORE, B_K, B_KP, B_G, B_P, B_NGP, B_PP, B_TOPK_GROUP, B_GROUP_TOP2,
                    B_HAS_RBIAS, B_WRITE_LOGITS, B_HAS_BIAS, B_HAS_SCALE, B_HASH, B_KT, B_SELECT, B_START,
                    B_RENORM, B_HAS_SCALING, B_MASK_ZERO, B_WEIGHTS, B_KEYS, PRECISE, ".cg",
                )

