"""Opening a database folder: the folder checked and made, the store opened, the parts made from the configuration.

:class:`~kvsearch.Database` checks the kinds of its options (:func:`check_options`), then opens in four steps,
each a function here:

1. :func:`open_store`: the folder is checked (a file, ``read_only`` without a database, what is left of a database
   whose store is gone), made if new, and its store opened with the lock timeout; what a failed creation made is
   removed again (:class:`~kvsearch.storage.folder.Creation`), a failed reopen touches nothing;
2. :func:`open_view` on the :class:`~kvsearch.view.View` of that store: :func:`create` (a new database: the
   configuration from what was given, recorded in the store) or :func:`reopen` (the stored configuration, checked
   against what was given; the encoders' files loaded and settled);
3. both hand back the :class:`Parts`: the configuration, the encoders and the retriever (its index served from
   the saved one or rebuilt), which the view adopts;
4. generation 1 of a new database is recorded, or the keys of one whose stored key embeddings are not its
   encoder's (:func:`kvsearch.generations.key_mismatch`) are re-encoded (:func:`repair`), both through the
   view's generation switch (:meth:`~kvsearch.view.View.switch`: under the write lock).

This module knows nothing of reads, writes, or how locks are taken and generations written.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvsearch import generations
from kvsearch.encoders.base import Encoder
from kvsearch.encoders.encoder_set import EncoderSet
from kvsearch.errors import (
    CorruptDatabaseError,
    DatabaseLockedError,
    InconsistentDatabaseError,
    InvalidArgumentError,
    NonFiniteError,
    ReadOnlyDatabaseError,
)
from kvsearch.retrieval import Retriever
from kvsearch.storage import fileio
from kvsearch.storage import folder as folders
from kvsearch.storage.config import check_reopen, new_config
from kvsearch.storage.encoder_files import EncoderFiles
from kvsearch.storage.store import Store

if TYPE_CHECKING:  # annotations only
    from kvsearch.view import View

__all__ = ["Given", "Parts", "check_options", "open_store", "open_view", "repair", "create", "reopen", "new_retriever"]


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


def check_options(search_params: object, read_only: object) -> None:
    """Check the kinds of ``Database(search_params=, read_only=)``.

    Raises:
        InvalidArgumentError: ``search_params`` is neither None nor a dict, or ``read_only`` is not a bool.
    """
    if search_params is not None and not isinstance(search_params, Mapping):
        got = type(search_params).__name__
        raise InvalidArgumentError(f"expected search_params as a dict such as {{'nprobe': 16}}, got {got}")
    if not isinstance(read_only, bool):
        raise InvalidArgumentError(f"expected read_only as a bool, got {read_only!r}")


def open_store(
    path: Path | None, device: torch.device, *, read_only: bool, lock_timeout: float
) -> tuple[Store, folders.Creation | None]:
    """The store of the database folder ``path`` (None: in memory), and the creation to undo if opening fails.

    The creation is None for an existing database (nothing of it is removed on failure). A store opened read-only
    although ``read_only`` was not asked for (its folder or file cannot be written) is warned about, once.

    Raises:
        InvalidArgumentError: ``path`` is a file, or ``read_only`` without an existing database.
        MissingFileError: the folder holds kvsearch files but no store.
        DiskFullError, ReadOnlyDatabaseError, CorruptDatabaseError: the folder or the store cannot be made or read.
    """
    if path is not None and path.exists() and not path.is_dir():
        raise InvalidArgumentError(f"expected a folder for the database, got a file: {path}")
    exists = path is not None and folders.is_database(path)
    if read_only and not exists:
        where = "a database in memory" if path is None else f"{path} without {folders.STORE_FILE}"
        raise InvalidArgumentError(f"expected an existing database folder to open with read_only=True, got {where}")
    if path is not None and not exists:
        folders.check_store_present(path)  # what is left of a database whose store is gone: never a new one
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
    except BaseException:
        store.close()
        if creation is not None:
            creation.rollback()
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
