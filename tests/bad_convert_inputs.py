"""The bad inputs of `loadopt convert --engine ray` (rows of tests/test_bad_inputs.py's table): an engine of no
known kind, Ray's options without Ray, an address where no cluster answers (one line within seconds: Ray itself
retries such an address for many minutes), and a damaged JPEG converted by Ray tasks (named as locally, nothing
partial left)."""

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


CONVERT_CASES = {  # name: (setup, exit code)
    "--engine of no known kind, convert": (unknown_engine, 2),
    "--num-cpus without --engine ray, convert": (ray_options_without_ray, 2),
    "--address where no Ray cluster answers, convert": (ray_address_where_nothing_answers, 2),
    "a damaged JPEG converted by Ray tasks, convert": (damaged_jpeg_on_ray, 1),
}
