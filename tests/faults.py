"""What the bad-input table (test_bad_inputs.py) and the fault tests (test_faults.py) share: configs
written for a case, what a command printed, small photo folders, leftover temporaries."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .conftest import make_image_folder, tiny_config_dict


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Setup:
    """What a case prepared: the CLI arguments, the line expected (a substring), files that must not be
    left, and the backend for the library check (None: the CLI only)."""

    args: list[str]
    culprit: str
    config: Path | None = None
    leftovers: Callable[[], list[Path]] = lambda: []
    backend: str | None = None
    overrides: dict = field(default_factory=dict)  # make_loader keywords (the form the CLI converted)
    must_not_contain: list[str] = field(default_factory=list)
    after: Callable[[], None] = lambda: None  # more checks once the command ran
    close: Callable[[], None] = lambda: None  # what the case started (a server), stopped when the test ends


def write_config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path / "results", **sections)))
    return path


def temps(folder: Path) -> Callable[[], list[Path]]:
    """Temporary files or folders of conversions and results left in `folder` (recursively)."""
    return lambda: [p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".tmp-" in p.name]


def said(result) -> str:
    """What a command printed, rich's line wrapping undone."""
    return " ".join(result.output.split())


def images(tmp_path: Path, corrupt: int = 1) -> tuple[Path, list[Path]]:
    root = tmp_path / "photos"
    return root, make_image_folder(root, classes=2, per_class=5, corrupt=corrupt)
