"""Opening the dataset a config names: its source's opener, looked up by name, then the config's storage tier
and shard cache laid over what it reads."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import fsspec

from loadopt.config_models import Config
from loadopt.errors import ConfigError
from loadopt.storage.dataset import Dataset
from loadopt.storage.forms.placement import conversion_home
from loadopt.storage.remote import listing as remote_listing
from loadopt.storage.remote.access import is_local_fs, open_url, redact, storage_errors
from loadopt.storage.remote.listing import ListingKey
from loadopt.storage.sources.request import IndexThrough, SourceRequest
from loadopt.storage.tiers.spec import TierSpec, dataset_root, resolve_tier
from loadopt.storage.tiers.stack import cache_reads, tier_filesystem

# A source's name -> the module whose `open_source(request)` opens it. Imported on first use, as fsspec's
# `known_implementations` are: a config of one kind loads none of the other sources' libraries (pyarrow's
# Parquet reader, the tar indexer). A new source is a module with `open_source` and a line here.
OPENERS: dict[str, str] = {
    "imagefolder": "loadopt.storage.sources.imagefolder",
    "webdataset": "loadopt.storage.sources.webdataset",
    "parquet": "loadopt.storage.sources.parquet",
    "records": "loadopt.storage.sources.records",
    "tokens": "loadopt.storage.sources.tokens",
    "synthetic": "loadopt.storage.sources.synthetic",
    "factory": "loadopt.storage.sources.user",
    "huggingface": "loadopt.storage.sources.user",  # a `save_to_disk` folder, read as the dataset it holds
}
Opener = Callable[[SourceRequest], Dataset]
# Sources read through a dataset object (its own `[i]`), not files: no tier or shard cache is laid over them.
OBJECT_SOURCES = ("factory", "huggingface")


def opener(name: str) -> Opener:
    """The `open_source` of source `name` (a key of `OPENERS`)."""
    return cast(Opener, importlib.import_module(OPENERS[name]).open_source)


def open_dataset(config: Config, split: str = "train", progress: Callable[[int, int], None] | None = None,
                 relist: bool = False) -> Dataset:
    """The dataset a config names (its `dataset.path`, the tier's `base`, or the synthetic one, generated if
    missing), read through `storage.tier`, and with `storage.cache_limit` a dataset not on the local disk through
    a bounded local cache of its files over the tier. Its listing is the saved one where there is one (a remote
    dataset's, a local ImageFolder's while its folders are unchanged); `relist` lists it again (`--relist`).

    Tokens and records are the `dataset.kind`s of those names; images are an ImageFolder, WebDataset tar shards,
    Parquet files or a Hugging Face `save_to_disk` folder (`dataset.format`, or what the path holds), the object
    `dataset.factory` returns, or the synthetic set where there is no path."""
    tier = resolve_tier(config.storage.tier, where=f"{config.source}: storage.tier")
    if config.dataset.kind == "tokens" or config.dataset.factory is not None:
        what = "token corpora are memory-mapped from a local file" if config.dataset.kind == "tokens" else \
            "dataset.factory's dataset is read through its own object"
        if tier.base is not None or tier.emulates():
            raise ConfigError(f"{config.source}: storage.tier: {what}; tiers apply to image datasets read from "
                              "files (use storage.tier: local)")
        return opener("tokens" if config.dataset.kind == "tokens" else "factory")(
            SourceRequest(config, split, config.dataset.path, progress=progress))
    path = dataset_root(tier, config.dataset.path, where=config.source)
    request = SourceRequest(config, split, path, tier.storage_options, progress, relist,
                            _index_through_cache(config, tier, path))
    name = source_name(request)
    if name in OBJECT_SOURCES:  # read through the dataset object it holds: no files of its own for a tier to limit
        if tier.base is not None or tier.emulates():
            raise ConfigError(f"{config.source}: storage.tier: a Hugging Face save_to_disk folder is read through "
                              "its dataset object; tiers apply to image datasets read from files (use storage.tier: "
                              "local)")
        return opener(name)(request)
    dataset = opener(name)(request)
    # `fs` and `converted` are set on the dataset classes, which all have them as plain attributes
    opened = cast(Any, dataset)
    opened.fs = tier_filesystem(tier, dataset.fs)  # reads go through the tier (itself when it imposes nothing)
    opened.converted = conversion_home(config.storage.converted, tier.base, opened.fs, dataset.root)
    if config.storage.cache_limit is not None:  # over the tier, so that every byte fetched still crosses it
        opened.fs = cache_reads(opened.fs, path, tier, config.storage.cache_limit, dataset.fingerprint,
                                config.storage.cache_fetches)
    return dataset


def source_name(request: SourceRequest) -> str:
    """Which source opens the request: records by their kind, the synthetic set where there is no path, else the
    image format `dataset.format` names or (`auto`) the one its saved listing or, without one, the path holds."""
    config, path = request.config, request.path
    if config.dataset.kind == "records":
        return "records"
    if path is None:
        return "synthetic"
    if config.dataset.format != "auto":
        return config.dataset.format
    from loadopt.storage.sources import parquet, webdataset
    from loadopt.storage.sources.format import detect_format

    spec, split, options = config.dataset, request.split, request.storage_options
    fs, inner = open_url(path, options)
    keys = [webdataset.listing_key(path, split, options, spec.label_key),
            parquet.listing_key(path, split, options, spec.columns.image, spec.columns.label),
            ListingKey.of("imagefolder", path, split, options)]
    saved = [key.source_format for key in keys if not request.relist and remote_listing.saves_listing(fs, inner)
             and remote_listing.is_saved(key)]
    if saved:  # detected when it was listed: asking again would cost the requests the listing saves
        return saved[0]
    with storage_errors(path, "look at the dataset"):
        return detect_format(fs, inner, split, redact(path))


def _index_through_cache(config: Config, tier: TierSpec, path: str | None) -> IndexThrough | None:
    """With `storage.cache_limit`, remote tar shards are indexed through the tier and the shard cache: indexing
    reads each shard whole, so its copy is kept and the first epoch reads it instead of fetching it again."""
    limit = config.storage.cache_limit
    if limit is None or path is None:
        return None

    def through(fs: fsspec.AbstractFileSystem, fingerprint: str) -> fsspec.AbstractFileSystem:
        if tier.base is None and is_local_fs(fs):  # read where it is (open_dataset says so once)
            return fs
        return cache_reads(tier_filesystem(tier, fs), path, tier, limit, fingerprint)

    return through
