"""Memory and decode-time predictions from stored byte counts, before anything is loaded.

Legend: L MoE layers, E routed experts per layer, K picks per token, B bytes of one
routed expert as stored (weights, block scales and biases), S expert slots on the GPU.

    model = model_bytes(checkpoint_info(path))            # or ModelBytes(...) for a benchmark's shapes
    mem   = predict_memory(model, gpu_budget_bytes=60 << 30)
    floor = decode_floor(model, DEVICES["h100"], resident_fraction=mem.resident_fraction)

`moeflow info PATH --gpu-budget 60GiB --device h100 [--json]` prints both. Everything here is
arithmetic on byte counts: no torch, no file access (moeflow.inspect reads the headers).

Memory at a budget: the non-expert weights and the reserve (KV cache, activations, kernel
workspace: a stated allowance, not a measurement) stay on the GPU; the routed experts fill
whole-expert slots with what is left (all of them when they fit), the rest live in pinned host
memory (moeflow.offload). A budget that cannot hold K experts beside the rest is refused: one
token's layer step pins K experts together.

Decode floor per token at batch 1: every byte a step reads, once, at the device's HBM bandwidth,
plus the PCIe copies of the expected misses. Bytes read per step = the non-expert weights a step
reads (all of them but the input embedding table, of which a step reads one row, unless the
output head is that same table) + K routed experts per MoE layer (shared experts are non-expert
weights), all as stored. KV-cache reads are left out (batch 1, a short context). Misses assume
uniform, independent routing over a cache holding a fixed share f of the experts (LRU at steady
state), so a pick hits with probability f and a token misses (1 - f) * L * K experts; a synchronous
offload step copies its misses before its layer reads them, so the two terms add.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 1 << 30

# What the floor divides by. HBM: the read roof benchmarks/common.hbm_read_roof_bytes_per_s
# measured (benchmarks/RESULTS.md: H100 3.136-3.177 TB/s, H200 4.224-4.248 TB/s); A100: datasheet.
# PCIe: pinned host->device copies measured on the H200 host (55.0 GB/s, RESULTS.md Offload; the
# H100 host has the same PCIe Gen5 x16 link); A100: PCIe Gen4 x16, half that (assumed).


@dataclass(frozen=True, kw_only=True)
class DeviceBandwidth:
    """A GPU's memory facts for the predictions: name, HBM read and pinned H2D bytes/s, memory bytes."""

    name: str
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float
    memory_bytes: int
    source: str


DEVICES: dict[str, DeviceBandwidth] = {
    "h100": DeviceBandwidth(name="NVIDIA H100 80GB HBM3", hbm_bytes_per_s=3.14e12, pcie_bytes_per_s=55e9,
                            memory_bytes=80 * 10**9, source="HBM read measured (bench roofs); PCIe as the H200 host's"),
    "h200": DeviceBandwidth(name="NVIDIA H200", hbm_bytes_per_s=4.23e12, pcie_bytes_per_s=55e9,
                            memory_bytes=141 * 10**9, source="HBM read and pinned H2D measured (bench roofs)"),
    "a100": DeviceBandwidth(name="NVIDIA A100-SXM4-80GB", hbm_bytes_per_s=2.039e12, pcie_bytes_per_s=27.5e9,
                            memory_bytes=80 * 10**9, source="HBM datasheet; PCIe Gen4 assumed half of Gen5's 55 GB/s"),
}

# The stated KV-cache / activation / workspace allowance when none is given.
DEFAULT_RESERVE_BYTES = 4 * GiB


def device_bandwidth(name: str) -> DeviceBandwidth:
    """The DeviceBandwidth of a named device (h100, h200, a100); ValueError naming the choices."""
    key = name.lower() if isinstance(name, str) else name
    if key not in DEVICES:
        raise ValueError(f"device={name!r}: expected one of {sorted(DEVICES)}")
    return DEVICES[key]


def _nonneg_int(name: str, v: object, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{name}={v!r}: expected an int >= {minimum}")
    return v


@dataclass(frozen=True, kw_only=True)
class ModelBytes:
    """A model's stored byte counts (the checkpoint's tensors as stored, or a benchmark's shapes).

    expert_bytes:      B, one routed expert (weights + scales + biases).
    num_experts:       routed experts over all MoE layers (the most a shared slot cache holds).
    routed_bytes:      all routed experts' bytes (num_experts * B for uniform layers).
    moe_layers:        L.
    top_k:             K.
    non_expert_bytes:  every other stored tensor (attention, embeddings, norms, routers, shared experts).
    decode_non_expert_bytes: the part of them one decode step reads (see the module doc).
    """

    expert_bytes: int
    num_experts: int
    routed_bytes: int
    moe_layers: int
    top_k: int
    non_expert_bytes: int
    decode_non_expert_bytes: int

    def __post_init__(self) -> None:
        _nonneg_int("ModelBytes.expert_bytes", self.expert_bytes, 1)
        _nonneg_int("ModelBytes.num_experts", self.num_experts, 1)
        _nonneg_int("ModelBytes.routed_bytes", self.routed_bytes)
        _nonneg_int("ModelBytes.moe_layers", self.moe_layers, 1)
        _nonneg_int("ModelBytes.top_k", self.top_k, 1)
        _nonneg_int("ModelBytes.non_expert_bytes", self.non_expert_bytes)
        _nonneg_int("ModelBytes.decode_non_expert_bytes", self.decode_non_expert_bytes)
        if self.decode_non_expert_bytes > self.non_expert_bytes:
            raise ValueError(f"ModelBytes.decode_non_expert_bytes={self.decode_non_expert_bytes}: exceeds "
                             f"non_expert_bytes={self.non_expert_bytes}")

    @property
    def step_bytes(self) -> int:
        """Bytes one decode step reads at batch 1: non-expert (decode part) + L * K experts."""
        return self.decode_non_expert_bytes + self.moe_layers * self.top_k * self.expert_bytes


@dataclass(frozen=True, kw_only=True)
class MemoryPrediction:
    """GPU and host bytes at a budget (see the module doc). fraction: S / all routed experts."""

    gpu_budget_bytes: int
    reserve_bytes: int
    non_expert_bytes: int
    slots: int
    resident_expert_bytes: int
    offloaded_expert_bytes: int
    gpu_bytes: int
    resident_fraction: float
    offloaded: bool

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class DecodeFloor:
    """The decode floor per token at batch 1 (see the module doc); times in seconds."""

    device: str
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float
    step_bytes: int
    resident_fraction: float
    expected_misses: float
    miss_bytes: float
    hbm_s: float
    pcie_s: float
    floor_s: float
    tokens_per_s: float
    assumption: str = "hit rate = resident fraction (uniform independent routing); HBM and PCIe terms add"

    def as_dict(self) -> dict:
        return asdict(self)


def predict_memory(model: ModelBytes, *, gpu_budget_bytes: int,
                   reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> MemoryPrediction:
    """GPU bytes resident vs host bytes offloaded when the model gets `gpu_budget_bytes` of the GPU.

    ValueError naming gpu_budget_bytes when the budget cannot hold the non-expert weights, the
    reserve and K experts (one token's layer step), with the least budget that does.
    """
    _nonneg_int("gpu_budget_bytes", gpu_budget_bytes, 1)
    _nonneg_int("reserve_bytes", reserve_bytes)
    fixed = model.non_expert_bytes + reserve_bytes
    if fixed + model.routed_bytes <= gpu_budget_bytes:
        slots, resident = model.num_experts, model.routed_bytes
    else:
        slots = max(0, (gpu_budget_bytes - fixed) // model.expert_bytes)
        if slots < model.top_k:
            need = fixed + model.top_k * model.expert_bytes
            raise ValueError(f"gpu_budget_bytes={gpu_budget_bytes}: below the {need} bytes ({need / GiB:.2f} GiB) "
                             f"that the non-expert weights ({model.non_expert_bytes}), the reserve ({reserve_bytes}) "
                             f"and K={model.top_k} experts of {model.expert_bytes} bytes need")
        slots = min(slots, model.num_experts)
        resident = slots * model.expert_bytes
    return MemoryPrediction(gpu_budget_bytes=gpu_budget_bytes, reserve_bytes=reserve_bytes,
                            non_expert_bytes=model.non_expert_bytes, slots=slots, resident_expert_bytes=resident,
                            offloaded_expert_bytes=model.routed_bytes - resident,
                            gpu_bytes=model.non_expert_bytes + resident + reserve_bytes,
                            resident_fraction=slots / model.num_experts, offloaded=slots < model.num_experts)


def decode_floor(model: ModelBytes, device: DeviceBandwidth, *, resident_fraction: float = 1.0,
                 hit_rate: float | None = None) -> DecodeFloor:
    """The time per token at batch 1 below which decode cannot go (module doc).

    resident_fraction: f in [0, 1], the share of the routed experts on the GPU; the expected hit
    rate is f unless `hit_rate` (in [0, 1], e.g. one a benchmark measured) is given.
    """
    f = resident_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        raise ValueError(f"resident_fraction={f!r}: expected a float in [0, 1]")
    h = f if hit_rate is None else hit_rate
    if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h <= 1.0:
        raise ValueError(f"hit_rate={h!r}: expected None or a float in [0, 1]")
    if f == 1.0:
        h = 1.0  # every expert resident: nothing to miss
    misses = (1.0 - h) * model.moe_layers * model.top_k
    miss_bytes = misses * model.expert_bytes
    hbm_s = model.step_bytes / device.hbm_bytes_per_s
    pcie_s = miss_bytes / device.pcie_bytes_per_s
    floor = hbm_s + pcie_s
    return DecodeFloor(device=device.name, hbm_bytes_per_s=device.hbm_bytes_per_s,
                       pcie_bytes_per_s=device.pcie_bytes_per_s, step_bytes=model.step_bytes,
                       resident_fraction=float(f), expected_misses=misses, miss_bytes=miss_bytes, hbm_s=hbm_s,
                       pcie_s=pcie_s, floor_s=floor, tokens_per_s=1.0 / floor,
                       **({} if hit_rate is None else {"assumption": f"hit rate {h:g} (given); HBM and PCIe terms add"}))


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str, *, name: str = "size") -> int:
    """Bytes of a size like '60GiB', '80GB', '1.5 TiB' or '64424509440'; ValueError naming `name` otherwise."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}={text!r}: expected a size like 60GiB, 80GB or a byte count "
                         f"(units: {', '.join(u for u in _UNITS if u)})")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{name}={text!r}: expected a positive size")
    return n
