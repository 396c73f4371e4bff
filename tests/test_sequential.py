"""The one sequential reader (storage/tiers/sequential.py): budgets, passes, O_DIRECT fallback, fsspec."""

from __future__ import annotations

import fsspec
import pytest

from loadopt.errors import DatasetError
from loadopt.storage.tiers.sequential import read_sequential


@pytest.fixture
def two_files(tmp_path):
    paths = []
    for name, size in (("a.bin", 3 << 20), ("b.bin", (1 << 20) + 123)):
        path = tmp_path / name
        path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        paths.append(str(path))
    return paths


def test_reads_every_byte_once_without_a_budget(two_files):
    latencies: list[float] = []
    done = read_sequential(two_files, 1 << 20, latencies=latencies)
    assert done.nbytes == (4 << 20) + 123 and done.seconds > 0 and not done.direct
    assert len(latencies) == 5  # 3 reads of a, 2 of b (the last one short)


def test_byte_budget_stops_in_the_middle_of_a_file(two_files):
    assert read_sequential(two_files, 1 << 20, max_bytes=(3 << 20) + 4096).nbytes == (3 << 20) + 4096


def test_passes_read_again_until_the_budget(two_files):
    done = read_sequential(two_files, 1 << 20, max_bytes=10 << 20, passes=True)
    assert done.nbytes == 10 << 20


def test_direct_reads_the_same_bytes_or_falls_back_to_buffered(two_files):
    done = read_sequential(two_files, 1 << 20, direct=True)
    assert done.nbytes == (4 << 20) + 123  # O_DIRECT where the file system does it, buffered where it refuses


def test_time_budget_ends_passes(two_files):
    done = read_sequential(two_files, 4096, max_seconds=0.05, passes=True)
    assert done.nbytes > 0 and done.seconds < 2.0


def test_fsspec_files_read_by_ranges():
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/seq/a.bin", b"y" * 10_000)
    latencies: list[float] = []
    done = read_sequential(["/seq/a.bin"], 4096, fs=fs, latencies=latencies)
    assert done.nbytes == 10_000 and len(latencies) == 3


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DatasetError, match="gone.bin"):
        read_sequential([str(tmp_path / "gone.bin")], 4096)
