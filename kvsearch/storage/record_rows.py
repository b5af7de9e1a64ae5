"""A record as a store hands it out, and the SQL of one write of records inside the caller's transaction.

:func:`write_rows` hands out the ids (the sequence's next, carried ones, or the replaced records' own), stores the
embeddings through the store's :class:`~kvsearch.storage.embeddings.Vectors`, inserts or updates the rows of
``records`` and the given flags. An add of new records without texts or metadata (a kNN memory's) costs a few
statements whatever its size and no Python work per record: the ids are a range, the rows one ranged insert
(:func:`~kvsearch.storage.schema.insert_records`), the given flags one ``INSERT ... SELECT``.

It knows nothing of the in-memory table, the key maps, the lock, the transaction or the version: the
:class:`~kvsearch.storage.store.Store` holds those and calls it inside its transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

from kvsearch.metadata.codec import encode as encode_metadata
from kvsearch.storage import schema
from kvsearch.storage.embeddings import Vectors, point_at, slots_of

__all__ = ["Record", "Written", "write_rows", "last_id", "seed_ids"]

#: The given flags of a run of new records (ids first..last, every one just inserted), in one statement.
_GIVEN_RANGE = "INSERT INTO given (id, side) SELECT id, ? FROM records WHERE id BETWEEN ? AND ?"


@dataclass(frozen=True)
class Record:
    """One stored record.

    Attributes:
        id: the global id.
        key: the key text, or None for a key given as an embedding.
        value: the value text, or None for a value given as an embedding.
        metadata: the metadata dict ({} when none was given).
        key_embedding: (dim,) float32 tensor on the CPU.
        value_embedding: (value_dim,) float32 tensor on the CPU.
    """

    id: int
    key: str | None
    value: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    key_embedding: Tensor | None = field(default=None, repr=False)
    value_embedding: Tensor | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Written:
    """What :func:`write_rows` wrote.

    Attributes:
        ids: every record's id, in order. new: positions of the new records. old: positions of the replaced ones.
        flagged: (id, given bits) of the records whose texts came with their embedding (filled only when asked).
    """

    ids: list[int]
    new: Sequence[int]
    old: list[int]
    flagged: list[tuple[int, int]]


def write_rows(
    conn: sqlite3.Connection,
    vectors: Vectors,
    records: tuple[Sequence[str | None], Sequence[str | None], Sequence[Mapping[str, Any] | None]],
    embeddings: tuple[np.ndarray, np.ndarray],
    ids: list[int | None],
    given: Sequence[int] | None,
    new_ids: Sequence[int] | None,
    *,
    flags: bool,
) -> Written:
    """Insert or update records (inside the caller's write transaction); see ``Store.write`` for the arguments.

    Args:
        conn: the store's connection, in its write transaction. vectors: where the embeddings are stored.
        records: keys, values, metadata: one entry per record (metadata None: none, or kept for a replaced record).
        embeddings: keys (n, dim) and values (n, value_dim) float32 CPU arrays.
        ids: per record, the stored id it replaces, or None for a new record.
        given: per record, given bits (or None). new_ids: the new records' carried ids, or None.
        flags: whether :attr:`Written.flagged` is wanted (the store holds its key maps).
    """
    keys, values, metadata = records
    key_np, value_np = embeddings
    n = len(keys)
    next_id = last_id(conn) + 1
    fresh = new_ids is None and ids.count(None) == n  # every record new, its id the sequence's next: an add
    if fresh:
        out, new, old = list(range(next_id, next_id + n)), range(n), []
    else:
        out, carried = [], None if new_ids is None else iter(new_ids)
        for id_ in ids:
            out.append(int(id_) if id_ is not None else next_id if carried is None else int(next(carried)))
            next_id += id_ is None
        new, old = [i for i in range(n) if ids[i] is None], [i for i in range(n) if ids[i] is not None]
    if new:
        every = len(new) == n  # the usual add: no row selection to copy
        added = np.arange(out[0], out[0] + n) if fresh else np.array([out[i] for i in new], dtype=np.int64)
        slots = vectors.append(conn, added, key_np if every else key_np[new], value_np if every else value_np[new])
        if every and list(metadata).count(None) == n:  # no metadata: nothing to encode a record at a time
            rows = (list(keys), list(values), [None] * n)
        else:
            rows = ([keys[i] for i in new], [values[i] for i in new], [encode_metadata(metadata[i]) for i in new])
        schema.insert_records(conn, *rows, slots.tolist(), out if every else added.tolist())
    if old:
        old_ids = np.array([out[i] for i in old], dtype=np.int64)
        slots_now = slots_of(conn, old_ids)
        moved = vectors.replace(conn, slots_now, old_ids, key_np[old], value_np[old])
        if moved is not None:  # file sets are append-only: the new embeddings are in new slots
            point_at(conn, old_ids, moved, old=slots_now)
        conn.executemany(  # metadata None: keep the stored
            "UPDATE records SET key = ?, value = ?, metadata = CASE WHEN ? THEN metadata ELSE ? END WHERE id = ?",
            ((keys[i], values[i], metadata[i] is None, encode_metadata(metadata[i]), out[i]) for i in old),
        )
    if fresh and n and given is not None and list(given).count(given[0]) == n:  # one flag for every record
        bits = int(given[0])
        if bits:  # the new ids are a run above every other: one statement, not one a record
            conn.execute(_GIVEN_RANGE, (bits, out[0], out[-1]))
        flagged = [(id_, bits) for id_ in out] if bits and flags else []
    else:
        flagged = [(out[i], int(given[i])) for i in range(n) if given is not None and given[i]]
        if old:
            conn.executemany("DELETE FROM given WHERE id = ?", ((out[i],) for i in old))
        conn.executemany("INSERT INTO given (id, side) VALUES (?, ?)", flagged)
    return Written(out, new, old, flagged)


def last_id(conn: sqlite3.Connection) -> int:
    """The last id SQLite's AUTOINCREMENT sequence handed out (0: none yet); deleted ids included."""
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
    return 0 if row is None else int(row[0])


def seed_ids(conn: sqlite3.Connection, floor: int) -> None:
    """Make the next new id ``floor + 1`` (inside the caller's write transaction)."""
    conn.execute("DELETE FROM sqlite_sequence WHERE name = 'records'")
    conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('records', ?)", (int(floor),))
