"""Test helpers shared by moeflow's tests and benchmarks (never imported by library code).

`assert_close` reports max-abs and RMS error on failure; `assert_bitwise_equal`
compares bit patterns, so -0.0 vs 0.0 and NaN payloads count as different.
"""

from __future__ import annotations

import torch


def error_stats(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, float]:
    """(max_abs, rms, max_rel) of actual - expected, computed in float64."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    d = (a - e).abs()
    if d.numel() == 0:
        return 0.0, 0.0, 0.0
    max_abs = float(d.max())
    rms = float(d.pow(2).mean().sqrt())
    max_rel = float((d / e.abs().clamp_min(1e-30)).max())
    return max_abs, rms, max_rel


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, what: str = "tensor"
) -> None:
    """Elementwise |a - e| <= atol + rtol * |e|; on failure print max-abs and RMS error."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if torch.isnan(a).any() or torch.isnan(e).any():
        same_nan = torch.equal(torch.isnan(a), torch.isnan(e))
        if not same_nan:
            raise AssertionError(f"{what}: NaN pattern differs ({int(torch.isnan(a).sum())} vs {int(torch.isnan(e).sum())})")
        keep = ~torch.isnan(e)
        a, e = a[keep], e[keep]
    bad = (a - e).abs() > atol + rtol * e.abs()
    if bad.any():
        max_abs, rms, max_rel = error_stats(a, e)
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} elements outside rtol={rtol} atol={atol}; "
            f"max_abs={max_abs:.3e} rms={rms:.3e} max_rel={max_rel:.3e}; first bad index {first}"
        )


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str = "tensor") -> None:
    """Bit-for-bit equality (same dtype, shape and bits)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: dtype/shape {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
        )
    if actual.dtype.is_floating_point:
        int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
        a = actual.detach().contiguous().view(int_dtype)
        e = expected.detach().contiguous().view(int_dtype)
    else:
        a, e = actual, expected
    if not torch.equal(a.cpu(), e.cpu()):
        diff = (a != e).nonzero()
        first = tuple(int(i) for i in diff[0])
        max_abs, rms, _ = error_stats(actual, expected)
        raise AssertionError(
            f"{what}: {diff.shape[0]} elements differ bitwise; first at {first}; max_abs={max_abs:.3e} rms={rms:.3e}"
        )


def capture_cuda_graph(fn):
    """(graph, out): fn() run once on a side stream (compiles and allocates off the capture), then
    captured into a CUDA graph whose replays write `out` (what the captured fn() returned). CUDA only."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def poisoned_like(t: torch.Tensor, pad_rows: int) -> torch.Tensor:
    """A copy of `t` [R, ...] followed by `pad_rows` NaN rows: padding a kernel must never read."""
    pad = torch.full((pad_rows, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=0)


def patch_interpreter_numerics() -> None:
    """Triton's interpreter only (tests, dry runs): make Triton 3.6's interpreter compute what the GPU does.

    - tl.dot on bfloat16 operands: the interpreter stores bf16 as uint16 and multiplies those raw bit
      patterns (np.matmul of the integers: results ~1e10 off). bf16 operands are decoded to f32 first
      (exact), as the GPU's bf16 MMA reads them.
    - f32 -> bf16 casts: the interpreter truncates (round toward zero: twice the GPU's rounding error,
      biased); torch's round to nearest even (the GPU's cvt.rn.bf16.f32) stands in.
    - f32 -> float8e4nv: the interpreter rounds by its cut-off bit alone (a mantissa carry corrupts the
      exponent); torch's round-to-nearest-even conversion (the GPU's cvt.rn) stands in.
    Other dtypes are untouched. Idempotent.
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_moeflow_patched", False):
        return
    orig_dot, orig_cast, orig_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, as_f32(a), as_f32(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar == tl.float32:
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn)
            return interp.TensorHandle(data.view(torch.uint8).numpy(), tl.float8e4nv)
        return orig_fp(self, src, dst_type, rounding_mode)

    for name, fn in (("create_dot", create_dot), ("cast_impl", cast_impl), ("create_fp_to_fp", fp_to_fp)):
        fn._moeflow_patched = True
        setattr(builder, name, fn)


def patch_interpreter_index() -> None:
    """Triton's interpreter only (tests, dry runs): numpy >= 2.4 refuses int() of a 1-element 1-D
    array, which Triton 3.6's interpreter does for loop bounds taken from kernel arguments; take
    the single element instead. Every interpreter entry point calls this, so it also applies
    patch_interpreter_numerics. Idempotent."""
    import triton.runtime.interpreter as interp

    patch_interpreter_numerics()
    orig = interp._patch_lang_tensor
    if getattr(orig, "_moeflow_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._moeflow_patched = True
    interp._patch_lang_tensor = patched


def run_interpreter_check(script: str, check: str, *, timeout: float = 900) -> None:
    """Run `python script check` under the Triton interpreter in a subprocess; assert it printed "PASS check".

    A subprocess, so the calling process never imports Triton in interpreter mode. The repo
    root (the script's parent's parent) goes first on PYTHONPATH and the caller's PYTHONPATH
    stays after it (where a CPU build of Triton may live); CUDA is hidden.
    """
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(script).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, script, check], cwd=root, capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, f"interpreter check {check!r} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert f"PASS {check}" in proc.stdout, proc.stdout


def cuda_scalar_division():
    """A context manager under which CPU tensors divide by Python numbers as PyTorch does on CUDA.

    PyTorch's CUDA `tensor / python_scalar` (div, true_divide, `/`) multiplies by the reciprocal
    rounded to the compute type (a * fl(1 / b)) where the CPU divides; the last bit differs for
    about half the values. Code that must give the same numbers on every device (quantization
    scales: moeflow.quant.formats.div_by_const) is checked on the CPU under this mode. Tensor /
    tensor divisions are untouched (IEEE on both devices).
    """
    import numbers

    from torch.overrides import TorchFunctionMode

    divs = {torch.Tensor.__truediv__, torch.Tensor.div, torch.Tensor.true_divide, torch.div, torch.true_divide,
            torch.divide, torch.Tensor.divide}

    class _CudaScalarDivision(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func in divs and len(args) == 2 and kwargs.get("rounding_mode") is None
                    and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
                    and isinstance(args[1], numbers.Real) and not isinstance(args[1], bool)):
                a = args[0]
                opmath = torch.float64 if a.dtype == torch.float64 else torch.float32
                return (a.to(opmath) * torch.tensor(1.0 / float(args[1]), dtype=opmath)).to(a.dtype)
            return func(*args, **kwargs)

    return _CudaScalarDivision()
