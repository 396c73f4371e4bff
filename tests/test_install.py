"""loadopt as a user installs it: the wheel in a fresh virtual environment, run from an empty folder far from any
checkout, its bundled configs found by name."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_installed_wheel_benches_a_bundled_config_from_an_empty_folder(tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheels), str(REPO)], capture_output=True, text=True, timeout=600)
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
    env = {**os.environ, "PYTHONPATH": ""}
    where = subprocess.run([str(venv / "bin" / "loadopt"), "--version"], cwd=empty, capture_output=True, text=True,
                           env=env, timeout=120)
    assert where.returncode == 0 and where.stdout.startswith("loadopt "), where.stderr[-2000:]
    found = subprocess.run([str(python), "-c", "import loadopt; print(loadopt.__file__)"], cwd=empty,
                           capture_output=True, text=True, env=env, timeout=120).stdout
    assert found.startswith(str(venv)), f"loadopt imported from {found}, not the installed wheel"
    done = subprocess.run([str(venv / "bin" / "loadopt"), "bench", "imagenet", "--quick", "--loaders", "torch",
                           "--set", "dataset.synthetic.num_samples=256"], cwd=empty, capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (empty / "results" / "imagenet" / "results.json").is_file()
    assert "fastest: torch" in done.stdout + done.stderr
    init = subprocess.run([str(venv / "bin" / "loadopt"), "init", "serve"], cwd=empty, capture_output=True,
                          text=True, env=env, timeout=120)
    assert init.returncode == 0 and (empty / "serve.yaml").read_text().startswith("# Inference"), init.stderr
