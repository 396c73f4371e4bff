"""Bottleneck attribution: constructed runs name the right stage; ceilings and verdicts reach the results."""

from __future__ import annotations

import json

from loadopt.bench.attribution import verdicts as attribution
from loadopt.bench.runner import run_bench
from loadopt.config import config_from_dict
from loadopt.report import render_report
from loadopt.schema.ceilings import Ceilings, Job, RunCeiling, written

from .conftest import tiny_config_dict

# 2 cores decode 690 img/s; the job asks 2,560 img/s (25 ms per batch of 64).
CEILINGS = {"memcpy": {"name": "memory copy bandwidth", "bytes_per_s": 10e9},
            "storage": {"name": "storage sequential read", "bytes_per_s": 200e6},
            "decode": {"cores": 2, "pil": {"decoder": "pil", "resize": "pil", "samples_per_s": 400.0},
                       "fast": {"decoder": "simplejpeg", "resize": "torch", "samples_per_s": 690.0}}}
JOB = {"batch_size": 64, "step_ms": 25.0, "demand_samples_per_s": 2560.0, "cache": "warm",
       "mean_sample_bytes": 110e3, "kind": "images"}


def attribute(run_metrics: dict, label: str, ceilings: dict, job: dict, settings: dict | None = None,
              recipe: dict | None = None) -> attribution.Attribution:
    """`attribution.attribute` on ceilings and a job written as results.json holds them."""
    return attribution.attribute(run_metrics, label, Ceilings.model_validate(ceilings), Job.model_validate(job),
                                 settings, recipe)


def metrics(stall: float, wait_s: float, finish_s: float, rate: float, batches: int = 100) -> dict:
    samples = batches * 64
    return {"samples_per_s": rate, "stall_fraction": stall, "wait_s": wait_s, "finish_s": finish_s,
            "batches": batches, "samples": samples, "wall_s": samples / rate, "compute_s": batches * 0.025,
            "h2d_s": 0.5, "h2d_gb_per_s": samples * 3 * 224 * 224 / 0.5 / 1e9, "bytes_read": samples * 110e3}


def test_a_stalled_jpeg_loader_waiting_for_batches_is_prep_bound_on_decode():
    found = attribute(metrics(0.6, wait_s=6.0, finish_s=0.3, rate=650.0), "torch tuned num_workers=2 prefetch=2",
                      CEILINGS, JOB, {"variant": "tuned", "decoder": "auto"})
    assert found.bottleneck == "prep-bound"
    assert written(found.ceiling) == {"name": "decode simplejpeg x 2 cores", "samples_per_s": 690.0}
    assert "2 cores decode 690 img/s" in found.text and "2,560" in found.text
    assert "dali" in found.text and "arrow --decoded" in found.text


def test_plain_torch_is_held_against_the_pil_ceiling_and_told_of_the_faster_decoder():
    found = attribute(metrics(0.8, wait_s=8.0, finish_s=0.3, rate=380.0), "torch plain num_workers=2 prefetch=2",
                      CEILINGS, JOB, {"variant": "plain", "decoder": "auto"})
    assert found.ceiling.samples_per_s == 400.0
    assert "simplejpeg" in found.text


def test_small_wait_but_large_finish_names_the_finishing_on_the_device():
    found = attribute(metrics(0.5, wait_s=0.05, finish_s=2.5, rate=1300.0), "arrow decoded 256px threads=2 prefetch=2",
                      CEILINGS, JOB, {"form": "decoded"})
    assert found.bottleneck == "finish-bound"
    assert "copying and normalising" in found.text and "on the device" in found.text
    assert found.ceiling.name.startswith("memory copy bandwidth")
    # 10 GB/s over 150,528 bytes per sample
    assert abs(found.ceiling.samples_per_s - 10e9 / (3 * 224 * 224)) < 1.0


def test_a_tiny_stall_is_compute_bound():
    found = attribute(metrics(0.01, wait_s=0.02, finish_s=0.01, rate=2540.0), "arrow decoded 256px threads=2",
                      CEILINGS, JOB, {"form": "decoded"})
    assert found.bottleneck == "compute-bound"
    assert "would not speed this job up" in found.text


def test_a_cold_cache_is_fetch_bound_when_storage_is_the_lower_capacity():
    slow_disk = {**CEILINGS, "storage": {"name": "storage sequential read", "bytes_per_s": 50e6}}
    found = attribute(metrics(0.7, wait_s=7.0, finish_s=0.2, rate=400.0), "arrow encoded threads=2", slow_disk,
                      {**JOB, "cache": "cold"}, {"form": "encoded"})
    assert found.bottleneck == "fetch-bound" and "50 MB/s" in found.text
    assert abs(found.ceiling.samples_per_s - 50e6 / 110e3) < 1.0
    # A faster disk leaves decode (690 img/s) as the lower capacity, cold or not.
    found = attribute(metrics(0.7, wait_s=7.0, finish_s=0.2, rate=600.0), "arrow encoded threads=2", CEILINGS,
                      {**JOB, "cache": "cold"}, {"form": "encoded"})
    assert found.bottleneck == "prep-bound"


def test_step_time_zero_has_no_demand():
    found = attribute(metrics(1.0, wait_s=6.0, finish_s=0.1, rate=650.0), "arrow encoded threads=2", CEILINGS,
                      {**JOB, "step_ms": 0.0, "demand_samples_per_s": None}, {"form": "encoded"})
    assert found.bottleneck == "prep-bound" and "step time 0" in found.text


def test_run_bench_writes_ceilings_and_verdicts_and_the_report_renders(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 0},
                                                       "arrow": {"form": "decoded", "threads": 1}})
    outcome = run_bench(config_from_dict(raw, "tiny.yaml"))
    results = json.loads(outcome.json_path.read_text())
    measured = [r for r in results["runs"] if "metrics" in r]
    assert len(measured) == 2
    for run in measured:
        assert run["ceiling"]["name"] and run["ceiling"]["samples_per_s"] > 0
        # a fraction, or none where the run beat its ceiling by over 10% (a busy phase while measuring it)
        assert run["fraction_of_ceiling"] > 0 if not run["ceiling"].get("unreliable") else \
            run["fraction_of_ceiling"] is None
    assert {v["label"] for v in results["verdicts"]} == {r["label"] for r in measured}
    # augment: train stores arrow's decoded form as whole frames: held to the crop + resize ceiling
    arrow = next(r for r in measured if r["backend"] == "arrow")
    assert arrow["recipe"]["stored"].startswith("whole frame")
    assert arrow["ceiling"]["name"].startswith("crop + resize of stored frames")
    assert arrow["ceiling"]["samples_per_s"] == results["ceilings"]["crop_resize"]["samples_per_s"]
    assert all(v["bottleneck"] and v["text"] for v in results["verdicts"])
    assert results["ceilings"]["memcpy"]["bytes_per_s"] > 0
    html = render_report([str(outcome.json_path)], "html")
    assert results["verdicts"][0]["bottleneck"] in html and "Ceilings were not measured" not in html
    markdown = render_report([str(outcome.json_path)], "markdown")
    assert "of ceiling" in markdown and results["verdicts"][0]["text"] in markdown


def test_run_bench_without_attribution_writes_no_ceilings(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", loaders={"torch": {"variant": "tuned", "num_workers": 0}})
    results = run_bench(config_from_dict(raw, "tiny.yaml"), attribute=False).document()
    assert "ceilings" not in results and "verdicts" not in results
    assert all("ceiling" not in r for r in results["runs"])


def test_a_slow_host_to_device_link_bounds_before_the_memory_copy():
    slow_link = {**CEILINGS, "h2d": {"name": "pinned h2d bandwidth", "bytes_per_s": 0.2e9}}
    found = attribute(metrics(0.6, wait_s=6.0, finish_s=0.3, rate=1200.0), "arrow decoded 256px threads=2",
                      slow_link, JOB, {"form": "decoded"})
    assert found.bottleneck == "transfer-bound" and found.ceiling.name.startswith("pinned h2d")
    assert "warm page cache" in found.text


def test_comparable_wait_and_finish_keep_the_stage_and_mention_the_finishing():
    found = attribute(metrics(0.45, wait_s=0.82, finish_s=1.2, rate=1380.0), "torch tuned num_workers=2 prefetch=2",
                      CEILINGS, JOB, {"variant": "tuned", "decoder": "auto"})
    assert found.bottleneck == "prep-bound" and "normalising on the device adds 12.0 ms" in found.text


# -- ceilings that hold on a busy machine -------------------------------------------------------------------


def test_a_run_more_than_10pct_above_its_ceiling_is_marked_unreliable_with_no_fraction():
    from loadopt.bench.attribution.verdicts import hold_to_ceiling

    run = hold_to_ceiling(RunCeiling(name="decode simplejpeg x 2 cores", samples_per_s=100.0), 631.0, busy=True)
    assert run.fraction is None
    assert run.ceiling.unreliable is True and run.ceiling.measured_fraction == 6.31
    assert "busy" in run.ceiling.reason and "631" in run.ceiling.reason
    # within 10%: noise of the two measurements, shown as it is
    close = hold_to_ceiling(RunCeiling(name="x", samples_per_s=100.0), 109.0, busy=False)
    assert close.fraction == 1.09 and "unreliable" not in written(close.ceiling)


def test_the_verdict_never_states_a_fraction_above_110pct_nor_recommends_a_decoder_measured_slower():
    # Figures a busy machine gave: the fast decoder measured 48 img/s, PIL 400 img/s.
    ceilings = {**CEILINGS, "decode": {"cores": 2, "pil": CEILINGS["decode"]["pil"],
                                       "fast": {**CEILINGS["decode"]["fast"], "samples_per_s": 48.0}}}
    fast = attribute(metrics(0.6, 20.0, 0.2, 303.0), "torch tuned num_workers=2", ceilings, JOB)
    assert "631%" not in fast.text and "unreliable" in fast.text
    plain = attribute(metrics(0.8, 30.0, 0.2, 300.0), "torch plain num_workers=2", ceilings, JOB)
    assert "a faster decoder" not in plain.text


# Whole frames (the decoded forms under augment: train): crop + resize, 2 cores 900 samples/s.
WHOLE = {"stored": "whole frame <= 512 px", "max_side": 512}
CENTRE = {"stored": "centre 256 px square", "max_side": 256}
CROPPING = {**CEILINGS, "crop_resize": {"name": "crop + resize of stored frames", "samples_per_s": 900.0,
                                        "workers": 2, "max_side": 512}}
TRAIN_JOB = {**JOB, "augment": "train"}


def test_a_whole_frame_run_is_held_to_the_crop_and_resize_ceiling_with_what_lifts_it():
    found = attribute(metrics(0.7, wait_s=7.0, finish_s=0.3, rate=810.0), "arrow decoded whole 512px threads=2",
                      CROPPING, TRAIN_JOB, {"form": "decoded", "frame": "auto"}, WHOLE)
    assert written(found.ceiling) == {"name": "crop + resize of stored frames x 2 cores", "samples_per_s": 900.0}
    assert found.bottleneck == "prep-bound"
    assert "2 cores crop and resize 900 samples/s from stored frames <= 512 px" in found.text
    assert "(90% of that ceiling)" in found.text  # 810 of 900, not 810 of ~66,000 copied
    for lever in ("frame: centre", "max_side", "GPU"):
        assert lever in found.text
    # Far below its ceiling, which would be enough for the job: loader-bound, the fraction of crop + resize.
    slow = attribute(metrics(0.7, wait_s=7.0, finish_s=0.3, rate=450.0), "posix decoded whole 512px",
                     {**CROPPING, "crop_resize": {**CROPPING["crop_resize"], "samples_per_s": 3000.0}}, TRAIN_JOB,
                     {"form": "decoded"}, WHOLE)
    assert slow.bottleneck == "loader-bound" and "(15% of that ceiling)" in slow.text


def test_a_centre_square_run_stays_held_to_the_memory_copy_whatever_the_augment():
    for job in (TRAIN_JOB, {**JOB, "augment": "eval"}):
        found = attribute(metrics(0.6, wait_s=6.0, finish_s=0.3, rate=1200.0), "arrow decoded centre 256px threads=2",
                          CROPPING, job, {"form": "decoded", "frame": "centre"}, CENTRE)
        assert found.ceiling.name.startswith("memory copy bandwidth")
        assert abs(found.ceiling.samples_per_s - 10e9 / (3 * 224 * 224)) < 1.0


def test_the_stored_form_is_read_from_the_recipe_before_the_settings_and_the_label():
    def stores_whole_frames(label: str, settings: dict, recipe: dict | None, job: dict) -> bool:
        return attribution.stores_whole_frames(label, settings, recipe, Job.model_validate(job))

    # The recorded recipe decides, whatever the label says.
    assert stores_whole_frames("arrow decoded 256px", {"form": "decoded"}, WHOLE, JOB)
    assert not stores_whole_frames("arrow decoded whole 512px", {"form": "decoded"}, CENTRE, TRAIN_JOB)
    # No recipe recorded (older results, stage measurements): the settings and the job's augment.
    assert stores_whole_frames("posix decoded", {"form": "decoded", "frame": "auto"}, None, TRAIN_JOB)
    eval_job = {**JOB, "augment": "eval"}
    assert not stores_whole_frames("posix decoded", {"form": "decoded", "frame": "auto"}, None, eval_job)
    assert stores_whole_frames("posix decoded", {"form": "decoded", "frame": "whole"}, None, eval_job)
    assert not stores_whole_frames("arrow encoded", {"form": "encoded"}, None, TRAIN_JOB)
    assert not stores_whole_frames("torch tuned", {"variant": "tuned"}, {"stored": "source"}, TRAIN_JOB)
    # kvikio resizes its frames on the device: not the host's crop + resize.
    assert not stores_whole_frames("kvikio decoded whole 512px", {"form": "decoded"}, WHOLE, TRAIN_JOB)
    assert not stores_whole_frames("arrow tokens", {}, {"kind": "tokens"}, {**TRAIN_JOB, "kind": "tokens"})


def test_an_unmeasured_crop_ceiling_says_so_rather_than_borrowing_another():
    found = attribute(metrics(0.7, wait_s=7.0, finish_s=0.3, rate=810.0), "arrow decoded whole 512px threads=2",
                      CEILINGS, TRAIN_JOB, {"form": "decoded"}, WHOLE)
    assert found.ceiling.samples_per_s is None and "crop + resize capacity not measured" in found.text


def test_a_warm_record_read_is_held_to_the_page_cache_copy_and_a_cold_one_to_the_storage_read():
    """Records (work kind io): warm, each record comes from the page cache, a memory copy (a converted
    form read from memory is not 10x over a disk's rate); cold, the storage's sequential read bounds it."""
    records = {"kind": "records"}
    job = {**JOB, "kind": "records", "mean_sample_bytes": 1.5e6}

    def run(rate: float) -> dict:
        return {**metrics(0.5, wait_s=5.0, finish_s=0.1, rate=rate), "bytes_read": 100 * 64 * 1.5e6}

    warm = attribute(run(4000.0), "arrow records threads=2", CEILINGS, job, {}, records)
    assert "page cache copy" in warm.ceiling.name and "above that ceiling" not in warm.text
    assert abs(warm.ceiling.samples_per_s - 10e9 / 1.5e6) < 1.0  # 4,000 of 6,667: 60%, not 30x
    cold = attribute(run(120.0), "arrow records threads=2", CEILINGS, {**job, "cache": "cold"}, {}, records)
    assert cold.bottleneck == "fetch-bound" and abs(cold.ceiling.samples_per_s - 200e6 / 1.5e6) < 1.0
    # Remote objects have no page cache: warm or not, the storage's read bounds them.
    remote = {**CEILINGS, "storage": {"name": "storage read", "bytes_per_s": 200e6}}
    found = attribute(run(120.0), "arrow records threads=2", remote, job, {}, records)
    assert found.ceiling.name.startswith("storage read")


def test_an_encoded_form_is_held_to_the_stored_jpegs_decode_ceiling():
    """The ring backends' encoded forms decode JPEGs stored with restart markers (less work for the same
    pixels): held to that measured rate, not the source JPEGs' (where it is measured), and named so."""
    ceilings = {**CEILINGS, "decode": {**CEILINGS["decode"],
                                       "stored": {"decoder": "simplejpeg", "resize": "torch", "samples_per_s": 900.0}}}
    recipe = {"kind": "images", "stored": "source"}
    for label in ("arrow encoded threads=2 prefetch=2", "posix encoded o_direct=False io_threads=2 threads=2"):
        found = attribute(metrics(0.6, wait_s=6.0, finish_s=0.3, rate=850.0), label, ceilings, JOB,
                          {"form": "encoded"}, recipe)
        assert written(found.ceiling) == {"name": "decode simplejpeg (stored JPEGs) x 2 cores", "samples_per_s": 900.0}
        assert "stored JPEGs" in found.text
    # the torch backend reads the sources: the source JPEGs' ceiling
    found = attribute(metrics(0.6, wait_s=6.0, finish_s=0.3, rate=650.0), "torch tuned num_workers=2 prefetch=2",
                      ceilings, JOB, {"variant": "tuned", "decoder": "auto"}, recipe)
    assert found.ceiling.samples_per_s == 690.0
