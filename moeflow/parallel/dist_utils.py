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

One EP step (one layer's dispatch ... combine) is an `EPStep`. Its collectives carry a
header, int64 [magic, step, layer, status, detail] (the step counter of the group on this
rank, the layer index, OK / REFUSED / FAILED and the refusing exception's kind), folded
into exchanges the step makes anyway: extra slots of the counts all-to-all, of the
all_reduce input check's all-gather, a column of the static all-to-all rows, rows of
the combine all-to-all and of the all_reduce sum. Every rank receives every rank's
header, so every rank reaches the same verdict: a peer at another step or layer raises
EPStepMismatch, a peer that refused the step raises EPStepAborted, on every rank, and
the group is marked broken (EPGroupBroken afterwards). A rank that refuses a step (bad
input, NaN routing, an exception in its experts) does not leave: `EPStep.abort` runs the
step's remaining collectives with a REFUSED / FAILED header, then the rank re-raises its
own error. The header is read on the host where reading costs no extra sync (CPU
tensors, a timed wait that already blocked, an existing host read of counts); otherwise
(CUDA without `timeout_s`, CUDA-graph capture) the verdict stays on the device: the
step's output is set to NaN and the verdict is read at the group's next host read
(`check_steps(group)` reads it at once).
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
    "EPStepAborted",
    "EPStepMismatch",
    "EPStep",
    "begin_step",
    "current_step",
    "check_steps",
    "owes_nothing",
    "check_timeout",
    "mark_broken",
    "collective",
    "point_to_point",
    "refuse_if_broken",
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


class EPStepMismatch(EPCollectiveError):
    """The ranks' EP step headers disagree: another rank is at a different step or layer.

    A rank skipped or repeated a layer, or left an earlier step before its last collective,
    so this step's collectives paired with another step's. The group is marked broken.
    """


class EPStepAborted(EPCollectiveError):
    """Another rank refused this EP step (its input, its routing or its experts failed).

    That rank raised its own error; this rank's result for the step is discarded. The
    group is marked broken.
    """


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


def point_to_point(name: str, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], *,
                   group: dist.ProcessGroup, timeout_s: float | None) -> None:
    """Post every send and receive at once (peer: its rank in `group` -> a contiguous buffer), then wait
    for each at most `timeout_s` seconds (both sides must post matching sizes; empty buffers are skipped).

    A failure (timeout, a peer's connection closed) raises EPCollectiveError naming `name`, and the
    group is marked broken (the peers' messages may still arrive later).
    """
    refuse_if_broken(group, f"collective {name!r}")
    t0 = time.monotonic()
    works = []
    try:
        for peer, buf in recvs.items():
            if buf.numel():
                works.append(dist.irecv(buf, src=dist.get_global_rank(group, peer), group=group))
        for peer, buf in sends.items():
            if buf.numel():
                works.append(dist.isend(buf, dst=dist.get_global_rank(group, peer), group=group))
    except Exception as exc:
        err = _error(name, group, timeout_s, t0, exc)
        mark_broken(group, f"{name!r}: {type(exc).__name__}")
        raise err from exc
    for work in works:
        _Pending(name, work, group, timeout_s, t0).wait()


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


# ----------------------------------------------------------------------------- EP steps

HEADER_LEN = 5  # int64 slots: magic, step, layer, status, detail
HEADER_BYTES = 8 * HEADER_LEN
STEP_MAGIC = 0x4D6F4546  # "MoEF": tells a step header from counts or payload of another collective
STATUS_OK, STATUS_REFUSED, STATUS_FAILED = 0, 1, 2
_STATUS_TEXT = {
    STATUS_REFUSED: "refused it before sending its data",
    STATUS_FAILED: "failed during it, after sending its data",
}
# A summing collective (all_reduce) carries per rank SUM_HEADER_LEN small digits instead:
# [SUM_MAGIC, step % 256, layer % 256, layer // 256 % 256, status, detail], each < 256 so
# exact in every float dtype a sum runs in (bfloat16 included), in the rank's own block of the
# header area (zeros elsewhere): after the sum, block r holds rank r's digits.
SUM_HEADER_LEN = 6
SUM_MAGIC = 0xA5
# detail: the kind of error the refusing rank raised (index + 1; 0: another kind). Append only.
_DETAIL_KINDS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, NotImplementedError, getattr(torch, "OutOfMemoryError", MemoryError), MemoryError,
    EPCollectiveError, RuntimeError,
)


def _detail(exc: BaseException) -> int:
    for i, kind in enumerate(_DETAIL_KINDS):
        if isinstance(exc, kind):
            return i + 1
    return 0


def _detail_name(code: int) -> str:
    return _DETAIL_KINDS[code - 1].__name__ if 1 <= code <= len(_DETAIL_KINDS) else "an error"


class _GroupSteps:
    """This rank's EP step bookkeeping for one process group.

    group:       held, so that its id (the key) is not reused while this state lives.
    count:       steps begun on the group by this rank (the header's step).
    current:     the step in flight (begun, not closed), or None.
    pending_dev: bool device scalar, True when a header verdict that was not read yet failed
                 (CUDA without a timeout: read at the group's next host read), or None.
    pending_msg: a failure this rank knows of and its peers will read later (it refused a step
                 whose verdict they did not read at once), or None.
    consts:      device constants the headers are built from (no host-to-device copy per step).
    """

    __slots__ = ("group", "count", "current", "pending_dev", "pending_msg", "consts")

    def __init__(self, group: object) -> None:
        self.group = group
        self.count = 0
        self.current: EPStep | None = None
        self.pending_dev: torch.Tensor | None = None
        self.pending_msg: str | None = None
        self.consts: dict[tuple, torch.Tensor] = {}


_STEPS: dict[int, _GroupSteps] = {}


def _steps(group: object) -> _GroupSteps:
    st = _STEPS.get(_group_key(group))
    if st is None or st.group is not group:
        st = _STEPS[_group_key(group)] = _GroupSteps(group)
    return st


def refuse_if_broken(group: object, name: str) -> None:
    """Raise EPGroupBroken naming `name` when `group` failed earlier."""
    _refuse_if_broken(group, name)


def _refuse_if_broken(group: object, name: str) -> None:
    broken = _BROKEN.get(_group_key(group))
    if broken is not None:
        raise EPGroupBroken(
            f"expert-parallel {name} refused: this process group failed earlier ({broken}); "
            f"its ranks are out of step. Create a new process group (and shard the layers on it) to go on."
        )


def _rank_of(group: object) -> str:
    try:
        return f"rank {dist.get_rank(group)}/{dist.get_world_size(group)}"
    except Exception:  # the group itself may be broken by now
        return "this rank"


def begin_step(group: dist.ProcessGroup, *, layer: int, owner: object, timeout_s: float | None) -> EPStep:
    """Open this rank's next EP step on `group` (not collective; its collectives come later).

    layer: the layer's index (-1 when the caller names none); owner: the dispatcher running it.
    Raises EPGroupBroken when the group failed earlier, or when the previous step on this rank
    was dispatched but never combined (that step is first finished with a FAILED header, so
    the peers waiting in it raise too instead of pairing with this one).
    """
    _refuse_if_broken(group, f"step (layer {layer})")
    st = _steps(group)
    stale = st.current
    if stale is not None and stale.live:
        stale.abort(RuntimeError("the step was left open"))
        mark_broken(group, f"step {stale.index} (layer {stale.layer}) was left open")
        raise EPGroupBroken(
            f"expert-parallel step {stale.index} (layer {stale.layer}) on {_rank_of(group)} was dispatched but "
            f"never combined (the caller left it); its peers were told and the group is now broken. Create a new "
            f"process group (and shard the layers on it) to go on."
        )
    st.count += 1
    step = EPStep(st, st.count, int(layer), owner, timeout_s)
    st.current = step
    return step


def current_step(group: dist.ProcessGroup) -> EPStep | None:
    """The step in flight on `group` on this rank (begun, not closed), or None."""
    st = _STEPS.get(_group_key(group))
    if st is None or st.current is None or not st.current.live:
        return None
    return st.current


def check_steps(group: dist.ProcessGroup) -> None:
    """Read the group's deferred step verdicts now (one host sync on CUDA).

    Raises EPStepAborted (and marks the group broken) when a step whose header was checked
    on the device failed (a rank refused it or was out of step), or when this rank refused
    one whose verdict its peers read only later. Call it on every rank at the same point,
    after each forward whether it raised or not, when steps run on CUDA without `timeout_s`
    (static decode has no other host read).
    """
    st = _STEPS.get(_group_key(group))
    if st is None:
        return
    flag, msg = st.pending_dev, st.pending_msg
    st.pending_dev = st.pending_msg = None
    if msg is not None or (flag is not None and bool(flag)):
        why = msg or "a step header checked on the device disagreed (another rank refused a step or was out of step)"
        mark_broken(group, "a deferred step verdict failed")
        raise EPStepAborted(
            f"expert-parallel group on {_rank_of(group)}: {why}; outputs since then were set to NaN. The group "
            f"is now broken: create a new process group (and shard the layers on it) to go on."
        )


class EPStep:
    """One EP step (one layer's dispatch ... combine) of this rank on a process group.

    index:   the group's step counter on this rank (the header's step); layer: the layer index.
    owner:   the dispatcher that runs it.
    started: this rank has sent its data (a refusal from now on is FAILED, not REFUSED).
    finish:  what the step still owes the other ranks if this rank gives it up now: a callable
             (status, detail) -> bool that runs the remaining collectives with that status in
             their header and returns whether every rank reads that verdict at once (False: it
             is read later, see the module docstring). Set by the dispatcher as the step
             advances; None: the dispatcher's `abort_step` knows what an unstarted step owes.
    live:    until closed (combined, refused, or failed). A `finish` that returns None
             (`owes_nothing`) means the step's last collective is done: an error after it
             is this rank's alone (the next step's header tells the peers if it leaves).
    """

    __slots__ = ("_st", "index", "layer", "owner", "timeout_s", "live", "started", "finish", "aborted",
                 "_aborts")

    def __init__(self, st: _GroupSteps, index: int, layer: int, owner: object, timeout_s: float | None) -> None:
        self._st = st
        self.index, self.layer, self.owner, self.timeout_s = index, layer, owner, timeout_s
        self.live = True
        self.started = False
        self.finish: Callable[[int, int], bool] | None = None
        self.aborted = False
        self._aborts: list[tuple[int, list[int]]] = []

    @property
    def group(self):
        return self._st.group

    def __repr__(self) -> str:
        return f"EPStep(step={self.index}, layer={self.layer}, live={self.live})"

    # -- the header

    def header(self, status: int = STATUS_OK, detail: int = 0) -> list[int]:
        """The header this rank sends: [magic, step, layer, status, detail]."""
        return [STEP_MAGIC, self.index, self.layer, status, detail]

    def header_tensor(self, device: torch.device, status: int = STATUS_OK, detail: int = 0,
                      dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """[HEADER_LEN] of `dtype` (int64, or float64 where it rides with floats) on `device`. On
        CUDA, an OK header is one kernel from cached constants (no host-to-device copy, which
        would sync the stream; capturable, the step baked in)."""
        if device.type != "cuda" or status != STATUS_OK:
            return torch.tensor(self.header(status, detail), dtype=dtype, device=device)
        consts = self._st.consts
        base = consts.get(("hdr", device, dtype, self.layer))
        if base is None:
            base = consts[("hdr", device, dtype, self.layer)] = torch.tensor(
                [STEP_MAGIC, 0, self.layer, STATUS_OK, 0], dtype=dtype, device=device)
        unit = consts.get(("unit", device, dtype))
        if unit is None:
            unit = consts[("unit", device, dtype)] = torch.tensor([0, 1, 0, 0, 0], dtype=dtype, device=device)
        return torch.add(base, unit, alpha=self.index)

    def zero_pad(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes] of zeros on `device`, cached (what pads a header to whole rows)."""
        key = ("pad", device, nbytes)
        pad = self._st.consts.get(key)
        if pad is None:
            pad = self._st.consts[key] = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        return pad

    def sum_header(self, status: int = STATUS_OK, detail: int = 0) -> list[int]:
        """This rank's SUM_HEADER_LEN digits for a summing collective."""
        L = self.layer & 0xFFFF
        return [SUM_MAGIC, self.index & 0xFF, L & 0xFF, L >> 8, status, detail]

    def write_sum_header(self, out: torch.Tensor, rank: int, status: int = STATUS_OK, detail: int = 0) -> None:
        """Fill `out` (1-D, the header area of a summing collective, >= W * SUM_HEADER_LEN
        elements, a float dtype) with this rank's digits in block `rank`, zeros elsewhere.
        On CUDA an OK header is one kernel from cached constants (capturable)."""
        device, dtype, n = out.device, out.dtype, int(out.numel())
        if device.type != "cuda" or status != STATUS_OK:
            area = torch.zeros(n, dtype=torch.float32)
            area[rank * SUM_HEADER_LEN: (rank + 1) * SUM_HEADER_LEN] = torch.tensor(
                self.sum_header(status, detail), dtype=torch.float32)
            out.copy_(area)
            return
        consts = self._st.consts
        key = ("sum", device, dtype, n, rank, self.layer)
        base = consts.get(key)
        if base is None:
            area = torch.zeros(n, dtype=torch.float32)
            area[rank * SUM_HEADER_LEN: (rank + 1) * SUM_HEADER_LEN] = torch.tensor(
                [SUM_MAGIC, 0, *self.sum_header()[2:]], dtype=torch.float32)
            base = consts[key] = area.to(device=device, dtype=dtype)
        ukey = ("sumunit", device, dtype, n, rank)
        unit = consts.get(ukey)
        if unit is None:
            area = torch.zeros(n, dtype=torch.float32)
            area[rank * SUM_HEADER_LEN + 1] = 1.0
            unit = consts[ukey] = area.to(device=device, dtype=dtype)
        torch.add(base, unit, alpha=self.index & 0xFF, out=out)

    def sum_header_expected(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[SUM_HEADER_LEN] of `dtype`: the digits every rank's block holds after an OK sum."""
        if device.type != "cuda":
            return torch.tensor(self.sum_header(), dtype=dtype)
        consts = self._st.consts
        key = ("sumwant", device, dtype, self.layer)
        base = consts.get(key)
        if base is None:
            base = consts[key] = torch.tensor([SUM_MAGIC, 0, *self.sum_header()[2:]], dtype=dtype, device=device)
        ukey = ("sumwantunit", device, dtype)
        unit = consts.get(ukey)
        if unit is None:
            unit = consts[ukey] = torch.tensor([0, 1, 0, 0, 0, 0], dtype=dtype, device=device)
        return torch.add(base, unit, alpha=self.index & 0xFF)

    def rows_from_sum(self, blocks: list[list[float]]) -> list[list[int]]:
        """Header rows (as `check` takes them) from the W digit blocks of a summing collective:
        a block that matches this rank's digits reads as this step; others keep their digits."""
        want = self.sum_header()
        rows = []
        for b in blocks:
            d = [int(round(v)) if v == v else -1 for v in b]  # NaN (a peer's poisoned sum) reads as -1
            magic = STEP_MAGIC if d[0] == SUM_MAGIC else 0
            step = self.index if d[1] == want[1] else d[1]
            layer = self.layer if d[2:4] == want[2:4] else d[2] + 256 * d[3]
            rows.append([magic, step, layer, d[4], d[5]])
        return rows

    def read_now(self, device: torch.device) -> bool:
        """Whether a verdict on `device` tensors is read on the host at once: CPU tensors, or a timed
        wait that already blocked the host (and no CUDA-graph capture)."""
        if device.type != "cuda":
            return True
        return self.timeout_s is not None and not _capturing()

    def pending_tensor(self, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor | None:
        """[1] of `dtype`: 1 when an earlier, unread device verdict of the group failed, to read with
        this step's headers; None when there is none to read."""
        flag = self._st.pending_dev
        if flag is None:
            return None
        return flag.to(device=device, dtype=dtype).view(1)

    # -- verdicts

    def check(self, rows: list[list[int]], *, final: bool = True, pending: int | None = None) -> None:
        """The host verdict on the headers every rank sent this collective (rows: W lists of
        HEADER_LEN ints in rank order; every rank receives the same ones, so every rank
        reaches the same verdict).

        Raises EPStepMismatch when a rank is at another step or layer; EPStepAborted when a
        rank refused the step (with final=False a refusal is only remembered: the caller
        runs the step's last collective first, so that no rank leaves it early); both mark
        the group broken and close the step. pending: the group's earlier device verdict,
        read with these rows (`pending_tensor`), or None where it was not read.
        """
        want = self.header()
        off = [(r, row) for r, row in enumerate(rows) if list(row[:3]) != want[:3]]
        if off:
            seen = "; ".join(
                f"rank {r} sent " + (f"step {row[1]} of layer {row[2]}" if row[0] == STEP_MAGIC
                                     else "something that is not a step header")
                for r, row in off)
            self._fail(EPStepMismatch(
                f"expert-parallel step {self.index} (layer {self.layer}) on {_rank_of(self.group)}: the ranks are "
                f"out of step: {seen}. A rank skipped or repeated a layer, or left an earlier step before its last "
                f"collective. The group is now broken: create a new process group (and shard the layers on it) "
                f"to go on."), "ranks out of step")
            return
        self._aborts += [(r, list(row)) for r, row in enumerate(rows) if row[3] != STATUS_OK]
        if pending is not None and not pending and self._st.pending_msg is None:
            self._st.pending_dev = None  # read, and nothing failed
        elif pending is not None:
            why = self._st.pending_msg or "a step header checked on the device disagreed"
            self._st.pending_dev = self._st.pending_msg = None
            self._fail(EPStepAborted(
                f"expert-parallel step {self.index} (layer {self.layer}) on {_rank_of(self.group)}: an earlier "
                f"step failed ({why}; its verdict was not read at once, its outputs were set to NaN). The group is "
                f"now broken: create a new process group (and shard the layers on it) to go on."),
                "an earlier step failed")
            return
        if final and self._aborts:
            by: dict[int, list[int]] = {}
            for r, row in self._aborts:
                by.setdefault(r, row)
            what = "; ".join(f"rank {r} {_STATUS_TEXT.get(row[3], 'refused it')} ({_detail_name(row[4])})"
                             for r, row in sorted(by.items()))
            self._fail(EPStepAborted(
                f"expert-parallel step {self.index} (layer {self.layer}) on {_rank_of(self.group)}: {what}. This "
                f"rank's result for the step is discarded; the group is now broken: create a new process group "
                f"(and shard the layers on it) to go on."), f"rank {min(by)} refused step {self.index}")

    def device_verdict(self, sent: torch.Tensor, received: list[torch.Tensor]) -> torch.Tensor:
        """bool device scalar: some received header ([..., n]) differs from `sent` ([n]: this
        rank's OK header, as int64 or as its bytes, or the OK digits of a summing collective).
        No host read; see `defer`."""
        if len(received) == 1:
            return received[0].ne(sent).any()
        n = int(sent.numel())
        return torch.cat([h.reshape(-1, n) for h in received]).ne(sent).any()

    def defer(self, bad: torch.Tensor) -> None:
        """Remember a device verdict for the group's next host read (not under CUDA-graph capture,
        where no host code runs at replay: there the NaN output is the signal)."""
        if _capturing():
            return
        st = self._st
        st.pending_dev = bad if st.pending_dev is None else st.pending_dev | bad

    def _fail(self, err: EPCollectiveError, why: str) -> None:
        mark_broken(self.group, f"step {self.index} (layer {self.layer}): {why}")
        self.close()
        if not self.aborted:  # a refusing rank re-raises its own error instead
            raise err

    # -- ending

    def close(self) -> None:
        """The step is over on this rank (combined, refused or failed)."""
        self.live = False
        self.finish = None  # drops what the owed collectives would have sent
        if self._st.current is self:
            self._st.current = None

    def abort(self, exc: BaseException) -> None:
        """This rank gives the step up because of `exc` (the caller re-raises it).

        Runs what the step still owes the other ranks (`finish`) with a REFUSED / FAILED
        header, so that they raise EPStepAborted instead of pairing their pending
        collectives with this rank's next step; marks the group broken (or, when the peers
        read the verdict only later, leaves it for the group's next read); closes the step.
        A KeyboardInterrupt-like exception may have cut a collective short: then the group
        is only marked broken (the peers time out). When an earlier step of the group already
        failed a verdict that was read only on the device, `exc` is its consequence (its NaN
        output refused here): raises EPStepAborted from `exc`, the group marked broken, and
        the peers are not involved (they learn it at their own next read).
        """
        if not self.live:
            return
        self.aborted = True
        group = self.group
        st = self._st
        told = True
        try:
            if _group_key(group) in _BROKEN:
                return
            # A failure path: reading the device verdict now costs nothing that matters.
            if st.pending_msg is not None or (st.pending_dev is not None and bool(st.pending_dev)):
                why = st.pending_msg or "a step header checked on the device disagreed"
                st.pending_dev = st.pending_msg = None
                mark_broken(group, "a deferred step verdict failed")
                raise EPStepAborted(
                    f"expert-parallel step {self.index} (layer {self.layer}) on {_rank_of(group)}: an earlier step "
                    f"failed ({why}; its verdict was read only now, its outputs were NaN), and this step's "
                    f"{type(exc).__name__} follows from it. The group is now broken: create a new process group "
                    f"(and shard the layers on it) to go on."
                ) from exc
            if not isinstance(exc, Exception) or self.finish is None:
                mark_broken(group, f"step {self.index} (layer {self.layer}) interrupted: {type(exc).__name__}")
                return
            status = STATUS_FAILED if self.started else STATUS_REFUSED
            try:
                told = self.finish(status, _detail(exc))
            except BaseException as err:
                mark_broken(group, f"step {self.index} (layer {self.layer}): telling the peers failed")
                _note(exc, f"expert parallelism: this rank refused step {self.index} (layer {self.layer}) but could "
                           f"not tell its peers ({type(err).__name__}: {err}); the group is now broken")
                return
            if told is None:
                return
            if told:
                mark_broken(group, f"this rank refused step {self.index} (layer {self.layer}): {type(exc).__name__}")
                when = "now"
            else:
                self._st.pending_msg = f"this rank refused step {self.index} (layer {self.layer})"
                when = "at the group's next host read (check_steps)"
            _note(exc, f"expert parallelism: this rank refused step {self.index} (layer {self.layer}); the other "
                       f"ranks of the group were told through the step's header and raise EPStepAborted {when}; "
                       f"the group is then broken")
        finally:
            self.close()


def owes_nothing(status: int, detail: int) -> None:
    """`EPStep.finish` once the step's last collective is done on this rank."""
    return None


def _note(exc: BaseException, text: str) -> None:
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(text)


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


class EPStepOwner:
    """The EP step protocol both expert-parallel dispatchers share (they set `group` and `timeout_s`).

    The layer opens a step with `begin_step(layer_idx)` before it routes and calls `abort_step` when its
    step raises; a dispatch runs in the step the layer began (`_open`), else in a new one. Each dispatcher
    says in `_owed_unstarted(step, x_TH, K)` what a step owes the other ranks when this rank refuses it
    before sending anything.
    """

    group: dist.ProcessGroup
    timeout_s: float | None

    def begin_step(self, layer_idx: int) -> None:
        """Open this rank's next EP step on the group for layer `layer_idx` (called by the layer
        before it routes, so that a refusal anywhere in its step can still be announced).
        Raises EPGroupBroken when the group failed earlier."""
        begin_step(self.group, layer=layer_idx, owner=self, timeout_s=self.timeout_s)

    def abort_step(self, x_TH: torch.Tensor, spec, exc: BaseException) -> None:
        """The layer's step raised `exc` on this rank (the caller re-raises it): run what the step
        still owes the other ranks with a REFUSED / FAILED header, so that they raise
        EPStepAborted now instead of pairing with this rank's next step.

        x_TH: [T, H] the step's input (it sizes the owed messages); spec: the layer's RouterSpec (K).
        Nothing to do when the step is already over (combined, or refused by every rank alike).
        """
        step = current_step(self.group)
        if step is None:
            return
        if step.finish is None and not step.started:
            step.finish = self._owed_unstarted(step, x_TH, int(spec.top_k))
        step.abort(exc)

    def _open(self, x_TH: torch.Tensor, K: int = 0) -> EPStep:
        """The step this dispatch runs in: the one the layer began, else a new one (layer -1)."""
        step = current_step(self.group)
        if step is None or step.owner is not self or step.started or step.finish is not None:
            step = begin_step(self.group, layer=-1, owner=self, timeout_s=self.timeout_s)
        step.finish = self._owed_unstarted(step, x_TH, K)
        return step

    def _owed_unstarted(self, step: EPStep, x_TH: torch.Tensor, K: int):
        raise NotImplementedError
