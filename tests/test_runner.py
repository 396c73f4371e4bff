"""run_bench with backends that are unavailable, fail, or get interrupted."""

import json

import pytest

from loadopt.bench.runner import run_bench
from loadopt.config import config_from_dict
from loadopt.loaders.registry import register, unregister

from .backends import DelayLoader
from .conftest import tiny_config_dict


class Unavailable(DelayLoader):
    @classmethod
    def available(cls):
        return False, "needs the frobnicator driver, not installed here"


class FailsAtRunTime(DelayLoader):
    def produce(self, batches):
        raise RuntimeError("the device fell over")
        yield


class InterruptedOnSecondRun(DelayLoader):
    """Ctrl-C arrives while the second measured run is under way."""

    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).built += 1
        self.interrupt = type(self).built == 4  # two built to describe the settings, then the runs

    def produce(self, batches):
        if self.interrupt:
            raise KeyboardInterrupt
        yield from super().produce(batches)


@pytest.fixture
def backends():
    register("t_delay")(type("TDelay", (DelayLoader,), {}))
    register("t_unavailable")(Unavailable)
    register("t_fails")(FailsAtRunTime)
    register("t_interrupted")(InterruptedOnSecondRun)
    yield
    for name in ("t_delay", "t_unavailable", "t_fails", "t_interrupted"):
        unregister(name)


def config(tmp_path, loaders, repeats=1):
    raw = tiny_config_dict(tmp_path / "out", loaders=loaders, workload={"repeats": repeats, "step_time_ms": 1})
    return config_from_dict(raw, "test.yaml")


def test_unavailable_and_failing_backends_are_listed_and_the_rest_runs(tmp_path, backends):
    cfg = config(tmp_path, {"t_delay": {"delay_s": [0.001, 0.02]}, "t_unavailable": {}, "t_fails": {}})
    outcome = run_bench(cfg)
    runs = {r["backend"]: r for r in outcome.document()["runs"]}
    assert runs["t_unavailable"]["status"] == "unavailable"
    assert "frobnicator" in runs["t_unavailable"]["reason"]
    assert runs["t_fails"]["status"] == "error" and "the device fell over" in runs["t_fails"]["reason"]
    measured = [r for r in outcome.document()["runs"] if r["status"] == "ok"]
    assert len(measured) == 2 and len(outcome.document()["ranking"]) == 2
    assert outcome.document()["summary"].startswith("fastest: t_delay delay_s=0.001")
    on_disk = json.loads(outcome.json_path.read_text())
    assert on_disk["runs"] == json.loads(json.dumps(outcome.document()["runs"]))


def test_ctrl_c_keeps_the_finished_runs(tmp_path, backends):
    InterruptedOnSecondRun.built = 0
    cfg = config(tmp_path, {"t_interrupted": {"delay_s": [0.001, 0.002]}}, repeats=2)
    outcome = run_bench(cfg)
    assert outcome.interrupted
    results = json.loads(outcome.json_path.read_text())
    assert results["interrupted"] is True
    statuses = [r["status"] for r in results["runs"]]
    assert statuses == ["ok", "not run"]
    assert len(results["runs"][0]["repeats"]) == 1


def test_cold_cache_is_stated(tmp_path, backends):
    raw = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 0}},
                           storage={"cache": "cold"})
    outcome = run_bench(config_from_dict(raw, "cold.yaml"))
    assert outcome.document()["cache"]["mode"] == "cold"
    assert "evicted from the page cache (posix_fadvise DONTNEED)" in outcome.document()["cache"]["note"]


def test_real_model_step(tmp_path, backends):
    raw = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 0}},
                           workload={"model": "small_cnn"})
    outcome = run_bench(config_from_dict(raw, "model.yaml"))
    metrics = outcome.document()["runs"][0]["metrics"]
    assert metrics["compute_s"]["median"] > 0 and 0 < metrics["accelerator_utilisation"]["median"] <= 1


def test_resnet50_without_torchvision_is_a_clear_error(tmp_path, backends):
    pytest.importorskip("torch")
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision imports here: resnet50 is available")
    except Exception:  # noqa: BLE001 - any import failure means resnet50 cannot be built
        pass
    from loadopt.errors import BackendUnavailable

    raw = tiny_config_dict(tmp_path / "out", workload={"model": "resnet50"})
    with pytest.raises(BackendUnavailable, match="workload.model: resnet50 needs torchvision"):
        run_bench(config_from_dict(raw, "model.yaml"))


def test_cold_runs_evict_what_each_loader_reads(tmp_path, backends, monkeypatch):
    from loadopt.bench import runner

    evicted: list[list[str]] = []
    monkeypatch.setattr(runner, "evict_for_cold", lambda files: evicted.append(list(files)) or (len(files), 0))
    raw = tiny_config_dict(tmp_path / "out", storage={"cache": "cold"},
                           loaders={"torch": {"variant": "tuned", "num_workers": 0}, "arrow": {"form": "decoded"},
                                    "posix": {"form": "decoded"}})
    run_bench(config_from_dict(raw, "cold.yaml"), attribute=False)
    assert len(evicted) == 3
    jpegs, arrow_files, shards = evicted
    assert len(jpegs) == 48 and all(f.endswith(".JPEG") for f in jpegs)
    assert len(arrow_files) == 1 and arrow_files[0].endswith(".arrow")
    assert shards and all(f.endswith(".bin") for f in shards)


def test_a_token_bench_runs_every_token_backend(tmp_path):
    """Token corpora are memory-mapped files, not a filesystem of samples: the tier bookkeeping must
    leave them be (a regression: the bench once failed on `TokenDataset.fs`)."""
    raw = tiny_config_dict(tmp_path / "out", dataset={"kind": "tokens", "tokens": {"num_tokens": 20_000}},
                           pipeline={"batch_size": 4, "seq_len": 64},
                           loaders={"torch": {"num_workers": 0}, "arrow": {}, "posix": {}},
                           workload={"step_time_ms": 0, "warmup_batches": 1, "measure_batches": 3})
    outcome = run_bench(config_from_dict(raw, "tokens.yaml"), quick=True, attribute=False)
    runs = {r["backend"]: r for r in outcome.document()["runs"]}
    assert set(runs) == {"torch", "arrow", "posix"}
    for run in runs.values():
        assert run["status"] == "ok", run["reason"]
        assert run["metrics"]["tokens_per_s"]["median"] > 0


def test_a_bench_refused_before_any_run_leaves_no_empty_results_folder(tmp_path, backends):
    from loadopt.errors import LoadoptError

    cfg = config(tmp_path, {"t_delay": {"delay_s": 0.001}})
    with pytest.raises(LoadoptError, match="no_such_backend"):
        run_bench(cfg, loaders=["no_such_backend"])
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # a folder the user had is kept, even empty
    with pytest.raises(LoadoptError, match="no_such_backend"):
        run_bench(cfg, loaders=["no_such_backend"])
    assert (tmp_path / "out").is_dir()


def test_a_failure_raised_while_handling_a_stop_is_the_stop():
    """SIGTERM landing while a library starts (torch's DataLoader iterator): its cleanup's own error carries the
    stop as its context; the bench stops (interrupted), the setting is not reported as failed."""
    from loadopt.errors import Terminated, stop_behind

    try:
        try:
            raise Terminated()
        except KeyboardInterrupt:
            raise RuntimeError("cannot join thread before it is started") from None
    except RuntimeError as exc:
        assert isinstance(stop_behind(exc), Terminated)
    assert stop_behind(RuntimeError("a real failure")) is None
