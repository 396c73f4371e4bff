"""Bad input and faults, one table: each case ends as one line naming the culprit, the exit code the
CLI promises, no traceback, and nothing partial left behind; the library (`make_loader`) raises a
`loadopt.errors` exception with the same line. Datasets are a dozen tiny JPEGs: the module stays fast.
Rows run in process through typer's runner; SIGTERM runs a real `loadopt bench` process."""

from __future__ import annotations

import errno
import json

import pytest
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.cli import app
from loadopt.errors import LoadoptError
from loadopt.storage.forms import arrow_convert

from .bad_bench_inputs import BENCH_CASES
from .bad_cli_inputs import CLI_CASES
from .bad_convert_inputs import CONVERT_CASES
from .bad_integrity_inputs import INTEGRITY_CASES
from .bad_label_inputs import LABEL_CASES
from .bad_pipeline_inputs import PIPELINE_CASES
from .bad_recompress_inputs import RECOMPRESS_CASES
from .bad_remote_inputs import REMOTE_CASES
from .bad_serving_inputs import (
    arrivals_file_with_a_bad_line,
    damaged_jpeg_request,
    every_request_damaged,
    slo_on_a_training_config,
)
from .bad_source_inputs import (
    arrow_shard_missing,
    cache_limit_not_a_size,
    dali_native_reader_on_tar_shards,
    empty_tar_shard,
    file_removed_since_the_listing,
    no_dataset_format_in_the_folder,
    parquet_files_of_different_schemas,
    parquet_without_the_named_column,
    raw_shard_missing,
    tar_sample_of_other_bytes,
    tar_sample_without_an_image,
    truncated_tar_shard,
    unknown_shuffle,
)
from .faults import Setup, free_port, images, temps, write_config

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


def newline_in_a_file_name(command: str):
    """A damaged JPEG named `bad<newline>name.jpg`: the name is quoted (repr), the error stays one line."""

    def make(tmp_path, cache):
        root, _ = images(tmp_path, corrupt=0)
        bad = root / "train" / "c0" / "bad\nname.jpg"
        bad.write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 4)
        config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"torch": {"num_workers": 0}})
        args = {"convert": ["convert", str(config), "--to", "arrow", "--decoded"], "bench": ["bench", str(config)]}
        return Setup(args[command], f"{str(bad)!r}: damaged JPEG", config=config, leftovers=temps(cache))

    return make


def s3_without_credentials(tmp_path, cache):
    config = write_config(tmp_path, dataset={"path": "s3://loadopt-missing/images"})
    return Setup(["bench", str(config)], "s3://loadopt-missing/images: no credentials for s3://", config=config,
                 backend="torch", leftovers=temps(cache))


def s3_without_credentials_probed(tmp_path, cache):
    out = tmp_path / "probe"
    return Setup(["probe", "s3://loadopt-missing/images", "--out", str(out)], "s3://loadopt-missing/images: no "
                 "credentials for s3://", leftovers=lambda: [p for p in [out] if p.exists()])


# Every command that takes a location, with its arguments: the dataset's (dataset.path) or probe's own.
URL_COMMANDS = {
    "bench": lambda config, url, out: ["bench", str(config)],
    "convert": lambda config, url, out: ["convert", str(config), "--to", "arrow"],
    "make-dataset": lambda config, url, out: ["make-dataset", str(config)],
    "explain": lambda config, url, out: ["explain", str(config)],
    "tiers": lambda config, url, out: ["tiers", str(config), "--tiers", "nvme", "--quick", "--out", str(out)],
    "probe": lambda config, url, out: ["probe", url, "--out", str(out)],
    "probe --tier": lambda config, url, out: ["probe", url, "--tier", "nvme", "--out", str(out)],
}


def s3_secret_in_the_url(command: str):
    """Credentials in an s3:// URL, whose endpoint refuses (s3_env): the secret is never shown, the
    refusal is said as one."""

    def make(tmp_path, cache):
        url = "s3://AKIAEXAMPLE:wJalr/XUtnFEMI@bucket/images"
        config = write_config(tmp_path, dataset={"path": url})
        out = tmp_path / "out"
        return Setup(URL_COMMANDS[command](config, url, out), "s3://***@bucket/images: the host 127.0.0.1:",
                     config=config, backend="torch" if command == "bench" else None,
                     must_not_contain=["wJalr", "XUtnFEMI", "AKIAEXAMPLE", "Traceback"],
                     leftovers=lambda: temps(cache)() + [p for p in [out / "probe.json", out / "tiers.json"]
                                                        if p.exists()] + [p for p in [out] if command.startswith(
                                                            "probe") and p.exists()])

    return make


def refused_connection(command: str):
    """A password in an http:// URL whose host refuses: "refused", not "not found", and no password."""

    def make(tmp_path, cache):
        port = free_port()  # nothing listens there
        url = f"http://user:hunter2@127.0.0.1:{port}/images"
        config = write_config(tmp_path, dataset={"path": url})
        out = tmp_path / "out"
        return Setup(URL_COMMANDS[command](config, url, out), f"http://***@127.0.0.1:{port}/images: the host "
                     f"127.0.0.1:{port} refused the connection", config=config,
                     backend="torch" if command == "bench" else None, must_not_contain=["hunter2", "not found"],
                     leftovers=lambda: temps(cache)() + [p for p in [out / "probe.json", out / "tiers.json"]
                                                        if p.exists()] + [p for p in [out] if command.startswith(
                                                            "probe") and p.exists()])

    return make


def refused_connection_records(tmp_path, cache):
    """The record folders (dataset.kind: records) go through the same mapping: refused, not "not found"."""
    port = free_port()
    url = f"http://user:hunter2@127.0.0.1:{port}/records"
    config = write_config(tmp_path, dataset={"kind": "records", "path": url,
                                             "records": {"samples_per_file": 2, "delivered_bytes": 500}})
    return Setup(["make-dataset", str(config)], f"http://***@127.0.0.1:{port}/records: the host 127.0.0.1:{port} "
                 "refused the connection", config=config, backend="torch", must_not_contain=["hunter2", "not found"])


def no_space_converting(tmp_path, cache, monkeypatch):
    """The disk fills while the Arrow file is written (emulated: the writer's batches raise ENOSPC)."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)})
    real = arrow_convert.record_batches

    def fills_up(*args, **kwargs):
        yield from real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arrow_convert, "record_batches", fills_up)
    folder = cache / "arrow"
    return Setup(["convert", str(config), "--to", "arrow"], f"{folder}: no space left on device: the Arrow "
                 "conversion (encoded) needs about ", config=config, backend="arrow",
                 overrides={"form": "encoded"}, leftovers=lambda: temps(cache)() + list(folder.glob("*/shard-*")) +
                 list(folder.glob(".*.partial")))


def damaged_arrow_file(tmp_path, cache):
    """Found by the check at open (a one-chunk shard: always sampled); `convert --verify` would convert it again."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"arrow": {"form": "encoded"}})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "arrow"]).exit_code == 0
    (path,) = (cache / "arrow").glob("*-encoded-*/shard-00000.arrow")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(64)  # inside the JPEG bytes: the record batch's body
    path.write_bytes(bytes(data))
    return Setup(["bench", str(config), "--no-convert"], f"{path}: record batch 0 (samples 0-9), "
                 "chunk 0 of column jpeg (bytes 0-", config=config, backend="arrow", overrides={"form": "encoded"})


def damaged_raw_shard(tmp_path, cache):
    """Found by the check at open (a one-chunk shard: always sampled); `convert --verify` would convert it again."""
    root, _ = images(tmp_path, corrupt=0)
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"posix": {"form": "encoded"}})
    assert CliRunner().invoke(app, ["convert", str(config), "--to", "raw"]).exit_code == 0
    (shard,) = (cache / "raw").glob("*-encoded-*/shard-00000.bin")
    with open(shard, "r+b") as handle:
        handle.seek(5000)
        handle.write(bytes(100))
    return Setup(["bench", str(config), "--no-convert"], f"{shard}: chunk 0 (bytes 0-", config=config,
                 backend="posix", overrides={"form": "encoded"})


def peer_on_a_tier(name: str):
    """A peer whose library reads its conversion from the local disk itself, asked to read through a tier."""

    def make(tmp_path, cache):
        from loadopt.loaders.registry import backend_class

        cls = backend_class(name)
        ok, reason = cls.available()
        if not ok:
            pytest.skip(f"{name}: {reason}")
        root, _ = images(tmp_path, corrupt=0)
        config = write_config(tmp_path, dataset={"path": str(root)}, loaders={name: {"num_workers": 0}},
                              storage={"tier": {"name": "fast", "bandwidth_mb_s": 2000}})
        results = tmp_path / "results"
        return Setup(["bench", str(config)], f"loaders.{name}: {cls.dist} reads its conversion from the local disk "
                     "itself; it cannot read through storage.tier", config=config, backend=name,
                     leftovers=lambda: temps(cache)() + [p for p in [results] if p.exists()])

    return make


def results_of_an_unknown_version(tmp_path, cache):
    from .test_schema import raw

    path = tmp_path / "future" / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**raw("results"), "schema_version": 99}))
    page = tmp_path / "report.html"
    return Setup(["report", str(path), "--out", str(page)], f"{path}: not a loadopt results file of a known shape "
                 "(schema_version 99 is not one this loadopt reads",
                 leftovers=lambda: [p for p in [page] if p.exists()])


def corrupt_results_explained(tmp_path, cache):
    path = tmp_path / "results.json"
    path.write_text('{"runs": [')  # cut short
    return Setup(["explain", str(path)], f"{path}: not valid JSON")


def damaged_record_file(tmp_path, cache):
    """A folder of npz record files, one cut short (no zip directory): the file is named, on open."""
    import numpy as np

    folder = tmp_path / "records"
    folder.mkdir()
    for k in range(3):
        np.savez(folder / f"r{k}.npz", x=np.zeros((2, 1000), np.uint8), y=np.zeros(2, np.uint8))
    victim = folder / "r1.npz"
    victim.write_bytes(victim.read_bytes()[:100])
    config = write_config(tmp_path, dataset={"kind": "records", "path": str(folder),
                                             "records": {"samples_per_file": 2, "delivered_bytes": 500}})
    return Setup(["make-dataset", str(config)], f"{victim}: not a readable npz record file", config=config,
                 backend="torch")


def backend_of_the_previous_contract(tmp_path, cache, monkeypatch):
    """An outside backend (an installed entry point) still defining `_produce`, not `produce`."""
    from loadopt.loaders import registry

    from .test_registry import OLD_CONTRACT_MODULE, _dist

    packages = tmp_path / "site"
    packages.mkdir()
    _dist(packages, "old_backend", "old = old_backend:OldLoader", OLD_CONTRACT_MODULE)
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))  # forgotten after the test
    config = write_config(tmp_path, loaders={"old": {}})
    return Setup(["bench", str(config)], "old: old_backend.OldLoader does not implement `produce`, which every "
                 "backend must", config=config, backend="old")


def dlio_workload_not_yaml(tmp_path, cache):
    path = tmp_path / "unet3d.yaml"
    path.write_text("dataset: {record_length: 10\n")
    return Setup(["import-dlio", str(path)], f"{path}: line ")


def bad_ceiling_window(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("LOADOPT_CEILING_SECONDS", "fast")
    config = write_config(tmp_path)

    def nothing_written() -> None:
        assert not (tmp_path / "results").exists(), "results of a bench that could not start"

    return Setup(["bench", str(config)], "LOADOPT_CEILING_SECONDS='fast': expected seconds between 0.01 and 60",
                 config=config, after=nothing_written)


CASES = {  # name: (setup, exit code)
    "empty config file": (empty_config, 2),
    "corrupt JPEG, decoded Arrow conversion": (corrupt_jpeg_decoded_arrow, 1),
    "corrupt JPEG, decoded raw conversion": (corrupt_jpeg_decoded_raw, 1),
    "a newline in a damaged file's name, convert": (newline_in_a_file_name("convert"), 1),
    "a newline in a damaged file's name, bench": (newline_in_a_file_name("bench"), 1),
    "s3:// without credentials": (s3_without_credentials, 1),
    "s3:// without credentials, probe": (s3_without_credentials_probed, 1),
    **{f"s3://KEY:SECRET@ in the URL, {command}": (s3_secret_in_the_url(command), 1) for command in URL_COMMANDS},
    **{f"refused connection, {command}": (refused_connection(command), 1) for command in URL_COMMANDS},
    "refused connection, a records dataset, make-dataset": (refused_connection_records, 1),
    "ENOSPC while converting": (no_space_converting, 1),
    "damaged Arrow file, bench": (damaged_arrow_file, 1),
    "damaged raw shard, bench": (damaged_raw_shard, 1),
    "streaming on a non-local tier": (peer_on_a_tier("streaming"), 2),
    "litdata on a non-local tier": (peer_on_a_tier("litdata"), 2),
    "results file of an unknown schema version, report": (results_of_an_unknown_version, 1),
    "corrupt results file, explain": (corrupt_results_explained, 1),
    "damaged npz record file": (damaged_record_file, 1),
    "DLIO workload file not valid YAML, import-dlio": (dlio_workload_not_yaml, 2),
    "outside backend of the previous contract (_produce), bench": (backend_of_the_previous_contract, 1),
    "tar shard cut short, bench": (truncated_tar_shard, 1),
    "tar sample without an image member, bench": (tar_sample_without_an_image, 1),
    "empty tar shard, bench": (empty_tar_shard, 1),
    "tar sample of non-image bytes, bench": (tar_sample_of_other_bytes, 1),
    "Parquet without the named image column, bench": (parquet_without_the_named_column, 1),
    "Parquet files of different schemas, bench": (parquet_files_of_different_schemas, 1),
    "$LOADOPT_CEILING_SECONDS not a number, bench": (bad_ceiling_window, 2),
    "dali reader native on tar shards, bench": (dali_native_reader_on_tar_shards, 2),
    "a folder of no dataset format, bench": (no_dataset_format_in_the_folder, 1),
    "a remote file removed since the dataset was listed, convert": (file_removed_since_the_listing, 1),
    "storage.cache_limit not a size, bench": (cache_limit_not_a_size, 2),
    "pipeline.shuffle of no known kind, bench": (unknown_shuffle, 2),
    "a raw shard gone that the manifest lists, bench": (raw_shard_missing, 1),
    "an Arrow shard gone that the manifest lists, bench": (arrow_shard_missing, 1),
    "arrivals file with a bad line, serving bench": (arrivals_file_with_a_bad_line, 2),
    "a damaged JPEG request, serving bench (single stream)": (damaged_jpeg_request, 1),
    "--slo-ms on a training config, bench": (slo_on_a_training_config, 2),
    "every request damaged under on_error: skip, serving bench": (every_request_damaged, 1),
    **CONVERT_CASES,
    **INTEGRITY_CASES,
    **RECOMPRESS_CASES,
    **REMOTE_CASES,
    **LABEL_CASES,
    **CLI_CASES,
    **BENCH_CASES,
    **PIPELINE_CASES,
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


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, tmp_path, own_cache, s3_env, monkeypatch, request):
    make, code = CASES[case]
    setup = make(tmp_path, own_cache, monkeypatch) if "monkeypatch" in make.__code__.co_varnames else \
        make(tmp_path, own_cache)
    request.addfinalizer(setup.close)
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
    command = "loadopt " + " ".join(setup.args)
    print(f"{case} | {command} | exit {result.exit_code} | {errors[0]}")  # one row a case: the table of user errors


# ---------------------------------------------------------------------------------------------
# Cases that need more than one command, a signal or a real small disk


def test_a_newline_in_a_file_name_read_by_make_loader_is_quoted(tmp_path, own_cache):
    """The library's error, raised while iterating, names the file on one line too."""
    from loadopt.errors import DatasetError

    setup = newline_in_a_file_name("bench")(tmp_path, own_cache)
    loader = make_loader(setup.config, backend="torch", num_workers=0)
    try:
        with pytest.raises(DatasetError) as caught:
            for _ in loader:
                pass
    finally:
        loader.close()
    assert str(caught.value).startswith(setup.culprit) and "\n" not in str(caught.value)
