"""Filter-only operations across the shards: the records a filter selects, counted, read, aggregated, deleted or
updated without a query, collectively.

    sel = sdb.where({"lang": "en"})          # collective: every rank, the same filter
    sel.count(); sel.ids(limit=20); sel.records(offset=20, limit=20); sel.distinct("lang"); sel.min_max("year")
    sel.fields(); sel.update({"reviewed": True}); sel.delete()     # each collective, the same answer on every rank

A :class:`ShardedSelection` has the operations of a plain :class:`~kvsearch.selection.Selection`, with the same
arguments and answers as one database holding every shard's records: every rank calls each operation with the same
arguments, each answers for its own shards (each shard's own ``where``), and the answers are merged: counts summed,
ids merged in id order before the page is cut, distinct values counted per value over the shards (ordered as one
database orders them: most frequent first, then by kind and value), min / max over the shards' ends of the kind
that wins (numbers, else datetimes, else texts), fields with the union of their kinds. ``delete`` and ``update`` run
on every shard, each in one transaction of its own (a selection spanning shards is atomic per shard, as a sharded
write is); they return the ids merged.

Reads run in one snapshot per shard, not across shards (each shard has its own store). An error on one rank (a bad
field, a read-only shard) is raised on every rank (:meth:`~kvsearch.distributed.collectives.Comm.agree`).

It knows nothing of the facade (it holds this rank's :class:`~kvsearch.distributed.local.LocalShards`) nor of SQL
or a shard's internals: each shard's public ``where`` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import date
from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvsearch.distributed.collectives import Comm, collective, describe
from kvsearch.errors import DistributedError, InvalidArgumentError
from kvsearch.inputs import check_metadata, id_tensor
from kvsearch.metadata.codec import epoch_us
from kvsearch.selection import Selection, page

if TYPE_CHECKING:
    from kvsearch.distributed.local import LocalShards
    from kvsearch.storage.store import Record

__all__ = ["ShardedSelection", "same_on_every_rank"]

_LAST = 2**63 - 1  # the largest limit SQLite takes


class ShardedSelection:
    """The records a filter selects in a sharded database (see :meth:`~kvsearch.distributed.ShardedDatabase.where`).

    Every method is collective: every rank calls it with the same arguments and gets the same answer. Arguments
    that differ between ranks raise :class:`~kvsearch.errors.DistributedError` on every rank.

    Args:
        local: this rank's shards and the ranks' collectives.
        where: the filter, checked and the same on every rank (:func:`~kvsearch.selection.selection_filter`).
    """

    def __init__(self, local: LocalShards, where: Mapping[str, Any]) -> None:
        self.local, self.where = local, where

    def __repr__(self) -> str:
        return f"ShardedSelection(where={self.where!r})"

    @property
    def comm(self) -> Comm:
        """The ranks' collectives (a call's signature is checked on them)."""
        return self.local.comm

    def _parts(self) -> list[Selection]:
        """The selection on each of this rank's shards."""
        return [db.where(self.where) for db in self.local.shards.values()]

    @collective()
    def count(self) -> int:
        """How many records it selects, over every shard. Collective.

        Returns:
            The count (the same on every rank).
        """
        return self.comm.all_sum(self.comm.agree(lambda: sum(part.count() for part in self._parts())))

    @collective("limit", "offset")
    def ids(self, *, limit: int | None = None, offset: int = 0) -> Tensor:
        """The ids of the selected records in id order, over every shard. Collective.

        Args:
            limit: at most this many (None: all). offset: skip this many first.

        Returns:
            (m,) int64 on the CPU.

        Raises:
            InvalidArgumentError: a negative ``offset`` or a ``limit`` below 0.
        """
        limit, offset = self.comm.agree(lambda: page(limit, offset))
        head = None if limit is None else min(offset + limit, _LAST)  # each shard's first ids that can make the page

        def local() -> list[int]:
            return sorted(i for part in self._parts() for i in part.ids(limit=head).tolist())

        merged = sorted(i for ids in self.comm.gather_objects(self.comm.agree(local)) for i in ids)
        return id_tensor(merged[offset : None if limit is None else offset + limit])

    @collective("limit", "offset")
    def records(self, *, limit: int | None = None, offset: int = 0) -> list[Record]:
        """The selected records in id order (texts, metadata and embeddings), over every shard. Collective.

        Each shard reads its part in one snapshot; only the records of the page travel between the ranks.

        Args:
            limit: at most this many (None: all). offset: skip this many first (paging: ``offset += limit``).

        Returns:
            The records (the same on every rank).

        Raises:
            InvalidArgumentError: a negative ``offset`` or a ``limit`` below 0.
        """
        comm = self.comm
        limit, offset = comm.agree(lambda: page(limit, offset))
        head = None if limit is None else min(offset + limit, _LAST)

        def local() -> dict[int, Record]:
            return {record.id: record for part in self._parts() for record in part.records(limit=head)}

        held = comm.agree(local)
        wanted = sorted(i for ids in comm.gather_objects(sorted(held)) for i in ids)
        wanted = wanted[offset : None if limit is None else offset + limit]
        found = {r.id: r for part in comm.gather_objects([held[i] for i in wanted if i in held]) for r in part}
        return [found[i] for i in wanted]

    @collective("field")
    def distinct(self, field: str) -> list[tuple[Any, int]]:
        """The distinct values of a field in the selected records, with how many hold each, most frequent first
        (ties by kind, then value), over every shard (see :meth:`kvsearch.selection.Selection.distinct`). Collective.

        Args:
            field: a metadata dot path or ``$id`` / ``$key`` / ``$value``.

        Returns:
            ``[(value, count), ...]``: a value's count summed over the shards.

        Raises:
            InvalidArgumentError: a bad field name.
        """
        local = self.comm.agree(lambda: [pair for part in self._parts() for pair in part.distinct(field)])
        counts: dict[tuple[str, Any], int] = {}
        shown: dict[tuple[str, Any], Any] = {}
        for pairs in self.comm.gather_objects(local):
            for value, n in pairs:
                key = _ordered(value)
                counts[key] = counts.get(key, 0) + n
                shown.setdefault(key, value)
        return [(shown[key], n) for key, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]

    @collective("field")
    def min_max(self, field: str) -> tuple[Any, Any] | None:
        """The smallest and largest value of a field in the selected records, over every shard: over its numbers
        when any shard holds one, else its datetimes and dates (as instants), else its strings. Collective.

        Args:
            field: a metadata dot path or ``$id`` / ``$key`` / ``$value``.

        Returns:
            ``(min, max)``, or None when no selected record holds such a value.

        Raises:
            InvalidArgumentError: a bad field name.
        """
        local = self.comm.agree(lambda: [ends for part in self._parts() if (ends := part.min_max(field)) is not None])
        ends = [pair for pairs in self.comm.gather_objects(local) for pair in pairs]
        for kind in ("number", "datetime", "text"):  # the kind that wins, as in one database
            of_kind = [pair for pair in ends if _ordered(pair[0])[0] == kind]
            if of_kind:
                low = min((pair[0] for pair in of_kind), key=lambda v: _ordered(v)[1])
                high = max((pair[1] for pair in of_kind), key=lambda v: _ordered(v)[1])
                return low, high
        return None

    @collective()
    def fields(self) -> dict[str, list[str]]:
        """The top-level metadata fields of the selected records over every shard, each with the kinds of value seen
        (sorted). Collective.

        Returns:
            field name -> kinds, the names sorted.
        """
        local = self.comm.agree(lambda: [part.fields() for part in self._parts()])
        kinds: dict[str, set[str]] = {}
        for found in self.comm.gather_objects(local):
            for one in found:
                for name, seen in one.items():
                    kinds.setdefault(name, set()).update(seen)
        return {name: sorted(seen) for name, seen in sorted(kinds.items())}

    @collective()
    def delete(self) -> list[int]:
        """Delete the selected records on every shard, each shard in one transaction of its own. Collective.

        Returns:
            The deleted ids over every shard, sorted.

        Raises:
            ReadOnlyDatabaseError, DatabaseLockedError: as every write (on every rank; shards that deleted before
                another failed keep their deletes: atomic per shard).
        """
        local = self.comm.agree(lambda: [i for part in self._parts() for i in part.delete()])
        return sorted(i for ids in self.comm.gather_objects(local) for i in ids)

    @collective("merge")
    def update(self, metadata: Mapping[str, Any], *, merge: bool = True) -> list[int]:
        """Set the metadata of the selected records on every shard, each shard in one transaction of its own;
        nothing is re-encoded (see :meth:`kvsearch.selection.Selection.update`). Collective.

        Args:
            metadata: a dict, the same on every rank (checked as :meth:`kvsearch.Database.add` checks metadata).
            merge: True: its top-level keys replace or join each record's own; False: it replaces each record's
                metadata whole.

        Returns:
            The updated ids over every shard, sorted.

        Raises:
            InvalidArgumentError, NonFiniteError: metadata that cannot be stored (nothing is written on any shard).
            DistributedError: the ranks passed different metadata (nothing is written).
            ReadOnlyDatabaseError, DatabaseLockedError: as every write (atomic per shard).
        """

        def check() -> Mapping[str, Any]:
            if not isinstance(metadata, Mapping):
                raise InvalidArgumentError(f"expected metadata as a dict, got {type(metadata).__name__}")
            check_metadata([metadata], 1)
            if not isinstance(merge, bool):
                raise InvalidArgumentError(f"expected merge=True or False, got {merge!r}")
            return dict(metadata)

        same_on_every_rank(self.comm, self.comm.agree(check), "update", "metadata")
        local = self.comm.agree(lambda: [i for part in self._parts() for i in part.update(metadata, merge=merge)])
        return sorted(i for ids in self.comm.gather_objects(local) for i in ids)


def same_on_every_rank(comm: Comm, value: Any, method: str, what: str) -> None:
    """Check that every rank passed an equal ``value`` (a filter, metadata). Collective.

    Args:
        comm: the ranks' collectives. value: this rank's value (picklable, comparable with ``==``).
        method, what: the call and the argument, for the message.

    Raises:
        DistributedError: on every rank, when some rank's value differs from rank 0's (naming each rank's value).
    """
    seen = comm.gather_objects(value)
    if any(v != seen[0] for v in seen):
        shown = ", ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(seen))
        raise DistributedError(f"expected every rank to call {method} with the same {what}, got {shown}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else describe(value)


def _ordered(value: Any) -> tuple[str, Any]:
    """A metadata value as one database groups and orders it: (kind, what it orders by) — ``1`` and ``1.0`` one
    value, ``True`` another; a datetime or date by its instant; texts by code point (SQLite's binary order)."""
    if isinstance(value, bool):
        return "bool", int(value)
    if isinstance(value, (int, float)):
        return "number", value
    if isinstance(value, date):
        return "datetime", epoch_us(value)
    if isinstance(value, str):
        return "text", value
    if value is None:
        return "null", 0
    return ("array" if isinstance(value, list) else "object"), json.dumps(value, separators=(",", ":"), default=str)
