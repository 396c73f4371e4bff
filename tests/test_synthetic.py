"""The synthetic dataset: layout, manifest, determinism, reuse, atomicity and cache errors."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import BaseModel

from loadopt.storage.sources import synthetic
from loadopt.storage.sources.synthetic import ensure_synthetic, synthetic_key, synthetic_root


class Spec(BaseModel):
    """Stands in for `loadopt.config.SyntheticSpec` (same fields), tiny by default."""

    num_samples: int = 24
    num_classes: int = 3
    mean_width: int = 96
    mean_height: int = 80
    jpeg_quality: int = 90
    seed: int = 0


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The tiny dataset generated once, in-process, as the bytes to compare against."""
    return _files(ensure_synthetic(Spec(), tmp_path_factory.mktemp("reference"), workers=1))


def test_layout_and_manifest(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    root = ensure_synthetic(Spec(), tmp_path, progress=lambda done, total: calls.append((done, total)),
                            workers=2)
    assert root == synthetic_root(Spec(), tmp_path)
    assert root == tmp_path / "datasets" / f"synthetic-{synthetic_key(Spec())}"
    assert [p.name for p in root.parent.iterdir()] == [root.name]  # no tmp folder left behind
    assert sorted(p.name for p in (root / "train").iterdir()) == ["class_000", "class_001", "class_002"]
    assert calls[-1] == (24, 24) and [d for d, _ in calls] == sorted(d for d, _ in calls)

    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["generator_version"] == synthetic.GENERATOR_VERSION
    assert manifest["spec"] == Spec().model_dump()
    assert manifest["num_samples"] == len(manifest["files"]) == 24
    on_disk = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.JPEG"))
    assert sorted(f[0] for f in manifest["files"]) == on_disk
    assert manifest["total_bytes"] == sum(f[1] for f in manifest["files"])
    for index, (rel, size, label) in enumerate(manifest["files"]):
        assert rel == f"train/class_{index % 3:03d}/{index:06d}.JPEG"
        assert label == index % 3 == int(rel.split("/")[1].removeprefix("class_"))
        assert (root / rel).stat().st_size == size
        with Image.open(root / rel) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
            assert 64 <= image.width <= 3 * 96 and 64 <= image.height <= 3 * 80
            image.load()
    assert np.bincount([f[2] for f in manifest["files"]]).tolist() == [8, 8, 8]


def test_deterministic_across_runs_and_workers(tmp_path: Path, reference: dict[str, bytes]) -> None:
    for workers in (1, 2):
        assert _files(ensure_synthetic(Spec(), tmp_path / f"w{workers}", workers=workers)) == reference
    other = _files(ensure_synthetic(Spec(seed=1), tmp_path / "seed1", workers=1))
    assert other.keys() - {"manifest.json"} == reference.keys() - {"manifest.json"}
    assert all(other[name] != reference[name] for name in reference if name.endswith(".JPEG"))


def test_second_call_reuses_the_dataset(tmp_path: Path) -> None:
    root = ensure_synthetic(Spec(), tmp_path, workers=1)
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    calls: list[tuple[int, int]] = []
    assert ensure_synthetic(Spec(), tmp_path, progress=lambda *a: calls.append(a), workers=2) == root
    assert calls == []
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == stamps


def test_interrupted_generations_are_never_used(tmp_path: Path, reference: dict[str, bytes]) -> None:
    root = synthetic_root(Spec(), tmp_path)
    fresh, old = root.with_name(f"{root.name}.tmp-1-fresh"), root.with_name(f"{root.name}.tmp-2-old")
    for leftover in (root, fresh, old):
        (leftover / "train" / "class_000").mkdir(parents=True)
        (leftover / "train" / "class_000" / "000000.JPEG").write_bytes(b"half-written")
    long_ago = time.time() - 2 * synthetic.STALE_SECONDS
    os.utime(old, (long_ago, long_ago))

    assert ensure_synthetic(Spec(), tmp_path, workers=2) == root
    assert _files(root) == reference
    remaining = sorted(p.name for p in root.parent.iterdir())
    assert remaining == [root.name, fresh.name]  # a recent tmp folder may still be in use


def test_concurrently_finished_dataset_wins(tmp_path: Path, reference: dict[str, bytes]) -> None:
    root = ensure_synthetic(Spec(), tmp_path, workers=1)
    ours = root.with_name(f"{root.name}.tmp-3-ours")
    (ours / "train").mkdir(parents=True)
    (ours / "manifest.json").write_text("{}")
    synthetic._publish(ours, root)  # the rename fails: theirs is kept, ours discarded
    assert not ours.exists() and _files(root) == reference


def test_different_specs_have_different_keys(tmp_path: Path) -> None:
    key = synthetic_key(Spec())
    assert re.fullmatch(r"[0-9a-f]{16}", key) and synthetic_key(Spec()) == key
    changes = dict(num_samples=25, num_classes=4, mean_width=97, mean_height=81, jpeg_quality=80, seed=1)
    keys = {synthetic_key(Spec(**{name: value})) for name, value in changes.items()}
    assert len(keys) == len(changes) and key not in keys
    assert synthetic_root(Spec(seed=1), tmp_path) != synthetic_root(Spec(), tmp_path)


def test_unwritable_cache_dir_raises_oserror_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError) as info:
        ensure_synthetic(Spec(), blocker / "cache", workers=1)
    assert str(blocker / "cache") in str(info.value)


def test_default_spec_sizes_and_bytes_resemble_imagenet() -> None:
    """Default spec (400x350, q90): over its 4000 samples the sides average 400.9 x 352.0 (clipped to
    [64, 3x mean]); the full generation measured a mean file of 111.6 KB (median 105, p5 59, p95 184)."""
    spec = Spec(num_samples=4000, num_classes=100, mean_width=400, mean_height=350)
    sides = np.array([synthetic._image_size(np.random.default_rng([0, i]), 400, 350) for i in range(4000)])
    width, height = sides.mean(axis=0)
    assert abs(width - 400) < 16 and abs(height - 350) < 14
    assert sides.min() >= 64 and sides[:, 0].max() <= 1200 and sides[:, 1].max() <= 1050
    aspect = sides[:, 0] / sides[:, 1]
    assert aspect.min() < 0.85 and aspect.max() > 1.6  # portrait and wide landscape both occur
    params = spec.model_dump()
    mean_kb = np.mean([len(synthetic._render_jpeg(params, i)) for i in range(40)]) / 1000
    assert 80 < mean_kb < 140, mean_kb


class ValSpec(Spec):
    val_fraction: float = 0.25


def test_val_split_beside_train_keeps_train_as_it_was(tmp_path: Path, reference: dict[str, bytes]) -> None:
    """val: its own root beside train's, `val_fraction x num_samples` new images (the indices after train's);
    train's root, key (its fingerprint) and bytes are those of a spec without a val split."""
    assert synthetic_key(ValSpec()) == synthetic_key(Spec())  # the val size is not part of train's key
    train = ensure_synthetic(ValSpec(), tmp_path, workers=1)
    images = {name: data for name, data in reference.items() if name != "manifest.json"}
    assert train == synthetic_root(Spec(), tmp_path) and _files(train).items() >= images.items()
    calls: list[tuple[int, int]] = []
    val = ensure_synthetic(ValSpec(), tmp_path, progress=lambda *a: calls.append(a), workers=2, split="val")
    assert val == tmp_path / "datasets" / f"synthetic-{synthetic_key(Spec())}-val6" and calls[-1] == (6, 6)
    manifest = json.loads((val / "manifest.json").read_text())
    assert [f[0] for f in manifest["files"]] == [f"val/class_{i % 3:03d}/{i:06d}.JPEG" for i in range(24, 30)]
    assert [f[2] for f in manifest["files"]] == [i % 3 for i in range(24, 30)]
    val_bytes = {p.read_bytes() for p in val.rglob("*.JPEG")}
    assert len(val_bytes) == 6 and not val_bytes & set(reference.values())  # no image shared with train
    assert ensure_synthetic(ValSpec(), tmp_path, workers=1, split="val") == val  # reused
    with pytest.raises(ValueError, match="val_fraction is 0"):
        ensure_synthetic(ValSpec(val_fraction=0.0), tmp_path, workers=1, split="val")
    with pytest.raises(ValueError, match="splits train, val, not 'test'"):
        ensure_synthetic(ValSpec(), tmp_path, workers=1, split="test")


def test_open_dataset_val_split_of_the_synthetic_dataset() -> None:
    from loadopt.config import config_from_dict
    from loadopt.errors import DatasetError
    from loadopt.storage.open import open_dataset

    raw = {"dataset": {"synthetic": {"num_samples": 20, "num_classes": 2, "mean_width": 64, "mean_height": 64,
                                     "seed": 5}}}
    train, val = open_dataset(config_from_dict(raw), "train"), open_dataset(config_from_dict(raw), "val")
    assert len(train) == 20 and len(val) == 2 and val.classes == train.classes == ["class_000", "class_001"]
    assert train.fingerprint == f"synthetic-{synthetic_key(config_from_dict(raw).dataset.synthetic)}"
    assert val.fingerprint == train.fingerprint + "-val2" and val.root.endswith("val")
    with pytest.raises(DatasetError, match="dataset.synthetic: the synthetic dataset has splits train, val, not"):
        open_dataset(config_from_dict(raw), "test")


def test_an_interrupted_generation_resumes_where_it_stopped(tmp_path: Path, reference: dict[str, bytes]) -> None:
    class Stop(Exception):
        pass

    def stop_after_some(done: int, total: int) -> None:
        if done >= 8:
            raise Stop

    with pytest.raises(Stop):
        ensure_synthetic(Spec(), tmp_path, progress=stop_after_some, workers=1)
    root = synthetic_root(Spec(), tmp_path)
    partial = root.with_name(f"{root.name}.tmp-resume")
    assert not root.exists() and (partial / synthetic.DONE_LOG).stat().st_size >= 8 * 16
    calls: list[tuple[int, int]] = []
    assert ensure_synthetic(Spec(), tmp_path, progress=lambda *a: calls.append(a), workers=2) == root
    assert calls[0][0] > 8 and calls[-1] == (24, 24)  # the finished images were not made again
    assert _files(root) == reference and not partial.exists()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_make_dataset_stopped_mid_generation_leaves_no_worker_and_resumes(tmp_path: Path, own_cache: Path,
                                                                         stop: str) -> None:
    """SIGTERM: one line, exit 143. SIGKILL (the OOM killer, a scheduler's last word) gives the command no say:
    its generating workers must still end with it, not wait forever on their queue. Either way the same command
    then finishes the set."""
    import signal
    import subprocess
    import sys

    import psutil
    import yaml

    path = tmp_path / "gen.yaml"
    path.write_text(yaml.safe_dump({"name": "gen", "dataset": {"synthetic": {
        "num_samples": 4_000, "num_classes": 10, "mean_width": 96, "mean_height": 80}}}))
    command = [sys.executable, "-m", "loadopt.cli", "make-dataset", str(path)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers, deadline = set(), time.time() + 120
    while time.time() < deadline and child.poll() is None and not (
            workers and any(p.stat().st_size for p in own_cache.glob(f"datasets/*/{synthetic.DONE_LOG}"))):
        workers |= {p.pid for p in psutil.Process(child.pid).children(recursive=True)}
        time.sleep(0.02)
    assert child.poll() is None and workers, child.stdout.read() if child.stdout else ""
    child.send_signal(getattr(signal, stop))
    output, _ = child.communicate(timeout=60)
    if stop == "SIGTERM":
        assert child.returncode == 143 and "Traceback" not in output, output
        assert output.strip().splitlines()[-1].startswith("interrupted (SIGTERM) before the dataset was ready")
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in workers if psutil.pid_exists(pid)], timeout=20)
    assert not alive, [p.pid for p in alive]
    assert not list(own_cache.glob("datasets/synthetic-*[0-9a-f]/manifest.json"))  # only a resumable folder
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(list(own_cache.glob("datasets/synthetic-*[0-9a-f]/manifest.json"))) == 1, done.stdout
