"""FP8 activation quantization (moeflow.kernels.moe_gemm_quant.fp8_quant_rows_kernel): time its program split,
GPP groups of 128 channels a program x num_warps, at prefill row counts, and check every split gives the same
bits. GPU only; triton.testing.do_bench (which flushes L2 between runs).

    PYTHONPATH=. python tools/diag_fp8_quant_rows.py

Its times set the pass's split, moeflow.tuning.rules fp8_quant_groups_per_program / fp8_quant_warps (H100:
8 groups on 2 warps 23.8 us at 8192 x 2048 and 66.6 us at 8192 x 7168, against 29.1 / 86.3 with 4 on 4).
"""

import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _launch(kernel, x, xq, xs, G: int, gpp: int, nw: int) -> None:
    """One quantization of x [M, H] into xq / xs, GPP groups a program on nw warps."""
    M, H = x.shape
    kernel[(M, -(-(H // G) // gpp))](x, xq, xs, M, H, x.stride(0), xq.stride(0), xs.stride(0), G=G, GPP=gpp,
                                     num_warps=nw)


def main() -> int:
    if not torch.cuda.is_available():
        print("diag_fp8_quant_rows: needs CUDA", file=sys.stderr)
        return 2
    import triton

    from moeflow.kernels.moe_gemm_quant import fp8_quant_rows_kernel

    torch.manual_seed(0)
    G = 128
    for M, H in ((8192, 2048), (8192, 7168), (2048, 7168)):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        ng = H // G
        ref = None
        for gpp in (4, 8, 16):
            for nw in (1, 2, 4, 8):
                xq = torch.empty(M, H, dtype=torch.float8_e4m3fn, device="cuda")
                xs = torch.empty(M, ng, device="cuda")

                run = functools.partial(_launch, fp8_quant_rows_kernel, x, xq, xs, G, gpp, nw)

                run()
                torch.cuda.synchronize()
                if ref is None:
                    ref = (xq.clone(), xs.clone())
                same = torch.equal(xq.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(xs, ref[1])
                ms = triton.testing.do_bench(run, warmup=20, rep=100)
                gbytes = (M * H * 3 + M * ng * 4) / 1e9  # bf16 in, e4m3 out, f32 scales
                print(f"M={M} H={H} gpp={gpp:2d} warps={nw} {ms * 1e3:7.1f} us {gbytes / (ms * 1e-3):7.0f} GB/s "
                      f"same={same}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
