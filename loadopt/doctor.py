"""`loadopt doctor`: what this machine offers each input path, and why an item is unusable."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, requires, version

import psutil


@dataclass
class Check:
    item: str
    ok: bool | None  # None: information only
    detail: str


def _torch_checks() -> list[Check]:
    import torch

    checks = [Check("torch", True, f"{torch.__version__} (built with CUDA {torch.version.cuda or 'none'})")]
    if not torch.cuda.is_available():
        reason = "no CUDA device or driver" if torch.version.cuda else "this torch build has no CUDA"
        checks.append(Check("CUDA", False, f"unavailable: {reason}"))
        return checks
    props = torch.cuda.get_device_properties(0)
    driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
    checks.append(Check("CUDA", True, f"{torch.cuda.device_count()} x {props.name}, "
                                      f"{props.total_memory / 2**30:.0f} GiB, driver API {driver}"))
    try:
        torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
        checks.append(Check("pinned memory", True, "1 MiB pinned allocation works"))
    except RuntimeError as exc:
        checks.append(Check("pinned memory", False, str(exc).splitlines()[0]))
    return checks


def _package(name: str, dist: str) -> Check:
    try:
        module = __import__(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a reason to show
        return Check(dist, False, f"not usable: {type(exc).__name__}: {exc}".splitlines()[0])
    try:
        found = version(dist)
    except PackageNotFoundError:
        found = getattr(module, "__version__", "installed")
    return Check(dist, True, found)


def _kvikio_checks() -> list[Check]:
    """kvikio itself and the CUDA driver its reads need; the GDS section says which mode cuFile is in."""
    checks = [_package("kvikio", _installed_dist(("kvikio-cu13", "kvikio-cu12"), "kvikio-cu12"))]
    if not checks[0].ok:
        checks[0].detail += " (pip install 'loadopt[gds]', or 'loadopt[gds-cu13]' for a CUDA 13 driver)"
        return checks
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        checks.append(Check("libcuda.so.1", False, "not found: kvikio imports, but every read needs the CUDA driver"))
        return checks
    checks.append(Check("libcuda.so.1", True, "loaded"))
    return checks


def _installed_dist(builds: tuple[str, ...], missing: str) -> str:
    """Which of one package's builds (one per CUDA version) is installed; `missing` when none is."""
    for dist in builds:
        try:
            version(dist)
            return dist
        except PackageNotFoundError:
            pass
    return missing


def peers_constraints() -> str:
    """The pip constraint file that keeps this machine's torch and numpy while the peer libraries install
    (Streaming and LitData pull torchvision, whose newest release wants a newer torch; Streaming caps numpy)."""
    import numpy
    import torch

    return f"torch=={torch.__version__}\nnumpy=={numpy.__version__}\n"


def peers_checks() -> list[Check]:
    """How to add `loadopt[peers]` without replacing this torch, and whether an installed torchvision fits it."""
    import torch

    checks = [Check("peers install", None, f"to keep torch {torch.__version__}: loadopt doctor --constraints > "
                                           "keep.txt; pip install 'loadopt[litdata]' -c keep.txt (or [webdataset], "
                                           "[streaming], [ffcv], [peers]; alone, pip may replace torch with a newer "
                                           "CUDA build: docs/backends.md, Installing the peer libraries)")]
    try:
        from packaging.requirements import Requirement  # not a loadopt dependency: without it, no fit check

        found = version("torchvision")
        needs = [Requirement(text) for text in requires("torchvision") or []]
    except (ImportError, PackageNotFoundError):
        return checks
    plain = torch.__version__.split("+", 1)[0]  # a local build (+cpu, +cu130) is its release for a requirement
    for need in needs:
        if need.name == "torch" and (need.marker is None or need.marker.evaluate({"extra": ""})) \
                and not need.specifier.contains(plain, prereleases=True):
            checks.append(Check("torchvision", False, f"{found} wants torch{need.specifier}, torch is "
                                f"{torch.__version__}: streaming and litdata may not import; reinstall them with "
                                "the constraint file above"))
            return checks
    checks.append(Check("torchvision", True, f"{found}, fits torch {torch.__version__}"))
    return checks


def _native_check() -> Check:
    try:
        from loadopt import _native
    except ImportError:
        return Check("native module", False, "not built (no C compiler at `pip install`): crops, posix reads and "
                                             "the emulated device's normalisation use slower NumPy/torch paths")
    simd = "SSSE3 mirror" if _native.SIMD else "no SIMD (not x86-64)"
    return Check("native module", True, f"built: streaming-store crops ({simd}), posix read-and-crop, normalise")


def _optional_native_checks() -> list[Check]:
    """The two other native modules: each optional, its fallback named."""
    import importlib

    checks = []
    for module, what, fallback in (
            ("loadopt._jpeg", "region JPEG decode", "not built (no libjpeg-turbo headers at `pip install`): JPEGs "
                                                    "are decoded whole, then cropped"),
            ("loadopt.storage._preads", "probe reads", "not built: `loadopt probe` times its reads in Python "
                                                        "(lower IOPS at many readers)")):
        try:
            importlib.import_module(module)
        except ImportError:
            checks.append(Check(what, False, fallback))
        else:
            checks.append(Check(what, True, f"built ({module})"))
    return checks


def run_checks() -> list[Check]:
    from loadopt.files import cache_dir
    from loadopt.imaging.decode import simplejpeg

    checks = [Check("python", None, f"{platform.python_version()} on {platform.platform()}")]
    checks += _torch_checks()
    checks.append(Check("JPEG decoder", True, "simplejpeg (libjpeg-turbo)" if simplejpeg is not None
                        else "PIL only (pip install simplejpeg for ~1.3x faster decode)"))
    checks.append(_native_check())
    checks += _optional_native_checks()
    dali = _package("nvidia.dali", _installed_dist(("nvidia-dali-cuda130", "nvidia-dali-cuda120"),
                                                  "nvidia-dali-cuda120"))
    if not dali.ok:
        dali.detail += " (pip install 'loadopt[dali]')"
    checks.append(dali)
    checks += _kvikio_checks()
    try:
        shm = shutil.disk_usage("/dev/shm")
        checks.append(Check("/dev/shm", shm.free > 1 << 30,
                            f"{shm.total / 2**30:.1f} GiB, {shm.free / 2**30:.1f} GiB free"
                            + ("" if shm.free > 1 << 30 else ": DataLoader workers may run out of shared memory")))
    except OSError as exc:
        checks.append(Check("/dev/shm", False, f"unavailable: {exc}"))
    from loadopt.loaders.registry import backend_class, backend_names
    from loadopt.machine import usable_cores

    for name in backend_names():
        available, reason = backend_class(name).available()
        checks.append(Check(f"backend {name}", available, "available" if available else reason))
    checks += peers_checks()
    cores = usable_cores()
    checks.append(Check("CPU cores", None, f"{cores} usable"))
    memory = psutil.virtual_memory()
    checks.append(Check("RAM", None, f"{memory.available / 2**30:.1f} GiB free of {memory.total / 2**30:.1f} GiB"))
    folder = cache_dir()
    writable = os.access(folder if folder.exists() else folder.parent if folder.parent.exists() else "/", os.W_OK)
    detail = f"{folder}" + ("" if writable else ": not writable; set LOADOPT_CACHE")
    checks.append(Check("cache folder", writable, detail))
    checks += _gds_checks(str(folder))
    return checks


# Filesystems cuFile reads in true GDS mode (NVIDIA's GDS support matrix); others fall back to compat mode.
_GDS_FILESYSTEMS = {"ext4", "xfs", "lustre", "gpfs", "wekafs", "beegfs", "nfs", "nfs4"}


def _mount_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of the longest mount point above `path`."""
    best = ("/", "unknown")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1]
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                    best = (point, fields[2])
    except OSError:
        pass
    return best


def _gds_checks(folder: str) -> list[Check]:
    """What GPUDirect Storage needs beyond kvikio: the cuFile library, the nvidia-fs kernel module,
    a readable /run/udev (cuFile enumerates devices there) and a filesystem it supports."""
    checks = []
    try:
        ctypes.CDLL("libcufile.so.0")
        checks.append(Check("libcufile", True, "loaded"))
    except OSError:
        checks.append(Check("libcufile", False, "libcufile.so.0 not found: no cuFile (kvikio uses its POSIX path)"))
    setting = os.environ.get("KVIKIO_COMPAT_MODE", "unset (AUTO)")
    try:
        from loadopt.loaders.kvikio.loader import cufile_mode

        true_gds, why = cufile_mode()
        checks.append(Check("GDS mode", true_gds, f"KVIKIO_COMPAT_MODE {setting}; in effect: {why}"))
    except Exception as exc:  # noqa: BLE001 - kvikio missing or broken: the setting alone
        checks.append(Check("GDS mode", None, f"KVIKIO_COMPAT_MODE {setting}; in effect: unknown "
                                              f"({type(exc).__name__}: {exc})".splitlines()[0]))
    from loadopt.loaders.kvikio.loader import nvidia_fs_loaded

    nvfs = nvidia_fs_loaded()
    checks.append(Check("nvidia-fs module", nvfs, "loaded" if nvfs else "not loaded: cuFile runs in compat mode"))
    udev = os.access("/run/udev", os.R_OK | os.X_OK)
    checks.append(Check("/run/udev", udev, "readable" if udev else "not readable (in a container, mount it "
                                                                     "read-only): cuFile cannot find devices"))
    point, fstype = _mount_of(os.path.realpath(folder))
    supported = fstype in _GDS_FILESYSTEMS
    checks.append(Check("dataset filesystem", supported, f"{fstype} at {point} under {folder}: "
                        + ("GDS supported" if supported else "not supported by GDS (compat mode)")))
    return checks
