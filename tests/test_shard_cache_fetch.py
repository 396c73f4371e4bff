"""The shard cache fetching ahead (storage/remote/cache_fetch.py): the loader hands it its epoch's files in the order
it reads them, a first open's indexing leaves copies the first epoch reads, and each file goes out as range
requests several at once, in the files' order."""

from __future__ import annotations

import pickle
import threading

import pytest

from loadopt import make_loader
from loadopt.storage.open import open_dataset
from loadopt.storage.remote import cache_fetch
from loadopt.storage.remote.shard_cache import ShardCacheFileSystem, shard_files_in_order
from loadopt.storage.tiers.stack import tier_counters

from .cache_serving import CountingHandler, cache_config, dataset_files

pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")


def test_a_loader_fetches_its_epochs_files_ahead_in_the_order_it_reads_them(served, own_cache, monkeypatch):
    """The loader hands the cache the files of the rest of its epoch in first-need order (under the window
    shuffle: the rank's shards as dealt): the cache fetches them ahead of the reads."""
    url, _ = served
    asked: list[list[str]] = []
    real = ShardCacheFileSystem.prefetch

    def recorded(self, paths, concurrency=None):
        asked.append(list(paths))
        return real(self, paths, concurrency)

    monkeypatch.setattr(ShardCacheFileSystem, "prefetch", recorded)
    open_dataset(cache_config(f"{url}/shards"))  # indexed and saved without the cache: the loader's fetches are its own
    config = cache_config(f"{url}/shards", "10MB")
    config.pipeline.shuffle, config.pipeline.window_shards = "window", 1
    config.storage.cache_fetches = 3
    loader = make_loader(config, backend="torch", num_workers=0)
    try:
        assert loader.dataset.fs.fetches == 3 == pickle.loads(pickle.dumps(loader.dataset.fs)).fetches
        order = loader.order()
        for _ in loader:
            pass
        dataset = loader.dataset
        assert asked == [shard_files_in_order(dataset, order.rank_shards().shards)]
        assert sorted(asked[0]) == sorted(dataset_files(dataset))
        dataset.fs.wait_ahead(30)
        counted = tier_counters(dataset.fs)
        assert counted["cache_fetched_files"] == len(asked[0])  # each once, ahead or when first read
    finally:
        loader.close()


def test_a_first_open_indexes_through_the_cache_so_the_first_epoch_fetches_nothing_more(served, own_cache):
    """Indexing remote tars reads each one whole: with a cache_limit the copies are kept, and the first epoch
    reads them instead of fetching every shard a second time."""
    url, root = served
    files = sorted((root / "shards").rglob("*.tar"))
    asked = CountingHandler.requests
    dataset = open_dataset(cache_config(f"{url}/shards", "10MB"))  # lists, indexes (a fresh cache: nothing saved)
    indexing = CountingHandler.requests - asked
    assert indexing > 0
    asked = CountingHandler.requests
    first = [dataset.read(i) for i in range(len(dataset))]
    assert CountingHandler.requests == asked  # every shard already a copy
    counted = tier_counters(dataset.fs)
    assert counted["bytes"] == 0 and counted["cache_hit_reads"] == len(first)
    assert sum(len(b) for b in first) < sum(f.stat().st_size for f in files)


def test_fetching_ahead_requests_each_files_ranges_together_in_the_files_order(served, own_cache, monkeypatch):
    """A file is fetched as range requests several at once (an object store limits each connection): the first
    file's ranges go out together, before any of the next file's, and every copy holds the file's bytes."""
    url, root = served
    open_dataset(cache_config(f"{url}/shards"))  # indexed and saved without the cache: its copies are the fetches'
    dataset = open_dataset(cache_config(f"{url}/shards", "10MB", cache_fetches=4))
    monkeypatch.setattr(cache_fetch, "RANGE_MIN_BYTES", 4096)  # the test's small tars: several ranges each
    files = dataset_files(dataset)
    first_ranges = cache_fetch.file_ranges(dataset.fs.size(files[0]), 4)
    assert len(files) > 2 and len(first_ranges) >= 2
    together = threading.Barrier(2, timeout=20)  # the first two requests wait for each other: at once, or fail
    asked: list[tuple[str, int, int]] = []
    lock = threading.Lock()
    tier = dataset.fs.tier
    real = type(tier).cat_file

    def recorded(self, path, start=None, end=None, **kwargs):
        with lock:
            asked.append((path, start, end))
            first_two = len(asked) <= 2
        if first_two:
            together.wait()
        return real(self, path, start=start, end=end, **kwargs)

    monkeypatch.setattr(type(tier), "cat_file", recorded)
    dataset.fs.prefetch(files)
    assert dataset.fs.wait_ahead(30)
    assert [path for path, _, _ in asked[:2]] == [files[0], files[0]]
    for path in files:
        assert sorted((a, b) for p, a, b in asked if p == path) == \
            cache_fetch.file_ranges(dataset.fs.size(path), 4)
    monkeypatch.setattr(type(tier), "cat_file", real)
    local = {f"{url}/shards/{p.relative_to(root / 'shards').as_posix()}": p.read_bytes()
             for p in (root / "shards").rglob("*.tar")}
    for path in files:
        assert dataset.fs.cat_file(path) == local[path]
    assert tier_counters(dataset.fs)["cache_ahead_files"] == len(files)
