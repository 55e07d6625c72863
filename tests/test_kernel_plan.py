"""The kernel plan (moeflow.experts.plan): one pure function chooses every kernel, tile and path.

Pure Python: no Triton, no CUDA. Plans are computed for named devices (an H100's facts) so the CPU suite
checks what the GPU runs. Each test states the choice and the reason the registry gives for it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from moeflow.experts.options import KernelOptions
from moeflow.experts.plan import (
    NAMED_DEVICES,
    VARIANTS,
    PlanError,
    StepShape,
    plan_step,
    refusal_key,
    variants_for,
)
from moeflow.tuning import GemmTile, MoETileConfig
from moeflow.tuning.rules import KernelRules, load_rules, write_rules

ROOT = Path(__file__).resolve().parents[1]
H100, A100, CPU = NAMED_DEVICES["h100"], NAMED_DEVICES["a100"], NAMED_DEVICES["cpu"]


def shape(E, H, I, K, T, *, fmt="plain", dtype="bfloat16", **kw) -> StepShape:
    group = {"plain": 0, "fp8_block": 128, "mxfp4": 32, "nvfp4": 16}[fmt]
    sbn = 128 if fmt == "fp8_block" else 0
    return StepShape(fmt=fmt, dtype=dtype, num_experts=E, tiling_experts=E, hidden_size=H, intermediate_size=I,
                     top_k=K, tokens=T, pairs=T * K, group=group, scale_block_n=sbn, **kw)


MIXTRAL = dict(E=8, H=4096, I=14336, K=2)
DSV3 = dict(E=256, H=7168, I=2048, K=8)
QWEN3 = dict(E=128, H=2048, I=768, K=8)
GPTOSS = dict(E=128, H=2880, I=2880, K=4)


def variants(plan) -> dict[str, str]:
    return {s.stage: s.variant for s in plan.stages}


def test_registry_rows_are_complete_and_unique():
    seen = set()
    for v in VARIANTS:
        key = (v.stage, v.name, v.formats)
        assert key not in seen, key
        seen.add(key)
        assert v.launch.startswith("fused:") and v.kernel and v.summary
    for fmt in ("plain", "fp8_block", "mxfp4", "nvfp4"):
        for stage in ("align", "gate_up", "down", "combine"):
            assert variants_for(stage, fmt), (stage, fmt)


def test_mixtral_bf16_on_hopper_prefill_and_decode():
    big = plan_step(shape(**MIXTRAL, T=8192), H100)
    assert variants(big)["gate_up"] == "tma_gather_x"  # I >= 8192 and T*K >= 8192: the rule
    assert "rule: I >= 8192" in big.stage("gate_up").why
    assert big.stage("gate_up").get("fused") is True
    assert big.tiles is not None and "tuned table" in big.tile_source
    assert big.pdl and big.pdl_gemm == 2  # "exit": the rules' trigger
    small = plan_step(shape(**MIXTRAL, T=1), H100)
    assert variants(small)["gate_up"] == "tma"  # T*K 2 < 8192: no row copy
    assert ("gate_up", "tma_gather_x", "rule: T*K 2 < 8192") in small.refused
    assert variants(small)["down"] in ("pointer", "tma")
    if small.tiles.down.split_k > 1:  # decode shapes split the down GEMM: TMA down runs one split
        assert variants(small)["down"] == "pointer"
        assert any(st == "down" and n == "tma" and "split_k" in why for st, n, why in small.refused)


def test_tma_off_and_pre_hopper_take_the_pointer_kernels():
    for plan, why in ((plan_step(shape(**MIXTRAL, T=8192), H100, options=KernelOptions(tma=False)),
                       "KernelOptions(tma=False)"),
                      (plan_step(shape(**MIXTRAL, T=8192), A100), "compute capability 8 < 9")):
        assert variants(plan)["gate_up"] == "pointer" and variants(plan)["down"] == "pointer"
        assert any(n == "tma" and why in w for _, n, w in plan.refused), plan.refused
    assert not plan_step(shape(**MIXTRAL, T=8), A100).pdl
    assert not plan_step(shape(**MIXTRAL, T=8), H100, options=KernelOptions(pdl=False)).pdl


def test_gptoss_matmul_layout_runs_pointer_kernels_and_says_why():
    p = plan_step(shape(**GPTOSS, T=2048, layout="matmul", interleaved=True, gate_up_bias=True, down_bias=True,
                        activation="gptoss"), H100)
    assert variants(p) == {"align": "align", "gate_up": "pointer", "down": "pointer", "combine": "combine"}
    # TMA variants run the linear layout only: they are not candidates for matmul
    assert not any(n.startswith("tma") for _, n, _ in p.refused)


def test_flat_down_rule_and_tuned_override():
    t = MoETileConfig(block_m=128, gate_up=GemmTile(block_n=128, block_k=64), down=GemmTile(block_n=128, block_k=64))
    s = shape(**QWEN3, T=8192)  # I 768 / BK 64 = 12 K steps <= 16
    assert variants(plan_step(s, H100, tile_config=t))["down"] == "tma_flat"
    assert plan_step(s, H100, tile_config=t).stage("down").get("programs") == 132
    assert variants(plan_step(s, H100, tile_config=dataclasses.replace(t, flat_down=False)))["down"] == "tma"
    assert variants(plan_step(s, H100, tile_config=dataclasses.replace(t, block_m=64)))["down"] == "tma"
    long_k = shape(**DSV3, T=8192)  # I 2048 / 64 = 32 steps
    assert variants(plan_step(long_k, H100, tile_config=t))["down"] == "tma"
    assert variants(plan_step(long_k, H100, tile_config=dataclasses.replace(t, flat_down=True)))["down"] == "tma_flat"


def test_fp8_gluon_rule_tma_and_batch_invariance():
    big = plan_step(shape(**DSV3, T=8192, fmt="fp8_block"), H100, impl="triton_quant")
    assert variants(big) == {"align": "align", "quant_x": "fp8_quant_rows", "gate_up": "fp8_gluon",
                             "down": "fp8_tma", "combine": "combine"}
    assert big.stage("gate_up").get("stages") == 5  # 200 KB // ((64 + 256) x 128 B)
    qwen = plan_step(shape(**QWEN3, T=8192, fmt="fp8_block"), H100)
    assert variants(qwen)["gate_up"] == "fp8_tma"  # H 2048 < 4096: the rule keeps the Triton kernel
    assert ("gate_up", "fp8_gluon", "rule: H 2048 < 4096") in qwen.refused
    bi = plan_step(shape(**DSV3, T=8192, fmt="fp8_block", batch_invariant=True), H100)
    assert variants(bi)["gate_up"] != "fp8_gluon"
    assert bi.stage("gate_up").get("imprecise") == 64 or bi.stage("gate_up").tile.block_k <= 64
    decode = plan_step(shape(**DSV3, T=1, fmt="fp8_block"), H100)
    assert variants(decode)["gate_up"] == "fp8_pointer" and decode.tiles.block_m == 16
    ue8m0 = plan_step(shape(**DSV3, T=8192, fmt="fp8_block", scale_f32=False), H100)
    assert variants(ue8m0)["gate_up"] == "fp8_tma"


def test_fp4_gemv_path_and_aligned_path():
    g = shape(**GPTOSS, T=1, fmt="mxfp4", layout="matmul", interleaved=True, gate_up_bias=True, down_bias=True,
              activation="gptoss")
    p = plan_step(g, H100)
    assert p.path == "gemv" and p.tiles is None and variants(p) == {"gate_up": "w4_gemv", "down": "w4_gemv",
                                                                      "combine": "combine"}
    assert (p.stage("gate_up").get("block_n"), p.stage("gate_up").get("block_k")) == (16, 512)  # <= 8 pairs
    assert p.stage("gate_up").get("asm") is True
    wide = plan_step(dataclasses.replace(g, tokens=64, pairs=256), H100)
    assert wide.path == "aligned" and variants(wide)["gate_up"] == "w4_pointer"
    assert ("path", "gemv", "rule: T*K 256 > 128") in wide.refused
    assert plan_step(dataclasses.replace(g, batch_invariant=True), H100).path == "aligned"
    nv = plan_step(shape(**DSV3, T=1, fmt="nvfp4"), H100)
    assert (nv.stage("gate_up").get("block_n"), nv.stage("gate_up").get("block_k")) == (16, 1024)  # H >= 4096
    assert plan_step(shape(**DSV3, T=1, fmt="nvfp4"), CPU).stage("gate_up").get("asm") is False


def test_pins_choose_or_refuse_by_name():
    s = shape(**MIXTRAL, T=8192)
    assert variants(plan_step(s, H100, options=KernelOptions(pin={"gate_up": "pointer"})))["gate_up"] == "pointer"
    assert variants(plan_step(shape(**MIXTRAL, T=8), H100,
                              options=KernelOptions(pin={"gate_up": "tma_gather_x"})))["gate_up"] == "tma_gather_x"
    with pytest.raises(PlanError, match=r"pin\['gate_up'\]='nope': no such plain variant"):
        plan_step(s, H100, options=KernelOptions(pin={"gate_up": "nope"}))
    with pytest.raises(PlanError, match="compute capability 8 < 9"):
        plan_step(s, A100, options=KernelOptions(pin={"gate_up": "tma"}))
    with pytest.raises(PlanError, match="does not run layout 'matmul'"):
        plan_step(shape(**GPTOSS, T=8, layout="matmul"), H100, options=KernelOptions(pin={"down": "tma"}))
    g = shape(**GPTOSS, T=64, fmt="mxfp4")
    with pytest.raises(PlanError, match="pin it for both"):
        plan_step(g, H100, options=KernelOptions(pin={"gate_up": "w4_gemv"}))
    p = plan_step(g, H100, options=KernelOptions(pin={"gate_up": "w4_gemv", "down": "w4_gemv"}))
    assert p.path == "gemv"


def test_options_validate_by_name():
    with pytest.raises(ValueError, match="stage 'up'"):
        KernelOptions(pin={"up": "tma"})
    with pytest.raises(TypeError, match="KernelOptions.tma"):
        KernelOptions(tma="yes")
    a, b = KernelOptions(pin={"down": "tma", "gate_up": "pointer"}), KernelOptions(pin=(("gate_up", "pointer"),
                                                                                          ("down", "tma")))
    assert a == b and hash(a) == hash(b) and a.pinned("down") == "tma"


def test_compile_refusal_is_named_in_the_plan():
    s = shape(**MIXTRAL, T=8)
    first = plan_step(s, H100)
    key = refusal_key("gate_up", "tma", first.tiles)
    p = plan_step(s, H100, compile_refused={key: "OutOfResources: shared memory"})
    assert variants(p)["gate_up"] == "pointer"
    assert ("gate_up", "tma", "did not compile here: OutOfResources: shared memory") in p.refused
    assert "did not compile here" in p.explain()


def test_plan_is_pure_and_explains_itself():
    s = shape(**DSV3, T=8192, fmt="fp8_block")
    assert plan_step(s, H100) == plan_step(s, H100)
    text = plan_step(s, H100, impl="triton_quant").explain()
    assert text.splitlines()[0].startswith("triton_quant: fp8_block bfloat16 E=256 H=7168 I=2048 K=8 T=8192")
    for word in ("fp8_gluon", "fp8_tma", "rule: H 7168 >= 4096", "PDL on"):
        assert word in text, text


def test_bad_step_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="StepShape.fmt='int4'"):
        shape(**MIXTRAL, T=1, fmt="plain").__class__(fmt="int4", dtype="bfloat16", num_experts=8, tiling_experts=8,
                                                      hidden_size=64, intermediate_size=64, top_k=2, tokens=1, pairs=2)
    with pytest.raises(ValueError, match="StepShape.hidden_size=0"):
        StepShape(fmt="plain", dtype="bfloat16", num_experts=8, tiling_experts=8, hidden_size=0,
                  intermediate_size=64, top_k=2, tokens=1, pairs=2)
    with pytest.raises(PlanError, match="block_k"):
        bad = MoETileConfig(block_m=64, gate_up=GemmTile(block_n=128, block_k=64), down=GemmTile(block_n=128, block_k=64))
        plan_step(shape(**DSV3, T=64, fmt="fp8_block"), H100, tile_config=bad)


def test_rules_are_data_and_round_trip(tmp_path):
    r = load_rules()
    assert r == KernelRules.from_dict(json.loads((ROOT / "moeflow/tuning/rules.json").read_text()))
    p = write_rules(dataclasses.replace(r, gather_x_min_pairs=4096), tmp_path / "rules.json")
    assert load_rules(p).gather_x_min_pairs == 4096
    loose = dataclasses.replace(r, gather_x_min_pairs=16)
    assert variants(plan_step(shape(**MIXTRAL, T=8), H100, rules=loose))["gate_up"] == "tma_gather_x"
    with pytest.raises(ValueError, match="pdl_gemm_trigger='late'"):
        KernelRules(pdl_gemm_trigger="late")
    with pytest.raises(ValueError, match="unknown keys"):
        KernelRules.from_dict({"gather_x": 1})


def _module_level_switches(tree: ast.Module) -> list[str]:
    out = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        for t in targets:
            if (isinstance(t, ast.Name) and t.id.isupper() and isinstance(value, ast.Constant)
                    and (value.value is None or isinstance(value.value, bool))):
                out.append(f"{t.id} = {value.value!r}")
    return out


def test_no_switches_and_no_environment_reads_in_the_package():
    """Which kernel runs is the plan's: no module-level True/False/None switch and no environment read under
    moeflow/ (the command line is moeflow/cli.py and its subcommands, which may read what a user sets)."""
    found = []
    for path in sorted((ROOT / "moeflow").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        src = path.read_text()
        tree = ast.parse(src)
        found += [f"{rel}: {s}" for s in _module_level_switches(tree)]
        if rel in ("moeflow/cli.py", "moeflow/trace_command.py", "moeflow/cli_trace.py", "moeflow/demo_ep.py",
                   "moeflow/testing.py"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"{rel}:{node.lineno}: os.{node.attr}")
    assert not found, "\n".join(found)


def test_info_kernels_prints_the_plan_per_T(capsys):
    """`moeflow info PATH --kernels --device h100`: the checkpoint's layer shape planned per T, on a CPU box."""
    from moeflow.cli import main

    rc = main(["info", str(ROOT / "moeflow/assets/tiny-moe"), "--kernels", "--device", "h100"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "kernel plan per T on NVIDIA H100 80GB HBM3" in out
    for T in (1, 8192):
        assert f"triton: plain bfloat16 E=8 H=128 I=256 K=2 T={T} " in out
    assert out.count("  gate_up ") == 6 and "not gate_up.tma_gather_x: rule: I 256 < 8192" in out
    rc = main(["info", str(ROOT / "moeflow/assets/tiny-moe"), "--kernels", "--device", "tpu"])
    assert rc == 2 and "--device 'tpu'" in capsys.readouterr().err
