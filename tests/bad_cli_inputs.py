"""The bad-input cases of the command line itself and of outside backends, for tests/test_bad_inputs.py's
table: options typer checks, a plugin of the previous contract configured with its own knobs, a failed probe, a
config name that is neither a file nor bundled, a misspelt `--loaders` or `--log-to`, and `loadopt init` refused."""

from __future__ import annotations

from .faults import Setup, free_port, write_config


def negative_slo(tmp_path, cache):
    """An option typer validates (`min=`): one line naming it, not click's framed usage block."""
    config = write_config(tmp_path)
    return Setup(["bench", str(config), "--slo-ms", "-1"], "Invalid value for '--slo-ms': Input should be greater "
                 "than or equal to 0.001", leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def missing_config_argument(tmp_path, cache):
    return Setup(["convert", "--to", "arrow"], "Missing argument 'config'")


def backend_of_the_previous_contract_with_a_knob(tmp_path, cache, monkeypatch):
    """An outside backend still defining `_produce`, whose Settings declares a knob the config sets: the knob is
    known (its Settings is read), and the line names `_produce`."""
    from loadopt.loaders import registry

    from .test_registry import OLD_CONTRACT_MODULE, _dist

    module = OLD_CONTRACT_MODULE.replace("from loadopt.loaders.base import HostBatch, Loader, NoSettings",
                                         "from pydantic import BaseModel\n"
                                         "from loadopt.loaders.base import HostBatch, Loader\n"
                                         "class NoSettings(BaseModel):\n    depth: int = 1\n")
    packages = tmp_path / "site"
    packages.mkdir()
    _dist(packages, "old_knob_backend", "oldknob = old_knob_backend:OldLoader", module)
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))  # forgotten after the test
    config = write_config(tmp_path, loaders={"oldknob": {"depth": [1, 2]}})
    return Setup(["bench", str(config)], "oldknob: old_knob_backend.OldLoader does not implement `produce`, which "
                 "every backend must (docs/plugins.md; it defines `_produce`, the previous contract's name: rename "
                 "it `produce`)", config=config, backend="oldknob", must_not_contain=["unknown key"])


def probe_of_a_refusing_host(tmp_path, cache):
    """A probe that fails leaves neither its folder nor the parent it had to create (`results/` of
    `results/probe`)."""
    port = free_port()
    out = tmp_path / "results" / "probe"
    return Setup(["probe", f"http://127.0.0.1:{port}/data", "--out", str(out)], f"http://127.0.0.1:{port}/data: the "
                 f"host 127.0.0.1:{port} refused the connection",
                 leftovers=lambda: [p for p in [tmp_path / "results"] if p.exists()])


def no_such_config_name(tmp_path, cache):
    return Setup(["bench", "no_such_config", "--quick"], "no_such_config: config file not found, nor a bundled config "
                 "of that name (bundled: cosmoflow, imagenet,")


def misspelt_loaders(tmp_path, cache):
    """Refused before the dataset is made: the cache holds no dataset after it."""
    config = write_config(tmp_path)
    return Setup(["bench", str(config), "--loaders", "torhc"], "--loaders torhc: unknown backend 'torhc' (known: "
                 "torch,", leftovers=lambda: [p for p in [tmp_path / "results", cache / "datasets"] if p.exists()])


def unknown_tracker(tmp_path, cache):
    config = write_config(tmp_path)
    return Setup(["bench", str(config), "--log-to", "tensorbored:runs"], "--log-to tensorbored:runs: unknown tracker "
                 "'tensorbored' (known: tensorboard, wandb, mlflow", leftovers=lambda: [
                     p for p in [tmp_path / "results", cache / "datasets"] if p.exists()])


def init_over_an_existing_file(tmp_path, cache):
    mine = tmp_path / "mine.yaml"
    mine.write_text("# my edits\n")

    def unchanged() -> None:
        assert mine.read_text() == "# my edits\n"

    return Setup(["init", "serve", "--out", str(mine)], f"{mine}: exists already; edit it, or name another file "
                 "with --out", after=unchanged)


def init_of_no_bundled_config(tmp_path, cache):
    return Setup(["init", "nope", "--out", str(tmp_path / "nope.yaml")], "nope: no bundled config of that name",
                 leftovers=lambda: [p for p in [tmp_path / "nope.yaml"] if p.exists()])


CLI_CASES = {
    "a config name neither a file nor bundled, bench": (no_such_config_name, 2),
    "--loaders misspelt, bench (before any dataset work)": (misspelt_loaders, 2),
    "--log-to an unknown tracker, bench (before any dataset work)": (unknown_tracker, 2),
    "init over an existing file (left as it was)": (init_over_an_existing_file, 2),
    "init of a config that is not bundled": (init_of_no_bundled_config, 2),
    "--slo-ms -1 (an option typer checks), bench": (negative_slo, 2),
    "CONFIG missing, convert": (missing_config_argument, 2),
    "outside backend of the previous contract with its knob set, bench": (backend_of_the_previous_contract_with_a_knob,
                                                                         1),
    "a probe that fails leaves no results folder": (probe_of_a_refusing_host, 1),
}
