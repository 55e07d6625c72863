"""Launch compiled Triton kernels without the JIT's per-call binding (host time per launch).

Why: a patched model's prefill on small-expert shapes (qwen3-30b-a3b) is host-bound
(benchmarks/RESULTS.md, 2026-12-03), and Triton's `JITFunction.run` was ~43% of a layer step's
host time under cProfile: per call it binds the arguments, specialises each one, builds a cache
key, looks the kernel up, checks globals and builds launch metadata, before the C launcher runs.

`fast_kernel(fn)` wraps a `@triton.jit` function; `k[grid](*args, **kwargs)` means exactly what
`fn[grid](*args, **kwargs)` means. The first call with a new key goes through `fn.run` (which
compiles if needed and launches) and keeps the compiled kernel; later calls with that key call
its launcher directly.

The key is the device, how the arguments were passed (count of positional ones, keyword names
in order) and, per argument: constexpr parameters and launch options (num_warps, ...) by value;
tensors by (dtype, 16-byte alignment of data_ptr); anything else by Triton's own specialisation
of it (`native_specialize_impl` with specialisation and alignment on: int width class, == 1,
% 16). That is at least as fine as the key the JIT computes (it may be finer where a parameter
is `do_not_specialize`), so a cached kernel is always the one the JIT would have launched.

Where the fast path does not apply, calls go to `fn[grid]` unchanged: MOEFLOW_FAST_LAUNCH=0
(or `moeflow.kernels.launch.ENABLED = False`), the Triton interpreter
(TRITON_INTERPRET=1), a Triton whose launcher signature is not the one checked here, a
callable grid, a kernel with pre-run hooks, or an argument type without a known key.
Not honoured after a key's first call: TRITON_DEBUG / instrumentation knobs changed at run
time, and a module global read by a kernel changing after compilation (the JIT raises there;
moeflow's kernels read no mutable globals).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

# MOEFLOW_FAST_LAUNCH=0 sends every launch through the JIT (A/B measurements, debugging);
# read at each launch, so a process may also flip it.
ENABLED = os.environ.get("MOEFLOW_FAST_LAUNCH", "1") != "0"
_FAST_OK: bool | None = None  # whether this Triton's JITFunction.run / launcher match (checked once)


def _fast_supported() -> bool:
    """True when Triton's JITFunction.run has the 3.4-3.6 shape this module relies on."""
    global _FAST_OK
    if _FAST_OK is None:
        try:
            from triton.runtime.jit import JITFunction

            src = inspect.getsource(JITFunction.run)
            _FAST_OK = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata"
                        in src and "*bound_args.values()" in src)
        except Exception:  # noqa: BLE001 - any surprise means: use the JIT path
            _FAST_OK = False
    return _FAST_OK


class FastKernel:
    """A `@triton.jit` function whose repeated launches skip the JIT's binder (see module doc).

    `kernel[grid](*args, **kwargs)` launches like the wrapped function; other attributes
    (`fn`, `warmup`, `cache`, ...) are the wrapped JITFunction's.
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self._cache: dict[tuple, tuple] = {}
        self._fast = False
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        if not isinstance(fn, JITFunction) or not _fast_supported():
            return  # the interpreter's InterpretedFunction, or an unknown Triton: plain launches
        import torch
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.driver import driver

        self._fast = True
        self._tensor = torch.Tensor
        self._spec = native_specialize_impl
        self._backend = CUDABackend
        self._driver = driver
        params = fn.params
        self._names = [p.name for p in params]
        self._constexpr_pos = tuple(p.is_constexpr for p in params)
        self._constexpr_kw = {p.name: p.is_constexpr for p in params}
        self._defaults = [p.default for p in params]
        from triton import knobs

        self._knobs = knobs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["fn"], name)

    def __getitem__(self, grid):
        if not (self._fast and ENABLED) or callable(grid) or self.fn.pre_run_hooks:
            return self.fn[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _arg_key(self, v: Any, by_value: bool):
        if by_value:
            return v
        if isinstance(v, self._tensor):
            return (v.dtype, v.data_ptr() & 15 == 0)
        return self._spec(self._backend, v, False, True, True)

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        """fn[grid](*args, **kwargs), through the cached compiled kernel when the key was seen."""
        cx_pos, cx_kw = self._constexpr_pos, self._constexpr_kw
        try:
            key = (
                self._driver.active.get_current_device(),
                len(args),
                tuple(kwargs),
                tuple([self._arg_key(v, cx_pos[i]) for i, v in enumerate(args)]),
                tuple([self._arg_key(v, cx_kw.get(k, True)) for k, v in kwargs.items()]),
            )
            entry = self._cache.get(key)
        except TypeError:  # an unhashable argument (a list, ...): no key, the JIT decides
            entry, key = None, None
        if entry is None:
            kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
            if key is not None and kernel is not None and not hasattr(kernel, "result"):
                self._cache[key] = (kernel, self._order(len(args), tuple(kwargs)))
            return
        kernel, order = entry
        vals = args + tuple(kwargs.values())
        full = vals if order is None else [vals[j] if j >= 0 else self._defaults[i] for i, j in enumerate(order)]
        device = key[0]
        stream = self._driver.active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        knobs = self._knobs.runtime
        enter = knobs.launch_enter_hook
        meta = None if enter is None else kernel.launch_metadata(grid, stream, *full)
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter,
                   knobs.launch_exit_hook, *full)

    def _order(self, n_pos: int, kw_names: tuple) -> list[int] | None:
        """Index into (args + kwargs values) of each parameter in signature order (-1: default).

        None when the call already passes every parameter in signature order (the common case).
        Options (num_warps, ...) are kwargs that are not parameters and are dropped.
        """
        where = {name: i for i, name in enumerate(self._names[:n_pos])}
        for j, k in enumerate(kw_names):
            if k in self._constexpr_kw:
                where[k] = n_pos + j
        order = [where.get(name, -1) for name in self._names]
        n_vals = n_pos + len(kw_names)
        if order == list(range(len(self._names))) and n_vals == len(self._names):
            return None
        return order


def fast_kernel(fn: Any) -> FastKernel:
    """Wrap a `@triton.jit` function for launches without the JIT binder (module doc)."""
    return FastKernel(fn)
