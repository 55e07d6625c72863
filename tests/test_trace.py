"""Routing traces: hand-checked replays, Belady, file round trip, statistics, live-cache agreement.

Legend: L layers, E experts per layer, K picks per token, S slots, W prediction width.
A key is (layer, expert); a step is one layer of one pass.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from moeflow.cli_trace import main as trace_main
from moeflow.offload.attach import attach_offload
from moeflow.offload.config import OffloadConfig
from moeflow.offload.trace import Step, Trace, record_trace, replay, trace_stats
from moeflow.testing import assert_bitwise_equal


def _cyclic_trace() -> Trace:
    """L=2, E=4, K=1, four decode passes: layer0/layer1 use expert 0, 1, 0, 1 in turn.

    Keys in order: (0,0) (1,0) (0,1) (1,1) (0,0) (1,0) (0,1) (1,1).
    """
    t = Trace(num_layers=2, num_experts=[4, 4], top_k=[1, 1], pred_width=0, expert_bytes=1000)
    for p, e in enumerate([0, 1, 0, 1]):
        t.steps.append(Step(p, 0, [[e]]))
        t.steps.append(Step(p, 1, [[e]]))
    return t


def test_replay_lru_on_a_cycle_larger_than_the_cache():
    # S=2 holds two keys; the cycle has four. LRU always evicts exactly the key needed
    # two steps later: 8 misses, 0 hits.
    r = replay(_cyclic_trace(), 2, "lru")
    assert (r.hits, r.misses, r.bytes_copied) == (0, 8, 8000)
    assert r.tokens == 4 and r.steps == 8
    # S=4 holds the whole cycle: 4 cold misses, then 4 hits.
    r = replay(_cyclic_trace(), 4, "lru")
    assert (r.hits, r.misses) == (4, 4)


def test_replay_belady_by_hand():
    # S=2, Belady (evict the key whose next use is furthest; never-again first):
    #  s0 (0,0) miss [free]          cache {(0,0)}
    #  s1 (1,0) miss [free]          cache {(0,0),(1,0)}
    #  s2 (0,1) miss: (0,0) next s4, (1,0) next s5 -> evict (1,0); cache {(0,0),(0,1)}
    #  s3 (1,1) miss: (0,0) next s4, (0,1) next s6 -> evict (0,1); cache {(0,0),(1,1)}
    #  s4 (0,0) hit
    #  s5 (1,0) miss: (0,0) never, (1,1) next s7 -> evict (0,0);   cache {(1,0),(1,1)}
    #  s6 (0,1) miss: (1,0) never, (1,1) next s7 -> evict (1,0);   cache {(0,1),(1,1)}
    #  s7 (1,1) hit
    # -> 2 hits, 6 misses (LRU: 0 hits).
    r = replay(_cyclic_trace(), 2, "belady")
    assert (r.hits, r.misses) == (2, 6)
    for policy in ("lru", "random_oldest", "predictive"):
        assert replay(_cyclic_trace(), 2, policy).misses >= r.misses


def _prefetch_trace() -> Trace:
    """L=2, E=4, K=1, W=1. Pass 0: l0 [0] predicts l1 [0] (right); pass 1: l0 [1] predicts [2] (wrong)."""
    t = Trace(num_layers=2, num_experts=[4, 4], top_k=[1, 1], pred_width=1, expert_bytes=10)
    t.steps = [Step(0, 0, [[0]], [[0]]), Step(0, 1, [[0]], None),
               Step(1, 0, [[1]], [[2]]), Step(1, 1, [[1]], None)]
    return t


def test_replay_prefetch_by_hand():
    # S=3, LRU, prefetch width 1; a prefetched expert enters at the LRU end (order below is
    # oldest first) and moves up when used:
    #  s0: acquire (0,0) miss -> slot0; prefetch (1,0) -> free slot1     order (1,0) (0,0)
    #  s1: acquire (1,0) hit: a used prefetch                            order (0,0) (1,0)
    #  s2: acquire (0,1) miss -> free slot2                              order (0,0) (1,0) (0,1)
    #      prefetch (1,2): no free slot; (0,1) pinned, (1,2) protected -> evict LRU (0,0)
    #                                                                    order (1,2) (1,0) (0,1)
    #  s3: acquire (1,1) miss -> evicts the LRU, the unused guess (1,2): a wasted prefetch
    # -> hits 1, misses 3, issued 2, used 1, wasted 1, bytes (3 + 2) * 10.
    r = replay(_prefetch_trace(), 3, "lru", prefetch=1, prefetch_rule="always")
    assert (r.hits, r.misses, r.prefetch_issued, r.prefetch_used, r.prefetch_wasted) == (1, 3, 2, 1, 1)
    assert r.bytes_copied == 50
    assert r.prefetch_recall == pytest.approx(1 / 4)  # used / (used + misses)
    assert r.prefetch_precision == pytest.approx(1 / 2)
    # without prefetch: 4 misses
    assert replay(_prefetch_trace(), 3, "lru").misses == 4


def test_replay_pins_a_whole_step():
    # K=2, S=2: every step needs both slots; alternating pairs -> all misses; repeated -> hits.
    t = Trace(num_layers=1, num_experts=[4], top_k=[2])
    t.steps = [Step(i, 0, [[0, 1] if i % 2 == 0 else [2, 3]]) for i in range(4)]
    assert (replay(t, 2, "lru").hits, replay(t, 2, "lru").misses) == (0, 8)
    assert (replay(t, 4, "lru").hits, replay(t, 4, "lru").misses) == (4, 4)
    with pytest.raises(ValueError, match="slots=1"):
        replay(t, 1, "lru")
    with pytest.raises(ValueError, match="policy='mru'"):
        replay(t, 2, "mru")
    with pytest.raises(ValueError, match="prefetch=1"):
        replay(t, 2, "lru", prefetch=1)  # the trace recorded no predictions


def test_trace_roundtrip_decode_view_and_stats(tmp_path):
    t = _prefetch_trace()
    for name in ("t.jsonl", "t.jsonl.gz"):
        t.save(tmp_path / name)
        u = Trace.load(tmp_path / name)
        assert [(s.pass_idx, s.layer, s.ids, s.pred) for s in u.steps] == \
               [(s.pass_idx, s.layer, s.ids, s.pred) for s in t.steps]
        assert (u.num_layers, u.num_experts, u.top_k, u.pred_width, u.expert_bytes) == (2, [4, 4], [1, 1], 1, 10)
    (tmp_path / "bad.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(ValueError, match="not a moeflow trace header"):
        Trace.load(tmp_path / "bad.jsonl")
    # a prefill pass of 2 tokens splits into 2 decode passes, token-major
    p = Trace(num_layers=2, num_experts=[4, 4], top_k=[1, 1], pred_width=1)
    p.steps = [Step(0, 0, [[0], [1]], [[0], [3]]), Step(0, 1, [[0], [2]], None)]
    d = p.as_decode()
    assert [(s.pass_idx, s.layer, s.ids) for s in d.steps] == [(0, 0, [[0]]), (0, 1, [[0]]),
                                                                (1, 0, [[1]]), (1, 1, [[2]])]
    st = trace_stats(t)
    # predictions of layer 1: pass 0 right, pass 1 wrong -> recall@K = 1/2
    assert st["recall_at_K"] == pytest.approx(0.5) and st["recall_at_2K"] is None
    # consecutive tokens: layer 0 [0] -> [1], layer 1 [0] -> [1]: no reuse
    assert st["reuse_consecutive"] == 0.0
    assert st["load_skew"]["0"]["loads"] == [1, 1, 0, 0]


def test_cli_replay_prints_a_table(tmp_path, capsys):
    _cyclic_trace().save(tmp_path / "c.jsonl")
    out_json = tmp_path / "r.json"
    assert trace_main(["replay", str(tmp_path / "c.jsonl"), "--slots", "2", "4", "--policy", "lru", "belady",
                       "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "belady" in text and "hit_rate" in text
    rows = json.loads(out_json.read_text())
    assert [(r["policy"], r["slots"], r["misses"]) for r in rows] == [("lru", 2, 8), ("belady", 2, 6),
                                                                        ("lru", 4, 4), ("belady", 4, 4)]
    assert trace_main(["stats", str(tmp_path / "c.jsonl")]) == 0
    assert "reuse" in capsys.readouterr().out
    assert trace_main(["stats", str(tmp_path / "c.jsonl"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reuse_consecutive"] == 0.0


@pytest.mark.parametrize("policy, prefetch", [("lru", 0), ("random_oldest", 2), ("predictive", 0),
                                              ("predictive", 3)])
def test_replay_of_a_recorded_trace_matches_the_live_cache(policy, prefetch):
    """Record the routing of an offloaded model; replaying it gives the live cache's exact counts."""
    from tests.test_offload_model import _inputs, _model, _run

    with torch.no_grad():
        ref = _model("deepseek", seed=7)
        off = copy.deepcopy(ref)
        cfg = OffloadConfig(gpu_slots=5, policy=policy, prefetch_width=prefetch,
                            prefetch_rule="always", device="cpu", seed=3,
                            oldest_fraction=0.5)
        rt = attach_offload(list(off), cfg, progress=False)
        seq, _ = _inputs(4, n_decode=16)
        with record_trace(off, width=4) as rec:
            for x in seq:
                assert_bitwise_equal(_run(off, x), _run(ref, x))
    trace = rec.trace
    assert len(trace.steps) == 16 * 4 and trace.pred_width == 4
    assert all(s.pred is None for s in trace.steps if s.layer == 3)
    assert [s.ids for s in trace.steps[-4:]] == [m.last_routing.ids_TK.tolist() for m in off]
    r = replay(trace, 5, policy, prefetch, seed=3, oldest_fraction=0.5, prefetch_rule="always")
    s = rt.stats()
    assert (r.hits, r.misses, r.prefetch_issued, r.prefetch_used, r.prefetch_wasted) == \
           (s.hits, s.misses, s.prefetch_issued, s.prefetch_used, s.prefetch_wasted)
    assert r.bytes_copied == s.bytes_copied


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=[4]), r"Trace.num_experts=\[4\]: expected a list of num_layers=2 ints >= 1"),
    (dict(top_k=[1, 5]), r"Trace.top_k\[1\]=5: exceeds the layer's 4 \+ 0 experts"),
    (dict(expert_bytes=-1), r"Trace.expert_bytes=-1: expected an int in \[0, "),
    (dict(pred_width=1.5), "Trace.pred_width=1.5"),
    (dict(num_layers=0), "Trace.num_layers=0"),
    (dict(num_zero_experts=[0]), r"Trace.num_zero_experts=\[0\]"),
])
def test_trace_header_is_validated_at_construction(kwargs, match):
    base = dict(num_layers=2, num_experts=[4, 4], top_k=[1, 1])
    with pytest.raises(ValueError, match=match):
        Trace(**{**base, **kwargs})


@pytest.mark.parametrize("step, match", [
    (Step(0, 0, [[99]]), r"step 0: ids\[0\]: expert id 99, expected an int in \[0, 4\)"),
    (Step(0, 0, [[-1]]), "expert id -1"),
    (Step(0, 0, [[1.5]]), "expert id 1.5"),
    (Step(0, 0, [[True]]), "expert id True"),
    (Step(0, 0, [[0, 1]]), "2 ids, expected K=1 ids"),
    (Step(0, 2, [[0]]), r"layer 2 outside \[0, 2\)"),
    (Step(-1, 0, [[0]]), "pass -1"),
    (Step(0, 0, []), "expected a list of T >= 1 rows"),
    (Step(0, 1, [[0]], [[1]]), "pred given, but the header's pred_width is 0"),
])
def test_replay_refuses_a_corrupt_step(step, match):
    t = Trace(num_layers=2, num_experts=[4, 4], top_k=[1, 1])
    t.steps = [step]
    with pytest.raises(ValueError, match=match):
        replay(t, 2, "lru")


def test_trace_predictions_and_pass_rows_are_validated():
    t = Trace(num_layers=2, num_experts=[4, 4], top_k=[1, 1], pred_width=2)
    t.steps = [Step(0, 1, [[0]], [[1, 2]])]
    with pytest.raises(ValueError, match="pred given for the last layer 1"):
        t.validate()
    t.steps = [Step(0, 0, [[0]], [[1]])]
    with pytest.raises(ValueError, match=r"pred\[0\]=\[1\]: 1 ids, expected pred_width=2"):
        t.validate()
    t.steps = [Step(0, 0, [[0]], [[1, 4]])]
    with pytest.raises(ValueError, match=r"expert id 4, expected an int in \[0, 4\)"):
        t.validate()
    t.steps = [Step(0, 0, [[0], [1]], None), Step(0, 1, [[0]], None)]
    with pytest.raises(ValueError, match="step 1: 1 token rows, but pass 0 has T=2"):
        t.validate()


def test_trace_load_names_the_line(tmp_path):
    head = {"moeflow_trace": 1, "num_layers": 1, "num_experts": [4], "top_k": [2]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(head) + '\n{"p":0,"l":0,"ids":[[0,1]]}\n{"p":1,"l":0,"ids":[[0,99]]}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:3: ids\[0\]: expert id 99"):
        Trace.load(path)
    path.write_text(json.dumps({**head, "num_experts": [4, 4]}) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:1: Trace.num_experts=\[4, 4\]"):
        Trace.load(path)
    path.write_text(json.dumps(head) + "\nnot json\n")
    with pytest.raises(ValueError, match="t.jsonl:2: not JSON"):
        Trace.load(path)
    with pytest.raises(ValueError, match="is a directory"):
        Trace.load(tmp_path)


def test_zero_expert_ids_are_valid_and_round_trip(tmp_path):
    # LongCat: ids >= E are zero experts (no weights, never cached); they are legal trace ids.
    t = Trace(num_layers=1, num_experts=[4], top_k=[2], num_zero_experts=[2])
    t.steps = [Step(0, 0, [[0, 5]]), Step(1, 0, [[4, 1]])]
    t.save(tmp_path / "z.jsonl")
    u = Trace.load(tmp_path / "z.jsonl")
    assert u.num_zero_experts == [2] and u.as_decode().num_zero_experts == [2]
    r = replay(u, 2, "lru")
    assert (r.hits, r.misses) == (0, 2)  # (0,0) and (0,1); the zero experts cost nothing


# ---- size claims, file kinds, argument bounds -------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=[10**9, 4]), r"Trace.num_experts\[0\]=1000000000 \(\+ 0 zero experts\): expected at most 65536"),
    (dict(num_zero_experts=[0, 70_000]), r"Trace.num_experts\[1\]=4 \(\+ 70000 zero experts\)"),
    (dict(num_layers=5000, num_experts=[4] * 5000, top_k=[1] * 5000), r"Trace.num_layers=5000: expected an int in \[1, 4096\]"),
    (dict(num_layers=32, num_experts=[60_000] * 32, top_k=[1] * 32), r"Trace.num_experts: 1920000 experts over 32 layers"),
    (dict(pred_width=5), r"Trace.pred_width=5: expected an int in \[0, 4\]"),
    (dict(expert_bytes=10**30), r"Trace.expert_bytes=10{30}"),
])
def test_trace_header_size_claims_are_bounded(kwargs, match):
    base = dict(num_layers=2, num_experts=[4, 4], top_k=[1, 1])
    with pytest.raises(ValueError, match=match):
        Trace(**{**base, **kwargs})


def test_check_replay_bounds_every_argument():
    from moeflow.offload.trace import check_replay

    t = _prefetch_trace()  # E = 4 per layer, 2 layers: 8 experts in all; K = 1, W = 1
    for kwargs, match in [(dict(slots=9), r"slots=9: expected an int in \[1, 8\]"),
                          (dict(slots=10**11), "slots=100000000000"),
                          (dict(slots=2, prefetch=2), "prefetch=2: expected 0..1"),
                          (dict(slots=2, predict_width=0), r"predict_width=0: expected an int in \[1, 1\]"),
                          (dict(slots=2, predict_width=2), "predict_width=2"),
                          (dict(slots=2, policy="mru"), "policy='mru'")]:
        with pytest.raises(ValueError, match=match):
            check_replay(t, **kwargs)
        with pytest.raises(ValueError, match=match):
            replay(t, **kwargs)
    with pytest.raises(ValueError, match="the trace recorded no predictions"):
        check_replay(_cyclic_trace(), 2, "predictive", predict_width=1)
    check_replay(t, 8, "adaptive_long", 1, predict_width=1)  # the largest of each is accepted


def test_replay_per_pass_bytes_add_up():
    rates, copied = [], []
    r = replay(_prefetch_trace(), 3, "lru", prefetch=1, prefetch_rule="always", per_pass=rates,
               per_pass_bytes=copied)
    assert len(rates) == len(copied) == 2
    assert sum(copied) == r.bytes_copied == 50


def test_prediction_width_refuses_more_than_the_experts():
    from moeflow.offload.trace import prediction_width

    assert prediction_width(None, [2, 2], [8, 3]) == 3  # the default, 2K, fits the fewest experts
    assert prediction_width(0, [2], [8]) == 0
    with pytest.raises(ValueError, match=r"width=100: expected an int in \[0, 8\]"):
        prediction_width(100, [2], [8])
    with pytest.raises(ValueError, match="width=-1"):
        prediction_width(-1, [2], [8])


def test_trace_load_reads_only_bounded_regular_files(tmp_path):
    import gzip
    import os

    from moeflow.offload.trace import MAX_LINE_CHARS, is_trace_file
    from moeflow.paths import PathError

    _cyclic_trace().save(tmp_path / "t.jsonl")
    header = (tmp_path / "t.jsonl").read_text().splitlines()[0]
    assert is_trace_file(tmp_path / "t.jsonl") and not is_trace_file(tmp_path)
    big = tmp_path / "big.jsonl.gz"
    big.write_bytes(gzip.compress((header + "\n" + "[" + " " * MAX_LINE_CHARS + "]\n").encode(), compresslevel=1))
    with pytest.raises(ValueError, match=f"big.jsonl.gz:2: line longer than {MAX_LINE_CHARS} characters"):
        Trace.load(big)
    deep = tmp_path / "deep.jsonl"
    deep.write_text(header + "\n" + "[" * 200_000 + "]" * 200_000 + "\n")
    with pytest.raises(ValueError, match="deep.jsonl:2: not JSON \\(JSON nested too deeply to parse\\)"):
        Trace.load(deep)
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(PathError, match="trace '.*fifo' is a FIFO, expected a regular file"):
            Trace.load(tmp_path / "fifo")  # refused before open(), which would block
        assert not is_trace_file(tmp_path / "fifo")
