"""Web scale (issue 34): what a shard-window order costs and mixes, a rank's share of the order, and the time to
the first batch at millions of samples.

Parts (`--part`, all by default):
- `shuffle`: one epoch's order from each shuffle on the same class-sorted synthetic ImageFolder (`--samples`,
  default 20,000 tiny JPEGs of 100 classes): loadopt's `global` and `window` (its defaults, and a window
  the size of the peers' buffers), and the peers' own loops (WebDataset's shard shuffle and 1,000-sample
  buffer, LitData's chunk shuffle, Streaming's default `py1e`: the indices their batches carry, read through
  their workers, each in a fresh process under the peer's Python, `--peer-python`). The figures
  (loaders/shuffle_quality.py): `neighbour_spread` (1: random, 0: storage order) and `class_mix` (distinct
  classes per batch over a random batch's expectation). Figures of the orders only: no timing.
- `order`: at `--order-samples` (default 10M) over world size 8, each rank's order under `global` and
  `window` built in its own process: the bytes it holds (its share against the whole permutation it needs
  under `global`) and the seconds to build it. `RESULT window_order_per_rank_10m_world8`: a window rank's
  bytes over (the global permutation's / 8), target <= 1.2.

- `index`: a raw (and an Arrow) conversion of `--index-samples` records (default 1M of 512 bytes, 1,000 a file: 4 GiB of
  shards at the raw form's 4 KiB per sample; 10M would take 40 GiB, more than this disk has free) read by
  each of `--world` ranks under the window shuffle, each in its own process locating every sample of its
  epoch as the posix backend does batch by batch. The index a rank needed (`RawIndex.index_bytes_read`: the
  4 KiB pages of index rows it located, and the shard table) against the conversion's index / world, and the
  kernel's view (the resident pages of its index mappings, /proc/self/smaps: read-ahead is off on them, the
  kernel's fault-around still maps up to 64 KiB of cached neighbours; the index files are evicted from the
  page cache before each rank, as on a node of its own).
  `RESULT index_per_rank_<n>_world<w>`: the largest rank's bytes over (the index / world), target <= 1.2.
  The same for the Arrow form of the records (`--index-forms raw,arrow`): its index is each record batch's
  offsets (8 bytes a sample); a rank reads the offsets of each run it locates (a source shard's rows within a
  record batch) from the shard file with pread into arrays of its own, and holds those, the record batch table
  and the table of runs (`ArrowColumn.index_bytes_read`); resident: its `.arrow` mappings' pages (the samples'
  own pages, as the form maps index and data in one file, and footers). `RESULT
  index_per_rank_arrow_<n>_world<w>`, target <= 1.2.

- `first_batch`: `--first-samples` records (default 10M of 512 bytes, 10,000 files, generated once into the
  cache) opened and read by `make_loader(backend="torch")` under each shuffle, each in a fresh process: the
  seconds to open the dataset (its listing saved: the second open) and to the first batch.
  `RESULT first_batch_<n>`: the window shuffle's open + first batch, seconds, target <= 5.
- `open_remote`: the index part's records served over HTTP (nginx) in a network namespace (tests/netns_tier.py:
  a first-byte delay per request, a shaped link), opened from inside it in fresh processes: the first open
  lists the folder and saves the listing, the second reads it (storage/remote/listing.py).
  `RESULT open_remote_<n>_manifest`: the second open's seconds, target <= 2.

- `remote`: `--remote-samples` synthetic photos (default 4,000, ~400 x 350 JPEGs) as WebDataset tars of 100,
  served over HTTP from the namespace's nginx and from its S3 server (moto, the tars and the peers' conversions
  uploaded to its bucket) at `--rate-mbit` (160) with `--first-byte-ms` (20) a request (benchmarks/webscale_remote.py,
  benchmarks/_webscale_s3_peers.py). Inside the namespace, each in a fresh process: the shards listed and indexed once
  per URL (saved, as after a job's first open), the tier probed over HTTP (`loadopt.storage.tiers.probe`: 1 MiB reads,
  4 in flight), then rounds of timed runs in rotating order, 2 workers each, two epochs each, every epoch 1 from
  the tier (loadopt's shard cache emptied, the peers' caches fresh): loadopt's torch tuned through the bounded
  shard cache under the window shuffle, over HTTP and over S3 (s3:// through s3fs at AWS_ENDPOINT_URL), and over
  HTTP on the same tars after `loadopt recompress` (set-up: each JPEG as JPEG XL, read back as the same JPEG;
  its MB/s count the JPEGs given back, as the others' count theirs);
  WebDataset's own loop over HTTP on the same tars (the `webdataset` backend's `library_batches`); LitData and
  MosaicML Streaming each on its own conversion of the same photos (the `litdata` / `streaming` backends'
  `prepare()`, LitData chunks and MDS shards uploaded to the bucket), read by the library's own S3 client and
  loop (`litdata.StreamingDataset("s3://...")` in its StreamingDataLoader; `streaming.StreamingDataset(remote=
  "s3://...", local=<fresh>)` in its StreamingDataLoader, its endpoint from S3_ENDPOINT_URL), `__getitem__`
  decoding and cropping as the local peer backends do; and a first job (nothing saved). Figures: the time to the
  first batch, each epoch's delivered MB/s (JPEG bytes delivered over the epoch's seconds), the MB the tier sent
  (tc's count of the shaped link), each peer's local cache after. A peer that cannot run here is a line saying why
  (Streaming imports torchvision, whose build must match the torch beside it, and caps numpy below 2.2: give
  it a venv of its own where it imports with `--peer-python streaming=PATH/bin/python`; its conversion and loops
  run there, importing this checkout's loadopt). LitData fetches chunks with obstore,
  whose client options omit `allow_http`: the run adds it, as the tier's S3 endpoint is plain HTTP.
  `RESULT epoch1_remote_of_tier`: loadopt's epoch-1 MB/s over HTTP over the probed MB/s, target >= 0.8;
  `RESULT remote_vs_best_peer`: round by round, loadopt's fastest epoch-1 MB/s (HTTP, S3, recompressed) over the
  best of WebDataset's, LitData's and Streaming's, target >= 1.2. `--conn-rate-mbit R` paces each connection to R as
  well (the delaying proxy), as an object store limits each connection while the link holds many: the same two
  figures come out as `..._per_connection`.

    python benchmarks/webscale.py [--part shuffle,order,index,first_batch,open_remote,remote] [--samples N]
                             [--order-samples N] [--index-samples N] [--first-samples N] [--world 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, ratio_result, result_line, spread
from _webscale_common import config_file, count_label, records_config
from _webscale_s3_peers import PEER_PYTHON, python_for, why_failed
from webscale_remote import open_remote_part, remote_part

PEERS = ("webdataset", "litdata", "streaming")


def _config(folder: Path, samples: int):
    """A config of the synthetic JPEGs opened as the ImageFolder they are written as: listed, so class-sorted
    as any ImageFolder is (the synthetic set's own index interleaves the classes)."""
    from loadopt.config import load_config
    from loadopt.storage.open import open_dataset

    overrides = [f"dataset.synthetic.num_samples={samples}", "dataset.synthetic.num_classes=100",
                 "dataset.synthetic.mean_width=40", "dataset.synthetic.mean_height=36", "pipeline.image_size=32",
                 "pipeline.max_side=64", "pipeline.batch_size=64", f"report.out={folder / 'results'}"]
    synthetic = open_dataset(load_config(REPO / "configs" / "peers.yaml", overrides))
    root = Path(synthetic.root).parent
    return load_config(REPO / "configs" / "peers.yaml", [*overrides, f"dataset.path={root}"])


# In a fresh process under the peer's own Python (`python_for`): the indices one epoch (0) of the peer's own loop
# delivers, its library's order, as JSON.
_PEER_ORDER = """
import json, sys
sys.path.insert(0, sys.argv[2])
from _common import build_loader
from loadopt.config import load_config
loader = build_loader(load_config(sys.argv[1]), sys.argv[3], num_workers=2)
try:
    loader.prepare()
    print(json.dumps([int(i) for batch in loader.library_batches(0) for i in batch["indices"].tolist()]))
finally:
    loader.close()
"""


def _peer_order(config_path: Path, backend: str) -> list[int]:
    import subprocess

    done = subprocess.run([python_for(backend), "-c", _PEER_ORDER, str(config_path), str(REPO / "benchmarks"), backend],
                          capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(why_failed(done))
    return json.loads(done.stdout.strip().splitlines()[-1])


def shuffle_part(samples: int) -> list[dict]:
    import numpy as np

    from loadopt.loaders.sampler import EpochOrder, ShardWindows
    from loadopt.loaders.shuffle_quality import shuffle_quality
    from loadopt.storage.open import open_dataset
    from loadopt.storage.sources.shards import shard_table

    with tempfile.TemporaryDirectory(prefix="webscale-") as folder:
        config = _config(Path(folder), samples)
        dataset = open_dataset(config)
        n, batch, labels = len(dataset), config.pipeline.batch_size, dataset.labels
        orders: dict[str, np.ndarray] = {"loadopt global": EpochOrder(n, batch, config.seed).indices()}
        for shard_samples, window_shards in ((1024, 16), (250, 4)):
            windows = ShardWindows(shard_table(dataset, shard_samples), window_shards)
            name = f"loadopt window {window_shards} x {shard_samples}"
            orders[name] = EpochOrder(n, batch, config.seed, shuffle="window", windows=windows).indices()
        config_path = config_file(Path(folder), config)
        for peer in PEERS:
            try:
                orders[f"{peer} (own loop)"] = np.array(_peer_order(config_path, peer))
            except RuntimeError as exc:  # a peer that cannot run here is a line saying why
                print(f"{peer}: not measured ({str(exc)[:200]})")
        rows = []
        for name, order in orders.items():
            quality = shuffle_quality(order, labels, batch)
            rows.append({"order": name, "samples": quality.samples, "neighbour_spread": quality.neighbour_spread,
                         "class_mix": quality.class_mix, "classes_per_batch": quality.classes_per_batch})
    print(f"\nshuffle quality, {samples:,} class-sorted samples of 100 classes, batches of {batch}, epoch 0")
    print(f"{'order':<34} {'samples':>8} {'neighbour spread':>17} {'class mix':>10} {'classes/batch':>14}")
    for row in rows:
        print(f"{row['order']:<34} {row['samples']:>8,} {row['neighbour_spread']:>17.3f} {row['class_mix']:>10.3f} "
              f"{row['classes_per_batch']:>14.1f}")
    return rows


def _rank_order(args: tuple[int, int, int, str]) -> dict:
    """One rank's order in a fresh process: the peak of what it allocated building it (tracemalloc, which
    numpy's buffers report to), what it holds after, and the time."""
    samples, rank, world, shuffle = args
    import tracemalloc

    from loadopt.loaders.sampler import EpochOrder, ShardWindows
    from loadopt.storage.sources.shards import ShardTable

    tracemalloc.start()
    start = time.perf_counter()
    windows = ShardWindows(ShardTable.blocks(samples)) if shuffle == "window" else None
    batches = EpochOrder(samples, 64, 0, 0, rank, world, shuffle, windows=windows).batches()
    seconds = time.perf_counter() - start
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"rank": rank, "shuffle": shuffle, "seconds": seconds, "held_bytes": held, "peak_bytes": peak,
            "batches": len(batches)}


def order_part(samples: int, world: int) -> str:
    context = multiprocessing.get_context("spawn")
    rows = []
    for shuffle in ("global", "window"):
        for rank in range(world):
            with context.Pool(1) as pool:  # a fresh process per rank: its peak is its own
                rows.append(pool.map(_rank_order, [(samples, rank, world, shuffle)])[0])
    whole = samples * 8  # the global permutation every rank builds, int64
    print(f"\nthe order per rank, {samples:,} samples, world size {world}")
    print(f"{'shuffle':<8} {'seconds (median)':>17} {'held MB (max)':>14} {'peak MB while built (max)':>26}")
    for shuffle in ("global", "window"):
        mine = [r for r in rows if r["shuffle"] == shuffle]
        print(f"{shuffle:<8} {statistics.median(r['seconds'] for r in mine):>17.3f} "
              f"{max(r['held_bytes'] for r in mine) / 1e6:>14.1f} {max(r['peak_bytes'] for r in mine) / 1e6:>26.1f}")
    window_peak = max(r["peak_bytes"] for r in rows if r["shuffle"] == "window")
    print(f"the global permutation: {whole / 1e6:.1f} MB; its share per rank: {whole / world / 1e6:.1f} MB")
    return result_line(f"window_order_per_rank_{count_label(samples)}_world{world}", window_peak / (whole / world),
                       "<=", 1.2)


def _mapped_bytes(suffix: str) -> int:
    """Resident bytes of this process's mappings of files ending in `suffix` (/proc/self/smaps)."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: its range, perms, ..., path
            counting = line.endswith(suffix)
        elif counting and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def _rank_index(args: tuple[str, str, int, int, int]) -> dict:
    folder, form, samples, rank, world = args
    from loadopt.loaders.sampler import EpochOrder, ShardWindows
    from loadopt.storage.open import open_dataset
    from loadopt.storage.sources.shards import shard_table

    config = records_config(Path(folder), samples)
    dataset = open_dataset(config)
    start = time.perf_counter()
    if form == "raw":
        from loadopt.storage.forms import raw_format

        index = raw_format.open_raw(raw_format.raw_path(dataset, "records", None), dataset, "records", None,
                                    verify="none")
        locate, whole, suffix = index.locate, index.index_bytes, ".idx.npy"
        files = len(index.shards)
    else:  # the Arrow form: each record batch's offsets, views of the mapped shards (loaders/arrow/column.py)
        from loadopt.loaders.arrow.column import ArrowColumn
        from loadopt.storage.forms import arrow_format

        conversion = arrow_format.open_arrow(arrow_format.arrow_path(dataset, "records", None), dataset, "records",
                                             None, verify="none")
        runs = shard_table(dataset, config.pipeline.shard_samples).bounds
        index = ArrowColumn(list(conversion), conversion.batch_file.copy(), runs, conversion.files,
                            conversion.offsets_at)  # as the arrow backend opens it
        locate, whole, suffix, files = index.locate, index.index_bytes, ".arrow", len(conversion.files)
    opened = time.perf_counter() - start
    windows = ShardWindows(shard_table(dataset, config.pipeline.shard_samples), config.pipeline.window_shards)
    order = EpochOrder(len(dataset), config.pipeline.batch_size, config.seed, 0, rank, world, "window",
                       windows=windows)
    for batch in order.batches():
        locate(batch)
    shards = len(index.opened_shards()) if form == "raw" else files
    return {"rank": rank, "needed": index.index_bytes_read(), "resident": _mapped_bytes(suffix), "whole": whole(),
            "open_s": opened, "shards": shards, "of_shards": files}


def index_part(samples: int, world: int, form: str = "raw") -> str:
    """A rank's index under the window shuffle: of the raw form (its shards' index files) or of the Arrow form
    (the offsets in its shards' record batches)."""
    from loadopt.storage.forms import arrow_convert, raw_convert
    from loadopt.storage.open import open_dataset
    from loadopt.storage.tiers.pagecache import evict

    folder = Path(tempfile.mkdtemp(prefix="webscale-index-"))
    dataset = open_dataset(records_config(folder, samples))
    start = time.perf_counter()
    if form == "raw":
        path = raw_convert.convert(dataset, "records", None)
        files = sorted(str(p) for p in path.glob("*.idx.npy"))
    else:
        path = arrow_convert.convert(dataset, "records", None)
        files = sorted(str(p) for p in path.glob("*.arrow"))
    print(f"\n{form} conversion of {len(dataset):,} records: {time.perf_counter() - start:.0f} s (reused if 0)")
    context = multiprocessing.get_context("spawn")
    rows = []
    for rank in range(world):
        evict(files)  # each rank starts from a cold index, as on its own node
        with context.Pool(1) as pool:  # a fresh process per rank: its mappings are its own
            rows.append(pool.map(_rank_index, [(str(folder), form, samples, rank, world)])[0])
    whole = rows[0]["whole"]
    print(f"the {form} form's index per rank, {len(dataset):,} samples, world size {world}, window shuffle; the "
          f"conversion's index {whole / 1e6:.1f} MB, / {world} = {whole / world / 1e6:.2f} MB")
    print(f"{'rank':>4} {'index needed MB':>16} {'resident MB':>12} {'shards mapped':>14} {'open s':>7}")
    for row in rows:
        print(f"{row['rank']:>4} {row['needed'] / 1e6:>16.2f} {row['resident'] / 1e6:>12.2f} "
              f"{row['shards']:>7} of {row['of_shards']:<4} {row['open_s']:>7.3f}")
    largest = max(r["needed"] for r in rows)
    name = "index_per_rank" if form == "raw" else f"index_per_rank_{form}"
    return result_line(f"{name}_{count_label(samples)}_world{world}", largest / (whole / world), "<=", 1.2)


_FIRST_BATCH = """
import json, sys, time
start = time.perf_counter()
from loadopt import make_loader
from loadopt.config import load_config
from loadopt.storage.open import open_dataset
config = load_config(sys.argv[1], sys.argv[2:])
opened_at = time.perf_counter()
dataset = open_dataset(config)
opened = time.perf_counter() - opened_at
loader = make_loader(config, backend="torch", num_workers=2)
inputs, labels = next(iter(loader))
first = time.perf_counter() - start
loader.close()
print(json.dumps({"open_s": opened, "first_batch_s": first, "samples": len(dataset), "batch": len(labels)}))
"""


def first_batch_part(samples: int, rounds: int) -> str:
    import subprocess

    from loadopt.storage.open import open_dataset

    folder = Path(tempfile.mkdtemp(prefix="webscale-first-"))
    config = records_config(folder, samples)
    start = time.perf_counter()
    dataset = open_dataset(config)  # generated once into the cache; listed, the listing saved
    print(f"\n{len(dataset):,} records ready in {time.perf_counter() - start:.0f} s (0: from the cache)")
    path = config_file(folder, config)
    rows: dict[str, list[dict]] = {"global": [], "window": []}
    for round_ in range(rounds):
        for shuffle in (("global", "window") if round_ % 2 == 0 else ("window", "global")):  # interleaved
            done = subprocess.run([sys.executable, "-c", _FIRST_BATCH, str(path), f"pipeline.shuffle={shuffle}"],
                                  capture_output=True, text=True, check=True, cwd=REPO)
            rows[shuffle].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"time to the first batch, {len(dataset):,} samples, torch, 2 workers, a fresh process each, {rounds} "
          "interleaved rounds")
    for shuffle, runs in rows.items():
        print(f"{shuffle:<8} open s: {spread([r['open_s'] for r in runs], '.2f')}; first batch s (from start): "
              f"{spread([r['first_batch_s'] for r in runs], '.2f')}")
    return ratio_result(f"first_batch_{count_label(samples)}", [r["first_batch_s"] for r in rows["window"]], "<=", 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="shuffle,order,index,first_batch,open_remote,remote")
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--order-samples", type=int, default=10_000_000)
    parser.add_argument("--index-samples", type=int, default=1_000_000)
    parser.add_argument("--index-forms", default="raw,arrow", help="index: the conversions measured (raw, arrow)")
    parser.add_argument("--first-samples", type=int, default=10_000_000)
    parser.add_argument("--remote-samples", type=int, default=4000)
    parser.add_argument("--rate-mbit", type=float, default=160.0)
    parser.add_argument("--first-byte-ms", type=float, default=20.0)
    parser.add_argument("--conn-rate-mbit", type=float, default=0.0,
                        help="remote: each connection paced to this too (0: the link's rate only)")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the timed parts (median and spread)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--peer-python", action="append", default=[], metavar="PEER=PYTHON",
                        help="run a peer's conversion and loops under its own interpreter (a venv where it imports: "
                             "MosaicML Streaming needs a torchvision built for the torch beside it)")
    args = parser.parse_args()
    # SIGTERM unwinds as Ctrl-C does: the namespace, its servers and the temporary folders are removed
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    for item in args.peer_python:
        peer, _, python = item.partition("=")
        if not python or not Path(python).is_file():
            parser.error(f"--peer-python {item}: expected PEER=PATH of a Python interpreter")
        PEER_PYTHON[peer] = python
    parts = set(args.part.split(","))
    figures: dict = {}
    results = []
    if "shuffle" in parts:
        figures["shuffle"] = shuffle_part(args.samples)
    if "order" in parts:
        results.append(order_part(args.order_samples, args.world))
    if "index" in parts:
        results += [index_part(args.index_samples, args.world, form) for form in args.index_forms.split(",")]
    if "first_batch" in parts:
        results.append(first_batch_part(args.first_samples, args.rounds))
    if "open_remote" in parts:
        results.append(open_remote_part(args.index_samples, args.rounds))
    if "remote" in parts:
        results += remote_part(args.remote_samples, args.rate_mbit, args.first_byte_ms, args.rounds,
                               args.conn_rate_mbit)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    for line in results:
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: everything it made is removed by then
        print("webscale: stopped before the end (SIGINT or SIGTERM); nothing measured is kept", file=sys.stderr)
        sys.exit(130)
