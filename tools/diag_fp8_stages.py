"""Per-stage comparison of the FP8 W8A8 Triton experts (TritonQuantExperts(fp8=True)) with the W8A8 reference.

Legend: T tokens, K slots, N = T*K pairs, E experts, H hidden, I intermediate, G = 128 (the
activation / weight block along a reduction axis). Stages, each on the same inputs:
    ref_device  quantize_fp8_activations of x on this device vs on the CPU (bitwise): the
                reference's own device dependence (PyTorch-CUDA's `tensor / 448.0` multiplies by
                fl(1/448): ~55% of scales 1 ulp off without moeflow.quant.formats.div_by_const)
    quant_x     the kernels' activation quantization (fp8_quant_rows_kernel) vs the reference's
                quantize_fp8_activations: e4m3 codes and f32 scales, bitwise
    h           gate_up's quantized intermediate (aq_PI, as_PG, rows by placed pair) vs the
                reference's act(x_hat @ W_gu) quantized the same way: codes that differ (fraction,
                largest distance in e4m3 steps), scales' max relative difference, rel-L2 of h_hat
    down        the down kernel's y (summed over split-K parts) vs the f32 down GEMM of the
                kernel's own h_hat: the down stage alone
    out         forward_tokens vs the W8A8 reference (rel-L2, max-abs), as tests/test_experts_triton_quant.py

GPU (the H200 check; < 60 s):
    python3 tools/diag_fp8_stages.py
CPU, kernels under the Triton interpreter (fp16 only for speed; the interpreter has its own
f32 -> bf16 truncation, see tests/test_experts_triton_quant.py::_patch_interpreter):
    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= PYTHONPATH=. python tools/diag_fp8_stages.py --small
Expected: ref_device 0 differing, quant_x 0 differing, h codes differing <~1e-3
(f32 sum order, fp8 MMA accumulation), out rel-L2 ~2-4e-3 (bf16 output rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from moeflow.config import ExpertWeights, MoEConfig  # noqa: E402


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _dequant_groups(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    return q.to(torch.float32) * s.repeat_interleave(group, dim=1)[:, : q.shape[1]]


def _e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|distance| in e4m3 codes between two float8_e4m3fn tensors (same sign: code difference)."""
    ia, ib = a.view(torch.uint8).to(torch.int32), b.view(torch.uint8).to(torch.int32)
    sa = torch.where(ia >= 128, -(ia - 128), ia)  # signed magnitude order
    sb = torch.where(ib >= 128, -(ib - 128), ib)
    return (sa - sb).abs()


def fp8_stage_report(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, w: ExpertWeights, cfg: MoEConfig,
                     impl, ref_context=contextlib.nullcontext) -> dict:
    """Per-stage numbers (module docstring) of impl (a TritonQuantExperts(fp8=True)) on x [T, H],
    ids [T, K] int32, wts [T, K] f32; fp8_block weights w, cfg without weight_on_input.

    ref_context: a context manager factory the reference's torch code runs under (the CPU tests pass
    moeflow.testing.cuda_scalar_division to compute it with CUDA's division semantics).
    """
    from moeflow.experts.activations import apply_activation
    from moeflow.experts.base import down_one, gate_up_one
    from moeflow.experts.fused import StepBuffers, fp8_quant_launch, run_plan
    from moeflow.quant.formats import quantize_fp8_activations
    from moeflow.tuning.quant_tiles import quant_group

    assert w.quant is not None and w.quant.format == "fp8_block", "fp8_block weights only"
    assert not getattr(cfg.router, "weight_on_input", False), "weight_on_input not covered here"
    rep: dict = {}
    T, K = ids.shape
    N, H, I = T * K, w.hidden_size, w.intermediate_size
    G = quant_group(w.quant)
    dev = x.device
    xf = x.float()

    # ref_device: the reference quantizer on this device vs on the CPU
    with ref_context():
        rq, rs = quantize_fp8_activations(xf, G)
    cq, cs = quantize_fp8_activations(xf.cpu(), G)
    rep["ref_device_scales_differing"] = int((rs.cpu() != cs).sum())
    rep["ref_device_codes_differing"] = int((rq.cpu().view(torch.uint8) != cq.view(torch.uint8)).sum())

    # quant_x: the kernels' activation quantization vs the reference's
    kq, ks = fp8_quant_launch(x, G)
    rep["quant_x_scales_differing"] = int((ks != rs).sum())
    rep["quant_x_codes_differing"] = int((kq.view(torch.uint8) != rq.view(torch.uint8)).sum())
    rep["quant_x_elements"] = int(rq.numel())

    # the pipeline as forward_tokens runs it (the impl's KernelPlan), keeping the step's buffers
    ids_N = ids.reshape(-1).to(torch.int32).contiguous()
    wts_N = wts.reshape(-1).contiguous()
    plan = impl.plan(w, T, K, act_dtype=x.dtype, activation=cfg.activation)
    assert plan.path == "aligned", plan.explain()
    b = StepBuffers(plan, x, ids_N, wts_N, T, K, w, weight_on_input=False, combine_weights=True)
    run_plan(plan, b, w, cfg)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    rep["variants"] = {st.stage: st.variant for st in plan.stages}
    sorted_P = b.sorted_P.long()
    used = (b.block_expert_B >= 0).repeat_interleave(plan.tiles.block_m)  # past the used blocks: never written
    valid = (used & (sorted_P >= 0) & (sorted_P < N)).nonzero().squeeze(1)
    pair = sorted_P[valid]
    aq = torch.empty(N, I, dtype=torch.float8_e4m3fn, device=dev)
    as_ = torch.empty(N, b.as_PG.shape[1], dtype=torch.float32, device=dev)
    aq[pair], as_[pair] = b.aq_PI[valid], b.as_PG[valid]

    # h: the reference intermediate from the reference x_hat, quantized the same way
    w32 = w.dequantize(torch.float32)
    x_hat = _dequant_groups(rq, rs, G)
    h_ref = torch.empty(N, I, dtype=torch.float32, device=dev)
    ids_l = ids_N.long()
    with ref_context():
        for e in torch.unique(ids_l).tolist():
            sel = (ids_l == e).nonzero().squeeze(1)
            h_ref[sel] = apply_activation(gate_up_one(x_hat[sel // K], w32, e), cfg)
        hq, hs = quantize_fp8_activations(h_ref, G)
    steps = _e4m3_steps(aq, hq)
    rep["h_codes_differing_frac"] = float((steps > 0).float().mean())
    rep["h_codes_max_steps"] = int(steps.max())
    rep["h_scales_max_rel"] = float(((as_ - hs).abs() / hs.abs().clamp_min(1e-30)).max())
    h_k = _dequant_groups(aq, as_, G)
    rep["h_hat_rel_l2"] = _rel_l2(h_k, _dequant_groups(hq, hs, G))

    # down: the kernel's y vs the f32 down GEMM of the kernel's own h_hat
    y_k = b.y_SNH.float().sum(0)
    y_from_hk = torch.empty(N, H, dtype=torch.float32, device=dev)
    for e in torch.unique(ids_l).tolist():
        sel = (ids_l == e).nonzero().squeeze(1)
        y_from_hk[sel] = down_one(h_k[sel], w32, e)
    rep["down_rel_l2"] = _rel_l2(y_k, y_from_hk)

    # out: forward_tokens vs the W8A8 reference (tests/test_experts_triton_quant.py's)
    out = impl.forward_tokens(x, ids, wts, w, cfg).float()
    y_ref = torch.empty(N, H, dtype=torch.float32, device=dev)
    h_hat_ref = _dequant_groups(hq, hs, G)
    for e in torch.unique(ids_l).tolist():
        sel = (ids_l == e).nonzero().squeeze(1)
        y_ref[sel] = down_one(h_hat_ref[sel], w32, e)
    ref = (wts.float().unsqueeze(-1) * y_ref.view(T, K, H)).sum(1)
    rep["out_rel_l2"] = _rel_l2(out, ref)
    rep["out_max_abs"] = float((out - ref).abs().max())
    rep["out_dtype_floor_rel_l2"] = _rel_l2(ref.to(x.dtype).float(), ref)  # rounding the reference to x's dtype
    return rep


def _case(E, H, I, K, act, device, seed=0):
    from moeflow.quant.experts import quantize_experts
    from moeflow.quant.spec import fp8_block_spec
    from moeflow.routing.spec import RouterSpec

    g = torch.Generator(device).manual_seed(seed)  # made and quantized on the device (fast on the GPU)
    limit = 0.75 if act == "swiglu_clamp" else None
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, activation=act, swiglu_limit=limit,
                    router=RouterSpec(score_fn="softmax", num_experts=E, top_k=K))
    gu = torch.randn(E, 2 * I, H, generator=g, device=device) * (2.0 / H**0.5)
    dn = torch.randn(E, H, I, generator=g, device=device) * (2.0 / I**0.5)
    wq = quantize_experts(ExpertWeights(gu, dn), fp8_block_spec((128, 128)))
    fields = {n: (None if getattr(wq, n) is None else getattr(wq, n).contiguous())
              for n in ExpertWeights.TENSOR_FIELDS}
    return cfg, ExpertWeights(quant=wq.quant, **fields)


def _tokens(T, H, E, K, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return x.to(device, dtype), ids.to(device), wts.to(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU / interpreter sizes (fp16, two cases)")
    args = ap.parse_args(argv)
    from moeflow.experts.triton_quant import TritonQuantExperts

    cpu = not torch.cuda.is_available()
    dev = torch.device("cpu" if cpu else "cuda")
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("no CUDA: run under TRITON_INTERPRET=1 (see the module docstring)")
    if cpu:  # the interpreter fixes the kernel tests use (numpy index, f32 -> e4m3 / bf16 rounding)
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from test_experts_triton_quant import _patch_interpreter

        _patch_interpreter()
    dtype = torch.float16 if cpu else torch.bfloat16
    cases = [(16, 384, 256, 4, "silu"), (7, 200, 176, 2, "swiglu_clamp"), (8, 1024, 512, 8, "silu"),
             (16, 7168, 2048, 8, "silu")]  # the last: deepseek-v3's H / I (the GPU tests' first two shapes)
    tokens = (1, 8, 64, 257)
    if args.small:
        cases, tokens = cases[:2], (7, 19)
    t0 = time.time()
    impls = [("default", TritonQuantExperts(fp8=True, allow_cpu=cpu)),
             ("batch_invariant", TritonQuantExperts(fp8=True, batch_invariant=True, allow_cpu=cpu))]
    print(f"device {torch.cuda.get_device_name() if not cpu else 'cpu (interpreter)'}, torch {torch.__version__}, "
          f"activations {dtype}")
    for E, H, I, K, act in cases:
        cfg, w = _case(E, H, I, K, act, dev)
        for T in tokens:
            x, ids, wts = _tokens(T, H, E, K, dtype, dev, seed=T)
            for name, impl in impls:
                r = fp8_stage_report(x, ids, wts, w, cfg, impl)
                print(f"E={E} H={H} I={I} K={K} {act} T={T} {name}: "
                      f"ref_device {r['ref_device_scales_differing']} scales / {r['ref_device_codes_differing']} codes | "
                      f"quant_x {r['quant_x_scales_differing']} scales / {r['quant_x_codes_differing']} codes "
                      f"of {r['quant_x_elements']} | h codes {r['h_codes_differing_frac']:.2e} "
                      f"(max {r['h_codes_max_steps']} steps) scales {r['h_scales_max_rel']:.1e} "
                      f"h_hat {r['h_hat_rel_l2']:.2e} | down {r['down_rel_l2']:.2e} | "
                      f"out {r['out_rel_l2']:.2e} (dtype floor {r['out_dtype_floor_rel_l2']:.1e}, "
                      f"max-abs {r['out_max_abs']:.2e})", flush=True)
    print(f"done in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
