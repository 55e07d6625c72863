"""benchmarks/bench_models.py --smoke: every row writes its tiny checkpoint, loads it and measures on the CPU."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_rows_write_load_and_measure(tmp_path):
    out = tmp_path / "models.json"
    cmd = [sys.executable, "benchmarks/bench_models.py", "--smoke", "--out", str(out), "--workdir",
           str(tmp_path / "ck"), "--batches", "1", "--new-tokens", "2", "--prefill-T", "8", "--repeats", "1",
           "--rows", "gpt-oss-120b,qwen3-30b-a3b-fp8,mixtral-8x7b:3,deepseek-v3"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "--smoke" in data["meta"]["command"]
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"gpt-oss-120b", "qwen3-30b-a3b-fp8", "mixtral-8x7b", "deepseek-v3"}
    for name, r in rows.items():
        assert "errors" not in r, (name, r.get("errors"))
        assert r["expert_bytes_loaded"] == r["expert_bytes"] > 0, name  # stored bytes, nothing dequantized
        for key in ("write_s", "load_s", "prefill_tok_s", "decode_tok_s_eager_B1"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key)
    assert rows["mixtral-8x7b"]["layers"] == 3
    assert rows["mixtral-8x7b"]["offloaded_bytes"] == rows["mixtral-8x7b"]["expert_bytes"]
    assert rows["deepseek-v3"]["offloaded_bytes"] > 0 and rows["deepseek-v3"]["keys"] == "per_expert"
    assert rows["qwen3-30b-a3b-fp8"]["hf_experts_implementation"]
    assert "gpt-oss" in rows["gpt-oss-120b"]["graph_status"] or "eager" in rows["gpt-oss-120b"]["graph_status"]
