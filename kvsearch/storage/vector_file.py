"""The records' embeddings of a store on disk, in files every process maps: one copy, shared by the page cache.

A store's embeddings live in a *file set* beside its SQLite file, three flat files of fixed-size rows, one row per
*slot*::

    store.sqlite.v<seq>.ids      int64 (the record id in each slot)
    store.sqlite.v<seq>.keys     float32 (dim per slot)
    store.sqlite.v<seq>.values   float32 (value_dim per slot)

SQLite stays the commit point and the single source of truth. Its ``vector_files`` row says which file set is
current (``seq``), how many slots of it are committed (``used``) and the dims; ``vector_holes`` lists the committed
slots no record holds any more; ``vector_segments`` has a CRC-32 of every appended run of slots. All three change in
the store's own transaction.

A file set is **append-only**: a new record takes the next slot (written past ``used``, synced to disk, then
``used`` grows in the transaction); a replaced embedding goes to a new slot and its old slot becomes a hole; a
deleted record's slot becomes a hole. A committed row is never written again, so a reader that maps the files sees
exactly the committed rows (it reads only slots below the ``used`` of its snapshot), and a crash leaves at most an
uncommitted tail past ``used``, which the next append overwrites and a writable open cuts off. Rewriting every row
(a generation switch, a repack once holes outnumber records, a clear) writes a new file set and switches ``seq`` in
the transaction; files of other sets are removed once no transaction names them (a reader that mapped one keeps
its pages: an unlinked file lives while it is mapped).

:meth:`VectorFiles.views` gives the committed rows as arrays *on the mapping* (``MAP_PRIVATE``: nothing is copied
and the page cache shares the pages between processes; a write to them would stay private to the process) when the
records hold one run of slots after a run of holes (a store built, appended to, or trimmed from its oldest end);
otherwise the caller copies the live rows (:meth:`VectorFiles.read_all`).

This module knows files, SQL and arrays only: nothing of tensors, texts or the records table.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sqlite3
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsearch.errors import CorruptDatabaseError
from kvsearch.storage import fileio

__all__ = ["SCHEMA", "VectorFiles", "FileState"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS vector_files (
    one INTEGER PRIMARY KEY CHECK (one = 0),
    seq INTEGER NOT NULL,
    used INTEGER NOT NULL,
    dim INTEGER NOT NULL,
    value_dim INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS vector_holes (slot INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS vector_segments (first INTEGER PRIMARY KEY, count INTEGER NOT NULL, crc INTEGER NOT NULL);
"""

#: The columns of a file set: (suffix, numpy dtype); the width of keys / values is the state's dim / value_dim.
COLUMNS = (("ids", np.dtype("<i8")), ("keys", np.dtype("<f4")), ("values", np.dtype("<f4")))
#: How many slots of a store's last segment :meth:`VectorFiles.check_tail` reads back at a writable open, at most.
TAIL_CHECK_SLOTS = 1 << 16


@dataclass(frozen=True)
class FileState:
    """The committed state of a store's vectors: file set ``seq``, its ``used`` slots, and the dims."""

    seq: int
    used: int
    dim: int
    value_dim: int

    def widths(self) -> tuple[int, int, int]:
        """Values per slot of each column: ids, keys, values."""
        return 1, self.dim, self.value_dim


class VectorFiles:
    """The vectors of one on-disk store: its file sets, their mappings, and their committed state in SQLite.

    Args:
        store_path: the store's SQLite file; the file sets lie beside it.
        writable: whether this process may write them (a read-only store maps only).
    """

    def __init__(self, store_path: Path, *, writable: bool) -> None:
        self.store_path = Path(store_path)
        self.writable = writable
        self._maps: dict[str, tuple[int, int, mmap.mmap]] = {}  # column -> (seq, bytes mapped, mapping)

    # ------------------------------------------------------------------ state

    @staticmethod
    def state(conn: sqlite3.Connection) -> FileState | None:
        """The committed state, or None when the store has no file set yet (no vector was ever written)."""
        row = conn.execute("SELECT seq, used, dim, value_dim FROM vector_files WHERE one = 0").fetchone()
        return None if row is None else FileState(*(int(x) for x in row))

    @staticmethod
    def in_use(conn: sqlite3.Connection) -> bool:
        """Whether the store keeps its vectors in file sets (a store of the chunk format does not, until moved)."""
        with contextlib.suppress(sqlite3.OperationalError):  # no such table: a store written before file sets
            return conn.execute("SELECT 1 FROM vector_files").fetchone() is not None
        return False

    def path(self, seq: int, column: str) -> Path:
        """The file of one column of file set ``seq``."""
        return self.store_path.with_name(f"{self.store_path.name}.v{seq}.{column}")

    @staticmethod
    def holes(conn: sqlite3.Connection) -> np.ndarray:
        """(h,) int64 sorted: the committed slots no record holds."""
        return np.array(conn.execute("SELECT slot FROM vector_holes ORDER BY slot").fetchall(), np.int64).reshape(-1)

    # ------------------------------------------------------------------ writing (inside the caller's transaction)

    def append(self, conn: sqlite3.Connection, ids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Write records into the next slots, synced to disk before the caller commits.

        Args:
            ids: (n,) int64. keys: (n, dim) float32. values: (n, value_dim) float32.

        Returns:
            (n,) int64: the slot of each record.

        Raises:
            CorruptDatabaseError: the dims differ from those of the stored vectors.
            OSError: the files cannot be written (a full disk: the caller rolls back).
        """
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        values = np.ascontiguousarray(values, dtype=np.float32)
        n = len(ids)
        state = self.state(conn)
        if state is None:
            state = FileState(1, 0, keys.shape[1], values.shape[1])
            conn.execute(
                "INSERT INTO vector_files (one, seq, used, dim, value_dim) VALUES (0, ?, 0, ?, ?)",
                (state.seq, state.dim, state.value_dim),
            )
        if (keys.shape[1], values.shape[1]) != (state.dim, state.value_dim):
            raise CorruptDatabaseError(
                f"expected embeddings of dims ({state.dim}, {state.value_dim}) as stored, got "
                f"({keys.shape[1]}, {values.shape[1]})"
            )
        if n:
            crc = 0
            for (column, _), array in zip(COLUMNS, (ids, keys, values)):
                data = array.tobytes()
                crc = zlib.crc32(data, crc)
                self._write_at(state.seq, column, state.used * (len(data) // n), data)
            conn.execute("INSERT INTO vector_segments (first, count, crc) VALUES (?, ?, ?)", (state.used, n, crc))
            conn.execute("UPDATE vector_files SET used = used + ? WHERE one = 0", (n,))
        return np.arange(state.used, state.used + n, dtype=np.int64)

    def _write_at(self, seq: int, column: str, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of a column file (made if absent) and sync it."""
        fd = os.open(self.path(seq, column), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            view = memoryview(data)
            while view:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def replace(
        self, conn: sqlite3.Connection, slots: np.ndarray, ids: np.ndarray, keys: np.ndarray, values: np.ndarray
    ) -> np.ndarray:
        """Give stored records new embeddings: new slots for them, their old slots become holes.

        Args:
            slots: (n,) their current slots. ids: (n,) their ids. keys: (n, dim). values: (n, value_dim).

        Returns:
            (n,) int64: their new slots (the caller points the records at them in the same transaction).
        """
        self.erase(conn, slots)
        return self.append(conn, ids, keys, values)

    @staticmethod
    def erase(conn: sqlite3.Connection, slots: np.ndarray) -> None:
        """Mark the slots of deleted (or moved) records as holes."""
        conn.executemany("INSERT INTO vector_holes (slot) VALUES (?)", ((int(s),) for s in np.asarray(slots)))

    def rewrite(self, conn: sqlite3.Connection, ids: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Write a new file set holding exactly these rows, in this order, and make it the current one.

        Args:
            ids: (n,) int64. keys: (n, dim) float32. values: (n, value_dim) float32.

        Returns:
            (n,) int64: the new slots, ``0 .. n - 1``.
        """
        state = self.state(conn)
        seq = 1 if state is None else state.seq + 1
        for column, _ in COLUMNS:  # a file left by a process that died before committing this seq
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(seq, column))
        conn.execute("DELETE FROM vector_files")
        conn.execute("DELETE FROM vector_holes")
        conn.execute("DELETE FROM vector_segments")
        conn.execute(
            "INSERT INTO vector_files (one, seq, used, dim, value_dim) VALUES (0, ?, 0, ?, ?)",
            (seq, keys.shape[1], values.shape[1]),
        )
        for column, _ in COLUMNS:  # each column's file exists, even empty
            self._write_at(seq, column, 0, b"")
        for start in range(0, len(ids), 1 << 16):  # a segment (and a CRC) per 65,536 rows
            part = slice(start, start + (1 << 16))
            self.append(conn, ids[part], keys[part], values[part])
        return np.arange(len(ids), dtype=np.int64)

    def write_all(
        self, conn: sqlite3.Connection, keys: np.ndarray | None, values: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Give every stored record new key and/or value embeddings (rows in id order): a new file set, in id order.

        Returns:
            ids (n,) and their new slots (n,), int64, in id order.

        Raises:
            CorruptDatabaseError: the arrays do not have one row per stored record.
        """
        state = self.state(conn)
        ids, slots, old_keys, old_values = self.read_all(conn, *(state.widths()[1:] if state else (0, 0)))
        for array in (keys, values):
            if array is not None and len(array) != len(ids):
                raise CorruptDatabaseError(f"expected embeddings for the {len(ids)} stored records, got {len(array)}")
        order = np.argsort(ids, kind="stable")  # slot order is id order unless records were replaced
        ids = ids[order]
        keys = old_keys[order] if keys is None else np.asarray(keys, dtype=np.float32)
        values = old_values[order] if values is None else np.asarray(values, dtype=np.float32)
        if state is None and not len(ids):
            return ids, ids.copy()
        return ids, self.rewrite(conn, ids, keys, values)

    @staticmethod
    def needs_repack(conn: sqlite3.Connection) -> bool:
        """Whether holes outnumber the records (and are more than a few): time for :meth:`repack`."""
        state = VectorFiles.state(conn)
        if state is None:
            return False
        holes = int(conn.execute("SELECT count(*) FROM vector_holes").fetchone()[0])
        return holes > state.used - holes and holes > 64

    def repack(self, conn: sqlite3.Connection) -> tuple[np.ndarray, np.ndarray]:
        """Write the records again, without holes and in id order, as a new file set.

        Returns:
            ids (n,) and their new slots (n,), int64, in id order (the caller points the records at them).
        """
        return self.write_all(conn, None, None)

    def clear(self, conn: sqlite3.Connection) -> None:
        """Forget every vector: a new, empty file set (the dims kept)."""
        state = self.state(conn)
        if state is not None:
            empty = np.empty((0, state.dim), np.float32), np.empty((0, state.value_dim), np.float32)
            self.rewrite(conn, np.empty(0, np.int64), *empty)

    def remove_stale(self, conn: sqlite3.Connection) -> None:
        """Remove the files of every file set but the committed one (after a switch committed, or at open), and cut
        the committed set's uncommitted tail (a writer that died before its commit)."""
        if not self.writable:
            return
        state = self.state(conn)
        prefix = f"{self.store_path.name}.v"
        for path in self.store_path.parent.glob(f"{prefix}*"):
            seq = path.name[len(prefix) :].split(".", 1)[0]
            if state is None or seq != str(state.seq):
                with contextlib.suppress(OSError):
                    path.unlink()
        if state is not None:
            for column, width, (_, dtype) in zip(("ids", "keys", "values"), state.widths(), COLUMNS):
                path = self.path(state.seq, column)
                with contextlib.suppress(OSError):
                    if path.stat().st_size > state.used * width * dtype.itemsize:
                        os.truncate(path, state.used * width * dtype.itemsize)

    def untidy(self, conn: sqlite3.Connection) -> bool:
        """Whether files of other file sets, or an uncommitted tail, are there to remove (:meth:`remove_stale`)."""
        state = self.state(conn)
        prefix = f"{self.store_path.name}.v"
        for path in self.store_path.parent.glob(f"{prefix}*"):
            if state is None or path.name[len(prefix) :].split(".", 1)[0] != str(state.seq):
                return True
        if state is None:
            return False
        for (column, dtype), width in zip(COLUMNS, state.widths()):
            with contextlib.suppress(OSError):
                if self.path(state.seq, column).stat().st_size > state.used * width * dtype.itemsize:
                    return True
        return False

    def release(self) -> None:
        """Forget the mappings of the files (at close): each holds a file descriptor until no array views it."""
        self._maps.clear()

    # ------------------------------------------------------------------ reading (inside the caller's snapshot)

    def _column(self, state: FileState, column: str, width: int, dtype: np.dtype) -> np.ndarray:
        """The committed rows of one column, on a private mapping of its file: (used, width), no copy.

        Raises:
            CorruptDatabaseError: the file is missing or shorter than the committed rows.
        """
        need = state.used * width * dtype.itemsize
        if not need:
            return np.empty((0, width), dtype=dtype)
        seq, size, mapping = self._maps.get(column, (0, 0, None))
        if seq != state.seq or size < need:
            path = self.path(state.seq, column)
            try:
                with fileio.storage_errors(path, "reading the vectors"):  # EMFILE: typed, never "corrupt"
                    fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptDatabaseError(f"{path} is missing: the store names its {state.used} vectors") from None
            try:
                size = os.fstat(fd).st_size
                if size < need:
                    raise CorruptDatabaseError(
                        f"{path} holds {size} bytes, the store names {need} ({state.used} slots of {width})"
                    )
                with fileio.storage_errors(path, "mapping the vectors"):  # mmap holds a descriptor of its own
                    mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._maps[column] = (state.seq, size, mapping)
        return np.frombuffer(mapping, dtype=dtype, count=state.used * width).reshape(state.used, width)

    def columns(
        self, conn: sqlite3.Connection, dim: int, value_dim: int, state: FileState | None = None
    ) -> tuple[np.ndarray, ...]:
        """Every committed slot's id (used,), key (used, dim) and value (used, value_dim): views of the mappings.

        Args:
            state: the committed state if the caller read it in this snapshot (else it is read here).

        Raises:
            CorruptDatabaseError: the stored dims are not these, or a file is missing or short.
        """
        state = state or self.state(conn)
        if state is None:
            return np.empty(0, np.int64), np.empty((0, dim), np.float32), np.empty((0, value_dim), np.float32)
        if (state.dim, state.value_dim) != (dim, value_dim):
            raise CorruptDatabaseError(
                f"expected embeddings of dims ({dim}, {value_dim}), the store's files hold ({state.dim}, "
                f"{state.value_dim})"
            )
        ids, keys, values = (
            self._column(state, column, width, dtype) for (column, dtype), width in zip(COLUMNS, state.widths())
        )
        return ids[:, 0], keys, values

    def views(
        self, conn: sqlite3.Connection, dim: int | None = None, value_dim: int | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        """ids (n,), keys (n, dim), values (n, value_dim) of every record in id order, on the mappings (no copy),
        and the slot of the first; None when the records do not hold one run of slots after the holes, in ascending
        id order (copy them with :meth:`read_all` then).

        Args:
            dim, value_dim: the dims expected (checked), or None: the stored ones.
        """
        state = self.state(conn)
        if state is None:
            return None
        dims = (state.dim if dim is None else dim, state.value_dim if value_dim is None else value_dim)
        count, last = conn.execute("SELECT count(*), coalesce(max(slot), -1) FROM vector_holes").fetchone()
        if last != count - 1:  # a hole after a record: not one run
            return None
        ids, keys, values = self.columns(conn, *dims, state=state)
        ids, keys, values = ids[count:], keys[count:], values[count:]
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            return None
        return ids, keys, values, int(count)

    def live_slots(self, conn: sqlite3.Connection) -> np.ndarray:
        """(n,) int64: the committed slots that hold a record, ascending."""
        state = self.state(conn)
        if state is None:
            return np.empty(0, np.int64)
        holes = self.holes(conn)
        if not len(holes):
            return np.arange(state.used, dtype=np.int64)
        keep = np.ones(state.used, dtype=bool)
        keep[holes[holes < state.used]] = False
        return np.flatnonzero(keep).astype(np.int64)

    def read_all(
        self, conn: sqlite3.Connection, dim: int, value_dim: int, *, alloc=None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every record's id, slot and embeddings, copied, in slot order.

        Args:
            alloc: ``alloc(rows, width)`` gives the float32 array to copy keys / values into; None: new arrays.

        Returns:
            ids (n,), slots (n,) int64, keys (n, dim), values (n, value_dim) float32: arrays of their own.
        """
        ids, keys, values = self.columns(conn, dim, value_dim)
        slots = self.live_slots(conn)
        alloc = alloc or (lambda rows, width: np.empty((rows, width), dtype=np.float32))
        out_keys, out_values = alloc(len(slots), dim), alloc(len(slots), value_dim)
        every = len(slots) == len(ids)
        out_keys[:] = keys if every else keys[slots]
        out_values[:] = values if every else values[slots]
        return ids[slots].copy(), slots, out_keys, out_values

    def read(self, conn: sqlite3.Connection, slots: np.ndarray, dim: int, value_dim: int) -> tuple[np.ndarray, ...]:
        """keys (n, dim) and values (n, value_dim) of some slots, in the order given, copied.

        Raises:
            CorruptDatabaseError: a slot is not a committed slot.
        """
        _, keys, values = self.columns(conn, dim, value_dim)
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= len(keys)):
            raise CorruptDatabaseError(f"the store names embedding slots that hold nothing: {slots[:5].tolist()}")
        return keys[slots], values[slots]

    def check_tail(self, conn: sqlite3.Connection) -> None:
        """Read back the last committed segment and compare its CRC-32 (a write lost before its commit reached the
        disk shows here first); the other segments are checked by :meth:`verify`.

        Raises:
            CorruptDatabaseError: it differs.
        """
        row = conn.execute("SELECT first, count, crc FROM vector_segments ORDER BY first DESC LIMIT 1").fetchone()
        if row is not None and row[1] <= TAIL_CHECK_SLOTS:
            self._check_segment(conn, *row)

    def verify(self, conn: sqlite3.Connection) -> None:
        """Compare every segment's CRC-32 with the bytes on disk (reads every vector once).

        Raises:
            CorruptDatabaseError: a segment differs, or a file is missing or short.
        """
        for row in conn.execute("SELECT first, count, crc FROM vector_segments ORDER BY first").fetchall():
            self._check_segment(conn, *row)

    def _check_segment(self, conn: sqlite3.Connection, first: int, count: int, crc: int) -> None:
        state = self.state(conn)
        if state is None:
            return
        crc_now = 0
        for array in self.columns(conn, state.dim, state.value_dim, state=state):
            crc_now = zlib.crc32(np.ascontiguousarray(array[first : first + count]).tobytes(), crc_now)
        if crc_now != crc:
            raise CorruptDatabaseError(
                f"the vectors of slots {first}..{first + count - 1} in {self.path(state.seq, 'keys').name} and its "
                "sibling files differ from what was committed (the files were damaged or changed from outside)"
            )
