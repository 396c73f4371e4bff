"""`loadopt convert --engine ray` as a user runs it, with Ray's processes killed under it: a Ray worker killed
mid-shard (Ray runs the task again), and a two-node cluster (`ray start --head` and `ray start --address`, both on
127.0.0.1: this machine's default address is not the loopback) whose second node is killed mid-conversion. Each
time the conversion finishes and its files are byte for byte those of `--engine local`. Every Ray process is
stopped at the end, whatever the test did."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

RAY = str(Path(sys.executable).with_name("ray"))
CONVERT = ["convert", "--to", "raw", "--decoded", "--size", "112", "--shard-mib", "2"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A config of 1,200 synthetic photos (22 shards of 2 MiB decoded), its cache, and the files of its local
    conversion by name: their sha256."""
    folder = tmp_path_factory.mktemp("ray-cluster")
    config = folder / "photos.yaml"
    config.write_text(yaml.safe_dump({
        "dataset": {"synthetic": {"num_samples": 1200, "num_classes": 4, "mean_width": 320, "mean_height": 256,
                                  "seed": 5}},
        "pipeline": {"image_size": 96, "augment": "eval"}, "report": {"out": str(folder / "out")}}))
    done = _loadopt(folder, [*CONVERT[:1], str(config), *CONVERT[1:]])
    assert done.returncode == 0, done.stderr
    return config, _digests(_conversion(folder))


def _loadopt(folder: Path, args: list[str], ray_env: dict | None = None, **popen):
    env = {**os.environ, **(ray_env or {}), "LOADOPT_CACHE": str(folder / "cache")}
    command = [sys.executable, "-m", "loadopt", *args]
    if popen:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


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
    config, expected = photos
    folder = Path(config).parent
    running = _loadopt(folder, [*CONVERT[:1], str(config), *CONVERT[1:], "--force", "--engine", "ray",
                                "--num-cpus", "2"], popen=True)
    killed = _kill_a_task_while(running, lambda proc: True)
    code, out, err = _finished(running)
    assert killed, "the conversion ended before a task could be killed"
    assert code == 0, err
    assert "converted in" in out
    assert _digests(_conversion(folder)) == expected


@pytest.fixture
def two_nodes(tmp_path):
    """A head node and a second node on this machine, one CPU each, with Ray's token authentication (on by
    default for a head since Ray 2.59; a joining node and the driver need the same token); yields (address, the
    second node's raylet, the environment that reaches them). `ray stop --force` at the end, whatever happened."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = tmp_path / "ray-token"
    token.write_text(secrets.token_hex(32))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    started = {"env": {**os.environ, **env}, "check": True, "capture_output": True, "timeout": 120}
    try:
        subprocess.run([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false", *common],
                       **started)
        before = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"}
        subprocess.run([RAY, "start", "--address", f"127.0.0.1:{port}", *common], **started)
        (second,) = [p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet" and p.pid not in before]
        yield f"127.0.0.1:{port}", second, env
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def test_a_node_killed_mid_conversion_leaves_the_same_conversion(photos, two_nodes):
    config, expected = photos
    folder = Path(config).parent
    address, second, ray_env = two_nodes
    running = _loadopt(folder, [*CONVERT[:1], str(config), *CONVERT[1:], "--force", "--engine", "ray", "--address",
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
    assert _digests(_conversion(folder)) == expected
