"""benchmarks/webscale.py's `remote` part, the peers that read S3: LitData and MosaicML Streaming, each on its own
conversion of the same photo tars, read from the namespaced tier's S3 server (moto behind the first-byte-delay
proxy, tests/netns_tier.py) by the library's own client and loop, in a fresh process inside the namespace.

The conversions are loadopt's peer backends' own (`peer_litdata`, `peer_streaming`: `prepare()` writes LitData
chunks or MDS shards into a cache of their own); each folder goes to the bucket under the library's name. The
loops are what their users write: LitData's `StreamingDataset("s3://...")` in its `StreamingDataLoader`,
Streaming's `StreamingDataset(remote="s3://...", local=<a fresh folder>)` in its `StreamingDataLoader` (a torch
DataLoader), 2 workers each, shuffled by the library, one dataset iterated for two epochs. `__getitem__` runs
the config's pipeline on each record as the local peer backends do (`peer_base.cropped` / `CropSample`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from _common import REPO

S3_PEERS = ("litdata", "streaming")
LABELS = {"litdata": "litdata (own S3 client and loop, its chunks, its cache; obstore given allow_http)",
          "streaming": "streaming (own S3 client and loop, its MDS shards, its cache)"}
# A peer's own Python where it cannot import beside this one (`--peer-python streaming=PATH`: MosaicML Streaming
# imports torchvision, whose build must match the torch beside it, and caps numpy): its conversion and its loop
# run there, importing this checkout's loadopt (their working folder is the repository).
PEER_PYTHON: dict[str, str] = {}


def python_for(peer: str) -> str:
    return PEER_PYTHON.get(peer, sys.executable)


# In a fresh process on the host: the peer backend's conversion of the local tars (its `prepare()`), its folder,
# and the JPEG bytes of each dataset index (what a delivered sample counts).
_CONVERT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[4])
from _common import build_loader
from loadopt.config import load_config
from loadopt.loaders.registry import backend_class
backend, path, root, _, sizes = sys.argv[1:6]
usable, why = backend_class(backend).available()
if not usable:
    print(why, file=sys.stderr)
    sys.exit(3)
loader = build_loader(load_config(path, [f"dataset.path={root}", "storage.cache_limit=null"]), backend, num_workers=2)
loader.prepare()
np.save(sizes, np.asarray(loader.dataset.sizes, dtype=np.int64))
print(json.dumps({"path": str(loader.path), "samples": loader.meta.samples}))
loader.close()
"""

# Inside the namespace, straight to moto (set-up, not a measurement, as tests/netns_tier.py uploads): `root`'s
# files under `prefix/` in `bucket` (made if missing).
_UPLOAD = """
import sys
from pathlib import Path
import boto3
root, bucket, prefix, endpoint = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
s3 = boto3.client("s3", endpoint_url=endpoint)
if bucket not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
    s3.create_bucket(Bucket=bucket)
for path in sorted(p for p in root.rglob("*") if p.is_file()):
    s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(root).as_posix()}", Body=path.read_bytes())
"""

# Inside the namespace, a fresh process: the library's own S3 loop, two epochs of one dataset.
_PEER = """
import json, os, sys, time
import numpy as np
mode, path, url, local, sizes = sys.argv[1:6]
sizes = np.load(sizes)
from loadopt.config import load_config
from loadopt.loaders.peers.base import CropSample, cropped
from loadopt.loaders.peers.batches import collate
config = load_config(path)
batch_size = config.pipeline.batch_size
crop = CropSample(config.pipeline, config.seed, 0, "auto")  # the local peer backends' pipeline, decoder `auto`
if mode == "litdata":  # its boto3 client takes the endpoint from AWS_ENDPOINT_URL; its chunk GETs go through obstore
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader
    # obstore (a LitData requirement) is given boto3's endpoint but client options without `allow_http`
    # (downloader.py: _OBSTORE_CLIENT_OPTIONS, _build_obstore_s3_store), so it refuses the tier's http:// endpoint
    # (reqwest BadScheme; AWS_ALLOW_HTTP does not count beside explicit client options): the one option added
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}
    start = time.perf_counter()
    dataset = cropped(StreamingDataset, "CroppedLitDataset")(crop, input_dir=url, cache_dir=local, shuffle=True,
                                                              seed=config.seed)
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=2, collate_fn=collate)
else:  # boto3's client: the endpoint from S3_ENDPOINT_URL
    from streaming import StreamingDataLoader, StreamingDataset
    start = time.perf_counter()
    dataset = cropped(StreamingDataset, "CroppedStreamingDataset")(crop, remote=url, local=local, shuffle=True,
                                                                    shuffle_seed=config.seed, batch_size=batch_size)
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=2, collate_fn=collate)
out = {"epochs": []}
for epoch in range(2):
    crop.epoch = epoch  # the workers (not persistent) take the dataset, and its crop plan, at each epoch
    began, first, samples, nbytes = time.perf_counter(), None, 0, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - (start if epoch == 0 else began)
        samples += len(batch["indices"]) + len(batch["failures"])
        nbytes += int(sizes[batch["indices"].numpy()].sum())
    seconds = time.perf_counter() - began
    out["epochs"].append({"first_batch_s": first, "seconds": seconds, "samples": samples,
                          "mb_per_s": nbytes / seconds / 1e6, "from_start_s": time.perf_counter() - start})
out["cache_bytes"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(local) for f in files)
print(json.dumps(out))
"""


def why_failed(done: subprocess.CompletedProcess) -> str:
    """A failed run's reason: its last exception line (a library may print a debug dump after it), else its
    last line."""
    lines = (done.stderr or done.stdout or "").strip().splitlines()
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", line)]
    return (errors or lines or [f"exit status {done.returncode}"])[-1][:300]


def prepare_s3_peers(tier, folder: Path, config_path: Path, root: Path, env: dict[str, str]) -> dict[str, str]:
    """Convert the tars at `root` with each S3 peer's backend (in a fresh process each, a cache of their own)
    and upload each conversion to the tier's bucket under the peer's name: {peer: its s3:// URL} of the peers
    that can run; a line saying why for each that cannot."""
    from tests.netns_tier import MOTO_PORT

    ready = {}
    for peer in S3_PEERS:
        sizes = folder / f"sizes-{peer}.npy"
        convert_env = {**env, "LOADOPT_CACHE": str(folder / f"convert-{peer}")}
        done = subprocess.run([python_for(peer), "-c", _CONVERT, peer, str(config_path), str(root),
                               str(REPO / "benchmarks"), str(sizes)], capture_output=True, text=True, env=convert_env,
                              cwd=REPO)
        if done.returncode:
            failed = "" if done.returncode == 3 else "its conversion failed: "  # 3: the library does not import
            print(f"{peer}: not run: {failed}{why_failed(done)}")
            continue
        converted = json.loads(done.stdout.strip().splitlines()[-1])
        upload = tier.run([sys.executable, "-c", _UPLOAD, converted["path"], tier.bucket, peer,
                           f"http://127.0.0.1:{MOTO_PORT}"], capture_output=True, text=True, env=env)
        shutil.rmtree(convert_env["LOADOPT_CACHE"], ignore_errors=True)  # in the bucket now
        if upload.returncode:
            print(f"{peer}: not run: uploading its conversion failed: {why_failed(upload)}")
            continue
        ready[peer] = f"s3://{tier.bucket}/{peer}"
    return ready


def upload_tars(tier, root: Path, env: dict[str, str]) -> str | None:
    """The photo tars (`root`'s files) into the tier's bucket under `root`'s name: their s3:// URL, or None
    (and a line saying why) when the upload failed."""
    from tests.netns_tier import MOTO_PORT

    done = tier.run([sys.executable, "-c", _UPLOAD, str(root), tier.bucket, root.name,
                     f"http://127.0.0.1:{MOTO_PORT}"], capture_output=True, text=True, env=env)
    if done.returncode:
        print(f"loadopt_s3: not run: uploading the tars failed: {why_failed(done)}")
        return None
    return f"s3://{tier.bucket}/{root.name}"


def run_s3_peer(tier, peer: str, url: str, folder: Path, config_path: Path, local: Path,
                env: dict[str, str]) -> subprocess.CompletedProcess:
    """One run of `peer`'s own S3 loop in a fresh process inside the namespace, its cache in `local` (fresh)."""
    env = {**env, "S3_ENDPOINT_URL": tier.s3_endpoint}  # Streaming's boto3 client takes its endpoint from here
    return tier.run([python_for(peer), "-c", _PEER, peer, str(config_path), url, str(local),
                     str(folder / f"sizes-{peer}.npy")], capture_output=True, text=True, env=env, cwd=REPO)


def wire_bytes(tier) -> int | None:
    """Bytes the tier's proxies have sent readers so far (tc's count of the shaped answer class, 1:1: HTTP and S3
    answers alike, headers included), or None where tc does not say."""
    done = subprocess.run(tier.command(["tc", "-s", "class", "show", "dev", "lo"]), capture_output=True, text=True)
    found = re.search(r"class htb 1:1 .*?Sent (\d+) bytes", done.stdout, re.S)
    return int(found.group(1)) if found else None
