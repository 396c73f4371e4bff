"""Faults beside the one-line table of test_bad_inputs.py: files skipped by `on_error: skip`, caches that
cannot lie (same-size replacements, damaged conversions, killed temporaries), SIGTERM mid-bench, a real full
disk, damage met while reading. DALI's faults and a remote server's have files of their own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.cli import app
from loadopt.storage.forms import integrity

from .faults import images, said, write_config
from .test_bad_inputs import damaged_arrow_file  # the table's damaged-conversion case, rebuilt here


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
    """The old time kept, `convert --verify` finds the new content and converts again. A touched file is missed
    while the folders' listing is reused (their mtimes unchanged: the documented miss); `--relist` and `--verify`
    stat every file again and make it a new dataset, a new conversion."""
    root, _ = images(tmp_path, corrupt=0)
    folders = [root / "train", *(root / "train").iterdir()]
    for folder in folders:  # changed long ago: the listing is saved whatever the machine's speed
        os.utime(folder, (folder.stat().st_atime - 3600, folder.stat().st_mtime - 3600))
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
    victim.touch()  # a new time, the folders' times unchanged: the saved listing holds
    missed = runner.invoke(app, ["convert", str(config), "--to", "arrow"])
    assert missed.exit_code == 0 and "reused: converted earlier" in said(missed), missed.output
    relisted = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--relist"])
    assert relisted.exit_code == 0 and "converted in" in said(relisted), relisted.output  # another dataset
    assert len(list((own_cache / "arrow").glob("*/manifest.json"))) == 2
    victim.touch()
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    verified = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--verify"])
    assert verified.exit_code == 0 and "converted in" in said(verified), verified.output  # --verify relists too
    assert len(list((own_cache / "arrow").glob("*/manifest.json"))) == 3


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


def bench_stopped_by_sigterm(config, log, after: str, before_signal=lambda pid: None) -> tuple[int, str]:
    """`loadopt bench CONFIG` in a real process, sent SIGTERM once `after` is in its output (it must still be
    running then): its exit code and output."""
    with open(log, "w") as out:
        child = subprocess.Popen([sys.executable, "-m", "loadopt.cli", "bench", str(config)], stdout=out,
                                 stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
        deadline = time.time() + 240
        while time.time() < deadline and after not in log.read_text() and child.poll() is None:
            time.sleep(0.1)
        assert child.poll() is None, log.read_text()
        before_signal(child.pid)
        child.send_signal(signal.SIGTERM)
        code = child.wait(timeout=120)
    return code, log.read_text()


HANDOVER_CUT = """
import os, sys, time
from multiprocessing import resource_sharer
from loadopt.loaders.torch_dl.workers import quiet_when_the_consumer_left
if sys.argv[1] == "worker":
    quiet_when_the_consumer_left(0)
for _ in range(5):
    read_end, _ = os.pipe()
    handover = resource_sharer.DupFd(read_end)  # what a torch worker makes for each batch's shared memory
    # the consumer asks for the descriptor and is stopped before it reads it (stdlib internals: no public door)
    resource_sharer._resource_sharer.get_connection(handover._id).close()
time.sleep(0.5)
try:
    raise ValueError("a worker's own fault")
except ValueError:
    sys.excepthook(*sys.exc_info())
"""


@pytest.mark.parametrize("process", ["plain", "worker"])
def test_a_batch_handover_cut_by_the_stop_prints_no_worker_traceback(process):
    """A torch worker's handover of a batch cut by SIGTERM printed the worker's BrokenPipeError traceback under
    the bench's one-line account of the stop (seen in CI); the worker hook drops that error and no other."""
    text = subprocess.run([sys.executable, "-c", HANDOVER_CUT, process], capture_output=True, text=True,
                          timeout=60).stderr
    assert "ValueError: a worker's own fault" in text, text
    if process == "plain":  # the cut is real: without the hook its tracebacks are printed
        assert "BrokenPipeError" in text or "ConnectionResetError" in text, text
    else:
        assert "BrokenPipeError" not in text and "ConnectionResetError" not in text, text


def test_sigterm_mid_bench_keeps_the_finished_runs(tmp_path, own_cache):
    """Slurm/Kubernetes/`timeout`: the finished run kept, `interrupted: true`, exit 143, no worker left."""
    psutil = pytest.importorskip("psutil")
    config = write_config(tmp_path, workload={"step_time_ms": 30, "warmup_batches": 1, "measure_batches": 25,
                                              "repeats": 1},
                          loaders={"torch": {"variant": "plain", "num_workers": [1, 2]}})
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    workers: list = []
    # once the first setting has its run, the second is under way: its workers are noted, then the signal
    code, text = bench_stopped_by_sigterm(config, tmp_path / "bench.log", "samples/s, stall",
                                          lambda pid: workers.extend(psutil.Process(pid).children(recursive=True)))
    assert code == 143, text
    assert "Traceback" not in text and "interrupted (SIGTERM): the results of the runs that finished were kept" in text
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["interrupted"] is True and results["interrupted_by"] == "SIGTERM"
    assert [r["status"] for r in results["runs"]][0] == "ok"
    beside = json.loads((tmp_path / "results" / "decision.json").read_text())  # the set agrees with itself
    assert beside == results["decision"] and beside["partial"] is True, beside
    assert beside["text"].startswith("partial (interrupted by SIGTERM; 1 of 2 settings measured"), beside["text"]
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
    (path,) = (own_cache / "arrow").glob("*-encoded-*/shard-00000.arrow")
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


def test_sigterm_mid_serving_bench_keeps_the_finished_paths(tmp_path, own_cache):
    """A serving bench stopped between its paths: the finished ones in serve.json, exit 143, one line."""
    config = write_config(tmp_path, workload={"scenario": "server", "step_time_ms": 1,
                                              "serve": {"target_qps": 40, "requests": 120, "max_batch": 4}},
                          loaders={"torch": {"variant": ["plain", "tuned"]}})
    # once torch plain's line is out, the tuned paths are still to come (3 s of arrivals each)
    code, text = bench_stopped_by_sigterm(config, tmp_path / "bench.log", "torch plain:")
    assert code == 143, text
    assert "Traceback" not in text and "interrupted (SIGTERM): the paths that finished were kept" in text
    document = json.loads((tmp_path / "results" / "serve.json").read_text())
    assert [p["label"] for p in document["paths"]] == ["torch plain"], document["paths"]
    assert document["interrupted_by"] == "SIGTERM"


def test_markdown_report_shows_html_in_a_config_name_as_text(tmp_path):
    """A config named `<img src=x onerror=alert(1)>`: the markdown report (pasted where HTML renders) carries it
    as escaped text, and a label's backtick cannot close its code span."""
    from loadopt.report import render_report

    from .test_schema import raw

    document = raw("results")
    document["config"] = {**(document.get("config") or {}), "name": "<img src=x onerror=alert(1)> & co &lt; x <= 5"}
    document["runs"][0]["label"] = "torch `plain` <b>"
    (tmp_path / "results.json").write_text(json.dumps(document))
    text = render_report([tmp_path], "markdown")
    assert "<img" not in text and "<b>" not in text.replace("`torch 'plain' <b>`", ""), text
    # a tag and an entity are shown as typed; a "<=" or a lone "&" needs no escape and reads as typed
    assert "&lt;img src=x onerror=alert(1)> & co &amp;lt; x <= 5" in text, text
    assert "`torch 'plain' <b>`" in text, text  # literal inside its code span


def test_make_preprocessor_names_a_damaged_request_on_one_line(tmp_path, own_cache):
    """Serving code handing a damaged or empty request gets a DatasetError naming the request, not PIL's."""
    from loadopt import make_preprocessor
    from loadopt.errors import DatasetError

    root, bad = images(tmp_path, corrupt=1)
    config = write_config(tmp_path, dataset={"path": str(root)}, workload={"scenario": "server"})
    good = next((root / "train").rglob("[0-9]*.jpg")).read_bytes()
    preprocessor = make_preprocessor(config)
    try:
        assert preprocessor([good, good]).shape[0] == 2
        expected = {(good, bad[0].read_bytes()): "request 2 of 2 (120 bytes): truncated image",
                    b"": "request 1 of 1 (0 bytes): empty: no image bytes",
                    (b"hello",): "request 1 of 1 (5 bytes): not a readable image"}
        for requests, line in expected.items():
            with pytest.raises(DatasetError) as caught:
                preprocessor(list(requests) if isinstance(requests, tuple) else requests)
            assert str(caught.value).startswith(line) and "\n" not in str(caught.value), str(caught.value)
            assert "BytesIO" not in str(caught.value)
    finally:
        preprocessor.close()


def _delivered_labels(config) -> list[int]:
    """Every label `make_loader` hands out in one epoch, in the dataset's order."""
    loader = make_loader(config, backend="torch", num_workers=0, shuffle=False, drop_last=False, batch_size=4)
    try:
        return [int(label) for _, labels in loader for label in labels]
    finally:
        loader.close()


def test_a_text_tar_label_is_skipped_and_the_others_keep_their_integers(tmp_path, own_cache):
    """One `.cls` of `cat` among 20 integer labels (0-19, so a text sort would renumber them): under
    `on_error: skip` it is left out and named, and every other sample keeps the very label written."""
    from loadopt.storage.open import open_dataset

    from .bad_label_inputs import numbered_samples
    from .source_files import write_shards

    samples = numbered_samples(tmp_path)
    key, _, data = samples[7]
    labelled: list = [*samples[:7], (key, "cat", data), *samples[8:]]
    shards = write_shards(tmp_path / "shards", labelled, per_shard=6)
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards"), "on_error": "skip"})
    from loadopt.config import load_config

    dataset = open_dataset(load_config(config))
    written = [label for i, (_, label, _) in enumerate(samples) if i != 7]
    assert dataset.labels.tolist() == written and [k.decode() for k in dataset.keys] == [
        k for i, (k, _, _) in enumerate(samples) if i != 7]
    assert dataset.classes == [str(n) for n in range(20)]
    assert len(dataset.left_out) == 1 and dataset.left_out[0].startswith(f"{shards[1]} (sample {key}, member "
                                                                         f"{key}.cls): label 'cat' ")
    assert _delivered_labels(config) == written


def test_a_null_parquet_label_or_image_is_skipped_and_the_others_keep_their_integers(tmp_path, own_cache):
    """A null label, a null image and an empty image among 20 rows: under `on_error: skip` each is left out
    and named by file and row, the 17 others keep their integers; under `raise` the first is the one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loadopt.config import load_config
    from loadopt.errors import DatasetError
    from loadopt.storage.open import open_dataset

    from .bad_label_inputs import numbered_samples

    samples = numbered_samples(tmp_path)
    images_column = [None if i == 4 else b"" if i == 11 else data for i, (_, _, data) in enumerate(samples)]
    labels_column = [None if i == 16 else label for i, (_, label, _) in enumerate(samples)]
    path = tmp_path / "pq" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"image": pa.array(images_column, pa.binary()), "label": pa.array(labels_column,
                                                                                               pa.int64())}),
                   path, row_group_size=6)
    raising = write_config(tmp_path, dataset={"path": str(tmp_path / "pq")})
    with pytest.raises(DatasetError, match=rf"^{path} \(row 4\): no image bytes \(null\); set dataset.on_error: "
                                           r"skip to leave it out \(3 such in all\)$"):
        open_dataset(load_config(raising))
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "pq"), "on_error": "skip"})
    dataset = open_dataset(load_config(config))
    written = [label for i, (_, label, _) in enumerate(samples) if i not in (4, 11, 16)]
    assert dataset.labels.tolist() == written and dataset.classes == [str(n) for n in range(20)]
    assert dataset.left_out == [f"{path} (row 4): no image bytes (null)", f"{path} (row 11): no image bytes (empty)",
                                f"{path} (row 16): label null is not a class number (an integer from 0; 19 of the "
                                "20 labels are)"]
    assert [dataset.read(i) for i in range(len(dataset))] == [
        data for i, (_, _, data) in enumerate(samples) if i not in (4, 11, 16)]
    assert _delivered_labels(config) == written


def test_a_hugging_face_class_label_keeps_its_names(tmp_path, own_cache):
    """Parquet written as `datasets` writes a ClassLabel: its names are the classes, the integers index them
    (also past 10, where a text sort would reorder), a name in the column is its index, and a number past
    the names is a named sample error."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from loadopt.storage.sources.parquet import open_parquet

    from .bad_label_inputs import numbered_samples
    from .source_files import write_parquet

    samples = numbered_samples(tmp_path, 12)
    names = [f"breed {n}" for n in range(12)]
    write_parquet(tmp_path / "hub", samples, names, files=2)
    dataset = open_parquet(str(tmp_path / "hub"))
    assert dataset.classes == names and dataset.labels.tolist() == list(range(12)) and not dataset.left_out
    features = {"image": {"_type": "Image"}, "label": {"names": ["cat", "dog"], "_type": "ClassLabel"}}
    table = pa.table({"image": pa.array([d for _, _, d in samples[:4]], pa.binary()),
                      "label": pa.array(["dog", "1", "cat", "7"])})
    path = tmp_path / "named" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}), path)
    named = open_parquet(str(path), on_error="skip")
    assert named.classes == ["cat", "dog"] and named.labels.tolist() == [1, 1, 0]
    assert named.left_out == [f"{path} (row 3): label '7' is neither a class number 0-1 nor a name of the "
                              "dataset's 2 classes (cat, dog)"]


def test_a_killed_bench_keeps_the_settings_it_finished(tmp_path, own_cache):
    """The process killed outright (SIGKILL, as a native crash ends it) while the second setting runs: results.json
    and timings.parquet hold the first setting's run, marked in progress; the earlier bench's report is gone."""
    config = write_config(tmp_path, loaders={"torch": {"variant": "plain", "num_workers": [0, 1]}})
    out = tmp_path / "results"
    out.mkdir()
    (out / "report.html").write_text("<p>an earlier bench's numbers</p>")
    script = ("import os, signal, sys\n"
              "from loadopt.bench import runner\n"
              "from loadopt.cli import app\n"
              "real, opened = runner.setting_loader, []\n"
              "def dies_at_the_second(*args, **kwargs):\n"
              "    opened.append(1)\n"
              "    if len(opened) == 2:\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return real(*args, **kwargs)\n"
              "runner.setting_loader = dies_at_the_second\n"
              "sys.argv = ['loadopt', 'bench', sys.argv[1], '--quick']\n"
              "app()\n")
    done = subprocess.run([sys.executable, "-c", script, str(config)], capture_output=True, text=True,
                          env={**os.environ, "LOADOPT_CACHE": str(own_cache)}, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["in_progress"] is True and results["interrupted"] is False
    assert [r["status"] for r in results["runs"]] == ["ok", "not run"], results["runs"]
    assert results["runs"][1]["reason"].startswith("the bench was still running when this file was written")
    import pyarrow.parquet as pq

    assert set(pq.read_table(out / "timings.parquet").column("run").to_pylist()) == {0}
    assert not (out / "report.html").exists() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def bench_after(patch: str, config, cache) -> subprocess.CompletedProcess:
    """`loadopt bench CONFIG --quick` in a process of its own after the code `patch` (which patches the runner),
    its output captured. Ctrl-C is made live there, as a terminal gives it: a test run started in the background
    (nohup, `&`) passes SIGINT on ignored."""
    code = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + patch +
            "\nfrom loadopt.cli import main\nsys.argv = ['loadopt', 'bench', sys.argv[1], '--quick']\nmain()\n")
    return subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LOADOPT_CACHE": str(cache), "COLUMNS": "200"})


STOPPED_IN_CLOSE = """
import atexit, contextlib, os, signal, sys
from loadopt.bench import runner
real, opened = runner.setting_loader, []
atexit.register(lambda: print(f"opened {len(opened)}"))

def stopped_in_close(*args, **kwargs):
    loader = real(*args, **kwargs)
    opened.append(loader)
    close = loader.close

    def close_eating_the_stop():
        close()
        if len(opened) == 1:  # delivered here, in the main thread, and swallowed as in a __del__
            with contextlib.suppress(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)

    loader.close = close_eating_the_stop
    return loader

runner.setting_loader = stopped_in_close
"""


def test_ctrl_c_lost_in_a_loaders_close_stops_at_the_next_setting(tmp_path, own_cache):
    """SIGINT arriving as a setting finishes, its KeyboardInterrupt eaten where Python ignores it (here: the
    loader's close, as a finaliser would): the next setting does not run, exit 130, `interrupted: true`. In a
    process of its own, as `loadopt bench` always is (in the full test run's process the stop was not seen)."""
    config = write_config(tmp_path, loaders={"torch": {"variant": "plain", "num_workers": [0, 1]}})
    done = bench_after(STOPPED_IN_CLOSE, config, own_cache)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "opened 1" in done.stdout  # the second setting never opened its loader
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["interrupted"] is True and results["interrupted_by"] == "SIGINT"
    assert [r["status"] for r in results["runs"]] == ["ok", "not run"]
    assert "in_progress" not in results
    partial = json.loads((tmp_path / "results" / "decision.json").read_text())
    assert partial["partial"] is True
    # backend="auto" never takes it: it is not in the cache, and not used even where it got in by hand
    from loadopt.bench.decision import decision_path, find_entry

    cached = decision_path(results["dataset"]["fingerprint"])
    assert not cached.exists()
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps({"schema_version": partial["schema_version"], "entries": [partial]}))
    found, match, _ = find_entry(partial["pipeline"], results["dataset"]["fingerprint"],
                                 partial["machine"]["storage_tier"])
    assert found is None and match != "exact", match


def test_a_run_that_delivered_nothing_is_an_error_and_no_decision(tmp_path, own_cache):
    """Every file unreadable under on_error: skip: 0 samples delivered is the setting's error with its reason,
    nothing is ranked, no decision is made, exit 1."""
    root = tmp_path / "photos"
    for name in ("c0", "c1"):
        (root / "train" / name).mkdir(parents=True)
        (root / "train" / name / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 4)
    config = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"},
                          loaders={"torch": {"variant": "plain", "num_workers": 0}})
    result = CliRunner().invoke(app, ["bench", str(config), "--quick"])
    assert result.exit_code == 1, result.output
    assert "error: no loader setting could be measured (torch plain num_workers=0: " in said(result)
    assert "delivered no samples (2 unreadable file(s) skipped under dataset.on_error: skip" in said(result)
    assert not (tmp_path / "results" / "decision.json").exists()
    assert not (tmp_path / "results" / "results.json").exists()


def test_no_space_for_the_report_leaves_no_stale_report_and_fails(tmp_path, own_cache, monkeypatch):
    """The disk fills at the report (ENOSPC emulated): no earlier bench's report.html is left beside the new
    results, one error line, exit 1."""
    import errno

    from loadopt import files

    config = write_config(tmp_path, loaders={"torch": {"variant": "plain", "num_workers": 0}})
    out = tmp_path / "results"
    out.mkdir()
    (out / "report.html").write_text("<p>an earlier bench's numbers</p>")
    real = files.atomic_write_text

    def fills_up(path, text):
        if path.name == "report.html":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(files, "atomic_write_text", fills_up)
    result = CliRunner().invoke(app, ["bench", str(config), "--quick"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {out / 'report.html'}: cannot write the report "
                                                     "(No space left on device); the results beside it")
    assert "Traceback" not in result.output
    assert not (out / "report.html").exists()
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["status"] == "ok" and "in_progress" not in results


def test_a_decode_pool_stopped_as_soon_as_it_started_stops_its_workers():
    """A worker not yet scheduled when the pool is terminated (a short conversion on a busy machine) took its
    SIGTERM into the CLI's inherited handler before Python's after-fork step, which dropped it: the worker then
    waited for good and `stop` for its whole timeout, saying so. SIGTERM is blocked while forking now. In a
    fresh process: one that used Ray (an earlier test here) forks no pool at all."""
    code = """
import logging, sys
from loadopt.cli.process import terminate_as_interrupt
from loadopt.storage.forms import decode_pool
logging.basicConfig(level=logging.WARNING)
with terminate_as_interrupt():  # the handler every forked worker of the CLI inherits
    for _ in range(20):
        pool = decode_pool.start(2)
        assert pool is not None, "no pool forked"
        decode_pool.stop(pool, timeout_s=10)
print("stopped 20 pools")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "stopped 20 pools" in done.stdout, done.stderr
    assert "did not stop" not in done.stderr, done.stderr


def test_a_raw_decoded_conversion_after_an_arrow_one_stops_its_decode_workers(tmp_path, own_cache):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    runner = CliRunner()
    arrow = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--decoded"])
    assert arrow.exit_code == 0 and "did not stop" not in arrow.output, arrow.output
    raw = runner.invoke(app, ["convert", str(config), "--to", "raw", "--decoded"])
    assert raw.exit_code == 0 and "converted in" in said(raw), raw.output
    assert "did not stop" not in raw.output, raw.output


def test_label_values_as_class_numbers():
    """What each label value is: integers, integral floats and their text are class numbers; among them text,
    null, a negative or fractional number are named errors; labels that are all text are sorted names."""
    from loadopt.storage.sources.format import class_numbers

    mixed = class_numbers([3, "7", 2.0, " 12 ", "cat", None, -1, 2.5, True], None)
    assert mixed.numbers.tolist() == [3, 7, 2, 12, -1, -1, -1, -1, -1]
    assert mixed.classes == [str(n) for n in range(13)]
    assert {i: why.split(" is ")[0] for i, why in mixed.wrong.items()} == {
        4: "label 'cat'", 5: "label null", 6: "label -1", 7: "label 2.5", 8: "label True"}
    names = class_numbers(["dog", "cat", None, "dog"], None)
    assert names.classes == ["cat", "dog"] and names.numbers.tolist() == [1, 0, -1, 1] and list(names.wrong) == [2]


def test_compressed_tar_shards_are_named_however_they_are_given(tmp_path, own_cache):
    """A brace pattern or a glob of .tar.gz shards, a `<split>/` folder of them, `dataset.format: webdataset`
    on their folder: each the one line naming them and saying to gunzip them."""
    import gzip

    from loadopt.config import load_config
    from loadopt.errors import DatasetError
    from loadopt.storage.open import open_dataset

    from .bad_label_inputs import numbered_samples
    from .source_files import write_shards

    shards = write_shards(tmp_path / "shards" / "train", numbered_samples(tmp_path, 6), per_shard=3)
    for shard in shards:
        shard.with_name(shard.name + ".gz").write_bytes(gzip.compress(shard.read_bytes()))
        shard.unlink()
    first = f"{shards[0]}.gz"
    for path, dataset in [(str(tmp_path / "shards" / "train" / "train-{000000..000001}.tar.gz"), {}),
                          (str(tmp_path / "shards" / "train" / "*.tar.gz"), {}),
                          (str(tmp_path / "shards"), {}),
                          (str(tmp_path / "shards" / "train"), {"format": "webdataset"}),
                          (first, {})]:
        config = load_config(write_config(tmp_path, dataset={"path": path, **dataset}))
        with pytest.raises(DatasetError) as caught:
            open_dataset(config)
        assert str(caught.value).startswith(first) and "compressed tar shards are not read" in str(caught.value)
        assert "gunzip" in str(caught.value), (path, str(caught.value))


def test_a_null_image_struct_in_hugging_face_parquet_is_skipped(tmp_path, own_cache):
    """A null `{bytes, path}` cell (a missing `Image()`): a named sample error that `on_error: skip` leaves out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loadopt.errors import DatasetError
    from loadopt.storage.sources.parquet import open_parquet

    from .bad_label_inputs import numbered_samples

    samples = numbered_samples(tmp_path, 8)
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    image = pa.array([None if i == 2 else {"bytes": d, "path": f"{k}.jpg"} for i, (k, _, d) in enumerate(samples)],
                     type=struct)
    path = tmp_path / "hub" / "train.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"image": image, "label": pa.array([label for _, label, _ in samples])}), path)
    with pytest.raises(DatasetError, match=rf"^{path} \(row 2\): no image bytes \(null\); set dataset.on_error"):
        open_parquet(str(path))
    dataset = open_parquet(str(path), on_error="skip")
    assert dataset.labels.tolist() == [0, 1, 3, 4, 5, 6, 7] and dataset.left_out == [
        f"{path} (row 2): no image bytes (null)"]
    assert dataset.read(2) == samples[3][2]


@pytest.mark.parametrize("damage", ["index cut short", "index row of its neighbour", "a flipped byte in the shard"])
def test_verify_converts_a_damaged_raw_conversion_again(tmp_path, own_cache, damage, caplog):
    """`--verify` reads every chunk and every index file against the manifest's checksums: damage is named, the
    conversion made again, and verified the next time. A plain convert checks what the open samples (here the one
    chunk and its index: all of it) and names the damage with the command that rebuilds it."""
    import numpy as np

    from .bad_integrity_inputs import REBUILD_RAW

    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    runner = CliRunner()
    assert runner.invoke(app, ["convert", str(config), "--to", "raw"]).exit_code == 0
    (folder,) = (own_cache / "raw").glob("*-encoded-*")
    index, shard = folder / "shard-00000.idx.npy", folder / "shard-00000.bin"
    if damage == "index cut short":
        index.write_bytes(index.read_bytes()[:-40])
        victim = index
    elif damage == "index row of its neighbour":
        rows = np.load(index)
        rows[3] = rows[4]
        np.save(index, rows)
        victim = index
    else:
        with open(shard, "r+b") as handle:
            handle.seek(5000)
            byte = handle.read(1)
            handle.seek(5000)
            handle.write(bytes([byte[0] ^ 0x10]))
        victim = shard
    damaged = victim.read_bytes()
    reused = runner.invoke(app, ["convert", str(config), "--to", "raw"])
    assert reused.exit_code == 1 and f"error: {victim}" in said(reused) and REBUILD_RAW in said(reused), reused.output
    verified = runner.invoke(app, ["convert", str(config), "--to", "raw", "--verify"])
    assert verified.exit_code == 0 and "converted in" in said(verified), verified.output
    warned = " ".join(r.getMessage() for r in caplog.records)  # the CLI's log line (logging set up once a process)
    assert f"{victim}: " in warned and "checksum mismatch" in warned and "converting again" in warned
    assert REBUILD_RAW not in warned
    assert victim.read_bytes() != damaged
    again = runner.invoke(app, ["convert", str(config), "--to", "raw", "--verify"])
    assert "reused: converted earlier, every chunk verified, source unchanged" in said(again), again.output


def test_verify_converts_a_truncated_arrow_shard_again(tmp_path, own_cache, caplog):
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    runner = CliRunner()
    assert runner.invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    (shard,) = (own_cache / "arrow").glob("*-encoded-*/shard-00000.arrow")
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-300])
    verified = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--verify"])
    assert verified.exit_code == 0 and "converted in" in said(verified), verified.output
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"{shard}: corrupt or truncated Arrow shard" in warned and "converting again" in warned
    assert shard.read_bytes() == whole  # the same samples, the same bytes
    again = runner.invoke(app, ["convert", str(config), "--to", "arrow", "--verify"])
    assert "reused: converted earlier, every chunk verified, source unchanged" in said(again), again.output


@pytest.mark.parametrize("to", ["arrow", "raw"])
def test_a_tar_member_that_is_no_image_is_skipped_and_counted_by_the_encoded_conversion(tmp_path, own_cache, to):
    from .source_files import folder_samples, write_shards

    root, _ = images(tmp_path, corrupt=0)
    samples = folder_samples(root)
    samples[3] = (samples[3][0], samples[3][1], b"not an image at all" * 10)
    write_shards(tmp_path / "shards", samples, per_shard=5)
    config = write_config(tmp_path, dataset={"path": str(tmp_path / "shards"), "on_error": "skip"})
    result = CliRunner().invoke(app, ["convert", str(config), "--to", to])
    assert result.exit_code == 0, result.output
    assert "1 unreadable file(s) skipped" in said(result), result.output


STOPPED_IN_A_FINALISER = """
import os, signal, sys
from loadopt.bench import runner
real = runner.setting_loader

class StoppedWhenCollected:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # the handler's raise lands in this finaliser

def stopped_in_a_finaliser(*args, **kwargs):
    loader = real(*args, **kwargs)
    close = loader.close

    def close_then_collect():
        close()
        held = StoppedWhenCollected()
        del held

    loader.close = close_then_collect
    return loader

runner.setting_loader = stopped_in_a_finaliser
"""


def test_ctrl_c_lost_in_a_finaliser_after_the_last_setting_is_still_a_stop(tmp_path, own_cache):
    """The KeyboardInterrupt raised inside a `__del__` run by the last setting's close (Python ignores it, through
    sys.unraisablehook): the bench still ends as stopped, exit 130, `interrupted: true`, a partial decision only.
    In a process of its own, as `loadopt bench` always is."""
    config = write_config(tmp_path, loaders={"torch": {"variant": "plain", "num_workers": 0}})
    done = bench_after(STOPPED_IN_A_FINALISER, config, own_cache)
    assert done.returncode == 130, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "Exception ignored" not in output and "Traceback" not in output, output
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["interrupted"] is True and results["interrupted_by"] == "SIGINT"
    assert results["runs"][0]["status"] == "ok"
    assert json.loads((tmp_path / "results" / "decision.json").read_text())["partial"] is True


def test_ceilings_stop_at_the_first_storage_failure(tmp_path):
    """The decode and crop ceilings read up to 300 samples: with the server down each read waited out its
    retries (4 of a bench's 5 minutes); a StorageError is the storage's, so the first one ends the ceiling."""
    from loadopt.bench.attribution import ceilings
    from loadopt.config import config_from_dict
    from loadopt.errors import StorageError
    from loadopt.storage.open import open_dataset

    from .conftest import tiny_config_dict

    config = config_from_dict(tiny_config_dict(tmp_path / "out"), "tiny.yaml")
    dataset = open_dataset(config)
    reads: list[int] = []

    def down(index: int) -> bytes:
        reads.append(index)
        raise StorageError("http://127.0.0.1:1/x.tar: the host 127.0.0.1:1 refused the connection 5 times")

    dataset.read = down  # type: ignore[method-assign]
    for measure in (ceilings.decode_rates, ceilings.crop_resize_rate):
        reads.clear()
        with pytest.raises(StorageError):  # the bench's guard records it as the ceiling's reason
            measure(config, dataset)
        assert reads == [0], reads
