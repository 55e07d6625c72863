"""Routing traces: record them from a patched model, replay them through the slot cache, measure them.

Legend: L MoE layers (positions in model order), E routed experts per layer, K
picks per token, W recorded prediction width, T tokens of one forward pass, S slots.
A key is (layer, expert).

File format (JSON lines, optionally .gz): the first line is the header
    {"moeflow_trace": 1, "num_layers": L, "num_experts": [E..], "top_k": [K..],
     "pred_width": W, "expert_bytes": B, "num_zero_experts": [Z..], "meta": {...}}
(`num_zero_experts` is optional, default all 0: LongCat's zero experts, ids E..E+Z-1.)
then one line per layer step, in execution order:
    {"p": pass, "l": layer, "ids": [[K ids] x T], "pred": [[W ids] x T] | null}
`pred` of layer l holds the predicted ids of layer l + 1 (the next layer's router
on layer l's input, best first; the last layer has none). A pass is one forward
of the model (prefill: T > 1 rows; decode: T = 1). `Trace.as_decode()` splits a
prefill pass into one pass per token (a causal model routes row t the same way
whether it is prefilled or decoded), the shape a decode cache sees.

`replay(trace, slots, policy, prefetch)` runs the live cache's SlotTable on the
trace step by step, in the live runtime's order (protect predictions -> pin and
load this step's experts -> prefetch the predicted ones), so its counts are the
live cache's counts. "belady" evicts the key used furthest ahead and never
prefetches: no policy, with or without prefetch, copies fewer experts.

Validation: a Trace refuses, at construction and when loaded (naming the field, the
line or step, and the value), what would otherwise replay into a wrong table: header
lists whose length is not num_layers, negative sizes, expert ids outside [0, E + Z),
rows of other than K distinct ids, predictions of the wrong width or range.
`Trace.validate()` checks the steps of a trace built in code; `replay` calls it.

Size claims are bounded before anything is sized by them: at most MAX_LAYERS layers,
MAX_EXPERTS experts per layer and MAX_EXPERTS_TOTAL over all layers (the statistics and
the plots hold one count per expert), expert_bytes at most MAX_EXPERT_BYTES, a pred_width
of at most the experts of a layer. `Trace.load` reads only a regular file (a FIFO would
block forever), lines of at most MAX_LINE_CHARS characters (a small gzip file can hold one
huge line), and refuses JSON nested too deeply to parse.

The command line (`moeflow trace record | replay | stats | plot`) lives in
`moeflow.trace_command`; this module is the library.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..paths import check_input_file
from .gate import PREFETCH_RULES, PrefetchGate
from .policy import POLICIES, PREDICTIVE_POLICIES, Belady, make_policy
from .slots import CacheRates, Key, SlotTable

TRACE_VERSION = 1
REPLAY_POLICIES = (*POLICIES, "belady")

# Bounds on what a trace may claim (the largest MoE models have a few hundred layers and
# experts per layer): the statistics and plots size lists by these numbers.
MAX_LAYERS = 1 << 12
MAX_EXPERTS = 1 << 16  # per layer, zero experts included
MAX_EXPERTS_TOTAL = 1 << 20  # routed experts over all layers (the most slots a replay can use)
MAX_EXPERT_BYTES = 1 << 40
# A step line holds T rows of K ids and T predictions of W ids: a pass of 65536 tokens with
# K = 8 and W = 16 is under 8 Mi characters.
MAX_LINE_CHARS = 1 << 24


@dataclass
class Step:
    """One layer step: `ids` [T][K] of layer `layer`, `pred` [T][W] of layer + 1 (or None)."""

    pass_idx: int
    layer: int
    ids: list[list[int]]
    pred: list[list[int]] | None = None


def _check_row(where: str, name: str, row: object, n: int, bound: int, what: str) -> None:
    """A row of exactly n distinct int ids in [0, bound)."""
    if not isinstance(row, list) or len(row) != n:
        got = f"{len(row)} ids" if isinstance(row, list) else repr(row)
        raise ValueError(f"{where}: {name}={row!r}: {got}, expected {what}={n} ids")
    for e in row:
        if not _is_int(e) or not 0 <= e < bound:
            raise ValueError(f"{where}: {name}: expert id {e!r}, expected an int in [0, {bound})")
    if len(set(row)) != n:
        raise ValueError(f"{where}: {name}={row!r}: repeats an expert id (expected {n} distinct)")


def _is_int(v: object) -> bool:
    # JSON gives 1.5 or true for a corrupt id; only a real int is an id.
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(name: str, v: object, n: int, minimum: int) -> list[int]:
    if not isinstance(v, (list, tuple)) or len(v) != n or not all(_is_int(x) and x >= minimum for x in v):
        raise ValueError(f"Trace.{name}={v!r}: expected a list of num_layers={n} ints >= {minimum}")
    return list(v)


@dataclass
class Trace:
    """A routing trace (see module doc). Header fields are validated at construction.

    num_layers: L >= 1.  num_experts, top_k: L ints each (E >= 1, 1 <= K <= E + Z).
    pred_width: W >= 0 ids per predicted row.  expert_bytes: bytes of one expert, >= 0.
    num_zero_experts: L ints >= 0 (None: all 0).  steps: see `Step` and `validate`.
    """

    num_layers: int
    num_experts: list[int]
    top_k: list[int]
    pred_width: int = 0
    expert_bytes: int = 0
    meta: dict = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    num_zero_experts: list[int] | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.num_layers) or not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"Trace.num_layers={self.num_layers!r}: expected an int in [1, {MAX_LAYERS}]")
        L = self.num_layers
        self.num_experts = _int_list("num_experts", self.num_experts, L, 1)
        self.num_zero_experts = _int_list("num_zero_experts", [0] * L if self.num_zero_experts is None
                                          else self.num_zero_experts, L, 0)
        self.top_k = _int_list("top_k", self.top_k, L, 1)
        for layer, (k, e, z) in enumerate(zip(self.top_k, self.num_experts, self.num_zero_experts)):
            if e + z > MAX_EXPERTS:
                raise ValueError(f"Trace.num_experts[{layer}]={e} (+ {z} zero experts): expected at most "
                                 f"{MAX_EXPERTS} experts per layer")
            if k > e + z:
                raise ValueError(f"Trace.top_k[{layer}]={k}: exceeds the layer's {e} + {z} experts")
        if sum(self.num_experts) > MAX_EXPERTS_TOTAL:
            raise ValueError(f"Trace.num_experts: {sum(self.num_experts)} experts over {L} layers, expected at "
                             f"most {MAX_EXPERTS_TOTAL}")
        for name, bound in (("pred_width", max(self.num_experts)), ("expert_bytes", MAX_EXPERT_BYTES)):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= v <= bound:
                what = "the most experts of a layer" if name == "pred_width" else "bytes of one expert"
                raise ValueError(f"Trace.{name}={v!r}: expected an int in [0, {bound}] ({what})")
        if not isinstance(self.meta, dict):
            raise ValueError(f"Trace.meta={self.meta!r}: expected a dict")

    # ---- validation ----------------------------------------------------------------------
    def check_step(self, step: Step, where: str) -> None:
        """ValueError naming `where` (a file line or a step index), the field and its value."""
        p, layer = step.pass_idx, step.layer
        if not _is_int(p) or p < 0:
            raise ValueError(f"{where}: pass {p!r}: expected an int >= 0")
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"{where}: layer {layer!r} outside [0, {self.num_layers})")
        K, S = self.top_k[layer], self.num_experts[layer] + self.num_zero_experts[layer]
        if not isinstance(step.ids, list) or not step.ids:
            raise ValueError(f"{where}: ids {step.ids!r}: expected a list of T >= 1 rows of K={K} ids")
        for t, row in enumerate(step.ids):
            _check_row(where, f"ids[{t}]", row, K, S, "K")
        if step.pred is None:
            return
        if self.pred_width == 0:
            raise ValueError(f"{where}: pred given, but the header's pred_width is 0")
        if layer + 1 >= self.num_layers:
            raise ValueError(f"{where}: pred given for the last layer {layer} (there is no layer {layer + 1})")
        if not isinstance(step.pred, list) or len(step.pred) != len(step.ids):
            n = len(step.pred) if isinstance(step.pred, list) else step.pred
            raise ValueError(f"{where}: pred has {n!r} rows, expected one per ids row ({len(step.ids)})")
        E_next = self.num_experts[layer + 1]  # zero experts hold no weights: never predicted
        for t, row in enumerate(step.pred):
            _check_row(where, f"pred[{t}]", row, self.pred_width, E_next, "pred_width")

    def validate(self) -> Trace:
        """Check every step (`check_step`) and that the steps of one pass agree on T; returns self."""
        rows: dict[int, int] = {}
        for i, s in enumerate(self.steps):
            where = f"step {i}"
            self.check_step(s, where)
            T = rows.setdefault(s.pass_idx, len(s.ids))
            if len(s.ids) != T:
                raise ValueError(f"{where}: {len(s.ids)} token rows, but pass {s.pass_idx} has T={T}")
        return self

    # ---- io ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        path = os.fspath(path)
        opener = gzip.open if path.endswith(".gz") else open
        head = {"moeflow_trace": TRACE_VERSION, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "top_k": self.top_k, "pred_width": self.pred_width, "expert_bytes": self.expert_bytes,
                "meta": self.meta}
        if any(self.num_zero_experts):
            head["num_zero_experts"] = self.num_zero_experts
        with opener(path, "wt") as f:
            f.write(json.dumps(head) + "\n")
            for s in self.steps:
                f.write(json.dumps({"p": s.pass_idx, "l": s.layer, "ids": s.ids, "pred": s.pred},
                                   separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        """Read and validate a trace file; ValueError names the line, the field and the value.

        Only a regular file is opened (FileNotFoundError, or moeflow.paths.PathError for a
        directory, a FIFO, a device); see the module doc for the bounds on what it may claim.
        """
        path = check_input_file(path, "trace")
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rt") as f:
                return cls._read(path, f)
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise ValueError(f"{path}: not a text trace file ({exc}); expected a trace written by "
                             f"`moeflow trace record` (.jsonl or .jsonl.gz)") from exc

    @classmethod
    def _read(cls, path: str, f) -> Trace:
        lines = _bounded_lines(path, f)
        _, first = next(lines, (1, ""))
        try:
            head = _json_line(first)
        except ValueError as exc:
            raise ValueError(f"{path}: line 1 is not JSON ({exc}); expected a moeflow trace header") from exc
        if not isinstance(head, dict) or head.get("moeflow_trace") != TRACE_VERSION:
            raise ValueError(f"{path}: line 1 is not a moeflow trace header (version {TRACE_VERSION})")
        for key in ("num_layers", "num_experts", "top_k"):
            if key not in head:
                raise ValueError(f"{path}:1: header lacks {key!r}")
        try:
            t = cls(num_layers=head["num_layers"], num_experts=head["num_experts"], top_k=head["top_k"],
                    pred_width=head.get("pred_width", 0), expert_bytes=head.get("expert_bytes", 0),
                    meta=head.get("meta", {}), num_zero_experts=head.get("num_zero_experts"))
        except ValueError as exc:
            raise ValueError(f"{path}:1: {exc}") from exc
        rows: dict[int, int] = {}
        for n, line in lines:
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                r = _json_line(line)
            except ValueError as exc:
                raise ValueError(f"{where}: not JSON ({exc}); expected a step line") from exc
            if not isinstance(r, dict) or any(k not in r for k in ("p", "l", "ids")):
                raise ValueError(f"{where}: expected a step {{'p': pass, 'l': layer, 'ids': [...]}}, got {line[:80]!r}")
            step = Step(r["p"], r["l"], r["ids"], r.get("pred"))
            t.check_step(step, where)
            T = rows.setdefault(step.pass_idx, len(step.ids))
            if len(step.ids) != T:
                raise ValueError(f"{where}: {len(step.ids)} token rows, but pass {step.pass_idx} has T={T}")
            t.steps.append(step)
        return t

    # ---- views ---------------------------------------------------------------------------
    def as_decode(self) -> Trace:
        """The same routing with every pass split into single-token passes (token-major order)."""
        out = Trace(self.num_layers, list(self.num_experts), list(self.top_k), self.pred_width,
                    self.expert_bytes, dict(self.meta), num_zero_experts=list(self.num_zero_experts))
        passes: dict[int, list[Step]] = {}
        for s in self.steps:
            passes.setdefault(s.pass_idx, []).append(s)
        p = 0
        for idx in sorted(passes):
            steps = passes[idx]
            T = len(steps[0].ids)
            for t in range(T):
                for s in steps:
                    out.steps.append(Step(p, s.layer, [s.ids[t]], None if s.pred is None else [s.pred[t]]))
                p += 1
        return out

    def tokens(self) -> list[dict[int, list[int]]]:
        """Per token (pass-major, row order): layer -> ids."""
        out: list[dict[int, list[int]]] = []
        passes: dict[int, list[Step]] = {}
        for s in self.steps:
            passes.setdefault(s.pass_idx, []).append(s)
        for idx in sorted(passes):
            steps = passes[idx]
            for t in range(len(steps[0].ids)):
                out.append({s.layer: s.ids[t] for s in steps})
        return out


def _bounded_lines(path: str, f):
    """(line number, line) of a text file, each line at most MAX_LINE_CHARS characters (else ValueError)."""
    n = 0
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE_CHARS:
            raise ValueError(f"{path}:{n}: line longer than {MAX_LINE_CHARS} characters; expected a trace line "
                             f"(a header, or one layer step)")
        yield n, line


def _json_line(line: str):
    """json.loads, with a nesting too deep for the parser refused as a ValueError."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None


def is_trace_file(path: str | os.PathLike) -> bool:
    """True when `path` is a regular file whose first line is a moeflow trace header (read bounded)."""
    path = os.fspath(path)
    try:
        check_input_file(path, "trace")
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            first = f.readline(1 << 20)
        head = json.loads(first)
    except (OSError, ValueError, EOFError, zlib.error, RecursionError):
        return False
    return isinstance(head, dict) and "moeflow_trace" in head


# ---- recording ------------------------------------------------------------------------------


class TraceRecorder:
    """Records every MoELayer step of a (patched, optionally offloaded) model into a Trace.

    Hooks: a forward pre-hook keeps each layer's input; a forward hook reads
    `layer.last_routing` (the real expert ids, also when offloaded) and, when
    width > 0, runs the next layer's router on that input (predict_next_ids). It
    reads ids back to the host (a sync per layer): a tracing tool, not the fast path.
    """

    def __init__(self, layers: Sequence, *, width: int | None = None, meta: dict | None = None,
                 expert_bytes: int | None = None) -> None:
        from ..routing.predict import predict_next_ids

        self._predict = predict_next_ids
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("layers: empty, expected the model's MoELayers")
        self.width = prediction_width(width, [m.config.top_k for m in self.layers],
                                      [m.config.num_experts for m in self.layers])
        if expert_bytes is None:
            expert_bytes = _held_expert_bytes(self.layers[0])
        elif not _is_int(expert_bytes) or not 0 <= expert_bytes <= MAX_EXPERT_BYTES:
            raise ValueError(f"expert_bytes={expert_bytes!r}: expected an int in [0, {MAX_EXPERT_BYTES}]")
        self.trace = Trace(len(self.layers), [m.config.num_experts for m in self.layers],
                           [m.config.top_k for m in self.layers], self.width, expert_bytes, dict(meta or {}),
                           num_zero_experts=[m.config.router.num_zero_experts for m in self.layers])
        self._pass = -1
        self._last_layer = len(self.layers)
        self._inputs: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> TraceRecorder:
        for pos, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(pos), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post(pos)))
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, pos: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["x"]
            self._inputs[pos] = x.reshape(-1, x.shape[-1]).detach()
            return None

        return hook

    def _post(self, pos: int):
        def hook(module, args, output):
            routing = module.last_routing
            if pos <= self._last_layer:
                self._pass += 1
            self._last_layer = pos
            ids = routing.ids_TK.cpu().tolist()
            pred = None
            if self.width > 0 and pos + 1 < len(self.layers):
                nxt = self.layers[pos + 1]
                x_TH = self._inputs.pop(pos)
                rw = nxt.router_weights
                with torch.no_grad():
                    p = self._predict(nxt.router_input(x_TH), rw.weight_EH, nxt.config.router,
                                      bias=rw.selection_bias_E, width=self.width, router_bias_E=rw.router_bias_E)
                pred = p.cpu().tolist()
            self.trace.steps.append(Step(self._pass, pos, ids, pred))

        return hook


def prediction_width(width: int | None, top_k: Sequence[int], num_experts: Sequence[int]) -> int:
    """The prediction width a recording uses: `width`, or by default 2K capped at the fewest experts of a layer.

    An explicit width must be an int in [0, E] (E: the fewest routed experts of a layer; a
    prediction is W distinct experts of the next layer); ValueError names it otherwise.
    """
    e_min = min(num_experts)
    if width is None:
        return min(2 * max(top_k), e_min)
    if not _is_int(width) or not 0 <= width <= e_min:
        raise ValueError(f"width={width!r}: expected an int in [0, {e_min}] (a prediction is W distinct experts "
                         f"of the next layer, which has E={e_min})")
    return width


def _held_expert_bytes(layer) -> int:
    """Bytes of one expert as the layer holds it (its offload store's, else its weights' dtype); 0 unknown."""
    store = getattr(getattr(layer, "offload", None), "store", None)
    if store is not None:
        return store.expert_bytes
    try:
        w = layer.expert_weights
        return (w.gate_up[0].numel() + w.down[0].numel()) * w.gate_up.element_size()
    except ValueError:
        return 0


def find_moe_layers(model) -> list:
    """The MoELayers of a patched model, in module (= layer) order (modules with a router and a
    dispatcher: this stage knows the layer by its interface, not by importing it)."""
    return [m for m in model.modules()
            if hasattr(m, "router_weights") and hasattr(m, "dispatcher") and hasattr(m, "last_routing")]


def record_trace(model_or_layers, *, width: int | None = None, meta: dict | None = None,
                 expert_bytes: int | None = None) -> TraceRecorder:
    """A recorder context for a patched model (or a list of MoELayers): `with record_trace(m) as r: ...`.

    expert_bytes: the bytes of one expert the trace's replays count (default: as the layers
    hold it, in the dtype the model was loaded in; `moeflow trace record` passes the
    checkpoint's stored bytes).
    """
    layers = model_or_layers if isinstance(model_or_layers, (list, tuple)) else find_moe_layers(model_or_layers)
    if not layers:
        raise ValueError("model: no MoELayer found; patch it first (moeflow.patch_model)")
    return TraceRecorder(layers, width=width, meta=meta, expert_bytes=expert_bytes)


# ---- replay ---------------------------------------------------------------------------------


@dataclass
class ReplayResult(CacheRates):
    """Counts of one replay (bytes use the trace's expert_bytes)."""

    policy: str
    slots: int
    prefetch: int
    steps: int
    tokens: int
    hits: int
    misses: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    bytes_copied: int
    prefetch_rule: str = "cost"
    prefetch_overlap: float = 0.0
    # bytes on the critical path: every demand copy, and of each prefetch the part that the
    # step's overlap budget (prefetch_overlap expert copies per layer step) does not hide
    exposed_bytes: int = 0

    @property
    def misses_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(hit_rate=self.hit_rate, prefetch_precision=self.prefetch_precision,
                 prefetch_recall=self.prefetch_recall, misses_per_token=self.misses_per_token)
        return d


def _step_keys(step: Step, num_experts: int) -> list[Key]:
    return sorted({(step.layer, e) for row in step.ids for e in row if e < num_experts})


def _pred_keys(step: Step, width: int) -> list[Key]:
    from .prefetch import Prefetcher

    if step.pred is None or width <= 0:
        return []
    return Prefetcher.keys(step.layer, [row[:width] for row in step.pred])


def check_replay(trace: Trace, slots: int, policy: str = "lru", prefetch: int = 0, *,
                 predict_width: int | None = None, prefetch_rule: str = "cost",
                 prefetch_overlap: float = 0.0) -> None:
    """ValueError naming the argument when `replay(trace, slots, policy, prefetch, ...)` cannot run.

    slots: an int in [K, N] (K: the most picks of a layer's token; N: the trace's routed
    experts over all layers: N slots hold every expert, more would only allocate).
    prefetch: an int in [0, pred_width]. predict_width: None or an int in [1, pred_width]
    (the trace must hold predictions). Cheap: a command checks every replay it will run first.
    """
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"policy={policy!r}: expected one of {REPLAY_POLICIES}")
    K, N = max(trace.top_k), sum(trace.num_experts)
    if not _is_int(slots) or not K <= slots <= N:
        raise ValueError(f"slots={slots!r}: expected an int in [{K}, {N}] (K={K} experts of one token's layer; "
                         f"{N} slots hold all of the trace's experts)")
    if not _is_int(prefetch) or not 0 <= prefetch <= trace.pred_width:
        raise ValueError(f"prefetch={prefetch!r}: expected 0..{trace.pred_width} (the trace's recorded pred_width)")
    if prefetch_rule not in PREFETCH_RULES:
        raise ValueError(f"prefetch_rule={prefetch_rule!r}: expected one of {PREFETCH_RULES}")
    o = prefetch_overlap
    if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0.0 <= o < math.inf:
        raise ValueError(f"prefetch_overlap={o!r}: expected a finite float >= 0 (expert copies per layer step)")
    if predict_width is not None:
        if trace.pred_width == 0:
            raise ValueError(f"predict_width={predict_width!r}: the trace recorded no predictions (pred_width 0)")
        if not _is_int(predict_width) or not 1 <= predict_width <= trace.pred_width:
            raise ValueError(f"predict_width={predict_width!r}: expected an int in [1, {trace.pred_width}] "
                             f"(the trace's recorded pred_width)")


def replay(trace: Trace, slots: int, policy: str = "lru", prefetch: int = 0, *, seed: int = 0,
           oldest_fraction: float = 0.0625, predict_width: int | None = None,
           prefetch_rule: str = "cost", prefetch_overlap: float = 0.0,
           per_pass: list[float] | None = None, per_pass_bytes: list[int] | None = None) -> ReplayResult:
    """Simulate a cache of `slots` experts with `policy` on `trace`; prefetch = width (0: off).

    prefetch_rule / prefetch_overlap: OffloadConfig's (the "cost" rule is the live
    PrefetchGate, fed the same steps); the overlap also sets `exposed_bytes`.

    per_pass: if a list is given, the hit rate of each forward pass (a decode step, or
    one prefill chunk) is appended to it, in trace order (for `moeflow trace plot`);
    per_pass_bytes likewise gets the bytes copied in each pass (misses and prefetches).

    Mirrors OffloadRuntime.forward_layer: protect the predicted keys of the next layer,
    pin + load this step's experts (in groups of <= slots when a step needs more), then
    prefetch the predicted missing ones. "predictive" protects `predict_width` (default:
    prefetch if > 0, else K) predictions. "belady" ignores prefetch. `check_replay` says
    which arguments are refused.
    """
    trace.validate()  # a corrupt step would replay into a plausible, wrong table
    check_replay(trace, slots, policy, prefetch, predict_width=predict_width, prefetch_rule=prefetch_rule,
                 prefetch_overlap=prefetch_overlap)
    keys_per_step = [_step_keys(s, trace.num_experts[s.layer]) for s in trace.steps]
    if policy == "belady":
        prefetch = 0
        uses: dict[Key, list[int]] = {}
        for i, ks in enumerate(keys_per_step):
            for k in ks:
                uses.setdefault(k, []).append(i)
        ptr = dict.fromkeys(uses, 0)
        now = [0]

        def next_use(key: Key) -> float:
            lst = uses.get(key)
            if not lst:
                return math.inf
            j = ptr[key]
            while j < len(lst) and lst[j] <= now[0]:
                j += 1
            ptr[key] = j
            return lst[j] if j < len(lst) else math.inf

        pol = Belady(next_use)
    else:
        pol = make_policy(policy, slots, fraction=oldest_fraction, seed=seed)
    if prefetch > 0:
        width = prefetch
    elif policy in PREDICTIVE_POLICIES:
        width = predict_width if predict_width is not None else max(trace.top_k)
    else:
        width = 0
    table = SlotTable(slots, pol, trace.expert_bytes)
    gate = PrefetchGate(overlap=prefetch_overlap, width=prefetch) if prefetch > 0 and prefetch_rule == "cost" else None
    B = trace.expert_bytes
    exposed = 0.0
    marks: list[tuple[int, int, int]] = []
    tokens = 0
    last_pass = None
    for i, (step, keys) in enumerate(zip(trace.steps, keys_per_step)):
        if policy == "belady":
            now[0] = i
        if step.pass_idx != last_pass:
            tokens += len(step.ids)
            last_pass = step.pass_idx
            _close_pass(per_pass, per_pass_bytes, table.stats, marks)
        table.protected = _pred_keys(step, width)  # best first, as the live Prefetcher gives them
        if gate is not None:
            gate.observe(keys)
        m0 = table.stats.misses
        for g in range(0, max(1, len(keys)), slots):
            table.begin_step()
            table.acquire(keys[g : g + slots])
        exposed += (table.stats.misses - m0) * B
        if prefetch > 0:
            pk = _pred_keys(step, prefetch)
            if gate is not None:
                gate.predicted(pk)
            left = prefetch_overlap
            for _ in table.prefetch(pk, gate=gate):
                hidden = min(1.0, left)
                left -= hidden
                exposed += (1.0 - hidden) * B
    if trace.steps:
        _close_pass(per_pass, per_pass_bytes, table.stats, marks)
    s = table.stats
    return ReplayResult(policy, slots, prefetch, len(trace.steps), tokens, s.hits, s.misses, s.prefetch_issued,
                        s.prefetch_used, s.prefetch_wasted, s.bytes_copied, prefetch_rule if prefetch else "-",
                        float(prefetch_overlap), int(round(exposed)))


def _close_pass(per_pass: list[float] | None, per_pass_bytes: list[int] | None, stats,
                marks: list[tuple[int, int, int]]) -> None:
    """Append the hit rate and bytes since the last mark (the pass that just ended) and set a new mark."""
    if per_pass is None and per_pass_bytes is None:
        return
    if marks:
        h0, m0, b0 = marks[-1]
        n = (stats.hits - h0) + (stats.misses - m0)
        if per_pass is not None:
            per_pass.append((stats.hits - h0) / n if n else 1.0)
        if per_pass_bytes is not None:
            per_pass_bytes.append(stats.bytes_copied - b0)
    marks.append((stats.hits, stats.misses, stats.bytes_copied))


# ---- statistics -----------------------------------------------------------------------------


def trace_stats(trace: Trace) -> dict:
    """Prediction recall at widths K and 2K, expert reuse between consecutive tokens, load skew.

    recall@W: per (token, layer l >= 1), |pred_W(l) ∩ actual(l)| / K, where pred_W is the
    W best of layer l's prediction made at layer l - 1; random guessing gives W / E.
    reuse: per layer, |ids(t) ∩ ids(t-1)| / K over consecutive tokens; independent uniform
    routing gives K / E.
    load skew: per layer, max load / mean load, the coefficient of variation of the loads,
    and the share of picks taken by the top quarter of the experts.
    """
    K = max(trace.top_k)
    E = min(trace.num_experts)
    toks = trace.tokens()
    preds: list[dict[int, list[int]]] = []
    passes: dict[int, list[Step]] = {}
    for s in trace.steps:
        passes.setdefault(s.pass_idx, []).append(s)
    for idx in sorted(passes):
        steps = passes[idx]
        for t in range(len(steps[0].ids)):
            preds.append({s.layer + 1: s.pred[t] for s in steps if s.pred is not None})
    out: dict = {"tokens": len(toks), "layers": trace.num_layers, "experts": E, "top_k": K,
                 "pred_width": trace.pred_width}
    for name, W in (("recall_at_K", K), ("recall_at_2K", 2 * K)):
        if W > trace.pred_width:
            out[name] = None
            continue
        hit = tot = 0
        per_layer: dict[int, list[int]] = {}
        for tok, pr in zip(toks, preds):
            for layer, ids in tok.items():
                p = pr.get(layer)
                if p is None:
                    continue
                h = len(set(p[:W]) & set(ids))
                hit += h
                tot += len(ids)
                acc = per_layer.setdefault(layer, [0, 0])
                acc[0] += h
                acc[1] += len(ids)
        out[name] = hit / tot if tot else None
        out[name + "_per_layer"] = {str(k): v[0] / v[1] for k, v in sorted(per_layer.items())}
        out[name + "_random"] = W / E
    reuse_hit = reuse_tot = 0
    reuse_layer: dict[int, list[int]] = {}
    for prev, cur in zip(toks, toks[1:]):
        for layer, ids in cur.items():
            if layer in prev:
                h = len(set(ids) & set(prev[layer]))
                reuse_hit += h
                reuse_tot += len(ids)
                acc = reuse_layer.setdefault(layer, [0, 0])
                acc[0] += h
                acc[1] += len(ids)
    out["reuse_consecutive"] = reuse_hit / reuse_tot if reuse_tot else None
    out["reuse_consecutive_per_layer"] = {str(k): v[0] / v[1] for k, v in sorted(reuse_layer.items())}
    out["reuse_random"] = K / E
    skew = {}
    for layer in range(trace.num_layers):
        c = Counter(e for tok in toks for e in tok.get(layer, []))
        loads = [c.get(e, 0) for e in range(trace.num_experts[layer])]
        total = sum(loads)
        if not total:
            continue
        mean = total / len(loads)
        var = sum((x - mean) ** 2 for x in loads) / len(loads)
        top = sorted(loads, reverse=True)[: max(1, len(loads) // 4)]
        skew[str(layer)] = {"max_over_mean": max(loads) / mean, "cv": math.sqrt(var) / mean,
                            "top_quarter_share": sum(top) / total, "loads": loads}
    out["load_skew"] = skew
    return out
