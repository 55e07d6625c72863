"""RoutingMonitor: the GPU routing status of a whole model, checked without a host sync per layer.

Legend: L MoE layers, T tokens of a forward.

On CUDA the selection kernels report NaN logits and bad hash ids through a per-row device
status (`moeflow.routing.gpu.RoutingStatus`) instead of a host read. A standalone MoELayer
checks it after each eager step (one sync per layer: `check_routing="eager"`). A patched
model does better (`check_routing="deferred"`): each layer hands its status to the model's
monitor, and

    end_forward()   after the last MoE block of a forward: ONE small device op (concatenate the L
                    status vectors, max) and a non-blocking copy of that flag into pinned
                    host memory, with an event. No host sync.
    poll()          at the first MoE block of the next forward (or from `check()`): when the event has
                    completed (the model synchronised meanwhile, e.g. generate reading its
                    next token) the flag is read from host memory at no cost; a set flag
                    re-checks the layers' statuses (a sync, on the error path only) and
                    raises the ValueError naming the layer and the row.

So a NaN is never a silent pick: it raises at the latest at the start of the next forward
(or at `check()`), naming where it happened. `check(wait=True)` waits for the flag (one
sync) for a caller that must know now. Under CUDA-graph capture nothing is enqueued; the
caller checks after each replay (`check(wait=True)`).
"""

from __future__ import annotations

import collections
import threading

import torch

__all__ = ["RoutingMonitor"]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class RoutingMonitor:
    """Collects the device routing statuses of one model's layers (see the module docstring)."""

    # Flags in flight at once: forwards enqueued back to back (no sync between them) wait for
    # the oldest flag only when this many are still pending on the device.
    RING = 4

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list = []  # statuses of the forward in progress
        # (statuses, ring slot) per forward whose flag is in flight, oldest first
        self._inflight: collections.deque[tuple[list, int]] = collections.deque()
        # RING pinned flags and events, allocated at the first forward (cudaHostAlloc is slow);
        # a slot is reused only after poll() has consumed its flag.
        self._host: torch.Tensor | None = None
        self._events: list = []
        self._next = 0

    # Layers called outside a model forward (a benchmark looping over one layer) never reach
    # end_forward: past this many pending statuses they are folded into one flag.
    MAX_PENDING = 1024

    def add(self, status) -> None:
        """Record one layer's RoutingStatus (called by MoELayer.route)."""
        with self._lock:
            self._pending.append(status)
            full = len(self._pending) >= self.MAX_PENDING
        if full:
            self.end_forward()

    def end_forward(self) -> None:
        """Enqueue the forward's one error flag (device op + non-blocking copy + event); no sync
        unless RING flags are still in flight."""
        if _capturing():
            return
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        self.poll()  # flags that have landed are checked first (free)
        rows = [s.status_T.reshape(-1) for s in pending if s.status_T.numel()]
        if not rows:
            return
        dev = rows[0].device
        while len(self._inflight) >= self.RING:  # all slots in flight: wait for the oldest (rare)
            self._consume(wait=True)
        if self._host is None:
            self._host = torch.zeros(self.RING, dtype=torch.int32, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(self.RING)]
        slot = self._next
        self._next = (slot + 1) % self.RING
        flag = torch.cat(rows).amax().to(torch.int32).reshape(1)
        self._host[slot : slot + 1].copy_(flag, non_blocking=True)
        self._events[slot].record(torch.cuda.current_stream(dev))
        with self._lock:
            self._inflight.append((pending, slot))

    def _consume(self, *, wait: bool) -> bool:
        """Check the oldest flag in flight if it has landed (or wait for it); False: nothing to do now."""
        with self._lock:
            if not self._inflight:
                return False
            statuses, slot = self._inflight[0]
            event = self._events[slot]
            if not wait and not event.query():
                return False
            self._inflight.popleft()
        if wait:
            event.synchronize()
        if int(self._host[slot]) != 0:
            for s in statuses:
                s.check()  # the error path: find and name the failed row (syncs)
        return True

    def poll(self, *, wait: bool = False) -> None:
        """Raise the named ValueError if a finished forward's flag says a row failed.

        wait=False: only look at flags whose events have completed (no host sync);
        wait=True: wait for every flag in flight (syncs).
        """
        if _capturing():
            return
        while self._consume(wait=wait):
            pass

    def check(self, *, wait: bool = True) -> None:
        """Check everything routed so far: the pending statuses and the one in flight."""
        with self._lock:
            pending, self._pending = self._pending, []
        self.poll(wait=wait)
        for s in pending:
            s.check()
