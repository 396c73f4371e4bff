"""A tar shard's members read from their headers alone (seeking over member data): each sample's image member, its
label and its small members, as WebDataset groups them (a sample is the run of members sharing a key)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from loadopt.errors import DatasetError
from loadopt.storage.sources.tar_fields import FIELD_MAX_BYTES

IMAGE_MEMBER_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "jxl")

BLOCK = 512
REGULAR_FILES = (b"0", b"\0", b"7")


def header_number(field_bytes: bytes) -> int:
    """A tar header's numeric field: octal text, or GNU's base-256 (high bit set) for large values."""
    if field_bytes[0] & 0x80:
        return int.from_bytes(field_bytes[1:], "big")
    text = field_bytes.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def is_member_header(header: bytes, size: int) -> bool:
    """Whether `header` is a valid tar header (its checksum) of a regular member of `size` bytes."""
    if len(header) != BLOCK or header.count(0) == BLOCK:
        return False
    try:
        checksum, stored = sum(header[:148]) + 8 * 32 + sum(header[156:]), header_number(header[148:156])
        return stored == checksum and header_number(header[124:136]) == size and header[156:157] in REGULAR_FILES
    except ValueError:  # not octal: not a header
        return False


def _pax_path(data: bytes) -> str | None:
    """The `path` record of a pax extended header (`<length> <key>=<value>\\n` records)."""
    position = 0
    while position < len(data):
        space = data.index(b" ", position)
        length = int(data[position:space])
        key, _, value = data[space + 1 : position + length - 1].partition(b"=")
        if key == b"path":
            return value.decode("utf-8", "surrogateescape")
        position += length
    return None


def _header_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0":  # POSIX ustar: a prefix field (GNU's header uses those bytes otherwise)
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")


def tar_members(read: Callable[[int, int], bytes], total: int, shown: str) -> list[tuple[str, int, int]]:
    """(name, data offset, size) of each regular member of a tar of `total` bytes, read header by header
    (GNU `././@LongLink` and pax long names applied to the member they precede)."""
    members: list[tuple[str, int, int]] = []
    offset, long_name = 0, None
    while offset + BLOCK <= total:
        header = read(offset, BLOCK)
        if header.count(0) == BLOCK:  # the end-of-archive blocks
            return members
        checksum = sum(header[:148]) + 8 * 32 + sum(header[156:])
        if len(header) < BLOCK or header_number(header[148:156]) != checksum:
            raise DatasetError(f"{shown}: not a tar header at offset {offset} (damaged or not a tar shard)")
        size, kind = header_number(header[124:136]), header[156:157]
        data = offset + BLOCK
        if data + size > total:
            raise DatasetError(f"{shown}: truncated at offset {offset} (a member of {size} bytes; the file ends "
                               f"at {total})")
        if kind == b"L":
            long_name = read(data, size).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == b"x":
            long_name = _pax_path(read(data, size)) or long_name
        elif kind in REGULAR_FILES:
            members.append((long_name or _header_name(header), data, size))
            long_name = None
        elif kind != b"K" and kind != b"g":  # folders, links: no sample data
            long_name = None
        offset = data + -(-size // BLOCK) * BLOCK
    if offset < total:
        raise DatasetError(f"{shown}: truncated at offset {offset} (a partial tar header)")
    return members


def _sample_key(name: str) -> tuple[str, str]:
    """(key, extension) of a member name: WebDataset's split at the first dot of the base name."""
    folder, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower()


def _label(members: dict[str, tuple[int, int]], read: Callable[[int, int], bytes], label_key: str | None,
           where: str) -> object:
    """The sample's label as written: its `cls` member's text, or the `label_key` field of its `json` member
    (`class_numbers` makes it a class number)."""
    if label_key is None:
        if "cls" not in members:
            raise DatasetError(f"{where}: no `cls` member (members: {', '.join(members)}); set dataset.label_key "
                               "to the field of its `json` member that holds the label")
        return read(*members["cls"]).strip().decode("utf-8", "replace")
    if "json" not in members:
        raise DatasetError(f"{where}: no `json` member for dataset.label_key {label_key!r} (members: "
                           f"{', '.join(members)})")
    try:
        value = json.loads(read(*members["json"]))[label_key]
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{where}: its `json` member has no field {label_key!r} ({type(exc).__name__})") from None
    return value


@dataclass
class ShardSamples:
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: list[object] = field(default_factory=list)  # as written (`_label`)
    label_members: list[str] = field(default_factory=list)  # the member each label was read from, for messages
    left_out: list[str] = field(default_factory=list)
    fields: list[dict[str, bytes]] = field(default_factory=list)  # each sample's small other members, by extension


def index_shard(read: Callable[[int, int], bytes], total: int, shown: str, label_key: str | None) -> ShardSamples:
    """The samples of one shard: the members of each key run, its image member and its label."""
    found = ShardSamples()
    runs: list[tuple[str, dict[str, tuple[int, int]]]] = []
    for name, offset, size in tar_members(read, total, shown):
        key, extension = _sample_key(name)
        if not runs or runs[-1][0] != key:
            runs.append((key, {}))
        runs[-1][1][extension] = (offset, size)
    for key, members in runs:
        image = next((m for m in members if m.rsplit(".", 1)[-1] in IMAGE_MEMBER_EXTENSIONS), None)
        if image is None:
            found.left_out.append(f"{shown} (sample {key}: no image member; members: {', '.join(members)})")
            continue
        found.labels.append(_label(members, lambda start, size: read(start, size), label_key,
                                   f"{shown} (sample {key})"))
        found.label_members.append(f"{key}.{'cls' if label_key is None else 'json'}")
        found.offsets.append(members[image][0])
        found.sizes.append(members[image][1])
        found.keys.append(key)
        label_member = "cls" if label_key is None else None
        found.fields.append({extension: read(*place) for extension, place in members.items()
                             if extension not in (image, label_member) and place[1] <= FIELD_MAX_BYTES})
    return found
