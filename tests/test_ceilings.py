"""The ceilings each run is held to (bench/attribution/ceilings.py), measured on this machine: positive and named, the
storage read within its budget, decode rates in worker processes of one thread, the better of the
measurements before and after the loaders, and the busy-machine note beside them."""

from __future__ import annotations

import pytest
import torch

from loadopt.bench.attribution.ceilings import measure_ceilings
from loadopt.config import config_from_dict
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict


def test_ceilings_measured_on_the_tiny_config_are_positive_and_named(tmp_path):
    config = config_from_dict(tiny_config_dict(tmp_path / "out"), "tiny.yaml")
    ceilings = measure_ceilings(config, open_dataset(config), torch.device("cpu"))
    for rate in (ceilings.memcpy, ceilings.storage):
        assert rate.name and rate.bytes_per_s > 0
    assert ceilings.compute.name and ceilings.compute.samples_per_s > 0
    for key in ("pil", "fast"):
        assert ceilings.decode.rate(key).samples_per_s > 0 and ceilings.decode.rate(key).decoder
    crop = ceilings.crop_resize  # the loaders' own primitive on frames stored as the decoded forms store them
    assert crop.samples_per_s > 0 and crop.primitive == "loadopt.loaders.crops.crop_frames"
    assert crop.max_side == config.pipeline.max_side and 0 < crop.mean_frame_pixels <= 512 * 512
    assert crop.how.endswith("one intra-op thread each") or crop.how.startswith("one thread")
    assert ceilings.h2d.skipped  # no CUDA here
    assert ceilings.job.demand_samples_per_s == 8 / 0.002


def test_storage_reads_only_the_budget_of_a_file_larger_than_it(tmp_path):
    from types import SimpleNamespace

    from loadopt.bench.attribution.ceilings import storage_bandwidth

    big = tmp_path / "corpus.bin"
    big.write_bytes(b"\0" * (3 << 20))
    found = storage_bandwidth(SimpleNamespace(local_files=lambda: [str(big)]), budget_bytes=1 << 20)
    assert found.bytes == 1 << 20 and found.bytes_per_s > 0


def test_decode_rate_in_worker_processes_runs_one_intra_op_thread_in_each():
    from loadopt.bench.attribution.parallel import rate_in_workers

    def work(_index: int) -> None:
        if torch.get_num_threads() != 1:
            raise AssertionError("a measuring process runs more than one intra-op thread")
        sum(range(2000))

    measured = rate_in_workers(work, workers=2, seconds=0.2)
    assert measured["workers"] == 2 and measured["samples"] > 2 and measured["samples_per_s"] > 0

    def fails(_index: int) -> None:
        raise ValueError("broken")

    try:
        rate_in_workers(fails, workers=2, seconds=0.2)
    except RuntimeError as exc:
        assert "measuring processes gave no" in str(exc)
    else:
        raise AssertionError("a measurement whose processes all failed gave a rate")


def test_keep_best_keeps_the_higher_measurement_of_each_ceiling_and_both_values(tmp_path):
    from loadopt.bench.attribution.ceilings import keep_best
    from loadopt.schema.ceilings import Ceilings, written

    config = config_from_dict(tiny_config_dict(tmp_path / "out"), "tiny.yaml")
    dataset = open_dataset(config)
    low = {"memcpy": {"name": "memory copy bandwidth", "bytes_per_s": 1.0},
           "storage": {"name": "storage sequential read", "bytes_per_s": 1e15},
           "decode": {"cores": 2, "workers": 2, "pil": {"decoder": "pil", "samples_per_s": 0.5},
                      "fast": {"decoder": "simplejpeg", "samples_per_s": 1e9}}}
    low["crop_resize"] = {"name": "crop + resize of stored frames", "samples_per_s": 0.5, "workers": 1}
    best = written(keep_best(Ceilings.model_validate(low), config, dataset))
    assert best["crop_resize"]["samples_per_s"] > 0.5 and best["crop_resize"]["measured"]["before"] == 0.5
    assert best["crop_resize"]["workers"] == 1
    assert best["memcpy"]["bytes_per_s"] > 1.0 and best["memcpy"]["measured"]["before"] == 1.0
    assert best["storage"]["bytes_per_s"] == 1e15 and best["storage"]["measured"]["after"] < 1e15
    assert best["decode"]["pil"]["samples_per_s"] > 0.5 and best["decode"]["fast"]["samples_per_s"] == 1e9
    assert best["decode"]["pil"]["how"].startswith("2 worker processes")


def test_others_cpu_share_and_the_busy_note():
    from loadopt.bench.monitor import MachineLoad, load_note, others_share

    assert others_share(busy_s=3.0, own_s=1.0, wall_s=2.0, cores=2) == 0.5
    assert others_share(busy_s=1.0, own_s=1.5, wall_s=2.0, cores=2) == 0.0  # never negative
    assert others_share(1.0, 0.0, 0.0, 2) is None
    quiet = {"busy": False, "cores": 2, "others_cpu_share": {"mean": 0.05, "max": 0.1}}
    assert load_note(quiet) is None and load_note(None) is None
    busy = {"busy": True, "cores": 2, "others_cpu_share": {"mean": 0.6, "max": 0.9},
            "load_average_1m": {"mean": 3.0, "max": 4.2}}
    assert "busy" in load_note(busy) and "60%" in load_note(busy) and "4.2" in load_note(busy)
    summary = MachineLoad(interval_s=0.05).start().stop()
    assert summary["samples"] >= 2 and 0.0 <= summary["others_cpu_share"]["mean"] <= 1.0
    assert isinstance(summary["busy"], bool) and summary["load_average_1m"]["max"] >= 0


def test_the_ceilings_window_from_the_environment(monkeypatch):
    from loadopt.bench.attribution.ceilings import ceiling_seconds
    from loadopt.errors import ConfigError

    monkeypatch.delenv("LOADOPT_CEILING_SECONDS")
    assert ceiling_seconds() == 1.0
    monkeypatch.setenv("LOADOPT_CEILING_SECONDS", "0.5")
    assert ceiling_seconds() == 0.5
    for bad in ("fast", "0", "-1", "nan", "1e9"):
        monkeypatch.setenv("LOADOPT_CEILING_SECONDS", bad)
        with pytest.raises(ConfigError, match=r"^LOADOPT_CEILING_SECONDS=.*: expected seconds between 0.01 and 60$"):
            ceiling_seconds()
