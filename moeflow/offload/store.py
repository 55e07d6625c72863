"""ExpertStore: every expert's weights on the host, and how to copy one into a cache slot.

Legend: L offloaded layers (positions 0..L-1 in the attached list), E routed
experts per layer, H hidden, I intermediate per expert. A key is (layer, expert).

Per-expert tensor names and shapes (the slot buffers use the same):
    layout "linear": gate_up [2I, H], down [H, I]
    layout "matmul": gate_up [H, 2I], down [I, H]
    with expert biases: gate_up_bias [2I], down_bias [H]

Modes:
    pinned  one host copy of each layer's expert tensors, page-locked when CUDA is
            available (full PCIe bandwidth: 54.8 GB/s pinned vs 6.7 GB/s pageable on the
            H200 host); plain memory otherwise. Costs host memory = all experts' bytes.
    mmap    nothing copied up front: a miss reads the expert's bytes from the memory-
            mapped safetensors (moeflow.checkpoint.index.CheckpointIndex), so the OS page
            cache is the host tier. For host memory shorter than the experts.
    model   the model's own tensors, no copy (CPU tests, or when they are already pinned).

Packed layout (`from_weights(..., packed=True)`, the sync-free decode of moeflow.offload.syncfree):
each layer's experts live in ONE host buffer uint8 [E, B]; row e holds expert e's tensors
back to back (each at a 16-byte aligned offset, B a multiple of 16), and the per-name
tensors are strided views into it. A device kernel then moves an expert as one row of
bytes, whatever the tensors' dtypes (quantized bytes included): `packed_layout`,
`packed_views` (the device slot pool uses the same layout).

`pieces(layer, expert)` is the copy recipe: [(name, rows | None, src)], where
`rows = (a, b)` writes src into slot[name][a:b] (Mixtral's w1 / w3 fill the two
halves of gate_up) and None fills the whole per-expert tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

NAMES = ("gate_up", "down", "gate_up_bias", "down_bias")


def _progress(iterable, *, total: int, desc: str, enabled: bool, unit: str = "it"):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency; stay usable without it
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class ExpertMismatchError(ValueError):
    """A store's expert is not the model's: the checkpoint read lazily (mode "mmap") holds other weights.

    Attributes: layer (the checkpoint's decoder-layer number), expert (its expert id), tensor
    (gate_up / down / a bias), row (the sampled row of the per-expert tensor that differs).
    """

    def __init__(self, message: str, *, layer: int, expert: int, tensor: str, row: int | None) -> None:
        super().__init__(message)
        self.layer, self.expert, self.tensor, self.row = layer, expert, tensor, row


# Rows of each per-expert tensor compared by `check_matches` (first, middle, last): a few
# pages of the checkpoint per expert, read once at attach.
def _sample_rows(n: int) -> list[int]:
    return sorted({0, n // 2, n - 1}) if n > 0 else []


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as integers (NaN compares equal to the same NaN; -0.0 differs from 0.0)."""
    return t.reshape(-1).contiguous().view(torch.uint8)


def check_matches(store: ExpertStore, weights: Sequence, *, layer_ids: Sequence[int],
                  expert_ids: Sequence[Sequence[int]] | None = None, source: str = "the checkpoint") -> None:
    """ExpertMismatchError unless each store expert's sampled rows equal the model's resident ones.

    A fingerprint, not a full comparison: per layer, expert and tensor, the first, middle and
    last rows (as a slot copy would convert them: to the resident tensor's dtype), and the
    per-expert shapes. Catches another checkpoint, another revision or rescaled weights of the
    same shapes before they serve a single step; an edit confined to unsampled rows passes.

    store: the lazily read store; weights: the layers' resident ExpertWeights, in store order;
    layer_ids: the checkpoint layer numbers (for the message); expert_ids: per layer the
    checkpoint expert each store expert is (expert parallelism), None: the same ids.
    """
    for i, w in enumerate(weights):
        layer = int(layer_ids[i])
        held = {n for n in w.TENSOR_FIELDS if getattr(w, n) is not None}
        if held != set(store.shapes):
            raise ExpertMismatchError(
                f"{source}: layer {layer} (layers[{i}]) holds expert tensors {sorted(store.shapes)}, the model's "
                f"layer holds {sorted(held)}; expected the checkpoint the model was loaded from",
                layer=layer, expert=0, tensor=sorted(held ^ set(store.shapes))[0], row=None)
        for name, shape in store.shapes.items():
            got = tuple(getattr(w, name).shape[1:])
            if got != tuple(shape):
                raise ExpertMismatchError(
                    f"{source}: layer {layer} (layers[{i}]) {name}: per-expert shape {tuple(shape)}, the model's is "
                    f"{got}; expected the checkpoint the model was loaded from", layer=layer, expert=0, tensor=name,
                    row=None)
        for e in range(store.num_experts[i]):
            ce = int(expert_ids[i][e]) if expert_ids is not None else e
            for name, rows, src in store.pieces(i, e):
                res = getattr(w, name)[e]
                start = 0 if rows is None else rows[0]
                for r in _sample_rows(int(src.shape[0]) if src.dim() else 0):
                    a, b = src[r].to(res.dtype), res[start + r]
                    if not torch.equal(_bits(a), _bits(b)):
                        diff = (a.float() - b.float()).abs().max().item()
                        raise ExpertMismatchError(
                            f"{source}: layer {layer} (layers[{i}]) expert {ce}: {name} row {start + r} differs from "
                            f"the model's resident weights (max |diff| {diff:.3g}); the checkpoint is not the one the "
                            f"model was loaded from; expected that checkpoint (OffloadConfig.checkpoint) or "
                            f"store='pinned'", layer=layer, expert=ce, tensor=name, row=start + r)


class ExpertStore:
    """All offloaded experts on the host (see module doc for modes and shapes).

    Attributes:
        num_layers: L.
        num_experts: list of E per layer.
        layer_tensors: per layer, name -> [E, *shape] host tensor of all its experts (pinned /
            model modes); None for mmap.
        shapes: name -> per-expert shape (gate_up, down, and the biases when present).
        dtype, layout, interleaved: as the layers' ExpertWeights.
        expert_bytes: bytes one expert's copy moves (in `dtype`).
        mode: "pinned" | "mmap" | "model".
        pinned: whether the host tensors are page-locked.
    """

    def __init__(self, *, num_experts: Sequence[int], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 layout: str, interleaved: bool, mode: str, pinned: bool, recipes,
                 dtypes: dict[str, torch.dtype] | None = None, quant=None) -> None:
        self.num_layers = len(num_experts)
        self.num_experts = list(num_experts)
        self.shapes = dict(shapes)
        self.dtype = dtype
        # Per-tensor dtypes: quantized experts keep their stored form (fp8 / packed uint8 data,
        # f32 or E8M0 scales, float biases), so the slots move the checkpoint's bytes.
        self.dtypes = {n: (dtypes or {}).get(n, dtype) for n in self.shapes}
        self.quant = quant
        self.layout = layout
        self.interleaved = interleaved
        self.mode = mode
        self.pinned = pinned
        self._recipes = recipes  # layer -> callable(expert) -> pieces
        # Per layer name -> [E, *shape] host tensor holding all its experts (from_weights: the
        # pinned copies or the model's tensors), or None (mmap: experts are read one at a time).
        self.layer_tensors: list[dict[str, torch.Tensor]] | None = None
        # Packed layout (module doc): per layer a uint8 [E, B] host buffer, or None.
        self.packed: list[torch.Tensor] | None = None
        self.packed_offsets: dict[str, int] = {}
        self.packed_row_bytes = 0
        self.expert_bytes = sum(math.prod(s) * torch.empty((), dtype=self.dtypes[n]).element_size()
                                for n, s in self.shapes.items())

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * sum(self.num_experts)

    def pieces(self, layer: int, expert: int) -> list[tuple[str, tuple[int, int] | None, torch.Tensor]]:
        """The copy recipe of one expert: [(tensor name, rows or None, host source tensor)]."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer}: expected 0 <= layer < {self.num_layers}")
        if not 0 <= expert < self.num_experts[layer]:
            raise ValueError(f"expert={expert}: expected 0 <= expert < {self.num_experts[layer]} (layer {layer})")
        return self._recipes[layer](expert)

    def __repr__(self) -> str:
        return (f"ExpertStore(mode={self.mode!r}, pinned={self.pinned}, layers={self.num_layers}, "
                f"experts={sum(self.num_experts)}, expert_bytes={self.expert_bytes}, "
                f"total={self.total_bytes / 2**30:.2f} GiB)")

    # ---- constructors ----------------------------------------------------------------------
    @classmethod
    def from_weights(cls, weights: Sequence, *, mode: str = "pinned", pin: bool | None = None,
                     progress: bool = True, packed: bool = False) -> ExpertStore:
        """A store of the given layers' ExpertWeights (one per offloaded layer, in order).

        mode "pinned": copies each layer's tensors once into host memory (page-locked when
        `pin`, default: CUDA available); a tensor shared by several layers is copied once.
        mode "model": the tensors themselves (must be on the CPU).
        packed: (mode "pinned" only) one uint8 [E, B] buffer per layer holding every expert's
        bytes in a row (module doc); the per-name tensors are views into it. Same host bytes.
        """
        if mode not in ("pinned", "model"):
            raise ValueError(f"mode={mode!r}: expected 'pinned' or 'model' (use from_checkpoint for 'mmap')")
        if packed and mode != "pinned":
            raise ValueError(f"packed=True: needs mode='pinned' (a copy into the packed buffers), got mode={mode!r}")
        if not weights:
            raise ValueError("weights: empty, expected one ExpertWeights per offloaded layer")
        w0 = weights[0]
        shapes = _shapes_of(w0)
        for i, w in enumerate(weights):
            got = _shapes_of(w)
            if got != shapes or w.dtype != w0.dtype or w.layout != w0.layout or w.interleaved != w0.interleaved \
                    or w.quant != w0.quant:
                raise ValueError(
                    f"weights[{i}]: per-expert shapes {got} / {w.dtype} / layout {w.layout!r} differ from "
                    f"weights[0]'s {shapes} / {w0.dtype} / {w0.layout!r}: one slot pool needs one expert shape"
                )
        if pin is None:
            pin = torch.cuda.is_available()
        pin = bool(pin) and mode == "pinned"
        copies: dict[int, torch.Tensor] = {}

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if mode == "model":
                if t.device.type != "cpu":
                    raise ValueError(f"store mode 'model' needs CPU expert tensors, got one on {t.device}")
                return t.detach()
            key = id(t)
            if key not in copies:
                dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                dst.copy_(t.detach())
                copies[key] = dst
            return copies[key]

        dtypes = {n: getattr(w0, n).dtype for n in shapes}
        offsets, row_bytes = packed_layout(shapes, dtypes)
        buffers: list[torch.Tensor] = []

        def packed_host(w) -> dict[str, torch.Tensor]:
            buf = torch.zeros((_expert_count(w), row_bytes), dtype=torch.uint8, pin_memory=pin)
            views = packed_views(buf, shapes, dtypes, offsets)
            for n, v in views.items():
                v.copy_(getattr(w, n).detach())
            buffers.append(buf)
            return views

        per_layer: list[dict[str, torch.Tensor]] = []
        total = sum(_expert_count(w) for w in weights)
        it = _progress(range(len(weights)), total=len(weights), desc=f"experts -> host ({total} experts)",
                       enabled=progress and mode == "pinned")
        for i in it:
            w = weights[i]
            per_layer.append(packed_host(w) if packed else {n: host(getattr(w, n)) for n in shapes})

        def recipe(tensors: dict[str, torch.Tensor]):
            return lambda e: [(name, None, t[e]) for name, t in tensors.items()]

        store = cls(num_experts=[_expert_count(w) for w in weights], shapes=shapes, dtype=w0.dtype,
                    layout=w0.layout, interleaved=w0.interleaved, mode=mode, pinned=pin,
                    recipes=[recipe(t) for t in per_layer], dtypes=dtypes, quant=w0.quant)
        store.layer_tensors = per_layer
        if packed:
            store.packed, store.packed_offsets, store.packed_row_bytes = buffers, offsets, row_bytes
        return store

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, layer_ids: Sequence[int], *, layout: str = "linear",
                        interleaved: bool = False, dtype: torch.dtype | None = None, family: str | None = None,
                        layer_prefix: str = "model.layers.{layer}.", progress: bool = True,
                        expert_ids: Sequence[Sequence[int]] | None = None) -> ExpertStore:
        """A lazy store reading experts from a safetensors checkpoint (mode "mmap").

        layer_ids: the checkpoint's decoder-layer numbers of the offloaded layers, in order
        (position i of the store is checkpoint layer layer_ids[i]).
        family: the checkpoint family / model_type (default: config.json's model_type when
        the checkpoint has one). Known families go through moeflow.checkpoint.loader.plan_layer
        (the checkpoint helper's strict, per-family key accounting, headers only); without a
        family the fallback recognises these expert keys under `layer_prefix`:
            block_sparse_moe.experts.{e}.w1/w3/w2.weight          (Mixtral, per expert)
            mlp.experts.{e}.gate_proj/up_proj/down_proj.weight   (Qwen-MoE, DeepSeek, OLMoE, ...)
            mlp.experts.gate_up_proj / down_proj [E, ...] (+ _bias) (fused, transformers 5 / gpt-oss)
        The initial pass reads headers only (a progress bar over layers); each miss then
        reads one expert's bytes through the memory map.
        expert_ids: per layer, the checkpoint experts the store serves, in order (store expert
        j of layer i is checkpoint expert expert_ids[i][j]: a rank's local experts under
        expert parallelism); None: every expert of each layer.
        """
        if expert_ids is not None and len(expert_ids) != len(layer_ids):
            raise ValueError(f"expert_ids: {len(expert_ids)} lists for {len(layer_ids)} layers")
        from ..checkpoint.index import CheckpointIndex

        index = CheckpointIndex(path)
        if family is None:
            family = _config_model_type(index.directory)
        recipes, counts = [], []
        shapes: dict[str, tuple[int, ...]] | None = None
        store_dtype = dtype
        for pos in _progress(range(len(layer_ids)), total=len(layer_ids), desc="indexing experts",
                             enabled=progress):
            if family is not None:
                recipe, n, layer_shapes, layer_dtype = _planned_layer(index, family, layer_ids[pos])
            else:
                prefix = layer_prefix.format(layer=layer_ids[pos])
                recipe, n, layer_shapes, layer_dtype = _checkpoint_layer(index, prefix, layout)
            if shapes is None:
                shapes = layer_shapes
            elif layer_shapes != shapes:
                raise ValueError(f"checkpoint layer {layer_ids[pos]}: expert shapes {layer_shapes} differ from "
                                 f"layer {layer_ids[0]}'s {shapes}: one slot pool needs one expert shape")
            store_dtype = store_dtype or layer_dtype
            if expert_ids is not None:
                ids = [int(e) for e in expert_ids[pos]]
                bad = [e for e in ids if not 0 <= e < n]
                if bad:
                    raise ValueError(f"expert_ids[{pos}]: expert {bad[0]} outside [0, {n}) of checkpoint layer "
                                     f"{layer_ids[pos]}")
                recipe, n = (lambda j, r=recipe, ids=ids: r(ids[j])), len(ids)
            recipes.append(recipe)
            counts.append(n)
        if shapes is None:
            raise ValueError("layer_ids: empty, expected the checkpoint layers to offload")
        return cls(num_experts=counts, shapes=shapes, dtype=store_dtype, layout=layout,
                   interleaved=interleaved, mode="mmap", pinned=False, recipes=recipes)


# Alignment of each tensor inside a packed row, and of the row itself (16 bytes: any dtype's
# element, torch's grouped GEMM's pointer rule, and 4-word vector loads in the gather kernel).
PACK_ALIGN = 16


def packed_layout(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]
                  ) -> tuple[dict[str, int], int]:
    """(name -> byte offset inside a packed row, row bytes B): names in `shapes` order, each 16-aligned."""
    offsets: dict[str, int] = {}
    off = 0
    for n, shape in shapes.items():
        offsets[n] = off
        nbytes = math.prod(shape) * torch.empty((), dtype=dtypes[n]).element_size()
        off += -(-nbytes // PACK_ALIGN) * PACK_ALIGN
    return offsets, max(off, PACK_ALIGN)


def packed_views(buf_RB: torch.Tensor, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype],
                 offsets: dict[str, int]) -> dict[str, torch.Tensor]:
    """name -> view [R, *shape] (its dtype) of a packed uint8 buffer [R, B] (rows: experts or slots).

    Each view has stride(0) = B / element size and its own per-expert part contiguous, so
    row r of every view is expert r's tensor as an unpacked [E, *shape] tensor would hold it.
    """
    if buf_RB.dtype != torch.uint8 or buf_RB.dim() != 2:
        raise ValueError(f"buf_RB: {buf_RB.dtype} shape {tuple(buf_RB.shape)}, expected uint8 [R, B]")
    out: dict[str, torch.Tensor] = {}
    R = int(buf_RB.shape[0])
    for n, shape in shapes.items():
        size = torch.empty((), dtype=dtypes[n]).element_size()
        numel = math.prod(shape)
        flat = buf_RB[:, offsets[n] : offsets[n] + numel * size].view(dtypes[n])  # [R, numel]
        out[n] = flat.view(R, *shape) if shape else flat[:, 0]
    return out


def _expert_count(w) -> int:
    return int(w.gate_up.shape[0])


def _shapes_of(w) -> dict[str, tuple[int, ...]]:
    """name -> per-expert shape of every tensor the ExpertWeights holds (quantization scales too)."""
    return {n: tuple(getattr(w, n).shape[1:]) for n in w.TENSOR_FIELDS if getattr(w, n) is not None}


def _config_model_type(directory: str) -> str | None:
    import json

    cfg = os.path.join(directory, "config.json")
    if not os.path.exists(cfg):
        return None
    with open(cfg) as f:
        data = json.load(f)
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else None
    return (text or data).get("model_type") or data.get("model_type")


def _planned_layer(index, family: str, layer_idx: int):
    """(recipe, E, per-expert shapes, dtype) from the checkpoint helper's plan of one MoE layer."""
    from ..checkpoint.loader import plan_layer

    plan = plan_layer(index, family, layer_idx)
    by_role = {s.role: s.key for s in plan.slots}
    d = plan.dims
    if plan.source_format == "fused":
        names = {n: by_role[n] for n in NAMES if n in by_role}
        shapes = {n: index.info(k).shape[1:] for n, k in names.items()}

        def recipe(e: int):
            return [(n, None, index.get(k, rows=slice(e, e + 1))[0]) for n, k in names.items()]

        return recipe, d.E, shapes, index.info(names["gate_up"]).dtype
    keys = plan.expert_keys
    I = d.I

    def recipe(e: int):  # noqa: F811 - one of the two recipes is returned
        g, u, dn = keys[e]
        return [("gate_up", (0, I), index.get(g)), ("gate_up", (I, 2 * I), index.get(u)),
                ("down", None, index.get(dn))]

    return recipe, d.E, {"gate_up": (2 * I, d.H), "down": (d.H, I)}, index.info(keys[0][0]).dtype


def _checkpoint_layer(index, prefix: str, layout: str):
    """(recipe, E, per-expert shapes, dtype) of one layer's experts in a checkpoint."""
    from ..checkpoint.index import CheckpointError

    fused = prefix + "mlp.experts.gate_up_proj"
    if fused in index:
        down_key = prefix + "mlp.experts.down_proj"
        gi, di = index.info(fused), index.info(down_key)
        names = {"gate_up": fused, "down": down_key}
        shapes = {"gate_up": gi.shape[1:], "down": di.shape[1:]}
        if fused + "_bias" in index:
            names["gate_up_bias"], names["down_bias"] = fused + "_bias", down_key + "_bias"
            shapes["gate_up_bias"] = index.info(fused + "_bias").shape[1:]
            shapes["down_bias"] = index.info(down_key + "_bias").shape[1:]

        def recipe(e: int):
            return [(n, None, index.get(k, rows=slice(e, e + 1))[0]) for n, k in names.items()]

        return recipe, gi.shape[0], shapes, gi.dtype

    for base, (g, u, d) in ((prefix + "block_sparse_moe.experts.", ("w1", "w3", "w2")),
                            (prefix + "mlp.experts.", ("gate_proj", "up_proj", "down_proj"))):
        first = f"{base}0.{g}.weight"
        if first not in index:
            continue
        if layout != "linear":
            raise ValueError(f"{first}: per-expert nn.Linear weights give layout 'linear', not {layout!r}")
        n = 0
        while f"{base}{n}.{g}.weight" in index:
            n += 1
        gi, di = index.info(first), index.info(f"{base}0.{d}.weight")
        I, H = gi.shape
        shapes = {"gate_up": (2 * I, H), "down": tuple(di.shape)}
        for e in range(n):
            for part in (g, u, d):
                if f"{base}{e}.{part}.weight" not in index:
                    raise CheckpointError(f"checkpoint lacks {base}{e}.{part}.weight (expert {e} of {n})",
                                          key=f"{base}{e}.{part}.weight")

        def recipe(e: int, base=base, g=g, u=u, d=d, I=I):
            return [("gate_up", (0, I), index.get(f"{base}{e}.{g}.weight")),
                    ("gate_up", (I, 2 * I), index.get(f"{base}{e}.{u}.weight")),
                    ("down", None, index.get(f"{base}{e}.{d}.weight"))]

        return recipe, n, shapes, gi.dtype
    raise CheckpointError(f"no routed-expert tensors under {prefix!r} (looked for fused mlp.experts.gate_up_proj, "
                          f"block_sparse_moe.experts.N.w1.weight, mlp.experts.N.gate_proj.weight)", key=prefix)
