"""The listing manifest of a local ImageFolder (storage/sources/manifest.py): same listing and fingerprint as
fsspec's walk, reused while no folder changed, refreshed when one did."""

from __future__ import annotations

import os
from pathlib import Path

import fsspec
import numpy as np
import pytest

from loadopt.storage.remote.listing import modified
from loadopt.storage.sources import manifest
from loadopt.storage.sources.imagefolder import IMAGE_EXTENSIONS, scan_image_folder

OLD = 1_600_000_000  # folders' mtimes set this far in the past: the listing is not racy


def _tree(root: Path) -> Path:
    split = root / "train"
    for cls, names in {"cat": ["b.jpg", "a.JPEG", "notes.txt"], "dog": ["c.png"], "emu": []}.items():
        (split / cls).mkdir(parents=True)
        for name in names:
            (split / cls / name).write_bytes(name.encode() * 3)
    (split / "dog" / "nested").mkdir()
    (split / "dog" / "nested" / "deep.jpg").write_bytes(b"x")  # deeper than <class>/<file>: not a sample
    (split / "loose.jpg").write_bytes(b"y")  # no class: not a sample
    os.symlink(split / "cat" / "b.jpg", split / "dog" / "link.jpg")  # a symlinked file is a sample
    _age(split)
    return split


def _age(split: Path, when: int = OLD) -> None:
    for folder in [split, *[p for p in split.rglob("*") if p.is_dir()]]:
        os.utime(folder, (when, when))


def _fsspec_fingerprint(split: Path) -> tuple[str, list[str]]:
    """The listing as fsspec's `find` gives it and the fingerprint computed from it (the walk it replaces)."""
    fs = fsspec.filesystem("file")
    files = fs.find(str(split), detail=True)
    prefix = str(split) + "/"
    entries = sorted((n[len(prefix):].split("/")[0], n, info["size"]) for n, info in files.items()
                     if len(n[len(prefix):].split("/")) == 2 and n.lower().endswith(IMAGE_EXTENSIONS))
    identity = fs.unstrip_protocol(os.path.realpath(split))
    digest = manifest.fingerprint(identity, [n[len(prefix):] for _, n, _ in entries], [s for _, _, s in entries],
                                  [modified(files[n]) for _, n, _ in entries])
    return digest, [n for _, n, _ in entries]


def test_listing_matches_fsspec_and_is_reused(tmp_path: Path, own_cache: Path) -> None:
    split = _tree(tmp_path / "data")
    first = scan_image_folder(str(tmp_path / "data"))
    expected, names = _fsspec_fingerprint(split)
    assert first.fingerprint == expected
    assert [p.decode() for p in first.paths] == names
    assert first.classes == ["cat", "dog"] and first.labels.tolist() == [0, 0, 1, 1]
    assert first.sizes.tolist() == [len(b"a.JPEG") * 3, len(b"b.jpg") * 3, len(b"b.jpg") * 3, len(b"c.png") * 3]
    assert manifest.manifest_path(str(split), own_cache).is_dir()
    again = manifest.local_listing(str(split), fsspec.filesystem("file").unstrip_protocol(str(split)),
                                   IMAGE_EXTENSIONS, own_cache)
    assert again.cached and again.fingerprint == first.fingerprint
    assert np.array_equal(again.paths, first.paths) and np.array_equal(again.labels, first.labels)
    assert again.labels.dtype == np.int64 and again.paths.dtype.kind == "S"  # arrays, no Python objects
    assert isinstance(again.paths, np.memmap) and not again.paths.flags.writeable  # shared by every process


@pytest.mark.parametrize("change", ["add", "remove", "rename_class", "new_class"])
def test_a_changed_folder_is_listed_again(tmp_path: Path, own_cache: Path, change: str) -> None:
    split = _tree(tmp_path / "data")
    before = scan_image_folder(str(split))
    if change == "add":
        (split / "cat" / "z.jpg").write_bytes(b"new")
    elif change == "remove":
        (split / "cat" / "a.JPEG").unlink()
    elif change == "rename_class":
        (split / "cat").rename(split / "cow")
    else:
        (split / "emu" / "e.jpg").write_bytes(b"e")
    _age(split, OLD + 60)  # the changed folders' mtimes differ from the saved ones, not racy either
    after = scan_image_folder(str(split))
    assert after.fingerprint != before.fingerprint
    assert after.fingerprint == _fsspec_fingerprint(split)[0]


def test_in_place_rewrite_is_missed_until_relisted(tmp_path: Path, own_cache: Path) -> None:
    """The documented limit: a file rewritten in place changes no folder's mtime."""
    split = _tree(tmp_path / "data")
    before = scan_image_folder(str(split))
    (split / "cat" / "a.JPEG").write_bytes(b"rewritten, longer than before")  # no folder's mtime changes
    assert scan_image_folder(str(split)).fingerprint == before.fingerprint
    relisted = scan_image_folder(str(split), relist=True)
    assert relisted.fingerprint != before.fingerprint
    assert relisted.fingerprint == _fsspec_fingerprint(split)[0]
    assert scan_image_folder(str(split)).fingerprint == relisted.fingerprint  # the relisting was saved


def test_a_folder_written_just_now_is_not_saved(tmp_path: Path, own_cache: Path) -> None:
    split = _tree(tmp_path / "data")
    (split / "cat" / "fresh.jpg").write_bytes(b"f")  # its folder's mtime is now: racy
    scan_image_folder(str(split))
    assert not manifest.manifest_path(str(split), own_cache).exists()


def test_a_damaged_manifest_is_listed_again(tmp_path: Path, own_cache: Path) -> None:
    split = _tree(tmp_path / "data")
    first = scan_image_folder(str(split))
    paths = manifest.manifest_path(str(split), own_cache) / "paths.npy"
    paths.write_bytes(paths.read_bytes()[:100])
    assert scan_image_folder(str(split)).fingerprint == first.fingerprint


def test_loaders_read_the_memory_mapped_listing(tmp_path: Path, own_cache: Path) -> None:
    """A dataset opened from its manifest (read-only mapped arrays) gives the same batches, workers included."""
    import torch

    from loadopt.api import make_loader

    from .conftest import make_image_folder, tiny_config_dict

    make_image_folder(tmp_path / "data", classes=2, per_class=5)
    _age(tmp_path / "data" / "train")
    config = tiny_config_dict(tmp_path / "r", dataset={"path": str(tmp_path / "data")})

    def epoch() -> list[torch.Tensor]:
        loader = make_loader(config, backend="torch", device="cpu", num_workers=1, variant="tuned")
        try:
            return [labels for _, labels in loader]
        finally:
            loader.close()

    listed = epoch()  # lists the folder and saves the manifest
    assert manifest.manifest_path(str(tmp_path / "data" / "train"), own_cache).is_dir()
    mapped = epoch()
    assert [t.tolist() for t in mapped] == [t.tolist() for t in listed] and sum(map(len, mapped)) == 10


def _torchvision_samples(split: Path) -> list[tuple[str, int]]:
    """The (path, label) pairs torchvision's ImageFolder lists (find_classes, then make_dataset's
    `os.walk(followlinks=True)` of each class), for a tree without loops (torchvision has no guard)."""
    classes = sorted(entry.name for entry in os.scandir(split) if entry.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for folder, _, files in sorted(os.walk(split / name, followlinks=True)):
            samples += [(os.path.join(folder, f), label) for f in sorted(files) if f.lower().endswith(IMAGE_EXTENSIONS)]
    return samples


def test_a_symlinked_class_folder_is_a_class_as_in_torchvision(tmp_path: Path, own_cache: Path, caplog) -> None:
    """`train/c9 -> /elsewhere/c9`: its images are samples (as torchvision lists them), through the loaders
    too; a link to a missing folder or back to the split (a loop) is left out, and said."""
    from loadopt.api import make_loader

    from .conftest import make_image_folder, tiny_config_dict

    make_image_folder(tmp_path / "data", classes=2, per_class=5)
    make_image_folder(tmp_path / "elsewhere", classes=1, per_class=3)
    split = tmp_path / "data" / "train"
    (split / "c9").symlink_to(tmp_path / "elsewhere" / "train" / "c0")
    _age(split)
    dataset = scan_image_folder(str(tmp_path / "data"))
    assert dataset.classes == ["c0", "c1", "c9"] and len(dataset) == 13
    assert dataset.samples == _torchvision_samples(split)
    config = tiny_config_dict(tmp_path / "r", dataset={"path": str(tmp_path / "data")})
    loader = make_loader(config, backend="torch", device="cpu", num_workers=0)
    try:
        labels = [label for _, batch in loader for label in batch.tolist()]
    finally:
        loader.close()
    assert sorted(labels) == [0] * 5 + [1] * 5 + [2] * 3

    (split / "gone").symlink_to(tmp_path / "nowhere")
    (split / "loop").symlink_to(split)
    (split / "up").symlink_to(tmp_path / "data")
    with caplog.at_level("WARNING", logger="loadopt.storage.sources.manifest"):
        again = scan_image_folder(str(tmp_path / "data"))
    assert again.classes == ["c0", "c1", "c9"] and len(again) == 13
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "the link's target is missing; class 'gone' left out" in said
    assert "(a loop); class 'loop' left out" in said and "(a loop); class 'up' left out" in said


@pytest.mark.parametrize("change", ["add_in_target", "retarget", "remove_link"])
def test_a_symlinked_class_folder_is_watched_through_its_target(tmp_path: Path, own_cache: Path, change: str) -> None:
    """The manifest sees a file added in the link's target (outside the tree), the link pointed elsewhere,
    and the link removed."""
    split = _tree(tmp_path / "data")
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.jpg").write_bytes(name.encode())
    (split / "fox").symlink_to(tmp_path / "one")
    _age(tmp_path)
    before = scan_image_folder(str(split))
    assert "fox" in before.classes and before.fingerprint == scan_image_folder(str(split)).fingerprint
    assert manifest.load(manifest.manifest_path(str(split), own_cache),
                         fsspec.filesystem("file").unstrip_protocol(str(split))) is not None  # reused as it is
    if change == "add_in_target":
        (tmp_path / "one" / "new.jpg").write_bytes(b"new")
    elif change == "retarget":
        (split / "fox").unlink()
        (split / "fox").symlink_to(tmp_path / "two")
    else:
        (split / "fox").unlink()
    _age(tmp_path, OLD + 60)
    after = scan_image_folder(str(split))
    assert after.fingerprint != before.fingerprint
    fox = [p.decode().rsplit("/", 1)[-1] for p, label in zip(after.paths, after.labels, strict=True)
           if after.classes[label] == "fox"]
    assert fox == {"add_in_target": ["new.jpg", "one.jpg"], "retarget": ["two.jpg"], "remove_link": []}[change]
    assert after.fingerprint == scan_image_folder(str(split), relist=True).fingerprint
