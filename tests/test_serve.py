"""The inference scenarios (loadopt/serve/): arrivals, the open-loop server and its batcher, one request at a
time, the rate search, the request paths, and `loadopt bench` with workload.scenario offline, server and
single_stream. Service times here come from a request path that sleeps a known time (the emulated work of an
outside backend); the truth against queueing theory at scale is benchmarks/serve_truth.py's."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from loadopt.cli import app
from loadopt.config import load_config
from loadopt.config_models import PipelineConfig, WorkloadConfig
from loadopt.errors import ConfigError
from loadopt.loaders.serving import RequestPath
from loadopt.schema.serve import LatencyParts, ServerPoint
from loadopt.serve import latency
from loadopt.serve.arrivals import offered_rate, poisson_arrivals, read_arrivals
from loadopt.serve.search import highest_rate_within
from loadopt.serve.server import Batching, serve_one_at_a_time, serve_open_loop
from loadopt.serve.step import ServingStep

from .conftest import tiny_config_dict
from .faults import said

PIPELINE = PipelineConfig(image_size=8, augment="eval")


class Sleeping(RequestPath):
    """Preprocesses a request in `service_s` (asleep: the GIL is free, as a decoder's), failing on b"bad"."""

    def __init__(self, service_s: float) -> None:
        super().__init__("sleeping", PIPELINE, 0)
        self.service_s = service_s

    def one(self, payload) -> torch.Tensor:
        time.sleep(self.service_s)
        if payload == b"bad":
            raise ValueError("damaged JPEG")
        return torch.zeros((8, 8, 3), dtype=torch.uint8)


class SleepingBatches(Sleeping):
    per_batch = True

    def batch(self, payloads) -> torch.Tensor:
        time.sleep(self.service_s)
        return torch.zeros((len(payloads), 8, 8, 3), dtype=torch.uint8)


def step_of(step_ms: float = 0.0, per_sample_ms: float = 0.0) -> ServingStep:
    workload = WorkloadConfig(step_time_ms=step_ms, serve={"per_sample_ms": per_sample_ms})
    return ServingStep(workload, 4, torch.device("cpu"))


def identity(images: torch.Tensor) -> torch.Tensor:
    return images


def test_poisson_arrivals_have_the_rate_and_are_seeded():
    arrivals = poisson_arrivals(500.0, 20_000, seed=1)
    assert np.all(np.diff(arrivals) >= 0)
    assert offered_rate(arrivals) == pytest.approx(500.0, rel=0.03)
    np.testing.assert_array_equal(arrivals, poisson_arrivals(500.0, 20_000, seed=1))
    assert not np.array_equal(arrivals, poisson_arrivals(500.0, 20_000, seed=2))


def test_arrival_files_are_read_and_bad_lines_named(tmp_path):
    good = tmp_path / "arrivals.txt"
    good.write_text("# seconds\n0.0\n0.5\n\n0.5\n2.0  # last\n")
    np.testing.assert_array_equal(read_arrivals(good), [0.0, 0.5, 0.5, 2.0])
    bad = tmp_path / "bad.txt"
    bad.write_text("0.1\nsoon\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: expected an arrival time in seconds, not 'soon'"):
        read_arrivals(bad)
    bad.write_text("0.5\n0.2\n")
    with pytest.raises(ConfigError, match=r"bad.txt:2: arrival times must be .* non-decreasing"):
        read_arrivals(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        read_arrivals(tmp_path / "missing.txt")


def test_a_quiet_server_answers_in_the_service_and_step_time():
    """Arrivals 30 ms apart, 5 ms of preprocessing and a 4 ms step: nobody queues, each result comes back
    in about 9 ms plus nothing the batcher adds (max_queue_delay 0)."""
    n = 20
    scheduled = np.arange(n) * 0.03
    times = serve_open_loop(Sleeping(0.005), [b"1"] * n, scheduled, Batching(8, 0.0), step_of(4.0), identity,
                            workers=2)
    assert times.served().all() and times.failures == {}
    latency_ms = (times.done - times.scheduled) * 1e3
    assert np.median(latency_ms) == pytest.approx(9.0, abs=2.0)
    assert np.all(times.started - times.scheduled >= -1e-4)  # never served before it arrived
    assert np.median(times.started - times.scheduled) < 0.002
    assert times.batch_sizes == [1] * n


def test_latency_counts_from_the_schedule_when_the_server_falls_behind():
    """One worker of 20 ms per request, a request every 5 ms: each waits for all before it. Latency from the
    scheduled arrival grows by 15 ms a request (no coordinated omission), whatever the worker's pace."""
    n = 12
    scheduled = np.arange(n) * 0.005
    times = serve_open_loop(Sleeping(0.020), [b"1"] * n, scheduled, Batching(1, 0.0), step_of(), identity,
                            workers=1)
    latency_s = times.done - times.scheduled
    slope = np.polyfit(np.arange(n), latency_s, 1)[0]
    assert slope == pytest.approx(0.015, abs=0.003)
    assert latency_s[-1] >= 0.185  # 12 x 20 ms of service minus the 55 ms over which they arrived


def test_the_batcher_fills_batches_up_to_max_batch_within_the_delay():
    """Every request at once: batches of max_batch; the delay only waits while more are due."""
    n = 23
    times = serve_open_loop(Sleeping(0.0), [b"1"] * n, np.zeros(n), Batching(5, 0.05), step_of(10.0), identity,
                            workers=2)
    assert times.served().all()
    assert max(times.batch_sizes) == 5 and sum(times.batch_sizes) == n
    # one request, then nothing: the batch goes when the delay has passed
    times = serve_open_loop(Sleeping(0.0), [b"1"], np.zeros(1), Batching(5, 0.03), step_of(), identity, workers=1)
    assert times.batch_sizes == [1]
    assert (times.step_start[0] - times.ready[0]) < 0.03  # nothing more was coming: no wait for the delay


def test_the_delay_is_waited_for_while_requests_are_still_due():
    scheduled = np.array([0.0, 0.5])
    times = serve_open_loop(Sleeping(0.0), [b"1", b"1"], scheduled, Batching(4, 0.04), step_of(), identity,
                            workers=1)
    assert times.batch_sizes == [1, 1]
    assert times.step_start[0] - times.ready[0] == pytest.approx(0.04, abs=0.015)


def test_failed_requests_are_counted_and_the_others_served():
    payloads = [b"1", b"bad", b"1", b"1"]
    times = serve_open_loop(Sleeping(0.001), payloads, np.arange(4) * 0.002, Batching(2, 0.0), step_of(),
                            identity, workers=2)
    assert set(times.failures) == {1} and "damaged JPEG" in times.failures[1]
    assert times.served().sum() == 3
    point = latency.server_point(times, 500.0, None)
    assert point.errors == 1 and point.requests == 4


def test_a_path_that_preprocesses_batches_gets_them_after_the_batcher():
    n = 12
    path = SleepingBatches(0.004)
    times = serve_open_loop(path, [b"1"] * n, np.zeros(n), Batching(4, 0.01), step_of(2.0), identity, workers=2)
    assert times.served().all() and max(times.batch_sizes) == 4
    assert np.all(times.ready - times.started >= 0.0035)  # each request's preprocessing is its batch's
    parts = latency.parts(times)
    total = (times.done - times.scheduled).mean() * 1e3
    assert parts.queue_ms + parts.preprocess_ms + parts.batch_ms + parts.compute_ms == pytest.approx(total, rel=1e-6)


def test_one_at_a_time_is_service_plus_step():
    times = serve_one_at_a_time(Sleeping(0.003), [b"1"] * 10, step_of(2.0, per_sample_ms=1.0), identity)
    stream = latency.single_stream(times)
    assert stream.p50_ms == pytest.approx(6.0, abs=1.5)
    assert stream.parts.queue_ms == pytest.approx(0.0, abs=0.05)
    assert stream.requests == 10 and stream.errors == 0


def test_stop_ends_the_workers():
    stop = threading.Event()
    stop.set()
    times = serve_open_loop(Sleeping(0.0), [b"1"] * 5, np.zeros(5) + 10.0, Batching(1, 0.0), step_of(), identity,
                            workers=2, stop=stop)
    assert not times.served().any()


def point(rate: float, p99: float, achieved: float | None = None) -> ServerPoint:
    parts = LatencyParts(queue_ms=0, preprocess_ms=0, batch_ms=0, compute_ms=0)
    return ServerPoint(offered_qps=rate, scheduled_qps=rate, achieved_qps=rate if achieved is None else achieved,
                       requests=1, errors=0,
                       p50_ms=p99, p90_ms=p99, p99_ms=p99, p999_ms=p99, mean_ms=p99, mean_queue_wait_ms=0,
                       p99_queue_wait_ms=0, mean_batch=1, accelerator_utilisation=0, parts=parts)


def test_the_search_finds_the_highest_rate_within_the_bound():
    """p99 = 10 ms below 300 requests/s and 100 ms above: the search closes in on 300 from either side."""
    tried: list[float] = []

    def trial(rate: float) -> ServerPoint:
        tried.append(rate)
        return point(rate, 10.0 if rate <= 300 else 100.0)

    curve: list[ServerPoint] = []
    best = highest_rate_within(trial, 100.0, 15.0, 10, curve)
    assert best is not None and 270 <= best.offered_qps <= 300
    assert tried[:3] == [100.0, 200.0, 400.0]
    assert [p.offered_qps for p in curve] == sorted(tried)
    assert highest_rate_within(lambda r: point(r, 50.0), 100.0, 15.0, 4, []) is None
    # a server that falls behind the arrivals is beyond the bound, however its p99 looks
    best = highest_rate_within(lambda r: point(r, 1.0, achieved=min(r, 250.0)), 100.0, 15.0, 8, [])
    assert best is not None and best.offered_qps <= 278


@pytest.fixture
def serve_config(tmp_path):
    def write(scenario: str, loaders: dict | None = None, **serve) -> str:
        config = tiny_config_dict(tmp_path / "results", workload={
            "scenario": scenario, "step_time_ms": 1.0,
            "serve": {"target_qps": 150, "requests": 60, "max_batch": 4, "max_queue_delay_ms": 1, "search_runs": 3,
                      **serve}},
            loaders=loaders or {"torch": {"variant": ["plain", "tuned"]}, "arrow": {"form": "decoded"},
                                "posix": {"form": "decoded"}})
        path = tmp_path / f"{scenario}.yaml"
        path.write_text(yaml.safe_dump(config))
        return str(path)
    return write


def test_request_paths_deliver_the_eval_recipe_alike(tmp_path, serve_config):
    """torch plain, tuned (whole and region) and the arrow catalogue of whole frames give the same centre crop
    (PIL's resize differs from torch's by a few levels; the region decode equals the whole decode exactly)."""
    from loadopt.loaders.registry import configured_loader
    from loadopt.storage.open import open_dataset

    config = load_config(serve_config("server"), [])
    config = config.model_copy(update={"pipeline": config.pipeline.model_copy(update={"augment": "eval"})})
    dataset = open_dataset(config)
    images = {}
    for name, settings in (("torch", {"variant": "plain"}), ("torch", {"variant": "tuned"}),
                           ("arrow", {"form": "decoded", "frame": "whole"})):
        loader = configured_loader(name, config, dataset, loader_settings(config, name, settings))
        for path in loader.request_paths(4):
            path.open(dataset)
            images[path.label] = path.one(path.payload(dataset, 5))
            path.close()
        loader.close()
    labels = sorted(images)
    assert len(labels) == 4, labels
    whole = next(label for label in labels if label.startswith("torch tuned") and "region" not in label)
    region = next(label for label in labels if "region" in label)
    assert torch.equal(images[whole], images[region])
    for label in labels:
        assert images[label].shape == (48, 48, 3) and images[label].dtype == torch.uint8
        assert (images[label].float() - images[whole].float()).abs().mean() < 8, label


def loader_settings(config, name: str, settings: dict):
    from loadopt.config import backend_settings

    (parsed,) = backend_settings(config.model_copy(update={"loaders": {name: settings}}), name)
    return parsed


def test_bench_server_with_a_bound(tmp_path, serve_config):
    result = CliRunner().invoke(app, ["bench", serve_config("server"), "--slo-ms", "200"])
    assert result.exit_code == 0, result.output
    text = said(result)
    assert "<=200ms qps" in text and "torch plain" in text and "arrow decoded" in text
    assert "posix: unavailable" in text and "no request path" in text
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    assert document["scenario"] == "server" and document["slo_ms"] == 200
    rows = {row["label"]: row for row in document["paths"]}
    measured = [row for row in rows.values() if row["status"] == "ok"]
    assert len(measured) == 4
    for row in measured:
        assert row["server"]["requests"] == 60 and row["server"]["errors"] == 0
        assert row["server"]["offered_qps"] == 150
        assert 1 <= len(row["curve"]) <= 3
        assert row["best_within_slo"] is None or row["best_within_slo"]["p99_ms"] <= 200
    assert document["summary"].startswith("server:")
    page = (tmp_path / "results" / "report.html").read_text()  # written beside serve.json, with the curve
    assert "<svg" in page and "offered rate" in page and "torch tuned region" in page
    markdown = CliRunner().invoke(app, ["report", str(tmp_path / "results"), "--format", "markdown"])
    assert markdown.exit_code == 0 and "| torch plain |" in markdown.output
    (tmp_path / "results" / "report.html").unlink()
    again = CliRunner().invoke(app, ["report", str(tmp_path / "results")])  # the folder: serve.json's page
    assert again.exit_code == 0, again.output
    assert "<svg" in (tmp_path / "results" / "report.html").read_text()


def test_bench_single_stream_and_offline(tmp_path, serve_config):
    result = CliRunner().invoke(app, ["bench", serve_config("single_stream")])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    stream = [row["single_stream"] for row in document["paths"] if row["status"] == "ok"]
    assert stream and all(s["requests"] == 60 and s["p90_ms"] >= s["p50_ms"] > 0 for s in stream)

    result = CliRunner().invoke(app, ["bench", serve_config("offline")])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    rows = [row for row in document["paths"] if row["status"] == "ok"]
    assert {row["backend"] for row in rows} == {"torch", "arrow", "posix"}  # offline: every loader
    for row in rows:
        assert row["offline"]["samples"] == 48 and row["offline"]["in_order"], row["label"]
        assert 0 < row["offline"]["first_result_s"] <= row["offline"]["seconds"]


def test_slo_on_a_training_config_is_one_line(tiny_config):
    result = CliRunner().invoke(app, ["bench", str(tiny_config), "--slo-ms", "10"])
    assert result.exit_code == 2
    assert "--slo-ms bounds the server scenario's latency" in said(result)
    assert "Traceback" not in result.output


def test_make_preprocessor_hands_over_the_best_path(tmp_path, serve_config):
    from loadopt import make_preprocessor
    from loadopt.storage.open import open_dataset

    path = serve_config("single_stream", loaders={"torch": {"variant": ["plain", "tuned"]}})
    config = load_config(path, [])
    before = make_preprocessor(config)  # no serve bench yet: the config's first request path
    assert before.label == "torch plain" and "no serve bench" in before.why
    assert CliRunner().invoke(app, ["bench", path]).exit_code == 0
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    best = min((row for row in document["paths"] if row["status"] == "ok"),
               key=lambda row: row["single_stream"]["p90_ms"])
    chosen = make_preprocessor(path)
    assert chosen.label == best["label"] and "best in" in chosen.why
    data = open_dataset(config).read(3)
    one, two = chosen(data), chosen([data, data])
    assert one.shape == (1, 3, 48, 48) and one.dtype == torch.float32 and two.shape == (2, 3, 48, 48)
    assert torch.equal(two[0], one[0])
    assert one.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ConfigError, match="no request path 'dali'"):
        make_preprocessor(path, path="dali")


def test_bench_server_from_an_arrivals_file(tmp_path, serve_config):
    arrivals = tmp_path / "arrivals.txt"
    arrivals.write_text("\n".join(f"{k * 0.01:.3f}" for k in range(1, 41)) + "\n")  # 100 requests/s, 40 of them
    result = CliRunner().invoke(app, ["bench", serve_config("server", loaders={"torch": {"variant": "tuned"}},
                                                            arrivals=str(arrivals))])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    assert document["arrivals"].startswith(f"{arrivals}: 40 arrivals, 100.0 requests/s")
    for row in document["paths"]:
        assert row["server"]["requests"] == 40 and row["server"]["scheduled_qps"] == pytest.approx(100.0)
        assert row["curve"] == [row["server"]] and row["best_within_slo"] is None


def test_damaged_requests_are_skipped_and_counted(tmp_path):
    """on_error: skip serves the others, counts the damaged ones and leaves them out of the latencies."""
    from .conftest import make_image_folder

    root = tmp_path / "photos"
    make_image_folder(root, classes=2, per_class=5, corrupt=1)
    config = tiny_config_dict(tmp_path / "results", dataset={"path": str(root), "on_error": "skip"},
                              workload={"scenario": "server", "step_time_ms": 1,
                                        "serve": {"target_qps": 200, "requests": 44, "max_batch": 4}},
                              loaders={"torch": {"variant": "tuned"}})
    path = tmp_path / "skip.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["bench", str(path)])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    for row in document["paths"]:
        assert row["server"]["errors"] == 4, row  # the damaged file is 1 of 11 samples, each requested 4 times
        assert row["server"]["p99_ms"] > 0
