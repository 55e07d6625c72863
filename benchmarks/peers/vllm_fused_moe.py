# SPDX-License-Identifier: Apache-2.0
# The two @triton.jit functions below (write_zeros_to_output, fused_moe_kernel) are copied
# verbatim from vLLM 0.33.0, vllm/model_executor/layers/fused_moe/fused_moe.py
# (SPDX-FileCopyrightText: Copyright contributors to the vLLM project; Apache-2.0). The rest of
# this file is moeflow's harness around them.
# vLLM's license: benchmarks/peers/LICENSE-vllm (Apache License 2.0, from the vllm-0.33.0 wheel).
"""vLLM 0.33's Triton fused MoE (bf16), run in our process as the experts benchmarks' peer (GPU).

vLLM 0.33 needs torch 2.14 and its compiled `_C` extension, so it does not import beside our
torch 2.11 on the H200 host. What runs here is what vLLM runs for bf16 MoE on Hopper,
`fused_experts_impl`, rebuilt around its own GEMM kernel:

    config        vLLM's tuned table for the H200 where it ships one (vllm_configs/: E=128 N=768,
                  E=8 N=14336), the nearest batch size (`try_get_optimal_moe_config`), else its
                  `get_default_config` bf16 branch (copied below as `default_config`);
    assignment    `_prepare_expert_assignment`: no alignment when T*K*4 <= E (one block per
                  (token, slot) pair: `naive_block_assignment`), else an alignment into its layout
                  (sorted pair ids with the sentinel T*K, an expert per block, num_tokens_post_padded);
    gate_up       fused_moe_kernel (A = x, top_k = K, no routed weight), w1 [E, 2I, H];
    activation    silu_and_mul / swigluoai_and_mul (gpt-oss: interleaved, clamp 7, alpha 1.702);
    down          fused_moe_kernel (top_k = 1, routed weight multiplied in f32), w2 [E, H, I];
    sum           moe_sum over the K slots.

Stand-ins (vLLM's are CUDA ops of its `_C` extension; ours are one launch each, as theirs):
alignment = moeflow's align kernel + a one-program count of the used blocks
(num_tokens_post_padded); activation = one Triton elementwise kernel; moe_sum = torch.sum over
slots (f32 accumulation, bf16 out). Everything else (tiles, grid, SWAP_AB off for bf16, TD path
off on CUDA) follows vLLM 0.33 as shipped.

Legend: T tokens, K slots, E experts, H hidden, I intermediate per expert, BM/BN/BK tile sizes.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

CONFIG_DIR = Path(__file__).resolve().parent / "vllm_configs"


@triton.jit
def write_zeros_to_output(
    c_ptr,
    stride_cm,
    stride_cn,
    pid_n,
    N,
    offs_token,
    token_mask,
    BLOCK_SIZE_M,
    BLOCK_SIZE_N,
    compute_type,
):
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=compute_type)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
    c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
    tl.store(c_ptrs, accumulator, mask=c_mask)




@triton.jit
def fused_moe_kernel(
    # Pointers to matrices
    a_ptr,
    b_ptr,
    c_ptr,
    b_bias_ptr,
    a_scale_ptr,
    b_scale_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    # Matrix dimensions
    N,
    K,
    EM,
    num_valid_tokens,
    # The stride variables represent how much to increase the ptr by when
    # moving by 1 element in a particular dimension. E.g. `stride_am` is
    # how much to increase `a_ptr` by to get the element one row down
    # (A has M rows).
    stride_am,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_asm,
    stride_ask,
    stride_bse,
    stride_bsk,
    stride_bsn,
    stride_bbe,  # bias expert stride
    stride_bbn,  # bias N stride
    # Block size for block-wise quantization
    group_n: tl.constexpr,
    group_k: tl.constexpr,
    naive_block_assignment: tl.constexpr,
    # Meta-parameters
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    top_k: tl.constexpr,
    compute_type: tl.constexpr,
    use_fp8_w8a8: tl.constexpr,
    use_int8_w8a8: tl.constexpr,
    use_int8_w8a16: tl.constexpr,
    per_channel_quant: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP_AB: tl.constexpr,
    # Tensor-descriptor path for the A gather and B load in the K-loop.
    USE_TD: tl.constexpr = False,
):
    """Implements the fused computation for a Mixture of Experts (MOE) using
    token and expert matrices.

    Key Parameters:
    - A: The input tensor representing tokens with shape (*, K), where '*' can
        be any shape representing batches and K is the feature dimension of
        each token.
    - B: The stacked MOE weight tensor with shape (E, N, K), where E is
        the number of experts, K is the input feature dimension, and N is
        the output feature dimension.
    - C: The output cache tensor with shape (M, topk, N), where M is the
        total number of tokens post padding, topk is the number of times
        each token is repeated, and N is the output feature dimension.
    - sorted_token_ids: A tensor containing the sorted indices of tokens,
        repeated topk times and arranged by the expert index they are
        assigned to.
    - expert_ids: A tensor containing the indices of the expert for each
        block. It determines which expert matrix from B should be used for
        each block in A.
    - naive_block_assignment: A boolean flag indicating whether to use naive
        token wise block assignment. If True, each block corresponds to a
        single token.
    This kernel performs the multiplication of a token by its corresponding
    expert matrix as determined by `expert_ids`. The sorting of
    `sorted_token_ids` by expert index and padding ensures divisibility by
    BLOCK_SIZE_M, which is necessary to maintain consistency in block matrix
    multiplication across different blocks processed by the same expert.
    """
    # -----------------------------------------------------------
    # Map program ids `pid` to the block of C it should compute.
    # This is done in a grouped ordering to promote L2 data reuse.
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # ----------------------------------------------------------
    # Create pointers for the first blocks of A and B.
    # We will advance this pointer as we move in the K direction
    # and accumulate
    # `a_ptrs` is a block of [BLOCK_SIZE_M, BLOCK_SIZE_K] pointers
    # `b_ptrs` is a block of [BLOCK_SIZE_K, BLOCK_SIZE_N] pointers
    offs = tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return
    if not naive_block_assignment:
        offs_token_id = pid_m * BLOCK_SIZE_M + offs
        offs_token = tl.load(sorted_token_ids_ptr + offs_token_id)
    else:
        offs_token = tl.where(
            offs == 0,
            pid_m,  # first element = pid_m
            num_valid_tokens,  # remaining elements = constant
        )
    # Cast to int64 to prevent overflow in stride*offset products
    # (e.g. stride_cm * offs_token can exceed int32 for large token counts)
    offs_token = offs_token.to(tl.int64)

    token_mask = offs_token < num_valid_tokens

    off_experts = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if off_experts == -1:
        # -----------------------------------------------------------
        # Write back zeros to the output when the expert is not
        # in the current expert parallel rank.
        write_zeros_to_output(
            c_ptr,
            stride_cm,
            stride_cn,
            pid_n,
            N,
            offs_token,
            token_mask,
            BLOCK_SIZE_M,
            BLOCK_SIZE_N,
            compute_type,
        )
        return

    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    # TD gather and the SWAP_AB accumulator layout are mutually exclusive.
    tl.static_assert(not (USE_TD and SWAP_AB))
    if USE_TD:
        # ``tt.descriptor_gather`` requires block_shape[0] == 1 and i32 idx.
        m_td = num_valid_tokens // top_k
        a_desc = tl.make_tensor_descriptor(
            base=a_ptr,
            shape=(m_td, K),
            strides=(stride_am, stride_ak),
            block_shape=(1, BLOCK_SIZE_K),
        )
        b_desc = tl.make_tensor_descriptor(
            base=b_ptr + off_experts * stride_be,
            shape=(N, K),
            strides=(stride_bn, stride_bk),
            block_shape=(BLOCK_SIZE_N, BLOCK_SIZE_K),
        )
        gather_idx = (offs_token // top_k).to(tl.int32)
    elif SWAP_AB:
        a_ptrs = a_ptr + (
            offs_k[:, None] * stride_ak + offs_token[None, :] // top_k * stride_am
        )
        b_ptrs = (
            b_ptr
            + off_experts * stride_be
            + (offs_bn[:, None] * stride_bn + offs_k[None, :] * stride_bk)
        )
    else:
        a_ptrs = a_ptr + (
            offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak
        )
        b_ptrs = (
            b_ptr
            + off_experts * stride_be
            + (offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn)
        )
    if use_int8_w8a16:
        b_scale_ptrs = (
            b_scale_ptr + off_experts * stride_bse + offs_bn[None, :] * stride_bsn
        )
        b_scale = tl.load(b_scale_ptrs)

    if use_fp8_w8a8 or use_int8_w8a8:
        # block-wise
        if group_k > 0 and group_n > 0:
            a_scale_ptrs = a_scale_ptr + (offs_token // top_k) * stride_asm
            offs_bsn = offs_bn // group_n
            b_scale_ptrs = (
                b_scale_ptr + off_experts * stride_bse + offs_bsn * stride_bsn
            )
        # channel-wise
        elif per_channel_quant:
            b_scale_ptrs = (
                b_scale_ptr + off_experts * stride_bse + offs_bn[None, :] * stride_bsn
            )
            b_scale = tl.load(b_scale_ptrs)
            # Load per-token scale for activations
            a_scale_ptrs = a_scale_ptr + (offs_token // top_k) * stride_asm
            a_scale = tl.load(a_scale_ptrs, mask=token_mask, other=0.0)[:, None]
        # tensor-wise
        else:
            a_scale = tl.load(a_scale_ptr)
            b_scale = tl.load(b_scale_ptr + off_experts)
    if HAS_BIAS:
        # bias shape: [num_experts, N]
        bias_ptrs = b_bias_ptr + off_experts * stride_bbe + offs_bn * stride_bbn
        bias = tl.load(bias_ptrs, mask=(offs_bn < N), other=0.0)
    # -----------------------------------------------------------
    # Iterate to compute a block of the C matrix.
    # We accumulate into a `[BLOCK_SIZE_M, BLOCK_SIZE_N]` block
    # of fp32 values for higher accuracy.
    # `accumulator` will be converted back to fp16 after the loop.
    if SWAP_AB:
        accumulator = tl.zeros((BLOCK_SIZE_N, BLOCK_SIZE_M), dtype=tl.float32)
    else:
        accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        # Load the next block of A and B, generate a mask by checking the
        # K dimension.
        if USE_TD:
            a = a_desc.gather(gather_idx, k * BLOCK_SIZE_K)
            b = b_desc.load([pid_n * BLOCK_SIZE_N, k * BLOCK_SIZE_K]).T
        elif SWAP_AB:
            a_mask = (offs_k[:, None] < K - k * BLOCK_SIZE_K) & token_mask[None, :]
            b_mask = offs_k[None, :] < K - k * BLOCK_SIZE_K
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        else:
            a = tl.load(
                a_ptrs,
                mask=token_mask[:, None] & (offs_k[None, :] < K - k * BLOCK_SIZE_K),
                other=0.0,
            )
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
        # We accumulate along the K dimension.
        if use_int8_w8a16:
            accumulator = tl.dot(a, b.to(compute_type), acc=accumulator)
        elif use_fp8_w8a8 or use_int8_w8a8:
            if group_k > 0 and group_n > 0:
                k_start = k * BLOCK_SIZE_K
                offs_ks = k_start // group_k
                a_scale = tl.load(
                    a_scale_ptrs + offs_ks * stride_ask, mask=token_mask, other=0.0
                )
                b_scale = tl.load(b_scale_ptrs + offs_ks * stride_bsk)
                if SWAP_AB:
                    accumulator += tl.dot(b, a) * b_scale[:, None] * a_scale[None, :]
                else:
                    accumulator += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
            else:
                if use_fp8_w8a8:
                    # acc used to enable fp8_fast_accum
                    if SWAP_AB:
                        accumulator = tl.dot(b, a, acc=accumulator)
                    else:
                        accumulator = tl.dot(a, b, acc=accumulator)
                else:
                    accumulator += tl.dot(a, b)
        else:
            accumulator += tl.dot(a, b)
        if not USE_TD:
            # Advance the ptrs to the next K block.
            a_ptrs += BLOCK_SIZE_K * stride_ak
            b_ptrs += BLOCK_SIZE_K * stride_bk

    if SWAP_AB:
        accumulator = tl.trans(accumulator, (1, 0))

    # Dequantization for supported quantization schemes:
    #   - int8_w8a16
    #   - fp8_w8a8
    #   - int8_w8a8
    # Accumulator and scalings are in float32 to preserve numerical accuracy.
    if use_int8_w8a16:
        accumulator = accumulator * b_scale
    elif (use_fp8_w8a8 or use_int8_w8a8) and not (group_k > 0 and group_n > 0):
        accumulator = accumulator * a_scale * b_scale

    # Bias addition:
    # Bias must be applied after dequantization:
    #   - Since bias is typically not quantized
    #   - Bias should not be scaled by quantization factors
    if HAS_BIAS:
        accumulator += bias[None, :]

    # Router (MoE) weight multiplication:
    # This multiplication MUST be performed in float32 before any precision
    # conversion to ensure numerical stability, which is especially critical
    # on ROCm platforms.
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(
            topk_weights_ptr + offs_token,
            mask=token_mask,
            other=0,
        )
        accumulator *= moe_weight[:, None]

    # Final precision conversion:
    # Cast once at the end to the desired compute/output dtype.
    accumulator = accumulator.to(compute_type)

    # -----------------------------------------------------------
    # Write back the block of the output
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
    c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
    tl.store(c_ptrs, accumulator, mask=c_mask)


# --------------------------------------------------------------------------- moeflow's harness
def default_config(M: int, E: int) -> dict:
    """vLLM 0.33 `get_default_config`, its bf16 / fp16 branch on CUDA (M = tokens T)."""
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    return {
        "BLOCK_SIZE_M": block_m,
        "BLOCK_SIZE_N": 64 if M <= 64 else 128,
        "BLOCK_SIZE_K": 128 if M <= 64 else 64,
        "GROUP_SIZE_M": 16 if M // max(E, 1) > 128 else 1,
        "num_warps": 4 if M <= 128 else 8,
        "num_stages": 4 if M <= 32 else 3,
    }


@functools.cache
def tuned_table(E: int, N: int) -> dict | None:
    """vLLM's tuned table for the H200 (`E={E},N={N},device_name=NVIDIA_H200.json`), or None."""
    path = CONFIG_DIR / f"E={E},N={N},device_name=NVIDIA_H200.json"
    if not path.exists():
        return None
    table = json.loads(path.read_text())
    table.pop("triton_version", None)
    return {int(k): v for k, v in table.items()}


def config_for(T: int, E: int, I: int) -> tuple[dict, str]:
    """(config, source) as vLLM's `try_get_optimal_moe_config` picks it for T tokens."""
    table = tuned_table(E, I)
    if table:
        return dict(table[min(table, key=lambda m: abs(m - T))]), f"tuned E={E},N={I} H200"
    return default_config(T, E), "vLLM default"


@triton.jit
def _count_used_blocks_kernel(block_expert_ptr, ntpp_ptr, B, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """num_tokens_post_padded = BLOCK_M * (blocks with an expert >= 0); one program."""
    acc = tl.zeros([CHUNK], dtype=tl.int32)
    for b0 in range(0, B, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        e = tl.load(block_expert_ptr + b, mask=b < B, other=-1)
        acc += (e >= 0).to(tl.int32)
    tl.store(ntpp_ptr, tl.sum(acc, 0) * BLOCK_M)


@triton.jit
def _act_and_mul_kernel(in_ptr, out_ptr, I, limit, alpha, SWIGLUOAI: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, :I] = act(gate) * up of in[r, :2I] (silu_and_mul: gate | up halves;
    swigluoai_and_mul: interleaved, clamped, (up + 1) * gate * sigmoid(alpha * gate)); grid (rows, I / BLOCK)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    if SWIGLUOAI:
        g = tl.load(in_ptr + r * 2 * I + 2 * c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(in_ptr + r * 2 * I + 2 * c + 1, mask=m, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    else:
        g = tl.load(in_ptr + r * 2 * I + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(in_ptr + r * 2 * I + I + c, mask=m, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + r * I + c, y.to(out_ptr.dtype.element_ty), mask=m)


def _invoke(A, B, C, topk_weights, sorted_token_ids, expert_ids, ntpp, mul_routed_weight: bool, top_k: int,
            config: dict, B_bias=None) -> None:
    """vLLM 0.33 `invoke_fused_moe_triton_kernel` for bf16 (no scales, SWAP_AB and TD off)."""
    M = A.size(0)
    num_tokens = M * top_k
    if sorted_token_ids is not None:
        EM = sorted_token_ids.size(0)
        if A.size(0) < config["BLOCK_SIZE_M"]:
            EM = min(sorted_token_ids.size(0), A.size(0) * top_k * config["BLOCK_SIZE_M"])
    else:
        EM = num_tokens * config["BLOCK_SIZE_M"]
    cfg = dict(config)
    cfg.pop("SPLIT_K", None)  # vLLM forces 1
    block_k = cfg.pop("BLOCK_SIZE_K")
    grid = (triton.cdiv(EM, cfg["BLOCK_SIZE_M"]) * triton.cdiv(B.size(1), cfg["BLOCK_SIZE_N"]),)
    fused_moe_kernel[grid](
        A, B, C, B_bias, None, None, topk_weights, sorted_token_ids, expert_ids, ntpp,
        B.size(1), B.size(2), EM, num_tokens,
        A.stride(0), A.stride(1), B.stride(0), B.stride(2), B.stride(1), C.stride(1), C.stride(2),
        0, 0, 0, 0, 0,
        B_bias.stride(0) if B_bias is not None else 0, B_bias.stride(1) if B_bias is not None else 0,
        0, 0,
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=tl.bfloat16 if A.dtype == torch.bfloat16
        else tl.float16 if A.dtype == torch.float16 else tl.float32,
        use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        naive_block_assignment=sorted_token_ids is None, HAS_BIAS=B_bias is not None,
        BLOCK_SIZE_K=block_k, SWAP_AB=False, USE_TD=False, SPLIT_K=1, **cfg,
    )


class VllmFusedMoE:
    """The peer on one layer's bf16 weights: `peer(x_TH, ids_TK, weights_TK) -> out_TH`.

    w: moeflow ExpertWeights (layout "linear" [E, 2I, H] / [E, H, I] is vLLM's own; "matmul" is
    transposed into a contiguous copy once, here). activation: "silu" or "gptoss" (interleaved
    gate/up, biases, clamp `limit`). CUDA only; capturable in a CUDA graph (no host sync).
    """

    def __init__(self, w, activation: str, limit: float | None = None, alpha: float = 1.702):
        if activation not in ("silu", "gptoss"):
            raise ValueError(f"activation: {activation!r}, expected 'silu' or 'gptoss' (what this peer runs)")
        if activation == "gptoss" and not w.interleaved:
            raise ValueError("activation 'gptoss': vLLM's swigluoai_and_mul reads gate/up interleaved")
        if activation == "silu" and w.interleaved:
            raise ValueError("activation 'silu': vLLM's silu_and_mul reads gate | up halves, not interleaved")
        if w.layout == "linear":
            self.w1, self.w2 = w.gate_up.contiguous(), w.down.contiguous()
        else:
            self.w1 = w.gate_up.transpose(1, 2).contiguous()
            self.w2 = w.down.transpose(1, 2).contiguous()
        self.b1, self.b2 = w.gate_up_bias, w.down_bias
        self.E, self.N2, self.H = self.w1.shape
        self.I = self.w2.shape[2]
        self.swigluoai = activation == "gptoss"
        self.limit = float(limit) if limit is not None else float("inf")
        self.alpha = float(alpha)
        self._ntpp: dict = {}

    def config(self, T: int) -> tuple[dict, str]:
        return config_for(T, self.E, self.I)

    def _assignment(self, ids_TK, BM: int):
        """(sorted_token_ids or None, expert_ids, num_tokens_post_padded) as `_prepare_expert_assignment`."""
        T, K = ids_TK.shape
        ids_N = ids_TK.reshape(-1).to(torch.int32).contiguous()
        if T * K * 4 <= self.E:  # vLLM's naive_block_assignment: one block per pair
            return None, ids_N, torch.full((1,), T * K * BM, dtype=torch.int32, device=ids_TK.device)
        from moeflow.experts.triton import max_blocks_for
        from moeflow.kernels.moe_align import align_launch

        n = T * K
        # vLLM's buffer sizes (moe_align_block_size): numel + E * (BM - 1), capped at numel * BM
        max_padded = n + self.E * (BM - 1)
        if n < self.E:
            max_padded = min(n * BM, max_padded)
        blocks = triton.cdiv(max_padded, BM)
        # our align kernel's own bound, which fits inside vLLM's (and is what it needs to place every pair)
        ours = max_blocks_for(n, self.E, BM)
        blocks = max(blocks, ours)
        sorted_ids = torch.empty(blocks * BM, dtype=torch.int32, device=ids_TK.device)
        expert_ids = torch.empty(blocks, dtype=torch.int32, device=ids_TK.device)
        align_launch(ids_N, self.E, BM, sorted_ids[: ours * BM], expert_ids[:ours])
        ntpp = torch.empty(1, dtype=torch.int32, device=ids_TK.device)
        _count_used_blocks_kernel[(1,)](expert_ids, ntpp, ours, BLOCK_M=BM, CHUNK=1024, num_warps=4)
        return sorted_ids, expert_ids, ntpp

    def __call__(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        T, H = x_TH.shape
        K = ids_TK.shape[1]
        config, _ = self.config(T)
        sorted_ids, expert_ids, ntpp = self._assignment(ids_TK, config["BLOCK_SIZE_M"])
        wts = weights_TK.to(torch.float32).contiguous()
        N2, I = self.N2, self.I
        cache13 = torch.empty(T * K * max(N2, H), device=x_TH.device, dtype=x_TH.dtype)
        cache1 = cache13[: T * K * N2].view(T, K, N2)
        cache3 = cache13[: T * K * H].view(T, K, H)
        cache2 = torch.empty(T * K, I, device=x_TH.device, dtype=x_TH.dtype)
        _invoke(x_TH.contiguous(), self.w1, cache1, wts, sorted_ids, expert_ids, ntpp, False, K, config, self.b1)
        block = min(1024, triton.next_power_of_2(I))
        _act_and_mul_kernel[(T * K, triton.cdiv(I, block))](cache1, cache2, I, self.limit, self.alpha,
                                                            SWIGLUOAI=self.swigluoai, BLOCK=block, num_warps=4)
        _invoke(cache2, self.w2, cache3, wts, sorted_ids, expert_ids, ntpp, True, 1, config, self.b2)
        return cache3.sum(dim=1)
