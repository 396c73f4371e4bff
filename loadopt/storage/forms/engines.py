"""Who writes a conversion's planned shards (`ShardJob`s): this machine's cores, a forked process per core
writing whole shards (`local`, the default; a single shard is written with its samples decoded by the pool
instead), or a Ray cluster, one task per shard on one core each (`ray`). The source's digest is read the same
way, in parts. Both call the same shard-writing function of the form, so the shards, their entries and their
checksums are the same whichever engine wrote them; shards finished by an earlier, stopped run are kept either way."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadopt.storage.forms import decode_pool, integrity, shard_work
from loadopt.storage.forms.engine import ConvertEngine, ReuseShard, WriteShard
from loadopt.storage.forms.shard_work import ShardJob


@contextlib.contextmanager
def running(engine: ConvertEngine) -> Iterator[None]:
    """The engine ready for one conversion: Ray joined or started here (and stopped after, when started here)."""
    if engine.name != "ray":
        yield
        return
    from loadopt.storage.forms import ray_engine

    with ray_engine.connected(engine):
        yield


def source_digest(dataset: Any, engine: ConvertEngine, workers: int = 1) -> str:
    """integrity.source_digest of `dataset`, read in parts by `workers` forked processes or by the engine's Ray
    tasks: the same digest."""
    if engine.name == "ray":
        from loadopt.storage.forms import ray_engine

        return ray_engine.source_digest(dataset)
    if workers <= 1 or len(dataset) < 4 * workers or not decode_pool.fork_safe():
        return integrity.source_digest(dataset)
    bounds = np.linspace(0, len(dataset), 4 * workers + 1).astype(np.int64).tolist()
    with _forked(workers, dataset=dataset) as pool:
        crcs = pool.map(_crcs_forked, list(zip(bounds, bounds[1:], strict=False)))
    return integrity.digest_of(np.concatenate(crcs))


def write_shards(work: Path, jobs: list[ShardJob], intact: Callable[[int, Any], bool], write: WriteShard,
                 reuse: ReuseShard, engine: ConvertEngine, workers: int,
                 progress: Callable[[int, int], None] | None = None,
                 receive: Callable[[Path, Any], Any] | None = None) -> list[Any]:
    """Every planned shard's entry, in order: those finished in `work` by an earlier run kept, reused ones
    linked here, the others written by `engine` (`workers` decode processes a shard, locally). `receive(work,
    what write returned)`: the shard's entry where the writers write elsewhere than `work` (a remote home), so
    `work` need not be seen by them; None: they write in `work`."""
    keep = receive if receive is not None else (lambda _, entry: entry)
    done = shard_work.finished_shards(work, jobs, intact)
    for job in jobs:  # an earlier conversion's shard: a link and a rewritten index, no decoding
        if job.reused is not None and job.k not in done:
            done[job.k] = reuse(work, job)
    todo = [job for job in jobs if job.k not in done]
    total = jobs[-1].stop if jobs else 0
    finished = total - sum(job.stop - job.start for job in todo)
    if engine.name == "ray":
        from loadopt.storage.forms import ray_engine

        written = ray_engine.write_shards(work, todo, write, engine, finished, total, progress,
                                          shared_work=receive is None)
        done.update({k: keep(work, result) for k, result in written.items()})
    elif len(todo) > 1 and workers > 1 and decode_pool.fork_safe():  # a process a shard: only its own writing is serial
        with _forked(min(workers, len(todo)), write=write, work=work) as pool:
            for result in pool.imap_unordered(_write_forked, todo):
                entry = keep(work, result)
                done[entry["shard"]] = entry
                finished += entry["samples"]
                if progress is not None:
                    progress(finished, total)
    else:  # one shard (or one core): its samples decoded by `workers` processes
        for job in todo:
            report = None if progress is None else (lambda n, base=finished: progress(base + n, total))
            done[job.k] = keep(work, write(work, job, workers, report))
            finished += job.stop - job.start
    return [done[job.k] for job in jobs]


_FORKED: dict[str, Any] = {}  # what the forked writers inherit (never pickled: the dataset is large)


@contextlib.contextmanager
def _forked(workers: int, **inherited: Any) -> Iterator[Any]:
    """A pool of `workers` (> 1) forked processes that inherit `inherited`: closed once its work is done (its
    workers exit on their own), terminated on an error or Ctrl-C."""
    _FORKED.update(inherited)
    pool = decode_pool.start(workers)
    assert pool is not None, "forked pools are for more than one worker"
    try:
        yield pool
    except BaseException:
        decode_pool.stop(pool)
        raise
    finally:
        _FORKED.clear()
    decode_pool.finish(pool)


def _write_forked(job: ShardJob) -> Any:
    return _FORKED["write"](_FORKED["work"], job, 1, None)


def _crcs_forked(part: tuple[int, int]) -> np.ndarray:
    return integrity.sample_crcs(_FORKED["dataset"], part[0], part[1], threads=4)
