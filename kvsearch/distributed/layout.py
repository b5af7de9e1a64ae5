"""The layout of a sharded database: shard folders, ``shards.json``, global ids and key routing.

    root/shards.json          the shard count (fixed at creation), hash, id layout, dims, score, index
    root/shard-0000/ ...      each an ordinary kvsearch database folder (store, lock, generations, index)

A record's id is global: the shard in the high bits, ``id = (shard << ID_SHIFT) | local``; shard s's store hands
out ids from ``(s << ID_SHIFT) + 1`` (its AUTOINCREMENT sequence is seeded at creation), so a deleted id is never
reused and the owner of an id is ``id >> ID_SHIFT`` — in a *banded* layout. A resharded database
(:mod:`kvsearch.distributed.reshard`) keeps its records' ids while they move to their keys' new shards: its layout
says ``banded_ids=False`` and the owner of an id is the shard that holds it (new ids are still handed out in each
shard's band, after every id the source ever handed out there). A key text lives on ``shard_of_key(key)``: a
stable 64-bit BLAKE2b hash of the UTF-8 bytes of its normalised text (never Python's ``hash()``, which is salted per
process). Rank r of a world of size W serves the shards s with ``s % W == r``.

This module knows nothing of torch.distributed, search or autograd.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvsearch.errors import CorruptDatabaseError, InvalidArgumentError
from kvsearch.inputs import normalize_key
from kvsearch.storage import fileio
from kvsearch.storage.folder import SHARDS_FILE  # the file that makes a folder a sharded database

__all__ = [
    "SHARDS_FILE",
    "ID_SHIFT",
    "HASH",
    "ShardLayout",
    "shard_of_key",
    "shard_of_id",
    "first_id",
    "shard_dir",
    "shards_of_rank",
    "is_sharded",
    "MAX_SHARDS",
]

#: Ids of shard s start at ``(s << ID_SHIFT) + 1``: 2^40 records per shard, 2^23 shards in an int64.
ID_SHIFT = 40
#: The key hash, by name (recorded in shards.json: a future change of hash is detected, never mixed).
HASH = "blake2b-64-le"
#: Most shards a new sharded database may have: a count that works on a normal machine. One process that serves
#: them all (the CLI, a ShardedDatabase without torch.distributed) holds up to
#: :data:`~kvsearch.checks.FILES_PER_DATABASE` open files per shard (10,240 at this count: within the hard limits
#: machines ship with, and the soft limit is raised to fit, see :func:`~kvsearch.checks.check_open_files`), about
#: 0.4 MiB of memory and ~13 ms to create each (13 s for 1,024: ``benchmarks/bench_shards_open.py``). Ids would
#: allow 2^22 shards; at 300 shards and beyond, a process under the common ``ulimit -n 1024`` failed halfway. More
#: ranks each open ``num_shards / world_size``.
MAX_SHARDS = 1024
_LAYOUT_MAX_SHARDS = 1 << 22  # what a layout may say: ids ``(shard << ID_SHIFT) | local`` stay positive int64
FORMAT = 1


def shard_of_key(key: str, num_shards: int) -> int:
    """The shard a key text lives on: BLAKE2b-64 of the UTF-8 bytes of its normalised text
    (:func:`~kvsearch.inputs.normalize_key`), little-endian, modulo the shard count."""
    digest = hashlib.blake2b(normalize_key(key).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def shard_of_id(id_: int) -> int:
    """The shard that owns a global id (its high bits)."""
    return int(id_) >> ID_SHIFT


def first_id(shard: int) -> int:
    """The first id shard ``shard`` hands out."""
    return (int(shard) << ID_SHIFT) + 1


def shard_dir(path: str | os.PathLike[str], shard: int) -> Path:
    """The database folder of one shard: ``path/shard-0003``."""
    return Path(path) / f"shard-{int(shard):04d}"


def shards_of_rank(num_shards: int, rank: int, world_size: int) -> list[int]:
    """The shards rank ``rank`` of ``world_size`` serves: those with ``s % world_size == rank``.

    Raises:
        InvalidArgumentError: the shard count is not a multiple of the world size.
    """
    if num_shards % world_size:
        raise InvalidArgumentError(
            f"expected a world size that divides the shard count {num_shards} (1, 2, 4, ...), got {world_size}: "
            "the shard count is fixed when the database is created"
        )
    return [s for s in range(num_shards) if s % world_size == rank]


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a sharded database (a :data:`SHARDS_FILE`)."""
    return (Path(path) / SHARDS_FILE).is_file()


@dataclass(frozen=True)
class ShardLayout:
    """What ``shards.json`` records: fixed when the sharded database is created.

    Attributes:
        num_shards: the shard count.
        dim, value_dim, score, index: the options every shard was created with.
        hash: the key hash (:data:`HASH`). id_shift: :data:`ID_SHIFT`. format: the layout's version.
        generation: the generation every shard is at (the commit point of a switch across shards: see
            :meth:`kvsearch.distributed.ShardedDatabase.switch_generation`); None in layouts written before.
        banded_ids: whether every id is held by the shard of its band (``id >> id_shift``); False after a reshard
            (the ids were carried over), when the owner of an id is found by asking the shards. True in layouts
            written before.
    """

    num_shards: int
    dim: int
    value_dim: int
    score: str
    index: str
    hash: str = HASH
    id_shift: int = ID_SHIFT
    format: int = FORMAT
    generation: int | None = None
    banded_ids: bool = True

    def __post_init__(self) -> None:
        n = self.num_shards
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _LAYOUT_MAX_SHARDS:
            raise InvalidArgumentError(f"expected num_shards as an integer in [1, {_LAYOUT_MAX_SHARDS}], got {n!r}")
        if not isinstance(self.banded_ids, bool):
            raise InvalidArgumentError(f"expected banded_ids as a bool, got {self.banded_ids!r}")

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write ``path/shards.json`` atomically (a temporary file, then a rename)."""
        target = Path(path) / SHARDS_FILE
        tmp = target.with_name(f".{SHARDS_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> ShardLayout:
        """Read ``path/shards.json``.

        Raises:
            CorruptDatabaseError: missing, not JSON, or not a layout this version reads.
            FileLimitError: the process may open no more files.
        """
        target = Path(path) / SHARDS_FILE
        try:
            data: Any = json.loads(target.read_text(encoding="utf-8"))
            layout = cls(**data)
        except (OSError, ValueError, TypeError, InvalidArgumentError) as exc:
            if fileio.is_out_of_files(exc):  # what it is, never "corrupt"
                raise fileio.file_limit_error(exc, target, "reading the shard layout") from None
            raise CorruptDatabaseError(f"{target} is not a kvsearch shard layout: {exc}") from None
        if layout.format != FORMAT or layout.hash != HASH or layout.id_shift != ID_SHIFT:
            raise CorruptDatabaseError(
                f"{target}: expected format {FORMAT}, hash {HASH!r}, id shift {ID_SHIFT}; got {layout.format}, "
                f"{layout.hash!r}, {layout.id_shift}"
            )
        return layout
