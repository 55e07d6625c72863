"""Offline SASS of a moeflow Triton kernel (no GPU): compile for a CUDA target, count the instructions
of its longest loop.

Why: instruction counts per weight value explained the FP4 GEMV's limit (issue-bound: ALU the busiest
pipe under ncu) before any device time was spent; Triton ships ptxas and nvdisasm, so
any machine with the triton package can compile for sm_90 and read the result.

    PYTHONPATH=. python tools/sass_mix.py moeflow.kernels.moe_gemm_quant:moe_down_w4_gemv_kernel \\
        --types act_ptr=*bf16,w_ptr=*u8,s_ptr=*u8,s2_ptr=*fp32,b_ptr=*bf16,y_ptr=*bf16,ids_ptr=*i32 \\
        --const stride_sk=1,FMT=1,G=32,HAS_BIAS=1,BLOCK_N=16,BLOCK_K=512,ASM=1 \\
        --div16 H,I,stride_an,stride_we,stride_wn,stride_se,stride_be,stride_yn --warps 4

Parameters not named in --types are i32 (pointers need a type); --const fixes constexprs (and
specializes ints); --div16 tells the compiler an int is a multiple of 16, as the launcher's
specialization does for such values (without it rows are not known to be aligned and loads
are not vectorized). Prints the loop's instruction count and its most frequent opcodes; --sass
writes the whole listing.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_OPCODE = re.compile(r"\s*(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)\s")


def compile_kernel(fn, types: dict[str, str], consts: dict[str, object], *, arch: int = 90, num_warps: int = 4,
                   num_stages: int = 3, div16: tuple[str, ...] = ()):
    """triton.compile of a @triton.jit function (or a moeflow FastKernel, or a @gluon.jit function) for
    cuda:`arch`, no device needed. A Gluon kernel's tensor descriptors name their shared layout in
    their type: gluon_desc_type."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        fn = fn.fn  # moeflow.kernels.launch.FastKernel
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    sig_params = inspect.signature(fn.fn).parameters
    params = list(sig_params)
    unknown = sorted((set(types) | set(consts) | set(div16)) - set(params))
    if unknown:
        raise ValueError(f"parameters {unknown} are not in {fn.fn.__name__}{tuple(params)}")
    # constexprs left out take their defaults, as a launch does (else they would compile as i32 arguments)
    consts = {**{p: v.default for p, v in sig_params.items() if p not in consts and p not in types
                 and v.default is not inspect.Parameter.empty and "constexpr" in str(v.annotation)}, **consts}
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p.endswith("_ptr") or p in div16}
    src = ASTSource(fn, signature=sig, constexprs={(params.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps,
                                                                             "num_stages": num_stages})


def gluon_desc_type(dtype: str, block: list[int]) -> str:
    """The signature type of a Gluon TensorDescriptor argument (dtype e.g. "bf16", its block shape) with
    the shared layout the host gives it: NVMMASharedLayout.get_default_for(block, dtype)."""
    from triton.experimental.gluon import language as gl

    el = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp8e4nv": gl.float8e4nv, "fp32": gl.float32}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), el)
    return f"tensordesc<{dtype}[{','.join(str(b) for b in block)}],{layout!r}>"


def sass_text(kernel) -> str:
    """The kernel's SASS listing (nvdisasm of its cubin, Triton's bundled copy)."""
    from triton.backends.nvidia import compiler as nvc

    tool = os.path.join(os.path.dirname(nvc.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def _loops(lines: list[str]):
    """(label line, branch line) of every backward-branch loop in a SASS listing."""
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(\.(L_x_\d+)\)", line)
        if not m:
            continue
        j = next((k for k, t in enumerate(lines) if t.startswith("." + m.group(1) + ":")), None)
        if j is not None and j < i:
            yield j, i


def longest_loop(sass: str) -> list[str]:
    """Lines of the longest backward-branch loop (label .. branch), the kernel's main loop."""
    lines = sass.splitlines()
    best = max(_loops(lines), key=lambda r: r[1] - r[0], default=None)
    return lines[best[0]: best[1] + 1] if best else []


def gmma_loop(sass: str) -> list[str]:
    """Lines of the shortest backward-branch loop holding a wgmma (HGMMA / QGMMA): a GEMM's K loop.

    longest_loop is wrong for kernels whose epilogue has loops of its own (the IEEE-division slow
    paths of the FP8 quantization, say); the K loop is the innermost loop around the MMAs.
    """
    lines = sass.splitlines()
    best = min(((j, i) for j, i in _loops(lines) if any("GMMA." in t for t in lines[j:i])),
               key=lambda r: r[1] - r[0], default=None)
    return lines[best[0]: best[1] + 1] if best else []


def register_usage(kernel, arch: str = "sm_90a") -> tuple[int, int]:
    """(registers per thread, spill-store bytes) of a compiled kernel, from Triton's bundled ptxas -v
    on its PTX (kernel.n_regs / n_spills need a GPU to load the binary)."""
    from triton.backends.nvidia import compiler as nvc

    tool = os.path.join(os.path.dirname(nvc.__file__), "bin", "ptxas")
    with tempfile.NamedTemporaryFile(suffix=".ptx", delete=False, mode="w") as f:
        f.write(kernel.asm["ptx"])
    try:
        err = subprocess.run([tool, "-v", f"-arch={arch}", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    if regs is None or spill is None:
        raise RuntimeError(f"ptxas -v printed no register / spill line:\n{err}")
    return int(regs.group(1)), int(spill.group(1))


def opcode_mix(lines: list[str]) -> collections.Counter:
    """Opcode (with modifiers) -> count over the given SASS lines."""
    mix: collections.Counter = collections.Counter()
    for line in lines:
        m = _OPCODE.match(line)
        if m:
            mix[m.group(1)] += 1
    return mix


def _kv(arg: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (a.strip() for a in arg.split(","))):
        if "=" not in item:
            raise ValueError(f"{item!r}: expected name=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel", help="module:function, e.g. moeflow.kernels.moe_gemm_quant:moe_down_w4_gemv_kernel")
    ap.add_argument("--types", default="", help="name=triton type (*bf16, *u8, fp32, ...) for pointers / floats")
    ap.add_argument("--const", default="", help="name=int constexprs / specialized values")
    ap.add_argument("--div16", default="", help="ints known to be multiples of 16 (comma list)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--sass", default=None, help="write the whole SASS listing here")
    args = ap.parse_args(argv)
    mod, _, name = args.kernel.partition(":")
    fn = getattr(importlib.import_module(mod), name)
    consts = {k: int(v) for k, v in _kv(args.const).items()}
    kernel = compile_kernel(fn, _kv(args.types), consts, arch=args.arch, num_warps=args.warps,
                            num_stages=args.stages, div16=tuple(filter(None, args.div16.split(","))))
    sass = sass_text(kernel)
    if args.sass:
        Path(args.sass).write_text(sass)
    loop = opcode_mix(longest_loop(sass))
    print(f"{name}: {sum(opcode_mix(sass.splitlines()).values())} instructions, "
          f"longest loop {sum(loop.values())}")
    for op, n in loop.most_common(args.top):
        print(f"  {n:5d}  {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
