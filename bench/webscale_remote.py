"""bench/webscale.py's parts on the network-namespace tier (tests/netns_tier.py): `open_remote` and `remote` (what
each measures: bench/webscale.py's docstring)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from _common import REPO, result_line
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


def open_remote_part(samples: int) -> str:
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
    with namespaced_tier(served, folder / "tier", rate_mbit=1000, first_byte_ms=20, upload=False) as tier:
        config = records_config(folder, samples)
        path = config_file(folder, config)
        url = f"dataset.path={tier.http_url}/{Path(local.root).name}"
        env = {**os.environ, **tier.env, "PYTHONPATH": str(REPO)}
        runs = []
        for _ in range(2):
            done = tier.run([sys.executable, "-c", _OPEN, str(path), url], capture_output=True, text=True,
                            env=env, cwd=REPO)
            if done.returncode:
                raise RuntimeError(done.stderr.strip().splitlines()[-1])
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\nopening {runs[0]['samples']:,} records in {len(list(Path(local.root).glob('*.bin')))} files over HTTP "
          f"(nginx in a namespace, {tier.first_byte_ms:g} ms first byte, {tier.rate_mbit:g} Mbit/s), fresh processes")
    print(f"first open (lists, saves the listing): {runs[0]['seconds']:.2f} s; second (the saved listing): "
          f"{runs[1]['seconds']:.2f} s")
    return result_line(f"open_remote_{count_label(samples)}_manifest", runs[1]["seconds"], "<=", 2)


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


def remote_part(samples: int, rate_mbit: float, first_byte_ms: float) -> list[str]:
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
    runs: dict[str, dict] = {}
    with namespaced_tier(folder, folder / "tier", rate_mbit=rate_mbit, first_byte_ms=first_byte_ms,
                         upload=False) as tier:
        url = f"{tier.http_url}/{root.name}"
        for mode in ("first_job", "index", "probe", "loadopt", "webdataset"):
            # first_job: a cache of its own, nothing saved (it lists and indexes); the others share one where
            # `index` saved the listing and the index, the shard cache emptied before each
            cache = folder / ("cache-first" if mode == "first_job" else "cache")
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
            runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    total = sum(p.stat().st_size for p in (root / "train").glob("*.tar"))
    probed = runs.get("probe", {}).get("mb_per_s")
    print(f"\nremote epochs: {samples:,} photos in tars of 100 ({total / 1e6:.0f} MB) over HTTP in a namespace, "
          f"{rate_mbit:g} Mbit/s, {first_byte_ms:g} ms first byte; the tier probed at "
          f"{probed or float('nan'):.1f} MB/s (1 MiB reads, 4 in flight)")
    print(f"{'path':<48} {'first batch s':>13} {'epoch 1 MB/s':>13} {'epoch 2 MB/s':>13} {'samples':>13} "
          f"{'tier MB read':>13}")
    for mode, label in (("loadopt", "loadopt torch tuned, shard cache, window"),
                        ("webdataset", "webdataset (own loop, its shuffle, no cache)")):
        if mode in runs:
            one, two = runs[mode]["epochs"]
            print(f"{label:<48} {one['first_batch_s']:>13.2f} {one['mb_per_s']:>13.1f} {two['mb_per_s']:>13.1f} "
                  f"{one['samples']:>6} {two['samples']:>6} {runs[mode]['tier_bytes'] / 1e6:>13.1f}")
    if "first_job" in runs and "webdataset" in runs:
        job, own = runs["first_job"], runs["webdataset"]["epochs"][0]
        until = job["epochs"][0]["from_start_s"]
        print(f"a first job (nothing saved: it lists and indexes the tars, through the shard cache): open, index and "
              f"epoch 1 in {until:.1f} s from its start ({total / 1e6 / until:.1f} MB/s), "
              f"{job['tier_bytes'] / 1e6:.0f} MB read by its epochs from the tier; WebDataset's own loop, which "
              f"keeps no index: {own['from_start_s']:.1f} s")
    results = []
    if "loadopt" in runs and probed:
        results.append(result_line("epoch1_remote_of_tier", runs["loadopt"]["epochs"][0]["mb_per_s"] / probed,
                                   ">=", 0.8))
    if "loadopt" in runs and "webdataset" in runs:
        results.append(result_line("remote_vs_best_peer", runs["loadopt"]["epochs"][0]["mb_per_s"] /
                                   runs["webdataset"]["epochs"][0]["mb_per_s"], ">=", 1.2))
    return results
