"""benchmarks/tune_experts: refine_best (the stage-sum ranking's best few are re-timed whole), bi_families
(the batch-invariant families offered to verify_family), the kernel plan it times the stages of, and
--write-rules: pure logic, CPU (the fake timers receive one TritonExperts per candidate: its tile_config is
the candidate)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="refine_best imports moeflow.experts.triton")


def _candidate(fn):
    """The tile configuration a refine_best timing function runs (its impl, bound as the first default)."""
    impl = fn.__defaults__[0]
    import benchmarks.tune_experts as te

    assert impl.options == te.OPTIONS, "refine_best times the kernels the run's KernelOptions choose"
    return impl.tile_config


@needs_triton
def test_refine_keeps_the_fastest_whole_step(monkeypatch):
    import benchmarks.tune_experts as te
    from moeflow.tuning import GemmTile, MoETileConfig

    def cfg(bm, bn):
        t = GemmTile(block_n=bn, block_k=64, num_warps=4, num_stages=3)
        return MoETileConfig(block_m=bm, gate_up=t, down=t)

    a, b, c = cfg(32, 128), cfg(16, 64), cfg(16, 32)
    whole = {a: 9e-6, b: 7e-6}  # the stage sums ranked a first; whole steps put b first; c is refused
    seen = []

    def fake_many(fns, reps, log):
        cfgs = {k: _candidate(fn) for k, fn in fns.items()}
        seen.extend(cfgs.values())
        log(": cannot capture")
        return {k: whole[c_] for k, c_ in cfgs.items() if c_ != c}

    monkeypatch.setattr(te, "time_many", fake_many)
    logs = []
    out = te.refine_best(te.shape_spec("tiny-silu"), {1: [(1e-6, a), (2e-6, b), (3e-6, c)]}, reps=2,
                         log=logs.append, dtype=__import__("torch").float32)
    assert seen == [a, b, c]  # BM 32 / 16: no half-tile variants
    best, t, first = out[1]
    assert best == b and t == 7e-6 and first == 9e-6
    assert any("cannot capture" in m for m in logs) and any("against 9.0 us" in m for m in logs)


@needs_triton
def test_refine_times_half_tiles(monkeypatch):
    """with_half adds each BM 64 / 128 candidate with half tiles after the ranked ones; refine keeps a
    half-tile config when its whole step is fastest, and half=False leaves them out."""
    import dataclasses

    import benchmarks.tune_experts as te
    from moeflow.tuning import GemmTile, MoETileConfig

    t = GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=3)
    a = MoETileConfig(block_m=128, gate_up=t, down=t)
    b = MoETileConfig(block_m=16, gate_up=t, down=t)
    ah = dataclasses.replace(a, half_tail=True)
    assert te.with_half([(1.0, a), (2.0, b)]) == [(1.0, a), (2.0, b), (1.0, ah)]
    assert te.with_half([(1.0, ah)]) == [(1.0, ah)]
    whole = {a: 9e-6, b: 9.5e-6, ah: 8e-6}
    monkeypatch.setattr(te, "time_many", lambda fns, reps, log: {k: whole[_candidate(fn)] for k, fn in fns.items()})
    kw = dict(reps=2, log=lambda m: None, dtype=__import__("torch").float32)
    out = te.refine_best(te.shape_spec("tiny-silu"), {7: [(1e-6, a), (2e-6, b)]}, **kw)
    assert out[7][0] == ah and out[7][1] == 8e-6
    out = te.refine_best(te.shape_spec("tiny-silu"), {7: [(1e-6, a), (2e-6, b)]}, half=False, **kw)
    assert out[7][0] == a


@needs_triton
def test_refine_times_the_other_down_form(monkeypatch):
    """with_flat adds each one-split candidate with the down GEMM form the plan's rule would not give it
    (flat_down=True, or False where the rule runs it flat) on TMA shapes, none on interleaved / biased ones;
    refine keeps the flat config when its whole step is fastest, and flat=False leaves it out."""
    import dataclasses

    import torch

    import benchmarks.tune_experts as te
    from moeflow.tuning import GemmTile, MoETileConfig

    t = GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=3)
    lin = te.shape_spec("tiny-silu")
    assert lin["layout"] == "linear" and not lin["interleaved"] and not lin["bias"]
    small = MoETileConfig(block_m=16, gate_up=t, down=t)                  # the rule: tiled
    full = MoETileConfig(block_m=128, gate_up=t, down=t)                  # the rule: flat at I <= 16 * 64
    split = MoETileConfig(block_m=16, gate_up=t, down=dataclasses.replace(t, split_k=2))  # no TMA down
    assert lin["I"] <= 16 * 64
    got = te.with_flat([(1.0, small), (2.0, full), (3.0, split)], lin)
    assert got == [(1.0, small), (2.0, full), (3.0, split), (1.0, dataclasses.replace(small, flat_down=True)),
                   (2.0, dataclasses.replace(full, flat_down=False))]
    assert te.with_flat(got, lin)[len(got):] == got[3:]  # explicit choices are not flipped again
    assert te.with_flat([(1.0, small)], te.shape_spec("tiny-gptoss")) == [(1.0, small)]  # interleaved, biased
    sf = dataclasses.replace(small, flat_down=True)
    whole = {small: 9e-6, sf: 8e-6}
    monkeypatch.setattr(te, "time_many", lambda fns, reps, log: {k: whole[_candidate(fn)] for k, fn in fns.items()})
    monkeypatch.setattr(te, "tma_wanted", lambda dev: True)
    kw = dict(reps=2, log=lambda m: None, dtype=torch.float32, half=False)
    assert te.refine_best(lin, {7: [(1e-6, small)]}, **kw)[7][0] == sf
    assert te.refine_best(lin, {7: [(1e-6, small)]}, flat=False, **kw)[7][0] == small
    monkeypatch.setattr(te, "tma_wanted", lambda dev: False)  # no TMA: no flat candidates
    assert te.refine_best(lin, {7: [(1e-6, small)]}, **kw)[7][0] == small


@needs_triton
def test_merge_replace_bi():
    """merge_into keeps the old batch-invariant entries unless replace_bi, then takes the run's."""
    import benchmarks.tune_experts as te
    from moeflow.tuning import GemmTile, MoETileConfig

    t = GemmTile(block_n=64, block_k=64)
    old_bi, new_bi = MoETileConfig(block_m=64, gate_up=t, down=t), MoETileConfig(block_m=128, gate_up=t, down=t)
    old = {"configs": {1: old_bi}, "batch_invariant": old_bi, "batch_invariant_by_T": {1: old_bi}}
    _, bi, by_t = te.merge_into(old, {8: new_bi}, new_bi, {1: new_bi})
    assert bi == old_bi and by_t == {1: old_bi}
    _, bi, by_t = te.merge_into(old, {8: new_bi}, new_bi, {1: new_bi}, replace_bi=True)
    assert bi == new_bi and by_t == {1: new_bi}
    _, bi, by_t = te.merge_into(old, {8: new_bi}, None, None, replace_bi=True)
    assert bi == old_bi and by_t == {1: old_bi}  # nothing new: the old entries stay


@needs_triton
def test_bm_range_offers_128_rows_from_half_full_blocks():
    """bm_range: BM 128 is tried once an expert holds more than 48 rows on average (half tiles make
    it pay from there); fewer rows keep the small heights only."""
    import benchmarks.tune_experts as te

    assert te.bm_range(2048, 8, 256, quick=False) == [16, 32, 64, 128]  # deepseek-v3: 64 rows per expert
    assert te.bm_range(1024, 8, 256, quick=False) == [16, 32, 64]  # 32 rows per expert
    assert te.bm_range(8192, 8, 128, quick=False) == [64, 128]


def test_bi_families_free_bk_and_order():
    """bi_families: one family per (gate_up BK, down BK) and a free-BK one, one split only, best worst
    ratio first; the free-BK family is never worse than a fixed one (it picks from a superset)."""
    from benchmarks.tune_experts import bi_families
    from moeflow.tuning import GemmTile, MoETileConfig

    bks = {0: 64, 1: 128}

    def to_cfg(bm, gi, di, s):
        return MoETileConfig(block_m=bm, gate_up=GemmTile(block_n=64, block_k=bks[gi]),
                             down=GemmTile(block_n=64, block_k=bks[di], split_k=s))

    combos = [(64, gi, di, s) for gi in (0, 1) for di in (0, 1) for s in (1, 2)]
    # T=1: BK 64 everywhere is fastest; T=8192: BK 128 everywhere; split 2 fastest of all at T=1
    times = {(1, 0, 0, 1): 10.0, (1, 1, 1, 1): 14.0, (1, 0, 1, 1): 12.0, (1, 1, 0, 1): 12.0, (1, 0, 0, 2): 8.0,
             (8192, 0, 0, 1): 130.0, (8192, 1, 1, 1): 100.0, (8192, 0, 1, 1): 115.0, (8192, 1, 0, 1): 115.0}

    def total(T, bm, gi, di, s):
        return times.get((T, gi, di, s))

    best = {1: (to_cfg(64, 0, 0, 2), 8.0), 8192: (to_cfg(64, 1, 1, 1), 100.0)}
    fams = bi_families([1, 8192], combos, best, total, to_cfg)
    labels = [f[3] for f in fams]
    assert sorted(labels) == ["BK 128 / 128", "BK 128 / 64", "BK 64 / 128", "BK 64 / 64", "free BK"]
    assert labels[0] == "free BK" and fams[0][1] == 10.0 / 8.0  # T=1 BK 64 (10 / 8), T=8192 BK 128 (1.0)
    assert [f[1] for f in fams] == sorted(f[1] for f in fams)
    free = fams[0][0]
    assert free[1].gate_up.block_k == 64 and free[8192].gate_up.block_k == 128
    assert all(c.down.split_k == 1 for f in fams for c in f[0].values())  # never the split-2 best


def test_balanced_routing_gives_every_expert_the_same_rows():
    import torch

    import benchmarks.tune_experts as tune

    T, E, K = 96, 16, 4
    ids, wts = tune.routing(T, E, K, "balanced", "cpu")
    assert ids.dtype == torch.int32 and ids.shape == (T, K) and wts.shape == (T, K)
    assert all(len(set(row.tolist())) == K for row in ids)  # distinct experts per token
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert counts.tolist() == [T * K // E] * E
    torch.testing.assert_close(wts.sum(1), torch.ones(T))
    with pytest.raises(ValueError, match="top_k 20 > num_experts 16"):
        tune.routing(T, E, 20, "balanced", "cpu")
    with pytest.raises(ValueError, match="'uniform', 'zipf' or 'balanced'"):
        tune.routing(T, E, K, "skewed", "cpu")


def test_the_tuners_flat_rule_is_the_plans():
    """with_flat flips the down form the plan would run (`_flat_by_rule` mirrors the plan's rule,
    KernelRules.flat_down_max_k_steps): for every one-split candidate of DOWN on an H100 at the standard
    shapes' I, the tuner's call equals the variant the plan picks (pure Python)."""
    import benchmarks.tune_experts as te
    from moeflow.experts.plan import NAMED_DEVICES, StepShape, plan_step
    from moeflow.tuning import MoETileConfig

    h100 = NAMED_DEVICES["h100"]
    checked = 0
    for I in (768, 1024, 2048, 14336):
        s = StepShape(fmt="plain", dtype="bfloat16", num_experts=8, tiling_experts=8, hidden_size=4096,
                      intermediate_size=I, top_k=2, tokens=4096, pairs=8192)
        for bm, tiles in te.DOWN.items():
            for t in tiles:
                for half in ((False, True) if bm >= 64 else (False,)):
                    c = MoETileConfig(block_m=bm, gate_up=te.GATE_UP[bm][0], down=t, half_tail=half)
                    down = plan_step(s, h100, tile_config=c).stage("down")
                    if down.variant not in ("tma", "tma_flat"):
                        continue  # a tile the TMA down cannot run: no flat form to flip
                    assert te._flat_by_rule(c, I) == (down.variant == "tma_flat"), (I, c, down.why)
                    checked += 1
    assert checked > 50, checked


@needs_triton
def test_staged_plans_with_the_runs_options(monkeypatch):
    """staged(): the plan of one step with the candidate's tiles and the run's KernelOptions (--tma / --no-tma),
    and StepBuffers sized by it (E overridden for the alignment and combine of proxy weights); tma_wanted is
    what that plan runs."""
    import torch

    import benchmarks.tune_experts as te
    from moeflow.experts.options import KernelOptions
    from moeflow.tuning import GemmTile, MoETileConfig

    spec = te.shape_spec("tiny-silu")
    w = te.make_weights(spec, "cpu", dtype=torch.float32, num_experts=2)
    t = GemmTile(block_n=16, block_k=16, num_stages=1)
    tc = MoETileConfig(block_m=16, gate_up=t, down=t)
    x = torch.randn(3, spec["H"])
    cpu = torch.device("cpu")
    assert not te.tma_wanted(cpu)
    plan, b = te.staged(w, x, 3, spec["K"], tc, cpu, num_experts=spec["E"])
    assert plan.tiles == tc and plan.options == te.OPTIONS and plan.stage("gate_up").variant == "pointer"
    assert b.E == spec["E"] and b.sorted_P.numel() == plan.padded and b.y_SNH.shape == (1, 3 * spec["K"], spec["H"])
    monkeypatch.setattr(te, "OPTIONS", KernelOptions(tma=True))
    assert te.tma_wanted(cpu)
    plan, b2 = te.staged(w, x, 3, spec["K"], tc, cpu, buffers=b)
    assert b2 is b and plan.stage("gate_up").variant == "tma" and plan.stage("down").variant == "tma"
    assert not te.tma_wanted(cpu, KernelOptions(tma=False))


def test_write_rules_updates_the_named_thresholds(tmp_path, monkeypatch, capsys):
    """--write-rules NAME=VALUE,...: the named KernelRules fields change in rules.json, the others are kept; a
    malformed item or an unknown name is refused (exit 2) and writes nothing."""
    import json

    import benchmarks.tune_experts as te
    import moeflow.tuning.rules as R

    path = tmp_path / "rules.json"
    path.write_text(R.RULES_PATH.read_text())
    monkeypatch.setattr(R, "RULES_PATH", path)
    before = R.load_rules()
    assert te.main(["--write-rules", "gather_x_min_pairs=4096,pdl_gemm_trigger=early"]) == 0
    after = R.load_rules()
    assert (after.gather_x_min_pairs, after.pdl_gemm_trigger) == (4096, "early")
    assert after == __import__("dataclasses").replace(before, gather_x_min_pairs=4096, pdl_gemm_trigger="early")
    assert json.loads(path.read_text())["gather_x_min_pairs"] == 4096
    text = path.read_text()
    assert te.write_rules_arg("gather_x_min_pairs") == 2
    assert te.write_rules_arg("no_such_rule=3") == 2
    assert te.write_rules_arg("pdl_gemm_trigger=late") == 2
    assert path.read_text() == text
    err = capsys.readouterr().err
    assert "expected NAME=VALUE" in err and "no_such_rule" in err and "'late'" in err
