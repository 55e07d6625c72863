"""CPU execution of missed experts (OffloadConfig.cpu_experts): outputs, the cost model, counters, errors.

Legend: L layers, H hidden, E routed experts, K picks per token, S slots, T tokens.

The models are tests/test_offload_model.py's residual stacks (one per family). With the
cache on the CPU, "always" runs every miss from the store's host tensors with the step's
own experts impl: the outputs equal the resident model bit for bit (the contract in
docs/offload.md). A different CPU impl (cpu_impl) agrees within the stated f32 tolerance.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from moeflow.experts.reference import ReferenceExperts
from moeflow.experts.select import get_impl
from moeflow.offload.attach import attach_offload
from moeflow.offload.config import CPU_EXPERTS, OffloadConfig
from moeflow.offload.cpu_experts import (
    ReuseEstimate,
    choose_cpu_experts,
    cpu_wins,
    host_expert_weights,
    measure_bandwidths,
)
from moeflow.offload.store import ExpertStore
from moeflow.parallel.local import combine_TH, dispatch_rows, local_dispatch, unpermute_TKH
from moeflow.testing import assert_bitwise_equal
from tests.test_offload_model import FAMILIES, L, ShapeSensitiveExperts, _inputs, _model, _run

# The tolerances stated in docs/offload.md for CPU rows computed by another impl than the
# GPU's, per layer output given the same input.
F32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _pair(family: str, impl: object = "auto", seed: int = 0):
    ref = _model(family, seed)
    for m in ref:
        m.experts_impl = impl
    return ref, copy.deepcopy(ref)


def _check_counts(rt) -> None:
    s, c = rt.stats(), rt.cpu_stats()
    assert s.hits + s.misses + c.cpu_experts == c.demand_keys
    assert c.bytes_not_copied == c.cpu_experts * rt.store.expert_bytes
    assert c.cpu_rows >= c.cpu_experts and c.cpu_steps <= s.steps
    rt.cache.table.check_invariants()


@pytest.mark.parametrize("family", FAMILIES)
def test_off_is_bitwise_resident_and_runs_nothing_on_cpu(family):
    ref, off = _pair(family)
    K = ref[0].config.top_k
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=max(K, 4), device="cpu", cpu_experts="off"),
                        progress=False)
    seq, prefill = _inputs(1)
    for x in [*seq, prefill]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} off")
    c = rt.cpu_stats()
    assert c.cpu_experts == 0 and c.bytes_not_copied == 0 and c.demand_keys > 0
    _check_counts(rt)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["auto", "reference", "grouped"])
def test_always_on_a_cpu_cache_is_bitwise_resident(family, impl):
    # prefetch_width=3 puts some experts in the cache: steps mix cache and CPU experts
    ref, off = _pair(family, impl)
    K = ref[0].config.top_k
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=max(K, 4), prefetch_width=3,
                                                 prefetch_rule="always", device="cpu",
                                                 cpu_experts="always"), progress=False)
    seq, prefill = _inputs(1)
    for x in [*seq, prefill]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} {impl} always")
    s, c = rt.stats(), rt.cpu_stats()
    assert s.misses == 0, "always: no miss is copied on demand"
    assert c.cpu_experts > 0 and s.hits > 0, "both paths ran"
    _check_counts(rt)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots", [None, 8])
def test_always_runs_the_resident_call_shape(family, slots):
    # The CPU experts and the cached ones each run in calls of the step's N rows (the resident
    # call's shape): an impl whose bits follow the call's shape gives the resident bits.
    # slots=8: a step's cached experts can fill every slot (the CPU rows then need a spare).
    ref, off = _pair(family)
    K = ref[0].config.top_k
    impl_ref, impl_off = ShapeSensitiveExperts(), ShapeSensitiveExperts()
    for a, b in zip(ref, off):
        a.experts_impl, b.experts_impl = impl_ref, impl_off
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=slots or max(K, 4), prefetch_width=3,
                                                 prefetch_rule="always", device="cpu",
                                                 cpu_experts="always"), progress=False)
    seq, prefill = _inputs(5, n_decode=4, n_prefill=7)
    for x in [*seq, prefill]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} always, T={x.shape[0]}")
    assert {n for n, _ in impl_off.calls} == {n for n, _ in impl_ref.calls}, "each call has the resident N"
    assert rt.cpu_stats().cpu_experts > 0 and rt.stats().hits > 0
    _check_counts(rt)


@pytest.mark.parametrize("family", FAMILIES)
def test_always_with_another_cpu_impl_is_within_tolerance(family):
    # The GPU part runs grouped, the CPU rows run reference (what a CUDA cache does): the
    # accumulation orders differ, the outputs agree within the stated f32 tolerance.
    ref, off = _pair(family, "grouped")
    K = ref[0].config.top_k
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=max(K, 4), prefetch_width=3,
                                                 prefetch_rule="always", device="cpu",
                                                 cpu_experts="always"), progress=False)
    rt.cpu_impl = get_impl("reference")
    seq, prefill = _inputs(2)
    for x in [*seq, prefill]:
        _layers_close(off, ref, x, **F32_TOL)
    assert rt.cpu_stats().cpu_experts > 0
    _check_counts(rt)


def _layers_close(off, ref, x, *, atol: float, rtol: float) -> None:
    """Each layer's output within the tolerance of the resident layer's, given the same input.

    Per layer, not over the stack: arithmetic that is not bit-identical may flip a later
    layer's near-tied routing pick, which no elementwise tolerance bounds.
    """
    for i, (a, b) in enumerate(zip(off, ref)):
        y = b(x)
        torch.testing.assert_close(a(x), y, atol=atol, rtol=rtol, msg=lambda m, i=i: f"layer {i}: {m}")
        x = x + y


class _FusedReference(ReferenceExperts):
    """A CPU impl with forward_tokens (dispatch + reference + combine), so layers hand out TokenBatches."""

    name = "fused_reference"

    def forward_tokens(self, x_TH, ids_TK, weights_TK, w, config):
        d = local_dispatch(ids_TK, w.num_experts)
        on_input = config.router.weight_on_input
        x_NH = dispatch_rows(x_TH, d)
        if on_input:
            x_NH = x_NH * weights_TK.reshape(-1).index_select(0, d.order_N).to(x_NH.dtype).unsqueeze(1)
        y_NH = self.forward_pairs(x_NH, d.expert_N, w, config)
        return combine_TH(unpermute_TKH(y_NH, d), weights_TK, weight_on_input=on_input, out_dtype=x_TH.dtype)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss", "llama4"])
def test_always_with_a_fused_token_batch_is_bitwise_resident(family):
    # A fused TokenBatch is run as pairs in a step with CPU experts (the host ids give the
    # pair order: no second read), then combined in slot order.
    impl = _FusedReference()
    ref, off = _pair(family, impl)
    K = ref[0].config.top_k
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=max(K, 4), prefetch_width=3,
                                                 prefetch_rule="always", device="cpu",
                                                 cpu_experts="always"), progress=False)
    seq, prefill = _inputs(3)
    for x in [*seq, prefill]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} fused always")
    assert rt.cpu_stats().cpu_experts > 0
    _check_counts(rt)


def test_cost_model_decision():
    # slow PCIe, no reuse: the CPU; the same bandwidths with high reuse: the copy
    assert cpu_wins(1, cpu_Bps=50e9, pcie_Bps=6.7e9, reuse=0.5)
    assert not cpu_wins(1, cpu_Bps=50e9, pcie_Bps=6.7e9, reuse=9.0)
    # fast pinned PCIe beats a CPU GEMV at any reuse
    assert not cpu_wins(1, cpu_Bps=50e9, pcie_Bps=54.8e9, reuse=0.0)
    # more rows cost the CPU more (each a GEMV), the copy the same
    assert cpu_wins(2, cpu_Bps=40e9, pcie_Bps=10e9, reuse=0.0)
    assert not cpu_wins(4, cpu_Bps=40e9, pcie_Bps=10e9, reuse=0.0)
    assert not cpu_wins(0, cpu_Bps=40e9, pcie_Bps=10e9, reuse=0.0)
    # the boundary: B_cpu > (1 + r) * n * B_pcie, strictly
    assert not cpu_wins(1, cpu_Bps=20e9, pcie_Bps=10e9, reuse=1.0)
    assert cpu_wins(1, cpu_Bps=20.1e9, pcie_Bps=10e9, reuse=1.0)
    assert not cpu_wins(1, cpu_Bps=1e12, pcie_Bps=1e9, reuse=math.inf)
    assert choose_cpu_experts({3: 1, 5: 8, 7: 2}, cpu_Bps=30e9, pcie_Bps=10e9, reuse=0.2) == {3, 7}


def test_reuse_estimate():
    r = ReuseEstimate(alpha=0.5)
    assert r.reuse == 0.0, "no statistics yet"
    r.update(hits=3, loads=1)
    assert r.reuse == pytest.approx(3.0)
    for _ in range(40):
        r.update(hits=2, loads=0)  # hits without copies: r grows, so copies resume
    assert r.reuse > 1e6
    r2 = ReuseEstimate(alpha=1.0)
    r2.update(hits=0, loads=0)
    r2.update(hits=1, loads=0)
    assert r2.reuse == math.inf


def _decode_then_prefill(off, ref, seed=4, n=12):
    seq, prefill = _inputs(seed, n_decode=n)
    for x in [*seq, prefill]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what="auto")


def test_auto_runs_misses_on_cpu_when_pcie_is_slow_and_reuse_low():
    ref, off = _pair("mixtral", seed=1)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=4, device="cpu", cpu_experts="auto"), progress=False)
    rt.set_bandwidths(cpu_Bps=1.5e9, pcie_Bps=1e9)
    rt.reuse = ReuseEstimate(alpha=0.0)  # r = 0 throughout: one row goes to the CPU, two or more are copied
    _decode_then_prefill(off, ref)
    s, c = rt.stats(), rt.cpu_stats()
    assert c.cpu_experts > 0 and s.misses > 0, "misses of one row on the CPU, the first fill and prefill copied"
    # the 9-token prefill copies its many-row experts, more than the slots: the chunked path ran with CPU rows
    _check_counts(rt)


def test_auto_copies_when_pcie_is_fast_or_the_cache_has_room():
    ref, off = _pair("deepseek", seed=2)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=4, device="cpu", cpu_experts="auto"), progress=False)
    rt.set_bandwidths(cpu_Bps=1e9, pcie_Bps=50e9)
    _decode_then_prefill(off, ref)
    assert rt.cpu_stats().cpu_experts == 0 and rt.stats().misses > 0
    # a cache with free slots copies (warming up evicts nothing), whatever the bandwidths
    ref, off = _pair("deepseek", seed=2)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=L * 8, device="cpu", cpu_experts="auto"),
                        progress=False)
    rt.set_bandwidths(cpu_Bps=1e12, pcie_Bps=1e6)
    _decode_then_prefill(off, ref)
    assert rt.cpu_stats().cpu_experts == 0
    _check_counts(rt)


def test_auto_high_measured_reuse_keeps_copying():
    # A cache that holds most experts is hit often: r (hits per copy) is high, so even a
    # CPU 3x faster than PCIe does not pay for leaving an expert out of the cache.
    ref, off = _pair("mixtral", seed=3)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=28, device="cpu", cpu_experts="auto"), progress=False)
    rt.set_bandwidths(cpu_Bps=3e9, pcie_Bps=1e9)
    seq, _ = _inputs(5, n_decode=40)
    for x in seq:
        assert_bitwise_equal(_run(off, x), _run(ref, x))
    assert rt.reuse.reuse > 2.0
    s, c = rt.stats(), rt.cpu_stats()
    assert c.cpu_experts <= 0.1 * s.misses, "copies, not CPU runs"
    _check_counts(rt)


def test_counters_reset_and_add_up():
    ref, off = _pair("longcat")
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=4, prefetch_width=2,
                                                 prefetch_rule="always", device="cpu", cpu_experts="always"),
                        progress=False)
    _decode_then_prefill(off, ref, n=6)
    c = rt.cpu_stats().snapshot()
    assert c["cpu_experts"] > 0 and 0 < c["cpu_share"] <= 1 and c["cpu_s"] >= 0
    rt.reset_stats()
    assert rt.cpu_stats().demand_keys == 0 and rt.stats().hits == 0
    _decode_then_prefill(off, ref, seed=6, n=4)
    _check_counts(rt)


def test_host_expert_weights_are_views_of_the_store():
    ref, _ = _pair("gpt_oss")
    store = ExpertStore.from_weights([m.expert_weights for m in ref], mode="model", progress=False)
    w = host_expert_weights(store, 2, 5)
    assert w.num_experts == 1 and w.has_bias and w.layout == "matmul" and w.interleaved
    assert w.gate_up.data_ptr() == ref[2].expert_weights.gate_up[5].data_ptr(), "a view, no copy"
    cpu_Bps, pcie_Bps = measure_bandwidths(store, get_impl("reference"), ref[0].config, torch.device("cpu"), reps=2)
    assert 0 < cpu_Bps < math.inf and 0 < pcie_Bps < math.inf


def test_config_and_attach_errors():
    assert CPU_EXPERTS == ("off", "auto", "always")
    for bad in ("on", "", 0.5, None, True):
        with pytest.raises(ValueError, match=r"OffloadConfig.cpu_experts=.*expected one of \('off', 'auto'"):
            OffloadConfig(gpu_slots=4, cpu_experts=bad)
    ref, off = _pair("mixtral")
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=4, device="cpu", cpu_experts="auto"), progress=False)
    with pytest.raises(ValueError, match="set_bandwidths: pcie_Bps=0"):
        rt.set_bandwidths(1e9, 0)
    assert rt.bandwidths is None
    cpu_Bps, pcie_Bps = rt.measure_bandwidths()  # measured now, kept for the cost model
    assert rt.bandwidths == (cpu_Bps, pcie_Bps) and 0 < cpu_Bps < math.inf and 0 < pcie_Bps < math.inf
    _, off_plain = _pair("mixtral")
    rt_off = attach_offload(list(off_plain), OffloadConfig(gpu_slots=4, device="cpu"), progress=False)
    with pytest.raises(ValueError, match="measure_bandwidths: OffloadConfig.cpu_experts='off'"):
        rt_off.measure_bandwidths()
    # quantized experts are refused by name (the store says it holds a quant format)
    store = ExpertStore.from_weights([m.expert_weights for m in ref], mode="model", progress=False)
    store.quant = type("Q", (), {"format": "fp8_block"})()
    with pytest.raises(ValueError, match="OffloadConfig.cpu_experts='always': quantized experts .*'fp8_block'"):
        attach_offload(list(ref), OffloadConfig(gpu_slots=4, device="cpu", cpu_experts="always"), progress=False,
                       store=store)
    assert not hasattr(ref[0], "offload"), "a refused attach changes nothing"


# bf16 on a CUDA cache, per layer output y given the same input (docs/offload.md): the CPU rows
# run `reference` in bf16 on the host, the GPU rows the layer's Triton impl, so rounding points
# and accumulation orders differ. The bound is relative to the output's scale, not elementwise:
# a layer output sums K expert rows (and a shared expert), so an element near zero after
# cancellation carries the rounding error of its large terms (test_cuda_cpu_experts_within_bf16_tolerance
# on an H200: max|d| / max|y| <= 0.009 over 5 families; an elementwise rtol fails on such elements).
CUDA_BF16_SCALE_TOL = 2e-2
CUDA_BF16_REL_L2 = 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_cpu_experts_within_bf16_tolerance(family):
    ref = _model(family, 0).to("cuda", torch.bfloat16)
    for m in ref:
        m.experts_impl = "triton"
    off = copy.deepcopy(ref)
    K = ref[0].config.top_k
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=max(K, 4), prefetch_width=3,
                                                 prefetch_rule="always", device="cuda",
                                                 cpu_experts="always"), progress=False)
    seq, prefill = _inputs(2)
    for step, x in enumerate([*seq, prefill]):
        x = x.to("cuda", torch.bfloat16)
        for i, (a, b) in enumerate(zip(off, ref)):
            y, z = b(x).float(), a(x).float()
            d = (z - y).abs()
            scale = y.abs().max().item()
            rel = (d.norm() / y.norm().clamp_min(1e-30)).item()
            assert d.max().item() <= CUDA_BF16_SCALE_TOL * scale and rel <= CUDA_BF16_REL_L2, (
                f"{family} step {step} layer {i}: max|d| {d.max().item():.4g} vs {CUDA_BF16_SCALE_TOL} * max|y| "
                f"{scale:.4g}; rel-L2 {rel:.3g} (bound {CUDA_BF16_REL_L2}); RMS {d.pow(2).mean().sqrt().item():.3g}")
            x = x + y.to(x.dtype)
    assert rt.cpu_stats().cpu_experts > 0
    _check_counts(rt)
