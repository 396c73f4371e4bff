"""`loadopt bench` in the inference scenarios: every configured backend's request paths (or, offline, its
loader) over the same dataset, recipe and accelerator; serve.json written into the output folder.

Each backend setting gives its request paths (`Loader.request_paths`), or the reason it has none (listed as
unavailable for the scenario). Per path: the requests' payloads are read first (LoadGen's query sample
library), a few requests warm it up, then the scenario's runs: `server` one open-loop run at `target_qps` (or
the arrivals file) and, with `slo_ms`, the search for the highest rate within it; `single_stream` one request
at a time; `offline` one ordered pass of the loader.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loadopt.bench.monitor import MachineLoad, load_note
from loadopt.config import backend_settings
from loadopt.config_models import Config, ServeConfig
from loadopt.device import DeviceTransfer, finish_inputs, resolve_device
from loadopt.errors import BackendUnavailable, DatasetError, LoadoptError, Terminated, shown_name
from loadopt.files import atomic_write_text, discard_output, prepare_output
from loadopt.loaders.base import Loader
from loadopt.loaders.registry import backend_for, configured_loader
from loadopt.loaders.serving import RequestPath, Unservable
from loadopt.machine import usable_cores
from loadopt.progress import Reporter
from loadopt.schema.serve import PathResult, ServeResults, ServerPoint
from loadopt.serve import latency
from loadopt.serve.arrivals import offered_rate, poisson_arrivals, read_arrivals
from loadopt.serve.offline import run_offline
from loadopt.serve.search import highest_rate_within
from loadopt.serve.server import Batching, serve_one_at_a_time, serve_open_loop
from loadopt.serve.step import ServingStep
from loadopt.storage.dataset import Dataset
from loadopt.storage.open import open_dataset

WARMUP_REQUESTS = 16  # one at a time before a path's timed runs: first decodes, allocations, DALI's first batch
QUICK_REQUESTS = 400  # --quick: requests per run
QUICK_RUN_SECONDS = 4.0  # --quick: seconds of arrivals per run at most
MIN_RUN_REQUESTS = 200  # a run shortened by run_seconds keeps at least these (its p99 rests on 2 of them)


@dataclass
class ServeOutcome:
    results: ServeResults
    json_path: Path | None  # None when nothing was measured (the folder left as it was)
    interrupted: bool = False


def serve_settings(config: Config, quick: bool, slo_ms: float | None) -> ServeConfig:
    serve = config.workload.serve
    update: dict[str, object] = {}
    if slo_ms is not None:
        update["slo_ms"] = slo_ms
    if quick:
        update.update(requests=min(serve.requests, QUICK_REQUESTS), search_runs=min(serve.search_runs, 4),
                      run_seconds=min(serve.run_seconds, QUICK_RUN_SECONDS))
    return serve.model_copy(update=update)


def run_serve_bench(config: Config, *, loaders: list[str] | None = None, out: str | None = None,
                    quick: bool = False, reporter: Reporter | None = None, slo_ms: float | None = None,
                    convert: bool = True, relist: bool = False) -> ServeOutcome:
    """Measure every configured backend in `config.workload.scenario`; write serve.json into `out`. `relist`
    lists the dataset again and saves the new listing."""
    serve = serve_settings(config, quick, slo_ms)
    if config.workload.scenario == "train":
        raise ValueError("run_serve_bench runs the inference scenarios; train is run_bench's")
    arrivals = read_arrivals(serve.arrivals) if serve.arrivals and config.workload.scenario == "server" else None
    requested = Path(out or config.report.out).expanduser()
    existed = requested.exists()
    folder = prepare_output(requested)
    bench = _ServeBench.start(config, serve, arrivals, reporter or Reporter(), convert, relist)
    load = MachineLoad().start()
    paths: list[PathResult] = []
    interrupted_by: str | None = None
    try:
        for name in loaders or list(config.loaders):
            for row in bench.backend_rows(name):  # row by row: an interrupt keeps the rows before it
                paths.append(row)
    except KeyboardInterrupt as exc:  # the paths finished are kept; the one under way is not
        interrupted_by = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
    interrupted = interrupted_by is not None
    results = bench.results(paths, load_note(load.stop()) or "")
    results.interrupted_by = interrupted_by
    if not any(p.status == "ok" for p in paths):
        discard_output(folder, existed)
        return ServeOutcome(results, None, interrupted)
    json_path = folder / "serve.json"
    atomic_write_text(json_path, results.model_dump_json(indent=2))
    return ServeOutcome(results, json_path, interrupted)


def inference_config(config: Config) -> Config:
    """`config` as inference takes it: the eval recipe, in input order, nothing dropped."""
    pipeline = config.pipeline.model_copy(update={"augment": "eval", "shuffle": False, "drop_last": False})
    return config.model_copy(update={"pipeline": pipeline})


@dataclass
class _ServeBench:
    """What every backend's rows share: the eval config, dataset, device, the accelerator's step, the finishing
    of a batch on the device, the serving settings and the arrivals file."""

    config: Config  # with the eval recipe, in input order
    serve: ServeConfig
    arrivals: np.ndarray | None
    dataset: Dataset
    device: torch.device
    step: ServingStep
    transfer: DeviceTransfer
    workers: int
    reporter: Reporter
    convert: bool

    @classmethod
    def start(cls, config: Config, serve: ServeConfig, arrivals: np.ndarray | None, reporter: Reporter,
              convert: bool, relist: bool = False) -> _ServeBench:
        device = resolve_device(config.workload.device)
        dataset = open_dataset(config, progress=reporter.dataset_progress, relist=relist)
        return cls(inference_config(config), serve, arrivals, dataset, device,
                   ServingStep(config.workload, max(1, len(dataset.classes)), device),
                   DeviceTransfer(device, emulate=True), serve.workers or usable_cores(), reporter, convert)

    def finish(self, images: torch.Tensor) -> torch.Tensor:
        """The server's batch on the device, finished (layout, normalisation) as the loaders' are."""
        moved = images if images.device == self.device else self.transfer.to_device(images)[0]
        return finish_inputs(moved, "NHWC", False, self.config.pipeline, self.transfer.scratch)

    def results(self, paths: list[PathResult], machine_load: str) -> ServeResults:
        config, serve, pipeline = self.config, self.serve, self.config.pipeline
        server = config.workload.scenario == "server"
        results = ServeResults(
            name=config.name, scenario=config.workload.scenario,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=str(self.device),
            dataset=f"{self.dataset.root} ({len(self.dataset):,} samples)",
            recipe=f"eval: the centre crop ({pipeline.image_size} px), {pipeline.dtype}, {pipeline.memory_format}",
            arrivals=_arrivals_text(serve, self.arrivals) if server else "", step=self.step.describe(),
            batching=f"max_batch={serve.max_batch} max_queue_delay_ms={serve.max_queue_delay_ms:g}",
            slo_ms=serve.slo_ms if server else None, workers=self.workers, machine_load=machine_load, paths=paths)
        results.summary = summary(results)
        return results

    def backend_rows(self, name: str) -> Iterator[PathResult]:
        """The rows of one configured backend: one per setting (offline) or per request path of each setting."""
        cls = backend_for(name, f"--loaders {name}")
        available, reason = cls.available()
        if available:
            available, reason = cls.supports(self.dataset)
        if not available:
            yield PathResult(label=name, backend=name, status="unavailable", reason=reason)
            return
        for settings in backend_settings(self.config, name):
            knobs = settings.model_dump(mode="json")
            try:
                loader = configured_loader(name, self.config, self.dataset, settings, device=self.device)
            except BackendUnavailable as exc:
                yield PathResult(label=name, backend=name, status="unavailable", reason=str(exc), settings=knobs)
                continue
            if self.config.workload.scenario == "offline":
                if not loader.shared_order:  # a peer library orders the samples itself
                    loader.close()
                    yield PathResult(label=name, backend=name, status="unavailable", settings=knobs,
                                     reason=f"{name} orders the samples itself; offline takes them in input order")
                    continue
                yield self.offline_row(loader, name, knobs)
                continue
            try:
                request_paths = loader.request_paths(self.serve.max_batch)
            except Unservable as exc:
                loader.close()
                yield PathResult(label=name, backend=name, status="unavailable", reason=str(exc), settings=knobs)
                continue
            try:
                for path in request_paths:
                    yield self.path_row(path, name, knobs)
            finally:
                loader.close()

    def offline_row(self, loader: Loader, name: str, knobs: dict) -> PathResult:
        label = f"{name} {loader.describe()}"
        try:
            loader.prepare(functools.partial(self.reporter.conversion_progress, label), self.convert)
            self.reporter.run_started(f"{label} offline", len(loader))
            offline = run_offline(loader, self.step, self.transfer)
        except BackendUnavailable as exc:
            return PathResult(label=label, backend=name, status="unavailable", reason=str(exc), settings=knobs)
        except LoadoptError as exc:
            return PathResult(label=label, backend=name, status="error", reason=str(exc).splitlines()[0],
                              settings=knobs)
        finally:
            loader.close()
        self.reporter.run_finished(f"{label} offline", None, None)
        self.reporter.line(f"  {label}: {offline.samples_per_s:,.0f} samples/s offline, first result in "
                           f"{offline.first_result_s:.2f} s")
        return PathResult(label=label, backend=name, status="ok", settings=knobs, offline=offline)

    def path_row(self, path: RequestPath, name: str, knobs: dict) -> PathResult:
        """One request path through the scenario's runs."""
        row = PathResult(label=path.label, backend=name, status="ok", settings=knobs)
        try:
            path.open(self.dataset, functools.partial(self.reporter.conversion_progress, path.label))
            count = len(self.arrivals) if self.arrivals is not None else self.serve.requests
            # Request i is sample i of the dataset (cycling): each payload read once, before any timing.
            payloads = [path.payload(self.dataset, i) for i in range(min(count, len(self.dataset)))]
            requests = [payloads[i % len(payloads)] for i in range(count)]
            warm = serve_one_at_a_time(path, requests[:WARMUP_REQUESTS], self.step, self.finish)
            self.raise_on_failures(warm.failures, len(payloads), 0)  # 0: the warm-up alone never ends a skip run
            self.reporter.run_started(f"{path.label} {self.config.workload.scenario}", 0)
            if self.config.workload.scenario == "single_stream":
                times = serve_one_at_a_time(path, requests, self.step, self.finish)
                self.raise_on_failures(times.failures, len(payloads), len(requests))
                row.single_stream = latency.single_stream(times)
            else:
                self.server_runs(row, path, requests, len(payloads))
            self.reporter.run_finished(path.label, None, None)
            self.reporter.line(f"  {path.label}: {_row_line(row)}")
        except (BackendUnavailable, ImportError) as exc:
            return PathResult(label=path.label, backend=name, status="unavailable",
                              reason=str(exc).splitlines()[0], settings=knobs)
        except LoadoptError as exc:
            return PathResult(label=path.label, backend=name, status="error", reason=str(exc).splitlines()[0],
                              settings=knobs)
        finally:
            path.close()
        return row

    def server_runs(self, row: PathResult, path: RequestPath, requests: list, samples: int) -> None:
        """The open-loop runs of one path: the arrivals file's, or one at target_qps and the search within slo_ms."""
        serve = self.serve
        batching = Batching(serve.max_batch, serve.max_queue_delay_ms / 1000.0)

        def trial(rate: float, schedule: np.ndarray | None = None) -> ServerPoint:
            if schedule is None:
                n = min(len(requests), max(MIN_RUN_REQUESTS, int(rate * serve.run_seconds)))
                schedule = poisson_arrivals(rate, n, serve.seed)
            times = serve_open_loop(path, requests[: len(schedule)], schedule, batching, self.step, self.finish,
                                    self.workers, stop=threading.Event())
            self.raise_on_failures(times.failures, samples, len(schedule))
            return latency.server_point(times, rate, serve.slo_ms)

        if self.arrivals is not None:
            row.server = trial(offered_rate(self.arrivals), self.arrivals)
            row.curve = [row.server]
        elif serve.slo_ms is not None:  # the first run at target_qps, then the search
            row.best_within_slo = highest_rate_within(trial, serve.target_qps, serve.slo_ms, serve.search_runs,
                                                      row.curve)
            row.server = next(p for p in row.curve if p.offered_qps == serve.target_qps)
        else:
            row.server = trial(serve.target_qps)
            row.curve = [row.server]

    def raise_on_failures(self, failures: dict[int, str], samples: int, total: int) -> None:
        """dataset.on_error: raise stops at the first request that could not be preprocessed, naming its sample
        (request i is sample i % `samples`); skip counts them, unless none of the `total` could be."""
        if failures and (self.config.dataset.on_error == "raise" or len(failures) == total):
            request, reason = min(failures.items())
            if len(failures) == total and self.config.dataset.on_error == "skip":
                raise DatasetError(f"none of the {total} requests could be preprocessed; the first: "
                                   f"{shown_name(self.dataset.path(request % samples))}: {reason}")
            raise DatasetError(f"{shown_name(self.dataset.path(request % samples))}: {reason} (request {request}; "
                               "dataset.on_error: skip serves the others and counts it)")


def _row_line(row: PathResult) -> str:
    """A finished path's figures in a few words (the progress line)."""
    if row.single_stream is not None:
        return f"p90 {row.single_stream.p90_ms:.1f} ms one at a time"
    best = row.best_within_slo
    if best is not None:
        return f"{best.offered_qps:,.0f} requests/s within the bound (p99 {best.p99_ms:.1f} ms)"
    if row.server is not None:
        return f"p99 {row.server.p99_ms:.1f} ms at {row.server.offered_qps:,.0f} requests/s"
    return "done"


def _arrivals_text(serve: ServeConfig, arrivals: np.ndarray | None) -> str:
    if arrivals is not None:
        return f"{serve.arrivals}: {len(arrivals):,} arrivals, {offered_rate(arrivals):,.1f} requests/s offered"
    return (f"Poisson from {serve.target_qps:g} requests/s, {serve.requests:,} requests per run (at most "
            f"{serve.run_seconds:g} s of arrivals, at least {MIN_RUN_REQUESTS}; seed {serve.seed})")


def best_path(results: ServeResults) -> PathResult | None:
    """The path that answers the scenario's question best: the most samples/s (offline), the lowest p90
    (single stream), the highest rate within the bound, else the lowest p99 at the offered rate (server)."""
    ok = [p for p in results.paths if p.status == "ok"]
    if results.scenario == "offline":
        ranked = [p for p in ok if p.offline is not None]
        return max(ranked, key=lambda p: p.offline.samples_per_s, default=None)  # type: ignore[union-attr]
    if results.scenario == "single_stream":
        ranked = [p for p in ok if p.single_stream is not None]
        return min(ranked, key=lambda p: p.single_stream.p90_ms, default=None)  # type: ignore[union-attr]
    if results.slo_ms is not None:
        ranked = [p for p in ok if p.best_within_slo is not None]
        return max(ranked, key=lambda p: p.best_within_slo.offered_qps, default=None)  # type: ignore[union-attr]
    ranked = [p for p in ok if p.server is not None]
    return min(ranked, key=lambda p: p.server.p99_ms, default=None)  # type: ignore[union-attr]


def summary(results: ServeResults) -> str:
    """One sentence: the best path and its figure."""
    best = best_path(results)
    if best is None:
        if results.scenario == "server" and results.slo_ms is not None and any(p.status == "ok" for p in results.paths):
            return f"server: no path keeps p99 within {results.slo_ms:g} ms at any rate tried"
        return "no request path could be measured"
    if best.offline is not None and results.scenario == "offline":
        return f"offline: {best.label} is fastest at {best.offline.samples_per_s:,.0f} samples/s"
    if best.single_stream is not None and results.scenario == "single_stream":
        return f"single stream: {best.label} has the lowest p90 latency, {best.single_stream.p90_ms:.2f} ms"
    if best.best_within_slo is not None:
        point = best.best_within_slo
        return (f"server: {best.label} serves the highest rate within p99 <= {results.slo_ms:g} ms: "
                f"{point.offered_qps:,.0f} requests/s (p99 {point.p99_ms:.1f} ms)")
    assert best.server is not None
    return f"server: {best.label} has the lowest p99 at the offered rate, {best.server.p99_ms:.1f} ms"
