"""The dataset commands of the `loadopt` CLI: `init` (a bundled config written here to edit), `make-dataset`
(generate or check the config's dataset), `import-dlio` (a DLIO workload file as a config), `recompress` (tar
shards' JPEGs as JPEG XL, losslessly) and `convert` (to a backend's format, cached; `--verify` checks it,
`--force` rebuilds it). Thin commands over `loadopt.storage`; registered on the app in `loadopt.cli`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from loadopt.cli.console import (
    RelistOption,
    RichReporter,
    SetOption,
    console,
    progress_bar,
    stopped,
    user_errors,
)
from loadopt.cli.process import terminate_as_interrupt
from loadopt.errors import ConfigError

app = typer.Typer()  # this module's commands; loadopt.cli joins it to the `loadopt` app


@app.command("make-dataset")
def make_dataset(
    config: str = typer.Argument(..., help="The config YAML whose dataset to prepare."),
    set_: list[str] = SetOption,
    relist: bool = RelistOption,
) -> None:
    """Generate (or check) the config's dataset, and nothing else.

    Examples:
      loadopt make-dataset imagenet --set dataset.synthetic.num_samples=1000
    """
    from loadopt.config import load_config
    from loadopt.storage.open import open_dataset

    with user_errors(), terminate_as_interrupt() as terminated:
        cfg = load_config(config, set_ or [])
        with progress_bar() as progress:
            reporter = RichReporter(progress, terminated)
            try:
                dataset = open_dataset(cfg, progress=reporter.dataset_progress, relist=relist)
            except KeyboardInterrupt as exc:  # a generated set is written in a folder of its own, renamed whole
                stopped("before the dataset was ready; the same command goes on from where it stopped (a synthetic "
                        "set from the images already written)", exc, terminated)
    what = {"images": f"images in {len(dataset.classes)} classes", "tokens": f"windows of {cfg.pipeline.seq_len + 1} "
            "tokens", "records": f"records in {len(getattr(dataset, 'files', []))} files"}[dataset.kind]
    console.print(f"{dataset.root}: {len(dataset):,} {what}, mean {dataset.sizes.mean() / 1e3:,.1f} KB, "
                  f"{dataset.sizes.sum() / 1e6:,.1f} MB in all", highlight=False)


@app.command()
def init(
    name: str = typer.Argument("imagenet", help="The bundled config to start from (`loadopt init --list` names them)."),
    out: str = typer.Option(None, "--out", "-o", help="Where to write it.", show_default="NAME.yaml in this folder"),
    list_: bool = typer.Option(False, "--list", help="Name the bundled configs and stop."),
) -> None:
    """Write a bundled config into this folder, to edit and then bench (`loadopt bench NAME.yaml`).

    Examples:
      loadopt init                 # imagenet.yaml: a synthetic ImageNet-shaped set on every backend
      loadopt init serve -o my.yaml
    """
    from loadopt.config import bundled_config, bundled_configs
    from loadopt.files import atomic_write_text

    if list_:
        console.print("\n".join(bundled_configs()), highlight=False)
        return
    with user_errors():
        source = bundled_config(name)
        if source is None:
            raise ConfigError(f"{name}: no bundled config of that name (bundled: {', '.join(bundled_configs())})")
        target = Path(out or f"{source.stem}.yaml")
        if target.exists():
            raise ConfigError(f"{target}: exists already; edit it, or name another file with --out")
        atomic_write_text(target, source.read_text())
    console.print(f"wrote {target} (from the bundled {source.stem}); edit it, then: loadopt bench {target}",
                  highlight=False, markup=False)


@app.command("import-dlio")
def import_dlio(
    workload: str = typer.Argument(..., help="A DLIO workload YAML (e.g. DLIO's configs/workload/unet3d_h100.yaml)."),
) -> None:
    """Print the loadopt config of a DLIO workload file (`> config.yaml`); what has no equivalent is named in
    its header.

    Examples:
      loadopt import-dlio unet3d_h100.yaml > unet3d.yaml
    """
    from loadopt.procurement.dlio import import_dlio as imported

    with user_errors():
        text = imported(workload)
    print(text, end="")


@app.command()
def convert(
    config: str = typer.Argument(..., help="The config YAML whose dataset to convert."),
    to: str = typer.Option(..., "--to", help="The format: arrow or raw (4 KiB-aligned shards)."),
    decoded: bool = typer.Option(False, "--decoded", help="Store decoded uint8 pixels instead of the JPEG bytes."),
    size: int = typer.Option(None, "--size", help="Decoded centre square.", show_default="pipeline.image_size / 0.875"),
    frame: str = typer.Option("auto", "--frame", help="Decoded: whole (longer side <= pipeline.max_side), centre, "
                              "or auto (whole for augment: train)."),
    shard_mib: float = typer.Option(256.0, "--shard-mib", help="Shard file size, MiB (raw, Arrow)."),
    verify: bool = typer.Option(False, "--verify", help="Check every chunk of an existing conversion against its "
                                                        "checksums (and every index and side file), lists the dataset "
                                                        "again and compares the source's content with the digest it "
                                                        "recorded (reads the whole source); reconverts what changed or "
                                                        "is damaged."),
    force: bool = typer.Option(False, "--force", help="Rebuild the conversion even when a finished one exists."),
    engine: str = typer.Option("local", "--engine", help="Who writes the shards: local (this machine's cores) or "
                               "ray (a Ray task per shard; pip install 'loadopt\\[ray]')."),
    address: str = typer.Option(None, "--address", help="Ray: the cluster to join.", show_default="start Ray here"),
    num_cpus: int = typer.Option(None, "--num-cpus", help="Ray started here: its CPUs.", show_default="all"),
    set_: list[str] = SetOption,
    relist: bool = RelistOption,
) -> None:
    """Convert the config's dataset to a backend's format (cached; reused when already done), on this machine or
    across a Ray cluster (docs/scale.md).

    Examples:
      loadopt convert my.yaml --to arrow         # the arrow backend's encoded form
      loadopt convert my.yaml --to raw --decoded --verify  # posix's aligned shards
    """
    from loadopt.config import load_config
    from loadopt.storage.forms import conversions
    from loadopt.storage.forms.engine import ConvertEngine
    from loadopt.storage.open import open_dataset
    from loadopt.storage.sources.tokens import TokenDataset

    with user_errors(), terminate_as_interrupt() as terminated:
        conversions.check_options(to, frame, size, shard_mib)
        writer = ConvertEngine(engine, address, num_cpus)  # type: ignore[arg-type]  # checked there: one line
        cfg = load_config(config, set_ or [])
        with progress_bar() as progress:
            reporter = RichReporter(progress, terminated)
            try:
                # --verify lists the dataset again too: a file rewritten in place or touched changes no
                # folder's mtime, so only its own stat tells.
                dataset = open_dataset(cfg, progress=reporter.dataset_progress, relist=relist or verify)
                form = conversions.converted_form(cfg.pipeline, "decoded" if decoded else "encoded", size,
                                                  frame, isinstance(dataset, TokenDataset), where="--size",
                                                  records=dataset.kind == "records")
                label = f"{conversions.FORMATS[to]} {form.describe()}"  # as the backend names it
                done = conversions.convert(to, dataset, form, shard_mib, on_error=cfg.dataset.on_error,
                                           force=force, verify=verify, engine=writer,
                                           progress=lambda n, total: reporter.conversion_progress(label, n, total))
            except KeyboardInterrupt as exc:  # shards are renamed into place whole, the conversion last
                stopped("before the conversion finished; a conversion there before is as it was, and the same "
                        "command resumes from the shards already written (with --force, it starts again)", exc,
                        terminated)
    how = ("reused: converted earlier" + (", every chunk verified, source unchanged" if verify else "")) \
        if done.reused else f"converted in {done.seconds:.1f} s" + (
            f"; {done.kept} of its {done.shards} shards kept from the conversion before the source changed"
            if done.kept else "")
    where = f"{done.path} (its reference; the shards at {done.data_at})" if done.data_at else f"{done.path}"
    console.print(f"{where}: {done.samples:,} samples, {done.stored}, {done.nbytes / 1e6:,.1f} MB ({how})",
                  highlight=False)
    if done.skipped:
        console.print(f"[yellow]{done.skipped} unreadable file(s) skipped (dataset.on_error: skip); every run "
                      "reports them[/]", highlight=False)



@app.command()
def recompress(
    source: str = typer.Argument(..., help="A folder of WebDataset .tar shards."),
    destination: str = typer.Argument(..., help="The folder to write the recompressed shards to (same names)."),
    workers: int = typer.Option(None, "--workers", help="Shards recompressed at once.", show_default="the cores"),
    force: bool = typer.Option(False, "--force", help="Write every shard again, even one already written."),
) -> None:
    """Rewrite tar shards with each JPEG losslessly recompressed as JPEG XL (pip install 'loadopt\\[jxl]'): about a
    fifth fewer bytes to store and move; loadopt reads each back as the very JPEG (docs/workloads.md).

    Examples:
      loadopt recompress shards/ shards-jxl/ --workers 2
    """
    from pathlib import Path

    from loadopt.storage.forms.recompress import recompress_shards

    with user_errors(), terminate_as_interrupt() as terminated, progress_bar() as progress:
        task = progress.add_task("recompressing shards", total=None)
        try:
            done = recompress_shards(Path(source), Path(destination), workers, force,
                                     progress=lambda n, total: progress.update(task, completed=n, total=total))
        except KeyboardInterrupt as exc:  # each shard is renamed into place whole
            stopped("before every shard was recompressed; the shards written are whole, and the same command "
                    "goes on with the rest", exc, terminated)
    reused = sum(s.reused for s in done.shards)
    console.print(f"{destination}: {len(done.shards)} shards, {done.bytes_before / 1e6:,.1f} MB -> "
                  f"{done.bytes_after / 1e6:,.1f} MB ({1 - done.bytes_after / max(done.bytes_before, 1):.1%} smaller); "
                  f"{done.recompressed:,} JPEGs recompressed, {done.kept:,} kept as they were"
                  + (f"; {reused} shards written before, kept" if reused else ""), highlight=False)
