"""PNG plots (matplotlib, imported lazily: it is a dev extra).

- `plot_expert_load(load_LE, path)`: heatmap, layer x expert token counts.
- `plot_hit_rate(series, path, bytes_per_step=...)`: cache hit rate over decode steps, one
  line style per policy, and a second panel of the bytes copied per step.
- `plot_roof_frac(rows, path)`: roof_frac against T per shape/implementation.

Every PNG carries a `moeflow` text chunk (`is_moeflow_png` reads it back), so a command may
replace a plot it wrote before and refuse to replace anyone else's file. The directory of
`path` must exist (nothing is created on the way).
"""

from __future__ import annotations

import math
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


# One look per series, so that equal curves stay visible: colour, dash pattern and marker all differ.
_STYLES = [("tab:blue", "-", "o"), ("tab:orange", "--", "s"), ("tab:green", "-.", "^"), ("tab:red", ":", "D"),
           ("tab:purple", (0, (5, 1)), "v"), ("tab:brown", (0, (3, 1, 1, 1, 1, 1)), "P"), ("tab:pink", "-", "X"),
           ("tab:gray", "--", "*"), ("tab:olive", "-.", "h"), ("tab:cyan", ":", "<")]


def _moving_average(values: Sequence[float], window: int) -> tuple[list[int], list[float]]:
    """(x, mean of the `window` values ending at x) for x = window - 1 .. n - 1 (every window full)."""
    v = [float(x) for x in values]
    window = max(1, min(window, len(v)))
    xs, out, acc = [], [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= window:
            acc -= v[i - window]
        if i >= window - 1:
            xs.append(i)
            out.append(acc / window)
    return xs, out


def _byte_unit(peak: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= scale:
            return unit, scale
    return "B", 1


def hit_rate_figure(series: Mapping[str, Sequence[float]], *, window: int | None = None,
                    bytes_per_step: Mapping[str, Sequence[float]] | None = None, slots: int | None = None,
                    step: str = "decode step"):
    """The matplotlib figure `plot_hit_rate` saves (see there); the caller closes it."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    if not series or not any(len(v) for v in series.values()):
        raise ValueError("series: empty, expected {policy: [hit rate per step]}")
    if bytes_per_step is not None and set(bytes_per_step) != set(series):
        raise ValueError(f"bytes_per_step: policies {sorted(bytes_per_step)}, expected those of series "
                         f"{sorted(series)}")
    n_steps = max(len(v) for v in series.values())
    if window is None:
        window = max(1, n_steps // 40)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r}: expected an int >= 1 (steps per moving average)")
    window = min(window, n_steps)
    steps = step + ("es" if step.endswith("s") else "s")
    panels = 2 if bytes_per_step is not None else 1
    fig, axes = plt.subplots(panels, 1, figsize=(10, 3.1 * panels + 1.3), sharex=True, squeeze=False,
                             layout="constrained")
    ax_hit = axes[0][0]
    ax_bytes = axes[1][0] if panels == 2 else None
    peak = max((max(v, default=0) for v in (bytes_per_step or {}).values()), default=0)
    unit, scale = _byte_unit(peak)
    k = len(series)
    handles = []
    for i, (name, values) in enumerate(series.items()):
        color, dash, marker = _STYLES[i % len(_STYLES)]
        # Earlier series draw thicker and below, so a later equal curve leaves them visible at its
        # edges; the markers go on top of every line, offset per series, so each policy shows.
        line = dict(color=color, linestyle=dash, linewidth=1.0 + 2.2 * (k - 1 - i) / max(1, k - 1), zorder=2 + i)
        dots = dict(color=color, linestyle="none", marker=marker, markersize=6, markeredgecolor="white",
                    markeredgewidth=0.6, zorder=50 + i)
        curves = [(ax_hit, values, 1.0)]
        n = len(values)
        label = f"{name}: hit rate {sum(map(float, values)) / n if n else 0.0:.3f}"
        if bytes_per_step is not None:
            b = bytes_per_step[name]
            curves.append((ax_bytes, b, scale))
            label += f", {sum(map(float, b)) / len(b) / scale if len(b) else 0.0:.1f} {unit}/step"
        for ax, v, div in curves:
            xs, ys = _moving_average(v, window)
            ys = [y / div for y in ys]
            ax.plot(xs, ys, **line)
            span = max(1, len(xs) // 10)
            first = i * span // k
            ax.plot(xs[first::span], ys[first::span], **dots)
        handles.append(Line2D([], [], label=label, marker=marker, markersize=6, **{**line, "linewidth": 1.6}))
    avg = f"curves: mean of the last {window} {steps}" if window > 1 else f"one point per {step}"
    ax_hit.set_ylabel("hit rate")
    low = min((y for ln in ax_hit.get_lines() for y in ln.get_ydata()), default=0.0)
    ax_hit.set_ylim(max(0.0, math.floor((low - 0.02) * 10) / 10), 1.01)  # the curves' range, up to 1
    ax_hit.grid(alpha=0.3)
    if ax_bytes is not None:
        ax_bytes.set_ylabel(f"{unit} copied per {step}\n(misses + prefetches)")
        ax_bytes.set_ylim(bottom=0)
        ax_bytes.grid(alpha=0.3)
    axes[-1][0].set_xlabel(f"{step} ({avg})")
    axes[-1][0].set_xlim(0, max(1, n_steps - 1))
    what = "hit rate and bytes copied" if ax_bytes is not None else "hit rate"
    cache = f"Offload cache of {slots} expert slots" if slots is not None else "Offload cache"
    fig.suptitle(f"{cache}: {what} per {step} ({n_steps} {steps})")
    # the legend below the panels, never over the data; its labels carry each policy's means
    fig.legend(handles=handles, loc="outside lower center", ncols=min(3, k), title="policy: mean over all steps",
               fontsize=8, title_fontsize=8)
    return fig


def plot_hit_rate(series: Mapping[str, Sequence[float]], path: str | Path, *, window: int | None = None,
                  bytes_per_step: Mapping[str, Sequence[float]] | None = None, slots: int | None = None,
                  step: str = "decode step") -> Path:
    """Cache hit rate over decode steps per policy (a moving average over `window` steps; default 1/40 of them).

    series: policy -> hit rate per step. bytes_per_step: policy -> bytes copied per step
    (misses and prefetches), drawn in a second panel. slots: the cache size, for the title.
    Each policy has its own colour, dash pattern and marker (equal curves stay visible); the
    legend sits outside the panels and gives each policy's mean hit rate (and bytes per step).
    """
    fig = hit_rate_figure(series, window=window, bytes_per_step=bytes_per_step, slots=slots, step=step)
    return _save(fig, _pyplot(), path, kind="hit_rate", tight=False)


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
