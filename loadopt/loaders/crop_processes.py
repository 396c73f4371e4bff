"""Whole-frame crops, and the encoded forms' JPEG decoding, in worker processes, each with its own
interpreter (and GIL).

`crops.crop_frames` on threads of one process shares one GIL: every sample's crop is a few Python
calls around torch's resize kernel, so each thread hands the GIL to the other once or twice a sample,
and each hand-over waits for the scheduler. On 2 cores the decoded whole-frame paths reached 0.56-0.62
of the rate at which 2 processes crop the same frames (benchmarks/raw_ceiling.py, benchmarks/arrow_ceiling.py).
Here the same function runs in forked processes, which inherit the frames' read-only mappings and write
into a ring held in shared memory; a batch's samples are split over them, and the parent only sends each
its positions and crop plan (a few KB) and waits for the replies. The Arrow encoded form's JPEGs go the
same way (`send_decode`: `transforms.decode_batch` on each worker's share): on 2 threads of one process
they used 1.8 of the 2 cores.

The workers are forked once per loader from the thread that starts the first epoch, exit when told, and
poll for their parent: a parent that dies (SIGKILL) leaves none behind for long. They ignore SIGINT (a
terminal's Ctrl-C reaches the whole process group; the parent's handler closes them).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import multiprocessing
import os
import resource
import signal
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple, NoReturn

import numpy as np

from loadopt.errors import LoadoptError
from loadopt.loaders import crops, transforms
from loadopt.loaders.sample_transform import Made, SampleTransform
from loadopt.loaders.transforms import Augment
from loadopt.storage.tiers.pagecache import release_pages

PARENT_CHECK_S = 1.0  # how often an idle worker checks that its parent is still there


class Replies(NamedTuple):
    """What the workers replied for one batch."""

    major_faults: int  # source pages not in the page cache meanwhile (each read from storage by its fault)
    failures: list[tuple[int, str]]  # a decoded batch's samples that could not be decoded: (index, why)


class InlinePool:
    """`crops.crop_frames`' pool in a worker: its one chunk run in the calling thread."""

    def map(self, function, chunks):  # noqa: ANN001, ANN201 - Executor.map's shape
        return [function(chunk) for chunk in chunks]


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class CropProcesses:
    """`crops.crop_frames` over `count` forked processes: `out` the ring's slots, (B, size, size, 3) uint8
    each, in shared memory; `sources` the frames' byte arrays (`which` indexes them); both inherited.
    `map_all`: each worker maps every page of the sources first (`populate`: where they fit in memory);
    `transform`: the job's own per-sample transform, run by the workers on what they crop or decode."""

    def __init__(self, out: Sequence[np.ndarray], sources: Sequence[np.ndarray], count: int,
                 map_all: bool = False, transform: SampleTransform | None = None) -> None:
        self.out, self.sources, self.count, self.transform = out, sources, max(1, count), transform
        context = multiprocessing.get_context("fork")
        self._connections: list[Any] = []
        self._processes: list[Any] = []
        self._sent: collections.deque[int] = collections.deque()  # per batch in flight: the chunks sent
        # A loader dropped without `close()` (a notebook, a sweep making loader after loader) ends its workers when
        # it is collected, not when the process exits: each left idle holds its copy-on-write pages.
        self._finalizer = weakref.finalize(self, stop_workers, self._connections, self._processes)
        try:
            for rank in range(self.count):
                parent_end, child_end = context.Pipe()
                self._connections.append(parent_end)
                process = context.Process(target=serve, args=(child_end, out, sources, os.getpid(), map_all, transform),
                                          name=f"loadopt-crop-{rank}", daemon=True)
                process.start()
                child_end.close()
                self._processes.append(process)
        except BaseException:  # those started are closed: nothing left behind
            self.close()
            raise

    def crop(self, slot: int, indices: np.ndarray, which: np.ndarray, starts: np.ndarray, frames: np.ndarray,
             augment: Augment, seed: int, epoch: int,
             planned: tuple[np.ndarray, np.ndarray] | None = None) -> int:
        """`crops.crop_frames` of a batch into ring slot `slot`, its positions split over the workers
        (`send`, then `receive`). Returns the workers' major page faults meanwhile (see `receive`)."""
        self.send(slot, indices, which, starts, frames, augment, seed, epoch, planned)
        return self.receive().major_faults

    def send(self, slot: int, indices: np.ndarray, which: np.ndarray, starts: np.ndarray, frames: np.ndarray,
             augment: Augment, seed: int, epoch: int,
             planned: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Hand a batch to the workers without waiting: each works through what it was sent in order, so
        a batch sent while the previous one is cropped starts the moment that one is done."""
        boxes, flips = planned if planned is not None else crops.frame_boxes(indices, frames, augment, seed, epoch)
        which, starts, frames = np.asarray(which), np.asarray(starts), np.asarray(frames)
        self._send(slot, len(indices), lambda a, b: ("crop", indices[a:b], which[a:b], starts[a:b], frames[a:b],
                                                     augment, seed, epoch, boxes[a:b], flips[a:b]))

    def send_decode(self, slot: int, indices: np.ndarray, which: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                    decoder: str, augment: Augment, seed: int, epoch: int, reduced_scale: bool,
                    release: bool = False) -> None:
        """Hand a batch of encoded samples to the workers (as `send`): position k's bytes are `lengths[k]` at
        `starts[k]` of `sources[which[k]]`, decoded into ring slot `slot` by `transforms.decode_batch` with
        CPU decoder `decoder`; `receive` returns the samples that failed. `release`: each worker then lets go
        of the pages it mapped of the sources (`pagecache.release_pages`: they stay in the page cache)."""
        which, starts, lengths = np.asarray(which), np.asarray(starts), np.asarray(lengths)
        self._send(slot, len(indices), lambda a, b: ("decode", indices[a:b], which[a:b], starts[a:b], lengths[a:b],
                                                     decoder, augment, seed, epoch, reduced_scale, release))

    def _send(self, slot: int, count: int, part: Callable[[int, int], tuple]) -> None:
        """Split positions [0, count) over the workers: each is sent (kind, slot, first, end, *rest) where
        (kind, *rest) = part(first, end)."""
        chunks = [c for c in np.array_split(np.arange(count), min(self.count, count)) if len(c)]
        self._sent.append(len(chunks))
        for rank, chunk in enumerate(chunks):
            first, end = int(chunk[0]), int(chunk[-1]) + 1
            kind, *rest = part(first, end)
            try:
                self._connections[rank].send((kind, slot, first, end, *rest))
            except OSError:  # a closed pipe: the worker is gone
                self._died(rank)

    def receive(self) -> Replies:
        """Wait for the oldest batch sent; raise its error, if any, as one line. Returns the workers' major
        page faults meanwhile (source pages that were not in the page cache, each read from storage by the
        fault, for a caller that stopped checking (mincore) to start again) and a decoded batch's failures.
        The targets a transform of (image, target) made go to it (`SampleTransform.give`), for the consumer to take
        with the batch."""
        replies = [self._reply(rank) for rank in range(self._sent.popleft())]
        for error, _, _, _ in replies:
            if error is not None:
                raise LoadoptError(error)
        if self.transform is not None:
            for *_, made in replies:
                self.transform.give(made)
        return Replies(sum(faults for _, faults, _, _ in replies), [f for _, _, failed, _ in replies for f in failed])

    def drain(self) -> None:
        """Receive every batch still in flight, errors dropped (an epoch that stopped early): the next
        epoch's replies must not meet this one's."""
        while self._sent:
            with contextlib.suppress(LoadoptError):
                self.receive()

    def _reply(self, rank: int) -> tuple[str | None, int, list[tuple[int, str]], Made | None]:
        try:
            return self._connections[rank].recv()
        except (EOFError, OSError):
            self._died(rank)

    def _died(self, rank: int) -> NoReturn:
        process = self._processes[rank]
        process.join(timeout=1.0)
        raise LoadoptError(f"crop worker process {exit_of(process)} died: out of memory, or killed") from None

    def close(self) -> None:
        """Tell the workers to exit and reap them (killed if they do not within a few seconds)."""
        stop_workers(self._connections, self._processes)
        self._connections, self._processes = [], []

    def alive(self) -> bool:
        return bool(self._processes) and all(p.is_alive() for p in self._processes)

    def dead(self) -> list[str]:
        """Each worker that has exited, as "PID (exit code N)"."""
        return [exit_of(p) for p in self._processes if not p.is_alive()]


def stop_workers(connections: list[Any], processes: list[Any]) -> None:
    """Tell workers to exit and reap them (killed if they do not within a few seconds); empties both lists."""
    owner = getattr(processes[0], "_parent_pid", None) if processes else None
    if owner is not None and owner != os.getpid():
        return  # a forked child's copy of a pool it does not own: its parent stops the workers
    for connection in connections:
        with contextlib.suppress(OSError, ValueError):  # already gone
            connection.send(None)
    for process in processes:
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
    for connection in connections:
        connection.close()
    connections.clear()
    processes.clear()


def exit_of(process: BaseProcess) -> str:
    """A worker process and how it ended, as "PID (exit code N)"."""
    return f"{process.pid} (exit code {process.exitcode})"


MADV_POPULATE_READ = 22  # Linux 5.14+: map a range's pages into this process at once (reading in any not cached)


def populate(sources: Sequence[np.ndarray]) -> None:
    """Map every page of the frames into this worker's page tables at once, where the kernel can.

    A forked worker inherits the frames' mappings but not their page tables (Linux copies none for shared
    file mappings): each fills its own by page faults, 16 pages a fault, so a worker's first epochs paid
    ~4 faults a sample, for as many epochs as it takes to touch every page of a large set.
    MADV_POPULATE_READ over the whole of it pays that once per worker, at its start. A page not
    in the page cache is read in (as a prefill): the loader asks for this only where the frames fit in
    memory. Per crop it was no gain (one madvise a sample cost more than the faults it saved)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):
        return
    for source in sources:
        array = np.asarray(source)
        if array.size:
            start = array.ctypes.data
            aligned = start - start % mmap.PAGESIZE
            if madvise(aligned, start + array.size - aligned, MADV_POPULATE_READ) != 0:
                return  # EINVAL: a kernel without it; the crops fault their pages in instead


def serve(connection, out: Sequence[np.ndarray], sources: Sequence[np.ndarray], parent: int,  # noqa: ANN001
          map_all: bool = False, transform: SampleTransform | None = None) -> None:
    """A worker's loop: crop (or decode) each chunk it is sent into its slots of `out`; reply (None or the
    error, its major faults meanwhile, the samples that could not be decoded, the targets a transform of (image,
    target) made). `map_all`: `populate` the sources first."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and closes the workers
    torch.set_num_threads(1)  # one core's worth each, as the ceiling's workers
    if crops.cv2 is not None:
        crops.cv2.setNumThreads(1)
    if map_all:
        populate(sources)
    while True:
        if not connection.poll(PARENT_CHECK_S):
            if os.getppid() != parent:  # the parent is gone: nothing to crop for
                return
            continue
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        kind, slot, first, end, indices, which, starts, *rest = message
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        failures: list[tuple[int, str]] = []
        error = None
        work, doing = WORK[kind]
        try:
            failures = work(out[slot][first:end], sources, indices, which, starts, *rest, transform=transform)
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it as one line
            error = f"{doing} samples {int(indices[0])}..{int(indices[-1])}: {exc}".splitlines()[0]
        made = transform.made() if transform is not None and transform.with_target else None
        connection.send((error, resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults, failures, made))


def crop(out: np.ndarray, sources: Sequence[np.ndarray], indices: np.ndarray, which: np.ndarray,
         starts: np.ndarray, frames: np.ndarray, augment: Augment, seed: int, epoch: int,
         boxes: np.ndarray, flips: np.ndarray, transform: SampleTransform | None = None) -> list[tuple[int, str]]:
    """A worker's share of `send`: its whole frames cropped into `out` by the plan drawn in the parent (then the
    job's own `transform`, if any)."""
    crops.crop_frames(out, indices, sources, which, starts, frames, augment, seed, epoch, InlinePool(), 1,
                      planned=(boxes, flips))
    return transform.apply_to_slots(out, indices, seed, epoch) if transform is not None else []


def decode(out: np.ndarray, sources: Sequence[np.ndarray], indices: np.ndarray, which: np.ndarray,
           starts: np.ndarray, lengths: np.ndarray, decoder: str, augment: Augment, seed: int,
           epoch: int, reduced_scale: bool, release: bool, transform: SampleTransform | None = None
           ) -> list[tuple[int, str]]:
    """A worker's share of `send_decode`: its samples decoded into `out` (its positions' HWC slots) one
    after another; the ones that could not be decoded returned."""
    import torch

    views = [np.asarray(source).data for source in sources]  # memoryviews: slices of them copy nothing
    places, sizes, sourced = starts.tolist(), lengths.tolist(), which.tolist()
    failures = transforms.decode_batch(torch.from_numpy(out), indices,
                                       lambda k: views[sourced[k]][places[k] : places[k] + sizes[k]], decoder,
                                       augment, seed, epoch, reduced_scale=reduced_scale, transform=transform)
    if release:
        for source in sources:
            release_pages(np.asarray(source))
    return failures


# What a worker does with each kind of message (`CropProcesses._send`), and its name in an error.
WORK: dict[str, tuple[Callable[..., list[tuple[int, str]]], str]] = {"crop": (crop, "cropping"),
                                                                      "decode": (decode, "decoding")}
