"""DeviceFacts of a torch.device: what the kernel plan needs to know about where a step runs.

Cached per CUDA index (device properties are host calls: not on every layer step).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .._triton import interpreted, triton_available
from .plan import DeviceFacts


@lru_cache(maxsize=16)
def _cuda_facts(index: int, interp: bool) -> DeviceFacts:
    props = torch.cuda.get_device_properties(index)
    major = torch.cuda.get_device_capability(index)[0]
    return DeviceFacts(type="cuda", name=props.name, capability=major, sm_count=props.multi_processor_count,
                       interpreted=interp, gluon=major >= 9 and not interp and _gluon_hopper())


@lru_cache(maxsize=1)
def _gluon_hopper() -> bool:
    """This Triton ships Gluon's Hopper warp specialisation (the fp8 Gluon gate_up needs it)."""
    if not triton_available():
        return False
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


def device_facts(device: torch.device) -> DeviceFacts:
    """DeviceFacts of `device` (CUDA: name, capability, SM count; CPU: the Triton interpreter's)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_facts(index, interpreted())
    return DeviceFacts(type=device.type, name="cpu", interpreted=interpreted())
