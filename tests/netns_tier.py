"""A remote storage tier with real sockets and real latency, for the tests and `benchmarks/webscale.py`: nginx
(HTTP ranges, directory listings) and moto's S3 server run inside a private network namespace whose
loopback is shaped by `tc` to a link rate, each behind a proxy (tests/delay_proxy.py) that holds every
request for a first-byte delay. Readers run inside the namespace too (`NamespacedTier.command` / `run`):
from the host the tier's ports are not reachable.

Needs root, `ip` and `tc` (iproute2), nginx and moto[server]; `netns_unavailable()` says why not where
one is missing. The emulated tier (`storage.tier` with figures) is the fallback elsewhere. moto's server
(werkzeug's) closes the connection after every answer, so S3 readers connect once per request, where
nginx keeps connections alive: both pay the first-byte delay once per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.servers import nginx_conf

PREFIX = "loadopt-"
HTTP_PORT = 8000  # the delay proxy in front of nginx: what readers connect to
NGINX_PORT = 8001
S3_PORT = 9000  # the delay proxy in front of moto
MOTO_PORT = 9001
# tc's figures: loopback's MTU (GSO sends packets of up to 64 KiB through the qdisc) and the lowest kernel
# tick rate in use (a token bucket refilled per tick must hold a tick's worth of bytes).
LO_MTU = 65536
LOWEST_HZ = 100
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
UPLOAD_TIMEOUT_S = 600.0
PROXY = Path(__file__).with_name("delay_proxy.py")
_STALE = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")

_WAIT_FOR_PORTS = """
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
for port in map(int, sys.argv[2:]):
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"nothing listens on 127.0.0.1:{port}")
            time.sleep(0.05)
"""

_UPLOAD = """
import sys
from pathlib import Path
import boto3
root, bucket, endpoint = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
s3 = boto3.client("s3", endpoint_url=endpoint)
s3.create_bucket(Bucket=bucket)
for path in sorted(p for p in root.rglob("*") if p.is_file()):
    s3.put_object(Bucket=bucket, Key=path.relative_to(root).as_posix(), Body=path.read_bytes())
"""


@dataclasses.dataclass(frozen=True)
class NamespacedTier:
    """A running namespaced tier: its URLs answer inside namespace `name` only."""

    name: str
    http_url: str
    s3_endpoint: str
    bucket: str
    rate_mbit: float
    first_byte_ms: float
    conn_rate_mbit: float  # each connection's own limit (0: none), under the link's rate_mbit
    env: dict[str, str]
    pids: tuple[int, ...]  # the servers and proxies started for it, all gone after the with-block

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """subprocess.run of `argv` inside the namespace, the tier's AWS_* variables added to the environment."""
        env = {**os.environ, **self.env, **kwargs.pop("env", {})}
        return subprocess.run(self.command(argv), env=env, **kwargs)


def _ip(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True, timeout=timeout)


def _in_namespace(name: str, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    return _ip("netns", "exec", name, *argv, timeout=timeout)


def _last_line(error: subprocess.CalledProcessError) -> str:
    lines = ((error.stderr or "") + (error.stdout or "")).strip().splitlines()
    return lines[-1] if lines else f"exit status {error.returncode}"


def _shape(name: str, rate_mbit: float, ports: tuple[int, ...]) -> None:
    """Shape the namespace's loopback to `rate_mbit` each way on the connections to `ports`.

    htb with a rate class rather than tbf on the whole device: a proxied byte crosses loopback twice (server
    to proxy, proxy to reader), so only the reader's leg is shaped (u32 on the proxies' ports); the rest
    (proxy to server, uploads, readiness probes) is unclassified and goes out unshaped (`default 0`). One
    class a direction, since loopback carries both directions of a connection: the responses do not queue
    behind the requests, as on a full-duplex link. (tbf on loopback, whose MTU is 64 KiB, drops every
    packet larger than its burst or its limit, and TCP stalls on it: it needs both above 64 KiB.)
    """
    rate_bits = int(rate_mbit * 1e6)
    # htb sends a packet larger than its burst by going into debt, so the rate holds with any burst (a
    # 1,600-byte one too); the burst sets how far ahead of the rate a class runs after idling: a tick's worth,
    # so a timer that fires a tick late loses no rate, and two loopback packets, a 3% head start on 4 MiB at 40 Mbit/s.
    burst = max(rate_bits // 8 // LOWEST_HZ, 2 * LO_MTU)
    _in_namespace(name, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "0")
    for classid, match in (("1:1", "sport"), ("1:2", "dport")):
        _in_namespace(name, "tc", "class", "add", "dev", "lo", "parent", "1:", "classid", classid, "htb",
                      "rate", f"{rate_bits}bit", "ceil", f"{rate_bits}bit", "burst", str(burst), "cburst", str(burst))
        for port in ports:
            _in_namespace(name, "tc", "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1",
                          "u32", "match", "ip", "protocol", "6", "0xff", "match", "ip", match, str(port), "0xffff",
                          "flowid", classid)


def _delete_namespace(name: str) -> None:
    """Kill whatever still runs in namespace `name` (all of it started by this module), then delete it."""
    with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
        for pid in _ip("netns", "pids", name).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
        _ip("netns", "del", name)


def _namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Delete the `loadopt-<pid>-*` namespaces whose process is gone (a killed test run leaves them); their names."""
    removed = []
    for name in _namespaces():
        match = _STALE.match(name)
        if match is not None and not _running(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


def _running(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (killed, its parent yet to reap it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # the state follows the command's name in parentheses


def _new_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


@functools.lru_cache(maxsize=1)
def netns_unavailable() -> str | None:
    """None where a namespaced tier can run here, else why not, in one line (probed once per process)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces and tc need root (run the tests as root, e.g. in a container)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nginx", "nginx-light")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (apt-get install {package})"
    # moto's server runs on flask (the [server] extra); find_spec looks without importing either
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        return "moto[server] is not installed (pip install -e '.[test]')"
    remove_stale_namespaces()
    name = _new_name()
    try:
        _ip("netns", "add", name)
        _in_namespace(name, "ip", "link", "set", "lo", "up")
        _shape(name, 40.0, (HTTP_PORT,))
    except subprocess.CalledProcessError as error:
        return f"cannot make and shape a network namespace here: {' '.join(error.cmd[:6])}...: {_last_line(error)}"
    finally:
        _delete_namespace(name)
    return None


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


class _Processes:
    """The processes started inside one namespace, their output in log files under `work`."""

    def __init__(self, name: str, work: Path) -> None:
        self.name, self.work = name, work
        self.started: list[tuple[str, subprocess.Popen, Path]] = []

    def start(self, label: str, argv: list[str], stdout: int | None = None) -> subprocess.Popen:
        log = self.work / f"{label}.log"
        with open(log, "wb") as handle:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], stdin=subprocess.DEVNULL,
                                    stdout=stdout if stdout is not None else handle, stderr=handle,
                                    start_new_session=True)  # a Ctrl-C meant for pytest does not reach it first
        self.started.append((label, proc, log))
        return proc

    def check_running(self) -> None:
        for label, proc, log in self.started:
            if proc.poll() is not None:
                raise RuntimeError(f"{label} exited with {proc.returncode} in namespace {self.name}: {_log_tail(log)}")

    def wait_for_ports(self, ports: tuple[int, ...], deadline: float) -> None:
        probe = subprocess.Popen(["ip", "netns", "exec", self.name, sys.executable, "-c", _WAIT_FOR_PORTS,
                                  str(max(0.0, deadline - time.monotonic())), *map(str, ports)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while True:
                try:
                    _, errors = probe.communicate(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    self.check_running()  # a server that died is reported now, with its log, not at the deadline
        finally:
            if probe.poll() is None:
                probe.kill()
                probe.wait()
        self.check_running()
        if probe.returncode != 0:
            raise RuntimeError(f"namespace {self.name}: {errors.decode(errors='replace').strip()}")

    def wait_for_ready_line(self, proc: subprocess.Popen, label: str, deadline: float) -> None:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            readable, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if readable:
                line = proc.stdout.readline().decode(errors="replace")
                if line.startswith("ready"):
                    return
                self.check_running()
                if not line:
                    break
        log = self.work / f"{label}.log"
        raise RuntimeError(f"{label} did not say ready in namespace {self.name}: {_log_tail(log)}")

    def stop(self) -> None:
        for _, proc, _ in self.started:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for _, proc, _ in self.started:
            try:
                proc.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _start(name: str, processes: _Processes, root: Path, work: Path, rate_mbit: float, first_byte_ms: float,
           bucket: str, env: dict[str, str], upload: bool = True, conn_rate_mbit: float = 0.0) -> None:
    try:
        _ip("netns", "add", name)
        _in_namespace(name, "ip", "link", "set", "lo", "up")
        _shape(name, rate_mbit, (HTTP_PORT, S3_PORT))
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"namespace {name}: {' '.join(error.cmd)}: {_last_line(error)}") from None
    deadline = time.monotonic() + START_TIMEOUT_S
    conf = work / "nginx.conf"
    conf.write_text(nginx_conf(root, work, NGINX_PORT))
    processes.start("nginx", [shutil.which("nginx") or "nginx", "-c", str(conf), "-p", str(work)])
    processes.start("moto", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(MOTO_PORT)])
    proxies = {}
    for label, listen, target in (("http-proxy", HTTP_PORT, NGINX_PORT), ("s3-proxy", S3_PORT, MOTO_PORT)):
        proxies[label] = processes.start(label, [sys.executable, str(PROXY), "--listen", f"127.0.0.1:{listen}",
                                                 "--to", f"127.0.0.1:{target}", "--first-byte-ms", str(first_byte_ms),
                                                 "--conn-rate-mbit", str(conn_rate_mbit)],
                                         stdout=subprocess.PIPE)
    processes.wait_for_ports((NGINX_PORT, MOTO_PORT), deadline)
    for label, proc in proxies.items():
        processes.wait_for_ready_line(proc, label, deadline)
    if not upload:
        return
    command = [sys.executable, "-c", _UPLOAD, str(root), bucket, f"http://127.0.0.1:{MOTO_PORT}"]
    try:  # straight to moto, not through the shaped proxy: the bucket's contents are set-up, not a measurement
        _in_namespace(name, "env", *(f"{key}={value}" for key, value in env.items()), *command,
                      timeout=UPLOAD_TIMEOUT_S)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        reason = _last_line(error) if isinstance(error, subprocess.CalledProcessError) else "timed out"
        raise RuntimeError(f"uploading {root} to s3://{bucket} in namespace {name} failed: {reason}") from None


@contextlib.contextmanager
def namespaced_tier(root: Path, work: Path, rate_mbit: float, first_byte_ms: float,
                    bucket: str = "data", upload: bool = True, conn_rate_mbit: float = 0.0) -> Iterator[NamespacedTier]:
    """nginx serving `root` and an S3 bucket holding its files (`upload`; else no bucket is made), in a fresh
    namespace shaped to `rate_mbit` each way, every request held `first_byte_ms` before it reaches a server, and
    each connection's answers paced to `conn_rate_mbit` (0: not); all of it gone after the with-block.
    A step that fails to start raises RuntimeError naming it (with its log's last lines)."""
    remove_stale_namespaces()
    root, work = Path(root).resolve(), Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    name = _new_name()
    processes = _Processes(name, work)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_SESSION_TOKEN": "",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}"}
    try:
        _start(name, processes, root, work, rate_mbit, first_byte_ms, bucket, env, upload, conn_rate_mbit)
        yield NamespacedTier(name=name, http_url=f"http://127.0.0.1:{HTTP_PORT}", s3_endpoint=env["AWS_ENDPOINT_URL"],
                             bucket=bucket, rate_mbit=rate_mbit, first_byte_ms=first_byte_ms,
                             conn_rate_mbit=conn_rate_mbit, env=env,
                             pids=tuple(proc.pid for _, proc, _ in processes.started))
    finally:
        processes.stop()
        _delete_namespace(name)
