"""The HTTP server of the shard cache's tests (tests/test_shard_cache*.py): tar shards and Parquet files of
a few photos, counting the requests it answers, and the configs that read them through a cache."""

from __future__ import annotations

import contextlib
import threading
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

from loadopt.config import config_from_dict
from loadopt.storage.remote.shard_cache import CacheCounters, shard_files_in_order
from loadopt.storage.sources.shards import shard_table

from .servers import RangeRequestHandler


class CountingHandler(RangeRequestHandler):
    """The test server's range handler, counting the requests it answers (GET and HEAD)."""

    requests = 0
    lock = threading.Lock()

    def send_head(self):
        with CountingHandler.lock:
            CountingHandler.requests += 1
        return super().send_head()


@contextlib.contextmanager
def counting_server(root: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(CountingHandler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def cache_config(path: str, limit=None, **storage):
    return config_from_dict({"dataset": {"path": path}, "storage": {"cache_limit": limit, **storage},
                             "pipeline": {"batch_size": 4, "image_size": 24, "augment": "eval"}}, "cache.yaml")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def dataset_files(dataset) -> list[str]:
    return shard_files_in_order(dataset, list(range(shard_table(dataset).num_shards)))


def cache_counters_of(fs) -> CacheCounters:
    return fs.cache_counters()

