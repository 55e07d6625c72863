"""A lazy, memory-mapped view of a Hugging Face safetensors checkpoint.

`CheckpointIndex(path)` accepts a checkpoint directory (with `model.safetensors` or
a sharded `model.safetensors.index.json`), a single `.safetensors` file, or an index
JSON. It reads only headers up front; a tensor's bytes are read when `get` asks for
them, and `get(key, rows=...)` reads only the requested first-dimension rows (one
expert out of a fused [E, ...] tensor), through safetensors' memory-mapped slices.

Legend: E experts (first dimension of a fused expert tensor).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .files import CheckpointError, ConfigError, check_regular_file, check_shard_name, read_json

__all__ = ["CheckpointError", "CheckpointIndex", "ConfigError", "TensorInfo", "INDEX_FILE", "SINGLE_FILE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype names -> torch dtypes (the F8 names exist only on newer torch).
_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# float8_e8m0fnu: UE8M0 block scales (transformers 5 FP8 `*_scale_inv`, 2^(byte - 127)).
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        _ST_DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor: shape, dtype, and the file that holds it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str

    @property
    def nbytes(self) -> int:
        """Stored bytes (elements x item size, from the header)."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _unreadable(file: str, exc: BaseException, *, key: str | None = None) -> CheckpointError:
    """The CheckpointError for a shard safetensors cannot parse or read (truncated, corrupt header)."""
    what = f"{key}: " if key is not None else ""
    return CheckpointError(
        f"{what}{file}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
        f"it may be truncated or corrupt: download or save it again", key=key)


def torch_dtype_of(st_dtype: str, *, key: str) -> torch.dtype:
    if st_dtype not in _ST_DTYPES:
        raise CheckpointError(f"{key}: safetensors dtype {st_dtype!r} is not supported by this torch", key=key)
    return _ST_DTYPES[st_dtype]


class CheckpointIndex:
    """Key -> shard map of a safetensors checkpoint, with lazy, row-sliced reads.

    Shards are opened (memory-mapped) the first time one of their keys is asked for,
    and stay open until `close()`. Nothing is read into memory until `get`.
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if os.path.isdir(path):
            directory = path
            index_path = os.path.join(path, INDEX_FILE)
            single_path = os.path.join(path, SINGLE_FILE)
            if os.path.exists(index_path):
                files = self._read_index(index_path)
            elif os.path.exists(single_path):
                files = None
                single = single_path
            else:
                found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
                if len(found) != 1:
                    raise CheckpointError(
                        f"CheckpointIndex: {path!r} has neither {INDEX_FILE} nor {SINGLE_FILE} "
                        f"(safetensors files found: {found})"
                    )
                files, single = None, os.path.join(path, found[0])
        elif os.path.exists(path) and path.endswith(".json"):
            directory = os.path.dirname(os.path.abspath(path))
            files = self._read_index(path)
        elif os.path.exists(path) and path.endswith(".safetensors"):
            check_regular_file(path, "safetensors file")
            directory = os.path.dirname(os.path.abspath(path))
            files, single = None, path
        else:
            raise CheckpointError(
                f"CheckpointIndex: path={path!r} is not a checkpoint directory, a .safetensors file "
                f"or a {INDEX_FILE}"
            )
        self.directory = directory
        self._handles: dict[str, object] = {}
        self._infos: dict[str, TensorInfo] = {}
        if files is None:
            # One file: its header is the index.
            handle = self._open(single)
            self._key_file = {k: single for k in handle.keys()}
        else:
            self._key_file = {k: os.path.join(directory, f) for k, f in files.items()}

    @staticmethod
    def _read_index(index_path: str) -> dict[str, str]:
        data = read_json(index_path, "safetensors index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' (expected a key -> shard file mapping)")
        return {k: check_shard_name(v, key=k, index_path=index_path) for k, v in weight_map.items()}

    def _open(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            if not os.path.exists(file):
                raise CheckpointError(f"CheckpointIndex: shard {file!r} named by the index does not exist")
            check_regular_file(file, "safetensors shard")
            from safetensors import safe_open

            try:
                handle = safe_open(file, framework="pt", device="cpu")
            except Exception as exc:  # safetensors' SafetensorError (a Rust error), or OSError
                raise _unreadable(file, exc) from exc
            self._handles[file] = handle
        return handle

    # -- queries (headers only) ------------------------------------------------------
    def keys(self) -> list[str]:
        return sorted(self._key_file)

    def __contains__(self, key: object) -> bool:
        return key in self._key_file

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self._key_file)

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return sorted(k for k in self._key_file if k.startswith(prefix))

    def info(self, key: str) -> TensorInfo:
        """Shape and dtype of `key` from its shard's header (reads no tensor data)."""
        cached = self._infos.get(key)
        if cached is not None:
            return cached
        if key not in self._key_file:
            raise CheckpointError(f"checkpoint has no tensor {key!r}", key=key)
        file = self._key_file[key]
        handle = self._open(file)
        if key not in handle.keys():
            raise CheckpointError(f"{key}: the index maps it to {os.path.basename(file)}, which lacks it", key=key)
        try:
            sl = handle.get_slice(key)
        except Exception as exc:
            raise _unreadable(file, exc, key=key) from exc
        info = TensorInfo(key=key, shape=tuple(int(d) for d in sl.get_shape()),
                          dtype=torch_dtype_of(sl.get_dtype(), key=key), file=file)
        self._infos[key] = info
        return info

    # -- reads -----------------------------------------------------------------------
    def get(self, key: str, *, rows: slice | Sequence[int] | None = None, device: str | torch.device = "cpu",
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read `key` (or only its first-dimension `rows`) into a tensor on `device`.

        rows: None (whole tensor), a slice with step 1, or a sequence of row ids (each
        read on its own from the memory map, then stacked in the given order).
        """
        info = self.info(key)
        try:
            t = self._read(info, rows)
        except (CheckpointError, ValueError):
            raise
        except Exception as exc:  # a read past a truncated mapping, a corrupt buffer
            raise _unreadable(info.file, exc, key=key) from exc
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if torch.device(device).type != "cpu" else t

    def _read(self, info: TensorInfo, rows: slice | Sequence[int] | None) -> torch.Tensor:
        key = info.key
        handle = self._open(info.file)
        sl = handle.get_slice(key)
        if rows is None:
            t = handle.get_tensor(key)
        elif isinstance(rows, slice):
            if rows.step not in (None, 1):
                raise ValueError(f"CheckpointIndex.get({key!r}): rows={rows!r}: expected a slice with step 1")
            t = sl[rows]
        else:
            ids = [int(r) for r in rows]
            n = info.shape[0] if info.shape else 0
            bad = [r for r in ids if not 0 <= r < n]
            if bad:
                raise ValueError(f"CheckpointIndex.get({key!r}): rows {bad} outside [0, {n})")
            if not ids:
                t = torch.empty((0, *info.shape[1:]), dtype=info.dtype)
            else:
                t = torch.stack([sl[r] for r in ids])
        return t

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        files = sorted({os.path.basename(f) for f in self._key_file.values()})
        return f"CheckpointIndex({self.directory!r}, {len(self)} tensors in {len(files)} file(s))"
