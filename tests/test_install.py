"""loadopt as a user installs it: the wheel in a fresh virtual environment, run from an empty folder far from any
checkout, its bundled configs found by name."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_installed_wheel_benches_a_bundled_config_from_an_empty_folder(tmp_path):
    wheels, source = tmp_path / "wheels", tmp_path / "source"
    # the tracked files alone, copied: what a release is built from, and no build folder left in the checkout
    for name in subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True,
                               text=True).stdout.split("\0"):
        if name and ((REPO / name).is_symlink() or (REPO / name).is_file()):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name, follow_symlinks=False)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheels), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = wheels.glob("loadopt-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                                str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    # its dependencies (torch, pyarrow, ...) from this environment's site-packages, read as a plain folder: the
    # editable install of the checkout there is not run (a folder named in a .pth has its .pth files ignored)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": "", "LOADOPT_CEILING_SECONDS": "0.2"}
    where = subprocess.run([str(venv / "bin" / "loadopt"), "--version"], cwd=empty, capture_output=True, text=True,
                           env=env, timeout=120)
    assert where.returncode == 0 and where.stdout.startswith("loadopt "), where.stderr[-2000:]
    found = subprocess.run([str(python), "-c", "import loadopt; print(loadopt.__file__)"], cwd=empty,
                           capture_output=True, text=True, env=env, timeout=120).stdout
    assert found.startswith(str(venv)), f"loadopt imported from {found}, not the installed wheel"
    # one torch setting of the sweep, on a small set: what is tried here is the install, not the sweep
    done = subprocess.run([str(venv / "bin" / "loadopt"), "bench", "imagenet", "--quick", "--loaders", "torch",
                           "--set", "dataset.synthetic.num_samples=256", "--set", "loaders.torch.variant=tuned",
                           "--set", "loaders.torch.num_workers=2"], cwd=empty, capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (empty / "results" / "imagenet" / "results.json").is_file()
    assert "fastest: torch" in done.stdout + done.stderr
    init = subprocess.run([str(venv / "bin" / "loadopt"), "init", "serve"], cwd=empty, capture_output=True,
                          text=True, env=env, timeout=120)
    assert init.returncode == 0 and (empty / "serve.yaml").read_text().startswith("# Inference"), init.stderr


def _extra(name: str) -> list[str]:
    """The requirements of loadopt's extra `name`, as the installed metadata has them."""
    from importlib.metadata import requires

    marker = f'extra == "{name}"'
    return [req.split(";")[0].strip() for req in requires("loadopt") or [] if marker in req]


@pytest.mark.parametrize("extra", ["webdataset", "streaming", "litdata", "ffcv"])
def test_each_peer_extra_installs_keeping_this_torch_and_numpy(extra, tmp_path):
    """`pip install --dry-run --report` of the peer's extra with the constraints `loadopt doctor --constraints`
    prints (the README's line): pip would install nothing in place of this torch or numpy."""
    keep = tmp_path / "keep.txt"
    printed = subprocess.run([sys.executable, "-m", "loadopt", "doctor", "--constraints"], capture_output=True,
                             text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    keep.write_text(printed.stdout)
    assert [line.split("==")[0] for line in printed.stdout.splitlines()] == ["torch", "numpy"]
    report = tmp_path / "report.json"
    dry = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                          "-c", str(keep), *_extra(extra)], capture_output=True, text=True, timeout=600)
    if dry.returncode != 0:
        reason = next((line.strip() for line in dry.stderr.splitlines() if line.startswith("ERROR")), dry.stderr[-300:])
        if "Failed to build" in reason or "Could not find" in reason or "No matching distribution" in reason:
            pytest.skip(f"pip cannot resolve [{extra}] here: {reason}")
        raise AssertionError(f"[{extra}] with the constraints does not resolve: {dry.stderr[-2000:]}")
    installed = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    assert "torch" not in installed and "numpy" not in installed, installed
