"""The `dali` backend: NVIDIA DALI decodes, crops, flips and normalises in its native engine.

`reader: external` (the default) feeds DALI through `fn.external_source` with the batches of
loadopt's shared sampler, so `dali` delivers the same samples per epoch as every other backend and
resumes exactly. A small thread pool reads each batch ahead (ImageFolder files, local or through
fsspec, or zero-copy views of the memory-mapped Arrow `encoded` file) and plans each sample's crop
with `transforms.plan` from the JPEG header, so crops and flips are the other backends' too. DALI
then decodes only the rows and columns the crop needs (`decoders.image_slice`, plus the filter's
margin), resizes the crop (linear, antialiased: PIL's bilinear filter) and runs
`crop_mirror_normalize` to NCHW float or uint8. On a GPU the decoder is `mixed` (nvImageCodec,
the hardware JPEG decoder where there is one) and the batch stays on the device. The pipeline's graph is
`DaliGraph`; the reading ahead and crop planning that feed it, `Feed` and `plan_batch`.

`reader: native` is DALI's own `fn.readers.file` (local files only) with `decoders.image_random_crop`:
its order, shards and crops are DALI's (describe() says `order=dali`), and it cannot resume mid-epoch.

A decode error fails DALI's whole batch: the batch is then decoded sample by sample to find the bad
files, which are reported by the `on_error` policy with DALI's message (not its stack).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from loadopt.errors import BackendUnavailable, ConfigError, DatasetError, LoadoptError
from loadopt.loaders.base import HostBatch, Loader, LoaderState, WorkKind
from loadopt.loaders.crop_processes import fork_available
from loadopt.loaders.dali.feed import Columns, Feed, Prepared, SampleFeed, dali_error, pil_refusal, plan_batch
from loadopt.loaders.dali.pipeline import DaliGraph, NativeFiles
from loadopt.loaders.dali.settings import DaliSettings
from loadopt.loaders.dali.workers import SampleWorkers
from loadopt.loaders.sampler import EpochOrder
from loadopt.loaders.serving import RequestPath
from loadopt.recipe import Recipe
from loadopt.storage.sources.imagefolder import ImageDataset
from loadopt.storage.sources.tokens import TokenDataset

if TYPE_CHECKING:
    import fsspec

INSTALL_HINT = "pip install 'loadopt[dali]'"


class _TierRanges(NamedTuple):
    """Where each sample's bytes are in the Arrow shards read through a storage tier (range requests)."""

    fs: fsspec.AbstractFileSystem
    paths: list[str]
    file_of: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray


class DaliLoader(Loader[DaliSettings]):
    name = "dali"
    Settings = DaliSettings
    # DALI's CPU decoder has died of a segfault on a JPEG with its scan data zeroed ("[jpeg_parser] Invalid
    # marker"), taking the process with it: `loadopt bench` runs each of its settings in a child process.
    runs_apart = True
    runs_sample_transform = True  # reader external: loadopt's decode and the transform in DALI's Python operator

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        s = self.settings
        if isinstance(self.dataset, TokenDataset):
            raise ConfigError("loaders.dali: DALI decodes images; token datasets use torch, arrow or posix")
        self.decoder = s.decoder if s.decoder != "auto" else "mixed" if self.device.type == "cuda" else "cpu"
        if self.decoder == "mixed" and not torch.cuda.is_available():
            raise BackendUnavailable("loaders.dali.decoder mixed needs a CUDA device; none is visible here")
        # DALI's file reader opens one file per sample: tar shards and Parquet files hold many.
        one_file_each = isinstance(self.dataset, ImageDataset)
        if s.reader == "native" and (s.source != "images" or not self.dataset.is_local() or not one_file_each):
            raise ConfigError("loaders.dali.reader native reads local ImageFolder files only; use reader: "
                              "external for remote, tar-shard or Parquet datasets, or source: arrow")
        if s.reader == "native" and any(name.lower().endswith(".jxl") for name in self.dataset.local_files()):
            raise ConfigError("loaders.dali.reader native: DALI decodes no JPEG XL (.jxl files in the dataset); use "
                              "reader: external, which hands DALI the JPEG each one was made from")
        self.graph = DaliGraph(s, self.pipeline, self.decoder, self.device, self.seed)
        self._views: list[tuple[np.ndarray, np.ndarray]] | None = None  # Arrow: (offsets, data) per record batch
        self._first_rows = np.zeros(0, np.int64)  # Arrow: each record batch's first sample
        self._tier_ranges: _TierRanges | None = None  # Arrow on a tier
        self._pipe: Any = None
        self._refused: dict[int, str] | None = None  # screen_samples: the samples PIL refused, index -> why
        self._native_done = 0  # native: batches DALI has delivered in its current epoch
        self._sample_workers: SampleWorkers | None = None  # the job's transform: its worker processes

    # -- the registry's questions ----------------------------------------------------------------

    @classmethod
    def supports(cls, dataset) -> tuple[bool, str]:
        if dataset.kind == "records":
            # DALI's docs (operations/nvidia.dali.fn.readers.numpy, examples/.../numpy_reader): it reads NumPy
            # array files (*.npy, file_filter '*.npy'), one array a file; not npz (NVIDIA/DALI#1858: "no .npz yet")
            return False, ("dali: its record reader, fn.readers.numpy, reads .npy files (one array each); "
                           "records here are npz archives (DLIO's) or raw byte ranges")
        return super().supports(dataset)

    @classmethod
    def runs_pipeline(cls, pipeline, settings: DaliSettings) -> tuple[bool, str]:
        if pipeline.transform is not None and settings.reader == "native":
            return False, ("dali reader native: DALI's own reader, crops and order; the job's own transform runs "
                           "with reader: external")
        return super().runs_pipeline(pipeline, settings)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import nvidia.dali  # noqa: F401
            import nvidia.dali.plugin.pytorch  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure is the reason
            return False, f"nvidia-dali not usable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        return True, ""

    @classmethod
    def knob_space(cls, cores: int) -> dict[str, list[Any]]:
        # normalise=device with NHWC: uint8 straight from the resize, normalised on the device (one pass
        # over the output fewer in DALI; benchmarks/dali_cpu.py measures it).
        return {"num_threads": list(range(1, max(1, cores) + 1)), "prefetch_queue_depth": [1, 2, 3],
                "normalise": ["dali", "device"], "layout": ["NCHW", "NHWC"]}

    @classmethod
    def cpu_demand(cls, settings: DaliSettings) -> int:
        return settings.num_threads

    @classmethod
    def work_kind(cls, settings: DaliSettings, recipe: Recipe | None = None) -> str:
        # auto decodes on the GPU on a CUDA device: the run's label says `mixed` there (attribution reads it)
        return WorkKind.DEVICE_DECODE if settings.decoder == "mixed" else WorkKind.JPEG_DECODE

    def reads_conversion(self) -> bool:
        return self.settings.source == "arrow"

    def request_paths(self, max_batch: int) -> list[RequestPath]:
        """Each dynamic batch through DALI (`external_source`), decoded on the GPU (`mixed`) where there is one."""
        from loadopt.loaders.dali.serving import DaliRequests

        return [DaliRequests(f"dali {self.decoder} threads={self.settings.num_threads}", self.pipeline, self.seed,
                             max_batch, self.settings.num_threads, self.decoder, self.device)]

    def describe(self) -> str:
        s = self.settings
        text = f"{self.decoder} num_threads={s.num_threads} prefetch={s.prefetch_queue_depth}"
        if s.reader == "native":
            text += " reader=native order=dali"
        if s.source != "images":
            text += f" source={s.source}"
        if not s.roi_decode:
            text += " roi_decode=false"
        if s.normalise != "dali" and self.pipeline.dtype == "float32":
            text += f" normalise={s.normalise}"
        return text + (" NHWC" if s.layout == "NHWC" else "")

    def recipe(self) -> Recipe:
        found = super().recipe()
        # reader native: DALI's file reader orders the samples, not the sampler (`auto` needs pipeline.order: any)
        return {**found, "order": "dali"} if self.settings.reader == "native" else found

    # -- storage ---------------------------------------------------------------------------------

    def prepare(self, progress: Callable[[int, int], None] | None = None, convert_missing: bool = True) -> None:
        if self.settings.source != "arrow" or self._views is not None:
            return
        from loadopt.storage.forms import placement, tier_reads
        from loadopt.storage.forms.arrow_convert import convert, open_conversion, reference_names
        from loadopt.storage.forms.arrow_format import arrow_path
        from loadopt.storage.forms.arrow_outline import arrow_layout
        from loadopt.storage.forms.ready import make_ready, read_from

        path = arrow_path(self.dataset, "encoded", None)
        make_ready(self.dataset, path, reference_names,
                   (lambda: convert(self.dataset, "encoded", None, progress=progress)) if convert_missing else None,
                   "arrow", "encoded")
        views = []
        conversion = open_conversion(self.dataset, "encoded", None, tier=placement.conversion_tier(self.dataset))
        for batch in conversion:
            column = batch.column(batch.num_columns - 1)
            offsets = np.frombuffer(column.buffers()[1], np.int32, batch.num_rows + 1, column.offset * 4)
            views.append((offsets, np.frombuffer(column.buffers()[2], np.uint8)))
        self._views, self._first_rows = views, conversion.first_rows
        if isinstance(conversion.images, tier_reads.ShadowShards):  # the data on the remote home, outlines here
            images = conversion.images
            self._tier_ranges = _TierRanges(images.fs, images.paths, images.file_of, images.offsets, images.lengths)
            return
        home = read_from(self.dataset, path)
        if home.tier is not None:  # on a tier every sample's bytes are a range request through it, not the map
            file_of, offsets, lengths = arrow_layout(conversion.files)
            self._tier_ranges = _TierRanges(home.tier, home.paths([f.name for f in conversion.files]), file_of,
                                            offsets, lengths)

    def storage_files(self) -> list[str]:
        if self.settings.source == "arrow":
            from loadopt.storage.forms import shard_work
            from loadopt.storage.forms.arrow_format import arrow_path, shard_files

            path = arrow_path(self.dataset, "encoded", None)
            try:
                return [str(f) for f in shard_files(path, shard_work.read_manifest(path, "Arrow conversion"))]
            except DatasetError:  # not converted yet: nothing of it in the page cache
                return []
        return super().storage_files()

    def _encoded(self, index: int) -> np.ndarray:
        if self._tier_ranges is not None:
            fs, paths, file_of, offsets, lengths = self._tier_ranges
            start = int(offsets[index])
            return np.frombuffer(fs.cat_file(paths[file_of[index]], start=start, end=start + int(lengths[index])),
                                 np.uint8)
        if self._views is not None:
            record = int(np.searchsorted(self._first_rows, index, side="right")) - 1
            local = index - int(self._first_rows[record])
            offsets, data = self._views[record]
            return data[offsets[local] : offsets[local + 1]]  # a view of the mapped file: no copy
        return np.frombuffer(self.dataset.read(index), np.uint8)

    # -- the pipeline ----------------------------------------------------------------------------

    def _prepare_batch(self, indices: np.ndarray, epoch: int) -> Prepared:
        """Read a batch and plan each sample's crop (in a reader thread)."""
        return plan_batch(indices, epoch, self._encoded, self.pipeline, self.seed, self.settings.roi_decode,
                          self._refused)

    def screen_samples(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Decode every sample once with PIL (libjpeg-turbo for JPEGs) so that DALI never sees one PIL refuses: each
        is then a failure under the on_error policy, named. For a run kept in the bench's process (a CUDA device,
        torchrun, a tuning trial, a stage), where a crash of DALI's decoder on bad bytes would end the whole bench.
        The list is cached per dataset fingerprint (the bench's later runs and the other ranks read it). Reader
        `external` only: DALI's native reader opens the files itself."""
        import json

        from loadopt.files import atomic_write_text, cache_dir

        if self._refused is not None or self.settings.reader != "external":
            return
        path = cache_dir() / "screened" / f"{self.dataset.fingerprint}.json"
        try:
            saved = json.loads(path.read_text())
            if saved.get("samples") == len(self.dataset):
                self._refused = {int(k): str(v) for k, v in saved["refused"].items()}
                return
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass  # none yet, or unreadable: screened again
        refused: dict[int, str] = {}
        total = len(self.dataset)
        with ThreadPoolExecutor(max(1, self.settings.num_threads), thread_name_prefix="loadopt-dali-screen") as pool:
            # PIL decodes with the GIL released: the threads decode side by side
            for start in range(0, total, 256):
                chunk = range(start, min(total, start + 256))
                for index, why in zip(chunk, pool.map(self._refusal, chunk), strict=True):
                    if why is not None:
                        refused[index] = f"refused before DALI saw it: PIL cannot decode it ({why})"
                if progress is not None:
                    progress(chunk.stop, total)
        self._refused = refused
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps({"samples": total, "refused": {str(k): v for k, v in refused.items()}}))
        except (OSError, LoadoptError):  # screened again next time: slower, never wrong
            pass

    def _refusal(self, index: int) -> str | None:
        try:
            data = self._encoded(index)
        except LoadoptError:
            raise
        except Exception:  # noqa: BLE001 - a read that fails (maybe for a while) is met again in the run, not cached
            return None
        return pil_refusal(data)

    def _new_pipeline(self, source: Callable[[], Columns] | None, depth: int | None = None) -> Any:
        native = None
        if self.settings.reader == "native":
            native = NativeFiles(self.dataset.local_files(), self.rank, self.world_size)
        graph = self.graph
        if self.sample_transform is not None:
            workers = self.sample_workers()
            graph = replace(graph, transform=self.sample_transform, batch_maker=workers)
            if workers is not None:
                workers.epoch = self.epoch
        return graph.build(source, self.epoch, depth, native)

    def sample_workers(self) -> SampleWorkers | None:
        """The worker processes that make each batch's samples for the job's transform (forked once, before DALI's
        pipeline starts its threads); None where fork is unavailable (DALI's Python operator then makes them)."""
        if self._sample_workers is None and fork_available() and self.sample_transform is not None:
            most = int(self.dataset.sizes.max()) * self.pipeline.batch_size * 2  # room for a batch of large ones
            self._sample_workers = SampleWorkers(self.pipeline, self.seed, self.sample_transform,
                                                 max(1, self.settings.num_threads), most)
        return self._sample_workers

    def engine_rate(self, batches: int = 6) -> tuple[float, float]:
        """(images/s, CPU seconds per wall second) of this pipeline alone: decode, crop, resize, flip and
        normalise over batches read and planned beforehand (not timed), the first one not timed either.
        With `num_threads: 1`, times the cores, it is DALI's ceiling on this machine."""
        planned = self.order().batches()[: batches + 1]
        prepared = [self._prepare_batch(indices, self.epoch) for indices in planned]
        # every batch already read and planned
        pipe = self._new_pipeline(Feed.of_prepared(prepared, self.sample_transform is not None))
        self.graph.run(pipe)  # allocations
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(len(planned) - 1):
            self.graph.run(pipe)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return sum(len(p.indices) for p in prepared[1:]) / wall, cpu / wall

    def _host_batch(self, images: torch.Tensor, indices: np.ndarray, failures: list[tuple[int, str]],
                    nbytes: int | None) -> HostBatch:
        labels = torch.from_numpy(self.dataset.labels[indices])
        if images.is_cuda:
            labels = labels.to(images.device, non_blocking=True)  # the whole batch is on the device: no h2d
        return HostBatch(images, labels, indices, self.settings.layout, normalised=self.graph.normalised(),
                         failures=failures, bytes_read=nbytes)

    # -- batches ---------------------------------------------------------------------------------

    def order(self) -> EpochOrder:
        if self.settings.reader == "native":
            return _dali_shard_order(self)
        return super().order()

    def load_state_dict(self, state: LoaderState) -> None:
        if self.settings.reader == "native" and int(state.get("batches_done", 0)):
            raise ConfigError("loaders.dali.reader native: DALI's file reader cannot resume mid-epoch (its order "
                              "is its own); use reader: external to resume exactly")
        super().load_state_dict(state)

    def produce(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        if self.settings.reader == "native":
            return self._produce_native(batches)
        return self._produce_external(batches)

    def _produce_external(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        self.prepare()
        epoch, s = self.epoch, self.settings
        pool = ThreadPoolExecutor(s.read_threads, thread_name_prefix="loadopt-dali-read")
        feed = Feed(lambda indices: self._prepare_batch(indices, epoch), batches, pool,
                    ahead=s.prefetch_queue_depth + s.read_threads, with_indices=self.sample_transform is not None)
        pipe = self._new_pipeline(feed)
        try:
            for k in range(len(batches)):
                prepared = feed.get(k)
                if not len(prepared.indices):  # every sample failed before DALI: never fed
                    yield HostBatch(torch.empty(0), torch.empty(0, dtype=torch.int64), prepared.indices,
                                    s.layout, failures=prepared.failures, bytes_read=prepared.bytes_read)
                    continue
                try:
                    (images,) = self.graph.run(pipe)
                    indices, failures = prepared.indices, prepared.failures
                    if self._sample_workers is not None and self._sample_workers.failures:
                        images, indices, failures = self._without_failed(images, indices, failures)
                except RuntimeError as exc:  # a sample DALI cannot decode fails its whole batch
                    del pipe
                    images, indices, failures = self._isolate(prepared, exc)
                    feed.cursor = k + 1  # the batches DALI had taken after this one are fed again
                    pipe = self._new_pipeline(feed)
                feed.forget(k)
                yield self._host_batch(images, indices, failures, prepared.bytes_read)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _without_failed(self, images: torch.Tensor, indices: np.ndarray, failures: list[tuple[int, str]]
                        ) -> tuple[torch.Tensor, np.ndarray, list[tuple[int, str]]]:
        """The batch less the samples the transform's workers could not make (`SampleWorkers.failures`), those added
        to its failures."""
        assert self._sample_workers is not None
        failed = self._sample_workers.failures
        kept = np.array([int(i) not in failed for i in indices.tolist()], dtype=bool)
        lost = [(int(i), failed.pop(int(i))) for i in indices[~kept].tolist()]
        return images[torch.from_numpy(kept)], indices[kept], [*failures, *lost]

    def _isolate(self, prepared: Prepared, exc: RuntimeError) -> tuple[torch.Tensor, np.ndarray, list[tuple[int, str]]]:
        """Decode a failed batch sample by sample: the good samples' images, indices, and the failures."""
        pending, good, failures = list(range(len(prepared.indices))), [], list(prepared.failures)
        while pending:
            pipe = self._new_pipeline(SampleFeed(prepared, pending, self.sample_transform is not None), depth=1)
            while pending:
                position = pending.pop(0)
                try:
                    good.append((position, self.graph.run(pipe)[0]))
                except RuntimeError as error:
                    failures.append((int(prepared.indices[position]), f"DALI cannot decode it ({dali_error(error)})"))
                    break  # the pipeline is no longer valid after an error
            del pipe
        if len(failures) == len(prepared.failures):  # every sample decodes alone: not a sample's fault
            raise DatasetError(f"loaders.dali: the DALI pipeline failed ({dali_error(exc)})") from None
        positions = [p for p, _ in good]
        images = torch.cat([t for _, t in good]) if good else torch.empty(0)
        return images, prepared.indices[positions], failures

    def _produce_native(self, batches: Sequence[np.ndarray]) -> Iterator[HostBatch]:
        start, planned = self._position, len(self.order())
        dali_batches = math.ceil(self.order().num_samples / self.pipeline.batch_size)  # drop_last: DALI still pads
        if self._pipe is None or self._native_done != start:
            if start:  # load_state_dict refuses this; a caller setting the position by hand gets here
                raise ConfigError("loaders.dali.reader native cannot start an epoch in its middle")
            self._pipe, self._native_done = self._new_pipeline(None), 0
        for batch in batches:
            images, positions = self.graph.run(self._pipe)
            n = len(batch)  # the shard's last batch is padded by DALI: cut to the shard's end
            indices = positions.reshape(-1)[:n].cpu().numpy().astype(np.int64)
            self._native_done += 1
            if self._native_done == planned:  # the epoch's end: skip what drop_last leaves out
                for _ in range(dali_batches - planned):
                    self.graph.run(self._pipe)
                self._native_done = 0
            yield self._host_batch(images[:n], indices, [], None)

    def close(self) -> None:
        self._pipe = None
        self._views = None
        if self._sample_workers is not None:
            self._sample_workers.close()
            self._sample_workers = None


def _dali_shard_order(loader: DaliLoader) -> EpochOrder:
    """For `reader: native`: batches sized as DALI's contiguous shard `rank` of `world_size` (DALI picks
    the samples); only the count and size of the batches matter to the base class."""
    n, k, r = len(loader.dataset), loader.world_size, loader.rank
    first, last = n * r // k, n * (r + 1) // k
    return _ShardOrder(last - first, loader.pipeline.batch_size, loader.seed, loader.epoch, 0, 1, False,
                       loader.pipeline.drop_last, offset=first)


@dataclass(frozen=True)
class _ShardOrder(EpochOrder):
    offset: int = 0

    def indices(self) -> np.ndarray:
        mine = np.arange(self.offset, self.offset + self.num_samples, dtype=np.int64)
        return mine[: len(mine) // self.batch_size * self.batch_size] if self.drop_last else mine
