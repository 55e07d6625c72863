"""Run a test module's distributed cases on W spawned gloo ranks (one spawn per module and W).

    CASES = [("name", fn), ...]          # fn(rank, W) raises on failure
    results = spawn_cases("test_module", W)   # {rank: {name: "ok" | traceback}}

Each rank runs every case in order on one process group (a case that breaks its group makes a
new one for the next: `fresh_group()`), reports through a queue and leaves with os._exit (a
timed-out gloo op may still be pending).
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CACHE: dict[tuple[str, int], dict[int, dict[str, str]]] = {}


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _worker(rank: int, W: int, port: int, module: str, q) -> None:
    torch.set_num_threads(1)
    results: dict[str, str] = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=60))
        mod = importlib.import_module(module)
        for name, fn in mod.CASES:
            try:
                fn(rank, W)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
    except Exception:
        results["_setup"] = traceback.format_exc()
    report_and_exit(q, rank, results)


def report_and_exit(q, rank: int, results: dict[str, str]) -> None:
    """A spawned rank's last act: its results through the queue, then os._exit (a timed-out gloo op
    may still be pending, so no destroy_process_group)."""
    q.put((rank, results))
    q.close()
    q.join_thread()
    os._exit(0)


def spawn_cases(module: str, W: int, *, limit_s: float = 150.0) -> dict[int, dict[str, str]]:
    """{rank: {case: "ok" | traceback}} of `module`'s CASES on W gloo ranks (cached per module and W)."""
    key = (module, W)
    if key in _CACHE:
        return _CACHE[key]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, W, port, module, q), daemon=True) for r in range(W)]
    _CACHE[key] = out = gather_ranks(procs, q, limit_s)
    return out


def gather_ranks(procs: list, q, limit_s: float) -> dict[int, dict[str, str]]:
    """Start the rank processes, collect each one's (rank, results) from q until all reported or limit_s
    passed, then join them (killing any left alive). {rank: results} of those that reported."""
    for p in procs:
        p.start()
    out: dict[int, dict[str, str]] = {}
    deadline = time.monotonic() + limit_s
    while len(out) < len(procs) and time.monotonic() < deadline:
        try:
            rank, res = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            break
        out[rank] = res
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return out


def check_case(module: str, W: int, case: str) -> None:
    res = spawn_cases(module, W)
    assert len(res) == W, f"only ranks {sorted(res)} of {W} reported (a worker crashed or hung)"
    for rank in range(W):
        assert "_setup" not in res[rank], res[rank]["_setup"]
        got = res[rank].get(case, "missing")
        assert got == "ok", f"rank {rank}:\n{got}"
