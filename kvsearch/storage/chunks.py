"""The records' embeddings, stored once, in SQLite: chunks of slots, each read whole at open.

Every record's key and value embeddings live in one *slot*; ``records.slot`` names it. Slots are grouped into
chunks, each two rows of two tables::

    chunks     (first INTEGER PRIMARY KEY, capacity, used, live)   small: updated on every write
    chunk_data (first INTEGER PRIMARY KEY, ids, keys, vals)        three blobs of their full size from the start

``first`` is the chunk's first slot; ``capacity`` its number of slots; ``used`` how many of them were handed out
(from the start, never reused); ``live`` how many hold a stored record. ``ids`` is the slots' record ids (int64,
0 for an emptied or unused slot), ``keys`` (capacity, dim) and ``vals`` (capacity, value_dim) float32.

Writes change the blobs in place with SQLite's incremental blob I/O (``Connection.blobopen``) inside the store's
own transaction, so an embedding is as crash-safe as any other row and there is no second copy to keep in step.
The small ``chunks`` row carries the counts because an UPDATE rewrites a whole row, blobs included. Opening reads
each chunk's blobs whole (about 3 GB/s here, against ~10 s per million records read as rows).

A new record always takes the next slot, and ids only grow, so slot order is id order: the live slots read in
order are the records sorted by id (:func:`read_all`). A deleted record's slot is emptied (id 0); a chunk left
with no record is dropped, and once empty slots outnumber live ones (:func:`needs_repack`), :func:`repack` writes
the live rows again after the last chunk, in order. A new chunk has a sixteenth as many slots as the store has live
records, rounded up to a power of two (at least :data:`MIN_SLOTS`, at most what fits :data:`MAX_CHUNK_BYTES` of
keys): the unused tail, at most one chunk, stays under an eighth of the store, and a large store has few chunks.

This module knows SQL and arrays only: nothing of tensors, texts or the records table.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator

import numpy as np

from kvsearch.errors import CorruptDatabaseError

__all__ = [
    "SCHEMA",
    "MIN_SLOTS",
    "MAX_CHUNK_BYTES",
    "append",
    "write",
    "erase",
    "read",
    "read_all",
    "write_all",
    "needs_repack",
    "repack",
    "live_count",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    first INTEGER PRIMARY KEY,
    capacity INTEGER NOT NULL,
    used INTEGER NOT NULL,
    live INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS chunk_data (
    first INTEGER PRIMARY KEY,
    ids BLOB NOT NULL,
    keys BLOB NOT NULL,
    vals BLOB NOT NULL
);
"""

#: The fewest slots a chunk has.
MIN_SLOTS = 64
#: The most bytes of keys (or of values, if wider) a chunk holds: its slots are the largest power of two that fits.
#: Small, because a read or write at an offset inside a blob walks the blob's chain of overflow pages from its start
#: (32 pages of 16 KiB here): a catch-up's or an append's few rows cost tens of microseconds, not a chain of 6 MB.
MAX_CHUNK_BYTES = 512 << 10
#: Above this share of a chunk's slots, a scattered read or write moves the whole blob instead of row by row.
_WHOLE_BLOB_SHARE = 1 / 8

_ID = np.dtype("<i8")
_FLOAT = np.dtype("<f4")


def _max_slots(width: int) -> int:
    """The most slots of a chunk whose widest blob has ``width`` floats a slot."""
    slots = MIN_SLOTS
    while slots * 2 * width * _FLOAT.itemsize <= MAX_CHUNK_BYTES:
        slots *= 2
    return slots


def _layout(conn: sqlite3.Connection, slots: np.ndarray | None = None) -> np.ndarray:
    """(c, 4) int64: first, capacity, used, live of every chunk, in slot order; with ``slots`` (n,), of the chunks
    that may hold them only (a range of the chunks' key: a catch-up of a few rows reads a few rows here)."""
    sql = "SELECT first, capacity, used, live FROM chunks"
    if slots is None or not len(slots):
        rows = conn.execute(sql + " ORDER BY first").fetchall()
    else:
        widest = conn.execute("SELECT coalesce(max(capacity), 0) FROM chunks").fetchone()[0]  # small: ~1 page
        lo, hi = int(slots.min()) - widest, int(slots.max())
        rows = conn.execute(sql + " WHERE first BETWEEN ? AND ? ORDER BY first", (lo, hi)).fetchall()
    return np.array(rows, dtype=np.int64).reshape(-1, 4)


def _chunk_of(layout: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Row of ``layout`` holding each slot: (n,) int64.

    Raises:
        CorruptDatabaseError: a slot lies in no chunk (the records table names a slot that was never written).
    """
    pos = np.searchsorted(layout[:, 0], slots, side="right") - 1  # (n,)
    bad = (pos < 0) | (slots >= layout[pos.clip(min=0), 0] + layout[pos.clip(min=0), 2])
    if len(slots) and bool(bad.any()):
        raise CorruptDatabaseError(f"the store names embedding slots that hold nothing: {slots[bad][:5].tolist()}")
    return pos


def _blob(conn: sqlite3.Connection, column: str, first: int, expected: int, *, readonly: bool) -> sqlite3.Blob:
    """An open handle on one chunk's blob, checked to have ``expected`` bytes."""
    try:
        blob = conn.blobopen("chunk_data", column, int(first), readonly=readonly)
    except sqlite3.OperationalError as exc:
        if "no such rowid" not in str(exc):
            raise
        raise CorruptDatabaseError(f"the embeddings chunk at slot {first} has no {column} ({exc})") from None
    if len(blob) != expected:
        size = len(blob)
        blob.close()
        raise CorruptDatabaseError(
            f"the embeddings chunk at slot {first} has {size} bytes of {column}, expected {expected} (the store "
            "was damaged, or written with other dims)"
        )
    return blob


def _columns(dim: int, value_dim: int) -> tuple[tuple[str, int, np.dtype], ...]:
    """(column, values per slot, dtype) of each blob."""
    return (("ids", 1, _ID), ("keys", dim, _FLOAT), ("vals", value_dim, _FLOAT))


def _read_rows(
    conn: sqlite3.Connection, first: int, capacity: int, column: str, width: int, dtype: np.dtype, start: int, stop: int
) -> np.ndarray:
    """Slots ``start:stop`` (offsets in the chunk) of one column: (stop - start, width), a fresh array."""
    row = width * dtype.itemsize
    with _blob(conn, column, first, capacity * row, readonly=True) as blob:
        blob.seek(start * row)
        data = blob.read((stop - start) * row)
    return np.frombuffer(data, dtype=dtype).reshape(stop - start, width)


def _write_rows(
    conn: sqlite3.Connection, first: int, capacity: int, column: str, array: np.ndarray, start: int
) -> None:
    """Overwrite slots ``start : start + len(array)`` of one column with ``array`` (rows of the column's width)."""
    data = np.ascontiguousarray(array)
    row = data.nbytes // max(1, len(data))
    width = 1 if data.ndim == 1 else data.shape[1]
    with _blob(conn, column, first, capacity * width * data.itemsize, readonly=False) as blob:
        blob.seek(start * row)
        blob.write(data)


def _patch(
    conn: sqlite3.Connection, first: int, capacity: int, column: str, offsets: np.ndarray, rows: np.ndarray
) -> None:
    """Overwrite the slots at ``offsets`` (g,) of one column with ``rows`` (g, width): a run of consecutive slots
    (the oldest records of a kNN memory) by one write, many others by reading, changing and writing the whole blob
    once, a few row by row."""
    if len(offsets) > 1 and bool((np.diff(offsets) == 1).all()):
        _write_rows(conn, first, capacity, column, rows, int(offsets[0]))
    elif len(offsets) > capacity * _WHOLE_BLOB_SHARE:
        whole = _read_rows(conn, first, capacity, column, rows.shape[1], rows.dtype, 0, capacity).copy()
        whole[offsets] = rows
        _write_rows(conn, first, capacity, column, whole, 0)
    else:
        for offset, one in zip(offsets.tolist(), rows):
            _write_rows(conn, first, capacity, column, one[None], offset)


def _new_chunk(
    conn: sqlite3.Connection, first: int, capacity: int, ids: np.ndarray, keys: np.ndarray, values: np.ndarray
) -> None:
    """Insert a chunk of ``capacity`` slots whose first ``len(ids)`` slots hold these rows (the rest zeros)."""
    n = len(ids)
    padded = []
    for array in (ids, keys, values):
        out = np.zeros((capacity, *array.shape[1:]), dtype=array.dtype)
        out[:n] = array
        padded.append(out)
    conn.execute("INSERT INTO chunks (first, capacity, used, live) VALUES (?, ?, ?, ?)", (first, capacity, n, n))
    conn.execute("INSERT INTO chunk_data (first, ids, keys, vals) VALUES (?, ?, ?, ?)", (first, *padded))


def live_count(conn: sqlite3.Connection) -> int:
    """How many slots hold a record."""
    return int(conn.execute("SELECT coalesce(sum(live), 0) FROM chunks").fetchone()[0])


def append(conn: sqlite3.Connection, ids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Store new records in the next slots (inside the caller's transaction).

    Args:
        ids: (n,) int64, each larger than every stored id (slot order stays id order).
        keys: (n, dim) float32. values: (n, value_dim) float32.

    Returns:
        (n,) int64: the slot of each record.
    """
    ids = np.asarray(ids, dtype=_ID)
    keys = np.asarray(keys, dtype=_FLOAT)
    values = np.asarray(values, dtype=_FLOAT)
    n, dim = keys.shape
    slots = np.empty(n, dtype=np.int64)
    tail = conn.execute("SELECT first, capacity, used FROM chunks ORDER BY first DESC LIMIT 1").fetchone()
    done = 0
    if tail is not None and tail[2] < tail[1] and n:
        first, capacity, used = tail
        done = min(n, capacity - used)
        for column, array in zip(("ids", "keys", "vals"), (ids, keys, values)):
            _write_rows(conn, first, capacity, column, array[:done], used)
        conn.execute("UPDATE chunks SET used = used + ?, live = live + ? WHERE first = ?", (done, done, first))
        slots[:done] = np.arange(first + used, first + used + done)
    next_first = 0 if tail is None else tail[0] + tail[1]
    live = live_count(conn) if done < n else 0
    while done < n:
        capacity = min(_max_slots(max(dim, values.shape[1])), max(MIN_SLOTS, 1 << max(0, live // 16 - 1).bit_length()))
        take = min(n - done, capacity)
        part = slice(done, done + take)
        _new_chunk(conn, next_first, capacity, ids[part], keys[part], values[part])
        slots[part] = np.arange(next_first, next_first + take)
        next_first += capacity
        live += take
        done += take
    return slots


def _by_chunk(layout: np.ndarray, slots: np.ndarray) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """(first, capacity, positions in ``slots``, offsets in the chunk) for every chunk holding some of ``slots``."""
    chunk = _chunk_of(layout, slots)  # (n,)
    order = np.argsort(chunk, kind="stable")
    bounds = np.flatnonzero(np.diff(chunk[order])) + 1
    for group in np.split(order, bounds) if len(order) else []:
        first, capacity = int(layout[chunk[group[0]], 0]), int(layout[chunk[group[0]], 1])
        yield first, capacity, group, slots[group] - first


def write(
    conn: sqlite3.Connection, slots: np.ndarray, keys: np.ndarray | None = None, values: np.ndarray | None = None
) -> None:
    """Overwrite the embeddings of stored records in place (inside the caller's transaction).

    Args:
        slots: (n,) the records' slots (``records.slot``).
        keys: (n, dim) float32 or None to keep. values: (n, value_dim) float32 or None to keep.

    Raises:
        CorruptDatabaseError: a slot is in no chunk, or a chunk's blobs do not have the expected size.
    """
    slots = np.asarray(slots, dtype=np.int64)
    for first, capacity, group, offsets in _by_chunk(_layout(conn, slots), slots):
        for column, array in (("keys", keys), ("vals", values)):
            if array is None:
                continue
            _patch(conn, first, capacity, column, offsets, np.asarray(array, dtype=_FLOAT)[group])


def erase(conn: sqlite3.Connection, slots: np.ndarray) -> None:
    """Empty the slots of deleted records; drop every chunk, but the last, left with no record.

    Args:
        slots: (n,) distinct slots of stored records.
    """
    slots = np.asarray(slots, dtype=np.int64)
    for first, capacity, group, offsets in _by_chunk(_layout(conn, slots), slots):
        _patch(conn, first, capacity, "ids", offsets, np.zeros((len(group), 1), dtype=_ID))
        conn.execute("UPDATE chunks SET live = live - ? WHERE first = ?", (len(group), first))
    last = "(SELECT max(first) FROM chunks)"
    conn.execute(f"DELETE FROM chunk_data WHERE first IN (SELECT first FROM chunks WHERE live = 0 AND first < {last})")
    conn.execute(f"DELETE FROM chunks WHERE live = 0 AND first < {last}")


def _live_rows(
    conn: sqlite3.Connection, chunk: np.ndarray, dim: int, value_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids (m,), slots (m,), keys (m, dim), values (m, value_dim)) of one chunk's live slots, in slot order."""
    first, capacity, used, live = (int(x) for x in chunk)
    parts = [
        _read_rows(conn, first, capacity, column, width, dtype, 0, used)
        for column, width, dtype in _columns(dim, value_dim)
    ]
    ids = parts[0][:, 0]
    keep = ids != 0  # (used,)
    if int(keep.sum()) != live:
        raise CorruptDatabaseError(
            f"the embeddings chunk at slot {first} holds {int(keep.sum())} records, its count says {live}"
        )
    slots = np.arange(first, first + used, dtype=np.int64)
    if live == used:
        return ids, slots, parts[1], parts[2]
    return ids[keep], slots[keep], parts[1][keep], parts[2][keep]


def read_all(
    conn: sqlite3.Connection, dim: int, value_dim: int, *, alloc: Callable[[int, int], np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every stored record's id, slot and embeddings, in slot (= id) order.

    Args:
        alloc: ``alloc(rows, width)`` gives the float32 array (rows, width) to read the keys / values into (e.g.
            the view of a buffer with room to grow); None: new arrays.

    Returns:
        ids (n,) int64, slots (n,) int64, keys (n, dim) float32, values (n, value_dim) float32: arrays of their own.

    Raises:
        CorruptDatabaseError: a chunk's blobs do not have the expected size, or its count of records is wrong.
    """
    layout = _layout(conn)
    n = int(layout[:, 3].sum())
    ids, slots = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    alloc = alloc or (lambda rows, width: np.empty((rows, width), dtype=np.float32))
    keys, values = alloc(n, dim), alloc(n, value_dim)
    pos = 0
    for chunk in layout:
        part = _live_rows(conn, chunk, dim, value_dim)
        m = len(part[0])
        ids[pos : pos + m], slots[pos : pos + m], keys[pos : pos + m], values[pos : pos + m] = part
        pos += m
    return ids, slots, keys, values


def read(conn: sqlite3.Connection, slots: np.ndarray, dim: int, value_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The embeddings in some slots, in the order given.

    Args:
        slots: (n,) slots of stored records.

    Returns:
        keys (n, dim) and values (n, value_dim), float32 arrays of their own.

    Raises:
        CorruptDatabaseError: a slot is in no chunk, or a chunk's blobs do not have the expected size.
    """
    slots = np.asarray(slots, dtype=np.int64)
    keys = np.empty((len(slots), dim), dtype=np.float32)
    values = np.empty((len(slots), value_dim), dtype=np.float32)
    for first, capacity, group, offsets in _by_chunk(_layout(conn, slots), slots):
        lo, hi = int(offsets.min()), int(offsets.max()) + 1
        for column, out in (("keys", keys), ("vals", values)):
            width = out.shape[1]
            if len(group) > capacity * _WHOLE_BLOB_SHARE or hi - lo <= 4 * len(group):  # dense: one read of the span
                out[group] = _read_rows(conn, first, capacity, column, width, _FLOAT, lo, hi)[offsets - lo]
            else:
                for position, offset in zip(group.tolist(), offsets.tolist()):
                    out[position] = _read_rows(conn, first, capacity, column, width, _FLOAT, offset, offset + 1)[0]
    return keys, values


def write_all(conn: sqlite3.Connection, keys: np.ndarray | None = None, values: np.ndarray | None = None) -> None:
    """Overwrite every stored record's key and/or value embedding (a generation switch).

    Args:
        keys: (n, dim) float32 in id order (every stored record), or None to keep.
        values: (n, value_dim) float32 in id order, or None to keep.

    Raises:
        CorruptDatabaseError: the arrays do not have one row per stored record, or a chunk is damaged.
    """
    layout = _layout(conn)
    n = int(layout[:, 3].sum())
    for array in (keys, values):
        if array is not None and len(array) != n:
            raise CorruptDatabaseError(f"expected embeddings for the {n} stored records, got {len(array)}")
    pos = 0
    for first, capacity, used, live in layout.tolist():
        ids = _read_rows(conn, first, capacity, "ids", 1, _ID, 0, used)[:, 0]
        keep = np.flatnonzero(ids != 0)  # (live,) offsets of the live slots
        for column, array in (("keys", keys), ("vals", values)):
            if array is None:
                continue
            rows = np.asarray(array[pos : pos + live], dtype=_FLOAT)  # (live, width)
            if len(keep) == used:
                _write_rows(conn, first, capacity, column, rows, 0)
            else:
                _patch(conn, first, capacity, column, keep, rows)
        pos += live


def needs_repack(conn: sqlite3.Connection) -> bool:
    """Whether emptied slots outnumber the records (and fill more than one chunk): time for :func:`repack`."""
    used, live = conn.execute("SELECT coalesce(sum(used), 0), coalesce(sum(live), 0) FROM chunks").fetchone()
    holes = used - live
    return holes > live and holes > MIN_SLOTS


def repack(conn: sqlite3.Connection, dim: int, value_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Write the live rows again into new chunks after the last one, in order, and drop the old chunks.

    One chunk is read at a time (memory: one chunk, not the store). The caller points ``records.slot`` at the new
    slots in the same transaction.

    Returns:
        ids (n,) and their new slots (n,), int64, in id order.
    """
    old = _layout(conn)
    if not len(old):
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    # The last chunk counts as full, so that the moved rows go after it, never into its free slots.
    conn.execute("UPDATE chunks SET used = capacity WHERE first = ?", (int(old[-1, 0]),))
    moved_ids, moved_slots = [], []
    for chunk in old:
        ids, _, keys, values = _live_rows(conn, chunk, dim, value_dim)
        conn.execute("DELETE FROM chunk_data WHERE first = ?", (int(chunk[0]),))
        conn.execute("DELETE FROM chunks WHERE first = ?", (int(chunk[0]),))
        moved_ids.append(ids)
        moved_slots.append(append(conn, ids, keys, values))
    return np.concatenate(moved_ids), np.concatenate(moved_slots)
