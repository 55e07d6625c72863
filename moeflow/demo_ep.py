"""`torchrun --nproc-per-node N -m moeflow demo --ep N`: the demo model, expert-parallel.

Every rank builds the demo's tiny Mixtral-like model (8 experts, top-2; the same
fixed-seed weights everywhere), takes its own prompt, and

1. generates with the unpatched model (the reference tokens);
2. patches it with `moeflow.patch_model(model, ep_group=WORLD, ep_mode=...)`, so each
   rank holds E/N experts, and generates again, counting per rank the (token, expert)
   pairs computed locally, sent to other ranks and received from them;
3. checks one MoE layer directly: its EP output for this rank's tokens against the
   single-process MoELayer on all ranks' tokens concatenated in rank order (bit for
   bit with the reference experts in all_to_all mode).

Rank 0 prints one line per rank and the verdict; the return value is 0 when every
rank's tokens and layer output match. Backend: NCCL when CUDA is available (device =
LOCAL_RANK), else gloo on CPU. This entry point reads torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); the library itself never does.

Legend: T tokens, H hidden, E experts, K picks per token, W ranks.
"""

from __future__ import annotations

import copy
import datetime
import os

import torch
import torch.distributed as dist

from .parallel.dist_utils import leave_process_group

__all__ = ["run_ep_demo"]


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def run_ep_demo(
    expected_world: int | None = None,
    *,
    mode: str = "all_to_all",
    tokens: int = 12,
    timeout_s: float = 60.0,
    prompt_len: int = 8,
) -> int:
    """Run the expert-parallel demo on the torchrun-launched ranks; returns 0 on success.

    expected_world: the N of `--ep N`; must equal torchrun's WORLD_SIZE.
    mode:           "all_to_all" (each rank its own prompt) or "all_reduce" (one prompt).
    tokens:         new tokens generated per rank.
    timeout_s:      process-group and per-collective timeout (a dead rank fails, not hangs).

    ValueError, before any process group starts, for an expected_world that is not an int
    >= 1 or tokens that do not fit the demo model's context with the longest rank's prompt.
    """
    if expected_world is not None and (isinstance(expected_world, bool) or not isinstance(expected_world, int)
                                       or expected_world < 1):
        raise ValueError(f"--ep={expected_world!r}: expected an int >= 1 (the number of ranks torchrun starts)")
    world = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    if world is None or rank is None:
        raise ValueError(
            "moeflow demo --ep: not launched by torchrun (RANK / WORLD_SIZE unset); run "
            f"`torchrun --nproc-per-node {expected_world or 4} -m moeflow demo --ep {expected_world or 4}`"
        )
    if expected_world is not None and expected_world != world:
        raise ValueError(f"moeflow demo --ep {expected_world}: torchrun started {world} ranks (--nproc-per-node)")
    from .demo import DEMO_CONFIG

    context = int(DEMO_CONFIG["max_position_embeddings"])
    longest = prompt_len + (world - 1 if mode == "all_to_all" else 0)  # rank r's prompt: prompt_len + r tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= context - longest:
        raise ValueError(f"tokens={tokens!r}: expected an int in [1, {context - longest}] (the demo model's context "
                         f"of {context} minus the longest prompt, {longest} tokens)")
    E = int(DEMO_CONFIG["num_local_experts"])
    if E % world:
        raise ValueError(f"moeflow demo --ep {world}: the demo model's E={E} experts do not split over {world} ranks")

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    try:
        return _demo(rank, world, group, device, mode, tokens, timeout_s, prompt_len)
    finally:
        leave_process_group()


def _demo(rank, world, group, device, mode, tokens, timeout_s, prompt_len) -> int:
    import moeflow
    from moeflow import hf as mhf

    from .demo import DEMO_CONFIG, build_tiny_mixtral
    from .parallel.ep import shard_layer

    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a dependency; this only quiets it
        pass

    V = int(DEMO_CONFIG["vocab_size"])
    model = build_tiny_mixtral().to(device)
    src = rank if mode == "all_to_all" else 0
    g = torch.Generator().manual_seed(100 + src)
    ids = torch.randint(1, V, (1, prompt_len + src if mode == "all_to_all" else prompt_len), generator=g).to(device)

    def generate():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)[0, ids.shape[1]:].tolist()

    with torch.no_grad():
        want = generate()
    # The single-process reference for the layer check below (patched before the model is sharded).
    single = copy.deepcopy(model)
    moeflow.patch_model(single, experts="reference")
    moeflow.patch_model(model, experts="reference", ep_group=group, ep_mode=mode)
    runners = mhf.moe_layers(model)
    totals = {"local": 0, "sent": 0, "received": 0, "zero": 0}

    def count(module, args, out):
        for k, v in module.token_stats().items():
            totals[k] += v

    hooks = [r.register_forward_hook(count) for r in runners]
    with torch.no_grad():
        got = generate()
    for h in hooks:
        h.remove()

    # One layer against the single-process MoELayer: each rank's tokens, all ranks' concatenated.
    layer = mhf.moe_layers(single)[0]
    H = layer.config.hidden_size
    T_r = [3 + r for r in range(world)] if mode == "all_to_all" else [5] * world
    xs = [torch.randn(T_r[r], H, generator=torch.Generator().manual_seed(200 + r)).to(device) for r in range(world)]
    x_mine = xs[rank] if mode == "all_to_all" else xs[0]
    ep = shard_layer(layer, group=group, mode=mode, timeout_s=timeout_s)
    with torch.no_grad():
        out = ep(x_mine)
        if mode == "all_to_all":
            ref = layer(torch.cat(xs))[sum(T_r[:rank]): sum(T_r[: rank + 1])]
        else:
            ref = layer(x_mine)
    bitwise = bool(torch.equal(out, ref))
    max_abs = float((out - ref).abs().max()) if out.numel() else 0.0
    layer_ok = bitwise if mode == "all_to_all" else max_abs <= 1e-5 * max(1.0, float(ref.abs().max()))

    row = dict(rank=rank, experts=list(ep.dispatcher.local_ids), tokens_ok=got == want, layer_bitwise=bitwise,
               layer_max_abs=max_abs, layer_ok=layer_ok, **totals)
    rows: list[dict] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(rows, row, group=group)
    ok = all(r["tokens_ok"] and r["layer_ok"] for r in rows)
    if rank == 0:
        print(f"moeflow demo --ep {world}: mode={mode}, backend={dist.get_backend(group)}, "
              f"{len(runners)} MoE layers, E={DEMO_CONFIG['num_local_experts']}, K={DEMO_CONFIG['num_experts_per_tok']}, "
              f"{tokens} new tokens per rank")
        print("(token, expert) pairs over the whole generation: local = computed on the rank for its own tokens,")
        print("sent = its tokens' pairs computed on other ranks, received = other ranks' pairs it computed")
        for r in rows:
            verdict = "bit-identical" if r["layer_bitwise"] else f"max_abs={r['layer_max_abs']:.2e}"
            print(f"  rank {r['rank']}: experts {r['experts'][0]}..{r['experts'][-1]}  local={r['local']:5d}  "
                  f"sent={r['sent']:5d}  received={r['received']:5d}  "
                  f"tokens==unsharded: {r['tokens_ok']}  layer==single-process: "
                  f"{verdict}")
        print("OK: every rank generated the unsharded model's tokens and the layer matches one process"
              if ok else "MISMATCH: see the rows above")
    return 0 if ok else 1
