"""The tuner: knob spaces from the backends, the machine's bounds, the budget, early stopping, the CLI hook."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import BaseModel, ConfigDict, Field

from loadopt.bench.knobs import MachineLimits, search_space
from loadopt.bench.runner import run_bench
from loadopt.bench.tuner import Tuner, Window, parse_budget
from loadopt.config import config_from_dict
from loadopt.errors import ConfigError
from loadopt.loaders.registry import backend_class, register, unregister
from loadopt.storage.open import open_dataset

from .backends import DelayLoader
from .conftest import tiny_config_dict

BIG = 1 << 40


class KnobSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workers: int = Field(1, ge=1)
    threads: int = Field(1, ge=1)
    prefetch: int = 2


class KnobLoader(DelayLoader):
    """Per-batch delay 8 ms / (workers x threads): more resources are faster, so an unbounded tuner
    would always ask for more than the machine has."""

    Settings = KnobSettings
    proposed: list[dict] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).proposed.append(self.settings.model_dump())
        self.settings = type("S", (), {"delay_s": 0.008 / (self.settings.workers * self.settings.threads),
                                       "background": True, "prefetch": self.settings.prefetch,
                                       "model_dump": self.settings.model_dump})()

    @classmethod
    def knob_space(cls, cores):
        return {"workers": [1, 2, 4, 8], "threads": [1, 2, 4], "prefetch": [1, 2, 4]}

    @classmethod
    def cpu_demand(cls, settings):
        return settings.workers * settings.threads

    def describe(self):
        return " ".join(f"{k}={v}" for k, v in self.settings.model_dump().items())


@pytest.fixture
def knobs():
    KnobLoader.proposed = []
    register("t_knobs")(KnobLoader)
    yield
    unregister("t_knobs")


def tiny(tmp_path, loaders, **workload):
    raw = tiny_config_dict(tmp_path / "out", loaders=loaders,
                           workload={"step_time_ms": 0, "warmup_batches": 1, "measure_batches": 4, **workload})
    return config_from_dict(raw, "tune.yaml")


def test_parse_budget():
    assert parse_budget("90s") == 90 and parse_budget("10m") == 600 and parse_budget("1h") == 3600
    assert parse_budget("1.5m") == 90 and parse_budget("45") == 45
    for bad in ("", "ten minutes", "-5m", "0s", "5d"):
        with pytest.raises(ConfigError, match="--budget"):
            parse_budget(bad)


def test_never_proposes_more_workers_x_threads_than_the_cores(tmp_path, knobs):
    config = tiny(tmp_path, {"t_knobs": {"workers": 8, "threads": 4}})  # the start is over the machine
    tuner = Tuner(config, open_dataset(config), "cpu", 60, window=Window(1, 4), limits=MachineLimits(4, BIG, BIG))
    [tuning] = tuner.tune(["t_knobs"])
    assert tuning.best is not None and len(tuning.trials) >= 3
    run = [p for p in KnobLoader.proposed]
    assert run and all(p["workers"] * p["threads"] <= 4 for p in run)
    assert tuning.best.settings["workers"] * tuning.best.settings["threads"] == 4  # the most it may use wins
    assert tuning.refused and all("needs" in r.reason for r in tuning.refused)
    # fewer trials than the grid of what fits (8 of the 4 x 3 x 3 grid fit within 4 cores... and 3 prefetch)
    fitting = sum(1 for w in (1, 2, 4, 8) for t in (1, 2, 4) if w * t <= 4) * 3
    assert len(tuning.trials) < fitting


def test_real_backends_stay_within_the_cores():
    for name in ("torch", "arrow", "posix", "kvikio"):
        cls = backend_class(name)
        for cores in (1, 2, 16):
            space = cls.knob_space(cores)
            assert space and all(key in cls.Settings.model_fields for key in space)
            for key, values in space.items():
                for value in values:
                    point = cls.Settings(**{key: value})
                    if key in ("num_workers", "threads"):
                        assert cls.cpu_demand(point) <= max(cores, 1), (name, key, value, cores)


def test_shared_memory_bound_refuses_big_rings(tmp_path):
    config = tiny(tmp_path, {"torch": {"variant": "tuned"}})
    cls = backend_class("torch")
    limits = MachineLimits(cores=2, shared_bytes=10 * 8 * 3 * 48 * 48, pinned_bytes=BIG)  # room for 10 batches
    small = cls.Settings(variant="tuned", num_workers=2, prefetch_factor=2)  # 6 slots
    large = cls.Settings(variant="tuned", num_workers=2, prefetch_factor=8)  # 18 slots
    assert limits.refuses(cls, small, config.pipeline) == ""
    assert "shared memory" in limits.refuses(cls, large, config.pipeline)


def test_config_lists_narrow_the_space_and_scalars_start_it(tmp_path):
    config = tiny(tmp_path, {"torch": {"variant": ["tuned"], "num_workers": 1, "prefetch_factor": 3}})
    space, start = search_space(config, "torch", backend_class("torch"), 2)
    assert space["variant"] == ["tuned"] and space["num_workers"] == [0, 1, 2]
    assert space["prefetch_factor"] == [2, 3, 4] and start.prefetch_factor == 3 and start.num_workers == 1
    # A sweep starts at the backend's own default when it holds it (torch: tuned, 2 workers), else its first.
    config = tiny(tmp_path, {"torch": {"variant": ["plain", "tuned"], "num_workers": [1, 2, 4]}})
    _, start = search_space(config, "torch", backend_class("torch"), 2)
    assert (start.variant, start.num_workers) == ("tuned", 2)
    config = tiny(tmp_path, {"torch": {"num_workers": [1, 4]}})
    assert search_space(config, "torch", backend_class("torch"), 4)[1].num_workers == 1


class FakeClock:
    """Advances `step` seconds every time the tuner reads it: the budget is spent by reading the clock."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.reads = 0.0, step, 0

    def __call__(self) -> float:
        self.now += self.step
        self.reads += 1
        return self.now


def test_the_budget_is_respected_with_a_fake_clock(tmp_path, knobs):
    register("t_delay")(type("TDelay", (DelayLoader,), {}))
    try:
        config = tiny(tmp_path, {"t_knobs": {}, "t_delay": {}})
        clock = FakeClock(1.0)
        tuner = Tuner(config, open_dataset(config), "cpu", 20.0, window=Window(1, 4), clock=clock,
                      limits=MachineLimits(64, BIG, BIG))
        knobbed, delay = tuner.tune(["t_knobs", "t_delay"])
    finally:
        unregister("t_delay")
    # Each batch reads the clock once (one "second" a batch): 20 s of budget cannot hold the 36 trials of
    # the space. Round 1 runs each backend's start (each within its share of what is left), then the
    # climbs share what remains; no trial starts past its deadline and a running one ends at the first
    # batch past it (the last batch, the read that refuses the next trial, and the read of the end time).
    assert 1 <= len(knobbed.trials) < 10 and delay.best is not None and knobbed.best is not None
    assert knobbed.seconds + delay.seconds <= 20.0 + 3


def test_a_backend_far_behind_is_not_climbed(tmp_path, knobs):
    class Slow(KnobLoader):  # 10x slower than t_knobs at the same knobs
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.settings.delay_s *= 10

    register("t_slow")(Slow)
    try:
        config = tiny(tmp_path, {"t_knobs": {"threads": [1], "prefetch": [2]},
                                 "t_slow": {"threads": [1], "prefetch": [2]}})
        for prune_below, climbed in ((0.5, False), (0.0, True)):
            tuner = Tuner(config, open_dataset(config), "cpu", 60, window=Window(1, 6, prune_below=prune_below),
                          limits=MachineLimits(4, BIG, BIG))
            fast, slow = tuner.tune(["t_knobs", "t_slow"])
            assert len(fast.trials) > 1 and fast.reason == ""
            assert (len(slow.trials) > 1) is climbed and slow.best is not None
            if not climbed:
                assert slow.reason.startswith("not climbed: its start ran at") and slow.best_settings == slow.start
    finally:
        unregister("t_slow")


@pytest.mark.timing  # wall-clock: a busy moment between the reference and the search can still push it out
def test_a_tiny_real_budget_ends_the_search_in_time(tmp_path, knobs):
    """Past its deadline the search runs at most one more batch: the whole search takes the budget plus what
    one trial costs around its batches (opening the loader, the harness's start and teardown), measured here
    in the same process first, since late in a long test session that cost alone has exceeded 0.5 s."""
    one = {"workers": [1], "threads": [1], "prefetch": [2]}
    reference_config = tiny(tmp_path / "fixed", {"t_knobs": one})
    fixed = Tuner(reference_config, open_dataset(reference_config), "cpu", 60, window=Window(1, 1),
                  limits=MachineLimits(64, BIG, BIG))
    started = time.monotonic()
    [reference] = fixed.tune(["t_knobs"])
    trial_cost = time.monotonic() - started  # two batches of 8 ms and a trial's fixed cost
    assert [t.outcome for t in reference.trials] == ["ok"]
    config = tiny(tmp_path, {"t_knobs": {}}, measure_batches=200)  # 200 batches of 8 ms: 1.6 s unbounded
    tuner = Tuner(config, open_dataset(config), "cpu", 0.5, window=Window(1, 200), limits=MachineLimits(64, BIG, BIG))
    started = time.monotonic()
    [tuning] = tuner.tune(["t_knobs"])
    elapsed = time.monotonic() - started
    assert elapsed < 0.5 + trial_cost + 0.2, (elapsed, trial_cost)
    assert tuning.trials[0].outcome == "cut by the budget"


def test_a_clearly_worse_setting_is_stopped_early(tmp_path, knobs):
    config = tiny(tmp_path, {"t_knobs": {"workers": 4, "threads": [1], "prefetch": [2]}})
    # 40 batches of room: on a busy machine both settings oversleep alike, and the early rates of the slower one
    # took all of a 12-batch window to fall below the bar (seen with two test runs at once)
    tuner = Tuner(config, open_dataset(config), "cpu", 60, window=Window(1, 40, min_batches=3),
                  limits=MachineLimits(4, BIG, BIG))
    [tuning] = tuner.tune(["t_knobs"])
    by_workers = {t.settings["workers"]: t for t in tuning.trials}
    assert by_workers[4].outcome == "ok"
    assert by_workers[2].outcome == "stopped early" and by_workers[2].batches < 40  # 2x slower: clearly worse
    assert 1 not in by_workers  # a numeric knob's climb stops at the first value that does not help
    assert tuning.best.settings["workers"] == 4


def test_bench_tune_writes_the_trace_and_the_table_says_tried(tmp_path, knobs):
    import yaml
    from typer.testing import CliRunner

    from loadopt.cli import app

    raw = tiny_config_dict(tmp_path / "out", loaders={"t_knobs": {"prefetch": [2]}},
                           workload={"step_time_ms": 0, "warmup_batches": 1, "measure_batches": 4})
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["bench", str(path), "--tune", "--budget", "20s", "--loaders", "t_knobs"])
    assert result.exit_code == 0, result.output
    assert "(tried " in result.output and "settings tried in" in result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    [backend] = results["tuning"]["backends"]
    assert backend["tried"] == len(backend["trials"]) >= 2 and results["tuning"]["budget_s"] == 20
    [run] = [r for r in results["runs"] if r["status"] == "ok"]
    assert run["settings"] == backend["best"]["settings"] and run["tuned"]["tried"] == backend["tried"]
    assert (tmp_path / "out" / "decision.json").exists()
    assert results["stages"] and results["verdicts"][0]["by"] == "stages measured apart"


def test_tune_on_real_backends_of_the_tiny_config(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": ["tuned"], "prefetch_factor": [2]},
                                                       "arrow": {"form": ["decoded"], "prefetch": [2]}},
                           workload={"step_time_ms": 1, "warmup_batches": 1, "measure_batches": 4})
    outcome = run_bench(config_from_dict(raw, "tiny.yaml"), tune=True, budget_s=30, quick=True)
    runs = [r for r in outcome.document()["runs"] if r["status"] == "ok"]
    assert {r["backend"] for r in runs} == {"torch", "arrow"}
    for backend in outcome.document()["tuning"]["backends"]:
        # a backend far behind the other after round 1 keeps its start (successive halving over backends)
        assert (backend["tried"] >= 2 or backend["reason"].startswith("not climbed")) and backend["seconds"] <= 30
        for trial in backend["trials"]:
            cls = backend_class(backend["backend"])
            assert cls.cpu_demand(cls.Settings(**trial["settings"])) <= MachineLimits.here().cores


def test_numeric_knobs_are_climbed_outwards_from_the_start():
    from loadopt.bench.knobs import directions

    assert directions([1, 2, 4, 8], 4) == [[2, 1], [8]]
    assert directions([1, 2, 4], 1) == [[], [2, 4]]
    assert directions(["plain", "tuned"], "tuned") == [["plain", "tuned"]]
    assert directions([1, 2], 3) == [[1, 2]]  # a start outside the list: every value
