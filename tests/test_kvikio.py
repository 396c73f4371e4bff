"""The kvikio backend: unavailable here with the reason, its batching and decoding logic run on the CPU
with the POSIX reader swapped in, the doctor's GDS rows, and (on a GPU) cuFile reads."""

import pytest
import torch

from loadopt.errors import DatasetError
from loadopt.loaders.arrow.loader import ArrowLoader, ArrowSettings
from loadopt.loaders.posix.loader import PosixLoader, PosixSettings
from loadopt.storage.open import open_dataset

from .test_arrow import assert_same, batches
from .test_raw import SMALL, config, tokens_config


def test_kvikio_is_unavailable_here_with_the_reason():
    from loadopt.loaders.registry import backend_class

    available, reason = backend_class("kvikio").available()
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: kvikio may well be available")
    assert not available and ("libcuda.so.1" in reason or "kvikio" in reason)


def kvikio_on_the_cpu(dataset, pipeline, settings, **kw):
    """The kvikio backend with its device read swapped for the POSIX reader into host staging."""
    from loadopt.loaders.kvikio.loader import KvikioLoader
    from loadopt.loaders.shard_reader import PosixReader

    loader = KvikioLoader(dataset, pipeline, settings, **kw)
    loader.reader_class, loader.staging_device = PosixReader, "cpu"
    return loader


@pytest.mark.parametrize("augment", ["eval", "train"])
def test_kvikio_logic_equals_arrow_decoded(tmp_path, augment):
    cfg = config(tmp_path, augment=augment)
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings(form="decoded"), seed=4))
    loader = kvikio_on_the_cpu(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL, task_kib=8), seed=4)
    assert_same(batches(loader), arrow)
    loader.close()


def test_kvikio_logic_tokens_and_resume(tmp_path):
    cfg = tokens_config(tmp_path)
    dataset = open_dataset(cfg)
    arrow = batches(ArrowLoader(dataset, cfg.pipeline, ArrowSettings()))
    assert_same(batches(kvikio_on_the_cpu(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL))), arrow)
    first = kvikio_on_the_cpu(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL))
    head = [x.clone() for _, (x, _) in zip(range(3), first, strict=False)]
    resumed = kvikio_on_the_cpu(dataset, cfg.pipeline, PosixSettings(shard_mib=SMALL))
    resumed.load_state_dict(first.state_dict())
    rest = [x.clone() for x, _ in resumed]
    assert all(torch.equal(a, b[0]) for a, b in zip(head + rest, arrow, strict=True))


def cpu_jpeg_decoder(streams, device):
    """Stands in for the GPU decoder: the same bitstreams in, CHW uint8 tensors out (simplejpeg)."""
    from loadopt.imaging.decode import decode_array

    return [torch.from_numpy(decode_array(bytes(s.numpy()), "simplejpeg")).permute(2, 0, 1)
            for s in streams]


@pytest.mark.parametrize("augment", ["eval", "train"])
def test_kvikio_logic_encoded_equals_posix(tmp_path, augment):
    """The encoded form: bitstreams read into staging, one batched decode, the shared crop plan."""
    cfg = config(tmp_path, augment=augment)
    dataset = open_dataset(cfg)
    posix = batches(PosixLoader(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL), seed=5))
    loader = kvikio_on_the_cpu(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL), seed=5)
    loader.jpeg_decoder = cpu_jpeg_decoder
    got = batches(loader)
    assert got[0][0].shape[1] == 3  # NCHW
    assert_same(got, posix)
    loader.close()


def test_kvikio_encoded_names_a_sample_the_decoder_rejects(tmp_path):
    cfg = config(tmp_path)
    dataset = open_dataset(cfg)

    from loadopt.imaging.reencode import with_restarts

    stored = with_restarts(dataset.read(0))  # the encoded form's JPEG: the source's with restart markers

    def fussy(streams, device):  # rejects any batch holding sample 0's bytes
        if any(bytes(s.numpy()) == stored for s in streams):
            raise ValueError("bad Huffman code")
        return cpu_jpeg_decoder(streams, device)

    for on_error in ("raise", "skip"):
        loader = kvikio_on_the_cpu(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL),
                                   on_error=on_error)
        loader.jpeg_decoder = fussy
        if on_error == "raise":
            with pytest.raises(DatasetError, match=r"cannot decode \(ValueError: bad Huffman code\) \(sample 0\)"):
                batches(loader)
        else:
            labels = torch.cat([y for _, y in batches(loader)])
            assert len(labels) == len(dataset) - 1 and len(loader.counters.skipped) == 1
        loader.close()


def test_kvikio_encoded_without_a_gpu_decoder_is_one_line(tmp_path):
    from loadopt.errors import BackendUnavailable
    from loadopt.loaders.kvikio.loader import KvikioLoader, gpu_jpeg_decoder

    if gpu_jpeg_decoder()[0] is not None:
        pytest.skip(f"a GPU JPEG decoder is installed here ({gpu_jpeg_decoder()[1]})")
    cfg = config(tmp_path)
    loader = KvikioLoader(open_dataset(cfg), cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL))
    with pytest.raises(BackendUnavailable, match="form encoded: no GPU JPEG decoder installed"):
        loader.prepare()


def test_doctor_has_the_gds_rows(tmp_path):
    from loadopt.doctor import _mount_of, run_checks

    rows = {check.item: check for check in run_checks()}
    for item in ("libcufile", "GDS mode", "nvidia-fs module", "/run/udev", "dataset filesystem"):
        assert item in rows and rows[item].detail
    assert "KVIKIO_COMPAT_MODE" in rows["GDS mode"].detail
    point, fstype = _mount_of(str(tmp_path))
    assert str(tmp_path).startswith(point) and fstype != "unknown"


@pytest.mark.parametrize(("setting", "kvikio_prefers_compat", "nvidia_fs", "true_gds", "why"), [
    ("ON", False, True, False, "KVIKIO_COMPAT_MODE is ON"),
    ("AUTO", True, True, False, "kvikio found no usable cuFile"),
    ("AUTO", False, False, False, "nvidia-fs kernel module is not loaded"),
    ("AUTO", False, True, True, "true GDS"),
])
def test_cufile_mode_says_which_path_reads_and_why(monkeypatch, setting, kvikio_prefers_compat, nvidia_fs,
                                                  true_gds, why):
    """The mode in effect from kvikio's setting, kvikio's own choice under AUTO, and the nvidia-fs module
    (a stand-in kvikio.defaults: the real one cannot reach cuFile without a GPU)."""
    import enum
    import sys
    import types

    from loadopt.loaders.kvikio import loader as kvikio_loader

    mode = enum.Enum("CompatMode", "ON OFF AUTO")[setting]
    defaults = types.SimpleNamespace(get=lambda name: mode, is_compat_mode_preferred=lambda: kvikio_prefers_compat)
    monkeypatch.setitem(sys.modules, "kvikio", types.SimpleNamespace(defaults=defaults))
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    modules = "nvidia_fs 282624 0 - Live\n" if nvidia_fs else "ext4 1 0 - Live\n"
    monkeypatch.setattr(kvikio_loader, "Path", lambda path: types.SimpleNamespace(read_text=lambda: modules))
    assert kvikio_loader.cufile_mode()[0] is true_gds
    assert why in kvikio_loader.cufile_mode()[1]


@pytest.mark.gpu
def test_kvikio_encoded_on_a_gpu_is_close_to_posix(tmp_path):
    """cuFile reads of the JPEG bytes, the installed GPU decoder, the float resize kernel: the labels
    and order of posix, pixels within a few levels (nvJPEG's IDCT and the float kernel round apart)."""
    from loadopt.loaders.kvikio.loader import gpu_jpeg_decoder
    from loadopt.loaders.registry import backend_class

    available, reason = backend_class("kvikio").available()
    if not available or gpu_jpeg_decoder()[0] is None:
        pytest.skip(reason or gpu_jpeg_decoder()[1])
    cfg = config(tmp_path, augment="train")
    dataset = open_dataset(cfg)
    posix = batches(PosixLoader(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL), seed=8))
    loader = backend_class("kvikio")(dataset, cfg.pipeline, PosixSettings(form="encoded", shard_mib=SMALL),
                                     device="cuda", seed=8)
    got = batches(loader)
    assert "decoded by" in loader.describe()
    for (x, y), (px, py) in zip(got, posix, strict=True):
        assert x.device.type == "cuda" and torch.equal(y.cpu(), py)
        diff = (x.cpu().int() - px.int()).abs().float()
        assert diff.mean() < 1.5 and diff.quantile(0.99) <= 12
