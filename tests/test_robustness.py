"""No silent wrong answers: layout-independent router logits, refused specs, tables, files and configs.

Legend: T tokens, H hidden size, E experts, K picks per token, V vocabulary.
Each test here failed (a wrong value, an accepted input, or a raw foreign error) before
the fix it guards.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

from moeflow.checkpoint.index import CheckpointError, CheckpointIndex
from moeflow.offload.config import OffloadConfig
from moeflow.routing.hash import check_hash_table
from moeflow.routing.logits import router_logits
from moeflow.routing.select import route
from moeflow.routing.spec import RouterSpec

REPO = pathlib.Path(__file__).resolve().parents[1]


# ---- A. router_logits: bits independent of memory layout ----------------------------------------


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same values as row-major, column-major, and a strided slice of a wider buffer."""
    wide = torch.full((t.shape[0], 3 * t.shape[1]), float("nan"), dtype=t.dtype)
    sliced = wide[:, 1::3]
    sliced.copy_(t)
    col = t.t().contiguous().t()
    assert not col.is_contiguous() and not sliced.is_contiguous()
    return {"row": t.contiguous(), "col": col, "sliced": sliced}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [64, 97])
def test_router_logits_bits_do_not_depend_on_layout(dtype, H):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, H, generator=g).to(dtype)
    w = torch.randn(16, H, generator=g).to(dtype)
    ref = router_logits(x, w)
    for xn, xl in _layouts(x).items():
        for wn, wl in _layouts(w).items():
            got = router_logits(xl, wl)
            assert torch.equal(got, ref), f"x {xn}, w {wn}: max diff {(got - ref).abs().max().item():.3e}"


def test_router_logits_row_bits_do_not_depend_on_position_or_layout():
    g = torch.Generator().manual_seed(1)
    H = 64
    w = torch.randn(8, H, generator=g)
    row = torch.randn(1, H, generator=g)
    alone = router_logits(row, w)[0]
    for T in (2, 5, 33):
        for pos in (0, T // 2, T - 1):
            batch = torch.randn(T, H, generator=g)
            batch[pos] = row[0]
            for layout in _layouts(batch).values():
                for wl in _layouts(w).values():
                    assert torch.equal(router_logits(layout, wl)[pos], alone), (T, pos)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or __import__("importlib").util.find_spec("triton") is None,
                    reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_cuda_bits_do_not_depend_on_layout(dtype):
    """The Triton kernel needs unit stride along H: the public launcher hands it a copy, same bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 192, generator=g).to(dtype)
    w = torch.randn(32, 192, generator=g).to(dtype)
    ref = router_logits(x.cuda(), w.cuda())
    for xl in _layouts(x).values():
        for wl in _layouts(w).values():
            assert torch.equal(router_logits(xl.cuda(), wl.cuda()), ref)


# ---- D. RouterSpec float and bool fields --------------------------------------------------------


_SPEC = dict(score_fn="softmax", num_experts=4, top_k=2, renorm=True)


@pytest.mark.parametrize("field, value, error", [
    ("scaling_factor", "2", TypeError), ("scaling_factor", None, TypeError),
    ("scaling_factor", math.nan, ValueError), ("scaling_factor", math.inf, ValueError),
    ("scaling_factor", 0.0, ValueError), ("scaling_factor", -1.0, ValueError),
    ("scaling_factor", True, TypeError),
    ("renorm_eps", -1, ValueError), ("renorm_eps", math.nan, ValueError), ("renorm_eps", "1e-20", TypeError),
    ("renorm_eps", None, TypeError),
    ("renorm", "yes", TypeError), ("use_bias", 1, TypeError), ("num_zero_experts", True, ValueError),
])
def test_router_spec_refuses_bad_fields(field, value, error):
    with pytest.raises(error, match=f"RouterSpec.{field}="):
        RouterSpec(**{**_SPEC, field: value})


def test_router_spec_stores_int_floats_as_float():
    s = RouterSpec(**_SPEC, scaling_factor=2, renorm_eps=0)
    assert type(s.scaling_factor) is float and type(s.renorm_eps) is float
    assert s == RouterSpec(**_SPEC, scaling_factor=2.0)


@pytest.mark.parametrize("field, value", [
    ("swiglu_limit", math.inf), ("swiglu_limit", -math.inf), ("swiglu_limit", math.nan),
    ("gptoss_alpha", math.inf), ("gptoss_alpha", math.nan),
    ("router_prenorm_eps", math.inf), ("router_prenorm_eps", math.nan),
])
def test_moe_config_refuses_non_finite_floats(field, value):
    from moeflow.config import MoEConfig

    kw = dict(hidden_size=8, intermediate_size=4, router=RouterSpec(**_SPEC), activation="gptoss", swiglu_limit=7.0)
    MoEConfig(**kw)  # the finite values are accepted
    with pytest.raises(ValueError, match=f"MoEConfig.{field}={value!r}: .*finite"):
        MoEConfig(**{**kw, field: value})


# ---- D. hash tables: K distinct ids per row -----------------------------------------------------


def test_check_hash_table_refuses_a_repeated_id():
    good = torch.tensor([[0, 1], [2, 3], [7, 4]])
    check_hash_table(good, 8, top_k=2)
    with pytest.raises(ValueError, match=r"row 1 repeats an expert id: \[2, 2\]"):
        check_hash_table(torch.tensor([[0, 1], [2, 2]]), 8, top_k=2)
    with pytest.raises(ValueError, match="row 1 holds expert id 8 outside"):
        check_hash_table(torch.tensor([[0, 1], [8, 2]]), 8)
    with pytest.raises(ValueError, match=r"shape \(2, 3\), expected \(V, K=2\)"):
        check_hash_table(torch.zeros(2, 3, dtype=torch.long), 8, top_k=2)
    with pytest.raises(TypeError, match="integer dtype"):
        check_hash_table(torch.zeros(2, 2), 8)


def test_route_refuses_a_hash_row_with_a_repeated_id():
    spec = RouterSpec(score_fn="sqrtsoftplus", num_experts=8, top_k=2, renorm=True, hash_routing=True)
    table = torch.tensor([[0, 1], [3, 3], [5, 6]])
    logits = torch.randn(2, 8)
    route(logits, spec, input_ids=torch.tensor([0, 2]), hash_table=table)  # rows used are fine
    with pytest.raises(ValueError, match=r"hash_table: row 1 repeats an expert id: \[3, 3\]"):
        route(logits, spec, input_ids=torch.tensor([0, 1]), hash_table=table)


# ---- D. truncated / corrupt safetensors ---------------------------------------------------------


@pytest.fixture
def safetensors_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(4, 8), "b": torch.randn(3)}, str(path))
    return path


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "corrupt_header"])
def test_checkpoint_index_names_the_damaged_file(safetensors_file, damage):
    data = safetensors_file.read_bytes()
    if damage == "truncate_data":
        data = data[:-20]
    elif damage == "truncate_header":
        data = data[:5]
    else:
        data = data[:8] + b"{garbage" + data[16:]
    safetensors_file.write_bytes(data)
    for path in (safetensors_file, safetensors_file.parent):
        with pytest.raises(CheckpointError, match="not a readable safetensors file") as exc:
            CheckpointIndex(path)
        assert str(safetensors_file) in str(exc.value)


def test_checkpoint_index_reads_an_intact_file(safetensors_file):
    with CheckpointIndex(safetensors_file) as idx:
        assert idx.keys() == ["a", "b"] and idx.get("a", rows=[1]).shape == (1, 8)


# ---- D. `moeflow info`: config vs stored tensors, truncated files -------------------------------


def _copy_checkpoint(tiny_checkpoint, tmp_path, family="mixtral") -> pathlib.Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(family), dst)
    return dst


def test_info_refuses_a_config_whose_E_disagrees_with_the_tensors(tiny_checkpoint, tmp_path):
    from moeflow.inspect import checkpoint_info

    ckpt = _copy_checkpoint(tiny_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["num_local_experts"] == 4
    cfg["num_local_experts"] = 2
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json says E=2 routed experts, but layer 0's expert tensors store 4"):
        checkpoint_info(ckpt)


def test_info_refuses_a_truncated_file(tiny_checkpoint, tmp_path):
    from moeflow.inspect import checkpoint_info

    ckpt = _copy_checkpoint(tiny_checkpoint, tmp_path)
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .*\(truncated"):
        checkpoint_info(ckpt)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short for a safetensors header"):
        checkpoint_info(ckpt)


def test_info_sizes_hold_for_longcat_zero_expert_rows(tiny_checkpoint):
    """transformers stores LongCat's zero-expert rows in some tensors: E + Z is not a mismatch."""
    from moeflow.inspect import checkpoint_info

    info = checkpoint_info(tiny_checkpoint("longcat_flash"))
    assert info.num_experts == 6 and info.expert_bytes > 0


def test_info_slots_beyond_every_routed_expert_are_refused():
    """A cache of more slots than the model has routed experts would print more bytes than resident."""
    from moeflow.demo import EMBEDDED_MODEL
    from moeflow.inspect import checkpoint_info

    info = checkpoint_info(EMBEDDED_MODEL, slots=32)  # 4 MoE layers x 8 experts: every expert cached
    assert info.offload_bytes == info.total_bytes
    assert checkpoint_info(EMBEDDED_MODEL, slots=2).offload_bytes < info.total_bytes
    for bad in (33, 1, True):
        with pytest.raises(ValueError, match=rf"--slots={bad}: expected an int in \[K=2, 32\]"):
            checkpoint_info(EMBEDDED_MODEL, slots=bad)


# ---- D. OffloadConfig: Path checkpoints, CUDA without CUDA --------------------------------------


def test_offload_config_accepts_a_path_checkpoint(tmp_path):
    from moeflow.demo import EMBEDDED_MODEL

    cfg = OffloadConfig(gpu_slots=4, store="mmap", checkpoint=EMBEDDED_MODEL)
    assert cfg.checkpoint == str(EMBEDDED_MODEL) and isinstance(cfg.checkpoint, str)
    assert OffloadConfig(gpu_slots=4, checkpoint=tmp_path).checkpoint == str(tmp_path)
    with pytest.raises(TypeError, match="OffloadConfig.checkpoint=3"):
        OffloadConfig(gpu_slots=4, checkpoint=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_offload_config_refuses_cuda_without_cuda(device):
    with pytest.raises(ValueError, match=f"OffloadConfig.device='{device}': CUDA is not available"):
        OffloadConfig(gpu_slots=4, device=device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_config_refuses_a_cuda_index_this_machine_lacks():
    n = torch.cuda.device_count()
    assert OffloadConfig(gpu_slots=4, device="cuda:0").device == "cuda:0"
    with pytest.raises(ValueError, match=f"this machine has {n} CUDA device"):
        OffloadConfig(gpu_slots=4, device=f"cuda:{n}")


def test_offload_config_refuses_an_unknown_device():
    with pytest.raises(ValueError, match="OffloadConfig.device='gpu': not a torch device"):
        OffloadConfig(gpu_slots=4, device="gpu")
    assert OffloadConfig(gpu_slots=4, device="cpu").resolved_device() == "cpu"


# ---- C. `moeflow bench offload` without CUDA: a quick CPU run -----------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback runs only without CUDA")
def test_bench_offload_runs_its_quick_cpu_configuration_without_cuda(tmp_path):
    out = tmp_path / "bench_offload.json"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moeflow", "bench", "offload", "--no-profile", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "running the quick CPU configuration" in proc.stdout
    assert time.perf_counter() - t0 < 60
    rows = json.loads(out.read_text())["rows"]
    assert {r["shape"] for r in rows} == {"quick-mixtral", "quick-deepseek"}
