"""Shared benchmark plumbing: roofs measured in the same run, CUDA-event timing, environment, JSON.

Every benchmark reports ratios taken in one process (shared/spec/benchmarks.md):
roof_frac = floor / our time, vs_peer = peer time / our time.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

STANDARD_SHAPES: dict[str, dict[str, int]] = {
    # name: H, I (per expert), E, K, shared (count of shared experts of width I)
    "mixtral-8x7b": {"H": 4096, "I": 14336, "E": 8, "K": 2, "shared": 0},
    "qwen3-30b-a3b": {"H": 2048, "I": 768, "E": 128, "K": 8, "shared": 0},
    "deepseek-v3": {"H": 7168, "I": 2048, "E": 256, "K": 8, "shared": 1},
    "gpt-oss-120b": {"H": 2880, "I": 2880, "E": 128, "K": 4, "shared": 0},
    "ds-v4.1-like": {"H": 4096, "I": 2048, "E": 384, "K": 6, "shared": 1},
}
STANDARD_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192)


def env_info() -> dict[str, str]:
    """Date, device and library versions for RESULTS.md."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = "not installed"
    return info


def add_kernel_options_args(ap) -> None:
    """The arguments that choose the Triton experts' KernelOptions (moeflow.experts.options) for a run:
    --tma, --pdl, --no-fast-launch, --pin STAGE=VARIANT (repeatable). `kernel_options(args)` builds them."""
    ap.add_argument("--tma", choices=("auto", "on", "off"), default="auto",
                    help="TMA descriptors for the aligned GEMMs' tiles (auto: on Hopper or newer)")
    ap.add_argument("--pdl", choices=("auto", "off"), default="auto",
                    help="programmatic dependent launch between the step's kernels (off: plain stream order)")
    ap.add_argument("--no-fast-launch", action="store_true", help="every launch through Triton's JIT binder")
    ap.add_argument("--pin", action="append", default=[], metavar="STAGE=VARIANT",
                    help="force a variant for a stage, e.g. gate_up=tma_gather_x (moeflow.experts.plan.VARIANTS); "
                         "repeatable")


def parse_pins(items: list[str]) -> dict[str, str]:
    """{stage: variant} of --pin values ("gate_up=tma", also comma-separated: "gate_up=tma,down=tma_flat")."""
    pins: dict[str, str] = {}
    for item in (p for arg in items for p in arg.split(",") if p):
        stage, sep, variant = item.partition("=")
        if not sep or not stage or not variant:
            raise ValueError(f"--pin {item!r}: expected STAGE=VARIANT")
        pins[stage.strip()] = variant.strip()
    return pins


def kernel_options(args, **overrides):
    """KernelOptions from add_kernel_options_args' arguments; `overrides` replace single fields
    (e.g. tma=True for a dry run under the Triton interpreter, which takes TMA kernels only when asked)."""
    from moeflow.experts.options import KernelOptions

    kw = dict(tma={"auto": None, "on": True, "off": False}[getattr(args, "tma", "auto")],
              pdl=False if getattr(args, "pdl", "auto") == "off" else None,
              fast_launch=not getattr(args, "no_fast_launch", False),
              pin=parse_pins(getattr(args, "pin", []) or []))
    kw.update(overrides)
    return KernelOptions(**kw)


def options_record(options) -> dict:
    """A KernelOptions as JSON-able fields, for a run's metadata (rows are comparable only under the same)."""
    return dict(tma=options.tma, pdl=options.pdl, fast_launch=options.fast_launch, pin=dict(options.pin))


def time_cpu(fn: Callable[[], object], *, reps: int = 20, warmup: int = 3) -> float:
    """Median wall seconds of fn() on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


_FLUSH: dict[str, torch.Tensor] = {}


def flush_l2(kind: str = "write") -> None:
    """Evict L2 so the next kernel reads its weights from HBM: "write" (the standard of
    shared/spec/benchmarks.md) writes 256 MB, which leaves L2 full of dirty lines that the next
    kernel's reads must write back first; "read" reads 256 MB (clean lines, like the previous
    layer's weights in a real decode step): tools/diag_flush.py measures the difference."""
    buf = _FLUSH.get("buf")
    if buf is None:
        buf = _FLUSH["buf"] = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    if kind == "write":
        buf.zero_()
    elif kind == "read":
        torch.amax(buf, dim=0, out=_FLUSH.setdefault("sink", torch.empty((), device="cuda")))
    else:
        raise ValueError(f"flush kind {kind!r}: expected 'write' or 'read'")


def time_cuda(fn: Callable[[], object], *, reps: int = 20, warmup: int = 5, flush: bool | str = True) -> float:
    """Median seconds of fn() by CUDA events, L2 flushed before each timed call when `flush`
    (True: the standard "write" flush; or a flush_l2 kind)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_time_once(fn, flush) for _ in range(reps))


def _time_once(fn: Callable[[], object], flush: bool | str) -> float:
    """Seconds of one fn() by CUDA events, after an L2 flush when `flush` (as time_cuda)."""
    if flush:
        flush_l2("write" if flush is True else flush)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph holding fn(), captured after three warm-up calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_cuda_graph(fn: Callable[[], object], *, reps: int = 20, flush: bool | str = True) -> float:
    """Median seconds of one replay of a CUDA graph holding fn() (capture_graph)."""
    return time_cuda(capture_graph(fn).replay, reps=reps, warmup=3, flush=flush)


def time_cuda_graphs_interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 5, reps: int = 3,
                                 flush: bool | str = True) -> dict[str, float]:
    """{name: median seconds of one replay} of a CUDA graph per fn, timed round-robin: `rounds` passes
    over the graphs, `reps` timed replays of each per pass (L2 flushed before each, as time_cuda).

    Why round-robin: compute-bound steps run the GPU at its power limit, and its clocks drift over
    seconds (H200: the same prefill config timed 3-12% apart when timed first and then again after
    other variants). Timing the variants one after another puts that drift into their ratios;
    interleaving spreads it over all of them."""
    graphs = {name: capture_graph(fn) for name, fn in fns.items()}
    for g in graphs.values():  # one untimed replay each
        g.replay()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            times[name] += [_time_once(g.replay, flush) for _ in range(reps)]
    return {name: statistics.median(ts) for name, ts in times.items()}


def torch_read_bytes_per_s(a: torch.Tensor) -> dict[str, float]:
    """Bytes / time of torch's two read-only reductions over `a` (CUDA f32, contiguous, even length,
    far larger than L2: no flush): torch.sum of it as f32 and torch.amax of it as bf16 (another load
    width and kernel). Keys are the reader names hbm_read_roof_detail reports."""
    nbytes = a.numel() * 4
    b = a.view(torch.bfloat16)
    return {"torch.sum f32": nbytes / time_cuda(a.sum, reps=10, warmup=2, flush=False),
            "torch.amax bf16": nbytes / time_cuda(b.amax, reps=10, warmup=2, flush=False)}


@functools.cache
def _read_roof(device: int) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    # Per device, once per process: every caller reads it once before timing (none re-measures),
    # and the Triton sweep costs seconds (compiles included); frozen so no caller can change it.
    from moeflow._triton import triton_available

    n = 1 << 29  # f32 elements: 2 GiB
    a = torch.ones(n, dtype=torch.float32, device="cuda")
    candidates = torch_read_bytes_per_s(a)
    if triton_available():  # Triton is a GPU extra: without it the roof is torch's two reductions
        from benchmarks.stream_read import best_stream_read_bytes_per_s, reader_name

        bps, cfg, _ = best_stream_read_bytes_per_s(a)
        candidates[reader_name(cfg)] = bps
    reader = max(candidates, key=candidates.get)
    return candidates[reader], reader, tuple(candidates.items())


def hbm_read_roof_detail() -> dict:
    """The HBM roof of a weight-streaming kernel and which reader set it (CUDA).

    Read-only streams over one 2 GiB buffer (every byte read once, almost nothing written):
    torch.sum of it as f32, torch.amax of it as bf16, and, when Triton is installed, the best
    of a small sweep of benchmarks/stream_read.py's kernel (16-byte loads, persistent grid).
    The fastest is the roof, so a decode kernel (which only reads weights) stays at roof_frac
    <= 1 up to timing noise, unlike against a copy's (read + write) / time: torch's reductions
    alone were beaten by our GEMMs by up to 5% on the H200.

    Returns {"bytes_per_s": float, "reader": the fastest's name ("torch.sum f32", "torch.amax
    bf16" or "triton stream BLOCK=... warps=... progs_per_sm=... order=... hint=..."),
    "candidates": {name: bytes_per_s}}. Measured once per process and device, on the current one.
    """
    bps, reader, candidates = _read_roof(torch.cuda.current_device())
    return {"bytes_per_s": bps, "reader": reader, "candidates": dict(candidates)}


def hbm_read_roof_bytes_per_s() -> float:
    """The HBM read roof in bytes / s: hbm_read_roof_detail()["bytes_per_s"] (its reader is in the detail)."""
    return hbm_read_roof_detail()["bytes_per_s"]


def hbm_roof_bytes_per_s() -> float:
    """Device-to-device copy of 2 GiB: (bytes read + written) / time. The older roof: kept for
    reference beside `hbm_read_roof_bytes_per_s` (a copy is not the fastest read stream)."""
    n = 1 << 29  # f32 elements: 2 GiB
    a = torch.empty(n, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    t = time_cuda(lambda: b.copy_(a), reps=10, warmup=2, flush=False)
    return 2 * n * 4 / t


def compute_roof_flops() -> float:
    """bf16 8192^3 torch.mm FLOP / time."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = time_cuda(lambda: torch.mm(a, b), reps=10, warmup=3, flush=False)
    return 2 * n**3 / t


def pcie_roof_bytes_per_s() -> float:
    """Pinned host -> device copy of 1 GiB: bytes / time."""
    n = 1 << 28
    h = torch.empty(n, dtype=torch.float32, pin_memory=True)
    d = torch.empty(n, dtype=torch.float32, device="cuda")
    t = time_cuda(lambda: d.copy_(h, non_blocking=True), reps=5, warmup=1, flush=False)
    return n * 4 / t


def write_json(path: str | Path, rows: list[dict], meta: dict | None = None) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta or env_info(), "rows": rows}, indent=1))


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of the given columns (floats to 4 significant digits)."""

    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
