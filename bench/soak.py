"""Long runs stay flat: `make_loader` torch tuned and arrow decoded over many epochs of the default dataset.

Each backend runs `--epochs` epochs through `make_loader` (the library path a training script uses,
`for inputs, labels in loader`), step time 0. Mid-epoch (at half of the epoch's batches) the process
tree's PSS is sampled (shared pages split between the processes that map them, so the ring of batches
shared by the workers counts once), with the consumer's own USS and PSS beside it. The figure is the
last epoch's PSS over the PSS of epoch 3 (the first two epochs warm up: allocator arenas, the page
cache of the mapped files, the first workers' imports); the spread is the smallest and largest of
every epoch's PSS over that of epoch 3. Target <= 1.10. The split by kind says what grew: anonymous
memory (heaps: a leak or allocator retention would show here), file-backed pages (a memory-mapped
file's pages count in PSS as they are touched, up to the file's size: the page cache, not the
process's memory) and shared memory (the batch ring).

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

    python bench/soak.py [--config configs/imagenet.yaml] [--epochs 30] [--backends torch,arrow] [--workers 2]
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
SHM = Path("/dev/shm")


ROLLUP_KEYS = {"Pss": "pss", "Pss_Anon": "anon", "Pss_File": "file", "Pss_Shmem": "shmem", "Private_Dirty": "dirty"}


def rollup(pid: int) -> dict[str, float]:
    """MB of a process's PSS, split into anonymous memory (its heap), file-backed pages (libraries and
    mapped files, shared with every process on the machine that maps them) and shared memory (the ring)."""
    out = dict.fromkeys(ROLLUP_KEYS.values(), 0.0)
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        if key in ROLLUP_KEYS:
            out[ROLLUP_KEYS[key]] = int(value.split()[0]) / 1024
    return out


def tree_memory() -> dict[str, float]:
    """MB of PSS of this process and all its descendants (total and by kind), and the consumer's own."""
    root = psutil.Process(os.getpid())
    own = rollup(root.pid)
    total, count = dict(own), 1
    for child in root.children(recursive=True):
        try:
            found = rollup(child.pid)
        except OSError:  # a worker that exited between the listing and the read
            continue
        total = {key: total[key] + found[key] for key in total}
        count += 1
    return {"tree_pss": total["pss"], "tree_anon": total["anon"], "tree_file": total["file"],
            "tree_shmem": total["shmem"], "own_pss": own["pss"], "own_anon": own["anon"], "own_dirty": own["dirty"],
            "processes": count}


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
    try:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            middle, start, count = len(loader) // 2, time.perf_counter(), 0
            for index, (inputs, labels) in enumerate(loader):
                count += min(inputs.shape[0], len(labels))
                if index == middle:
                    samples.append(tree_memory())
            rate = count / (time.perf_counter() - start)
            s = samples[-1]
            print(f"  epoch {epoch + 1:2d}: tree PSS {s['tree_pss']:6.1f} MB over {s['processes']} processes "
                  f"(anon {s['tree_anon']:6.1f}, file {s['tree_file']:6.1f}, shmem {s['tree_shmem']:5.1f}); "
                  f"consumer PSS {s['own_pss']:6.1f} (anon {s['own_anon']:6.1f}, private dirty "
                  f"{s['own_dirty']:6.1f}); {rate:5.0f} samples/s", flush=True)
    finally:
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
    if args.epochs < FIRST_EPOCH + 2:
        parser.error(f"--epochs must be at least {FIRST_EPOCH + 2}: epochs 1-2 warm up")

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
        first, last = found["samples"][FIRST_EPOCH - 1], found["samples"][-1]
        growth = pss[-1] / pss[0]
        print(f"{backend}: tree PSS epoch {FIRST_EPOCH} {pss[0]:.1f} MB -> epoch {args.epochs} {pss[-1]:.1f} MB "
              f"(x{growth:.3f}; every epoch from {FIRST_EPOCH}: x{min(pss) / pss[0]:.3f} to x{max(pss) / pss[0]:.3f},"
              f" median {statistics.median(pss):.1f} MB); by kind: anon {first['tree_anon']:.1f} -> "
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
