"""Backends come from the `loadopt.loaders` entry-point group, so outside packages can add theirs."""

import sys

import pytest

from loadopt.loaders import base


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
        base._registered.pop(name, None)
    sys.modules.pop("outside_backend", None)


def test_entry_point_backend_is_found_and_builds(outside_package):
    assert {"torch", "outside", "broken"} <= set(base.backend_names())
    cls = base.backend_class("outside")
    assert cls.__name__ == "OutsideLoader" and cls.name == "outside"
    assert cls.available() == (True, "")


def test_a_backend_that_fails_to_import_is_listed_unavailable(outside_package):
    available, reason = base.backend_class("broken").available()
    assert not available and "outside_backend_missing" in reason


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(KeyError, match="unknown backend 'nope' \\(known: torch"):
        base.backend_class("nope")


def test_builtin_torch_backend_declares_its_knobs():
    cls = base.backend_class("torch")
    assert {"variant", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers"} <= set(
        cls.Settings.model_fields)
