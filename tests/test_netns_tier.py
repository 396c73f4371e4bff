"""The namespaced storage tier (tests/netns_tier.py): its link rate and first-byte delay hold on real sockets,
its bucket holds the served files, it is unreachable from the host, nothing of it outlives its with-block,
and loadopt's bench reads a WebDataset from it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from .conftest import make_image_folder, tiny_config_dict
from .netns_tier import HTTP_PORT, namespaced_tier, netns_unavailable, remove_stale_namespaces
from .source_files import folder_samples, write_shards

REASON = netns_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no namespaced tier here ({REASON}); the emulated tier "
                                                          "(tests/test_emulated_tier.py) is tested instead")

BLOB_BYTES = 4 << 20
DELAY_MS = 30.0
RANGE_BYTES = 1024
# What the host, a busy 2-core machine, adds to a delayed small request: the proxy's hop and the server's own
# answer (moto's is slowest, a few ms) at worst; a delay applied twice would exceed it.
MARGIN_MS = 25.0

_GET_SECONDS = """
import http.client, sys, time
port, path = int(sys.argv[1]), sys.argv[2]
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
for _ in range(int(sys.argv[3])):
    start = time.perf_counter()
    connection.request("GET", path)
    response = connection.getresponse()
    body = response.read()
    print(time.perf_counter() - start, response.status, len(body))
"""

# The same GET on `n` connections at once: the seconds until the last answer is whole.
_PARALLEL_GETS = """
import http.client, sys, time
from concurrent.futures import ThreadPoolExecutor
port, path, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def get(_):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", path)
    return len(connection.getresponse().read())
start = time.perf_counter()
with ThreadPoolExecutor(n) as pool:
    sizes = list(pool.map(get, range(n)))
print(time.perf_counter() - start, *sizes)
"""

# Ten range requests in turn on one connection: seconds each, and whether every one reused the first socket.
_HTTP_RANGES = """
import http.client, json, sys, time
port, path, size, expected = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), open(sys.argv[4], "rb").read()
connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
connection.connect()
first_socket, seconds, same = connection.sock, [], True
for i in range(10):
    start = time.perf_counter()
    connection.request("GET", path, headers={"Range": f"bytes={i * size}-{(i + 1) * size - 1}"})
    response = connection.getresponse()
    body = response.read()
    seconds.append(time.perf_counter() - start)
    same = same and response.status == 206 and body == expected[i * size:(i + 1) * size]
    same = same and connection.sock is first_socket
print(json.dumps({"seconds": seconds, "ok": same}))
"""

_S3_RANGES = """
import json, sys, time
import boto3
bucket, key, size, expected = sys.argv[1], sys.argv[2], int(sys.argv[3]), open(sys.argv[4], "rb").read()
s3 = boto3.client("s3")  # the endpoint, region and credentials from the tier's AWS_* variables
seconds, same = [], True
for i in range(10):
    start = time.perf_counter()
    body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={i * size}-{(i + 1) * size - 1}")["Body"].read()
    seconds.append(time.perf_counter() - start)
    same = same and body == expected[i * size:(i + 1) * size]
print(json.dumps({"seconds": seconds, "ok": same}))
"""

_BUCKET_MATCHES_ROOT = """
import json, sys
from pathlib import Path
import boto3
root, bucket = Path(sys.argv[1]), sys.argv[2]
s3 = boto3.client("s3")
pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
keys = [listed["Key"] for page in pages for listed in page.get("Contents", [])]
files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
differ = [k for k in files if s3.get_object(Bucket=bucket, Key=k)["Body"].read() != (root / k).read_bytes()]
print(json.dumps({"keys": sorted(keys), "files": files, "differ": differ}))
"""


@pytest.fixture(scope="module")
def served_root(tmp_path_factory) -> Path:
    """A 4 MiB blob, and a 64-sample WebDataset (two tar shards of small JPEGs) under data/train/."""
    root = tmp_path_factory.mktemp("netns-root")
    (root / "blob.bin").write_bytes(os.urandom(BLOB_BYTES))
    images = tmp_path_factory.mktemp("netns-images")
    make_image_folder(images, classes=4, per_class=16)
    write_shards(root / "data" / "train", folder_samples(images), per_shard=32)
    return root


@pytest.fixture(scope="module")
def tier_40(served_root, tmp_path_factory):
    with namespaced_tier(served_root, tmp_path_factory.mktemp("netns-40"), rate_mbit=40, first_byte_ms=0) as tier:
        yield tier


@pytest.fixture(scope="module")
def tier_400(served_root, tmp_path_factory):
    with namespaced_tier(served_root, tmp_path_factory.mktemp("netns-400"), rate_mbit=400, first_byte_ms=0) as tier:
        yield tier


@pytest.fixture(scope="module")
def tier_per_connection(served_root, tmp_path_factory):
    with namespaced_tier(served_root, tmp_path_factory.mktemp("netns-conn"), rate_mbit=400, first_byte_ms=0,
                         conn_rate_mbit=40) as tier:
        yield tier


@pytest.fixture(scope="module")
def tier_delayed(served_root, tmp_path_factory):
    with namespaced_tier(served_root, tmp_path_factory.mktemp("netns-delay"), rate_mbit=400,
                         first_byte_ms=DELAY_MS) as tier:
        yield tier


def _run_json(tier, script: str, *args: object) -> dict:
    done = tier.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _get_seconds(tier, path: str, times: int) -> list[float]:
    """Seconds of `times` whole GETs of `path` in turn on one connection, timed inside the namespace."""
    argv = [sys.executable, "-c", _GET_SECONDS, str(HTTP_PORT), path, str(times)]
    done = tier.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines()]
    assert [(status, int(size)) for _, status, size in rows] == [("200", BLOB_BYTES)] * times
    return [float(seconds) for seconds, _, _ in rows]


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_link_holds_its_rate_and_a_faster_link_is_faster(tier_40, tier_400):
    expected = BLOB_BYTES * 8 / 40e6
    (at_40,) = _get_seconds(tier_40, "/blob.bin", 1)
    print(f"4 MiB at 40 Mbit/s: {at_40:.3f} s (expected {expected:.3f} s)")
    assert 0.75 * expected <= at_40 <= 1.25 * expected
    at_400 = min(_get_seconds(tier_400, "/blob.bin", 3))
    print(f"4 MiB at 400 Mbit/s: {at_400:.3f} s (expected {expected / 10:.3f} s)")
    assert at_400 < at_40 / 3  # shaped: 10x the rate is far faster, where a slow machine would make both slow


def test_each_connection_holds_its_own_rate_and_connections_add_up(tier_per_connection):
    expected = BLOB_BYTES * 8 / 40e6  # one connection at 40 Mbit/s, under a 400 Mbit/s link
    (one,) = _get_seconds(tier_per_connection, "/blob.bin", 1)
    assert 0.75 * expected <= one <= 1.25 * expected, (one, expected)
    done = tier_per_connection.run([sys.executable, "-c", _PARALLEL_GETS, str(HTTP_PORT), "/blob.bin", "4"],
                                   capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, *sizes = done.stdout.split()
    assert [int(n) for n in sizes] == [BLOB_BYTES] * 4
    assert float(seconds) < 2 * expected  # four connections at once: ~4x one's rate, not one rate shared


def _latencies_ms(result: dict) -> list[float]:
    assert result["ok"], "a range answered wrongly, or the connection was not kept alive"
    return [s * 1000 for s in result["seconds"]]


@pytest.mark.timing
def test_every_request_on_a_kept_alive_http_connection_pays_the_first_byte_delay(tier_delayed, served_root):
    result = _run_json(tier_delayed, _HTTP_RANGES, HTTP_PORT, "/blob.bin", RANGE_BYTES, served_root / "blob.bin")
    latencies = _latencies_ms(result)
    print("HTTP ranges, ms:", [round(ms, 1) for ms in latencies])
    assert min(latencies) >= DELAY_MS and statistics.median(latencies) < DELAY_MS + MARGIN_MS


@pytest.mark.timing
def test_every_s3_range_get_pays_the_first_byte_delay(tier_delayed, served_root):
    # moto's server closes the connection after each answer, so boto3 connects per request here (unlike S3's
    # kept-alive connections): the delay per request is what holds, the HTTP test holds it on one connection
    result = _run_json(tier_delayed, _S3_RANGES, tier_delayed.bucket, "blob.bin", RANGE_BYTES, served_root / "blob.bin")
    latencies = _latencies_ms(result)
    print("S3 ranges, ms:", [round(ms, 1) for ms in latencies])
    assert min(latencies) >= DELAY_MS and statistics.median(latencies) < DELAY_MS + MARGIN_MS


def test_the_bucket_holds_every_file_of_the_root(tier_400, served_root):
    result = _run_json(tier_400, _BUCKET_MATCHES_ROOT, served_root, tier_400.bucket)
    assert len(result["files"]) == 3 and result["keys"] == result["files"] and result["differ"] == []


def test_the_tier_answers_inside_its_namespace_only(tier_400):
    index = f"import urllib.request; print(urllib.request.urlopen('{tier_400.http_url}/').read().decode())"
    inside = tier_400.run([sys.executable, "-c", index], capture_output=True, text=True, timeout=30)
    assert "blob.bin" in inside.stdout  # nginx's index of the root, through the proxy
    try:
        connection = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=2)
        connection.request("GET", "/")
        outside = connection.getresponse().read().decode(errors="replace")
    except OSError:
        return  # nothing listens there on the host
    assert "blob.bin" not in outside


@pytest.mark.parametrize("fails", [False, True], ids=["exits", "raises"])
def test_nothing_outlives_the_with_block(served_root, tmp_path, fails):
    with pytest.raises(KeyError, match="own error") if fails else contextlib.nullcontext(), \
            namespaced_tier(served_root, tmp_path, rate_mbit=100, first_byte_ms=1) as tier:
        assert tier.name in _namespaces() and all(_alive(pid) for pid in tier.pids) and len(tier.pids) == 4
        if fails:
            raise KeyError("the with-block's own error")
    assert tier.name not in _namespaces()
    assert [pid for pid in tier.pids if _alive(pid)] == []


def test_a_failed_start_leaves_nothing_behind(served_root, tmp_path):
    # The other tests' tiers are up, and another test run may be adding its own: only this process's count
    mine = f"loadopt-{os.getpid()}-"
    namespaces = {name for name in _namespaces() if name.startswith(mine)}
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    # botocore refuses the bucket's name, after the servers started
    with pytest.raises(RuntimeError, match="uploading .* failed"), \
            namespaced_tier(served_root, tmp_path, rate_mbit=100, first_byte_ms=0, bucket="not a bucket!"):
        pytest.fail("the tier started")
    assert (tmp_path / "nginx.log").exists() and (tmp_path / "moto.log").exists()
    assert {name for name in _namespaces() if name.startswith(mine)} == namespaces
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()]
    assert [c for c in left if c.status() != psutil.STATUS_ZOMBIE] == []


def test_stale_namespaces_of_gone_processes_are_removed():
    dead_pid = _exited_pid()
    stale, live = f"loadopt-{dead_pid}-0badc0de", f"loadopt-{os.getpid()}-0badc0de"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        removed = remove_stale_namespaces()
        assert stale in removed and live not in removed
        assert stale not in _namespaces() and live in _namespaces()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _exited_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_loadopt_bench_reads_a_webdataset_from_the_tier(tier_400, tmp_path):
    # the undelayed tier: at 30 ms a request, one read a sample, the bench's indexing and batches take 3x longer
    config = tiny_config_dict(tmp_path / "results", dataset={"path": f"{tier_400.http_url}/data",
                                                             "format": "webdataset"},
                              pipeline={"batch_size": 8, "image_size": 32},
                              workload={"warmup_batches": 1, "measure_batches": 4, "repeats": 1},
                              loaders={"torch": {"variant": "plain", "num_workers": 0}})
    del config["dataset"]["synthetic"]
    path = tmp_path / "netns.yaml"
    path.write_text(yaml.safe_dump(config))
    done = tier_400.run([sys.executable, "-m", "loadopt", "bench", str(path), "--quick", "--loaders", "torch"],
                        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "samples/s" in done.stdout
    (run,) = json.loads((tmp_path / "results" / "results.json").read_text())["runs"]
    assert run["status"] == "ok" and run["metrics"]["samples_per_s"]["median"] > 0
    assert run["metrics"]["tier_bytes"]["median"] > 0  # read over the tier's HTTP, not from a local copy
