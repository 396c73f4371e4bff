"""Real storage servers on loopback for the remote-tier tests.

- HTTP: nginx (autoindex, ranges) when the OS has it, else a Python server whose handler answers
  `Range: bytes=...` with 206 Partial Content (http.server's own handler ignores ranges). Both serve
  directory index pages, which is how fsspec lists an ImageFolder over HTTP.
- S3: moto's standalone server (`ThreadedMotoServer`), the way s3fs tests itself, with dummy
  credentials and its endpoint in the environment (AWS_ENDPOINT_URL), as a user would set them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RangeRequestHandler(SimpleHTTPRequestHandler):
    """http.server's file handler plus single byte ranges (RFC 9110 `bytes=a-b`, `a-`, `-n`)."""

    _remaining: int | None = None

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        pass

    def send_head(self):
        match = _RANGE.match(self.headers.get("Range", "").strip())
        path = self.translate_path(self.path)
        if match is None or os.path.isdir(path):
            self._remaining = None
            return super().send_head()
        try:
            handle = open(path, "rb")  # noqa: SIM115 - returned to the base class, which closes it
        except OSError:
            self.send_error(404, "File not found")
            return None
        size = os.fstat(handle.fileno()).st_size
        first, last = match.groups()
        if first == "":
            start, end = max(0, size - int(last or 0)), size - 1
        else:
            start, end = int(first), min(size - 1, int(last)) if last else size - 1
        if start >= size or start > end:
            handle.close()
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.end_headers()
            return None
        handle.seek(start)
        self._remaining = end - start + 1
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(self._remaining))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return handle

    def copyfile(self, source, outputfile) -> None:
        if self._remaining is None:
            return super().copyfile(source, outputfile)
        left = self._remaining
        while left > 0:
            chunk = source.read(min(left, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            left -= len(chunk)


@contextlib.contextmanager
def python_http_server(root: Path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeRequestHandler, directory=str(root)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


_NGINX_CONF = """daemon off;
{user}worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {work}; proxy_temp_path {work}; fastcgi_temp_path {work};
  uwsgi_temp_path {work}; scgi_temp_path {work};
  server {{ listen 127.0.0.1:{port}; root {root}; autoindex on; }}
}}
"""


def nginx_conf(root: Path, work: Path, port: int) -> str:
    """nginx's config serving `root` on 127.0.0.1:`port` (autoindex, ranges), its pid, logs and temp files in `work`."""
    # started as root, nginx's workers drop to `nobody`, who cannot read pytest's private temp folders
    user = "user root;\n" if os.geteuid() == 0 else ""
    return _NGINX_CONF.format(user=user, work=work, port=port, root=root)


@contextlib.contextmanager
def nginx_server(root: Path, work: Path):
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "nginx.conf"
    conf.write_text(nginx_conf(root, work, port))
    proc = subprocess.Popen([shutil.which("nginx"), "-c", str(conf), "-p", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError("nginx did not start listening")


@contextlib.contextmanager
def http_server(root: Path, work: Path):
    """Serve `root` over HTTP on loopback (nginx when installed and it starts, else Python); yields the URL."""
    if shutil.which("nginx") and os.environ.get("LOADOPT_TEST_NGINX", "1") != "0":
        try:
            with nginx_server(root, work) as url:
                yield url
            return
        except RuntimeError:
            pass  # nginx present but cannot run here (permissions, ...): the Python server will do
    with python_http_server(root) as url:
        yield url


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a free loopback port; dummy credentials and the endpoint in the environment."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[remote]')")
    port = free_port()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the request log, one line per S3 call
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_SESSION_TOKEN": "",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # none made before under other credentials or endpoints
    try:
        yield endpoint
    finally:
        restore_environment(saved)
        server.stop()


def restore_environment(saved: dict[str, str | None]) -> None:
    """Put the environment variables `saved` back as they were (None: it was not set)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
