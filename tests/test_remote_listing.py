"""A remote dataset's saved listing (storage/remote/listing.py): over HTTP and S3 (moto) on loopback, with
every request the servers receive counted, the first open lists and every later open sends no request
at all (same fingerprint, same samples); `--relist` lists again and sees an added shard; a file removed or
rewritten since the listing is one line naming it, when it was listed, and `--relist`."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.cli import app
from loadopt.config import config_from_dict
from loadopt.errors import DatasetChanged, DatasetError
from loadopt.storage.open import open_dataset
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.listing import ListingKey, SavedListing

from .conftest import make_image_folder
from .faults import write_config
from .servers import RangeRequestHandler, free_port, restore_environment
from .source_files import folder_samples, write_parquet, write_shards

RECORDS = {"kind": "records", "records": {"samples_per_file": 2, "delivered_bytes": 500, "file_format": "npz"}}
FORMATS = {"imagefolder": ("images", {}), "webdataset": ("shards", {}), "parquet": ("hub", {}),
           "records": ("records", RECORDS)}


def _make_sources(root: Path) -> None:
    make_image_folder(root / "images", classes=2, per_class=3)
    samples = folder_samples(root / "images")
    write_shards(root / "shards", samples, per_shard=2)
    write_parquet(root / "hub", samples, ["c0", "c1"])
    (root / "records").mkdir()
    for k in range(3):
        np.savez(root / "records" / f"r{k}.npz", x=np.full((2, 700), k, np.uint8), y=np.zeros(2, np.uint8))


@dataclass
class Store:
    """A server of the test's files, the requests it received by kind (list, stat, read) and the means to
    change what it holds."""

    name: str
    url: str  # what `<url>/<folder>` reads the folder by
    counts: collections.Counter
    put: Callable[[Path, str], None]  # a local folder copied to `<folder>`
    remove: Callable[[str], None]  # a file removed
    write: Callable[[str, bytes], None]  # a file (re)written

    def requests(self) -> int:
        return sum(self.counts.values())


# ---------------------------------------------------------------------------------------------
# HTTP: Python's server (ranges added), every request counted


class _CountingHandler(RangeRequestHandler):
    counts: collections.Counter = collections.Counter()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.counts["list" if os.path.isdir(self.translate_path(self.path)) else "read"] += 1
        super().do_GET()

    def do_HEAD(self) -> None:  # noqa: N802
        self.counts["stat"] += 1
        super().do_HEAD()


@pytest.fixture(scope="module")
def http_store(tmp_path_factory) -> Iterator[Store]:
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    root = tmp_path_factory.mktemp("served")
    _make_sources(root)
    counts: collections.Counter = collections.Counter()
    handler = type("Handler", (_CountingHandler,), {"counts": counts})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield Store("http", f"http://127.0.0.1:{server.server_address[1]}", counts,
                    put=lambda local, folder: shutil.copytree(local, root / folder, dirs_exist_ok=True),
                    remove=lambda name: (root / name).unlink(),
                    write=lambda name, data: (root / name).write_bytes(data))
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------
# S3: moto's server app behind a counting WSGI layer, its endpoint in the environment as a user sets it


def _s3_kind(environ: dict) -> str:
    query, path = environ.get("QUERY_STRING", ""), environ.get("PATH_INFO", "/").strip("/")
    if environ["REQUEST_METHOD"] == "HEAD":
        return "stat"
    if environ["REQUEST_METHOD"] == "GET" and ("list-type" in query or "prefix=" in query or "/" not in path):
        return "list"
    return "read" if environ["REQUEST_METHOD"] == "GET" else "write"


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory) -> Iterator[Store]:
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[remote]')")
    from werkzeug.serving import make_server

    counts: collections.Counter = collections.Counter()
    moto_app = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)

    def counted(environ, start_response):
        counts[_s3_kind(environ)] += 1
        return moto_app(environ, start_response)

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", free_port(), counted, threaded=True,
                         request_handler=moto_server.MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_SESSION_TOKEN": "",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    fs.mkdir("listed")
    root = tmp_path_factory.mktemp("uploaded")
    _make_sources(root)
    fs.put(f"{root}/", "listed/", recursive=True)
    try:
        yield Store("s3", "s3://listed", counts,
                    put=lambda local, folder: fs.put(f"{local}/", f"listed/{folder}/", recursive=True),
                    remove=lambda name: fs.rm(f"listed/{name}"),
                    write=lambda name, data: fs.pipe(f"listed/{name}", data))
    finally:
        restore_environment(saved)
        s3fs.S3FileSystem.clear_instance_cache()
        server.shutdown()


@pytest.fixture(params=["http", "s3"])
def store(request) -> Store:
    return request.getfixturevalue(f"{request.param}_store")


def _fresh_clients() -> None:
    """No filesystem instance (nor its own listings cache) carried from one open to the next: what a new
    process would have."""
    import fsspec.implementations.http

    fsspec.implementations.http.HTTPFileSystem.clear_instance_cache()
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


def _config(store: Store, folder: str, **dataset):
    return config_from_dict({"dataset": {"path": f"{store.url}/{folder}", **dataset}}, "listed.yaml")


def _open_counted(store: Store, config, **options) -> tuple[object, dict[str, int]]:
    _fresh_clients()
    store.counts.clear()
    dataset = open_dataset(config, **options)
    return dataset, dict(store.counts)


# ---------------------------------------------------------------------------------------------
# Listed once, never again on open


@pytest.mark.parametrize("source_format", list(FORMATS))
def test_the_second_open_sends_no_request(store, source_format, own_cache):
    folder, dataset_options = FORMATS[source_format]
    config = _config(store, folder, **dataset_options)
    first, listed = _open_counted(store, config)
    second, again = _open_counted(store, config)
    print(f"{store.name} {source_format}: first open {listed}, second open {again or 'no request'}")  # -s
    assert listed.get("list", 0) + listed.get("stat", 0) > 0, listed  # the first open listed
    assert again == {}, f"the second open asked the storage: {again}"
    assert type(second).__name__ == type(first).__name__ and second.source_format in (source_format, "records")
    assert second.fingerprint == first.fingerprint and len(second) == len(first) > 0
    assert second.labels.tolist() == first.labels.tolist() and second.sizes.tolist() == first.sizes.tolist()
    assert [second.read(i) for i in range(len(second))] == [first.read(i) for i in range(len(first))]
    assert len(list((own_cache / "listings").iterdir())) == 1  # one listing, its arrays beside meta.json
    _, relisted = _open_counted(store, config, relist=True)
    assert relisted.get("list", 0) + relisted.get("stat", 0) > 0, relisted


def test_relist_on_the_command_line_picks_up_an_added_shard(store, own_cache, tmp_path):
    make_image_folder(tmp_path / "photos", classes=2, per_class=3)
    write_shards(tmp_path / "grow", folder_samples(tmp_path / "photos"), per_shard=2)
    (tmp_path / "grow" / "train-000002.tar").rename(tmp_path / "later.tar")  # 2 shards now, the third later
    folder = f"grow-{store.name}"
    store.put(tmp_path / "grow", folder)
    config = write_config(tmp_path, dataset={"path": f"{store.url}/{folder}"})

    def make_dataset(*extra: str) -> tuple[str, dict[str, int]]:
        _fresh_clients()
        store.counts.clear()
        result = CliRunner().invoke(app, ["make-dataset", str(config), *extra])
        assert result.exit_code == 0, result.output
        return " ".join(result.output.split()), dict(store.counts)

    said, _ = make_dataset()
    assert ": 4 images in 2 classes" in said
    store.write(f"{folder}/train-000002.tar", (tmp_path / "later.tar").read_bytes())
    said, asked = make_dataset()
    assert ": 4 images in 2 classes" in said and asked == {}  # the saved listing: the new shard unseen
    said, asked = make_dataset("--relist")
    assert ": 6 images in 2 classes" in said and asked.get("list", 0) + asked.get("stat", 0) > 0
    said, asked = make_dataset()
    assert ": 6 images in 2 classes" in said and asked == {}  # the new listing, saved


@pytest.mark.parametrize("command", ["bench", "convert", "make-dataset", "explain", "tiers"])
def test_every_command_that_opens_a_dataset_takes_relist(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--relist" in result.output, result.output


def test_a_file_removed_or_rewritten_since_the_listing_is_one_line(store, own_cache, tmp_path):
    make_image_folder(tmp_path / "photos", classes=2, per_class=3)
    folder = f"shrink-{store.name}"
    store.put(tmp_path / "photos", folder)
    config = _config(store, folder)
    listed, _ = _open_counted(store, config)
    store.remove(f"{folder}/train/c0/1.jpg")
    store.write(f"{folder}/train/c1/2.jpg", b"other bytes")
    dataset, asked = _open_counted(store, config)
    assert asked == {} and len(dataset) == 6  # the saved listing still names both
    gone = next(i for i in range(len(dataset)) if dataset.path(i).endswith("c0/1.jpg"))
    other = next(i for i in range(len(dataset)) if dataset.path(i).endswith("c1/2.jpg"))
    when = remote_listing.when(listed.listed_at)
    with pytest.raises(DatasetChanged) as caught:
        dataset.read(gone)
    assert str(caught.value) == (f"{store.url}/{folder}/train/c0/1.jpg: not found: the dataset changed since it was "
                                 f"listed ({when}); rerun with --relist to list it again")
    with pytest.raises(DatasetChanged, match=r"c1/2\.jpg: 11 bytes read where the listing said [0-9,]+: the dataset "
                       r"changed since it was listed"):
        dataset.read(other)
    _fresh_clients()
    loader = make_loader(config, backend="torch", num_workers=0, shuffle=False)
    try:  # through a loader: the same file named, on one line
        with pytest.raises(DatasetError, match=r"c0/1\.jpg: not found: the dataset changed since it was listed "
                           r"\(.*\); rerun with --relist") as caught:
            for _ in loader:
                pass
        assert "\n" not in str(caught.value)
    finally:
        loader.close()
    _fresh_clients()
    assert len(open_dataset(config, relist=True)) == 5  # the new listing


# ---------------------------------------------------------------------------------------------
# The key, what is not saved, and a large listing


def test_the_key_holds_the_endpoint_and_no_secret(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    options = {"key": "AKIAEXAMPLE", "secret": "wJalrXUtnFEMI", "client_kwargs": {"endpoint_url": "http://a:9000"}}
    key = ListingKey.of("imagefolder", "s3://AKIAEXAMPLE:wJalr@bucket/images", "train", options)
    identity = key.identity()
    assert "http://a:9000" in identity and "AKIAEXAMPLE" not in identity and "wJalr" not in identity
    other = ListingKey.of("imagefolder", "s3://AKIAEXAMPLE:wJalr@bucket/images", "train",
                          {**options, "client_kwargs": {"endpoint_url": "http://b:9000"}})
    assert other.path(Path("/c")) != key.path(Path("/c"))  # the same bucket name elsewhere: another dataset
    rotated = ListingKey.of("imagefolder", "s3://bucket/images", "train", {**options, "secret": "rotated"})
    assert rotated.endpoint == key.endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://env:9000")
    assert "http://env:9000" in ListingKey.of("imagefolder", "s3://bucket/images", "train", None).identity()


def test_locations_that_are_not_saved():
    import fsspec

    assert not remote_listing.saves_listing(fsspec.filesystem("file"), "/data/images")
    assert not remote_listing.saves_listing(fsspec.filesystem("memory"), "/data/images")
    http = fsspec.filesystem("http")
    assert not remote_listing.saves_listing(http, "http://user:hunter2@host/images")  # it would cache the password
    assert remote_listing.saves_listing(http, "http://host/images")


def test_a_million_file_listing_opens_in_milliseconds(tmp_path):
    count = 1_000_000
    names = np.char.add(b"bucket/imagenet/train/n01440764/", np.char.zfill(np.arange(count).astype("S8"), 8))
    listing = SavedListing(root="bucket/imagenet/train", files=names, sizes=np.full(count, 110_000, np.int64),
                           mtimes=np.full(count, b"2026-12-01 20:04:05+00:00"), etags=np.full(count, b'"0123abcd"'),
                           fingerprint="f" * 16, classes=["n01440764"], arrays={"labels": np.zeros(count, np.int64)},
                           listed_at=time.time())
    key = ListingKey.of("imagefolder", "s3://bucket/imagenet", "train", None)
    assert remote_listing.save(tmp_path / "listing", listing, key)
    started = time.perf_counter()
    loaded = remote_listing.load(tmp_path / "listing", key)
    took = time.perf_counter() - started
    assert loaded is not None and loaded.cached and len(loaded.files) == count
    assert isinstance(loaded.files, np.memmap) and loaded.files[-1] == names[-1]
    assert took < 0.5, f"{took:.3f} s to open a 1M-file listing"
    assert not list(tmp_path.glob("*.tmp-*"))  # written whole, renamed into place
