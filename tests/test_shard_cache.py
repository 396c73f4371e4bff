"""The bounded local cache of remote shards (`storage.cache_limit`, storage/remote/shard_cache.py): a first epoch
fetches each shard once, a second asks the storage nothing; the folder never holds more than the limit and
evicts the least recently used copy; fetching ahead never evicts a file it is about to need; processes
sharing the cache end with intact copies; a killed fetch's temporary file is cleaned up."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from loadopt import make_loader
from loadopt.config import config_from_dict
from loadopt.config_models import byte_size
from loadopt.storage.open import open_dataset
from loadopt.storage.remote.shard_cache import ShardCacheFileSystem, shard_files_in_order
from loadopt.storage.sources.shards import shard_table
from loadopt.storage.tiers.spec import TierSpec
from loadopt.storage.tiers.stack import tier_counters, tier_filesystem

from .cache_serving import (
    CountingHandler,
    cache_config,
    cache_counters_of,
    folder_bytes,
)
from .servers import s3_endpoint  # noqa: F401 - s3_endpoint is a fixture

pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")


@pytest.mark.parametrize("form", ["shards", "hub"])
def test_a_second_epoch_asks_the_storage_nothing(served, own_cache, form):
    url, root = served
    dataset = open_dataset(cache_config(f"{url}/{form}", "10MB"))
    assert isinstance(dataset.fs, ShardCacheFileSystem)
    files = sorted((root / form).rglob("*.tar" if form == "shards" else "*.parquet"))
    before, asked = tier_counters(dataset.fs), CountingHandler.requests
    first = [dataset.read(i) for i in range(len(dataset))]
    after = tier_counters(dataset.fs)
    fetched = after["bytes"] - before["bytes"]
    # each file once, whole: Parquet files by the first epoch; tars already by their indexing (which reads them
    # whole, through the cache), so the first epoch reads the copies
    assert fetched == (0 if form == "shards" else sum(f.stat().st_size for f in files))
    assert after["cache_fetched_files"] == (0 if form == "shards" else len(files))
    assert after["cache_uncached_reads"] == 0
    print(f"{form}: epoch 1 fetched {fetched:,} bytes in {after['requests'] - before['requests']:.0f} tier "
          f"requests ({CountingHandler.requests - asked} at the server) for {len(files)} files")
    asked = CountingHandler.requests
    reopened = open_dataset(cache_config(f"{url}/{form}", "10MB"))  # as the next job would (its listing is saved)
    assert CountingHandler.requests == asked
    second = [reopened.read(i) for i in range(len(reopened))]
    again = tier_counters(reopened.fs)
    assert second == first and CountingHandler.requests == asked  # not one request
    assert again["bytes"] == again["requests"] == again["cache_fetched_files"] == 0 and again["cache_hit_reads"] > 0
    print(f"{form}: epoch 2 fetched {again['bytes']:.0f} bytes, 0 requests at the server; "
          f"{again['cache_hit_reads']:.0f} reads from the copies")
    local = open_dataset(cache_config(str(root / form)))
    assert first == [local.read(i) for i in range(len(local))]


def test_s3_shards_are_fetched_once(served, s3_endpoint, own_cache):  # noqa: F811 - the fixture imported above
    import s3fs

    _, root = served
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("loadopt-cache")
    fs.put(f"{root / 'shards'}/", "loadopt-cache/shards/", recursive=True)
    open_dataset(cache_config("s3://loadopt-cache/shards"))  # listed and indexed (saved) without the cache
    dataset = open_dataset(cache_config("s3://loadopt-cache/shards", "10MB"))
    sizes = sum(p.stat().st_size for p in (root / "shards").glob("*.tar"))
    for epoch in range(2):
        before = tier_counters(dataset.fs)
        [dataset.read(i) for i in range(len(dataset))]
        after = tier_counters(dataset.fs)
        assert after["bytes"] - before["bytes"] == (sizes if epoch == 0 else 0)
    assert after["requests"] == before["requests"]  # the second epoch: none
    assert after["cache_fetched_files"] == 4 and after["requests"] == 4  # one request a shard (under 8 MiB)


def _tier(url: str, own_cache: Path, limit: int, **tier) -> tuple[ShardCacheFileSystem, list[str]]:
    """A cache of `limit` bytes over the shards at `url` (its own folder), and the shards' names."""
    base = fsspec.filesystem("http")
    fs = ShardCacheFileSystem(tier_filesystem(TierSpec(**tier), base), own_cache / "shards-here", limit, "v1")
    return fs, [f"{url}/shards/train-{k:06d}.tar" for k in range(4)]


def _sizes(root: Path) -> list[int]:
    return [(root / "shards" / f"train-{k:06d}.tar").stat().st_size for k in range(4)]


def test_the_least_recently_used_copy_is_evicted_and_the_folder_stays_within_the_limit(served, own_cache):
    url, root = served
    sizes = _sizes(root)
    limit = sorted(sizes)[-1] + sorted(sizes)[-2] + 1024  # room for two shards, never three
    assert sum(sorted(sizes)[:3]) > limit
    fs, names = _tier(url, own_cache, limit)
    fs.cat_file(names[0], 0, 512)
    fs.cat_file(names[1], 0, 512)
    fs.cat_file(names[0], 512, 1024)  # shard 0 used last: shard 1 is the least recently used
    fs.cat_file(names[2], 0, 512)
    assert fs.copy_path(names[0]).exists() and fs.copy_path(names[2]).exists()
    assert not fs.copy_path(names[1]).exists()
    counts = cache_counters_of(fs)
    assert counts.evicted_files == 1 and counts.evicted_bytes == sizes[1] and counts.fetched_files == 3
    assert folder_bytes(fs.store.folder) <= limit


def test_a_loader_through_a_two_shard_cache_keeps_within_it(served, own_cache):
    url, root = served
    sizes = _sizes(root)
    limit = sorted(sizes)[-1] + sorted(sizes)[-2] + 1024
    config = cache_config(f"{url}/shards", limit)
    loader = make_loader(config, backend="torch", num_workers=2, shuffle="global")
    folder, most, batches = None, 0, 0
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for _ in loader:
                folder = folder or loader.dataset.fs.store.folder
                most = max(most, folder_bytes(folder))
                assert most <= limit, f"{most:,} bytes in the cache folder, limit {limit:,}"
                batches += 1
        counts = loader.dataset.fs.cache_counters()
    finally:
        loader.close()
    assert counts.evicted_files > 0 and counts.hit_reads + counts.miss_reads == 24
    print(f"limit {limit:,} bytes: at most {most:,} in the folder over {batches} batches; {counts}")


def test_fetching_ahead_never_evicts_a_file_earlier_in_its_list(served, own_cache):
    url, root = served
    sizes = _sizes(root)
    limit = sorted(sizes)[-1] + sorted(sizes)[-2] + 1024
    fs, names = _tier(url, own_cache, limit, latency_ms=40)
    fs.prefetch(names, concurrency=2)
    in_flight = 0
    while not fs.wait_ahead(0.005):
        in_flight = max(in_flight, len(list((fs.store.folder / "tmp").iterdir())))
    assert fs.wait_ahead(20) and 1 <= in_flight <= 2  # at most `concurrency` fetches at once
    assert [fs.copy_path(n).exists() for n in names] == [True, True, False, False]
    counts = cache_counters_of(fs)
    assert counts.ahead_files == 2 and counts.ahead_bytes == sizes[0] + sizes[1] and counts.evicted_files == 0
    fs.cat_file(names[3], 0, 10)  # read on demand: evicts shard 0, the least recently used
    fs.prefetch([names[1], names[2], names[0]])
    assert fs.wait_ahead(20)  # shard 2 may evict shard 3 (not in the list), then shard 0 would take shard 1
    assert [fs.copy_path(n).exists() for n in names] == [False, True, True, False]
    assert folder_bytes(fs.store.folder) <= limit
    fs.close()


def test_a_bench_reports_the_caches_counters_with_the_tiers(served, own_cache, tmp_path):
    from loadopt.bench.runner import run_bench

    from .conftest import tiny_config_dict

    url, root = served
    raw = tiny_config_dict(tmp_path / "out", dataset={"path": f"{url}/shards"}, storage={"cache_limit": "1MiB"},
                           loaders={"torch": {"num_workers": 0}}, pipeline={"batch_size": 4, "image_size": 24},
                           workload={"warmup_batches": 0, "measure_batches": 3, "repeats": 2})
    run_bench(config_from_dict(raw, "cached.yaml"), attribute=False)
    (run,) = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    counters = run["tier_counters"]
    assert run["status"] == "ok" and run["bytes_source"] == "tier local (as it is) over http://"
    assert counters["cache_hit_reads"] + counters["cache_miss_reads"] == 24  # 2 repeats of 3 batches of 4
    assert counters["bytes"] <= sum(_sizes(root)) and counters["cache_fetched_files"] <= 4


def _child_reads(fs: ShardCacheFileSystem, names: list[str], seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        name = rng.choice(names)
        start = rng.randrange(0, 4096)
        assert len(fs.cat_file(name, start, start + 700)) == 700
        with fs.open(name, "rb") as handle:
            handle.seek(start)
            assert len(handle.read(100)) == 100


def test_processes_sharing_the_cache_fetch_each_file_once_and_leave_it_intact(served, own_cache):
    url, root = served
    fs, names = _tier(url, own_cache, 10 << 20)
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=_child_reads, args=(pickle.loads(pickle.dumps(fs)), names, seed))
                for seed in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0, 0]
    for name, k in zip(names, range(4), strict=True):
        assert fs.copy_path(name).read_bytes() == (root / "shards" / f"train-{k:06d}.tar").read_bytes()
    assert not list((fs.store.folder / "tmp").iterdir())
    counts = tier_counters(fs)
    assert counts["bytes"] == sum(_sizes(root)) and counts["cache_fetched_files"] == 4  # once each, in all


def test_a_killed_fetch_is_cleaned_up_and_fetched_again(served, own_cache):
    url, root = served
    fs, names = _tier(url, own_cache, 10 << 20)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    size = _sizes(root)[0]
    left = fs.store.temp(fs.entry(names[0]), int(dead.stdout), size)
    left.write_bytes(b"half a shard")  # what a worker killed mid-fetch leaves
    assert fs.cat_file(names[0], 0, 100) == (root / "shards" / "train-000000.tar").read_bytes()[:100]
    assert not left.exists() and not list((fs.store.folder / "tmp").iterdir())
    assert fs.copy_path(names[0]).read_bytes() == (root / "shards" / "train-000000.tar").read_bytes()
    assert cache_counters_of(fs).dead_temps == 1


def test_a_file_larger_than_the_limit_is_read_through_and_said_once(served, own_cache, caplog):
    url, root = served
    fs, names = _tier(url, own_cache, 1000)
    with caplog.at_level(logging.WARNING, logger="loadopt.storage.remote.shard_cache"):
        assert fs.cat_file(names[0], 0, 10) == (root / "shards" / "train-000000.tar").read_bytes()[:10]
        fs.cat_file(names[1], 0, 10)
    assert not list((fs.store.folder / "files").iterdir())
    assert len([r for r in caplog.records if "more than storage.cache_limit" in r.getMessage()]) == 1
    assert cache_counters_of(fs).uncached_reads == 2


def test_make_loader_through_the_cache_delivers_the_same_labels(served, own_cache):
    url, _ = served

    def labels(limit) -> list[list[int]]:
        loader = make_loader(cache_config(f"{url}/shards", limit), backend="torch", num_workers=2)
        try:
            return [y.tolist() for _, y in loader]
        finally:
            loader.close()

    assert labels("1MiB") == labels(None)


def test_a_local_dataset_is_not_cached_and_says_why(served, caplog):
    _, root = served
    with caplog.at_level(logging.INFO, logger="loadopt.storage"):
        dataset = open_dataset(cache_config(str(root / "shards"), "1GB"))
    assert not isinstance(dataset.fs, ShardCacheFileSystem)
    assert [r.getMessage() for r in caplog.records if "storage.cache_limit" in r.getMessage()] == [
        f"storage.cache_limit: the dataset is on the local disk ({root / 'shards'}): it is read where it is, "
        "not cached"]


def test_shard_files_in_order(served):
    _, root = served
    shards = open_dataset(cache_config(str(root / "shards")))
    assert shard_files_in_order(shards, [2, 0, 3]) == [str(root / "shards" / f"train-{k:06d}.tar")
                                                        for k in (2, 0, 3)]
    hub = open_dataset(cache_config(str(root / "hub")))
    table = shard_table(hub)
    names = shard_files_in_order(hub, list(reversed(range(table.num_shards))))
    assert names == [str(p) for p in sorted((root / "hub" / "data").glob("*.parquet"), reverse=True)]


@pytest.mark.parametrize(("text", "size"), [("20GiB", 20 << 30), ("500MB", 500_000_000), (4096, 4096),
                                            ("1.5 kb", 1500)])
def test_cache_limit_sizes(text, size):
    assert byte_size(text) == size
    assert config_from_dict({"storage": {"cache_limit": text}}).storage.cache_limit == size


def test_the_cache_folder_is_keyed_by_location_and_endpoint(own_cache):
    from loadopt.storage.remote.shard_cache import cache_key

    assert cache_key("s3://b/x", {"endpoint_url": "http://a:1"}) != cache_key("s3://b/x", {"endpoint_url": "http://b:1"})
    assert cache_key("s3://k:secret@b/x", None) == cache_key("s3://other:key@b/x", None)  # never the secret
    assert os.sep not in cache_key("s3://b/x", None)


