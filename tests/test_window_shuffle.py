"""The shard-window shuffle (`pipeline.shuffle: window`): shards dealt to ranks, samples shuffled within a window
of shards, the same order on every backend, exact resume under another worker count."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadopt import make_loader
from loadopt.config import load_config
from loadopt.errors import ConfigError
from loadopt.loaders.sampler import EpochOrder, ShardWindows
from loadopt.storage.sources.shards import ShardTable

from .conftest import make_image_folder, tiny_config_dict
from .source_files import folder_samples, write_shards


@pytest.fixture
def image_folder(tmp_path) -> Path:
    make_image_folder(tmp_path / "folder", classes=3, per_class=4)
    return tmp_path / "folder"


def _config(folder: Path, path: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c.yaml").write_text(json.dumps(tiny_config_dict(folder / "results", dataset={"path": path})))
    return load_config(folder / "c.yaml")


@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 10**6), st.integers(1, 16))
@settings(max_examples=200, deadline=None)
def test_each_rank_reads_its_own_shards_a_window_at_a_time(shard_sizes, world, window_shards, seed, batch):
    table = ShardTable(np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64))
    n = table.num_samples
    windows = ShardWindows(table, window_shards)
    parts: list[tuple[int, int, int]] = []
    for rank in range(world):
        order = EpochOrder(n, batch, seed, 3, rank, world, "window", windows=windows)
        mine = order.share()
        part = order.rank_shards()
        assert len(mine) == n * (rank + 1) // world - n * rank // world  # contiguous shares: at most one apart
        parts += zip(part.shards.tolist(), part.first.tolist(), part.last.tolist(), strict=True)
        shard_of = np.searchsorted(table.bounds, mine, side="right") - 1
        assert set(shard_of.tolist()) <= set(part.shards.tolist())  # it reads only the shards dealt to it
        at = 0
        for begin in range(0, len(part.shards), window_shards):  # each window: the samples of its shards only
            shards = part.shards[begin : begin + window_shards]
            count = int((part.last - part.first)[begin : begin + window_shards].sum())
            assert set(shard_of[at : at + count].tolist()) == set(shards.tolist())
            at += count
    covered = np.zeros(n, dtype=int)  # the ranks' parts of shards cover every sample once
    for shard, first, last in parts:
        covered[table.bounds[shard] + first : table.bounds[shard] + last] += 1
    assert (covered == 1).all()


def test_the_order_is_a_function_of_seed_and_epoch_and_shuffles_within_windows():
    table = ShardTable.blocks(10_000, 100)
    windows = ShardWindows(table, 4)
    a = EpochOrder(10_000, 32, 7, 0, windows=windows, shuffle="window").indices()
    assert np.array_equal(a, EpochOrder(10_000, 32, 7, 0, windows=windows, shuffle="window").indices())
    assert not np.array_equal(a, EpochOrder(10_000, 32, 7, 1, windows=windows, shuffle="window").indices())
    assert not np.array_equal(a, EpochOrder(10_000, 32, 8, 0, windows=windows, shuffle="window").indices())
    first_window = a[:400]  # 4 shards of 100: shuffled among themselves, not in storage order
    assert len(np.unique(first_window // 100)) == 4
    assert np.mean(np.abs(np.diff(first_window))) > 50


def test_the_order_refuses_a_table_of_another_dataset():
    with pytest.raises(ValueError, match="shard table holds 100 samples, the order 99"):
        EpochOrder(99, 4, shuffle="window", windows=ShardWindows(ShardTable.blocks(100, 10)))
    with pytest.raises(ValueError, match="needs the dataset's shards"):
        EpochOrder(99, 4, shuffle="window")


def test_a_webdataset_s_shards_are_its_tar_files(tmp_path, image_folder, own_cache):
    from loadopt.storage.sources.shards import shard_table
    from loadopt.storage.sources.webdataset import open_webdataset

    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=5)
    dataset = open_webdataset(str(tmp_path / "shards"))
    table = shard_table(dataset)
    assert table.num_shards == len(dataset.shards)
    assert np.array_equal(table.sizes(), np.bincount(dataset.shard_of))


def _labels_and_indices(config, backend: str, **settings) -> tuple[list[int], list[int]]:
    loader = make_loader(config, backend=backend, seed=5, shuffle="window", window_shards=2, **settings)
    try:
        labels, indices = [], []
        for batch in loader.host_batches():
            labels += batch.labels.tolist()
            indices += batch.indices.tolist()
        return labels, indices
    finally:
        loader.close()


def test_every_backend_delivers_the_window_order_of_the_tar_shards(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=3)
    config = _config(tmp_path / "config", str(tmp_path / "shards"))
    runs = (("torch", {"variant": "plain", "num_workers": 0}), ("torch", {"variant": "tuned", "num_workers": 2}),
            ("arrow", {"form": "decoded"}), ("posix", {}))
    expected = _labels_and_indices(config, *runs[0][:1], **runs[0][1])
    assert sorted(expected[1]) == list(range(len(samples)))
    assert expected[1] != list(range(len(samples)))
    for backend, settings_ in runs[1:]:
        assert _labels_and_indices(config, backend, **settings_) == expected, (backend, settings_)


def test_resume_mid_epoch_under_another_worker_count_continues_the_same_order(tmp_path, image_folder, own_cache):
    samples = folder_samples(image_folder)
    write_shards(tmp_path / "shards", samples, per_shard=3)
    config = _config(tmp_path / "config", str(tmp_path / "shards"))
    common = {"seed": 9, "shuffle": "window", "window_shards": 2, "batch_size": 4}
    whole = make_loader(config, backend="torch", variant="tuned", num_workers=2, **common)
    full = [b.indices.tolist() for b in whole.host_batches()]
    whole.close()
    first = make_loader(config, backend="torch", variant="tuned", num_workers=2, **common)
    batches = first.host_batches()
    head = [next(batches).indices.tolist() for _ in range(2)]
    state = first.state_dict()
    first.close()
    resumed = make_loader(config, backend="torch", variant="tuned", num_workers=0, **common)
    resumed.load_state_dict(state)
    tail = [b.indices.tolist() for b in resumed.host_batches()]
    resumed.close()
    assert head + tail == full


def test_an_unknown_shuffle_is_one_line(tmp_path, image_folder, own_cache):
    with pytest.raises(ConfigError, match="shuffle"):
        make_loader(_config(tmp_path / "config", str(image_folder)), backend="torch", shuffle="windowed")


def test_shuffle_quality_scores_a_permutation_near_one_and_storage_order_near_zero():
    from loadopt.loaders.shuffle_quality import shuffle_quality

    labels = np.repeat(np.arange(50), 200)  # class-sorted, as an ImageFolder is stored
    rng = np.random.default_rng(0)
    random = shuffle_quality(rng.permutation(len(labels)), labels, 64)
    assert 0.95 < random.neighbour_spread < 1.05 and 0.97 < random.class_mix < 1.03
    stored = shuffle_quality(np.arange(len(labels)), labels, 64)
    assert stored.neighbour_spread < 0.001 and stored.classes_per_batch < 2
    table = ShardTable.blocks(len(labels), 100)
    window = EpochOrder(len(labels), 64, 1, shuffle="window", windows=ShardWindows(table, 4)).indices()
    windowed = shuffle_quality(window, labels, 64)
    # 4 blocks of 100 are at most 4 classes a window: better than storage order, far from random
    assert stored.class_mix < windowed.class_mix < 0.2 and windowed.neighbour_spread < 0.1


def test_a_webdataset_keeps_its_shard_table_in_its_index(tmp_path, image_folder, own_cache):
    """The table comes from the saved index (`shard_bounds`), not from reading every sample's shard number."""
    from loadopt.storage.sources.shards import shard_table
    from loadopt.storage.sources.webdataset import open_webdataset

    write_shards(tmp_path / "shards", folder_samples(image_folder), per_shard=5)
    dataset = open_webdataset(str(tmp_path / "shards"))
    again = open_webdataset(str(tmp_path / "shards"))  # from the saved index
    assert again.shard_bounds is not None
    again.shard_of = None  # not read
    assert np.array_equal(shard_table(again).bounds, np.concatenate([[0], np.cumsum(np.bincount(dataset.shard_of))]))


def test_parquet_and_record_datasets_keep_their_shard_tables(tmp_path, image_folder, own_cache):
    from loadopt.config import config_from_dict
    from loadopt.storage.open import open_dataset
    from loadopt.storage.sources.parquet import open_parquet
    from loadopt.storage.sources.shards import ShardTable, shard_table

    from .source_files import write_parquet

    write_parquet(tmp_path / "hub", folder_samples(image_folder), ["c0", "c1", "c2"], rows_per_group=2)
    for dataset in (open_parquet(str(tmp_path / "hub")),
                    open_dataset(config_from_dict({"dataset": {"kind": "records", "records": {
                        "num_files": 5, "samples_per_file": 3, "record_bytes": 2048, "delivered_bytes": 2048,
                        "file_format": "raw"}}}, "r.yaml"))):
        assert dataset.shard_bounds is not None
        assert np.array_equal(shard_table(dataset).bounds, ShardTable.from_runs(dataset.file_of).bounds)
