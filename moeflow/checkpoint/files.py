"""A checkpoint's own files, read defensively: regular files only, bounded JSON, shards inside the checkpoint.

Everything a checkpoint directory claims is input: a `config.json` or shard that is a FIFO
(or a device, a socket) blocks `open` forever; JSON nested 200,000 deep overflows Python's
parser; an index may name a shard outside the checkpoint (`../x`, `/etc/x`); and a 13 KB
config.json may claim 10^10 layers, which transformers' config classes turn into per-layer
lists before anything else runs. The helpers here refuse each by name, before opening,
parsing or allocating. No torch import: `moeflow info` reads configs and headers with them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

from ..paths import PathError, check_input_file

__all__ = ["CheckpointError", "ConfigError", "check_regular_file", "read_json", "check_shard_name",
           "layer_ids", "layer_bound", "check_layer_claims", "read_config_json", "hf_config"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint does not match what the model expects; the message names the key."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


class ConfigError(CheckpointError):
    """config.json cannot be read as a model config; the message names the file and the cause."""


def check_regular_file(path: str | os.PathLike, what: str, *, error: type[CheckpointError] = CheckpointError) -> None:
    """`error` (a CheckpointError) naming `path` unless it is a regular file (symlinks followed).

    `what` says what the file should be ("config.json", "safetensors shard"). A FIFO would
    block the open (or the read) forever; a directory or a device is no checkpoint file either.
    The check is moeflow.paths.check_input_file's (the CLI's inputs), raised as a checkpoint error.
    """
    try:
        check_input_file(path, what)
    except (FileNotFoundError, PathError) as exc:
        raise error(str(exc)) from exc.__cause__


def read_json(path: str | os.PathLike, what: str, *, error: type[CheckpointError] = CheckpointError) -> Any:
    """The parsed JSON of a regular file, or `error` naming the file and why it is not readable JSON."""
    check_regular_file(path, what, error=error)
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return json.loads(data)
    except RecursionError:
        # json's scanner recurses once per level: a deeply nested file exhausts the stack.
        raise error(f"{os.fspath(path)}: JSON nested too deeply to parse (expected the few levels of a "
                    f"{what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{os.fspath(path)}: not valid JSON ({exc}); expected a {what}") from exc


def check_shard_name(name: Any, *, key: str, index_path: str) -> str:
    """A weight_map shard name: a relative path inside the checkpoint directory, or CheckpointError naming it.

    An absolute name, or one with a '..' component, would open a file outside the checkpoint.
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index_path}: weight_map[{key!r}]={name!r}: expected a shard file name", key=key)
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name) or ".." in parts:
        raise CheckpointError(
            f"{index_path}: weight_map[{key!r}]={name!r}: expected a shard path inside the checkpoint directory "
            "(relative, without '..')", key=key)
    return name


def layer_ids(keys: Iterable[str]) -> set[int]:
    """The decoder-layer ids that some tensor name holds (`...layers.{i}....`)."""
    out: set[int] = set()
    for k in keys:
        m = _LAYER_RE.search(k)
        if m:
            out.add(int(m.group(1)))
    return out


def layer_bound(present: set[int]) -> tuple[int, str]:
    """(the most layers a config may claim, what the tensors hold in words) for these layer ids.

    The count of distinct ids, not the largest id + 1: an index JSON can name a tensor of
    layer 10^10 in a few bytes, but every distinct id costs its own tensor name.
    """
    if not present:
        return 0, "no decoder layer"
    lo, hi = min(present), max(present)
    span = f"ids {lo}..{hi}" if len(present) == hi - lo + 1 else f"ids {lo}..{hi} with gaps"
    return len(present), f"{len(present)} decoder layers ({span})"


def check_layer_claims(raw: dict, present: set[int], config_path: str) -> None:
    """ConfigError when config.json claims more decoder layers than the tensors hold.

    raw: the parsed config.json; present: layer ids of the checkpoint's tensor names. The
    top-level and text_config `num_hidden_layers` are checked (transformers builds lists of
    that length while reading the config), before transformers sees the file. A checkpoint
    may hold more layers than claimed (DeepSeek-V3's multi-token-prediction layer), never fewer.
    """
    bound, held = layer_bound(present)
    scopes = [("", raw)]
    if isinstance(raw.get("text_config"), dict):
        scopes.append(("text_config.", raw["text_config"]))
    for where, cfg in scopes:
        n = cfg.get("num_hidden_layers")
        if isinstance(n, bool) or not isinstance(n, (int, float)):
            continue  # absent or not a number: transformers' own check names it
        if n > bound:
            raise ConfigError(f"{config_path}: {where}num_hidden_layers={n!r}, but the checkpoint's tensors hold "
                              f"{held}; expected at most the layers present")


def read_config_json(path: str | os.PathLike) -> dict:
    """config.json as a dict with a model_type, or ConfigError naming the file and the fault."""
    raw = read_json(path, "Hugging Face model config", error=ConfigError)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{os.fspath(path)}: no 'model_type' (expected a Hugging Face model config)")
    return raw


def hf_config(directory: str | os.PathLike) -> Any:
    """transformers' AutoConfig of `directory`, any error it raises wrapped in a ConfigError naming config.json.

    transformers raises OSError, KeyError, AttributeError, ValueError or huggingface_hub's
    StrictDataclass*ValidationError (an Exception) for a config.json it cannot read.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.fspath(directory))
    except Exception as exc:
        path = os.path.join(os.fspath(directory), "config.json")
        raise ConfigError(f"{path}: transformers cannot read it ({type(exc).__name__}: {exc})") from exc
