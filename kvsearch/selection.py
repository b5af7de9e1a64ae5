"""Filter-only operations: the records a filter selects, read, counted, aggregated, deleted or updated without a query.

    db.where({"lang": "en"}).count()                        # Chroma's count, Qdrant's count
    db.where({"year": {"$gte": 2000}}).records(limit=20)    # Chroma's get, Qdrant's scroll: in id order
    db.where({"draft": True}).delete()                      # Chroma's delete(where=): one transaction
    db.where(ids=[3, 7]).update({"reviewed": True})         # Qdrant's set_payload: metadata only
    db.where().distinct("lang")                             # [("en", 812), ("fr", 95), ...]

A :class:`Selection` is a filter held for later, not a snapshot: each call runs it again, in SQL
(:mod:`kvsearch.metadata.filters`, :mod:`kvsearch.storage.queries`), on what is committed then. Reads run in one
store snapshot;
writes take the write lock and run in one transaction, as every write does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvsearch.checks import check_int
from kvsearch.inputs import id_tensor
from kvsearch.metadata.filters import check_where
from kvsearch.storage import queries

if TYPE_CHECKING:  # annotations only
    from kvsearch.storage.store import Record
    from kvsearch.view import View
    from kvsearch.writes import Writes

__all__ = ["Selection", "selection_filter", "page"]


class Selection:
    """The records a filter selects (see :meth:`kvsearch.Database.where`).

    Args:
        view: the database's view (store, locks, snapshots).
        writes: the database's write path (for :meth:`delete` and :meth:`update`).
        where: a filter (:mod:`kvsearch.metadata.filters`); None selects every record.
        ids: only these ids as well (any iterable of ints, a tensor or an array); None: no such limit.

    Raises:
        InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter or ids (checked here, at once).
    """

    def __init__(self, view: View, writes: Writes, where: Mapping[str, Any] | None, ids: Any = None) -> None:
        self._view, self._writes, self.where = view, writes, selection_filter(where, ids)

    def __repr__(self) -> str:
        return f"Selection(where={self.where!r})"

    def count(self) -> int:
        """How many records it selects."""
        with self._view.reading():
            return queries.count(self._view.store.conn, self.where)

    def ids(self, *, limit: int | None = None, offset: int = 0) -> Tensor:
        """The ids of the selected records in id order: (m,) int64 on the CPU (see :meth:`records` for the paging)."""
        limit, offset = page(limit, offset)
        with self._view.reading():
            return id_tensor(queries.ids(self._view.store.conn, self.where, limit, offset))

    def records(self, *, limit: int | None = None, offset: int = 0) -> list[Record]:
        """The selected records in id order (texts, metadata and embeddings), read in one snapshot.

        Args:
            limit: at most this many (None: all). offset: skip this many first (paging: ``offset += limit``).

        Raises:
            InvalidArgumentError: a negative ``offset`` or a ``limit`` below 0.
        """
        limit, offset = page(limit, offset)
        with self._view.reading():
            store = self._view.store
            wanted = queries.ids(store.conn, self.where, limit, offset)
            fetched = store.fetch(wanted)
        return [fetched[i] for i in wanted]

    def distinct(self, field: str) -> list[tuple[Any, int]]:
        """The distinct values of a field in the selected records, with how many hold each, most frequent first.

        A field is a metadata dot path or ``$id`` / ``$key`` / ``$value``. A list counts each member; ``1`` and
        ``1.0`` are one value, ``True`` another; missing fields are not counted, null is (as None).

        Raises:
            InvalidArgumentError: a bad field name.
        """
        with self._view.reading():
            return queries.distinct(self._view.store.conn, field, self.where)

    def min_max(self, field: str) -> tuple[Any, Any] | None:
        """The smallest and largest value of a field in the selected records: over its numbers when it holds any,
        else its datetimes and dates (as instants), else its strings. None when none holds such a value.

        Raises:
            InvalidArgumentError: a bad field name.
        """
        with self._view.reading():
            return queries.min_max(self._view.store.conn, field, self.where)

    def fields(self) -> dict[str, list[str]]:
        """The top-level metadata fields of the selected records, each with the kinds of value seen (sorted among
        ``"array" "bool" "datetime" "null" "number" "object" "text"``)."""
        with self._view.reading():
            return queries.fields(self._view.store.conn, self.where)

    def delete(self) -> list[int]:
        """Delete the selected records in one transaction.

        Returns:
            The deleted ids, sorted.

        Raises:
            ReadOnlyDatabaseError, DatabaseLockedError: as every write.
        """
        return self._writes.delete_where(self.where)

    def update(self, metadata: Mapping[str, Any], *, merge: bool = True) -> list[int]:
        """Set the metadata of the selected records in one transaction; nothing is re-encoded.

        Args:
            metadata: a dict (checked as :meth:`kvsearch.Database.add` checks metadata).
            merge: True: its top-level keys replace or join each record's own (a key set to None holds null);
                False: it replaces each record's metadata whole (``{}`` clears it).

        Returns:
            The updated ids, sorted.

        Raises:
            InvalidArgumentError, NonFiniteError: metadata that cannot be stored (nothing is written).
            ReadOnlyDatabaseError, DatabaseLockedError: as every write.
        """
        return self._writes.update_metadata(self.where, metadata, merge=merge)


def selection_filter(where: Mapping[str, Any] | None, ids: Any = None) -> Mapping[str, Any]:
    """The one filter a selection runs: ``where`` (None: every record), limited to ``ids`` when given.

    Args:
        where: a filter (:mod:`kvsearch.metadata.filters`) or None.
        ids: only these ids as well (any iterable of ints, a tensor or an array); None: no such limit.

    Returns:
        The filter, checked.

    Raises:
        InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter or ids.
    """
    where = {} if where is None else where
    check_where(where)
    if ids is not None:
        wanted = [int(i) for i in id_tensor(ids).reshape(-1).tolist()]
        where = {"$and": [where, {"$id": {"$in": wanted}}]}
    return where


def page(limit: object, offset: object) -> tuple[int | None, int]:
    """A page of a selection's records in id order, checked: ``(limit or None, offset)``.

    Raises:
        InvalidArgumentError: a ``limit`` or ``offset`` that is not an int in [0, 2**63).
    """
    if limit is not None:
        limit = check_int(limit, "limit", low=0, high=2**63 - 1)
    offset = check_int(offset, "offset", low=0, high=2**63 - 1)  # what SQLite's LIMIT / OFFSET take
    return limit, offset
