"""A loopback HTTP server whose behaviour a test shapes while it runs, for the remote fault tests
(tests/test_faults.py, tests/bad_remote_inputs.py): it serves a folder as tests/servers.py's range server does,
and can answer `503 Service Unavailable` (with `Retry-After`) to the next N requests, refuse byte ranges (a server
without Range support answers 200 with the whole file), and die (stop listening: the next connection is refused).
A file rewritten in the served folder is served as it is now (with its new Last-Modified)."""

from __future__ import annotations

import threading
from functools import partial
from http.server import ThreadingHTTPServer
from pathlib import Path

from .servers import RangeRequestHandler


class ShapedHandler(RangeRequestHandler):
    """The range handler, answering as its server's `Shape` says."""

    server: ShapedServer

    def send_head(self):
        shape = self.server.shape
        with shape.lock:
            shape.requests += 1
            busy = shape.busy_left > 0
            if busy:
                shape.busy_left -= 1
        if busy:
            self.send_response(503)
            if shape.retry_after is not None:
                self.send_header("Retry-After", str(shape.retry_after))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if not shape.ranges and "Range" in self.headers:
            del self.headers["Range"]  # answered whole, 200, as a server that ignores ranges does
        return super().send_head()


class Shape:
    """What the server does now (changed from the test's thread; read under `lock` by the handlers)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = 0  # every request answered, 503s included
        self.busy_left = 0
        self.retry_after: int | None = None
        self.ranges = True


class ShapedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), partial(ShapedHandler, directory=str(root)))
        self.shape = Shape()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        self._dead = False

    def busy(self, requests: int, retry_after: int | None = 1) -> None:
        """Answer the next `requests` requests `503 Service Unavailable`, with `Retry-After: retry_after`."""
        with self.shape.lock:
            self.shape.busy_left, self.shape.retry_after = requests, retry_after

    def without_ranges(self) -> None:
        """Answer every request with the whole file (200), as a server without Range support."""
        self.shape.ranges = False

    def die(self) -> None:
        """Stop listening: connections from now on are refused."""
        if not self._dead:
            self._dead = True
            self.shutdown()
            self.server_close()


def shaped_server(root: Path) -> ShapedServer:
    """A shaped server of `root` on a free loopback port, serving already; `die()` it when done."""
    return ShapedServer(root)
