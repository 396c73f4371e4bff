"""`loadopt tiers`: accelerators a tier keeps busy, on emulated tiers where the answer is known."""

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from loadopt.config import config_from_dict
from loadopt.procurement import measure_tier as tier_measure
from loadopt.procurement.plan import Utilisation, demand, predict, search
from loadopt.procurement.run import run_tiers
from loadopt.storage.open import open_dataset
from loadopt.storage.tiers.emulated import EmulatedFileSystem
from loadopt.storage.tiers.spec import TierSpec
from loadopt.storage.tiers.stack import BASE_BOUND_SHARE

from .conftest import tiny_config_dict
from .test_cli import loadopt, one_line_error

AU = 0.9


def small_config(tmp_path):
    # small samples and batches, so that the consumers' CPU stays far below the two cores here
    return config_from_dict(tiny_config_dict(
        tmp_path, dataset={"synthetic": {"num_samples": 256, "num_classes": 4, "mean_width": 64, "mean_height": 48}},
        pipeline={"batch_size": 4, "image_size": 32}, workload={"step_time_ms": 20}))


def test_supported_accelerators_known_by_construction(tmp_path):
    config = small_config(tmp_path)
    need = demand(config, float(open_dataset(config).sizes.mean()), AU)["mb_per_s_at_threshold"]
    # A tier of B MB/s keeps floor(B / need) accelerators at AU >= 0.9; B sits halfway between two counts.
    tiers = [{"name": f"bw{k}", "bandwidth_mb_s": (k + 0.5) * need, "latency_ms": 1.0} for k in (2, 5)]
    # (the probe at --quick's 0.5 s a level: its prediction still agrees with the search, asserted below)
    result = run_tiers(config, tiers, au=AU, max_accelerators=12, warmup_s=0.3, measure_s=0.8, probe_s=0.5).document()
    for row, truth in zip(result["tiers"], (2, 5), strict=True):
        assert math.floor(row["spec"]["bandwidth_mb_s"] / need) == truth
        measured, predicted = row["accelerators_supported"], row["predicted_accelerators"]
        assert abs(measured - truth) <= 1, row["trials"]
        # measured and predicted agree within 20% (or one accelerator, for counts this small)
        assert abs(predicted - measured) <= max(1, 0.2 * measured), row["prediction"]
        at = next(t for t in row["trials"] if t["accelerators"] == measured)
        assert at["accelerator_utilisation"] >= AU and row["delivered_mb_s"] == at["mb_per_s"]
        above = [t for t in row["trials"] if t["accelerators"] == measured + 1]
        assert above and above[0]["accelerator_utilisation"] < AU  # the next count was tried and fell short
        assert row["delivered_mb_s"] <= row["spec"]["bandwidth_mb_s"] * 1.05  # never more than the tier gives
        # the tier's figures, not the local disk under it, set the reads' times: its own answer, from the probe
        assert row["bounded_by_base"] is None and row["prediction"]["source"] == "the probe", row["base"]
        assert row["base"]["probe_share"] < BASE_BOUND_SHARE and row["base"]["storage"] == "local disk"
    assert result["tiers"][0]["cost"] == {"per_month": None}
    assert result["tiers"][0]["cost_per_supported_accelerator"] is None
    # The report renders the tiers section from this file (the keys report/data.py reads).
    from loadopt.report import write_report

    path = tmp_path / "tiers.json"
    path.write_text(json.dumps(result))
    page = write_report([path]).read_text()
    assert "Storage tiers" in page and "bw2" in page and "bw5" in page
    # each value under one key (loadopt.schema.documents, version 2)
    assert not {"tier", "measured", "predicted"} & set(result["tiers"][0]) and result["schema_version"] == 2


def test_search_doubles_then_bisects():
    calls = []

    def trial(n):
        calls.append(n)
        return Utilisation(n, min(1.0, 5.5 * 0.9 / n))

    supported, trials, note = search(trial, 0.9, 64, budget_s=60)
    assert supported == 5 and calls == [1, 2, 4, 8, 6, 5] and "6 accelerators fall below" in note
    supported, _, note = search(trial, 0.9, 3, budget_s=60)
    assert supported == 3 and "--max-accelerators 3" in note
    supported, trials, _ = search(lambda n: Utilisation(n, 0.5), 0.9, 8, 60)
    assert supported == 0 and len(trials) == 1


def test_predict_from_probe_points():
    probe = {"patterns": [{"pattern": "files", "concurrency": c, "mb_per_s": m}
                          for c, m in ((1, 10.0), (4, 40.0), (16, 100.0), (64, 100.0))]}
    # 4 readers a consumer: N consumers get probe(4N) / N; 100 MB/s saturates from 16 in flight
    assert predict(probe, 10.0, readers=4, max_n=64).accelerators == 10
    assert predict(probe, 30.0, readers=4, max_n=64).accelerators == 2  # 3 consumers: probe(12) = 80, 80 / 3 < 30
    assert predict(probe, 60.0, readers=4, max_n=64).accelerators == 0  # one consumer gets 40 MB/s


def test_cli_tiers_table_and_errors(tmp_path):
    path = tmp_path / "job.yaml"
    data = tiny_config_dict(tmp_path / "r", pipeline={"batch_size": 4, "image_size": 32},
                            workload={"step_time_ms": 20})
    path.write_text(yaml.safe_dump(data))
    # The three commands side by side (the two refused ones need no dataset): one start's time, not three.
    with ThreadPoolExecutor(3) as pool:
        ran = pool.submit(loadopt, "tiers", path, "--set",
                          "storage.tier={name: tiny, bandwidth_mb_s: 0.1, price_per_tb_month: 20}",
                          "--max-accelerators", "2", "--readers", "2", "--warmup", "0.2", "--measure", "0.5",
                          "--no-backends", "--out", tmp_path / "out")
        unknown = pool.submit(loadopt, "tiers", path, "--tiers", "nonesuch")
        above_one = pool.submit(loadopt, "tiers", path, "--au", "1.5")
    proc = ran.result()
    assert proc.returncode == 0, proc.stderr
    assert "loadopt tiers" in proc.stdout and "tiny" in proc.stdout
    # not on a terminal: the plan up front, then one line per trial and one per tier (no bar is drawn)
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("1 tier (tiny): a probe and about") and "trials" in lines[0], proc.stderr
    assert [line for line in lines if line.startswith("tiny: trial 1 (at most")], proc.stderr
    assert lines[-1].startswith("tiny: 0 accelerators kept at AU >= 90%"), proc.stderr
    result = json.loads((tmp_path / "out" / "tiers.json").read_text())
    row = result["tiers"][0]
    # 0.1 MB/s feeds nobody
    assert row["name"] == "tiny" and row["accelerators_supported"] == 0 and row["predicted_accelerators"] == 0
    assert row["cost"]["per_month"] == pytest.approx(20 * row["capacity_tb"])
    line = one_line_error(unknown.result(), code=2)
    assert "unknown tier 'nonesuch'" in line
    line = one_line_error(above_one.result(), code=2)
    assert "--au 1.5" in line


def test_every_backend_through_each_tier_and_the_decision_follows_the_tier(tmp_path):
    """arrow and posix, decoded and encoded, side by side on each tier; on a tier that starves them of
    bytes the encoded form (a fifth of the decoded one's bytes here) wins, and that tier's decision says so."""
    from loadopt.bench.decision import decision_path

    config = config_from_dict(tiny_config_dict(tmp_path, pipeline={"batch_size": 4, "image_size": 32},
                                               workload={"step_time_ms": 1},
                                               loaders={"arrow": {"form": "decoded"}, "posix": {"shard_mib": 0.25}}))
    tiers = [{"name": "starved", "bandwidth_mb_s": 1.0}, {"name": "roomy", "bandwidth_mb_s": 2000}]
    result = run_tiers(config, tiers, max_accelerators=1, warmup_s=0.1, measure_s=0.3, budget_s=5, probe_s=0.5,
                       backends_out=str(tmp_path / "backends"), backend_warmup=2, backend_batches=6).document()
    for row in result["tiers"]:
        runs = row["backends"]["runs"]
        assert sorted((r["backend"], r["form"]) for r in runs) == [("arrow", "decoded"), ("arrow", "encoded"),
                                                                   ("posix", "decoded"), ("posix", "encoded")]
        assert all(r["status"] == "ok" and r["bytes_source"].startswith(f"tier {row['name']}") for r in runs)
        assert all(r["tier_bytes"] > 0 for r in runs)  # (the exact count is test_tier_backends.py's)
    starved = result["tiers"][0]["backends"]
    rates = {(r["backend"], r["form"]): r["samples_per_s"] for r in starved["runs"]}
    assert rates[("arrow", "encoded")] > 2 * rates[("arrow", "decoded")], rates
    assert starved["decision"]["label"].split()[:2] in (["arrow", "encoded"], ["posix", "encoded"]), starved
    # recorded as `loadopt bench` records it: one entry per tier, so `auto` follows the tier it runs on
    entries = json.loads(decision_path(open_dataset(config).fingerprint).read_text())["entries"]
    assert {e["machine"]["storage_tier"].split(":")[0] for e in entries} >= {"starved", "roomy"}


def test_the_tier_sweep_takes_both_image_forms_but_one_of_records():
    """Records (and token windows) have one stored form: sweeping `form` listed each backend twice."""
    from loadopt.procurement.plan import backend_sweep

    from .test_records import records_config

    raw = records_config(Path("/tmp"), "npz")
    raw["loaders"] = {"posix": {"threads": [1, 2]}, "arrow": {}, "torch": {"num_workers": [0, 2]}}
    sweep = backend_sweep(config_from_dict(raw, "rec.yaml"))
    assert all(not isinstance(value, list) for settings in sweep.values() for value in settings.values()), sweep
    images = config_from_dict({**raw, "dataset": {"kind": "images"}}, "img.yaml")
    assert backend_sweep(images)["posix"]["form"] == ["decoded", "encoded"]


def test_a_tier_over_slower_storage_says_so_and_predicts_from_its_own_figures(tmp_path, monkeypatch):
    """An emulated tier can only slow the storage under it down: over a disk slower than its figures, what is
    measured is that disk's, the row says so, and the prediction comes from the tier's figures."""
    config = small_config(tmp_path)
    need = demand(config, float(open_dataset(config).sizes.mean()), AU)["mb_per_s_at_threshold"]
    disk = TierSpec(name="disk", bandwidth_mb_s=1.5 * need).model_dump(mode="json")  # feeds one accelerator
    fast = {"name": "fast", "bandwidth_mb_s": 1000 * need, "latency_ms": 0.2}  # would feed every one of them

    def over_slow_disk(spec, base):  # the machine's disk, as slow as the one the tier's answer followed
        return EmulatedFileSystem(spec.model_dump(mode="json"), EmulatedFileSystem(disk, base))

    monkeypatch.setattr(tier_measure, "tier_filesystem", over_slow_disk)  # where a tier's dataset is made
    row = run_tiers(config, [fast], au=AU, max_accelerators=3, warmup_s=0.3, measure_s=0.8,
                    probe_s=0.5).document()["tiers"][0]
    assert row["accelerators_supported"] <= 2, row["trials"]  # the disk's answer
    assert "bounded by the" in row["bounded_by_base"] and "not a figure of tier fast" in row["bounded_by_base"]
    assert row["bounded_by_base"] in row["measured_note"]
    from loadopt.report import write_report

    (tmp_path / "tiers.json").write_text(json.dumps({"command": "loadopt tiers", "runs": [], "tiers": [row]}))
    assert "not a figure of tier fast" in write_report([tmp_path / "tiers.json"]).read_text()
    assert max(row["base"]["probe_share"], row["base"]["deciding_trial_share"] or 0) >= BASE_BOUND_SHARE
    # the prediction is the tier's own: all 3 (the search's bound); the probe through the slow disk said fewer
    assert row["predicted_accelerators"] == 3 and row["prediction"]["source"].startswith("the tier's own figures")
    assert row["prediction"]["probe_accelerators"] <= 2


def test_the_plan_said_up_front_follows_the_tiers_figures(tmp_path):
    """The trials the search will run by a tier's figures, and under --quick a tier whose batches are slow
    keeps its backends uncompared (said why) where a fast one runs them all."""
    from loadopt.procurement.plan import plan_line, plan_tier, search_trials

    assert search_trials(5, 64) == [1, 2, 4, 8, 6, 5]  # the sequence `search` tries (test above)
    config = config_from_dict(tiny_config_dict(tmp_path, loaders={"arrow": {}, "torch": {"variant": ["plain",
                                                                                                     "tuned"]}}))
    dataset = open_dataset(config)
    need = demand(config, float(dataset.sizes.mean()), AU)["mb_per_s_at_threshold"]
    options = {"au": AU, "max_accelerators": 64, "readers": 4, "probe_s": 0.5, "ranks": None, "backends": True,
               "backend_warmup": 2, "backend_batches": 8}
    roomy = plan_tier(config, TierSpec(name="roomy", bandwidth_mb_s=3.5 * need), dataset, quick=False, **options)
    assert roomy.expected_accelerators == 3 and roomy.expected_trials == search_trials(3, roomy.most)
    assert roomy.backend_settings == 4 and roomy.backend_batches == 8  # arrow's two forms, torch's two variants
    slow = TierSpec(name="far", latency_ms=2000)
    quick = [plan_tier(config, spec, dataset, quick=True, **options) for spec in (TierSpec(name="roomy",
                                                                                          bandwidth_mb_s=3.5 * need),
                                                                                 slow)]
    assert quick[0].backend_settings == 3 and quick[0].backend_batches == 8  # --quick: torch's last variant only
    assert quick[1].backend_settings == 0 and "not compared under --quick" in quick[1].backend_note
    line = plan_line(quick, 0.5, 1.0, 30.0)
    assert line.startswith("2 tiers (roomy, far)") and "trials" in line and "in all" in line


STOPS = [("SIGTERM", "second: trial 1 "), ("SIGINT", "second: trial 1 "), ("SIGTERM", "2 tiers (")]


def _tiers_stopped(folder: Path, cache: Path, signal_name: str, after: str) -> tuple[int, str, str, Path]:
    """`loadopt tiers` over two tiers, sent `signal_name` once it printed a line starting with `after`; its exit
    status, stdout, stderr and output folder."""
    folder.mkdir()
    profiles = folder / "tiers.yaml"
    profiles.write_text(yaml.safe_dump({"tiers": {name: {"bandwidth_mb_s": 100} for name in ("first", "second")}}))
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(folder / "r", pipeline={"batch_size": 4, "image_size": 32},
                                                    workload={"step_time_ms": 20})))
    out = folder / "out"
    env = {**os.environ, "LOADOPT_CACHE": str(cache), "LOADOPT_CEILING_SECONDS": "0.2", "LOADOPT_TIERS": str(profiles),
           "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "loadopt.cli", "tiers", str(path), "--tiers", "first,second",
                             "--max-accelerators", "2", "--readers", "2", "--warmup", "0.2", "--measure", "0.6",
                             "--no-backends", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
        reader.start()
        seen = [lines.get(timeout=120)]
        while not seen[-1].startswith(after):
            seen.append(lines.get(timeout=120))
        proc.send_signal(getattr(signal, signal_name))
        proc.wait(timeout=60)
        stdout = proc.stdout.read()
        reader.join(timeout=10)
        return proc.returncode, stdout, "".join(seen + list(lines.queue)), out
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def tiers_stopped(tmp_path_factory, cache_dir):
    """Each of `STOPS` run at once, side by side (each waits on its own trials' sleeps, not on the CPU): the
    futures of `_tiers_stopped`, by (signal, line). The tiny dataset is generated here first."""
    folder = tmp_path_factory.mktemp("tiers-stopped")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOADOPT_CACHE", str(cache_dir))
        open_dataset(config_from_dict(tiny_config_dict(folder / "r", pipeline={"batch_size": 4, "image_size": 32}),
                                      str(folder / "job.yaml")))
    with ThreadPoolExecutor(len(STOPS)) as pool:
        yield {(name, after): pool.submit(_tiers_stopped, folder / f"{name}-{index}", cache_dir, name, after)
               for index, (name, after) in enumerate(STOPS)}


@pytest.mark.parametrize(("signal_name", "after"), STOPS)
def test_cli_tiers_stopped_keeps_the_tiers_that_finished(tiers_stopped, signal_name, after):
    """SIGTERM (`timeout`, Slurm) or Ctrl-C mid-run: the tiers that finished are in tiers.json (and the report),
    with what stopped it and the trials of the tier cut short; stopped before any finished, nothing is written."""
    returncode, stdout, stderr, out = tiers_stopped[(signal_name, after)].result()
    assert returncode == (143 if signal_name == "SIGTERM" else 130), stderr
    assert "Traceback" not in stderr
    if after.startswith("2 tiers"):  # before any tier finished: the folder is left as it was (it was not there)
        assert not out.exists() and "before any tier finished: no results were written" in stderr
        return
    doc = json.loads((out / "tiers.json").read_text())
    assert [row["name"] for row in doc["tiers"]] == ["first"] and doc["tiers"][0]["accelerators_supported"] >= 1
    assert doc["interrupted"] and doc["interrupted_by"] == signal_name
    assert doc["cut_short"]["tier"] == "second" and len(doc["cut_short"]["trials"]) >= 1
    assert f"It was interrupted ({signal_name}): only the tiers that finished" in (out / "report.html").read_text()
    assert "first" in stdout
    assert f"interrupted ({signal_name}): the 1 tier(s) measured were kept" in stderr
    assert "second was cut short in its search" in stderr
