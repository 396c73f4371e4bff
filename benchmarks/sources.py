"""What reading a shard format costs: the same images as an ImageFolder, as WebDataset tar shards and as
Parquet (the Hugging Face layout), each backend's rate on each, rounds interleaved.

The tar shards are written with WebDataset's `ShardWriter` (`<key>.jpg`, `<key>.cls`), the Parquet files
by pyarrow in the layout Hugging Face `datasets` writes an `Image()` feature (`data/train-0000N-of-0000M
.parquet`, a `{bytes, path}` struct and a ClassLabel `label` named in the `huggingface` metadata). Every
backend runs loader-bound (step time 0) through the harness after its conversion (not timed), warm (the
files it reads read once just before), the formats' order rotated round by round.
Per round, a format's rate ÷ the ImageFolder's on the same backend; the RESULT is the median over rounds:

    RESULT source_cost_<format>_<backend> ratio=<rate on the format / rate on the ImageFolder> target>=0.9
    RESULT loadopt_vs_webdataset_on_tars ratio=<loadopt's fastest path delivering the config's training
        input, from the tars / WebDataset's own loader on the same tars> target>=1.5

    python benchmarks/sources.py [--config configs/imagenet.yaml] [--batches 30] [--rounds 5] [--backends ...]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from _common import REPO, build_loader, harness_run, ratio_result, spread

# backend: its settings (one point each: the bench compares formats, not settings)
BACKENDS: dict[str, dict] = {
    "torch": {"variant": "tuned", "num_workers": 2},
    "arrow": {"form": "encoded", "threads": 2},
    "arrow-decoded": {"form": "decoded", "threads": 2},
    "posix": {"form": "decoded"},
    "dali": {"num_threads": 2, "decoder": "cpu", "reader": "external"},
    "webdataset": {"num_workers": 2},
}
PEERS = ("webdataset",)


def write_tar_shards(dataset, folder: Path, per_shard: int = 500) -> Path:
    """The dataset's samples as WebDataset shards `train-NNNNNN.tar`, written by its ShardWriter."""
    import webdataset as wds

    done = folder / "DONE"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for index in range(len(dataset)):
            sink.write({"__key__": f"s{index:07d}", "jpg": dataset.read(index), "cls": int(dataset.labels[index])})
    done.write_text("")
    return folder


def write_hub_parquet(dataset, folder: Path, files: int = 4, rows_per_group: int = 256) -> Path:
    """The dataset's samples as a Hugging Face hub folder of Parquet files (`data/train-*.parquet`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / "DONE"
    if done.exists():
        return folder
    (folder / "data").mkdir(parents=True, exist_ok=True)
    per_file = -(-len(dataset) // files)
    features = {"image": {"_type": "Image"}, "label": {"names": list(dataset.classes), "_type": "ClassLabel"}}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for number in range(files):
        rows = range(number * per_file, min(len(dataset), (number + 1) * per_file))
        table = pa.table({"image": pa.array([{"bytes": dataset.read(i), "path": f"s{i:07d}.jpg"} for i in rows],
                                            type=image_type),
                          "label": pa.array([int(dataset.labels[i]) for i in rows], pa.int64())})
        table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
        pq.write_table(table, folder / "data" / f"train-{number:05d}-of-{files:05d}.parquet",
                       row_group_size=rows_per_group)
    done.write_text("")
    return folder


def format_configs(config_path: str):
    """The config on the ImageFolder, the tar shards and the Parquet files of the same samples."""
    import yaml

    from loadopt.config import config_from_dict
    from loadopt.files import cache_dir
    from loadopt.storage.open import open_dataset

    raw = yaml.safe_load(Path(config_path).read_text())
    folder_config = config_from_dict(raw, config_path)
    dataset = open_dataset(folder_config)
    work = cache_dir() / "bench-sources" / dataset.fingerprint
    paths = {"imagefolder": dataset.root, "webdataset": str(write_tar_shards(dataset, work / "shards")),
             "parquet": str(write_hub_parquet(dataset, work / "hub"))}
    configs = {}
    for name, path in paths.items():
        dataset_section = {**raw["dataset"], "path": path, "format": name}
        configs[name] = config_from_dict({**raw, "dataset": dataset_section}, config_path)
    return configs, len(dataset)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args()

    from loadopt import recipe
    from loadopt.loaders.registry import backend_class

    configs, samples = format_configs(args.config)
    names = [b for b in args.backends.split(",") if b]
    usable = []
    for name in names:
        ok, why = backend_class(name.split("-")[0]).available()
        if ok:
            usable.append(name)
        else:
            print(f"{name}: not measured ({why})")
    load = os.getloadavg()[0]
    print(f"{samples} images as an ImageFolder, tar shards and Parquet; {args.rounds} rounds of {args.batches} "
          f"batches, backends {', '.join(usable)}; load average {load:.2f} at the start", flush=True)
    rates: dict[tuple[str, str], list[float]] = {}
    same_input: dict[str, bool] = {}
    from loadopt.bench.attribution.stages import warm_files

    formats = list(configs)
    for round_index in range(args.rounds):
        # each round starts the formats at another one: no format always runs first (or after the same one)
        order = formats[round_index % len(formats):] + formats[:round_index % len(formats)]
        for name in usable:
            for source in order:
                config = configs[source]
                loader = build_loader(config, name.split("-")[0], **BACKENDS[name])
                loader.prepare()  # the conversion, not timed
                warm_files(loader.storage_files())  # warm: every file this loader reads is in the page cache
                if source == "webdataset":  # the config's training input (the order aside: a library's own)
                    want = {**recipe.wanted(config.pipeline), "order": "any"}
                    same_input[name] = not recipe.differences({**loader.recipe(), "order": "any"}, want)
                rate = harness_run(loader, args.batches, epoch=round_index).metrics["samples_per_s"]
                rates.setdefault((name, source), []).append(rate)
                print(f"round {round_index + 1} {name:14s} {source:12s} {rate:8,.0f} samples/s", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for name in usable:
        for source in configs:
            print(f"{name:14s} {source:12s} {spread(rates[(name, source)], ',.0f')} samples/s")
    lines = []
    for name in usable:
        for source in ("webdataset", "parquet"):
            ratios = [f / i for f, i in zip(rates[(name, source)], rates[(name, "imagefolder")], strict=True)]
            lines.append(ratio_result(f"source_cost_{source}_{name}", ratios, ">=", 0.9))
    ours = [n for n in usable if n not in PEERS and same_input.get(n)]
    if "webdataset" in usable and ours:
        best = [max(rates[(n, "webdataset")][r] for n in ours) / rates[("webdataset", "webdataset")][r]
                for r in range(args.rounds)]
        print(f"loadopt's paths delivering the config's input from the tars: {', '.join(ours)}")
        lines.append(ratio_result("loadopt_vs_webdataset_on_tars", best, ">=", 1.5))
    print("\n".join(lines))
    return 0 if all(line.endswith("pass") for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
