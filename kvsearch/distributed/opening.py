"""Opening a sharded database: its root checked, the layout written or read, this rank's shards opened.

A root holds one kind of database (:func:`kvsearch.storage.folder.check_kind`): ``ShardedDatabase`` on a plain
database's folder is refused, and a new sharded database is made only in an absent or empty folder outside any
other database (:func:`kvsearch.storage.folder.check_new_folder`). Each shard holds up to
:data:`kvsearch.checks.FILES_PER_DATABASE` file descriptors: the shards a process opens must fit in its open-file
limit, checked up front (:func:`kvsearch.checks.check_open_files`).

This module knows nothing of search, writes or collectives: it runs inside the facade's agreement, on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsearch.checks import check_open_files
from kvsearch.database import Database
from kvsearch.distributed.generations import check_generations
from kvsearch.distributed.layout import MAX_SHARDS, ShardLayout, first_id, is_sharded, shard_dir, shards_of_rank
from kvsearch.errors import ConfigMismatchError, InvalidArgumentError, MissingFileError
from kvsearch.storage import fileio
from kvsearch.storage import folder as folders

if TYPE_CHECKING:
    from kvsearch.encoders.base import Encoder

__all__ = ["Shard", "check_num_shards", "open_shards"]


class Shard(Database):
    """One shard of a sharded database: an ordinary database whose folder lies inside its sharded root."""

    _shard = True


def check_num_shards(num_shards: object, *, optional: bool = True) -> int | None:
    """A shard count: an int in [1, :data:`MAX_SHARDS`], or None when ``optional`` (``ShardedDatabase``: reopen).

    Raises:
        InvalidArgumentError: anything else (a bool, a float, 0, a count past the maximum).
    """
    if num_shards is None and optional:
        return None
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or not 1 <= num_shards <= MAX_SHARDS:
        reopen = " (or None to reopen)" if optional else ""
        raise InvalidArgumentError(
            f"expected num_shards as an integer in [1, {MAX_SHARDS:,}]{reopen}, got {num_shards!r}"
        )
    return num_shards


def open_shards(
    path: Path,
    num_shards: int | None,
    encoder: Encoder | None,
    value_encoder: Encoder | None,
    options: Mapping[str, Any],
    rank: int,
    world_size: int,
) -> dict[int, Database]:
    """Create (rank 0 writes the layout, the others wait) or reopen a sharded database, and open this rank's shards.

    Args:
        path: the root folder.
        num_shards: the shard count of a new database (or of an existing one, checked); None reopens.
        encoder, value_encoder, options: what every shard is created with (as for :class:`~kvsearch.Database`).
        rank, world_size: this rank and the number of ranks serving the database.

    Returns:
        This rank's shards by number (``s % world_size == rank``).

    Raises:
        WrongKindError: the root holds a plain database, or a new one would lie inside another database.
        ForeignFolderError: a new sharded database in a folder of other files.
        InvalidArgumentError: no sharded database there and no ``num_shards``; the world size does not divide it.
        ConfigMismatchError: ``num_shards`` differs from the stored count.
        MissingFileError: a shard folder of an existing sharded database is missing.
        FileLimitError: this rank's shards would not fit in the process's open-file limit.
    """
    with fileio.storage_errors(path, "opening the sharded database's folder", "nothing was written"):  # EMFILE
        folders.check_kind(path, "sharded")
        exists = is_sharded(path)
        if exists:
            stored = ShardLayout.read(path).num_shards
            if num_shards is not None and stored != num_shards:
                raise ConfigMismatchError(f"{path} was created with num_shards={stored}; got num_shards={num_shards}")
            num_shards = stored
        elif num_shards is None:
            raise InvalidArgumentError(f"expected a sharded database at {path} (or num_shards to create one)")
        else:
            folders.check_new_folder(path)
    mine = shards_of_rank(num_shards, rank, world_size)
    check_open_files(len(mine), f"opening {len(mine):,} shards of {path}")
    if exists:
        missing = [shard_dir(path, s).name for s in mine if not folders.is_database(shard_dir(path, s))]
        if missing:
            raise MissingFileError(
                f"{path} is a sharded database of {num_shards} shards, but {', '.join(missing[:5])} "
                f"{'is' if len(missing) == 1 else 'are'} missing or hold no store: restore them from a backup "
                "(a shard is never made anew in an existing database)"
            )
    shards: dict[int, Database] = {}
    try:
        for s in mine:
            new = not folders.is_database(shard_dir(path, s))
            db = Shard(shard_dir(path, s), encoder=encoder, value_encoder=value_encoder, **options)
            if new:
                db.store.start_ids_after(first_id(s) - 1)
            shards[s] = db
            encoder, value_encoder = db.encoder, (db.value_encoder if db.value_encoder is not db.encoder else None)
        if not exists and rank == 0:
            first = shards[0]
            layout = ShardLayout(num_shards, first.dim, first.value_dim, first.score, first.index_spec)
            replace(layout, generation=first.generation).write(path)
        if exists:
            check_generations(ShardLayout.read(path), shards)
        query = next((db.query_encoder for db in shards.values() if db.query_encoder is not None), None)
        for db in shards.values():  # one query-side encoder object for every local shard
            if query is not None and db.query_encoder is not query:
                db.query_encoder = query
    except BaseException:
        for db in shards.values():
            db.close()
        raise
    return shards
