"""The `kvikio` backend: raw shards read with cuFile (`kvikio.CuFile.pread`) straight into GPU memory.

Same shards, batch plan (sorted, coalesced, split into `task_kib` reads) and double-buffered
producer as the `posix` backend; the staging buffer and the batch ring are CUDA tensors, every read
of a batch is in flight at once (kvikio's own thread pool, `io_threads` threads), and the batch is
finished on the GPU with torch ops: crops + flips of decoded pixels, windows of token ids. Whether
cuFile runs in true GDS mode or in compat mode (a POSIX bounce buffer), and why, is in `describe()`
and so in the results.

The `encoded` form is decoded on the GPU in one batched call (torchvision's nvJPEG binding, else
nvImageCodec, whichever is installed), then cropped, resized and flipped there with the shared crop
plan. Every GPU JPEG decoder parses the bitstream on the host (nvJPEG's Huffman stage runs on the
CPU for all but the hardware decoder's path, which is also fed from host memory), so for this form
cuFile reads the JPEG bytes into pinned host memory: bytes read into GPU memory would have to come
back first. `describe()` says so; the decoded form is the one where GDS can pay.

On a tier that is not plain local disk the shards are read through the tier's filesystem object
into pinned host memory (cuFile reads would bypass its limits) and finished on the GPU as above.

Every step but the device read and the GPU decode is plain torch on whatever device the staging
buffer is on, so the tests run it on the CPU with the reader swapped for the POSIX one
(`reader_class`, `staging_device`) and the decoder for a CPU one (`jpeg_decoder`).
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import replace
from pathlib import Path

import torch

from loadopt.errors import DatasetError
from loadopt.loaders.base import WorkKind
from loadopt.loaders.fillers import FillContext
from loadopt.loaders.kvikio.device_fillers import DEVICE_FILLERS
from loadopt.loaders.posix.loader import PosixLoader, PosixSettings
from loadopt.loaders.shard_reader import aligned_empty
from loadopt.loaders.transforms import DeviceDecoder
from loadopt.storage.forms.tier_reads import TierReader


def nvidia_fs_loaded() -> bool:
    """Whether the nvidia-fs kernel module, which true GDS needs, is loaded."""
    try:
        return "nvidia_fs" in Path("/proc/modules").read_text()
    except OSError:
        return False


def cufile_mode() -> tuple[bool, str]:
    """(true GDS, why) for the cuFile reads of this process: kvikio's compat-mode setting, and the
    nvidia-fs kernel module that true GDS needs."""
    import kvikio.defaults

    compat = kvikio.defaults.compat_mode() if hasattr(kvikio.defaults, "compat_mode") else \
        kvikio.defaults.get("compat_mode")
    name = getattr(compat, "name", str(compat))
    if name in ("ON", "True", "1"):
        return False, f"compat mode: KVIKIO_COMPAT_MODE is {name}"
    # kvikio's own choice under AUTO (kvikio >= 25): POSIX reads when cuFile cannot be used at all
    preferred = getattr(kvikio.defaults, "is_compat_mode_preferred", None)
    if preferred is not None and preferred():
        return False, "compat mode: kvikio found no usable cuFile (libcufile or the CUDA driver) and reads with POSIX"
    if not nvidia_fs_loaded():
        return False, "compat mode: the nvidia-fs kernel module is not loaded (cuFile's own POSIX fallback)"
    return True, f"true GDS (compat_mode {name}, nvidia-fs loaded)"


def gpu_jpeg_decoder() -> tuple[DeviceDecoder | None, str]:
    """A batched GPU JPEG decoder (host bitstreams in, CHW uint8 device tensors out) and its name, or
    None and why: torchvision's `decode_jpeg(device="cuda")`, else nvImageCodec."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        def torchvision_decode(streams: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
            return decode_jpeg(streams, mode=ImageReadMode.RGB, device=device)

        return torchvision_decode, "torchvision nvJPEG"
    except Exception:  # noqa: BLE001 - torchvision is optional and may fail to import beside this torch
        pass
    try:
        # `nvidia` is a namespace package (DALI's too) whose modules mypy cannot see: imported by name
        nvimgcodec = importlib.import_module("nvidia.nvimgcodec")
        decoder = nvimgcodec.Decoder()

        def nvimgcodec_decode(streams: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
            images = decoder.decode([stream.numpy() for stream in streams])
            if any(image is None for image in images):
                raise ValueError("nvImageCodec could not decode a sample of the batch")
            # HWC device images (__cuda_array_interface__): viewed by torch, no copy.
            return [torch.as_tensor(image, device=device).permute(2, 0, 1) for image in images]

        return nvimgcodec_decode, "nvImageCodec"
    except Exception:  # noqa: BLE001 - not installed
        pass
    return None, ("no GPU JPEG decoder installed: pip install torchvision (matching torch) or "
                  "nvidia-nvimgcodec-cu12, or use form: decoded")


class KvikioReader:
    """cuFile reads into CUDA memory: one `CuFile` per shard, every read returned as a future."""

    def __init__(self, shards: list, o_direct: bool = False) -> None:
        import kvikio

        self.shards = shards
        self.files = [kvikio.CuFile(str(shard), "r") for shard in shards]

    def submit(self, shard: int, offset: int, out: torch.Tensor):
        # Host memory (the encoded form's pinned staging) goes to kvikio as a numpy view: torch exposes
        # the CUDA array interface for device tensors only.
        buffer = out.numpy() if out.device.type == "cpu" else out
        return _Waitable(self.files[shard].pread(buffer, out.numel(), offset), out.numel(), self.shards[shard], offset)

    def close(self) -> None:
        for f in self.files:
            f.close()
        self.files = []


class _Waitable:
    """A kvikio IOFuture with the `result()` of a concurrent Future and a short read as an error."""

    def __init__(self, future, nbytes: int, shard, offset: int) -> None:
        self.future, self.nbytes, self.shard, self.offset = future, nbytes, shard, offset

    def result(self) -> None:
        got = self.future.get()
        if got != self.nbytes:
            raise DatasetError(f"{self.shard}: ends at byte {self.offset + got}, the index needs "
                               f"{self.offset + self.nbytes} (truncated shard)")


class KvikioLoader(PosixLoader):
    name = "kvikio"
    Settings = PosixSettings
    fillers = DEVICE_FILLERS  # each form finished on the staging buffer's device
    runs_sample_transform = False  # finished on the device: a per-sample Python transform would copy it back
    reader_class: type = KvikioReader
    sample_reads = False  # whole batches into device memory, finished there
    staging_device: str = "cuda"
    jpeg_decoder: DeviceDecoder | None = None  # the encoded form's; None: the GPU decoder installed here

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = ""
        self._decoder_name = ""

    def decodes_in_workers(self) -> bool:
        """Never: its batches are read whole into device memory and decoded there (`fillers`), not by posix's crop
        worker processes."""
        return False

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            return False, "libcuda.so.1 not found: kvikio may import, but every cuFile read needs the CUDA driver"
        try:
            import kvikio  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason
            return False, f"kvikio not usable ({type(exc).__name__}: {exc}); pip install 'loadopt[gds]'"
        if not torch.cuda.is_available():
            return False, "no CUDA device visible to torch"
        return True, ""

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list]:
        # Reads in flight (kvikio's pool waits on DMA, not on cores) and batches ahead; decoded form only.
        return {"io_threads": [2, 4, 8, 16], "read_ahead": [1, 2, 4], "prefetch": [1, 2, 4]}

    @classmethod
    def cpu_demand(cls, settings: PosixSettings) -> int:
        return 1  # the producer thread; crops run as GPU kernels, reads as DMA

    @classmethod
    def memory_demand(cls, settings: PosixSettings, pipeline) -> dict[str, int]:
        return {"shared": 0, "pinned": 0}  # staging and ring live in device memory

    @classmethod
    def work_kind(cls, settings, recipe=None) -> str:
        # Crops and resizes run on the GPU, off the host: what bounds the host is the copy of the stored
        # pixels or tokens; the encoded form is decoded on the GPU.
        if (recipe or {}).get("kind") == "tokens":
            return WorkKind.TOKEN_GATHER
        if (recipe or {}).get("kind") == "records":  # read into device memory, first bytes copied there
            return WorkKind.IO
        return WorkKind.PIXEL_COPY if settings.form == "decoded" else WorkKind.DEVICE_DECODE

    def describe(self) -> str:
        text = f"{super().describe()}{f' cuFile {self.mode}' if self.mode else ''}"
        if self._decoder_name:  # found for the encoded forms
            text += f", JPEG bytes read into pinned host memory, decoded by {self._decoder_name}"
        return text

    def fill_context(self) -> FillContext:
        return replace(super().fill_context(), device_decoder=self._device_decoder)

    def _device_decoder(self) -> tuple[DeviceDecoder | None, str]:
        """The encoded forms' GPU decoder (`jpeg_decoder`, else the one installed here) and its name."""
        if self.jpeg_decoder is None:
            self.jpeg_decoder, why = gpu_jpeg_decoder()
            self._decoder_name = why if self.jpeg_decoder is not None else ""
            return self.jpeg_decoder, why
        return self.jpeg_decoder, self._decoder_name

    def prepare(self, progress=None, convert_missing: bool = True) -> None:
        self.open_filler()  # first: an encoded form without a GPU decoder is refused before anything is converted
        super().prepare(progress, convert_missing)
        if self.reader_class is KvikioReader and not self._through_tier():
            self.mode = cufile_mode()[1]
            import kvikio.defaults

            if hasattr(kvikio.defaults, "set"):  # the thread pool serving every pread
                kvikio.defaults.set({"num_threads": self.settings.io_threads,
                                     "task_size": self.settings.task_kib * 1024})

    def _through_tier(self) -> bool:
        """Whether the shards are read through a storage tier (host reads; cuFile cannot pass its limits)."""
        return isinstance(self._reader, TierReader)

    def _new_staging(self, nbytes: int) -> torch.Tensor:
        if torch.device(self.staging_device).type == "cpu":  # the POSIX reader swapped in: aligned host memory
            return torch.from_numpy(aligned_empty(nbytes))
        if self._through_tier():  # the tier's reads land in host memory, pinned for the copy to the device
            return torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        if self.filler.bytes_on_host:  # JPEG bitstreams: the decoders parse them on the host
            return torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.staging_device)

    def _make_ring(self) -> list[torch.Tensor]:
        # image slots are HWC (RingLoader.layout), decoded JPEGs' crops written through CHW views
        slot, dtype = self.filler.slot_shape()
        return list(torch.empty((self.settings.prefetch + 2, *slot), dtype=dtype, device=self.staging_device))

    def _submit(self, staging, tasks, io) -> list:
        reader = self._reader
        if not isinstance(reader, KvikioReader):  # a host reader: its blocking reads go to the pool
            return super()._submit(staging, tasks, io)
        return [reader.submit(shard, offset, staging[at : at + nbytes]) for shard, offset, at, nbytes in tasks]
