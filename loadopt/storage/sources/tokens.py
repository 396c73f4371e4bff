"""Token corpora for LLM pre-training workloads: a flat array of token ids, memory-mapped.

Sample i is the window of `seq_len + 1` tokens starting at token `i * seq_len` (inputs and targets
shifted by one), so windows tile the corpus and the shared sampler shuffles their order. The
synthetic corpus is generated once into the cache (seeded), written under a temporary name and
renamed when complete, like the synthetic images.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from loadopt.config_models import TokenSpec
from loadopt.errors import DatasetError
from loadopt.files import cache_dir, honour_umask
from loadopt.storage.sources.request import SourceRequest

GENERATOR_VERSION = 1
CHUNK_TOKENS = 4_000_000


@dataclass
class TokenDataset:
    """The windows of a token file; the same interface the loaders use for image datasets."""

    root: str  # the token file
    tokens: np.ndarray  # memory-mapped, uint16 or uint32
    seq_len: int
    fingerprint: str
    synthetic: bool = False
    classes: list[str] = field(default_factory=list)
    # No filesystem to read through (nor a storage tier): the corpus is a local memory map.
    fs: None = None
    converted: str | None = None  # a corpus is local: its conversions live in the local cache
    left_out: list[str] = field(default_factory=list)  # samples indexing left out (on_error: skip), named
    kind: ClassVar[str] = "tokens"  # what `recipe` and the backends' `supports` tell datasets apart by
    source_format: ClassVar[str] = "tokens"

    def __post_init__(self) -> None:
        count = max(0, (len(self.tokens) - 1) // self.seq_len)
        self.sizes = np.full(count, (self.seq_len + 1) * self.tokens.itemsize, dtype=np.int64)
        self.labels = np.zeros(count, dtype=np.int64)  # windows have no class; kept for the protocol

    def __len__(self) -> int:
        return len(self.sizes)

    def path(self, index: int) -> str:
        return f"{self.root} (window {index}, tokens {index * self.seq_len}-{index * self.seq_len + self.seq_len})"

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def windows(self) -> np.ndarray:
        """All windows as one strided view (n, seq_len + 1), overlapping by one token: no copy."""
        return np.lib.stride_tricks.as_strided(self.tokens, shape=(len(self), self.seq_len + 1),
                                               strides=(self.seq_len * self.tokens.itemsize, self.tokens.itemsize),
                                               writeable=False)

    def read(self, index: int) -> bytes:
        return self.window(index).tobytes()

    def is_local(self) -> bool:
        return True

    def local_files(self) -> list[str]:
        return [self.root]


def _key(spec: TokenSpec) -> str:
    text = json.dumps({"version": GENERATOR_VERSION, "spec": spec.model_dump()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def ensure_tokens(spec: TokenSpec, cache_dir: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """The synthetic corpus file for `spec`, generated (chunk by chunk, seeded) if missing."""
    folder = cache_dir / "datasets"
    final = folder / f"tokens-{_key(spec)}.bin"
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder)
    try:
        honour_umask(tmp)  # a shared cache: readable as a plain open's file is, not mkstemp's 0600
        with os.fdopen(fd, "wb") as out:
            done = 0
            while done < spec.num_tokens:
                count = min(CHUNK_TOKENS, spec.num_tokens - done)
                # Zipf-like ids (frequent tokens are small numbers), as a tokenised text corpus has.
                rng = np.random.Generator(np.random.PCG64([spec.seed, done]))
                ids = (rng.zipf(1.3, count) - 1) % spec.vocab_size
                out.write(ids.astype(spec.dtype).tobytes())
                done += count
                if progress is not None:
                    progress(done, spec.num_tokens)
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def open_tokens(path: str | Path, spec: TokenSpec, seq_len: int, synthetic: bool = False) -> TokenDataset:
    """Memory-map a flat token file; its size must be a whole number of `spec.dtype` ids."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DatasetError(f"{path}: token file not found") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the token file ({exc.strerror or exc})") from None
    itemsize = np.dtype(spec.dtype).itemsize
    if size % itemsize:
        raise DatasetError(f"{path}: {size} bytes is not a whole number of {spec.dtype} token ids "
                           f"(dataset.tokens.vocab_size {spec.vocab_size} implies {spec.dtype})")
    if size // itemsize < seq_len + 1:
        raise DatasetError(f"{path}: {size // itemsize} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")
    tokens = np.memmap(path, dtype=spec.dtype, mode="r")
    stat = path.stat()
    fingerprint = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{seq_len}".encode())
    return TokenDataset(str(path), tokens, seq_len, fingerprint.hexdigest()[:16], synthetic=synthetic)


def open_source(request: SourceRequest) -> TokenDataset:
    """The token file at `dataset.path` (memory-mapped, on the local disk), or the synthetic corpus the config
    describes, generated on first use."""
    config, progress = request.config, request.progress
    spec, seq_len = config.dataset.tokens, config.pipeline.seq_len
    if config.dataset.path is not None:
        path = os.path.expanduser(config.dataset.path)
        if "://" in path and not path.startswith("file://"):
            raise DatasetError(f"{path}: token files are memory-mapped and must be on a local file system")
        return open_tokens(path.removeprefix("file://"), spec, seq_len)
    try:
        corpus = ensure_tokens(spec, cache_dir(), progress=progress)
    except OSError as exc:
        raise DatasetError(f"{cache_dir()}: cannot write the synthetic token corpus into the cache ({exc}); "
                           "set LOADOPT_CACHE to a writable folder") from None
    return open_tokens(corpus, spec, seq_len, synthetic=True)
