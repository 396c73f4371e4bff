"""`loadopt convert --engine ray` as a user runs it, with Ray's processes killed under it: a Ray worker killed
mid-shard (Ray runs the task again; the conversion on the local disk), and a two-node cluster (`ray start --head`
and `ray start --address`, both on 127.0.0.1: this machine's default address is not the loopback) whose second
node is killed mid-conversion, converting photos on S3 (moto's server on loopback) into a home on S3
(`storage.converted`), as a cluster's nodes, which share no disk, would. Each time the conversion finishes and its
files are byte for byte those of `--engine local` on the local disk. Every Ray process is stopped at the end,
whatever the test did."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from loadopt.config_models import SyntheticSpec
from loadopt.storage.sources.synthetic import ensure_synthetic

from .servers import free_port, s3_endpoint  # noqa: F401 - a fixture
from .test_remote_conversion import BUCKET, s3_fs

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

RAY = str(Path(sys.executable).with_name("ray"))
CONVERT = ["convert", "--to", "raw", "--decoded", "--size", "112", "--shard-mib", "1"]
PIPELINE = {"image_size": 96, "augment": "eval"}
DATA = (".bin", ".npy")  # a raw conversion's shard data and index rows (its manifest records when and how)
# No way to S3 but the config's storage_options, for the driver and every Ray process: the endpoint in the
# environment leads nowhere and there are no credentials, so a client made without them fails instead of
# reaching moto (or writing anywhere else).
NO_S3 = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_EC2_METADATA_DISABLED": "true",
         "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """480 synthetic photos (20 shards of 1 MiB decoded) as an ImageFolder on the local disk, a config reading
    them there, and the files of its local conversion by name: their sha256."""
    folder = tmp_path_factory.mktemp("ray-cluster")
    spec = SyntheticSpec(num_samples=480, num_classes=4, mean_width=320, mean_height=256, seed=5)
    images = folder / "photos"
    images.mkdir()
    (ensure_synthetic(spec, folder / "generated") / "train").rename(images / "train")
    config = folder / "photos.yaml"
    config.write_text(yaml.safe_dump({"dataset": {"path": str(images)}, "pipeline": PIPELINE,
                                      "report": {"out": str(folder / "out")}}))
    done = _loadopt(folder, [*CONVERT[:1], str(config), *CONVERT[1:]])
    assert done.returncode == 0, done.stderr
    return config, images, _digests(_conversion(folder))


def _loadopt(folder: Path, args: list[str], ray_env: dict | None = None, **popen):
    env = {**_without_s3(), **(ray_env or {}), "LOADOPT_CACHE": str(folder / "cache")}
    command = [sys.executable, "-m", "loadopt", *args]
    if popen:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _without_s3() -> dict[str, str]:
    """This process's environment with no AWS settings but `NO_S3`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **NO_S3}


def _conversion(folder: Path) -> Path:
    (found,) = (folder / "cache" / "raw").glob("*-decoded-*")
    return found


def _digests(conversion: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(conversion.iterdir())}


def _kill_a_task_while(running: subprocess.Popen, under: Callable[[psutil.Process], bool]) -> int:
    """SIGKILL the first Ray worker seen running a shard (`under` it: on the wanted node) while the conversion
    `running` runs; its pid (0 if the conversion ended first)."""
    while running.poll() is None:
        for proc in psutil.process_iter(["cmdline"]):
            line = proc.info["cmdline"] or []
            if line and line[0].startswith("ray::write_shard_task") and under(proc):
                proc.send_signal(signal.SIGKILL)
                return proc.pid
        time.sleep(0.005)
    return 0


def _finished(running: subprocess.Popen) -> tuple[int, str, str]:
    out, err = running.communicate(timeout=300)
    return running.returncode, out, err


def test_a_killed_ray_worker_is_retried_into_the_same_conversion(photos, tmp_path):
    config, _, expected = photos
    folder = Path(config).parent
    running = _loadopt(folder, [*CONVERT[:1], str(config), *CONVERT[1:], "--force", "--engine", "ray",
                                "--num-cpus", "2"], popen=True)
    killed = _kill_a_task_while(running, lambda proc: True)
    code, out, err = _finished(running)
    assert killed, "the conversion ended before a task could be killed"
    assert code == 0, err
    assert "converted in" in out
    assert _digests(_conversion(folder)) == expected


# The GCS's health checks of the nodes: a raylet that stops answering is declared dead after about 3 s instead of
# Ray's 15 s or more (every 3 s, 5 missed), and its tasks run again elsewhere sooner: most of the wait after the kill.
NODE_DEATH_SEEN_IN_SECONDS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                              "RAY_health_check_failure_threshold": "3"}


@pytest.fixture
def two_nodes(tmp_path):
    """A head node and a second node on this machine, one CPU each, with Ray's token authentication (on by
    default for a head since Ray 2.59; a joining node and the driver need the same token), and no way to S3 in
    their environment (`NO_S3`), their cache `nodes-cache`; yields (address, the second node's raylet, the
    environment that reaches them). Every process of the cluster is killed at the end, whatever happened."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), **NODE_DEATH_SEEN_IN_SECONDS}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    nodes = {**_without_s3(), **env, "LOADOPT_CACHE": str(tmp_path / "nodes-cache")}
    started = {"env": nodes, "check": True, "capture_output": True, "timeout": 120}
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false", *common],
                       **started)
        (head,) = _raylets(port)
        subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", *common], **started)
        (second,) = [p for p in _raylets(port) if p.pid != head.pid]
        yield f"127.0.0.1:{port}", second, env
    finally:
        _stop_cluster(port)


def _raylets(port: int) -> list[psutil.Process]:
    """The raylets (a node each) of the cluster whose head listens on `port`, not those of any other Ray here."""
    return [p for p in psutil.process_iter(["name", "cmdline"]) if p.info["name"] == "raylet"
            and _of_cluster(p.info["cmdline"] or [], port)]


def _stop_cluster(port: int) -> None:
    """SIGKILL every process of the cluster whose head listens on `port` (as `ray stop --force` does), and only
    those: `ray stop` stops every Ray on this machine, another test's or user's too. Its processes are those that
    name its session (its GCS server, raylets, monitors) and theirs (workers, agents)."""
    procs = list(psutil.process_iter(["cmdline"]))
    sessions = {a.removeprefix("--session-name=") for p in procs if _of_cluster(p.info["cmdline"] or [], port)
                for a in p.info["cmdline"] or [] if a.startswith("--session-name=")}
    doomed = {p for p in procs if any(name in a for name in sessions for a in p.info["cmdline"] or [])}
    for proc in list(doomed):
        with contextlib.suppress(psutil.Error):
            doomed.update(proc.children(recursive=True))
    for proc in doomed:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(doomed), timeout=30)
    # the address a later `ray.init()` on this machine would join (as `ray stop` does, only if it is this one's)
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    with contextlib.suppress(OSError):
        if current.read_text().strip().endswith(f":{port}"):
            current.unlink()


def _of_cluster(args: list[str], port: int) -> bool:
    """Whether a process's command line names the cluster whose head listens on `port` (the GCS server's)."""
    return any(a == f"--gcs_server_port={port}" or a.startswith("--gcs-address=") and a.endswith(f":{port}")
               for a in args)


def test_a_node_killed_mid_conversion_to_s3_leaves_the_same_conversion(photos, s3_endpoint, two_nodes,  # noqa: F811
                                                                       tmp_path):
    """The photos on S3, where every node reads them; their conversion's home on S3 too (`storage.converted`),
    reached through the config's storage_options alone: each task uploads its shard's data, and only the
    reference (manifest, index rows) stays in the driver's cache."""
    _, images, local = photos
    expected = {name: digest for name, digest in local.items() if name.endswith(DATA)}
    fs = s3_fs()  # this process's own client: the endpoint and credentials of its environment
    source, home = f"{BUCKET}/cluster-photos-{tmp_path.name}", f"{BUCKET}/cluster-conversions-{tmp_path.name}"
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    fs.put(f"{images}/", f"{source}/", recursive=True)
    config = tmp_path / "photos-s3.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"tier": {"name": "moto", "base": f"s3://{source}", "storage_options": {
            "endpoint_url": s3_endpoint, "key": "testing", "secret": "testing-secret"}},
            "converted": f"s3://{home}"},
        "pipeline": PIPELINE, "report": {"out": str(tmp_path / "out")}}))
    address, second, ray_env = two_nodes
    running = _loadopt(tmp_path, [*CONVERT[:1], str(config), *CONVERT[1:], "--engine", "ray", "--address",
                                  address], ray_env, popen=True)
    # the second node's first running task: then the node goes, its raylet and every worker of it at once
    node = [second]
    seen = _kill_a_task_while(running, lambda proc: second in proc.parents())
    assert seen, "the conversion ended before the second node ran a shard"
    node += [p for p in second.children(recursive=True) if p.is_running()]
    for proc in node:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    code, out, err = _finished(running)
    assert code == 0, err
    assert "converted in" in out
    on_s3 = {path.rsplit("/", 1)[-1]: path for path in fs.find(home)}
    assert "manifest.json" in on_s3, sorted(on_s3)  # the reference published beside the data, its manifest last
    assert {name: hashlib.sha256(fs.cat_file(path)).hexdigest() for name, path in sorted(on_s3.items())
            if name.endswith(DATA)} == expected
    # nothing written to the local disk instead: the driver's cache holds the reference alone
    assert not list((tmp_path / "cache").rglob("*.bin"))
    here = sorted(p.name for p in _conversion(tmp_path).iterdir())
    assert "manifest.json" in here, here
    assert {name for name in here if name.endswith(DATA)} == {name for name in expected if name.endswith(".npy")}
    assert all(name.endswith((".npy", ".json")) for name in here), here  # the index rows, manifest and entries
    # nor on the nodes: their cache holds no conversion, only what a killed writer may have left (`.*.tmp`)
    assert not [p.name for p in (tmp_path / "nodes-cache").glob("raw/*") if not p.name.startswith(".")]
