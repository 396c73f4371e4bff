"""benchmarks/webscale.py's parts on the network-namespace tier (tests/netns_tier.py): `open_remote` and `remote` (what
each measures: benchmarks/webscale.py's docstring)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from _common import REPO, ratio_result, result_line, spread
from _webscale_common import config_file, count_label, records_config
from _webscale_s3_peers import LABELS, S3_PEERS, prepare_s3_peers, run_s3_peer, upload_tars, why_failed, wire_bytes

_OPEN = """
import json, sys, time
start = time.perf_counter()
from loadopt.config import load_config
from loadopt.storage.open import open_dataset
config = load_config(sys.argv[1], sys.argv[2:])
dataset = open_dataset(config)
print(json.dumps({"seconds": time.perf_counter() - start, "samples": len(dataset)}))
"""


def open_remote_part(samples: int, rounds: int) -> str:
    import os

    from loadopt.storage.open import open_dataset
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
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from loadopt.config import load_config
mode, path, url = sys.argv[1:4]
config = load_config(path, [f"dataset.path={url}", *sys.argv[4:]])
if mode == "index":  # listed and indexed once, saved in the cache: the runs after start from the saved index
    from loadopt.storage.open import open_dataset
    print(json.dumps({"samples": len(open_dataset(config))}))
    sys.exit()
if mode == "probe":
    from loadopt.storage.tiers.probe import probe, summary
    result = probe(url + "/train", block_sizes=(1 << 20,), concurrencies=(4,), duration_s=4.0, sequential=False,
                   cold=False)
    print(json.dumps({"mb_per_s": summary(result)["best_mb_per_s"]}))
    sys.exit()
from loadopt import make_loader
from loadopt.storage.tiers.stack import tier_counters
start = time.perf_counter()
if mode in ("loadopt", "loadopt_s3", "loadopt_jxl", "first_job"):
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
    from loadopt.storage.open import open_dataset
    from tests.source_files import write_shards

    synthetic = open_dataset(load_config(REPO / "configs" / "peers.yaml", [
        f"dataset.synthetic.num_samples={samples}", f"report.out={folder / 'results'}"]))
    records = [(f"s{i:07d}", int(synthetic.labels[i]), synthetic.read(i)) for i in range(len(synthetic))]
    write_shards(folder / "photos" / "train", records, per_shard=100)
    return folder / "photos"


def _jpegs(folder: Path):
    """Every image member's bytes in the tars of `folder`."""
    import tarfile

    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith((".jpg", ".jpeg")):
                    yield tar.extractfile(member).read()


# the timed runs, rotated each round; `first_job` times a job with nothing saved, loadopt_s3 reads the same tars
# from the bucket, loadopt_jxl the same tars after `loadopt recompress` (the same JPEGs given back), the peers
# their own conversions
OURS = ("loadopt", "loadopt_s3", "loadopt_jxl")
TIMED = (*OURS, "webdataset", *S3_PEERS, "first_job")
SHOWN = {"loadopt": "loadopt torch tuned over HTTP, shard cache, window",
         "loadopt_s3": "loadopt torch tuned over S3, shard cache, window",
         "loadopt_jxl": "loadopt torch tuned over HTTP on the recompressed tars (JPEG XL), shard cache, window",
         "webdataset": "webdataset (own loop over HTTP, its shuffle, no cache)", **LABELS}
PEERS = ("webdataset", *S3_PEERS)


def _run(tier, mode: str, urls: dict[str, str], folder: Path, path: Path, number: int, env: dict[str, str]):
    """One run of `mode` in a fresh process inside the namespace."""

    if mode in S3_PEERS:  # a fresh local folder each: every run's epoch 1 from the tier
        local = folder / f"peer-local-{number}"
        try:
            return run_s3_peer(tier, mode, urls[mode], folder, path, local, env)
        finally:
            shutil.rmtree(local, ignore_errors=True)
    # first_job: a cache of its own, nothing saved (it lists and indexes); the others share one where `index`
    # saved the listing and the index, the shard cache emptied before each
    cache = folder / (f"cache-first-{number}" if mode == "first_job" else "cache")
    shutil.rmtree(cache / "shard-cache", ignore_errors=True)  # every run's epoch 1 from the tier
    # WebDataset's own loop streams its tars from the server, as its users run it (not through loadopt's shard
    # cache, which the config's cache_limit would put under the backend's tar streams too)
    extra = ["storage.cache_limit=null"] if mode == "webdataset" else []
    script_mode = "index" if mode.startswith("index") else mode
    return tier.run([sys.executable, "-c", _REMOTE, script_mode, str(path), urls[mode], *extra],
                    capture_output=True, text=True, env={**env, "LOADOPT_CACHE": str(cache)}, cwd=REPO)


def remote_part(samples: int, rate_mbit: float, first_byte_ms: float, rounds: int,
                conn_rate_mbit: float = 0.0) -> list[str]:
    from tests.netns_tier import netns_unavailable

    why = netns_unavailable()
    if why:
        print(f"\nremote: not measured: {why}")
        return []
    folder = Path(tempfile.mkdtemp(prefix="webscale-photos-"))
    try:  # the photos, their conversions and the runs' caches: about 1.5 GB at 4,000 photos
        return _measure_remote(folder, samples, rate_mbit, first_byte_ms, rounds, conn_rate_mbit)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _measure_remote(folder: Path, samples: int, rate_mbit: float, first_byte_ms: float, rounds: int,
                    conn_rate_mbit: float) -> list[str]:
    import os

    from loadopt.config import load_config
    from tests.netns_tier import namespaced_tier

    root = _photo_shards(folder, samples)
    from loadopt.storage.forms.recompress import recompress_shards

    # set-up, not timed: the same tars with their JPEGs as JPEG XL, served beside them (`loadopt recompress`)
    packed = recompress_shards(root / "train", folder / "photos-jxl" / "train")
    config = load_config(REPO / "configs" / "peers.yaml", [
        "pipeline.shuffle=window", "pipeline.window_shards=4", "storage.cache_limit=4GiB",
        f"report.out={folder / 'results'}"])
    path = config_file(folder, config)
    runs: dict[str, list[dict]] = {}
    with namespaced_tier(folder, folder / "tier", rate_mbit=rate_mbit, first_byte_ms=first_byte_ms,
                         upload=False, conn_rate_mbit=conn_rate_mbit) as tier:
        # the caller's PYTHONPATH after the repository's
        env = {**os.environ, **tier.env, "PYTHONPATH": os.pathsep.join(filter(None, [
            str(REPO), os.environ.get("PYTHONPATH")]))}
        http = f"{tier.http_url}/{root.name}"
        urls = {"index": http, "probe": http, "loadopt": http, "webdataset": http, "first_job": http,
                "index_jxl": f"{tier.http_url}/photos-jxl", "loadopt_jxl": f"{tier.http_url}/photos-jxl"}
        s3 = upload_tars(tier, root, env)  # set-up: the bucket filled straight, not through the shaped link
        if s3 is not None:
            urls["index_s3"] = urls["loadopt_s3"] = s3
        urls.update(prepare_s3_peers(tier, folder, path, root, env))
        timed = [mode for mode in TIMED if mode in urls]
        # `index` (each URL's) and `probe` once; then rounds of the timed runs, their order rotating each round
        plan = [(mode, -1) for mode in ("index", "index_s3", "index_jxl", "probe") if mode in urls]
        plan += [(timed[(k + r) % len(timed)], r) for r in range(rounds) for k in range(len(timed))]
        for number, (mode, round_) in enumerate(plan):
            before = wire_bytes(tier)
            done = _run(tier, mode, urls, folder, path, number, env)
            after = wire_bytes(tier)
            if done.returncode:
                print(f"{mode}: failed: {why_failed(done)}")
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result.update(round=round_, wire_bytes=None if before is None or after is None else after - before)
            runs.setdefault(mode, []).append(result)
    total = sum(p.stat().st_size for p in (root / "train").glob("*.tar"))
    jpeg_bytes = sum(len(data) for data in _jpegs(root / "train"))
    for run in runs.get("loadopt_jxl", []):  # the JPEGs it gave back, as the others deliver: the same samples
        for epoch in run["epochs"]:
            epoch["tier_mb_per_s"], epoch["mb_per_s"] = epoch["mb_per_s"], jpeg_bytes / epoch["seconds"] / 1e6
    print(f"\nrecompressed (loadopt recompress, set-up): {packed.bytes_before / 1e6:.1f} MB of tars -> "
          f"{packed.bytes_after / 1e6:.1f} MB ({packed.recompressed} JPEGs as JPEG XL, {packed.kept} kept); its "
          "MB/s below count the JPEGs given back, as the others' do")
    probed = runs["probe"][0]["mb_per_s"] if "probe" in runs else None
    print(f"\nremote epochs: {samples:,} photos in tars of 100 ({total / 1e6:.0f} MB) over HTTP (nginx) and S3 (moto, "
          f"a connection per request) in a namespace, {rate_mbit:g} Mbit/s"
          f"{f' ({conn_rate_mbit:g} Mbit/s each connection)' if conn_rate_mbit else ''}, {first_byte_ms:g} ms first "
          "byte; the "
          f"tier probed over HTTP at {probed or float('nan'):.1f} MB/s (1 MiB reads, 4 in flight); {rounds} "
          "interleaved rounds, 2 workers each")
    for mode, label in SHOWN.items():
        for figure, name, spec in (("first_batch_s", "first batch s", ".2f"), ("mb_per_s", "MB/s", ".1f")):
            for epoch in (0, 1):
                if figure == "first_batch_s" and epoch:
                    continue
                values = [run["epochs"][epoch][figure] for run in runs.get(mode, [])]
                if values:
                    print(f"{label}: epoch {epoch + 1} {name}: {spread(values, spec)}")
        if mode in runs:
            run = runs[mode][0]
            wire = f"{run['wire_bytes'] / 1e6:.1f}" if run["wire_bytes"] is not None else "?"
            read = f", loadopt's tier counters {run['tier_bytes'] / 1e6:.1f}" if "tier_bytes" in run else ""
            cache = f"; its local cache after {run['cache_bytes'] / 1e6:.1f} MB" if "cache_bytes" in run else ""
            print(f"{label}: samples per epoch {run['epochs'][0]['samples']}, MB from the tier over both epochs "
                  f"(tc, answers' bytes) {wire}{read}{cache}")
    if "first_job" in runs and "webdataset" in runs:
        jobs = [r["epochs"][0]["from_start_s"] for r in runs["first_job"]]
        own = [r["epochs"][0]["from_start_s"] for r in runs["webdataset"]]
        print("a first job (nothing saved: it lists and indexes the tars, through the shard cache), open, index "
              f"and epoch 1, s from its start: {spread(jobs, '.1f')}; WebDataset's own loop, which keeps no index, "
              f"epoch 1 from its start: {spread(own, '.1f')}")
    results = []
    suffix = "_per_connection" if conn_rate_mbit else ""  # the tier that limits each connection, not only the link
    mine = [run["epochs"][0]["mb_per_s"] for run in runs.get("loadopt", [])]
    if mine and probed:
        results.append(ratio_result(f"epoch1_remote_of_tier{suffix}", [m / probed for m in mine], ">=", 0.8))
    ratios = []
    for round_ in range(rounds):  # round by round: each run of a round minutes apart at most
        epoch1 = {mode: run["epochs"][0]["mb_per_s"] for mode in (*OURS, *PEERS)
                  for run in runs.get(mode, []) if run["round"] == round_}
        ours = max(OURS, key=lambda m: epoch1.get(m, 0.0))
        best = max(PEERS, key=lambda m: epoch1.get(m, 0.0))
        if epoch1.get(ours) and epoch1.get(best):
            print(f"round {round_ + 1}: loadopt's fastest {ours} {epoch1[ours]:.1f} MB/s, the best peer {best} "
                  f"{epoch1[best]:.1f} MB/s (of {', '.join(p for p in PEERS if p in epoch1)})")
            ratios.append(epoch1[ours] / epoch1[best])
    if ratios:
        results.append(ratio_result(f"remote_vs_best_peer{suffix}", ratios, ">=", 1.2))
    for epochs in (1, 2, JOB_EPOCHS):  # a job of many epochs: its first from the tier, the others from its cache
        jobs = {mode: [_job_seconds(run, epochs) for run in runs[mode]] for mode in SHOWN if runs.get(mode)}
        print(f"a job of {epochs} epoch{'s' if epochs > 1 else ''}, s from its start (epoch 1 as measured, each "
              "later one as its epoch 2): " + "; ".join(f"{mode} {spread(values, '.1f')}"
                                                         for mode, values in jobs.items()))
    second = []
    for round_ in range(rounds):
        epoch2 = {mode: run["epochs"][1]["mb_per_s"] for mode in ("loadopt", "loadopt_jxl")
                  for run in runs.get(mode, []) if run["round"] == round_ and len(run["epochs"]) > 1}
        if len(epoch2) == 2:
            second.append(epoch2["loadopt_jxl"] / epoch2["loadopt"])
    if second:  # the JPEGs given back per second from the shard cache: the recompressed tars against the plain ones
        results.append(ratio_result(f"recompressed_epoch2_vs_plain{suffix}", second, ">=", 0.9))
    return results


JOB_EPOCHS = 10


def _job_seconds(run: dict, epochs: int) -> float:
    """A job's seconds from its start to the end of epoch `epochs`: epoch 1 as measured (from its start), each later
    epoch as long as the run's epoch 2 (from the cache)."""
    first = run["epochs"][0]
    later = run["epochs"][1]["seconds"] if len(run["epochs"]) > 1 else first["seconds"]
    return first["from_start_s"] + (epochs - 1) * later
