"""The shards of a conversion, planned before any is written (storage/forms/shard_work.py `plan_shards`): whole
source shards grouped up to the size, a source shard larger than it cut between samples, a sample larger than
it alone, a reused segment one shard; and the engine's options checked before anything runs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from loadopt.errors import ConfigError
from loadopt.storage.forms import shard_work
from loadopt.storage.forms.engine import ConvertEngine
from loadopt.storage.forms.shard_work import Segment, ShardJob, plan_shards


def spans(jobs: list[ShardJob]) -> list[tuple[int, int]]:
    return [(job.start, job.stop) for job in jobs]


def test_whole_source_shards_are_grouped_up_to_the_size():
    stored = np.full(40, 10, np.int64)  # 10 bytes a sample; source shards of 8 samples (80 bytes)
    bounds = np.arange(0, 41, 8)
    jobs = plan_shards([Segment(0, 40)], stored, bounds, 170)  # two source shards fit, not three
    assert spans(jobs) == [(0, 16), (16, 32), (32, 40)] and [j.k for j in jobs] == [0, 1, 2]


def test_a_source_shard_larger_than_the_size_is_cut_between_samples_and_a_huge_sample_is_alone():
    stored = np.array([10] * 8 + [500] + [10] * 7, np.int64)  # one source shard of 16 samples; sample 8 is huge
    jobs = plan_shards([Segment(0, 16)], stored, np.array([0, 16]), 45)
    assert spans(jobs) == [(0, 4), (4, 8), (8, 9), (9, 13), (13, 16)]
    assert all(stored[a:b].sum() <= 45 or b - a == 1 for a, b in spans(jobs))


def test_a_reused_segment_is_one_shard_and_the_segments_around_it_are_planned():
    stored = np.full(30, 10, np.int64)
    bounds = np.arange(0, 31, 5)
    earlier = Segment(10, 20, {"shard": 3, "first": 0, "samples": 10}, Path("/earlier"))
    jobs = plan_shards([Segment(0, 10), earlier, Segment(20, 30)], stored, bounds, 50)
    assert spans(jobs) == [(0, 5), (5, 10), (10, 20), (20, 25), (25, 30)]
    assert jobs[2].reused is earlier and all(j.reused is None for j in jobs if j is not jobs[2])


def test_a_plan_covers_every_sample_once_in_order():
    rng = np.random.default_rng(3)
    stored = rng.integers(1, 300, 1000).astype(np.int64)
    bounds = np.unique(np.r_[0, np.sort(rng.integers(1, 1000, 30)), 1000])
    jobs = plan_shards([Segment(0, 1000)], stored, bounds, 2000)
    assert jobs[0].start == 0 and jobs[-1].stop == 1000
    assert all(a.stop == b.start for a, b in zip(jobs, jobs[1:], strict=False))
    inner = set(bounds.tolist())
    for job in jobs:  # a cut inside a source shard only where that source shard alone exceeds the size
        if job.stop not in inner:
            owner = bounds[np.searchsorted(bounds, job.start, side="right") - 1]
            after = bounds[np.searchsorted(bounds, job.start, side="right")]
            assert stored[owner:after].sum() > 2000


def test_the_finished_shards_of_the_same_plan_are_kept_in_any_order(tmp_path):
    jobs = [ShardJob(0, 0, 4), ShardJob(1, 4, 8), ShardJob(2, 8, 12)]
    for job in (jobs[2], jobs[0]):  # written out of order, as parallel writers do
        shard_work.write_text(tmp_path / shard_work.entry_name(job.k),
                              f'{{"first": {job.start}, "samples": {job.stop - job.start}}}')
    (tmp_path / shard_work.entry_name(1)).write_text('{"first": 4, "samples": 3}')  # another plan's shard 1
    assert sorted(shard_work.finished_shards(tmp_path, jobs, lambda k, entry: True)) == [0, 2]
    assert sorted(shard_work.finished_shards(tmp_path, jobs, lambda k, entry: k != 2)) == [0]


@pytest.mark.parametrize(("engine", "line"), [
    (("spark", None, None), "--engine spark: unknown (known: local, ray)"),
    (("local", "h:1", None), "--address and --num-cpus are for --engine ray"),
    (("ray", "h:1", 2), "--num-cpus is for a Ray started here: the cluster at --address has its own"),
    (("ray", None, 0), "--num-cpus 0: at least 1"),
])
def test_engine_options_are_one_line(engine, line):
    with pytest.raises(ConfigError, match=re.escape(line)):
        ConvertEngine(*engine)


def test_ray_not_installed_is_one_line(monkeypatch, tmp_path):
    from loadopt.storage.forms import engines as convert_engines

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"--engine ray needs Ray: pip install 'loadopt\[ray\]'"), \
            convert_engines.running(ConvertEngine("ray")):
        pass
