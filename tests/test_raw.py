"""Raw shards and the posix backend: equal to arrow, O_DIRECT, resumption, errors (kvikio: test_kvikio.py)."""

import os

import numpy as np
import pytest
import torch

from loadopt.config import config_from_dict
from loadopt.errors import DatasetError
from loadopt.imaging.reencode import with_restarts
from loadopt.loaders.arrow.loader import ArrowLoader, ArrowSettings
from loadopt.loaders.posix.loader import PosixLoader, PosixSettings
from loadopt.storage.forms import raw_convert, raw_format
from loadopt.storage.open import open_dataset

from .conftest import tiny_config_dict
from .test_arrow import assert_same, batches

SMALL = 0.05  # MiB per shard: several shards even for the tiny datasets


def config(tmp_path, **pipeline):
    raw = tiny_config_dict(tmp_path / "out", pipeline={"augment": "eval", "dtype": "uint8", **pipeline})
    return config_from_dict(raw, "raw.yaml")


def tokens_config(tmp_path):
    raw = tiny_config_dict(tmp_path / "out", dataset={"kind": "tokens", "tokens": {"num_tokens": 20_000,
                                                                                  "vocab_size": 70_000}},
                           pipeline={"batch_size": 4, "seq_len": 64})
    return config_from_dict(raw, "tokens.yaml")


@pytest.fixture(scope="module", autouse=True)
def _not_tmpfs(cache_dir):
    """O_DIRECT needs a real disk: the session cache must not be on tmpfs."""
    with open("/proc/mounts") as mounts:
        best = max((line.split() for line in mounts), key=lambda f: len(f[1]) if str(cache_dir).startswith(f[1])
                   else -1)
    if best[2] == "tmpfs":
        pytest.skip(f"{cache_dir} is on tmpfs: O_DIRECT is refused there")


@pytest.mark.parametrize("reads", ["through the cache", "staged", "o_direct"])
@pytest.mark.parametrize("augment", ["eval", "train"])
def test_decoded_posix_equals_arrow(tmp_path, augment, reads, monkeypatch):
    """Per-sample reads through the page cache (native), staged batches (no native crops), O_DIRECT."""
    from loadopt.loaders import crops

    if reads == "through the cache" and crops.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    if reads == "staged":
        monkeypatch.setattr(crops, "native", None)
    cfg = config(tmp_path, augment=augment)
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded"), seed=3))
    posix = PosixLoader(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL, o_direct=reads == "o_direct",
                                                             io_threads=3, task_kib=16, read_ahead=3), seed=3)
    assert_same(batches(posix), arrow)
    assert len(posix._raw.shards) > 3
    posix.close()


@pytest.mark.parametrize("prefill", [True, False])
def test_decoded_reads_through_a_cold_cache(tmp_path, monkeypatch, prefill):
    """Evicted shards: the first batch misses the page cache (RWF_NOWAIT). With `prefill` (the shards
    fit in memory) they are then read in sequentially, once; without it the next batches are
    announced to the kernel (POSIX_FADV_WILLNEED). Either way the batches equal arrow's."""
    from loadopt.loaders import crops
    from loadopt.loaders.posix import cache as posix_cache
    from loadopt.storage.tiers.pagecache import evict

    if crops.native is None:
        pytest.skip("loadopt._native is not built (no C compiler when loadopt was installed)")
    cfg = config(tmp_path, augment="train")
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded", frame="centre"), seed=3))
    posix = PosixLoader(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL, read_ahead=2, prefill=prefill,
                                                             frame="centre"), seed=3)
    posix.prepare()
    announced, prefilled = [], []
    advise, fill = posix_cache.advise, posix_cache.prefill
    monkeypatch.setattr(posix_cache, "advise", lambda loader, indices: (announced.append(indices),
                                                                          advise(loader, indices)))
    monkeypatch.setattr(posix_cache, "prefill", lambda shards: (prefilled.append(shards), fill(shards)))
    batches(posix)  # warm: nothing missed, nothing read ahead
    assert announced == [] and prefilled == []
    shards = [str(shard) for shard in posix.raw.shards]
    posix.close()  # its mappings of the shards hold their pages in the cache
    evict(shards)
    posix.set_epoch(0)
    assert_same(batches(posix), arrow)
    if prefill:
        assert len(prefilled) == 1 and announced == []
    else:
        assert announced and prefilled == []
    posix.close()


@pytest.mark.parametrize("o_direct", [False, True])
def test_encoded_posix_equals_arrow(tmp_path, o_direct):
    cfg = config(tmp_path, augment="train")
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="encoded"), seed=1))
    posix = PosixLoader(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL, o_direct=o_direct,
                                                             read_ahead=1, io_threads=1), seed=1)
    assert_same(batches(posix), arrow)
    # every stored JPEG read once (stored with restart markers: its own length, not the source's)
    assert posix.counters.bytes_read == int(raw_format.align_up(posix.raw.length.astype(np.int64)).sum())


@pytest.mark.parametrize("o_direct", [False, True])
def test_tokens_posix_equals_arrow(tmp_path, o_direct):
    cfg = tokens_config(tmp_path)
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings()))
    posix = batches(PosixLoader(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL, o_direct=o_direct)))
    assert_same(posix, arrow)
    x, y = posix[0]
    assert x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])


def test_resume_and_shards(tmp_path):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)

    def make(**kw):
        return PosixLoader(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL), seed=2, **kw)

    full = [b.indices.tolist() for b in make().host_batches()]
    first = make()
    head = []
    for batch in first.host_batches():
        head.append(batch.indices.tolist())
        if len(head) == 2:
            break
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [b.indices.tolist() for b in resumed.host_batches()] == full
    assert len(make()) == len(full) == 6
    seen = [i for rank in range(3) for b in make(rank=rank, world_size=3).host_batches() for i in b.indices]
    assert sorted(seen) == list(range(len(dataset)))


def test_plan_coalesces_adjacent_samples(tmp_path):
    cfg = config(tmp_path)
    loader = PosixLoader(open_dataset(cfg), cfg.pipeline, PosixSettings(shard_mib=SMALL, task_kib=1024))
    loader.prepare()
    raw = loader._raw
    same_shard = np.nonzero(raw.shard == 0)[0][:3]
    starts, tasks, nbytes = loader.plan(same_shard[::-1].copy())
    padded = int(raw_format.align_up(raw.length[same_shard[0]]))
    assert tasks == [(0, 0, 0, 3 * padded)] and nbytes == 3 * padded  # one read for three neighbours
    assert starts.tolist() == [2 * padded, padded, 0]
    _, tasks, _ = loader.plan(np.array([same_shard[0], same_shard[2]]))
    assert len(tasks) == 2  # a gap: two reads
    loader.close()


def test_index_round_trip(tmp_path):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)
    folder = raw_convert.convert(dataset, "encoded", shard_mib=SMALL)
    raw = raw_format.open_raw(folder, dataset, "encoded", None, SMALL, verify_labels=True)
    assert raw.meta["form"] == "encoded" and (raw.offset % raw_format.ALIGN == 0).all()
    for i in (0, 17, len(dataset) - 1):
        with open(raw.shards[raw.shard[i]], "rb") as f:
            f.seek(raw.offset[i])
            assert f.read(raw.length[i]) == with_restarts(dataset.read(i))  # the source's coefficients, restarts
    assert raw_convert.convert(dataset, "encoded", shard_mib=SMALL) == folder  # reused
    assert not list(folder.parent.glob("*.tmp"))


def test_truncated_shard_and_bad_index_are_named(tmp_path):
    cfg = config(tmp_path, image_size=40)
    dataset = open_dataset(cfg)
    folder = raw_convert.convert(dataset, "encoded", shard_mib=SMALL)
    raw = raw_format.open_raw(folder, dataset, "encoded", None, SMALL)
    shard = raw.shards[1]
    data = shard.read_bytes()
    try:
        shard.write_bytes(data[: len(data) - 5000])
        with pytest.raises(DatasetError, match=f"^{shard}: {len(data) - 5000} bytes, the manifest says .*truncated"):
            raw_format.open_raw(folder, dataset, "encoded", None, SMALL)
    finally:
        shard.write_bytes(data)
    index = folder / raw_format.shard_index_name(1)
    saved = index.read_bytes()
    try:
        rows = np.load(index)
        rows[2]["offset"] = 1 << 30
        np.save(index, rows)
        sample = int(rows[2]["sample_id"])
        with pytest.raises(DatasetError, match=f"{raw.shards[1]}: sample {sample} needs bytes 1073741824-"):
            raw_format.open_raw(folder, dataset, "encoded", None, SMALL, verify="none").locate(
                np.array([sample]))
        index.write_bytes(saved[:100])
        with pytest.raises(DatasetError, match="corrupt raw index"):
            raw_format.open_raw(folder, dataset, "encoded", None, SMALL, verify="none").locate(
                np.array([sample]))
        index.unlink()
        with pytest.raises(DatasetError, match="shard index not found"):
            raw_format.open_raw(folder, dataset, "encoded", None, SMALL, verify="none").locate(
                np.array([sample]))
    finally:
        index.write_bytes(saved)
    shard.unlink()
    try:
        with pytest.raises(DatasetError, match=f"^{shard}: shard file not found \\(the manifest lists it"):
            raw_format.open_raw(folder, dataset, "encoded", None, SMALL)
    finally:
        shard.write_bytes(data)


@pytest.mark.parametrize("form", ["encoded", "decoded"])  # staged batch reads; per-sample reads in C
def test_a_shard_truncated_after_opening_fails_the_read(tmp_path, form):
    cfg = config(tmp_path, image_size=40)
    loader = PosixLoader(open_dataset(cfg), cfg.pipeline, PosixSettings(form=form, shard_mib=SMALL))
    loader.prepare()
    shard = loader._raw.shards[0]
    data = shard.read_bytes()
    try:
        os.truncate(shard, 4096)
        with pytest.raises(DatasetError, match=f"^{shard}: ends at byte"):
            batches(loader)
    finally:
        shard.write_bytes(data)
        loader.close()


def test_no_convert_names_the_missing_folder(tmp_path):
    cfg = config(tmp_path, image_size=40)
    loader = PosixLoader(open_dataset(cfg), cfg.pipeline, PosixSettings(decoded_size=43))
    with pytest.raises(DatasetError, match="no raw conversion .* run `loadopt convert CONFIG --to raw --decoded`"):
        loader.prepare(convert_missing=False)


def test_o_direct_refused_is_one_line(tmp_path, monkeypatch):
    cfg = config(tmp_path)
    loader = PosixLoader(open_dataset(cfg), cfg.pipeline, PosixSettings(o_direct=True, shard_mib=SMALL))
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    with pytest.raises(DatasetError, match="refuses O_DIRECT .* set o_direct: false") as info:
        loader.prepare()
    assert "\n" not in str(info.value)


def test_cli_convert_to_raw_and_bench(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    import yaml

    from .test_cli import loadopt, one_line_error

    raw = tiny_config_dict(tmp_path / "out", loaders={"posix": {"form": "decoded", "decoded_size": 52,
                                                                "frame": "centre", "o_direct": True,
                                                                "shard_mib": SMALL}})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    with ThreadPoolExecutor(2) as pool:  # the two refused commands side by side: one start's time, not two
        no_convert = pool.submit(loadopt, "bench", path, "--no-convert")
        unknown = pool.submit(loadopt, "convert", path, "--to", "nope")
    line = one_line_error(no_convert.result())
    assert "no raw conversion" in line
    done = loadopt("convert", path, "--to", "raw", "--decoded", "--frame", "centre", "--size", "52", "--shard-mib",
                   str(SMALL))
    assert done.returncode == 0, done.stderr
    dataset = open_dataset(config_from_dict(raw, "p.yaml"))
    folder = raw_format.raw_path(dataset, "decoded", 52, SMALL)
    assert str(folder) in done.stdout and (folder / raw_format.MANIFEST).exists()
    proc = loadopt("bench", path, "--quick", "--no-convert")
    assert proc.returncode == 0, proc.stderr
    assert "posix decoded centre 52px o_direct=True" in proc.stdout
    assert "unknown format (known: arrow, raw)" in one_line_error(unknown.result())


@pytest.mark.parametrize("o_direct", [False, True])
def test_whole_frames_at_variable_lengths_equal_arrows(tmp_path, o_direct):
    """The `frames` form: each sample's whole frame (longer side <= max_side) at its own length and
    4 KiB-aligned offset, its dims in the index; read with preadv (or O_DIRECT) and cropped by the
    shared plan, the batches equal arrow's, epoch after epoch."""
    cfg = config(tmp_path, augment="train", max_side=72)
    dataset = open_dataset(cfg)
    arrow = ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded"), seed=4)
    posix = PosixLoader(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL, o_direct=o_direct), seed=4)
    posix.prepare()
    frames = posix._raw.frames
    assert posix.stored_form == "frames" and frames.shape == (len(dataset), 4) and frames[:, :2].max() <= 72
    assert len(set(posix._raw.length.tolist())) > 1  # variable lengths
    assert (posix._raw.length == frames[:, 0].astype(np.int64) * frames[:, 1] * 3).all()
    for epoch in (0, 1):
        arrow.set_epoch(epoch)
        posix.set_epoch(epoch)
        assert_same(batches(posix), batches(arrow))
    posix.close()


def test_a_reader_maps_the_index_of_the_shards_it_reads_only(tmp_path):
    """The manifest names every shard; a reader maps a shard's index only when it locates a sample in it."""
    cfg = config(tmp_path, image_size=36)
    dataset = open_dataset(cfg)
    folder = raw_convert.convert(dataset, "decoded", 41, shard_mib=SMALL, workers=1)
    raw = raw_format.open_raw(folder, dataset, "decoded", 41, SMALL, verify="none")
    table = raw.meta["shard_table"]
    assert len(table) > 3 and raw.opened_shards() == []
    first, second = table[1], table[2]
    shard, offset, length = raw.locate(np.arange(first["first"], first["first"] + first["samples"]))
    assert (shard == 1).all() and (length == 41 * 41 * 3).all() and raw.opened_shards() == [1]
    assert raw.index_bytes_read() == 4096 + raw.firsts.nbytes  # shard 1's rows and header: one page
    raw.locate(np.array([second["first"]]))
    assert raw.opened_shards() == [1, 2] and raw.index_bytes_read() == 2 * 4096 + raw.firsts.nbytes


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["posix", "kvikio"])
def test_on_a_gpu_equals_arrow(tmp_path, backend):
    """posix with its pinned ring, kvikio with real cuFile reads into GPU memory (where installed)."""
    from loadopt.loaders.registry import backend_class

    cls = backend_class(backend)
    available, reason = cls.available()
    if not available:
        pytest.skip(reason)
    cfg = config(tmp_path, augment="train")
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded"), device="cuda", seed=6))
    loader = cls(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL), device="cuda", seed=6)
    got = batches(loader)
    assert got[0][0].device.type == "cuda"
    assert_same(got, arrow)
    if backend == "kvikio":
        assert "cuFile" in loader.describe()


def test_a_prefill_of_a_missing_shard_names_it(tmp_path):
    from loadopt.loaders.posix.cache import prefill

    missing = tmp_path / "shard-00007.bin"
    with pytest.raises(DatasetError, match=f"^{missing}: cannot read \\(No such file or directory\\)$"):
        prefill([missing])


def test_the_o_direct_staging_buffer_is_page_aligned_zeroed_and_writable():
    """`aligned_empty` (private anonymous map, huge pages where given): at a page boundary as O_DIRECT
    requires, at least the bytes asked for in whole pages, zeroed, writable."""
    from loadopt.loaders.shard_reader import aligned_empty

    for nbytes in (1, 4096, 5 << 20):
        buffer = aligned_empty(nbytes)
        assert buffer.ctypes.data % 4096 == 0 and len(buffer) >= nbytes and len(buffer) % 4096 == 0
        assert not buffer.any()
        buffer[:] = 7
        assert buffer[-1] == 7
