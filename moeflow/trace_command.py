"""The `moeflow trace record | replay | stats | plot` subcommand: its parser and actions, over `moeflow.offload.trace`.

    moeflow trace record MODEL_DIR --out t.jsonl [--text FILE | --prompt TEXT] [--tokens N] [--ctx C] [--width W]
    moeflow trace replay t.jsonl --slots 8 16 [--policy lru ... belady] [--prefetch 0 2]   (default: every policy)
    moeflow trace stats t.jsonl [--json]
    moeflow trace plot t.jsonl --slots 12 [--out DIR]

`record` runs the checkpoint on a text (default: DEFAULT_TOKENS tokens of Python source,
the embedded model's kind of text) in forward passes of `--ctx` tokens and writes every
MoE layer's expert ids and next-layer predictions. `replay` and `plot` simulate a decode
cache by default: each recorded token is its own pass (`Trace.as_decode`; a causal model
routes a token the same way prefilled or decoded). `--prefill` replays the recorded
forward passes as they ran instead, where one step can touch every expert of a layer.

Every path is checked before any work (`moeflow.paths`): a trace or `--text` must be a
regular file; `--out` / `--json` / the PNGs of `plot` must not be an input (nor a file of
the checkpoint directory) and replace an existing file only when moeflow wrote it, or with
`--force`; their directory must exist. Every replay a command will run is checked
(`check_replay`) before the first one runs.

Errors (a directory or a corrupt trace, an impossible `--slots`) raise ValueError /
OSError, which `moeflow.cli.main` prints as one line, exit code 2.

`moeflow.cli` adds the subcommand to the `moeflow` parser (`add_trace_parser`);
`python -m moeflow.cli_trace ACTION ...` runs it as a program of its own.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from .paths import check_input_file, check_output_dir, check_output_file

DEFAULT_TOKENS = 2048
# Forward-pass length of a recording: the embedded model's training context.
DEFAULT_CTX = 128


def default_text(n_bytes: int) -> tuple[bytes, list[str]]:
    """At least `n_bytes` of Python source (when there is that much): moeflow's own modules.

    Returns the bytes and the files they came from (package-relative, sorted), so a
    recording says what it ran on. The package is always installed with its sources,
    unlike a particular Python's stdlib.
    """
    root = Path(__file__).resolve().parent
    data, used = b"", []
    for f in sorted(root.rglob("*.py")):
        data += f.read_bytes()
        used.append(str(f.relative_to(root)))
        if len(data) >= n_bytes:
            break
    return data[:n_bytes], used


def _format_table(rows: Iterable, lru_bytes: dict[int, int] | None = None,
                  belady_bytes: dict[int, int] | None = None) -> str:
    """One line per replay: misses and bytes side by side; `vs_lru` / `vs_bel` = bytes / LRU's (no
    prefetch) / Belady's bytes at the same slots (lru_bytes, belady_bytes: slots -> bytes; '-' when unknown)."""
    head = (f"{'policy':<14}{'slots':>6}{'pf':>4}{'hits':>9}{'misses':>9}{'hit_rate':>9}{'miss/tok':>9}"
            f"{'pf_iss':>8}{'pf_used':>8}{'pf_wast':>8}{'MB_copied':>11}{'KB/tok':>10}{'vs_lru':>8}{'vs_bel':>8}")
    lines = [head, "-" * len(head)]

    def ratio(num: int, base: int | None) -> str:
        return f"{num / base:>8.3f}" if base else f"{'-':>8}"

    for r in rows:
        per_tok = r.bytes_copied / r.tokens / 1e3 if r.tokens else 0.0
        lines.append(f"{r.policy:<14}{r.slots:>6}{r.prefetch:>4}{r.hits:>9}{r.misses:>9}{r.hit_rate:>9.3f}"
                     f"{r.misses_per_token:>9.3f}{r.prefetch_issued:>8}{r.prefetch_used:>8}{r.prefetch_wasted:>8}"
                     f"{r.bytes_copied / 1e6:>11.2f}{per_tok:>10.1f}{ratio(r.bytes_copied, (lru_bytes or {}).get(r.slots))}"
                     f"{ratio(r.bytes_copied, (belady_bytes or {}).get(r.slots))}")
    return "\n".join(lines)


def _load(args: argparse.Namespace):
    """The trace of args.path, in decode order unless --prefill (see the module doc)."""
    from .offload.trace import Trace

    trace = Trace.load(args.path)
    return trace if args.prefill else trace.as_decode()


def _progress(iterable, *, total: int, desc: str, unit: str, delay: float = 1.0):
    """A tqdm bar on stderr over `iterable` (shown once the work has taken `delay` seconds)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, delay=delay)


_REPLAY_ROW_KEYS = frozenset({"policy", "slots", "prefetch", "hits", "misses", "bytes_copied"})


def _is_replay_json(path: str) -> bool:
    """True for a JSON file of replay rows, as `trace replay --json` writes it."""
    try:
        if os.path.getsize(path) > 64 << 20:
            return False
        with open(path, "rb") as f:
            rows = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(rows, list) and all(isinstance(r, dict) and _REPLAY_ROW_KEYS <= r.keys() for r in rows)


def _replays(trace, args: argparse.Namespace, slots_list: list[int], predict_width: int | None = None) -> list:
    """The (slots, policy, prefetch) runs asked for, each checked before any runs; ValueError when there are none."""
    from .offload.trace import check_replay

    runs = [(slots, policy, pf) for slots in slots_list for policy in args.policy for pf in args.prefetch
            if not (policy == "belady" and pf)]
    if not runs:
        raise ValueError(f"--policy {' '.join(args.policy)} --prefetch {' '.join(map(str, args.prefetch))}: no replay "
                         f"to run (belady never prefetches); expected another policy or --prefetch 0")
    for slots, policy, pf in runs:
        check_replay(trace, slots, policy, pf, predict_width=predict_width,
                     prefetch_rule=getattr(args, "prefetch_rule", "cost"),
                     prefetch_overlap=getattr(args, "prefetch_overlap", 0.0))
    return runs


def _cmd_replay(args: argparse.Namespace) -> int:
    from .offload.trace import replay

    if args.json:
        check_output_file(args.json, "--json", inputs=[("trace", args.path)], ours=_is_replay_json, force=args.force)
    trace = _load(args)
    runs = _replays(trace, args, args.slots, args.predict_width)
    rows = [replay(trace, slots, policy, pf, seed=args.seed, predict_width=args.predict_width,
                   prefetch_rule=args.prefetch_rule, prefetch_overlap=args.prefetch_overlap)
            for slots, policy, pf in _progress(runs, total=len(runs), desc="replay", unit="run")]
    # the references of the bytes ratios: plain LRU and Belady (the floor) at each cache size,
    # replayed when not asked for
    lru_bytes = {r.slots: r.bytes_copied for r in rows if r.policy == "lru" and r.prefetch == 0}
    bel_bytes = {r.slots: r.bytes_copied for r in rows if r.policy == "belady"}
    for slots in args.slots:
        if slots not in lru_bytes:
            lru_bytes[slots] = replay(trace, slots, "lru", 0).bytes_copied
        if slots not in bel_bytes:
            bel_bytes[slots] = replay(trace, slots, "belady", 0).bytes_copied
    order = "prefill passes as recorded" if args.prefill else "decode order, one pass per token"
    print(f"{args.path}: {rows[0].tokens if rows else 0} tokens, {order}; vs_lru / vs_bel = bytes copied / "
          f"LRU's (no prefetch) / Belady's at the same slots")
    print(_format_table(rows, lru_bytes, bel_bytes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(r.as_dict(), bytes_per_token=r.bytes_copied / r.tokens if r.tokens else 0.0,
                            bytes_vs_lru=r.bytes_copied / lru_bytes[r.slots] if lru_bytes[r.slots] else None,
                            bytes_vs_belady=r.bytes_copied / bel_bytes[r.slots] if bel_bytes[r.slots] else None)
                       for r in rows], f, indent=1)
    return 0


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_stats(stats: dict, trace=None, path: str = "") -> str:
    """`trace_stats(trace)` as a table: one row per layer (recall, reuse, load skew), then all layers and random."""

    def cell(v, width: int = 10) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:>{width}.3f}"

    K, E, W = stats["top_k"], stats["experts"], stats["pred_width"]
    head = [f"{path + ': ' if path else ''}{stats['tokens']} tokens, {stats['layers']} MoE layers, E={E}, K={K}, "
            f"predictions of width W={W}" + (" (none recorded)" if W == 0 else "")]
    if trace is not None and trace.expert_bytes:
        of = trace.meta.get("expert_bytes_of")
        head.append(f"expert bytes {_human_bytes(trace.expert_bytes)} each" + (f" ({of})" if of else ""))
    head += ["recall@W: share of a layer's K experts among the W best its predictor (the previous layer) named;",
             "reuse: share of a token's K experts the previous token also picked; max/mean, cv, top 1/4: load skew",
             ""]
    cols = f"{'layer':>6}{'recall@K':>10}{'recall@2K':>10}{'reuse':>10}{'max/mean':>10}{'cv':>10}{'top 1/4':>10}"
    lines = [*head, cols, "-" * len(cols)]
    rk, r2k = stats.get("recall_at_K_per_layer", {}), stats.get("recall_at_2K_per_layer", {})
    reuse, skew = stats.get("reuse_consecutive_per_layer", {}), stats.get("load_skew", {})
    for layer in range(stats["layers"]):
        key = str(layer)
        sk = skew.get(key, {})
        lines.append(f"{layer:>6}{cell(rk.get(key))}{cell(r2k.get(key))}{cell(reuse.get(key))}"
                     f"{cell(sk.get('max_over_mean'))}{cell(sk.get('cv'))}{cell(sk.get('top_quarter_share'))}")
    lines.append("-" * len(cols))
    lines.append(f"{'all':>6}{cell(stats.get('recall_at_K'))}{cell(stats.get('recall_at_2K'))}"
                 f"{cell(stats.get('reuse_consecutive'))}")
    rand_top = min(1.0, max(1, E // 4) / E) if E else None
    lines.append(f"{'random':>6}{cell(stats.get('recall_at_K_random'))}{cell(stats.get('recall_at_2K_random'))}"
                 f"{cell(stats.get('reuse_random'))}{cell(1.0)}{cell(0.0)}{cell(rand_top)}")
    lines.append("(random: uniform routing and guessing; '-': not measurable, e.g. no predictions recorded)")
    return "\n".join(lines)


def _cmd_stats(args: argparse.Namespace) -> int:
    from .offload.trace import Trace, trace_stats

    trace = Trace.load(args.path)
    stats = trace_stats(trace)
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats, trace, args.path))
    return 0


def _positive(name: str, v: int) -> None:
    if v < 1:
        raise ValueError(f"{name}={v}: expected an int >= 1")


def _stored_as(info, text_cfg) -> str:
    """The experts' stored format in words: the quantized format, else the config's dtype."""
    if info.quant:
        return info.quant.split(":")[0]
    dtype = getattr(text_cfg, "dtype", None) or getattr(text_cfg, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "the checkpoint's dtype"


def _cmd_record(args: argparse.Namespace) -> int:
    from .offload.trace import is_trace_file, prediction_width

    if args.tokens is not None:
        _positive("--tokens", args.tokens)
    _positive("--ctx", args.ctx)
    if args.width is not None:
        _positive("--width", args.width)
    check_output_file(args.out, "--out", inputs=[("MODEL", args.model), ("--text", args.text)], ours=is_trace_file,
                      force=args.force)
    if args.text is not None:
        check_input_file(args.text, "--text")

    from .inspect import check_context, checkpoint_info, encode_prompt, load_config

    root = Path(args.model)
    info = checkpoint_info(root)  # config.json, family, weights, expert counts: refused before loading anything
    width = prediction_width(args.width, [info.top_k], [info.num_experts])
    tokens = DEFAULT_TOKENS if args.tokens is None else args.tokens
    whole_text = True  # the text holds everything there is to record
    if args.text is not None:
        data, source = Path(args.text).read_bytes(), {"text_file": args.text}
    elif args.prompt is not None:
        data, source = args.prompt.encode("utf-8"), {"prompt": args.prompt}
    else:
        data, files = default_text(tokens * 4)  # >= 1 byte per token for any tokenizer
        whole_text = len(data) < tokens * 4
        source = {"text": "moeflow package sources", "files": files}
    text_cfg = load_config(root).get_text_config()
    # each forward pass is one sequence of <= ctx tokens
    check_context(text_cfg, args.ctx, "--ctx", hint="pass a --ctx within the model's context")
    ids = encode_prompt(root, data, text_cfg.vocab_size)[0]
    if ids.numel() == 0:
        raise ValueError("the text to record is empty: expected at least one token (--prompt / --text)")
    n_text = ids.numel()
    if args.tokens is not None and n_text < tokens and whole_text:
        what = ("the --text file" if args.text is not None else "the --prompt" if args.prompt is not None
                else "moeflow's package sources (the default text)")
        raise ValueError(f"--tokens={tokens}: only {n_text} tokens in {what}; expected at most {n_text}"
                         + ("" if args.text is not None else " (or a longer text: --text FILE)"))
    ids = ids[:tokens]
    stored = _stored_as(info, text_cfg)
    meta = {"model": str(root), "family": info.family, "ctx": args.ctx, **source,
            "expert_bytes_of": f"the checkpoint's stored experts, {stored}"}
    trace = _record(root, ids, args.ctx, width, meta, info.expert_bytes)
    trace.save(args.out)
    short = f" (the text has only {n_text} of the --tokens={tokens})" if n_text < tokens else ""
    print(f"wrote {args.out}: {len(trace.steps)} layer steps, {ids.numel()} tokens{short}, "
          f"passes of {args.ctx} tokens; expert bytes {_human_bytes(info.expert_bytes)} each as stored ({stored}; "
          f"the routing ran in float32)")
    return 0


def _record(root: Path, ids, ctx: int, width: int, meta: dict, expert_bytes: int):
    """Run the checkpoint (float32, patched) on `ids` in passes of `ctx` tokens under a recorder; the Trace."""
    import torch
    from transformers import AutoModelForCausalLM

    from .hf import patch_model
    from .offload.trace import record_trace

    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    model.eval()
    patch_model(model)
    starts = range(0, ids.numel(), ctx)
    with torch.no_grad(), record_trace(model, width=width, meta=meta, expert_bytes=expert_bytes) as rec:
        for start in _progress(starts, total=len(starts), desc="record", unit="pass", delay=0.0):
            model(input_ids=ids[start : start + ctx].unsqueeze(0))
    return rec.trace


def _cmd_plot(args: argparse.Namespace) -> int:
    from . import plots
    from .offload.trace import replay

    out_dir = check_output_dir(args.out, "--out")
    paths = {}
    for name in ("expert_load.png", "hit_rate.png"):
        paths[name] = check_output_file(os.path.join(out_dir, name), "--out", inputs=[("trace", args.path)],
                                        ours=plots.is_moeflow_png, force=args.force)
    plots.require_matplotlib()
    trace = _load(args)
    runs = _replays(trace, args, [args.slots])
    load_LE = []
    toks = trace.tokens()
    for layer in range(trace.num_layers):
        c = Counter(e for tok in toks for e in tok.get(layer, []))
        load_LE.append([c.get(e, 0) for e in range(trace.num_experts[layer])])
    rates, copied = {}, {}
    for slots, policy, pf in _progress(runs, total=len(runs), desc="replay", unit="run"):
        name = f"{policy}" + (f"+pf{pf}" if pf else "")
        rates[name], copied[name] = [], []
        replay(trace, slots, policy, pf, per_pass=rates[name], per_pass_bytes=copied[name])
    step = "decode step" if not args.prefill else "forward pass"
    p1 = plots.plot_expert_load(load_LE, paths["expert_load.png"], title=f"expert load ({len(toks)} tokens)")
    p2 = plots.plot_hit_rate(rates, paths["hit_rate.png"], bytes_per_step=copied, slots=args.slots, step=step)
    print(f"wrote {p1} and {p2}")
    return 0


def _order_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--prefill", action="store_true",
                   help="replay the recorded forward passes as they ran (default: decode order, one pass per token)")
    g.add_argument("--decode", action="store_true", help="decode order, one pass per token (the default)")


def add_trace_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `trace` and its four actions (each with its own --help) to the `moeflow` subparsers."""
    from .offload.trace import REPLAY_POLICIES

    t = sub.add_parser("trace", help="record, replay, plot or measure routing traces",
                       description="Routing traces: record them from a checkpoint, replay them through the "
                                   "offload cache, plot and measure them.")
    acts = t.add_subparsers(dest="action", required=True)

    r = acts.add_parser("replay", help="simulate cache sizes and policies on a trace")
    r.add_argument("path", help="a trace file written by `moeflow trace record` (.jsonl or .jsonl.gz)")
    r.add_argument("--slots", type=int, nargs="+", required=True)
    r.add_argument("--policy", nargs="+", default=list(REPLAY_POLICIES), choices=REPLAY_POLICIES,
                   help="policies to replay (default: all, Belady included)")
    r.add_argument("--prefetch", type=int, nargs="+", default=[0], help="prefetch widths (0: off)")
    r.add_argument("--prefetch-rule", default="cost", choices=["cost", "always"],
                   help="OffloadConfig.prefetch_rule: copy a guess only when it pays its bytes (cost), or every one")
    r.add_argument("--prefetch-overlap", type=float, default=0.0,
                   help="OffloadConfig.prefetch_overlap: expert copies per layer step hidden behind compute (0: "
                        "none, the cost rule then copies no guess)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--predict-width", type=int, default=None,
                   help="predictions per token the predictive/adaptive policies see with prefetch off (default K)")
    _order_flags(r)
    r.add_argument("--json", default=None, help="also write the rows as JSON (a new file, or one moeflow wrote)")
    _force_flag(r, "--json")
    r.set_defaults(func=_cmd_replay)

    s = acts.add_parser("stats", help="prediction recall, reuse between tokens, load skew (a table per layer)")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="print the statistics as JSON instead (for machines)")
    s.set_defaults(func=_cmd_stats)

    c = acts.add_parser("record", help="record a trace from a checkpoint on a text")
    c.add_argument("model", help="a checkpoint directory (config.json + *.safetensors)")
    c.add_argument("--out", required=True, help="the trace file to write (.jsonl, or .jsonl.gz: compressed)")
    _force_flag(c, "--out")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--text", default=None, help="a file whose contents are the input")
    src.add_argument("--prompt", default=None, help="the input text itself")
    c.add_argument("--tokens", type=int, default=None,
                   help=f"tokens to record, at most what the text holds (default {DEFAULT_TOKENS}, or all of a "
                        f"shorter text; without --text/--prompt: of Python source)")
    c.add_argument("--ctx", type=int, default=DEFAULT_CTX,
                   help=f"tokens per forward pass, at most the model's context (default {DEFAULT_CTX})")
    c.add_argument("--width", type=int, default=None,
                   help="prediction width to record, at most the experts of a layer (default 2K, at most E)")
    c.set_defaults(func=_cmd_record)

    pl = acts.add_parser("plot", help="PNG: expert load heatmap; cache hit rate and bytes copied per decode step, "
                                      "per policy")
    pl.add_argument("path")
    pl.add_argument("--slots", type=int, required=True)
    pl.add_argument("--policy", nargs="+", default=list(REPLAY_POLICIES), choices=REPLAY_POLICIES,
                    help="policies to replay (default: all, Belady included)")
    pl.add_argument("--prefetch", type=int, nargs="+", default=[0])
    _order_flags(pl)
    pl.add_argument("--out", default=".", help="an existing directory for expert_load.png and hit_rate.png")
    _force_flag(pl, "the PNGs")
    pl.set_defaults(func=_cmd_plot)
    return t


def _force_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--force", action="store_true",
                        help=f"replace an existing file at {what} that moeflow did not write (never an input)")
