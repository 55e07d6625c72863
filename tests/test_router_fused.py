"""The single-kernel router step (moeflow/kernels/router_fused.py) against the two-kernel step.

Legend: T tokens, H hidden size, E routed experts, Z zero experts, S = E + Z logit
columns, K picks per token, W prediction width, V hash vocabulary.

Three tiers, one set of checks (`check_*`, run on a device):
  * CPU, always: argument refusals and the fused-path choice (pure Python, no Triton).
  * CPU with Triton installed: the kernels under the Triton interpreter (TRITON_INTERPRET=1,
    in a subprocess so this process never imports Triton that way), fp32 and fp16 operands
    (the interpreter has no bf16 dot).
  * GPU (`-m gpu`, skipped without CUDA): bf16 and mixed bf16 x fp32-weight operands at
    real router shapes, CUDA-graph capture and replay.

Tolerances (stated once):
  * fused vs two-kernel step: exact. Logits, weights bit for bit, ids / prediction keys /
    status equal as integers: T <= FUSED_MAX_T takes the fused path and larger T the
    two-kernel one, and a row's bits must not depend on T (the checks force fused=True at
    every T they test, whatever the threshold);
  * vs the CPU reference on the step's own logits (moeflow.routing.select.route_reference):
    ids exact except near-tie rows (tests/test_routing_gpu.py's rule, < 25% of a tiny batch
    here), weights relative 1e-6 (absolute 1e-30).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from moeflow.testing import assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_routing_gpu import FAMILIES, GROUPED, compare_routing, family_inputs, family_spec, near_tie_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()

gpu_mark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton")

# The next layer whose prediction rides along with each family's step (a mix of rules:
# groups, zero experts, hash tables, plain softmax).
NEXT = {
    "mixtral": "deepseek_v3", "qwen3_moe": "longcat_flash", "olmoe": "deepseek_v4_hash",
    "deepseek_v3": "deepseek_v3", "glm4_moe": "qwen3_moe", "deepseek_v2": "deepseek_v2",
    "deepseek_v4": "deepseek_v4_hash", "deepseek_v4_hash": "longcat_flash", "gpt_oss": "deepseek_v3",
    "llama4": "mixtral", "longcat_flash": "deepseek_v3", "gemma4": "glm4_moe",
}


def _gpu():
    from moeflow.routing import gpu

    return gpu


# --------------------------------------------------------------------------- builders


def step_case(family: str, E: int, H: int, T: int, dtype, device: str, *, seed: int, w_dtype=None,
              next_family: str | None = None, next_E: int | None = None):
    """(x_TH, weight_EH, kwargs of router_step_cuda) for `family`, optionally with a prediction.

    Weights scaled so logits are O(1); family extras (selection bias, expert scale, hash
    table and ids, gpt-oss's router bias) from test_routing_gpu.family_inputs.
    """
    spec = family_spec(family, E)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w = (torch.randn(spec.num_slots, H, generator=g) / math.sqrt(H)).to(w_dtype or dtype)
    _, kw, _ = family_inputs(spec, T, seed=seed)
    if "bias" in kw:  # continuous: biased keys clustered on three values near-tie too often
        kw["bias"] = torch.randn(spec.num_slots, generator=g) * 0.05
    if family == "gpt_oss":
        kw["router_bias"] = torch.randn(spec.num_slots, generator=g) * 0.1
    kw = {k: v.to(device) for k, v in kw.items()}
    kw.update(spec=spec, layer=5)
    if next_family is not None:
        nspec = family_spec(next_family, next_E or E)
        _, nkw, _ = family_inputs(nspec, T, seed=seed + 1)
        wn = (torch.randn(nspec.num_slots, H, generator=g) / math.sqrt(H)).to(w_dtype or dtype)
        kw.update(next_weight_EH=wn.to(device), next_spec=nspec, next_layer=6,
                  width=min(nspec.top_k + 3, nspec.num_experts))
        if "bias" in nkw:
            kw["next_bias"] = (torch.randn(nspec.num_slots, generator=g) * 0.05).to(device)
        if nspec.hash_routing:
            kw["next_input_ids"] = nkw["input_ids"].to(device)
            kw["next_hash_table"] = nkw["hash_table"].to(device)
    return x.to(device), w.to(device), kw


def _step(x, w, kw, **extra):
    kw = dict(kw)
    spec = kw.pop("spec")
    return _gpu().router_step_cuda(x, w, spec, **kw, **extra)


def assert_same_step(f, u, what: str) -> None:
    """Fused step f and two-kernel step u: same bits everywhere."""
    assert f.fused and not u.fused, (what, f.fused, u.fused)
    assert_bitwise_equal(f.logits_TS, u.logits_TS, what=f"{what} logits")
    assert torch.equal(f.routing.ids_TK, u.routing.ids_TK), f"{what}: ids differ"
    assert_bitwise_equal(f.routing.weights_TK, u.routing.weights_TK, what=f"{what} weights")
    assert torch.equal(f.routing.status.status_T, u.routing.status.status_T), f"{what}: status differs"
    assert (f.prediction is None) == (u.prediction is None)
    if f.prediction is not None:
        assert torch.equal(f.prediction.keys_TW2, u.prediction.keys_TW2), f"{what}: prediction keys differ"
        assert torch.equal(f.prediction.status.status_T, u.prediction.status.status_T), f"{what}: pred status"


def _tickets_zero(device: str) -> None:
    gpu = _gpu()
    dev = torch.zeros(0, device=device).device  # with its index
    t = gpu._TICKETS[(dev.type, dev.index)]
    assert int(t.abs().sum()) == 0, "the fused kernel left a ticket counter non-zero"


def _family_E(family: str, small: bool) -> int:
    if small:
        return 32  # divisible by the 8 groups of the grouped families
    return {"mixtral": 8, "llama4": 16, "gpt_oss": 128, "longcat_flash": 512, "olmoe": 64}.get(family, 256)


def _check_reference(step, kw, what: str, x=None, w=None) -> None:
    """The step's routing against the CPU reference on the step's own logits (near ties skipped).

    With the step's operands x [T, H] and w [E, H], a failure also says which rows differ and
    how far the step's logits are from float64 x @ w.T there: a wrong weight from right logits
    (the selection) reads differently from logits written apart from the ones selected on.
    """
    from moeflow.routing.select import route_reference

    spec = kw["spec"]
    logits = step.logits_TS.cpu()
    rkw = {k: kw[k].cpu() for k in ("bias", "expert_scale", "input_ids", "hash_table") if k in kw}
    # The reference runs on the logits in float64: in these interpreter processes torch's
    # f32 CPU softplus, about once in 10-20 runs, came back ~3e-4 off on rows 32..63 (the
    # second half) of its [64, 64] buffer (cause not found); the f64 path
    # never did, and its rounding to f32 stays within the stated 1e-6.
    ref = route_reference(logits.double(), spec, **rkw)
    skip = set() if spec.hash_routing else near_tie_rows(logits, spec, rkw.get("bias"))
    assert len(skip) <= max(1, logits.shape[0] // 4), f"{what}: {len(skip)} near-tie rows"
    try:
        compare_routing(step.routing, ref, skip=skip, what=what)
    except AssertionError as err:
        if x is None or w is None or step.routing.weights_TK is None:
            raise
        raise AssertionError(f"{err}\n{_reference_diagnosis(step, ref, spec, rkw, x, w)}") from None


def _reference_diagnosis(step, ref, spec, rkw, x, w) -> str:
    """Rows whose weights differ from the reference, with the logits' distance from f64 there."""
    from moeflow.routing.select import route_reference

    got = step.routing.weights_TK.cpu()
    rel_T = ((got - ref.weights_TK).abs() / ref.weights_TK.abs().clamp_min(1e-30)).amax(dim=1)
    bad = (rel_T > 1e-6).nonzero()[:, 0].tolist()
    l64 = (x.cpu().double() @ w.cpu().double().T)[:, : step.logits_TS.shape[1]]
    lerr_T = ((step.logits_TS.cpu().double() - l64).abs()
              / l64.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)).amax(dim=1)
    ref64 = route_reference(l64, spec, **rkw).weights_TK  # on exact logits, not the step's
    rel64_T = ((got - ref64).abs() / ref64.abs().clamp_min(1e-30)).amax(dim=1)
    rows = ", ".join(f"{t}: w {rel_T[t]:.1e} logits {lerr_T[t]:.1e} w-vs-f64-ref {rel64_T[t]:.1e}" for t in bad[:12])
    ok_T = rel_T <= 1e-6
    ok_lerr = lerr_T[ok_T].max().item() if bool(ok_T.any()) else 0.0
    return (f"rows with weights off (rel): {len(bad)} of {got.shape[0]} ({rows}); rows ok: logits within "
            f"{ok_lerr:.1e} of f64 (relative to the row's max); {_platform()}")


def _platform() -> str:
    """CPU model and the numeric libraries' versions: what the interpreter's arithmetic runs on."""
    import platform

    import numpy

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import triton

    return f"cpu {cpu!r}, torch {torch.__version__}, numpy {numpy.__version__}, triton {triton.__version__}"


# --------------------------------------------------------------------------- checks (any device)


def check_families(device: str, dtype, Ts, families, *, small: bool, H_of=None, w_dtype=None,
                   plain_T1: bool = True) -> None:
    """Fused == two-kernel (bits) for each family and T, with a prediction (NEXT[family]) and,
    at T = 1, without (plain_T1 False: T = 1 only without); the fused routing agrees with the
    CPU reference; the ticket counters are back at zero; the default picks fused for small T."""
    for fi, family in enumerate(families):
        E = _family_E(family, small)
        H = H_of(fi) if H_of else 2048
        for T in Ts:
            what = f"{family} T={T} H={H} {dtype}"
            x, w, kw = step_case(family, E, H, T, dtype, device, seed=17 * fi + T, w_dtype=w_dtype,
                                 next_family=NEXT[family], next_E=_family_E(NEXT[family], small))
            if T == 1:  # the decode step without a prediction (another compiled variant)
                plain = {k: v for k, v in kw.items() if not k.startswith("next_") and k != "width"}
                f = _step(x, w, plain, fused=True)
                assert_same_step(f, _step(x, w, plain, fused=False), f"{what} no prediction")
                assert f.prediction is None
                _tickets_zero(device)
                _check_reference(f, plain, what, x, w)
                if not plain_T1:
                    continue
            f = _step(x, w, kw, fused=True)
            u = _step(x, w, kw, fused=False)
            assert_same_step(f, u, what)
            _tickets_zero(device)
            _check_reference(f, kw, what, x, w)
            f.routing.check()
            f.prediction.check()
            # the default picks the fused kernel for T <= FUSED_MAX_T
            assert _step(x, w, kw).fused == (T <= _gpu().FUSED_MAX_T)


def check_row_bits_across_T(device: str, dtype, family: str, E: int, H: int, big_T: int, windows, w_dtype=None) -> None:
    """Rows of a big batch (two-kernel path) keep their bits when they come in small batches
    (fused path): the batch invariance the layer promises. windows: (n, start) sub-batches."""
    x, w, kw = step_case(family, E, H, big_T, dtype, device, seed=3, w_dtype=w_dtype,
                         next_family=NEXT[family])
    full = _step(x, w, kw, fused=False)
    per_row = {"input_ids"}
    for n, start in windows:
        sub = {k: (v[start : start + n] if k in per_row or k == "next_input_ids" else v) for k, v in kw.items()}
        part = _step(x[start : start + n], w, sub, fused=True)
        sl = slice(start, start + n)
        what = f"{family} rows {start}..{start + n - 1} of {big_T}"
        assert_bitwise_equal(part.logits_TS, full.logits_TS[sl], what=f"{what} logits")
        assert torch.equal(part.routing.ids_TK, full.routing.ids_TK[sl]), what
        assert_bitwise_equal(part.routing.weights_TK, full.routing.weights_TK[sl], what=f"{what} weights")
        assert torch.equal(part.prediction.keys_TW2, full.prediction.keys_TW2[sl]), what


def check_status(device: str, dtype, *, small: bool) -> None:
    """NaN logits and bad hash inputs: same per-row status on both paths, the named errors."""
    H = 256 if small else 2048
    E = _family_E("deepseek_v3", small)
    x, w, kw = step_case("deepseek_v3", E, H, 8, dtype, device, seed=9, next_family="deepseek_v3")
    x[3] = float("nan")
    f, u = _step(x, w, kw, fused=True), _step(x, w, kw, fused=False)
    assert_same_step(f, u, "NaN row")
    status = f.routing.status.status_T.cpu()
    assert status.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    assert f.routing.ids_TK[3].tolist() == list(range(kw["spec"].top_k))
    assert bool(torch.isnan(f.routing.weights_TK[3]).all())
    with pytest.raises(ValueError, match=r"token row 3 of layer 5 \(1 rows hold NaN\)"):
        f.routing.check()
    with pytest.raises(ValueError, match=r"token row 3 of layer 6"):
        f.prediction.check()
    _tickets_zero(device)

    E = _family_E("deepseek_v4_hash", small)
    x, w, kw = step_case("deepseek_v4_hash", E, H, 6, dtype, device, seed=4)
    ids = kw["input_ids"].clone()
    ids[4] = kw["hash_table"].shape[0]  # one past the vocabulary
    kw["input_ids"] = ids
    f, u = _step(x, w, kw, fused=True), _step(x, w, kw, fused=False)
    assert_same_step(f, u, "bad hash id")
    assert int(f.routing.status.status_T[4]) == 2
    with pytest.raises(ValueError, match=rf"input_ids: id {int(ids[4])} in token row 4 of layer 5"):
        f.routing.check()


# --------------------------------------------------------------------------- CPU: no Triton needed


def test_fused_argument_is_checked_first():
    gpu = _gpu()
    spec = family_spec("mixtral", 8)
    with pytest.raises(TypeError, match="fused: 'yes', expected None or a bool"):
        gpu.router_step_cuda(torch.zeros(1, 4), torch.zeros(8, 4), spec, fused="yes")
    with pytest.raises(ValueError, match="CUDA"):
        gpu.router_step_cuda(torch.zeros(1, 4), torch.zeros(8, 4), spec, fused=True)


def test_fused_rows_rule():
    gpu = _gpu()
    assert gpu._fused_rows(256, 1, 64) == 1  # decode: one row, smallest tile
    assert gpu._fused_rows(256, 2, 64) == gpu._SELECT_TILE // 256
    assert gpu._fused_rows(4096, 64, 64) == 1  # a row fills the tile
    assert gpu._fused_rows(8, 64, 32) == 32  # at most one row group
    assert isinstance(gpu.FUSED_MAX_T, int) and 1 <= gpu.FUSED_MAX_T <= 64


# --------------------------------------------------------------------------- CPU: Triton interpreter


def _run_interp(check: str) -> None:
    from moeflow.testing import run_interpreter_check

    run_interpreter_check(__file__, check)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
@pytest.mark.parametrize("check", ["families", "wide", "invariance"])
def test_interpreter(check):
    _run_interp(check)


def _interp_main(check: str) -> None:
    from test_experts_triton import _patch_interpreter_index

    _patch_interpreter_index()
    # routing.gpu takes CPU tensors under the interpreter, which runs the CUDA kernels on them
    # H alternates between one split (H <= 128) and several (fp32 tiles: 128 of H per split)
    hs = (100, 200, 300)
    if check == "families":
        check_families("cpu", torch.float32, (1, 3, 8), FAMILIES, small=True, H_of=lambda i: hs[i % 3])
    elif check == "wide":
        # T = 64 (two fp32 row groups of 32, two tickets), fp16 tensor-core tiles with 1 and 3 splits
        check_families("cpu", torch.float32, (64,), ["deepseek_v3", "deepseek_v4_hash"], small=True,
                       H_of=lambda i: hs[i % 3])
        check_families("cpu", torch.float16, (3,), ["deepseek_v3"], small=True, H_of=lambda i: 1100)
        check_families("cpu", torch.float16, (64,), ["gpt_oss"], small=True, H_of=lambda i: 300)
        check_status("cpu", torch.float32, small=True)
    elif check == "invariance":
        # Only windows that keep each row at its position in a 32-row tile: the interpreter's
        # tl.dot is numpy's matmul, whose rounding may depend on a row's place in the tile (the
        # GPU's MMA does not: the GPU test moves rows to every position).
        check_row_bits_across_T("cpu", torch.float32, "deepseek_v3", 32, 200, 66,
                                [(1, 0), (1, 32), (3, 32), (8, 0), (34, 32)])
    else:
        raise SystemExit(f"unknown check {check!r}")
    print(f"PASS {check}")


# --------------------------------------------------------------------------- GPU


@gpu_mark
@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_fused_equals_two_kernel(family):
    # real router widths: H of the family's models (gpt-oss 2880, deepseek 7168, ...)
    H = {"gpt_oss": 2880, "mixtral": 4096, "llama4": 5120, "longcat_flash": 6144}.get(
        family, 7168 if family in GROUPED or family.startswith("deepseek") else 2048)
    check_families("cuda", torch.bfloat16, (1, 3, 8, 64), [family], small=False, H_of=lambda i: H, plain_T1=False)


@gpu_mark
@needs_gpu
def test_gpu_fused_fp32_gate_weight():
    """DeepSeek keeps the gate weight in fp32: the mixed-operand (exact f32 product) GEMM path."""
    check_families("cuda", torch.bfloat16, (1, 8, 64), ["deepseek_v3", "deepseek_v4"], small=False,
                   H_of=lambda i: 7168, w_dtype=torch.float32, plain_T1=False)


@gpu_mark
@needs_gpu
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_gpu_row_bits_do_not_depend_on_T(w_dtype):
    windows = [(1, 0), (1, 299), (3, 5), (8, 292), (17, 100), (64, 1)]
    check_row_bits_across_T("cuda", torch.bfloat16, "deepseek_v3", 256, 7168, 300, windows, w_dtype=w_dtype)
    check_row_bits_across_T("cuda", torch.bfloat16, "gpt_oss", 128, 2880, 300, windows, w_dtype=w_dtype)


@gpu_mark
@needs_gpu
def test_gpu_status():
    check_status("cuda", torch.bfloat16, small=False)


@gpu_mark
@needs_gpu
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_cuda_graph_replays_the_fused_step(T):
    """Capture the fused step (with a prediction), replay with new inputs: replay == eager,
    repeated replays of one input equal, the counters reset themselves, NaN rows reported."""
    x, w, kw = step_case("deepseek_v3", 256, 7168, T, torch.bfloat16, "cuda", seed=21, next_family="deepseek_v3")
    x_static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(x_static, w, kw, fused=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(x_static, w, kw, fused=True)
    assert out.fused, "the captured step fell back to two kernels"
    g = torch.Generator(device="cuda").manual_seed(T)
    for trial in range(4):
        x_new = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
        if trial == 3:
            x_new[T - 1] = float("nan")
        x_static.copy_(x_new)
        snaps = []
        for _ in range(2):  # two replays of the same input: same bits (tickets were reset)
            graph.replay()
            torch.cuda.synchronize()
            snaps.append((out.logits_TS.clone(), out.routing.ids_TK.clone(), out.routing.weights_TK.clone(),
                          out.prediction.keys_TW2.clone()))
        for a, b in zip(snaps[0], snaps[1]):
            assert_bitwise_equal(a, b, what=f"replay twice T={T}")
        _tickets_zero("cuda")
        eager = _step(x_static, w, kw, fused=False)
        assert_bitwise_equal(out.logits_TS, eager.logits_TS, what="graph logits")
        assert torch.equal(out.routing.ids_TK, eager.routing.ids_TK)
        assert_bitwise_equal(out.routing.weights_TK, eager.routing.weights_TK, what="graph weights")
        assert torch.equal(out.prediction.keys_TW2, eager.prediction.keys_TW2)
        if trial < 3:
            out.routing.check()
            out.prediction.check()
        else:
            with pytest.raises(ValueError, match=f"token row {T - 1} of layer 5"):
                out.routing.check()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: TRITON_INTERPRET=1 python tests/test_router_fused.py {families|wide|invariance}")
    _interp_main(sys.argv[1])
