"""`triton` experts: fused GPU kernels (alignment by expert, gate_up + activation, down, combine).

Legend: T tokens, K slots per token, N = T*K (token, slot) pairs (pair n = t*K + k), H hidden,
I intermediate per expert, E experts held, P padded positions, S split-K parts of the down GEMM.

Two paths, chosen per call in `forward_tokens` (`uses_decode_path`); neither syncs the host,
so a call can be captured in a CUDA graph and replayed.

Decode path (TritonExperts(decode_max_pairs=N), or where a tuned table's "decode" entries say it
won, moeflow.tuning.decode_tuned; not by heuristics, DECODE_BY_DEFAULT says why; never in
batch-invariant mode; 2 launches,
moeflow/kernels/moe_decode.py): no alignment pass; gate_up one program per (pair, column
tile), the first pair of each expert computing all of that expert's pairs; down one program
per (token, H tile) that sums its K slots in slot order with the combine weights in its
epilogue. Launch-bound decode shapes (128 small experts, T = 1..8) lose two launches and the
buffers between them; the sum order is fixed, so the result is deterministic.

Aligned path (everything else, and forward_pairs; 4 launches at small N, 6 at large N):
    align    ids_TK -> sorted_P (pairs grouped by expert, stable, padded to BM), block_expert_B
    gate_up  act_PI = act(x[tok] @ W_gu[e] (+ b_gu))     activation fused in the epilogue
    down     y_SNH  = act_PI @ W_d[e] (+ b_d)            split-K partials for decode shapes
    combine  out_TH = sum_k w[t,k] * sum_s y[s, t*K+k]   one small pass, slot order, no atomics
On Hopper or newer each launch uses programmatic dependent launch (moeflow/kernels/pdl.py:
the next kernel starts early and waits on the device; MOEFLOW_PDL=0 turns it off).
The kernels are in moeflow/kernels/moe_align.py and moe_gemm.py; the tile configuration
comes from moeflow.tuning (JSON written by benchmarks/tune_experts.py, nearest T), or its
heuristics. On Hopper or newer (TMA_BY_DEFAULT; MOEFLOW_TMA=0 or `TritonExperts(tma=False)` turns
it off) gate_up and down take their weight tiles by TMA (moeflow/kernels/
moe_gemm_tma.py; down its activation tiles too) where the layout allows: linear, not
interleaved, no bias, BN | I and BK | H (down: BN | H, BK | I, one split). Same tiles, same K
order: bit for bit the pointer kernels' output (benchmarks/diag_tma_gemm.py, H200: 1.01-1.31x
faster at prefill).

Half tiles (MoETileConfig.half_tail, from the tuned tables): a block_m-row block holding at most
block_m / 2 pairs (an expert's last) runs its GEMMs as a block_m / 2-row tile; same bits.

Modes:
    TritonExperts()                       tiles chosen per T (fastest).
    TritonExperts(batch_invariant=True)   a token's output bits do not depend on the batch: no
                                          split-K and one K-step (BK) per GEMM for every T. Tuned
                                          tables may let BM/BN/warps follow T inside that family
                                          ("batch_invariant_by_T", checked bit for bit on the device
                                          by the tuner); without one, a single configuration.
Both are deterministic run to run (fixed sum orders, integer-only counting).

Triton is imported only inside the launch functions: importing this module needs neither
Triton nor CUDA, and `supports` says why it refuses when either is missing.

Ids are expected in [0, E) (zero experts and EP sentinels never reach this impl); checking
that on CUDA would cost a device sync, so instead a pair with an id outside the range is never
computed and turns its token's output row to NaN (loud, not a silent clamp).
"""

from __future__ import annotations

import dataclasses
import math
import os
from functools import lru_cache

import torch

from .._triton import triton_available
from ..config import ExpertWeights, MoEConfig
from ..tuning import DecodeConfig, MoETileConfig, ShapeKey, decode_lookup, decode_tuned, lookup
from .base import check_pairs, check_token_devices, check_tokens, flat_pairs, tiling_experts

_ACT_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_clamp": 2, "gptoss": 3}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
# Combine pass: columns per program.
_COMBINE_BLOCK_H = 1024
# Decode path bounds. N = T*K pairs at most DECODE_MAX_PAIRS: its gate_up leader compares all N
# ids in one vector and holds all of an expert's pairs in one dot of next_pow2(N) rows (so 64 is
# also the hard cap). At most DECODE_PAIRS_PER_EXPERT * E pairs: the token-major down kernel
# reads an expert's down weights once per token using it, which stays near one read per
# expert only while pairs per expert stay about one (mixtral's 8 experts leave at T = 8).
DECODE_MAX_PAIRS = 64
DECODE_PAIRS_PER_EXPERT = 1
# Whether the default (decode_max_pairs=None) takes the decode path at all. Off: measured on the
# H200 (CUDA graph, L2 flushed, 2026-12-03) it was slower than the aligned path at 15 of 16 decode
# points with its heuristic tiles (qwen3-30b-a3b T=1 56.8 vs 41.5 us, gpt-oss-120b T=1 111.3 vs
# 74.3 us, deepseek-v3 T=8 1702 vs 1140 us); only deepseek-v3 T=2 tied. It stays opt-in
# (decode_max_pairs=N) until tuned tiles ("decode" entries of moeflow/tuning) make it pay.
DECODE_BY_DEFAULT = False
# Shared memory a decode gate_up program may plan for (H200: 227 KB a block); stages shrink to fit.
_DECODE_SMEM_BYTES = 180 * 1024
# (kernel, tiles) whose TMA variant did not compile (shared memory): those run the pointer kernel.
_TMA_REFUSED: set[tuple] = set()
# TMA weight tiles by default (tma=None) on Hopper or newer: bit for bit the pointer kernels'
# output (diag_tma_gemm.py) and 1.01-1.31x faster at prefill; on since the whole GPU suite passed
# with them (H200, 2026-12-03: 200 passed, 2 skipped, 1 xfailed). MOEFLOW_TMA=0 turns them off,
# MOEFLOW_TMA=1 on, whatever this says.
TMA_BY_DEFAULT = True


@lru_cache(maxsize=8)
def _tma_device(index: int) -> bool:
    """Whether CUDA device `index` takes TMA weight tiles when tma=None (Hopper or newer; MOEFLOW_TMA, else
    TMA_BY_DEFAULT)."""
    env = os.environ.get("MOEFLOW_TMA")
    wanted = TMA_BY_DEFAULT if env is None else env != "0"
    return wanted and torch.cuda.get_device_capability(index)[0] >= 9


# The TMA gate_up kernels' fused form (moeflow/kernels/moe_gemm_tma.py: FUSED): one [BM, 2BN] dot per
# K step over gate and up rows interleaved 8 by 8. A module flag so the diagnostics can A/B it.
FUSED_GATE_UP = True


# The TMA down GEMM as one flattened persistent loop over (work tile, K step)
# (moeflow/kernels/moe_gemm_tma.py: _down_flat; fp8: moe_gemm_fp8_tma._fp8_down_flat): one program per
# SM whatever the tile's `persistent`, no half tiles; the same bits. FLAT_GATE_UP: the same for the fp8
# gate_up (_fp8_gate_up_flat; the bf16 gate_up has no flat form). Module flags so the diagnostics can
# A/B them (benchmarks/diag_half_tiles.py, diag_fp8_prefill.py). FLAT_DOWN = None: the bf16 down runs
# flat where its K loop is short (at most FLAT_DOWN_AUTO_K_STEPS steps of BK) on full 128-row tiles
# (BM >= 128, no half tiles: the flat loop has none); the fp8 down does not. Why that rule (H100,
# 2026-12-05, RESULTS.md): on full BM 128 tiles flat won 4-7% at qwen3 (I = 768: 12 steps of BK 64,
# T = 2048 and 8192, uniform and Zipf); with the tuned half-tile entries it lost 6% at qwen3 T = 2048
# and won 2% at T = 8192; on the BM 16-64 tiles of T = 16-512 it lost 0-3%; it lost 5-9% at
# deepseek-v3 T = 2048 (32 steps) and 10% in the fp8 down at qwen3. A tile entry's MoETileConfig.flat_down
# (True / False, chosen by benchmarks/tune_experts.py's refinement) overrides the rule; the flag set to
# True / False overrides both.
FLAT_DOWN: bool | None = None
FLAT_DOWN_AUTO_K_STEPS = 16
FLAT_GATE_UP = False

# The bf16 / fp16 down GEMM (one split) as a warp-specialised kernel written in Gluon
# (moeflow/kernels/moe_gemm_ws.py: a producer warp feeds a TMA ring, two consumer warp groups share
# 128-row tiles (WS_COOP) or take alternate 64-row ones; host side moeflow/experts/triton_ws.py), in
# place of the Triton TMA kernel (linear layout) or the pointer kernel (gpt-oss's matmul layout with
# biases). The same bits (GPU test). Off: on the H100 (2026-12-05) it ran at 0.76-0.95x the table's
# Triton down at qwen3 / deepseek-v3 / gpt-oss T = 8192 and 1.10x at mixtral; a module flag so the
# diagnostics and the GPU tests can A/B it.
WS_DOWN = False
# The same schedule for the gate_up (moe_gemm_ws.moe_gate_up_ws_kernel: a producer warp group gathers the
# activation rows by cp.async beside the weight boxes' TMA). Off: 0.68-1.02x the Triton gate_up (H100).
WS_GATE_UP = False
# Their schedule where the plan's blocks are 128 rows: cooperative (True: both consumer warp groups on one
# 128-row tile, 64 rows each, sharing the stage's weight box, as the Triton kernels' 8 warps do) or
# ping-pong (False: alternate 64-row tiles). Ping-pong reads each weight box for 64 rows, twice the
# cooperative's weight traffic a FLOP: on the H100 (2026-12-05) its kernels ran DRAM-bound at 0.3-0.9x
# the Triton kernels' speed. BM 64 plans run ping-pong either way.
WS_COOP = True
# Cooperative only: a block's padding second half computed too (masked stores) rather than skipped, so a
# CTA on a mostly-padding block keeps the pace of the CTAs that share its weight box (moe_gemm_ws.py
# docstring, PACE). On the H100 (2026-12-06, benchmarks/RESULTS.md thirteenth session) it cut the
# cooperative gate_up's DRAM reads at deepseek-v3 T = 8192 from 36.6 to 19.7 GB and its time from 12.6 to
# 7.4 ms (tensor pipe 37% -> 80%); the Gluon pair went from 0.63x to 0.89x the table, the Gluon gate_up
# alone with the Triton down to 1.05-1.07x (but 0.90x at Zipf routing, so WS stays off by default).
WS_PACE = True

# The TMA gate_up's activation rows copied into pair order first (moe_gemm_tma.gather_rows_kernel: x_PH
# [P, H], zeros at padding) and read by TMA boxes like its weights (A_TMA), instead of gathered by pointer
# loads in the K loop. The same bits (a padding row is zero either way). Why: ncu at mixtral T = 2048
# (2026-12-06, seventeenth session) showed the pointer-gathered gate_up L1/L2-bound (L1/L2 76%, tensor
# pipe 75%, top stall the L1TEX scoreboard) beside a down at 85-89% whose operands both come by TMA.
# Cost: a read of the routed rows and a write of P x H (P padded pair positions; the buffer lives for the
# call: 142 MB at mixtral T = 8192), against gate_up FLOPs of 4 P H I: the copy weighs 1 / I. A/B on the H100 (2026-12-06, benchmarks/diag_half_tiles.py --variants
# gather_x, results/diag_gather_x_s17_h100.log, uniform / Zipf): mixtral (I = 14336) T = 8192 x1.033 /
# x1.037, T = 2048 x1.002 / x1.004; deepseek-v3 (I = 2048) T = 8192 x0.968 / x1.011; qwen3 (I = 768)
# T = 8192 x0.916 / x0.917. None (the default): at I >= GATHER_X_MIN_I and T * K >= GATHER_X_MIN_PAIRS;
# True / False: always / never (a module flag so the diagnostics can A/B it).
GATHER_X: bool | None = None
GATHER_X_MIN_I = 8192
GATHER_X_MIN_PAIRS = 8192


def fused_gate_up_ok(I: int, block_n: int) -> bool:
    """Whether the fused gate_up box serves this shape: 8 | BN (the interleave) and BN | I."""
    return FUSED_GATE_UP and block_n % 8 == 0 and I % block_n == 0


def gate_up_descriptor(W_ENK: torch.Tensor, block_n: int, block_k: int, fused: bool):
    """TensorDescriptor over a contiguous gate_up W_ENK [E, 2I, H] (linear layout, gate rows then up rows).

    fused: the 5D view [E, I/8, 2, 8, H] (strides 2IH, 8H, IH, H, 1), block [1, BN/8, 2, 8, BK]:
    BN gate rows and their BN up rows, interleaved 8 by 8, in one copy. Else [E*2I, H], block [BN, BK].
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, N2, H = W_ENK.shape
    I = N2 // 2
    if not fused:
        return TensorDescriptor(W_ENK, shape=[E * N2, H], strides=[H, 1], block_shape=[block_n, block_k])
    return TensorDescriptor(W_ENK, shape=[E, I // 8, 2, 8, H], strides=[N2 * H, 8 * H, I * H, H, 1],
                            block_shape=[1, block_n // 8, 2, 8, block_k])


def tma_wanted(tma: bool | None, dev: torch.device) -> bool:
    """An impl's `tma` setting resolved for weights on `dev`: True / False as given; None (default)
    on CUDA devices where _tma_device says so."""
    if tma is not None:
        return tma
    return dev.type == "cuda" and _tma_device(dev.index if dev.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=8)
def _device_facts(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on BM-row blocks after padding each expert to BM (no host sync needed)."""
    return -(-num_pairs // block_m) + min(num_pairs, num_experts)


class TritonExperts:
    """Fused Triton experts. See the module docstring for the pipeline and the modes.

    batch_invariant: one fixed tile configuration for every T (bitwise batch invariance).
    tile_config:     force this MoETileConfig for every call (tests, the tuner); the aligned
                     path then serves every call unless decode_max_pairs says otherwise.
    decode_max_pairs: None (default): when DECODE_BY_DEFAULT (off today, see its comment) the
                     decode path serves calls of N = T*K <= DECODE_MAX_PAIRS and
                     N <= DECODE_PAIRS_PER_EXPERT * E; never when tile_config is given.
                     An int in [0, DECODE_MAX_PAIRS]: the decode path serves N <= it, whatever E
                     (0: never). Batch-invariant mode never takes it (one arithmetic for every T).
    decode_config:   force these decode tiles (tests); else tuned data / heuristics.
    allow_cpu:       accept CPU tensors (only meaningful under TRITON_INTERPRET=1, the
                     Triton interpreter; the CPU test suite uses it).
    tma:             TMA weight tiles in the aligned GEMMs (module docstring): None (default)
                     on CUDA devices of compute capability >= 9 (TMA_BY_DEFAULT, unless
                     MOEFLOW_TMA=0); True wherever the layout allows (the interpreter runs
                     them too); False never.
    """

    name = "triton"
    graph_capturable = True  # no host sync; the GPU tests replay it from CUDA graphs
    device_types = ("cuda",)

    def __init__(self, *, batch_invariant: bool = False, tile_config: MoETileConfig | None = None,
                 decode_max_pairs: int | None = None, decode_config: DecodeConfig | None = None,
                 allow_cpu: bool = False, tma: bool | None = None) -> None:
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"TritonExperts.batch_invariant={batch_invariant!r}: expected a bool")
        if tile_config is not None and not isinstance(tile_config, MoETileConfig):
            raise TypeError(f"TritonExperts.tile_config: expected a MoETileConfig, got {type(tile_config).__name__}")
        if decode_max_pairs is not None and (
                isinstance(decode_max_pairs, bool) or not isinstance(decode_max_pairs, int)
                or not 0 <= decode_max_pairs <= DECODE_MAX_PAIRS):
            raise ValueError(f"TritonExperts.decode_max_pairs={decode_max_pairs!r}: expected None or an int in "
                             f"[0, {DECODE_MAX_PAIRS}]")
        if decode_config is not None and not isinstance(decode_config, DecodeConfig):
            raise TypeError(f"TritonExperts.decode_config: expected a DecodeConfig, got {type(decode_config).__name__}")
        if tma is not None and not isinstance(tma, bool):
            raise TypeError(f"TritonExperts.tma={tma!r}: expected None or a bool")
        if decode_max_pairs is None and tile_config is not None:
            decode_max_pairs = 0  # a forced aligned-path tiling means: time / test that path
        self.decode_max_pairs = decode_max_pairs
        self.decode_config = decode_config
        self.batch_invariant = batch_invariant
        self.name = "triton_bi" if batch_invariant else "triton"
        self.tile_config = tile_config
        self.allow_cpu = allow_cpu
        self.tma = tma
        if allow_cpu:
            self.device_types = ("cuda", "cpu")
        self._cfg_cache: dict[tuple, MoETileConfig] = {}
        # set on copies made by experts.base.tiled_as: tiles (and the path) chosen as for a layer
        # of this many experts, whatever E the weights handed in have (an offload slot pool)
        self.tiling_experts: int | None = None

    def __repr__(self) -> str:
        return f"TritonExperts(batch_invariant={self.batch_invariant})"

    # ------------------------------------------------------------------ selection
    def supports(self, config: MoEConfig) -> tuple[bool, str]:
        if not isinstance(config, MoEConfig):
            return False, f"config: expected MoEConfig, got {type(config).__name__}"
        if not triton_available():
            return False, "the triton package is not installed"
        if not self.allow_cpu and not torch.cuda.is_available():
            return False, "needs a CUDA device (torch.cuda.is_available() is False)"
        if config.activation not in _ACT_CODES:
            return False, f"activation {config.activation!r} has no fused kernel (have {tuple(_ACT_CODES)})"
        return True, "fused Triton kernels: bf16/fp16 (fp32 exact) weights, every layout, activation and bias"

    def tile_config_for(self, w: ExpertWeights, top_k: int, num_tokens: int) -> MoETileConfig:
        """The MoETileConfig a call of num_tokens tokens runs with (cached per (shape, T))."""
        if self.tile_config is not None:
            return self.tile_config
        bi = self.batch_invariant
        return self._cached("bi" if bi else "aligned", w, top_k, tiling_experts(self, w), num_tokens,
                            lambda name, sms, key: lookup(key, max(1, num_tokens), name, batch_invariant=bi,
                                                          sm_count=sms))

    def uses_decode_path(self, num_tokens: int, top_k: int, num_experts: int,
                         w: ExpertWeights | None = None) -> bool:
        """Whether forward_tokens of num_tokens tokens with top_k slots runs the two-launch decode path.

        With the weights `w` (what forward_tokens passes) a tuned table also decides: its
        "decode" entries name the T where that path won (moeflow.tuning.decode_tuned).
        """
        if self.batch_invariant:
            return False  # its bits must not depend on T: one (aligned) arithmetic for every T
        n = num_tokens * top_k
        if self.decode_max_pairs is not None:
            return 0 < n <= self.decode_max_pairs
        if not 0 < n <= DECODE_MAX_PAIRS:
            return False
        if DECODE_BY_DEFAULT and n <= DECODE_PAIRS_PER_EXPERT * num_experts:
            return True
        if w is None or self.tile_config is not None:
            return False
        return self._cached("decode_tuned", w, top_k, num_experts, num_tokens,
                            lambda name, sms, key: decode_tuned(key, num_tokens, name))

    def decode_config_for(self, w: ExpertWeights, top_k: int, num_tokens: int) -> DecodeConfig:
        """The DecodeConfig a decode-path call of num_tokens tokens runs with (cached per (shape, T))."""
        if self.decode_config is not None:
            return self.decode_config
        return self._cached("decode", w, top_k, tiling_experts(self, w), num_tokens,
                            lambda name, sms, key: decode_lookup(key, max(1, num_tokens), name, sm_count=sms))

    def _cached(self, kind: str, w: ExpertWeights, top_k: int, num_experts: int, num_tokens: int, make):
        """make(device name, SM count, ShapeKey) for (kind, w's shape / layout / dtype / device, top_k,
        num_experts, num_tokens), computed once per instance: a table lookup on every layer step
        would be host time."""
        ck = (kind, num_experts, w.hidden_size, w.intermediate_size, top_k, w.layout, w.interleaved, w.dtype,
              str(w.device), num_tokens)
        hit = self._cfg_cache.get(ck)
        if hit is None:
            hit = self._cfg_cache[ck] = make(*self._lookup_facts(w, top_k, num_experts))
        return hit

    @staticmethod
    def _lookup_facts(w: ExpertWeights, top_k: int, num_experts: int) -> tuple[str, int, ShapeKey]:
        dev = w.device
        if dev.type == "cuda":
            name, sms = _device_facts(dev.index if dev.index is not None else torch.cuda.current_device())
        else:
            name, sms = "cpu", 132
        key = ShapeKey(num_experts=num_experts, hidden_size=w.hidden_size,
                       intermediate_size=w.intermediate_size, top_k=top_k, layout=w.layout,
                       interleaved=w.interleaved, dtype=_DTYPE_NAMES[w.dtype])
        return name, sms, key

    # ------------------------------------------------------------------ entry points
    def forward_tokens(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                       w: ExpertWeights, config: MoEConfig) -> torch.Tensor:
        """out_TH [T, H] (x's dtype) = sum over k in slot order of weights[t,k] * expert_{ids[t,k]}(x[t]).

        With config.router.weight_on_input (llama4) the weight scales the expert's input
        instead (rounded to x's dtype, as the HF module does) and the combine weight is 1.

        Args:
            x_TH: [T, H], the weights' dtype and device, unit stride along H.
            ids_TK: int [T, K], every id in [0, E) (an id outside gives a NaN row).
            weights_TK: float [T, K] combine weights (f32 in moeflow's routing).
            w: the experts' tensors (views of the model's parameters).
            config: the layer's MoEConfig.
        """
        self._check_common(w, config)
        T, K = check_tokens(x_TH, ids_TK, weights_TK, w.hidden_size)
        self._check_x(x_TH, w, "x_TH")
        check_token_devices(x_TH, ids_TK, weights_TK)
        if T == 0 or K == 0:
            return torch.zeros_like(x_TH)
        ids_N, wts_N = flat_pairs(ids_TK, weights_TK)
        on_input = bool(getattr(config.router, "weight_on_input", False))
        if self.uses_decode_path(T, K, tiling_experts(self, w), w):
            dcfg = self.decode_config_for(w, K, T)
            return _run_decode(x_TH, ids_N, wts_N, T, K, w, config, dcfg, weight_on_input=on_input)
        cfg = self.tile_config_for(w, K, T)
        return _run(x_TH, ids_N, wts_N, T, K, w, config, cfg,
                    weight_on_input=on_input, combine_weights=not on_input, tma=self.uses_tma(w))

    def forward_pairs(self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights,
                      config: MoEConfig) -> torch.Tensor:
        """y_NH [N, H] (x's dtype): row n through expert expert_N[n], unweighted, rows in input order.

        Bits of a row depend on the tile configuration, which follows N unless
        batch_invariant=True (then they depend on the row alone).
        """
        self._check_common(w, config)
        check_pairs(x_NH, expert_N, w, config)
        self._check_x(x_NH, w, "x_NH")
        N = int(x_NH.shape[0])
        if N == 0:
            return torch.empty_like(x_NH)
        ids_N = expert_N.to(torch.int32).contiguous()
        # Tiles are tuned by tokens of a K-slot layer: N pairs are N / K such tokens.
        cfg = self.tile_config_for(w, config.top_k, max(1, N // config.top_k))
        return _run(x_NH, ids_N, None, N, 1, w, config, cfg, weight_on_input=False, combine_weights=False,
                    tma=self.uses_tma(w))

    def uses_tma(self, w: ExpertWeights) -> bool:
        """Whether this call's device may take TMA weight tiles (each GEMM still checks its shape)."""
        return tma_wanted(self.tma, w.device)

    # ------------------------------------------------------------------ checks
    def _check_common(self, w: ExpertWeights, config: MoEConfig) -> None:
        if not isinstance(w, ExpertWeights):
            raise TypeError(f"w: expected ExpertWeights, got {type(w).__name__}")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
        ok, reason = self.supports(config)
        if not ok:
            raise ValueError(f"experts impl 'triton' refuses this config: {reason}")
        w.check_config(config)
        if w.dtype not in _DTYPE_NAMES:
            raise TypeError(f"ExpertWeights dtype {w.dtype}: expected bfloat16, float16 or float32")
        if w.device.type not in self.device_types:
            raise ValueError(f"ExpertWeights on {w.device}: the triton impl runs on {self.device_types}")

    @staticmethod
    def _check_x(x: torch.Tensor, w: ExpertWeights, name: str) -> None:
        if x.dtype != w.dtype:
            raise TypeError(f"{name}: dtype {x.dtype}, expected the experts' dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"{name}: on {x.device}, expected the experts' device {w.device}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"{name}: stride {x.stride()}, expected unit stride along H")


def _weight_strides(w: ExpertWeights) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((stride_e, stride_out, stride_in) of gate_up, same of down): out = the GEMM's N axis."""
    gu, dn = w.gate_up, w.down
    if w.layout == "linear":  # gate_up [E, 2I, H], down [E, H, I]
        return (gu.stride(0), gu.stride(1), gu.stride(2)), (dn.stride(0), dn.stride(1), dn.stride(2))
    # "matmul": gate_up [E, H, 2I], down [E, I, H]
    return (gu.stride(0), gu.stride(2), gu.stride(1)), (dn.stride(0), dn.stride(2), dn.stride(1))


class _Plan:
    """Sizes and buffers of one call (every size from shapes alone: no host sync)."""

    def __init__(self, x_MH: torch.Tensor, T: int, K: int, w: ExpertWeights, cfg: MoETileConfig) -> None:
        dev = x_MH.device
        self.T, self.K, self.N = T, K, T * K
        self.E, self.H, self.I = w.num_experts, w.hidden_size, w.intermediate_size
        self.cfg = cfg
        self.max_blocks = max_blocks_for(self.N, self.E, cfg.block_m)
        self.P = self.max_blocks * cfg.block_m
        self.sorted_P = torch.empty(self.P, dtype=torch.int32, device=dev)
        self.block_expert_B = torch.empty(self.max_blocks, dtype=torch.int32, device=dev)
        self.act_PI = torch.empty(self.P, self.I, dtype=w.dtype, device=dev)
        S = cfg.down.split_k
        # A single part is the expert's output itself: kept in x's dtype (what the HF modules
        # round to); split-K partials stay f32 so the split adds no rounding.
        self.y_SNH = torch.empty(S, self.N, self.H, dtype=w.dtype if S == 1 else torch.float32, device=dev)
        self.out_TH = torch.empty(T, self.H, dtype=x_MH.dtype, device=dev)
        self.precision = "ieee" if w.dtype == torch.float32 else "tf32"
        self.tma = False  # set by _run: TMA weight tiles allowed on this device
        from ..kernels.pdl import gemm_mode, pdl_for

        # programmatic dependent launch (moeflow/kernels/pdl.py): launch attribute, and the GEMMs' mode
        self.pdl = pdl_for(dev)
        self.pdl_gemm = gemm_mode(self.pdl)


def _tma_weights_ok(t, W: torch.Tensor, n: int, k: int, bias) -> bool:
    """A linear-layout weight [E, n, k] whose [BN, BK] tiles a TMA descriptor over [E*n, k] can serve."""
    return (bias is None and n % t.block_n == 0 and k % t.block_k == 0 and W.is_contiguous()
            and W.data_ptr() % 16 == 0 and (k * W.element_size()) % 16 == 0)


def _launch_tma(kind: str, t, launch) -> bool:
    """Run launch() (a TMA kernel launch); False when this tiling's TMA variant does not compile."""
    key = (kind, t)
    if key in _TMA_REFUSED:
        return False
    from triton.runtime.errors import OutOfResources

    try:
        launch()
    except OutOfResources:  # raised while compiling, before anything is enqueued
        _TMA_REFUSED.add(key)
        return False
    return True


def _launch_align(plan: _Plan, ids_N: torch.Tensor) -> None:
    from ..kernels.moe_align import align_launch

    align_launch(ids_N, plan.E, plan.cfg.block_m, plan.sorted_P, plan.block_expert_B, pdl=plan.pdl)


def _launch_gate_up(plan: _Plan, x_rows: torch.Tensor, top_k_div: int, w: ExpertWeights,
                    config: MoEConfig) -> None:
    """act_PI from x_rows (row of pair n = x_rows[n // top_k_div])."""
    from ..kernels.moe_gemm import moe_gate_up_kernel

    t = plan.cfg.gate_up
    if WS_GATE_UP and plan.tma and _launch_gate_up_ws(plan, x_rows, top_k_div, w, config):
        return
    if (plan.tma and w.layout == "linear" and not w.interleaved
            and _tma_weights_ok(t, w.gate_up, plan.I, plan.H, w.gate_up_bias)
            and _launch_tma("gate_up", (plan.cfg.block_m, plan.cfg.half_tail, t), lambda: _launch_gate_up_tma(
                plan, x_rows, top_k_div, w, config))):
        return
    (gse, gsn, gsk), _ = _weight_strides(w)
    has_bias = w.gate_up_bias is not None
    gub = w.gate_up_bias if has_bias else w.gate_up  # dummy pointer when no bias
    grid = (plan.max_blocks * math.ceil(plan.I / t.block_n),)
    moe_gate_up_kernel[grid](
        x_rows, w.gate_up, gub, plan.act_PI, plan.sorted_P, plan.block_expert_B,
        plan.N, plan.H, plan.I, top_k_div, plan.max_blocks,
        x_rows.stride(0), gse, gsn, gsk, gub.stride(0), plan.act_PI.stride(0),
        float(config.swiglu_limit or 0.0), float(config.gptoss_alpha),
        ACT=_ACT_CODES[config.activation], INTERLEAVED=bool(w.interleaved), HAS_BIAS=has_bias,
        EVEN_K=plan.H % t.block_k == 0, PRECISION=plan.precision,
        BLOCK_M=plan.cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        HALF_TAIL=plan.cfg.half_tail, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
        launch_pdl=plan.pdl,
    )


def _launch_down(plan: _Plan, w: ExpertWeights) -> None:
    """y_SNH from act_PI (split-K parts over I)."""
    from ..kernels.moe_gemm import moe_down_kernel

    t = plan.cfg.down
    if WS_DOWN and plan.tma and t.split_k == 1 and _launch_down_ws(plan, w):
        return
    if (plan.tma and w.layout == "linear" and t.split_k == 1
            and _tma_weights_ok(t, w.down, plan.H, plan.I, w.down_bias)
            and _launch_tma("down", (plan.cfg.block_m, plan.cfg.half_tail, t), lambda: _launch_down_tma(plan, w))):
        return
    _, (dse, dsn, dsk) = _weight_strides(w)
    has_bias = w.down_bias is not None
    db = w.down_bias if has_bias else w.down  # dummy pointer when no bias
    S = t.split_k
    k_tiles_per_split = math.ceil(math.ceil(plan.I / t.block_k) / S)
    grid = (plan.max_blocks * math.ceil(plan.H / t.block_n), S)
    y = plan.y_SNH
    moe_down_kernel[grid](
        plan.act_PI, w.down, db, y, plan.sorted_P, plan.block_expert_B,
        plan.N, plan.H, plan.I, plan.max_blocks, k_tiles_per_split,
        plan.act_PI.stride(0), dse, dsn, dsk, db.stride(0), y.stride(0), y.stride(1),
        HAS_BIAS=has_bias, EVEN_K=plan.I % t.block_k == 0, PRECISION=plan.precision,
        BLOCK_M=plan.cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        HALF_TAIL=plan.cfg.half_tail, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
        launch_pdl=plan.pdl,
    )


def flat_down_rule(cfg: MoETileConfig, I: int) -> bool:
    """FLAT_DOWN's auto rule for the bf16 down of cfg at intermediate size I: full 128-row tiles (BM >= 128,
    no half tiles) and at most FLAT_DOWN_AUTO_K_STEPS K steps (see FLAT_DOWN for the measurements)."""
    return cfg.block_m >= 128 and not cfg.half_tail and -(-I // cfg.down.block_k) <= FLAT_DOWN_AUTO_K_STEPS


def tma_gemm_programs(t, dev: torch.device, gate_up: bool = False, by_rule: bool = False,
                      cfg_flat: bool | None = None) -> tuple[int, bool]:
    """(programs, flat) of a TMA down GEMM launch (bf16 and fp8; gate_up=True: of the fp8 gate_up):
    flat runs the flattened loop with one program per SM whatever t.persistent; else
    persistent_programs(t, dev). Whether flat, first that is not None: FLAT_DOWN (FLAT_GATE_UP), the
    config's choice (cfg_flat: MoETileConfig.flat_down), the caller's default (by_rule: the bf16 down
    passes flat_down_rule, the fp8 GEMMs nothing)."""
    flat = FLAT_GATE_UP if gate_up else FLAT_DOWN
    if flat is None and not gate_up:
        flat = cfg_flat
    if flat is None:
        flat = by_rule
    return persistent_programs(dataclasses.replace(t, persistent=True) if flat else t, dev), flat


def persistent_programs(t, dev: torch.device) -> int:
    """Programs of a persistent TMA GEMM of tile t on dev (one per SM: a constant per device, so no
    recompile per T); 0 when the tile is not persistent (one program per work tile)."""
    if not t.persistent:
        return 0
    if dev.type != "cuda":
        return 4  # the interpreter: a few programs, each walking several tiles
    return _sm_count(dev)


def _launch_gate_up_tma(plan: _Plan, x_rows: torch.Tensor, top_k_div: int, w: ExpertWeights,
                        config: MoEConfig) -> None:
    """_launch_gate_up with the weight tiles by TMA (the caller checked the layout and shape)."""
    from ..kernels.moe_gemm_tma import moe_gate_up_tma_kernel

    t = plan.cfg.gate_up
    H, I = plan.H, plan.I
    fused = fused_gate_up_ok(I, t.block_n)
    wd = gate_up_descriptor(w.gate_up, t.block_n, t.block_k, fused)
    tiles = plan.max_blocks * (I // t.block_n)
    progs = persistent_programs(t, plan.act_PI.device)
    xd, xd_half = (_gathered_x_descriptors(plan, x_rows, top_k_div) if gather_x_rule(plan.N, I)
                   else (None, None))
    moe_gate_up_tma_kernel[(progs or tiles,)](
        x_rows, xd, xd_half, wd, plan.act_PI, plan.sorted_P, plan.block_expert_B,
        plan.N, H, I, top_k_div, plan.max_blocks, tiles, x_rows.stride(0), plan.act_PI.stride(0),
        float(config.swiglu_limit or 0.0), float(config.gptoss_alpha),
        ACT=_ACT_CODES[config.activation], PERSISTENT=progs > 0, WS=False, NUM_PROGS=max(1, progs),
        BLOCK_M=plan.cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        HALF_TAIL=plan.cfg.half_tail, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
        FUSED=fused, A_TMA=xd is not None, launch_pdl=plan.pdl,
    )


def gather_x_rule(num_pairs: int, I: int) -> bool:
    """Whether the TMA gate_up of num_pairs pairs (T * K) at intermediate size I reads its activation rows
    from a pair-ordered copy (GATHER_X, which says why and when)."""
    if GATHER_X is not None:
        return GATHER_X
    return I >= GATHER_X_MIN_I and num_pairs >= GATHER_X_MIN_PAIRS


# columns of x_PH one program of gather_rows_kernel copies (it takes a block's BM rows; H splits over grid
# axis 1): 128 keeps a BM 128 program at 128 values a thread on 4 warps
_GATHER_BLOCK_H = 128


def _gathered_x_descriptors(plan: _Plan, x_rows: torch.Tensor, top_k_div: int):
    """(xd, xd_half): x_rows copied into pair order (x_PH [P, H], moe_gemm_tma.gather_rows_kernel) and
    TensorDescriptors over it with blocks [BM, BK] and [BM/2, BK] (xd_half is xd without half tiles)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..kernels.moe_gemm_tma import gather_rows_kernel

    BM, BK, H = plan.cfg.block_m, plan.cfg.gate_up.block_k, plan.H
    x_PH = torch.empty(plan.P, H, dtype=x_rows.dtype, device=x_rows.device)
    gather_rows_kernel[(plan.max_blocks, -(-H // _GATHER_BLOCK_H))](
        x_rows, x_PH, plan.sorted_P, plan.block_expert_B, plan.N, H, top_k_div, x_rows.stride(0), x_PH.stride(0),
        BLOCK_M=BM, BLOCK_H=_GATHER_BLOCK_H, num_warps=4, PDL=plan.pdl_gemm, launch_pdl=plan.pdl)
    xd = TensorDescriptor(x_PH, shape=[plan.P, H], strides=[H, 1], block_shape=[BM, BK])
    xd_half = (TensorDescriptor(x_PH, shape=[plan.P, H], strides=[H, 1], block_shape=[BM // 2, BK])
               if plan.cfg.half_tail else xd)
    return xd, xd_half


def _launch_down_tma(plan: _Plan, w: ExpertWeights) -> None:
    """_launch_down with weight and activation tiles by TMA (one split; the caller checked the shape)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..kernels.moe_gemm_tma import moe_down_tma_kernel

    t = plan.cfg.down
    E, H, I, BM = w.down.shape[0], plan.H, plan.I, plan.cfg.block_m
    ad = TensorDescriptor(plan.act_PI, shape=[plan.P, I], strides=[I, 1], block_shape=[BM, t.block_k])
    # the half tiles' activation rows (HALF_TAIL): the same buffer in [BM/2, BK] boxes
    ad_half = (TensorDescriptor(plan.act_PI, shape=[plan.P, I], strides=[I, 1], block_shape=[BM // 2, t.block_k])
               if plan.cfg.half_tail else ad)
    wd = TensorDescriptor(w.down, shape=[E * H, I], strides=[I, 1], block_shape=[t.block_n, t.block_k])
    tiles = plan.max_blocks * (H // t.block_n)
    progs, flat = tma_gemm_programs(t, plan.act_PI.device, by_rule=flat_down_rule(plan.cfg, I),
                                    cfg_flat=plan.cfg.flat_down)
    y = plan.y_SNH
    moe_down_tma_kernel[(progs or tiles,)](
        ad, ad_half, wd, y, plan.sorted_P, plan.block_expert_B, plan.N, H, I, plan.max_blocks, tiles, y.stride(1),
        PERSISTENT=progs > 0, WS=False, NUM_PROGS=max(1, progs), BLOCK_M=BM, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, HALF_TAIL=plan.cfg.half_tail and not flat, num_warps=t.num_warps, num_stages=t.num_stages,
        PDL=plan.pdl_gemm, FLAT=flat, launch_pdl=plan.pdl,
    )


def _launch_gate_up_ws(plan: _Plan, x_rows: torch.Tensor, top_k_div: int, w: ExpertWeights,
                       config: MoEConfig) -> bool:
    """The gate_up GEMM by the warp-specialised Gluon kernel (WS_GATE_UP); False where it does not serve."""
    from .triton_ws import launch_gate_up_ws, ws_device_ok, ws_gate_up_tiles, ws_rows_ok

    t = plan.cfg.gate_up
    coop, pace = _ws_schedule(plan)
    tiles = ws_gate_up_tiles(plan.cfg.block_m, t.block_n, t.block_k, plan.H, plan.I, w.gate_up.dtype,
                             config.activation, w.layout, bool(w.interleaved), coop)
    if (tiles is None or not ws_device_ok(plan.act_PI) or not ws_rows_ok(x_rows, w.gate_up.dtype)
            or not w.gate_up.is_contiguous() or (w.gate_up_bias is not None and not w.interleaved)):
        return False
    # a tiling whose kernel does not compile (shared memory) falls back, as the TMA kernels do
    return _launch_tma("ws_gate_up", (tiles, w.layout, config.activation, coop, pace), lambda: launch_gate_up_ws(
        x_rows, w.gate_up, w.gate_up_bias, plan.act_PI, plan.sorted_P, plan.block_expert_B, plan.N, top_k_div,
        plan.max_blocks, tiles, w.layout, config.activation, float(config.swiglu_limit or 0.0),
        float(config.gptoss_alpha), t.group_m, _sm_count(plan.act_PI.device), coop, pace))


def _launch_down_ws(plan: _Plan, w: ExpertWeights) -> bool:
    """The down GEMM by the warp-specialised Gluon kernel (WS_DOWN, one split); False where it does not serve."""
    from .triton_ws import launch_down_ws, ws_device_ok, ws_down_tiles

    t = plan.cfg.down
    coop, pace = _ws_schedule(plan)
    tiles = ws_down_tiles(plan.cfg.block_m, t.block_n, t.block_k, plan.H, plan.I, w.down.dtype, w.layout, coop)
    if tiles is None or not ws_device_ok(plan.act_PI) or not w.down.is_contiguous():
        return False
    return _launch_tma("ws_down", (tiles, w.layout, coop, pace), lambda: launch_down_ws(
        plan.act_PI, w.down, w.down_bias, plan.y_SNH[0], plan.sorted_P, plan.block_expert_B, plan.N, plan.max_blocks,
        tiles, w.layout, t.group_m, _sm_count(plan.act_PI.device), coop, pace))


def _ws_schedule(plan: _Plan) -> tuple[bool, bool]:
    """(coop, pace) of the Gluon GEMMs: the cooperative schedule (WS_COOP, on 128-row blocks), and whether
    it computes padding halves (WS_PACE; cooperative only)."""
    coop = WS_COOP and plan.cfg.block_m == 128
    return coop, coop and WS_PACE


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of CUDA device dev."""
    return _device_facts(dev.index if dev.index is not None else torch.cuda.current_device())[1]


def _launch_combine(plan: _Plan, wts_N: torch.Tensor | None, ids_N: torch.Tensor) -> None:
    """out_TH = sum over slots (and splits) of y, weighted when wts_N is given."""
    combine_launch(plan.y_SNH, wts_N, ids_N, plan.out_TH, plan.K, plan.E, pdl=plan.pdl)


def combine_launch(y_SNH: torch.Tensor, wts_N: torch.Tensor | None, ids_N: torch.Tensor, out_TH: torch.Tensor,
                   K: int, E: int, *, pdl: bool = False) -> None:
    """out_TH [T, H] = sum over the K slots (and the S split parts of y_SNH [S, T*K, H]) of y, weighted by
    wts_N [T*K] when given, in slot order (moe_gemm.moe_combine_kernel; shared by the quantized experts).

    pdl: launched with programmatic dependent launch (moeflow/kernels/pdl.py; the caller checked pdl_for).
    """
    from ..kernels.moe_gemm import moe_combine_kernel

    T, H = out_TH.shape
    S = y_SNH.shape[0]
    # Each program keeps K*S loads of BLOCK_H in flight: narrow the block as K*S grows (no
    # spills, and more programs when T is small).
    bh = max(128, min(_COMBINE_BLOCK_H, 4096 // (K * S)))
    bh = 1 << (bh.bit_length() - 1)
    bh = min(bh, 1 << max(0, (H - 1).bit_length()))
    moe_combine_kernel[(T, math.ceil(H / bh))](
        y_SNH, wts_N if wts_N is not None else ids_N, ids_N, out_TH, H, E, y_SNH.stride(0), y_SNH.stride(1),
        out_TH.stride(0), K=K, SPLIT=S, HAS_W=wts_N is not None, BLOCK_H=bh, num_warps=4, PDL=pdl, launch_pdl=pdl,
    )


def _run(x_MH, ids_N, wts_N, T, K, w: ExpertWeights, config: MoEConfig, cfg: MoETileConfig, *,
         weight_on_input: bool, combine_weights: bool, tma: bool = False) -> torch.Tensor:
    """Launch the pipeline for T rows of x with K slots each (K=1 for forward_pairs)."""
    plan = _Plan(x_MH, T, K, w, cfg)
    plan.tma = tma
    _launch_align(plan, ids_N)
    if weight_on_input:
        # llama4: the expert's input is (w * x) rounded to x's dtype, made once before the GEMMs.
        x_rows = (x_MH.unsqueeze(1) * wts_N.view(T, K, 1).to(x_MH.dtype)).reshape(plan.N, plan.H)
        _launch_gate_up(plan, x_rows, 1, w, config)
    else:
        _launch_gate_up(plan, x_MH, K, w, config)
    _launch_down(plan, w)
    _launch_combine(plan, wts_N if combine_weights else None, ids_N)
    return plan.out_TH


def _decode_rows(num_pairs: int) -> int:
    """MP: decode gate_up tile rows for N pairs (a power of two >= N, at least the smallest dot's 16)."""
    return max(16, 1 << max(0, (num_pairs - 1).bit_length()))


def _run_decode(x_TH, ids_N, wts_N, T, K, w: ExpertWeights, config: MoEConfig, dcfg: DecodeConfig, *,
                weight_on_input: bool) -> torch.Tensor:
    """The two-launch decode path (moeflow/kernels/moe_decode.py): out_TH [T, H] in x's dtype.

    Buffers: act_NI [N, I] (weights' dtype, what the aligned path rounds act to) and out_TH.
    """
    from ..kernels.moe_decode import DOWN_DOT_ROWS, moe_decode_down_kernel, moe_decode_gate_up_kernel

    N, H, I, E = T * K, w.hidden_size, w.intermediate_size, w.num_experts
    dev = x_TH.device
    act_NI = torch.empty(N, I, dtype=w.dtype, device=dev)
    out_TH = torch.empty(T, H, dtype=x_TH.dtype, device=dev)
    precision = "ieee" if w.dtype == torch.float32 else "tf32"
    (gse, gsn, gsk), (dse, dsn, dsk) = _weight_strides(w)
    mp = _decode_rows(N)
    gu = dcfg.gate_up
    # Shared memory per stage: the x rows [MP, BK] and the gate_up columns [BK, 2BN]; drop
    # stages (never below 2) rather than fail to compile when MP grows to 64 rows.
    stage_bytes = (mp * gu.block_k + gu.block_k * 2 * gu.block_n) * w.dtype.itemsize
    stages = gu.num_stages
    while stages > 2 and stages * stage_bytes > _DECODE_SMEM_BYTES:
        stages -= 1
    gub = w.gate_up_bias if w.gate_up_bias is not None else w.gate_up  # dummy pointer when no bias
    moe_decode_gate_up_kernel[(N, math.ceil(I / gu.block_n))](
        x_TH, w.gate_up, gub, wts_N, ids_N, act_NI,
        N, E, H, I, K,
        x_TH.stride(0), gse, gsn, gsk, gub.stride(0), act_NI.stride(0),
        float(config.swiglu_limit or 0.0), float(config.gptoss_alpha),
        ACT=_ACT_CODES[config.activation], INTERLEAVED=bool(w.interleaved), HAS_BIAS=w.gate_up_bias is not None,
        WEIGHT_ON_INPUT=weight_on_input, EVEN_K=H % gu.block_k == 0, PRECISION=precision,
        BLOCK_M=mp, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, num_warps=gu.num_warps, num_stages=stages,
    )
    dn = dcfg.down
    db = w.down_bias if w.down_bias is not None else w.down  # dummy pointer when no bias
    moe_decode_down_kernel[(T, math.ceil(H / dn.block_n))](
        act_NI, w.down, db, wts_N, ids_N, out_TH,
        E, H, I,
        act_NI.stride(0), dse, dsn, dsk, db.stride(0), out_TH.stride(0),
        K=K, HAS_W=not weight_on_input, HAS_BIAS=w.down_bias is not None, EVEN_K=I % dn.block_k == 0,
        PRECISION=precision, ROWS=DOWN_DOT_ROWS, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k,
        num_warps=dn.num_warps, num_stages=dn.num_stages,
    )
    return out_TH


IMPL = TritonExperts()
