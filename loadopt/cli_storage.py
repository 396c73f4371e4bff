"""The storage commands of the `loadopt` CLI: `probe` (what a location delivers) and `tiers` (how many
accelerators each storage tier keeps busy). Thin commands over loadopt/storage/probe.py and
loadopt/bench/procurement.py; registered on the app of loadopt/cli.py when that module imports this one.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from loadopt.cli import SetOption, app, auto_report, console, progress_bar, user_errors


@app.command()
def probe(
    url: str = typer.Argument(..., help="A file or folder to read: a local path or an fsspec URL."),
    out: str = typer.Option("results/probe", "--out", help="Output folder of probe.json."),
    duration: float = typer.Option(3.0, "--duration", help="Seconds per pattern."),
    blocks: str = typer.Option("4k,128k,1m", "--blocks", help="Random-read block sizes."),
    concurrency: str = typer.Option("1,4,16,64", "--concurrency", help="Readers in flight for random reads."),
    seq: str = typer.Option("1g", "--seq", help="At most this much is read sequentially."),
    file_size: str = typer.Option(None, "--file-size", help="Write a test file of this size into the folder URL, "
                                                            "probe it, then remove it (else existing files are read)."),
    buffered: bool = typer.Option(False, "--buffered", help="Local files: read through the page cache (evicted "
                                                            "first) instead of O_DIRECT."),
    warm: bool = typer.Option(False, "--warm", help="Local files: leave the page cache as it is."),
    tier: str = typer.Option(None, "--tier", help="Read through this storage tier (a profile of tiers.yaml)."),
) -> None:
    """Measure a storage location: sequential bandwidth, random-read IOPS, MB/s and latency."""
    import json
    from pathlib import Path

    import fsspec

    from loadopt.bench.results import atomic_write_text, prepare_output
    from loadopt.errors import DatasetError
    from loadopt.storage.probe import parse_size
    from loadopt.storage.probe import probe as run_probe

    with user_errors():
        block_sizes = tuple(parse_size(b, "--blocks") for b in blocks.split(",") if b.strip())
        levels = tuple(int(parse_size(c, "--concurrency")) for c in concurrency.split(",") if c.strip())
        folder = prepare_output(out)
        fs = None
        path = url
        if tier is not None:
            from loadopt.storage.tiers import resolve_tier, tier_filesystem

            spec = resolve_tier(tier, where="--tier")
            try:
                base_fs, path = fsspec.core.url_to_fs(url)
            except (ImportError, ValueError) as exc:
                raise DatasetError(f"{url}: cannot open this location ({exc})") from None
            fs = tier_filesystem(spec, base_fs)
        with progress_bar() as progress:
            task = progress.add_task("probing", total=None)

            def step(label: str, done: int, total: int) -> None:
                progress.update(task, description=f"probing: {label}", completed=done, total=total)

            result = run_probe(path, block_sizes=block_sizes, concurrencies=levels, duration_s=duration,
                               seq_bytes=parse_size(seq, "--seq"), cold=not warm, direct=not buffered,
                               file_size=parse_size(file_size, "--file-size") if file_size else None,
                               fs=fs, progress=step)
        result["url"], result["tier"] = url, tier or "local"
        json_path = Path(folder) / "probe.json"
        atomic_write_text(json_path, json.dumps(result, indent=2) + "\n")
    console.print(probe_table(result))
    console.print(f"[dim]{result['files']} file(s), {result['total_bytes'] / 1e6:,.1f} MB; {result['cache_note']}[/]",
                  highlight=False)
    console.print(f"results: {json_path}", highlight=False)


def probe_table(result: dict[str, Any]) -> Table:
    """One row per read pattern of `loadopt probe`."""
    table = Table(title=f"loadopt probe: {result['url']} (tier {result.get('tier', 'local')})", title_justify="left")
    for column in ("pattern", "block", "readers", "IOPS", "MB/s", "lat p50 ms", "lat p99 ms"):
        table.add_column(column, justify="left" if column == "pattern" else "right")
    for p in result["patterns"]:
        block = p["block_bytes"]
        size = f"{block / 1024:,.0f} KiB" if block < 1 << 20 else f"{block / (1 << 20):,.1f} MiB"
        if "skipped" in p:
            table.add_row(p["pattern"], size, str(p["concurrency"]), f"[yellow]skipped: {escape(p['skipped'])}[/]",
                          "", "", "")
            continue
        latency = ["-" if p[k] is None else f"{p[k]:,.3f}" for k in ("lat_p50_ms", "lat_p99_ms")]
        table.add_row(p["pattern"], size, str(p["concurrency"]), f"{p['iops']:,.0f}", f"{p['mb_per_s']:,.1f}",
                      *latency)
    return table


@app.command()
def tiers(
    config: str = typer.Argument(..., help="The config YAML whose workload (batch size, samples, step time) to serve."),
    tier_names: str = typer.Option(None, "--tiers", help="Comma-separated tier profiles (default: the config's "
                                                         "storage.tier when it is not local, else every profile)."),
    au: float = typer.Option(0.9, "--au", help="The mean accelerator utilisation each tier must keep."),
    max_accelerators: int = typer.Option(64, "--max-accelerators", help="Upper bound of the search."),
    readers: int = typer.Option(4, "--readers", help="Reader threads of each consumer."),
    measure: float = typer.Option(3.0, "--measure", help="Seconds measured per trial (after --warmup)."),
    warmup: float = typer.Option(1.0, "--warmup", help="Seconds of warm-up per trial."),
    budget: float = typer.Option(300.0, "--budget", help="Seconds of search per tier."),
    capacity_tb: float = typer.Option(None, "--capacity-tb", help="TB stored, for the cost (default: the dataset's)."),
    out: str = typer.Option("results/tiers", "--out", help="Output folder of tiers.json."),
    backends: bool = typer.Option(True, "--backends/--no-backends", help="Also run every configured backend "
                                  "(arrow and posix decoded and encoded) through each tier, cold: the decision "
                                  "per tier."),
    backend_batches: int = typer.Option(20, "--backend-batches", help="Measured batches per backend and tier."),
    quick: bool = typer.Option(False, "--quick", help="A first look: 1 s trials, 30 s of search per tier, "
                                                      "8 measured batches per backend."),
    set_: list[str] = SetOption,
) -> None:
    """For each storage tier: how many emulated accelerators it keeps at the AU threshold, measured and predicted;
    and which backend is fastest through it."""
    from pathlib import Path

    from loadopt.bench.procurement import run_tiers
    from loadopt.bench.results import atomic_write_text, prepare_output
    from loadopt.config import load_config
    from loadopt.schema import results_text
    from loadopt.storage.tiers import load_tier_profiles

    with user_errors():
        cfg = load_config(config, set_ or [])
        if tier_names:
            names: list[Any] = [t.strip() for t in tier_names.split(",") if t.strip()]
        elif cfg.storage.tier != "local":
            names = [cfg.storage.tier]
        else:
            names = list(load_tier_profiles())
        folder = prepare_output(out)
        if quick:
            measure, warmup, budget, backend_batches = min(measure, 1.0), min(warmup, 0.5), min(budget, 30.0), \
                min(backend_batches, 8)
        with progress_bar() as progress:
            task = progress.add_task("tiers", total=None)
            result = run_tiers(cfg, names, au=au, max_accelerators=max_accelerators, readers=readers,
                               warmup_s=warmup, measure_s=measure, budget_s=budget, capacity_tb=capacity_tb,
                               progress=lambda text: progress.update(task, description=text),
                               backends_out=str(Path(folder) / "backends") if backends else None,
                               backend_warmup=2 if quick else 3, backend_batches=backend_batches)
        json_path = Path(folder) / "tiers.json"
        atomic_write_text(json_path, results_text(result))
    console.print(tiers_table(result))
    need = result["demand"]
    console.print(f"[dim]each accelerator needs {need['mb_per_s']:,.1f} MB/s at full use "
                  f"({need['batch_bytes'] / 1e6:,.2f} MB a batch every {need['step_time_ms']:g} ms), "
                  f"{need['mb_per_s_at_threshold']:,.1f} MB/s at AU {result['au_threshold']:.0%}; "
                  f"consumers read the stored bytes with {readers} threads each[/]", highlight=False)
    if any("backends" in row for row in result["tiers"]):
        console.print(backends_table(result))
        for line in backend_lines(result):
            console.print(escape(line), highlight=False)
    console.print(f"results: {json_path}", highlight=False)
    auto_report(json_path)


def backends_table(result: dict[str, Any]) -> Table:
    """Every backend setting (rows) through every tier (columns): samples/s and accelerator utilisation of
    one accelerator, the tier's winner marked."""
    rows = [row for row in result["tiers"] if "backends" in row]
    table = Table(title="every backend through each tier (one accelerator, cold; * = the tier's decision)",
                  title_justify="left")
    table.add_column("backend setting", justify="left")
    for row in rows:
        table.add_column(f"{row['name']}: samples/s (AU)", justify="right")
    labels: list[str] = []
    for row in rows:
        labels += [run["label"].removesuffix(" via tier") for run in row["backends"]["runs"]
                   if run["label"].removesuffix(" via tier") not in labels]
    for label in labels:
        cells = []
        for row in rows:
            run = next((r for r in row["backends"]["runs"] if r["label"].removesuffix(" via tier") == label), None)
            if run is None:
                cells.append("-")
            elif run.get("samples_per_s") is None:
                cells.append(f"[yellow]{run['status']}[/]")
            else:
                chosen = (row["backends"].get("decision") or {}).get("label") == run["label"]
                au = run.get("accelerator_utilisation")
                cells.append(f"{'* ' if chosen else ''}{run['samples_per_s']:,.0f}"
                             f"{f' ({au:.0%})' if au is not None else ''}")
        table.add_row(escape(label), *cells)
    return table


def backend_lines(result: dict[str, Any]) -> list[str]:
    """Per tier: the decision and where the bytes came from; then the settings that did not run, and why."""
    lines = []
    for row in result["tiers"]:
        backends = row.get("backends")
        if not backends:
            continue
        decision = backends.get("decision") or {}
        sources = sorted({str(r["bytes_source"]) for r in backends["runs"] if r.get("bytes_source")})
        lines.append(f"{row['name']}: auto picks {decision.get('label') or 'nothing (no setting ran)'}"
                     f"{'; ' + decision['text'] if decision.get('text') else ''}; bytes from {', '.join(sources)}")
        for run in backends["runs"]:
            if run.get("samples_per_s") is None:
                lines.append(f"  {row['name']}, {run['label']}: {run['status']}: {run['reason']}")
    return lines


def tiers_table(result: dict[str, Any]) -> Table:
    """One row per tier of `loadopt tiers`."""
    table = Table(title=f"loadopt tiers: accelerators kept at AU >= {result['au_threshold']:.0%}", title_justify="left")
    for column in ("tier", "measured", "predicted", "delivered MB/s", "samples/s", "AU", "CPU load", "$/month",
                   "$/accelerator-month", "search"):
        table.add_column(column, justify="left" if column in ("tier", "search") else "right")
    for row in result["tiers"]:
        costs = (row["cost"]["per_month"], row["cost_per_supported_accelerator"])
        money = ["-" if cost is None else f"{cost:,.2f}" for cost in costs]
        au = "-" if row["accelerator_utilisation"] is None else f"{row['accelerator_utilisation']:.1%}"
        load = "-" if row["cpu_load"] is None else f"{row['cpu_load']:.0%}"
        table.add_row(escape(row["name"]), str(row["accelerators_supported"]), str(row["predicted_accelerators"]),
                      f"{row['delivered_mb_s']:,.1f}",
                      f"{row['samples_per_s']:,.0f}", au, load, *money, escape(row["measured_note"]))
    return table
