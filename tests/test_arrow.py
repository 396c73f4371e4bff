"""The arrow backend and the Arrow conversion: equal tensors, resumption, errors."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml

from loadopt.config import config_from_dict
from loadopt.errors import DatasetError
from loadopt.loaders.arrow.loader import ArrowLoader, ArrowSettings
from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings
from loadopt.storage.forms.arrow_convert import convert
from loadopt.storage.forms.arrow_format import arrow_path, open_arrow
from loadopt.storage.forms.shard_work import MANIFEST
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict


def config(tmp_path, **pipeline):
    raw = tiny_config_dict(tmp_path / "out", pipeline={"augment": "eval", "dtype": "uint8", **pipeline})
    return config_from_dict(raw, "arrow.yaml")


def batches(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def assert_same(a, b, atol=0):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb)
        assert xa.shape == xb.shape and xa.dtype == xb.dtype
        assert (xa.float() - xb.float()).abs().max() <= atol


@pytest.mark.parametrize("augment", ["eval", "train"])
def test_encoded_arrow_equals_torch_tuned(tmp_path, augment):
    cfg = config(tmp_path, augment=augment)
    dataset = open_dataset(cfg)
    torch_batches = batches(TorchLoader(dataset, cfg.pipeline, TorchSettings(num_workers=1), seed=5))
    arrow = ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="encoded", threads=2), seed=5)
    assert_same(batches(arrow), torch_batches)


def test_decoded_arrow_equals_torch_for_the_centre_crop(tmp_path):
    """Decoded = shorter side resized to image_size/0.875 and centre-cropped at conversion, then the
    centre crop: the same source pixels and filter as torch's one-step eval resize (PIL kernel)."""
    cfg = config(tmp_path, image_size=56)  # decoded_size 64
    dataset = open_dataset(cfg)
    reference = batches(TorchLoader(dataset, cfg.pipeline, TorchSettings(variant="plain", num_workers=0,
                                                                         decoder="simplejpeg", resize="pil")))
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded")))
    assert_same(arrow, reference, atol=1)  # float rounding of PIL's filter positions: at most one level
    diffs = torch.cat([(a[0].float() - r[0].float()).abs().flatten() for a, r in zip(arrow, reference, strict=True)])
    assert (diffs > 0).float().mean() < 0.02  # ~1% here: PIL rounds to uint8 between its two passes


def test_decoded_train_crops_flip_and_normalise(tmp_path):
    cfg = config(tmp_path, augment="train", dtype="float32")
    dataset = open_dataset(cfg)
    first = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded")))
    again = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded")))
    assert_same(first, again)  # deterministic for a seed and epoch
    x, _ = first[0]
    assert x.shape == (8, 3, 48, 48) and x.dtype == torch.float32 and -3 < x.mean() < 3


def test_resume_and_shards(tmp_path):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)

    def make(**kw):
        return ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded"), seed=2, **kw)

    full = [b.indices.tolist() for b in make().host_batches()]
    first = make()
    head = []
    for batch in first.host_batches():
        head.append(batch.indices.tolist())
        if len(head) == 3:
            break
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [b.indices.tolist() for b in resumed.host_batches()] == full
    seen = [i for rank in range(3) for b in make(rank=rank, world_size=3).host_batches() for i in b.indices]
    assert sorted(seen) == list(range(len(dataset)))


def test_tokens_arrow_equals_torch_memmap(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", dataset={"kind": "tokens", "tokens": {"num_tokens": 20_000,
                                                                                  "vocab_size": 70_000}},
                           pipeline={"batch_size": 4, "seq_len": 64})
    cfg = config_from_dict(raw, "tokens.yaml")
    dataset = open_dataset(cfg)
    assert dataset.tokens.dtype == np.uint32 and len(dataset) == (20_000 - 1) // 64
    reference = batches(TorchLoader(dataset, cfg.pipeline, TorchSettings(num_workers=2)))
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings()))
    assert_same(arrow, reference)
    x, y = reference[0]
    assert x.shape == (4, 64) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_truncated_and_mismatched_files_are_named(tmp_path):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)
    folder = convert(dataset, "encoded")
    path = folder / "shard-00000.arrow"
    data = path.read_bytes()
    try:
        path.write_bytes(data[: len(data) // 2])
        with pytest.raises(DatasetError, match=f"{path}: corrupt or truncated Arrow shard .*samples 0-"):
            open_arrow(folder, dataset, "encoded", None)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("x", pa.int8())])) as w:
            w.write_batch(pa.record_batch([pa.array([1], pa.int8())], names=["x"]))
        with pytest.raises(DatasetError, match=f"{path}: schema does not match the config"):
            open_arrow(folder, dataset, "encoded", None)
        path.unlink()
        with pytest.raises(DatasetError, match=f"{path}: Arrow shard not found \\(the manifest lists it: samples 0-"):
            open_arrow(folder, dataset, "encoded", None)
        (folder / MANIFEST).unlink()
        with pytest.raises(DatasetError, match=f"{folder}: Arrow conversion not found \\(no {MANIFEST}\\)"):
            open_arrow(folder, dataset, "encoded", None)
    finally:
        path.write_bytes(data)


def test_no_convert_names_the_missing_file(tmp_path):
    cfg = config(tmp_path, image_size=40)
    loader = ArrowLoader(open_dataset(cfg), cfg.pipeline, ArrowSettings(form="decoded", decoded_size=44))
    with pytest.raises(DatasetError, match="no Arrow conversion .* run `loadopt convert CONFIG --to arrow --decoded`"):
        loader.prepare(convert_missing=False)


def test_interrupted_conversion_is_never_used(tmp_path, cache_dir):
    raw = tiny_config_dict(tmp_path / "out")
    raw["dataset"]["synthetic"] = {"num_samples": 3000, "num_classes": 4, "mean_width": 64, "mean_height": 64,
                                   "seed": 11}
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(raw))
    dataset = open_dataset(config_from_dict(raw, "big.yaml"))  # generated here, converted in the child
    target = arrow_path(dataset, "decoded", 55)
    env = {**os.environ, "LOADOPT_CACHE": str(cache_dir)}
    child = subprocess.Popen([sys.executable, "-m", "loadopt.cli", "convert", str(path), "--to", "arrow",
                              "--decoded", "--frame", "centre"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list(target.parent.glob(f".{target.name}.partial/.*.tmp")):
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    assert not (target / MANIFEST).exists()  # nothing a later run would use
    done = subprocess.run([sys.executable, "-m", "loadopt.cli", "convert", str(path), "--to", "arrow", "--decoded",
                           "--frame", "centre"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (target / MANIFEST).exists() and len(open_arrow(target, dataset, "decoded", 55, verify_labels=True)) == 3


def test_cli_bench_no_convert_and_truncated_file(tmp_path):
    from .test_cli import loadopt, one_line_error

    raw = tiny_config_dict(tmp_path / "out", loaders={"arrow": {"form": "decoded", "decoded_size": 50,
                                                                         "frame": "centre"}})
    path = tmp_path / "a.yaml"
    path.write_text(yaml.safe_dump(raw))
    line = one_line_error(loadopt("bench", path, "--no-convert"))
    assert "no Arrow conversion" in line and "/arrow/" in line
    proc = loadopt("bench", path, "--quick")
    assert proc.returncode == 0, proc.stderr
    assert "arrow decoded centre 50px" in proc.stdout
    cfg = config_from_dict(raw, "a.yaml")
    target = arrow_path(open_dataset(cfg), "decoded", 50) / "shard-00000.arrow"
    target.write_bytes(target.read_bytes()[:1000])
    line = one_line_error(loadopt("bench", path, "--quick"))
    assert f"{target}: corrupt or truncated Arrow shard" in line
    shutil.rmtree(target.parent)


def test_an_error_in_the_producer_thread_reaches_the_consumer(tmp_path, monkeypatch):
    cfg = config(tmp_path, augment="train")
    loader = ArrowLoader(open_dataset(cfg), cfg.pipeline, ArrowSettings(form="decoded", crop_in="threads"))

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(loader.filler, "fill", broken)
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(iter(loader))
    loader.close()


@pytest.mark.parametrize("path", ["native", "opencv", "numpy"])
@pytest.mark.parametrize(("stored", "size"), [(20, 12), (40, 35), (48, 32)])
def test_crop_batch_crops_and_mirrors_exactly(path, stored, size, monkeypatch):
    """Every crop path, at sizes that take the 16-pixel mirror, its remainder and unaligned rows."""
    from concurrent.futures import ThreadPoolExecutor

    from loadopt.loaders import crops
    from loadopt.loaders.crops import crop_batch, plan_crops

    if path == "native" and crops.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    if path != "native":
        monkeypatch.setattr(crops, "native", None)
    if path == "numpy":
        monkeypatch.setattr(crops, "cv2", None)
    elif path == "opencv" and crops.cv2 is None:
        pytest.skip("OpenCV is not installed (pip install 'loadopt[opencv]')")

    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (2, 8, stored, stored, 3), dtype=np.uint8)  # two sources of 8 images
    indices = np.arange(16)
    which, local = np.divmod(indices, 8)
    out = np.empty((16, size, size, 3), np.uint8)
    with ThreadPoolExecutor(2) as pool:
        crop_batch(out, indices, list(images), which, local * stored * stored * 3, stored, "train", 3, 1, pool, 2)
    tops, lefts, flips = plan_crops(indices, stored - size, "train", 3, 1)
    assert flips.any() and not flips.all()
    for k in range(16):
        expected = images[which[k], local[k], tops[k] : tops[k] + size, lefts[k] : lefts[k] + size]
        assert np.array_equal(out[k], expected[:, ::-1] if flips[k] else expected)


def test_native_crops_refuse_reads_past_a_source():
    from loadopt.loaders import crops

    if crops.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    source = np.zeros(10 * 10 * 3, np.uint8)
    out = np.empty((1, 8, 8, 3), np.uint8)
    with pytest.raises(IndexError, match="sample 0 reads past the end of source 0"):
        crops.native.crop_batch(out, [source], np.zeros(1, np.int32), np.array([3 * 10 * 3], np.int64),
                                np.zeros(1, np.uint8), 30, 8, 0, 1)


def test_encoded_pages_released_every_32_batches_read_back_the_same(tmp_path, monkeypatch):
    """The encoded form unmaps the JPEG pages it read every 32 batches (`_release_mapped`): the next
    epochs read the same bytes back from the page cache."""
    from loadopt.loaders.arrow import loader as arrow_loader
    from loadopt.storage.open import open_dataset

    from .conftest import prepared_loader

    cfg = config(tmp_path, batch_size=1)  # the tiny set's 48 samples: 48 batches an epoch, a release at 32
    dataset = open_dataset(cfg)
    released = []
    release = arrow_loader.release_pages
    monkeypatch.setattr(arrow_loader, "release_pages", lambda view: (released.append(view.nbytes), release(view)))
    loader = prepared_loader(cfg, dataset, "arrow", {"form": "encoded", "crop_in": "threads"})
    first, second = batches(loader), batches(loader)
    loader.close()
    assert released and all(n > 0 for n in released)
    monkeypatch.setattr(arrow_loader, "release_pages", lambda view: None)
    kept = prepared_loader(cfg, dataset, "arrow", {"form": "encoded", "crop_in": "threads"})
    assert_same(first, batches(kept))
    assert_same(second, batches(kept))
    kept.close()


def test_encoded_pages_are_released_by_the_decoding_workers_every_32_batches(tmp_path, monkeypatch):
    """With the JPEGs decoded by worker processes (the default), each worker is told to let go of the pages
    it mapped at the same batches (`send_decode(release=True)`), and the epochs deliver what threads do."""
    from loadopt.loaders.crop_processes import CropProcesses, fork_available
    from loadopt.storage.open import open_dataset

    from .conftest import prepared_loader

    if not fork_available():
        pytest.skip("worker processes are forked: no fork here")
    cfg = config(tmp_path, batch_size=1)  # 48 batches an epoch: released once, at batch 32
    dataset = open_dataset(cfg)
    told = []
    send = CropProcesses.send_decode
    monkeypatch.setattr(CropProcesses, "send_decode", lambda self, *a, **k: (told.append(k["release"]),
                                                                              send(self, *a, **k)))
    workers = prepared_loader(cfg, dataset, "arrow", {"form": "encoded"})
    threads = prepared_loader(cfg, dataset, "arrow", {"form": "encoded", "crop_in": "threads"})
    for _ in range(2):
        assert_same(batches(workers), batches(threads))
    assert workers.croppers is not None and len(told) == 96 and [i for i, r in enumerate(told) if r] == [31, 79]
    workers.close()
    threads.close()
