"""moeflow.kernels.launch: cached launches of compiled Triton kernels without the JIT binder, and the
expert impls' KernelOptions(fast_launch=False), which sends every launch through Triton's JIT instead.

CPU tests drive FastKernel's cache with a stand-in for the compiled kernel and the driver (no
launch happens): which calls hit the cache, and that a hit passes every parameter in signature
order. The GPU test launches real kernels through the fast path and compares with the JIT. The impls
with fast_launch=False: every kernel a launcher uses is handed to the JIT (CPU), the same bits with no
FastKernel launch (an interpreter check, and on the GPU).
"""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1" and __name__ != "__main__":
    pytest.skip("the fast path is off under the interpreter (covered by every interpreter test)",
                allow_module_level=True)
import triton.language as tl  # noqa: E402

from moeflow.experts.options import KernelOptions  # noqa: E402
from moeflow.kernels.launch import FastKernel, _fast_supported  # noqa: E402


@triton.jit(do_not_specialize=["n"])
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SCALE: tl.constexpr = 1):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    tl.store(out_ptr + offs, (alpha * x + y) * SCALE, mask=m)


class _FakeCompiled:
    """Stands in for triton's CompiledKernel: records launcher calls."""

    function = "fn"
    packed_metadata = "meta"

    def __init__(self, tag):
        self.tag, self.calls = tag, []

    def run(self, *a):
        self.calls.append(a)

    def launch_metadata(self, *a):
        return None


class _FakeDriver:
    class active:  # noqa: N801 - mirrors triton.runtime.driver.driver.active
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


def _fake_kernel(monkeypatch):
    if not _fast_supported():
        pytest.skip(f"triton {triton.__version__}: launcher signature not the checked one, fast path off")
    k = FastKernel(_axpy_kernel)
    assert k._fast
    compiled = []

    def fake_run(*args, grid, warmup, **kwargs):
        c = _FakeCompiled((args, tuple(kwargs.items())))
        compiled.append(c)
        return c

    monkeypatch.setattr(k.fn, "run", fake_run)
    k._driver = _FakeDriver
    return k, compiled


def test_cache_hits_pass_every_parameter_in_signature_order(monkeypatch):
    k, compiled = _fake_kernel(monkeypatch)
    x, y, out = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    k[(4,)](x, y, out, 64, 2.0, BLOCK=16, num_warps=4)  # miss: through fn.run
    assert len(compiled) == 1 and compiled[0].calls == []
    k[(4,)](x, y, out, 64, 2.0, BLOCK=16, num_warps=4)  # hit: the launcher, directly
    assert len(compiled) == 1
    (call,) = compiled[0].calls
    # grid, stream, function, metadata, launch metadata, hooks, then all 7 parameters incl. constexprs
    assert call[:4] == (4, 1, 1, 1234) and call[4:6] == ("fn", "meta")
    assert call[9:] == (x, y, out, 64, 2.0, 16, 1), call[9:]
    # a different n of the same specialisation class (both % 16 == 0) hits too
    k[(4,)](x, y, out, 48, 3.0, BLOCK=16, num_warps=4)
    assert len(compiled) == 1 and compiled[0].calls[-1][9:] == (x, y, out, 48, 3.0, 16, 1)


@pytest.mark.parametrize("change", ["block", "num_warps", "misaligned", "dtype", "n_is_1", "n_not_div16",
                                    "n_int64", "alpha_int", "scale_kw"])
def test_a_new_specialisation_misses(monkeypatch, change):
    k, compiled = _fake_kernel(monkeypatch)
    x, y, out = torch.zeros(80), torch.zeros(80), torch.zeros(80)
    base = dict(args=(x, y, out, 64, 2.0), kw=dict(BLOCK=16, num_warps=4))
    k[(4,)](*base["args"], **base["kw"])
    args, kw = list(base["args"]), dict(base["kw"])
    if change == "block":
        kw["BLOCK"] = 32
    elif change == "num_warps":
        kw["num_warps"] = 8
    elif change == "misaligned":
        args[0] = x[1:]  # 4-byte offset: Triton's 16-byte alignment specialisation no longer holds
    elif change == "dtype":
        args[1] = y.double()
    elif change == "n_is_1":
        args[3] = 1
    elif change == "n_not_div16":
        args[3] = 63
    elif change == "n_int64":
        args[3] = 2**32  # i64: Triton compiles another kernel
    elif change == "alpha_int":
        args[4] = 2  # an int where a float was: another signature
    elif change == "scale_kw":
        kw["SCALE"] = 2
    k[(4,)](*args, **kw)
    assert len(compiled) == 2, "a call Triton would specialise differently must not reuse the cached kernel"
    assert compiled[0].calls == []


def test_positional_or_keyword_is_the_same_key(monkeypatch):
    k, compiled = _fake_kernel(monkeypatch)
    x, y, out = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    k[(4,)](x, y, out, 64, 2.0, BLOCK=16)
    k[(4,)](x, y, out, 64, 2.0, 16)
    k[(4,)](x, y, out_ptr=out, n=64, alpha=2.0, BLOCK=16, SCALE=1)
    assert len(compiled) == 1 and len(compiled[0].calls) == 2


def test_keyword_parameters_are_reordered_to_the_signature(monkeypatch):
    k, compiled = _fake_kernel(monkeypatch)
    x, y, out = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        k[(2, 3)](x, y, SCALE=4, out_ptr=out, alpha=0.5, n=17, BLOCK=32)
    (call,) = compiled[0].calls
    assert call[:3] == (2, 3, 1)
    assert call[9:] == (x, y, out, 17, 0.5, 32, 4)


def test_a_launch_hook_sends_launches_through_the_jit(monkeypatch):
    from triton import knobs

    k, compiled = _fake_kernel(monkeypatch)
    x = torch.zeros(64)
    k[(1,)](x, x, x, 64, 1.0, BLOCK=16)
    seen = []
    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip(f"triton {triton.__version__}: no HookChain")
    hook.add(seen.append)
    try:
        k[(1,)](x, x, x, 64, 1.0, BLOCK=16)
    finally:
        hook.remove(seen.append)
    assert len(compiled) == 2 and compiled[0].calls == [], "with a hook registered the JIT must launch"
    k[(1,)](x, x, x, 64, 1.0, BLOCK=16)
    assert len(compiled) == 2 and len(compiled[0].calls) == 1, "hook gone: the cached kernel again"


def test_unhashable_or_callable_grid_goes_through_the_jit(monkeypatch):
    k, compiled = _fake_kernel(monkeypatch)
    x = torch.zeros(64)
    for _ in range(2):
        k[(1,)](x, x, x, 64, [1.0], BLOCK=16)  # a list is unhashable: no key
    assert len(compiled) == 2 and all(c.calls == [] for c in compiled)
    assert k[lambda meta: (1,)] is not None  # callable grid: the JIT's own launcher object


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fast_launches_match_the_jit():
    k = FastKernel(_axpy_kernel)
    assert k._fast, "the fast path must be on for the Triton installed on the GPU machine"
    base = torch.randn(4096 + 8, device="cuda")
    y = torch.randn(4096 + 8, device="cuda")
    for n, off, block, scale in [(4096, 0, 256, 1), (4096, 1, 256, 1), (4000, 0, 128, 2), (1, 0, 128, 1),
                                 (4096, 0, 256, 1), (4000, 3, 128, 2), (1, 0, 128, 1)]:
        x = base[off: off + n]
        out_fast, out_jit = torch.full_like(y, 7.0), torch.full_like(y, 7.0)
        grid = (triton.cdiv(n, block),)
        for _ in range(2):  # the second call is a cache hit
            k[grid](x, y, out_fast, n, 1.5, BLOCK=block, SCALE=scale)
        _axpy_kernel[grid](x, y, out_jit, n, 1.5, BLOCK=block, SCALE=scale)
        torch.cuda.synchronize()
        assert torch.equal(out_fast, out_jit), (n, off, block, scale)
        # against torch: the kernel may fuse alpha * x + y into one FMA, so not bitwise
        torch.testing.assert_close(out_fast[:n], (1.5 * x + y[:n]) * scale, rtol=1e-6, atol=1e-6)
    # 5 distinct keys: (aligned, 256, n%16), (misaligned), (128, scale 2, n%16==0 also for 4000), (n == 1),
    # (misaligned 4000): repeats hit
    assert len(k._cache) == 5, sorted(map(str, k._cache))


# --------------------------------------------------------------------------- the impls' fast_launch option
# The Triton kernels the expert launchers (moeflow.experts.fused) launch, by module.
LAUNCHED_KERNELS = {
    "moe_gemm": ("moe_gate_up_kernel", "moe_down_kernel", "moe_combine_kernel"),
    "moe_gemm_tma": ("moe_gate_up_tma_kernel", "moe_down_tma_kernel", "gather_rows_kernel"),
    "moe_gemm_fp8_tma": ("moe_gate_up_fp8_tma_kernel", "moe_down_fp8_tma_kernel"),
    "moe_gemm_quant": ("fp8_quant_rows_kernel", "moe_gate_up_fp8_kernel", "moe_down_fp8_kernel",
                       "moe_gate_up_w4_kernel", "moe_down_w4_kernel", "moe_gate_up_w4_gemv_kernel",
                       "moe_down_w4_gemv_kernel"),
}


def test_fast_launch_off_hands_every_kernel_to_the_jit():
    """With KernelOptions(fast_launch=False) the launchers launch each kernel through Triton's JIT (a
    JITFunction, whose `[grid]` binds the arguments on every call), with the default through the kernel as
    defined (a FastKernel where the module wraps it). Pure Python: nothing is launched."""
    import importlib

    from triton.runtime.jit import JITFunction

    from moeflow.experts.fused import _k
    from moeflow.experts.plan import NAMED_DEVICES, StepShape, plan_step

    s = StepShape(fmt="plain", dtype="float32", num_experts=4, tiling_experts=4, hidden_size=64,
                  intermediate_size=64, top_k=2, tokens=3, pairs=6)
    on = plan_step(s, NAMED_DEVICES["cpu"])
    off = plan_step(s, NAMED_DEVICES["cpu"], options=KernelOptions(fast_launch=False))
    wrong = []
    for mod, names in LAUNCHED_KERNELS.items():
        m = importlib.import_module(f"moeflow.kernels.{mod}")
        for name in names:
            kernel = getattr(m, name)
            assert _k(kernel, on) is kernel
            got = _k(kernel, off)
            if not isinstance(got, JITFunction):
                wrong.append(f"{mod}.{name}: {type(got).__name__}")
    assert not wrong, wrong


def _impl_cases(device: str):
    """[(what, make_impl(options), forward(impl))]: bf16 / f32 pointer and TMA kernels, fp8 pointer and TMA
    kernels, FP4 GEMV path and MMA tiles, each at a small shape (forced tiles on the interpreter's bf16 / f32 and
    fp8 cases, where the TMA kernels need them)."""
    import dataclasses

    from test_experts_triton import _tiny_tiles, make_case
    from test_experts_triton import make_tokens as tokens_plain
    from test_experts_triton_quant import make_quant_case
    from test_experts_triton_quant import make_tokens as tokens_quant

    from moeflow.experts.triton import TritonExperts
    from moeflow.experts.triton_quant import TritonQuantExperts
    from moeflow.tuning import GemmTile, MoETileConfig
    from moeflow.tuning.rules import load_rules

    cpu = device == "cpu"
    cases = []
    dt = torch.float32 if cpu else torch.bfloat16
    cfg, w = make_case(4, 64, 64, 2, "silu", dtype=dt, device=device)
    x, ids, wts = tokens_plain(37, 64, 4, 2, dt, device, seed=3)
    for tma in (False, True):
        tiles = _tiny_tiles(1) if cpu else None
        cases.append((f"{dt} tma={tma}",
                      lambda o, tiles=tiles, tma=tma: TritonExperts(allow_cpu=cpu, tile_config=tiles,
                                                                    options=dataclasses.replace(o, tma=tma)),
                      lambda m, x=x, ids=ids, wts=wts, w=w, cfg=cfg: m.forward_tokens(x, ids, wts, w, cfg)))
    adt = torch.float16 if cpu else torch.bfloat16
    cfg8, w8 = make_quant_case("fp8_b32", 3, 64, 64, 2, "silu", device=device)
    x8, ids8, wts8 = tokens_quant(37, 64, 3, 2, adt, device, seed=3)
    t32 = GemmTile(block_n=32, block_k=32, num_stages=1)
    for tma in (False, True):
        cases.append((f"fp8 tma={tma}",
                      lambda o, tma=tma: TritonQuantExperts(allow_cpu=cpu, tile_config=MoETileConfig(
                          block_m=64, gate_up=t32, down=t32), options=dataclasses.replace(o, tma=tma)),
                      lambda m: m.forward_tokens(x8, ids8, wts8, w8, cfg8)))
    cfg4, w4 = make_quant_case("mxfp4", 3, 64, 96, 2, "silu", device=device)
    # few pairs: the GEMV path; more than the rule's bound: the MMA tiles
    for T in (5, load_rules().fp4_gemv_max_pairs // 2 + 1):
        x4, ids4, wts4 = tokens_quant(T, 64, 3, 2, adt, device, seed=4)
        cases.append((f"mxfp4 T={T}", lambda o: TritonQuantExperts(allow_cpu=cpu, options=o),
                      lambda m, x4=x4, ids4=ids4, wts4=wts4: m.forward_tokens(x4, ids4, wts4, w4, cfg4)))
    return cases


def check_impls_fast_launch_off(device: str) -> None:
    """KernelOptions(fast_launch=False) gives the default's bits and launches nothing through FastKernel (the
    default does), for every case of _impl_cases."""
    from moeflow.testing import assert_bitwise_equal

    launches = []
    orig = FastKernel.__getitem__

    def counted(self, grid):
        launches.append(self.fn)
        return orig(self, grid)

    with mock.patch.object(FastKernel, "__getitem__", counted):
        for what, make, forward in _impl_cases(device):
            launches.clear()
            want = forward(make(KernelOptions()))
            assert launches, f"{what}: the default launched nothing through FastKernel"
            launches.clear()
            got = forward(make(KernelOptions(fast_launch=False)))
            assert not launches, f"{what}: fast_launch=False launched {len(launches)} kernels through FastKernel"
            assert_bitwise_equal(got, want, what=f"{what}: fast_launch=False vs the default")
            print(f"{what}: fast_launch=False, the same bits")


def test_impls_fast_launch_off_in_the_interpreter():
    from moeflow.testing import run_interpreter_check

    run_interpreter_check(__file__, "impls")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_impls_fast_launch_off():
    check_impls_fast_launch_off("cuda")


if __name__ == "__main__":
    if sys.argv[1:] != ["impls"]:
        raise SystemExit("usage: TRITON_INTERPRET=1 python tests/test_fast_launch.py impls")
    from moeflow.testing import patch_interpreter_index

    patch_interpreter_index()
    check_impls_fast_launch_off("cpu")
    print("PASS impls")
