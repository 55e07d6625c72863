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
reads. What that saves is each boundary's launch and ramp: a few percent at decode (H200, CUDA graph,
L2 flushed; `python benchmarks/bench_experts.py --tokens 1,2,4,8` with and without `--pdl off`). A bulk L2
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
The kernels' PDL constexpr: OFF (0: no asm emitted; non-Hopper GPUs and the Triton interpreter),
EARLY (1: wait, then trigger) or AT_EXIT (2: wait only). Which one a step's launches use is the
kernel plan's (moeflow.experts.plan: `KernelPlan.pdl` / `pdl_gemm`, from KernelOptions.pdl and the
measured rule KernelRules.pdl_gemm_trigger); the alignment and combine passes always trigger early
(one small program / a light pass: nothing to crowd).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Values of the kernels' PDL constexpr.
OFF, EARLY, AT_EXIT = 0, 1, 2


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
