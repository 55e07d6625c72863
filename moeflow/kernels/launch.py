"""Launch compiled Triton kernels without the JIT's per-call binding (host time per launch).

Why: a patched model's prefill on small-expert shapes (qwen3-30b-a3b) is host-bound
(cProfile of a layer step: `python -m cProfile benchmarks/bench_e2e.py ...`), and Triton's `JITFunction.run` was ~43% of a layer step's
host time under cProfile: per call it binds the arguments, specialises each one, builds a cache
key, looks the kernel up, checks globals and builds launch metadata, before the C launcher runs.

`fast_kernel(fn)` wraps a `@triton.jit` function; `k[grid](*args, **kwargs)` means exactly what
`fn[grid](*args, **kwargs)` means. The first call with a new key goes through `fn.run` (which
compiles if needed and launches) and keeps the compiled kernel; later calls with that key call
its launcher directly.

Each wrapped kernel gets a runner compiled for its signature (`_generate_runner`), so Python
binds the arguments (positional or keyword, defaults filled) and the key is one tuple expression:
the device; constexpr parameters and launch options (num_warps, ...) by value; tensors by dtype
and 16-byte alignment of data_ptr; int32-range ints by (== 1, % 16 == 0); anything else (wider
ints, floats, bools, None, Tensor subclasses) by Triton's own specialisation of it
(`native_specialize_impl` with specialisation and alignment on). That is at least as fine as the
key the JIT computes (finer where a parameter is `do_not_specialize`), so a cached kernel is
always the one the JIT would have launched.

Where the fast path does not apply, calls go to `fn[grid]` unchanged: the Triton interpreter
(TRITON_INTERPRET=1), a Triton whose launcher signature is not the one checked here, a
callable grid, a kernel with pre-run hooks or a parameter named with a leading underscore, a
registered Triton launch hook (proton and other profilers), or an unhashable argument.
Not honoured after a key's first call: TRITON_DEBUG / instrumentation knobs changed at run
time, and a module global read by a kernel changing after compilation (the JIT raises there;
moeflow's kernels read no mutable globals).
"""

from __future__ import annotations

import inspect
from functools import lru_cache, partial
from typing import Any


@lru_cache(maxsize=1)
def _fast_supported() -> bool:
    """True when Triton's JITFunction.run has the 3.4-3.6 shape this module relies on (checked once)."""
    try:
        from triton.runtime.jit import JITFunction

        src = inspect.getsource(JITFunction.run)
        return ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata"
                in src and "*bound_args.values()" in src)
    except Exception:  # noqa: BLE001 - any surprise means: use the JIT path
        return False


class FastKernel:
    """A `@triton.jit` function whose repeated launches skip the JIT's binder (see module doc).

    `kernel[grid](*args, **kwargs)` launches like the wrapped function; other attributes
    (`fn`, `warmup`, `cache`, ...) are the wrapped JITFunction's.
    """

    def __init__(self, fn: Any):
        self.fn = fn
        self._cache: dict[tuple, Any] = {}
        self._fast = False
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        if not isinstance(fn, JITFunction) or not _fast_supported():
            return  # the interpreter's InterpretedFunction, or an unknown Triton: plain launches
        from triton.runtime.driver import driver

        self._driver = driver
        self._run = _generate_runner(self)
        self._fast = self._run is not None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["fn"], name)

    def __getitem__(self, grid):
        if not self._fast or callable(grid) or self.fn.pre_run_hooks:
            return self.fn[grid]
        return partial(self._run, grid)

    def _miss(self, grid: tuple, key: tuple | None, args: tuple, options: dict) -> None:
        """First launch of a key (or an unhashable one): Triton's JIT compiles if needed and launches."""
        kernel = self.fn.run(*args, grid=grid, warmup=False, **options)
        if key is not None and kernel is not None and not hasattr(kernel, "result"):
            self._cache[key] = kernel


# Key of one runtime argument, inlined per parameter by _generate_runner (no call per argument),
# as fine as Triton's specialisation of it: a torch.Tensor by dtype and 16-byte alignment (the
# dtype itself when aligned, else a 1-tuple of it); an int in int32 range by "one" when == 1, else
# whether it is % 16 == 0 (a bool); anything else (larger ints, bool, float, None, a Tensor
# subclass, ...) by Triton's own specialisation tuple. The forms never compare equal to each other.
_ARG_KEY = (
    "(({p}.dtype if ({p}.data_ptr() & 15) == 0 else ({p}.dtype,)) if {p}.__class__ is _Tensor else "
    "(('one' if {p} == 1 else ({p} & 15) == 0) if {p}.__class__ is int and -2147483648 <= {p} <= 2147483647 "
    "else _spec(_backend, {p}, False, True, True)))"
)


def _generate_runner(k: FastKernel):
    """Compile `run(grid, <the kernel's parameters>, **options)` for one kernel (module doc).

    Python binds the call's arguments to the signature (positional or keyword, defaults filled),
    so the key and the launcher's argument list need no per-argument Python loop. Launch hooks:
    Triton 3.6 keeps an empty HookChain in knobs.runtime.launch_enter_hook (its JIT then builds
    launch metadata on every launch); a hook that would run sends the launch through the JIT.
    """
    import torch
    from triton import knobs
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    params = k.fn.params
    names = [prm.name for prm in params]  # callers pass constexprs (and some others) by name
    sig, defaults = [], {}
    for i, (n, prm) in enumerate(zip(names, params)):
        if prm.default is inspect.Parameter.empty:
            sig.append(n)
        else:
            sig.append(f"{n}=_d{i}")
            defaults[f"_d{i}"] = prm.default
    keys = [n if prm.is_constexpr else _ARG_KEY.format(p=n) for n, prm in zip(names, params)]
    args = ", ".join(names)
    src = f"""
def _run(_grid, {", ".join(sig)}, **_options):
    _rt = _knobs.runtime
    _drv = _k._driver.active
    _device = _drv.get_current_device()
    try:
        _key = (_device, ({", ".join(keys)},), tuple(_options.items()) if _options else ())
        _kernel = _cache.get(_key)
    except TypeError:  # an unhashable argument: no key, the JIT decides every time
        _key = _kernel = None
    _eh, _xh = _rt.launch_enter_hook, _rt.launch_exit_hook
    if (_kernel is None or (_eh is not None and (_eh.__class__ is not _HookChain or _eh.calls))
            or (_xh is not None and (_xh.__class__ is not _HookChain or _xh.calls))):
        return _k._miss(_grid, _key if _kernel is None else None, ({args},), _options)
    _n = len(_grid)
    _kernel.run(_grid[0], _grid[1] if _n > 1 else 1, _grid[2] if _n > 2 else 1, _drv.get_current_stream(_device),
                _kernel.function, _kernel.packed_metadata, None, None, None, {args})
"""
    if any(n.startswith("_") for n in names):
        return None  # a parameter name could collide with the runner's own names: plain launches
    ns = dict(_k=k, _cache=k._cache, _knobs=knobs, _HookChain=getattr(knobs, "HookChain", ()), _Tensor=torch.Tensor, _spec=native_specialize_impl,
              _backend=CUDABackend, **defaults)
    exec(compile(src, f"<moeflow FastKernel {k.fn.__name__}>", "exec"), ns)  # noqa: S102
    return ns["_run"]


def fast_kernel(fn: Any) -> FastKernel:
    """Wrap a `@triton.jit` function for launches without the JIT binder (module doc)."""
    return FastKernel(fn)
