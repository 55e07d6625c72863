"""PNG plots (matplotlib, imported lazily: it is a dev extra).

- `plot_expert_load(load_LE, path)`: heatmap, layer x expert token counts.
- `plot_hit_rate(series, path)`: cache hit rate over decode steps, one line per policy.
- `plot_roof_frac(rows, path)`: roof_frac against T per shape/implementation.

Every PNG carries a `moeflow` text chunk (`is_moeflow_png` reads it back), so a command may
replace a plot it wrote before and refuse to replace anyone else's file. The directory of
`path` must exist (nothing is created on the way).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MARK = "moeflow"  # the PNG text chunk's keyword


def is_moeflow_png(path: str | os.PathLike) -> bool:
    """True when `path` is a PNG whose text chunks (before the image data) include moeflow's mark."""
    try:
        with open(path, "rb") as f:
            if f.read(8) != _PNG_SIGNATURE:
                return False
            for _ in range(64):  # matplotlib writes a handful of chunks before the image data
                head = f.read(8)
                if len(head) < 8:
                    return False
                length, kind = struct.unpack(">I4s", head)
                if kind in (b"IDAT", b"IEND") or length > 1 << 20:
                    return False
                data = f.read(length)
                f.seek(4, os.SEEK_CUR)  # the chunk's CRC
                if kind in (b"tEXt", b"iTXt", b"zTXt") and data.split(b"\0", 1)[0] == _MARK.encode():
                    return True
    except OSError:
        return False
    return False


def require_matplotlib() -> None:
    """ValueError (with the pip command) when matplotlib is not installed; call it before the work."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("plots need matplotlib: pip install 'moeflow[dev]' (or pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_expert_load(load_LE: Sequence[Sequence[float]], path: str | Path, *, title: str = "expert load") -> Path:
    """Heatmap of tokens per (layer, expert). load_LE: L rows of E counts."""
    plt = _pyplot()
    rows = [list(map(float, r)) for r in load_LE]
    if not rows or not rows[0]:
        raise ValueError("load_LE: empty, expected L >= 1 rows of E >= 1 counts")
    fig, ax = plt.subplots(figsize=(max(4, len(rows[0]) * 0.3 + 2), max(2.5, len(rows) * 0.35 + 1.5)))
    im = ax.imshow(rows, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="tokens")
    return _save(fig, plt, path, kind="expert_load")


def plot_hit_rate(series: Mapping[str, Sequence[float]], path: str | Path, *, window: int = 16) -> Path:
    """Cache hit rate over decode steps per policy (a moving average over `window` steps)."""
    plt = _pyplot()
    if not series:
        raise ValueError("series: empty, expected {policy: [hit rate per step]}")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, values in series.items():
        v = [float(x) for x in values]
        smooth = [sum(v[max(0, i - window + 1) : i + 1]) / len(v[max(0, i - window + 1) : i + 1]) for i in range(len(v))]
        ax.plot(range(len(v)), smooth, label=name)
    ax.set_xlabel("decode step")
    ax.set_ylabel(f"hit rate (moving avg {window})")
    ax.set_ylim(0, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, plt, path, kind="hit_rate")


def plot_roof_frac(rows: Sequence[Mapping], path: str | Path, *, key: str = "impl") -> Path:
    """roof_frac against T (log x), one line per (shape, rows[key]). rows need shape, T, roof_frac."""
    return plot_vs_tokens(rows, path, metric="roof_frac", key=key)


def plot_vs_tokens(rows: Sequence[Mapping], path: str | Path, *, metric: str, key: str = "impl") -> Path:
    """rows[metric] against T (log x), one line per (shape, rows[key]); rows without the metric are skipped."""
    plt = _pyplot()
    lines: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(metric) is None or r.get("T") is None:
            continue
        label = (r.get("shape", ""), r.get(key, ""), r.get("mode", ""))
        lines.setdefault(label, []).append((float(r["T"]), float(r[metric])))
    if not lines:
        raise ValueError(f"rows: no row with T and {metric} to plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    for (shape, impl, mode), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(x for x in (shape, impl, mode) if x))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    if metric == "roof_frac":
        ax.set_ylabel("roof_frac (floor / time)")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
    else:
        ax.set_ylabel(metric)
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, plt, path, kind=metric)


def _save(fig, plt, path: str | Path, *, kind: str = "plot", tight: bool = True) -> Path:
    p = Path(path)
    if tight:
        fig.tight_layout()
    fig.savefig(p, dpi=110, metadata={_MARK: kind})
    plt.close(fig)
    return p
