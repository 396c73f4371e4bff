"""Bad input and faults, one table: each case ends as one line naming the culprit, the exit code the
CLI promises, no traceback, and nothing partial left behind; the library (`make_loader`) raises a
`loadopt.errors` exception with the same line. Datasets are a dozen tiny JPEGs: the module stays fast.

Rows run in process through typer's runner; SIGTERM runs a real `loadopt bench` process.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.cli import app
from loadopt.errors import LoadoptError
from loadopt.storage import arrow_format, integrity

from .conftest import make_image_folder, tiny_config_dict


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Setup:
    """What a case prepared: the CLI arguments, the line expected (a substring), files that must not be
    left, and the backend for the library check (None: the CLI only)."""

    args: list[str]
    culprit: str
    config: Path | None = None
    leftovers: Callable[[], list[Path]] = lambda: []
    backend: str | None = None
    overrides: dict = field(default_factory=dict)  # make_loader keywords (the form the CLI converted)
    must_not_contain: list[str] = field(default_factory=list)
    after: Callable[[], None] = lambda: None  # more checks once the command ran


def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "results", **sections)))
    return path


def temps(folder: Path) -> Callable[[], list[Path]]:
    """Temporary files or folders of conversions and results left in `folder` (recursively)."""
    return lambda: [p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".tmp-" in p.name]


def said(result) -> str:
    """What a command printed, rich's line wrapping undone."""
    return " ".join(result.output.split())


def images(tmp_path: Path, corrupt: int = 1) -> tuple[Path, list[Path]]:
    root = tmp_path / "photos"
    return root, make_image_folder(root, classes=2, per_class=5, corrupt=corrupt)


# ---------------------------------------------------------------------------------------------
# The cases


def empty_config(tmp_path, cache):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    return Setup(["bench", str(path)], f"{path}: the config file is empty", config=path, backend="torch",
                 leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def corrupt_jpeg_decoded_arrow(tmp_path, cache):
    root, bad = images(tmp_path)
    config = write_config(tmp_path, dataset={"path": str(root)})
    return Setup(["convert", str(config), "--to", "arrow", "--decoded"], f"{bad[0]}: damaged JPEG",
                 config=config, backend="arrow", leftovers=temps(cache), must_not_contain=["BytesIO"],
                 after=lambda: not list((cache / "arrow").glob("*.arrow")) or pytest.fail("a partial conversion"))


def corrupt_jpeg_decoded_raw(tmp_path, cache):
    root, bad = images(tmp_path)
    config = write_config(tmp_path, dataset={"path": str(root)})
    return Setup(["convert", str(config), "--to", "raw", "--decoded"], f"{bad[0]}: damaged JPEG",
                 config=config, backend="posix", leftovers=temps(cache), must_not_contain=["BytesIO"])


def s3_without_credentials(tmp_path, cache):
    config = write_config(tmp_path, dataset={"path": "s3://loadopt-missing/images"})
    return Setup(["bench", str(config)], "s3://loadopt-missing/images: no credentials for s3://", config=config,
                 backend="torch", leftovers=temps(cache))


def s3_secret_in_the_url(tmp_path, cache):
    config = write_config(tmp_path, dataset={"path": "s3://AKIAEXAMPLE:wJalr/XUtnFEMI@bucket/images"})
    return Setup(["bench", str(config)], "s3://***@bucket/images: the host 127.0.0.1:", config=config, backend="torch",
                 must_not_contain=["wJalr", "XUtnFEMI", "AKIAEXAMPLE"])


def refused_connection(tmp_path, cache):
    port = free_port()  # nothing listens there
    config = write_config(tmp_path, dataset={"path": f"http://user:hunter2@127.0.0.1:{port}/images"})
    return Setup(["bench", str(config)], f"http://***@127.0.0.1:{port}/images: the host 127.0.0.1:{port} refused "
                 "the connection", config=config, backend="torch", must_not_contain=["hunter2", "not found"])


def no_space_converting(tmp_path, cache, monkeypatch):
    """The disk fills while the Arrow file is written (emulated: the writer's batches raise ENOSPC)."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    real = arrow_format._record_batches

    def fills_up(*args, **kwargs):
        yield from real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arrow_format, "_record_batches", fills_up)
    folder = cache / "arrow"
    return Setup(["convert", str(config), "--to", "arrow"], f"{folder}: no space left on device: the Arrow "
                 "conversion (encoded) needs about ", config=config, backend="arrow",
                 overrides={"form": "encoded"}, leftovers=lambda: temps(cache)() + list(folder.glob("*.arrow")))


def damaged_arrow_file(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    (path,) = (cache / "arrow").glob("*-encoded-*.arrow")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # inside the JPEG bytes: the record batch's body
    path.write_bytes(bytes(data))
    return Setup(["convert", str(config), "--to", "arrow", "--verify"], f"{path}: record batch 0 (samples 0-9), "
                 "chunk 0 of column jpeg (bytes 0-", config=config, backend="arrow", overrides={"form": "encoded"})


def damaged_raw_shard(tmp_path, cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "raw"]).exit_code == 0
    (shard,) = (cache / "raw").glob("*-encoded-*/shard-00000.bin")
    with open(shard, "r+b") as handle:
        handle.seek(5000)
        handle.write(bytes(100))
    return Setup(["convert", str(config), "--to", "raw", "--verify"], f"{shard}: chunk 0 (bytes 0-", config=config,
                 backend="posix", overrides={"form": "encoded"})


CASES = {  # name: (setup, exit code)
    "empty config file": (empty_config, 2),
    "corrupt JPEG, decoded Arrow conversion": (corrupt_jpeg_decoded_arrow, 1),
    "corrupt JPEG, decoded raw conversion": (corrupt_jpeg_decoded_raw, 1),
    "s3:// without credentials": (s3_without_credentials, 1),
    "s3://KEY:SECRET@ in the URL": (s3_secret_in_the_url, 1),
    "refused connection": (refused_connection, 1),
    "ENOSPC while converting": (no_space_converting, 1),
    "damaged Arrow file": (damaged_arrow_file, 1),
    "damaged raw shard": (damaged_raw_shard, 1),
}


@pytest.fixture
def s3_env(monkeypatch):
    """No AWS credentials anywhere, and an endpoint where nothing listens (nothing leaves the machine)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _forget_s3_instances()
    yield
    # fsspec caches filesystems by their arguments: one made here without credentials would otherwise be
    # handed to a later test that sets credentials in the environment.
    _forget_s3_instances()


def _forget_s3_instances() -> None:
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOADOPT_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, tmp_path, own_cache, s3_env, monkeypatch):
    make, code = CASES[case]
    setup = make(tmp_path, own_cache, monkeypatch) if "monkeypatch" in make.__code__.co_varnames else \
        make(tmp_path, own_cache)
    result = CliRunner().invoke(app, setup.args)
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == code, output
    assert result.exception is None or isinstance(result.exception, SystemExit), output  # no traceback
    assert "Traceback" not in output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr  # one line
    line = errors[0][len("error: "):]
    assert setup.culprit in line, line
    for secret in setup.must_not_contain:
        assert secret not in output
    assert setup.leftovers() == []
    setup.after()
    if setup.backend is not None:  # the library path: the same one line, as a loadopt.errors exception
        with pytest.raises(LoadoptError) as caught:
            loader = make_loader(setup.config, backend=setup.backend, **setup.overrides)
            loader.close()
        assert str(caught.value) == line or setup.culprit in str(caught.value), (str(caught.value), line)
        for secret in setup.must_not_contain:
            assert secret not in str(caught.value)
        assert setup.leftovers() == []
    print(f"{case} | exit {result.exit_code} | {errors[0]}")  # the table of the closing note (-s)


# ---------------------------------------------------------------------------------------------
# Cases that need more than one command, a signal or a real small disk


def test_on_error_skip_counts_files_with_a_reason_each_and_results_honour_the_umask(tmp_path, own_cache):
    """Two damaged files met in every epoch: two files, each with what was wrong; the result files get
    the umask's mode (0640 under umask 027), not mkstemp's 0600."""
    root, bad = images(tmp_path, corrupt=2)
    config = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"},
                          loaders={"torch": {"variant": "plain", "num_workers": 0}})
    previous = os.umask(0o027)
    try:
        result = CliRunner().invoke(app, ["bench", str(config), "--quick"])
    finally:
        os.umask(previous)
    assert result.exit_code == 0, result.output
    assert "2 unreadable file(s) skipped" in said(result) and "BytesIO" not in said(result)
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    skipped = results["runs"][0]["skipped_files"]
    assert sorted(s["path"] for s in skipped) == sorted(map(str, bad))
    assert all(s["reason"] and "BytesIO" not in s["reason"] and s["times"] >= 1 for s in skipped)
    for name in ("results.json", "timings.parquet", "report.html"):
        assert (tmp_path / "results" / name).stat().st_mode & 0o777 == 0o640, name


def test_a_decoded_conversion_records_skipped_files_and_every_run_reports_them(tmp_path, own_cache):
    root, bad = images(tmp_path, corrupt=1)
    config = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"})
    result = CliRunner().invoke(app, ["convert", str(config), "--to", "raw", "--decoded"])
    assert result.exit_code == 0, result.output
    assert "1 unreadable file(s) skipped" in said(result)
    for backend in ("posix", "arrow"):
        loader = make_loader(config, backend=backend, shuffle=False)
        try:
            delivered = sum(len(labels) for _, labels in loader)
        finally:
            loader.close()
        assert delivered == 10  # 11 files, one skipped
        assert [path for path, _ in loader.counters.skipped] == [str(bad[0])]
        assert "damaged JPEG" in loader.counters.skipped[0][1]


def test_a_file_replaced_by_bytes_of_the_same_size(tmp_path, own_cache):
    """A new modification time makes a new dataset; the old time kept, `convert --verify` finds the new
    content and converts again."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    runner = CliRunner()
    assert runner.invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    victim = sorted((root / "train" / "c1").glob("*.jpg"))[0]
    stat = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-100:-2] = bytes(98)  # other bytes, same size
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a copy that kept the time (cp -p, rsync -t)
    reused = runner.invoke(app, ["convert", str(config), "--to", "arrow"])
    assert "reused" in said(reused)  # names, sizes and times match: only the content can tell
    verified = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--verify"])
    assert verified.exit_code == 0 and "converted in" in said(verified), verified.output
    again = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--verify"])
    assert "reused: converted earlier, every chunk verified, source unchanged" in said(again)
    victim.touch()  # a new time: another dataset, another conversion
    fresh = runner.invoke(app, ["convert", str(config), "--to", "arrow"])
    assert fresh.exit_code == 0 and "converted in" in said(fresh)
    assert len(list((own_cache / "arrow").glob("*.arrow"))) == 2


def test_force_rebuilds_a_damaged_conversion(tmp_path, own_cache):
    setup = damaged_arrow_file(tmp_path, own_cache)
    runner = CliRunner()
    assert runner.invoke(app, setup.args).exit_code == 1
    forced = runner.invoke(app, ["convert", str(setup.config), "--to", "arrow", "--force"])
    assert forced.exit_code == 0 and "converted in" in said(forced)
    verified = runner.invoke(app, ["convert", str(setup.config), "--to", "arrow", "--verify"])
    assert verified.exit_code == 0, verified.output


def test_temps_of_a_killed_conversion_are_removed_at_the_next_start(tmp_path, own_cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    folder = own_cache / "arrow"
    folder.mkdir(parents=True)
    host = socket.gethostname()
    killed = folder / f".x-encoded-0.arrow.{host}.{dead.pid}.abcd1234.tmp"
    killed.write_bytes(bytes(1000))
    alive = folder / f".x-encoded-0.arrow.{host}.{os.getpid()}.abcd1234.tmp"  # a conversion still running
    alive.write_bytes(bytes(10))
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    assert not killed.exists() and alive.exists()


def test_sigterm_mid_bench_keeps_the_finished_runs(tmp_path, own_cache):
    """Slurm/Kubernetes/`timeout`: the finished run kept, `interrupted: true`, exit 143, no worker left."""
    psutil = pytest.importorskip("psutil")
    config = write_config(tmp_path, workload={"step_time_ms": 30, "warmup_batches": 1, "measure_batches": 25,
                                              "repeats": 1},
                          loaders={"torch": {"variant": "plain", "num_workers": [1, 2]}})
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = {**os.environ, "COLUMNS": "200"}
    log = tmp_path / "bench.log"
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "loadopt.cli", "bench", str(config)], stdout=out,
                                 stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 240
        while time.time() < deadline and "samples/s, stall" not in log.read_text() and child.poll() is None:
            time.sleep(0.1)
        assert child.poll() is None, log.read_text()  # still running: the second setting is under way
        workers = psutil.Process(child.pid).children(recursive=True)
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=120)
    text = log.read_text()
    assert code == 143, text
    assert "Traceback" not in text and "interrupted (SIGTERM): the results of the runs that finished were kept" in text
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["interrupted"] is True and results["interrupted_by"] == "SIGTERM"
    assert [r["status"] for r in results["runs"]][0] == "ok"
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in shm_after - shm_before if "torch" in name or "loadopt" in name}


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (root only): a real full disk."""
    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_real_full_disk_while_converting_and_generating(tmp_path, small_disk, monkeypatch):
    monkeypatch.setenv("LOADOPT_CACHE", str(small_disk))
    config = write_config(tmp_path, dataset={"synthetic": {"num_samples": 400, "num_classes": 4, "mean_width": 96,
                                                           "mean_height": 80}})
    generated = CliRunner().invoke(app, ["make-dataset", str(config)])
    assert generated.exit_code == 1, generated.output
    assert f"error: {small_disk / 'datasets'}: no space left on device: the synthetic dataset needs about" in \
        generated.stderr
    assert not [p for p in small_disk.rglob("*") if ".tmp" in p.name]
    root, _ = images(tmp_path, corrupt=0)  # on the big disk; its conversion is bigger than the small one
    big = tmp_path / "big"
    for k in range(40):
        shutil.copytree(root / "train" / "c0", big / "train" / f"c{k}")
    config = write_config(tmp_path, dataset={"path": str(big)})
    converted = CliRunner().invoke(app, ["convert", str(config), "--to", "raw", "--decoded"])
    assert converted.exit_code == 1, converted.output
    assert f"error: {small_disk / 'raw'}: no space left on device: the raw conversion (frames) needs up to" in \
        converted.stderr
    assert not [p for p in small_disk.rglob("*") if p.is_file()]


def test_damage_met_while_reading_blames_the_converted_file_not_the_source(tmp_path, own_cache, monkeypatch):
    """A JPEG inside the encoded Arrow file damaged, and the cheap sample at open missing it: the decode
    failure is checked against the record batch's checksums and the Arrow file is named, not the intact
    source JPEG."""
    from loadopt.errors import DatasetError

    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    (path,) = (own_cache / "arrow").glob("*-encoded-*.arrow")
    data = bytearray(path.read_bytes())
    start = data.find(b"\xff\xd8\xff")  # the first sample's JPEG header
    data[start:start + 4] = bytes(4)
    path.write_bytes(bytes(data))
    monkeypatch.setattr(integrity, "SAMPLE_CHUNKS", 0)  # the sample at open checks nothing
    loader = make_loader(config, backend="arrow", form="encoded")
    try:
        with pytest.raises(DatasetError) as caught:
            for _ in loader:
                pass
    finally:
        loader.close()
    message = str(caught.value)
    assert message.startswith(f"{path}: record batch 0") and "checksum mismatch" in message, message
    assert str(root) not in message
