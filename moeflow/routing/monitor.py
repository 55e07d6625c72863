"""RoutingMonitor: the GPU routing status of a whole model, checked without a host sync per layer.

Legend: L MoE layers, T tokens of a forward.

On CUDA the selection kernels report NaN logits and bad hash ids through a per-row device
status (`moeflow.routing.gpu.RoutingStatus`) instead of a host read. A standalone MoELayer
checks it after each eager step (one sync per layer: `check_routing="eager"`). A patched
model does better (`check_routing="deferred"`): each layer hands its status to the model's
monitor, and

    end_forward()   after the model's forward: ONE small device op (concatenate the L
                    status vectors, max) and a non-blocking copy of that flag into pinned
                    host memory, with an event. No host sync.
    poll()          before the next forward (or from `check()`): when the event has
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

import threading

import torch

__all__ = ["RoutingMonitor"]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class RoutingMonitor:
    """Collects the device routing statuses of one model's layers (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list = []  # statuses of the forward in progress
        self._inflight: tuple[list, torch.Tensor, torch.cuda.Event] | None = None  # (statuses, host flag, event)
        # One pinned flag and one event, allocated at the first forward (cudaHostAlloc is slow):
        # a flag is only reused after poll() has consumed the previous one.
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

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
        """Enqueue the forward's one error flag (device op + non-blocking copy + event); no sync."""
        if _capturing():
            return
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        self.poll()  # a previous flag still in flight is checked first (free when it has landed)
        rows = [s.status_T.reshape(-1) for s in pending if s.status_T.numel()]
        if not rows:
            return
        dev = rows[0].device
        if self._inflight is not None:  # the previous flag has not landed: wait for it (rare)
            self.poll(wait=True)
        if self._host is None:
            self._host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._event = torch.cuda.Event()
        flag = torch.cat(rows).amax().to(torch.int32).reshape(1)
        self._host.copy_(flag, non_blocking=True)
        self._event.record(torch.cuda.current_stream(dev))
        with self._lock:
            self._inflight = (pending, self._host, self._event)

    def poll(self, *, wait: bool = False) -> None:
        """Raise the named ValueError if a finished forward's flag says a row failed.

        wait=False: only look at a flag whose event has completed (no host sync);
        wait=True: wait for it (one sync).
        """
        if _capturing():
            return
        with self._lock:
            inflight = self._inflight
            if inflight is None:
                return
            statuses, host, event = inflight
            if not wait and not event.query():
                return
            self._inflight = None
        if wait:
            event.synchronize()
        if int(host[0]) != 0:
            for s in statuses:
                s.check()  # the error path: find and name the failed row (syncs)

    def check(self, *, wait: bool = True) -> None:
        """Check everything routed so far: the pending statuses and the one in flight."""
        with self._lock:
            pending, self._pending = self._pending, []
        self.poll(wait=wait)
        for s in pending:
            s.check()
