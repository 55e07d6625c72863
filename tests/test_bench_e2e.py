"""benchmarks/bench_e2e.py: its tiny CPU mode runs and writes sane JSON; its trace parsing on a synthetic CUDA trace."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b"}


def test_tiny_cpu_run_writes_sane_json(tmp_path):
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    cmd = [sys.executable, "benchmarks/bench_e2e.py", "--cpu", "--tiny", "--out", str(out), "--md", str(md),
           "--time-budget-s", "90", "--variants", "hf,auto,triton_bi,no_moe"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    meta, rows = data["meta"], data["rows"]
    for key in ("date", "device", "torch", "transformers", "triton", "command", "shapes", "skipped", "stopped"):
        assert key in meta, key
    assert "--tiny" in meta["command"]
    assert set(meta["shapes"]) == SHAPES
    for name, sm in meta["shapes"].items():
        assert sm["layers"] == 2, name
        assert sm["hf_experts_implementation"], name
        assert "reference" in sm, name
    for r in rows:
        assert {"shape", "variant", "metric", "value", "status"} <= set(r), r
        if r["status"] == "ok" and isinstance(r["value"], float):
            assert math.isfinite(r["value"]), r

    def ok(shape, variant, metric, **kw):
        return [r for r in rows if r["shape"] == shape and r["variant"] == variant and r["metric"] == metric
                and r["status"] == "ok" and all(r.get(k) == v for k, v in kw.items())]

    skipped = {(s["shape"], s["point"], s.get("T"), s.get("batch")) for s in meta["skipped"]}
    for shape in SHAPES:
        for variant in ("hf", "auto"):
            # tier 1 (prefill at the largest T <= 2048, decode b1) always runs; tier 2 may be cut by the budget
            assert ok(shape, variant, "prefill_tok_s", T=64)[0]["value"] > 0
            if (shape, "prefill", 16, None) not in skipped:
                assert ok(shape, variant, "prefill_tok_s", T=16)[0]["value"] > 0
            for B in (1, 4):
                if (shape, "decode", None, B) in skipped:
                    continue
                assert ok(shape, variant, "generate_tok_s", batch=B)[0]["value"] > 0
                dec = [r for r in rows if r["shape"] == shape and r["variant"] == variant
                       and r["metric"] == "decode_tok_s" and r.get("batch") == B]
                # t(N) - t(1) can come out <= 0 on a noisy CPU: then n/a with both times, never a guess
                assert len(dec) == 1 and (dec[0]["value"] > 0 if dec[0]["status"] == "ok"
                                          else dec[0]["status"].startswith("n/a: t(generate")), dec
            rel = ok(shape, variant, "logits_rel_l2")[0]["value"]
            assert 0 <= rel < 1e-4, (shape, variant, rel)  # fp32 on CPU: the same model, up to rounding
            assert ok(shape, variant, "top1_agree")[0]["value"] > 0.9
            parts = {r["part"]: r for r in rows if r["shape"] == shape and r["variant"] == variant
                     and r["metric"] == "layer_ms"}
            assert set(parts) == {"router", "experts", "shared", "moe_glue", "rest"}
            for part in ("router", "experts", "rest"):
                assert parts[part]["status"] == "ok" and parts[part]["value"] > 0, (shape, variant, part)
            # only deepseek-v3 has a shared expert; elsewhere the part is n/a, not a guess
            assert parts["shared"]["status"].startswith("ok" if shape == "deepseek-v3" else "n/a"), shape
            assert ok(shape, variant, "syncs_per_prefill")[0]["value"] == 0  # CPU: no CUDA runtime calls
            assert ok(shape, variant, "syncs_per_decode_token", batch=1)
        assert ok(shape, "auto", "decode_tokens_equal_hf", batch=1)[0]["value"] == 1.0
        # the Triton variant cannot run on the CPU: recorded as an error, and the run went on
        bi = [r for r in rows if r["shape"] == shape and r["variant"] == "triton_bi"]
        assert bi and all(r["status"].startswith("error") for r in bi)
        # no_moe: prefill and decode rows only (the rest of the model's time), no token comparison, and
        # the blocks came back after it (every later hf / auto point above ran on the real blocks:
        # auto's tokens equal hf's)
        floor = [r for r in rows if r["shape"] == shape and r["variant"] == "no_moe"]
        assert {"prefill_tok_s", "generate_tok_s"} <= {r["metric"] for r in floor}, floor
        assert {r["metric"] for r in floor} <= {"prefill_tok_s", "prefill_ms", "generate_tok_s", "decode_tok_s",
                                                "decode_ms_per_step"}, floor
        assert all(r["status"] == "ok" and r["value"] > 0 for r in floor if r["metric"] != "decode_tok_s"), floor
        assert meta["shapes"][shape]["variant_impl"]["no_moe"].startswith("none"), shape
    text = md.read_text()
    assert "| qwen3-30b-a3b | 2 | auto |" in text and "×" in text


def test_rounds_repeat_the_timed_points_round_robin(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, "benchmarks/bench_e2e.py", "--cpu", "--tiny", "--out", str(out), "--shapes", "mixtral-8x7b",
           "--points", "prefill", "--prefill-T", "16", "--variants", "hf,auto", "--rounds", "2", "--repeats", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if r["metric"] == "prefill_tok_s"]
    assert [(r["variant"], r["round"]) for r in rows] == [("hf", 0), ("auto", 0), ("hf", 1), ("auto", 1)], rows
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_e2e import _index

    key = ("mixtral-8x7b", "hf", "prefill_tok_s", 16, None, None)
    vals = sorted(r["value"] for r in rows if r["variant"] == "hf")
    assert _index(rows)[key] == (vals[0] + vals[1]) / 2  # the median of the two rounds


def _synthetic_cuda_trace():
    """A forward with one MoE block: ranges on the CPU thread, launches, kernels, a sync and a D2H copy."""
    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}

    ev = [x("user_annotation", "e2e::forward", 0, 1000), x("user_annotation", "e2e::moe_block", 100, 400),
          x("user_annotation", "e2e::router", 110, 90), x("user_annotation", "e2e::experts", 200, 200),
          x("user_annotation", "e2e::shared", 400, 50), x("user_annotation", "e2e::head", 900, 50)]
    launches = [(150, 1), (250, 2), (260, 3), (420, 4), (470, 5), (600, 6), (920, 7)]
    ev += [x("cuda_runtime", "cudaLaunchKernel", ts, 5, correlation=c) for ts, c in launches[:2]]
    ev += [x("cuda_driver", "cuLaunchKernel", ts, 5, correlation=c) for ts, c in launches[2:]]
    durs = {1: 10, 2: 100, 3: 50, 4: 20, 5: 5, 6: 30, 7: 8}
    names = {1: "_route_kernel", 2: "moe_gate_up_kernel", 3: "moe_down_kernel", 4: "nvjet_gemm", 5: "add",
             6: "flash_fwd", 7: "gemm_head"}
    ev += [{"ph": "X", "cat": "kernel", "name": names[c], "pid": 0, "tid": 7, "ts": 2000 + 200 * c, "dur": durs[c],
            "args": {"correlation": c}} for c in durs]
    ev.append({"ph": "X", "cat": "kernel", "name": "orphan", "pid": 0, "tid": 7, "ts": 5000, "dur": 1,
               "args": {"correlation": 99}})
    # .item(): D2H cudaMemcpyAsync + cudaStreamSynchronize inside the forward; one more sync after it
    ev += [x("cuda_runtime", "cudaMemcpyAsync", 300, 5, correlation=50),
           {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "pid": 0, "tid": 7,
            "ts": 2500, "dur": 1, "args": {"correlation": 50}},
           x("cuda_runtime", "cudaStreamSynchronize", 306, 20, correlation=51),
           x("cuda_runtime", "cudaMemcpy", 700, 5, correlation=52),
           {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 7,
            "ts": 3000, "dur": 1, "args": {"correlation": 52}},
           x("cuda_runtime", "cudaDeviceSynchronize", 1500, 20, correlation=53)]
    return ev


def test_split_and_sync_count_on_a_synthetic_cuda_trace():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_e2e import count_syncs, split_from_trace

    ev = _synthetic_cuda_trace()
    split = split_from_trace(ev, n_layers=2, cuda=True)
    tot = split["total_ms"]
    assert math.isclose(tot["router"], 0.010) and math.isclose(tot["shared"], 0.020)
    assert math.isclose(tot["experts"], 0.150 + 0.001)  # gate_up + down + the D2H copy launched in its range
    assert math.isclose(tot["moe_glue"], 0.005) and math.isclose(tot["head"], 0.008)
    assert math.isclose(tot["rest"], 0.030 + 0.001)  # flash_fwd + the blocking copy launched outside the block
    assert math.isclose(split["per_layer_ms"]["experts"], 0.151 / 2)
    assert split["unmatched_ms"] == 0.001 and "na" not in split  # 1 of ~226 us unmatched: under 2%
    assert split["top_kernels"]["experts"][0][0] == "moe_gate_up_kernel"
    assert split["na_parts"] == {}
    syncs = count_syncs(ev, "e2e::forward")
    # the stream sync after the D2H async copy + the blocking cudaMemcpy D2H; the device sync is outside
    assert syncs["syncs"] == 2 and syncs["sync_calls"] == 1 and syncs["d2h_copies"] == 2 and syncs["blocking_d2h"] == 1
    # a moeflow kernel whose launch was not recorded is attributed by its name; an unknown one is not
    ev.append({"ph": "X", "cat": "kernel", "name": "moe_combine_kernel", "pid": 0, "tid": 7, "ts": 5500, "dur": 40,
               "args": {"correlation": 97}})
    split = split_from_trace(ev, n_layers=2, cuda=True)
    assert math.isclose(split["total_ms"]["experts"], 0.191) and math.isclose(split["attributed_by_name_ms"], 0.040)
    assert "na" not in split
    # a trace with too much kernel time lacking a launch is not split
    ev.append({"ph": "X", "cat": "kernel", "name": "big_orphan", "pid": 0, "tid": 7, "ts": 6000, "dur": 100,
               "args": {"correlation": 98}})
    assert "na" in split_from_trace(ev, n_layers=2, cuda=True)


def test_fresh_prefill_and_compiled_points_on_cpu(tmp_path):
    """The fresh-length prefill rows (each length once) and the compiled-decode rows' shape (on CPU transformers
    does not compile: the rows say so)."""
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, "benchmarks/bench_e2e.py", "--cpu", "--tiny", "--shapes", "qwen3-30b-a3b", "--out",
           str(out), "--points", "decode,compiled,fresh_prefill", "--decode-batches", "1", "--variants", "hf,auto",
           "--compiled-hf-experts", "grouped_mm", "--fresh-count", "5", "--time-budget-s", "90"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for variant in ("hf", "auto"):
        fresh = [r for r in rows if r["variant"] == variant and r["metric"] == "fresh_prefill_tok_s"]
        assert len(fresh) == 1 and fresh[0]["status"] == "ok" and fresh[0]["value"] > 0, fresh
        Ts = fresh[0]["detail"]["T"]
        assert len(Ts) == len(set(Ts)) == 5 and all(16 <= T <= 128 for T in Ts), Ts
        comp = [r for r in rows if r["variant"] == variant and r["metric"] == "compiled_decode_tok_s"]
        assert len(comp) == 1 and comp[0]["status"] == "ok", comp
        assert comp[0]["experts"] == ("grouped_mm" if variant == "hf" else "moeflow")
        assert "CPU" in comp[0]["note"]
        same = [r for r in rows if r["variant"] == variant and r["metric"] == "compiled_tokens_equal_eager"]
        assert same and same[0]["value"] == 1.0, same
