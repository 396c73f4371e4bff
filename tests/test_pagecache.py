"""storage/tiers/pagecache.py: pages of a mapped file released from the process stay readable, and leave its memory."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from loadopt.storage.tiers.pagecache import cached_bytes, evict, evict_for_cold, release_pages


def resident_kb(address: int) -> int:
    """The Rss of the mapping that holds `address` (/proc/self/smaps)."""
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith(("Rss", "Pss")):
            low, high = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            found = low <= address < high
        elif found and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


def test_released_pages_leave_the_process_and_read_back_the_same(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 64 * mmap.PAGESIZE, dtype=np.uint8)
    path = tmp_path / "file.bin"
    path.write_bytes(data.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    assert int(mapped.astype(np.int64).sum()) == int(data.astype(np.int64).sum())  # every page touched
    before = resident_kb(mapped.ctypes.data)
    release_pages(mapped[10:])  # the whole pages inside the view: 62 of 64 (the partial first one kept)
    after = resident_kb(mapped.ctypes.data)
    assert before >= 60 * mmap.PAGESIZE // 1024 and after <= before - 60 * mmap.PAGESIZE // 1024
    assert np.array_equal(np.asarray(mapped), data)  # read again from the page cache


def test_a_cold_eviction_says_what_a_live_mapping_kept_and_collects_a_dropped_one(tmp_path):
    """Mapped pages cannot leave the page cache: a closed loader's mapping still held in a reference cycle kept
    a "cold" stage warm in CI. evict_for_cold collects it and evicts again; a mapping still in use is reported."""
    import gc
    import os

    path = tmp_path / "shard.bin"
    path.write_bytes(os.urandom(4 << 20))
    files = [str(path)]
    assert evict(files) == 1 and cached_bytes(files) == 0
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)  # keeps its own descriptor
    assert len(mapping[::4096]) == 1024  # a byte of every page read through the mapping
    evict(files)
    assert cached_bytes(files) == 4 << 20  # mapped: still cached
    assert evict_for_cold(files) == (1, 4 << 20)  # in use: reported, not hidden
    cycle: list = [mapping]
    cycle.append(cycle)  # only the collector frees it
    del mapping, cycle
    gc.disable()
    try:
        assert evict_for_cold(files) == (1, 0)
    finally:
        gc.enable()
