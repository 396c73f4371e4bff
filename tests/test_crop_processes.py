"""Whole frames cropped (and the Arrow encoded form's JPEGs decoded) by worker processes (`crop_in: processes`,
the default) equal the threads' crops; the workers are closed with the loader, a dead one is named in one
line, and a new epoch replaces it."""

import os
import signal

import numpy as np
import pytest
import torch

from loadopt.config import config_from_dict
from loadopt.errors import LoadoptError
from loadopt.loaders import crops
from loadopt.loaders.arrow.loader import ArrowLoader, ArrowSettings
from loadopt.loaders.crop_processes import CropProcesses, fork_available
from loadopt.loaders.posix.loader import PosixLoader, PosixSettings
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict
from .test_arrow import assert_same, batches

pytestmark = pytest.mark.skipif(not fork_available(), reason="worker processes are forked: no fork here")


def whole_frames(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", pipeline={"augment": "train", "dtype": "uint8", "max_side": 72})
    cfg = config_from_dict(raw, "frames.yaml")
    return cfg, open_dataset(cfg)


def children() -> set[int]:
    """This process's live child processes (from /proc: no psutil needed)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.add(int(entry))
    return found


def loader(backend: str, dataset, cfg, crop_in: str):
    if backend == "posix":
        if crops.native is None:
            pytest.skip("loadopt._native is not built: posix crops no frames from the page cache")
        return PosixLoader(dataset, cfg.pipeline, PosixSettings(shard_mib=0.05, crop_in=crop_in), seed=4)
    return ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded", crop_in=crop_in), seed=4)


@pytest.mark.parametrize("backend", ["posix", "arrow"])
def test_processes_crop_what_threads_crop_and_leave_nothing_behind(tmp_path, backend):
    cfg, dataset = whole_frames(tmp_path)
    before = children()
    threads, processes = loader(backend, dataset, cfg, "threads"), loader(backend, dataset, cfg, "processes")
    for epoch in (0, 1):
        threads.set_epoch(epoch)
        processes.set_epoch(epoch)
        assert_same(batches(processes), batches(threads))
    assert threads.croppers is None
    if backend == "posix":  # cached frames cropped without a major fault: the per-batch mincore check stops
        assert processes._check_frames is False
    workers = processes.croppers
    assert workers is not None and workers.alive() and len(children() - before) == 2  # threads: 2
    processes.close()
    threads.close()
    assert processes.croppers is None and children() <= before


def test_a_dead_worker_is_named_in_one_line_and_the_next_epoch_replaces_it(tmp_path):
    cfg, dataset = whole_frames(tmp_path)
    arrow = loader("arrow", dataset, cfg, "processes")
    expected = batches(arrow)
    croppers = arrow.croppers
    victim = croppers._processes[0]
    send = croppers.send

    def killed_then_sent(*args, **kwargs):
        """Killed once the epoch has kept its workers (a worker dead before would be replaced): mid-epoch."""
        croppers.send = send
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=10)
        return send(*args, **kwargs)

    croppers.send = killed_then_sent
    with pytest.raises(LoadoptError) as caught:
        batches(arrow)
    message = str(caught.value)
    assert "crop worker process" in message and str(victim.pid) in message and "\n" not in message
    arrow.set_epoch(0)
    assert_same(batches(arrow), expected)  # the same epoch again, by new workers
    assert arrow.croppers.alive() and victim.pid not in [p.pid for p in arrow.croppers._processes]
    arrow.close()


def test_a_worker_dead_between_epochs_is_said_and_replaced(tmp_path, caplog):
    cfg, dataset = whole_frames(tmp_path)
    arrow = loader("arrow", dataset, cfg, "processes")
    expected = batches(arrow)
    victim = arrow.croppers._processes[0]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(timeout=10)
    arrow.set_epoch(0)
    assert_same(batches(arrow), expected)
    assert f"crop worker process {victim.pid} (exit code -9) died between epochs" in caplog.text
    assert arrow.croppers.alive() and victim.pid not in [p.pid for p in arrow.croppers._processes]
    arrow.close()


def test_a_crop_that_fails_in_a_worker_is_one_line_naming_the_samples():
    out = [np.zeros((2, 8, 8, 3), np.uint8)]
    sources = [np.zeros(10 * 10 * 3, np.uint8)]  # one 10x10 frame; the second sample points past its end
    workers = CropProcesses(out, sources, 1)
    try:
        frames = np.array([[10, 10, 10, 10], [10, 10, 10, 10]], np.int32)
        with pytest.raises(LoadoptError, match=r"cropping samples 7\.\.8: ") as caught:
            workers.crop(0, np.array([7, 8]), np.zeros(2, np.int32), np.array([0, 150], np.int64), frames,
                         "train", 0, 0)
        assert "\n" not in str(caught.value)
        workers.crop(0, np.array([7, 7]), np.zeros(2, np.int32), np.zeros(2, np.int64), frames, "eval", 0, 0)
    finally:
        workers.close()
    assert not workers.alive()
    assert torch.from_numpy(out[0]).float().abs().sum() == 0  # zero frames resized stay zero


def test_a_shard_truncated_once_checking_stopped_is_named(tmp_path):
    """After an epoch cropped without a page fault from storage, the producer stops checking the cache
    (mincore) but still checks the shards' sizes: a shard truncated then is named, not a worker's SIGBUS."""
    from loadopt.errors import DatasetError

    cfg, dataset = whole_frames(tmp_path)
    posix = loader("posix", dataset, cfg, "processes")
    batches(posix)
    batches(posix)
    shard = posix._raw.shards[0]
    data = shard.read_bytes()
    try:
        os.truncate(shard, 4096)
        with pytest.raises(DatasetError, match=f"^{shard}: ends at byte"):
            batches(posix)
    finally:
        shard.write_bytes(data)
        posix.close()


@pytest.mark.parametrize("backend", ["posix", "arrow"])
def test_an_epoch_left_early_leaves_the_next_one_right(tmp_path, backend):
    """Two batches are in flight in the workers: an epoch the consumer leaves after one batch must not
    leave replies behind for the next epoch's batches."""
    cfg, dataset = whole_frames(tmp_path)
    threads, processes = loader(backend, dataset, cfg, "threads"), loader(backend, dataset, cfg, "processes")
    iterator = iter(processes)
    next(iterator)
    iterator.close()
    for each in (threads, processes):
        each.set_epoch(1)
    assert_same(batches(processes), batches(threads))
    processes.close()
    threads.close()



def test_where_worker_processes_cannot_start_threads_crop_instead(tmp_path, monkeypatch, caplog):
    """E.g. in a daemonic process (multiprocessing lets it have no children): the loader crops in threads,
    with a warning saying why, instead of failing."""
    from loadopt.loaders import ring

    def refused(*args, **kwargs):
        raise AssertionError("daemonic processes are not allowed to have children")

    cfg, dataset = whole_frames(tmp_path)
    expected = batches(loader("arrow", dataset, cfg, "threads"))
    monkeypatch.setattr(ring, "CropProcesses", refused)
    arrow = loader("arrow", dataset, cfg, "processes")
    assert_same(batches(arrow), expected)
    assert arrow.croppers is None and "worker processes could not start (daemonic" in caplog.text
    arrow.close()


def test_arrow_encoded_jpegs_are_decoded_by_workers_as_threads_decode_them(tmp_path):
    """The Arrow encoded form's JPEGs go to the worker processes too (the same pixels), and so do posix's (read into
    staging buffers in shared memory), unless `crop_in: threads` keeps them in the loader's threads."""
    raw = tiny_config_dict(tmp_path / "out", pipeline={"augment": "train", "dtype": "uint8"})
    cfg = config_from_dict(raw, "encoded.yaml")
    dataset = open_dataset(cfg)
    before = children()
    settings = [ArrowSettings(form="encoded", crop_in=crop_in) for crop_in in ("threads", "processes")]
    threads, processes = (ArrowLoader(dataset, cfg.pipeline, s, seed=4) for s in settings)
    for epoch in (0, 1):
        threads.set_epoch(epoch)
        processes.set_epoch(epoch)
        assert_same(batches(processes), batches(threads))
    assert processes.croppers is not None and processes.croppers.alive() and len(children() - before) == 2
    posix_threads, posix = (PosixLoader(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=0.05,
                                                                             crop_in=crop_in), seed=4)
                            for crop_in in ("threads", "processes"))
    assert_same(batches(posix), batches(posix_threads))
    assert posix.croppers is not None and posix_threads.croppers is None
    for each in (threads, processes, posix_threads, posix):
        each.close()
    assert children() <= before


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_jpeg_a_worker_cannot_decode_goes_by_on_error(tmp_path, on_error):
    from loadopt.errors import DatasetError

    from .conftest import make_image_folder

    make_image_folder(tmp_path / "data", classes=2, per_class=6)
    good = (tmp_path / "data" / "train" / "c0" / "0.jpg").read_bytes()
    bad = tmp_path / "data" / "train" / "c0" / "broken.jpg"  # a valid header (the conversion reads it), no scan
    sos = good.index(b"\xff\xda")
    bad.write_bytes(good[: sos + 12] + b"\xff\xd9")
    raw = tiny_config_dict(tmp_path / "out", dataset={"path": str(tmp_path / "data")},
                           pipeline={"augment": "train", "dtype": "uint8"})
    cfg = config_from_dict(raw, "bad.yaml")
    dataset = open_dataset(cfg)
    arrow = ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="encoded", crop_in="processes"), seed=4,
                        on_error=on_error)
    if on_error == "raise":
        with pytest.raises(DatasetError, match=bad.name):
            batches(arrow)
    else:
        delivered = sum(len(x) for x, _ in arrow)
        skipped = [path.endswith(bad.name) for path, _ in arrow.counters.skipped]
        assert delivered == len(dataset) - 1 and skipped == [True]
    assert arrow.croppers is not None  # decoded by the workers, not by threads
    arrow.close()


@pytest.mark.skipif(not fork_available(), reason="the crop workers are forked: this OS cannot fork")
def test_workers_of_a_pool_dropped_without_close_end_when_it_is_collected():
    import gc
    import time

    out = [np.zeros((2, 8, 8, 3), np.uint8)]
    pool = CropProcesses(out, [np.zeros(16, np.uint8)], 2)
    processes = list(pool._processes)
    assert all(p.is_alive() for p in processes)
    del pool
    gc.collect()
    deadline = time.monotonic() + 10.0  # they are told at once; exiting takes a moment on a busy machine
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in processes), "a dropped pool left its workers running"
