"""`loadopt.measure`: stalls of a loop of known delays, batches untouched, results files.

The zero-code runner and results across ranks: test_measure_script.py.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from loadopt.bench.metrics import median
from loadopt.errors import OutputError
from loadopt.measure import count_samples, measure, measure_steps
from tests.backends import delay_loader

STEPS = 30


def sleepy(n: int, delay_s: float, batch_size: int = 4, spent: list[float] | None = None):
    """A foreground loader: each batch costs `delay_s` when asked for (the time each one really took,
    sleep's overshoot on a busy machine included, appended to `spent`)."""
    for i in range(n):
        start = time.perf_counter()
        time.sleep(delay_s)
        if spent is not None:
            spent.append(time.perf_counter() - start)
        yield torch.full((batch_size, 2), float(i))


def run_loop(iterable, body_s: float, spent: list[float] | None = None) -> int:
    steps = 0
    for _ in iterable:
        start = time.perf_counter()
        time.sleep(body_s)
        if spent is not None:
            spent.append(time.perf_counter() - start)
        steps += 1
    return steps


@pytest.mark.timing
@pytest.mark.parametrize("delay_s, body_s", [(0.02, 0.01), (0.005, 0.025)], ids=["loader-bound", "compute-bound"])
def test_stall_fraction_of_a_foreground_loader(delay_s, body_s):
    waited, worked = [], []
    m = measure(sleepy(STEPS, delay_s, spent=waited), device="cpu", summary=False)
    assert run_loop(m, body_s, spent=worked) == STEPS
    metrics = m.metrics()
    # The truth from the sleeps as they really ran: on a busy machine each oversleeps by a few ms.
    truth = sum(waited) / (sum(waited) + sum(worked))
    assert abs(truth - delay_s / (delay_s + body_s)) < 0.1  # the delays injected are what ran
    assert metrics["batches"] == STEPS and metrics["samples"] == 4 * STEPS
    assert abs(metrics["stall_fraction"] - truth) < 0.03, (metrics["stall_fraction"], truth)
    assert abs(metrics["accelerator_utilisation"] - (1 - truth)) < 0.03
    assert metrics["wait_p50_ms"] == pytest.approx(statistics.median(waited) * 1000, abs=3)


@pytest.mark.timing
@pytest.mark.parametrize("delay_s, body_s", [(0.02, 0.01), (0.01, 0.02)], ids=["loader-bound", "compute-bound"])
def test_stall_fraction_of_a_prefetching_loader(delay_s, body_s):
    """A producer thread with a prefetch queue (like DataLoader workers): in steady state the loop
    waits max(0, delay - body) per batch; the first batch is waited for in full."""
    loader = delay_loader(num_samples=16 * STEPS, batch_size=16, delay_s=delay_s, background=True)
    m = measure(loader, device="cpu", summary=False)
    assert run_loop(m, body_s) == STEPS
    loader.close()
    wait = delay_s + (STEPS - 1) * max(0.0, delay_s - body_s)
    if delay_s < body_s:  # a queued batch still takes its hand-over from the producer thread right after the
        # loop's sleep (~0.6 ms on this VM): real idle time, measured here on the same loader with no delay
        ready = delay_loader(num_samples=16 * STEPS, batch_size=16, delay_s=0.0, background=True)
        calibration = measure(ready, device="cpu", summary=False)
        run_loop(calibration, body_s)
        ready.close()
        wait += (STEPS - 1) * calibration.metrics()["wait_p50_ms"] / 1000
    wall = delay_s + (STEPS - 1) * max(delay_s, body_s) + body_s
    assert abs(m.metrics()["stall_fraction"] - wait / wall) < 0.03, (m.metrics()["stall_fraction"], wait / wall)
    assert m.label == "DelayLoader"


def test_batches_come_out_identical_and_in_order():
    Pair = namedtuple("Pair", "x y")
    batches = [torch.arange(6).view(3, 2), (torch.zeros(2), torch.ones(2)), {"x": torch.zeros(5)}, Pair(1, 2), "text"]
    out = list(measure(batches, summary=False))
    assert len(out) == len(batches) and all(a is b for a, b in zip(out, batches, strict=True))

    data = TensorDataset(torch.randn(40, 3), torch.arange(40))

    def loader():
        return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7))

    plain = list(loader())
    measured = list(measure(loader(), summary=False))
    assert len(plain) == len(measured) == 5
    for (x1, y1), (x2, y2) in zip(plain, measured, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_exceptions_of_the_wrapped_loader_surface_unchanged(tmp_path, caplog):
    error = ValueError("corrupt shard 3")

    def failing():
        yield torch.zeros(2, 1)
        yield torch.zeros(2, 1)
        raise error

    m = measure(failing(), summary=False)
    got = []
    with pytest.raises(ValueError) as info:
        for batch in m:
            got.append(batch)
    assert info.value is error
    assert len(got) == 2 and m.metrics()["batches"] == 2 and not m._open

    # Reporting at the end (here: an unwritable `out`) neither replaces the loader's exception nor
    # raises one of its own.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.INFO, logger="loadopt.measure"), pytest.raises(ValueError) as info:
        list(measure(failing(), out=blocker / "out"))
    assert info.value is error and "a-file" in caplog.text and "cannot write" in caplog.text
    assert list(measure(range(3), out=blocker / "out")) == [0, 1, 2]


def test_break_and_body_errors_close_the_window(caplog):
    m = measure(range(100))
    with caplog.at_level(logging.INFO, logger="loadopt.measure"):
        for i in m:
            if i == 4:
                break
    assert not m._open and m.metrics()["batches"] == 5
    assert "measure range: 5 steps" in caplog.text
    m2 = measure(range(10), summary=False)
    with pytest.raises(KeyError):
        for i in m2:
            if i == 2:
                raise KeyError(i)
    del i  # the suspended generator is closed when its last reference goes
    assert not m2._open and m2.metrics()["batches"] == 3


def test_verdicts_and_periodic_lines(caplog):
    with caplog.at_level(logging.INFO, logger="loadopt.measure"):
        run_loop(measure(sleepy(10, 0.01), every=5), 0.0)
    text = caplog.text
    assert "input-bound: a faster loader (see `loadopt bench`) would speed this job up by up to" in text
    assert "step 5:" in text and "step 10:" in text
    assert "the loop body stands for the accelerator" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loadopt.measure"):
        run_loop(measure([torch.zeros(1)] * 5), 0.01)
    assert "compute-bound" in caplog.text


@pytest.mark.timing
def test_measure_steps_context_manager_and_decorator():
    with measure_steps(summary=False) as m:
        for batch in sleepy(STEPS // 2, 0.02):
            m.batch(batch)
            time.sleep(0.01)
            m.step()
    assert abs(m.metrics()["stall_fraction"] - 2 / 3) < 0.03 and m.metrics()["samples"] == 4 * (STEPS // 2)

    d = measure_steps(summary=False)

    @d
    def train_step(batch):
        time.sleep(0.02)
        return batch.sum()

    with d:
        for batch in sleepy(STEPS // 2, 0.005):
            train_step(batch)
    assert abs(d.metrics()["stall_fraction"] - 0.2) < 0.03 and d.metrics()["batches"] == STEPS // 2
    assert train_step.__name__ == "train_step"


def test_steps_without_batch_marks_are_flagged():
    with measure_steps(summary=False) as m:
        for _ in range(3):
            m.step()
    metrics = m.metrics()
    assert metrics["batches"] == 3 and metrics["unmarked_waits"] == 3
    assert "no `m.batch()` mark" in m.summary()


def test_count_samples():
    assert count_samples(torch.zeros(7, 3)) == 7
    assert count_samples((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert count_samples({"input_ids": torch.zeros(3, 9), "mask": torch.zeros(3, 9)}) == 3
    assert count_samples([["a", "b", "c"], torch.zeros(3)]) == 3
    assert count_samples(torch.tensor(1.0)) == 1 and count_samples(object()) == 1 and count_samples(()) == 1


def test_to_device_on_the_cpu_hands_the_batch_through():
    m = measure([(torch.zeros(2, 3), torch.ones(2))], device="cpu", summary=False)
    for batch in m:
        assert m.to_device(batch) is batch
    assert m.metrics()["h2d_gb_per_s"] is None


def test_to_json_has_the_shape_of_bench_results(tmp_path):
    m = measure(sleepy(5, 0.002), summary=False, sample_bytes=1000)
    run_loop(m, 0.001)
    path = m.to_json(tmp_path / "sub" / "measure.json")
    doc = json.loads(path.read_text())
    assert doc["schema_version"] == 2 and doc["command"] == "loadopt.measure" and doc["steps"] == 5
    assert doc["device"] == "cpu" and doc["machine"]["cpu_count"] and doc["machine_fingerprint"]
    run = doc["runs"][0]
    assert run["backend"] == "measured" and run["label"] == "generator" and run["status"] == "ok"
    assert set(run["metrics"]["samples_per_s"]) == {"median", "min", "max"}
    assert run["repeats"][0]["samples_per_s"] == median(run["metrics"], "samples_per_s")
    assert run["repeats"][0]["mb_per_s"] == pytest.approx(run["repeats"][0]["samples_per_s"] * 1000 / 1e6)
    for key in ("stall_fraction", "accelerator_utilisation", "wait_p50_ms", "wait_p95_ms", "wait_p99_ms",
                "wait_max_ms", "cpu_seconds_per_1k_samples", "peak_rss_mb"):
        assert isinstance(run["repeats"][0][key], float), key
    assert doc["ranking"] == ["generator"] and doc["summary"].startswith("measure: 5 steps")


def test_unwritable_output_names_the_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    m = measure([1, 2], summary=False)
    list(m)
    with pytest.raises(OutputError, match="a-file"):
        m.to_json(blocker / "measure.json")


class FakeEvent:
    """A CUDA event on a device that runs in step with the host (completes when recorded)."""

    created = 0

    def __init__(self, enable_timing=False):
        FakeEvent.created += 1
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def query(self):
        return True

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


@pytest.mark.timing
def test_device_busy_and_idle_from_events_with_fake_cuda(monkeypatch):
    """The CUDA path's bookkeeping without a GPU: on a device in step with the host, the idle share
    read from events is the host's stall, and events are pooled rather than made per step."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    FakeEvent.created = 0
    m = measure(sleepy(STEPS // 2, 0.01), summary=False)
    run_loop(m, 0.02)
    metrics = m.metrics()
    assert m.device.type == "cuda" and metrics["compute_source"] == "cuda events"
    assert abs(metrics["device_idle_fraction"] - 1 / 3) < 0.03
    assert abs(metrics["stall_fraction"] - metrics["wait_fraction"]) < 0.01
    assert FakeEvent.created <= 2 * (m._cuda.lag + 3)
    assert "CUDA events" in m.summary() and "stands for the accelerator" not in m.summary()


@pytest.mark.gpu
def test_cuda_events_give_device_idle_without_per_step_sync():
    device = torch.device("cuda")
    torch.zeros(1, device=device)  # the job has initialised CUDA: the default device is CUDA
    cycles = 10_000_000  # torch.cuda._sleep: a device-side busy kernel, the host stays free
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    kernel_s = start.elapsed_time(end) / 1000.0
    m = measure(sleepy(STEPS, kernel_s * 2, batch_size=8), summary=False)
    for batch in m:
        moved = m.to_device(batch)
        assert moved.device.type == "cuda"
        torch.cuda._sleep(cycles)
    metrics = m.metrics()
    assert m.device.type == "cuda" and metrics["compute_source"] == "cuda events"
    # Per step the host waits 2k for the batch while the kernel of the step before (k) runs: the
    # device is idle half the time, though the host loop waited for data nearly all of it.
    assert metrics["device_idle_fraction"] == pytest.approx(0.5, abs=0.08)
    assert metrics["wait_fraction"] > 0.9
    assert metrics["h2d_gb_per_s"] is not None and metrics["h2d_gb_per_s"] > 0
