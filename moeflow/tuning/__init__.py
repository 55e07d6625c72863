"""Tile configurations of the Triton expert kernels, as data.

Legend: T tokens in the batch (the lookup key "M"), K slots, E experts, H hidden,
I intermediate per expert, BM/BN/BK tile sizes, S split-K parts of the down GEMM.

Files live beside this module, one per (device, shape), written by
benchmarks/tune_experts.py:

    <device>__E<E>_H<H>_I<I>_K<K>_<layout>[_il]_<dtype>.json
    {"device": "NVIDIA_H200", "shape": {...},
     "configs": {"1": <MoETileConfig>, "2": ..., "8192": ...},
     "batch_invariant": <MoETileConfig>,           # optional: one config for every T
     "batch_invariant_by_T": {"1": ..., ...}}      # optional, see below

Batch invariance needs every token's sums done in one order whatever the batch: no split-K
and one K-step (BK) per GEMM. "batch_invariant" is one whole configuration for every T (always
safe). "batch_invariant_by_T" lets BM, BN and warps follow T while BK and split_k=1 stay fixed:
a row's dot products then run the same K-steps in the same order, which the tuner checks bit
for bit on the device before writing it (an MMA instruction whose internal sum order changed
with the tile shape would break it; the tuner then keeps the single configuration). BK may
follow T too where the tuner checked that family bit for bit ("batch_invariant_by_T_mixed_bk":
true; each k16 MMA step joins one f32 accumulator in order, so BK should not change the bits, but
only the device says so); a table mixing K-steps without that mark is refused when read.

The thresholds a measurement chose for the kernel plan (which variant serves a shape) are
data too: `rules.json` beside this module, read by `moeflow.tuning.rules.load_rules`.

A lookup takes the entry whose T is nearest in log scale (ties: the smaller T). Without a
file, `default_config` picks from shape heuristics. This module is pure Python (no triton,
no CUDA): the CPU suite tests it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

TUNING_DIR = Path(__file__).resolve().parent

_POW2 = (16, 32, 64, 128, 256)


@dataclass(frozen=True, kw_only=True)
class GemmTile:
    """Tile of one grouped GEMM. split_k only applies to the down GEMM (gate_up needs whole sums).

    persistent: only the TMA kernels (moeflow/kernels/moe_gemm_tma.py) have a persistent form (one
    program per SM walking the grouped tile order); the pointer kernels ignore it. Same tiles, same
    bits either way.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    split_k: int = 1
    persistent: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v not in _POW2:
                raise ValueError(f"GemmTile.{name}={v!r}: expected one of {_POW2}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmTile.num_warps={self.num_warps!r}: expected 1, 2, 4, 8 or 16")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"GemmTile.num_stages={self.num_stages!r}: expected an int in [1, 8]")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"GemmTile.group_m={self.group_m!r}: expected an int >= 1")
        if not isinstance(self.split_k, int) or not 1 <= self.split_k <= 16:
            raise ValueError(f"GemmTile.split_k={self.split_k!r}: expected an int in [1, 16]")
        if not isinstance(self.persistent, bool):
            raise ValueError(f"GemmTile.persistent={self.persistent!r}: expected a bool")


@dataclass(frozen=True, kw_only=True)
class MoETileConfig:
    """block_m is shared: the alignment pads each expert's rows to it for both GEMMs.

    half_tail: a block whose rows from block_m / 2 on are all padding (an expert's last block,
    holding at most block_m / 2 pairs) runs as a block_m / 2-row tile in the same kernel
    (moeflow/kernels/moe_gemm.py, HALF_TAIL): less padding computed, the full blocks keep
    block_m's efficiency, and a row's dot products take the same K steps, so the same bits.

    flat_down: where the bf16 / fp16 down GEMM takes TMA tiles (Hopper, linear layout, one split),
    True runs it as one flattened persistent loop over (tile, K step) (moe_gemm_tma._down_flat;
    without half tiles: the same bits), False tiled; None (default) leaves it to the plan's rule
    (`moeflow.tuning.rules.KernelRules.flat_down_max_k_steps`).
    """

    block_m: int
    gate_up: GemmTile
    down: GemmTile
    half_tail: bool = False
    flat_down: bool | None = None

    def __post_init__(self) -> None:
        if self.block_m not in _POW2:
            raise ValueError(f"MoETileConfig.block_m={self.block_m!r}: expected one of {_POW2}")
        if self.gate_up.split_k != 1:
            raise ValueError(
                f"MoETileConfig.gate_up.split_k={self.gate_up.split_k}: expected 1 (the activation needs whole sums)"
            )
        if not isinstance(self.half_tail, bool):
            raise ValueError(f"MoETileConfig.half_tail={self.half_tail!r}: expected a bool")
        if self.flat_down is not None and not isinstance(self.flat_down, bool):
            raise ValueError(f"MoETileConfig.flat_down={self.flat_down!r}: expected True, False or None")
        if self.half_tail and self.block_m < 32:
            raise ValueError(f"MoETileConfig.half_tail with block_m={self.block_m}: expected block_m >= 32 "
                             "(a half tile is a dot of >= 16 rows)")

    def to_dict(self) -> dict:
        d = {"block_m": self.block_m, "gate_up": asdict(self.gate_up), "down": asdict(self.down)}
        if self.half_tail:  # tables without half tiles keep their exact keys
            d["half_tail"] = True
        if self.flat_down is not None:  # likewise
            d["flat_down"] = self.flat_down
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MoETileConfig:
        keys = {"block_m", "gate_up", "down"}
        if not isinstance(d, dict) or not keys <= set(d) <= keys | {"half_tail", "flat_down"}:
            raise ValueError(f"MoETileConfig: expected keys block_m, gate_up, down (and optionally half_tail, "
                             f"flat_down); got {d!r}")
        return cls(block_m=d["block_m"], gate_up=GemmTile(**d["gate_up"]), down=GemmTile(**d["down"]),
                   half_tail=d.get("half_tail", False), flat_down=d.get("flat_down"))


@dataclass(frozen=True, kw_only=True)
class ShapeKey:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    layout: str
    interleaved: bool
    dtype: str  # "bfloat16" | "float16" | "float32"

    def file_name(self, device: str) -> str:
        il = "_il" if self.interleaved else ""
        return (
            f"{device_slug(device)}__E{self.num_experts}_H{self.hidden_size}_I{self.intermediate_size}"
            f"_K{self.top_k}_{self.layout}{il}_{self.dtype}.json"
        )


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200' (file-name safe)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def nearest_key(keys, m: int) -> int:
    """The key nearest to m in log scale; ties go to the smaller key."""
    ks = sorted(int(k) for k in keys)
    if not ks:
        raise ValueError("nearest_key: no keys to choose from")
    if m < 1:
        raise ValueError(f"nearest_key: m={m!r}, expected >= 1")
    lm = math.log(m)
    return min(ks, key=lambda k: (abs(math.log(k) - lm), k))


# A table whose batch_invariant_by_T family lets BK follow T says so under this key (benchmarks/
# tune_experts.py writes it only for a family it checked bit for bit on the device).
MIXED_BK_KEY = "batch_invariant_by_T_mixed_bk"


def mixes_k_steps(by_t: dict[int, MoETileConfig]) -> bool:
    """Whether a batch-invariant family's entries differ in a GEMM's K-step (block_k)."""
    return len({(c.gate_up.block_k, c.down.block_k) for c in by_t.values()}) > 1


@lru_cache(maxsize=256)
def _load(path: str) -> dict | None:
    p = Path(path)
    if not p.is_file():
        return None
    data = json.loads(p.read_text())
    configs = {int(k): MoETileConfig.from_dict(v) for k, v in data.get("configs", {}).items()}
    bi = data.get("batch_invariant")
    by_t = {int(k): MoETileConfig.from_dict(v) for k, v in data.get("batch_invariant_by_T", {}).items()}
    for t, c in by_t.items():
        if c.down.split_k != 1:
            raise ValueError(f"{path}: batch_invariant_by_T[{t}].down.split_k={c.down.split_k}, expected 1")
    if mixes_k_steps(by_t) and not data.get(MIXED_BK_KEY):
        raise ValueError(f"{path}: batch_invariant_by_T mixes K-steps (block_k); expected one per GEMM, or "
                         f"{MIXED_BK_KEY!r}: true from a tuner that checked the mix bit for bit on the device")
    return {"configs": configs, "batch_invariant": MoETileConfig.from_dict(bi) if bi else None,
            "batch_invariant_by_T": by_t}


# Hopper parts with 132 SMs (sm_90, 228 KB shared memory a block): a table tuned on one is the best
# start on another, where none of its own exists. Why: without it an H100 ran the heuristic tiles at
# every shape (the tables were tuned on the H200), and lost 9% to the vLLM peer (run with its H200
# tables) at deepseek-v3 T = 2048 (`python benchmarks/bench_experts.py --shapes deepseek-v3 --tokens 2048` on an
# H100 with and without the sibling table). Ranked: the first sibling with a file wins.
HOPPER_132_SM = ("NVIDIA_H200", "NVIDIA_H100_80GB_HBM3", "NVIDIA_H200_NVL", "NVIDIA_H100_NVL", "NVIDIA_H800",
                 "NVIDIA_GH200_480GB", "NVIDIA_GH200_144G_HBM3e")


def table_device(key: ShapeKey, device: str, directory: Path | None = None, *, siblings: bool = True) -> str | None:
    """The device slug whose table serves `device` at this shape: its own, else (siblings=True) the
    first of HOPPER_132_SM with a table when `device` is one of them; None when there is none."""
    d = directory or TUNING_DIR
    own = device_slug(device)
    cands = [own] + ([s for s in HOPPER_132_SM if s != own] if siblings and own in HOPPER_132_SM else [])
    return next((c for c in cands if (d / key.file_name(c)).is_file()), None)


def load_table(key: ShapeKey, device: str, directory: Path | None = None, *, siblings: bool = True) -> dict | None:
    """{'configs': {T: MoETileConfig}, 'batch_invariant': MoETileConfig | None, ...} or None.
    siblings=True: a Hopper sibling's table when the device has none of its own (table_device); the
    tuner's --merge-from passes False so it never writes another card's entries under this one."""
    src = table_device(key, device, directory, siblings=siblings)
    return None if src is None else _load(str((directory or TUNING_DIR) / key.file_name(src)))


def write_table(key: ShapeKey, device: str, configs: dict[int, MoETileConfig],
                batch_invariant: MoETileConfig | None, directory: Path | None = None,
                batch_invariant_by_T: dict[int, MoETileConfig] | None = None,
                batch_invariant_mixed_bk: bool = False) -> Path:
    """Write a tuned table (module docstring's format). batch_invariant_mixed_bk: the by-T family's BK
    follows T, checked bit for bit on the device by the caller (MIXED_BK_KEY)."""
    path = (directory or TUNING_DIR) / key.file_name(device)
    data = {
        "device": device_slug(device),
        "shape": asdict(key),
        "configs": {str(m): c.to_dict() for m, c in sorted(configs.items())},
    }
    if batch_invariant is not None:
        data["batch_invariant"] = batch_invariant.to_dict()
    if batch_invariant_by_T:
        data["batch_invariant_by_T"] = {str(m): c.to_dict() for m, c in sorted(batch_invariant_by_T.items())}
        if batch_invariant_mixed_bk:
            data[MIXED_BK_KEY] = True
    path.write_text(json.dumps(data, indent=1) + "\n")
    _load.cache_clear()
    return path


def _down_split(active_blocks: int, n_tiles: int, k_tiles: int, sm_count: int) -> int:
    """Smallest split that gives >= 2 programs per SM, keeping >= 2 K-steps per split."""
    split = 1
    while active_blocks * n_tiles * split < 2 * sm_count and split < 8 and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def default_config(key: ShapeKey, num_tokens: int, sm_count: int = 132) -> MoETileConfig:
    """Heuristic tiles when no tuned file exists (and the starting point of the tuner).

    rows per used expert ~ T*K / min(T*K, E) decides the regime: decode tiles (BM=16, narrow
    columns and a split-K down GEMM so the weight stream covers every SM), then wider tiles
    as rows per expert grow, then 128x128 compute tiles.
    """
    n_pairs = num_tokens * key.top_k
    used = min(n_pairs, key.num_experts)
    rows = n_pairs / used
    I, H = key.intermediate_size, key.hidden_size
    small = key.dtype == "float32"  # the interpreter/CPU path: keep shared memory small
    if rows <= 16:
        bm = 16
        bn_gu = 64 if used * math.ceil(I / 64) >= 2 * sm_count else 32
        bk = 64 if small else 128
        gu = GemmTile(block_n=bn_gu, block_k=bk, num_warps=4, num_stages=1 if small else 4)
        bn_d = 64 if used * math.ceil(H / 64) >= sm_count else 32
        split = _down_split(used, math.ceil(H / bn_d), math.ceil(I / bk), sm_count)
        dn = GemmTile(block_n=bn_d, block_k=bk, num_warps=4, num_stages=1 if small else 4, split_k=split)
        return MoETileConfig(block_m=bm, gate_up=gu, down=dn)
    if rows <= 64 or small:
        bm = 32 if rows <= 32 else 64
        gu = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=1 if small else 4)
        dn = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=1 if small else 4)
        return MoETileConfig(block_m=bm, gate_up=gu, down=dn)
    gu = GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=3)
    dn = GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=4)
    return MoETileConfig(block_m=128 if rows >= 128 else 64, gate_up=gu, down=dn)


def default_batch_invariant(key: ShapeKey) -> MoETileConfig:
    """One configuration for every T: no split-K (a split would change the sum order only if
    it changed with T; we keep it at 1 so the partial buffer stays small at large T)."""
    if key.dtype == "float32":
        t = GemmTile(block_n=32, block_k=32, num_warps=4, num_stages=1)
        return MoETileConfig(block_m=16, gate_up=t, down=t)
    return MoETileConfig(
        block_m=64,
        gate_up=GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=4),
        down=GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=4),
    )


def lookup(key: ShapeKey, num_tokens: int, device: str, *, batch_invariant: bool = False,
           sm_count: int = 132, directory: Path | None = None) -> MoETileConfig:
    """The tile configuration for a batch of num_tokens tokens (tuned file first, else heuristic)."""
    table = load_table(key, device, directory)
    if batch_invariant:
        if table is not None and table["batch_invariant_by_T"]:
            by_t = table["batch_invariant_by_T"]
            return by_t[nearest_key(by_t, num_tokens)]
        if table is not None and table["batch_invariant"] is not None:
            return table["batch_invariant"]
        return default_batch_invariant(key)
    if table is not None and table["configs"]:
        return table["configs"][nearest_key(table["configs"], num_tokens)]
    return default_config(key, num_tokens, sm_count)
