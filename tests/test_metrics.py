"""The harness's metrics against loaders whose per-batch delays are known."""

import numpy as np
import pytest
import torch

from loadopt.bench.accelerator import EmulatedAccelerator
from loadopt.bench.harness import run_repeat
from loadopt.device import DeviceTransfer

from .backends import delay_loader, pixel_loader

CPU = torch.device("cpu")
BATCH = 16


def run(delay_s, step_s, background, batches=40, prefetch=2, loader=None):
    loader = loader or delay_loader(4096, batch_size=BATCH, delay_s=delay_s, background=background,
                                    prefetch=prefetch)
    return run_repeat(loader, EmulatedAccelerator(step_s, CPU), DeviceTransfer(CPU, emulate=True),
                      warmup_batches=3, measure_batches=batches)


def measure(delay_s, step_s, background, batches=40, prefetch=2, loader=None):
    return run(delay_s, step_s, background, batches, prefetch, loader).metrics


@pytest.mark.parametrize(("delay_s", "step_s", "background", "prefetch"), [
    (0.020, 0.008, True, 2),  # loader-bound, prefetching producer: one batch per delay
    (0.004, 0.016, True, 2),  # compute-bound: the producer keeps ahead, no stall
    (0.010, 0.010, False, 2),  # synchronous loader: the device runs step i while the host makes batch i+1
    (0.010, 0.025, True, 4),  # an outside backend's thread, 4 batches ahead of a 25 ms step: never a stall
    (0.040, 0.025, True, 4),  # the same at 40 ms a batch: a stall of 1 - 25/40 = 0.375, all the loader's
])
@pytest.mark.timing
def test_stall_fraction_and_throughput_match_the_truth(delay_s, step_s, background, prefetch):
    batches = 40
    loader = delay_loader(4096, batch_size=BATCH, delay_s=delay_s, background=background, prefetch=prefetch)
    result = run(delay_s, step_s, background, batches=batches, loader=loader)
    m = result.metrics
    # The emulated device as a GPU: each step lasts the step time on its clock, and the copy and finishing of
    # the next batch run beside it, so the period of a step is the slowest of the step, the loader (its own
    # time per batch: the delay as slept, which runs long on a busy machine) and the finishing (timed by
    # the harness, `finish_s`), never their sum. A synchronous loader makes each batch on the host, which
    # also queues the batch's copy and step between holding one batch and asking for the next.
    assert m["compute_s"] / m["batches"] == pytest.approx(step_s)
    made_s = float(np.mean(loader.made_s[3:]))
    assert made_s >= delay_s
    measured = [p for p in result.probes if p.measured]
    between_s = float(np.mean([b.start_s - a.start_s - a.wait_s for a, b in
                               zip(measured, measured[1:], strict=False)]))
    finish_s = m["finish_s"] / m["batches"]
    period = max(step_s, made_s if background else made_s + between_s, finish_s)
    true_stall = 1.0 - step_s / period
    # The window may open on up to prefetch + 1 batches the producer made ahead during the warm-up (as the
    # throughput's bound below counts them): a loader-bound window then stalls less, never more.
    ahead = period * batches / (batches + prefetch + 1) if background else period
    least_stall = 1.0 - step_s / max(step_s, ahead)
    assert least_stall - 0.03 <= m["stall_fraction"] <= true_stall + 0.03, (m["stall_fraction"], true_stall)
    # Whose the stall is: the loader's here (the finishing of these batches is far shorter than a step).
    assert m["loader_stall_fraction"] + m["finish_stall_fraction"] == pytest.approx(m["stall_fraction"], abs=1e-6)
    assert m["finish_stall_fraction"] <= 0.03
    # The harness's own work only adds time, so the truth is an upper bound to within the clock's
    # resolution, plus the batches the producer made ahead while the warm-up's steps ended (its queue and
    # the one it holds); a loaded machine (CI) lands up to ~5% below it.
    upper = BATCH / period * (batches + prefetch + 1) / batches * 1.02 if background else BATCH / period * 1.02
    assert BATCH / period * 0.90 <= m["samples_per_s"] <= upper
    assert m["accelerator_utilisation"] + m["stall_fraction"] == pytest.approx(1.0)


@pytest.mark.timing
def test_a_finishing_slower_than_the_step_is_the_finishings_stall():
    """Batches ready at once, their finishing (a real copy and normalisation of large uint8 batches on the
    emulated device) longer than the step: the stall is the finishing's, at least 1 - step / finishing."""
    loader = pixel_loader(batch_size=64, size=224)
    step_s = 0.002
    m = measure(0.0, step_s, False, batches=30, loader=loader)
    finish_s = m["finish_s"] / m["batches"]
    assert finish_s > 2 * step_s  # the premise: the finishing cannot keep up with the step
    true_stall = 1.0 - step_s / finish_s
    # On a busy machine the stream's thread also waits for a core between batches: more stall, never less.
    assert true_stall - 0.03 <= m["stall_fraction"] <= true_stall + 0.10
    assert m["finish_stall_fraction"] >= m["stall_fraction"] - 0.03
    assert m["loader_stall_fraction"] <= 0.03


def test_a_borrowed_buffer_is_copied_before_the_backend_reuses_it():
    """A backend that writes every batch into one buffer (`borrowed`) and waits on `copy_done` before it
    reuses it: the emulated device copies each batch's own pixels although it copies asynchronously."""
    loader = pixel_loader(batch_size=8, size=16, borrowed=True)
    seen: list[int] = []

    class Recording(DeviceTransfer):
        def to_device(self, *tensors):
            out = super().to_device(*tensors)
            seen.append(int(out[0][0, 0, 0, 0]))
            return out

    run_repeat(loader, EmulatedAccelerator(0.002, CPU), Recording(CPU, emulate=True), warmup_batches=2,
               measure_batches=20)
    assert seen == [n % 256 for n in range(22)]


def test_counts_bytes_percentiles_and_emulated_h2d():
    m = measure(0.002, 0.001, True, batches=20)
    assert m["samples"] == 20 * BATCH and m["batches"] == 20
    assert m["sample_bytes_delivered"] == 20 * BATCH * 1000
    assert m["goodput_ratio"] == pytest.approx(1.0)
    assert m["wait_p50_ms"] <= m["wait_p95_ms"] <= m["wait_p99_ms"] <= m["wait_max_ms"]
    assert m["h2d_emulated"] and m["h2d_gb_per_s"] > 0
    assert m["cpu_seconds_per_1k_samples"] is not None
    assert m["peak_rss_mb"] > 10 and 0 < m["peak_pss_mb"] <= m["peak_rss_mb"]


def test_measurement_spans_epochs():
    loader = delay_loader(40, batch_size=8, delay_s=0.0, background=False)  # 5 batches per epoch
    result = run_repeat(loader, EmulatedAccelerator(0.0, CPU), DeviceTransfer(CPU, emulate=True),
                        warmup_batches=2, measure_batches=12)
    assert result.metrics["batches"] == 12
    assert loader.epoch == 2


def _burn(seconds):
    import time as t

    end = t.process_time() + seconds
    while t.process_time() < end:
        pass


def test_process_tree_monitor_counts_children_that_exit_inside_the_window():
    import multiprocessing

    from loadopt.bench.monitor import ProcessTreeMonitor

    with ProcessTreeMonitor(interval_s=0.05) as monitor:
        child = multiprocessing.get_context("fork").Process(target=_burn, args=(0.4,))
        child.start()
        child.join()
    usage = monitor.usage
    assert usage.cpu_seconds >= 0.35  # the child's CPU, though it exited before the window closed
    assert 0 < usage.peak_pss_bytes <= usage.peak_rss_bytes


def test_a_monitor_without_pss_at_its_edges_reads_pss_only_on_its_thread(monkeypatch):
    """`loadopt measure` starts and stops a monitor at every pass's edges, on the training loop's own clock:
    there it must not walk the page tables (PSS), which takes ~0.1 s in a process that has mapped a few GB."""
    import os
    import threading
    import time

    from loadopt.bench import monitor as monitor_module

    read_memory = monitor_module._memory
    pss_threads: list[str] = []

    def counted(proc, with_pss):
        if with_pss and proc.pid == os.getpid():  # this process's reads (the suite may have children alive)
            pss_threads.append(threading.current_thread().name)
        return read_memory(proc, with_pss)

    monkeypatch.setattr(monitor_module, "_memory", counted)
    short = monitor_module.ProcessTreeMonitor(interval_s=0.5, pss_at_edges=False).start()
    short.stop()
    assert pss_threads == [] and short.usage.peak_pss_bytes == 0  # shorter than one interval: none taken
    assert short.usage.peak_rss_bytes > 0
    long = monitor_module.ProcessTreeMonitor(interval_s=0.05, pss_at_edges=False).start()
    time.sleep(0.3)  # the monitor's own thread samples meanwhile: the wait is the window, not a stand-in
    long.stop()
    assert pss_threads and set(pss_threads) == {"loadopt-monitor"}
    assert 0 < long.usage.peak_pss_bytes <= long.usage.peak_rss_bytes
    pss_threads.clear()
    with monitor_module.ProcessTreeMonitor(interval_s=0.5):  # the bench's: PSS at both edges as well
        pass
    assert pss_threads == [threading.current_thread().name] * 2


def test_emulated_device_buffers_are_freed_without_the_cycle_collector():
    """A bench builds one emulated device per run: its buffers (~100 MB at ImageNet sizes) must go
    when the run ends, not at some later cyclic garbage collection."""
    import gc
    import weakref

    gc.disable()
    try:
        loader = delay_loader(64, batch_size=8, delay_s=0.0, background=False)
        transfer = DeviceTransfer(CPU, emulate=True)
        run_repeat(loader, EmulatedAccelerator(0.0, CPU), transfer, warmup_batches=1, measure_batches=3)
        refs = [weakref.ref(transfer), weakref.ref(loader)]
        del transfer, loader
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def test_one_function_for_bench_and_measure():
    """The same window, as bench's probes and as measure's record, gives the same step metrics
    (loadopt.bench.metrics.step_metrics computes both), with the values DESIGN.md defines."""

    from loadopt.bench.metrics import BatchProbe, step_metrics, window_metrics
    from loadopt.bench.monitor import TreeUsage
    from loadopt.device import Elapsed
    from loadopt.measure.reporting import Recorded, recorded_metrics

    waits, steps, samples = [0.010, 0.030, 0.020, 0.040], [0.050, 0.050, 0.050, 0.050], [8, 8, 8, 4]
    wall = sum(waits) + sum(steps)  # 0.3 s
    probes = [BatchProbe(i, True, 0.0, w, Elapsed(0.001), 2_000_000, 0.0, Elapsed(s), n, n * 1000)
              for i, (w, s, n) in enumerate(zip(waits, steps, samples, strict=True))]
    usage = TreeUsage(cpu_seconds=0.56, storage_bytes_read=10**6, peak_rss_bytes=2**30, peak_pss_bytes=2**29,
                      others_cpu_share=0.0)
    bench = window_metrics(probes, wall, usage, loader_bytes_read=56_000, h2d_pinned=True, h2d_emulated=False)
    measured = recorded_metrics(Recorded(
        wait_ns=np.array(waits) * 1e9, step_ns=np.array(steps) * 1e9, samples=np.array(samples), sample_bytes=1000.0,
        cpu_seconds=0.56, storage_bytes_read=10**6, peak_rss_bytes=2**30, peak_pss_bytes=2**29,
        h2d_bytes=8_000_000, h2d_s=0.004, h2d_pinned=True, device_busy_s=None, device_idle_s=None, unmarked_waits=0))
    assert bench["samples_per_s"] == pytest.approx(28 / 0.3) and bench["mb_per_s"] == pytest.approx(28_000 / 0.3 / 1e6)
    assert bench["stall_fraction"] == pytest.approx(0.1 / 0.3) and bench["compute_s"] == pytest.approx(0.2)
    assert bench["wait_p50_ms"] == pytest.approx(25.0) and bench["wait_max_ms"] == pytest.approx(40.0)
    assert bench["h2d_gb_per_s"] == pytest.approx(8e6 / 0.004 / 1e9) and bench["goodput_ratio"] == pytest.approx(0.5)
    assert bench["cpu_seconds_per_1k_samples"] == pytest.approx(20.0) and bench["peak_pss_mb"] == 512
    for key in step_metrics(waits_s=np.array(waits), wall_s=wall, compute_s=0.2, samples=28, batches=4,
                            sample_bytes=28_000, h2d_s=0.004, h2d_bytes=8_000_000, cpu_seconds=0.56,
                            storage_bytes_read=10**6, peak_rss_bytes=2**30, peak_pss_bytes=2**29):
        assert measured[key] == pytest.approx(bench[key]), key
