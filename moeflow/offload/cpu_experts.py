"""CPU execution of missed experts: run an expert that is not in the slot cache on the host.

Legend: H hidden, I intermediate per expert, N (token, pick) rows of one layer step,
R rows that run on the CPU, n_e rows of expert e in the step, S slots.

What llama.cpp's `--n-cpu-moe` and KTransformers do for small GPUs: an expert that is not
resident is computed where its weights already are (host memory) instead of being copied
over PCIe. Only its rows cross the bus (R x H each way, vs the expert's whole weights).

The cost model (`OffloadConfig(cpu_experts="auto")`, pure function `cpu_wins`), per missed
expert e of a step:

    t_cpu(e)  = n_e * expert_bytes / B_cpu      each row a GEMV streaming the expert's weights
                                                from host memory (conservative for n_e > 1)
    t_copy(e) = expert_bytes / B_pcie           the host->device copy of the whole expert
    r         = expected later hits of an expert copied now (before its eviction)

    copying serves this use and r later ones for one t_copy; running it on the CPU costs
    t_cpu now and leaves the r later uses facing the same miss, so over those 1 + r uses:

        CPU  iff  (1 + r) * t_cpu(e) < t_copy(e)   <=>   B_cpu > (1 + r) * n_e * B_pcie

    (expert_bytes cancels). r is the cache's recent hits per copy (`ReuseEstimate`: an
    exponential moving average of hits and of loads = demand misses + prefetches, over about
    8 tokens of layer steps). In steady state every copied expert is hit hits/loads times on
    average before it is evicted, so this is the mean reuse of a copy. When no copy happened
    for a while the loads average decays and r grows, so copies (and fresh statistics)
    resume: the estimate corrects itself. While the cache still has a free slot the runtime
    copies (a copy into a free slot evicts nothing: that is the cache warming up).
    B_cpu and B_pcie are measured once, at the first "auto" step (`measure_bandwidths`), or
    set with `OffloadRuntime.set_bandwidths`. Not modelled: the rows' own transfers (R x H
    each way) and GPU compute of a copied expert (both small next to an expert's weights).

Numerical contract (details in docs/offload.md, "CPU execution of missed experts"):
    - cpu_experts="off": the offload path is unchanged, bit-identical to the resident model.
    - cache on the CPU (device="cpu"): the CPU rows run with the step's own experts impl
      ("reference", or "grouped" and its path) on the store's host tensors, one call per
      expert on that expert's rows in their order; outputs equal the resident model's bit
      for bit (tests: every family, reference and grouped).
    - cache on CUDA: the CPU rows run with "reference" (F.linear on the host tensors in the
      weights' dtype) while the GPU runs its impl: the two differ in accumulation order, so
      outputs agree with the resident model within the stated tolerance, not bit for bit:
      bf16: max|d| <= 2e-2 * max|y| and rel-L2 <= 1e-2 on a layer's output y (relative to the
      output's scale: an element that cancels to near zero keeps its terms' rounding error);
      f32: atol = rtol = 1e-5.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ..config import ExpertWeights, MoEConfig
from .config import CPU_EXPERTS

__all__ = ["CPU_EXPERTS", "CpuExpertStats", "ReuseEstimate", "cpu_wins", "choose_cpu_experts",
           "host_expert_weights", "measure_bandwidths"]

def cpu_wins(rows: int, *, cpu_Bps: float, pcie_Bps: float, reuse: float) -> bool:
    """Whether a missed expert with `rows` rows this step is cheaper on the CPU than copied.

    Args:
        rows: n_e >= 1, rows of the expert in this step.
        cpu_Bps: B_cpu, bytes/s the host's GEMV reads one expert's weights at (one row).
        pcie_Bps: B_pcie, host->device copy bytes/s.
        reuse: r >= 0, expected later hits of the expert if copied now.
    Returns:
        (1 + r) * rows * expert_bytes / B_cpu < expert_bytes / B_pcie.
    """
    if rows <= 0:
        return False
    return cpu_Bps > (1.0 + max(0.0, reuse)) * rows * pcie_Bps


def choose_cpu_experts(missing_rows: dict[int, int], *, cpu_Bps: float, pcie_Bps: float, reuse: float
                       ) -> set[int]:
    """The experts of `missing_rows` (expert -> rows this step) that `cpu_wins` sends to the CPU."""
    return {e for e, n in missing_rows.items() if cpu_wins(n, cpu_Bps=cpu_Bps, pcie_Bps=pcie_Bps, reuse=reuse)}


@dataclass
class ReuseEstimate:
    """r = hits per load of the cache lately (exponential moving averages; see module doc).

    alpha: weight of the newest layer step (the runtime uses 1 / (8 L): about 8 tokens).
    """

    alpha: float
    hits: float = 0.0
    loads: float = 0.0

    def update(self, hits: int, loads: int) -> None:
        a = self.alpha
        self.hits = (1.0 - a) * self.hits + a * hits
        self.loads = (1.0 - a) * self.loads + a * loads

    @property
    def reuse(self) -> float:
        """Expected later hits of an expert copied now (0 before any statistics; inf after hits without loads)."""
        if self.loads <= 0.0:
            return math.inf if self.hits > 0.0 else 0.0
        return self.hits / self.loads


@dataclass
class CpuExpertStats:
    """The runtime's per-step choices (mutable; `snapshot()` gives a dict). They add up, after
    `OffloadRuntime.reset_stats()` and without `cache.warm`:

        cache hits + cache misses + cpu_experts == demand_keys
        bytes_not_copied == cpu_experts * expert_bytes

    demand_keys:      distinct (layer, expert) keys the layer steps used.
    cpu_experts:      of them, run on the CPU from host memory (never copied, not in the cache).
    cpu_rows:         rows those experts computed on the CPU.
    cpu_steps:        layer steps that ran at least one expert on the CPU.
    bytes_not_copied: host->device bytes the CPU experts saved.
    cpu_s:            host seconds spent computing CPU experts (perf_counter; no device sync).
    """

    demand_keys: int = 0
    cpu_experts: int = 0
    cpu_rows: int = 0
    cpu_steps: int = 0
    bytes_not_copied: int = 0
    cpu_s: float = 0.0

    def snapshot(self) -> dict:
        d = asdict(self)
        d["cpu_share"] = self.cpu_experts / self.demand_keys if self.demand_keys else 0.0
        return d


def host_expert_weights(store, layer: int, expert: int) -> ExpertWeights:
    """One expert's host tensors as a 1-expert ExpertWeights (gate_up [1, 2I, H] / [1, H, 2I], ...).

    From the store's copy recipe (`ExpertStore.pieces`): a whole-tensor piece is used as a
    view (no copy: pinned / model stores); pieces that fill row ranges (a checkpoint's w1 / w3
    halves) are assembled into a new host tensor (a host copy, no device traffic).
    """
    parts: dict[str, list] = {}
    for name, rows, src in store.pieces(layer, expert):
        parts.setdefault(name, []).append((rows, src))
    tensors: dict[str, torch.Tensor] = {}
    for name, items in parts.items():
        dtype = store.dtypes.get(name, store.dtype)
        if len(items) == 1 and items[0][0] is None:
            t = items[0][1]
            if t.device.type != "cpu" or t.dtype != dtype:
                t = t.to("cpu", dtype)
        else:
            t = torch.empty(store.shapes[name], dtype=dtype)
            for rows, src in items:
                (t if rows is None else t[rows[0]: rows[1]]).copy_(src)
        tensors[name] = t.unsqueeze(0)
    return ExpertWeights(**tensors, layout=store.layout, interleaved=store.interleaved)


def measure_bandwidths(store, impl, config: MoEConfig, device: torch.device, *, reps: int = 5
                       ) -> tuple[float, float]:
    """(B_cpu, B_pcie) in bytes/s, measured on expert (0, 0) of `store`.

    B_cpu: expert_bytes / the median time of `impl` running one row through the expert's
    host tensors (one warm-up call first). B_pcie: expert_bytes / the median time of copying
    the expert's host tensors into a scratch buffer on `device` (synchronised; pinned when
    the store is; on a CPU "device" a host->host copy). A few milliseconds for a real expert.
    """
    w = host_expert_weights(store, 0, 0)
    nbytes = store.expert_bytes
    x = torch.randn(1, config.hidden_size).to(w.dtype)
    e0 = torch.zeros(1, dtype=torch.int64)
    cpu_t = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        impl.forward_pairs(x, e0, w, config)
        if i:
            cpu_t.append(time.perf_counter() - t0)
    srcs = [src for _, _, src in store.pieces(0, 0)]
    dsts = [torch.empty(s.shape, dtype=s.dtype, device=device) for s in srcs]
    cuda = device.type == "cuda"
    copy_t = []
    for i in range(reps + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            copy_t.append(time.perf_counter() - t0)
    tiny = 1e-9  # a timer that reads 0 must not divide by zero
    return nbytes / max(statistics.median(cpu_t), tiny), nbytes / max(statistics.median(copy_t), tiny)
