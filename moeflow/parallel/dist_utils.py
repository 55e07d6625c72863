"""torch.distributed helpers for expert parallelism: monitored collectives and set-up checks.

Legend: W ranks in the group, F fields of a config fingerprint.

Every collective the EP code issues goes through `collective(...)`: it starts the op
with `async_op=True` and waits with the user's timeout, so a rank that died, hung
or skipped the call surfaces as `EPCollectiveError` naming the collective, the rank
and the timeout, instead of an endless hang. (The process group's own timeout, from
`init_process_group(timeout=...)`, still applies underneath; NCCL's watchdog uses it.)

While a CUDA graph is being captured nothing may block the host, so the wait there
is the plain stream-ordered `work.wait()` without a timeout.

On NCCL a timed `work.wait(timeout)` blocks the host until the collective finishes
(a device sync per collective); for throughput leave `timeout_s=None` and rely on
`init_process_group(timeout=...)` (NCCL's watchdog), and set `timeout_s` when a clear
error naming the collective matters more (tests, bring-up, the demo).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

__all__ = [
    "EPCollectiveError",
    "EPConfigMismatch",
    "EPGroupBroken",
    "EPInputMismatch",
    "check_timeout",
    "mark_broken",
    "collective",
    "group_device",
    "group_rank",
    "group_size",
    "check_same_across_ranks",
    "dtype_code",
]

# Stable small integers for dtypes in a config fingerprint (order never changes; append only).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)


class EPCollectiveError(RuntimeError):
    """A collective failed or did not finish within the timeout (a peer died, hung or skipped it)."""


class EPConfigMismatch(ValueError):
    """Ranks of one EP group were set up with different layer configs."""


class EPGroupBroken(EPCollectiveError):
    """A collective of this group failed earlier: the group is out of step and refuses every call.

    After a timeout the peers may still hold (or later issue) the collectives this rank gave
    up on, so a later call would pair with a stale one (wrong data, or an abort inside the
    backend). The way out is a new process group (and new layers built on it).
    """


class EPInputMismatch(ValueError):
    """The ranks of an all_reduce EP group were given different tokens (the mode needs the same)."""


# id(group) -> the first failure's message. Keyed by id: ProcessGroup objects live as long as
# the program uses them, and a new group (the way out) gets a new id.
_BROKEN: dict[int, str] = {}


def _group_key(group: object) -> int:
    return id(group)


def mark_broken(group: object, why: str) -> None:
    """Record that `group` failed; every later `collective` on it raises EPGroupBroken."""
    _BROKEN.setdefault(_group_key(group), why)


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float | None:
    """timeout_s as a float, or None; ValueError naming the value unless a finite number of seconds > 0."""
    if timeout_s is None:
        return None
    import math

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not timeout_s > 0:
        raise ValueError(f"{name}={timeout_s!r}: expected None or a finite number of seconds > 0")
    return float(timeout_s)


def dtype_code(dtype: torch.dtype | None) -> int:
    """A small integer for `dtype` (-1 for None), stable across processes."""
    if dtype is None:
        return -1
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        return 100 + sum(map(ord, str(dtype)))


def _dtype_name(code: int) -> str:
    if 0 <= code < len(_DTYPES):
        return str(_DTYPES[code])
    return "None" if code == -1 else f"dtype#{code}"


def _check_group(group: object) -> None:
    if group is None:
        raise ValueError(
            "group=None: pass the process group explicitly (torch.distributed.group.WORLD for the default one)"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")


def group_rank(group: dist.ProcessGroup) -> int:
    _check_group(group)
    return dist.get_rank(group)


def group_size(group: dist.ProcessGroup) -> int:
    _check_group(group)
    return dist.get_world_size(group)


def group_device(group: dist.ProcessGroup) -> torch.device:
    """Where the group's collectives want their tensors: CUDA (current device) for NCCL, else CPU."""
    _check_group(group)
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def collective(
    name: str,
    fn: Callable[..., object],
    *args: object,
    group: dist.ProcessGroup,
    timeout_s: float | None,
    wait: bool = True,
    **kwargs: object,
):
    """Run `fn(*args, group=group, async_op=True, **kwargs)` and wait at most `timeout_s` seconds.

    Returns the work handle when `wait=False` (finish it with `wait_work`), else None.
    Any failure (timeout, a peer's connection closed) raises EPCollectiveError naming
    `name`, this rank and the timeout.
    """
    broken = _BROKEN.get(_group_key(group))
    if broken is not None:
        raise EPGroupBroken(
            f"expert-parallel collective {name!r} refused: this process group failed earlier ({broken}); "
            f"its ranks are out of step. Create a new process group (and shard the layers on it) to go on."
        )
    t0 = time.monotonic()
    try:
        work = fn(*args, group=group, async_op=True, **kwargs)
    except Exception as exc:  # a peer already gone shows up here on some backends
        err = _error(name, group, timeout_s, t0, exc)
        mark_broken(group, f"{name!r}: {type(exc).__name__}")
        raise err from exc
    if not wait:
        return _Pending(name, work, group, timeout_s, t0)
    _Pending(name, work, group, timeout_s, t0).wait()
    return None


class _Pending:
    """An in-flight collective started by `collective(..., wait=False)`."""

    __slots__ = ("name", "work", "group", "timeout_s", "t0")

    def __init__(self, name, work, group, timeout_s, t0) -> None:
        self.name, self.work, self.group, self.timeout_s, self.t0 = name, work, group, timeout_s, t0

    def wait(self) -> None:
        try:
            if self.timeout_s is None or _capturing():
                self.work.wait()
            else:
                ok = self.work.wait(timeout=datetime.timedelta(seconds=float(self.timeout_s)))
                # Some backends return False instead of raising on timeout.
                if ok is False:
                    raise TimeoutError("work.wait returned False")
        except EPCollectiveError:
            mark_broken(self.group, f"{self.name!r} failed")
            raise
        except Exception as exc:
            err = _error(self.name, self.group, self.timeout_s, self.t0, exc)
            mark_broken(self.group, f"{self.name!r}: {type(exc).__name__} after {time.monotonic() - self.t0:.1f}s")
            raise err from exc


def _error(name: str, group, timeout_s: float | None, t0: float, exc: BaseException) -> EPCollectiveError:
    try:
        where = f"rank {dist.get_rank(group)}/{dist.get_world_size(group)} ({dist.get_backend(group)})"
    except Exception:  # the group itself may be broken by now
        where = "this rank"
    limit = "no timeout set" if timeout_s is None else f"timeout {timeout_s:g}s"
    return EPCollectiveError(
        f"expert-parallel collective {name!r} failed on {where} after {time.monotonic() - t0:.1f}s "
        f"({limit}): {type(exc).__name__}: {exc}. A peer rank may have died, hung, or not entered "
        f"this collective (ranks must run the same layers in the same order)."
    )


def check_same_across_ranks(
    fields: Mapping[str, int],
    *,
    group: dist.ProcessGroup,
    timeout_s: float | None,
    what: str = "EP layer",
    dtype_fields: tuple[str, ...] = ("dtype",),
) -> None:
    """All-gather a small int64 fingerprint and raise EPConfigMismatch naming every field that differs.

    fields: name -> int (dtypes through `dtype_code`; the names in `dtype_fields` are
            printed back as dtypes). Every rank must pass the same names in the same order
            (their count is checked first, so a different key set cannot be read as values).
    """
    names = list(fields)
    device = group_device(group)
    W = dist.get_world_size(group)
    mine = torch.tensor([len(names), *(int(fields[n]) for n in names)], dtype=torch.int64, device=device)
    size = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(W)]
    collective(f"all_gather({what} fingerprint size)", dist.all_gather, sizes, size, group=group, timeout_s=timeout_s)
    sizes_l = [int(s) for s in torch.cat(sizes).tolist()]
    if len(set(sizes_l)) != 1:
        raise EPConfigMismatch(
            f"{what}: ranks disagree on the config fingerprint's length {sizes_l} (different moeflow versions?)"
        )
    got = [torch.empty_like(mine) for _ in range(W)]
    collective(f"all_gather({what} fingerprint)", dist.all_gather, got, mine, group=group, timeout_s=timeout_s)
    table = torch.stack(got).cpu().tolist()
    bad = []
    for j, n in enumerate(names, start=1):
        vals = [row[j] for row in table]
        if len(set(vals)) != 1:
            shown = [_dtype_name(v) for v in vals] if n in dtype_fields else vals
            bad.append(f"{n} per rank = {shown}")
    if bad:
        raise EPConfigMismatch(
            f"{what}: ranks were set up with different configs: " + "; ".join(bad)
            + f" (this is rank {dist.get_rank(group)}; every rank must build the same layer)"
        )


def leave_process_group() -> None:
    """Barrier, then destroy the default group: every rank leaves together.

    A rank that tears gloo down while a peer still talks to it aborts at interpreter
    exit ("terminate called without an active exception"); finished async work handles
    are collected first so none outlives the group.
    """
    import gc

    if not dist.is_initialized():
        return
    gc.collect()
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
