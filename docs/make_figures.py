"""Remake the pictures of README.md and docs/ from a short real run on this machine.

    python docs/make_figures.py [--work DIR] [--samples 1000] [--skip-runs]

It runs a short `loadopt bench` (torch, arrow, posix on a small synthetic ImageNet-shaped set) and a quick
`loadopt tiers` search, renders the report's own plots (loadopt/report/plots.py) as PNGs into docs/img/,
draws the recipe's crop plan on one of the dataset's images, and writes docs/performance/figures.md: each
picture with the date, the machine, its load and the command that made it. Keep the runs short: the PNGs
show what the plots look like and where the time goes, not a benchmark to quote.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
PAGE = ROOT / "docs" / "performance" / "figures.md"
DPI = 100  # ~800 px wide: readable on a page's column, well under 200 KB a PNG


def run(command: list[str], log: list[dict], work: Path) -> None:
    """Run one loadopt command, recording when, at which load, and what was run (as a reader would type it)."""
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    shown = shlex.join(["python", *command[1:]]).replace(str(work), "$WORK")
    print("+", shown, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    log.append({"command": shown, "started": started.strftime("%Y-%m-%d %H:%M UTC"),
                "minutes": round((dt.datetime.now(dt.timezone.utc) - started).total_seconds() / 60, 1),
                "load": f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}"})


def save(fig: Figure, name: str) -> Path:
    """The figure as a PNG of 256 colours: a third of the bytes of a full-colour one, the plots unchanged
    to the eye, so the repository stays small."""
    path = IMG / name
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", pad_inches=0.08)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path


def report_figures(bench_dir: Path, tiers_dir: Path | None) -> list[Path]:
    """The report's plots of the runs, as PNGs. The public functions of loadopt.report.plots return SVG
    text for the HTML page; their Figure builders are used here under the same style."""
    from loadopt.report import plots
    from loadopt.report.data import load

    made = []
    res = load(bench_dir)
    palette = plots.Palette([r.label for r in res.ranked])
    with matplotlib.rc_context(plots.STYLE):
        made.append(save(plots.ranking_figure(res, palette), "ranking.png"))
        made.append(save(plots.breakdown_figure(res, palette.width), "breakdown.png"))
        made.append(save(plots.over_time_figure(res, palette), "over_time.png"))
        if tiers_dir is not None:
            tiers = load(tiers_dir / "tiers.json", timings=False)
            made.append(save(plots.tier_au_figure(plots.WIDTH_IN, tiers.tiers()), "tiers_au.png"))
    return made


def recipe_figure(dataset_root: Path) -> Path:
    """One stored image with the crop plan's boxes for eight epochs (train) and the eval box: the boxes
    every backend cuts, whatever it reads."""
    from loadopt.loaders.transforms import plan

    first = sorted(p for p in dataset_root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[0]
    image = Image.open(first).convert("RGB")
    width, height = image.size
    colours = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#000000", "#F0E442"]
    with matplotlib.rc_context({"font.size": 9, "font.family": "sans-serif"}):
        fig = Figure(figsize=(8.0, 3.3))
        grid = fig.add_gridspec(2, 6, width_ratios=[3.2, 1, 1, 1, 1, 0.01])
        ax = fig.add_subplot(grid[:, 0])
        ax.imshow(np.asarray(image))
        crops = []
        for epoch, colour in enumerate(colours):
            (left, top, right, bottom), flip = plan(width, height, "train", 0, epoch, 0)
            ax.add_patch(matplotlib.patches.Rectangle((left, top), right - left, bottom - top, fill=False,
                                                      edgecolor=colour, linewidth=1.6))
            ax.text(left + 3, top + 12, f"e{epoch}{' flip' if flip else ''}", color=colour, fontsize=7,
                    bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})
            crop = image.crop((round(left), round(top), round(right), round(bottom))).resize((224, 224),
                                                                                           Image.BILINEAR)
            crops.append((epoch, colour, crop.transpose(Image.FLIP_LEFT_RIGHT) if flip else crop))
        (left, top, right, bottom), _ = plan(width, height, "eval", 0, 0, 0)
        ax.add_patch(matplotlib.patches.Rectangle((left, top), right - left, bottom - top, fill=False,
                                                  edgecolor="white", linewidth=1.2, linestyle="--"))
        ax.set_title(f"{first.parent.name}/{first.name} ({width}x{height}): train boxes of epochs 0-7, "
                     "eval box dashed", fontsize=8, loc="left")
        ax.axis("off")
        for i, (epoch, colour, crop) in enumerate(crops):
            sub = fig.add_subplot(grid[i // 4, 1 + i % 4])
            sub.imshow(np.asarray(crop))
            sub.set_title(f"epoch {epoch}", fontsize=7, color=colour)
            sub.axis("off")
        fig.subplots_adjust(wspace=0.08, hspace=0.2)
        return save(fig, "recipe_crops.png")


def machine_line() -> str:
    from loadopt.machine import machine_info

    info = machine_info()
    gpu = info["gpu"]["name"] if info.get("gpu") else "no GPU"
    return f"{info['cpu_model']}, {info['cpu_count']} cores, {info['ram_gb']} GB RAM, {gpu}"


def load_note(bench_dir: Path) -> str:
    """The bench's own account of how busy the machine was (results.json `machine.load.note`)."""
    load = json.loads((bench_dir / "results.json").read_text()).get("machine", {}).get("load") or {}
    return f"The bench noted: {load['note']}." if load.get("note") else ""


def write_page(log: list[dict], made: list[Path], machine: str, note: str) -> None:
    lines = ["# How the pictures were made", "",
             "Every picture in the README and in these pages comes from `python docs/make_figures.py`, which ran",
             "the commands below on the machine named here; rerun it to remake them. The runs are short on",
             "purpose: the pictures show what each plot says, not figures to quote.", "",
             f"Machine: {machine}. Made {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. `$WORK` is",
             "`--work` (default `$LOADOPT_CACHE/figures`).", "", *([note, ""] if note else []),
             "| command | started | minutes | load average (1 min) before -> after |",
             "| --- | --- | ---: | --- |"]
    lines += [f"| `{e['command']}` | {e['started']} | {e['minutes']} | {e['load']} |" for e in log]
    lines += ["", "Pictures: " + ", ".join(f"`docs/img/{p.name}`" for p in made) + ".", ""]
    PAGE.write_text("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from loadopt.files import cache_dir

    parser.add_argument("--work", type=Path, default=cache_dir() / "figures", help="where the runs write their results")
    parser.add_argument("--samples", type=int, default=1000, help="synthetic images in the dataset")
    parser.add_argument("--skip-runs", action="store_true", help="render from the results already in --work")
    args = parser.parse_args()
    IMG.mkdir(parents=True, exist_ok=True)
    loadopt = [sys.executable, "-m", "loadopt"]
    size = [f"--set=dataset.synthetic.num_samples={args.samples}"]
    bench_dir, tiers_dir = args.work / "bench", args.work / "tiers"
    log_file = args.work / "commands.json"
    log: list[dict] = []
    if not args.skip_runs:
        run(loadopt + ["bench", "configs/imagenet.yaml", "--quick", "--loaders", "torch,arrow,posix",
                       "--set=loaders.torch.num_workers=2", *size, "--out", str(bench_dir)], log, args.work)
        run(loadopt + ["tiers", "configs/imagenet.yaml", "--quick", "--no-backends", "--tiers",
                       "hdd,nfs_10gbe,object_standard", "--max-accelerators", "8", *size, "--out", str(tiers_dir)],
            log, args.work)
        log_file.write_text(json.dumps(log, indent=1))
    else:
        log = json.loads(log_file.read_text())
    made = report_figures(bench_dir, tiers_dir if (tiers_dir / "tiers.json").exists() else None)
    from loadopt.config import load_config
    from loadopt.files import cache_dir
    from loadopt.storage.sources.synthetic import synthetic_root

    config = load_config(ROOT / "configs" / "imagenet.yaml", [size[0].removeprefix("--set=")])
    made.append(recipe_figure(synthetic_root(config.dataset.synthetic, cache_dir())))
    write_page(log, made, machine_line(), load_note(bench_dir))
    for path in made:
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
