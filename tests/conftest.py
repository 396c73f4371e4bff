"""Shared fixtures: a private cache, tiny synthetic configs, small real ImageFolder trees, a backend's
prepared loader and one epoch of its inputs."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device: none here (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "timing" in item.keywords:
            # Stall figures held within 0.03 of delays made with sleeps: a machine busy enough to oversleep
            # by milliseconds (other jobs beside CI) can push one run out; a wrong figure fails every time.
            item.add_marker(pytest.mark.flaky(reruns=2, reruns_delay=2))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("loadopt-cache")


@pytest.fixture(autouse=True)
def _private_cache(cache_dir, monkeypatch):
    """Every test uses one session-wide cache, never the user's ~/.cache/loadopt; the ceilings' timed windows
    are 0.2 s instead of 1 s (the suite runs about a hundred tiny benches; no test holds a ceiling's value)."""
    monkeypatch.setenv("LOADOPT_CACHE", str(cache_dir))
    monkeypatch.setenv("LOADOPT_CEILING_SECONDS", "0.2")


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOADOPT_CACHE", str(cache))
    return cache


def tiny_config_dict(out: Path, **sections) -> dict:
    config = {
        "name": "tiny",
        "dataset": {"synthetic": {"num_samples": 48, "num_classes": 4, "mean_width": 96, "mean_height": 80}},
        "pipeline": {"batch_size": 8, "image_size": 48},
        "workload": {"step_time_ms": 2, "warmup_batches": 1, "measure_batches": 6, "repeats": 1},
        "loaders": {"torch": {"variant": ["plain", "tuned"], "num_workers": [0, 1]}},
        "report": {"out": str(out)},
    }
    for key, value in sections.items():  # sections merge into the defaults; `loaders` replaces them
        merge = isinstance(value, dict) and key != "loaders"
        config[key] = {**config.get(key, {}), **value} if merge else value
    return config


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "results")))
    return path


def jpeg_bytes(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=85)
    return out.getvalue()


def make_image_folder(root: Path, classes: int = 3, per_class: int = 4, corrupt: int = 0) -> list[Path]:
    """A real ImageFolder tree `root/train/<class>/<n>.jpg`; returns the corrupt files it wrote."""
    bad = []
    for c in range(classes):
        folder = root / "train" / f"c{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            (folder / f"{n}.jpg").write_bytes(jpeg_bytes(40 + 3 * n, 32 + 2 * c, seed=c * 100 + n))
    for n in range(corrupt):
        path = root / "train" / "c0" / f"corrupt{n}.jpg"
        path.write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 4)
        bad.append(path)
    return bad


def prepared_loader(config, dataset, backend: str, settings: dict, seed: int = 3):
    """Backend `backend` over `dataset` with `settings` (validated as the config's own would be), prepared
    (converted); the test is skipped where the backend cannot run here."""
    from loadopt.config import backend_settings
    from loadopt.loaders.registry import backend_class

    cls = backend_class(backend)
    if not cls.available()[0]:
        pytest.skip(f"{backend}: {cls.available()[1]}")
    (parsed,) = backend_settings(config.model_copy(update={"loaders": {backend: settings}}), backend)
    loader = cls(dataset, config.pipeline, parsed, seed=seed)
    loader.prepare()
    return loader


def epoch_inputs(loader) -> list[torch.Tensor]:
    """The inputs of one epoch of `loader` (copied out); the loader is closed after it."""
    try:
        return [x.clone() for x, _ in loader]
    finally:
        loader.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The shard cache's tests' server: 4 tar shards of 3 photos each and 2 Parquet files of the same 12, over
    HTTP, counting its requests (tests/cache_serving.py); yields (url, root)."""
    from .cache_serving import counting_server
    from .source_files import folder_samples, write_parquet, write_shards

    root = tmp_path_factory.mktemp("shard-cache")
    make_image_folder(root / "photos", classes=3, per_class=4)
    samples = folder_samples(root / "photos")
    write_shards(root / "shards", samples, per_shard=3)
    write_parquet(root / "hub", samples, ["c0", "c1", "c2"], rows_per_group=2)
    with counting_server(root) as url:
        yield url, root
