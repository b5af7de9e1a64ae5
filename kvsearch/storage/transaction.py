"""A store's write transaction: BEGIN IMMEDIATE under the folder's write lock, then COMMIT, or ROLLBACK on error."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import TYPE_CHECKING

from kvsearch.errors import DatabaseLockedError
from kvsearch.storage import fileio

if TYPE_CHECKING:
    from kvsearch.storage.store import Store

__all__ = ["Transaction"]


class Transaction:
    """``with store.transaction():`` — BEGIN IMMEDIATE under the write lock, then COMMIT, or ROLLBACK on error.

    Nested inside an open transaction it is a SAVEPOINT (``depth_owner`` is False): an error inside rolls back only
    its own writes, and the outermost one commits. Every write transaction first checks that the store file is
    still the one opened (:meth:`Store.check_file`). A commit the file system refuses (a full disk) is rolled back
    and raised as :class:`~kvsearch.errors.DiskFullError`; a rolled-back transaction leaves the table's version
    as it found it.

    Raises:
        ReadOnlyDatabaseError: the store is read-only. DatabaseLockedError: another writer holds it.
        StoreChangedError: the store file was deleted or replaced. DiskFullError: no space to commit.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.depth_owner = False
        self.savepoint: str | None = None
        self.loaded = store.table.version

    def __enter__(self) -> None:
        store = self.store
        conn = store.conn
        self.loaded = store.table.version
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
        conn = self.store.conn
        if self.savepoint is not None:
            if exc_type is None:
                conn.execute(f"RELEASE {self.savepoint}")
                return
            if conn.in_transaction:  # SQLite may have rolled the whole transaction back itself (a full disk)
                with contextlib.suppress(sqlite3.Error):
                    conn.execute(f"ROLLBACK TO {self.savepoint}")
                    conn.execute(f"RELEASE {self.savepoint}")
            self.store.table.version = self.loaded
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
        conn = self.store.conn
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        self.store.table.version = self.loaded

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
