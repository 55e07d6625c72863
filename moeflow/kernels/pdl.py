"""Programmatic dependent launch (PDL, Hopper and newer) for the expert pipeline's kernels.

Why: a decode step of a small-expert model (qwen3-30b-a3b, T = 1: 8 experts, 75 MB of weights)
is a chain of dependent launches (align -> gate_up -> down -> combine), each a fraction of a
wave long. With stream order, each kernel starts only after the previous one has drained and
flushed, so every boundary costs a ramp-down plus a ramp-up, and the down GEMM's weight stream
starts only when gate_up has finished. Launched with PDL (`launch_pdl=True`: the
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION attribute, kept by CUDA-graph capture), a
kernel may start once every program of the previous kernel has executed
`griddepcontrol.launch_dependents` (`pdl_trigger`) or exited, and it must execute
`griddepcontrol.wait` (`pdl_wait`) before it touches anything the previous kernel writes or
reads. What that saves is each boundary's launch and ramp; measured on the H200 (CUDA graph, L2
flushed, benchmarks/diag_pdl.py, RESULTS.md 2026-12-04) it is a few percent at decode. A bulk L2
prefetch of the down GEMM's weight slab before its wait (overlapping down's weight stream with
gate_up's) was tried there and lost at every point: it is not kept.

Rules every PDL kernel of moeflow keeps (what makes the early start safe):
  * every program runs pdl_wait first, before any load, store or early exit. A grid must not
    complete before its predecessor: a later kernel in stream order (a foreign one, or one the
    caching allocator gives this call's freed buffers to) relies on every earlier kernel having
    finished, and a grid whose programs all exited without waiting (a down GEMM whose blocks are
    all padding, when every id is out of range) would break that.
  * pdl_trigger after pdl_wait, never before (a foreign predecessor never triggers early: it
    triggers at exit).
The kernels' PDL constexpr: OFF (0 / False: no asm emitted; non-Hopper GPUs and the Triton
interpreter, where `pdl_for` says False), EARLY (1 / True: wait, then trigger) or AT_EXIT (2: wait
only; see GEMM_TRIGGER).

MOEFLOW_PDL=0 (or `moeflow.kernels.pdl.ENABLED = False`) launches every kernel in plain stream
order (A/B measurements, debugging); read at each launch.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from .._triton import INTERPRETED

ENABLED = os.environ.get("MOEFLOW_PDL", "1") != "0"
# How a GEMM of the chain (gate_up, down) lets its successor start: "early" triggers right after its
# own wait (the successor's programs become resident beside it, in whatever SM slots are free),
# "exit" never triggers (the successor launches as this grid's programs exit, onto freed SMs).
# MOEFLOW_PDL_TRIGGER overrides; read at each call. The alignment and combine passes always
# trigger early (one small program / a light pass: nothing to crowd). "exit" because "early" lost
# up to 6% where gate_up's grid is under a wave (gpt-oss-120b T = 2: down's programs, resident
# early in the free slots, crowd a few SMs), "exit" lost nowhere beyond noise (H200, 2026-12-04,
# benchmarks/diag_pdl.py: 0.994-1.036x stream order at 20 decode points, bf16 / FP8 / MXFP4).
GEMM_TRIGGER = "exit"
# Values of the kernels' PDL constexpr.
OFF, EARLY, AT_EXIT = 0, 1, 2


@functools.cache
def _capability_major(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


def pdl_for(device) -> bool:
    """Whether kernels on `device` (a torch.device) launch with PDL: ENABLED, CUDA, sm_90 or newer."""
    if not ENABLED or INTERPRETED or device.type != "cuda":
        return False
    import torch

    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def gemm_mode(pdl: bool) -> int:
    """The PDL constexpr of a chain GEMM launched with PDL on (pdl True) or off: OFF, EARLY or AT_EXIT."""
    if not pdl:
        return OFF
    how = os.environ.get("MOEFLOW_PDL_TRIGGER", GEMM_TRIGGER)
    if how not in ("early", "exit"):
        raise ValueError(f"MOEFLOW_PDL_TRIGGER: {how!r}, expected 'early' or 'exit'")
    return EARLY if how == "early" else AT_EXIT


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible (PDL != OFF)."""
    if PDL != 0:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel in the stream start (once every program of this one has triggered or exited);
    only PDL == EARLY: AT_EXIT leaves the trigger to the programs' exit."""
    if PDL == 1:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
