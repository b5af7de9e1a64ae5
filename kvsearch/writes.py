"""The write path of one database: checked input, then one store transaction, then the index follows the commit.

:class:`Writes` is what :class:`~kvsearch.Database` hands ``add``, ``upsert``, ``delete`` and ``clear`` to (and
:class:`~kvsearch.selection.Selection` its deletes and metadata updates by filter). Each write checks what came
(texts or embeddings, one value per key, metadata, the memory the grown table needs) before taking the lock; under
the write lock (:meth:`View.writing <kvsearch.view.View.writing>`: the view brought up to date first) it resolves the
keys already stored — for keys given as embeddings, the stored key embedding equal to each
(:meth:`Writes.equal_keys`) — encodes what has no embedding, writes the records in ONE store transaction (after
its commit the store's in-memory table follows), and then removes / adds just those ids in the candidate index.

A database in memory may have a *capacity* (:func:`check_capacity`): it keeps its newest ``capacity`` records, as a
memorizing transformer's kNN memory keeps its ``max_memories``. A write that would hold more deletes the oldest
records (the smallest ids) in the same transaction (:meth:`Writes.write`), so a failed write leaves every record as it
was; the store, its in-memory tensors and the exact index drop them without copying the rest (O(records added or
dropped), amortised: see :class:`~kvsearch.storage.buffers.RowWindow`).

It knows nothing of search, generations, file formats or how the lock is taken: it is given the database's
:class:`~kvsearch.view.View` (the store, the encoders, the retriever, the dims, the write context) and the index
spec.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import check_batch, check_fits, index_bytes
from kvsearch.encoders.base import Encoder
from kvsearch.errors import (
    DimensionMismatchError,
    DuplicateKeyError,
    InvalidArgumentError,
    NotSupportedError,
    UnknownOptionError,
)
from kvsearch.inputs import KeysIn, check_metadata, delete_items, encode_side, record_side
from kvsearch.metadata.filters import check_where
from kvsearch.storage import queries
from kvsearch.storage.schema import GIVEN_KEY, GIVEN_VALUE

if TYPE_CHECKING:  # annotations only
    from kvsearch.retrieval import Retriever
    from kvsearch.storage.store import Store
    from kvsearch.view import View

__all__ = ["Writes", "check_capacity"]


def check_capacity(capacity: object, path: Path | None) -> int | None:
    """``Database(capacity=)``: None (no limit), or the most records a database in memory keeps.

    Args:
        capacity: None, or a positive int (the newest records are kept, the oldest dropped first).
        path: the database's folder, None in memory.

    Returns:
        The capacity, or None.

    Raises:
        InvalidArgumentError: not None and not a positive int.
        NotSupportedError: a capacity for a database on disk.
    """
    if capacity is None:
        return None
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise InvalidArgumentError(f"expected capacity as a positive int (or None), got {capacity!r}")
    if path is not None:
        raise NotSupportedError(
            f"capacity= is for a database in memory (Database(None, ...)), got capacity={capacity} with the folder "
            f"{path}: a database on disk keeps every record until it is deleted (delete(), clear())"
        )
    return capacity


class Writes:
    """The writes of one open database (see the module docstring).

    Args:
        view: the database's view: its store, encoders and retriever (read at each write: an encoder set or
            reloaded later is used), its dims and index spec, and its write context
            (:meth:`~kvsearch.view.View.writing`: the write lock held and the view up to date; it raises
            DatabaseClosedError, ReadOnlyDatabaseError, DatabaseLockedError, DiskFullError, StoreChangedError).
        capacity: the most records kept (checked by :func:`check_capacity`), or None for no limit.
    """

    def __init__(self, view: View, capacity: int | None = None) -> None:
        self.view = view
        self.dim, self.value_dim, self.index_spec = view.dim, view.value_dim, view.index_spec
        self.capacity = capacity

    @property
    def store(self) -> Store:
        return self.view.store

    @property
    def retriever(self) -> Retriever:
        """The database's retriever now."""
        return self.view.retriever

    @property
    def encoder(self) -> Encoder | None:
        return self.view.encoders.key

    @property
    def value_encoder(self) -> Encoder | None:
        return self.view.encoders.value

    def write(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None,
        key_embeddings: Tensor | np.ndarray | None,
        value_embeddings: Tensor | np.ndarray | None,
        *,
        upsert: bool,
    ) -> list[int]:
        """``Database.add`` (``upsert=False``: every key must be new) or ``Database.upsert``: the ids, in order.

        With a capacity, the oldest records beyond it are deleted in the same transaction (those of this write too,
        when it alone holds more: their ids are returned all the same); a replaced record keeps its place.

        Raises:
            EmptyKeyError, DuplicateKeyError, DimensionMismatchError, NonFiniteError, InvalidArgumentError,
                MissingEncoderError, MemoryLimitError: before anything is written.
        """
        key_texts, key_embs = record_side(keys, "keys", self.encoder, self.dim, key_embeddings)
        n = len(key_texts)
        value_texts, value_embs = record_side(values, "values", self.value_encoder, self.value_dim, value_embeddings)
        if len(value_texts) != n:
            raise DimensionMismatchError(f"expected one value per key ({n}), got {len(value_texts)} values")
        check_batch(n, "records")
        metadata = check_metadata(metadata, n)
        self.check_memory(n)
        # which texts came with their own embedding: kept as given, never re-encoded from the text
        given = (GIVEN_KEY if key_embeddings is not None else 0) | (GIVEN_VALUE if value_embeddings is not None else 0)
        with self.view.writing():
            if key_texts.count(None) < n:  # keys with text: those stored already (keys as embeddings have none)
                existing = self.store.texts.stored_ids_of_keys(key_texts, allow=upsert)  # raises DuplicateKeyError
            else:  # the key maps are not even read (a kNN memory's adds never read them)
                existing = [None] * n
            if upsert and n and key_texts[0] is None:  # keys as embeddings: the same key is an equal embedding
                existing = self.equal_keys(key_embs)  # raises DuplicateKeyError
            if n == 0:
                return []
            key_embs = encode_side(key_texts, key_embs, self.encoder, self.dim, "keys")  # (n, dim)
            value_embs = encode_side(value_texts, value_embs, self.value_encoder, self.value_dim, "values")
            fresh = existing.count(None) == n  # every record new: its ids ascend past every stored one
            over = self.capacity is not None and len(self.store.table) + existing.count(None) > self.capacity
            with self.view.atomic() if over else contextlib.nullcontext():  # the write and the drop: all or nothing
                ids = self.store.write(key_texts, value_texts, metadata, key_embs, value_embs, existing, [given] * n)
                dropped = self.drop_oldest() if over else []  # ascending
            removed, added = [] if fresh else [i for i in existing if i is not None], ids
            if dropped and fresh:  # the dropped ids of this write are its first ones: slices, no set of ids
                mine = len(dropped) - bisect.bisect_left(dropped, ids[0])  # how many of this write's were dropped
                removed, added = dropped[: len(dropped) - mine], ids[mine:]
                key_embs = key_embs[mine:]  # (kept, dim)
            elif dropped:  # the index loses what it held of them, and never gets those of this write
                gone = set(dropped)
                new = {id_ for id_, stored in zip(ids, existing) if stored is None}  # the ids this write made
                removed = sorted(set(removed) | (gone - new))
                kept = [p for p, id_ in enumerate(ids) if id_ not in gone]  # positions still stored
                added = [ids[p] for p in kept]
                key_embs = key_embs[torch.tensor(kept, dtype=torch.long, device=key_embs.device)]  # (kept, dim)
            self.retriever.apply(removed=removed, added=added, keys=key_embs)
        return ids

    def drop_oldest(self) -> list[int]:
        """Delete the oldest records (the smallest ids) beyond the capacity: their ids, ascending (the caller holds
        the lock)."""
        excess = len(self.store.table) - self.capacity
        if excess <= 0:
            return []
        oldest = self.store.table.ids[:excess].tolist()  # the table is sorted by id, and up to date under the lock
        self.store.delete(oldest, held=True)
        return oldest

    def clear(self) -> None:
        """``Database.clear``: delete every record in one transaction; the index follows (emptied).

        Raises:
            DatabaseClosedError, ReadOnlyDatabaseError, DatabaseLockedError, DiskFullError: see the view's writing.
        """
        with self.view.writing():
            self.store.clear()
            self.retriever.rebuild()

    def check_memory(self, n: int) -> None:
        """Refuse (MemoryLimitError) a write of ``n`` records whose grown table (copied once when its buffer is
        full) and index additions cannot fit."""
        held = len(self.store.table)
        need = (held + 2 * n) * (self.dim + self.value_dim) * 4 + index_bytes(self.index_spec, n, self.dim)
        check_fits(need, f"adding {n:,} records")

    def equal_keys(self, key_embs: Tensor) -> list[int | None]:
        """The stored id each key embedding (n, dim) replaces in an upsert: the one record without key text whose
        key embedding equals it, or None for a new key.

        Raises:
            DuplicateKeyError: two equal rows in the batch; or the equal stored key has a text, or several records
                have it (replace one by id instead).
        """
        _, inverse, counts = torch.unique(key_embs + 0.0, dim=0, return_inverse=True, return_counts=True)
        if bool((counts > 1).any()):
            twice = torch.nonzero(counts[inverse] > 1).flatten().tolist()  # positions of repeated rows
            raise DuplicateKeyError(f"expected unique key embeddings, got equal rows at positions {twice[:10]}")
        first, count = self.retriever.key_matches(key_embs)  # (n,), (n,)
        out: list[int | None] = []
        for i, (id_, c) in enumerate(zip(first.tolist(), count.tolist())):
            how = f"replace a record by id: delete({id_}) then add(...); nothing was written"
            if c > 1:
                raise DuplicateKeyError(
                    f"expected one stored record per key embedding, got {c} records equal to the key at position "
                    f"{i}; {how}"
                )
            text = self.store.texts.key_of_id.get(id_) if c else None
            if text is not None:
                raise DuplicateKeyError(
                    f"expected a key embedding without text, got one equal to the key {text!r} of record {id_} "
                    f"(position {i}): upsert it by its text with key_embeddings=, or {how}"
                )
            out.append(id_ if c else None)
        return out

    def delete(self, key_or_keys: object, *, missing: Literal["raise", "ignore"]) -> list[int]:
        """``Database.delete``: the deleted ids.

        Raises:
            KeyNotFoundError: a key or id is not stored and ``missing="raise"`` (then nothing is deleted).
            InvalidArgumentError: an item is neither str nor int.
            UnknownOptionError: ``missing`` is neither ``"raise"`` nor ``"ignore"``.
        """
        if missing not in ("raise", "ignore"):
            raise UnknownOptionError(f"expected missing='raise' or 'ignore', got {missing!r}")
        items = delete_items(key_or_keys)
        with self.view.writing():
            store = self.store
            if missing == "ignore":
                texts, table = store.texts, store.table
                items = [i for i in items if (i in texts.id_of_key if isinstance(i, str) else table.contains_id(i))]
            ids = store.texts.resolve(items, "nothing was deleted", store.table.contains_id)  # KeyNotFoundError
            if ids:
                store.delete(ids)
                self.retriever.apply(removed=ids, added=[], keys=None)
        return ids

    def delete_where(self, where: Mapping[str, Any]) -> list[int]:
        """``Selection.delete``: delete the records a filter matches in one transaction; their ids, sorted."""
        check_where(where)  # before the lock: a bad filter takes nothing
        with self.view.writing():
            ids = self.store.ids_where(where).tolist()
            if ids:
                self.store.delete(ids)
                self.retriever.apply(removed=ids, added=[], keys=None)
        return ids

    def update_metadata(self, where: Mapping[str, Any], metadata: Mapping[str, Any], *, merge: bool) -> list[int]:
        """``Selection.update``: set the metadata of the records a filter matches in one transaction (no vector
        changes, nothing is re-encoded); their ids, sorted."""
        check_where(where)
        check_metadata([metadata], 1)  # before the lock: bad metadata writes nothing
        if not isinstance(merge, bool):
            raise InvalidArgumentError(f"expected merge=True or False, got {merge!r}")
        with self.view.writing(), self.store.transaction():  # no vector, version or index changes
            ids = queries.ids(self.store.conn, where)
            queries.set_metadata(self.store.conn, ids, metadata, merge=merge)
        return ids
