"""Every GPU test and GPU benchmark in one run, ending with one table: for a lent GPU machine.

1. `pytest -m gpu` (the CUDA paths: pinned transfers timed with events, the busy-kernel accelerator,
   the tuned ring pinned with cudaHostRegister, the harness's device idle time, measure's events).
2. Ceilings on this machine: pinned and pageable host-to-device bandwidth (256 MiB, CUDA events).
3. Each backend through the harness on the GPU (short runs of the default config, step 25 ms and 0),
   DALI with mixed (GPU) decode on the ImageFolder and on the Arrow encoded file, and its CPU pipeline.
4. kvikio (cuFile into GPU memory) against posix + copy on decoded and encoded raw shards, warm and
   cold (page cache evicted; posix with O_DIRECT), with the storage bandwidth each reached.

Exits 0 when every check passed, 1 when there is no CUDA device, 2 when any check failed: the GPU tests
(pytest's exit not 0) or a benchmark that raised (a backend refusing with `BackendUnavailable`, e.g. a
missing GPU JPEG decoder, is reported as unavailable with its reason, not failed) or DALI's mixed decode
copying bytes host-to-device. The failed rows are listed after the table. Meant to finish in a few
minutes on one GPU: `python benchmarks/gpu_check.py [--batches 60]`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from _common import REPO, build_loader, harness_run


def harness(config, backend: str, step_ms: float, batches: int, cold: bool = False, **settings) -> dict:
    from loadopt.storage.tiers.pagecache import evict

    loader = build_loader(config, backend, **settings)
    if cold:  # what this loader reads (the raw shards, the Arrow file, the JPEGs) out of the page cache
        loader.prepare()
        evict(loader.storage_files())
    result = harness_run(loader, batches, warmup=5, step_ms=step_ms, emulate=False)
    # Bytes the harness copied host-to-device: 0 for batches a backend delivers on the device (DALI mixed).
    return {**result.metrics, "h2d_bytes": sum(p.h2d_bytes for p in result.probes if p.measured)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=60)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("unavailable: torch.cuda.is_available() is False on this machine; nothing to check")
        return 1
    from loadopt.bench.attribution.ceilings import copy_to_device_bandwidth
    from loadopt.errors import BackendUnavailable

    rows: list[tuple[str, str]] = [("GPU", torch.cuda.get_device_name(0))]
    failed: list[str] = []  # the rows that failed: any one makes the exit non-zero
    start = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
                           cwd=REPO, capture_output=True, text=True)
    summary = (tests.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(tests.stdout[-4000:])
    rows.append(("pytest -m gpu", f"{summary} (exit {tests.returncode}, {time.perf_counter() - start:.0f} s)"))
    if tests.returncode != 0:  # a failed test, or none collected (5): either way the GPU paths were not shown
        failed.append("pytest -m gpu")
    for pinned in (True, False):
        rate = copy_to_device_bandwidth(torch.device("cuda"), pinned)
        rows.append((f"h2d {'pinned' if pinned else 'pageable'}", f"{rate / 1e9:.1f} GB/s"))

    from loadopt.config import load_config

    config = load_config(REPO / "configs" / "imagenet.yaml", ["workload.device=cuda"])
    for label, backend, settings in (("torch plain w=4", "torch", {"variant": "plain", "num_workers": 4}),
                                     ("torch tuned w=4", "torch", {"variant": "tuned", "num_workers": 4}),
                                     ("arrow decoded", "arrow", {"form": "decoded"}),
                                     ("arrow encoded", "arrow", {"form": "encoded", "threads": 4}),
                                     # DALI's mixed decode (nvImageCodec, the HW JPEG decoder where there is
                                     # one): batches delivered on the GPU, so h2d must read 0 bytes.
                                     ("dali mixed images", "dali", {"decoder": "mixed", "num_threads": 4}),
                                     ("dali mixed arrow", "dali", {"decoder": "mixed", "num_threads": 4,
                                                                   "source": "arrow"}),
                                     ("dali cpu t=8", "dali", {"decoder": "cpu", "num_threads": 8})):
        for step_ms in (25.0, 0.0):
            try:
                m = harness(config, backend, step_ms, args.batches, **settings)
                value = (f"{m['samples_per_s']:,.0f} samples/s, stall {m['stall_fraction']:.1%}, "
                         f"device idle {m.get('device_idle_fraction') or 0:.1%}, h2d {m['h2d_gb_per_s'] or 0:.1f} GB/s "
                         f"({'pinned' if m['h2d_pinned'] else 'pageable'})"
                         + (f", h2d bytes {m.get('h2d_bytes', 0):,}" if backend == "dali" else ""))
                if settings.get("decoder") == "mixed" and m.get("h2d_bytes", 0):
                    value = f"failed: mixed decode delivers on the GPU, yet the harness copied: {value}"
            except BackendUnavailable as exc:
                value = f"unavailable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
                value = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rows.append((f"{label}, step {step_ms:g} ms", value))
            if value.startswith("failed"):
                failed.append(rows[-1][0])
    # GPUDirect Storage against the classic path: kvikio (cuFile into GPU memory; true GDS or compat mode
    # in its label) and posix (preadv into pinned host memory, then the copy), raw shards, warm and cold,
    # step 0: the storage bandwidth each reached and its h2d traffic.
    for form in ("decoded", "encoded"):
        for backend in ("posix", "kvikio"):
            for cold in (False, True):
                label = f"{backend} {form} {'cold' if cold else 'warm'}, step 0"
                settings = {"form": form, "o_direct": cold} if backend == "posix" else {"form": form}
                try:
                    m = harness(config, backend, 0.0, args.batches, cold=cold, **settings)
                    value = (f"{m['samples_per_s']:,.0f} samples/s, storage {m['bytes_read'] / m['wall_s'] / 1e9:.2f} "
                             f"GB/s, h2d bytes {m.get('h2d_bytes', 0):,}")
                except BackendUnavailable as exc:  # e.g. kvikio's encoded form without a GPU JPEG decoder
                    value = f"unavailable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
                    value = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                rows.append((label, value))
                if value.startswith("failed"):
                    failed.append(label)
    width = max(len(name) for name, _ in rows)
    print("\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    if failed:
        print(f"\ngpu_check: {len(failed)} failed: " + "; ".join(failed))
        return 2
    print("\ngpu_check: every check passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
