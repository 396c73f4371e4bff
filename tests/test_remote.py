"""Remote tiers: a dataset read over HTTP (range requests) and S3 (moto's server) on loopback gives the
same samples as from local disk, through every process of the torch backend; credentials never reach
messages or results."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loadopt.bench.runner import run_bench
from loadopt.config import PipelineConfig, config_from_dict
from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings
from loadopt.storage.open import open_dataset
from loadopt.storage.remote.access import redact
from loadopt.storage.sources.imagefolder import scan_image_folder
from loadopt.storage.tiers.stack import tier_counters

from .conftest import make_image_folder, tiny_config_dict
from .servers import nginx_server, python_http_server, s3_endpoint  # noqa: F401 - s3_endpoint is a fixture

PIPELINE = PipelineConfig(batch_size=4, image_size=24, augment="eval")


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-images")
    make_image_folder(root, classes=3, per_class=5)
    return root


@pytest.fixture(scope="module", params=["python", "nginx"])
def http_url(request, image_root, tmp_path_factory):
    """The images over HTTP from Python's server (ranges added) and, when the OS has it, nginx."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    if request.param == "nginx":
        if shutil.which("nginx") is None:
            pytest.skip("nginx is not installed (apt-get install nginx-light); the Python server is tested")
        with nginx_server(image_root, tmp_path_factory.mktemp("nginx")) as url:
            yield url
    else:
        with python_http_server(image_root) as url:
            yield url


@pytest.fixture(scope="module")
def s3_url(s3_endpoint, image_root):  # noqa: F811 - the fixture imported above
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("loadopt-test")
    fs.put(f"{image_root}/", "loadopt-test/images/", recursive=True)
    return "s3://loadopt-test/images"


def _batches(dataset, workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = TorchLoader(dataset, PIPELINE, TorchSettings(num_workers=workers, decoder="pil", resize="pil"), seed=3)
    try:
        return [(x.clone(), y.clone()) for x, y in loader]
    finally:
        loader.close()


def _open(path: str, tier="local"):
    return open_dataset(config_from_dict({"dataset": {"path": path}, "storage": {"tier": tier}}, "remote.yaml"))


def _assert_same_samples(remote, local) -> None:
    assert remote.classes == local.classes and len(remote) == len(local) == 15
    assert remote.labels.tolist() == local.labels.tolist() and remote.sizes.tolist() == local.sizes.tolist()
    assert [remote.read(i) for i in range(len(remote))] == [local.read(i) for i in range(len(local))]
    reference = _batches(local, workers=0)
    for workers in (0, 2):  # forked workers read through their own connections
        for (xr, yr), (xl, yl) in zip(_batches(remote, workers), reference, strict=True):
            assert torch.equal(yr, yl) and torch.equal(xr, xl)


def test_http_dataset_gives_the_same_samples_as_local_disk(http_url, image_root):
    remote = _open(http_url)
    assert remote.root.startswith("http://127.0.0.1:")
    _assert_same_samples(remote, scan_image_folder(str(image_root)))
    counters = tier_counters(remote.fs)  # remote storage is always read with retries and counters
    assert counters["requests"] >= 15 and counters["failed_reads"] == 0


def test_http_range_reads(http_url, image_root):
    remote = _open(http_url)
    first = sorted((image_root / "train" / "c0").glob("*.jpg"))[0].read_bytes()
    assert remote.fs.cat_file(remote.path(0), 100, 164) == first[100:164]
    with remote.fs.open(remote.path(0), block_size=32) as handle:
        handle.seek(len(first) - 10)
        assert handle.read() == first[-10:]


def test_s3_dataset_gives_the_same_samples_as_local_disk(s3_url, image_root):
    remote = _open(s3_url)
    assert remote.root == "s3://loadopt-test/images/train"
    _assert_same_samples(remote, scan_image_folder(str(image_root)))


def test_s3_through_an_emulated_tier_with_base_and_options(s3_url, s3_endpoint, image_root):  # noqa: F811
    tier = {"base": s3_url, "latency_ms": 2, "storage_options": {"endpoint_url": s3_endpoint, "key": "testing",
                                                                  "secret": "testing-secret"}}
    remote = open_dataset(config_from_dict({"storage": {"tier": tier}}, "remote.yaml"))
    _assert_same_samples(remote, scan_image_folder(str(image_root)))


def test_results_never_hold_credentials(s3_url, s3_endpoint, tmp_path):  # noqa: F811
    tier = {"name": "moto", "base": s3_url, "storage_options": {"endpoint_url": s3_endpoint, "key": "testing",
                                                                 "secret": "testing-secret"}}
    raw = tiny_config_dict(tmp_path / "out", storage={"tier": tier}, loaders={"torch": {"num_workers": 0}},
                           pipeline={"batch_size": 4, "image_size": 24}, workload={"measure_batches": 2})
    run_bench(config_from_dict(raw, "moto.yaml"), attribute=False)
    text = (tmp_path / "out" / "results.json").read_text()
    results = json.loads(text)
    assert results["runs"][0]["status"] == "ok" and results["tier"]["name"] == "moto"
    assert "testing-secret" not in text and results["tier"]["storage_options"]["secret"] == "***"
    assert results["runs"][0]["tier_counters"]["requests"] >= 12


def test_redact_removes_url_credentials_and_secret_options():
    assert redact("s3://AKIA123:sEcReT@bucket/data") == "s3://***@bucket/data"
    assert redact("see https://user:pw@host:8080/x and http://host/y") == "see https://***@host:8080/x and http://host/y"
    options = {"key": "AKIA123", "secret": "s", "token": "t", "client_kwargs": {"aws_secret_access_key": "s2",
                                                                               "endpoint_url": "http://h:1"},
               "password": "p", "anon": False}
    assert redact(options) == {"key": "***", "secret": "***", "token": "***",
                               "client_kwargs": {"aws_secret_access_key": "***", "endpoint_url": "http://h:1"},
                               "password": "***", "anon": False}


@pytest.mark.parametrize(("text", "expected"), [
    ("s3://AKIA:wJalr/XUtn+FEMI@bucket/x", "s3://***@bucket/x"),  # AWS secret keys hold '/'
    ("https://ghp_TOKEN@github.com/org/repo", "https://***@github.com/org/repo"),  # a token as the user
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc&X-Amz-Security-Token=t&v=1",
     "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***&v=1"),
    ("https://acct.blob.core.windows.net/c/x.jpg?sv=2024&sig=ab%2Fc", "https://acct.blob.core.windows.net/c/x.jpg?sv=2024&sig=***"),
    ("gs://bucket/x?access_token=ya29.a0", "gs://bucket/x?access_token=***"),
    ("s3://bucket/train/a.jpg and http://127.0.0.1:9/x", "s3://bucket/train/a.jpg and http://127.0.0.1:9/x"),
])
def test_redact_every_url_form(text, expected):
    assert redact(text) == expected


def test_credentials_in_an_s3_url_become_options_not_a_bucket_name():
    from loadopt.storage.remote.access import open_url

    fs, path = open_url("s3://AKIAKEY:se%2Fcret@bucket/images", {"endpoint_url": "http://127.0.0.1:1"})
    assert path == "bucket/images" and fs.key == "AKIAKEY" and fs.secret == "se/cret"


def test_unreachable_url_is_one_line_without_credentials(image_root):
    from loadopt.errors import StorageError

    from .servers import free_port

    url = f"http://user:hunter2@127.0.0.1:{free_port()}/images"  # nothing listens there
    with pytest.raises(StorageError) as caught:  # waited for as a read is, then the storage's failure
        scan_image_folder(url)
    message = str(caught.value)
    assert "hunter2" not in message and "\n" not in message and "127.0.0.1" in message


def test_a_converting_backend_on_a_read_only_http_dataset_converts_into_the_local_cache(http_url, own_cache, tmp_path):
    """Nothing is written to a static file server: the conversions stay in the local cache, read from the
    local disk, and their rows say so, beside the row that reads the images over HTTP."""
    from typer.testing import CliRunner

    from loadopt.cli import app

    from .faults import said, write_config

    config = write_config(tmp_path, dataset={"path": http_url}, pipeline={"batch_size": 4, "image_size": 24},
                          workload={"warmup_batches": 1, "measure_batches": 3, "repeats": 1},
                          loaders={"torch": {"num_workers": 0}, "arrow": {"form": "decoded"},
                                   "posix": {"form": "encoded", "shard_mib": 0.25}})
    result = CliRunner().invoke(app, ["bench", str(config), "--quick"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    runs = {r["backend"]: r for r in json.loads((tmp_path / "results" / "results.json").read_text())["runs"]}
    assert all(run["status"] == "ok" for run in runs.values()), runs
    assert runs["torch"]["bytes_source"] == "tier local (as it is) over http://"
    for backend in ("arrow", "posix"):
        assert runs[backend]["bytes_source"] == ("local disk (direct reads of the conversion in the local cache: "
                                                 "http:// storage beside the source cannot be written)")
        assert "via tier" not in runs[backend]["label"]
        assert runs[backend]["metrics"]["tier_bytes"]["median"] == 0  # not one byte of it over HTTP
    assert runs["torch"]["metrics"]["tier_bytes"]["median"] > 0
    assert list((own_cache / "arrow").glob("*/manifest.json")) and list((own_cache / "raw").glob("*/manifest.json"))
    assert "bytes from local disk (direct reads of the conversion in the local cache" in said(result)


def test_a_storage_converted_on_a_read_only_http_server_is_one_line(http_url, own_cache, tmp_path):
    from typer.testing import CliRunner

    from loadopt.cli import app

    from .faults import said, write_config

    config = write_config(tmp_path, dataset={"path": http_url}, storage={"converted": f"{http_url}/conversions"},
                          loaders={"arrow": {"form": "encoded"}})
    result = CliRunner().invoke(app, ["bench", str(config), "--quick"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: {http_url}/conversions/arrow/"), result.output
    assert "cannot write the converted dataset there" in said(result) and "storage.converted" in lines[-1]
    assert not (tmp_path / "results").exists()


def test_probe_reads_urls_with_credentials_and_keeps_them_out_of_its_results(http_url, s3_url, tmp_path):
    """`loadopt probe` opens a location as every command does: s3:// credentials in the URL become the
    driver's options (not a bucket name), and neither they nor an http password reach probe.json."""
    from typer.testing import CliRunner

    from loadopt.cli import app

    bucket_path = s3_url.removeprefix("s3://")
    for number, url in enumerate([http_url.replace("http://", "http://user:hunter2@") + "/",
                                  f"s3://testing:testing-secret@{bucket_path}"]):
        out = tmp_path / f"probe{number}"
        result = CliRunner().invoke(app, ["probe", url, "--blocks", "4k", "--concurrency", "2", "--duration", "0.2",
                                          "--seq", "64k", "--out", str(out)])
        assert result.exit_code == 0, result.output
        text = (out / "probe.json").read_text()
        assert "hunter2" not in text and "testing-secret" not in text and "hunter2" not in result.output
        probed = json.loads(text)
        assert probed["files"] == 15 and probed["url"] == redact(url) and "***@" in probed["url"]
        assert all(p["requests"] > 0 for p in probed["patterns"] if "skipped" not in p)


def test_storage_failure_is_one_redacted_line_for_the_drivers_errors_and_keeps_a_bug_a_bug():
    from loadopt.storage.remote.access import storage_failure

    exceptions = pytest.importorskip("botocore.exceptions")
    invalid = exceptions.ParamValidationError(report='Invalid bucket name "b!": Bucket name must match')
    assert str(storage_failure("s3://KEY:SECRET@b!/x", invalid, "list it")) == (
        's3://***@b!/x: cannot list it (ParamValidationError: Parameter validation failed: Invalid bucket name '
        '"b!": Bucket name must match)')
    assert str(storage_failure("/data", FileNotFoundError(2, "No such file"), "list it")) == "/data: not found"
    assert storage_failure("s3://b/x", KeyError("slot"), "list it") is None  # ours: its traceback is kept
