"""The dali backend: the CPU pipeline end to end, same order and pixels as torch, resume, shards, errors.

GPU paths (mixed decode, batches delivered on the device) are marked `gpu`: skipped without CUDA,
run by benchmarks/gpu_check.py on a GPU machine.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from loadopt import make_loader
from loadopt.config import PipelineConfig, config_from_dict
from loadopt.errors import ConfigError, DatasetError
from loadopt.loaders.dali.feed import dali_error
from loadopt.loaders.dali.loader import DaliLoader
from loadopt.loaders.dali.settings import DaliSettings
from loadopt.loaders.registry import backend_class
from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings
from loadopt.storage.open import open_dataset
from loadopt.storage.sources.imagefolder import scan_image_folder

from .conftest import make_image_folder, tiny_config_dict

pytestmark = pytest.mark.skipif(not DaliLoader.available()[0], reason=f"DALI: {DaliLoader.available()[1]}")

LEVEL = 1 / (255 * 0.224)  # one uint8 level after normalisation, at the smallest std (the largest step)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("dali-folder")
    make_image_folder(root, classes=3, per_class=5)
    return root


def pipeline(augment="train", dtype="float32", batch_size=4, size=24) -> PipelineConfig:
    return PipelineConfig(batch_size=batch_size, image_size=size, augment=augment, dtype=dtype)


def dali(dataset, augment="train", dtype="float32", **kw) -> DaliLoader:
    loader_kw = {k: kw.pop(k) for k in ("rank", "world_size", "on_error", "device") if k in kw}
    return DaliLoader(dataset, pipeline(augment, dtype), DaliSettings(**kw), seed=3, **loader_kw)


def reference(dataset, augment="train", dtype="float32") -> list:
    settings = TorchSettings(variant="plain", num_workers=0, decoder="pil", resize="pil")
    return collect(TorchLoader(dataset, pipeline(augment, dtype), settings, seed=3))


def collect(loader) -> list:
    return [(x.clone(), y.clone()) for x, y in loader]


def differences(a: list, b: list) -> torch.Tensor:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb)  # same samples, same order
        assert xa.shape == xb.shape and xa.dtype == xb.dtype
    return torch.cat([(xa.float() - xb.float()).abs().flatten() for (xa, _), (xb, _) in zip(a, b, strict=True)])


def test_registered_and_described(folder):
    assert backend_class("dali") is DaliLoader
    loader = dali(scan_image_folder(str(folder)), num_threads=1)
    assert loader.describe() == "cpu num_threads=1 prefetch=2"
    assert DaliLoader.cpu_demand(DaliSettings(num_threads=3)) == 3
    assert DaliLoader.knob_space(2) == {"num_threads": [1, 2], "prefetch_queue_depth": [1, 2, 3],
                                        "normalise": ["dali", "device"], "layout": ["NCHW", "NHWC"]}


@pytest.mark.parametrize("roi_decode", [True, False])
def test_centre_crop_matches_torch_within_one_level(folder, roi_decode):
    """Centre crop, no flip, bilinear antialiased (DALI's linear filter and PIL's): same labels in the
    same order, pixels within one uint8 level (rounding of the two resamplers, measured: max 1, ~18%
    of the values off by one)."""
    dataset = scan_image_folder(str(folder))
    diff = differences(collect(dali(dataset, "eval", "uint8", roi_decode=roi_decode)), reference(dataset, "eval",
                                                                                                  "uint8"))
    assert diff.max() <= 1 and diff.mean() < 0.3


def test_normalised_float_output_matches_torch(folder):
    dataset = scan_image_folder(str(folder))
    ours = collect(dali(dataset, "eval", "float32"))
    assert ours[0][0].dtype == torch.float32 and ours[0][0].shape == (4, 3, 24, 24)
    assert ours[0][0].is_contiguous(memory_format=torch.channels_last)  # pipeline.memory_format's default
    assert differences(ours, reference(dataset, "eval", "float32")).max() <= LEVEL * 1.001
    on_device = collect(dali(dataset, "eval", "float32", normalise="device", layout="NHWC"))
    assert differences(on_device, ours).max() < 1e-4  # uint8 NHWC from DALI, normalised by `finish`


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])  # through crop_mirror_normalize, or straight from the resize
def test_train_crops_and_flips_are_the_shared_plan(folder, layout):
    """Random crops and flips come from the shared per-sample plan: the same crop boxes as torch,
    so pixels agree up to the resamplers' rounding (PIL's filter also reads pixels just outside the
    box at the crop's border). Flips are done by the resize (a mirrored ROI)."""
    dataset = scan_image_folder(str(folder))
    ours = collect(dali(dataset, "train", "uint8", layout=layout))  # finishing makes NHWC an NCHW view
    theirs = reference(dataset, "train", "uint8")
    differences(ours, theirs)
    inner = torch.cat([(a[..., 2:-2, 2:-2].float() - b[..., 2:-2, 2:-2].float()).abs().flatten()
                       for (a, _), (b, _) in zip(ours, theirs, strict=True)])
    assert inner.max() <= 2 and inner.mean() < 0.3


def test_epochs_follow_the_shared_order(folder):
    dataset = scan_image_folder(str(folder))
    ours = dali(dataset, "eval", "uint8")
    theirs = TorchLoader(dataset, pipeline("eval", "uint8"), TorchSettings(num_workers=0), seed=3)
    for epoch in range(2):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert [b.indices.tolist() for b in ours.host_batches()] == [b.indices.tolist() for b in theirs.host_batches()]
    assert len(ours) == 4


def test_resume_mid_epoch_without_repeat_or_skip(folder):
    dataset = scan_image_folder(str(folder))
    full = [b.indices.tolist() for b in dali(dataset).host_batches()]
    first = dali(dataset)
    head = []
    for batch in first.host_batches():
        head.append(batch.indices.tolist())
        if len(head) == 2:
            break
    resumed = dali(dataset)
    resumed.load_state_dict(first.state_dict())
    assert head + [b.indices.tolist() for b in resumed.host_batches()] == full
    assert sorted(np.concatenate(full).tolist()) == list(range(15))


def test_two_ranks_share_the_epoch(folder):
    dataset = scan_image_folder(str(folder))
    shares = [[i for b in dali(dataset, rank=r, world_size=2).host_batches() for i in b.indices.tolist()]
              for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(15)) and len(shares[0]) == 8


def test_arrow_source_equals_the_image_folder(tmp_path):
    cfg = config_from_dict(tiny_config_dict(tmp_path / "out", pipeline={"augment": "train"}), "dali.yaml")
    dataset = open_dataset(cfg)
    images = collect(DaliLoader(dataset, cfg.pipeline, DaliSettings(), seed=1))
    arrow = DaliLoader(dataset, cfg.pipeline, DaliSettings(source="arrow"), seed=1)
    assert differences(collect(arrow), images).max() == 0  # same bytes, same decoder: bit-equal
    # asked after the pass, which converted the set (before it, a fresh cache holds no Arrow file)
    assert "source=arrow" in arrow.describe() and arrow.storage_files()[0].endswith(".arrow")


def test_native_reader_covers_each_shard_once_and_refuses_to_resume(folder):
    dataset = scan_image_folder(str(folder))
    seen = []
    for rank in range(2):
        loader = dali(dataset, reader="native", rank=rank, world_size=2)
        assert "order=dali" in loader.describe()
        for epoch in range(2):  # the pipeline carries over into DALI's next epoch
            loader.set_epoch(epoch)
            batches = list(loader.host_batches())
            assert len(batches) == len(loader) == 2
            indices = [i for b in batches for i in b.indices.tolist()]
            labels = torch.cat([b.labels for b in batches]).numpy()
            assert np.array_equal(labels, dataset.labels[indices])
            assert batches[0].inputs.shape == (4, 3, 24, 24)
            if epoch == 0:
                seen += indices
    assert sorted(seen) == list(range(15))
    with pytest.raises(ConfigError, match="cannot resume mid-epoch"):
        loader.load_state_dict({**loader.state_dict(), "batches_done": 1})


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_corrupt_jpeg_follows_on_error(tmp_path, on_error):
    bad = make_image_folder(tmp_path, corrupt=1)[0]
    loader = dali(scan_image_folder(str(tmp_path)), on_error=on_error)
    if on_error == "raise":
        with pytest.raises(DatasetError, match=f"{bad}: truncated image"):
            collect(loader)
        return
    assert sum(len(y) for _, y in collect(loader)) == 12
    assert [p for p, _ in loader.counters.skipped] == [str(bad)]


def test_a_file_only_dalis_decoder_rejects_is_found_and_named(tmp_path):
    """A valid header over a broken body passes the pre-check; DALI fails the batch, which is then
    decoded sample by sample: the bad file is reported with DALI's message, not its C++ stack."""
    make_image_folder(tmp_path, classes=2, per_class=3)
    good = (tmp_path / "train" / "c0" / "0.jpg").read_bytes()
    sos = good.index(b"\xff\xda")
    bad = tmp_path / "train" / "c1" / "broken.jpg"
    bad.write_bytes(good[: sos + 12] + b"\xff\xd9")  # scan cut short right after its header
    loader = dali(scan_image_folder(str(tmp_path)), "eval", on_error="skip")
    batches = collect(loader)
    if not loader.counters.skipped:
        pytest.skip("this DALI build decodes a truncated scan without an error (fills the rest)")
    assert sum(len(y) for _, y in batches) == 6
    path, reason = loader.counters.skipped[0]
    assert path == str(bad) and reason.startswith("DALI cannot decode it") and "\n" not in reason


def test_dali_error_keeps_the_message_not_the_stack():
    exc = RuntimeError("Critical error in pipeline:\nError in CPU operator `nvidia.dali.fn.decoders.image`,\n"
                       "  File \"x.py\", line 3\n\nencountered:\n\nnvImageCodec failure: '#3'\n"
                       "Current pipeline object is no longer valid.")
    assert dali_error(exc) == "nvImageCodec failure: '#3'"


def test_missing_folder_and_token_dataset_are_one_line_errors(tmp_path):
    with pytest.raises(DatasetError, match="dataset folder not found"):
        scan_image_folder(str(tmp_path / "missing"))
    raw = tiny_config_dict(tmp_path / "out", dataset={"kind": "tokens", "tokens": {"num_tokens": 5_000}})
    cfg = config_from_dict(raw, "t.yaml")
    with pytest.raises(ConfigError, match="DALI decodes images"):
        DaliLoader(open_dataset(cfg), cfg.pipeline, DaliSettings())


def test_mixed_decoder_without_a_gpu_says_so(folder):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    with pytest.raises(Exception, match="decoder mixed needs a CUDA device"):
        dali(scan_image_folder(str(folder)), decoder="mixed")


def test_make_loader_and_bench_end_to_end(tmp_path):
    raw = tiny_config_dict(tmp_path / "results", loaders={"dali": {"num_threads": [1, 2]}})
    path = tmp_path / "dali.yaml"
    path.write_text(yaml.safe_dump(raw))
    loader = make_loader(path, backend="dali", batch_size=16)
    batches = collect(loader)
    assert len(batches) == 3 and batches[0][0].shape == (16, 3, 48, 48)
    assert loader.counters.samples == 48 and loader.settings.num_threads == 2  # the sweep holds dali's default
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "loadopt.cli", "bench", str(path), "--quick"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    labels = {run["label"]: run for run in results["runs"]}
    assert set(labels) == {"dali cpu num_threads=1 prefetch=2", "dali cpu num_threads=2 prefetch=2"}
    assert all(run["repeats"][0]["samples_per_s"] > 0 for run in labels.values())
    assert "dali cpu num_threads=2 prefetch=2" in proc.stdout


# -- GPU (skipped without CUDA; benchmarks/gpu_check.py runs them) ---------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_mixed_decode_delivers_on_the_device_close_to_the_cpu_pipeline(folder, dtype):
    dataset = scan_image_folder(str(folder))
    gpu = collect(dali(dataset, "eval", dtype, device="cuda"))
    assert gpu[0][0].is_cuda and gpu[0][1].is_cuda
    cpu = [(x.cuda(), y.cuda()) for x, y in collect(dali(dataset, "eval", dtype))]
    diff = differences(gpu, cpu)  # nvJPEG/HW decoder and libjpeg-turbo differ by IDCT rounding
    assert diff.mean() < (2 if dtype == "uint8" else 2 * LEVEL)


@pytest.mark.gpu
def test_harness_records_no_host_to_device_copy_for_device_batches(folder):
    from loadopt.bench.accelerator import EmulatedAccelerator
    from loadopt.bench.harness import run_repeat
    from loadopt.device import DeviceTransfer

    loader = dali(scan_image_folder(str(folder)), device="cuda")
    device = torch.device("cuda")
    result = run_repeat(loader, EmulatedAccelerator(0.001, device), DeviceTransfer(device), 1, 6)
    assert all(p.h2d_bytes == 0 for p in result.probes)
    assert "mixed" in loader.describe()


@pytest.mark.gpu
def test_mixed_decode_resumes_and_skips_corrupt_files(tmp_path):
    bad = make_image_folder(tmp_path, corrupt=1)[0]
    loader = dali(scan_image_folder(str(tmp_path)), device="cuda", on_error="skip")
    assert sum(len(y) for _, y in collect(loader)) == 12 and loader.counters.skipped[0][0] == str(bad)
    full = [b.indices.tolist() for b in loader.host_batches()]
    first = dali(scan_image_folder(str(tmp_path)), device="cuda", on_error="skip")
    first.set_epoch(1)
    head = [next(first.host_batches()).indices.tolist()]
    resumed = dali(scan_image_folder(str(tmp_path)), device="cuda", on_error="skip")
    resumed.load_state_dict(first.state_dict())
    assert head + [b.indices.tolist() for b in resumed.host_batches()] == full


def test_dali_is_judged_against_its_own_engine(tmp_path):
    """The bench measures DALI's CPU engine alone (one thread x cores) when the config runs dali, and a
    dali run's verdict is against that ceiling, not PIL's or simplejpeg's."""
    from loadopt.bench.attribution.ceilings import decode_rates
    from loadopt.bench.attribution.verdicts import bounding_ceiling
    from loadopt.schema.ceilings import Ceilings, Job

    config = config_from_dict(tiny_config_dict(tmp_path / "out", loaders={"dali": {}}), "d.yaml")
    decode = decode_rates(config, open_dataset(config))
    engine = decode.rate("dali")
    assert engine.decoder == "dali cpu" and engine.per_core > 0
    assert engine.samples_per_s == pytest.approx(engine.per_core * decode.cores)
    metrics = {"samples_per_s": {"median": 10.0}}
    stage, _, capacity, words, _ = bounding_ceiling(metrics, "dali cpu num_threads=2", Ceilings(decode=decode),
                                                    Job(kind="images"), {"decoder": "auto"})
    assert stage == "prep-bound" and capacity == engine.samples_per_s and "dali cpu" in words
