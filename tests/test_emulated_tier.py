"""The emulated tier: measured bandwidth, latency and concurrency match what it was told (within 10%),
across threads and processes; injected faults are retried, counted, and a tier that keeps failing
ends its run with a one-line error while the other runs keep their results."""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path

import fsspec
import fsspec.implementations.local
import pytest

import loadopt
from loadopt.bench.runner import run_bench
from loadopt.config import config_from_dict
from loadopt.errors import ConfigError, StorageError
from loadopt.storage.tiers.emulated import EmulatedFileSystem, SharedTierState
from loadopt.storage.tiers.spec import DEFAULT_TIERS_FILE, TierSpec, load_tier_profiles, resolve_tier
from loadopt.storage.tiers.stack import BASE_BOUND_SHARE, base_share, tier_counters, tier_filesystem
from loadopt.storage.tiers.state import SLOT_RELEASES

from .conftest import tiny_config_dict

FAST_RETRY = {"base_delay_s": 0.001, "max_delay_s": 0.01}


def _files(tmp_path: Path, count: int, size: int) -> list[str]:
    paths = []
    for i in range(count):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(bytes([i % 251]) * size)
        paths.append(str(path))
    return paths


def _read_all(fs, paths: list[str], threads: int) -> float:
    """Read every path through `fs` from `threads` threads; returns the elapsed seconds."""
    chunks = [paths[k::threads] for k in range(threads)]
    workers = [threading.Thread(target=lambda c=c: [fs.cat_file(p) for p in c]) for c in chunks]
    start = time.monotonic()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.monotonic() - start


def test_bandwidth_is_what_the_tier_was_told(tmp_path):
    paths = _files(tmp_path, 16, 500_000)  # 8 MB at 20 MB/s: 0.4 s
    fs = tier_filesystem(TierSpec(bandwidth_mb_s=20), fsspec.filesystem("file"))
    elapsed = _read_all(fs, paths, threads=4)
    delivered = 16 * 500_000 / elapsed / 1e6
    assert delivered == pytest.approx(20, rel=0.10), f"{delivered:.1f} MB/s delivered, 20 told"
    counters = tier_counters(fs)
    assert counters["bytes"] == 8_000_000 and counters["requests"] == 16


def test_latency_is_what_the_tier_was_told(tmp_path):
    paths = _files(tmp_path, 20, 1000)
    fs = tier_filesystem(TierSpec(latency_ms=20), fsspec.filesystem("file"))
    each, late = [], []
    for path in paths:
        start = time.monotonic()
        fs.cat_file(path)
        each.append(time.monotonic() - start)
        # what a bare 20 ms sleep costs on this machine now: on a busy one the scheduler wakes sleepers late,
        # which no emulation can undo; the tier must add its latency and nothing else of its own
        start = time.monotonic()
        time.sleep(0.020)
        late.append(time.monotonic() - start - 0.020)
    assert min(each) >= 0.020
    # the tier's sleeps are tighter than a bare one (1 us timer slack): no more than the latency and the lateness
    assert statistics.mean(each) <= 1.10 * 0.020 + statistics.mean(late), (
        f"{statistics.mean(each) * 1000:.1f} ms a request; a bare 20 ms sleep woke {statistics.mean(late) * 1000:.1f}"
        " ms late")


class _SlowInFlight(fsspec.implementations.local.LocalFileSystem):
    """The local filesystem with 0.1 s reads, counting how many run at once (the tier reads inside a slot)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.now = self.most = 0
        self.lock = threading.Lock()

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.1)  # long enough that the reads the cap lets through overlap
            return super().cat_file(path, start=start, end=end, **kwargs)
        finally:
            with self.lock:
                self.now -= 1


def test_concurrency_cap_is_never_exceeded_and_is_used(tmp_path):
    base = _SlowInFlight(skip_instance_cache=True)
    capped = tier_filesystem(TierSpec(max_concurrency=2), base)
    _read_all(capped, _files(tmp_path, 8, 100), threads=8)
    assert base.most == 2


def test_concurrency_cap_limits_iops(tmp_path):
    paths = _files(tmp_path, 80, 1000)  # 0.8 s: the threads' start and end on a busy machine weigh little
    capped = tier_filesystem(TierSpec(latency_ms=20, max_concurrency=2), fsspec.filesystem("file"))
    elapsed = _read_all(capped, paths, threads=8)
    # IOPS = concurrency / latency: no slot idles while a request waits (one queue per slot did)
    assert 80 / elapsed == pytest.approx(2 / 0.020, rel=0.10)
    uncapped = tier_filesystem(TierSpec(latency_ms=20), fsspec.filesystem("file"))
    assert _read_all(uncapped, paths, threads=8) < elapsed / 2  # the cap, not the threads, set the pace


def test_a_queued_request_starts_when_the_slot_was_due_to_free(tmp_path):
    """Service time is a virtual clock: a request that queued begins at its slot's announced release,
    however late the holder really let go (wake-ups must not eat into the tier's IOPS)."""
    state = SharedTierState(tmp_path / "tier", slots=1)
    arrival = time.monotonic()
    began = {}

    def second() -> None:
        with state.slot(arrival + 0.005) as (start, _, _):
            began["second"] = start

    with state.slot(arrival) as (start, releases_at, _):
        assert start == arrival  # a free slot: service begins at arrival
        releases_at(arrival + 0.010)
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.030)  # the holder lets go 20 ms after it said it would
    waiter.join(10)
    assert began["second"] == arrival + 0.010


def _hold_a_slot(fs, fifo: str) -> None:
    fs.cat_file(fifo)  # opening a FIFO that has no writer blocks: the slot stays held until killed


def test_a_killed_reader_gives_its_slot_back(tmp_path):
    """A DataLoader worker killed mid-read must not keep its slot (flocks end with their process)."""
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    path = _files(tmp_path, 1, 100)[0]
    fs = tier_filesystem(TierSpec(max_concurrency=1), fsspec.filesystem("file"))
    child = multiprocessing.get_context("spawn").Process(target=_hold_a_slot, args=(fs, str(fifo)))
    child.start()
    try:
        deadline = time.monotonic() + 60
        fs.state._attach()  # maps the tier's shared state in this process
        while fs.state._values[SLOT_RELEASES] == 0:  # the child has taken the slot once it says when it ends
            assert time.monotonic() < deadline and child.is_alive(), "the child never took the slot"
            time.sleep(0.01)
        reader = threading.Thread(target=fs.cat_file, args=(path,))
        reader.start()
        reader.join(0.5)
        assert reader.is_alive()  # the only slot is held: this read waits
    finally:
        child.kill()
        child.join(30)
    reader.join(30)
    assert not reader.is_alive()  # the killed holder's slot was given back
    assert tier_counters(fs)["requests"] == 1


@pytest.mark.parametrize("distribution", ["exponential", "lognormal"])
def test_latency_distributions_have_the_mean_they_were_told(distribution):
    fs = EmulatedFileSystem(TierSpec(latency_ms=10, latency_distribution=distribution),
                            fsspec.filesystem("memory"))
    draws = [fs._latency_s() for _ in range(5000)]
    assert statistics.mean(draws) == pytest.approx(0.010, rel=0.10)
    assert statistics.pstdev(draws) > 0.002  # drawn, not fixed


def _child_reads(fs, paths: list[str], barrier, out) -> None:
    barrier.wait()
    start = time.monotonic()
    for path in paths:
        fs.cat_file(path)
    out.put((start, time.monotonic()))


def test_two_processes_share_one_tier(tmp_path):
    """Spawned processes (the fs is pickled to them) share the tier's bandwidth and counters."""
    paths = _files(tmp_path, 16, 500_000)  # 8 MB at 16 MB/s: 0.5 s whatever the number of readers
    fs = tier_filesystem(TierSpec(bandwidth_mb_s=16), fsspec.filesystem("file"))
    context = multiprocessing.get_context("spawn")
    barrier, out = context.Barrier(2), context.Queue()
    children = [context.Process(target=_child_reads, args=(fs, paths[k::2], barrier, out)) for k in range(2)]
    for child in children:
        child.start()
    spans = [out.get(timeout=60) for _ in children]
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
    assert 8_000_000 / elapsed / 1e6 == pytest.approx(16, rel=0.10)  # not 2 x 16: one pipe for both
    assert tier_counters(fs)["bytes"] == 8_000_000  # both processes' reads, seen from here


def test_transient_errors_are_retried_and_counted(tmp_path):
    paths = _files(tmp_path, 50, 100)
    # 20 attempts: some read failing all of them has p = 50 x 0.3^20 < 1e-9 (at the default 5 it was 12%)
    fs = tier_filesystem(TierSpec(error_rate=0.3, retry={**FAST_RETRY, "max_attempts": 20}), fsspec.filesystem("file"))
    assert [fs.cat_file(p) for p in paths] == [Path(p).read_bytes() for p in paths]
    counters = tier_counters(fs)
    assert counters["injected_errors"] > 0
    assert counters["retries"] == counters["injected_errors"] and counters["failed_reads"] == 0
    assert counters["requests"] == 50 + counters["retries"]


def test_a_tier_that_keeps_failing_gives_up_with_one_line(tmp_path):
    path = _files(tmp_path, 1, 100)[0]
    fs = tier_filesystem(TierSpec(timeout_rate=1.0, timeout_s=0.05, retry={**FAST_RETRY, "max_attempts": 3}),
                         fsspec.filesystem("file"))
    start = time.monotonic()
    with pytest.raises(StorageError) as caught:
        fs.cat_file(path)
    assert time.monotonic() - start >= 3 * 0.05  # each attempt waited out its timeout
    message = str(caught.value)
    assert "\n" not in message and path in message and "3 times" in message and "InjectedTimeout" in message
    counters = tier_counters(fs)
    assert counters["injected_timeouts"] == 3 and counters["retries"] == 2 and counters["failed_reads"] == 1


def test_range_reads_and_files_go_through_the_tier(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 100)
    fs = tier_filesystem(TierSpec(latency_ms=1), fsspec.filesystem("file"))
    assert fs.cat_file(str(path), 10, 20) == bytes(range(10, 20))
    with fs.open(str(path), block_size=4096) as handle:
        handle.seek(300)
        assert handle.read(4) == bytes([44, 45, 46, 47])
    assert tier_counters(fs)["requests"] >= 2


def test_profiles_and_inline_specs_resolve(tmp_path):
    profiles = load_tier_profiles()
    assert {"nvme", "sata_ssd", "hdd", "nfs_10gbe", "nfs_25gbe", "parallel_fs", "object_standard"} <= set(profiles)
    assert all(p.price_per_tb_month is not None and p.bandwidth_mb_s for p in profiles.values())
    assert resolve_tier("local") == TierSpec()
    assert resolve_tier("hdd").max_concurrency == 1
    assert resolve_tier({"profile": "hdd", "error_rate": 0.5}).error_rate == 0.5
    with pytest.raises(ConfigError, match="unknown tier 'tape'.*hdd"):
        resolve_tier("tape")
    with pytest.raises(ConfigError, match="storage.tier.bandwith_mb_s: unknown key"):
        config_from_dict({"storage": {"tier": {"bandwith_mb_s": 10}}})
    # a local disk read with no limits is not wrapped: the backends keep their plain-open fast path
    local = fsspec.filesystem("file")
    assert tier_filesystem(TierSpec(), local) is local


def test_the_default_profiles_ship_inside_the_package():
    # an installed wheel has no configs/ folder: the profiles must be package data, and the checkout's
    # configs/tiers.yaml must be the same file, not a copy that can drift
    package_dir = Path(loadopt.__file__).parent
    assert DEFAULT_TIERS_FILE.parent == package_dir / "storage" / "tiers" and DEFAULT_TIERS_FILE.is_file()
    checkout_copy = package_dir.parent / "configs" / "tiers.yaml"
    if checkout_copy.exists():
        assert checkout_copy.resolve() == DEFAULT_TIERS_FILE.resolve()
    pyproject = package_dir.parent / "pyproject.toml"
    if pyproject.exists():
        assert '"loadopt.storage.tiers" = ["tiers.yaml"]' in pyproject.read_text()


def _bench(tmp_path: Path, tier: dict, loaders: dict, name: str) -> dict:
    raw = tiny_config_dict(tmp_path / name, storage={"tier": tier}, loaders=loaders,
                           workload={"step_time_ms": 0, "warmup_batches": 1, "measure_batches": 5, "repeats": 2})
    outcome = run_bench(config_from_dict(raw, f"{name}.yaml"), attribute=False)
    if outcome.json_path is None:  # nothing measured: the reasons are returned, nothing is written
        assert not (tmp_path / name).exists()
        return outcome.document()
    return json.loads(outcome.json_path.read_text())


def test_bench_with_five_percent_errors_completes_and_reports_retries(tmp_path):
    results = _bench(tmp_path, {"error_rate": 0.05, "retry": FAST_RETRY},
                     {"torch": {"variant": ["plain", "tuned"], "num_workers": [0, 1]}}, "flaky")
    assert [r["status"] for r in results["runs"]] == ["ok"] * 4
    totals = {k: sum(r["tier_counters"][k] for r in results["runs"]) for k in ("requests", "retries", "failed_reads")}
    # 4 settings x 2 repeats x 48 samples read: ~19 injected errors expected (none at all: p < 1e-8)
    assert totals["retries"] > 0 and totals["failed_reads"] == 0 and totals["requests"] >= 4 * 2 * 48
    assert results["tier"]["error_rate"] == 0.05


def test_failing_tier_ends_its_runs_with_one_line_and_others_keep_results(tmp_path):
    loaders = {"torch": {"variant": "tuned", "num_workers": [0, 1]}, "arrow": {"form": "encoded"}}
    _bench(tmp_path, "local", {"arrow": {"form": "encoded"}}, "convert")  # the Arrow form, converted off the tier
    results = _bench(tmp_path, {"name": "broken", "error_rate": 1.0, "retry": {**FAST_RETRY, "max_attempts": 2}},
                     loaders, "broken")
    by_backend = {r["label"]: r for r in results["runs"]}
    torch_runs = [r for label, r in by_backend.items() if label.startswith("torch")]
    assert len(torch_runs) == 2
    for run in torch_runs:
        assert run["status"] == "error" and "\n" not in run["reason"]
        # the read's own line, from the consumer or a worker alike (a storage failure is no damaged sample)
        assert "read failed 2 times over" in run["reason"] and "InjectedReadError" in run["reason"]
        assert run["tier_counters"]["failed_reads"] >= 1 and "metrics" not in run
    # the converted file is read through the tier too: it fails as well, in one line
    arrow = next(r for label, r in by_backend.items() if label.startswith("arrow"))
    assert arrow["status"] == "error" and "read failed 2 times" in arrow["reason"] and "\n" not in arrow["reason"]


def test_many_slots_and_threads_open_descriptors_as_requests_overlap(tmp_path):
    """A tier of 825 slots (S3's request rate x latency) used by 64 threads: the slot files' descriptors
    are pooled per slot, so they number at most the slots plus the requests held at once, not slots x
    threads (52,800, which ran `loadopt tiers` out of open files)."""
    from concurrent.futures import ThreadPoolExecutor

    state = SharedTierState(tmp_path / "tier", slots=825)
    before = len(os.listdir("/proc/self/fd"))

    def request(_: int) -> None:
        with state.slot(time.monotonic(), 0.0005):
            time.sleep(0.0005)

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(request, range(3000)))
    opened = len(os.listdir("/proc/self/fd")) - before
    assert 0 < opened <= 825 + 64 + 8, opened  # one a slot, one more per request held at once, the state


def test_the_storage_under_a_tier_counts_the_time_it_runs_past_the_tiers_figures(tmp_path):
    """The emulation can only slow the storage under it down: where that storage is slower than the tier's
    figures, the requests' time past those figures is counted as the base's (`base_share`)."""
    paths = _files(tmp_path, 48, 20_000)
    local = fsspec.implementations.local.LocalFileSystem()
    # a slow disk (itself emulated: 2 MB/s) under a fast tier: most of each request's time is the disk's
    disk = EmulatedFileSystem(TierSpec(name="disk", bandwidth_mb_s=2), local)
    fast = EmulatedFileSystem(TierSpec(name="fast", bandwidth_mb_s=1000, latency_ms=0.1), disk)
    _read_all(fast, paths, 4)
    assert base_share(tier_counters(fast)) > 0.6, tier_counters(fast)
    # a slow tier over the local disk: its figures set every request's time, and it delivers what they say
    spec = TierSpec(name="slow", latency_ms=10, max_concurrency=2)
    slow = tier_filesystem(spec, local)
    elapsed = _read_all(slow, paths, 4)
    assert base_share(tier_counters(slow)) < BASE_BOUND_SHARE, tier_counters(slow)
    delivered = 48 * 20_000 / elapsed / 1e6
    assert 0.75 < delivered / spec.profile_mb_s(4, 20_000) <= 1.05, (delivered, spec.profile_mb_s(4, 20_000))


def test_a_tiers_own_figures():
    """MB/s of requests in flight by the figures alone: the latency and the transfer, the cap, the pipe."""
    spec = TierSpec(bandwidth_mb_s=100, latency_ms=10, max_concurrency=2)  # 1e5 bytes: 10 + 1 ms a request
    assert spec.profile_mb_s(1, 1e5) == pytest.approx(1e5 / 0.011 / 1e6)
    assert spec.profile_mb_s(4, 1e5) == spec.profile_mb_s(64, 1e5) == pytest.approx(2e5 / 0.011 / 1e6)  # 2 slots
    assert TierSpec(bandwidth_mb_s=50).profile_mb_s(8, 1e6) == 50  # no latency: the pipe
    assert TierSpec(bandwidth_mb_s=50, latency_ms=1).profile_mb_s(1000, 1e6) == 50
    assert TierSpec(name="as it is").profile_mb_s(4, 1e5) is None  # no figures: the storage's own


def test_bench_through_a_tier_over_slower_storage_says_its_figures_are_that_storages(tmp_path, monkeypatch):
    """`loadopt bench` under an emulated tier over a disk slower than the tier's figures: each run, and the
    decision resting on them, says its reads were bounded by that disk; over a faster disk, nothing is said."""
    import loadopt.storage.open as opening

    loaders = {"torch": {"variant": "tuned", "num_workers": 0}}
    tier = {"name": "fast", "bandwidth_mb_s": 1000, "latency_ms": 2}
    results = _bench(tmp_path, tier, loaders, "roomy")  # the tier's 2 ms a read set every read's time
    assert results["runs"][0]["status"] == "ok" and results["runs"][0]["bounded_by_base"] is None
    assert "bounded" not in json.loads((tmp_path / "roomy" / "decision.json").read_text())["text"]

    disk = TierSpec(name="disk", bandwidth_mb_s=0.3)  # the machine's disk, slower
    monkeypatch.setattr(opening, "tier_filesystem", lambda spec, base: EmulatedFileSystem(
        spec, EmulatedFileSystem(disk, base)))
    results = _bench(tmp_path, tier, loaders, "starved")
    run = results["runs"][0]
    assert run["status"] == "ok" and run["bounded_by_base"].startswith("reads bounded by the"), run
    assert "not a figure of tier fast" in run["bounded_by_base"]
    decision = json.loads((tmp_path / "starved" / "decision.json").read_text())
    assert run["bounded_by_base"] in decision["text"] and decision["bounded_by_base"] == run["bounded_by_base"]
