"""The change log: which ids each committed write touched, so that another process catches up on them alone.

Every write transaction of the store bumps its version and, in the same transaction, records here what that
version changed (:func:`record`)::

    changes(version INTEGER, kind TEXT, ids BLOB)      PRIMARY KEY (version, kind)

    kind  "added"     new records (ids never reused)
          "replaced"  records whose key / value / embeddings were overwritten in place (an upsert)
          "deleted"   records removed
          "full"      every row may have changed (a generation switch: refresh, fine-tuning, rollback); ids empty

``ids`` is the little-endian int64 array of the ids. Every version has at least one row, so a reader knows the log
reaches back to its loaded version when it finds one row per version since (:func:`read`). The log is bounded:
each write deletes the rows older than its version minus ``keep`` (default :data:`KEEP_VERSIONS`) in the same
transaction. A reader whose loaded version is older than that, or whose range holds a "full" change, reloads
everything instead (the store stays the single source of truth: the log only says which rows to read again).

This module knows SQL and ids only: nothing of tensors, indexes or the records' contents.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SCHEMA", "KINDS", "KEEP_VERSIONS", "Changes", "record", "read"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS changes (
    version INTEGER NOT NULL,
    kind TEXT NOT NULL,
    ids BLOB NOT NULL,
    PRIMARY KEY (version, kind)
) WITHOUT ROWID;
"""

#: The kinds of change a version records.
KINDS = ("added", "replaced", "deleted", "full")
#: Versions the log keeps by default: a reader more than this many writes behind reloads everything.
KEEP_VERSIONS = 1000


@dataclass(frozen=True)
class Changes:
    """The net effect of the versions after a reader's loaded version, up to the store's version.

    Attributes:
        upserted: sorted ids whose rows must be read again (added or replaced since, and still stored).
        deleted: sorted ids removed since (each may or may not be in the reader's table).
    """

    upserted: list[int]
    deleted: list[int]

    def __len__(self) -> int:
        return len(self.upserted) + len(self.deleted)


def record(conn: sqlite3.Connection, version: int, changes: Mapping[str, Sequence[int]] | None, keep: int) -> None:
    """Record what ``version`` changed and drop the rows older than ``version - keep`` (inside the open transaction).

    Args:
        conn: the connection, inside the write transaction that bumps the version to ``version``.
        version: the version being committed.
        changes: kind ("added", "replaced", "deleted") -> ids; None for a change of every row ("full").
        keep: how many versions the log keeps (>= 1).

    Raises:
        ValueError: an unknown kind.
        sqlite3.Error: the write failed (the caller's transaction rolls back).
    """
    rows: list[tuple[int, str, bytes]] = []
    if changes is None:
        rows.append((version, "full", b""))
    else:
        for kind, ids in changes.items():
            if kind not in KINDS[:3]:
                raise ValueError(f"expected a change kind among {KINDS[:3]}, got {kind!r}")
            if len(ids):
                rows.append((version, kind, np.asarray(ids, dtype="<i8").tobytes()))
        if not rows:  # a write that changed no row still marks its version as logged
            rows.append((version, "added", b""))
    conn.executemany("INSERT OR REPLACE INTO changes (version, kind, ids) VALUES (?, ?, ?)", rows)
    conn.execute("DELETE FROM changes WHERE version <= ?", (version - max(1, int(keep)),))


def read(conn: sqlite3.Connection, since: int, until: int) -> Changes | None:
    """The net changes of the versions ``since + 1 .. until``, or None when a full reload is needed.

    None when the log does not reach back to ``since + 1`` (compacted, or written before the log existed), when a
    version is missing, when a "full" change is in the range, or when the store has no log table (read-only, older).

    Args:
        conn: the connection, inside the read transaction that read ``until``.
        since: the version the reader's table reflects.
        until: the store's version now (> since).

    Returns:
        The net effect (an id added then deleted in the range appears in neither list).
    """
    try:
        rows = conn.execute(
            "SELECT version, kind, ids FROM changes WHERE version > ? AND version <= ? ORDER BY version",
            (since, until),
        ).fetchall()
    except sqlite3.OperationalError:  # no such table: a store of an earlier version opened read-only
        return None
    if len({r[0] for r in rows}) != until - since:
        return None
    upserted: set[int] = set()
    deleted: set[int] = set()
    for _, kind, blob in rows:
        if kind == "full":
            return None
        ids = np.frombuffer(blob, dtype="<i8").tolist()
        if kind == "deleted":
            upserted.difference_update(ids)
            deleted.update(ids)
        else:
            upserted.update(ids)
            deleted.difference_update(ids)  # never happens (ids are not reused), kept for safety
    return Changes(upserted=sorted(upserted), deleted=sorted(deleted))
