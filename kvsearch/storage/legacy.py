"""Stores of the earlier format, which kept every embedding in its records row (``key_emb``, ``value_emb``).

- :func:`is_legacy`: whether a store is of that format.
- :func:`move_to_chunks`: move it to the chunks of :mod:`kvsearch.storage.chunks` in one transaction (a store opened
  for writing does so at open).
- :func:`read_all`, :func:`read_rows`, :func:`embeddings_of_rows`: read it as it is (a store opened read-only).

This module knows nothing of the in-memory tensors or of versions: the move runs in the store's own transaction, and
the mirror (:mod:`kvsearch.storage.mirror`) reads an unmoved store through these functions.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvsearch.errors import CorruptDatabaseError
from kvsearch.storage import chunks
from kvsearch.storage.schema import METADATA_INDEX, select_in

if TYPE_CHECKING:
    from kvsearch.storage.store import Store

__all__ = ["is_legacy", "move_to_chunks", "read_all", "read_rows", "embeddings_of_rows"]


def is_legacy(conn: sqlite3.Connection) -> bool:
    """Whether the records table still holds the embeddings (the format before :mod:`kvsearch.storage.chunks`)."""
    return "key_emb" in {row[1] for row in conn.execute("PRAGMA table_info(records)")}


def move_to_chunks(store: Store) -> None:
    """Move a store of the earlier format to chunks, in one transaction (then VACUUM gives the space back).

    The records keep their ids, texts, metadata and the next id; the version is not bumped (nothing a reader
    sees changed). A process that stops midway leaves the earlier format whole, moved again at the next open.
    Sets ``store.legacy`` to False once the store is moved (by this process or, first, by another).
    """
    with store.lock:
        with store.transaction():
            if not is_legacy(store.conn):
                store.legacy = False
                return  # another process moved it first
            conn = store.conn
            seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
            conn.execute(
                "CREATE TABLE records_moved (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE, value TEXT, "
                "metadata TEXT, slot INTEGER NOT NULL)"
            )
            rows = conn.execute("SELECT id, key, value, metadata, key_emb, value_emb FROM records ORDER BY id")
            while batch := rows.fetchmany(4096):
                ids = np.array([r[0] for r in batch], dtype=np.int64)
                keys, values = embeddings_of_rows([(r[4], r[5]) for r in batch])
                slots = chunks.append(conn, ids, keys, values).tolist()
                conn.executemany(
                    "INSERT INTO records_moved (id, key, value, metadata, slot) VALUES (?, ?, ?, ?, ?)",
                    ((r[0], r[1], r[2], r[3], slot) for r, slot in zip(batch, slots)),
                )
            conn.execute("DROP TABLE records")
            conn.execute("ALTER TABLE records_moved RENAME TO records")
            conn.execute(METADATA_INDEX)  # dropped with the old table
            conn.execute("DELETE FROM sqlite_sequence WHERE name IN ('records', 'records_moved')")
            if seq is not None:
                conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('records', ?)", (seq[0],))
        store.legacy = False
        with contextlib.suppress(sqlite3.Error):
            store.conn.execute("VACUUM")  # the old rows' pages back to the file system (best effort)


def read_all(
    conn: sqlite3.Connection, dim: int, value_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, str | None]]]:
    """Every record of a store of the earlier format, in id order (in the caller's snapshot).

    Returns:
        ids (n,) int64, keys (n, dim) and values (n, value_dim) float32, and the (id, key text) rows.

    Raises:
        CorruptDatabaseError: an embedding does not have the expected dims.
    """
    rows = conn.execute("SELECT id, key, key_emb, value_emb FROM records ORDER BY id").fetchall()
    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    keys, values = embeddings_of_rows([(r[2], r[3]) for r in rows], dim, value_dim)
    return ids, keys, values, [(r[0], r[1]) for r in rows]


def read_rows(
    conn: sqlite3.Connection, ids: Sequence[int], dim: int, value_dim: int
) -> tuple[list[tuple[int, str | None, int]], np.ndarray, np.ndarray]:
    """The stored records among ``ids`` of a store of the earlier format, in id order (ids not stored left out).

    Returns:
        rows (id, key, -1: no slot), and their keys (r, dim) and values (r, value_dim) as float32 arrays.

    Raises:
        CorruptDatabaseError: an embedding does not have the expected dims.
    """
    found = select_in(conn, "SELECT id, key, key_emb, value_emb FROM records WHERE id IN ({})", ids)
    found.sort(key=lambda row: row[0])
    keys, values = embeddings_of_rows([(r[2], r[3]) for r in found], dim, value_dim)
    return [(r[0], r[1], -1) for r in found], keys, values


def embeddings_of_rows(
    blobs: Sequence[tuple[bytes, bytes]], dim: int | None = None, value_dim: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Key and value embeddings from (key_emb, value_emb) blobs of rows of the earlier format.

    Args:
        blobs: one (key bytes, value bytes) pair per row. dim, value_dim: the dims, or None to take the first row's.

    Returns:
        keys (n, dim) and values (n, value_dim), float32 arrays of their own.

    Raises:
        CorruptDatabaseError: a blob does not have the expected size.
    """
    if dim is None or value_dim is None:
        dim, value_dim = (len(blobs[0][0]) // 4, len(blobs[0][1]) // 4) if blobs else (0, 0)
    try:
        keys = np.frombuffer(b"".join(b[0] for b in blobs), dtype=np.float32).reshape(len(blobs), dim).copy()
        values = np.frombuffer(b"".join(b[1] for b in blobs), dtype=np.float32).reshape(len(blobs), value_dim).copy()
    except ValueError:
        raise CorruptDatabaseError(f"stored embeddings do not have the expected dims ({dim}, {value_dim})") from None
    return keys, values
