"""Expert offloading: host store, device slot cache, eviction policies, next-layer prefetch, traces.

    from moeflow.offload import OffloadConfig, attach_offload
    runtime = attach_offload(moe_layers, OffloadConfig(gpu_slots=16))   # plain LRU, no prefetch: the fastest measured
    ...
    print(runtime.stats().snapshot())

Modules: config (OffloadConfig), store (ExpertStore), slots (SlotTable, CacheStats: the
bookkeeping), cache (ExpertCache: the device slots), policy (LRU, RandomOldest, Predictive,
Belady), prefetch (Prefetcher), gate (PrefetchGate: which guesses pay their copy), attach
(attach_offload, OffloadRuntime, OffloadedExperts: the offload expert source), trace (record /
replay / stats; the `moeflow trace` command is moeflow.trace_command).
Names are imported lazily so `import moeflow.offload` stays light.
"""

from __future__ import annotations

from moeflow._lazy import lazy_exports

_EXPORTS = {
    "OffloadConfig": "moeflow.offload.config",
    "ExpertStore": "moeflow.offload.store",
    "ExpertMismatchError": "moeflow.offload.store",
    "ExpertCache": "moeflow.offload.cache",
    "SlotTable": "moeflow.offload.slots",
    "CacheStats": "moeflow.offload.slots",
    "Prefetcher": "moeflow.offload.prefetch",
    "PrefetchGate": "moeflow.offload.gate",
    "attach_offload": "moeflow.offload.attach",
    "OffloadRuntime": "moeflow.offload.attach",
    "OffloadedExperts": "moeflow.offload.attach",
    "OffloadedExpertsError": "moeflow.offload.attach",
    "Trace": "moeflow.offload.trace",
    "record_trace": "moeflow.offload.trace",
    "replay": "moeflow.offload.trace",
    "trace_stats": "moeflow.offload.trace",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("moeflow.offload", globals(), _EXPORTS)
