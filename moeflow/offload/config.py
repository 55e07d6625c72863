"""OffloadConfig: how many GPU expert slots, which eviction policy, how wide a prefetch.

Legend: S slots (whole experts the device cache holds), L MoE layers, E routed
experts per layer, K picks per token, W prediction width.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .gate import PREFETCH_RULES
from .policy import POLICIES, PREDICTIVE_POLICIES  # the registry lives with the policies

STORES: tuple[str, ...] = ("auto", "pinned", "mmap", "model")
# Where a missed expert runs (moeflow.offload.cpu_experts): copied into a slot ("off"), the
# cost model's choice per step ("auto"), or on the CPU from host memory ("always").
CPU_EXPERTS: tuple[str, ...] = ("off", "auto", "always")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_device(device: str) -> None:
    """ValueError naming OffloadConfig.device when it does not parse or names a CUDA device this machine lacks."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"OffloadConfig.device={device!r}: not a torch device ({exc}); expected 'cuda', "
                         f"'cuda:N' or 'cpu'") from exc
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"OffloadConfig.device={device!r}: CUDA is not available on this machine; "
                         f"expected device='cpu' or None (cuda when available, else cpu)")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"OffloadConfig.device={device!r}: this machine has {count} CUDA device(s), "
                         f"expected an index in [0, {count})")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Expert offloading for `patch_model(model, offload=...)` / `attach_offload(layers, config)`.

    gpu_slots:      S, whole experts the device cache holds (shared by all layers). Must be
                    >= K of every layer (one step's experts are pinned together) and >= 1.
    policy:         eviction policy: "lru" (strict least recently used), "random_oldest"
                    (uniform among the oldest `oldest_fraction` of the slots, seeded: strict
                    LRU thrashes on a working set slightly larger than the cache), or
                    "predictive" (random_oldest that never evicts an expert the next-layer
                    predictor wants while another candidate exists), or "adaptive" (hit density:
                    evicts the key with the fewest expected hits per slot-step, from online reuse
                    hazards and the next-layer predictor's per-rank precision, duelled against a
                    shadow LRU so it follows whichever missed less recently; prefetch only at a
                    rank precision >= 0.95; moeflow.offload.policy).
    prefetch_width: W experts per token predicted for the next layer and copied ahead on a
                    side stream (0: no prefetch copies). May exceed K. Off by default: on the
                    measured decode rows plain LRU without prefetch is the fastest (README,
                    "Offloading experts"; benchmarks/RESULTS.md, Offload).
    prefetch_rule:  which predicted missing experts are copied: "cost" (one only when its
                    expected saving pays its bytes: measured precision of the prediction's layer
                    and rank > the exposed share of its copy + the measured chance that its victim
                    is needed again; moeflow.offload.gate), "always" (every one, up to W a token).
    prefetch_overlap: the "cost" rule's expert copies per layer step that the host link completes
                    behind compute (pinned H2D bandwidth x resident time per layer step / expert
                    bytes; `python benchmarks/bench_offload.py` prints it). 0: every copy is exposed
                    and no guess pays its bytes, so the rule copies none.
    predict_width:  experts per token the "predictive" policy protects when prefetch is off
                    (None: prefetch_width if > 0, else the next layer's K).
    device:         device of the slot cache ("cuda", "cuda:1", "cpu"; None: cuda when
                    available, else cpu). CPU runs the same logic with host->host copies.
                    A CUDA device is checked here, at construction, so a machine without
                    CUDA (or without that device index) refuses before any model is touched.
    store:          where the experts live on the host: "pinned" (a copy in page-locked
                    memory when CUDA is available, plain memory otherwise), "mmap" (memory-
                    mapped safetensors, read lazily; needs `checkpoint`), "model" (the
                    model's own tensors, no copy), "auto" (pinned when the copy fits in
                    available host memory with a margin, else mmap when `checkpoint` is set,
                    else model).
    checkpoint:     a safetensors file or checkpoint directory, for store "mmap"/"auto": a str
                    or any os.PathLike (pathlib.Path); stored as the str os.fspath gives.
    oldest_fraction: share of the slots "random_oldest"/"predictive" draw victims from (~6%).
    seed:           seed of the eviction RNG (runs are reproducible).
    measure_wait:   time the compute stream's waits on copies with CUDA events (read back
                    without host syncs, by event queries); off: wait time reads 0.
    cpu_experts:    an expert not resident in the cache: "off" copies it into a slot (the
                    resident model's bits); "auto" computes its rows on the CPU from host
                    memory when the cost model says that beats the copy (measured CPU GEMV
                    and host->device bandwidths, the cache's recent reuse:
                    moeflow.offload.cpu_experts); "always" runs every miss on the CPU (tests,
                    llama.cpp --n-cpu-moe-like runs). Unquantized experts only. Numerical
                    contract: docs/offload.md, "CPU execution of missed experts".
    sync_free:      decode with no host sync per layer step, capturable in a CUDA graph
                    (moeflow.offload.syncfree): a device table maps (layer, expert) -> slot. With
                    policy "lru" a kernel admits the step's missing experts on the device (least
                    recently used slots) and copies them from pinned host memory straight into
                    their slots (needs gpu_slots >= min(E, sync_free_tokens * K)); with
                    "random_oldest" it copies them into staging slots and the cache refills a
                    step later from ids read back without waiting (event queries), which moves
                    each miss twice. Bit-identical to the resident model. A step of more than
                    `sync_free_tokens` tokens (a prefill) runs the synchronous path. Needs store "pinned"/"auto" (a packed pinned copy), Triton
                    on a CUDA cache (the CPU runs a torch version of the same step), policy
                    "lru" or "random_oldest", prefetch_width=0, cpu_experts="off", no zero experts
                    and no expert parallelism; anything else is refused with a ValueError.
                    Between CUDA-graph replays call `runtime.refill()` (eager steps call it).
    sync_free_tokens: tokens per layer step the sync-free path serves (decode batch size);
                    the device pool holds gpu_slots + min(E, sync_free_tokens * K) experts
                    (the staging slots: one step's misses always fit).
    """

    gpu_slots: int
    policy: str = "lru"
    prefetch_width: int = 0
    prefetch_rule: str = "cost"
    prefetch_overlap: float = 0.0
    predict_width: int | None = None
    device: str | None = None
    store: str = "auto"
    checkpoint: str | os.PathLike | None = None
    oldest_fraction: float = 0.0625
    seed: int = 0
    measure_wait: bool = True
    cpu_experts: str = "off"
    sync_free: bool = False
    sync_free_tokens: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.gpu_slots) or self.gpu_slots < 1:
            raise ValueError(f"OffloadConfig.gpu_slots={self.gpu_slots!r}: expected an int >= 1 (whole experts)")
        if self.policy not in POLICIES:
            raise ValueError(f"OffloadConfig.policy={self.policy!r}: expected one of {POLICIES}")
        if not _is_int(self.prefetch_width) or self.prefetch_width < 0:
            raise ValueError(
                f"OffloadConfig.prefetch_width={self.prefetch_width!r}: expected an int >= 0 (0 turns prefetch off)"
            )
        if not isinstance(self.prefetch_rule, str) or self.prefetch_rule not in PREFETCH_RULES:
            raise ValueError(f"OffloadConfig.prefetch_rule={self.prefetch_rule!r}: expected one of {PREFETCH_RULES}")
        o = self.prefetch_overlap
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0.0 <= o < float("inf"):
            raise ValueError(f"OffloadConfig.prefetch_overlap={o!r}: expected a finite float >= 0 "
                             f"(expert copies per layer step hidden behind compute)")
        if self.predict_width is not None and (not _is_int(self.predict_width) or self.predict_width < 1):
            raise ValueError(f"OffloadConfig.predict_width={self.predict_width!r}: expected None or an int >= 1")
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"OffloadConfig.device={self.device!r}: expected a str like 'cuda' or 'cpu', or None")
        if self.device is not None:
            _check_device(self.device)
        if self.store not in STORES:
            raise ValueError(f"OffloadConfig.store={self.store!r}: expected one of {STORES}")
        if self.store == "mmap" and self.checkpoint is None:
            raise ValueError("OffloadConfig.checkpoint=None: store='mmap' needs a safetensors file or directory")
        if self.checkpoint is not None:
            if not isinstance(self.checkpoint, (str, os.PathLike)):
                raise TypeError(
                    f"OffloadConfig.checkpoint={self.checkpoint!r}: expected a path (str or os.PathLike) or None")
            path = os.fspath(self.checkpoint)
            if not isinstance(path, str):  # a bytes path: the stores and the index read str paths
                raise TypeError(f"OffloadConfig.checkpoint={self.checkpoint!r}: expected a str path, got bytes")
            # One type downstream (store.py, attach.py read it): always the str.
            object.__setattr__(self, "checkpoint", path)
        f = self.oldest_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(f"OffloadConfig.oldest_fraction={f!r}: expected a float in (0, 1]")
        if not _is_int(self.seed):
            raise ValueError(f"OffloadConfig.seed={self.seed!r}: expected an int")
        if not isinstance(self.measure_wait, bool):
            raise TypeError(f"OffloadConfig.measure_wait={self.measure_wait!r}: expected a bool")
        if not isinstance(self.cpu_experts, str) or self.cpu_experts not in CPU_EXPERTS:
            raise ValueError(f"OffloadConfig.cpu_experts={self.cpu_experts!r}: expected one of {CPU_EXPERTS}")
        self._check_sync_free()

    def _check_sync_free(self) -> None:
        """The combinations the sync-free path does not serve are refused here, naming the field."""
        if not isinstance(self.sync_free, bool):
            raise TypeError(f"OffloadConfig.sync_free={self.sync_free!r}: expected a bool")
        if not _is_int(self.sync_free_tokens) or self.sync_free_tokens < 1:
            raise ValueError(f"OffloadConfig.sync_free_tokens={self.sync_free_tokens!r}: expected an int >= 1")
        if not self.sync_free:
            return
        if self.prefetch_width:
            # a lagged prediction would copy guesses for a token already gone: bytes for nothing
            raise ValueError(f"OffloadConfig.prefetch_width={self.prefetch_width}: sync_free=True serves no "
                             f"prefetch; expected prefetch_width=0")
        if self.policy in PREDICTIVE_POLICIES:
            raise ValueError(f"OffloadConfig.policy={self.policy!r}: sync_free=True runs no next-layer predictor "
                             f"(its keys would need a read-back); expected 'lru' or 'random_oldest'")
        if self.cpu_experts != "off":
            raise ValueError(f"OffloadConfig.cpu_experts={self.cpu_experts!r}: sync_free=True copies every miss "
                             f"on the device; expected cpu_experts='off'")
        if self.store not in ("auto", "pinned"):
            raise ValueError(f"OffloadConfig.store={self.store!r}: sync_free=True reads experts from one packed "
                             f"pinned host buffer per layer; expected store='pinned' or 'auto'")

    def check_layers(self, top_ks: list[int], num_experts: list[int]) -> None:
        """ValueError when the slots cannot hold one step of the widest layer.

        One layer's step pins its distinct experts together: up to min(T*K, E) of
        them. At decode (T = 1) that is K, so S >= K is the hard floor; a prefill
        of many tokens that touches more distinct experts than S is run in chunks
        by the offload wrapper.
        """
        if not top_ks:
            raise ValueError("layers: empty, expected at least one MoE layer to offload")
        k_max = max(top_ks)
        if self.gpu_slots < k_max:
            raise ValueError(
                f"OffloadConfig.gpu_slots={self.gpu_slots}: fewer slots than the K={k_max} experts one "
                f"token uses in one layer; expected gpu_slots >= {k_max}"
            )
        e_min = min(num_experts)
        if self.prefetch_width > e_min:
            raise ValueError(
                f"OffloadConfig.prefetch_width={self.prefetch_width}: exceeds the E={e_min} experts of a layer"
            )
        if self.predict_width is not None and self.predict_width > e_min:
            raise ValueError(
                f"OffloadConfig.predict_width={self.predict_width}: exceeds the E={e_min} experts of a layer"
            )

    def resolved_device(self) -> str:
        """The cache device: `device`, or cuda when available, else cpu."""
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def prediction_width(self, top_k: int) -> int:
        """Experts per token the predictor ranks for the next layer (0: no prediction needed)."""
        if self.prefetch_width > 0:
            return self.prefetch_width
        if self.policy in PREDICTIVE_POLICIES:
            return self.predict_width if self.predict_width is not None else top_k
        return 0
