"""The bad-input cases of the serving scenarios (workload.scenario offline, server, single_stream), for
tests/test_bad_inputs.py's table: each prepares a config and says the one line `loadopt bench` must print."""

from __future__ import annotations

from .faults import Setup, images, write_config


def serving(tmp_path, scenario: str = "server", **serve):
    return write_config(tmp_path, workload={"scenario": scenario, "serve": {"requests": 20, **serve}},
                        loaders={"torch": {"variant": "tuned"}})


def arrivals_file_with_a_bad_line(tmp_path, cache):
    arrivals = tmp_path / "arrivals.txt"
    arrivals.write_text("0.0\nsoon\n")
    config = serving(tmp_path, arrivals=str(arrivals))
    return Setup(["bench", str(config)], f"{arrivals}:2: expected an arrival time in seconds, not 'soon'",
                 config=config, leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def damaged_jpeg_request(tmp_path, cache):
    root, bad = images(tmp_path)
    config = write_config(tmp_path, dataset={"path": str(root)}, workload={"scenario": "single_stream"},
                          loaders={"torch": {"variant": "tuned"}})
    return Setup(["bench", str(config)], f"{bad[0]}: damaged JPEG", config=config,
                 leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def slo_on_a_training_config(tmp_path, cache):
    config = write_config(tmp_path)
    return Setup(["bench", str(config), "--slo-ms", "20"], "--slo-ms bounds the server scenario's latency",
                 config=config)


def every_request_damaged(tmp_path, cache):
    root, bad = images(tmp_path, corrupt=1)
    for good in (root / "train").rglob("[0-9]*.jpg"):
        good.unlink()  # the damaged file alone is left
    config = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"},
                          workload={"scenario": "single_stream", "serve": {"requests": 10}},
                          loaders={"torch": {"variant": "tuned"}})
    return Setup(["bench", str(config)], f"none of the 10 requests could be preprocessed; the first: {bad[0]}: "
                 "damaged JPEG", config=config, leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])
