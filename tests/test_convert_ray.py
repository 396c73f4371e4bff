"""`loadopt convert --engine ray` on a real Ray of 2 CPUs on this machine (storage/forms/ray_engine.py): the shards,
their checksums and the manifest are byte for byte those of `--engine local`, a damaged sample is named as
locally (counted and named in the manifest under `on_error: skip`), a conversion stopped part way is finished
on Ray writing only the shards that are missing, and a Ray worker killed mid-shard is retried into the same
output. The two-node cluster with a node killed: tests/test_convert_ray_cluster.py."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from loadopt.config import config_from_dict
from loadopt.errors import DatasetError
from loadopt.storage.forms import arrow_convert, arrow_format, conversions, raw_format, ray_engine, shard_work
from loadopt.storage.forms.conversions import ConvertedForm
from loadopt.storage.forms.engine import ConvertEngine
from loadopt.storage.open import open_dataset

from .cache_serving import cache_config
from .conftest import make_image_folder, tiny_config_dict
from .source_files import folder_samples, write_shards
from .test_sources import _config as source_config

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

RAY = ConvertEngine("ray")
DECODED = ConvertedForm("decoded", "centre", "decoded", 40)
ENCODED = ConvertedForm("encoded", "centre", "encoded", None)


@pytest.fixture
def ray_here():
    """Each conversion on Ray starts its own (2 CPUs, this machine's) and stops it, as the command does; none is
    left running whatever the test did."""
    yield
    if ray.is_initialized():
        ray.shutdown()


def folder_dataset(tmp_path: Path, on_error: str = "skip", corrupt: int = 1):
    make_image_folder(tmp_path / "photos", classes=3, per_class=12, corrupt=corrupt)
    raw = tiny_config_dict(tmp_path / "out", dataset={"path": str(tmp_path / "photos"), "on_error": on_error},
                           pipeline={"augment": "eval", "image_size": 36})
    return open_dataset(config_from_dict(raw, "ray.yaml"))


def file_digests(folder: Path) -> dict[str, str]:
    """Every file of a conversion (the manifest too) by name: its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def data_digests(conversion: Path) -> dict[str, str]:
    """`file_digests` of the shards and their indexes only: the entries of an incremental conversion also name
    where each kept shard came from."""
    return {name: digest for name, digest in file_digests(conversion).items() if not name.endswith(".json")}


@pytest.mark.parametrize(("to", "form"), [("raw", DECODED), ("arrow", DECODED), ("arrow", ENCODED)])
def test_ray_writes_the_same_shards_checksums_and_manifest_as_local(ray_here, own_cache, tmp_path, to, form):
    dataset = folder_dataset(tmp_path)
    local = conversions.convert(to, dataset, form, 0.02, on_error="skip")
    expected = file_digests(local.path)
    on_ray = conversions.convert(to, dataset, form, 0.02, on_error="skip", force=True, engine=RAY)
    assert on_ray.path == local.path and not on_ray.reused
    assert on_ray.shards == local.shards > 3
    assert file_digests(on_ray.path) == expected
    meta = shard_work.read_manifest(on_ray.path, to)
    bad = [str(p) for p in (tmp_path / "photos").rglob("corrupt*.jpg")]
    if form.stored == "decoded":  # the damaged file: counted and named in the manifest, as locally
        assert on_ray.skipped == 1 and [dataset.paths[int(i)].decode() for i, _ in meta["skipped"]] == bad


def test_a_damaged_sample_on_ray_is_one_error_naming_it(ray_here, own_cache, tmp_path, monkeypatch):
    dataset = folder_dataset(tmp_path, on_error="raise")
    bad = next((tmp_path / "photos").rglob("corrupt*.jpg"))
    cancelled: list = []  # Ray 2.60's driver can abort (exit 1, no traceback) on a cancel racing a completion
    monkeypatch.setattr(ray, "cancel", lambda *args, **kwargs: cancelled.append(args))
    with pytest.raises(DatasetError, match=str(bad)) as raised:
        conversions.convert("raw", dataset, DECODED, 0.02, on_error="raise", engine=RAY)
    assert "\n" not in str(raised.value) and "Traceback" not in str(raised.value), raised.value
    assert not raw_format.raw_path(dataset, "decoded", 40, 0.02).exists()  # no conversion, no manifest
    assert not cancelled


def test_ray_holds_only_a_few_tasks_in_flight_and_still_writes_every_shard(ray_here, own_cache, tmp_path,
                                                                          monkeypatch):
    """Submitted a few at a time (what an error leaves under way), the shards are those of the local engine."""
    dataset = folder_dataset(tmp_path, corrupt=0)
    expected = file_digests(conversions.convert("raw", dataset, DECODED, 0.02).path)
    waited_on, real_wait = [], ray.wait

    def wait(refs, **kwargs):
        waited_on.append(len(refs))
        return real_wait(refs, **kwargs)

    monkeypatch.setattr(ray_engine, "in_flight", lambda ray: 2)
    monkeypatch.setattr(ray, "wait", wait)
    on_ray = conversions.convert("raw", dataset, DECODED, 0.02, force=True, engine=RAY)
    assert on_ray.shards > 4 and file_digests(on_ray.path) == expected
    assert max(waited_on) == 2, waited_on


def test_a_stopped_conversion_finished_on_ray_writes_only_the_missing_shards(ray_here, own_cache, tmp_path,
                                                                             monkeypatch):
    dataset = folder_dataset(tmp_path, corrupt=0)
    real, made = arrow_convert.record_batches, [0]

    def dies(*args):
        for batch in real(*args):
            made[0] += 1
            if made[0] == 5:  # a record batch a shard (4 samples of 4,800 bytes): 4 shards finished
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(arrow_convert, "record_batches", dies)
    with pytest.raises(KeyboardInterrupt):
        arrow_convert.convert(dataset, "decoded", 40, 0.02, workers=1)
    monkeypatch.setattr(arrow_convert, "record_batches", real)
    final = arrow_format.arrow_path(dataset, "decoded", 40, 0.02)
    work = shard_work.work_folder(final)
    kept = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in work.glob("shard-*.arrow")}
    assert kept and not final.exists()
    arrow_convert.convert(dataset, "decoded", 40, 0.02, engine=RAY)
    table = shard_work.read_manifest(final, "arrow")["shard_table"]
    assert len(table) > len(kept)
    for name, (inode, mtime) in kept.items():  # the finished shards were not written again
        assert ((final / name).stat().st_ino, (final / name).stat().st_mtime_ns) == (inode, mtime)
    written = file_digests(final)
    arrow_convert.convert(dataset, "decoded", 40, 0.02, workers=1, force=True)  # from scratch, locally
    assert file_digests(final) == written


def test_a_changed_tar_shard_reconverted_on_ray_keeps_the_other_shards(ray_here, own_cache, tmp_path):
    """Converted locally, then one tar rewritten: the conversion on Ray keeps every shard of the unchanged tars
    (linked from the earlier conversion), writes the changed tar's, and holds what a conversion from scratch
    holds, byte for byte."""
    make_image_folder(tmp_path / "folder", classes=3, per_class=16)
    samples = folder_samples(tmp_path / "folder")
    write_shards(tmp_path / "shards" / "train", samples, per_shard=8)
    config = source_config(tmp_path, str(tmp_path / "shards"))
    first = conversions.convert("raw", open_dataset(config), DECODED, 0.03)
    changed = [(samples[16][0], samples[16][1], samples[0][2])] + samples[17:24]  # tar 2: one image replaced
    write_shards(tmp_path / "new", changed, per_shard=8)
    os.replace(tmp_path / "new" / "train-000000.tar", tmp_path / "shards" / "train" / "train-000002.tar")
    after = open_dataset(config)
    on_ray = conversions.convert("raw", after, DECODED, 0.03, engine=RAY)
    assert on_ray.path != first.path and on_ray.shards == first.shards and on_ray.kept == first.shards - 2
    written = data_digests(on_ray.path)
    scratch = conversions.convert("raw", after, DECODED, 0.03, force=True)  # locally, from nothing
    assert data_digests(scratch.path) == written


def test_a_task_on_a_node_that_cannot_see_the_conversions_folder_names_the_node(tmp_path):
    """What a Ray task does on a node where the work folder is not (no shared filesystem): one line naming the
    folder and the node, nothing written."""
    from loadopt.storage.forms.ray_engine import write_shard_task

    def never(*args):
        raise AssertionError("a shard written where the conversion's folder is not")

    with pytest.raises(DatasetError, match=f"{tmp_path / 'elsewhere'}: the conversion's folder is not there on Ray "
                                           f"node {socket.gethostname()}") as raised:
        write_shard_task(never, str(tmp_path / "elsewhere"), shard_work.ShardJob(0, 0, 4))
    assert "\n" not in str(raised.value) and not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("limit", [None, "10MB"], ids=["direct", "shard-cache"])
@pytest.mark.parametrize("form", ["shards", "hub"], ids=["tar", "parquet"])
def test_ray_tasks_read_a_remote_source_through_its_tier(ray_here, own_cache, served, form, limit):
    """Tar shards and Parquet files over HTTP, read by the Ray tasks through the dataset's filesystem (directly, or
    through the bounded shard cache): the same files as the local engine's conversion of the same URL."""
    url, _ = served
    dataset = open_dataset(cache_config(f"{url}/{form}", limit))
    local = conversions.convert("raw", dataset, DECODED, 0.02)
    expected = file_digests(local.path)
    on_ray = conversions.convert("raw", dataset, DECODED, 0.02, force=True, engine=RAY)
    assert on_ray.path == local.path and on_ray.shards == local.shards > 1 and on_ray.samples == 12
    assert file_digests(on_ray.path) == expected


def test_sigterm_mid_conversion_on_ray_stops_cleanly_and_the_rerun_resumes(tmp_path, own_cache):
    """`loadopt convert --engine ray` stopped by SIGTERM: Ray's own handler (exit code 15, a stack dump, an abort
    3 s later) is not the one that answers. One line, exit 143, the Ray it started gone, and the rerun finishes."""
    import signal
    import subprocess
    import sys
    import time

    import psutil
    import yaml

    raw = tiny_config_dict(tmp_path / "out", dataset={"synthetic": {"num_samples": 600, "num_classes": 4,
                                                                    "mean_width": 96, "mean_height": 80}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    dataset = open_dataset(config_from_dict(raw, str(path)))  # generated before the conversion starts
    command = [sys.executable, "-m", "loadopt.cli", "convert", str(path), "--to", "raw", "--decoded", "--frame",
               "centre", "--size", "56", "--shard-mib", "0.05", "--engine", "ray", "--num-cpus", "2"]
    final = raw_format.raw_path(dataset, "decoded", 56, 0.05)
    work = shard_work.work_folder(final)
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started, deadline = set(), time.time() + 120
    while time.time() < deadline and len(list(work.glob("shard-*.json"))) < 3 and child.poll() is None:
        started |= {p.pid for p in psutil.Process(child.pid).children(recursive=True)}
        time.sleep(0.02)
    assert child.poll() is None, child.stdout.read() if child.stdout else ""
    child.send_signal(signal.SIGTERM)
    output, _ = child.communicate(timeout=60)
    assert child.returncode == 143, output
    assert "Traceback" not in output and "SIGTERM received" not in output, output
    assert output.strip().splitlines()[-1].startswith("interrupted (SIGTERM) before the conversion finished")
    assert started and not final.exists()
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in started if psutil.pid_exists(pid)], timeout=20)
    assert not alive, [p.cmdline()[:2] for p in alive]  # the Ray this conversion started went with it
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    raw_format.open_raw(final, dataset, "decoded", 56, 0.05, verify_labels=True, verify="all")
