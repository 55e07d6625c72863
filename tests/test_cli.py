"""The `moeflow` command: each subcommand on a tiny checkpoint, and user errors as one line + exit 2."""

import contextlib
import importlib.util
import json
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
    assert len(err.splitlines()) == 1, err
    assert "error: no config.json" in err and "; hint: " in err and "Traceback" not in err


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
    captured = capsys.readouterr()
    assert "identical to the unpatched model: yes" in captured.out
    # both generations show a progress bar (a long --tokens is no silent wait)
    assert "unpatched generate" in captured.err and "moeflow generate" in captured.err


def test_trace_record_replay_stats_plot(tmp_path, capsys):
    from moeflow.demo import EMBEDDED_MODEL
    from moeflow.inspect import checkpoint_info
    from moeflow.offload.trace import Trace

    t = str(tmp_path / "t.jsonl")
    assert main(["trace", "record", str(EMBEDDED_MODEL), "--out", t, "--prompt", "def f(x):\n    return x"]) == 0
    captured = capsys.readouterr()
    # the trace counts an expert's bytes as stored, as `moeflow info` does, and says in which dtype
    assert Trace.load(t).expert_bytes == checkpoint_info(EMBEDDED_MODEL).expert_bytes == 192 * 1024
    assert "expert bytes 192.0 KiB each as stored (bfloat16" in captured.out
    assert "record" in captured.err  # the progress bar over the forward passes
    assert main(["trace", "replay", t, "--slots", "8", "--policy", "lru", "belady", "--decode"]) == 0
    out = capsys.readouterr().out
    assert "belady" in out and "hit_rate" in out
    assert main(["trace", "stats", t]) == 0
    table = capsys.readouterr().out
    assert "recall@K" in table and "\n   all " in table and "\nrandom " in table and "{" not in table
    assert main(["trace", "stats", t, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recall_at_K"] is not None
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


# ---- user errors: exit 2, exactly "moeflow CMD: error: ..." and "  hint: ...", no traceback ------


def _assert_user_error(capsys, argv, *needles):
    """main(argv) exits 2 with exactly one line on stderr (the documented format); returns that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert rc == 2, err
    assert "Traceback" not in err and "--debug" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"moeflow {argv[0]}") and ": error: " in lines[0], err
    for n in needles:
        assert n in lines[0], err
    return lines[0]


def _bad_config_dir(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "mixtral", ')
    return str(d)


def _no_weights_dir(tmp_path):
    from moeflow.demo import EMBEDDED_MODEL

    d = tmp_path / "noweights"
    d.mkdir()
    (d / "config.json").write_text((EMBEDDED_MODEL / "config.json").read_text())
    return str(d)


def test_route_refuses_an_empty_prompt_and_zero_tokens(capsys):
    from moeflow.demo import EMBEDDED_MODEL

    _assert_user_error(capsys, ["route", str(EMBEDDED_MODEL), "--prompt", ""], "--prompt=''")
    _assert_user_error(capsys, ["route", str(EMBEDDED_MODEL), "--prompt", "x", "--max-tokens", "0"], "--max-tokens=0")


@pytest.mark.parametrize("command", ["info", "route", "trace record"])
@pytest.mark.parametrize("make, needle", [(_bad_config_dir, "config.json: not valid JSON"),
                                          (_no_weights_dir, "no *.safetensors files")])
def test_malformed_or_weightless_checkpoints_are_user_errors(tmp_path, capsys, command, make, needle):
    path = make(tmp_path)
    extra = {"info": [], "route": ["--prompt", "hi"], "trace record": ["--out", str(tmp_path / "t.jsonl")]}[command]
    _assert_user_error(capsys, [*command.split(), path, *extra], needle)
    assert not (tmp_path / "t.jsonl").exists()


def test_route_checks_the_family_like_info(tmp_path, capsys):
    import transformers

    transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the family check comes first
    _assert_user_error(capsys, ["route", str(tmp_path), "--prompt", "hi"], "not a supported MoE family", "mixtral")


def test_route_refuses_a_prompt_beyond_the_context_and_says_what_it_cuts(capsys):
    from moeflow.demo import EMBEDDED_MODEL

    long = "x = 1\n" * 100  # 600 bytes = 600 tokens > the embedded model's 512 positions
    line = _assert_user_error(capsys, ["route", str(EMBEDDED_MODEL), "--prompt", long], "600 tokens", "512")
    assert "; hint: " in line and "--max-tokens 512" in line.split("; hint: ")[1]
    # past 32 bytes nothing is cut silently: the whole prompt, or the cut said in the table
    assert main(["route", str(EMBEDDED_MODEL), "--prompt", long[:60]]) == 0
    assert capsys.readouterr().out.startswith("60 tokens, 4 MoE layers")
    assert main(["route", str(EMBEDDED_MODEL), "--prompt", long[:60], "--max-tokens", "40"]) == 0
    assert "40 tokens (first 40 of the prompt's 60, --max-tokens 40)" in capsys.readouterr().out


def test_trace_replay_of_a_directory_is_a_user_error(tmp_path, capsys):
    _assert_user_error(capsys, ["trace", "replay", str(tmp_path), "--slots", "8"], "is a directory")


def _write_trace(path, header_changes=None, step=None):
    head = {"moeflow_trace": 1, "num_layers": 2, "num_experts": [8, 8], "top_k": [2, 2], "pred_width": 0,
            "expert_bytes": 10, "meta": {}}
    head.update(header_changes or {})
    steps = [{"p": 0, "l": 0, "ids": [[0, 1]], "pred": None}, step or {"p": 0, "l": 1, "ids": [[2, 3]], "pred": None}]
    path.write_text("\n".join(json.dumps(x) for x in [head, *steps]) + "\n")
    return str(path)


@pytest.mark.parametrize("header, step, needle", [
    ({"num_experts": [8]}, None, "Trace.num_experts=[8]: expected a list of num_layers=2"),
    ({"expert_bytes": -5}, None, "Trace.expert_bytes=-5"),
    (None, {"p": 0, "l": 1, "ids": [[2, 99]]}, "expert id 99, expected an int in [0, 8)"),
    (None, {"p": 0, "l": 1, "ids": [[-1, 3]]}, "expert id -1"),
    (None, {"p": 0, "l": 1, "ids": [[1.5, 3]]}, "expert id 1.5"),
    (None, {"p": 0, "l": 1, "ids": [[1, 2, 3]]}, "3 ids, expected K=2 ids"),
    (None, {"p": 0, "l": 1, "ids": [[3, 3]]}, "repeats an expert id"),
])
def test_trace_replay_of_a_corrupt_trace_is_a_user_error(tmp_path, capsys, header, step, needle):
    path = _write_trace(tmp_path / "t.jsonl", header, step)
    line = _assert_user_error(capsys, ["trace", "replay", path, "--slots", "8"], needle)
    if step is not None:
        assert "t.jsonl:3:" in line  # the file's line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without CUDA")
def test_demo_on_cuda_without_cuda_is_a_user_error(capsys):
    _assert_user_error(capsys, ["demo", "--device", "cuda", "--tokens", "2"], "CUDA is not available")


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="checks the refusal without Triton")
def test_bench_experts_dry_run_without_triton_is_a_user_error(capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    line = _assert_user_error(capsys, ["bench", "experts", "--dry-run"], "'triton', which is not installed")
    assert "; hint: pip install" in line


@pytest.mark.parametrize("argv, usage", [
    (["trace", "record", "--help"], "usage: moeflow trace record"),
    (["trace", "replay", "--help"], "usage: moeflow trace replay"),
    (["trace", "stats", "--help"], "usage: moeflow trace stats"),
    (["trace", "plot", "--help"], "usage: moeflow trace plot"),
    (["bench", "routing", "--help"], "usage: moeflow bench routing"),
    (["bench", "offload", "--help"], "usage: moeflow bench offload"),
])
def test_help_reaches_every_action(argv, usage, capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out[:200]
    if argv[0] == "bench":
        assert "--out" in out  # the script's own options


def test_debug_works_anywhere_on_the_line(tmp_path, capsys):
    for argv in (["--debug", "info", str(tmp_path)], ["info", "--debug", str(tmp_path)],
                 ["info", str(tmp_path), "--debug"]):
        with pytest.raises(FileNotFoundError, match="no config.json"):
            main(argv)
    assert main(["info", str(tmp_path)]) == 2


def test_version(capsys):
    import moeflow

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"moeflow {moeflow.__version__}"


def test_readme_record_then_replay_gives_belady_hits(tmp_path, capsys, monkeypatch):
    """The README's `trace record ... && trace replay t.jsonl --slots 8 --policy lru belady`, as written."""
    from moeflow.demo import EMBEDDED_MODEL
    from moeflow.offload.trace import Trace

    monkeypatch.chdir(tmp_path)
    assert main(["trace", "record", str(EMBEDDED_MODEL), "--out", "t.jsonl"]) == 0
    assert "2048 tokens" in capsys.readouterr().out
    assert main(["trace", "replay", "t.jsonl", "--slots", "8", "--policy", "lru", "belady", "--json", "r.json"]) == 0
    assert "decode order" in capsys.readouterr().out
    rows = {r["policy"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert rows["belady"]["hit_rate"] > 0.3 and rows["belady"]["hit_rate"] >= rows["lru"]["hit_rate"] > 0
    assert rows["belady"]["tokens"] == 2048
    # the prefill order stays available, and is what gave 0.000 before
    assert main(["trace", "replay", "t.jsonl", "--slots", "8", "--policy", "lru", "--prefill"]) == 0
    assert "prefill passes" in capsys.readouterr().out
    assert main(["trace", "plot", "t.jsonl", "--slots", "12", "--policy", "lru", "belady"]) == 0
    assert (tmp_path / "hit_rate.png").stat().st_size > 5000
    assert len(Trace.load("t.jsonl").steps) == 2048 // 128 * 4


# ---- output paths: checked before the work; never an input; an existing file only if moeflow wrote it ----


def _small_trace(path, *, num_experts=4, header=None):
    """A 2-layer trace (E=4, K=1, W=2, 6 decode passes) written by moeflow: fast to replay and plot."""
    from moeflow.offload.trace import Step, Trace

    t = Trace(num_layers=2, num_experts=[num_experts] * 2, top_k=[1, 1], pred_width=2, expert_bytes=1000)
    for p, e in enumerate([0, 1, 2, 0, 1, 3]):
        t.steps += [Step(p, 0, [[e]], [[e, (e + 1) % num_experts]]), Step(p, 1, [[e]], None)]
    t.save(path)
    if header:
        lines = path.read_text().splitlines()
        lines[0] = json.dumps({**json.loads(lines[0]), **header})
        path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def checkpoint_copy(tmp_path, monkeypatch):
    """A copy of the embedded checkpoint whose weights must survive; loading the model fails the test."""
    import shutil

    import transformers

    from moeflow.demo import EMBEDDED_MODEL

    ck = tmp_path / "ck"
    shutil.copytree(EMBEDDED_MODEL, ck)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded: the refusal came after the work")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    return ck


def _digest(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("out, extra, needle", [
    ("ck/model.safetensors", [], "is a file of the input MODEL"),
    ("ck/model.safetensors", ["--force"], "is a file of the input MODEL"),  # an input, even with --force
    ("in.txt", ["--text", "in.txt", "--force"], "is the input --text"),
    ("user.jsonl", [], "exists and moeflow did not write it; pass --force"),
    ("new/dir/t.jsonl", [], "does not exist; expected an existing directory"),
    ("ck", [], "is a directory"),
])
def test_trace_record_refuses_an_output_path_before_loading(tmp_path, capsys, monkeypatch, checkpoint_copy,
                                                            out, extra, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "user.jsonl").write_text('{"mine": 1}\n')
    before = {p: _digest(p) for p in tmp_path.rglob("*") if p.is_file()}
    _assert_user_error(capsys, ["trace", "record", "ck", "--out", out, *extra], needle)
    assert {p: _digest(p) for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "new").exists()


def test_trace_record_replaces_a_trace_it_wrote(tmp_path, capsys, monkeypatch):
    from moeflow.demo import EMBEDDED_MODEL

    monkeypatch.chdir(tmp_path)
    _small_trace(tmp_path / "t.jsonl")
    assert main(["trace", "record", str(EMBEDDED_MODEL), "--out", "t.jsonl", "--prompt", "def f(): pass"]) == 0
    assert "13 tokens" in capsys.readouterr().out


def test_trace_replay_json_path_is_checked_before_the_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = _small_trace(tmp_path / "t.jsonl")
    digest = _digest(tmp_path / "t.jsonl")
    _assert_user_error(capsys, ["trace", "replay", t, "--slots", "2", "--json", t], "is the input trace")
    assert _digest(tmp_path / "t.jsonl") == digest
    rc = main(["trace", "replay", t, "--slots", "2", "--json", "missing/dir/r.json"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "" and "does not exist" in captured.err  # no table: no work done
    (tmp_path / "notes.json").write_text('{"mine": 1}')
    _assert_user_error(capsys, ["trace", "replay", t, "--slots", "2", "--json", "notes.json"],
                       "'notes.json' exists and moeflow did not write it")
    assert (tmp_path / "notes.json").read_text() == '{"mine": 1}'
    assert main(["trace", "replay", t, "--slots", "2", "--policy", "lru", "--json", "notes.json", "--force"]) == 0
    assert main(["trace", "replay", t, "--slots", "2", "--policy", "belady", "--json", "notes.json"]) == 0  # its own
    assert [r["policy"] for r in json.loads((tmp_path / "notes.json").read_text())] == ["belady"]


def test_trace_plot_paths_are_checked_before_any_png(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = _small_trace(tmp_path / "t.jsonl")
    _assert_user_error(capsys, ["trace", "plot", t, "--slots", "0"], "slots=0")
    assert not list(tmp_path.glob("*.png"))  # refused before the first PNG
    _assert_user_error(capsys, ["trace", "plot", t, "--slots", "2", "--out", "new/dir"], "no such directory")
    assert not (tmp_path / "new").exists()
    (tmp_path / "hit_rate.png").write_bytes(b"someone's picture")
    _assert_user_error(capsys, ["trace", "plot", t, "--slots", "2"],
                       "hit_rate.png' exists and moeflow did not write it; pass --force")
    assert (tmp_path / "hit_rate.png").read_bytes() == b"someone's picture"
    assert not (tmp_path / "expert_load.png").exists()
    assert main(["trace", "plot", t, "--slots", "2", "--force"]) == 0
    assert main(["trace", "plot", t, "--slots", "2"]) == 0  # its own PNGs: replaced without --force
    assert (tmp_path / "hit_rate.png").stat().st_size > 5000


# ---- size claims and non-regular files: refused by name, before allocating or blocking ----------------


def test_trace_stats_refuses_a_header_claiming_a_billion_experts(tmp_path, capsys):
    t = _small_trace(tmp_path / "t.jsonl", header={"num_experts": [10**9, 4]})
    _assert_user_error(capsys, ["trace", "stats", t], "num_experts[0]=1000000000", "at most 65536")


@pytest.mark.parametrize("action", ["replay", "plot"])
def test_trace_replay_and_plot_refuse_absurd_slots(tmp_path, capsys, monkeypatch, action):
    monkeypatch.chdir(tmp_path)
    t = _small_trace(tmp_path / "t.jsonl")
    _assert_user_error(capsys, ["trace", action, t, "--slots", "99999999999"], "slots=99999999999",
                       "expected an int in [1, 8]")
    assert not list(tmp_path.glob("*.png"))


def test_trace_stats_refuses_a_huge_line_and_deep_nesting(tmp_path, capsys):
    import gzip

    head = (tmp_path / "h.jsonl")
    _small_trace(head)
    header = head.read_text().splitlines()[0]
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress((header + "\n" + " " * (17 << 20) + "\n").encode(), compresslevel=1))
    _assert_user_error(capsys, ["trace", "stats", str(bomb)], "bomb.jsonl.gz:2: line longer than")
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    _assert_user_error(capsys, ["trace", "stats", str(deep)], "nested too deeply")


@contextlib.contextmanager
def _fifo_released_after(path, seconds=15.0):
    """After `seconds`, keep opening (and closing) the FIFO's write end, so a reader blocked on it returns:
    a missing check then fails the test instead of hanging it."""
    import os
    import threading

    stop = threading.Event()

    def release():
        if stop.wait(seconds):
            return
        while not stop.is_set():
            os.close(os.open(path, os.O_WRONLY))
            stop.wait(0.05)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        try:  # a writer blocked in open() returns once a reader opens the other end
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(1.0)


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_as_a_trace_and_as_a_text(tmp_path, capsys, checkpoint_copy, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with _fifo_released_after(fifo):
        _assert_user_error(capsys, ["trace", "stats", str(fifo)], "is a FIFO, expected a regular file")
        _assert_user_error(capsys, ["trace", "record", "ck", "--out", "t.jsonl", "--text", str(fifo)],
                           "--text", "is a FIFO")


def test_demo_refuses_tokens_beyond_the_context(capsys):
    _assert_user_error(capsys, ["demo", "--tokens", "99999999999"], "tokens=99999999999",
                       "context of 512", "expected at most 478")


def test_trace_record_refuses_more_tokens_than_its_text(tmp_path, capsys, monkeypatch, checkpoint_copy):
    monkeypatch.chdir(tmp_path)
    _assert_user_error(capsys, ["trace", "record", "ck", "--out", "t.jsonl", "--tokens", "99999999999"],
                       "--tokens=99999999999: only", "package sources")
    _assert_user_error(capsys, ["trace", "record", "ck", "--out", "t.jsonl", "--prompt", "abc", "--tokens", "5"],
                       "--tokens=5: only 3 tokens in the --prompt")


# ---- options accepted silently before: refused by name ---------------------------------------------------


def test_trace_replay_refuses_predict_width_0(tmp_path, capsys):
    t = _small_trace(tmp_path / "t.jsonl")
    _assert_user_error(capsys, ["trace", "replay", t, "--slots", "2", "--predict-width", "0"],
                       "predict_width=0", "[1, 2]")


def test_trace_record_refuses_a_width_beyond_the_experts(tmp_path, capsys, monkeypatch, checkpoint_copy):
    monkeypatch.chdir(tmp_path)
    _assert_user_error(capsys, ["trace", "record", "ck", "--out", "t.jsonl", "--width", "100"],
                       "width=100", "E=8")


def test_demo_refuses_an_unknown_device_without_a_gpu_hint(capsys):
    line = _assert_user_error(capsys, ["demo", "--device", "tpu"], "device='tpu'", "unknown device")
    assert "GPU" not in line and "hint" not in line


def test_demo_refuses_zero_tokens_in_one_clean_line(capsys):
    line = _assert_user_error(capsys, ["demo", "--tokens", "0"], "tokens=0: expected an int >= 1")
    assert "hint" not in line


def test_trace_plot_replays_every_policy_replay_supports():
    from moeflow.cli import build_parser
    from moeflow.offload.trace import REPLAY_POLICIES

    args = build_parser().parse_args(["trace", "plot", "t.jsonl", "--slots", "8"])
    assert args.policy == list(REPLAY_POLICIES) and "adaptive_long" in args.policy
