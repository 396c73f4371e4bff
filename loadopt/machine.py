"""What machine this is: its cores, CPU, memory, GPU and library versions, and the fingerprint that says
when two machines are comparable for a decision.

A leaf beside `loadopt.files`: torch is imported only when the machine is described (for the GPU), so
the command line's help stays light.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pydantic import ConfigDict, with_config
from typing_extensions import TypedDict

__all__ = ["LIBRARIES", "GpuInfo", "MachineInfo", "library_versions", "machine_fingerprint", "machine_info",
           "usable_cores"]
LIBRARIES = ("loadopt", "torch", "numpy", "pyarrow", "fsspec", "pillow", "simplejpeg", "nvidia-dali-cuda120",
             "nvidia-dali-cuda130", "kvikio-cu12", "kvikio-cu13", "torchvision")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    if versions["loadopt"] is None:  # run from a source tree on PYTHONPATH, not installed
        from loadopt.version import __version__

        versions["loadopt"] = __version__
    return versions


class GpuInfo(TypedDict):
    """The first CUDA device (and how many there are)."""

    name: str
    count: int
    memory_gb: float
    cuda: str | None  # the CUDA version torch was built with


@with_config(ConfigDict(extra="allow"))  # read back from files: older or hand-written ones may differ
class LoadAverage(TypedDict, total=False):
    """The 1-minute load average over the bench's samples."""

    mean: float
    max: float


@with_config(ConfigDict(extra="allow"))  # read back from files: older or hand-written ones may differ
class CpuShare(TypedDict, total=False):
    """The share of all cores other processes used: over the whole bench, and the most in one interval."""

    mean: float | None  # None: the machine's CPU time could not be read
    max: float | None


@with_config(ConfigDict(extra="allow"))  # read back from files: older or hand-written ones may differ
class LoadSummary(TypedDict, total=False):
    """The machine's load over a bench: results.json's `machine.load`."""

    cores: int
    samples: int
    interval_s: float
    load_average_1m: LoadAverage | None  # None: never sampled
    others_cpu_share: CpuShare
    busy: bool  # others used BUSY_SHARE of the cores or more
    note: str | None  # load_note's sentence when busy


@with_config(ConfigDict(extra="allow"))  # results.json adds the bench's `load`; older files lack keys
class MachineInfo(TypedDict, total=False):
    """This machine as results.json's and decision.json's `machine` records it."""

    hostname: str
    platform: str
    python: str
    cpu_model: str
    cpu_count: int  # the usable cores (the affinity mask)
    ram_gb: float
    gpu: GpuInfo | None
    libraries: dict[str, str | None]  # version of each of LIBRARIES; None where it is not installed
    load: LoadSummary | None  # a bench's results only: the machine's load over the bench (`MachineLoad`)


def machine_info() -> MachineInfo:
    import psutil
    import torch

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = GpuInfo(name=props.name, count=torch.cuda.device_count(), memory_gb=props.total_memory / 2**30,
                      cuda=torch.version.cuda)
    return MachineInfo(
        hostname=platform.node(),
        platform=platform.platform(),
        python=platform.python_version(),
        cpu_model=_cpu_model(),
        cpu_count=usable_cores(),
        ram_gb=round(psutil.virtual_memory().total / 2**30, 1),
        gpu=gpu,
        libraries=library_versions(),
    )


def machine_fingerprint(machine: MachineInfo) -> str:
    """What makes two machines comparable for a decision: CPU, cores, RAM, GPU."""
    gpu = machine["gpu"]
    key = json.dumps([machine["cpu_model"], machine["cpu_count"], round(machine["ram_gb"]),
                      gpu["name"] if gpu else None, gpu["count"] if gpu else None])
    return hashlib.sha256(key.encode()).hexdigest()[:16]
