"""The exception types of kvsearch, all under one base class.

Every error says what was expected and what came, and is raised before anything is
written: the database is left exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "KVSearchError",
    "InvalidArgumentError",
    "MissingEncoderError",
    "UnknownOptionError",
    "DimensionMismatchError",
    "NonFiniteError",
    "EmptyKeyError",
    "DuplicateKeyError",
    "KeyNotFoundError",
    "UnknownTargetError",
    "EmptyDatabaseError",
    "DatabaseClosedError",
    "ConfigMismatchError",
    "CorruptDatabaseError",
    "DatabaseLockedError",
    "MissingDependencyError",
    "BadFileError",
    "MemoryLimitError",
    "StorageError",
    "DiskFullError",
    "ReadOnlyDatabaseError",
    "MissingFileError",
    "StoreChangedError",
    "NotPicklableError",
    "WrongKindError",
    "ForeignFolderError",
    "FileLimitError",
    "DatabaseExistsError",
    "DatabaseNotFoundError",
]


class KVSearchError(Exception):
    """Base class of every error kvsearch raises on purpose."""


class InvalidArgumentError(KVSearchError, ValueError):
    """An argument has the wrong type or an out-of-range value (for example k < 1)."""


class MissingEncoderError(InvalidArgumentError):
    """Texts came for a side (keys, values or queries) that this database has no encoder for; pass embeddings."""


class UnknownOptionError(KVSearchError, ValueError):
    """A named option (score, pooling, index spec, encoder type) is not one we know."""


class DimensionMismatchError(KVSearchError, ValueError):
    """An embedding or query has a different dimension from the one expected."""


class NonFiniteError(KVSearchError, ValueError):
    """An embedding, query or numeric value holds NaN or Inf."""


class EmptyKeyError(KVSearchError, ValueError):
    """A key is the empty string (or only white space)."""


class DuplicateKeyError(KVSearchError, ValueError):
    """A key appears twice in one batch, or is already stored."""


class KeyNotFoundError(KVSearchError, KeyError):
    """No record has this key (or id)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "key not found"


class UnknownTargetError(KeyNotFoundError, InvalidArgumentError):
    """A (query, target) pair's target matches no stored record: no stored key (``targets="key"``) or no stored
    value text (``targets="value"``), whatever the side. A :class:`KeyNotFoundError` (a ``KeyError``) and an
    :class:`InvalidArgumentError` (a ``ValueError``): the types an unknown key and an unknown value raised before.

    Attributes:
        pairs: the argument whose targets these are (``"train_pairs"``, ``"eval_pairs"``, ``"pairs"``), or None.
        positions: the positions in it of the pairs whose target is unknown, in order.
        targets: ``"key"`` or ``"value"``, or None.
        other_kind: whether all or most of the unknown targets are of the other kind (stored value texts for key
            targets, stored keys for value targets).
    """

    def __init__(
        self,
        message: str,
        *,
        pairs: str | None = None,
        positions: list[int] | None = None,
        targets: str | None = None,
        other_kind: bool = False,
    ) -> None:
        super().__init__(message)
        self.pairs = pairs
        self.positions: list[int] = list(positions or [])
        self.targets = targets
        self.other_kind = other_kind


class EmptyDatabaseError(KVSearchError, LookupError):
    """The database holds no records, so there is nothing to search."""


class DatabaseClosedError(KVSearchError, RuntimeError):
    """The database was closed and cannot be used any more."""


class ConfigMismatchError(KVSearchError, ValueError):
    """A database is reopened with options that differ from the ones it was created with."""


class CorruptDatabaseError(KVSearchError, RuntimeError):
    """A file of the database is damaged or foreign and cannot be rebuilt from the store."""


class MissingFileError(CorruptDatabaseError):
    """A file the database needs (``store.sqlite``, an encoder json) is missing; the message says how to restore it."""


class StoreChangedError(CorruptDatabaseError):
    """``store.sqlite`` was deleted or replaced from outside while the database was open: nothing more is written."""


class InconsistentDatabaseError(CorruptDatabaseError):
    """The stored key embeddings are not the key encoder's: written by an older version, or damaged."""


class NothingToRollBackError(KVSearchError, RuntimeError):
    """There is no previous generation of encoders to return to (none yet, or it was already rolled back)."""


class DatabaseLockedError(KVSearchError, RuntimeError):
    """Another process holds the write lock of this database."""


class MissingDependencyError(KVSearchError, ImportError):
    """An optional dependency (such as matplotlib for plots) is not installed; the message names the extra."""


class BadFileError(KVSearchError, ValueError):
    """An input file (CSV, TSV or JSONL) cannot be read or has bad rows; nothing was written from it.

    Attributes:
        problems: every bad row found, as ``(line number, what is wrong)``, in file order.
    """

    def __init__(self, message: str, problems: list[tuple[int, str]] | None = None) -> None:
        super().__init__(message)
        self.problems: list[tuple[int, str]] = list(problems or [])


class MemoryLimitError(KVSearchError, MemoryError):
    """An operation would need more memory than it may use; it is refused before anything is written."""


class StorageError(KVSearchError, OSError):
    """The file system refused a write (or an open): the message names the path and the cause."""


class DiskFullError(StorageError):
    """No space left on the device (or the quota is used up); the write was rolled back, nothing of it kept."""


class FileLimitError(StorageError):
    """The process may not open more files (``EMFILE`` / ``ENFILE``, ``ulimit -n``): nothing is damaged; the message
    names the limit and what needed more (for example a shard count), and how to raise it."""


class ReadOnlyDatabaseError(StorageError):
    """The database is open read-only (asked for, or its folder or file system cannot be written): no writes."""


class WrongKindError(InvalidArgumentError):
    """The folder holds the other kind of database (a plain one where a sharded one was asked for, or the reverse);
    the message names what is there and how to open it. Nothing was written."""


class ForeignFolderError(InvalidArgumentError):
    """A new database was asked for in a folder that holds files of its own (not a kvsearch database): the folder is
    left alone; the message names some of its files."""


class DatabaseExistsError(InvalidArgumentError):
    """A new database (a reshard's destination) was asked for where a kvsearch database already is: it is left alone;
    the message names it."""


class DatabaseNotFoundError(InvalidArgumentError, FileNotFoundError):
    """An existing database was asked for (``create=False``, an unpickled database or model) where there is none:
    nothing was created; the message names the folder and what is there instead."""


class DistributedError(KVSearchError, RuntimeError):
    """A peer process of a sharded database died, hung past the timeout, or a collective failed."""


class NotSupportedError(KVSearchError, NotImplementedError):
    """What was asked is not supported here yet (e.g. across shards); the message says what is."""


class NotPicklableError(KVSearchError, TypeError):
    """This database cannot be pickled (one in memory, a sharded one): the message says what to save instead."""
