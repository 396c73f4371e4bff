"""The bad-input cases of a remote dataset's server failing (down, or busy with 503s), for tests/test_bad_inputs.py's
table: tar shards served by a shaped loopback server (tests/shaped_server.py), listed by a first command, then the
server failing under the command of the row. Each says the one line: the storage failure, never a damaged sample."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from loadopt.cli import app

from .faults import Setup, images, temps, write_config
from .shaped_server import ShapedServer, shaped_server
from .source_files import folder_samples, write_shards

FAST_RETRY = {"max_attempts": 2, "base_delay_s": 0.01, "max_delay_s": 0.02, "max_retry_after_s": 0.05}


def _listed_shards(tmp_path, **dataset) -> tuple[ShapedServer, object]:
    """Tar shards of 10 photos served over HTTP, listed (the listing saved) by `make-dataset`; (server, config)."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    root, _ = images(tmp_path, corrupt=0)
    write_shards(tmp_path / "site" / "shards", folder_samples(root), per_shard=5)
    server = shaped_server(tmp_path / "site")
    config = write_config(tmp_path, dataset={"path": f"{server.url}/shards", "format": "webdataset", **dataset},
                          storage={"tier": {"retry": FAST_RETRY}},
                          loaders={"torch": {"variant": "plain", "num_workers": 0}})
    listed = CliRunner().invoke(app, ["make-dataset", str(config)])
    if listed.exit_code != 0:
        server.die()
    assert listed.exit_code == 0, listed.output
    return server, config


def server_down_during_bench(tmp_path, cache):
    """The server stopped after the listing, under `dataset.on_error: skip`: the reads are the storage's failure,
    not unreadable samples; the bench ends in one line naming it, and no decision is written."""
    server, config = _listed_shards(tmp_path, on_error="skip")
    port = server.url.rsplit(":", 1)[-1]
    server.die()
    results = tmp_path / "results"
    return Setup(["bench", str(config)], f"the host 127.0.0.1:{port} refused the connection 2 times over ",
                 config=config, must_not_contain=["skipped", "cannot decode", "Traceback"],
                 after=lambda: not list(results.rglob("decision.json")) or pytest.fail("a decision was written"),
                 close=server.die)


def busy_server_during_convert(tmp_path, cache):
    """The server answering 503 Service Unavailable (Retry-After) to every read of a conversion: one line naming
    the shard and what the server did, never multiprocessing's MaybeEncodingError of aiohttp's error."""
    server, config = _listed_shards(tmp_path)
    server.busy(10**9, retry_after=1)
    return Setup(["convert", str(config), "--to", "raw"], f"{server.url}/shards/train-000000.tar: the server answered "
                 "503 Service Unavailable 2 times over ", config=config, backend="posix",
                 overrides={"form": "encoded"}, leftovers=temps(cache),
                 must_not_contain=["MaybeEncodingError", "Traceback", "pickle"], close=server.die)


def busy_server_while_listing(tmp_path, cache):
    """The server answering 503 Service Unavailable to every request of the first listing: waited for as reads
    are, then one line saying what the server did (fsspec's HTTP driver made it "shards not found")."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    root, _ = images(tmp_path, corrupt=0)
    write_shards(tmp_path / "site" / "shards", folder_samples(root), per_shard=5)
    server = shaped_server(tmp_path / "site")
    config = write_config(tmp_path, dataset={"path": f"{server.url}/shards", "format": "webdataset"})
    server.busy(10**9, retry_after=0)
    return Setup(["make-dataset", str(config)], f"{server.url}/shards: the server answered 503 Service Unavailable 5 "
                 "times over ", config=config, backend="torch", must_not_contain=["not found", "Traceback"],
                 close=server.die)


REMOTE_CASES = {  # name: (setup, exit code)
    "remote server busy (503) while listing, make-dataset": (busy_server_while_listing, 1),
    "remote server down during bench under on_error: skip": (server_down_during_bench, 1),
    "remote server busy (503) during convert": (busy_server_during_convert, 1),
}
