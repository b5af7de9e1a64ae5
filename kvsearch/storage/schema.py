"""The SQLite file of a store: its tables, the queries and bits the storage wing shares, and how it is opened.

- :data:`SCHEMA`: the tables (``meta``, ``records``, ``given``, the chunks of :mod:`kvsearch.storage.chunks`, the
  file sets' state of :mod:`kvsearch.storage.vector_file`, the change log of :mod:`kvsearch.storage.changelog`, the
  records summary kept by triggers: :data:`SUMMARY`, :func:`init_summary`) and :data:`METADATA_INDEX`, the partial
  index of the records that have metadata (:data:`METADATA_SQL` reads through it, :data:`METADATA_PLAIN_SQL`
  without it).
- :data:`GIVEN_KEY`, :data:`GIVEN_VALUE`: the bits of ``given.side``.
- :func:`connect_read_only`, :func:`connect_writable`, :func:`connect_in_memory`, :func:`reconnect`: connections as
  the store opens them (autocommit: the store opens its transactions itself); :func:`open_error`: the typed error of
  a file that cannot be opened.
- :func:`select_in`: the rows of a query with one ``IN ({})`` for any number of values.
- :func:`insert_records`, :func:`delete_records`: rows of ``records`` (and ``given``) added / deleted, in one
  statement for a run of consecutive ids (a kNN memory's adds and drops).

This module knows nothing of what the records mean, of transactions, versions or the in-memory tensors
(:mod:`kvsearch.storage.store`, :mod:`kvsearch.storage.catchup`).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsearch.errors import CorruptDatabaseError, DatabaseLockedError, StorageError
from kvsearch.storage import changelog, chunks, fileio, vector_file

__all__ = [
    "SCHEMA",
    "METADATA_INDEX",
    "METADATA_SQL",
    "METADATA_PLAIN_SQL",
    "METADATA_ANY_SQL",
    "GIVEN_KEY",
    "GIVEN_VALUE",
    "SQLITE_CANTOPEN",
    "connect_read_only",
    "connect_writable",
    "connect_in_memory",
    "reconnect",
    "open_error",
    "select_in",
    "IN_CHUNK",
    "insert_records",
    "delete_records",
    "init_summary",
    "SUMMARY_MOD",
    "SUMMARY_SCAN",
]

SCHEMA = """
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
METADATA_INDEX = "CREATE INDEX IF NOT EXISTS records_with_metadata ON records (id) WHERE metadata IS NOT NULL;"
SCHEMA += METADATA_INDEX
#: The metadata of the hits of a search, through the partial index of the ids that have any: a hit without metadata
#: costs no read of its row (a random page of the table, ~10-20 us each), only a look in that small index.
METADATA_SQL = (
    "SELECT id, metadata FROM records INDEXED BY records_with_metadata WHERE metadata IS NOT NULL AND id IN ({})"
)
#: Whether any record has metadata: one step into the partial index (a store without it raises "no such index").
METADATA_ANY_SQL = "SELECT 1 FROM records INDEXED BY records_with_metadata WHERE metadata IS NOT NULL LIMIT 1"
#: The same without the index: a store of an earlier version opened read-only, or one whose records table another
#: process rebuilt (until the next writable open makes the index again).
METADATA_PLAIN_SQL = "SELECT id, metadata FROM records WHERE id IN ({}) AND metadata IS NOT NULL"
#: Bits of ``given.side``: the record's key / value text came with its own embedding (never re-encoded).
GIVEN_KEY, GIVEN_VALUE = 1, 2

SCHEMA += chunks.SCHEMA  # the embeddings in memory, and of stores written before file sets (kvsearch.storage.chunks)
SCHEMA += vector_file.SCHEMA  # the embeddings on disk (see kvsearch.storage.vector_file)

#: The modulus of the records summary's sums (a prime below 2**31: every sum of a write fits 64 bits).
SUMMARY_MOD = 2147483647
#: The records summary: kept by triggers in every transaction that changes ``records`` (whoever runs it), so that an
#: open compares the embeddings' ids and slots with the records table without reading the table: the count, and the
#: sums (mod :data:`SUMMARY_MOD`) of the ids, of the slots and of ``id XOR slot`` (``(id | slot) - (id & slot)``).
SUMMARY = """
CREATE TABLE IF NOT EXISTS records_summary (
    one INTEGER PRIMARY KEY CHECK (one = 0), n INTEGER NOT NULL, ids INTEGER NOT NULL, slots INTEGER NOT NULL,
    pairs INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS records_summary_insert AFTER INSERT ON records BEGIN
    UPDATE records_summary SET n = n + 1, ids = (ids + new.id % {m}) % {m}, slots = (slots + new.slot % {m}) % {m},
        pairs = (pairs + ((new.id | new.slot) - (new.id & new.slot)) % {m}) % {m};
END;
CREATE TRIGGER IF NOT EXISTS records_summary_delete AFTER DELETE ON records BEGIN
    UPDATE records_summary SET n = n - 1, ids = (ids + {m} - old.id % {m}) % {m},
        slots = (slots + {m} - old.slot % {m}) % {m},
        pairs = (pairs + {m} - ((old.id | old.slot) - (old.id & old.slot)) % {m}) % {m};
END;
CREATE TRIGGER IF NOT EXISTS records_summary_update AFTER UPDATE OF id, slot ON records BEGIN
    UPDATE records_summary SET ids = (ids + {m} - old.id % {m} + new.id % {m}) % {m},
        slots = (slots + {m} - old.slot % {m} + new.slot % {m}) % {m},
        pairs = (pairs + {m} - ((old.id | old.slot) - (old.id & old.slot)) % {m}
            + ((new.id | new.slot) - (new.id & new.slot)) % {m}) % {m};
END;
""".replace("{m}", str(SUMMARY_MOD))
#: The summary of a store whose records table was written before the summary (or without it): one scan.
SUMMARY_SCAN = (
    f"SELECT count(*), coalesce(sum(id % {SUMMARY_MOD}), 0) % {SUMMARY_MOD}, "
    f"coalesce(sum(slot % {SUMMARY_MOD}), 0) % {SUMMARY_MOD}, "
    f"coalesce(sum(((id | slot) - (id & slot)) % {SUMMARY_MOD}), 0) % {SUMMARY_MOD} FROM records"
)
SUMMARY_INIT = f"INSERT OR IGNORE INTO records_summary (one, n, ids, slots, pairs) SELECT 0, * FROM ({SUMMARY_SCAN})"
SCHEMA += changelog.SCHEMA  # the change log: written in every write transaction (see kvsearch.storage.changelog)

_SQLITE_BUSY, _SQLITE_LOCKED, SQLITE_CANTOPEN = 5, 6, 14
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
        if fileio.sqlite_code(exc) != SQLITE_CANTOPEN or pending:
            raise
    conn = sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=timeout, **_CONNECT)
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return conn


def connect_writable(path: Path, timeout: float) -> sqlite3.Connection:
    """A connection to the store file ``path``, created (with our tables) if it does not exist.

    Raises:
        StorageError: the file cannot be created (:class:`~kvsearch.errors.DiskFullError`, ...).
        sqlite3.Error: SQLite cannot open it or make its tables.
    """
    with fileio.storage_errors(path, "creating the store", "nothing was created"):
        fileio.create_new(path)  # made by us with the umask's mode, not SQLite's fixed 0644
    conn = sqlite3.connect(str(path), timeout=timeout, **_CONNECT)
    try:
        # A record is ~4 dim bytes of embeddings: 16 KiB pages hold several, and a 64 MiB WAL between
        # checkpoints, insert ~1.5x faster than SQLite's 4 KiB / 4 MiB defaults (page_size only takes
        # effect when the file is created; it must come before WAL mode).
        conn.execute("PRAGMA page_size=16384")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA wal_autocheckpoint=4096")
        conn.executescript(SCHEMA)
        init_summary(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def connect_in_memory(timeout: float) -> sqlite3.Connection:
    """A new in-memory database with our tables."""
    conn = sqlite3.connect(":memory:", timeout=timeout, **_CONNECT)
    conn.executescript(SCHEMA)
    init_summary(conn)
    return conn


def init_summary(conn: sqlite3.Connection) -> None:
    """Make the records summary and its triggers; count it once for a store written before it had one (one scan;
    new stores: none). A store of the earlier format (no slots yet) gets it once moved (:mod:`.migrate`)."""
    if "slot" not in {row[1] for row in conn.execute("PRAGMA table_info(records)")}:
        return
    conn.executescript(SUMMARY)
    if conn.execute("SELECT 1 FROM records_summary").fetchone() is None:
        conn.execute(SUMMARY_INIT)


def reconnect(path: Path, timeout: float) -> sqlite3.Connection:
    """A fresh writable connection to the existing store file ``path`` (a child of fork() opens its own).

    Raises:
        sqlite3.Error: SQLite cannot open it.
    """
    conn = sqlite3.connect(str(path), timeout=timeout, **_CONNECT)
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def open_error(exc: sqlite3.Error, path: Path | None) -> Exception:
    """The typed error of a store that cannot be opened: full, read-only, unreachable, locked, or damaged."""
    typed = fileio.storage_error(exc, path, "opening the store", "nothing was written")
    if typed is not None:
        return typed
    code = fileio.sqlite_code(exc)
    if code in (_SQLITE_BUSY, _SQLITE_LOCKED):
        return DatabaseLockedError(f"another process holds {path} locked: {exc}")
    if code in _SQLITE_ACCESS:
        return StorageError(f"cannot open {path} (SQLite said: {exc})")
    return CorruptDatabaseError(f"{path} is not a kvsearch store (SQLite said: {exc})")


#: Values bound in one ``IN (...)`` at most: under SQLite's bound-parameter limit.
IN_CHUNK = 900


def select_in(conn: sqlite3.Connection, sql: str, values: Sequence[Any]) -> list[tuple]:
    """The rows of ``sql`` (one ``IN ({})``) for every value, in chunks under SQLite's bound-parameter limit."""
    rows: list[tuple] = []
    for start in range(0, len(values), IN_CHUNK):
        chunk = list(values[start : start + IN_CHUNK])
        rows.extend(conn.execute(sql.format(",".join("?" * len(chunk))), chunk).fetchall())
    return rows


#: New records without texts or metadata, of consecutive ids and slots: one statement for all of them.
_INSERT_RANGE = (
    "WITH RECURSIVE s(i) AS (VALUES(0) UNION ALL SELECT i + 1 FROM s WHERE i + 1 < ?) "
    "INSERT INTO records (slot, id) SELECT ? + i, ? + i FROM s"
)


def insert_records(
    conn: sqlite3.Connection,
    keys: Sequence[str | None],
    values: Sequence[str | None],
    metadata: Sequence[str | None],
    slots: Sequence[int],
    ids: Sequence[int],
) -> None:
    """Insert new rows of ``records`` (inside the caller's transaction), one per id.

    Rows of embeddings only (no key or value text, no metadata; a kNN memory's adds) whose ids and slots ascend one
    by one are inserted by ONE statement (about 6x faster than a statement a row: SQLite's AUTOINCREMENT counter and
    the key index are updated once per statement); any other rows one statement each.

    Args:
        keys, values: the texts (None: none). metadata: the JSON text (None: none). slots, ids: ascending ints.
    """
    n = len(ids)
    if not n:
        return
    consecutive = ids[-1] - ids[0] == n - 1 and slots[-1] - slots[0] == n - 1  # ascending: consecutive
    if consecutive and keys.count(None) + values.count(None) + metadata.count(None) == 3 * n:  # no texts
        conn.execute(_INSERT_RANGE, (n, int(slots[0]), int(ids[0])))
        return
    conn.executemany(
        "INSERT INTO records (key, value, metadata, slot, id) VALUES (?, ?, ?, ?, ?)",
        zip(keys, values, metadata, slots, ids),
    )


def delete_records(conn: sqlite3.Connection, ids: Sequence[int]) -> np.ndarray:
    """Delete the rows of ``records`` and ``given`` of stored ids (inside the caller's transaction): their slots.

    A run of consecutive ascending ids (the oldest records of a kNN memory) takes one statement per table; other ids
    one statement each.

    Args:
        ids: distinct stored ids.

    Returns:
        (n,) int64: the slots the records held, in the order of ``ids``.
    """
    n = len(ids)
    if n and ids[-1] - ids[0] == n - 1 and ids == list(range(ids[0], ids[0] + n)):
        span = (int(ids[0]), int(ids[-1]))
        slots = conn.execute("SELECT slot FROM records WHERE id BETWEEN ? AND ? ORDER BY id", span).fetchall()
        conn.execute("DELETE FROM records WHERE id BETWEEN ? AND ?", span)
        conn.execute("DELETE FROM given WHERE id BETWEEN ? AND ?", span)
        return np.array(slots, dtype=np.int64).reshape(-1)
    slot_of = dict(select_in(conn, "SELECT id, slot FROM records WHERE id IN ({})", list(ids)))
    conn.executemany("DELETE FROM records WHERE id = ?", ((i,) for i in ids))
    conn.executemany("DELETE FROM given WHERE id = ?", ((i,) for i in ids))
    return np.array([slot_of[i] for i in ids], dtype=np.int64)
