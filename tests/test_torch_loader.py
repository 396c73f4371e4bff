import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loadopt.config import PipelineConfig
from loadopt.errors import DatasetError
from loadopt.loaders.torch_dl.loader import TorchLoader, TorchSettings
from loadopt.storage.sources.imagefolder import scan_image_folder

from .conftest import make_image_folder


@pytest.fixture
def folder(tmp_path):
    make_image_folder(tmp_path, classes=3, per_class=5)
    return tmp_path


def loader(folder, variant="tuned", workers=0, augment="train", dtype="float32", resize="pil", batch_size=4, **kw):
    dataset = scan_image_folder(str(folder))
    pipeline = PipelineConfig(batch_size=batch_size, image_size=24, augment=augment, dtype=dtype)
    settings = TorchSettings(variant=variant, num_workers=workers, decoder="pil", resize=resize)
    return TorchLoader(dataset, pipeline, settings, seed=3, **kw)


def collect(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_shapes_labels_and_len(folder):
    ld = loader(folder)
    batches = collect(ld)
    assert len(ld) == 4 and len(batches) == 4  # 15 samples, batches of 4
    x, y = batches[0]
    assert x.shape == (4, 3, 24, 24) and x.dtype == torch.float32 and y.dtype == torch.int64
    labels = torch.cat([y for _, y in batches]).tolist()
    assert sorted(labels) == sorted([0] * 5 + [1] * 5 + [2] * 5)


@pytest.mark.parametrize("augment", ["eval", "train"])
@pytest.mark.parametrize("dtype", ["float32", "uint8"])
def test_plain_and_tuned_deliver_equal_tensors(folder, augment, dtype):
    plain = collect(loader(folder, "plain", augment=augment, dtype=dtype))
    tuned = collect(loader(folder, "tuned", workers=2, augment=augment, dtype=dtype))
    for (xp, yp), (xt, yt) in zip(plain, tuned, strict=True):
        assert torch.equal(yp, yt)
        assert xp.dtype == xt.dtype and xp.shape == xt.shape
        assert torch.allclose(xp.float(), xt.float(), atol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "tuned"])
def test_torch_resize_kernel_is_close_to_pils(folder, variant):
    """The tuned default (torch's uint8 kernel) differs from PIL's by rounding inside the crop; at its
    border PIL's filter also reads the pixels just outside the box, torch's clamps to the crop."""
    reference = collect(loader(folder, "plain", augment="train", dtype="uint8"))
    fast = collect(loader(folder, variant, augment="train", dtype="uint8", resize="torch", workers=1))
    for (xr, yr), (xf, yf) in zip(reference, fast, strict=True):
        assert torch.equal(yr, yf)
        diff = (xr.int() - xf.int()).abs().float()
        assert diff.mean() < 1.0
        assert diff[..., 2:-2, 2:-2].max() <= 2


def test_workers_give_the_same_batches_as_the_main_process(folder):
    a = collect(loader(folder, "plain", workers=0))
    b = collect(loader(folder, "plain", workers=2))
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


@pytest.mark.parametrize("persistent", [False, True])
def test_resume_mid_epoch_with_workers(folder, persistent):
    def make():
        ld = loader(folder, "tuned", workers=2)
        ld.settings = TorchSettings(variant="tuned", num_workers=2, persistent_workers=persistent, decoder="pil")
        return ld

    full = [b.indices.tolist() for b in make().host_batches()]
    first = make()
    head = []
    for batch in first.host_batches():
        head.append(batch.indices.tolist())
        if len(head) == 2:
            break
    state = first.state_dict()
    first.close()
    resumed = make()
    resumed.load_state_dict(state)
    tail = [b.indices.tolist() for b in resumed.host_batches()]
    assert head + tail == full
    assert sorted(np.concatenate(full).tolist()) == list(range(15))


def test_two_ranks_share_the_epoch(folder):
    seen = []
    for rank in range(2):
        ld = loader(folder, world_size=2, rank=rank)
        seen += [i for b in ld.host_batches() for i in b.indices.tolist()]
    assert sorted(seen) == list(range(15))


@pytest.mark.parametrize("variant", ["plain", "tuned"])
def test_corrupt_jpeg_raise_names_the_file(tmp_path, variant):
    bad = make_image_folder(tmp_path, corrupt=1)[0]
    with pytest.raises(DatasetError, match=str(bad)):
        collect(loader(tmp_path, variant, workers=1))


@pytest.mark.parametrize("variant", ["plain", "tuned"])
def test_corrupt_jpeg_skip_counts_and_names(tmp_path, variant):
    bad = make_image_folder(tmp_path, corrupt=1)[0]
    ld = loader(tmp_path, variant, workers=1, on_error="skip")
    batches = collect(ld)
    assert sum(len(y) for _, y in batches) == 12
    assert [p for p, _ in ld.counters.skipped] == [str(bad)]
    assert ld.counters.bytes_read > ld.counters.bytes_delivered  # the bad file was read, not delivered


def test_empty_and_missing_folders(tmp_path):
    (tmp_path / "train" / "c0").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no images found"):
        scan_image_folder(str(tmp_path))
    with pytest.raises(DatasetError, match="dataset folder not found"):
        scan_image_folder(str(tmp_path / "missing"))


def test_reads_through_fsspec_memory_filesystem(folder):
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in sorted((folder / "train").rglob("*.jpg")):
        fs.pipe(f"/data/train/{path.parent.name}/{path.name}", path.read_bytes())
    remote = scan_image_folder("memory://data")
    assert len(remote) == 15
    ld = TorchLoader(remote, PipelineConfig(batch_size=4, image_size=24, augment="eval"),
                     TorchSettings(num_workers=0, decoder="pil", resize="pil"), seed=3)
    local = collect(loader(folder, "tuned", augment="eval"))
    for (xr, yr), (xl, yl) in zip(collect(ld), local, strict=True):
        assert torch.equal(yr, yl) and torch.allclose(xr, xl)


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_batches_kept_by_the_caller_are_not_overwritten_by_the_ring(folder, dtype):
    """tuned batches live in reused shared-memory slots; what the caller keeps must stay intact."""
    reference = collect(loader(folder, "tuned", workers=0, dtype=dtype))
    kept = list(loader(folder, "tuned", workers=2, dtype=dtype))  # no clone: the loader must protect them
    assert len(kept) == len(reference)
    for (xk, yk), (xr, yr) in zip(kept, reference, strict=True):
        assert torch.equal(yk, yr) and torch.equal(xk, xr)


def test_ring_survives_epochs_and_persistent_workers(folder):
    ld = loader(folder, "tuned", workers=2)
    ld.settings = TorchSettings(variant="tuned", num_workers=2, persistent_workers=True, decoder="pil", resize="pil")
    fresh = loader(folder, "tuned", workers=0)
    for epoch in range(3):
        ld.set_epoch(epoch)
        fresh.set_epoch(epoch)
        for (xa, ya), (xb, yb) in zip(collect(ld), collect(fresh), strict=True):
            assert torch.equal(ya, yb) and torch.equal(xa, xb)
    ld.close()


def test_close_unmaps_the_shared_batch_ring(folder):
    def ring_bytes() -> int:  # bytes of torch's shared-memory files this process maps
        total = 0
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "/torch_" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                total += end - start
        return total

    before = ring_bytes()
    ld = loader(folder, variant="tuned", workers=1)
    collect(ld)
    assert ring_bytes() > before  # the ring is shared memory while the loader runs
    ld.close()
    assert ring_bytes() == before  # closed: unmapped though the loader object lives on
    assert len(collect(ld)) == 4  # and a later pass makes a new one
    ld.close()


def test_batches_handed_out_on_the_cpu_are_fresh_memory_while_the_transpose_buffer_is_reused(folder):
    held = list(loader(folder))  # no copies: every batch must still hold its own pixels
    assert len({x.data_ptr() for x, _ in held}) == len(held)
    expected = collect(loader(folder))
    assert all(torch.equal(x, e) for (x, _), (e, _) in zip(held, expected, strict=True))


def _kill_a_worker(before: set[int]) -> int:
    """SIGKILL one of the DataLoader workers started since `before` (this process's children then) and
    wait until it is dead (a zombie: not yet reaped)."""
    import os
    import signal
    import time

    import psutil

    me = psutil.Process()
    # Forked workers run this process's command line (a resource tracker, say, is a command of its own).
    started = [c for c in me.children() if c.pid not in before and c.cmdline() == me.cmdline()]
    victim = min(started, key=lambda c: c.pid)
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while victim.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    return victim.pid


def _children() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


@pytest.fixture
def no_sigchld_handler():
    """Call it once the DataLoader started (torch installs its handler then): SIGCHLD at its default, as
    where torch installs none (a loader iterated off the main thread); torch's handler would raise its
    RuntimeError wherever the test happens to be when it fires. The handler is put back after the test."""
    import signal

    installed = []

    def drop() -> None:
        installed.append(signal.getsignal(signal.SIGCHLD))  # torch's (installed once per process)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    yield drop
    if installed:
        signal.signal(signal.SIGCHLD, installed[0])


@pytest.mark.parametrize("variant", ["plain", "tuned"])
def test_a_killed_worker_is_one_line_naming_it_and_how(folder, variant, no_sigchld_handler):
    """Killed while it still has batches to make (batches of 1: 15 a pass, at most 4 asked ahead); a batch it had
    queued that points at its shared memory (plain) makes torch's next() a ConnectionResetError."""
    from loadopt.errors import WorkerDied

    ld = loader(folder, variant=variant, workers=2, batch_size=1)
    try:
        before = _children()
        batches = iter(ld)
        next(batches)
        no_sigchld_handler()
        pid = _kill_a_worker(before)
        with pytest.raises(WorkerDied) as caught:
            for _ in batches:
                pass
        message = str(caught.value)
        assert re.fullmatch(rf"torch: DataLoader worker \d \(pid {pid}\) was killed by SIGKILL \(the kernel's OOM "
                            r"killer .*\); the pass stopped after \d+ of its batches", message), message
        assert len(collect(ld)) == 15  # the next pass starts new workers
    finally:
        ld.close()


def test_a_worker_killed_between_batches_is_one_line_naming_it_from_torchs_own_handler(folder):
    """torch's SIGCHLD handler (left in place) fires wherever the consumer is: here in its step."""
    from loadopt.errors import WorkerDied

    ld = loader(folder, variant="plain", workers=2)
    try:
        before = _children()
        batches = iter(ld)
        next(batches)
        pid = min(_children() - before)
        with pytest.raises(WorkerDied) as caught:
            os.kill(pid, signal.SIGKILL)
            time.sleep(5)  # the training step: the signal's handler raises in here
        message = str(caught.value)
        assert re.fullmatch(rf"torch: DataLoader worker \d \(pid {pid}\) was killed by SIGKILL \(the kernel's OOM "
                            r"killer .*\), between batches", message), message
        batches.close()
        assert len(collect(ld)) == 4  # the next pass starts new workers
    finally:
        ld.close()


def test_a_persistent_worker_killed_between_epochs_fails_the_next_pass_then_is_replaced(folder, no_sigchld_handler):
    from loadopt.errors import WorkerDied

    dataset = scan_image_folder(str(folder))
    settings = TorchSettings(variant="tuned", num_workers=2, decoder="pil", resize="pil", persistent_workers=True)
    ld = TorchLoader(dataset, PipelineConfig(batch_size=4, image_size=24), settings, seed=3)
    try:
        before = _children()
        first = collect(ld)
        no_sigchld_handler()
        pid = _kill_a_worker(before)
        with pytest.raises(WorkerDied, match=rf"worker \d \(pid {pid}\) was killed by SIGKILL.*after 0 of its batches"):
            collect(ld)
        again = collect(ld)
        assert len(again) == len(first) == 4
    finally:
        ld.close()
