"""A read-only streaming Triton kernel: a candidate for the HBM read roof (GPU; CPU under TRITON_INTERPRET=1).

Why: roof_frac = floor / time is <= 1 by construction only when the roof is at least as fast a
pure read as anything we time against it. torch.sum / torch.amax over 2 GiB were beaten by our
own weight-streaming GEMMs by up to 5% on the H200 (roof_frac 1.05 in benchmarks/bench_experts.py), so
benchmarks.common.hbm_read_roof_detail takes the fastest of them and the best configuration of
this kernel, which does nothing but read: 16-byte loads, one XOR per word, one word written per
program.

Kernel (`stream_read_kernel`): the buffer is viewed as n int32 words and cut into blocks of
BLOCK words (the tail, n % BLOCK words, is one masked block). A persistent grid of
SMs * progs_per_sm programs walks the full blocks either grid-stride (order "stride": program p
reads blocks p, p + G, ...; the programs running at once read neighbouring blocks) or as one
contiguous slab each (order "slab"), XORs every word into a register accumulator, and stores
its one combined word to out[p], so no load can be elided. The XOR of out[:G] equals the XOR
of all n words, which is what the tests check.

Sweep (`best_stream_read_bytes_per_s`): coordinate descent over SWEEP, 11 configurations:
BLOCK x warps (6), then programs per SM, then the walk order, then the cache hint, each axis
tried on the best configuration so far.

    PYTHONPATH=. python benchmarks/stream_read.py             # each configuration's TB/s, torch's, checked
    PYTHONPATH=. python benchmarks/stream_read.py --gib 0.5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moeflow.kernels.launch import fast_kernel  # noqa: E402

# One 16-byte load per thread per row: a block is loaded as [BLOCK // COLS, COLS] int32 words with
# COLS = 4 words x 32 lanes x warps, so Triton's coalescing gives each thread 4 contiguous words of
# every row (ld.global.v4) and the rows of one thread are XORed in registers, with no shuffle in the loop.
WORDS_PER_LOAD = 4

PROGS_PER_SM = (1, 2, 4)
BASE = {"block": 8192, "warps": 8, "progs_per_sm": 2, "order": "stride", "cache": "", "evict": ""}
# Axes of the coordinate descent, in order; each entry overrides BASE / the best so far.
SWEEP: tuple[tuple[dict, ...], ...] = (
    tuple({"block": b, "warps": w} for b in (4096, 8192, 16384) for w in (4, 8)),
    tuple({"progs_per_sm": p} for p in PROGS_PER_SM),
    ({"order": "stride"}, {"order": "slab"}),
    ({"cache": "", "evict": ""}, {"cache": "", "evict": "evict_first"}, {"cache": ".cg", "evict": ""}),
)


@fast_kernel
@triton.jit
def stream_read_kernel(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, COLS: tl.constexpr, SLAB: tl.constexpr,
                       CACHE: tl.constexpr, EVICT: tl.constexpr):
    """out[p] = XOR of the int32 words of src[0:n_words] that program p reads.

    src_ptr: [n_words] int32 (16-byte aligned for the vector loads); out_ptr: [programs] int32.
    BLOCK: words per loop step, a multiple of COLS = 4 * 32 * num_warps. SLAB: contiguous slab per
    program, else grid-stride. CACHE / EVICT: tl.load's cache_modifier / eviction_policy ("" none).
    Offsets stay int32: blk * BLOCK and n_full * BLOCK are at most n_words (which Triton passes as
    int64 when it needs to), and they are added to the pointer before offs, in 64 bits.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_full = n_words // BLOCK
    offs = tl.arange(0, BLOCK // COLS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    acc = tl.zeros([COLS], dtype=tl.int32)
    if SLAB:
        per = tl.cdiv(n_full, nprog)
        start = pid * per
        stop = tl.minimum(start + per, n_full)
        step = 1
    else:
        start = pid
        stop = n_full
        step = nprog
    for blk in range(start, stop, step):
        words = tl.load(src_ptr + blk * BLOCK + offs, cache_modifier=CACHE, eviction_policy=EVICT)
        acc ^= tl.xor_sum(words, axis=0)
    # The masked tail goes to the last program: in either order it has no more full blocks than any other.
    if pid == nprog - 1:
        words = tl.load(src_ptr + n_full * BLOCK + offs, mask=offs < n_words - n_full * BLOCK, other=0)
        acc ^= tl.xor_sum(words, axis=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (its index, or the current device's when it has none)."""
    from moeflow.experts.devices import device_facts  # the project's cached device properties

    return device_facts(device).sm_count


def stream_read_fn(buf: torch.Tensor, out: torch.Tensor, *, block: int = BASE["block"], warps: int = BASE["warps"],
                   progs_per_sm: int = BASE["progs_per_sm"], order: str = BASE["order"], cache: str = "",
                   evict: str = "", sms: int | None = None) -> tuple[Callable[[], None], int]:
    """Check the arguments once; returns (launch, G): launch() reads every byte of `buf` once and
    writes out[:G], G the number of programs. launch() does no host work but Triton's launch:
    timed without a flush, the host's launch time is a gap inside the event timing.

    buf: contiguous, any dtype, nbytes a multiple of 4 (read as int32 words). out: int32 with at
    least G = sms * progs_per_sm elements; sms defaults to the CUDA device's SM count (pass it on
    the CPU, under the interpreter). block: int32 words per loop step, a power of two and a
    multiple of 4 * 32 * warps. order: "stride" or "slab". cache / evict: tl.load's
    cache_modifier (".cg") / eviction_policy ("evict_first"), "" for none.
    XOR of out[:G] = XOR of buf's words.
    """
    if not buf.is_contiguous() or buf.numel() * buf.element_size() % 4:
        raise ValueError(f"buf: need a contiguous buffer of whole int32 words, got {tuple(buf.shape)} {buf.dtype}")
    cols = WORDS_PER_LOAD * 32 * warps
    if block % cols or block & (block - 1):
        raise ValueError(f"block {block}: need a power of two and a multiple of 4 * 32 * warps = {cols}")
    if order not in ("stride", "slab"):
        raise ValueError(f"order {order!r}: expected 'stride' or 'slab'")
    if sms is None:
        if buf.device.type != "cuda":
            raise ValueError("sms: needed off CUDA (the SM count sizes the persistent grid)")
        sms = device_sms(buf.device)
    grid = sms * progs_per_sm
    if out.dtype != torch.int32 or out.numel() < grid or out.device != buf.device:
        raise ValueError(f"out: need >= {grid} int32 words on {buf.device}, got {out.numel()} {out.dtype} on {out.device}")
    words = buf.reshape(-1).view(torch.int32)
    n_words = words.numel()
    kernel = stream_read_kernel[(grid,)]
    consts = {"BLOCK": block, "COLS": cols, "SLAB": order == "slab", "CACHE": cache, "EVICT": evict,
              "num_warps": warps}

    def launch() -> None:
        kernel(words, out, n_words, **consts)

    return launch, grid


def stream_read(buf: torch.Tensor, out: torch.Tensor, **cfg) -> int:
    """One read of `buf` (stream_read_fn's arguments: block, warps, progs_per_sm, order, cache,
    evict, sms); returns G, the number of programs, whose words are out[:G]."""
    launch, grid = stream_read_fn(buf, out, **cfg)
    launch()
    return grid


def reader_name(cfg: dict) -> str:
    """The roof's reader label of one configuration (benchmarks.common.hbm_read_roof_detail)."""
    hint = cfg["cache"] or cfg["evict"] or "none"
    return (f"triton stream BLOCK={cfg['block']} warps={cfg['warps']} progs_per_sm={cfg['progs_per_sm']} "
            f"order={cfg['order']} hint={hint}")


def best_stream_read_bytes_per_s(buf: torch.Tensor, timer: Callable[[Callable[[], object]], float] | None = None,
                                 *, sms: int | None = None) -> tuple[float, dict, list[dict]]:
    """Time the SWEEP configurations reading `buf`; returns (best bytes/s, its config, all results).

    timer(fn) -> seconds; default benchmarks.common.time_cuda(fn, reps=10, warmup=2, flush=False)
    (buf is meant to be far larger than L2, so no flush: every byte comes from HBM). sms: as
    stream_read_fn's (given, with a CPU timer, the sweep runs under the interpreter). Each result
    is the config dict plus "seconds" and "bytes_per_s", in the order timed.
    """
    if timer is None:
        from benchmarks.common import time_cuda

        def timer(fn):
            return time_cuda(fn, reps=10, warmup=2, flush=False)

    nbytes = buf.numel() * buf.element_size()
    if sms is None:
        sms = device_sms(buf.device)
    out = torch.empty(sms * max(PROGS_PER_SM), dtype=torch.int32, device=buf.device)
    results: list[dict] = []
    done: dict[tuple, float] = {}

    def measure(cfg: dict) -> float:
        key = tuple(sorted(cfg.items()))
        if key not in done:
            t = timer(stream_read_fn(buf, out, sms=sms, **cfg)[0])
            done[key] = nbytes / t
            results.append({**cfg, "seconds": t, "bytes_per_s": done[key]})
        return done[key]

    best = dict(BASE)
    for axis in SWEEP:
        best = max(({**best, **change} for change in axis), key=measure)
    return done[tuple(sorted(best.items()))], best, results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size in GiB (default 2, as the roof)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("stream_read: needs CUDA", file=sys.stderr)
        return 2
    import numpy as np

    from benchmarks.common import torch_read_bytes_per_s

    n = int(args.gib * 2**30) // 16 * 4  # int32 words, a whole number of 16-byte vectors
    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=gen)
    ref = int(np.bitwise_xor.reduce(buf.cpu().numpy()))
    best_bps, best, results = best_stream_read_bytes_per_s(buf)
    out = torch.empty(device_sms(buf.device) * max(PROGS_PER_SM), dtype=torch.int32, device="cuda")
    print(f"{torch.cuda.get_device_name()}: {n * 4 / 2**30:.2f} GiB read, no flush, median of 10")
    wrong = 0
    for r in results:
        cfg = {k: r[k] for k in BASE}
        g = stream_read(buf, out, **cfg)
        ok = int(np.bitwise_xor.reduce(out[:g].cpu().numpy())) == ref
        wrong += not ok
        print(f"  {r['bytes_per_s'] / 1e12:6.3f} TB/s  {reader_name(cfg)}{'' if ok else '  WRONG XOR'}")
    for name, bps in torch_read_bytes_per_s(buf.view(torch.float32)).items():
        print(f"  {bps / 1e12:6.3f} TB/s  {name}")
    print(f"best triton: {best_bps / 1e12:.3f} TB/s, {reader_name(best)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
