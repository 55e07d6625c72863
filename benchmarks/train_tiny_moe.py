"""Train a tiny Mixtral-family MoE language model on the Python standard library's sources.

Why: offload traces need real routing structure (expert reuse between tokens,
skewed load, a next-layer router that predicts something), which random
routing does not have. The text ships offline with every Python install, and a
byte-level vocabulary (ByT5 convention: pad=0, eos=1, unk=2, byte b -> b + 3,
259 ids) means no tokenizer files to download: `AutoTokenizer` loads the saved
ByT5Tokenizer.

The result is a standard Hugging Face checkpoint (`MixtralForCausalLM`,
config.json + model.safetensors + tokenizer files) that loads with
`transformers.AutoModelForCausalLM.from_pretrained(dir)` and is moeflow's
embedded default model (moeflow/assets/tiny-moe/).

Legend: B batch, S sequence length (ctx), V vocab.

Usage (the exact command for the committed checkpoint is in the asset README):

    python benchmarks/train_tiny_moe.py --out moeflow/assets/tiny-moe --steps 600 --threads 1
    python benchmarks/train_tiny_moe.py --device cuda --steps 3000 --batch 64   # GPU, minutes

Deterministic for a given (seed, device, threads, torch version).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import sysconfig
import time
import zlib

import torch

VOCAB = 259  # ByT5: 3 specials + 256 bytes
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
BYTE_OFFSET = 3


def encode_bytes(data: bytes) -> torch.Tensor:
    """bytes -> int64 [len] ids in the ByT5 convention (byte b -> b + 3)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64) + BYTE_OFFSET


def stdlib_corpus(max_bytes: int, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The stdlib's top-level *.py files, sorted by name, split train/val by a hash of the file name.

    Returns (train_ids int64 [N], val_ids int64 [M], info). Files are joined with EOS
    so a window that crosses a file boundary sees the document end.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no stdlib sources under {root!r}: the corpus needs Python's *.py files")
    train_parts: list[torch.Tensor] = []
    val_parts: list[torch.Tensor] = []
    eos = torch.tensor([EOS_ID], dtype=torch.int64)
    n_train = n_val = 0
    for path in files:
        name = os.path.basename(path)
        with open(path, "rb") as f:
            data = f.read()
        # the split depends on the name only, so it is the same on every machine
        is_val = (zlib.crc32(name.encode()) % 1000) < val_fraction * 1000
        ids = torch.cat([encode_bytes(data), eos])
        if is_val:
            val_parts.append(ids)
            n_val += ids.numel()
        elif n_train < max_bytes:
            train_parts.append(ids)
            n_train += ids.numel()
    train = torch.cat(train_parts)[:max_bytes]
    val = torch.cat(val_parts) if val_parts else train[-max(1, train.numel() // 20):]
    info = {"stdlib": root, "files": len(files), "train_bytes": int(train.numel()), "val_bytes": int(val.numel())}
    return train, val, info


def make_config(args: argparse.Namespace):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2),
        head_dim=args.hidden // args.heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=max(512, args.ctx),
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,  # set per call during training; off for inference
        pad_token_id=PAD_ID,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        use_cache=True,
    )


def batch_from(data: torch.Tensor, batch: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    """Random windows: int64 [B, ctx + 1] (inputs = [:, :-1], targets = [:, 1:])."""
    starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + ctx + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, val: torch.Tensor, ctx: int, device: str, n_windows: int = 32) -> float:
    """Mean next-byte cross-entropy (nats) on fixed, evenly spaced val windows."""
    model.eval()
    step = max(1, (val.numel() - ctx - 1) // n_windows)
    xs = torch.stack([val[i * step : i * step + ctx + 1] for i in range(n_windows)]).to(device)
    out = model(input_ids=xs[:, :-1], labels=xs[:, 1:].contiguous(), output_router_logits=False)
    model.train()
    # HF shifts labels by one itself; we pass already-shifted targets, so compute it here
    logits = out.logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), xs[:, 1:].reshape(-1))
    return float(loss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="moeflow/assets/tiny-moe")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--aux-coef", type=float, default=0.02)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop early (and still save) after this many minutes; 0 = no limit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import ByT5Tokenizer, MixtralForCausalLM

    train, val, info = stdlib_corpus(args.max_bytes)
    print(f"corpus: {info}", flush=True)
    config = make_config(args)
    model = MixtralForCausalLM(config).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M params, config {config.num_hidden_layers}L H={config.hidden_size} "
          f"I={config.intermediate_size} E={config.num_local_experts} K={config.num_experts_per_tok}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    log: list[dict] = []
    model.train()
    step = 0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        xb = batch_from(train, args.batch, args.ctx, gen).to(args.device)
        inputs, targets = xb[:, :-1], xb[:, 1:]
        out = model(input_ids=inputs, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, VOCAB), targets.reshape(-1))
        aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=ce.device)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        if step % args.log_every == 0 or step == args.steps - 1:
            rec = {"step": step, "ce": round(ce.item(), 4), "aux": round(aux.item(), 4),
                   "lr": lr_at(step), "elapsed_s": round(elapsed, 1)}
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if args.max_minutes > 0 and elapsed > args.max_minutes * 60:
            print(f"time budget reached at step {step}", flush=True)
            break

    val_ce = evaluate(model, val, args.ctx, args.device)
    print(f"val cross-entropy {val_ce:.4f} nats/byte ({val_ce / math.log(2):.3f} bits/byte)", flush=True)

    os.makedirs(args.out, exist_ok=True)
    model.eval()
    save_dtype = getattr(torch, args.save_dtype)
    model.to("cpu").to(save_dtype)
    model.config.output_router_logits = False
    model.save_pretrained(args.out, safe_serialization=True)
    ByT5Tokenizer(extra_ids=0).save_pretrained(args.out)
    meta = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "steps_run": step + 1,
        "train_seconds": round(time.perf_counter() - t0, 1),
        "val_ce_nats_per_byte": round(val_ce, 4),
        "params": n_params,
        "corpus": info,
        "torch": torch.__version__,
        "log": log,
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(meta, f, indent=1)
    total = sum(os.path.getsize(os.path.join(args.out, n)) for n in os.listdir(args.out))
    print(f"saved {args.out} ({total / 1e6:.2f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
