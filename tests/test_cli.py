"""The `moeflow` command: each subcommand on a tiny checkpoint, and user errors as one line + exit 2."""

import subprocess
import sys

import pytest

from moeflow.cli import main


def test_help_on_every_subcommand(capsys):
    for sub in ("demo", "info", "route", "bench", "trace"):
        with pytest.raises(SystemExit) as exc:
            main([sub, "--help"])
        assert exc.value.code == 0
        assert "usage: moeflow" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "longcat_flash"])
def test_info_reads_headers_only(tiny_checkpoint, family, capsys):
    path = tiny_checkpoint(family)
    assert main(["info", path, "--slots", "4"]) == 0
    out = capsys.readouterr().out
    assert f"family          {family}" in out
    assert "GPU, offloaded" in out and "expert bytes" in out


def test_info_numbers_match_the_tensors(tiny_checkpoint):
    import torch
    from safetensors import safe_open

    from moeflow.inspect import checkpoint_info

    path = tiny_checkpoint("mixtral", original_format=False)
    info = checkpoint_info(path, slots=3)
    total = 0
    from pathlib import Path

    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys())
    assert info.total_bytes == total
    assert info.offload_bytes == info.other_bytes + 3 * info.expert_bytes
    assert info.expert_bytes * info.num_experts * len(info.moe_layers) == info.routed_bytes
    del torch


def test_route_shows_experts_per_token(tmp_path, hf_quiet, capsys):
    from hf_configs import tiny_model

    tiny_model("qwen3_moe", vocab_size=256).save_pretrained(tmp_path)
    assert main(["route", str(tmp_path), "--prompt", "hi moe"]) == 0
    out = capsys.readouterr().out
    assert "6 tokens" in out and "load [" in out


def test_route_refuses_prompt_it_cannot_encode(tiny_checkpoint, capsys):
    assert main(["route", tiny_checkpoint("mixtral"), "--prompt", "hi"]) == 2
    assert "cannot byte-encode" in capsys.readouterr().err


def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: no config.json" in err and "hint:" in err and "Traceback" not in err


def test_unsupported_family_lists_supported(tmp_path, capsys):
    import transformers

    transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the family check comes first
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a supported MoE family" in err and "mixtral" in err


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moeflow", "--debug", "info", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_demo_runs_and_matches(capsys):
    assert main(["demo", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "identical to the unpatched model: yes" in out


def test_trace_record_replay_stats_plot(tmp_path, capsys):
    from moeflow.demo import EMBEDDED_MODEL

    t = str(tmp_path / "t.jsonl")
    assert main(["trace", "record", str(EMBEDDED_MODEL), "--out", t, "--prompt", "def f(x):\n    return x"]) == 0
    assert main(["trace", "replay", t, "--slots", "8", "--policy", "lru", "belady", "--decode"]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "hit_rate" in out
    assert main(["trace", "stats", t]) == 0
    assert '"recall_at_K"' in capsys.readouterr().out
    assert main(["trace", "plot", t, "--slots", "8", "--decode", "--out", str(tmp_path)]) == 0
    from PIL import Image

    for name in ("expert_load.png", "hit_rate.png"):
        img = Image.open(tmp_path / name).convert("RGB")
        assert img.size[0] >= 300 and len(img.getcolors(1 << 20)) > 20


def test_bench_help_lists_benchmarks(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in ("experts", "routing", "ep", "offload"):
        assert name in out


def test_route_on_the_embedded_byte_model(capsys):
    from moeflow.demo import EMBEDDED_MODEL

    assert main(["route", str(EMBEDDED_MODEL), "--prompt", "def main():"]) == 0
    out = capsys.readouterr().out
    assert "11 tokens, 4 MoE layers" in out


def test_info_on_the_embedded_model(capsys):
    from moeflow.demo import EMBEDDED_MODEL

    assert main(["info", str(EMBEDDED_MODEL), "--slots", "12"]) == 0
    out = capsys.readouterr().out
    assert "family          mixtral" in out and "4 MoE: 0-3" in out


def test_bench_routing_cpu_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # benchmarks/ lives in the checkout
    out = tmp_path / "bench"
    rc = main(["bench", "routing", "--plot", "--cpu", "--tokens", "1,8", "--shapes", "qwen3-30b-a3b",
               "--reps", "1", "--out", str(out)])
    assert rc == 0
    assert (out / "bench_routing_cpu.json").is_file()
    pngs = list(out.glob("*.png"))
    assert pngs and pngs[0].stat().st_size > 5000
    assert "plot:" in capsys.readouterr().out
