"""`loadopt probe`: the read patterns on small temp files, through an emulated tier, and the CLI."""

import json
import time

import numpy as np
import pytest

from loadopt.errors import ConfigError, DatasetError
from loadopt.storage.tiers.probe import parse_size, probe
from loadopt.storage.tiers.spec import TierSpec
from loadopt.storage.tiers.stack import tier_filesystem

from .test_cli import loadopt, one_line_error

FAST = {"duration_s": 0.2, "seq_bytes": 1 << 20}


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes())
    return path


def test_file_patterns(data_file):
    result = probe(str(data_file), block_sizes=(4096, 65536), concurrencies=(1, 4), **FAST)
    kinds = [(p["pattern"], p["block_bytes"], p["concurrency"]) for p in result["patterns"]]
    assert kinds == [("sequential", 1 << 20, 1), ("random", 4096, 1), ("random", 4096, 4), ("random", 65536, 1),
                     ("random", 65536, 4)]
    assert result["local"] and result["cold"] and result["files"] == 1 and result["total_bytes"] == 4 << 20
    sequential = result["patterns"][0]
    assert sequential["bytes"] == 1 << 20 and sequential["requests"] == 1  # the --seq budget, 1 MiB chunks
    for p in result["patterns"][1:]:
        assert p["requests"] > 0 and p["bytes"] == p["requests"] * p["block_bytes"]
        assert p["iops"] == pytest.approx(p["requests"] / p["seconds"])
        assert p["mb_per_s"] == pytest.approx(p["bytes"] / p["seconds"] / 1e6)
        assert 0 < p["lat_p50_ms"] <= p["lat_p99_ms"]


def test_request_budget_and_forked_readers(data_file):
    # 16 readers of a local file are spread over forked processes; the request budget holds across them
    result = probe(str(data_file), block_sizes=(4096,), concurrencies=(1, 16), max_requests=32, duration_s=5.0,
                   seq_bytes=1 << 20)
    random_reads = [p for p in result["patterns"] if p["pattern"] == "random"]
    assert [p["requests"] for p in random_reads] == [32, 32]
    assert all(p["seconds"] < 5.0 for p in random_reads)  # the budget, not the duration, ended them


def test_folder_small_files_and_whole_file_reads(tmp_path):
    folder = tmp_path / "samples"
    folder.mkdir()
    for i in range(20):
        (folder / f"{i}.jpg").write_bytes(bytes([i]) * 1000)
    result = probe(str(folder), block_sizes=(512, 4096), concurrencies=(2,), **FAST)
    by_kind = {(p["pattern"], p["block_bytes"] if p["pattern"] == "random" else None): p for p in result["patterns"]}
    assert "skipped" not in by_kind[("random", 512)]
    assert "no file holds 4 KiB" in by_kind[("random", 4096)]["skipped"]
    files = by_kind[("files", None)]
    assert files["requests"] > 0 and files["block_bytes"] == 1000  # whole files of 1000 bytes
    assert result["files"] == 20 and not result["test_file_written"]


def test_test_file_is_written_and_removed(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "keep.txt").write_text("x")
    result = probe(str(folder), file_size=2 << 20, block_sizes=(65536,), concurrencies=(1,), **FAST)
    assert result["test_file_written"] and result["total_bytes"] == 2 << 20 and result["files"] == 1
    assert [p.name for p in folder.iterdir()] == ["keep.txt"]


def test_emulated_tier_latency_and_concurrency(data_file):
    fs = tier_filesystem(TierSpec(name="slow", latency_ms=20.0), __import__("fsspec").filesystem("file"))
    result = probe(str(data_file), fs=fs, block_sizes=(4096,), concurrencies=(1, 4), duration_s=0.5,
                   seq_bytes=1 << 20)
    assert not result["local"] and not result["cold"]
    one, four = [p for p in result["patterns"] if p["pattern"] == "random"]
    assert 20.0 <= one["lat_p50_ms"] < 35.0
    assert 3.0 <= four["iops"] / one["iops"] <= 4.5  # no concurrency cap: four in flight, four times the IOPS


def test_missing_location_is_a_user_error(tmp_path):
    with pytest.raises(DatasetError, match="nope: not found"):
        probe(str(tmp_path / "nope"), **FAST)


def test_parse_size():
    assert [parse_size(s) for s in ("4k", "128KiB", "1m", "2G", "4096")] == [4096, 131072, 1 << 20, 2 << 30, 4096]
    with pytest.raises(ConfigError, match="expected a positive size"):
        parse_size("lots")


def test_cli_probe_table_and_json(data_file, tmp_path):
    proc = loadopt("probe", data_file, "--duration", "0.2", "--blocks", "4k", "--concurrency", "1,2", "--seq", "1m",
                   "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "loadopt probe" in proc.stdout and "sequential" in proc.stdout and "4 KiB" in proc.stdout
    result = json.loads((tmp_path / "out" / "probe.json").read_text())
    assert [p["concurrency"] for p in result["patterns"]] == [1, 1, 2]


def test_cli_probe_errors(tmp_path):
    line = one_line_error(loadopt("probe", tmp_path / "absent", "--out", tmp_path / "out"))
    assert line == f"error: {tmp_path / 'absent'}: not found"
    line = one_line_error(loadopt("probe", tmp_path, "--blocks", "huge", "--out", tmp_path / "out"), code=2)
    assert "--blocks 'huge': expected a positive size" in line
    line = one_line_error(loadopt("probe", tmp_path, "--tier", "nonesuch", "--out", tmp_path / "out"), code=2)
    assert "unknown tier 'nonesuch'" in line


def test_reader_keeps_few_files_open(tmp_path):
    # a folder of thousands of samples read by 64 readers must not run out of file descriptors
    from loadopt.storage.tiers import probe_readers

    files = []
    for i in range(3 * probe_readers._OPEN_FILES):
        path = tmp_path / f"{i}.bin"
        path.write_bytes(b"x" * 8192)
        files.append(probe_readers.File(str(path), 8192))
    reader = probe_readers.Reader(None, local=True, direct=False, max_length=8192)
    try:
        assert sum(reader.read(f, 0, 8192) for f in files) == 8192 * len(files)
        assert len(reader._fds) == probe_readers._OPEN_FILES
    finally:
        reader.close()


@pytest.mark.parametrize("in_c", [True, False])
def test_random_reads_in_c_and_in_python_count_the_same(data_file, monkeypatch, in_c):
    from loadopt.storage.tiers import probe_readers

    if in_c and probe_readers.native is None:
        pytest.skip("loadopt.storage._preads is not compiled here (setup.py builds it)")
    if not in_c:
        monkeypatch.setattr(probe_readers, "native", None)
    result = probe(str(data_file), block_sizes=(4096, 65536), concurrencies=(1, 16), sequential=False, **FAST)
    for p in result["patterns"]:
        assert p["requests"] > 0 and p["bytes"] == p["requests"] * p["block_bytes"]
        assert p["seconds"] == pytest.approx(FAST["duration_s"], rel=0.5)
    budget = probe(str(data_file), block_sizes=(4096,), concurrencies=(4,), max_requests=40, duration_s=5.0,
                   sequential=False)["patterns"][0]
    assert budget["requests"] == 40


def test_a_reader_slow_to_start_does_not_shorten_the_others(data_file, monkeypatch):
    """The clock starts once every reader is ready: one slow to open (a fork under load) costs no time."""
    from loadopt.storage.tiers import probe_readers

    made = []
    original = probe_readers.Reader.__init__

    def slow_first(self, *args, **kwargs):
        made.append(1)
        if len(made) == 1:
            time.sleep(0.5)
        original(self, *args, **kwargs)

    monkeypatch.setattr(probe_readers.Reader, "__init__", slow_first)
    pattern = probe(str(data_file), block_sizes=(4096,), concurrencies=(4,), duration_s=0.3,
                    sequential=False)["patterns"][0]
    assert pattern["seconds"] == pytest.approx(0.3, rel=0.5)  # not 0.8: the wait for the slow one is not counted
    assert pattern["requests"] > 4  # every reader read through the whole duration, not one read after the end
