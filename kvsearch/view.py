"""One process's view of a database folder: its store, encoders and index kept in step with the folder, under its locks.

    view = View(path, store)                 # the store opened by kvsearch.opening.open_store
    view.adopt(opening.create(...))          # the configuration, the encoders and the retriever
    with view.writing(): ...                 # the write lock held, the view brought up to date first
    with view.reading(): ...                 # one SQLite snapshot, the view up to date with it

:class:`View` is what :class:`~kvsearch.Database` and its write and read paths (:class:`~kvsearch.writes.Writes`,
:class:`~kvsearch.reads.Reads`) share. It holds the store, the folder's encoder files, the current configuration,
the encoders and the retriever, whether it is closed and how deep ``atomic()`` blocks are open. It takes the locks
(a write: the store lock and the folder's write lock; a read: the store lock and one snapshot), brings this view up
to date with what other processes committed (:meth:`View.sync`), runs the transaction of ``atomic()`` and puts the
mirror and the index back after a failed one, switches generations under the write lock (:meth:`View.switch`),
records search parameters in the configuration, saves what changed and closes.

It knows nothing of the facade, nor of the writes and reads that use it: input checks, encoding, answers.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsearch import generations
from kvsearch.errors import (
    DatabaseClosedError,
    DatabaseLockedError,
    NonFiniteError,
    NotSupportedError,
    ReadOnlyDatabaseError,
)
from kvsearch.storage import fileio
from kvsearch.storage.encoder_files import EncoderFiles
from kvsearch.storage.store import Store

if TYPE_CHECKING:  # annotations only
    from kvsearch.encoders.encoder_set import EncoderSet
    from kvsearch.opening import Parts
    from kvsearch.retrieval import Retriever

__all__ = ["View"]


class View:
    """One process's view of an open database folder (see the module docstring).

    Args:
        path: the database folder, or None for a database in memory.
        store: its record store, open.

    Attributes:
        store, files: the record store and the folder's encoder files.
        config: the current configuration (replaced when another process records a new one).
        encoders, retriever: the encoders and the retriever (set by :meth:`adopt`; the retriever is never
            replaced after, only reloaded).
        closed: whether :meth:`close` ran.
        depth: how many ``atomic()`` blocks are open.
    """

    def __init__(self, path: Path | None, store: Store) -> None:
        self.path = path
        self.store = store
        self.files = EncoderFiles(path, store)
        self.config: dict[str, Any] = {}
        self.encoders: EncoderSet
        self.retriever: Retriever
        self.closed = False
        self.depth = 0  # depth of atomic() blocks open

    def adopt(self, parts: Parts) -> None:
        """Take the configuration, encoders and retriever that :mod:`kvsearch.opening` made."""
        self.config, self.encoders, self.retriever = parts

    @property
    def dim(self) -> int:
        return int(self.config["dim"])

    @property
    def value_dim(self) -> int:
        return int(self.config["value_dim"])

    def check_open(self) -> None:
        if self.closed:
            raise DatabaseClosedError("this database was closed; open the folder again to use it")

    def check_writable(self) -> None:
        if self.store.read_only is not None:
            raise ReadOnlyDatabaseError(
                f"{self.path} is open read-only ({self.store.read_only}): writes are refused, nothing was written"
            )

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold this folder's write lock (bounded wait) and bring a stale view up to date first.

        Raises:
            DatabaseClosedError: the database was closed.
            ReadOnlyDatabaseError: the database is read-only (nothing is locked or written).
            DatabaseLockedError: another writer held the lock for longer than ``lock_timeout``.
            DiskFullError: the file system refused the write for lack of space (it was rolled back).
            StoreChangedError: ``store.sqlite`` was deleted or replaced since the database was opened.
        """
        self.check_open()
        self.check_writable()
        with self.store.lock, self.store.write_lock:
            self.sync()
            with fileio.storage_errors(self.path, "writing to the database"):
                yield

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A consistent read: one store snapshot, this process's view brought up to date with it first.

        Every read runs in a SQLite read transaction (WAL: it never blocks a writer), so the texts and metadata
        it fetches are those of the same committed state as the in-memory tensors and the index it searches.

        Raises:
            DatabaseClosedError: the database was closed.
        """
        with self.store.lock:
            self.check_open()
            with self.store.snapshot():
                self.sync()
                yield

    def sync(self) -> None:
        """Reload what another process changed since this view was loaded (callers hold the store lock).

        ``PRAGMA data_version`` says whether another connection committed at all (no table read); only then is
        the store version read. When it moved, the mirror catches up on the rows the change log names and the
        index removes / adds just those ids (:meth:`Store.catch_up`); when the log does not reach back or holds a
        change of every row (a new generation: the encoders are reloaded too, their weights loaded into this
        process's encoder objects), the mirror is reloaded whole and the retriever serves the saved index of that
        version or rebuilds it.
        """
        if self.path is None:
            return
        self.store.check_file()  # raises StoreChangedError: never read or write a store deleted from the folder
        if not self.store.is_stale():
            return
        config = self.store.get_meta("config") or self.config
        encoders_moved = config.get("encoders_version", 0) != self.config.get("encoders_version", 0)
        self.config = dict(config)
        if encoders_moved:
            self.encoders.reload(self.config)
            self.store.load(self.dim, self.value_dim)
            self.retriever.open()
            return
        caught = self.store.catch_up(self.dim, self.value_dim)
        if caught is None:
            self.retriever.open()
        else:
            self.retriever.apply(removed=caught.removed, added=caught.added, keys=caught.keys)

    def catch_up(self) -> None:
        """Bring this view up to date outside a snapshot (text queries are encoded with the encoders as they are)."""
        with self.store.lock:
            self.check_open()
            self.sync()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """``Database.atomic``: the writes inside are one transaction under the write lock; on an exception (or a
        refused commit) the mirror and the index are reloaded from what is committed."""
        with self.writing():
            try:
                with self.store.transaction():
                    self.depth += 1
                    try:
                        yield
                    finally:
                        self.depth -= 1
            except BaseException:
                self.store.load(self.dim, self.value_dim)  # back to what is committed: the mirror and the index
                self.retriever.open()
                raise

    def switch(self, what: str, switch: Callable[..., dict[str, Any]], **options: Any) -> dict[str, Any]:
        """Switch generation (``generations.commit`` or ``rollback``) under the write lock, adopt the configuration
        it records and rebuild the index; refused inside ``atomic()``, whose rollback could not undo its files."""
        with self.writing():
            if self.depth:
                raise NotSupportedError(f"{what} inside atomic() is not supported: its files could not be rolled back")
            self.config = switch(self.store, self.files, self.encoders, self.config, **options)
            self.retriever.rebuild()
        return self.config

    def set_search_params(self, params: dict[str, float]) -> None:
        """``Database.set_search_params``: set them on the index and record them in the configuration."""
        with self.writing():
            self.retriever.set_params(**params)
            self.config["search_params"] = {**self.config.get("search_params", {}), **params}
            self.store.set_meta("config", self.config)

    def describe(self) -> dict[str, Any]:
        """The encoders and their generation, read in one snapshot (see :func:`kvsearch.generations.describe`)."""
        with self.reading():
            return generations.describe(self.files, self.encoders, self.config)

    def save(self, *, wait: bool, stacklevel: int = 3) -> None:
        """Write the changed encoders (waiting for the lock) and the changed index (waiting only if ``wait``).

        Nothing changed, nothing is written and no lock is taken: a process that only read never blocks on,
        or overwrites, what another process wrote. The index is derived data: ``close`` writes it only if the
        lock is free at once (else the next open rebuilds it from the store). ``stacklevel`` is the warning's
        (changed encoders not saved), counted from here: 3 is the caller of the caller.
        """
        if self.path is None or self.store.read_only is not None:  # a read-only reader never writes, not even the index
            return
        self.store.check_file()
        if self.encoders.changed():
            try:
                self.switch("a new generation", generations.commit)
            except NonFiniteError as exc:  # never saved: the folder keeps its last good generation
                warnings.warn(f"kvsearch: the changed encoders were not saved: {exc}", RuntimeWarning, stacklevel)
        if not self.retriever.needs_save:
            return
        with self.store.lock:
            try:
                self.store.write_lock.acquire(timeout=None if wait else 0.0)
            except DatabaseLockedError:
                if wait:
                    raise
                return
            try:
                if not self.store.is_stale():
                    self.retriever.save()
            finally:
                self.store.write_lock.release()

    def close(self, *, stacklevel: int = 3) -> None:
        """``Database.close``: save what changed (not waiting for the index's lock), then close the store; closing
        twice is harmless. ``stacklevel`` as :meth:`save`'s, counted from here."""
        if self.closed:
            return
        try:
            self.save(wait=False, stacklevel=stacklevel + 1)
        finally:
            self.closed = True
            self.store.close()
