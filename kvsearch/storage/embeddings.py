"""Where a store keeps its records' embeddings: file sets that processes map, or SQLite chunks.

:class:`Embeddings` is the one object the store and its mirror call to write and read embeddings by slot. It picks
the layout once per open:

- an on-disk store keeps them in file sets (:mod:`kvsearch.storage.vector_file`): mapped, shared by every process
  through the page cache, append-only. A store of the chunk format that is opened for writing is moved there at
  open (:meth:`Embeddings.move_from_chunks`, one transaction); opened read-only it is read as it is.
- an in-memory store keeps them in SQLite chunks (:mod:`kvsearch.storage.chunks`): nothing to share, and a
  chunk is written in place.

Writes run inside the store's transaction and return the slots the records table must name; the caller points the
records at them in the same transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvsearch.storage import chunks
from kvsearch.storage.vector_file import VectorFiles

__all__ = ["Embeddings"]


class Embeddings:
    """The embeddings of one store, in file sets (on disk) or chunks (in memory, or an unmoved store read-only).

    Args:
        store_path: the store's SQLite file, or None in memory.
        conn: the store's connection (to see which layout the store has).
        writable: whether the store may be written.

    Attributes:
        files: the file sets (:class:`~kvsearch.storage.vector_file.VectorFiles`), or None when in chunks.
    """

    def __init__(self, store_path: Path | None, conn: sqlite3.Connection, *, writable: bool) -> None:
        self.store_path = store_path
        self.files: VectorFiles | None = None
        if store_path is not None:
            self.files = VectorFiles(store_path, writable=writable)
            if not writable and not VectorFiles.in_use(conn) and _has_chunks(conn):
                self.files = None  # the chunk format, read-only: read as it is

    def follow(self, conn: sqlite3.Connection) -> None:
        """Notice that another process moved a chunk-format store to file sets (a read-only store reads them)."""
        if self.files is None and self.store_path is not None and VectorFiles.in_use(conn):
            self.files = VectorFiles(self.store_path, writable=False)

    def append(self, conn: sqlite3.Connection, ids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Store new records' embeddings: (n,) their slots."""
        if self.files is None:
            return chunks.append(conn, ids, keys, values)
        return self.files.append(conn, ids, keys, values)

    def replace(
        self, conn: sqlite3.Connection, slots: np.ndarray, ids: np.ndarray, keys: np.ndarray, values: np.ndarray
    ) -> np.ndarray | None:
        """Give stored records new embeddings: their new slots (n,), or None when they kept their slots."""
        if self.files is None:
            chunks.write(conn, slots, keys, values)
            return None
        return self.files.replace(conn, slots, ids, keys, values)

    def erase(self, conn: sqlite3.Connection, slots: np.ndarray) -> None:
        """Forget the embeddings of deleted records."""
        if self.files is None:
            chunks.erase(conn, slots)
        else:
            self.files.erase(conn, slots)

    def write_all(
        self, conn: sqlite3.Connection, keys: np.ndarray | None, values: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Overwrite every record's key and/or value embedding (rows in id order): (ids, new slots) if they moved."""
        if self.files is None:
            chunks.write_all(conn, keys, values)
            return None
        return self.files.write_all(conn, keys, values)

    def repack_if_needed(self, conn: sqlite3.Connection, dim: int, value_dim: int) -> tuple[np.ndarray, ...] | None:
        """Write the records again once emptied slots outnumber them: (ids, new slots), or None (not needed)."""
        if self.files is None:
            return chunks.repack(conn, dim, value_dim) if chunks.needs_repack(conn) else None
        return self.files.repack(conn) if self.files.needs_repack(conn) else None

    def clear(self, conn: sqlite3.Connection) -> None:
        """Forget every embedding."""
        conn.execute("DELETE FROM chunks")
        conn.execute("DELETE FROM chunk_data")
        if self.files is not None:
            self.files.clear(conn)

    def after_commit(self, conn: sqlite3.Connection) -> None:
        """Remove the file sets no committed state names any more (after a switch, at a writable open)."""
        if self.files is not None:
            self.files.remove_stale(conn)

    def read_all(
        self, conn: sqlite3.Connection, dim: int, value_dim: int, *, alloc: Callable | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """ids, slots, keys, values of every record, copied, in slot order (see ``chunks.read_all``)."""
        if self.files is None:
            return chunks.read_all(conn, dim, value_dim, alloc=alloc)
        return self.files.read_all(conn, dim, value_dim, alloc=alloc)

    def views(
        self, conn: sqlite3.Connection, dim: int | None = None, value_dim: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        """ids, keys, values of every record in id order on shared mappings and the first one's slot, or None (in
        chunks, or not one run of slots: copy with :meth:`read_all`)."""
        return None if self.files is None else self.files.views(conn, dim, value_dim)

    def read(self, conn: sqlite3.Connection, slots: np.ndarray, dim: int, value_dim: int) -> tuple[np.ndarray, ...]:
        """keys (n, dim), values (n, value_dim) of some slots, copied, in the order given."""
        if self.files is None:
            return chunks.read(conn, slots, dim, value_dim)
        return self.files.read(conn, slots, dim, value_dim)

    def holds_chunks(self, conn: sqlite3.Connection) -> bool:
        """Whether an on-disk store still has its embeddings in SQLite chunks (to move: :meth:`move_from_chunks`)."""
        return self.files is not None and not VectorFiles.in_use(conn) and _has_chunks(conn)

    def move_from_chunks(self, conn: sqlite3.Connection) -> np.ndarray | None:
        """Move a chunk-format store's embeddings to a file set (inside the caller's transaction).

        Returns:
            (n, 2) int64 rows (id, new slot) for the records table, or None when there was nothing to move.
        """
        if self.files is None or VectorFiles.in_use(conn) or not _has_chunks(conn):
            return None
        dims = conn.execute("SELECT length(keys), length(vals), capacity FROM chunk_data JOIN chunks USING (first)")
        row = dims.fetchone()
        dim, value_dim = row[0] // 4 // row[2], row[1] // 4 // row[2]
        ids, _, keys, values = chunks.read_all(conn, dim, value_dim)
        order = np.argsort(ids, kind="stable")
        slots = self.files.rewrite(conn, ids[order], keys[order], values[order])
        conn.execute("DELETE FROM chunks")
        conn.execute("DELETE FROM chunk_data")
        return np.c_[ids[order], slots]


def _has_chunks(conn: sqlite3.Connection) -> bool:
    """Whether the store has embeddings in SQLite chunks."""
    try:
        return conn.execute("SELECT 1 FROM chunks LIMIT 1").fetchone() is not None
    except sqlite3.OperationalError:
        return False
