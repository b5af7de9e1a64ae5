"""One process's view of a database folder: opened, kept in step with the folder under its locks, closed.

    store, creation = open_store(path, device, read_only=False, lock_timeout=10.0)
    view = View(path, store)
    open_view(view, creation, device, Given(encoder=NgramEncoder()))  # create or reopen: the view adopts its parts
    with view.writing(): ...                 # the write lock held, the view brought up to date first
    with view.reading(): ...                 # one SQLite snapshot, the view up to date with it

:class:`View` is what :class:`~kvsearch.Database` and its write and read paths (:class:`~kvsearch.writes.Writes`,
:class:`~kvsearch.reads.Reads`) share. It holds the store, the folder's encoder files, the current configuration,
the encoders and the retriever, whether it is closed and how deep ``atomic()`` blocks are open. It takes the locks
(a write: the store lock and the folder's write lock; a read: the store lock and one snapshot), brings this view up
to date with what other processes committed (:meth:`View.sync`), runs the transaction of ``atomic()`` and puts the
store's in-memory table and the index back after a failed one, switches generations under the write lock
(:meth:`View.switch`), records search parameters in the configuration, saves what changed and closes.

Opening, in four steps (the facade first checks the kinds of its options: :func:`check_options`):

1. :func:`open_store`: the folder is checked (a file, ``read_only`` without a database, what is left of a database
   whose store is gone), made if new, and its store opened with the lock timeout; what a failed creation made is
   removed again (:class:`~kvsearch.storage.folder.Creation`), a failed reopen touches nothing;
2. :func:`open_view` on the :class:`View` of that store: :func:`create` (a new database: the configuration from
   what was :class:`Given`, recorded in the store) or :func:`reopen` (the stored configuration, checked against what
   was given; the encoders' files loaded and settled);
3. both hand back the :class:`Parts`: the configuration, the encoders and the retriever (its index served from the
   saved one or rebuilt), which the view adopts;
4. generation 1 of a new database is recorded, or the keys of one whose stored key embeddings are not its encoder's
   (:func:`kvsearch.generations.key_mismatch`) are re-encoded (:func:`repair`), both through :meth:`View.switch`.

A database is a resource like a dataset, never duplicated by a copy of the model that holds it: :func:`same_object`
is its ``copy.copy`` and ``copy.deepcopy``, and :func:`reduce_database` its ``__reduce__`` (a folder and the options
that reopen it; a database in memory refuses).

It knows nothing of the facade, nor of the writes and reads that use it: input checks, encoding, answers.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

from kvsearch import generations
from kvsearch.encoders.base import Encoder
from kvsearch.encoders.encoder_set import EncoderSet
from kvsearch.errors import (
    CorruptDatabaseError,
    DatabaseClosedError,
    DatabaseLockedError,
    DatabaseNotFoundError,
    InconsistentDatabaseError,
    InvalidArgumentError,
    NonFiniteError,
    NotPicklableError,
    NotSupportedError,
    ReadOnlyDatabaseError,
)
from kvsearch.retrieval import Retriever
from kvsearch.storage import fileio
from kvsearch.storage import folder as folders
from kvsearch.storage.config import check_reopen, new_config
from kvsearch.storage.encoder_files import EncoderFiles
from kvsearch.storage.store import Store

__all__ = [
    "View",
    "Given",
    "Parts",
    "check_options",
    "open_store",
    "open_view",
    "repair",
    "create",
    "reopen",
    "same_object",
    "reduce_database",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Given:
    """What ``Database(...)`` was given to create a database with, or to check a reopened one against (None: not
    given)."""

    encoder: Encoder | None = None
    value_encoder: Encoder | None = None
    dim: int | None = None
    value_dim: int | None = None
    index: str | None = None
    score: str | None = None
    search_params: Mapping[str, float] | None = None


class Parts(NamedTuple):
    """What a database is made of besides its store and encoder files."""

    config: dict[str, Any]
    encoders: EncoderSet
    retriever: Retriever


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
        """Take the configuration, encoders and retriever that :func:`create` or :func:`reopen` made."""
        self.config, self.encoders, self.retriever = parts

    @property
    def dim(self) -> int:
        return int(self.config["dim"])

    @property
    def value_dim(self) -> int:
        return int(self.config["value_dim"])

    @property
    def score(self) -> str:
        """The database's score function (fixed when it was created)."""
        return str(self.config["score"])

    @property
    def index_spec(self) -> str:
        """The database's index spec (fixed when it was created)."""
        return str(self.config["index"])

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
        the store version read. When it moved, the store's table catches up on the rows the change log names
        (:meth:`Store.catch_up <kvsearch.storage.store.Store.catch_up>`) and the index removes / adds just those ids;
        when the log does not reach back or holds a change of every row (a new generation: the encoders are reloaded
        too, their weights loaded into this process's encoder objects), the table is reloaded whole and the retriever
        serves the saved index of that version or rebuilds it.
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

    def current(self) -> bool:
        """Whether this view is up to date with the store, asked without reading it (callers hold the store lock): in
        memory always; on disk when the folder still holds the file opened and no other connection committed since
        the last sync (``PRAGMA data_version``: one statement, no table read). A read that needs nothing from SQLite
        may then answer from this process's memory, outside a snapshot (a commit after this check is not seen: the
        answer is that of the moment before it).

        Raises:
            StoreChangedError: the store file was deleted or replaced.
        """
        if self.path is None:
            return True
        self.store.check_file()
        return not self.store.is_stale()

    def catch_up(self) -> None:
        """Bring this view up to date outside a snapshot (text queries are encoded with the encoders as they are)."""
        with self.store.lock:
            self.check_open()
            self.sync()

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """``Database.atomic``: the writes inside are one transaction under the write lock; on an exception (or a
        refused commit) the store's table and the index are reloaded from what is committed."""
        with self.writing():
            try:
                with self.store.transaction():
                    self.depth += 1
                    try:
                        yield
                    finally:
                        self.depth -= 1
            except BaseException:
                self.store.load(self.dim, self.value_dim)  # back to what is committed: the table and the index
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

    def record_run(self, summary: Mapping[str, Any]) -> None:
        """Record a fine-tuning run that committed nothing as the last run (``encoders_info()["last_run"]``); the
        generation, the encoders and the records stay as they are. A read-only database records nothing."""
        if self.store.read_only is None:
            with self.writing():
                self.store.set_meta("last_run", dict(summary))

    def set_search_params(self, params: dict[str, float]) -> None:
        """``Database.set_search_params``: set them on the index and record them in the configuration."""
        with self.writing():
            self.retriever.set_params(**params)
            self.config["search_params"] = {**self.config.get("search_params", {}), **params}
            self.store.set_meta("config", self.config)

    def summary(self, device: torch.device) -> str:
        """``repr(db)``: where the database lives, its records (or closed) and its options."""
        where = "memory" if self.path is None else str(self.path)
        state = "closed" if self.closed else f"{len(self.store.table)} records"
        return (
            f"Database({where!r}, {state}, dim={self.dim}, value_dim={self.value_dim}, "
            f"index={self.index_spec!r}, score={self.score!r}, device={device})"
        )

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
            if hasattr(self, "retriever"):  # (a creation that failed has none)
                self.retriever.release()


# --------------------------------------------------------------------------- copies and pickles


def same_object(obj: T, memo: object = None) -> T:
    """``copy.copy`` and ``copy.deepcopy`` of a database: the database itself.

    A database is a resource like a dataset: ``copy.deepcopy(model)`` and ``AveragedModel(model)`` share it by
    reference, never duplicate it (``memo``: the deep copy's, unused).
    """
    return obj


def reduce_database(view: View, device: torch.device, opener: Callable[..., T]) -> tuple[Callable[..., T], tuple[str]]:
    """``Database.__reduce__``: a database on disk pickles as its folder and the options that reopen it.

    The encoders, dims, index and score are in the folder; the pickle holds the folder's absolute path, ``device``,
    ``read_only``, ``lock_timeout`` and the search parameters when set. Loading it opens a fresh handle on the folder
    in the loading process (on the same device), which sees the records as they are then; ``create=False``: a folder
    that is gone (moved, renamed, deleted) raises ``DatabaseNotFoundError`` naming it. Encoders changed in
    memory but not saved are not in the folder: a ``RuntimeWarning`` says so (``save_encoders()`` first).

    Args:
        view: the database's view. device: its device. opener: what reopens it (the database's class).

    Returns:
        ``(functools.partial(opener, **options), (path,))``, as ``__reduce__`` returns it.

    Raises:
        NotPicklableError: the database is in memory: nothing outside this process could reopen it.
        DatabaseClosedError: the database was closed (open the folder again, and pickle that).
    """
    if view.path is None:
        raise NotPicklableError(
            "a database in memory (Database(None)) cannot be pickled: its records live only in this process. "
            "Save the model's state_dict() instead (it never holds the database) and pass a database to the layer "
            "when you rebuild it, or use a database on disk, which pickles as its folder"
        )
    view.check_open()
    if view.encoders.changed():
        warnings.warn(
            f"kvsearch: pickling {view.path}: its encoders changed and were not saved; the pickle reopens the folder "
            "with the saved ones (call save_encoders() first to keep the changes)",
            RuntimeWarning,
            stacklevel=3,  # the caller of pickle.dumps (reduce_database <- __reduce__ <- dumps, which is C)
        )
    options: dict[str, Any] = {
        "device": str(device),
        "read_only": view.store.read_only is not None,
        "lock_timeout": view.store.write_lock.timeout,
        "create": False,  # a folder that moved is named as such, never made anew and empty
    }
    if view.config.get("search_params"):
        options["search_params"] = dict(view.config["search_params"])
    return functools.partial(opener, **options), (str(view.path.absolute()),)


# --------------------------------------------------------------------------- opening


def check_options(search_params: object, read_only: object, create: object = True) -> None:
    """Check the kinds of ``Database(search_params=, read_only=, create=)``.

    Raises:
        InvalidArgumentError: ``search_params`` is neither None nor a dict, or ``read_only`` or ``create`` is not a
            bool.
    """
    if search_params is not None and not isinstance(search_params, Mapping):
        got = type(search_params).__name__
        raise InvalidArgumentError(f"expected search_params as a dict such as {{'nprobe': 16}}, got {got}")
    for name, flag in (("read_only", read_only), ("create", create)):
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"expected {name} as a bool, got {flag!r}")


def open_store(
    path: Path | None,
    device: torch.device,
    read_only: bool,
    lock_timeout: float,
    create: bool = True,
    *,
    inside_ok: bool = False,
) -> tuple[Store, folders.Creation | None]:
    """The store of the database folder ``path`` (None: in memory), and the creation to undo if opening fails.

    The creation is None for an existing database (nothing of it is removed on failure). A store opened read-only
    although ``read_only`` was not asked for (its folder or file cannot be written) is warned about, once. A new
    database is made only in an absent or empty folder outside other databases (``inside_ok``: a shard, inside its
    sharded root); never with ``create=False``.

    Raises:
        DatabaseNotFoundError: ``create=False`` and no database at ``path`` (or ``path`` is None).
        InvalidArgumentError: ``path`` is a file, or ``read_only`` without an existing database.
        WrongKindError: the folder holds a sharded database, or a new one would lie inside another database.
        ForeignFolderError: a new database in a folder of other files.
        MissingFileError: the folder holds kvsearch files but no store.
        DiskFullError, ReadOnlyDatabaseError, CorruptDatabaseError: the folder or the store cannot be made or read.
    """
    if path is not None and path.exists() and not path.is_dir():
        raise InvalidArgumentError(f"expected a folder for the database, got a file: {path}")
    exists = path is not None and folders.is_database(path)
    if path is not None:
        with fileio.storage_errors(path, "opening the database folder", "nothing was written"):  # EMFILE: typed
            folders.check_kind(path, "plain")  # a sharded root: WrongKindError, whatever else was asked
            if not exists and not create:
                folders.check_store_present(path)  # what is left of a database: MissingFileError, as a reopen says
                raise DatabaseNotFoundError(_not_found(path))
            if not exists and not read_only:  # never among someone else's files, nor beside what is left of one
                folders.check_new_folder(path, inside_ok=inside_ok)
    if not create and not exists:  # in memory
        raise DatabaseNotFoundError(_not_found(path))
    if read_only and not exists:
        where = "a database in memory" if path is None else f"{path} without {folders.STORE_FILE}"
        raise InvalidArgumentError(f"expected an existing database folder to open with read_only=True, got {where}")
    # what a failed creation leaves behind is removed again; a failed reopen touches nothing
    creation = None if exists else folders.Creation(path)
    if path is not None:
        with fileio.storage_errors(path, "creating the database folder", "nothing was created"):
            path.mkdir(parents=True, exist_ok=True)
    try:
        store = Store(None if path is None else path / folders.STORE_FILE, device, read_only=read_only)
    except BaseException:
        if creation is not None:
            creation.rollback()
        raise
    store.write_lock.timeout = float(lock_timeout)
    if store.read_only is not None and not read_only:
        warnings.warn(
            f"kvsearch: {path} was opened read-only ({store.read_only}); reads work, writes raise "
            "ReadOnlyDatabaseError",
            RuntimeWarning,
            stacklevel=3,  # the caller of Database()
        )
    return store, creation


def _not_found(path: Path | None) -> str:
    """Why ``create=False`` found no database at ``path``: what is there instead."""
    if path is None:
        return "expected an existing database folder (create=False), got None: a database in memory is always new"
    if not path.exists():
        there = "no such folder"
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is not None and parent != path.parent.absolute():
            there += f" (the nearest existing folder above it is {parent})"
    elif not any(path.iterdir()):
        there = "an empty folder"
    else:
        there = f"a folder without {folders.STORE_FILE}"
    return (
        f"expected an existing database at {path} (create=False: nothing is made), got {there}. "
        "Was it moved or renamed? A pickled database or model reopens its folder by the absolute path it had"
    )


def open_view(view: View, creation: folders.Creation | None, device: torch.device, given: Given) -> None:
    """Create or reopen the database whose store ``view`` holds, and hand the view its parts.

    Args:
        view: the view of the store :func:`open_store` opened. creation: what :func:`open_store` returned with it.
        device: the database's device. given: what the database was given.

    Raises:
        As :func:`create`, :func:`reopen` and :func:`repair`; CorruptDatabaseError: a store without configuration
        (its creation never finished). On any exception the store is closed and what a creation made is removed.
    """
    store = view.store
    try:
        saved = store.get_meta("config")
        if saved is not None:
            view.adopt(reopen(store, view.files, device, saved, given))
            mismatch = generations.key_mismatch(store, view.encoders.key)
            if mismatch > generations.KEY_TOLERANCE:  # by an older version during a run that stopped, or damaged
                repair(view, mismatch)
        elif store.read_only is not None:
            raise CorruptDatabaseError(f"{store.path} holds no configuration: its creation never finished")
        else:
            with fileio.storage_errors(view.path, "creating the database", "nothing of it was kept"):
                view.adopt(create(store, view.files, device, given))
                view.switch("a new generation", generations.commit)  # generation 1: the encoders as given
    except BaseException as exc:
        out_of_files = isinstance(exc, Exception) and fileio.is_out_of_files(exc)  # asked before closing frees files
        store.close()
        if creation is not None:
            creation.rollback()
        if out_of_files:  # what it is, never "corrupt"
            raise fileio.file_limit_error(exc, view.path, "opening the database", "nothing was written") from None
        raise


def repair(view: View, mismatch: float) -> None:
    """Re-encode the keys of a database whose stored key embeddings are not its key encoder's (a new generation).

    Raises:
        InconsistentDatabaseError: they could not be re-encoded (locked, not finite, read-only).
    """
    what = f"{view.path}: the stored key embeddings differ from the key encoder's by up to {mismatch:.3g}"
    try:
        view.switch("a new generation", generations.commit, force={"keys"})  # as Database.refresh()
    except (DatabaseLockedError, NonFiniteError, ReadOnlyDatabaseError) as exc:
        raise InconsistentDatabaseError(f"{what}; they could not be re-encoded ({exc})") from None
    # stacklevel 3: Database.__init__ (repair <- open_view <- Database.__init__), where it always pointed
    warnings.warn(f"kvsearch: {what}; every key was re-encoded with the stored encoder", RuntimeWarning, 3)


def create(store: Store, files: EncoderFiles, device: torch.device, given: Given) -> Parts:
    """The parts of a new database: its configuration (recorded in the store), encoders and an empty index.

    Raises:
        InvalidArgumentError, UnknownOptionError, DimensionMismatchError: what was given does not make a database.
    """
    g = given
    if g.encoder is None and g.dim is None and files.folder is not None:  # most often a mistyped path: say so
        raise InvalidArgumentError(
            f"expected an encoder or an explicit dim to create a new database: {files.folder} holds none, so one "
            "would be made there. To open an existing database, check the path (create=False never makes one)"
        )
    config, value_encoder = new_config(
        g.encoder, g.value_encoder, g.dim, g.value_dim, g.index, g.score, g.search_params
    )
    retriever = new_retriever(store, config, files.folder)
    encoders = EncoderSet.create(files, device, key=g.encoder, value=value_encoder)
    config = {**config, **encoders.flags()}
    store.set_meta("config", config)
    store.load(config["dim"], config["value_dim"])
    return Parts(config, encoders, retriever)


def reopen(store: Store, files: EncoderFiles, device: torch.device, saved: dict[str, Any], given: Given) -> Parts:
    """The parts of an existing database, from its stored configuration ``saved`` (what was given must agree).

    Raises:
        ConfigMismatchError: a dim, index, score or encoder that differs from the stored one.
        MissingFileError, CorruptDatabaseError: an encoder's file is missing or damaged.
    """
    dims = {"dim": given.dim, "value_dim": given.value_dim, "index": given.index, "score": given.score}
    config = check_reopen(saved, files.folder, given.search_params, **dims)
    encoders = EncoderSet.reopen(
        files, device, config, key=given.encoder, value=given.value_encoder, where=files.folder
    )
    files.settle()
    store.load(config["dim"], config["value_dim"])
    retriever = new_retriever(store, config, files.folder)
    retriever.open()
    return Parts(config, encoders, retriever)


def new_retriever(store: Store, config: dict[str, Any], folder: Path | None) -> Retriever:
    """The retriever of this store, with the configuration's index spec, score and search parameters."""
    options = {"spec": config["index"], "score": config["score"], "params": config.get("search_params") or {}}
    return Retriever(store, dim=config["dim"], folder=folder, **options)
