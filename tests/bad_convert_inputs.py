"""The bad inputs of `loadopt convert --engine ray` (rows of tests/test_bad_inputs.py's table): an engine of no
known kind, Ray's options without Ray, an address where no cluster answers (one line within seconds: Ray itself
retries such an address for many minutes), a damaged JPEG converted by Ray tasks (named as locally, nothing
partial left), and a raw conversion's local reference whose shards are on another remote home (storage.converted
changed since: moto's S3 server on loopback)."""

from __future__ import annotations

import importlib.util

import pytest

from .faults import Setup, free_port, images, temps, write_config


def unknown_engine(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    return Setup(["convert", str(config), "--to", "arrow", "--engine", "spark"],
                 "--engine spark: unknown (known: local, ray)", config=config, leftovers=temps(cache))


def ray_options_without_ray(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    return Setup(["convert", str(config), "--to", "arrow", "--num-cpus", "2"],
                 "--address and --num-cpus are for --engine ray", config=config, leftovers=temps(cache))


def ray_address_where_nothing_answers(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    address = f"127.0.0.1:{free_port()}"
    return Setup(["convert", str(config), "--to", "arrow", "--engine", "ray", "--address", address],
                 f"--address {address}: no Ray cluster answers there",  # asked before Ray is even imported
                 config=config, leftovers=temps(cache),
                 after=lambda: not list((cache / "arrow").rglob("*.arrow")) or pytest.fail("a conversion written"))


def damaged_jpeg_on_ray(tmp_path, cache):
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    root, bad = images(tmp_path)
    config = write_config(tmp_path, dataset={"path": str(root)})
    return Setup(["convert", str(config), "--to", "raw", "--decoded", "--engine", "ray", "--num-cpus", "1"],
                 f"{bad[0]}: damaged JPEG", config=config, leftovers=temps(cache), must_not_contain=["RayTaskError"],
                 after=lambda: not list((cache / "raw").rglob("manifest.json")) or pytest.fail("a partial conversion"))


def _reference_of_another_home(tmp_path, cache, monkeypatch, to: str, backend: str):
    """A conversion made for one remote home, then storage.converted changed to another: the local
    reference names shards that are not there. `bench --no-convert` says so in one line (a bench that may convert,
    and `loadopt convert`, make it again there: tests/test_remote_shards.py)."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[remote]')")
    from moto.server import ThreadedMotoServer

    from loadopt.config import load_config
    from loadopt.storage.forms import conversions
    from loadopt.storage.open import open_dataset

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                        "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    root, _ = images(tmp_path, corrupt=0)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = f"homes-{to}"  # moto keeps its buckets per process, across servers
    fs.mkdir(bucket)
    fs.put(f"{root}/", f"{bucket}/images/", recursive=True)
    tier = {"name": "moto", "base": f"s3://{bucket}/images",
            "storage_options": {"endpoint_url": endpoint, "key": "testing", "secret": "testing-secret"}}
    first = write_config(tmp_path, storage={"tier": tier, "converted": f"s3://{bucket}/first"},
                         loaders={backend: {"form": "decoded"}})
    config = load_config(str(first))
    form = conversions.converted_form(config.pipeline, "decoded", None, "auto", False, where="--size")
    conversions.convert(to, open_dataset(config), form, 256.0)
    moved = tmp_path / "moved.yaml"
    moved.write_text(first.read_text().replace(f"s3://{bucket}/first", f"s3://{bucket}/second"))
    return Setup(["bench", str(moved), "--no-convert"], f"whose shards are not at s3://{bucket}/second/{to}/",
                 config=moved, leftovers=temps(cache), close=server.stop)


def raw_reference_of_another_home(tmp_path, cache, monkeypatch):
    return _reference_of_another_home(tmp_path, cache, monkeypatch, "raw", "posix")


def arrow_reference_of_another_home(tmp_path, cache, monkeypatch):
    return _reference_of_another_home(tmp_path, cache, monkeypatch, "arrow", "arrow")


CONVERT_CASES = {  # name: (setup, exit code)
    "--engine of no known kind, convert": (unknown_engine, 2),
    "--num-cpus without --engine ray, convert": (ray_options_without_ray, 2),
    "--address where no Ray cluster answers, convert": (ray_address_where_nothing_answers, 2),
    "a damaged JPEG converted by Ray tasks, convert": (damaged_jpeg_on_ray, 1),
    "a raw reference whose shards are on another remote home, bench --no-convert": (raw_reference_of_another_home, 1),
    "an Arrow reference whose shards are on another remote home, bench --no-convert": (arrow_reference_of_another_home,
                                                                                     1),
}
