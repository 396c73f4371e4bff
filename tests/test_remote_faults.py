"""A remote dataset's server failing or changing: a busy server retried, a listing that waits for it, a shard
rewritten on the server delivering its new labels after --relist, never served as damaged samples."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from loadopt import make_loader
from loadopt.cli import app

from .faults import images, said, write_config


def _served_shards(tmp_path, labels=None):
    """Tar shards of 10 photos (5 a shard) in `tmp_path/site/shards` (`labels`: each sample's label, else its
    class), served by a shaped loopback server; (server, config reading them over HTTP, the samples)."""
    from .shaped_server import shaped_server
    from .source_files import folder_samples, write_shards

    root, _ = images(tmp_path, corrupt=0)
    samples = folder_samples(root)
    if labels is not None:
        samples = [(key, label, data) for (key, _, data), label in zip(samples, labels, strict=True)]
    write_shards(tmp_path / "site" / "shards", samples, per_shard=5)
    server = shaped_server(tmp_path / "site")
    config = write_config(tmp_path, dataset={"path": f"{server.url}/shards", "format": "webdataset"},
                          storage={"tier": {"retry": {"max_attempts": 4, "base_delay_s": 0.01, "max_delay_s": 0.05,
                                                      "max_retry_after_s": 1}}},
                          loaders={"torch": {"variant": "plain", "num_workers": 0}})
    return server, config, samples


def test_a_busy_http_server_is_retried_and_the_convert_and_bench_succeed(tmp_path, own_cache):
    """503 Service Unavailable with Retry-After for the first requests of a read: retried (waiting what it asks,
    within storage.tier.retry's bound), and the conversion and the bench go on as if the server had answered."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    server, config, _ = _served_shards(tmp_path)
    try:
        listed = CliRunner().invoke(app, ["make-dataset", str(config)])
        assert listed.exit_code == 0, listed.output
        server.busy(2, retry_after=1)
        converted = CliRunner().invoke(app, ["convert", str(config), "--to", "raw"])
        assert converted.exit_code == 0, converted.output
        assert server.shape.busy_left == 0  # both 503s were answered, and read past
        server.busy(2, retry_after=1)
        benched = CliRunner().invoke(app, ["bench", str(config)])
        assert benched.exit_code == 0, benched.output
        assert server.shape.busy_left == 0
        runs = json.loads((tmp_path / "results" / "results.json").read_text())["runs"]
        assert runs and all(r["status"] == "ok" for r in runs), [r.get("reason") for r in runs]
        assert all(not r.get("skipped_files") for r in runs)
    finally:
        server.die()


@pytest.mark.parametrize("ranges", [True, False], ids=["ranges", "no-ranges"])
def test_a_shard_rewritten_on_the_server_delivers_its_new_labels_after_relist(tmp_path, own_cache, ranges):
    """A tar shard rewritten on the HTTP server between runs (the same size, every `.cls` changed, a later
    Last-Modified): `--relist` takes the server's word for it, so the shards are indexed again (the old index is
    not reused), their copies in the shard cache are not read, and the loader delivers the new labels; a server
    without Range support too."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    import os

    import numpy as np

    from loadopt.config import load_config
    from loadopt.storage.open import open_dataset

    from .source_files import write_shards

    server, config, samples = _served_shards(tmp_path)
    if not ranges:
        server.without_ranges()
    try:
        cfg = load_config(config)
        cached = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"cache_limit": 1 << 30})})

        def labels(relist: bool) -> list[int]:
            loader = make_loader(config, backend="torch", num_workers=0, relist=relist, shuffle="none",
                                 drop_last=False, augment="eval")
            try:
                return [int(v) for _, batch in loader for v in batch.tolist()]
            finally:
                loader.close()

        before = labels(relist=False)
        first = open_dataset(cached)
        old_bytes = [first.fs.cat_file(name.decode()) for name in first.shards]  # copies now in the shard cache
        assert sorted(before) == sorted(label for _, label, _ in samples)
        shards = sorted((tmp_path / "site" / "shards").glob("*.tar"))
        sizes = [p.stat().st_size for p in shards]
        write_shards(tmp_path / "site" / "shards", [(k, 1 - label, d) for k, label, d in samples], per_shard=5)
        for path in shards:  # a later Last-Modified, as a rewrite on the server gives (whatever the clock's grain)
            os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 120))
        assert [p.stat().st_size for p in shards] == sizes  # the same sizes: only what the server says tells
        assert labels(relist=False) == before  # the saved listing, as documented: no request asks the server
        after = labels(relist=True)
        assert after == [1 - label for label in before]
        again = open_dataset(cached, relist=True)
        assert np.array_equal(again.labels, 1 - first.labels)
        assert [again.fs.cat_file(name.decode()) for name in again.shards] == [p.read_bytes() for p in shards]
        assert [again.fs.cat_file(name.decode()) for name in again.shards] != old_bytes
    finally:
        server.die()


def test_a_shard_rewritten_with_its_members_moved_is_a_changed_dataset_not_skipped_samples(tmp_path, own_cache):
    """A shard rewritten on the server with its members at other offsets (a member added in front), read under
    the saved listing: each read brings the member's tar header along, which no longer matches, so the run
    stops on one line saying the dataset changed and to relist, even under on_error: skip (the images were
    handed on as damaged before, every one of that shard skipped); `relist` reads it right."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    import io
    import tarfile

    from loadopt.errors import DatasetChanged

    server, config, samples = _served_shards(tmp_path)
    import yaml

    document = yaml.safe_load(config.read_text())
    document["dataset"]["on_error"] = "skip"
    config.write_text(yaml.safe_dump(document))
    try:
        def labels(relist: bool) -> list[int]:
            loader = make_loader(config, backend="torch", num_workers=0, relist=relist, shuffle="none",
                                 drop_last=False, augment="eval")
            try:
                return [int(v) for _, batch in loader for v in batch.tolist()]
            finally:
                loader.close()

        before = labels(relist=False)
        shard = sorted((tmp_path / "site" / "shards").glob("*.tar"))[0]
        with tarfile.open(shard) as tar:
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
        rewritten = io.BytesIO()
        with tarfile.open(fileobj=rewritten, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            note = tarfile.TarInfo("a-readme.txt")
            note.size = 3000
            tar.addfile(note, io.BytesIO(b"x" * 3000))
            for member, data in members:
                tar.addfile(member, io.BytesIO(data))
        shard.write_bytes(rewritten.getvalue())
        os.utime(shard, (shard.stat().st_atime, shard.stat().st_mtime + 120))
        with pytest.raises(DatasetChanged) as caught:
            labels(relist=False)
        message = str(caught.value)
        assert "the dataset changed since it was listed" in message and "--relist" in message, message
        assert shard.name in message and "\n" not in message, message
        assert sorted(labels(relist=True)) == sorted(before)
    finally:
        server.die()


def test_a_listing_waits_for_a_busy_server(tmp_path, own_cache):
    """Two 503s (Retry-After: 1) when the dataset is first listed: waited for, then listed whole (it was "shards
    not found" at once)."""
    pytest.importorskip("aiohttp", reason="aiohttp is not installed (pip install -e '.[remote]')")
    server, config, samples = _served_shards(tmp_path)
    try:
        server.busy(2, retry_after=1)
        listed = CliRunner().invoke(app, ["make-dataset", str(config)])
        assert listed.exit_code == 0, listed.output
        assert server.shape.busy_left == 0 and f"{len(samples)} images" in said(listed), listed.output
    finally:
        server.die()
