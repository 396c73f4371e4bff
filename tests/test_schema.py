"""The one results schema (loadopt.schema.documents): files of the previous version (1) are read by report, explain
and the decision; unknown versions and corrupt files are one-line errors naming the file."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from loadopt.bench import decision
from loadopt.explain import explain_results
from loadopt.report import render_report
from loadopt.schema.documents import (
    SCHEMA_VERSION,
    SchemaError,
    decision_text,
    parse_decision,
    read_results,
    read_results_file,
    results_text,
)

from .test_cli import loadopt, one_line_error

FIXTURES = Path(__file__).parent / "fixtures"
V1 = {name: FIXTURES / f"{name}_v1.json" for name in ("results", "measure", "tiers", "decision")}


def raw(name):
    return json.loads(V1[name].read_text())


@pytest.mark.parametrize("name", ["results", "measure", "tiers"])
def test_version_1_results_read_upgraded_nothing_dropped(name, tmp_path):
    old = raw(name)
    doc = read_results(V1[name])
    assert doc["schema_version"] == SCHEMA_VERSION == 2
    assert set(old) <= set(doc)  # every key recorded is kept (extra="allow")
    assert doc["runs"] == old["runs"]
    # written back through the schema and read again: the same document
    again = tmp_path / "again.json"
    again.write_text(results_text(doc))
    assert read_results(again) == doc


def test_version_1_tiers_rows_have_each_value_under_one_key():
    old = raw("tiers")["tiers"][0]
    assert old["tier"] == old["name"] and old["measured"] == old["accelerators_supported"]  # the two-key form
    row = read_results(V1["tiers"])["tiers"][0]
    assert not {"tier", "measured", "predicted"} & set(row)
    assert row["name"] == old["tier"] and row["accelerators_supported"] == old["measured"]
    assert row["predicted_accelerators"] == old["predicted"]
    assert row["cost_per_supported_accelerator"] == old["cost"]["per_accelerator_month"]
    assert "per_accelerator_month" not in row["cost"] and row["cost"]["per_month"] == old["cost"]["per_month"]


@pytest.mark.parametrize("name", ["results", "measure", "tiers"])
def test_report_reads_version_1(name):
    page = render_report([V1[name]], "markdown")
    if name == "tiers":
        assert "Storage tiers" in page and "| tiny |" in page
    else:
        assert raw(name)["ranking"][0] in page


@pytest.mark.parametrize("name", ["results", "measure"])
def test_explain_reads_version_1(name):
    text = explain_results(V1[name])
    assert raw(name)["summary"].split(";")[0][:40] in text or raw(name)["ranking"][0] in text


def test_decision_from_version_1_results_and_auto_reads_a_version_1_decision(tmp_path, monkeypatch):
    results = read_results_file(V1["results"])
    made = decision.make_decision(results, "local:ext4")
    assert made is not None and made.label == results.ranking[0] and made.schema_version == SCHEMA_VERSION
    assert parse_decision(json.loads(decision_text(made)), "made").label == made.label

    # A version 1 entry (no schema_version) in the cache, for this machine: `auto` finds and uses it.
    old = raw("decision")
    assert "schema_version" not in old
    here = decision.machine_key(decision.machine_info(), old["machine"]["storage_tier"])
    old.update(machine=here.model_dump(), machine_fingerprint=here.fingerprint)  # made here, whatever machine runs this
    monkeypatch.setenv("LOADOPT_CACHE", str(tmp_path))
    path = decision.decision_path(old["dataset_fingerprint"])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(old))
    found, match, _ = decision.find(old["pipeline"], old["dataset_fingerprint"], here.storage_tier)
    assert match == "exact" and found["backend"] == old["backend"] and found["schema_version"] == SCHEMA_VERSION
    # an entry of an unknown version is not used (not this loadopt's to interpret)
    path.write_text(json.dumps({**old, "schema_version": 99}))
    found, match, _ = decision.find(old["pipeline"], old["dataset_fingerprint"], here.storage_tier)
    assert found is None and match == "none"


def test_unknown_version_and_corrupt_files_are_one_line_errors_naming_the_file(tmp_path):
    future = tmp_path / "future" / "results.json"
    future.parent.mkdir()
    future.write_text(json.dumps({**raw("results"), "schema_version": 99}))
    with pytest.raises(SchemaError, match=r"results\.json: .*schema_version 99 is not one this loadopt reads"):
        read_results(future)
    line = one_line_error(loadopt("report", future, "--out", tmp_path / "r.html"))
    assert str(future) in line and "schema_version 99" in line

    broken = tmp_path / "broken.json"
    doc = raw("measure")
    doc["runs"][0]["repeats"] = "not a list"
    broken.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match=r"broken\.json: .*runs\.0\.repeats"):
        read_results(broken)
    broken.write_text('{"runs": [')
    with pytest.raises(SchemaError, match=r"broken\.json: not valid JSON"):
        read_results(broken)


def test_writers_refuse_a_document_off_the_schema():
    with pytest.raises(ValidationError):
        results_text({"command": "loadopt bench"})  # no runs
    with pytest.raises(ValidationError):
        results_text({"runs": [{"backend": "torch"}]})  # a run without a label
    with pytest.raises(ValidationError):
        decision_text({"label": "x"})  # no backend
