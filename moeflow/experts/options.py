"""What a caller may choose about the fused expert kernels: one frozen object, passed in.

Everything else about which kernel runs is the kernel plan's (`moeflow.experts.plan`): the
registry of variants, each variant's `supports`, and the thresholds a measurement chose, which
live in the tuning data (`moeflow.tuning`, written by benchmarks/tune_experts.py). Nothing here
is read from the environment or from a module global.

    KernelOptions()                          the defaults: every fast path the device has
    KernelOptions(tma=False)                 pointer kernels only (no TMA descriptors)
    KernelOptions(pdl=False)                 plain stream order between the pipeline's launches
    KernelOptions(fast_launch=False)         every launch through Triton's JIT binder
    KernelOptions(pin={"gate_up": "tma"})    this variant for that stage (benchmarks' A/B); a
                                             pinned variant that does not support the step is
                                             an error naming its reason, never a quiet fallback
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# The stages of one expert step that have more than one variant (moeflow.experts.plan.VARIANTS).
PIN_STAGES = ("gate_up", "down")


@dataclass(frozen=True, kw_only=True)
class KernelOptions:
    """Caller's choices for the Triton expert impls (`TritonExperts`, `TritonQuantExperts`).

    tma:         TMA descriptors for the tiles of the aligned GEMMs. None (default): on devices of
                 compute capability >= 9 (Hopper); True: wherever the layout allows (the Triton
                 interpreter runs them too); False: never.
    pdl:         programmatic dependent launch between the step's kernels (moeflow.kernels.pdl).
                 None (default): on sm_90 or newer; False: plain stream order. True means None (a
                 device without PDL cannot take it).
    fast_launch: launch compiled kernels without Triton's per-call binder (moeflow.kernels.launch).
    pin:         {stage: variant name} forcing a variant for "gate_up" or "down" (names in
                 `moeflow.experts.plan.VARIANTS`). Stored as a sorted tuple of pairs (hashable).
    """

    tma: bool | None = None
    pdl: bool | None = None
    fast_launch: bool = True
    pin: Mapping[str, str] | tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("tma", "pdl"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"KernelOptions.{name}={v!r}: expected None, True or False")
        if not isinstance(self.fast_launch, bool):
            raise TypeError(f"KernelOptions.fast_launch={self.fast_launch!r}: expected True or False")
        pin = self.pin
        items = pin.items() if isinstance(pin, Mapping) else pin
        try:
            pairs = tuple(sorted((str(k), v) for k, v in items))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"KernelOptions.pin={pin!r}: expected a mapping of stage -> variant name") from exc
        for stage, variant in pairs:
            if stage not in PIN_STAGES:
                raise ValueError(f"KernelOptions.pin: stage {stage!r}, expected one of {PIN_STAGES}")
            if not isinstance(variant, str) or not variant:
                raise TypeError(f"KernelOptions.pin[{stage!r}]={variant!r}: expected a variant name")
        object.__setattr__(self, "pin", pairs)

    def pinned(self, stage: str) -> str | None:
        """The variant pinned for `stage`, or None."""
        return dict(self.pin).get(stage)


DEFAULT_OPTIONS = KernelOptions()
