"""The `posix` backend over raw decoded shards against its three ceilings, measured in the same run.

The copy and IO figures (1, 2) are held on the explicit centre form (`frame: centre`: 256 px centre squares,
a crop copied, no resize): what they measure is the read and the copy. The whole-frame form (3; the
default under `augment: train`, the JPEG paths' training input) resizes every crop, so it is held to the
crop + resize ceiling instead.

1. Cold cache: posix with O_DIRECT (no page cache), shuffled order, step time 0: the bytes it reads
   from storage per second, against a plain sequential O_DIRECT read (4 MiB preadv calls, one after
   another) of the same shard files; two settings (defaults, and 32 io threads 4 batches ahead), the
   better one held to the target. Rounds interleaved, medians. Target >= 0.9. For context, the disk's
   own rate for random reads of one sample, 32 in flight (fio, where installed): a random-order loader
   cannot read faster than that, and on this virtual disk it is below the sequential rate at times.
   posix's staging buffers were a shared anonymous map (shmem: 4 KiB pages, its slower pinning path for
   O_DIRECT): 0.816 and 0.889 at load averages of 10-14. Private and in huge pages since (MADV_HUGEPAGE;
   an epoch's CPU 278 -> 118 ms, its rate 1,234 -> 2,612 MB/s interleaved): 1.49, 1.91, 1.18, 1.52, 1.72 at
   load averages of 10-16 (the sequential reference swings 1.0-3.0 GB/s from round to round).
2. Warm cache: posix without O_DIRECT after one full epoch (which reads the shards in with its
   prefill), the bytes of the batches it delivers per second, against one `numpy.copyto` of a buffer
   8x the L3 cache measured in the same round; the median of the rounds' ratios. Shown beside it:
   posix with the page cache warmed by random reads only (prefill off), and arrow.
   Target >= 0.6 (the arrow backend's ceiling target); the decoded arrow backend's rate is shown beside
   it for context (no preadv copy: it crops straight from the mapped file).
   In each round a loader's rate is the median of 5 epochs timed one by one (`--epochs`), the copy's the
   median of 5 copies of about an epoch's length, measured just before and just after the loader's epochs
   (their mean taken): the same statistic on both sides. One epoch a round (the figure held before) took in
   whichever other process's time slice fell into its ~40 ms, where the copy's median did not: 0.418 (spread
   0.355-0.462, load 1.4-10), and 0.67 (0.378-0.872) in the same hour as the figures below. Measured since:
   0.893 (spread 0.784-1.30; load average 10-11, copy 7.9 GB/s) and 0.828 (0.743-1.02; load 9.6, copy
   13.3 GB/s); arrow beside it 1.15 and 0.855, posix prefill off 0.82 and 0.86. Profiled (perf, warm epochs):
   the crop's copy and mirror take ~75% of the cycles (memory-bound: a 32-byte streaming-store mirror was
   no faster), the Python of producer and consumer ~40-60 us a batch, and mincore, a system call a
   sample, ~15% of the rate (posix 9.6 GB/s with it, 11.4 without, arrow 10.5, interleaved): it now checks
   only until a batch is all cached and after a miss (`posix_cache`). Since: 0.716 (spread 0.497-1.21;
   load average 14, copy 8.8 GB/s), 0.794 (0.694-1.24; load 16, CPU pressure 99%) and 1.47 (1.29-1.61; load
   14.5, posix 9.5 GB/s, copy 7.7 GB/s); arrow beside it 0.786, 0.802 and 1.02.
   Posix crops cached samples straight from read-only mappings of the shards (`posix_cache`), so the
   page cache's history matters little once they are mapped; the bench measures from both states and
   states them: the shards read in sequentially from an evicted start (posix's prefill: large folios),
   and a cache that random reads filled (prefill off: 4 KiB pages; the pread path this replaced cost
   2.2x per sample from those). The share of the shards' pages still cached after the eviction is
   checked by mincore (reads nothing; the RWF_NOWAIT probe used before started reading what it missed,
   so a second look found it cached).
3. Whole frames, warm cache (the frames' shards read in by one epoch with prefill first): posix's
   images/s against the rate at which this machine turns the same stored frames into samples
   (`loadopt.bench.attribution.ceilings.crop_resize_rate`: the shared crop plan + the loaders' own `crops.crop_frames`,
   as many worker processes as posix's finishing threads, one intra-op thread each), measured just before
   and just after the loader in every round (their mean taken: this machine's load swings within seconds).
   Target >= 0.7: the loader runs `crops.crop_frames` itself. On 2 threads of one process (`crop_in:
   threads`) it reached 0.56-0.62 on a quiet machine (loader ~10-11k images/s, ceiling ~17.5k): the
   threads shared one GIL, the batch's crop plan (a seeded generator per sample, ~15 us each) held it
   for ~4 ms a batch, and the loader used 1.5 of the 2 cores. Since: the plan is drawn for a batch at
   once (`transforms.plan_batch`, 0.7 us a sample), the per-sample Python of `crop_frames` halved, and
   whole frames are cropped by forked worker processes (`crop_in: processes`, the default off CUDA;
   `loaders/crop_processes.py`), the ceiling's own arrangement; the producer's mincore over each batch's
   frames (~3 ms a batch) stops once a batch was cropped without a major fault (the shards' sizes are
   still checked). History of this figure under other arrangements, for context: 0.614, then 0.738 and
   0.97 with mapped frames and the plan drawn ahead; 0.577-1.0 at load averages of 10-16 with threads.
Every figure is printed with its spread over the rounds (5 by default) and held on the median; the
rounds of each part are interleaved (subject and reference measured in every round).

    python benchmarks/raw_ceiling.py [--config configs/imagenet.yaml] [--rounds 5] [--io-threads 8]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import time

import numpy as np
from _common import REPO, build_loader, host_batches_forever, ratio_result, result_line, spread
from probe_vs_fio import fio

from loadopt.bench.attribution.ceilings import crop_resize_rate, memcpy_bandwidth  # shared with the bench's ceilings
from loadopt.storage.forms.raw_format import align_up
from loadopt.storage.tiers.sequential import read_sequential


def sequential_o_direct(shards: list, block: int = 4 << 20) -> tuple[float, bool]:
    """(bytes/s, whether O_DIRECT held) of reading every shard front to back, one 4 MiB preadv at a time
    (the one sequential reader, `storage/tiers/sequential.py`)."""
    read = read_sequential([str(shard) for shard in shards], block, direct=True)
    return read.nbytes / read.seconds, read.direct


def evict(shards: list) -> None:
    from loadopt.storage.tiers.pagecache import evict as drop

    drop([str(s) for s in shards])


def cached_fraction(shards: list) -> float:
    """The share of the shards' pages in the page cache, by mincore over a read-only mapping of each: it
    reads nothing (an RWF_NOWAIT read of a missing page starts reading it in: the next look finds it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page, cached, total = mmap.PAGESIZE, 0, 0
    for shard in shards:
        size = os.path.getsize(shard)
        if not size:
            continue
        fd = os.open(shard, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"{shard}: cannot map it")
            vector = np.zeros((size + page - 1) // page, np.uint8)
            try:
                if libc.mincore(address, size, vector.ctypes.data) != 0:
                    raise OSError(ctypes.get_errno(), f"{shard}: mincore failed")
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        cached, total = cached + int((vector & 1).sum()), total + len(vector)
    return cached / total if total else 0.0


def epoch_rate(loader, warm: bool) -> tuple[float, float]:
    """(storage bytes/s, delivered bytes/s) over one full epoch of host batches, step time 0."""
    if warm:
        for _ in loader.host_batches():
            pass
    start, read, delivered = time.perf_counter(), 0, 0
    for batch in loader.host_batches():
        read += batch.bytes_read
        delivered += batch.inputs.numel() * batch.inputs.element_size()
    seconds = time.perf_counter() - start
    return read / seconds, delivered / seconds


def median_epoch_rate(loader, epochs: int) -> float:
    """Delivered bytes/s of the median of `epochs` full epochs timed one by one (the loader warmed beforehand):
    the same statistic as the copy reference (`memcpy_bandwidth`: the median of 5 copies, each about as long
    as an epoch here), so another process's time slice landing in one window moves neither figure."""
    return statistics.median(epoch_rate(loader, warm=False)[1] for _ in range(epochs))


def samples_rate(loader, batches: int) -> float:
    """Samples/s of `batches` host batches, step time 0 (the loader warmed beforehand)."""
    iterator = host_batches_forever(loader)
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        samples += len(next(iterator).indices)
    seconds = time.perf_counter() - start
    iterator.close()
    return samples / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=5, help="epochs per round of the warm part (their median)")
    parser.add_argument("--frame-batches", type=int, default=30, help="batches per round of the whole-frame part")
    parser.add_argument("--parts", default="cold,warm,frames", help="which parts to run (comma-separated)")
    args = parser.parse_args()

    from loadopt.config import load_config

    config = load_config(args.config)
    parts = set(args.parts.split(","))
    # Two O_DIRECT settings: the defaults, and more reads in flight (32 threads, 4 batches ahead);
    # the one with the higher median is held to the target.
    colds = {f"io_threads={n} read_ahead={ahead}": build_loader(config, "posix", form="decoded", frame="centre",
                                                                   o_direct=True, io_threads=n, read_ahead=ahead)
             for n, ahead in ((args.io_threads, 2), (32, 4))}
    try:
        for cold in colds.values():
            cold.prepare()
    except Exception as exc:  # noqa: BLE001 - e.g. O_DIRECT refused: cannot measure
        print(f"cannot measure: {exc}")
        return 1
    shards = cold.raw.shards
    size = sum(s.stat().st_size for s in shards)
    print(f"{len(cold.dataset)} decoded samples in {len(shards)} shards, {size / 1e6:,.0f} MB "
          f"({cold.size}px, crops to {config.pipeline.image_size}, {config.pipeline.augment} pipeline)")

    if "cold" in parts:
        # Each round reads sequentially, then with each setting. The disk here swings between about 1.1 and
        # 2.6 GB/s for sequential reads from one read to the next (not a slow drift), so the medians of the
        # rates are compared rather than each round's pair.
        # Context: the disk's own rate for random reads of one sample (fio, 32 in flight), where fio is installed.
        sample_bytes = int(align_up(int(cold.raw.length.max())))
        sequential, posix, device_random, direct = [], {label: [] for label in colds}, [], True
        for _ in range(args.rounds):
            evict(shards)
            rate, held = sequential_o_direct(shards)
            sequential.append(rate)
            direct = direct and held
            for label, cold in colds.items():
                evict(shards)
                posix[label].append(epoch_rate(cold, warm=False)[0])
            if shutil.which("fio"):
                device_random.append(fio(str(shards[0]), "randread", sample_bytes, 32, 2, shards[0].stat().st_size)
                                     ["mb_per_s"] * 1e6)
            print(f"  cold round: sequential O_DIRECT {sequential[-1] / 1e6:,.0f} MB/s, posix O_DIRECT "
                  + ", ".join(f"{label} {rates[-1] / 1e6:,.0f} MB/s" for label, rates in posix.items())
                  + (f", fio random {sample_bytes >> 10} KiB x32 {device_random[-1] / 1e6:,.0f} MB/s" if device_random
                     else ""))
        for cold in colds.values():
            cold.close()
        best = max(posix, key=lambda label: statistics.median(posix[label]))
        cold_ratio = statistics.median(posix[best]) / statistics.median(sequential)
        per_round = [r / q for r, q in zip(posix[best], sequential, strict=True)]
        print(f"cold, each round's posix / sequential: {spread(per_round)} (held on the ratio of the medians: the "
              "disk's rate swings from one read to the next, so a round's pair is not a pair)")
        if not direct:
            print("the sequential reference fell back to buffered reads (the file system refused O_DIRECT)")
        print(f"cold (median of {args.rounds}): posix O_DIRECT {best} {statistics.median(posix[best]) / 1e6:,.0f} MB/s "
              f"read, sequential O_DIRECT {statistics.median(sequential) / 1e6:,.0f} MB/s"
              + (f"; the disk's random reads of a sample (fio) {statistics.median(device_random) / 1e6:,.0f} MB/s: "
                 f"posix reaches {statistics.median(posix[best]) / statistics.median(device_random):.2f} of them"
                 if device_random else ""))

    if "warm" in parts:
        # Warm: the copy bandwidth is measured again in every round, beside the loaders, and each round's
        # ratio is taken: this shared machine's copy rate drifts by 20% from minute to minute. The shards
        # start out of the page cache (the cold rounds evicted them), so posix's first epoch reads them in
        # with its prefill (large folios). For context, the same after warming by random reads alone
        # (prefill off: the 4 KiB pages a random-access job leaves behind).
        evict(shards)
        warm = build_loader(config, "posix", form="decoded", frame="centre", io_threads=args.io_threads)
        random_warmed = build_loader(config, "posix", form="decoded", frame="centre", io_threads=args.io_threads,
                                     prefill=False)
        # context: the same crops from a memory-mapped file
        arrow = build_loader(config, "arrow", form="decoded", frame="centre")
        ratios: dict[str, list[float]] = {}
        left_cached: dict[str, float] = {}
        for name, loaders in (("posix", {"posix": warm, "arrow": arrow}), ("posix prefill off", {"": random_warmed})):
            evict(shards)
            left_cached[name] = cached_fraction(shards)
            for loader in loaders.values():
                loader.prepare()
                epoch_rate(loader, warm=True)
            # The copy measured just before and just after each loader's epoch, their mean taken (as the
            # frames part below): on this shared machine the copy rate moves 2x within seconds.
            copies, rates = [], {label: [] for label in loaders}
            bracketing: dict[str, list[float]] = {label: [] for label in loaders}
            for _ in range(args.rounds):
                before = memcpy_bandwidth.__wrapped__()
                for label, loader in loaders.items():
                    rates[label].append(median_epoch_rate(loader, args.epochs))
                    after = memcpy_bandwidth.__wrapped__()
                    bracketing[label].append((before + after) / 2)
                    before = after
                copies.append(before)
            for label, loader in loaders.items():
                loader.close()
                ratios[label or name] = [r / c for r, c in zip(rates[label], bracketing[label], strict=True)]
                print(f"warm (median of {args.rounds}): {label or name} delivers "
                      f"{statistics.median(rates[label]) / 1e9:.2f} GB/s of batches, "
                      f"{statistics.median(ratios[label or name]):.2f} of the memory copy "
                      f"({statistics.median(copies) / 1e9:.2f} GB/s); of the copy per round: "
                      f"{spread(ratios[label or name])}")
        state = ("the shards read in sequentially by posix's prefill from an evicted start "
                 f"({left_cached['posix']:.0%} of their pages were still cached after the eviction (mincore)"
                 + (": the state was NOT reached, the figure below reflects the earlier cache" if
                    left_cached["posix"] > 0.1 else "") + ")")
        print(f"posix_warm_vs_memcpy needs {state}; from a cache filled by random reads (4 KiB pages, prefill off) "
              f"posix delivers {statistics.median(ratios['posix prefill off']):.2f} of the memory copy "
              f"({spread(ratios['posix prefill off'])})")

    if "frames" in parts:
        # Whole frames: the crop + resize is the work; a warm cache (one epoch with prefill, from an evicted
        # start), and the ceiling measured in each round beside the loader.
        from loadopt.config import load_config as with_overrides
        from loadopt.storage.open import open_dataset

        train = with_overrides(config, ["pipeline.augment=train"])
        frames = build_loader(train, "posix", form="decoded", frame="whole", io_threads=args.io_threads)
        frames.prepare()
        frame_shards = frames.raw.shards
        evict(frame_shards)
        epoch_rate(frames, warm=True)
        frames_cached = cached_fraction(frame_shards)
        dataset, threads = open_dataset(train), frames.settings.threads
        print(f"whole frames <= {frames.size} px: {sum(s.stat().st_size for s in frame_shards) / 1e6:,.0f} MB in "
              f"{len(frame_shards)} shards, {frames_cached:.0%} of their pages cached after one epoch; "
              f"crop + resize ceiling in {threads} worker processes")
        whole_ratios = []
        for round_index in range(args.rounds):
            before = crop_resize_rate(train, dataset, threads).samples_per_s
            rate = samples_rate(frames, args.frame_batches)
            ceiling = (before + crop_resize_rate(train, dataset, threads).samples_per_s) / 2
            whole_ratios.append(rate / ceiling)
            print(f"  round {round_index + 1}: posix whole frames {rate:,.0f} images/s, crop + resize ceiling "
                  f"{ceiling:,.0f} samples/s: {rate / ceiling:.2f} of it")
        frames.close()

    load = os.getloadavg()
    print(f"load average {load[0]:.1f} / {load[1]:.1f} at the end (a shared machine)")

    lines = []
    if "cold" in parts:
        lines.append(result_line("posix_o_direct_cold_vs_sequential_read", cold_ratio, ">=", 0.9))
    if "warm" in parts:
        lines.append(ratio_result("posix_warm_vs_memcpy", ratios["posix"], ">=", 0.6))
    if "frames" in parts:
        lines.append(ratio_result("posix_frames_warm_vs_crop_resize", whole_ratios, ">=", 0.7))
    print("\n".join(lines))  # the RESULT lines last (the spreads above them)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
