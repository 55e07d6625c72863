"""Eviction policies on decode traces (CPU replay): bytes and misses per policy vs LRU and Belady.

Legend: L layers, E experts per layer, K picks per token, S slots (25% / 50% of L*E).

Traces (recorded here, seconds on a CPU):
    tiny-moe        the embedded trained model (`moeflow trace record moeflow/assets/tiny-moe`:
                    2048 tokens of moeflow's sources), L=4, E=8, K=2;
    tiny-moe-val    the same model on 4096 held-out stdlib bytes (bench_offload --trace-stats' text);
    synth-*         bench_offload's correlated synthetic routing (x_{t+1} = 0.8 x_t + 0.6 noise,
                    Zipf(1.2) per-layer bias), decoded token by token: mixtral-like (L=8, E=8, K=2),
                    e32k4 (L=8, E=32, K=4), deepseek-like (L=4, E=256, K=8; no groups).
For each trace and cache size every policy is replayed without prefetch and with prefetch W=K
copying every predicted missing expert (prefetch_rule "always"; `moeflow.offload.trace.replay`: the
live cache's SlotTable), plus Belady (the floor on copies). Prefetch rows also give prefetch_bytes
(what prefetch copied) and prefetch_saved_bytes (the demand copies it saved against the same policy
without prefetch).

Prefetch rules (rows with "bench": "prefetch_rule"): LRU without prefetch against LRU and
"predictive" with prefetch W = --rule-width (2: the configuration the README used to recommend),
rule "always" and the cost rule (moeflow.offload.gate) at each --overlaps value (expert copies per
layer step hidden behind compute). Per row: bytes copied, hits, and exposed_bytes, the bytes on the
critical path under that overlap (every demand copy; of each prefetch the part the step's overlap
does not hide). These are replay byte counts, not GPU tokens/s.

    python benchmarks/replay_policies.py --out benchmarks/results/replay_policies.json
    python benchmarks/replay_policies.py --only-rules --traces synth-mixtral4 synth-mixtral synth-e32k4 \
        synth-deepseek --fractions 0.25 --out benchmarks/results/replay_prefetch_rule.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_offload import build_layers, decode, token_inputs, val_text_bytes  # noqa: E402
from benchmarks.common import STANDARD_SHAPES, env_info  # noqa: E402
from moeflow.offload.trace import Trace, record_trace, replay  # noqa: E402

SYNTH = {"synth-mixtral": ({"H": 128, "I": 32, "E": 8, "K": 2, "shared": 0}, 8),
         "synth-mixtral4": ({"H": 128, "I": 32, "E": 8, "K": 2, "shared": 0}, 4),
         "synth-e32k4": ({"H": 128, "I": 32, "E": 32, "K": 4, "shared": 0}, 8),
         "synth-deepseek": ({"H": 128, "I": 16, "E": 256, "K": 8, "shared": 0}, 4)}
POLICIES = ("lru", "random_oldest", "predictive", "adaptive", "adaptive_long")


def synth_trace(name: str, tokens: int) -> Trace:
    shape, L = SYNTH[name]
    STANDARD_SHAPES[name] = shape
    layers = build_layers(name, L, "cpu", torch.float32)
    with torch.no_grad(), record_trace(list(layers), width=2 * shape["K"], meta={"synthetic": name}) as rec:
        for x in token_inputs(tokens, shape["H"], "cpu", torch.float32):
            decode(layers, x)
    return rec.trace


def tiny_trace(data: bytes) -> Trace:
    from transformers import AutoModelForCausalLM

    from moeflow.demo import EMBEDDED_MODEL
    from moeflow.hf import patch_model

    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    patch_model(model)
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + 3  # ByT5 ids: byte + 3
    with torch.no_grad(), record_trace(model, width=2 * model.config.num_experts_per_tok) as rec:
        for start in range(0, ids.numel(), 128):  # passes of the training context, as `trace record`
            model(input_ids=ids[start : start + 128].unsqueeze(0))
    return rec.trace.as_decode()


def rule_rows(name: str, trace: Trace, frac: float, S: int, width: int, overlaps: list[float]) -> list[dict]:
    """LRU (no prefetch) against prefetch W=width under rule "always" and the cost rule, per overlap."""
    B = trace.expert_bytes
    rows = []
    base = replay(trace, S, "lru")
    for ov in overlaps:
        runs = [("lru", 0, "-")] + [(pol, width, rule) for pol in ("lru", "predictive") for rule in ("always", "cost")]
        for policy, pf, rule in runs:
            r = base if pf == 0 else replay(trace, S, policy, pf, prefetch_rule=rule, prefetch_overlap=ov)
            # exposed bytes of no prefetch are its demand bytes at any overlap
            exposed = r.bytes_copied if pf == 0 else r.exposed_bytes
            d = dict(r.as_dict(), bench="prefetch_rule", trace=name, cache_frac=frac, overlap=ov,
                     prefetch_rule=rule, exposed_bytes=exposed, bytes_vs_lru=r.bytes_copied / base.bytes_copied,
                     exposed_vs_lru=exposed / base.bytes_copied, hits_vs_lru=r.hits / base.hits,
                     prefetch_bytes=r.prefetch_issued * B)
            rows.append(d)
            print(f"{name:<15}{frac:>5.2f}{S:>5} ov={ov:<5g}{policy:<11}W={pf} {rule:<7} hits {r.hits:>7} "
                  f"copies {r.misses + r.prefetch_issued:>7} (pf {r.prefetch_issued:>6}, used {r.prefetch_used:>6}) "
                  f"bytes/LRU {d['bytes_vs_lru']:.3f} exposed/LRU {d['exposed_vs_lru']:.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--traces", nargs="+", default=["tiny-moe", "tiny-moe-val", *SYNTH])
    p.add_argument("--overlaps", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 2.0],
                   help="prefetch rule rows: expert copies per layer step hidden behind compute")
    p.add_argument("--rule-width", type=int, default=2, help="prefetch rule rows: the prediction width W")
    p.add_argument("--only-rules", action="store_true", help="only the prefetch rule rows")
    p.add_argument("--out", default="benchmarks/results/replay_policies.json")
    args = p.parse_args(argv)
    from moeflow.cli_trace import default_text

    rows = []
    for name in args.traces:
        if name == "tiny-moe":
            trace = tiny_trace(default_text(args.tokens * 4)[0][: args.tokens])
        elif name == "tiny-moe-val":
            trace = tiny_trace(val_text_bytes(2 * args.tokens)[0])
        else:
            trace = synth_trace(name, args.tokens)
        K, total = max(trace.top_k), trace.num_layers * min(trace.num_experts)
        for frac in args.fractions:
            S = max(K, round(frac * total))
            rows += rule_rows(name, trace, frac, S, args.rule_width, args.overlaps)
            if args.only_rules:
                continue
            lru = replay(trace, S, "lru").bytes_copied
            bel = replay(trace, S, "belady")
            for policy in (*POLICIES, "belady"):
                no_pf = None
                for pf in ((0,) if policy == "belady" else (0, K)):
                    r = bel if policy == "belady" else replay(trace, S, policy, pf, prefetch_rule="always")
                    no_pf = r if pf == 0 else no_pf
                    d = dict(r.as_dict(), trace=name, cache_frac=frac, bytes_per_token=r.bytes_copied / r.tokens,
                             bytes_vs_lru=r.bytes_copied / lru, bytes_vs_belady=r.bytes_copied / bel.bytes_copied)
                    if pf:
                        # what prefetch copied against the demand copies it saved (the same policy, no prefetch)
                        d.update(prefetch_bytes=r.prefetch_issued * trace.expert_bytes,
                                 prefetch_saved_bytes=(no_pf.misses - r.misses) * trace.expert_bytes)
                    rows.append(d)
                    extra = (f" pf_copied {r.prefetch_issued} pf_saved {no_pf.misses - r.misses}" if pf else "")
                    print(f"{name:<15}{frac:>5.2f}{S:>5} {policy:<14}pf={pf:<2} miss/tok {r.misses_per_token:6.3f} "
                          f"KB/tok {d['bytes_per_token'] / 1e3:9.1f} vs_lru {d['bytes_vs_lru']:.3f} "
                          f"vs_belady {d['bytes_vs_belady']:.3f}{extra}", flush=True)
    meta = env_info()
    meta["command"] = "python " + " ".join(["benchmarks/replay_policies.py", *(argv or sys.argv[1:])])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
