"""`loadopt explain`: the decision auto uses here, and what a results file says."""

import json

import pytest

from loadopt.config import config_from_dict
from loadopt.explain import explain_config, explain_results
from loadopt.report.data import ResultsFileError

from .conftest import tiny_config_dict
from .test_cli import loadopt, one_line_error


def config(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", dataset={"synthetic": {"num_samples": 40, "num_classes": 2,
                                                                    "mean_width": 64, "mean_height": 64, "seed": 21}},
                           loaders={"torch": {"variant": "tuned", "num_workers": [0, 1]}})
    return config_from_dict(raw, "explain.yaml")


def test_no_decision_then_the_bench_decision(tmp_path):
    from loadopt.bench.runner import run_bench

    cfg = config(tmp_path)
    before = explain_config(cfg)
    assert "no bench decision" in before and "auto falls back to:" in before
    outcome = run_bench(cfg)
    after = explain_config(cfg)
    assert f"auto uses: {outcome.document()['ranking'][0]}" in after and "the fastest in the bench" in after
    text = explain_results(outcome.json_path)
    assert outcome.document()["summary"] in text
    assert text.count("\n- ") == 2 and "samples/s, the accelerator idle" in text


def test_measure_results_are_explained(tmp_path):
    path = tmp_path / "measure.json"
    path.write_text(json.dumps({"command": "loadopt.measure", "summary": "measure: 10 steps", "runs": [
        {"label": "DataLoader", "status": "ok", "metrics": {"samples_per_s": {"median": 100.0}, "stall_fraction":
                                                            {"median": 0.5}, "wall_s": {"median": 1.0},
                                                            "wait_s": {"median": 0.5}}}]}))
    text = explain_results(path)
    assert "measure: 10 steps" in text and "DataLoader: 100 samples/s" in text and "input-bound" in text


def test_bad_results_files(tmp_path):
    with pytest.raises(ResultsFileError, match="no such results file"):
        explain_results(tmp_path / "none.json")
    with pytest.raises(ResultsFileError, match="no results.json or measure.json in this folder"):
        explain_results(tmp_path)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ResultsFileError, match="not valid JSON"):
        explain_results(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"runs": 3}')
    with pytest.raises(ResultsFileError, match="not a loadopt results file"):
        explain_results(tmp_path / "y.json")
    line = one_line_error(loadopt("explain", tmp_path / "x.json"))
    assert str(tmp_path / "x.json") in line


def test_a_decision_of_another_recipe_is_not_used(tmp_path):
    """A bench of this dataset where the centre-square arrow form (another training input under train
    augmentation) won: explain says auto does not use it and why, and names what auto falls back to."""
    from loadopt.bench.runner import run_bench

    cfg = config(tmp_path)
    cfg = cfg.model_copy(update={"loaders": {"arrow": {"form": "decoded", "frame": "centre"}}})
    outcome = run_bench(cfg)
    assert outcome.results.decision is None  # its only setting delivers another training input
    assert "random 48 px crop" in str(outcome.document()["runs"][0]["recipe"])
    from loadopt.bench import decision

    forced = decision.make_decision(outcome.results.model_copy(update={"recipe": None}), "x")
    forced = forced.model_copy(update={"machine": decision.machine_key(decision.machine_info(), decision.storage_tier(
        cfg.storage.tier, outcome.document()["dataset"]["root"]))})
    decision.record(forced, None)  # as an older loadopt, which did not compare recipes, would have
    text = explain_config(cfg)
    assert "delivers another training input" in text and "auto does not use it" in text
    assert "auto falls back to:" in text
