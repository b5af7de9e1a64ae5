"""The records and their embeddings: SQLite on disk (the single source of truth) and tensors in memory.

A record is ``(id, key, value, metadata)`` with a key embedding (dim,) and a value embedding (value_dim,).
Ids are global integers from SQLite's AUTOINCREMENT: never reused, so a deleted id never comes back.
``key`` and ``value`` are text or None (records given directly as embeddings have no text).

Every embedding is stored once, in the same SQLite file: in chunks of slots that are read whole at open
(:mod:`kvsearch.storage.chunks`; ``records.slot`` names a record's slot). A store written by an earlier version, which kept
the embeddings in the records rows, is moved to chunks the first time it is opened for writing.

Every write is one SQLite transaction that also bumps a version counter; the in-memory tensors are
changed only after the commit succeeds. Anything derived from the store (the FAISS index) records the
version it was built at, so a stale copy is detected on open and rebuilt.

A store opened read-only (asked for, or its folder or file cannot be written) reads through a ``mode=ro``
connection and refuses every write with :class:`~kvsearch.errors.ReadOnlyDatabaseError`. A write transaction
that the file system refuses (a full disk) is rolled back and raised as :class:`~kvsearch.errors.DiskFullError`.
The store remembers which file it opened: once ``store.sqlite`` is deleted or replaced from outside,
:meth:`Store.check_file` raises :class:`~kvsearch.errors.StoreChangedError` (every transaction checks it).

The store knows nothing of FAISS or autograd: its tensors are plain (no grad), on ``device``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvsearch.errors import (
    CorruptDatabaseError,
    DatabaseLockedError,
    DuplicateKeyError,
    KeyNotFoundError,
    ReadOnlyDatabaseError,
    StorageError,
    StoreChangedError,
)
from kvsearch.filters import where_sql
from kvsearch.inputs import normalize_key
from kvsearch.storage import changelog, chunks, fileio
from kvsearch.storage.buffers import row_buffer
from kvsearch.storage.locking import LOCK_FILE, WriteLock

__all__ = ["Record", "Store", "CatchUp", "connect_read_only"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT UNIQUE,
    value TEXT,
    metadata TEXT,
    slot INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS given (id INTEGER PRIMARY KEY, side INTEGER NOT NULL);
"""
#: The ids whose record has metadata (a partial index: as small as the records with metadata are few).
_METADATA_INDEX = "CREATE INDEX IF NOT EXISTS records_with_metadata ON records (id) WHERE metadata IS NOT NULL;"
_SCHEMA += _METADATA_INDEX
#: The metadata of the hits of a search, through the partial index of the ids that have any: a hit without metadata
#: costs no read of its row (a random page of the table, ~10-20 us each), only a look in that small index.
_METADATA_SQL = (
    "SELECT id, metadata FROM records INDEXED BY records_with_metadata WHERE metadata IS NOT NULL AND id IN ({})"
)
#: The same without the index: a store of an earlier version opened read-only, or one whose records table another
#: process rebuilt (until the next writable open makes the index again).
_METADATA_PLAIN_SQL = "SELECT id, metadata FROM records WHERE id IN ({}) AND metadata IS NOT NULL"
#: Bits of ``given.side``: the record's key / value text came with its own embedding (never re-encoded).
GIVEN_KEY, GIVEN_VALUE = 1, 2

_SCHEMA += chunks.SCHEMA  # the embeddings (see kvsearch.storage.chunks)
_SCHEMA += changelog.SCHEMA  # the change log: written in every write transaction (see kvsearch.storage.changelog)

_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_CANTOPEN = 5, 6, 14
#: SQLite errors of a file that cannot be reached, as opposed to one that is damaged.
_SQLITE_ACCESS = {3, 10, 14, 23}  # SQLITE_PERM, SQLITE_IOERR, SQLITE_CANTOPEN, SQLITE_AUTH
_CONNECT = {"isolation_level": None, "check_same_thread": False}  # we open transactions ourselves


def connect_read_only(path: str | os.PathLike[str], timeout: float = 10.0) -> sqlite3.Connection:
    """A read-only SQLite connection to ``path`` that never writes into its folder.

    ``mode=ro`` first (it sees other processes' commits); where SQLite cannot make its WAL index because the folder
    cannot be written and no WAL is pending (a store closed cleanly on a read-only file system), ``immutable=1``.

    Raises:
        sqlite3.Error: the file cannot be opened or read.
    """
    uri = Path(path).absolute().as_uri()
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=timeout, **_CONNECT)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # SQLite opens lazily: fail here, not later
        return conn
    except sqlite3.OperationalError as exc:
        conn.close()
        wal = Path(f"{path}-wal")
        pending = wal.is_file() and wal.stat().st_size > 0
        if fileio.sqlite_code(exc) != _SQLITE_CANTOPEN or pending:
            raise
    conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=timeout, **_CONNECT)
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return conn


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
class CatchUp:
    """What :meth:`Store.catch_up` changed in the mirror, for the index to follow.

    Attributes:
        removed: ids that left the mirror or were replaced in it (the index removes them).
        added: ids added or replaced, in the order of ``keys`` (the index adds them).
        keys: (len(added), dim) their key embeddings, on the store's device.
    """

    removed: list[int]
    added: list[int]
    keys: Tensor


class Store:
    """SQLite records plus in-memory key / value tensors ordered by id.

    Args:
        path: the SQLite file, or None for an in-memory store.
        device: where the in-memory tensors live.
        timeout: seconds to wait for another process's SQLite lock (and the write lock).
        read_only: open for reading only; a store whose folder or file cannot be written is opened so anyway.

    Attributes:
        read_only: why the store is read-only (asked for, or what cannot be written), or None.
        full_loads: how many times the mirror was read whole (:meth:`load`: the open, and catch-ups that could not
            use the change log) — a counter to observe, e.g. in tests.
        catch_ups: how many times the mirror caught up on another process's commits row by row (:meth:`catch_up`).
        changelog_keep: versions the change log keeps (see :mod:`kvsearch.storage.changelog`); each write drops older ones.

    Raises:
        CorruptDatabaseError: the file is not a SQLite database or lacks our tables.
        StorageError: the file cannot be opened (:class:`ReadOnlyDatabaseError`: a new store in a folder that cannot
            be written; :class:`DiskFullError`: no space to create it).
        DatabaseLockedError: another process holds a write transaction for longer than the timeout.
    """

    def __init__(
        self,
        path: str | Path | None,
        device: torch.device | str = "cpu",
        timeout: float = 10.0,
        *,
        read_only: bool = False,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.device = torch.device(device)
        self.lock = threading.RLock()
        self._timeout = timeout
        self._pid = os.getpid()
        self.loaded_version = 0  # the store version the in-memory mirror (and the index) reflect
        self.full_loads = 0
        self.catch_ups = 0
        self.changelog_keep = changelog.KEEP_VERSIONS
        self._seen_data_version: int | None = None  # PRAGMA data_version when loaded_version was last checked
        self._metadata_sql = _METADATA_SQL  # or _METADATA_PLAIN_SQL once the index was found missing
        self._spare: tuple[Tensor, Tensor] | None = None  # the buffers keys / values are views of (room to grow)
        self.read_only: str | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file opened
        if self.path is not None:
            self.read_only = "it was opened with read_only=True" if read_only else self._unwritable()
        _open_stores.add(self)
        try:
            self._conn = self._connect()
        except sqlite3.Error as exc:
            refused = fileio.is_read_only(exc) or fileio.sqlite_code(exc) == _SQLITE_CANTOPEN
            if self.path is None or self.read_only is not None or not self.path.is_file() or not refused:
                raise self._open_error(exc) from None
            self.read_only = f"SQLite cannot write {self.path} ({exc})"  # e.g. a file another user owns
            try:
                self._conn = self._connect()
            except sqlite3.Error as again:
                raise self._open_error(again) from None
        # One writer at a time per folder, across processes; every transaction takes it (reentrant).
        self.write_lock = WriteLock(None if path is None else self.path.parent / LOCK_FILE, timeout, self.read_only)
        # A store of the earlier format keeps its embeddings in the records rows: moved to chunks when writable.
        self._legacy = self._is_legacy()
        if self._legacy and self.read_only is None:
            self._move_embeddings_to_chunks()
        if self.read_only is None and self.path is not None:
            for old in self.path.parent.glob(f"{self.path.name}.emb*"):  # side files of earlier versions: unused
                with contextlib.suppress(OSError):
                    old.unlink()
        # In-memory mirror, sorted by id: ids (n,), keys (n, dim), values (n, value_dim).
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        # id_of_key: the normalised key text (normalize_key) -> id; key_of_id: id -> the key text as stored.
        self.id_of_key: dict[str, int] = {}
        self.key_of_id: dict[int, str] = {}
        # Ids of records whose key / value text came with its embedding: re-encoding from the text skips them.
        self.given_keys: set[int] = set()
        self.given_values: set[int] = set()

    def _is_legacy(self) -> bool:
        """Whether the records table still holds the embeddings (the format before :mod:`kvsearch.storage.chunks`)."""
        return "key_emb" in {row[1] for row in self._conn.execute("PRAGMA table_info(records)")}

    def _still_legacy(self) -> bool:
        """Whether the store is still of the earlier format (another process may have moved it since)."""
        self._legacy = self._legacy and self._is_legacy()
        return self._legacy

    def _move_embeddings_to_chunks(self) -> None:
        """Move a store of the earlier format to chunks, in one transaction (then VACUUM gives the space back).

        The records keep their ids, texts, metadata and the next id; the version is not bumped (nothing a reader
        sees changed). A process that stops midway leaves the earlier format whole, moved again at the next open.
        """
        with self.lock:
            with self.transaction():
                if not self._is_legacy():
                    self._legacy = False
                    return  # another process moved it first
                conn = self._conn
                seq = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
                conn.execute(
                    "CREATE TABLE records_moved (id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE, value TEXT, "
                    "metadata TEXT, slot INTEGER NOT NULL)"
                )
                rows = conn.execute("SELECT id, key, value, metadata, key_emb, value_emb FROM records ORDER BY id")
                while batch := rows.fetchmany(4096):
                    ids = np.array([r[0] for r in batch], dtype=np.int64)
                    keys, values = _embeddings_of_rows([(r[4], r[5]) for r in batch])
                    slots = chunks.append(conn, ids, keys, values).tolist()
                    conn.executemany(
                        "INSERT INTO records_moved (id, key, value, metadata, slot) VALUES (?, ?, ?, ?, ?)",
                        ((r[0], r[1], r[2], r[3], slot) for r, slot in zip(batch, slots)),
                    )
                conn.execute("DROP TABLE records")
                conn.execute("ALTER TABLE records_moved RENAME TO records")
                conn.execute(_METADATA_INDEX)  # dropped with the old table
                conn.execute("DELETE FROM sqlite_sequence WHERE name IN ('records', 'records_moved')")
                if seq is not None:
                    conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('records', ?)", (seq[0],))
            self._legacy = False
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("VACUUM")  # the old rows' pages back to the file system (best effort)

    def _unwritable(self) -> str | None:
        """Why the store cannot be written (its folder, or the file itself), or None.

        Raises:
            ReadOnlyDatabaseError: there is no store yet and its folder cannot be written (nothing to read).
        """
        reason = fileio.unwritable_reason(self.path.parent)
        if reason is not None and not self.path.exists():
            raise ReadOnlyDatabaseError(f"cannot create a store at {self.path}: {reason}")
        if reason is None and self.path.exists():
            reason = fileio.unwritable_reason(self.path)
        return reason

    def _connect(self) -> sqlite3.Connection:
        """Open the connection (read-only when :attr:`read_only` says so) and remember which file it opened."""
        if self.path is None:
            conn = sqlite3.connect(":memory:", timeout=self._timeout, **_CONNECT)
            conn.executescript(_SCHEMA)
            return conn
        if self.read_only is not None:
            conn = connect_read_only(self.path, self._timeout)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"meta", "records"} <= tables:
                conn.close()
                raise CorruptDatabaseError(f"{self.path} is not a kvsearch store (it lacks the meta / records tables)")
        else:
            with fileio.storage_errors(self.path, "creating the store", "nothing was created"):
                fileio.create_new(self.path)  # made by us with the umask's mode, not SQLite's fixed 0644
            conn = sqlite3.connect(str(self.path), timeout=self._timeout, **_CONNECT)
            try:
                # A record is ~4 dim bytes of embeddings: 16 KiB pages hold several, and a 64 MiB WAL between
                # checkpoints, insert ~1.5x faster than SQLite's 4 KiB / 4 MiB defaults (page_size only takes
                # effect when the file is created; it must come before WAL mode).
                conn.execute("PRAGMA page_size=16384")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=FULL")
                conn.execute("PRAGMA wal_autocheckpoint=4096")
                conn.executescript(_SCHEMA)
            except BaseException:
                conn.close()
                raise
        self._identity = fileio.file_identity(self.path)
        return conn

    def _open_error(self, exc: sqlite3.Error) -> Exception:
        """The typed error of a store that cannot be opened: full, read-only, unreachable, locked, or damaged."""
        typed = fileio.storage_error(exc, self.path, "opening the store", "nothing was written")
        if typed is not None:
            return typed
        code = fileio.sqlite_code(exc)
        if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
            return DatabaseLockedError(f"another process holds {self.path} locked: {exc}")
        if code in _SQLITE_ACCESS:
            return StorageError(f"cannot open {self.path} (SQLite said: {exc})")
        return CorruptDatabaseError(f"{self.path} is not a kvsearch store (SQLite said: {exc})")

    def check_file(self) -> None:
        """Check that ``path`` still names the file this store opened.

        Raises:
            StoreChangedError: it was deleted, or replaced by another file, since the store was opened.
        """
        if self._identity is None:
            return
        now = fileio.file_identity(self.path)
        if now == self._identity:
            return
        what = "deleted" if now is None else "replaced by another file"
        raise StoreChangedError(
            f"{self.path} was {what} while this database was open (expected the file of device {self._identity[0]} "
            f"inode {self._identity[1]}, found {'none' if now is None else f'inode {now[1]}'}): nothing more is "
            "written, it would be acknowledged into a file no longer in the folder. Restore the store from a backup "
            "if it was lost, then open the folder again"
        )

    # ------------------------------------------------------------------ fork safety

    @property
    def _conn(self) -> sqlite3.Connection:
        """The SQLite connection of this process: a child of fork() opens its own (see ``_after_fork``)."""
        if self._pid != os.getpid():
            self._reconnect_after_fork()
        return self._connection

    @_conn.setter
    def _conn(self, conn: sqlite3.Connection) -> None:
        self._connection = conn

    def _reconnect_after_fork(self) -> None:
        # A SQLite connection must not cross fork(): the child's copy shares file locks and WAL state with
        # the parent's. Keep the inherited object alive (closing it could disturb the parent's locks) and
        # open a fresh connection; the in-memory mirror copied by fork() is kept and revalidated against
        # the store version before any write.
        inherited = self._connection
        self._pid = os.getpid()
        self._seen_data_version = None  # data_version is per connection
        if self.path is None:
            return  # an in-memory database was copied by fork(); the child owns its copy
        _inherited_connections.append(inherited)
        try:
            if self.read_only is not None:
                self._connection = connect_read_only(self.path, self._timeout)
            else:
                self._connection = sqlite3.connect(str(self.path), timeout=self._timeout, **_CONNECT)
                self._connection.execute("PRAGMA synchronous=FULL")
        except sqlite3.DatabaseError as exc:
            raise CorruptDatabaseError(f"{self.path}: cannot reopen the store after fork(): {exc}") from None

    # ------------------------------------------------------------------ meta

    def get_meta(self, name: str) -> Any:
        """A JSON value from the meta table, or None."""
        row = self._conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, name: str, value: Any) -> None:
        """Write a JSON value to the meta table in its own transaction."""
        with self.transaction():
            self._put_meta(name, value)

    def _put_meta(self, name: str, value: Any) -> None:
        self._conn.execute(
            "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value",
            (name, json.dumps(value)),
        )

    @property
    def version(self) -> int:
        """A counter bumped by every committed write."""
        return int(self.get_meta("version") or 0)

    # ------------------------------------------------------------------ loading

    def load(self, dim: int, value_dim: int) -> None:
        """Read every record into the in-memory tensors, in one snapshot.

        Raises:
            CorruptDatabaseError: the embeddings do not have the expected dims, or do not match the records.
        """
        buffers: list[Tensor] = []

        def alloc(rows: int, width: int) -> np.ndarray:
            buffer = row_buffer(rows + max(64, rows // 8), width, like=torch.empty(0))  # (capacity, width)
            buffers.append(buffer)
            return buffer[:rows].numpy()

        with self.lock:
            conn = self._conn
            own = not conn.in_transaction
            if own:
                conn.execute("BEGIN")  # one snapshot: the rows and the version they are at
            try:
                data_version = self._data_version()  # first: it starts the snapshot the version is read in
                version = self.version
                if self._still_legacy():  # read-only, earlier format: the embeddings are in the rows
                    rows = conn.execute("SELECT id, key, key_emb, value_emb FROM records ORDER BY id").fetchall()
                    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
                    keys, values = _embeddings_of_rows([(r[2], r[3]) for r in rows], dim, value_dim)
                else:
                    ids, slots, keys, values = chunks.read_all(conn, dim, value_dim, alloc=alloc)
                    self._check_ids(ids, slots)
                    rows = conn.execute("SELECT id, key FROM records WHERE key IS NOT NULL").fetchall()
                given = conn.execute("SELECT id, side FROM given").fetchall()
            finally:
                if own:
                    conn.execute("COMMIT")
            if len(ids) > 1 and not bool((np.diff(ids) > 0).all()):
                order = np.argsort(ids, kind="stable")  # slot order is id order; kept sorted should it not be
                ids, keys, values = ids[order], keys[order], values[order]
                buffers.clear()
            self.ids = torch.from_numpy(ids)
            self.keys = torch.from_numpy(keys).to(self.device)  # (n, dim)
            self.values = torch.from_numpy(values).to(self.device)  # (n, value_dim)
            # read into buffers with room to grow: the first append after a load does not copy the mirror
            same = len(buffers) == 2 and buffers[0].data_ptr() == self.keys.data_ptr()
            self._spare = (buffers[0], buffers[1]) if same and buffers[1].data_ptr() == self.values.data_ptr() else None
            self.key_of_id = {r[0]: r[1] for r in rows if r[1] is not None}
            self.id_of_key = _id_of_key(self.key_of_id, self.path)
            self.given_keys = {i for i, bits in given if bits & GIVEN_KEY}
            self.given_values = {i for i, bits in given if bits & GIVEN_VALUE}
            self.loaded_version = version
            self._seen_data_version = data_version
            self.full_loads += 1

    def _check_ids(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Check that the chunks hold the records the records table lists, each in the slot it names.

        Compared: the count, min, max and sum of the ids, the sum of the slots and a sum of (id, slot) pairs
        (one scan of the records table, no row read into Python).

        Raises:
            CorruptDatabaseError: they differ (the file was damaged or changed by hand).
        """
        pairs = (ids % 65521) * (slots % 65521)  # (n,) < 2**32 each: the pairs' sum fits int64 up to 2**31 records
        try:
            found = self._conn.execute(
                "SELECT count(*), min(id), max(id), sum(id), sum(slot), sum((id % 65521) * (slot % 65521)) FROM records"
            ).fetchone()
            count = found[0]
            expected = (len(ids), *((int(ids.min()), int(ids.max())) if len(ids) else (None, None)))
            expected += (int(ids.sum(dtype=np.int64)), int(slots.sum(dtype=np.int64)), int(pairs.sum(dtype=np.int64)))
            same = tuple(found) == expected if len(ids) else count == 0
        except sqlite3.OperationalError:  # a sum overflowed 64 bits: compare the lists
            listed = self._conn.execute("SELECT id, slot FROM records ORDER BY id").fetchall()
            order = np.argsort(ids)
            count, same = len(listed), np.array_equal(np.array(listed).reshape(-1, 2), np.c_[ids[order], slots[order]])
        if not same:
            raise CorruptDatabaseError(
                f"{self.path or 'the store'}: the embeddings hold {len(ids)} records that are not the "
                f"{count} records of the records table (the file was damaged or changed from outside)"
            )

    def _data_version(self) -> int:
        """SQLite's ``PRAGMA data_version``: changes when another connection commits (no table is read)."""
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    def is_stale(self) -> bool:
        """Whether another connection (another process) committed since this mirror was loaded.

        When no other connection committed since the last check (``PRAGMA data_version`` unchanged), the version
        is not read at all.
        """
        data_version = self._data_version()
        if data_version == self._seen_data_version:
            return False
        stale = self.version != self.loaded_version
        if not stale:
            self._seen_data_version = data_version
        return stale

    def catch_up(self, dim: int, value_dim: int) -> CatchUp | None:
        """Bring the mirror up to the store's version: row by row from the change log, else by a full :meth:`load`.

        Reads only the rows the log names (added or replaced since :attr:`loaded_version`), drops the deleted ones,
        in one snapshot. Falls back to :meth:`load` when the log does not reach back (compacted, or older than the
        log), when a change of every row (a generation switch) is in the range, or when more rows changed than
        half the mirror holds (reading everything is then as cheap).

        Args:
            dim: the key dimension. value_dim: the value dimension.

        Returns:
            What changed, for the index to follow; None after a full :meth:`load` (the index is rebuilt or served).

        Raises:
            CorruptDatabaseError: an embedding blob has the wrong size.
        """
        with self.lock:
            conn = self._conn
            own = not conn.in_transaction
            if own:
                conn.execute("BEGIN")  # one snapshot: the log, the rows and the version they are at
            try:
                data_version = self._data_version()
                version = self.version
                changes = None if self.keys is None else changelog.read(conn, self.loaded_version, version)
                if changes is not None and len(changes) > max(1024, len(self.ids) // 2):
                    changes = None
                if self._still_legacy():
                    changes = None  # an earlier format, read-only: read whole
                rows: list[tuple] = []
                if changes is not None:
                    rows, keys, values = self._rows_of_ids(changes.upserted, dim, value_dim)
                flags = {} if changes is None else self._given_of_ids(conn, changes.upserted)
            finally:
                if own:
                    conn.execute("COMMIT")
            if changes is None or len(rows) != len(changes.upserted):
                self.load(dim, value_dim)
                return None
            keys = torch.from_numpy(keys).to(self.device, torch.float32)  # (u, dim)
            values = torch.from_numpy(values).to(self.device, torch.float32)  # (u, value_dim)
            upserted = torch.tensor(changes.upserted, dtype=torch.long)  # (u,)
            present = self.rows_of(upserted) >= 0  # (u,) replaced in place; the others are new
            gone = [i for i in changes.deleted if self.contains_id(i)]
            removed = sorted(gone + upserted[present].tolist())
            self._drop_from_memory(gone)
            if bool(present.any()):
                rows_now = self.rows_of(upserted[present]).to(self.device)  # (r,)
                sel = present.to(self.device)
                self.keys[rows_now] = keys[sel]
                self.values[rows_now] = values[sel]
            if not bool(present.all()):
                sel = ~present
                self._append(upserted[sel], keys[sel.to(self.device)], values[sel.to(self.device)])
            for id_ in upserted[present].tolist():
                self._forget_key(id_)
            for id_ in upserted.tolist():  # which texts came with their own embedding, as the writer recorded
                self.given_keys.discard(id_)
                self.given_values.discard(id_)
                if flags.get(id_, 0) & GIVEN_KEY:
                    self.given_keys.add(id_)
                if flags.get(id_, 0) & GIVEN_VALUE:
                    self.given_values.add(id_)
            for id_, key, _ in rows:
                if key is not None:
                    self.id_of_key[normalize_key(key)] = id_
                    self.key_of_id[id_] = key
            self.loaded_version = version
            self._seen_data_version = data_version
            self.catch_ups += 1
            return CatchUp(removed=removed, added=changes.upserted, keys=keys)

    def _rows_of_ids(
        self, ids: Sequence[int], dim: int, value_dim: int
    ) -> tuple[list[tuple[int, str | None, int]], np.ndarray, np.ndarray]:
        """The stored records among ``ids``, in id order (ids not stored are left out).

        Returns:
            rows (id, key, slot), and their keys (r, dim) and values (r, value_dim) as float32 arrays.

        Raises:
            CorruptDatabaseError: a record names a slot that holds nothing, or a chunk is damaged.
        """
        if self._still_legacy():  # the earlier format (read-only): the embeddings are in the rows
            found = _select_in(self._conn, "SELECT id, key, key_emb, value_emb FROM records WHERE id IN ({})", ids)
            found.sort(key=lambda row: row[0])
            keys, values = _embeddings_of_rows([(r[2], r[3]) for r in found], dim, value_dim)
            return [(r[0], r[1], -1) for r in found], keys, values
        rows = sorted(_select_in(self._conn, "SELECT id, key, slot FROM records WHERE id IN ({})", ids))
        keys, values = chunks.read(self._conn, np.array([r[2] for r in rows], dtype=np.int64), dim, value_dim)
        return rows, keys, values

    def _slots_of(self, ids: Sequence[int]) -> np.ndarray:
        """(n,) the slots of stored ids, in the order given."""
        slot_of = dict(_select_in(self._conn, "SELECT id, slot FROM records WHERE id IN ({})", [int(i) for i in ids]))
        return np.array([slot_of[int(i)] for i in ids], dtype=np.int64)

    @staticmethod
    def _given_of_ids(conn: sqlite3.Connection, ids: Sequence[int]) -> dict[int, int]:
        """id -> its ``given`` bits, for those of the ids that have any."""
        return dict(_select_in(conn, "SELECT id, side FROM given WHERE id IN ({})", ids))

    def _append(self, ids: Tensor, keys: Tensor, values: Tensor) -> None:
        """Append rows to the mirror: ids (a,), keys (a, dim), values (a, value_dim), copied.

        The key / value tensors are views of buffers with room to grow (:func:`kvsearch.storage.buffers.row_buffer`: an
        eighth more rows, or a reservation for as many as memory holds), so an append copies the new rows, not the
        whole mirror. Ids larger than every stored one keep the mirror
        sorted (new ids always are); otherwise it is sorted again.
        """
        if self.keys is None:
            self.ids, self.keys, self.values = ids.clone(), keys.clone(), values.clone()
            return
        n, a = len(self.ids), len(ids)
        spare = self._spare or (None, None)
        spare = (_room_for(spare[0], self.keys, a), _room_for(spare[1], self.values, a))  # each grown if full
        self._spare = spare
        spare[0][n : n + a] = keys
        spare[1][n : n + a] = values
        self.keys, self.values = spare[0][: n + a], spare[1][: n + a]  # (n + a, dim), (n + a, value_dim)
        self.ids = torch.cat([self.ids, ids])  # (n + a,)
        if n and a and int(ids.min()) <= int(self.ids[n - 1]):
            order = torch.argsort(self.ids)  # (n + a,)
            self.ids = self.ids[order]
            self.keys, self.values = self.keys[order.to(self.device)], self.values[order.to(self.device)]
            self._spare = None

    def __len__(self) -> int:
        return len(self.ids)

    # ------------------------------------------------------------------ writing

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """``with store.snapshot():`` — a read transaction: every read inside sees one committed state.

        In WAL mode a reader never blocks a writer; nested in a transaction already open, it adds nothing.
        """
        with self.lock:
            conn = self._conn
            if conn.in_transaction:
                yield
                return
            conn.execute("BEGIN")
            try:
                yield
            finally:
                conn.execute("COMMIT")  # ends the read; nothing was written

    def transaction(self) -> Transaction:
        """``with store.transaction():`` — BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error."""
        return Transaction(self)

    def write(
        self,
        keys: Sequence[str | None],
        values: Sequence[str | None],
        metadata: Sequence[dict[str, Any] | None],
        key_embs: Tensor,
        value_embs: Tensor,
        ids: Sequence[int | None] | None = None,
        given: Sequence[int] | None = None,
    ) -> list[int]:
        """Insert or update records in one transaction.

        Args:
            keys, values, metadata: one entry per record. A replaced record whose metadata entry is None keeps
                its stored metadata; ``{}`` clears it.
            key_embs: (n, dim) float32. value_embs: (n, value_dim) float32.
            ids: per record, the stored id it replaces in place, or None for a new record (all new if None).
            given: per record, ``GIVEN_KEY | GIVEN_VALUE`` bits: which texts came with their own embedding
                (kept as given: re-encoding the texts skips them). None: no text came with an embedding.

        Returns:
            The ids of the records, in order (new ids are fresh, never reused).
        """
        n = len(keys)
        ids = [None] * n if ids is None else list(ids)
        key_np = key_embs.detach().to("cpu", torch.float32).contiguous().numpy()  # (n, dim)
        value_np = value_embs.detach().to("cpu", torch.float32).contiguous().numpy()  # (n, value_dim)

        def meta(i: int) -> str | None:
            return None if not metadata[i] else json.dumps(metadata[i])

        with self.lock:
            with self.transaction():
                seq = self._conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
                next_id = (seq[0] if seq else 0) + 1
                out: list[int] = []
                for id_ in ids:
                    out.append(next_id if id_ is None else int(id_))
                    next_id += id_ is None
                new = [i for i in range(n) if ids[i] is None]
                old = [i for i in range(n) if ids[i] is not None]
                if new:
                    every = len(new) == n  # the usual add: no row selection to copy
                    new_ids = np.array([out[i] for i in new], dtype=np.int64)
                    slots = chunks.append(
                        self._conn, new_ids, key_np if every else key_np[new], value_np if every else value_np[new]
                    ).tolist()
                    self._conn.executemany(
                        "INSERT INTO records (key, value, metadata, slot, id) VALUES (?, ?, ?, ?, ?)",
                        ((keys[i], values[i], meta(i), slot, out[i]) for i, slot in zip(new, slots)),
                    )
                if old:
                    chunks.write(self._conn, self._slots_of([out[i] for i in old]), key_np[old], value_np[old])
                    self._conn.executemany(  # metadata None: keep the stored
                        "UPDATE records SET key = ?, value = ?, metadata = CASE WHEN ? THEN metadata ELSE ? END "
                        "WHERE id = ?",
                        ((keys[i], values[i], metadata[i] is None, meta(i), out[i]) for i in old),
                    )
                flagged = [(out[i], int(given[i])) for i in range(n) if given is not None and given[i]]
                if old:
                    self._conn.executemany("DELETE FROM given WHERE id = ?", ((out[i],) for i in old))
                self._conn.executemany("INSERT INTO given (id, side) VALUES (?, ?)", flagged)
                self.bump_version({"added": [out[i] for i in new], "replaced": [out[i] for i in old]})
            # Committed: now mirror it in memory (still under the lock, so readers never see half of it).
            dev_keys = key_embs.detach().to(self.device, torch.float32)  # (n, dim)
            dev_values = value_embs.detach().to(self.device, torch.float32)  # (n, value_dim)
            if old:
                rows = self.rows_of(torch.tensor([out[i] for i in old])).to(self.device)  # (n_old,)
                sel = torch.tensor(old, device=self.device)
                self.keys[rows] = dev_keys[sel]
                self.values[rows] = dev_values[sel]
            if new:
                every = len(new) == n  # the usual add: no row selection to copy
                sel = None if every else torch.tensor(new, device=self.device)
                add_keys = dev_keys if every else dev_keys[sel]  # (n_new, dim)
                add_values = dev_values if every else dev_values[sel]  # (n_new, value_dim)
                # copied: the mirror never shares memory with the caller's tensors (.to() may return them as they are)
                self._append(torch.tensor([out[i] for i in new], dtype=torch.long), add_keys, add_values)
            for i in old:
                self._forget_key(out[i])
                self.given_keys.discard(out[i])
                self.given_values.discard(out[i])
            for id_, bits in flagged:
                if bits & GIVEN_KEY:
                    self.given_keys.add(id_)
                if bits & GIVEN_VALUE:
                    self.given_values.add(id_)
            for i, key in enumerate(keys):
                if key is not None:
                    self.id_of_key[normalize_key(key)] = out[i]
                    self.key_of_id[out[i]] = key
        return out

    def _forget_key(self, id_: int) -> None:
        """Drop a record's key from the key maps (the normalised key only if it names this record)."""
        key = self.key_of_id.pop(id_, None)
        if key is not None and self.id_of_key.get(normalize_key(key)) == id_:
            del self.id_of_key[normalize_key(key)]

    def delete(self, ids: Sequence[int]) -> None:
        """Delete records by id in one transaction.

        Raises:
            KeyNotFoundError: an id is not stored (nothing is deleted then).
        """
        with self.lock:
            missing = [i for i in ids if not self.contains_id(i)]
            if missing:
                raise KeyNotFoundError(f"expected stored ids, got unknown ids {missing[:10]}")
            with self.transaction():
                self._delete_rows(ids)
                self.bump_version({"deleted": [int(i) for i in ids]})
                if chunks.needs_repack(self._conn):  # emptied slots outnumber the records: write them again
                    moved, slots = chunks.repack(self._conn, self.keys.shape[1], self.values.shape[1])
                    self._conn.executemany(
                        "UPDATE records SET slot = ? WHERE id = ?", zip(slots.tolist(), moved.tolist())
                    )
            self._drop_from_memory(ids)

    def start_ids_after(self, floor: int) -> None:
        """Make the next new id ``floor + 1`` or more: seeds SQLite's AUTOINCREMENT sequence (a shard's id range).

        Ids are never lowered: a store whose sequence is past ``floor`` is left as it is.
        """
        with self.lock, self.transaction():
            row = self._conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'records'").fetchone()
            if row is None:
                self._conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('records', ?)", (int(floor),))
            elif row[0] < floor:
                self._conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'records'", (int(floor),))

    def stored_ids_of_keys(self, keys: Sequence[str | None], *, allow: bool) -> list[int | None]:
        """The stored id of each key text (None for a new key or no text).

        Args:
            keys: key texts, or None for keys given as embeddings.
            allow: whether stored keys are allowed (an upsert); else one raises.

        Raises:
            DuplicateKeyError: a key is already stored and ``allow`` is False.
        """
        out: list[int | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            id_ = -1 if key is None else self.id_of(key)
            if id_ >= 0:
                if not allow:
                    raise DuplicateKeyError(
                        f"expected new keys, got {key!r} (record {i}) which is already stored; use upsert"
                    )
                out[i] = id_
        return out

    def id_of(self, key: str) -> int:
        """The id of the record with this key text, -1 if none: compared after :func:`normalize_key`.

        Keys stored by an earlier version that did not normalise are found by their normalised text too.
        """
        return self.id_of_key.get(normalize_key(key), -1)

    def resolve(self, items: Sequence[str | int], consequence: str) -> list[int]:
        """The stored ids of key texts and ids, in order, without repeats.

        Args:
            items: key texts and int ids.
            consequence: what the error message adds, e.g. ``"nothing was deleted"``.

        Raises:
            KeyNotFoundError: a key or an id is not stored.
        """
        ids: list[int] = []
        for item in items:
            if isinstance(item, str):
                id_ = self.id_of(item)
                if id_ < 0:
                    raise KeyNotFoundError(f"expected a stored key, got {item!r}; {consequence}")
                ids.append(id_)
            else:
                if not self.contains_id(item):
                    raise KeyNotFoundError(f"expected a stored id, got {item}; {consequence}")
                ids.append(int(item))
        return list(dict.fromkeys(ids))

    def replace_embeddings(
        self, keys: Tensor | None = None, values: Tensor | None = None, *, meta: Mapping[str, Any] | None = None
    ) -> None:
        """Overwrite every record's key and/or value embedding (rows in id order), in one transaction.

        Args:
            keys: (n, dim) or None to keep. values: (n, value_dim) or None to keep.
            meta: meta entries (name -> JSON value) written in the same transaction (a generation switch).
        """
        with self.lock:
            with self.transaction():
                for name, value in (meta or {}).items():
                    self._put_meta(name, value)
                as_numpy = [None if t is None else t.detach().to("cpu", torch.float32).numpy() for t in (keys, values)]
                chunks.write_all(self._conn, *as_numpy)
                self.bump_version()
            if keys is not None:
                self.keys = keys.detach().to(self.device, torch.float32).clone()
            if values is not None:
                self.values = values.detach().to(self.device, torch.float32).clone()

    def _delete_rows(self, ids: Iterable[int]) -> None:
        ids = [int(i) for i in ids]
        chunks.erase(self._conn, self._slots_of(ids))
        self._conn.executemany("DELETE FROM records WHERE id = ?", ((int(i),) for i in ids))
        self._conn.executemany("DELETE FROM given WHERE id = ?", ((int(i),) for i in ids))

    def bump_version(self, changes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Record one more committed write: the version and its change log entry, inside the open transaction
        (every write calls it last).

        Other processes compare the version with the one their mirror was loaded at (:meth:`is_stale`) and catch
        up on the logged ids (:meth:`catch_up`).

        Args:
            changes: kind ("added", "replaced", "deleted") -> ids; None when every row may have changed (a
                generation switch), which makes other processes reload everything.
        """
        version = self.version + 1
        self._put_meta("version", version)
        changelog.record(self._conn, version, changes, self.changelog_keep)
        self.loaded_version = version  # callers reload a stale mirror before writing (Database._writing)

    def _drop_from_memory(self, ids: Sequence[int]) -> None:
        if not len(ids):
            return
        drop = torch.as_tensor(list(ids), dtype=torch.long)
        keep = ~torch.isin(self.ids, drop)  # (n,)
        self.ids = self.ids[keep]
        keep_dev = keep.to(self.device)
        self.keys = self.keys[keep_dev]
        self.values = self.values[keep_dev]
        for id_ in drop.tolist():
            self._forget_key(id_)
            self.given_keys.discard(id_)
            self.given_values.discard(id_)

    # ------------------------------------------------------------------ reading

    def contains_id(self, id_: int) -> bool:
        """Whether a record with this id is stored (never one outside int64, which SQLite cannot hold)."""
        if not 0 <= int(id_) < 2**63:
            return False
        pos = int(torch.searchsorted(self.ids, torch.tensor(int(id_))))
        return pos < len(self.ids) and int(self.ids[pos]) == int(id_)

    def rows_of(self, ids: Tensor) -> Tensor:
        """Row positions of ids in the in-memory tensors; -1 where an id is -1 or not stored.

        Args:
            ids: LongTensor of any shape.

        Returns:
            LongTensor of the same shape, on the CPU.
        """
        flat = ids.reshape(-1).cpu().numpy()  # (n,) numpy: a search's few ids cost ~1 us per op, torch's ~3
        stored = self.ids.numpy()  # (m,) sorted
        if len(stored) == 0:
            return torch.full_like(ids.cpu(), -1)
        pos = np.minimum(np.searchsorted(stored, flat), len(stored) - 1)  # (n,)
        found = (stored[pos] == flat) & (flat >= 0)
        return torch.from_numpy(np.where(found, pos, -1)).reshape(ids.shape)

    def gather(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings for ids (any shape, -1 allowed), gathered by id.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) with zeros where ids are missing,
            and a keep-mask of ids.shape — all on the store's device.
        """
        rows = self.rows_of(ids).to(self.device)  # (*shape)
        mask = rows >= 0
        if len(self.keys) == 0:  # nothing stored: every id is missing (no row 0 to clamp to)
            shape = rows.shape
            zeros = self.keys.new_zeros
            return zeros(*shape, self.keys.shape[-1]), zeros(*shape, self.values.shape[-1]), mask
        flat = rows.clamp(min=0).reshape(-1)  # (n,) index_select: far cheaper than fancy indexing for small n
        keys = self.keys.index_select(0, flat).reshape(*rows.shape, self.keys.shape[-1])  # (*shape, dim)
        values = self.values.index_select(0, flat).reshape(*rows.shape, self.values.shape[-1])  # (*shape, value_dim)
        if not bool(mask.all()):
            keys = keys * mask.unsqueeze(-1)  # (*shape, dim) zeros where missing
            values = values * mask.unsqueeze(-1)  # (*shape, value_dim)
        return keys, values, mask

    def fetch(self, ids: Iterable[int]) -> dict[int, Record]:
        """Whole records (text, metadata, embeddings) for ids: the texts in one query, the embeddings from the
        in-memory tensors (read from the store only for a record committed since they were loaded)."""
        wanted = sorted({int(i) for i in ids if 0 <= int(i) < 2**63})  # SQLite holds int64 ids only
        if self.keys is None:
            return {}
        with self.snapshot():
            sql = "SELECT id, key, value, metadata FROM records WHERE id IN ({})"
            rows = sorted(_select_in(self._conn, sql, wanted))
            found = [r[0] for r in rows]
            at = self.rows_of(torch.tensor(found, dtype=torch.long))  # (r,) -1: not in memory yet
            later = [id_ for id_, row in zip(found, at.tolist()) if row < 0]
            if later:
                _, later_keys, later_values = self._rows_of_ids(later, self.keys.shape[1], self.values.shape[1])
        keys = self.keys[at.clamp(min=0).to(self.device)].cpu()  # (r, dim)
        values = self.values[at.clamp(min=0).to(self.device)].cpu()  # (r, value_dim)
        if later:
            gaps = (at < 0).nonzero().squeeze(1)  # (g,) in found's order, as ``later``
            keys[gaps], values[gaps] = torch.from_numpy(later_keys), torch.from_numpy(later_values)
        return {
            id_: Record(
                id=id_,
                key=key,
                value=value,
                metadata=json.loads(meta) if meta else {},
                key_embedding=keys[i].clone(),  # its own storage, not a view of the batch
                value_embedding=values[i].clone(),
            )
            for i, (id_, key, value, meta) in enumerate(rows)
        }

    def value_texts(self, ids: Iterable[int]) -> dict[int, str | None]:
        """Value text for ids (None for embedding-only values), in one query."""
        wanted = sorted({int(i) for i in ids if 0 <= int(i) < 2**63})  # SQLite holds int64 ids only
        return dict(_select_in(self._conn, "SELECT id, value FROM records WHERE id IN ({})", wanted))

    def metadata_texts(self, ids: Iterable[int]) -> dict[int, str]:
        """id -> the record's metadata as stored (JSON text), for the ids among ``ids`` that have metadata."""
        wanted = sorted({int(i) for i in ids if int(i) >= 0})
        try:
            return dict(_select_in(self._conn, self._metadata_sql, wanted))
        except sqlite3.OperationalError as exc:  # refused when prepared: nothing was read, the snapshot holds
            if self._metadata_sql is _METADATA_PLAIN_SQL or "no such index" not in str(exc):
                raise
        self._metadata_sql = _METADATA_PLAIN_SQL
        return dict(_select_in(self._conn, self._metadata_sql, wanted))

    def answer_values(self, ids: Sequence[int], *, texts: bool = True) -> dict[int, str | Tensor | None]:
        """id -> the value as an answer shows it: its text, or its embedding (CPU tensor) when it has no text.

        Args:
            ids: stored ids (an id no longer stored maps to None).
            texts: whether values may have text; without (no value encoder) nothing is read from SQLite.
        """
        out: dict[int, str | Tensor | None] = self.value_texts(ids) if texts else dict.fromkeys(ids)
        need_emb = [i for i, text in out.items() if text is None]
        if need_emb:
            rows = self.rows_of(torch.tensor(need_emb))  # (r,) -1 for an id no longer stored
            values = self.values[rows.clamp(min=0).to(self.device)].cpu()  # (r, value_dim)
            for i, row, present in zip(need_emb, values, (rows >= 0).tolist()):
                out[i] = row.clone() if present else None  # its own storage, not a view of the batch
        return out

    def values_present(self, texts: Sequence[str]) -> Tensor:
        """Whether some record has each value text: (n,) bool on the CPU."""
        wanted = sorted(set(texts))
        found = {r[0] for r in _select_in(self._conn, "SELECT DISTINCT value FROM records WHERE value IN ({})", wanted)}
        return torch.tensor([t in found for t in texts], dtype=torch.bool)

    def ids_where(self, where: dict[str, Any]) -> Tensor:
        """The ids of the records whose metadata satisfies a filter (see :mod:`kvsearch.filters`).

        Args:
            where: a filter such as ``{"lang": "en", "year": {"$gte": 2000}}``.

        Returns:
            (m,) int64 CPU tensor of sorted ids.

        Raises:
            InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter.
        """
        sql, params = where_sql(where)  # every user value is a bound parameter
        rows = self._conn.execute(f"SELECT id FROM records WHERE {sql} ORDER BY id", params).fetchall()
        return torch.tensor([r[0] for r in rows], dtype=torch.long)  # (m,)

    def close(self) -> None:
        """Close the SQLite connection (in a child of fork(), only the child's own connection)."""
        with self.lock:
            if self._pid == os.getpid() or self.path is None:
                self._connection.close()
            self.write_lock.close()


def _id_of_key(key_of_id: dict[int, str], where: Path | None) -> dict[str, int]:
    """The normalised key -> id map of the stored keys.

    Keys written by this version are normalised already. Keys an earlier version stored as given (surrounding
    whitespace, NFD) are found by their normalised text; should two of them normalise alike, the key names the
    older record (the smaller id), the other stays reachable by id, and a RuntimeWarning names them.
    """
    id_of_key = {normalize_key(key): id_ for id_, key in key_of_id.items()}
    if len(id_of_key) == len(key_of_id):
        return id_of_key
    groups: dict[str, list[int]] = {}
    for id_, key in sorted(key_of_id.items()):
        groups.setdefault(normalize_key(key), []).append(id_)
    clashes = {key: ids for key, ids in groups.items() if len(ids) > 1}
    shown = "; ".join(f"{key!r}: ids {ids}" for key, ids in list(clashes.items())[:5])
    warnings.warn(
        f"kvsearch: {where or 'a database in memory'} holds {len(clashes)} keys stored by an earlier version that "
        f"are equal after normalisation (NFC, surrounding whitespace stripped): {shown}. Each key names its "
        "smallest id; the others are reachable by id only (get / delete by id).",
        RuntimeWarning,
        stacklevel=4,
    )
    return {key: ids[0] for key, ids in groups.items()}


def _select_in(conn: sqlite3.Connection, sql: str, values: Sequence[Any]) -> list[tuple]:
    """The rows of ``sql`` (one ``IN ({})``) for every value, in chunks under SQLite's bound-parameter limit."""
    rows: list[tuple] = []
    for start in range(0, len(values), 900):
        chunk = list(values[start : start + 900])
        rows.extend(conn.execute(sql.format(",".join("?" * len(chunk))), chunk).fetchall())
    return rows


def _room_for(buffer: Tensor | None, rows: Tensor, a: int) -> Tensor:
    """The buffer ``rows`` (n, width) is a view of, if it has room for ``a`` more rows, else a new one holding them.

    A new buffer has an eighth more rows than needed, or is reserved (:func:`kvsearch.storage.buffers.row_buffer`).
    """
    n = rows.shape[0]
    if buffer is not None and buffer.shape[0] >= n + a and buffer.data_ptr() == rows.data_ptr():
        return buffer
    grown = row_buffer(n + a + max(64, (n + a) // 8), rows.shape[1], like=rows)  # (capacity, width)
    grown[:n] = rows
    return grown


def _embeddings_of_rows(
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


# Stores of this process, so that a child of fork() gets fresh thread locks (a lock held by another
# thread at fork() time would otherwise stay held forever in the child), and the connections a child
# inherited, kept open on purpose (closing them could release the parent's SQLite file locks).
_open_stores: weakref.WeakSet[Store] = weakref.WeakSet()
_inherited_connections: list[sqlite3.Connection] = []


def _after_fork_in_child() -> None:
    for store in list(_open_stores):
        store.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Transaction:
    """``with store.transaction():`` — BEGIN IMMEDIATE under the write lock, then COMMIT, or ROLLBACK on error.

    Nested inside an open transaction it is a SAVEPOINT (``depth_owner`` is False): an error inside rolls back only
    its own writes, and the outermost one commits. Every write transaction first checks that the store file is
    still the one opened (:meth:`Store.check_file`). A commit the file system refuses (a full disk) is rolled back
    and raised as :class:`~kvsearch.errors.DiskFullError`; a rolled-back transaction leaves ``loaded_version`` as
    it found it.

    Raises:
        ReadOnlyDatabaseError: the store is read-only. DatabaseLockedError: another writer holds it.
        StoreChangedError: the store file was deleted or replaced. DiskFullError: no space to commit.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.depth_owner = False
        self.savepoint: str | None = None
        self.loaded = store.loaded_version

    def __enter__(self) -> None:
        store = self.store
        conn = store._conn
        self.loaded = store.loaded_version
        if conn.in_transaction:
            self.savepoint = f"kvsearch_{id(self):x}"
            conn.execute(f"SAVEPOINT {self.savepoint}")
            return
        store.write_lock.acquire()  # bounded wait, then DatabaseLockedError; ReadOnlyDatabaseError when read-only
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc):
                    raise DatabaseLockedError(f"another process is writing to {store.path}: {exc}") from None
                typed = self._typed(exc)
                if typed is None:
                    raise
                raise typed from None
            store.check_file()
        except BaseException:
            self._abort()
            store.write_lock.release()
            raise
        self.depth_owner = True

    def __exit__(self, exc_type, exc, tb) -> None:
        conn = self.store._conn
        if self.savepoint is not None:
            if exc_type is None:
                conn.execute(f"RELEASE {self.savepoint}")
                return
            if conn.in_transaction:  # SQLite may have rolled the whole transaction back itself (a full disk)
                with contextlib.suppress(sqlite3.Error):
                    conn.execute(f"ROLLBACK TO {self.savepoint}")
                    conn.execute(f"RELEASE {self.savepoint}")
            self.store.loaded_version = self.loaded
            typed = self._typed(exc)
            if typed is not None:
                raise typed from None
            return
        if not self.depth_owner:
            return
        try:
            if exc_type is None:
                try:
                    conn.execute("COMMIT")
                except sqlite3.Error as failed:
                    self._abort()
                    typed = self._typed(failed)
                    if typed is None:
                        raise
                    raise typed from None
            else:
                self._abort()
                typed = self._typed(exc)
                if typed is not None:
                    raise typed from None
        finally:
            self.store.write_lock.release()

    def _abort(self) -> None:
        """Roll back what is open (SQLite may already have done it) and forget the versions it counted."""
        conn = self.store._conn
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        self.store.loaded_version = self.loaded

    def _typed(self, exc: BaseException | None) -> Exception | None:
        """A full disk or a read-only file as the typed error, else None (the error stays as it is)."""
        if exc is None or not isinstance(exc, (OSError, sqlite3.Error)):
            return None
        return fileio.storage_error(
            exc,
            self.store.path,
            "writing to the store",
            "the write was rolled back: the store holds what was committed before it",
        )
