"""A checkpoint's claims are input: checked against what is on disk, by name, before anything acts on them.

Each test here failed before the guard it covers: a 13 KB checkpoint whose config.json
claims 10^6 experts or 10^10 layers (seconds, gigabytes, a MemoryError), JSON nested
200,000 deep (RecursionError), a FIFO in place of a file (a read blocked forever), an
index that names shards outside the checkpoint (opened), transformers' own errors on a bad
config.json (escaped unwrapped), and load_moe_layer arguments read as something else
(experts=[0.5, 1.7] loaded experts 0 and 1; dtype="bfloat16" was taken for a device).

Legend: E experts, H hidden size.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tracemalloc

import pytest
import torch

from moeflow.checkpoint.files import ConfigError
from moeflow.checkpoint.index import CheckpointError, CheckpointIndex
from moeflow.checkpoint.loader import load_moe_layer, moe_layer_indices
from moeflow.inspect import checkpoint_info

REPO = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")


def _copy(tiny_checkpoint, tmp_path, family: str = "mixtral", **kw) -> pathlib.Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(family, **kw), dst)
    return dst


def _edit_config(ckpt: pathlib.Path, **fields) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(fields)
    (ckpt / "config.json").write_text(json.dumps(cfg))


_FIFO_CALLS = """
import json, sys
from moeflow.checkpoint.index import CheckpointIndex
from moeflow.checkpoint.loader import load_moe_layer
from moeflow.inspect import checkpoint_info
ckpt, name = sys.argv[1], sys.argv[2]
calls = {"load_moe_layer": lambda: load_moe_layer(ckpt, "mixtral", 0), "checkpoint_info": lambda: checkpoint_info(ckpt)}
if name == "model.safetensors":
    calls["CheckpointIndex"] = lambda: CheckpointIndex(ckpt + "/" + name)
out = {}
for what, call in calls.items():
    try:
        call()
        out[what] = "returned"
    except Exception as exc:
        out[what] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


# ---- load_moe_layer's arguments -------------------------------------------------------------------


def test_expert_ids_must_be_integers(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", original_format=False)
    with pytest.raises(TypeError, match=r"experts: id 0\.5 \(float\), expected an int expert id"):
        load_moe_layer(path, "mixtral", 0, experts=[0.5, 1.7])
    with pytest.raises(TypeError, match=r"experts: id 1\.0 \(float\)"):
        load_moe_layer(path, "mixtral", 0, experts=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"experts: id True \(bool\)"):
        load_moe_layer(path, "mixtral", 0, experts=[True])
    np = pytest.importorskip("numpy")
    assert load_moe_layer(path, "mixtral", 0, experts=np.array([2, 0])).expert_ids == (2, 0)


def test_dtype_may_be_named_as_in_config_json(tiny_checkpoint):
    path = tiny_checkpoint("mixtral", original_format=False)
    by_name = load_moe_layer(path, "mixtral", 0, dtype="bfloat16")
    by_dtype = load_moe_layer(path, "mixtral", 0, dtype=torch.bfloat16)
    assert by_name.experts.gate_up.dtype == torch.bfloat16
    assert torch.equal(by_name.experts.gate_up, by_dtype.experts.gate_up)
    assert load_moe_layer(path, "mixtral", 0, dtype="torch.float16").router_weight_EH.dtype == torch.float16
    with pytest.raises(TypeError, match=r"dtype='bfloat17': not a torch dtype name; expected a floating torch\.dtype"):
        load_moe_layer(path, "mixtral", 0, dtype="bfloat17")
    with pytest.raises(TypeError, match=r"dtype=torch\.int8: expected a floating torch\.dtype of 16 bits or more"):
        load_moe_layer(path, "mixtral", 0, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"dtype=16 \(int\)"):
        load_moe_layer(path, "mixtral", 0, dtype=16)


# ---- B. claims a tiny file cannot back -----------------------------------------------------------


def test_a_million_experts_are_refused_from_the_router_header(tiny_checkpoint, tmp_path):
    """Per-expert names: the plan listed 3 x 10^6 keys (1.6 GiB, 11 s) before finding the first missing."""
    ckpt = _copy(tiny_checkpoint, tmp_path)  # mixtral, per-expert names
    _edit_config(ckpt, num_local_experts=10**6)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"block_sparse_moe\.gate\.weight: shape \[4, 32\], expected "
                                                  r"\[1000000, 32\] \(the config's E=1000000 experts, H=32\)"):
            load_moe_layer(ckpt, None, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the refusal"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ten_billion_layers_are_refused_before_transformers_reads_them(tiny_checkpoint, tmp_path, family):
    """qwen3_moe's config builds a layer_types list of num_hidden_layers entries (MemoryError);
    moe_layer_indices walked range(num_hidden_layers)."""
    ckpt = _copy(tiny_checkpoint, tmp_path, family)
    _edit_config(ckpt, num_hidden_layers=10**10)
    want = (r"config\.json: num_hidden_layers=10000000000, but the checkpoint's tensors hold 2 decoder layers "
            r"\(ids 0\.\.1\); expected at most the layers present")
    with pytest.raises(ConfigError, match=want):
        moe_layer_indices(ckpt, None)
    with pytest.raises(ConfigError, match=want):
        load_moe_layer(ckpt, None, 0)
    with pytest.raises(ConfigError, match=want):
        checkpoint_info(ckpt)


def test_a_layer_named_only_by_the_index_does_not_back_ten_billion_layers(tiny_checkpoint, tmp_path):
    """The bound counts distinct layer ids, not the largest: an index names layer 10^10 in a few bytes."""
    ckpt = _copy(tiny_checkpoint, tmp_path)
    weight_map = dict.fromkeys(CheckpointIndex(ckpt).keys(), "model.safetensors")
    weight_map["model.layers.9999999999.mlp.gate.weight"] = "model.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _edit_config(ckpt, num_hidden_layers=10**10)
    with pytest.raises(ConfigError, match=r"tensors hold 3 decoder layers \(ids 0\.\.9999999999 with gaps\)"):
        moe_layer_indices(ckpt, None)


def test_a_config_object_claiming_more_layers_than_stored_is_refused(tiny_checkpoint):
    from transformers import AutoConfig

    path = tiny_checkpoint("mixtral", original_format=False)
    config = AutoConfig.from_pretrained(path)
    assert moe_layer_indices(path, config) == [0, 1]
    config.num_hidden_layers = 10**10
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=10000000000, but .* hold 2 decoder layers"):
        moe_layer_indices(path, config)


@pytest.mark.parametrize("which", ["config", "index"])
def test_deeply_nested_json_is_named(tiny_checkpoint, tmp_path, which):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    deep = "[" * 200_000 + "]" * 200_000
    if which == "config":
        (ckpt / "config.json").write_text(deep)
        for call in (lambda: load_moe_layer(ckpt, None, 0), lambda: checkpoint_info(ckpt)):
            with pytest.raises(ConfigError, match=r"config\.json: JSON nested too deeply to parse"):
                call()
    else:
        (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ' + deep + "}")
        with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: JSON nested too deeply"):
            CheckpointIndex(ckpt)


# ---- C. files that are not what they say -----------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_fifo_is_refused_not_opened(tiny_checkpoint, tmp_path, name):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    os.remove(ckpt / name)
    os.mkfifo(ckpt / name)
    want = rf"(Checkpoint|Config)Error: .*{name.replace('.', '[.]')}' is a FIFO, expected a regular file"
    # In a child process: a blocked open() of a FIFO (safetensors' included) cannot be interrupted.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-c", _FIFO_CALLS, str(ckpt), name], capture_output=True, text=True,
                              timeout=180, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"blocked on the FIFO {ckpt / name} for 180 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for what, got in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert re.search(want, got), f"{what}: {got}"


@pytest.mark.parametrize("shard", ["/abs/model.safetensors", "../other/model.safetensors", "a/../../b.safetensors"])
def test_index_shards_outside_the_checkpoint_are_refused(tiny_checkpoint, tmp_path, shard):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    keys = CheckpointIndex(ckpt).keys()
    # A real file at the escaping path: before, the index opened it.
    if not shard.startswith("/"):
        outside = (ckpt / shard).resolve()
        outside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ckpt / "model.safetensors", outside)
    weight_map = {k: shard for k in keys}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"weight_map\[.*\]='" + shard.replace(".", "[.]")
                       + r"': expected a shard path inside the checkpoint directory"):
        CheckpointIndex(ckpt)


@pytest.mark.parametrize("field, value, cause", [
    ("rope_parameters", 5, "StrictDataclassFieldValidationError"),
    ("quantization_config", 5, "AttributeError"),
    ("model_type", "no_such_model", "ValueError"),
])
def test_transformers_errors_on_config_json_are_wrapped(tiny_checkpoint, tmp_path, field, value, cause):
    ckpt = _copy(tiny_checkpoint, tmp_path, original_format=False)
    _edit_config(ckpt, **{field: value})
    want = rf"config\.json: transformers cannot read it \({cause}: "
    with pytest.raises(ConfigError, match=want):
        load_moe_layer(ckpt, None, 0)
    if field != "model_type":  # (info names an unknown model_type itself: not a supported MoE family)
        with pytest.raises(ConfigError, match=want):
            checkpoint_info(ckpt)
