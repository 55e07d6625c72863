"""The composed pipeline: one forward, stages that compose, one family table, clean imports.

Also the reliability checks that live in the pipeline's shared mechanisms:
concurrent offloaded forwards, atomic patch_model refusals.

Legend: T tokens, H hidden, E experts, K picks per token.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

import moeflow
from moeflow import hf as mhf
from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts.source import ResidentExperts
from moeflow.families import FAMILIES, ROUTER_MODEL_TYPES, family_for
from moeflow.layer import MoELayer
from moeflow.offload.config import OffloadConfig
from moeflow.parallel.local import LOCAL
from moeflow.routing.router import RouterWeights
from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal
from moeflow.types import Dispatcher, ExpertSource

PKG = pathlib.Path(moeflow.__file__).resolve().parent
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _embedded():
    from transformers import AutoModelForCausalLM

    from moeflow.demo import EMBEDDED_MODEL

    return AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32, attn_implementation="eager")


def _layer(E=6, K=2, H=16, I=8, seed=0) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g))
    return MoELayer(cfg, router_weight_EH=torch.randn(E, H, generator=g), experts=w, experts_impl="reference")


# ----------------------------------------------------------------------------- one forward


def test_stages_are_protocol_choices():
    layer = _layer()
    assert isinstance(layer.dispatcher, Dispatcher) and layer.dispatcher is LOCAL
    assert isinstance(layer.source, ExpertSource) and isinstance(layer.source, ResidentExperts)
    # the same layer built from a RouterWeights holder and a source gives the same bits
    again = MoELayer(layer.config, router=layer.router_weights, experts=ResidentExperts(layer.expert_weights),
                     experts_impl="reference")
    x = torch.randn(7, 16)
    assert_bitwise_equal(again(x), layer(x), what="holder-built layer")
    twin = layer.replace()
    assert twin.router_weights.weight_EH is layer.router_weights.weight_EH, "replace shares the router tensors"
    assert_bitwise_equal(twin(x), layer(x), what="replace()")


def test_router_holder_checked_against_spec():
    layer = _layer()
    bad = RouterWeights(weight_EH=torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"router_weight_EH: shape \(5, 16\), expected \(6, 16\)"):
        MoELayer(layer.config, router=bad, experts=layer.expert_weights)
    with pytest.raises(ValueError, match="router: given together with router_"):
        MoELayer(layer.config, router=layer.router_weights, router_weight_EH=torch.randn(6, 16),
                 experts=layer.expert_weights)
    with pytest.raises(TypeError, match="dispatcher: expected a Dispatcher"):
        MoELayer(layer.config, router=layer.router_weights, experts=layer.expert_weights, dispatcher=object())


def test_one_forward_in_the_library():
    """Only layer.py strings dispatch -> experts -> combine together (no second forward elsewhere)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel in ("layer.py",):
            continue
        text = path.read_text()
        if ".dispatch(" in text and ".combine(" in text and "def dispatch" not in text:
            offenders.append(rel)
    assert not offenders, f"modules that re-spell the layer's forward: {offenders}"


# ----------------------------------------------------------------------------- imports


_LOWER = ("parallel", "offload", "experts", "routing", "kernels", "tuning")


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    pkg_parts = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg_parts[: len(pkg_parts) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_lower_stages_do_not_import_layer_or_integrations():
    bad = []
    for sub in _LOWER:
        for path in (PKG / sub).rglob("*.py"):
            for mod in _imports(path):
                if mod in ("moeflow.layer", "moeflow.hf", "moeflow.cli", "moeflow.demo", "moeflow.demo_ep") or \
                        mod.startswith("moeflow.hf."):
                    bad.append(f"{path.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_no_module_reads_another_modules_private_attributes():
    pattern_names = ("._tensor(", "._rows", "._parameters[", "._buffers[")
    bad = []
    for path in PKG.rglob("*.py"):
        if path.name == "refs.py":  # the storage mechanism itself
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if any(p in line for p in pattern_names) and "self._" not in line:
                bad.append(f"{path.relative_to(PKG)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_every_module_imports_alone():
    """No import cycle that only works in one import order: each module imports first, alone."""
    mods = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith("__main__"):
            continue
        if name.startswith("moeflow.kernels.") and not _HAVE_TRITON:
            continue  # the private @triton.jit modules need triton itself (a GPU extra)
        mods.append(name.removesuffix(".__init__"))
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    for k in [k for k in sys.modules if k.startswith('moeflow')]:\n        del sys.modules[k]\n    importlib.import_module(m)\n"
    r = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


# ----------------------------------------------------------------------------- one family table


def test_family_table_is_the_one_source():
    from moeflow.checkpoint.families import CHECKPOINT_FAMILIES, adapter_for
    from moeflow.routing.families import SUPPORTED_FAMILIES

    assert SUPPORTED_FAMILIES == ROUTER_MODEL_TYPES
    names = {f.name for f in FAMILIES}
    assert set(CHECKPOINT_FAMILIES) <= names
    assert {f.name for f in mhf.HF_FAMILIES} <= names
    for fam in FAMILIES:
        for t in fam.model_types:
            assert family_for(t) is fam
        if fam.checkpoint is not None:
            a = adapter_for(fam.name)
            assert (a.family, a.layout, a.interleaved) == (fam.name, fam.layout, fam.interleaved), fam.name
    with pytest.raises(ValueError, match="not a supported MoE family"):
        family_for("bert")


# ----------------------------------------------------------------------------- reliability


@pytest.mark.parametrize("slots,policy", [(2, "lru"), (12, "predictive"), (32, "lru")])
def test_offloaded_model_from_two_threads_is_correct(slots, policy):
    """Two threads forwarding one offloaded model get the resident model's logits, every time."""
    resident = _embedded()
    off = _embedded()
    moeflow.patch_model(resident, experts="reference")
    moeflow.patch_model(off, experts="reference",
                        offload=OffloadConfig(gpu_slots=slots, policy=policy, prefetch_width=2,
                                              prefetch_rule="always", device="cpu"))
    prompts = [torch.randint(3, 200, (1, 6 + i % 5), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    with torch.no_grad():
        want = [resident(p).logits for p in prompts]
    errors: list[str] = []

    def worker(offset: int) -> None:
        try:
            for rep in range(3):
                for i in range(offset, len(prompts), 2):
                    with torch.no_grad():
                        got = off(prompts[i]).logits
                    if not torch.equal(got, want[i]):
                        errors.append(f"thread {offset} rep {rep} prompt {i}: max diff "
                                      f"{float((got - want[i]).abs().max()):.3g}")
        except Exception as exc:  # a spurious error is a failure too
            errors.append(f"thread {offset}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, "\n".join(errors[:10])


@pytest.mark.parametrize("bad,match", [
    (dict(gpu_slots=1), "gpu_slots=1: fewer slots than the K=2"),
    (dict(gpu_slots=4, prefetch_width=9), "prefetch_width=9: exceeds the E=8"),
    (dict(gpu_slots=4, store="mmap", checkpoint="/nonexistent/moeflow-ckpt"), "no such file or directory"),
])
def test_refused_offload_patch_leaves_the_model_untouched(bad, match):
    model = _embedded()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        moeflow.patch_model(model, offload=OffloadConfig(device="cpu", **bad))
    assert not any(isinstance(m, mhf.MoEBlock) for m in model.modules()), "a refused call patched the model"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused call changed a tensor"
    report = moeflow.patch_model(model, offload=OffloadConfig(gpu_slots=4, device="cpu"))  # the corrected retry
    assert report.offload and len(report) == 4


def test_routing_monitor_folds_pending_statuses_and_names_the_failure():
    """The monitor's logic on CPU tensors (the CUDA event path is tested on the GPU): statuses of
    layers called outside a model forward never pile up, and a failed row raises by name."""
    from moeflow.routing.monitor import RoutingMonitor

    class Status:  # the RoutingStatus interface the monitor uses
        def __init__(self, bad: bool) -> None:
            self.status_T = torch.tensor([1 if bad else 0], dtype=torch.int32)
            self.bad = bad

        def check(self) -> None:
            if self.bad:
                raise ValueError("logits_TE: NaN logit in token row 0 of layer 3")

    m = RoutingMonitor()
    m.end_forward = lambda: m._pending.clear()  # CPU: no CUDA event; only the folding is tested here
    for _ in range(RoutingMonitor.MAX_PENDING + 5):
        m.add(Status(False))
    assert len(m._pending) < RoutingMonitor.MAX_PENDING
    m2 = RoutingMonitor()
    m2.add(Status(True))
    with pytest.raises(ValueError, match="NaN logit in token row 0 of layer 3"):
        m2.check(wait=True)
