"""FP4 GEMV path (GPU): its tiles per T, against the MMA tiles and against an earlier revision's kernels.

Legend: T tokens, K slots, N = T*K (token, slot) pairs, E experts, H hidden, I intermediate,
BN outputs per program, BK reduction elements a step, W warps.

Why: the MXFP4 decode GEMV (moeflow.experts.triton_quant, `uses_gemv`) was issue-bound (ncu
2026-12-03: ALU the busiest pipe, ~75% of issue slots); it was rewritten to read packed int32 words
with the activations in registers (one inline-PTX block a word: decode and fma chain). This tool
measures, in one process, under CUDA-graph replay with L2 flushed (median of --reps):
    baseline      TritonQuantExperts() of --baseline-rev (moeflow/experts/triton_quant.py and
                  moeflow/kernels/moe_gemm_quant.py of that git revision, loaded beside the current
                  ones; its own GEMV / MMA choice)
    default       TritonQuantExperts() as it is (--tiles default): its own tiles and GEMV / MMA choice
    gemv_BNxBKwW  the current GEMV with those tiles (_GEMV_MAX_PAIRS raised so every T runs it)
    gemv_..._tdec the first named tile with FP4_DECODE_ASM = False: must equal it bit for bit
    mma_default   the current MMA tiles (_GEMV_MAX_PAIRS = 0)
Every variant is timed twice, the second pass in reverse order, and keeps the lower time.
floor = quantized bytes of the distinct experts touched + x + out over the read-only HBM roof
measured in the same run; each row's rel-L2 is against the dequantized-f32 reference.
--shape: any FP4 shape of benchmarks/bench_experts_quant.SHAPES; --tiles BNxBKwW,... or default.

    PYTHONPATH=. python benchmarks/diag_gemv_tiles.py --tokens 1,2,4,8,16,32 --baseline-rev 4ea8f86 \
        --json out/diag_gemv_tiles.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_experts_quant import SHAPES, build_weights, error_vs, reference  # noqa: E402
from benchmarks.common import env_info, hbm_read_roof_bytes_per_s, time_cuda_graph  # noqa: E402
from benchmarks.tune_experts import routing  # noqa: E402
from moeflow.experts import triton_quant as tq  # noqa: E402

# triton_quant's GEMV tile dicts, each set to the variant's tile (one tile whatever the rule would pick).
GEMV_TILE_DICTS = ("_GEMV_TILES", "_GEMV_TILES_FEW", "_GEMV_TILES_LONG_K")
TILES = ((16, 512, 8), (16, 256, 4), (32, 512, 8), (32, 256, 4), (16, 512, 4), (32, 512, 4), (64, 256, 8),
         (16, 256, 8))


def load_baseline(rev: str, tmp: Path):
    """TritonQuantExperts class of git revision `rev` (its triton_quant and moe_gemm_quant modules,
    relative imports pointed at the current package for everything else). `rev` may also be a
    directory holding the two files (triton_quant.py, moe_gemm_quant.py), e.g. on a machine whose
    copy of the tree has no .git."""
    def show(path: str) -> str:
        if Path(rev).is_dir():
            return (Path(rev) / Path(path).name).read_text()
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout

    kq = re.sub(r"^from \.(\w+) import", r"from moeflow.kernels.\1 import", show("moeflow/kernels/moe_gemm_quant.py"),
                flags=re.M)
    tqs = show("moeflow/experts/triton_quant.py").replace("from ..kernels import moe_gemm_quant as kq",
                                                          "import baseline_kq as kq")
    tqs = re.sub(r"from \.\.(\w)", r"from moeflow.\1", tqs)
    tqs = re.sub(r"^from \.(\w+) import", r"from moeflow.experts.\1 import", tqs, flags=re.M)
    (tmp / "baseline_kq.py").write_text(kq)
    (tmp / "baseline_tq.py").write_text(tqs)
    sys.path.insert(0, str(tmp))
    spec = importlib.util.spec_from_file_location("baseline_tq", tmp / "baseline_tq.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TritonQuantExperts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gpt-oss-120b",
                    choices=sorted(n for n, v in SHAPES.items() if v["fmt"] in ("mxfp4", "nvfp4")))
    ap.add_argument("--tiles", default=None,
                    help="BNxBKwW,... (e.g. 8x512w4,16x512w4): the GEMV tiles to time instead of TILES")
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--baseline-rev", default=None,
                    help="git revision (or a directory with its two files) whose quantized experts run as 'baseline'")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tiles_list = TILES
    if args.tiles:
        tiles_list = tuple(None if t == "default" else
                           tuple(int(v) for v in re.fullmatch(r"(\d+)x(\d+)w(\d+)", t).groups())
                           for t in args.tiles.split(","))
    if not torch.cuda.is_available():
        print("diag_gemv_tiles: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    tmp = Path(tempfile.mkdtemp(prefix="moeflow_baseline_"))
    baseline = load_baseline(args.baseline_rev, tmp) if args.baseline_rev else None
    spec = SHAPES[args.shape]
    cfg, wq, _ = build_weights(spec, dev, torch.bfloat16)
    E, H, K = spec["E"], spec["H"], spec["K"]
    roof = hbm_read_roof_bytes_per_s()
    print(f"{env_info()} HBM read roof {roof / 1e12:.3f} TB/s", flush=True)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        ids, wts = routing(T, E, K, "uniform", dev)
        x = (torch.randn(T, H, device=dev, generator=torch.Generator(device=dev).manual_seed(T)) * 0.5
             ).to(torch.bfloat16)
        floor = torch.unique(ids).numel() * wq.expert_bytes + 2 * T * H * 2
        ref = reference(x, ids, wts, wq, cfg, w8a8=False)
        variants = [("baseline", baseline(), None, True)] if baseline else []
        variants += [("default", tq.TritonQuantExperts(), None, True) if t is None else
                     (f"gemv_{t[0]}x{t[1]}w{t[2]}", tq.TritonQuantExperts(),
                      dict(block_n=t[0], block_k=t[1], num_warps=t[2]), True) for t in tiles_list]
        bn, bk, nw = next((t for t in tiles_list if t is not None), TILES[0])
        variants.append((f"gemv_{bn}x{bk}w{nw}_tdec", tq.TritonQuantExperts(),
                         dict(block_n=bn, block_k=bk, num_warps=nw), False))
        variants.append(("mma_default", tq.TritonQuantExperts(), "mma", True))
        outs = {}
        # Two passes, the second in reverse order, each variant's time the lower of the two: the first
        # variant timed after the weights were built ran 5-10% slow on the H100 (sixteenth session).
        for name, impl, tiles, asm in variants + variants[::-1]:
            saved_tiles = {d: dict(getattr(tq, d)) for d in GEMV_TILE_DICTS}
            saved = (tq._GEMV_MAX_PAIRS, tq.FP4_DECODE_ASM)
            tq.FP4_DECODE_ASM = asm
            if tiles == "mma":
                tq._GEMV_MAX_PAIRS = 0
            elif tiles is not None:
                for d in GEMV_TILE_DICTS:
                    getattr(tq, d).update(tiles)
                tq._GEMV_MAX_PAIRS = 1 << 20
            try:
                fn = functools.partial(impl.forward_tokens, x, ids, wts, wq, cfg)
                out = fn()
                torch.cuda.synchronize()
                outs[name] = out.clone()
                rel, _ = error_vs(out, ref)
                t = time_cuda_graph(fn, reps=args.reps)
                first = next((q for q in rows if q["T"] == T and q["variant"] == name and "us" in q), None)
                if first is not None:  # the second pass: one row, the lower time
                    rows.remove(first)
                    t = min(t, first["us"] * 1e-6)
                r = dict(T=T, variant=name, us=t * 1e6, roof=floor / roof / t, rel_l2=rel,
                         path="gemv" if impl.uses_gemv(wq, T * K) else "mma")
            except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
                r = dict(T=T, variant=name, error=repr(exc)[:400])
            finally:
                for d, v in saved_tiles.items():
                    getattr(tq, d).clear()
                    getattr(tq, d).update(v)
                tq._GEMV_MAX_PAIRS, tq.FP4_DECODE_ASM = saved
            rows.append(r)
            print(json.dumps(r), flush=True)
        a, b = f"gemv_{bn}x{bk}w{nw}", f"gemv_{bn}x{bk}w{nw}_tdec"
        if a in outs and b in outs:
            same = torch.equal(outs[a].view(torch.int16), outs[b].view(torch.int16))
            rows.append(dict(T=T, variant="asm_vs_tdec_bitwise", equal=bool(same)))
            print(f"T={T} PTX vs Triton decode bit for bit: {same}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(rows=rows, roof=roof, env=env_info()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
