"""The storage commands of the `loadopt` CLI: `probe` (what a location delivers) and `tiers` (how many
accelerators each storage tier keeps busy). Thin commands over `probe` and
`run_tiers`; registered on the app in `loadopt.cli`, their tables in `tables`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from loadopt.cli.console import (
    RelistOption,
    RichReporter,
    SetOption,
    console,
    err_console,
    progress_bar,
    user_errors,
)
from loadopt.cli.process import terminate_as_interrupt
from loadopt.cli.reading import auto_report
from loadopt.cli.tables import backend_lines, backends_table, bounded_lines, probe_table, tiers_table
from loadopt.errors import Terminated
from loadopt.progress import Reporter, TiersProgress

if TYPE_CHECKING:
    from loadopt.config_models import Config
    from loadopt.procurement.tiers_document import TiersRun

app = typer.Typer()  # this module's commands; loadopt.cli joins it to the `loadopt` app


class RichTiersProgress(TiersProgress):
    """`loadopt tiers` as it goes: the bar's description on a terminal, and one line per finished step on
    stderr (a log gets them too, where the bar is not drawn). A stop (SIGTERM in `terminated`, Ctrl-C in
    `interrupted`) whose raise a finaliser swallowed (each trial's tier is finalised) is raised again here."""

    def __init__(self, progress: Any, terminated: list[bool], interrupted: list[bool]) -> None:
        self.progress, self.terminated, self.interrupted = progress, terminated, interrupted
        self.task = progress.add_task("tiers", total=None)

    def status(self, text: str) -> None:
        _raise_stop(self.terminated, self.interrupted)
        self.progress.update(self.task, description=text)

    def line(self, text: str) -> None:
        _raise_stop(self.terminated, self.interrupted)
        self.progress.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def bench_reporter(self) -> Reporter:
        return _TierBenchReporter(self.progress, self.terminated, self.interrupted)


class _TierBenchReporter(RichReporter):
    """The backends' runs on a tier, drawn as `loadopt bench` draws them, stopped by Ctrl-C as by SIGTERM."""

    def __init__(self, progress: Any, terminated: list[bool], interrupted: list[bool]) -> None:
        super().__init__(progress, terminated)
        self.interrupted = interrupted

    def stop_if_terminated(self) -> None:
        _raise_stop(self.terminated, self.interrupted)


def _raise_stop(terminated: list[bool], interrupted: list[bool]) -> None:
    if terminated:
        raise Terminated()
    if interrupted:
        raise KeyboardInterrupt()


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
    """Measure a storage location: sequential bandwidth, random-read IOPS, MB/s and latency.

    Examples:
      loadopt probe /data --duration 5
      loadopt probe s3://bucket/prefix --concurrency 16
    """
    import json
    import os

    from loadopt.files import atomic_write_text, discard_output, prepare_output
    from loadopt.storage.remote.access import open_url, redact
    from loadopt.storage.tiers.probe import parse_size
    from loadopt.storage.tiers.probe import probe as run_probe

    with user_errors():
        block_sizes = tuple(parse_size(b, "--blocks") for b in blocks.split(",") if b.strip())
        levels = tuple(int(parse_size(c, "--concurrency")) for c in concurrency.split(",") if c.strip())
        existed = Path(out).expanduser().exists()
        folder = prepare_output(out)
        try:
            fs = None
            path = url
            if tier is not None:
                from loadopt.storage.tiers.spec import resolve_tier
                from loadopt.storage.tiers.stack import tier_filesystem

                spec = resolve_tier(tier, where="--tier")
                base_fs, path = open_url(os.path.expanduser(url))
                fs = tier_filesystem(spec, base_fs)
            with progress_bar() as progress:
                task = progress.add_task("probing", total=None)

                def step(label: str, done: int, total: int) -> None:
                    progress.update(task, description=f"probing: {label}", completed=done, total=total)

                result = run_probe(path, block_sizes=block_sizes, concurrencies=levels, duration_s=duration,
                                   seq_bytes=parse_size(seq, "--seq"), cold=not warm, direct=not buffered,
                                   file_size=parse_size(file_size, "--file-size") if file_size else None,
                                   fs=fs, progress=step, source=url)
        except BaseException:  # a probe that failed leaves no empty output folder behind
            discard_output(folder, existed)
            raise
        result["url"], result["tier"] = redact(url), tier or "local"
        json_path = Path(folder) / "probe.json"
        atomic_write_text(json_path, json.dumps(result, indent=2) + "\n")
    console.print(probe_table(result))
    console.print(f"[dim]{result['files']} file(s), {result['total_bytes'] / 1e6:,.1f} MB; {result['cache_note']}[/]",
                  highlight=False)
    console.print(f"results: {json_path}", highlight=False)


def _tier_names(cfg: Config, tier_names: str | None) -> list[str | dict[str, Any]]:
    """The tiers asked for: `--tiers`, else the config's storage.tier when it is not local, else every profile."""
    from loadopt.storage.tiers.spec import load_tier_profiles

    if tier_names:
        return [t.strip() for t in tier_names.split(",") if t.strip()]
    if cfg.storage.tier != "local":
        return [cfg.storage.tier]
    return list(load_tier_profiles())


def _say_stopped(result: TiersRun, json_path: Path, stopped: str, code: int) -> None:
    """A stopped `tiers`: what was kept and where it was cut short, then its exit (143 or 130)."""
    cut = result.cut_short
    where = ""
    if cut is not None and cut.stage == "backends":
        where = f"; {cut.tier} was cut short in its backends (its row and its finished backend runs are kept)"
    elif cut is not None:
        where = f"; {cut.tier} was cut short in its {cut.stage} ({len(cut.trials)} trial(s) in cut_short, not a row)"
    err_console.print(f"interrupted ({stopped}): the {len(result.tiers)} tier(s) measured were kept in "
                      f"{json_path}{where}", highlight=False, markup=False)
    raise typer.Exit(code)


def _print_tiers(result: TiersRun, readers: int) -> None:
    """The tiers' table, each accelerator's need, the rows bounded by the storage under them, the backends."""
    console.print(tiers_table(result))
    need = result.demand or {}
    console.print(f"[dim]each accelerator needs {need['mb_per_s']:,.1f} MB/s at full use "
                  f"({need['batch_bytes'] / 1e6:,.2f} MB a batch every {need['step_time_ms']:g} ms), "
                  f"{need['mb_per_s_at_threshold']:,.1f} MB/s at AU {result.au_threshold:.0%}; "
                  f"consumers read the stored bytes with {readers} threads each[/]", highlight=False)
    for line in bounded_lines(result):
        console.print(f"[yellow]{escape(line)}[/]", highlight=False)
    if any(row.backends is not None for row in result.tiers):
        console.print(backends_table(result))
        for line in backend_lines(result):
            console.print(escape(line), highlight=False)


def _write_tiers(result: TiersRun, folder: Path, existed: bool) -> Path:
    """tiers.json in `folder`; a run stopped before any tier finished writes nothing, leaves the folder as it
    was and exits (143 for SIGTERM, else 130)."""
    from loadopt.files import atomic_write_text, discard_output
    from loadopt.schema.documents import results_text

    stopped = result.interrupted_by
    if stopped and not result.tiers:
        discard_output(folder, existed)
        err_console.print(f"interrupted ({stopped}) before any tier finished: no results were written",
                          highlight=False, markup=False)
        raise typer.Exit(_stop_code(stopped))
    json_path = folder / "tiers.json"
    atomic_write_text(json_path, results_text(result.document()))
    return json_path


def _stop_code(stopped: str) -> int:
    return Terminated.exit_code if stopped == "SIGTERM" else 130


@app.command()
def tiers(
    config: str = typer.Argument(..., help="The config YAML whose workload (batch size, samples, step time) to serve."),
    tier_names: str = typer.Option(None, "--tiers", help="Comma-separated tier profiles.",
                                   show_default="the config's storage.tier when it is not local, else every profile"),
    au: float = typer.Option(0.9, "--au", help="The mean accelerator utilisation each tier must keep."),
    max_accelerators: int = typer.Option(64, "--max-accelerators", help="Upper bound of the search."),
    readers: int = typer.Option(4, "--readers", help="Reader threads of each consumer."),
    measure: float = typer.Option(3.0, "--measure", help="Seconds measured per trial (after --warmup)."),
    warmup: float = typer.Option(1.0, "--warmup", help="Seconds of warm-up per trial."),
    budget: float = typer.Option(300.0, "--budget", help="Seconds of search per tier."),
    capacity_tb: float = typer.Option(None, "--capacity-tb", help="TB stored, for the cost.",
                                      show_default="the dataset's"),
    out: str = typer.Option("results/tiers", "--out", help="Output folder of tiers.json."),
    backends: bool = typer.Option(True, "--backends/--no-backends", help="Also run every configured backend "
                                  "(arrow and posix decoded and encoded) through each tier, cold: the decision "
                                  "per tier."),
    backend_batches: int = typer.Option(20, "--backend-batches", help="Measured batches per backend and tier."),
    quick: bool = typer.Option(False, "--quick", help="A first look in a few minutes: 1 s trials, 30 s of search "
                                                      "per tier, a shorter probe, up to 8 measured batches per "
                                                      "backend (fewer, or none, where a tier's batches are slow)."),
    set_: list[str] = SetOption,
    relist: bool = RelistOption,
) -> None:
    """For each storage tier: how many emulated accelerators it keeps at the AU threshold, measured and predicted;
    and which backend is fastest through it.

    Examples:
      loadopt tiers resnet50_storage --quick
      loadopt tiers my.yaml --tiers nvme,nfs_10gbe --au 0.9
    """
    from loadopt.bench.distributed import launched_rank
    from loadopt.config import load_config
    from loadopt.files import prepare_output
    from loadopt.procurement.ranks import run_tiers_here

    interrupted: list[bool] = []
    with user_errors(), terminate_as_interrupt(interrupted) as terminated:
        cfg = load_config(config, set_ or [])
        names = _tier_names(cfg, tier_names)
        # Under torchrun rank 0 writes (the other ranks may be on machines without the folder).
        existed = Path(out).expanduser().exists()
        folder = prepare_output(out) if launched_rank() == 0 else Path(out)
        if quick:
            measure, warmup, budget, backend_batches = min(measure, 1.0), min(warmup, 0.5), min(budget, 30.0), \
                min(backend_batches, 8)
        with progress_bar() as progress:
            # Alone, or one rank of `torchrun ... -m loadopt tiers` (each rank one accelerator)
            result = run_tiers_here(cfg, names, au=au, max_accelerators=max_accelerators, readers=readers,
                                    warmup_s=warmup, measure_s=measure, budget_s=budget, capacity_tb=capacity_tb,
                                    progress=RichTiersProgress(progress, terminated, interrupted),
                                    backends_out=str(folder / "backends") if backends else None,
                                    backend_warmup=2 if quick else 3, backend_batches=backend_batches, quick=quick,
                                    relist=relist)
        if result is None:  # a torchrun rank other than 0: rank 0 writes and prints
            return
        json_path = _write_tiers(result, folder, existed)
    _print_tiers(result, readers)
    console.print(f"results: {json_path} ({result.elapsed_s:,.0f} s)", highlight=False)
    auto_report(json_path)
    if result.interrupted_by:
        _say_stopped(result, json_path, result.interrupted_by, _stop_code(result.interrupted_by))
