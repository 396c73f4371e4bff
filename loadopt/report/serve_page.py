"""The report of a serving bench (serve.json): the paths' table and, for the server scenario, latency against the
offered rate per path (perf_analyzer's curve), the bound drawn across it. One self-contained HTML page."""

from __future__ import annotations

from html import escape

from matplotlib.figure import Figure

from loadopt.report import plots
from loadopt.report.html import CSS
from loadopt.schema.serve import PathResult, ServeResults


def _curve(results: ServeResults) -> Figure:
    paths = [p for p in results.paths if p.status == "ok" and p.curve]
    palette = plots.Palette([p.label for p in paths])
    fig = Figure(figsize=(plots.WIDTH_IN, 3.6))
    axes = fig.subplots()
    for path in paths:
        rates = [point.offered_qps for point in path.curve]
        axes.plot(rates, [point.p99_ms for point in path.curve], marker="o", color=palette.colour(path.label),
                  linestyle=palette.linestyle(path.label), label=f"{path.label} p99")
        axes.plot(rates, [point.p50_ms for point in path.curve], marker=".", color=palette.colour(path.label),
                  linestyle=":", alpha=0.6)
    if results.slo_ms is not None:
        axes.axhline(results.slo_ms, color=plots.GREY, linestyle="--", linewidth=1)
        axes.annotate(f"p99 bound {results.slo_ms:g} ms", (0.01, results.slo_ms), xycoords=("axes fraction", "data"),
                      va="bottom", fontsize=8, color=plots.GREY)
    axes.set_yscale("log")
    axes.set_xlabel("offered rate, requests/s")
    axes.set_ylabel("latency, ms (p99 solid, p50 dotted)")
    axes.legend(loc="upper left")
    return fig


def _row(path: PathResult, scenario: str) -> str:
    return "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in _cells(path, scenario)) + "</tr>"


def _cells(path: PathResult, scenario: str) -> list[str]:
    cells = [path.label]
    if path.status != "ok":
        cells += [f"{path.status}: {path.reason}"]
    elif scenario == "offline" and path.offline:
        o = path.offline
        cells += [f"{o.samples_per_s:,.0f} samples/s", f"first result {o.first_result_s:.2f} s",
                  f"AU {o.accelerator_utilisation:.0%}", "in order" if o.in_order else "NOT in order"]
    elif scenario == "single_stream" and path.single_stream:
        s = path.single_stream
        cells += [f"p50 {s.p50_ms:.2f} ms", f"p90 {s.p90_ms:.2f} ms", f"p99 {s.p99_ms:.2f} ms"]
    elif path.server:
        best = path.best_within_slo
        cells += [f"within the bound: {best.offered_qps:,.0f} requests/s (p99 {best.p99_ms:.1f} ms)" if best
                  else "within the bound: -",
                  f"at {path.server.offered_qps:,.0f}/s: p50 {path.server.p50_ms:.1f}, p99 {path.server.p99_ms:.1f}, "
                  f"p99.9 {path.server.p999_ms:.1f} ms"]
    return cells


def render(results: ServeResults) -> str:
    title = f"loadopt serving: {results.name}, {results.scenario}"
    parts = [f"<h1>{escape(title)}</h1>",
             f"<p>{escape(results.summary)}</p>",
             f"<p>{escape(results.dataset)}; {escape(results.recipe)}; step: {escape(results.step)}; "
             f"{escape(results.batching)}; {escape(results.arrivals)}; device {escape(results.device)}</p>"]
    if results.machine_load:
        parts.append(f"<p>{escape(results.machine_load)}</p>")
    parts.append("<table>" + "".join(_row(p, results.scenario) for p in results.paths) + "</table>")
    if results.scenario == "server" and any(p.curve for p in results.paths):
        svg = plots.render_svg(_curve, results)
        parts.append(f"<figure>{svg}<figcaption>Latency against the offered rate per request path (each point one "
                     "open-loop run of the search): where a path's p99 leaves the bound is the highest rate it "
                     "serves.</figcaption></figure>")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"/><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body><main>{''.join(parts)}</main></body></html>")


def markdown(results: ServeResults) -> str:
    """The summary and one line per path, for a pull request."""
    lines = [f"## loadopt serving: {results.name}, {results.scenario}", "", results.summary, "",
             f"{results.dataset}; {results.recipe}; step: {results.step}; {results.batching}", "",
             "| path | figures | |", "| --- | --- | --- |"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in _cells(p, results.scenario)) + " |"
              for p in results.paths]
    return "\n".join(lines) + "\n"
