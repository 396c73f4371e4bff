"""What benchmarks/webscale.py and benchmarks/webscale_remote.py share: the record sets they generate, a config written
to a file for a fresh process, and a sample count as a RESULT line names it."""

from __future__ import annotations

from pathlib import Path

from _common import REPO


def records_config(folder: Path, samples: int):
    from loadopt.config import load_config

    files = max(1, samples // 1000)
    overrides = ["dataset.kind=records", "dataset.records.record_bytes=512", "dataset.records.delivered_bytes=512",
                 "dataset.records.record_bytes_stdev=0", "dataset.records.scale=1", "workload.accelerator=null",
                 "dataset.records.samples_per_file=1000", f"dataset.records.num_files={files}",
                 "dataset.records.file_format=raw", "pipeline.shuffle=window", "pipeline.batch_size=64",
                 f"report.out={folder / 'results'}"]
    return load_config(REPO / "configs" / "imagenet.yaml", overrides)


def config_file(folder: Path, config) -> Path:
    import yaml

    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return path


def count_label(samples: int) -> str:
    return f"{samples // 1_000_000}m" if samples >= 1_000_000 else f"{samples // 1000}k"
