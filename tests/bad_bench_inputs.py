"""The bad inputs of `loadopt bench` (rows of tests/test_bad_inputs.py's table): a zero-byte JPEG under DALI, a
run that delivered no sample (every file unreadable under on_error: skip), and a disk that fills at the report
(ENOSPC emulated) beside an earlier bench's report."""

from __future__ import annotations

import errno

import pytest

from .faults import Setup, images, temps, write_config


def zero_byte_jpeg_under_dali(tmp_path, cache):
    """An empty .jpg: named, and said to be empty (never PIL's "cannot identify ... <_io.BytesIO at 0x...>")."""
    from loadopt.loaders.dali.loader import DaliLoader

    if not DaliLoader.available()[0]:
        pytest.skip(DaliLoader.available()[1])
    root, _ = images(tmp_path, corrupt=0)
    empty = root / "train" / "c1" / "empty.jpg"
    empty.write_bytes(b"")
    config = write_config(tmp_path, dataset={"path": str(root)}, loaders={"dali": {"num_threads": 1}})
    return Setup(["bench", str(config), "--quick"], f"{empty}: empty file (0 bytes)", config=config,
                 must_not_contain=["BytesIO", "0x"], leftovers=temps(tmp_path / "results"))


def every_sample_skipped(tmp_path, cache):
    """No sample delivered: the setting's error with its reason, nothing ranked, no decision, nothing written."""
    root = tmp_path / "photos"
    for name in ("c0", "c1"):
        (root / "train" / name).mkdir(parents=True)
        (root / "train" / name / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 4)
    config = write_config(tmp_path, dataset={"path": str(root), "on_error": "skip"},
                          loaders={"torch": {"variant": "plain", "num_workers": 0}})
    out = tmp_path / "results"
    culprit = ("no loader setting could be measured (torch plain num_workers=0: delivered no samples (2 unreadable "
               "file(s) skipped under dataset.on_error: skip")
    return Setup(["bench", str(config), "--quick"], culprit, config=config,
                 leftovers=lambda: [p for p in (out / "decision.json", out / "results.json") if p.exists()])


def no_space_for_the_report(tmp_path, cache, monkeypatch):
    """The disk fills at report.html: one line, exit 1, and the earlier bench's report is not left beside the new
    results (it described other numbers)."""
    from loadopt import files

    config = write_config(tmp_path, loaders={"torch": {"variant": "plain", "num_workers": 0}})
    out = tmp_path / "results"
    out.mkdir()
    stale = out / "report.html"
    stale.write_text("<p>an earlier bench's numbers</p>")
    real = files.atomic_write_text

    def fills_up(path, text):
        if path.name == "report.html":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(files, "atomic_write_text", fills_up)
    culprit = f"{stale}: cannot write the report (No space left on device); the results beside it are this bench's"
    return Setup(["bench", str(config), "--quick"], culprit, config=config,
                 leftovers=lambda: [stale] * stale.exists() + temps(out)())


BENCH_CASES = {  # name: (setup, exit code)
    "bench: a zero-byte JPEG under DALI": (zero_byte_jpeg_under_dali, 1),
    "bench: every sample skipped, none delivered": (every_sample_skipped, 1),
    "bench: no space left for the report": (no_space_for_the_report, 1),
}


def no_space_for_the_decision(tmp_path, cache, monkeypatch):
    """The disk fills at decision.json: one line, exit 1; the earlier bench's decision is not left beside the new
    results, and the report describes them."""
    from loadopt.bench import decision

    config = write_config(tmp_path, loaders={"torch": {"variant": "plain", "num_workers": 0}})
    out = tmp_path / "results"
    out.mkdir()
    stale = out / "decision.json"
    stale.write_text('{"backend": "an earlier bench\'s"}')
    real = decision.atomic_write_text

    def fills_up(path, text):
        if path == stale:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)

    monkeypatch.setattr(decision, "atomic_write_text", fills_up)

    def after() -> None:
        assert (out / "report.html").exists() and (out / "results.json").exists()

    return Setup(["bench", str(config), "--quick"], f"{stale}: cannot write the decision (no space left on device)",
                 config=config, leftovers=lambda: [stale] * stale.exists() + temps(out)(), after=after)


BENCH_CASES["bench: no space left for the decision"] = (no_space_for_the_decision, 1)
