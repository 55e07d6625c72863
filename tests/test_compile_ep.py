"""Expert parallelism under torch.compile: 2 gloo ranks, each compiling its patched model fullgraph.

The EP step (route, all_to_all / all_reduce collectives, experts, combine) runs inside each
block's moeflow op, its host bookkeeping (splits, step protocol) outside the traced graph. Each
rank's compiled logits must match the unsharded eager model's within rtol 1e-5 (atol 1e-5 x
max|logit|; max-abs and RMS error in the failure message) at two prompt lengths, ranks holding
different token counts under all_to_all. gemma4 with EP (its routing passes between two
modules through Python) refuses to compile with CompiledStepError naming the layer.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_ep_dist import _free_port

W = 2
TIMEOUT_S = 120


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _compiled_matches_unsharded(rank: int, mode: str) -> None:
    from hf_configs import tiny_model

    import moeflow
    from moeflow.testing import assert_close

    model = tiny_model("qwen3_moe", seed=11)
    prompts = [torch.randint(3, 97, (2, S + (rank if mode == "all_to_all" else 0)),
                             generator=torch.Generator().manual_seed(40 + S)) for S in (6, 9)]
    with torch.no_grad():
        want = [model(ids).logits for ids in prompts]
    moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode=mode,
                        ep_options={"timeout_s": 30.0})
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for ids, w in zip(prompts, want):
            assert_close(compiled(ids).logits, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()),
                         what=f"rank {rank} {mode} compiled logits, S={ids.shape[1]}")
    torch._dynamo.reset()


def _gemma4_refuses(rank: int) -> None:
    from hf_configs import available_families, tiny_model

    import moeflow
    from moeflow.hf.op import CompiledStepError

    if "gemma4" not in available_families():
        return
    model = tiny_model("gemma4", seed=12)
    moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode="all_to_all")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        with torch.no_grad():
            compiled(torch.randint(3, 97, (1, 5)))
    except CompiledStepError as exc:
        assert "gemma4 with expert parallelism" in str(exc) and "(layer 0)" in str(exc), str(exc)
    else:
        raise AssertionError("gemma4 with EP compiled without the named refusal")
    torch._dynamo.reset()


CASES = {
    "all_to_all": lambda rank: _compiled_matches_unsharded(rank, "all_to_all"),
    "all_reduce": lambda rank: _compiled_matches_unsharded(rank, "all_reduce"),
    "gemma4_refuses": _gemma4_refuses,
}


def _worker(rank: int, port: int, q) -> None:
    torch.set_num_threads(1)
    results = {}
    try:
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        _quiet()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=60))
        for name, fn in CASES.items():
            try:
                fn(rank)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
    except Exception:
        results["_setup"] = traceback.format_exc()
    q.put((rank, results))
    q.close()
    q.join_thread()
    os._exit(0)


_RESULTS: dict[int, dict[str, str]] = {}


def _spawn() -> dict[int, dict[str, str]]:
    if _RESULTS:
        return _RESULTS
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, q), daemon=True) for r in range(W)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT_S
    while len(_RESULTS) < W and time.monotonic() < deadline:
        try:
            rank, res = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            break
        _RESULTS[rank] = res
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return _RESULTS


@pytest.mark.parametrize("case", list(CASES))
def test_ep_under_compile(case):
    res = _spawn()
    assert len(res) == W, f"only ranks {sorted(res)} of {W} reported (a worker crashed or hung)"
    for rank in range(W):
        assert "_setup" not in res[rank], res[rank]["_setup"]
        got = res[rank].get(case, "missing")
        assert got == "ok", f"rank {rank}:\n{got}"
