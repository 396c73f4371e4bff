"""Long runs stay flat: `make_loader` torch tuned and arrow decoded over many epochs of the default dataset.

Each backend runs `--epochs` epochs through `make_loader` (the library path a training script uses,
`for inputs, labels in loader`), step time 0. Mid-epoch (at half of the epoch's batches) the process
tree's PSS is sampled (shared pages split between the processes that map them, so the ring of batches
shared by the workers counts once), with each process's PSS, USS and anonymous PSS beside it (and
the tree's PSS at a quarter and three quarters of the epoch). The figure is the median own memory
(below) of the last 5 epochs over that of epochs 3-7 (the first two epochs warm up: allocator arenas, the page
cache of the mapped files, the first workers' imports); the spread is the smallest and largest of
every epoch's PSS over the first window's median. Target <= 1.10. A leak (memory that grows with
the epochs) moves the last window as far as it moves the last epoch; one sample does not.

Why windows and not the last epoch over epoch 3 (issue 17: a 30-epoch run of torch tuned printed
x1.61 from one last epoch at 616 MB after 27 epochs at 382-445 MB): the consumer's memory steps up and
down between single samples by whole buffers its allocator keeps or returns. Measured per process
(two 30- and 12-epoch runs after that one, no step above x1.23 and last over epoch 3 x0.84 and x1.08,
anonymous memory over 30 epochs x0.998): the workers' own memory (USS) stayed at 11-14 MB every epoch;
the consumer's USS moved between 54 and 161 MB from epoch to epoch in steps of ~36 MB (one float
batch of 64 x 3 x 224 x 224: malloc maps each in its own region), and its brk heap in steps of 18 MB
(the epoch's last batch of 32, allocated from the heap below malloc's mmap threshold and kept when
freed) up to ~144 MB and back; a 36 MB anonymous region holding the 9.6 MB transposed-pixel buffer
(`Loader._intermediate`) with freed memory that malloc keeps around it; no full garbage collection
in the consumer during any sampled epoch (counted). The workers forked each epoch share whatever
the consumer's heap holds at that moment, so their anonymous PSS follows it.

What is held is the tree's own memory: anonymous and shared-memory PSS (heaps: a leak or allocator
retention would show here; the batch ring), not file-backed pages. A shared library's pages (libtorch:
hundreds of MB) count in PSS divided among every process on the machine that maps them, so the tree's
file-backed PSS moves when other users' processes start and exit: in a 30-epoch run during which the
machine's load fell from 29 to 2 (other helpers' processes ended) torch's file-backed PSS went
37 -> 124 MB and the consumer's USS 57 -> 150-193 MB with it, while its anonymous PSS went x1.07: the
whole tree's PSS read x1.17 over the same windows. A memory-mapped file's pages (arrow) likewise count
as they are touched, up to the file's size: the page cache. The whole PSS and its file-backed part
are printed beside the figure held.

Found with it (issue 17): torch tuned's tree PSS rose from ~400 to 800-1100 MB over the first epochs,
then wandered there. Not a leak (Python's traced heap stayed ~1 MB; with glibc's mmap threshold pinned,
MALLOC_MMAP_THRESHOLD_=131072, the same run stayed at 300-324 MB): a fresh 9.6 MB transposed copy of
each batch while finishing it on the CPU raised glibc's mmap threshold, so these buffers came from a
heap that fragmented and was not returned, and the workers forked each epoch started from that heap.
Finishing now reuses one buffer for that copy (`Loader._intermediate`).

After `close()`: the loader's processes still alive (a second later), the /dev/shm files that
appeared during the run and are still there, and shared-memory mappings the consumer still holds
(torch shares tensors through unlinked /dev/shm files, which only /proc/<pid>/maps shows). Each must
be none: `RESULT soak_leftovers_<backend> ratio=<count> target<=0`.

    python benchmarks/soak.py [--config configs/imagenet.yaml] [--epochs 30] [--backends torch,arrow] [--workers 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import psutil
from _common import REPO, result_line

FIRST_EPOCH = 3  # 1-based: the first epoch compared (epochs 1 and 2 warm up)
WINDOW = 5  # epochs in each of the two windows compared (their medians)
SHM = Path("/dev/shm")


ROLLUP_KEYS = {"Pss": "pss", "Pss_Anon": "anon", "Pss_File": "file", "Pss_Shmem": "shmem", "Private_Dirty": "dirty",
               "Private_Clean": "clean", "Rss": "rss"}


def rollup(pid: int) -> dict[str, float]:
    """MB of a process's PSS, split into anonymous memory (its heap), file-backed pages (libraries and
    mapped files, shared with every process on the machine that maps them) and shared memory (the ring)."""
    out = dict.fromkeys(ROLLUP_KEYS.values(), 0.0)
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        if key in ROLLUP_KEYS:
            out[ROLLUP_KEYS[key]] = int(value.split()[0]) / 1024
    return out


def large_anonymous(pid: int, at_least_mb: float = 16) -> dict:
    """The process's brk heap (resident MB) and its other anonymous mappings of `at_least_mb` or more
    (resident MB each): a float batch handed out is one such mapping (malloc maps blocks this large)."""
    heap, large, size, name = 0.0, [], 0.0, ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            size, name = (end - start) / 2**20, fields[5] if len(fields) > 5 else ""
        elif fields[0] == "Rss:":
            rss = int(fields[1]) / 1024
            if name == "[heap]":
                heap += rss
            elif not name and size >= at_least_mb:
                large.append(round(rss))
    return {"heap": heap, "large": sorted(large, reverse=True)}


def tree_memory() -> dict[str, float]:
    """MB of PSS of this process and all its descendants (total and by kind), and the consumer's own."""
    root = psutil.Process(os.getpid())
    own = rollup(root.pid)
    total, count = dict(own), 1
    each = [{"pid": root.pid, "role": "consumer", **own, **large_anonymous(root.pid)}]
    for child in root.children(recursive=True):
        try:
            found = rollup(child.pid)
        except OSError:  # a worker that exited between the listing and the read
            continue
        total = {key: total[key] + found[key] for key in total}
        each.append({"pid": child.pid, "role": "worker", **found})
        count += 1
    return {"tree_pss": total["pss"], "tree_anon": total["anon"], "tree_file": total["file"],
            "tree_shmem": total["shmem"], "own_pss": own["pss"], "own_anon": own["anon"], "own_dirty": own["dirty"],
            "processes": count, "each": each}


def shm_files() -> dict[str, int]:
    """This user's files in /dev/shm and their sizes."""
    found = {}
    uid = os.getuid()
    for entry in SHM.iterdir() if SHM.is_dir() else ():
        try:
            stat = entry.stat()
        except OSError:
            continue
        if stat.st_uid == uid:
            found[entry.name] = stat.st_size
    return found


def shm_mappings() -> dict[str, int]:
    """Shared-memory files (unlinked or not) this process still maps, and their mapped bytes: torch's
    shared tensors among them."""
    found: dict[str, int] = {}
    for line in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines():
        if "/dev/shm/" in line or "/torch_" in line or "memfd:" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            name = line.split(maxsplit=5)[-1]
            found[name] = found.get(name, 0) + end - start
    return found


def soak(config, backend: str, epochs: int, settings: dict) -> dict:
    from loadopt import make_loader

    shm_before, maps_before = shm_files(), set(shm_mappings())
    inputs = labels = None
    loader = make_loader(config, backend=backend, device="cpu", **settings)
    print(f"{backend}: {loader.describe()}, {len(loader)} batches an epoch, {epochs} epochs", flush=True)
    samples: list[dict[str, float]] = []
    full_collections: list[float] = []  # when the consumer's garbage collector went through every object

    def on_collection(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full_collections.append(time.perf_counter())

    gc.callbacks.append(on_collection)
    try:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            middle, start, count = len(loader) // 2, time.perf_counter(), 0
            quarters = {len(loader) // 4: "q1", middle: "mid", 3 * len(loader) // 4: "q3"}
            around: dict[str, dict] = {}
            for index, (inputs, labels) in enumerate(loader):
                count += min(inputs.shape[0], len(labels))
                if index in quarters:
                    around[quarters[index]] = tree_memory()
                    around[quarters[index]]["full_gc"] = sum(t > start for t in full_collections)
            rate = count / (time.perf_counter() - start)
            s = around["mid"]
            samples.append({**s, "q1_pss": around["q1"]["tree_pss"], "q3_pss": around["q3"]["tree_pss"]})
            print(f"  epoch {epoch + 1:2d}: tree PSS {s['tree_pss']:6.1f} MB over {s['processes']} processes "
                  f"(consumer's full collections this epoch before the sample: {s['full_gc']}) "
                  f"(quarter {around['q1']['tree_pss']:.0f}, three quarters {around['q3']['tree_pss']:.0f}; "
                  f"anon {s['tree_anon']:6.1f}, file {s['tree_file']:6.1f}, shmem {s['tree_shmem']:5.1f}); "
                  f"{rate:5.0f} samples/s; consumer's heap {s['each'][0]['heap']:.0f} MB, its anonymous "
                  f"mappings >= 16 MB {s['each'][0]['large']} MB; by process (PSS/USS/anon MB): " + ", ".join(
                      f"{p['role']} {p['pid']} {p['pss']:.0f}/{p['clean'] + p['dirty']:.0f}/{p['anon']:.0f}"
                      for p in s["each"]), flush=True)
    finally:
        gc.callbacks.remove(on_collection)
        loader.close()
    # The script's own last batch (its labels may be a tensor shared by a worker) is the script's, not a leftover.
    del loader, inputs, labels
    gc.collect()
    me = psutil.Process(os.getpid())
    deadline = time.monotonic() + 5.0  # workers get a moment to exit after close()
    while me.children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [f"{p.pid} {p.name()}" for p in me.children(recursive=True)]
    new = {name: size for name, size in shm_files().items() if name not in shm_before}
    # Other processes of the same user (on a shared machine) create files there too: a file counts as this
    # loader's when this process still holds it open, or its name carries this process's id (torch_<pid>_...).
    held = {os.path.basename(_link(fd).removesuffix(" (deleted)")) for fd in Path("/proc/self/fd").iterdir()
            if _link(fd).startswith(str(SHM))}
    mine = {name: size for name, size in new.items() if name in held or f"_{os.getpid()}_" in name}
    maps_left = {name: size for name, size in shm_mappings().items() if name not in maps_before}
    return {"samples": samples, "alive": alive, "shm": mine, "others_shm": len(new) - len(mine), "maps": maps_left}


def _link(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "imagenet.yaml"))
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--backends", default="torch,arrow")
    parser.add_argument("--workers", type=int, default=2, help="torch tuned's num_workers")
    args = parser.parse_args()
    if args.epochs < FIRST_EPOCH + 3:
        parser.error(f"--epochs must be at least {FIRST_EPOCH + 3}: epochs 1-2 warm up, then two windows")

    from loadopt.config import load_config

    config = load_config(args.config)
    settings = {"torch": {"variant": "tuned", "num_workers": args.workers}, "arrow": {"form": "decoded"}}
    load = os.getloadavg()
    print(f"load average at the start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} over {os.cpu_count()} cores")
    lines = []
    for backend in args.backends.split(","):
        try:
            found = soak(config, backend, args.epochs, settings.get(backend, {}))
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run here cannot be measured
            print(f"{backend}: cannot measure: {type(exc).__name__}: {exc}")
            return 1
        pss = [s["tree_pss"] for s in found["samples"]][FIRST_EPOCH - 1:]
        own = [s["tree_anon"] + s["tree_shmem"] for s in found["samples"]][FIRST_EPOCH - 1:]
        first, last = found["samples"][FIRST_EPOCH - 1], found["samples"][-1]
        window = min(WINDOW, len(pss) // 2)
        own_start, own_end = statistics.median(own[:window]), statistics.median(own[-window:])
        growth = own_end / own_start
        print(f"{backend}: the tree's own memory (anonymous + shared-memory PSS), median of epochs {FIRST_EPOCH}-"
              f"{FIRST_EPOCH + window - 1} {own_start:.1f} MB -> of epochs {args.epochs - window + 1}-{args.epochs} "
              f"{own_end:.1f} MB (x{growth:.3f}; every epoch from {FIRST_EPOCH}: x{min(own) / own_start:.3f} to "
              f"x{max(own) / own_start:.3f})")
        start, end = statistics.median(pss[:window]), statistics.median(pss[-window:])
        print(f"{backend}: for information, with file-backed pages: tree PSS, median of epochs {FIRST_EPOCH}-"
              f"{FIRST_EPOCH + window - 1} {start:.1f} MB -> of "
              f"epochs {args.epochs - window + 1}-{args.epochs} {end:.1f} MB (x{end / start:.3f}; every epoch from "
              f"{FIRST_EPOCH}: x{min(pss) / start:.3f} to x{max(pss) / start:.3f}); one sample each, for information: "
              f"epoch {FIRST_EPOCH} {pss[0]:.1f} MB -> epoch {args.epochs} {pss[-1]:.1f} MB (x{pss[-1] / pss[0]:.3f})")
        print(f"{backend}: by kind from epoch {FIRST_EPOCH} to {args.epochs}: anon {first['tree_anon']:.1f} -> "
              f"{last['tree_anon']:.1f}, file-backed {first['tree_file']:.1f} -> {last['tree_file']:.1f}, shmem "
              f"{first['tree_shmem']:.1f} -> {last['tree_shmem']:.1f} MB")
        print(f"{backend}: after close(): {len(found['alive'])} processes alive {found['alive'] or ''}, "
              f"{len(found['shm'])} new /dev/shm files ({sum(found['shm'].values()) / 2**20:.1f} MB) "
              f"{sorted(found['shm']) or ''} (and {found['others_shm']} of other processes), "
              f"{len(found['maps'])} shared mappings held "
              f"{ {name: f'{size / 2**20:.1f} MB' for name, size in found['maps'].items()} or ''}")
        leftovers = len(found["alive"]) + len(found["shm"]) + len(found["maps"])
        print(f"{backend}: anonymous memory alone x{last['tree_anon'] / first['tree_anon']:.3f} from epoch "
              f"{FIRST_EPOCH} to {args.epochs}")
        lines.append(result_line(f"soak_pss_growth_{backend}", growth, "<=", 1.10))
        lines.append(result_line(f"soak_leftovers_{backend}", leftovers, "<=", 0))
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (a shared machine: rates vary; "
          "the PSS does not depend on them)")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
