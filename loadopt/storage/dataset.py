"""The one protocol every dataset answers (an ImageFolder, token windows, record files; tar shards and
Parquet next), so backends, conversions and the harness read any of them through the same questions and a
new source needs no change in any of them."""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import fsspec
import numpy as np


class Dataset(Protocol):
    """A split's samples: how many, their labels and stored sizes, where they live and how to name one."""

    kind: ClassVar[str]  # images | tokens | records: what `recipe` and the backends' `supports` tell apart
    source_format: ClassVar[str]  # imagefolder | webdataset | parquet | tokens | records: as the files hold it
    root: str  # the split's folder or file, as a path or URL
    fingerprint: str  # changes whenever the samples do (names, sizes, modification times, or generator)
    synthetic: bool
    classes: list[str]
    labels: np.ndarray  # int64, one per sample (zeros where samples have no class)
    sizes: np.ndarray  # int64, each sample's stored bytes
    converted: str | None  # where its conversions live when not in the local cache (`conversion_home`)
    left_out: list[str]  # samples its indexing left out (dataset.on_error: skip), each named

    @property
    def fs(self) -> fsspec.AbstractFileSystem | None:
        """The filesystem the samples are read through (None: a local memory map, no filesystem)."""
        ...

    def __len__(self) -> int: ...

    def read(self, index: int) -> bytes:
        """The stored bytes of sample `index`."""
        ...

    def path(self, index: int) -> str:
        """Sample `index` named for a message: its file, and where in it."""
        ...

    def is_local(self) -> bool:
        """Whether the samples are read straight from a local disk."""
        ...

    def local_files(self) -> list[str]:
        """Every file of the samples on a local disk, else empty (whoever reads them directly would bypass
        a tier's limits)."""
        ...


@runtime_checkable
class SampleFields(Protocol):
    """A dataset whose samples carry fields besides the image and label (a caption, a JSON target, a dict item's
    other keys), read in the consumer by index: every backend's batch gets them, whatever form it read."""

    def field_names(self, partial: bool = False) -> list[str]:
        """The fields every sample has (those `pipeline.fields: null` carries); `partial`: also those only some
        have."""
        ...

    def fields(self, indices: np.ndarray, names: list[str]) -> dict[str, list]:
        """Fields `names` of samples `indices`, in their order: one Python value per sample."""
        ...

    def missing_fields(self, names: list[str]) -> dict[int, str]:
        """The samples without one of fields `names`, index -> which (they fail, or are skipped and counted)."""
        ...
