"""Which engine writes a conversion's shards (`local` or `ray`), and the shard-writing function every engine
calls: the value a command's `--engine` options become."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from loadopt.errors import ConfigError
from loadopt.storage.forms.shard_work import ShardJob

ENGINES = ("local", "ray")
# (work folder, job, decode processes, samples written so far in the shard -> None) -> the shard's entry
WriteShard = Callable[[Path, ShardJob, int, Callable[[int], None] | None], Any]
ReuseShard = Callable[[Path, ShardJob], Any]


@dataclass(frozen=True)
class ConvertEngine:
    """Where a conversion's shards are written: `local`, or `ray` on the cluster at `address` (None: a Ray
    started on this machine with `num_cpus`, None for all of them)."""

    name: Literal["local", "ray"] = "local"
    address: str | None = None
    num_cpus: int | None = None

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise ConfigError(f"--engine {self.name}: unknown (known: {', '.join(ENGINES)})")
        if self.name == "local" and (self.address is not None or self.num_cpus is not None):
            raise ConfigError("--address and --num-cpus are for --engine ray")
        if self.address is not None and self.num_cpus is not None:
            raise ConfigError("--num-cpus is for a Ray started here: the cluster at --address has its own")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"--num-cpus {self.num_cpus}: at least 1")


LOCAL = ConvertEngine()
