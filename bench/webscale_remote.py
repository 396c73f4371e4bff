"""bench/webscale.py's parts on the network-namespace tier (tests/netns_tier.py): `open_remote` and `remote` (what
each measures: bench/webscale.py's docstring)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from _common import REPO, ratio_result, result_line, spread
from _webscale_common import config_file, count_label, records_config

_OPEN = """
import json, sys, time
start = time.perf_counter()
from loadopt.config import load_config
from loadopt.storage.imagefolder import open_dataset
config = load_config(sys.argv[1], sys.argv[2:])
dataset = open_dataset(config)
print(json.dumps({"seconds": time.perf_counter() - start, "samples": len(dataset)}))
"""


def open_remote_part(samples: int, rounds: int) -> str:
    import os

    from loadopt.storage.imagefolder import open_dataset
    from tests.netns_tier import namespaced_tier, netns_unavailable

    why = netns_unavailable()
    if why:
        print(f"\nopen_remote: not measured: {why}")
        return result_line(f"open_remote_{count_label(samples)}_manifest", float("inf"), "<=", 2)
    folder = Path(tempfile.mkdtemp(prefix="webscale-remote-"))
    local = open_dataset(records_config(folder, samples))  # the index part's records (generated if missing)
    served = Path(local.root).parent
    first, second = [], []
    with namespaced_tier(served, folder / "tier", rate_mbit=1000, first_byte_ms=20, upload=False) as tier:
        config = records_config(folder, samples)
        path = config_file(folder, config)
        url = f"dataset.path={tier.http_url}/{Path(local.root).name}"
        for round_ in range(rounds):  # a cache of each round's own: its first open lists
            env = {**os.environ, **tier.env, "PYTHONPATH": str(REPO), "LOADOPT_CACHE": str(folder / f"cache-{round_}")}
            for opens in (first, second):
                done = tier.run([sys.executable, "-c", _OPEN, str(path), url], capture_output=True, text=True,
                                env=env, cwd=REPO)
                if done.returncode:
                    raise RuntimeError(done.stderr.strip().splitlines()[-1])
                opens.append(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])
    print(f"\nopening {samples:,} records in {len(list(Path(local.root).glob('*.bin')))} files over HTTP "
          f"(nginx in a namespace, {tier.first_byte_ms:g} ms first byte, {tier.rate_mbit:g} Mbit/s), fresh processes, "
          f"{rounds} rounds")
    print(f"first open (lists, saves the listing) s: {spread(first, '.2f')}; second (the saved listing) s: "
          f"{spread(second, '.2f')}")
    return ratio_result(f"open_remote_{count_label(samples)}_manifest", second, "<=", 2)


_REMOTE = """
import json, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
from loadopt.config import load_config
mode, path, url = sys.argv[1:4]
config = load_config(path, [f"dataset.path={url}", *sys.argv[4:]])
if mode == "index":  # listed and indexed once, saved in the cache: the runs after start from the saved index
    from loadopt.storage.imagefolder import open_dataset
    print(json.dumps({"samples": len(open_dataset(config))}))
    sys.exit()
if mode == "probe":
    from loadopt.storage.probe import probe, summary
    result = probe(url + "/train", block_sizes=(1 << 20,), concurrencies=(4,), duration_s=4.0, sequential=False,
                   cold=False)
    print(json.dumps({"mb_per_s": summary(result)["best_mb_per_s"]}))
    sys.exit()
from loadopt import make_loader
from loadopt.storage.tiers import tier_counters
start = time.perf_counter()
if mode in ("loadopt", "first_job"):
    loader = make_loader(config, backend="torch", variant="tuned", num_workers=2)
    epochs = lambda epoch: ((y, None) for _, y in loader)
else:
    from _common import build_loader
    loader = build_loader(config, "webdataset", num_workers=2)
    loader.prepare()
    epochs = lambda epoch: ((b["labels"], b["indices"]) for b in loader.library_batches(epoch))
sizes = loader.dataset.sizes
out = {"epochs": []}
for epoch in range(2):
    began, first, samples, nbytes = time.perf_counter(), None, 0, 0
    for labels, indices in epochs(epoch):
        if first is None:
            first = time.perf_counter() - (start if epoch == 0 else began)
        samples += len(labels)
        nbytes += int(sizes[indices.numpy()].sum()) if indices is not None else 0
    seconds = time.perf_counter() - began
    if indices is None:  # loadopt's batches are the whole epoch's samples, each once
        nbytes = int(sizes.sum())
    out["epochs"].append({"first_batch_s": first, "seconds": seconds, "samples": samples,
                          "mb_per_s": nbytes / seconds / 1e6, "from_start_s": time.perf_counter() - start})
counters = tier_counters(loader.dataset.fs) or {}
out["tier_bytes"] = counters.get("bytes", 0.0)
loader.close()
print(json.dumps(out))
"""


def _photo_shards(folder: Path, samples: int) -> Path:
    """`samples` synthetic photos as WebDataset tars of 100 (`<folder>/photos/train-NNNNNN.tar`)."""
    from loadopt.config import load_config
    from loadopt.storage.imagefolder import open_dataset
    from tests.source_files import write_shards

    synthetic = open_dataset(load_config(REPO / "configs" / "peers.yaml", [
        f"dataset.synthetic.num_samples={samples}", f"report.out={folder / 'results'}"]))
    records = [(f"s{i:07d}", int(synthetic.labels[i]), synthetic.read(i)) for i in range(len(synthetic))]
    write_shards(folder / "photos" / "train", records, per_shard=100)
    return folder / "photos"


def remote_part(samples: int, rate_mbit: float, first_byte_ms: float, rounds: int) -> list[str]:
    import os
    import shutil

    from loadopt.config import load_config
    from tests.netns_tier import namespaced_tier, netns_unavailable

    why = netns_unavailable()
    if why:
        print(f"\nremote: not measured: {why}")
        return []
    folder = Path(tempfile.mkdtemp(prefix="webscale-photos-"))
    root = _photo_shards(folder, samples)
    config = load_config(REPO / "configs" / "peers.yaml", [
        "pipeline.shuffle=window", "pipeline.window_shards=4", "storage.cache_limit=4GiB",
        f"report.out={folder / 'results'}"])
    path = config_file(folder, config)
    runs: dict[str, list[dict]] = {}
    timed = ("loadopt", "webdataset", "first_job")
    with namespaced_tier(folder, folder / "tier", rate_mbit=rate_mbit, first_byte_ms=first_byte_ms,
                         upload=False) as tier:
        url = f"{tier.http_url}/{root.name}"
        # `index` and `probe` once; then rounds of the three timed runs, their order rotating each round
        plan = ["index", "probe"] + [timed[(k + r) % 3] for r in range(rounds) for k in range(3)]
        for number, mode in enumerate(plan):
            # first_job: a cache of its own, nothing saved (it lists and indexes); the others share one where
            # `index` saved the listing and the index, the shard cache emptied before each
            cache = folder / (f"cache-first-{number}" if mode == "first_job" else "cache")
            shutil.rmtree(cache / "shard-cache", ignore_errors=True)  # every run's epoch 1 from the tier
            env = {**os.environ, **tier.env, "PYTHONPATH": str(REPO), "LOADOPT_CACHE": str(cache)}
            # WebDataset's own loop streams its tars from the server, as its users run it (not through loadopt's
            # shard cache, which the config's cache_limit would put under the backend's tar streams too)
            extra = ["storage.cache_limit=null"] if mode == "webdataset" else []
            done = tier.run([sys.executable, "-c", _REMOTE, mode, str(path), url, *extra], capture_output=True,
                            text=True, env=env, cwd=REPO)
            if done.returncode:
                print(f"{mode}: failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else '?'}")
                continue
            runs.setdefault(mode, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
    total = sum(p.stat().st_size for p in (root / "train").glob("*.tar"))
    probed = runs["probe"][0]["mb_per_s"] if "probe" in runs else None
    print(f"\nremote epochs: {samples:,} photos in tars of 100 ({total / 1e6:.0f} MB) over HTTP in a namespace, "
          f"{rate_mbit:g} Mbit/s, {first_byte_ms:g} ms first byte; the tier probed at "
          f"{probed or float('nan'):.1f} MB/s (1 MiB reads, 4 in flight); {rounds} interleaved rounds")
    for mode, label in (("loadopt", "loadopt torch tuned, shard cache, window"),
                        ("webdataset", "webdataset (own loop, its shuffle, no cache)")):
        for figure, name, spec in (("first_batch_s", "first batch s", ".2f"), ("mb_per_s", "MB/s", ".1f")):
            for epoch in (0, 1):
                if figure == "first_batch_s" and epoch:
                    continue
                values = [run["epochs"][epoch][figure] for run in runs.get(mode, [])]
                if values:
                    print(f"{label}: epoch {epoch + 1} {name}: {spread(values, spec)}")
        if mode in runs:
            print(f"{label}: samples per epoch {runs[mode][0]['epochs'][0]['samples']}, tier MB read over both "
                  f"epochs {runs[mode][0]['tier_bytes'] / 1e6:.1f}")
    if "first_job" in runs and "webdataset" in runs:
        jobs = [r["epochs"][0]["from_start_s"] for r in runs["first_job"]]
        own = [r["epochs"][0]["from_start_s"] for r in runs["webdataset"]]
        print("a first job (nothing saved: it lists and indexes the tars, through the shard cache), open, index "
              f"and epoch 1, s from its start: {spread(jobs, '.1f')}; WebDataset's own loop, which keeps no index, "
              f"epoch 1 from its start: {spread(own, '.1f')}")
    results = []
    mine = [run["epochs"][0]["mb_per_s"] for run in runs.get("loadopt", [])]
    peers = [run["epochs"][0]["mb_per_s"] for run in runs.get("webdataset", [])]
    if mine and probed:
        results.append(ratio_result("epoch1_remote_of_tier", [m / probed for m in mine], ">=", 0.8))
    if mine and len(peers) == len(mine):  # round by round: each pair ran minutes apart at most
        results.append(ratio_result("remote_vs_best_peer", [m / p for m, p in zip(mine, peers, strict=True)],
                                    ">=", 1.2))
    return results
