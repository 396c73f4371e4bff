"""The report page: one self-contained HTML file (inline SVG plots, inline styles, no script, no URL).

The page is also well-formed XML (void elements closed, no named entities), so that a strict parser
can check it. Several results files go side by side in every section (a grid that falls back to one
column on a narrow screen and in print).
"""

from __future__ import annotations

from collections.abc import Iterable
from html import escape

import yaml

from loadopt.report import plots
from loadopt.report.data import Results, common_labels, stored_size

CSS = """
*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,-apple-system,"Segoe UI","DejaVu Sans",sans-serif;color:#1a1a1a;
background:#fff}
main{max-width:1040px;margin:0 auto;padding:1.2rem 1.4rem 3rem}
main.wide{max-width:1700px}
h1{font-size:1.5rem;margin:.2rem 0 .4rem}
h2{font-size:1.2rem;margin:2rem 0 .5rem;padding-top:.6rem;border-top:2px solid #0072B2}
h3{font-size:1rem;margin:.8rem 0 .3rem}
p{margin:.4rem 0}
.lead{font-size:1.05rem;font-weight:600}
.meta,.note,figcaption{color:#555;font-size:.88rem}
.note{font-style:italic}
nav{font-size:.88rem;margin:.6rem 0}
nav a{margin-right:.9rem;color:#0072B2}
.files{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,34rem),1fr));gap:1.2rem 2rem}
.file{min-width:0}
figure{margin:.5rem 0 1rem}
.plot svg{width:100%;height:auto;display:block}
table{border-collapse:collapse;font-size:.84rem;margin:.4rem 0 1rem;width:100%}
th,td{padding:.22rem .5rem;border-bottom:1px solid #ddd;text-align:left;vertical-align:top}
th{background:#f3f6f9}
table.kv th{width:9rem;white-space:nowrap;background:none}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
td.n{white-space:nowrap}
.tw{overflow-x:auto}
.file table{font-size:.76rem}
.file th,.file td{padding:.2rem .3rem}
code,pre{font-family:"DejaVu Sans Mono",ui-monospace,monospace;font-size:.82rem}
pre{background:#f6f6f6;padding:.6rem;overflow-x:auto;white-space:pre-wrap}
ul{margin:.3rem 0;padding-left:1.3rem}
@media print{
body{font-size:11pt}
main,main.wide{max-width:none;padding:0}
.tw{overflow:visible}
nav{display:none}
.files{display:block}
h2{break-after:avoid}
figure,table,tr{break-inside:avoid}
}
"""


def _table(head: list[str], rows: Iterable[list[str]], numeric: set[int] | frozenset[int] = frozenset()) -> str:
    """Cells are escaped here; numeric columns are right-aligned."""
    cls = lambda i: ' class="n"' if i in numeric else ""  # noqa: E731
    out = ["<table><thead><tr>" + "".join(f"<th{cls(i)}>{escape(h)}</th>" for i, h in enumerate(head))
           + "</tr></thead><tbody>"]
    for row in rows:
        out.append("<tr>" + "".join(f"<td{cls(i)}>{escape(c)}</td>" for i, c in enumerate(row)) + "</tr>")
    # Wrapped: a table wider than its column scrolls on its own instead of widening the page.
    return '<div class="tw">' + "".join(out) + "</tbody></table></div>"


def _num(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _figure(svg: str, caption: str) -> str:
    return f'<figure><div class="plot">{svg}</div><figcaption>{escape(caption)}</figcaption></figure>'


def _note(text: str) -> str:
    return f'<p class="note">{escape(text)}</p>'


def _section(key: str, title: str, files: list[Results], body, intro: str = "") -> str:
    """A section with one column per results file (`body(res) -> html`)."""
    parts = [f'<section id="{key}" data-section="{key}"><h2>{escape(title)}</h2>']
    if intro:
        parts.append(f"<p>{escape(intro)}</p>")
    if len(files) == 1:
        parts.append(body(files[0]))
    else:
        parts.append('<div class="files">')
        for res in files:
            parts.append(f'<div class="file"><h3>{escape(res.tag)}: {escape(res.short_name)}</h3>{body(res)}</div>')
        parts.append("</div>")
    return "".join(parts) + "</section>"


def _ranking(res: Results, palette: plots.Palette) -> str:
    ranked = res.ranked
    if not ranked:
        return _note("No loader setting was measured.") + _unmeasured(res)
    key, unit = res.rate_unit()
    measured_ceilings = any(r.ceiling_rate() for r in ranked)
    caption = (f"Throughput ({unit}) per loader setting, fastest first; colours are the loader settings' throughout "
               "the report.")
    caption += (" The black diamond marks the ceiling that bounds each setting (measured on the same machine); a "
                "black triangle at the axis end, a ceiling far beyond the measured rates (its value is written); "
                "the fraction of it reached is written on the bar." if measured_ceilings else "")
    parts = [_figure(plots.ranking(res, palette), caption)]
    if res.busy_note():
        parts.append(_note(f"Busy machine: {res.busy_note()}."))
    if res.bytes_sources():
        parts.append(_note(f"Bytes from: {res.bytes_sources()} (every run's; tier_bytes in the results counts what "
                           "crossed a tier)."))
    if not measured_ceilings:
        parts.append(_note("Ceilings were not measured for these results (no storage, memory-copy or decode ceiling "
                           "in the file), so no loader is shown as a fraction of the one that bounds it."))
    tokens = key == "tokens_per_s"
    head = ["#", "loader setting", "samples/s", "spread"] + (["tokens/s"] if tokens else ["MB/s"]) + [
        "AU", "stall", "wait p99 ms", "CPU s/1k", "peak mem MB", "of ceiling"]
    rows = []
    for rank, run in enumerate(ranked, start=1):
        spread = run.spread("samples_per_s")
        rows.append([str(rank), run.label, _num(run.value("samples_per_s"), ",.0f"),
                     f"{spread[0]:,.0f}-{spread[1]:,.0f}" if spread else "-",
                     _num(run.value("tokens_per_s"), ",.0f") if tokens else _num(run.value("mb_per_s"), ",.1f"),
                     _num(run.value("accelerator_utilisation"), ".1%"), _num(run.value("stall_fraction"), ".1%"),
                     _num(run.value("wait_p99_ms"), ",.1f"), _num(run.value("cpu_seconds_per_1k_samples"), ".2f"),
                     _num(run.value("peak_pss_mb"), ",.0f"),
                     run.ceiling_cell()])
    parts.append(_table(head, rows, numeric={0, 2, 3, 4, 5, 6, 7, 8, 9}))
    return "".join(parts) + _unmeasured(res)


def _unmeasured(res: Results) -> str:
    runs = res.unmeasured
    if not runs:
        return ""
    items = "".join(f"<li><code>{escape(r.label)}</code>: {escape(r.why_unmeasured())}</li>" for r in runs)
    return f"<p>Not measured:</p><ul>{items}</ul>"


def _breakdown(res: Results, palette: plots.Palette) -> str:
    runs = [r for r in res.ranked if r.per_step_ms()]
    if not runs:
        return _note("The file holds no compute/wait totals to split a step by.")
    caption = ("Mean time of one step per loader setting: the accelerator computing, the training loop waiting for "
               "the batch, the host-to-device copy and the rest of the finishing (layout, normalisation on the "
               "device), and what remains of the wall time. On the emulated device the copy and finishing overlap the "
               "step before: there a step is its compute and the accelerator's idle time before it, the loader's "
               "(waiting) and the host finishing's. The shorter the bar, the higher the throughput.")
    parts = [_figure(plots.breakdown(res, palette), caption)]
    rows = []
    for run in runs:
        step = run.per_step_ms() or {}
        rows.append([run.label] + [_num(step.get(k), ".2f") for k in ("compute", "wait", "h2d", "finish", "other")]
                    + [_num(sum(step.values()), ".2f"), _num(run.value("accelerator_utilisation"), ".1%")])
    parts.append(_table(["loader setting", "compute ms", "wait ms", "copy ms", "finishing ms", "other ms", "step ms",
                         "AU"], rows, numeric={1, 2, 3, 4, 5, 6, 7}))
    if any(r.metrics.get("h2d_emulated") for r in runs):
        parts.append(_note("No GPU: the host-to-device copy is emulated as a copy into a preallocated buffer."))
    return "".join(parts)


def _latency(res: Results, palette: plots.Palette) -> str:
    parts = []
    if any(r.label in res.timings for r in res.ranked):
        parts.append(_figure(plots.latency(res, palette),
                             "Cumulative distribution of the wait for each batch (measured batches of every repeat; "
                             "log scale). Circles mark the median (p50), triangles p99: the tail a real-time "
                             "inference service would feel."))
    else:
        parts.append(_note(f"No wait distribution to plot: {res.timings_note or 'no per-batch timings'}."))
    rows = [[r.label] + [_num(r.value(f"wait_{p}_ms"), ",.2f") for p in ("p50", "p95", "p99", "max")]
            for r in res.ranked]
    if rows:
        parts.append(_table(["loader setting", "wait p50 ms", "p95 ms", "p99 ms", "max ms"], rows,
                            numeric={1, 2, 3, 4}))
    return "".join(parts)


def _over_time(res: Results, palette: plots.Palette) -> str:
    if not any(r.label in res.timings for r in res.ranked):
        return _note(f"No timeline to plot: {res.timings_note or 'no per-batch timings'}.")
    return _figure(plots.over_time(res, palette),
                   "Along each run (its median repeat): samples/s of each batch (its samples over the time to the "
                   "next request; dashed: the run's throughput) and the wait for each batch. Warm-up batches are "
                   "shaded. Stalls show as dips and spikes, jitter as spread, warm-up as the shaded start.")


def _tiers(res: Results, palette: plots.Palette) -> str:
    tiers = res.tiers()
    if not tiers:
        return _note("This results file has no storage tiers.")
    parts = [_figure(svg, title) for title, svg in plots.tier_plots(res, palette)]
    rows = []
    for t in tiers:
        au = t.get("au_threshold")
        rows.append([str(t["name"]), _num(au, ".0%") if isinstance(au, (int, float)) else "-",
                     _plain(t.get("accelerators_supported"), ",.0f"), _plain(t.get("predicted_accelerators"), ",.0f"),
                     stored_size(t.get("capacity_tb")), _plain(t.get("delivered_mb_s"), ",.1f"),
                     _plain(t.get("samples_per_s"), ",.0f"),
                     _plain(t.get("price_per_tb_month"), ",.2f"), _plain(t.get("cost_per_supported_accelerator"),
                                                                          ",.2f")])
    parts.append(_table(["tier", "AU threshold", "accelerators supported", "predicted from probe", "dataset",
                         "delivered MB/s", "samples/s", "$/TB-month", "$ per supported accelerator"], rows,
                        numeric={1, 2, 3, 4, 5, 6, 7, 8}))
    for t in tiers:  # an emulated tier over slower storage measured that storage: its prediction is its own figures'
        if t.get("bounded_by_base"):
            parts.append(_note(f"{t['name']}: {t['bounded_by_base']}; predicted from the tier's own figures."))
    return "".join(parts)


def _plain(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _decision(res: Results) -> str:
    parts = [f'<p class="lead">{escape(res.decision())}</p>']
    summary = res.doc.get("summary")
    if summary and summary != res.decision():
        parts.append(f"<p>{escape(str(summary))}</p>")
    verdicts = res.verdicts()
    if verdicts:
        parts.append("<p>Bottlenecks:</p><ul>" + "".join(
            f"<li>{f'<code>{escape(label)}</code>: ' if label else ''}{escape(text)}</li>" for label, text in verdicts)
                     + "</ul>")
    else:
        parts.append(_note("Bottleneck attribution was not measured for these results (the stages were not run "
                           "apart), so no stage is named as the bottleneck."))
    if res.doc.get("interrupted"):
        what = "tiers that" if res.doc.get("command") == "loadopt tiers" else "runs that"
        parts.append(_note(f"It was interrupted ({res.doc.get('interrupted_by') or 'stopped'}): only the {what} "
                           "finished are in it."))
    return "".join(parts)


def _machine(res: Results) -> str:
    doc, m = res.doc, res.doc.get("machine") or {}
    gpu = m.get("gpu") or {}
    rows = [["results file", str(res.path)], ["command", str(doc.get("command", "-"))],
            ["created", str(doc.get("created", "-"))], ["device", str(doc.get("device", "-"))],
            ["machine", res.machine_line()], ["platform", str(m.get("platform", "-"))],
            ["python", str(m.get("python", "-"))],
            ["GPU", f"{gpu.get('count', 1)}x {gpu.get('name')} (CUDA {gpu.get('cuda')})" if gpu else "none"],
            ["workload", res.workload_line() or "-"]]
    if doc.get("cache"):
        rows.append(["cache", str(doc["cache"].get("note") or doc["cache"].get("mode"))])
    ds = doc.get("dataset") or {}
    if ds:
        rows.append(["dataset", f"{ds.get('fingerprint', '?')}: {ds.get('num_samples', '?')} samples, "
                                f"{ds.get('num_classes', '?')} classes, "
                                f"{_plain((ds.get('total_bytes') or 0) / 1e6, ',.1f')} MB at {ds.get('root', '?')}"])
    parts = ['<table class="kv"><tbody>' + "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>"
                                                   for k, v in rows) + "</tbody></table>"]
    libs = m.get("libraries") or {}
    if libs:
        versions = ([f"{k} {v}" for k, v in libs.items() if v]
                    + [f"{k}: not installed" for k, v in libs.items() if not v])
        parts.append(f"<h3>Library versions</h3><p>{escape(', '.join(versions))}</p>")
    if doc.get("config"):
        source = doc.get("config_source") or "the config"
        # Flow style for the leaves (lists of numbers) keeps the config to half the lines.
        dumped = yaml.safe_dump(doc["config"], sort_keys=False, default_flow_style=None, width=100)
        parts.append(f"<h3>Config ({escape(str(source))}, as run)</h3><pre>{escape(dumped)}</pre>")
    else:
        parts.append(_note("No config in this results file (it was written by "
                           f"{doc.get('command', 'another tool')})."))
    return "".join(parts)


def _comparison(files: list[Results]) -> str:
    labels = common_labels(files)
    base = files[0]
    parts = ['<section id="comparison" data-section="comparison"><h2>Comparison</h2><ul>']
    parts += [f"<li><b>{escape(f.tag)}</b>: <code>{escape(str(f.path))}</code>: {escape(f.title)}; "
              f"{escape(f.machine_line())}</li>" for f in files]
    parts.append("</ul>")
    if not labels:
        parts.append(_note("No loader setting was measured in every file, so there is nothing to put side by side."))
        return "".join(parts) + "</section>"
    parts.append(_figure(plots.comparison(files, labels),
                         f"Throughput of the loader settings measured in every file, with the ratio to {base.tag}."))
    rows = []
    for label in labels:
        rates = [next(r for r in f.ranked if r.label == label).value("samples_per_s") for f in files]
        rows.append([label] + [_num(r, ",.0f") for r in rates]
                    + [f"{r / rates[0]:.2f}x" if r is not None and rates[0] else "-" for r in rates[1:]])
    head = ["loader setting"] + [f"{f.tag} samples/s" for f in files] + [f"{f.tag}/{base.tag}" for f in files[1:]]
    parts.append(_table(head, rows, numeric=set(range(1, len(head)))))
    return "".join(parts) + "</section>"


SECTIONS = (("ranking", "Ranking"), ("time", "Where the time goes"), ("latency", "Latency"),
            ("over-time", "Over time"), ("tiers", "Storage tiers"), ("decision", "Decision and bottlenecks"),
            ("machine", "Machine, libraries and config"))


def render(files: list[Results]) -> str:
    """The whole page for one results file, or several side by side."""
    labels = [r.label for f in files for r in f.ranked]
    palette = plots.Palette(labels, plots.WIDTH_IN if len(files) == 1 else plots.WIDTH_SIDE_IN)
    tiers = any(f.tiers() for f in files)
    title = files[0].title if len(files) == 1 else "loadopt comparison: " + " against ".join(
        f"{f.tag} ({f.short_name})" for f in files)
    lead = "".join(f'<p class="lead">{escape(f.tag + ": " if len(files) > 1 else "")}{escape(f.decision())}</p>'
                   for f in files)
    meta = "".join(f'<p class="meta">{escape(f.tag + ": " if len(files) > 1 else "")}{escape(f.machine_line())}'
                   f"{escape(' · ' + f.workload_line() if f.workload_line() else '')}"
                   f"{escape(' · ' + str(f.doc['created']) if f.doc.get('created') else '')}</p>" for f in files)
    shown = [(k, t) for k, t in SECTIONS if k != "tiers" or tiers]
    nav = "<nav>" + ("<a href=\"#comparison\">Comparison</a>" if len(files) > 1 else "") + "".join(
        f'<a href="#{k}">{escape(t)}</a>' for k, t in shown) + "</nav>"
    body = [_comparison(files)] if len(files) > 1 else []
    body.append(_section("ranking", "Ranking", files, lambda r: _ranking(r, palette)))
    body.append(_section("time", "Where the time goes", files, lambda r: _breakdown(r, palette)))
    body.append(_section("latency", "Latency", files, lambda r: _latency(r, palette)))
    body.append(_section("over-time", "Over time", files, lambda r: _over_time(r, palette)))
    if tiers:
        body.append(_section("tiers", "Storage tiers", files, lambda r: _tiers(r, palette),
                             "Per tier: how many emulated accelerators it keeps at or above the accelerator "
                             "utilisation (AU) threshold, AU as accelerators are added, and what each supported "
                             "accelerator costs in storage."))
    body.append(_section("decision", "Decision and bottlenecks", files, _decision))
    body.append(_section("machine", "Machine, libraries and config", files, _machine))
    wide = ' class="wide"' if len(files) > 1 else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/>"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>"
            f"<title>{escape(title)}</title><style>{CSS}</style></head>"
            f"<body><main{wide}><header><h1>{escape(title)}</h1>{lead}{meta}</header>{nav}"
            + "".join(body) + "</main></body></html>\n")
