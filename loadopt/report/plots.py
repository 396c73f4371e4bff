"""The report's plots as inline SVG text (matplotlib, no pyplot: nothing global is switched).

Figures are built with `matplotlib.figure.Figure` and saved as SVG, so no GUI backend is ever
selected and the caller's pyplot state is untouched. Text stays text (`svg.fonttype: none`: small,
searchable, crisp when printed); the SVG is stripped of its XML prolog, DOCTYPE (which names a URL)
and metadata, and its ids are prefixed so that several figures can share one HTML page.
"""

from __future__ import annotations

import io
import itertools
import re
import textwrap
from typing import TYPE_CHECKING, Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from loadopt.report.data import Results, Timings, median_repeat

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType  # the rc keys matplotlib knows (a Literal)

# Okabe & Ito (2008): distinguishable with the common colour-vision deficiencies. Yellow comes last:
# it is the weakest on white.
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#000000", "#F0E442"]
LINESTYLES = ["-", "--", ":", "-."]  # beyond eight loaders, the line style tells them apart
GREY = "#999999"
SEGMENTS = (("compute", "compute (accelerator busy)", "#0072B2"), ("wait", "waiting for data", "#D55E00"),
            ("h2d", "host-to-device copy", "#E69F00"), ("finish", "finishing (layout, normalise)", "#CC79A7"),
            ("other", "other (harness, Python)", GREY))
STYLE: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",
    "svg.hashsalt": "loadopt",  # stable ids: the same data gives the same SVG
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial", "Helvetica"],
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "legend.frameon": False,
    "legend.fontsize": 8,
}
WIDTH_IN = 8.0  # one file: the page's column is ~1000 px
WIDTH_SIDE_IN = 5.2  # files side by side get ~560 px each: narrower figures keep the text readable
_counter = itertools.count(1)


class Palette:
    """One colour (and line style) per loader label, the same in every plot and file of a report."""

    def __init__(self, labels: list[str], width: float = WIDTH_IN) -> None:
        self._index = {label: i for i, label in enumerate(dict.fromkeys(labels))}
        self.width = width  # of every per-file figure, in inches

    def colour(self, label: str) -> str:
        return OKABE_ITO[self._index.get(label, 0) % len(OKABE_ITO)]

    def linestyle(self, label: str) -> str:
        return LINESTYLES[self._index.get(label, 0) // len(OKABE_ITO) % len(LINESTYLES)]


def _svg(fig: Figure) -> str:
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight", pad_inches=0.05)
    text = out.getvalue()
    text = re.sub(r"<\?xml[^>]*\?>\s*", "", text)
    text = re.sub(r"<!DOCTYPE[^>]*>\s*", "", text)
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    # Inline SVG in HTML needs no namespace declarations; dropping them leaves no URL in the page.
    text = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", text)
    text = text.replace("xlink:href=", "href=")  # SVG 2: every browser takes a plain href
    text = re.sub(r'<svg([^>]*?)\s+width="[^"]*"\s+height="[^"]*"', r'<svg\1', text, count=1)  # CSS sizes it
    prefix = f"f{next(_counter)}-"
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', text)
    text = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', text)
    text = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", text)
    return text.replace("<svg", '<svg role="img"', 1).strip()


def render_svg(build, *args: Any) -> str:
    with matplotlib.rc_context(STYLE):
        fig = build(*args)
        return _svg(fig)


def _short(label: str, width: int = 44) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _tick(label: str, figure_width: float) -> str:
    """An axis label: whole on a full-width figure; wrapped on two lines on a narrow one, so the bars keep room."""
    if figure_width >= WIDTH_IN or len(label) <= 24:
        return _short(label)
    return "\n".join(textwrap.wrap(label, 24, max_lines=2, placeholder="…"))


def _row_in(figure_width: float) -> float:
    return 0.36 if figure_width >= WIDTH_IN else 0.42  # height per bar, inches (two-line labels need more)


OFF_SCALE = 3.0  # a ceiling above this multiple of the fastest rate is marked at the axis end


def ranking(res: Results, palette: Palette) -> str:
    """Throughput per loader setting as bars (min-max spread as whiskers), the bounding ceiling as a
    black diamond with the fraction written on the bar."""
    return render_svg(ranking_figure, res, palette)


def ranking_figure(res: Results, palette: Palette) -> Figure:
    runs = res.ranked
    key, unit = res.rate_unit()
    fig = Figure(figsize=(palette.width, 0.9 + _row_in(palette.width) * max(1, len(runs))))
    ax = fig.add_subplot()
    y = np.arange(len(runs))
    rates = [r.value(key) or 0.0 for r in runs]
    ax.barh(y, rates, color=[palette.colour(r.label) for r in runs], height=0.62)
    whiskers = False
    for i, run in enumerate(runs):
        spread = run.spread(key)
        if spread and spread[0] != spread[1]:
            ax.plot(spread, [i, i], color="#333333", linewidth=1.0)
            whiskers = True
    ceilings = [r.ceiling_rate() if key == "samples_per_s" else None for r in runs]
    # The axis follows the measured rates: a ceiling far above them (e.g. memory copy for decoded pixels,
    # 50x the rate) would squash every bar to a sliver, so it is marked at the axis end instead.
    scale_limit = OFF_SCALE * max(rates + [1.0])
    xmax = max(rates + [c for c in ceilings if c and c <= scale_limit] + [1.0])
    drawn: set[str] = set()
    for i, (run, rate, ceiling) in enumerate(zip(runs, rates, ceilings, strict=True)):
        if not ceiling:
            ax.text(rate + xmax * 0.01, i, f"{rate:,.0f}", va="center", fontsize=8)
            continue
        fraction = rate / ceiling
        off = ceiling > scale_limit
        at, label = (xmax * 1.03, "ceiling beyond the axis") if off else (ceiling, "ceiling that bounds it")
        ax.plot([at], [i], marker=">" if off else "D", color="black", markersize=6, linestyle="none", zorder=4,
                label=None if label in drawn else label)
        drawn.add(label)
        # The fraction on the bar (at its start, boxed in white: readable on every bar colour, yellow
        # included), the value and the ceiling's name after whichever ends further right: no overlaps.
        shown = "unreliable" if run.ceiling_unreliable() else f"{fraction:.0%}"  # never a fraction above 110%
        ax.text(xmax * 0.005, i, shown, va="center", fontsize=7, zorder=5,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.85, "linewidth": 0})
        name = run.ceiling.name if run.ceiling is not None else "ceiling"
        beyond = f", at {ceiling:,.0f}" if off else ""
        ax.text(max(rate, at) + xmax * 0.015, i, f"{rate:,.0f} ({shown} of {name}{beyond})", va="center",
                fontsize=7.5)
    ax.set_yticks(y, [_tick(r.label, palette.width) for r in runs])
    ax.invert_yaxis()
    ax.set_xlim(0, xmax * (1.7 if any(ceilings) else 1.15))  # room for the value and the ceiling's name
    ax.set_xlabel(f"throughput ({unit}, median of repeats{'; whiskers: min-max' if whiskers else ''})")
    ax.grid(axis="y", visible=False)
    if any(ceilings):
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0))  # above the axes: never over a row's text
    return fig


def comparison(files: list[Results], labels: list[str]) -> str:
    """Samples/s of the loader settings common to every file, grouped, one colour per file."""
    return render_svg(_comparison, files, labels)


def _comparison(files: list[Results], labels: list[str]) -> Figure:
    fig = Figure(figsize=(WIDTH_IN, 0.9 + 0.3 * len(labels) * len(files)))
    ax = fig.add_subplot()
    height = 0.8 / len(files)
    base = files[0]
    for j, res in enumerate(files):
        by_label = {r.label: r for r in res.ranked}
        rates = [by_label[label].value("samples_per_s") or 0.0 for label in labels]
        y = np.arange(len(labels)) + j * height
        # The first file is the baseline the ratios are against: grey; the others in the palette.
        ax.barh(y, rates, height=height * 0.9, color=GREY if j == 0 else OKABE_ITO[(j - 1) % len(OKABE_ITO)],
                label=f"{res.tag}: {_short(res.short_name, 40)}")
        if j:
            first = {r.label: r.value("samples_per_s") for r in base.ranked}
            for yi, label, rate in zip(y, labels, rates, strict=True):
                baseline = first.get(label)
                if baseline:
                    ax.text(rate, yi, f" {rate / baseline:.2f}x", va="center", fontsize=8)
    ax.set_yticks(np.arange(len(labels)) + height * (len(files) - 1) / 2, [_short(label) for label in labels])
    ax.invert_yaxis()
    ax.set_xlabel(f"throughput (samples/s); ratios against {base.tag}")
    ax.grid(axis="y", visible=False)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=min(3, len(files)))
    ax.margins(x=0.15)
    return fig


def breakdown(res: Results, palette: Palette) -> str:
    """Per loader setting, one stacked bar of a step's mean time: compute, waiting for data, the copy."""
    return render_svg(breakdown_figure, res, palette.width)


def breakdown_figure(res: Results, width: float) -> Figure:
    runs = [r for r in res.ranked if r.per_step_ms()]
    fig = Figure(figsize=(width, 1.2 + _row_in(width) * max(1, len(runs))))
    ax = fig.add_subplot()
    y = np.arange(len(runs))
    left = np.zeros(len(runs))
    steps = [r.per_step_ms() or {} for r in runs]
    for key, name, colour in SEGMENTS:
        widths = np.array([s.get(key, 0.0) for s in steps])
        if not widths.any():
            continue
        ax.barh(y, widths, left=left, color=colour, height=0.62, label=name)
        left += widths
    for i, total in enumerate(left):
        ax.text(total, i, f" {total:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(y, [_tick(r.label, width) for r in runs])
    ax.invert_yaxis()
    ax.set_xlabel("time per step (ms, mean over measured batches)")
    ax.grid(axis="y", visible=False)
    ax.margins(x=0.12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45 / max(1, len(runs)) - 0.12), ncol=3)
    return fig


def latency(res: Results, palette: Palette) -> str:
    """The CDF of per-batch wait for each loader setting (measured batches of every repeat), with
    p50 (circle) and p99 (triangle) marked."""
    return render_svg(_latency, res, palette)


def _latency(res: Results, palette: Palette) -> Figure:
    fig = Figure(figsize=(palette.width, 4.2 if palette.width >= WIDTH_IN else 4.6))
    ax = fig.add_subplot()
    floor = 1e-3  # ms; a wait of zero still needs a place on a log axis
    for run in res.ranked:
        t = res.timings.get(run.label)
        if t is None or not t.measured.any():
            continue
        waits = np.sort(np.maximum(t.wait_s[t.measured.astype(bool)] * 1000.0, floor))
        cdf = np.arange(1, len(waits) + 1) / len(waits)
        colour, style = palette.colour(run.label), palette.linestyle(run.label)
        ax.step(waits, cdf, where="post", color=colour, linestyle=style, linewidth=1.4,
                label=_tick(run.label, palette.width))
        p50, p99 = np.percentile(waits, 50), np.percentile(waits, 99)
        ax.plot([p50], [0.5], marker="o", color=colour, markersize=5, linestyle="none")
        ax.plot([p99], [0.99], marker="^", color=colour, markersize=6, linestyle="none")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.1, 1, 10 ms rather than 10^-1
    ax.set_xlabel("wait for a batch (ms, log scale)")
    ax.set_ylabel("fraction of batches")
    ax.set_ylim(0, 1.02)
    ax.axhline(0.5, color=GREY, linewidth=0.6, linestyle=":")
    ax.axhline(0.99, color=GREY, linewidth=0.6, linestyle=":")
    ax.plot([], [], marker="o", color="#555555", linestyle="none", label="p50")
    ax.plot([], [], marker="^", color="#555555", linestyle="none", label="p99")
    if palette.width >= WIDTH_IN:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:  # a narrow figure keeps its width for the curves
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    return fig


def over_time(res: Results, palette: Palette) -> str:
    """Per loader setting, one row: samples/s per batch and wait per batch along its median repeat,
    warm-up shaded."""
    return render_svg(over_time_figure, res, palette)


def _timeline(t: Timings, repeat: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    mask = t.repeat == repeat
    order = np.argsort(t.batch[mask])
    start, wait = t.start_s[mask][order], t.wait_s[mask][order]
    samples, measured = t.samples[mask][order], t.measured[mask][order].astype(bool)
    # A batch's rate: its samples over the time to the next request (the last one has no next).
    cycle = np.diff(start)
    rate = np.divide(samples[:-1], cycle, out=np.zeros(len(cycle)), where=cycle > 0)
    return start, wait * 1000.0, rate, measured


def over_time_figure(res: Results, palette: Palette) -> Figure:
    rows = [(r, res.timings[r.label]) for r in res.ranked if r.label in res.timings]
    fig = Figure(figsize=(palette.width, 0.5 + 1.25 * max(1, len(rows))))
    axes = fig.subplots(max(1, len(rows)), 2, squeeze=False, sharex="row")
    for i, (run, t) in enumerate(rows):
        repeat = median_repeat(run)
        start, wait_ms, rate, measured = _timeline(t, repeat)
        colour = palette.colour(run.label)
        rate_ax, wait_ax = axes[i]
        rate_ax.plot(start[:-1], rate, color=colour, linewidth=1.0)
        overall = run.value("samples_per_s")
        if overall:
            rate_ax.axhline(overall, color="black", linewidth=0.8, linestyle="--")
        wait_ax.plot(start, wait_ms, color=colour, linewidth=1.0)
        for ax in (rate_ax, wait_ax):
            if (~measured).any() and measured.any():
                ax.axvspan(start[0], start[np.argmax(measured)], color="#000000", alpha=0.08, linewidth=0)
            ax.set_ylim(bottom=0)
            ax.tick_params(labelsize=7)
        title = _short(run.label, 60) + (f" (repeat {repeat + 1} of {len(run.repeats)})" if len(run.repeats) > 1
                                          else "")
        rate_ax.set_title(title, loc="left", fontsize=8)
        rate_ax.set_ylabel("samples/s", fontsize=7)
        wait_ax.set_ylabel("wait (ms)", fontsize=7)
    fig.supxlabel("time since the run started (s); shaded: warm-up", fontsize=8)
    fig.subplots_adjust(hspace=0.75, wspace=0.25, bottom=0.5 / fig.get_figheight() + 0.02)
    return fig


def tier_plots(res: Results, palette: Palette) -> list[tuple[str, str]]:
    """(title, svg) for each tier plot the file's tiers have data for."""
    tiers, width = res.tiers(), palette.width
    out = []
    if any(isinstance(t.get("accelerators_supported"), (int, float)) for t in tiers):
        thresholds = {t["au_threshold"] for t in tiers if isinstance(t.get("au_threshold"), (int, float))}
        at = f"{thresholds.pop():.0%}" if len(thresholds) == 1 else "each tier's threshold"
        out.append(("Accelerators supported per tier", render_svg(_tier_bars, width, tiers, "accelerators_supported",
                                                               f"accelerators kept at AU ≥ {at} (count)", "{:,.0f}")))
    if any(t.get("au_by_accelerators") for t in tiers):
        out.append(("Accelerator utilisation against accelerator count", render_svg(tier_au_figure, width, tiers)))
    if any(isinstance(t.get("cost_per_supported_accelerator"), (int, float)) for t in tiers):
        out.append(("Cost per supported accelerator",
                    render_svg(_tier_bars, width, tiers, "cost_per_supported_accelerator",
                            "cost per supported accelerator ($ per month)", "${:,.2f}")))
    return out


def _tier_bars(width: float, tiers: list[dict[str, Any]], key: str, xlabel: str, fmt: str) -> Figure:
    fig = Figure(figsize=(width, 0.9 + 0.4 * len(tiers)))
    ax = fig.add_subplot()
    values = [float(t[key]) if isinstance(t.get(key), (int, float)) else 0.0 for t in tiers]
    y = np.arange(len(tiers))
    ax.barh(y, values, color=[OKABE_ITO[i % len(OKABE_ITO)] for i in range(len(tiers))], height=0.6)
    for i, (tier, value) in enumerate(zip(tiers, values, strict=True)):
        known = isinstance(tier.get(key), (int, float))
        ax.text(value, i, " " + (fmt.format(value) if known else "not known"), va="center", fontsize=8)
    ax.set_yticks(y, [_tick(str(t["name"]), width) for t in tiers])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(axis="y", visible=False)
    ax.margins(x=0.15)
    return fig


def tier_au_figure(width: float, tiers: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(width, 3.6))
    ax = fig.add_subplot()
    thresholds = set()
    for i, tier in enumerate(tiers):
        points = [p for p in tier.get("au_by_accelerators") or [] if isinstance(p, (list, tuple)) and len(p) == 2]
        if not points:
            continue
        n, au = zip(*sorted(points), strict=True)
        ax.plot(n, np.array(au) * 100.0, marker="o", markersize=4, color=OKABE_ITO[i % len(OKABE_ITO)],
                linestyle=LINESTYLES[i // len(OKABE_ITO) % len(LINESTYLES)], label=str(tier["name"]))
        if isinstance(tier.get("au_threshold"), (int, float)):
            thresholds.add(float(tier["au_threshold"]))
    for threshold in thresholds:
        ax.axhline(threshold * 100.0, color="black", linewidth=0.8, linestyle="--")
        ax.annotate(f"AU threshold {threshold:.0%}", xy=(0.01, threshold * 100.0), xycoords=("axes fraction", "data"),
                    va="bottom", fontsize=7)
    ax.set_xlabel("emulated accelerators (count)")
    ax.set_ylabel("accelerator utilisation (%)")
    ax.set_ylim(0, 102)
    ax.legend(loc="lower left")
    return fig
