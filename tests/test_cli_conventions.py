"""The command line's conventions: `--version`, `-h`, an example in every command's help, the bundled configs by
name from any folder, and `loadopt init`."""

import pytest
from typer.testing import CliRunner

from loadopt.cli import app
from loadopt.config import bundled_configs, load_config
from loadopt.errors import ConfigError
from loadopt.version import __version__

COMMANDS = ["bench", "measure", "report", "doctor", "explain", "make-dataset", "init", "import-dlio", "convert",
            "recompress", "probe", "tiers"]


def test_version_and_short_help():
    runner = CliRunner()
    assert runner.invoke(app, ["--version"]).output == f"loadopt {__version__}\n"
    shown = runner.invoke(app, ["-h"])
    assert shown.exit_code == 0 and "Usage:" in shown.output and "loadopt bench imagenet" in shown.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_short_help_and_an_example(command):
    shown = CliRunner().invoke(app, [command, "-h"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "Examples:" in shown.output and f"loadopt {command}" in shown.output.split("Examples:")[1]


def test_a_bundled_config_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"imagenet", "serve", "tokens"} <= set(bundled_configs())
    assert load_config("imagenet").pipeline.batch_size == load_config("imagenet.yaml").pipeline.batch_size
    (tmp_path / "imagenet.yaml").write_text("pipeline: {batch_size: 7}\n")  # a file of that name here wins
    assert load_config("imagenet.yaml").pipeline.batch_size == 7
    with pytest.raises(ConfigError, match=r"^nosuch: config file not found, nor a bundled config of that name "
                                          r"\(bundled: cosmoflow, imagenet, .*`loadopt init NAME` writes one"):
        load_config("nosuch")


def test_init_writes_a_bundled_config_here_and_never_over_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    done = runner.invoke(app, ["init"])
    assert done.exit_code == 0, done.output
    assert load_config(tmp_path / "imagenet.yaml").name == load_config("imagenet").name
    (tmp_path / "imagenet.yaml").write_text("# mine\n")
    again = runner.invoke(app, ["init"])
    assert again.exit_code != 0 and "imagenet.yaml: exists already" in again.output
    assert (tmp_path / "imagenet.yaml").read_text() == "# mine\n"
    unknown = runner.invoke(app, ["init", "nope"])
    assert unknown.exit_code != 0 and "nope: no bundled config of that name" in unknown.output
    assert runner.invoke(app, ["init", "serve", "-o", "s.yaml"]).exit_code == 0 and (tmp_path / "s.yaml").is_file()


def test_long_work_off_a_terminal_says_each_stage_as_it_goes(tmp_path):
    import os
    import subprocess
    import sys

    log = tmp_path / "log"
    with log.open("w") as sink:  # `> log 2>&1`: no terminal
        done = subprocess.run([sys.executable, "-m", "loadopt", "convert", "imagenet", "--to", "arrow", "--set",
                               "dataset.synthetic.num_samples=60"], stdout=sink, stderr=subprocess.STDOUT,
                              cwd=tmp_path, env={**os.environ, "LOADOPT_CACHE": str(tmp_path / "cache")}, timeout=600)
    lines = log.read_text().splitlines()
    assert done.returncode == 0, lines[-5:]
    assert lines[0] == "generating the synthetic dataset: started 0/60 (0 s)"
    assert any(line.startswith("generating the synthetic dataset: done 60/60") for line in lines[1:-1])
    assert any(line.startswith("converting for arrow encoded: done 60/60") for line in lines[1:-1])
    assert "60 samples, encoded" in " ".join(lines[-2:])  # the last line, wrapped at the width of a pipe
