"""Stages run apart (bench/attribution/stages.py): a loader slowed in decode is prep-bound, a slow tier fetch-bound, and
the stage verdict on constructed stages."""

from __future__ import annotations

import pytest
import torch

from loadopt.bench.attribution.ceilings import measure_ceilings
from loadopt.config import config_from_dict
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict


def stage_case(tmp_path, cache: str, loaders=None):
    raw = tiny_config_dict(tmp_path / "out", loaders=loaders or {"torch": {"variant": "tuned", "num_workers": 0}},
                           storage={"cache": cache}, workload={"step_time_ms": 1, "warmup_batches": 2,
                                                               "measure_batches": 12})
    return config_from_dict(raw, "stages.yaml")


def stages_of(config):
    from loadopt.bench.attribution import stages
    from loadopt.loaders.registry import backend_class

    dataset = open_dataset(config)
    device = torch.device("cpu")
    name, settings = next(iter(config.loaders.items()))
    cls = backend_class(name)
    cls(dataset, config.pipeline, cls.Settings(**settings)).prepare()  # the conversion, as the bench's plan does
    ceilings = measure_ceilings(config, dataset, device)
    return stages.measure_stages(config, dataset, device, name, settings, f"{name} {settings}", ceilings)


@pytest.mark.timing  # rates of sleeps and of a short loop: a busy machine stretches them
def test_stages_name_decode_when_the_decoder_is_slow(tmp_path, monkeypatch):
    """A loader made slow on purpose in decode: 10 ms a sample, in decode alone and in the loader's 2 workers
    (forked: they inherit the slow decoder)."""
    import time

    from loadopt.loaders import transforms

    real = transforms.write_sample

    def slow_write(*args, **kwargs):
        time.sleep(0.010)
        return real(*args, **kwargs)

    monkeypatch.setattr(transforms, "write_sample", slow_write)
    # persistent workers: the 6-batch epochs of the tiny dataset would otherwise restart them every 6 batches
    found = stages_of(stage_case(tmp_path, "cold", {"torch": {"variant": "tuned", "num_workers": 2,
                                                              "persistent_workers": True}}))
    stages = found.stages
    assert found.bottleneck == "prep-bound", found.text
    assert stages.prep.samples_per_s < 250 < stages.storage.samples_per_s  # decode, not the disk
    # The loader: 2 workers x 100 samples/s, plus at most the 4 batches its workers prefetched (2 each) and the
    # 2 they were making when the 12 measured began (265 and 272 read with a 4-batch bound; 700+ unslowed).
    most = 2 / 0.010 * (12 + 6) / 12 * 1.01
    assert stages.loader_warm.samples_per_s < most and stages.loader_cold.samples_per_s < most
    assert "decode" in found.text and "the job needs 8,000 samples/s" in found.text


@pytest.mark.timing  # rates of sleeps and of a short loop: a busy machine stretches them
def test_stages_name_the_fetch_when_the_tier_is_slow(tmp_path, monkeypatch):
    """A tier made slow on purpose: 1 MB/s shared by every read of the raw shards (the posix loader's
    preadv threads and the storage-alone stage), one read at a time, as a link of that bandwidth would."""
    import threading
    import time

    from loadopt.bench.attribution import stages
    from loadopt.loaders.shard_reader import PosixReader

    rate, link = 1e6, threading.Lock()
    real_read, real_file = PosixReader.read, stages._read_file

    def slow_read(self, shard, offset, out):
        with link:
            time.sleep(len(memoryview(out).cast("B")) / rate)
        return real_read(self, shard, offset, out)

    def slow_file(path, limit):
        nbytes = real_file(path, limit)
        with link:
            time.sleep(nbytes / rate)
        return nbytes

    monkeypatch.setattr(PosixReader, "read", slow_read)
    monkeypatch.setattr(stages, "_read_file", slow_file)
    found = stages_of(stage_case(tmp_path, "cold", {"posix": {"form": "decoded", "io_threads": 4}}))
    s = found.stages
    assert found.bottleneck == "fetch-bound", found.text
    assert s.storage.bytes_per_s < 1.3e6 and s.storage.samples_per_s < s.prep.samples_per_s
    assert "the storage reads 1 MB/s" in found.text and "a faster tier" in found.text
    assert "stayed cached" not in s.loader_cold.note, s.loader_cold.note  # the cold run read the tier


def test_stage_verdict_on_constructed_stages():
    from loadopt.bench.attribution import stages
    from loadopt.schema.ceilings import Job, Stages

    def stage_verdict(measured: dict, job: dict) -> stages.StageVerdict:
        """`stages.stage_verdict` on stages and a job written as results.json holds them."""
        return stages.stage_verdict(Stages.model_validate(measured), Job.model_validate(job))

    job = {"demand_samples_per_s": 2560.0, "cache": "warm", "device": "cpu"}
    base = {"compute": {"samples_per_s": 2560.0},
            "storage": {"samples_per_s": 5000.0, "bytes_per_s": 550e6, "bytes_per_sample": 110e3},
            "prep": {"kind": "prep-bound", "samples_per_s": 700.0, "words": "2 cores decode 700 img/s", "lift": "x"}}

    def run(rate, stall, wait_ms=20.0, finish_ms=1.0):
        return {"samples_per_s": rate, "stall_fraction": stall, "wait_ms": wait_ms, "finish_ms": finish_ms}

    assert stage_verdict({**base, "loader_warm": run(2550, 0.01), "loader_cold": run(2500, 0.02)},
                         job).bottleneck == "compute-bound"
    assert stage_verdict({**base, "loader_warm": run(680, 0.7), "loader_cold": run(650, 0.7)},
                         job).bottleneck == "prep-bound"
    short = stage_verdict({**base, "loader_warm": run(300, 0.8), "loader_cold": run(290, 0.8)}, job)
    assert short.bottleneck == "loader-bound" and "43% of that capacity" in short.text
    slow_finish = {"loader_warm": run(1200, 0.5, 0.5, 12.0), "loader_cold": run(1100, 0.5)}
    # A decoded form (copy-bound preparation): finishing on the device is the stall.
    copying = {**base, "prep": {**base["prep"], "kind": "copy-bound"}}
    assert stage_verdict({**copying, **slow_finish}, job).bottleneck == "finish-bound"
    # A decoding loader on the emulated device: decoding and finishing share the CPU's cores.
    shared = stage_verdict({**base, **slow_finish}, job)
    assert shared.bottleneck == "cpu-bound" and "share the same cores" in shared.text
    assert stage_verdict({**base, **slow_finish}, {**job, "device": "cuda"}).bottleneck == "finish-bound"
    slow_disk = {**base, "storage": {"samples_per_s": 200.0, "bytes_per_s": 22e6, "bytes_per_sample": 110e3}}
    cold = stage_verdict({**slow_disk, "loader_warm": run(680, 0.7), "loader_cold": run(190, 0.9)},
                         {**job, "cache": "cold"})
    assert cold.bottleneck == "fetch-bound" and "22 MB/s" in cold.text
    warm = stage_verdict({**slow_disk, "loader_warm": run(680, 0.7), "loader_cold": run(190, 0.9)}, job)
    assert warm.bottleneck == "prep-bound" and "cold it would be fetch-bound" in warm.text
