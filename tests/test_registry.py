"""Backends come from the `loadopt.loaders` entry-point group, so outside packages can add theirs."""

import sys

import pytest

from loadopt.loaders import registry


@pytest.fixture
def outside_package(tmp_path, monkeypatch):
    """An installed distribution (a .dist-info on sys.path) that declares two backends."""
    (tmp_path / "outside_backend.py").write_text(
        "from tests.backends import DelayLoader\n\nclass OutsideLoader(DelayLoader):\n    pass\n")
    info = tmp_path / "outside_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[loadopt.loaders]\noutside = outside_backend:OutsideLoader\nbroken = outside_backend_missing:Nope\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("outside", "broken"):
        registry.unregister(name)
    sys.modules.pop("outside_backend", None)


def test_entry_point_backend_is_found_and_builds(outside_package):
    assert {"torch", "outside", "broken"} <= set(registry.backend_names())
    cls = registry.backend_class("outside")
    assert cls.__name__ == "OutsideLoader" and cls.name == "outside"
    assert cls.available() == (True, "")


def test_a_backend_that_fails_to_import_is_listed_unavailable(outside_package):
    available, reason = registry.backend_class("broken").available()
    assert not available and "outside_backend_missing" in reason


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown backend 'nope' \\(known: torch"):
        registry.backend_class("nope")


def test_builtin_torch_backend_declares_its_knobs():
    cls = registry.backend_class("torch")
    assert {"variant", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers"} <= set(
        cls.Settings.model_fields)


# -- one list of built-ins; clashes; the declared work ---------------------------------------------------

def _dist(tmp_path, name: str, entry_points: str, module: str = "") -> None:
    if module:
        (tmp_path / f"{name}.py").write_text(module)
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[loadopt.loaders]\n{entry_points}\n")


def test_the_builtins_are_one_list_in_the_package_not_in_the_metadata():
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."loadopt.loaders"]' not in pyproject  # one list: registry.BUILTINS
    assert registry.backend_names()[:len(registry.BUILTINS)] == list(registry.BUILTINS)


def test_an_outside_entry_point_with_a_builtins_name_is_warned_about_and_the_builtin_kept(tmp_path, monkeypatch):
    _dist(tmp_path, "clashing_backend", "torch = clashing_backend:MyTorch")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_clashes_warned", set())
    with pytest.warns(UserWarning) as caught:
        names = registry.backend_names()
    text = " ".join(str(w.message) for w in caught)
    assert "clashing_backend:MyTorch" in text and registry.BUILTINS["torch"] in text and "clashing-backend" in text
    assert names.count("torch") == 1
    assert registry.backend_class("torch").__module__ == "loadopt.loaders.torch_dl.loader"


def test_an_entry_point_naming_the_builtins_own_target_is_no_clash(tmp_path, monkeypatch):
    import warnings

    _dist(tmp_path, "old_loadopt_metadata", f"torch = {registry.BUILTINS['torch']}")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_clashes_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.backend_names()


PLUGIN_MODULE = '''
from loadopt.loaders import WorkKind
from tests.backends import DelayLoader

class ReadOnly(DelayLoader):
    @classmethod
    def work_kind(cls, settings, recipe=None):
        return WorkKind.IO

class Undeclared(DelayLoader):
    pass
'''


@pytest.fixture
def declaring_package(tmp_path, monkeypatch):
    _dist(tmp_path, "declaring_backend",
          "readonly = declaring_backend:ReadOnly\nundeclared = declaring_backend:Undeclared", PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("readonly", "undeclared"):
        registry.unregister(name)
    sys.modules.pop("declaring_backend", None)


def test_attribution_holds_an_outside_backend_to_the_ceiling_it_declares(declaring_package):
    from loadopt.bench.attribution.verdicts import declared_work_kind
    from loadopt.schema.ceilings import Job

    from .test_attribution import CEILINGS, JOB, attribute, metrics

    run = metrics(0.6, wait_s=6.0, finish_s=0.3, rate=650.0)
    assert declared_work_kind("readonly delay_s=0.01", {"delay_s": 0.01}, None, Job.model_validate(JOB)) == "io"
    found = attribute(run, "readonly delay_s=0.01", CEILINGS, {**JOB, "cache": "cold"}, {"delay_s": 0.01})
    assert found.ceiling.name == "storage read (200 MB/s)"  # 200 MB/s / 110 KB a sample
    assert abs(found.ceiling.samples_per_s - 200e6 / 110e3) < 1
    # Warm, its local bytes come from the page cache: a memory copy of them bounds it, not the disk.
    found = attribute(run, "readonly delay_s=0.01", CEILINGS, JOB, {"delay_s": 0.01})
    assert found.ceiling.name == "page cache copy (10.0 GB/s)"
    # Declaring nothing: what its recipe says (the source JPEGs decoded), never the memory copy by default.
    found = attribute(run, "undeclared delay_s=0.01", CEILINGS, JOB, {"delay_s": 0.01},
                      {"kind": "images", "stored": "source"})
    assert found.ceiling.name == "decode simplejpeg x 2 cores" and "memory copies" not in found.text
    assert declared_work_kind("undeclared", {}, None, Job.model_validate(JOB)) == "jpeg_decode"


def test_the_builtins_declare_what_bounds_them():
    images = {"kind": "images", "stored": "source"}
    frames = {"kind": "images", "stored": "whole frame <= 512 px"}
    torch_loader = registry.backend_class("torch")
    assert torch_loader.work_kind(torch_loader.Settings(), images) == "jpeg_decode"
    arrow = registry.backend_class("arrow")
    assert arrow.work_kind(arrow.Settings(form="decoded"), frames) == "crop_resize"
    assert arrow.work_kind(arrow.Settings(form="decoded"), {"kind": "images", "stored": "centre 256 px square"}) \
        == "pixel_copy"
    assert arrow.work_kind(arrow.Settings(), {"kind": "tokens"}) == "token_gather"
    # the encoded forms' JPEGs are stored with restart markers: their own decode ceiling
    for ring in (arrow, registry.backend_class("posix")):
        assert ring.work_kind(ring.Settings(form="encoded"), images) == "stored_jpeg_decode"
    kvikio = registry.backend_class("kvikio")
    if kvikio.__name__ == "KvikioLoader":  # its module imports without kvikio installed
        assert kvikio.work_kind(kvikio.Settings(form="decoded"), frames) == "pixel_copy"  # resized on the GPU
    dali = registry.backend_class("dali")
    if dali.available()[0]:
        assert dali.work_kind(dali.Settings(decoder="mixed"), images) == "device_decode"
        assert dali.work_kind(dali.Settings(decoder="cpu"), images) == "jpeg_decode"
    assert registry.backend_class("webdataset").work_kind(None, images) == "jpeg_decode"


def test_supports_says_which_datasets_a_backend_reads():
    from loadopt.storage.sources.tokens import TokenDataset

    tokens = TokenDataset.__new__(TokenDataset)
    assert registry.backend_class("torch").supports(tokens) == (True, "")
    assert registry.backend_class("arrow").supports(tokens) == (True, "")
    ok, why = registry.backend_class("webdataset").supports(tokens)
    assert not ok and "image datasets only" in why


OLD_CONTRACT_MODULE = '''
import torch
from loadopt.loaders.base import HostBatch, Loader, NoSettings

class OldLoader(Loader[NoSettings]):
    Settings = NoSettings

    def _produce(self, batches):  # the extension point's name before it was public
        for indices in batches:
            yield HostBatch(torch.zeros((len(indices), 3, 8, 8)), torch.zeros(len(indices), dtype=torch.int64),
                            indices)
'''


def test_a_backend_of_the_previous_contract_is_unavailable_naming_the_method(tmp_path, monkeypatch, tiny_config):
    """An outside backend still defining `_produce`: one line naming it and `produce`, not a TypeError
    when it is first built (make_loader, bench, doctor all see it unavailable)."""
    from loadopt import make_loader
    from loadopt.errors import BackendUnavailable

    _dist(tmp_path, "old_backend", "old = old_backend:OldLoader", OLD_CONTRACT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        available, reason = registry.backend_class("old").available()
        assert not available
        assert reason.startswith("old_backend.OldLoader does not implement `produce`")
        assert "rename it `produce`" in reason
        with pytest.raises(BackendUnavailable) as caught:
            make_loader(tiny_config, backend="old")
        assert str(caught.value) == f"backend old: {reason}" and "\n" not in str(caught.value)
    finally:
        registry.unregister("old")
        sys.modules.pop("old_backend", None)
    namespace: dict = {}
    exec(OLD_CONTRACT_MODULE, namespace)  # noqa: S102 - the same class, registered in process
    registry.register("old_registered")(namespace["OldLoader"])
    try:
        assert "does not implement `produce`" in registry.backend_class("old_registered").available()[1]
    finally:
        registry.unregister("old_registered")
