"""Older on-disk formats, read or moved once, at open: the one place that knows them.

A store's embeddings have lived in three places over its versions:

1. in the records rows (``key_emb``, ``value_emb`` columns: the earliest format),
2. in SQLite chunks (:mod:`kvsearch.storage.chunks`, ``records.slot`` naming a record's slot),
3. in file sets beside the SQLite file (:mod:`kvsearch.storage.vector_file`): the format of today.

:func:`upgrade` moves a store opened for writing to today's format on disk (1 -> 2 -> 3, each move one transaction;
a process that stops midway leaves the earlier format whole, moved again at the next open). :func:`open_vectors`
picks, once per open, the :class:`~kvsearch.storage.embeddings.Vectors` the store writes through and reads from: file
sets on disk, chunks in memory; a store opened read-only is read as it is (its chunks, or its rows by
:class:`RowVectors`) into the in-memory table, and :func:`follow` picks again should another process move it since.

This module knows SQL, files and arrays: nothing of tensors, versions or the in-memory table; the moves run in the
transactions the store hands it.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from kvsearch.errors import CorruptDatabaseError
from kvsearch.storage import chunks, schema
from kvsearch.storage.embeddings import ChunkVectors, FileVectors, Rows, Vectors, has_chunks
from kvsearch.storage.schema import METADATA_INDEX, select_in
from kvsearch.storage.vector_file import VectorFiles

__all__ = ["upgrade", "open_vectors", "follow", "is_legacy", "RowVectors", "embeddings_of_rows"]


def open_vectors(path: Path | None, conn: sqlite3.Connection, *, writable: bool) -> Vectors:
    """The vectors of a store, picked once at open (after :func:`upgrade` when it is writable).

    Args:
        path: the store's SQLite file, or None in memory. conn: its connection. writable: whether it may be written.

    Returns:
        :class:`ChunkVectors` in memory; on disk :class:`FileVectors`, or, read-only and of an earlier format, the
        reader of that format (:class:`RowVectors` for rows, :class:`ChunkVectors` for chunks).
    """
    if path is None:
        return ChunkVectors()
    if not writable and is_legacy(conn):
        return RowVectors()
    if not writable and not VectorFiles.in_use(conn) and has_chunks(conn):
        return ChunkVectors(on_disk=True)  # the chunk format, read-only: read as it is
    return FileVectors(path, writable=writable)


def follow(path: Path | None, conn: sqlite3.Connection, vectors: Vectors) -> Vectors:
    """``vectors``, or the vectors of the store's format now should another process have moved it since (a store
    opened read-only in an earlier format). Inside the caller's snapshot."""
    return vectors if vectors.current(conn) else open_vectors(path, conn, writable=False)


def upgrade(conn: sqlite3.Connection, path: Path | None, transaction: Callable[[], AbstractContextManager]) -> None:
    """Move a store opened for writing to today's format: rows -> chunks -> file sets (on disk).

    Args:
        conn: the store's connection. path: its SQLite file, or None in memory.
        transaction: opens one write transaction of the store (under its locks).
    """
    if is_legacy(conn):
        _rows_to_chunks(conn, transaction)
        schema.init_summary(conn)  # the moved records table has slots: its summary and triggers
    if path is not None and not VectorFiles.in_use(conn) and has_chunks(conn):
        with transaction():
            _chunks_to_files(conn, FileVectors(path, writable=True))


def _rows_to_chunks(conn: sqlite3.Connection, transaction: Callable[[], AbstractContextManager]) -> None:
    """Move a store of the earliest format to chunks, in one transaction (then VACUUM gives the space back).

    The records keep their ids, texts, metadata and the next id; the version is not bumped (nothing a reader sees
    changed).
    """
    with transaction():
        if not is_legacy(conn):
            return  # another process moved it first
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
    with contextlib.suppress(sqlite3.Error):
        conn.execute("VACUUM")  # the old rows' pages back to the file system (best effort)


def _chunks_to_files(conn: sqlite3.Connection, files: FileVectors) -> None:
    """Move a chunk-format store's embeddings to a file set and point the records at their new slots (inside the
    caller's transaction; nothing when another process moved them first)."""
    if VectorFiles.in_use(conn) or not has_chunks(conn):
        return
    dims = conn.execute("SELECT length(keys), length(vals), capacity FROM chunk_data JOIN chunks USING (first)")
    row = dims.fetchone()
    dim, value_dim = row[0] // 4 // row[2], row[1] // 4 // row[2]
    ids, _, keys, values = chunks.read_all(conn, dim, value_dim)
    order = np.argsort(ids, kind="stable")
    slots = files.rewrite(conn, ids[order], keys[order], values[order])
    conn.execute("DELETE FROM chunks")
    conn.execute("DELETE FROM chunk_data")
    conn.executemany("UPDATE records SET slot = ? WHERE id = ?", zip(slots.tolist(), ids[order].tolist()))


def is_legacy(conn: sqlite3.Connection) -> bool:
    """Whether the records table still holds the embeddings (the format before :mod:`kvsearch.storage.chunks`)."""
    return "key_emb" in {row[1] for row in conn.execute("PRAGMA table_info(records)")}


class RowVectors(ChunkVectors):
    """The reader of a store of the earliest format opened read-only: every embedding is in its records row.

    Only the reads are used (a read-only store writes nothing); the records have no slots (``slotted`` False: no
    records summary to check them against).
    """

    slotted = False

    def __init__(self) -> None:
        super().__init__(on_disk=True)

    def current(self, conn: sqlite3.Connection) -> bool:
        return is_legacy(conn)

    def read_all(
        self, conn: sqlite3.Connection, dim: int, value_dim: int, *, alloc: Callable | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every record in id order: ids (n,), slots (n,) all -1, keys (n, dim), values (n, value_dim).

        Raises:
            CorruptDatabaseError: an embedding does not have the expected dims.
        """
        rows = conn.execute("SELECT id, key_emb, value_emb FROM records ORDER BY id").fetchall()
        ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        keys, values = embeddings_of_rows([(r[1], r[2]) for r in rows], dim, value_dim)
        return ids, np.full(len(ids), -1, dtype=np.int64), keys, values

    def read_rows(self, conn: sqlite3.Connection, ids: Sequence[int], dim: int, value_dim: int) -> Rows:
        """The stored records among ``ids`` in id order: rows (id, key, -1: no slot), keys (r, dim), values.

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
    """Key and value embeddings from (key_emb, value_emb) blobs of rows of the earliest format.

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
