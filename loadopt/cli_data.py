"""The dataset commands of the `loadopt` CLI: `make-dataset` (generate or check the config's dataset) and
`convert` (to a backend's format, cached; `--verify` checks it, `--force` rebuilds it). Thin commands over
loadopt/storage/; registered on the app of loadopt/cli.py when that module imports this one.
"""

from __future__ import annotations

from typing import Any

import typer

from loadopt.cli import RichReporter, SetOption, app, console, progress_bar, user_errors


@app.command("make-dataset")
def make_dataset(
    config: str = typer.Argument(..., help="The config YAML whose dataset to prepare."),
    set_: list[str] = SetOption,
) -> None:
    """Generate (or check) the config's dataset, and nothing else."""
    from loadopt.config import load_config
    from loadopt.storage.imagefolder import open_dataset

    with user_errors():
        cfg = load_config(config, set_ or [])
        with progress_bar() as progress:
            reporter = RichReporter(progress)
            dataset = open_dataset(cfg, progress=reporter.dataset_progress)
    console.print(f"{dataset.root}: {len(dataset):,} images in {len(dataset.classes)} classes, "
                  f"mean {dataset.sizes.mean() / 1e3:,.1f} KB, {dataset.sizes.sum() / 1e6:,.1f} MB in all",
                  highlight=False)


@app.command()
def convert(
    config: str = typer.Argument(..., help="The config YAML whose dataset to convert."),
    to: str = typer.Option(..., "--to", help="The format: arrow or raw (4 KiB-aligned shards)."),
    decoded: bool = typer.Option(False, "--decoded", help="Store decoded uint8 pixels instead of the JPEG bytes."),
    size: int = typer.Option(None, "--size", help="Decoded centre square (default: pipeline.image_size / 0.875)."),
    frame: str = typer.Option("auto", "--frame", help="Decoded: whole (longer side <= pipeline.max_side), centre, "
                              "or auto (whole for augment: train)."),
    shard_mib: float = typer.Option(256.0, "--shard-mib", help="Shard file size of the raw format, MiB."),
    verify: bool = typer.Option(False, "--verify", help="Check every chunk of an existing conversion against its "
                                                        "checksums and the source's content against the digest it "
                                                        "recorded (reads the whole source); reconverts on a change."),
    force: bool = typer.Option(False, "--force", help="Rebuild the conversion even when a finished one exists."),
    set_: list[str] = SetOption,
) -> None:
    """Convert the config's dataset to a backend's format (cached; reused when already done)."""
    import time

    from loadopt.config import load_config
    from loadopt.errors import ConfigError
    from loadopt.loaders.arrow_loader import ArrowLoader, ArrowSettings
    from loadopt.loaders.posix_loader import PosixLoader, PosixSettings
    from loadopt.storage import arrow_format, raw_format
    from loadopt.storage.imagefolder import open_dataset

    with user_errors():
        if to not in ("arrow", "raw"):
            raise ConfigError(f"--to {to}: unknown format (known: arrow, raw)")
        cfg = load_config(config, set_ or [])
        form = "decoded" if decoded else "encoded"
        if frame not in ("auto", "whole", "centre"):
            raise ConfigError(f"--frame {frame}: unknown (known: auto, whole, centre)")
        if to == "raw":
            settings, cls = PosixSettings(form=form, decoded_size=size, frame=frame, shard_mib=shard_mib), PosixLoader
        else:
            settings, cls = ArrowSettings(form=form, decoded_size=size, frame=frame), ArrowLoader
        with progress_bar() as progress:
            reporter = RichReporter(progress)
            dataset = open_dataset(cfg, progress=reporter.dataset_progress)
            loader = cls(dataset, cfg.pipeline, settings)  # what the backend would read: form and size
            stored = getattr(loader, "stored_form", loader.form)
            path = raw_format.raw_path(dataset, stored, loader.size, shard_mib) if to == "raw" else \
                arrow_format.arrow_path(dataset, stored, loader.size)
            existed = (path / "index.npz").exists() if to == "raw" else path.exists()
            before = _mtime(path / "index.npz" if to == "raw" else path)
            start = time.perf_counter()
            step = lambda done, total: reporter.conversion_progress(loader.describe(), done, total)  # noqa: E731
            options = {"progress": step, "on_error": cfg.dataset.on_error, "force": force, "verify": verify}
            if to == "raw":
                raw_format.convert(dataset, stored, loader.size, shard_mib, **options)
                skipped = len(raw_format.open_raw(path, dataset, stored, loader.size, shard_mib).meta["skipped"])
            else:
                arrow_format.convert(dataset, stored, loader.size, **options)
                skipped = len(arrow_format.open_arrow(path, dataset, stored, loader.size).skipped)
            seconds = time.perf_counter() - start
            loader.close()
    reused = existed and _mtime(path / "index.npz" if to == "raw" else path) == before
    nbytes = sum(f.stat().st_size for f in path.iterdir()) if to == "raw" else path.stat().st_size
    how = ("reused: converted earlier" + (", every chunk verified, source unchanged" if verify else "")) if reused \
        else f"converted in {seconds:.1f} s"
    console.print(f"{path}: {len(dataset):,} samples, {stored}, {nbytes / 1e6:,.1f} MB ({how})", highlight=False)
    if skipped:
        console.print(f"[yellow]{skipped} unreadable file(s) skipped (dataset.on_error: skip); every run reports "
                      "them[/]", highlight=False)


def _mtime(path: Any) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None
