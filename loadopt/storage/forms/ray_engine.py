"""A conversion's planned shards written on a Ray cluster (`loadopt convert --engine ray`, the `ray` extra).

Plain Ray tasks, one per output shard, not Ray Data: the plan (`plan_shards`) already cut the conversion
into shards of whole source shards, and each shard must come out as loadopt writes it locally (its
record batches or aligned samples, its checksums taken while writing, read back, renamed, its entry last), which
Ray Data's block repartitioning and its own writers would not keep. A task is then also the unit Ray retries: a
worker or node lost mid-shard leaves only a temporary file, and the retry writes the shard again.

The driver (this
process) keeps the lock, links reused shards, and writes the manifest once every task is done and the folder
checked (shard_work.build). The source's digest that a conversion records (`source_digest`) is read by tasks too, a
part each: read by the driver alone it was a third of a 2-CPU conversion's time. The conversion's folder must be a
path every node sees (a task that cannot see it says so, naming its node), except for a raw conversion whose home is
remote storage (`storage.converted: s3://...`): each task then uploads its shard's data there and returns the
shard's index to the driver."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadopt.errors import ConfigError, DatasetError, LoadoptError
from loadopt.storage.forms import decode_pool, integrity, shard_work
from loadopt.storage.forms.engine import ConvertEngine, WriteShard
from loadopt.storage.forms.shard_work import ShardJob

REACH_TIMEOUT_S = 10.0  # --address: a cluster's head that does not accept a connection in this long is not there
RETRIES = 3  # a task whose worker or node died is run again this many times (Ray's own retry)


def write_shards(work: Path, jobs: list[ShardJob], write: WriteShard, engine: ConvertEngine, finished: int,
                 total: int, progress: Callable[[int, int], None] | None, shared_work: bool = True) -> dict[int, Any]:
    """Each of `jobs` written by a Ray task of one CPU; what each returned, by shard. A task's error is raised here
    as it was raised there (a damaged sample names itself). At most `in_flight` tasks are submitted at a time, so
    that an error or Ctrl-C leaves only those under way: `connected` ends them as it leaves Ray, and where the
    caller had connected Ray itself they finish their shards, which a resumed conversion keeps (none is cancelled:
    see `in_flight`). `shared_work`: the tasks write in `work`, which every node must see (else they write
    elsewhere: a remote home)."""
    ray = _ray()
    task = ray.remote(num_cpus=1, max_retries=RETRIES)(write_shard_task)
    writer = ray.put(write)  # the dataset and settings, shipped once
    waiting = list(reversed(jobs))  # popped from the end: submitted in the plan's order
    pending: dict[Any, ShardJob] = {}
    done: dict[int, Any] = {}
    while waiting or pending:
        room = in_flight(ray) - len(pending)
        while waiting and room > 0:
            job = waiting.pop()
            pending[task.remote(writer, str(work) if shared_work else None, job)] = job
            room -= 1
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            job = pending.pop(ref)
            done[job.k] = _result(ray, ref, job)
            finished += job.stop - job.start
            if progress is not None:
                progress(finished, total)
    return done


def in_flight(ray: Any) -> int:
    """How many tasks are submitted at a time: twice the cluster's CPUs, so that no CPU waits for the driver's
    next submission. Bounded because Ray 2.60's driver can abort the whole process ("Tried to complete task that
    was not pending") when it cancels a task that is just completing, with force or without: an error therefore
    cancels nothing, and what is under way is only this many shards."""
    return max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))


def source_digest(dataset: Any) -> str:
    """integrity.source_digest of `dataset`, its samples' CRC-32s read by Ray tasks (a part each, a few per
    CPU of the cluster) instead of by this process alone: the same digest."""
    ray = _ray()
    parts = max(1, min(len(dataset), 4 * int(ray.cluster_resources().get("CPU", 1))))
    bounds = np.linspace(0, len(dataset), parts + 1).astype(np.int64).tolist()
    task = ray.remote(num_cpus=1, max_retries=RETRIES)(integrity.sample_crcs)
    shipped = ray.put(dataset)
    refs = [task.remote(shipped, a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return integrity.digest_of(np.concatenate([_result(ray, ref, None) for ref in refs]))


@contextlib.contextmanager
def connected(engine: ConvertEngine) -> Iterator[None]:
    """Ray joined (or started here) for one conversion, and shut down after it when this started it."""
    _reachable(engine)  # before Ray is imported: an address where nothing answers costs nothing more
    ray = _ray()
    started = _connect(ray, engine)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def write_shard_task(write: WriteShard, work: str | None, job: ShardJob) -> Any:
    """On a Ray worker: shard `job`, in the conversion's work folder (which every node must see), or (`work` None)
    where `write` puts it (the conversions' remote home)."""
    if work is None:
        return write(None, job, 1, None)  # type: ignore[arg-type]  # a remote writer keeps no work folder here
    folder = Path(work)
    if not (folder / shard_work.RUN).is_file():
        raise DatasetError(f"{work}: the conversion's folder is not there on Ray node {socket.gethostname()}: "
                           "--engine ray writes to a path every node sees (storage.converted or $LOADOPT_CACHE on "
                           "shared storage)")
    return write(folder, job, 1, None)


def _result(ray: Any, ref: Any, job: ShardJob | None) -> Any:
    what = f"shard {job.k} (samples {job.start}-{job.stop - 1})" if job else "reading the source's checksums"
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # raised by the task: loadopt's own errors are one line as they were
        cause = exc.cause
        if isinstance(cause, LoadoptError | OSError | KeyboardInterrupt):
            raise cause from None
        raise DatasetError(f"{what} failed on Ray: "
                           f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}") from None
    except ray.exceptions.RayError as exc:  # its worker or node lost more often than Ray retries
        raise DatasetError(f"{what}: Ray lost its task {RETRIES + 1} "
                           f"times ({type(exc).__name__}); run the conversion again to finish the rest") from None


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray needs Ray: pip install 'loadopt[ray]'") from None
    return ray


def _reachable(engine: ConvertEngine) -> None:
    """One line when nothing accepts a connection at `engine.address` (host:port): Ray itself retries such an
    address for many minutes."""
    if engine.address and "://" not in engine.address and ":" in engine.address:
        host, port = engine.address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--address {engine.address}: no Ray cluster answers there ({exc})") from None


def _connect(ray: Any, engine: ConvertEngine) -> bool:
    """Join the cluster at `engine.address`, or start Ray on this machine; True when this call started or joined
    it (and so shuts it down), False when the caller's process was already connected."""
    if ray.is_initialized():
        return False
    where = f"--address {engine.address}" if engine.address else "a Ray on this machine"
    main_thread = threading.current_thread() is threading.main_thread()
    on_sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        # "local": a Ray of its own here, never a cluster that `ray start` left running on this machine
        ray.init(address=engine.address or "local", num_cpus=None if engine.address else engine.num_cpus,
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False,
                 configure_logging=True)
    except Exception as exc:  # noqa: BLE001 - whatever stops Ray from starting or joining (an address, a token)
        raise ConfigError(f"{where}: cannot start or join Ray ({str(exc).splitlines()[0]})") from None
    finally:
        # Ray's init takes SIGTERM: its handler exits with code 15 and, under it, abseil's prints a stack dump and
        # aborts the process 3 s later. The caller's handler (the CLI's: a clean stop, exit 143) is put back.
        if on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)
    decode_pool.ray_used()
    return True
