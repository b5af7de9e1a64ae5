"""Reading a store's vectors for the in-memory table: whole (:func:`read_whole`), or what changed since a version
(:func:`read_delta`, from the change log).

Both run inside the caller's snapshot (one read transaction: the rows and the version they are at) and hand back what
to give :class:`~kvsearch.storage.table.VectorTable`; the store owns the snapshot, the lock and the counters. A
whole read is checked against the records summary the triggers keep (:func:`check_summary`).

This module knows SQL and arrays: nothing of transactions, key texts, FAISS or autograd.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kvsearch.errors import CorruptDatabaseError
from kvsearch.storage import changelog
from kvsearch.storage.buffers import MIN_ROOM, row_buffer
from kvsearch.storage.embeddings import Vectors
from kvsearch.storage.schema import SUMMARY_MOD, SUMMARY_SCAN, select_in
from kvsearch.storage.table import Delta, Views

__all__ = ["Whole", "read_whole", "read_delta", "check_summary", "given_of_ids"]


@dataclass(frozen=True)
class Whole:
    """Every record, read in one snapshot: either ``views`` (shared mappings, nothing copied) or copies.

    Attributes:
        views: the records on the shared file mappings, or None (then the copies below).
        ids: (n,) int64, slot order. keys: (n, dim) float32. values: (n, value_dim) float32.
        buffers: the CPU buffers with room that ``keys`` and ``values`` were read into.
    """

    views: Views | None
    ids: np.ndarray | None = None
    keys: np.ndarray | None = None
    values: np.ndarray | None = None
    buffers: tuple[Tensor, ...] = ()


def read_whole(
    conn: sqlite3.Connection, vectors: Vectors, dims: tuple[int, int], *, shared: bool, path: Path | None
) -> Whole:
    """Every record's embeddings: views of the shared file mappings when ``shared`` and the records hold one run of
    slots (nothing copied), else copies into buffers with room to grow.

    Args:
        conn: the store's connection, inside a snapshot. vectors: its vectors. dims: (dim, value_dim).
        shared: whether views may be taken (the table is on the CPU). path: the store's file, for messages.

    Raises:
        CorruptDatabaseError: the embeddings do not have the expected dims, or do not match the records.
    """
    views = vectors.views(conn, *dims) if shared else None
    if views is not None:
        ids, _, _, first = views
        check_summary(conn, ids, np.arange(first, first + len(ids), dtype=np.int64), path)
        return Whole(views)
    buffers: list[Tensor] = []

    def alloc(rows: int, width: int) -> np.ndarray:
        buffer = row_buffer(rows + max(MIN_ROOM, rows // 8), width, like=torch.empty(0))  # (capacity, width)
        buffers.append(buffer)
        return buffer[:rows].numpy()

    ids, slots, keys, values = vectors.read_all(conn, *dims, alloc=alloc)
    if vectors.slotted:
        check_summary(conn, ids, slots, path)
    return Whole(None, ids, keys, values, tuple(buffers))


def read_delta(
    conn: sqlite3.Connection,
    vectors: Vectors,
    seen: int,
    version: int,
    dims: tuple[int, int],
    *,
    most: int,
    shared: bool,
) -> Delta | None:
    """What was committed between versions ``seen`` and ``version``, from the change log (inside a snapshot).

    Args:
        conn: the store's connection. vectors: its vectors. seen: the version the table holds. version: the store's.
        dims: (dim, value_dim). most: the most changed rows worth reading one by one (else everything is read).
        shared: whether the records may be handed as views of the shared mappings (the table is on the CPU).

    Returns:
        The delta, or None: read everything instead (the log does not reach back to ``seen``, a change of every row
        is in the range, more rows than ``most`` changed, or a logged record is gone).

    Raises:
        CorruptDatabaseError: an embedding has the wrong size.
    """
    changes = changelog.read(conn, seen, version)
    if changes is None or len(changes) > most:
        return None
    rows, keys, values = vectors.read_rows(conn, changes.upserted, *dims)
    if len(rows) != len(changes.upserted):
        return None
    views = vectors.views(conn, *dims) if shared else None  # the records of this snapshot, shared, when one run
    return Delta(
        version=version,
        deleted=list(changes.deleted),
        ids=list(changes.upserted),  # sorted, as the rows
        keys=torch.from_numpy(keys),  # (u, dim)
        values=torch.from_numpy(values),  # (u, value_dim)
        views=views,
        texts=[key for _, key, _ in rows],
        given=[(id_, bits) for id_, bits in sorted(given_of_ids(conn, changes.upserted).items()) if bits],
    )


def given_of_ids(conn: sqlite3.Connection, ids: Sequence[int]) -> dict[int, int]:
    """id -> its ``given`` bits, for those of the ids that have any."""
    return dict(select_in(conn, "SELECT id, side FROM given WHERE id IN ({})", ids))


def check_summary(conn: sqlite3.Connection, ids: np.ndarray, slots: np.ndarray, path: Path | None) -> None:
    """Check that the embeddings hold the records the records table lists, each in the slot it names.

    Compared with the records summary the triggers keep (:data:`~kvsearch.storage.schema.SUMMARY`): the count and
    the sums of the ids, of the slots and of ``id XOR slot`` — no row of the records table is read. A store without
    a summary (read-only, written before it) is compared by one scan of the records table.

    Raises:
        CorruptDatabaseError: they differ (the file was damaged or changed by hand).
    """
    expected = summary(np.asarray(ids, dtype=np.int64), slots)
    try:
        found = conn.execute("SELECT n, ids, slots, pairs FROM records_summary").fetchone()
    except sqlite3.OperationalError:  # a store written before the summary, opened read-only
        found = None
    if found is None:
        found = conn.execute(SUMMARY_SCAN).fetchone()
    if tuple(found) != expected:
        raise CorruptDatabaseError(
            f"{path or 'the store'}: the embeddings hold {len(ids)} records that are not the {found[0]} records of "
            "the records table (the file was damaged or changed from outside)"
        )


def summary(ids: np.ndarray, slots: np.ndarray) -> tuple[int, int, int, int]:
    """(count, sum of ids, sum of slots, sum of ``id XOR slot``), the sums mod :data:`SUMMARY_MOD`, as the records
    summary's triggers count them. ids (n,), slots (n,) int64, non-negative.

    Ids and slots below the modulus (the usual case) need no modulo per element (~15 ns each in numpy): a sum of 2**31
    values under 2**31 fits 64 bits. (A million records: ~5 ms.)
    """
    m, n = SUMMARY_MOD, len(ids)
    if not n:
        return 0, 0, 0, 0
    small = int(ids.max()) < m and int(slots.max()) < m and n < 2**31
    ids_m, slots_m = (ids, slots) if small else (ids % m, slots % m)
    xor = np.bitwise_xor(ids, slots)  # (n,) < 2**31 when both are
    xor_m = xor if small else xor % m
    return n, int(ids_m.sum() % m), int(slots_m.sum() % m), int(xor_m.sum() % m)
