"""The records: SQLite on disk (the single source of truth), its transactions and its version.

A record is ``(id, key, value, metadata)`` with a key embedding (dim,) and a value embedding (value_dim,).
Ids are global integers from SQLite's AUTOINCREMENT: never reused, so a deleted id never comes back.
``key`` and ``value`` are text or None (records given directly as embeddings have no text).

Every embedding is stored once (``records.slot`` names a record's slot), through the store's
:class:`~kvsearch.storage.embeddings.Vectors` picked at open: on disk in file sets beside the SQLite file that every
process maps (:mod:`kvsearch.storage.vector_file`), in memory in SQLite chunks (:mod:`kvsearch.storage.chunks`). A store
written by an earlier version is moved to today's format the first time it is opened for writing, and read as it is
when opened read-only (:mod:`kvsearch.storage.migrate`). The tables and the connections are
:mod:`kvsearch.storage.schema`'s.

Every write is one SQLite transaction that also bumps a version counter; the in-memory tensors (``store.table``, a
:class:`~kvsearch.storage.table.VectorTable` that knows nothing of the store) are changed only after the commit
succeeds. Another process's commits reach them as a :class:`~kvsearch.storage.table.Delta` read from the change log
(:meth:`Store.catch_up`, :mod:`kvsearch.storage.catchup`). The key texts and given flags are read lazily
(:attr:`Store.texts`). Anything derived from the store (the index) records the version it was built at, so a stale
copy is detected on open and rebuilt.

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
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvsearch.errors import (
    CorruptDatabaseError,
    DatabaseLockedError,
    KeyNotFoundError,
    ReadOnlyDatabaseError,
)
from kvsearch.metadata.codec import decode as decode_metadata
from kvsearch.metadata.filters import where_sql
from kvsearch.storage import catchup, changelog, fileio, migrate, schema
from kvsearch.storage.embeddings import point_at
from kvsearch.storage.key_texts import KeyTexts, read_key_texts
from kvsearch.storage.locking import LOCK_FILE, WriteLock
from kvsearch.storage.record_rows import Record, last_id, seed_ids, write_rows
from kvsearch.storage.schema import IN_CHUNK, METADATA_ANY_SQL, METADATA_PLAIN_SQL, METADATA_SQL, select_in
from kvsearch.storage.table import CatchUp, VectorTable, Views
from kvsearch.storage.transaction import Transaction

__all__ = ["Record", "Store"]


class Store:
    """SQLite records, their transactions and version; the in-memory tensors (:attr:`table`) it hands them to.

    Args:
        path: the SQLite file, or None for an in-memory store.
        device: where the in-memory tensors live.
        timeout: seconds to wait for another process's SQLite lock (and the write lock).
        read_only: open for reading only; a store whose folder or file cannot be written is opened so anyway.

    Attributes:
        table: the in-memory ids, keys and values sorted by id, and the version they reflect
            (:class:`~kvsearch.storage.table.VectorTable`; an index's key source).
        vectors: where the embeddings are written and read (:class:`~kvsearch.storage.embeddings.Vectors`, picked
            at open by :func:`kvsearch.storage.migrate.open_vectors`).
        full_loads: how many times the table was read whole (:meth:`load`: the open, and catch-ups that could not
            use the change log) — a counter to observe, e.g. in tests.
        catch_ups: how many times the table caught up on another process's commits row by row (:meth:`catch_up`).
        read_only: why the store is read-only (asked for, or what cannot be written), or None.
        changelog_keep: versions the change log keeps (see :mod:`kvsearch.storage.changelog`); each write drops older
            ones.

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
        self.table = VectorTable(self.device)
        self.full_loads = 0
        self.catch_ups = 0
        self.seen_data_version: int | None = None  # PRAGMA data_version when the table's version was last checked
        # the key texts and given flags, read at their first use (None: not yet): a process that only searches by
        # vector never holds them
        self._texts: KeyTexts | None = None
        self.changelog_keep = changelog.KEEP_VERSIONS
        self._metadata_sql = METADATA_SQL  # or METADATA_PLAIN_SQL once the index was found missing
        # ((table version, data_version seen), whether any record had metadata then) (has_metadata): another
        # process's commit, or a rolled-back one of this process that reused a version number, moves the pair
        self._metadata_at: tuple[tuple[int, int | None], bool] | None = None
        self.read_only: str | None = None
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file opened
        if self.path is not None:
            self.read_only = "it was opened with read_only=True" if read_only else self._unwritable()
        _open_stores.add(self)
        try:
            self.conn = self._connect()
        except sqlite3.Error as exc:
            refused = fileio.is_read_only(exc) or fileio.sqlite_code(exc) == schema.SQLITE_CANTOPEN
            if self.path is None or self.read_only is not None or not self.path.is_file() or not refused:
                raise schema.open_error(exc, self.path) from None
            self.read_only = f"SQLite cannot write {self.path} ({exc})"  # e.g. a file another user owns
            try:
                self.conn = self._connect()
            except sqlite3.Error as again:
                raise schema.open_error(again, self.path) from None
        # One writer at a time per folder, across processes; every transaction takes it (reentrant).
        self.write_lock = WriteLock(None if path is None else self.path.parent / LOCK_FILE, timeout, self.read_only)
        # A store of an earlier format is moved to today's when writable; then the layout is picked, once.
        if self.read_only is None:
            migrate.upgrade(self.conn, self.path, self.transaction)  # no other thread has the store yet
        self.vectors = migrate.open_vectors(self.path, self.conn, writable=self.read_only is None)
        if self.read_only is None and self.path is not None:
            self._open_files()
            for old in self.path.parent.glob(f"{self.path.name}.emb*"):  # side files of earlier versions: unused
                with contextlib.suppress(OSError):
                    old.unlink()

    def _open_files(self) -> None:
        """At a writable open on disk: check the last committed segment of the vectors, and tidy the files if they
        need it."""
        with self.lock, self.snapshot():
            self.vectors.check_tail(self.conn)
            untidy = self.vectors.untidy(self.conn)
        if untidy:
            with contextlib.suppress(DatabaseLockedError):  # another writer is busy: tidied at a later open
                self._tidy_files()

    def _tidy_files(self) -> None:
        """Remove the file sets no committed state names and cut an uncommitted tail, under the write lock (another
        writer's files in the making are never touched)."""
        if self.path is not None and self.read_only is None:
            with self.lock, self.transaction():
                self.vectors.tidy(self.conn)

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
            return schema.connect_in_memory(self._timeout)
        if self.read_only is not None:
            conn = schema.connect_read_only(self.path, self._timeout)
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"meta", "records"} <= tables:
                conn.close()
                raise CorruptDatabaseError(f"{self.path} is not a kvsearch store (it lacks the meta / records tables)")
        else:
            conn = schema.connect_writable(self.path, self._timeout)
        self._identity = fileio.file_identity(self.path)
        return conn

    def check_file(self) -> None:
        """Check that ``path`` still names the file this store opened (every read and write asks: one ``stat``
        here, :func:`~kvsearch.storage.fileio.check_same_file` words the error).

        Raises:
            StoreChangedError: it was deleted, or replaced by another file, since the store was opened.
        """
        if self._identity is not None and _identity_now(self.path) != self._identity:
            fileio.check_same_file(self.path, self._identity)  # raises

    # ------------------------------------------------------------------ fork safety

    @property
    def conn(self) -> sqlite3.Connection:
        """The SQLite connection of this process: a child of fork() opens its own (see ``_after_fork``)."""
        if self._pid != os.getpid():
            self._reconnect_after_fork()
        return self._connection

    @conn.setter
    def conn(self, conn: sqlite3.Connection) -> None:
        self._connection = conn

    def _reconnect_after_fork(self) -> None:
        # A SQLite connection must not cross fork(): the child's copy shares file locks and WAL state with
        # the parent's. Keep the inherited object alive (closing it could disturb the parent's locks) and
        # open a fresh connection; the in-memory table copied by fork() is kept and revalidated against
        # the store version before any write.
        inherited = self._connection
        self._pid = os.getpid()
        self.seen_data_version = None  # data_version is per connection
        if self.path is None:
            return  # an in-memory database was copied by fork(); the child owns its copy
        _inherited_connections.append(inherited)
        try:
            if self.read_only is not None:
                self._connection = schema.connect_read_only(self.path, self._timeout)
            else:
                self._connection = schema.reconnect(self.path, self._timeout)
        except sqlite3.DatabaseError as exc:
            raise CorruptDatabaseError(f"{self.path}: cannot reopen the store after fork(): {exc}") from None

    # ------------------------------------------------------------------ meta

    def get_meta(self, name: str) -> Any:
        """A JSON value from the meta table, or None."""
        row = self.conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, name: str, value: Any) -> None:
        """Write a JSON value to the meta table in its own transaction."""
        with self.transaction():
            self._put_meta(name, value)

    def _put_meta(self, name: str, value: Any) -> None:
        self.conn.execute(
            "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value",
            (name, json.dumps(value)),
        )

    @property
    def version(self) -> int:
        """A counter bumped by every committed write."""
        return int(self.get_meta("version") or 0)

    # ------------------------------------------------------------------ the table (see kvsearch.storage.table)

    @contextmanager
    def _reading(self) -> Iterator[tuple[int, int]]:
        """Under the lock, one snapshot (joined if a transaction is open), on the vectors of the store's format now:
        yields (``PRAGMA data_version``, the version) read first in it."""
        with self.lock, self.snapshot():
            data_version = int(self.conn.execute("PRAGMA data_version").fetchone()[0])  # starts the snapshot
            if self.read_only is not None:  # another process may have moved a store of an earlier format
                self.vectors = migrate.follow(self.path, self.conn, self.vectors)
            yield data_version, self.version

    def load(self, dim: int, value_dim: int) -> None:
        """Read every record into the table, in one snapshot: on the CPU, views of the shared file mappings when the
        records hold one run of slots (nothing copied), else copies.

        Raises:
            CorruptDatabaseError: the embeddings do not have the expected dims, or do not match the records.
        """
        with self._reading() as (data_version, version):
            shared = self.device.type == "cpu"
            whole = catchup.read_whole(self.conn, self.vectors, (dim, value_dim), shared=shared, path=self.path)
            if whole.views is not None:
                self.table.adopt(whole.views)
                self.table.version = version
            else:
                self.table.load(whole.ids, whole.keys, whole.values, version, whole.buffers)
            self._texts = None  # read again at their first use
            self.seen_data_version = data_version
            self.full_loads += 1

    def is_stale(self) -> bool:
        """Whether another connection (another process) committed since the table was loaded.

        When no other connection committed since the last check (``PRAGMA data_version`` unchanged), the version
        is not read at all.
        """
        data_version = int(self.conn.execute("PRAGMA data_version").fetchone()[0])
        if data_version == self.seen_data_version:
            return False
        stale = self.version != self.table.version
        if not stale:
            self.seen_data_version = data_version
        return stale

    def catch_up(self, dim: int, value_dim: int) -> CatchUp | None:
        """Bring the table up to the store's version: row by row from the change log, else by a full :meth:`load`.

        Reads only the rows the log names (added or replaced since the table's version), drops the deleted ones, in
        one snapshot (:func:`~kvsearch.storage.catchup.read_delta`). Falls back to :meth:`load` when the log does
        not reach back (compacted, or older than the log), when a change of every row (a generation switch) is in
        the range, or when more rows changed than half the table holds (reading everything is then as cheap).

        Returns:
            What changed, for the index to follow; None after a full :meth:`load` (the index is rebuilt or served).

        Raises:
            CorruptDatabaseError: an embedding has the wrong size.
        """
        with self._reading() as (data_version, version):
            delta = None
            if self.table.keys is not None:
                most = max(1024, len(self.table) // 2)
                shared = self.device.type == "cpu"
                dims = (dim, value_dim)
                delta = catchup.read_delta(
                    self.conn, self.vectors, self.table.version, version, dims, most=most, shared=shared
                )
            if delta is None:
                self.load(dim, value_dim)
                return None
            if self._texts is not None:  # else read at their first use
                for id_ in delta.deleted:
                    self._texts.forget(int(id_))
                self._texts.follow(delta.ids, delta.texts, delta.ids, delta.given)
            changed = self.table.apply(delta)
            self.seen_data_version = data_version
            self.catch_ups += 1
            return changed

    @property
    def texts_held(self) -> bool:
        """Whether the key texts are in memory (:attr:`texts` reads nothing)."""
        return self._texts is not None

    @property
    def texts(self) -> KeyTexts:
        """The key maps and given flags of the records the table holds, read from the store at their first use."""
        if self._texts is None:
            with self.lock, self.snapshot():
                self._texts = read_key_texts(self.conn, self._held, self.path)
        return self._texts

    def _held(self, ids: list[int]) -> set[int]:
        """Those of ``ids`` the table holds (a store ahead of the table names records it does not hold yet)."""
        if not ids:
            return set()
        found = self.table.rows_of(torch.tensor(ids, dtype=torch.long)) >= 0  # (r,)
        return set(np.asarray(ids)[found.numpy()].tolist())

    # ------------------------------------------------------------------ writing

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """``with store.snapshot():`` — a read transaction: every read inside sees one committed state.

        In WAL mode a reader never blocks a writer; nested in a transaction already open, it adds nothing.
        """
        with self.lock:
            conn = self.conn
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
        new_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Insert or update records in one transaction.

        Args:
            keys, values, metadata: one entry per record. A replaced record whose metadata entry is None keeps
                its stored metadata; ``{}`` clears it.
            key_embs: (n, dim) float32. value_embs: (n, value_dim) float32.
            ids: per record, the stored id it replaces in place, or None for a new record (all new if None).
            given: per record, ``GIVEN_KEY | GIVEN_VALUE`` bits (:mod:`kvsearch.storage.schema`): which texts came
                with their own embedding (kept as given: re-encoding the texts skips them). None: no text came
                with an embedding.
            new_ids: the ids the new records take (carried over from another database by a reshard; none of them
                stored), instead of the sequence's next ones; None: the sequence's.

        Returns:
            The ids of the records, in order (new ids are fresh, never reused).
        """
        ids = [None] * len(keys) if ids is None else list(ids)
        key_np = key_embs.detach().to("cpu", torch.float32).contiguous().numpy()  # (n, dim)
        value_np = value_embs.detach().to("cpu", torch.float32).contiguous().numpy()  # (n, value_dim)
        with self.lock:
            with self.transaction():
                rows = (keys, values, metadata)
                done = write_rows(self.conn, self.vectors, rows, (key_np, value_np), ids, given, new_ids,
                                  flags=self._texts is not None)  # fmt: skip
                out, new, old = done.ids, done.new, done.old
                added = out if len(new) == len(out) else [out[i] for i in new]
                self.bump_version({"added": added, "replaced": [out[i] for i in old]})
                views = self._shared_views()
            # Committed: now the table and the key maps follow (still under the lock: readers never see half of it).
            if self._texts is not None:  # else read at their first use
                self._texts.follow(out, keys, [out[i] for i in old], done.flagged)
            self.table.write(out, key_embs, value_embs, replaced=old, added=new, views=views)
        return out

    def delete(self, ids: Sequence[int], *, held: bool = False) -> None:
        """Delete records by id in one transaction.

        Args:
            ids: distinct ids. held: they are ints taken from :attr:`table` under the write lock (a memory's oldest
                records): not looked up again.

        Raises:
            KeyNotFoundError: an id is not stored (nothing is deleted then).
        """
        with self.lock:
            missing = [] if held else self.table.missing_ids(ids)
            if missing:
                raise KeyNotFoundError(f"expected stored ids, got unknown ids {missing[:10]}")
            ids = ids if held else [int(i) for i in ids]
            with self.transaction():
                self._delete_rows(ids)
                self.bump_version({"deleted": ids})
                dims = self.table.keys.shape[1], self.table.values.shape[1]
                repacked = self.vectors.repack_if_needed(self.conn, *dims)  # holes outnumber the records
                if repacked is not None:
                    point_at(self.conn, *repacked)
                views = self._shared_views()
            if repacked is not None:
                self._tidy_files()
            if self._texts is not None:
                for id_ in ids:
                    self._texts.forget(int(id_))
            self.table.drop(ids, views=views)

    def clear(self) -> None:
        """Delete every record in one transaction (a few statements, whatever the count); ids are never reused."""
        with self.lock:
            with self.transaction():
                for table in ("records", "given"):
                    self.conn.execute(f"DELETE FROM {table}")  # our own table names
                self.vectors.clear(self.conn)
                self.bump_version()  # a change of every row: another process reloads its table
            self._tidy_files()
            self.table.clear()
            self._texts = KeyTexts({}, {}, set(), set())

    def last_id(self) -> int:
        """The last id SQLite's AUTOINCREMENT sequence handed out (0: none yet); deleted ids included."""
        return last_id(self.conn)

    def start_ids_after(self, floor: int, *, exactly: bool = False) -> None:
        """Make the next new id ``floor + 1`` or more: seeds SQLite's AUTOINCREMENT sequence (a shard's id range).

        Ids are never lowered unless ``exactly`` (a reshard's new store, whose carried ids of other bands lie above
        ``floor``): a store whose sequence is past ``floor`` is left as it is.
        """
        with self.lock, self.transaction():
            if exactly or self.last_id() < floor:
                seed_ids(self.conn, floor)

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
                moved = self.vectors.write_all(self.conn, *as_numpy)
                if moved is not None:  # a new file set, in id order
                    point_at(self.conn, *moved)
                self.bump_version()
                views = self._shared_views()
            self._tidy_files()
            self.table.replace_all(keys, values, views=views)

    def _delete_rows(self, ids: list[int]) -> None:
        self.vectors.erase(self.conn, schema.delete_records(self.conn, ids))  # slots emptied

    def _shared_views(self) -> Views | None:
        """Inside a write transaction: the records as it leaves them on the shared file mappings (CPU), or None."""
        return self.vectors.views(self.conn) if self.device.type == "cpu" else None

    def bump_version(self, changes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Record one more committed write: the version and its change log entry, inside the open transaction
        (every write calls it last).

        Other processes compare the version with the one their table was loaded at (:meth:`is_stale`) and catch
        up on the logged ids (:meth:`catch_up`).

        Args:
            changes: kind ("added", "replaced", "deleted") -> ids; None when every row may have changed (a
                generation switch), which makes other processes reload everything.
        """
        version = self.version + 1
        self._put_meta("version", version)
        changelog.record(self.conn, version, changes, self.changelog_keep)
        self.table.version = version  # callers reload a stale table before writing (View.writing); a rollback
        # puts the version it found back (Transaction)

    # ------------------------------------------------------------------ reading

    def fetch(self, ids: Iterable[int]) -> dict[int, Record]:
        """Whole records (text, metadata, embeddings) for ids: the texts in one query, the embeddings from the
        in-memory tensors (read from the store only for a record committed since they were loaded)."""
        wanted = sorted({int(i) for i in ids if 0 <= int(i) < 2**63})  # SQLite holds int64 ids only
        table = self.table
        if table.keys is None:
            return {}
        with self.lock, self.snapshot():
            sql = "SELECT id, key, value, metadata FROM records WHERE id IN ({})"
            rows = sorted(select_in(self.conn, sql, wanted))
            at = table.rows_of(torch.tensor([r[0] for r in rows], dtype=torch.long))  # (r,) -1: not in memory yet
            later = [r[0] for r, row in zip(rows, at.tolist()) if row < 0]  # committed since the table was loaded
            if later:
                dims = table.keys.shape[1], table.values.shape[1]
                _, later_keys, later_values = migrate.follow(self.path, self.conn, self.vectors).read_rows(
                    self.conn, later, *dims
                )
        keys, values = table.take(at, (later_keys, later_values) if later else None)  # (r, dim), (r, value_dim)
        return {
            id_: Record(
                id=id_,
                key=key,
                value=value,
                metadata=decode_metadata(meta),
                key_embedding=keys[i].clone(),  # its own storage, not a view of the batch
                value_embedding=values[i].clone(),
            )
            for i, (id_, key, value, meta) in enumerate(rows)
        }

    def _by_ids(self, sql: str, ids: list[int]) -> list[tuple]:
        """The rows of ``sql`` (one ``IN ({})``) for ``ids``: one statement for a search's few, else
        :func:`~kvsearch.storage.schema.select_in`'s chunks. Callers hold a snapshot or a transaction, whose start
        (or the view's sync before it) already reconnected a child of fork(): the connection is used as it is."""
        if len(ids) > IN_CHUNK:
            return select_in(self._connection, sql, ids)
        return self._connection.execute(sql.format(",".join("?" * len(ids))), ids).fetchall() if ids else []

    def value_texts(self, ids: Iterable[int]) -> dict[int, str | None]:
        """Value text for ids (None for embedding-only values), in one query."""
        wanted = sorted({int(i) for i in ids if 0 <= int(i) < 2**63})  # SQLite holds int64 ids only
        return dict(self._by_ids("SELECT id, value FROM records WHERE id IN ({})", wanted))

    def metadata_texts(self, ids: Iterable[int]) -> dict[int, str]:
        """id -> the record's metadata as stored (JSON text), for the ids among ``ids`` that have metadata."""
        wanted = sorted({int(i) for i in ids if int(i) >= 0})
        try:
            return dict(self._by_ids(self._metadata_sql, wanted))
        except sqlite3.OperationalError as exc:  # refused when prepared: nothing was read, the snapshot holds
            if self._metadata_sql is METADATA_PLAIN_SQL or "no such index" not in str(exc):
                raise
        self._metadata_sql = METADATA_PLAIN_SQL
        return dict(self._by_ids(self._metadata_sql, wanted))

    def hit_texts(self, ids: list[int], *, values: bool, metadata: bool) -> tuple[dict[int, str], dict[int, str]]:
        """The value texts and the metadata texts of a search's hits, in one statement (callers hold a snapshot).

        Args:
            ids: stored ids (others are skipped).
            values: whether to read the value texts. metadata: whether to read the metadata texts.

        Returns:
            id -> value text (for the ids whose value has one), id -> metadata JSON (for those with metadata).
        """
        if not (values or metadata):
            return {}, {}
        wanted = sorted({i for i in ids if 0 <= i < 2**63})  # SQLite holds int64 ids only
        if not wanted:
            return {}, {}
        if not values:
            return {}, self.metadata_texts(wanted)
        column = "metadata" if metadata else "NULL"
        rows = self._by_ids(f"SELECT id, value, {column} FROM records WHERE id IN ({{}})", wanted)
        return {i: v for i, v, _ in rows if v is not None}, {i: m for i, _, m in rows if m is not None}

    def metadata_known_absent(self) -> bool:
        """Whether :meth:`has_metadata` found no metadata at the table's version (no read: False if it did not ask)."""
        return self._metadata_at == ((self.table.version, self.seen_data_version), False)

    def has_metadata(self) -> bool:
        """Whether any record has metadata (callers hold a snapshot): one read of the partial index of the records
        with metadata, remembered for the table's version either way (:meth:`metadata_known_absent`). Without that
        index (an earlier store opened read-only) it says True: the hits' metadata are then read every time."""
        at = (self.table.version, self.seen_data_version)
        if self._metadata_at is not None and self._metadata_at[0] == at:
            return self._metadata_at[1]
        try:
            found = self.conn.execute(METADATA_ANY_SQL).fetchone() is not None
        except sqlite3.OperationalError as exc:  # refused when prepared: nothing was read
            if "no such index" not in str(exc):
                raise
            return True
        self._metadata_at = (at, found)
        return found

    def answer_values(self, ids: Sequence[int], *, texts: bool = True) -> dict[int, str | Tensor | None]:
        """id -> the value as an answer shows it: its text, or its embedding (CPU tensor) when it has no text.

        Args:
            ids: stored ids (an id no longer stored maps to None).
            texts: whether values may have text; without (no value encoder) nothing is read from SQLite.
        """
        out: dict[int, str | Tensor | None] = self.value_texts(ids) if texts else dict.fromkeys(ids)
        need_emb = [i for i, text in out.items() if text is None]
        if need_emb:
            out.update(self.table.values_of(need_emb))
        return out

    def ids_where(self, where: dict[str, Any]) -> Tensor:
        """The ids of the records whose metadata satisfies a filter (see :mod:`kvsearch.metadata.filters`).

        Args:
            where: a filter such as ``{"lang": "en", "year": {"$gte": 2000}}``.

        Returns:
            (m,) int64 CPU tensor of sorted ids.

        Raises:
            InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter.
        """
        sql, params = where_sql(where)  # every user value is a bound parameter
        rows = self.conn.execute(f"SELECT id FROM records WHERE {sql} ORDER BY id", params).fetchall()
        return torch.tensor([r[0] for r in rows], dtype=torch.long)  # (m,)

    def close(self) -> None:
        """Close the SQLite connection (in a child of fork(), only the child's own connection) and the write lock,
        and let go of the mapped vector files: a closed store holds no file descriptor (a tensor the caller still
        holds keeps its own mapping alive)."""
        with self.lock:
            if self._pid == os.getpid() or self.path is None:
                self._connection.close()
            self.write_lock.close()
            self.table.clear()
            self._texts = KeyTexts({}, {}, set(), set())
            self.vectors.release()


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


def _identity_now(path: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``path`` now, None where it is gone (:meth:`Store.check_file`'s ``stat``)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino
