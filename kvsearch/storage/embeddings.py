"""Where a store keeps its records' embeddings: one interface (:class:`Vectors`), two layouts, chosen once at open.

- :class:`FileVectors`: an on-disk store's file sets (:mod:`kvsearch.storage.vector_file`): mapped, shared by every
  process through the page cache, append-only.
- :class:`ChunkVectors`: SQLite chunks (:mod:`kvsearch.storage.chunks`): an in-memory store's (nothing to share, a
  chunk is written in place), and an on-disk store of the chunk format opened read-only (read as it is).

Older formats are moved or read by :mod:`kvsearch.storage.migrate`, which also picks the layout at open. Writes run
inside the store's transaction and return the slots the records table must name; the caller points the records at
them in the same transaction. Reads run inside the caller's snapshot.

The records' slot pointers are read and moved here too (:func:`slots_of`, :func:`point_at`). This module knows SQL,
files and arrays: nothing of tensors, versions or the in-memory table.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from kvsearch.storage import chunks
from kvsearch.storage.schema import select_in
from kvsearch.storage.vector_file import VectorFiles

__all__ = ["Vectors", "FileVectors", "ChunkVectors", "Rows", "has_chunks", "rows_of_ids", "slots_of", "point_at"]

#: (id, key text, slot) rows of the records table, and their keys (r, dim) and values (r, value_dim).
Rows = tuple[list[tuple[int, "str | None", int]], np.ndarray, np.ndarray]
#: ids (n,), keys (n, dim), values (n, value_dim) on shared mappings, in id order, and the first record's slot.
SharedViews = tuple[np.ndarray, np.ndarray, np.ndarray, int]


class Vectors(Protocol):
    """What a store writes its embeddings through and reads them back from (one layout, picked at open).

    Attributes:
        slotted: whether the records table names each record's slot (checked against the records summary on load).
    """

    slotted: bool

    def current(self, conn: sqlite3.Connection) -> bool:
        """Whether the store on disk is still of this layout (another process may have moved a read-only one's)."""
        ...

    def append(self, conn: sqlite3.Connection, ids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Store new records' embeddings: (n,) their slots."""
        ...

    def replace(
        self, conn: sqlite3.Connection, slots: np.ndarray, ids: np.ndarray, keys: np.ndarray, values: np.ndarray
    ) -> np.ndarray | None:
        """Give stored records new embeddings: their new slots (n,), or None when they kept their slots."""
        ...

    def erase(self, conn: sqlite3.Connection, slots: np.ndarray) -> None:
        """Forget the embeddings of deleted records."""
        ...

    def write_all(
        self, conn: sqlite3.Connection, keys: np.ndarray | None, values: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Overwrite every record's key and/or value embedding (rows in id order): (ids, new slots) if they moved."""
        ...

    def repack_if_needed(self, conn: sqlite3.Connection, dim: int, value_dim: int) -> tuple[np.ndarray, ...] | None:
        """Write the records again once emptied slots outnumber them: (ids, new slots), or None (not needed)."""
        ...

    def clear(self, conn: sqlite3.Connection) -> None:
        """Forget every embedding."""
        ...

    def untidy(self, conn: sqlite3.Connection) -> bool:
        """Whether files no committed state names are there to remove (:meth:`tidy`)."""
        ...

    def tidy(self, conn: sqlite3.Connection) -> None:
        """Remove what no committed state names any more (after a switch, at a writable open)."""
        ...

    def check_tail(self, conn: sqlite3.Connection) -> None:
        """At a writable open: check the last committed writes reached the disk (raises CorruptDatabaseError)."""
        ...

    def read_all(
        self, conn: sqlite3.Connection, dim: int, value_dim: int, *, alloc: Callable | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """ids, slots, keys, values of every record, copied, in slot order (``alloc(rows, width)`` gives the float32
        arrays to copy keys / values into)."""
        ...

    def read_rows(self, conn: sqlite3.Connection, ids: Sequence[int], dim: int, value_dim: int) -> Rows:
        """The stored records among ``ids`` in id order (those not stored left out): rows (id, key, slot), keys,
        values."""
        ...

    def views(
        self, conn: sqlite3.Connection, dim: int | None = None, value_dim: int | None = None
    ) -> SharedViews | None:
        """Every record on shared mappings (see :data:`SharedViews`), or None: copy them with :meth:`read_all`."""
        ...

    def release(self) -> None:
        """Let go of any file mapping (at close)."""
        ...


class FileVectors(VectorFiles):
    """An on-disk store's file sets, as :class:`Vectors` (see :class:`~kvsearch.storage.vector_file.VectorFiles`).

    Args:
        store_path: the store's SQLite file. writable: whether this process may write the files.
    """

    slotted = True

    def __init__(self, store_path: Path, *, writable: bool) -> None:
        super().__init__(store_path, writable=writable)

    def current(self, conn: sqlite3.Connection) -> bool:
        return True  # the newest layout

    def repack_if_needed(self, conn: sqlite3.Connection, dim: int, value_dim: int) -> tuple[np.ndarray, ...] | None:
        return self.repack(conn) if self.needs_repack(conn) else None

    def clear(self, conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM chunks")
        conn.execute("DELETE FROM chunk_data")
        super().clear(conn)

    def tidy(self, conn: sqlite3.Connection) -> None:
        self.remove_stale(conn)

    def read_rows(self, conn: sqlite3.Connection, ids: Sequence[int], dim: int, value_dim: int) -> Rows:
        rows = rows_of_ids(conn, ids)
        keys, values = self.read(conn, np.array([r[2] for r in rows], dtype=np.int64), dim, value_dim)
        return rows, keys, values


class ChunkVectors:
    """SQLite chunks, as :class:`Vectors`: an in-memory store's, or an on-disk chunk-format store's read-only.

    Args:
        on_disk: whether the store is on disk (then read-only, until another process moves it to file sets).
    """

    slotted = True

    def __init__(self, *, on_disk: bool = False) -> None:
        self.on_disk = on_disk

    def current(self, conn: sqlite3.Connection) -> bool:
        return not self.on_disk or not VectorFiles.in_use(conn)

    def append(self, conn: sqlite3.Connection, ids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        return chunks.append(conn, ids, keys, values)

    def replace(
        self, conn: sqlite3.Connection, slots: np.ndarray, ids: np.ndarray, keys: np.ndarray, values: np.ndarray
    ) -> np.ndarray | None:
        chunks.write(conn, slots, keys, values)
        return None

    def erase(self, conn: sqlite3.Connection, slots: np.ndarray) -> None:
        chunks.erase(conn, slots)

    def write_all(
        self, conn: sqlite3.Connection, keys: np.ndarray | None, values: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        chunks.write_all(conn, keys, values)
        return None

    def repack_if_needed(self, conn: sqlite3.Connection, dim: int, value_dim: int) -> tuple[np.ndarray, ...] | None:
        return chunks.repack(conn, dim, value_dim) if chunks.needs_repack(conn) else None

    def clear(self, conn: sqlite3.Connection) -> None:
        conn.execute("DELETE FROM chunks")
        conn.execute("DELETE FROM chunk_data")

    def untidy(self, conn: sqlite3.Connection) -> bool:
        return False

    def tidy(self, conn: sqlite3.Connection) -> None:
        return None

    def check_tail(self, conn: sqlite3.Connection) -> None:
        return None

    def read_all(
        self, conn: sqlite3.Connection, dim: int, value_dim: int, *, alloc: Callable | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return chunks.read_all(conn, dim, value_dim, alloc=alloc)

    def read_rows(self, conn: sqlite3.Connection, ids: Sequence[int], dim: int, value_dim: int) -> Rows:
        rows = rows_of_ids(conn, ids)
        keys, values = chunks.read(conn, np.array([r[2] for r in rows], dtype=np.int64), dim, value_dim)
        return rows, keys, values

    def views(self, conn: sqlite3.Connection, dim: int | None = None, value_dim: int | None = None) -> None:
        return None  # nothing shared: chunks are read into this process's memory

    def release(self) -> None:
        return None


def rows_of_ids(conn: sqlite3.Connection, ids: Sequence[int]) -> list[tuple[int, str | None, int]]:
    """The (id, key text, slot) rows of the stored records among ``ids``, in id order."""
    return sorted(select_in(conn, "SELECT id, key, slot FROM records WHERE id IN ({})", ids))


def has_chunks(conn: sqlite3.Connection) -> bool:
    """Whether the store has embeddings in SQLite chunks."""
    try:
        return conn.execute("SELECT 1 FROM chunks LIMIT 1").fetchone() is not None
    except sqlite3.OperationalError:
        return False


def slots_of(conn: sqlite3.Connection, ids: Sequence[int]) -> np.ndarray:
    """(n,) the slots the records table names for stored ids, in the order given."""
    slot_of = dict(select_in(conn, "SELECT id, slot FROM records WHERE id IN ({})", [int(i) for i in ids]))
    return np.array([slot_of[int(i)] for i in ids], dtype=np.int64)


def point_at(conn: sqlite3.Connection, ids: np.ndarray, slots: np.ndarray, old: np.ndarray | None = None) -> None:
    """Point records at new slots (inside the transaction that moved their embeddings), skipping unmoved ones.

    Args:
        conn: the store's connection. ids: (n,) stored ids. slots: (n,) their new slots. old: (n,) their current
            slots, if the caller read them.
    """
    if old is None and len(ids) > 4096:  # many (a new file set): one ordered read of every record's slot
        held = np.array(conn.execute("SELECT id, slot FROM records ORDER BY id").fetchall(), np.int64)
        held = held.reshape(-1, 2)  # (r, 2) id, slot
        old = held[np.searchsorted(held[:, 0], ids), 1]
    elif old is None:
        old = slots_of(conn, ids)
    moved = np.flatnonzero(old != slots)
    pairs = zip(slots[moved].tolist(), ids[moved].tolist())
    conn.executemany("UPDATE records SET slot = ? WHERE id = ?", pairs)
