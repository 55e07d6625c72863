"""benchmarks/stream_read.py: the read-only streaming kernel behind the HBM read roof reads every word once.

CPU with Triton installed: the kernel under the Triton interpreter (a subprocess,
moeflow.testing.run_interpreter_check) on 10_001 random int32 words (not a multiple of any
BLOCK: a masked tail), both walk orders, three block sizes (one larger than the buffer: tail
only), grids with programs that get no full block. Each program's word is checked exactly
against numpy's XOR of the blocks its walk assigns it (the module doc's orders), and the XOR of
all of them against numpy's XOR of the buffer; and the sweep's coordinate descent, timed on the
CPU (at most 16 configurations, the best the fastest). GPU (`-m gpu`): the same on 64 MiB + 3 words
for the kernel variants of the sweep's axes, the sweep's timing gives a positive rate, and
benchmarks.common's read roof is the fastest of its candidates (torch's two and the sweep's best).
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


def expected_words(words: np.ndarray, block: int, programs: int, order: str) -> np.ndarray:
    """[programs] int32: the XOR of the blocks each program reads (host model of the kernel's walk).

    stride: program p reads full blocks p, p + G, ...; slab: blocks [p * per, (p + 1) * per) with
    per = ceil(full / G); the masked tail (len % block words) goes to program G - 1.
    """
    full = len(words) // block
    per = -(-full // programs)
    out = np.zeros(programs, dtype=np.int32)
    for b in range(full):
        p = b % programs if order == "stride" else b // per
        out[p] ^= np.bitwise_xor.reduce(words[b * block:(b + 1) * block])
    if len(words) % block:
        out[-1] ^= np.bitwise_xor.reduce(words[full * block:])
    return out


def check_kernel(device: str, n_words: int, cases) -> None:
    """stream_read on n_words random int32 words against expected_words, for (block, warps, order, hints, sms)."""
    from benchmarks.stream_read import PROGS_PER_SM, stream_read

    g = torch.Generator().manual_seed(n_words)
    buf = torch.randint(-2**31, 2**31 - 1, (n_words,), dtype=torch.int32, generator=g)
    host = buf.numpy()
    whole = np.bitwise_xor.reduce(host)
    buf = buf.to(device)
    for block, warps, order, hints, sms in cases:
        for progs in PROGS_PER_SM:
            out = torch.full((sms * progs + 1,), 7, dtype=torch.int32, device=device)
            G = stream_read(buf, out, block=block, warps=warps, progs_per_sm=progs, order=order, sms=sms, **hints)
            got = out.cpu().numpy()
            case = f"block={block} warps={warps} order={order} {hints} programs={G}"
            assert G == sms * progs and got[G] == 7, f"{case}: wrote outside out[:G]"
            np.testing.assert_array_equal(got[:G], expected_words(host, block, G, order), err_msg=case)
            assert np.bitwise_xor.reduce(got[:G]) == whole, case


# 10_001 words: 19 full blocks of 512 + 273, 4 of 2048 + 1809, none of 16384 (tail only)
INTERP_CASES = [(block, warps, order, {}, 3) for block, warps in ((512, 1), (2048, 4), (16384, 8))
                for order in ("stride", "slab")]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_kernel_reads_every_word_once_in_the_interpreter():
    from moeflow.testing import run_interpreter_check

    run_interpreter_check(__file__, "kernel")


def check_sweep() -> None:
    """The sweep's coordinate descent on the CPU: at most 16 configurations, each timed once, the best
    the fastest of them, reported as the roof's reader name."""
    from benchmarks.common import time_cpu
    from benchmarks.stream_read import BASE, best_stream_read_bytes_per_s, reader_name

    buf = torch.ones(2 * 16384 + 5, dtype=torch.int32)
    bps, best, results = best_stream_read_bytes_per_s(buf, lambda fn: time_cpu(fn, reps=1, warmup=0), sms=2)
    configs = [tuple((k, r[k]) for k in BASE) for r in results]
    assert len(results) <= 16 and len(set(configs)) == len(configs)
    assert set(best) == set(BASE) and tuple(best.items()) in configs
    assert bps == max(r["bytes_per_s"] for r in results) > 0
    assert reader_name(best).startswith(f"triton stream BLOCK={best['block']} warps={best['warps']} ")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_sweep_in_the_interpreter():
    from moeflow.testing import run_interpreter_check

    run_interpreter_check(__file__, "sweep")


@pytest.mark.skipif(not HAS_TRITON, reason="benchmarks.stream_read imports triton")
def test_launcher_refusals():
    from benchmarks.stream_read import stream_read

    buf, out = torch.zeros(4096, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    with pytest.raises(ValueError, match="power of two"):
        stream_read(buf, out, block=1536, warps=1, sms=1)
    with pytest.raises(ValueError, match="multiple of 4"):
        stream_read(buf, out, block=256, warps=4, sms=1)
    with pytest.raises(ValueError, match="order"):
        stream_read(buf, out, block=512, warps=1, order="zigzag", sms=1)
    with pytest.raises(ValueError, match="whole int32 words"):
        stream_read(torch.zeros(3, dtype=torch.bfloat16), out, block=512, warps=1, sms=1)
    with pytest.raises(ValueError, match="contiguous"):
        stream_read(torch.zeros(64, 64, dtype=torch.int32).t(), out, block=512, warps=1, sms=1)
    with pytest.raises(ValueError, match=">= 32 int32"):
        stream_read(buf, out, block=512, warps=1, sms=16, progs_per_sm=2)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="sms"):
            stream_read(buf, out, block=512, warps=1)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")
def test_gpu_kernel_and_sweep():
    from benchmarks.stream_read import BASE, SWEEP, best_stream_read_bytes_per_s, device_sms

    sms = device_sms(torch.device("cuda"))
    # the kernel variants of the sweep's axes around BASE (check_kernel runs each at every
    # progs_per_sm), on 64 MiB + 3 words (a tail)
    variants = sorted({(c["block"], c["warps"], c["order"], c["cache"], c["evict"])
                       for c in ({**BASE, **change} for axis in SWEEP for change in axis)})
    check_kernel("cuda", (64 << 20) // 4 + 3, [(b, w, o, {"cache": ca, "evict": ev}, sms) for b, w, o, ca, ev in variants])
    buf = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    bps, best, results = best_stream_read_bytes_per_s(buf)
    assert bps > 0 and len(results) <= 16 and set(best) == set(BASE)
    assert bps == max(r["bytes_per_s"] for r in results)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")
def test_gpu_read_roof_takes_the_fastest_reader():
    from benchmarks.common import hbm_read_roof_bytes_per_s, hbm_read_roof_detail

    d = hbm_read_roof_detail()
    c = dict(d["candidates"])
    assert {"torch.sum f32", "torch.amax bf16"} < set(c) and any(k.startswith("triton stream ") for k in c)
    assert d["bytes_per_s"] == c[d["reader"]] == max(c.values()) > 0
    d["candidates"].clear()  # a caller's copy: the cached measurement stays whole
    assert hbm_read_roof_detail()["candidates"] == c and hbm_read_roof_bytes_per_s() == d["bytes_per_s"]


if __name__ == "__main__":  # run_interpreter_check: python tests/test_stream_read.py {kernel|sweep}
    from moeflow.testing import patch_interpreter_index

    patch_interpreter_index()
    if sys.argv[1] == "kernel":
        check_kernel("cpu", 10_001, INTERP_CASES)
    else:
        check_sweep()
    print(f"PASS {sys.argv[1]}")
