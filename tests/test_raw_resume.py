"""The raw conversion stopped part way and run again (Ctrl-C, SIGTERM through the CLI), and converted by two
processes at once: finished shards kept, the rest converted, one conversion."""

import os
from pathlib import Path

import pytest

from loadopt.config import config_from_dict
from loadopt.storage.forms import raw_convert, raw_format, shard_work
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict
from .test_raw import SMALL, config


def test_an_interrupted_conversion_resumes_from_its_finished_shards(tmp_path, monkeypatch, own_cache):
    """Stopped part way, nothing is used (no manifest, no conversion folder); run again, it keeps the shards it
    finished and converts only the samples after them, into the same bytes as a conversion from scratch."""
    cfg = config(tmp_path, image_size=36)
    dataset = open_dataset(cfg)
    real = raw_convert.samples
    asked: list[int] = []
    made = [0]  # samples made, over every shard

    def dies(*args):
        for blob in real(*args):
            made[0] += 1
            if made[0] == 21:
                raise KeyboardInterrupt
            yield blob

    def counted(*args):
        asked.append(args[-2])  # the first sample converted (then the end)
        yield from real(*args)

    monkeypatch.setattr(raw_convert, "samples", dies)
    with pytest.raises(KeyboardInterrupt):
        raw_convert.convert(dataset, "decoded", 41, shard_mib=SMALL, workers=1)
    final = raw_format.raw_path(dataset, "decoded", 41, SMALL)
    work = shard_work.work_folder(final)
    finished = sorted(work.glob("shard-*.json"))
    assert not final.exists() and finished and not (work / raw_format.MANIFEST).exists()
    assert not list(work.glob(".*.tmp"))  # the shard being written was abandoned
    monkeypatch.setattr(raw_convert, "samples", counted)
    assert raw_convert.convert(dataset, "decoded", 41, shard_mib=SMALL, workers=1) == final
    resumed_at = asked[0]
    firsts = raw_format.RawIndex(final, [], raw_format.read_manifest(final)).firsts
    assert 0 < resumed_at <= 20 and resumed_at == firsts[len(finished)]
    table = raw_format.read_manifest(final)["shard_table"]
    assert asked == [e["first"] for e in table[len(finished):]]  # each shard not finished converted once, alone
    assert not work.exists()
    raw = raw_format.open_raw(final, dataset, "decoded", 41, SMALL, verify_labels=True, verify="all")
    assert raw.meta["shape"] == [41, 41, 3] and (raw.length == 41 * 41 * 3).all()
    fresh = raw_convert.convert(dataset, "decoded", 41, shard_mib=SMALL, workers=1, force=True)
    assert [e["checksums"] for e in raw_format.read_manifest(fresh)["shard_table"]] == \
        [e["checksums"] for e in raw.meta["shard_table"]]


def _convert_in_child(cache: str, root: str, out: str) -> None:
    os.environ["LOADOPT_CACHE"] = cache
    from loadopt.config import load_config

    dataset = open_dataset(load_config(root))
    Path(out).write_text(str(raw_convert.convert(dataset, "decoded", 41, shard_mib=SMALL, workers=2)))


def test_two_processes_converting_at_once_make_one_conversion(tmp_path, own_cache):
    """The second waits on the work folder's lock and finds the first's conversion (even though the decode pools'
    forked workers hold the lock file open)."""
    import multiprocessing

    import yaml

    cfg = config(tmp_path, image_size=36)
    open_dataset(cfg)  # the synthetic set generated before the race
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    context = multiprocessing.get_context("spawn")  # not a Pool: its daemonic workers could not fork decoders
    children = [context.Process(target=_convert_in_child, args=(os.environ["LOADOPT_CACHE"], str(path),
                                                                 str(tmp_path / f"out{k}"))) for k in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    folders = [(tmp_path / f"out{k}").read_text() for k in range(2)]
    assert folders[0] == folders[1]
    raw_format.open_raw(folders[0], open_dataset(cfg), "decoded", 41, SMALL, verify_labels=True, verify="all")
    assert not shard_work.work_folder(Path(folders[0])).exists()


def test_sigterm_mid_conversion_keeps_the_finished_shards_and_the_rerun_resumes(tmp_path, own_cache):
    """`loadopt convert` stopped by SIGTERM (a scheduler's time limit) exits without a traceback, leaving its
    finished shards; run again, it keeps them (their files untouched) and finishes the conversion."""
    import signal
    import subprocess
    import sys
    import time

    import yaml

    raw = tiny_config_dict(tmp_path / "out", dataset={"synthetic": {"num_samples": 600, "num_classes": 4,
                                                                    "mean_width": 96, "mean_height": 80}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = config_from_dict(raw, str(path))
    dataset = open_dataset(cfg)  # generated before the conversion starts
    command = [sys.executable, "-m", "loadopt.cli", "convert", str(path), "--to", "raw", "--decoded", "--frame",
               "centre", "--size", "56", "--shard-mib", "0.05"]
    work = shard_work.work_folder(raw_format.raw_path(dataset, "decoded", 56, 0.05))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(work.glob("shard-*.json"))) < 3 and child.poll() is None:
        time.sleep(0.02)
    assert child.poll() is None, child.stdout.read() if child.stdout else ""
    child.send_signal(signal.SIGTERM)
    output, _ = child.communicate(timeout=60)
    assert child.returncode == 143 and "Traceback" not in output, output
    assert output.strip().splitlines()[-1].startswith("interrupted (SIGTERM) before the conversion finished")
    kept = {p.name: p.stat().st_mtime_ns for p in work.glob("shard-*.bin")}
    assert len(kept) >= 3 and not (work / raw_format.MANIFEST).exists()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    final = raw_format.raw_path(dataset, "decoded", 56, 0.05)
    for name, mtime in kept.items():
        if (final / name.replace(".bin", ".json")).exists() and name != max(kept):  # the last may be redone
            assert (final / name).stat().st_mtime_ns == mtime, name
    raw_format.open_raw(final, dataset, "decoded", 56, 0.05, verify_labels=True, verify="all")
