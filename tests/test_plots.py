"""Plots are real PNGs of a sensible size and not blank."""

import pytest

from moeflow import plots

PIL = pytest.importorskip("PIL.Image", reason="matplotlib brings Pillow; installed with the dev extra")


def _check_png(path):
    img = PIL.open(path).convert("RGB")
    w, h = img.size
    assert w >= 300 and h >= 200, (w, h)
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 20, "image looks blank"


def test_expert_load_heatmap(tmp_path):
    load = [[(l * 7 + e * 3) % 11 for e in range(16)] for l in range(4)]
    _check_png(plots.plot_expert_load(load, tmp_path / "load.png"))


def test_hit_rate_plot(tmp_path):
    series = {"lru": [0.5 + 0.3 * ((i % 7) / 7) for i in range(100)], "predictive": [0.8] * 100}
    _check_png(plots.plot_hit_rate(series, tmp_path / "hit.png"))


def test_roof_frac_plot(tmp_path):
    rows = [{"shape": "mixtral", "impl": "triton", "T": t, "roof_frac": 0.5 + 0.01 * t} for t in (1, 2, 4, 8, 16)]
    _check_png(plots.plot_roof_frac(rows, tmp_path / "roof.png"))


def test_empty_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="load_LE"):
        plots.plot_expert_load([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="series"):
        plots.plot_hit_rate({}, tmp_path / "x.png")


def test_hit_rate_figure_shows_every_policy_the_bytes_and_the_slots(tmp_path):
    """Equal curves stay visible (own colour, dashes and marker; markers above every line), the legend
    sits outside the data, the title gives the slot count, a second panel the bytes copied per step."""
    import matplotlib.pyplot as plt

    same = [0.5 + 0.3 * ((i % 7) / 7) for i in range(200)]
    series = {"lru": same, "random_oldest": list(same), "predictive": [0.8] * 200}
    copied = {"lru": [3 << 20] * 200, "random_oldest": [3 << 20] * 200, "predictive": [1 << 20] * 200}
    fig = plots.hit_rate_figure(series, bytes_per_step=copied, slots=12)
    try:
        fig.canvas.draw()
        axes = fig.get_axes()
        assert len(axes) == 2 and "MiB copied per decode step" in axes[1].get_ylabel()
        assert "12 expert slots" in fig._suptitle.get_text()
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        assert labels[0] == f"lru: hit rate {sum(same) / 200:.3f}, 3.0 MiB/step" and len(labels) == 3
        styles = [(h.get_color(), str(h.get_linestyle()), h.get_marker()) for h in legend.legend_handles]
        for i in range(3):  # each of colour, dashes and marker differs between policies
            assert len({s[i] for s in styles}) == 3, styles
        box = legend.get_window_extent()
        for ax in axes:
            assert not box.overlaps(ax.get_window_extent()), "the legend covers a panel"
        for ax in axes:
            lines = [ln for ln in ax.get_lines() if ln.get_linestyle() != "None"]
            dots = [ln for ln in ax.get_lines() if ln.get_linestyle() == "None"]
            assert len(lines) == len(dots) == 3
            assert min(d.get_zorder() for d in dots) > max(ln.get_zorder() for ln in lines)
            assert lines[0].get_linewidth() > lines[1].get_linewidth()  # an earlier equal curve shows around
    finally:
        plt.close(fig)
    path = plots.plot_hit_rate(series, tmp_path / "hit.png", bytes_per_step=copied, slots=12)
    _check_png(path)
    assert plots.is_moeflow_png(path)


def test_plots_carry_moeflow_mark_and_create_no_directory(tmp_path):
    load = [[1, 2, 3], [3, 2, 1]]
    assert plots.is_moeflow_png(plots.plot_expert_load(load, tmp_path / "load.png"))
    (tmp_path / "other.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    assert not plots.is_moeflow_png(tmp_path / "other.png") and not plots.is_moeflow_png(tmp_path / "none.png")
    with pytest.raises(FileNotFoundError):
        plots.plot_expert_load(load, tmp_path / "new" / "load.png")
    assert not (tmp_path / "new").exists()
