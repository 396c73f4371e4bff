"""CPU time, storage reads and resident memory of this process and all its descendants.

Loader workers come and go (a plain DataLoader forks new ones every epoch), so the tree is sampled
from a background thread and every process seen is remembered with its first and last counters.
CPU time is exact besides: `os.times()` adds the CPU of children already reaped.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import psutil

from loadopt.machine import CpuShare, LoadAverage, LoadSummary


@dataclass
class TreeUsage:
    cpu_seconds: float
    storage_bytes_read: int  # /proc/<pid>/io read_bytes: what came from the block device
    peak_rss_bytes: int  # sum of RSS: pages shared between processes (a worker ring) count once per process
    peak_pss_bytes: int  # sum of PSS (shared pages split between the processes mapping them), sampled ~1/s
    others_cpu_share: float | None = None  # the CPU other processes used over the window, of all the cores


@dataclass
class _Seen:
    first_io: int  # read_bytes
    last_io: int
    first_cpu: float
    last_cpu: float


def _io(proc: psutil.Process) -> int:
    """Bytes the process read from the block device (/proc/<pid>/io read_bytes); 0 where it cannot be read."""
    try:
        return proc.io_counters().read_bytes
    except (psutil.Error, AttributeError):
        return 0


def _memory(proc: psutil.Process, with_pss: bool) -> tuple[int, int | None]:
    """(RSS, PSS or None). PSS walks the page tables (smaps_rollup: milliseconds for a process with
    torch loaded, against microseconds for RSS), so it is read only when asked."""
    if with_pss:
        try:
            full = proc.memory_full_info()
            return full.rss, getattr(full, "pss", None)
        except psutil.AccessDenied:
            pass
    return proc.memory_info().rss, None


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (idle and I/O wait left out; time
    stolen by the hypervisor for other guests counted: it is taken from this machine's work)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def tree_cpu_seconds(root: psutil.Process) -> float:
    """CPU seconds of `root` and its descendants, reaped ones included."""
    total = 0.0
    for proc in [root, *_children(root)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _children(root: psutil.Process) -> list[psutil.Process]:
    try:
        return root.children(recursive=True)
    except psutil.Error:
        return []


def others_share(busy_s: float, own_s: float, wall_s: float, cores: int) -> float | None:
    """Of all the cores over `wall_s`, the share the machine's other processes used."""
    if wall_s <= 0 or cores <= 0:
        return None
    return min(1.0, max(0.0, (busy_s - own_s) / (wall_s * cores)))


def _cpu(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
        return times.user + times.system
    except psutil.Error:
        return 0.0


class ProcessTreeMonitor:
    """`start()` and `stop()` (or `with`) around the measured window; then `usage` holds the result."""

    def __init__(self, interval_s: float = 0.1, pss_every: int = 10, pss_at_edges: bool = True) -> None:
        self.interval_s = interval_s
        self.pss_every = pss_every  # PSS on every n-th sample (and the first and last): ~1% of a core
        # PSS walks the page tables: ~0.1 s for a process that has mapped a few GB (seen late in a test run).
        # Without `pss_at_edges` it is read only by the thread, never by `start` and `stop`, which run on the
        # measured job's own clock (a training loop's pass edges); a window shorter than `interval_s` then
        # has no PSS.
        self.pss_at_edges = pss_at_edges
        self._samples = 0
        self.usage: TreeUsage | None = None
        self._root = psutil.Process(os.getpid())
        self._children: dict[int, tuple[psutil.Process, _Seen]] = {}
        self._root_io = 0
        self._peak_rss = 0
        self._peak_pss = 0
        self._pss_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadopt-monitor", daemon=True)

    def _reaped_cpu(self) -> float:
        times = os.times()
        return times.children_user + times.children_system

    def _sample(self, with_pss: bool | None = None) -> None:
        if with_pss is None:
            with_pss = self._pss_samples == 0 or self._samples % self.pss_every == 0
        self._samples += 1
        rss, pss = _memory(self._root, with_pss)
        try:
            children = self._root.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            io, cpu = _io(child), _cpu(child)
            try:
                child_rss, child_pss = _memory(child, with_pss)
            except psutil.Error:
                continue
            rss = rss + child_rss
            pss = None if pss is None or child_pss is None else pss + child_pss
            known = self._children.get(child.pid)
            if known is None:
                self._children[child.pid] = (child, _Seen(io, io, cpu, cpu))
            else:
                known[1].last_io, known[1].last_cpu = io, cpu
        self._peak_rss = max(self._peak_rss, rss)
        if pss is not None:
            self._peak_pss = max(self._peak_pss, pss)
            self._pss_samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> ProcessTreeMonitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ProcessTreeMonitor:
        self._machine_start = (machine_busy_seconds(), time.perf_counter())
        self._root_io = _io(self._root)
        self._root_cpu = sum(os.times()[:2])
        self._start_reaped = self._reaped_cpu()
        self._sample(with_pss=self.pss_at_edges)
        # Children alive at the start count only their CPU from now on.
        self._live_at_start = {pid: seen.first_cpu for pid, (_, seen) in self._children.items()}
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(with_pss=self.pss_at_edges)
        storage = _io(self._root) - self._root_io
        cpu = sum(os.times()[:2]) - self._root_cpu
        # Reaped children: exact from os.times (includes the CPU they used before the window began,
        # which is subtracted below for those that were alive at the start).
        cpu += self._reaped_cpu() - self._start_reaped
        for pid, (proc, seen) in self._children.items():
            storage += seen.last_io - seen.first_io
            alive = proc.is_running()
            if alive:
                cpu += seen.last_cpu - self._live_at_start.get(pid, 0.0)
            else:
                cpu -= self._live_at_start.get(pid, 0.0)
        busy, wall = machine_busy_seconds() - self._machine_start[0], time.perf_counter() - self._machine_start[1]
        self.usage = TreeUsage(cpu, storage, self._peak_rss, self._peak_pss,
                               others_share(busy, cpu, wall, psutil.cpu_count() or 1))


BUSY_SHARE = 0.25  # other processes using a quarter of the cores or more: the machine was busy


class MachineLoad:
    """The machine's load over a whole bench, sampled every `interval_s` from a background thread: the
    load average (1 min) and the share of all cores that other processes used (the machine's busy CPU
    time less this process tree's). `start()`, `stop()`, then `summary()` for `results.json`."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self._root = psutil.Process(os.getpid())
        self._cores = psutil.cpu_count() or 1
        self._load: list[float] = []
        self._shares: list[float] = []
        self._first: tuple[float, float, float] | None = None
        self._last: tuple[float, float, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loadopt-machine-load", daemon=True)

    def _point(self) -> tuple[float, float, float]:
        return time.perf_counter(), machine_busy_seconds(), tree_cpu_seconds(self._root)

    def _sample(self) -> None:
        point = self._point()
        self._load.append(os.getloadavg()[0])
        if self._last is not None:
            share = others_share(point[1] - self._last[1], point[2] - self._last[2], point[0] - self._last[0],
                                 self._cores)
            if share is not None:
                self._shares.append(share)
        self._last = point

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> MachineLoad:
        self._sample()
        self._first = self._last
        self._thread.start()
        return self

    def stop(self) -> LoadSummary:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        self._sample()
        return self.summary()

    def summary(self) -> LoadSummary:
        first, last = self._first, self._last
        overall = None
        if first is not None and last is not None:
            overall = others_share(last[1] - first[1], last[2] - first[2], last[0] - first[0], self._cores)
        peak = max(self._shares, default=overall)
        busy = overall is not None and overall >= BUSY_SHARE
        out = LoadSummary(
            cores=self._cores, samples=len(self._load), interval_s=self.interval_s,
            load_average_1m=LoadAverage(mean=sum(self._load) / len(self._load), max=max(self._load)) if self._load
            else None,
            others_cpu_share=CpuShare(mean=overall, max=peak), busy=busy, note=None)
        out["note"] = load_note(out)
        return out


def load_note(load: LoadSummary | None) -> str | None:
    """A sentence saying the machine was busy (None when it was not, or was not sampled)."""
    if not load or not load.get("busy"):
        return None
    share = load["others_cpu_share"]
    average = load.get("load_average_1m")
    highest = average["max"] if average else 0
    return (f"the machine was busy: other processes used {share['mean']:.0%} of its {load['cores']} cores during "
            f"the bench (up to {share['max']:.0%}; load average up to {highest:.1f}), so rates and "
            "ceilings are lower than on a quiet machine and close comparisons are less sure")
