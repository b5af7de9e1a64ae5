"""The in-memory vectors of a store: its ids, key and value tensors sorted by id, gathered by id or by row.

:class:`VectorTable` holds what a search reads without touching SQLite: the ids (n,), the key embeddings (n, dim)
and the value embeddings (n, value_dim) in id order on the store's device, and the store version they reflect. It is
loaded whole (:meth:`VectorTable.load`, :meth:`VectorTable.adopt` of the shared file mappings), follows committed
writes (:meth:`VectorTable.write`, :meth:`VectorTable.drop`, :meth:`VectorTable.replace_all`,
:meth:`VectorTable.clear`) and another process's commits (:meth:`VectorTable.apply` of a :class:`Delta`), and finds
and gathers rows by id (:meth:`VectorTable.rows_of`, :meth:`VectorTable.gather`, :meth:`VectorTable.gather_rows`).
It meets :class:`kvsearch.index.topk.KeySource`: an index reads its ``ids``, ``keys``, ``version`` and ``rows_of``.

It knows nothing of the store, SQL, transactions, key texts, FAISS or autograd: what to hold is handed to it (by
:class:`~kvsearch.storage.store.Store`, which reads it in :mod:`kvsearch.storage.catchup`), and its tensors are plain
(no grad).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from kvsearch.nn.precision import host_reads
from kvsearch.storage.buffers import RowWindow

__all__ = ["VectorTable", "Delta", "CatchUp", "Views", "find_rows", "gather_rows"]

#: The records on the store's shared file mappings: ids (n,), keys (n, dim), values (n, value_dim) (numpy views, in
#: id order) and the first record's slot.
Views = tuple[np.ndarray, np.ndarray, np.ndarray, int]


@dataclass(frozen=True)
class Delta:
    """What other processes committed between two store versions, read in one snapshot (see
    :func:`kvsearch.storage.catchup.read_delta`).

    Attributes:
        version: the store version the delta brings the table to.
        deleted: ids deleted since (some may never have been held).
        ids: ids added or replaced since, sorted.
        keys: (u, dim) float32 CPU, their key embeddings. values: (u, value_dim), their value embeddings.
        views: the records of that snapshot on the shared file mappings (adopted instead of copying), or None.
        texts: the key texts of ``ids`` (None: no text), and given: (id, bits) of those whose texts came with their
            embedding — for the store's key maps (the table reads neither).
    """

    version: int
    deleted: list[int]
    ids: list[int]
    keys: Tensor
    values: Tensor
    views: Views | None = None
    texts: list[str | None] = field(default_factory=list)
    given: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class CatchUp:
    """What :meth:`VectorTable.apply` changed, for the index to follow.

    Attributes:
        removed: ids that left the table or were replaced in it (the index removes them).
        added: ids added or replaced, in the order of ``keys`` (the index adds them).
        keys: (len(added), dim) their key embeddings, on the table's device.
    """

    removed: list[int]
    added: list[int]
    keys: Tensor


class VectorTable:
    """The key / value tensors of a store, sorted by id, on one device.

    Args:
        device: where the keys and values live (the ids stay on the CPU).

    The ids, keys and values are views of buffers with room (:class:`~kvsearch.storage.buffers.RowWindow`): appending
    new rows (larger ids) copies the new rows only, and dropping the oldest rows (:meth:`drop` of the smallest ids, a
    memory at capacity) copies nothing; the live rows are copied once the dropped ones outnumber them. Every append
    and such a drop is therefore O(rows added or dropped), amortised, whatever the number of rows held.

    Attributes:
        ids: (n,) int64 ids on the CPU, sorted.
        keys: (n, dim) key embeddings on ``device``; None before the first load or write.
        values: (n, value_dim) value embeddings on ``device``; None before the first load or write.
        version: the store version the tensors (and an index built from them) reflect.
        keys_shared: whether ids / keys / values are views of the store's shared file mappings (not copies of this
            process's own): an index reads them in place.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.version = 0
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.keys_shared = False
        # the buffers ids / keys / values are views of (room to grow), each used while it holds them
        self._windows = (RowWindow(), RowWindow(), RowWindow())

    @classmethod
    def of(cls, ids: Tensor, keys: Tensor, values: Tensor, version: int = 0) -> VectorTable:
        """A table holding these tensors as they are (not copied): ids (n,) int64 CPU sorted, keys (n, dim), values
        (n, value_dim) on the keys' device, at ``version``."""
        table = cls(keys.device)
        table.ids, table.keys, table.values, table.version = ids, keys, values, version
        return table

    def __len__(self) -> int:
        return self.ids.shape[0]  # not len(): torch's Tensor.__len__ is a Python frame

    # ------------------------------------------------------------------ loading whole

    def load(
        self, ids: np.ndarray, keys: np.ndarray, values: np.ndarray, version: int, buffers: Sequence[Tensor]
    ) -> None:
        """Hold copies read whole: ids (n,), keys (n, dim), values (n, value_dim), in slot order.

        Args:
            ids, keys, values: what was read (sorted here by id if a replaced record moved to a later slot).
            version: the store version they are at.
            buffers: the (capacity, width) CPU buffers with room that ``keys`` and ``values`` were read into: the
                first append after a load does not copy them.
        """
        if len(ids) > 1 and not bool((np.diff(ids) > 0).all()):
            order = np.argsort(ids, kind="stable")  # a replaced record moved to a later slot: sort by id
            ids, keys, values = ids[order], keys[order], values[order]
            buffers = ()
        self.keys_shared = False
        self.ids = torch.from_numpy(ids)
        self.keys = torch.from_numpy(keys).to(self.device)  # (n, dim)
        self.values = torch.from_numpy(values).to(self.device)  # (n, value_dim)
        self._windows = (RowWindow(), RowWindow(), RowWindow())
        for window, buffer, read in zip(self._windows[1:], buffers, (self.keys, self.values)):
            if buffer.data_ptr() == read.data_ptr():
                window.adopt(buffer, len(read))
        self.version = version

    def adopt(self, views: Views) -> None:
        """Make ids / keys / values the views (ids (n,), keys (n, dim), values (n, value_dim), first slot) of the
        store's shared file mappings: nothing is copied."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a mapping torch may warn of: it is copy-on-write
            self.ids = torch.from_numpy(views[0])
            self.keys = torch.from_numpy(views[1])
            self.values = torch.from_numpy(views[2])
        self.keys_shared = True
        self._windows = (RowWindow(), RowWindow(), RowWindow())

    def _own(self) -> None:
        """Copy mapped tensors into this process's memory, before changing them row by row."""
        if self.keys_shared:
            self.ids, self.keys, self.values = self.ids.clone(), self.keys.clone(), self.values.clone()
            self.keys_shared = False

    # ------------------------------------------------------------------ following changes

    def apply(self, delta: Delta) -> CatchUp:
        """Follow another process's commits: drop the deleted ids, replace the held ones in place, append the new.

        Returns:
            What changed, for the index to follow.
        """
        keys = delta.keys.to(self.device, torch.float32)  # (u, dim)
        values = delta.values.to(self.device, torch.float32)  # (u, value_dim)
        present = (self.rows_of(torch.tensor(delta.ids, dtype=torch.long)) >= 0).tolist()  # replaced in place
        gone = [i for i in delta.deleted if self.contains_id(i)]
        removed = sorted(gone + [id_ for id_, here in zip(delta.ids, present) if here])
        self.drop(gone, views=delta.views)
        replaced = [n for n, here in enumerate(present) if here]
        added = [n for n, here in enumerate(present) if not here]
        self.write(delta.ids, keys, values, replaced=replaced, added=added, views=delta.views)
        self.version = delta.version
        return CatchUp(removed=removed, added=list(delta.ids), keys=keys)

    def write(
        self,
        ids: Sequence[int],
        key_embs: Tensor,
        value_embs: Tensor,
        replaced: Sequence[int],
        added: Sequence[int],
        views: Views | None = None,
    ) -> None:
        """Follow a committed write of records (the caller holds the store's lock: readers never see half of it).

        Args:
            ids: the records' ids, in order. key_embs: (n, dim). value_embs: (n, value_dim).
            replaced: positions (into ``ids``) of the records replaced in place. added: positions of the new ones.
            views: the store's records after the write on its shared mappings (:meth:`adopt`), or None: the
                tensors are changed row by row (copied into this process first if they were mapped).
        """
        if views is not None:
            self.adopt(views)
            return
        self._own()
        dev_keys = key_embs.detach().to(self.device, torch.float32)  # (n, dim)
        dev_values = value_embs.detach().to(self.device, torch.float32)  # (n, value_dim)
        if replaced:
            rows = self.rows_of(torch.tensor([ids[i] for i in replaced])).to(self.device)  # (n_old,)
            sel = torch.tensor(replaced, device=self.device)
            self.keys[rows] = dev_keys[sel]
            self.values[rows] = dev_values[sel]
        if added:
            every = len(added) == len(ids)  # the usual add: no row selection to copy
            sel = None if every else torch.tensor(added, device=self.device)
            add_keys = dev_keys if every else dev_keys[sel]  # (n_new, dim)
            add_values = dev_values if every else dev_values[sel]  # (n_new, value_dim)
            # copied: the table never shares memory with the caller's tensors (.to() may return them as they are)
            new_ids = torch.tensor(list(ids) if every else [ids[i] for i in added], dtype=torch.long)  # (n_new,)
            self._append(new_ids, add_keys, add_values)

    def clear(self) -> None:
        """Follow a committed deletion of every record: no rows (the dims kept)."""
        width = (0, 0) if self.keys is None else (self.keys.shape[1], self.values.shape[1])
        self._windows = (RowWindow(), RowWindow(), RowWindow())
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys = torch.empty(0, width[0], device=self.device)
        self.values = torch.empty(0, width[1], device=self.device)
        self.keys_shared = False

    def replace_all(self, keys: Tensor | None, values: Tensor | None, views: Views | None = None) -> None:
        """Follow a committed overwrite of every key and/or value embedding: keys (n, dim), values (n, value_dim);
        with ``views``, the store's new file set is adopted instead (:meth:`adopt`)."""
        if views is not None:
            self.adopt(views)
            return
        self._own()
        if keys is not None:
            self.keys = keys.detach().to(self.device, torch.float32).clone()
        if values is not None:
            self.values = values.detach().to(self.device, torch.float32).clone()

    def _append(self, ids: Tensor, keys: Tensor, values: Tensor) -> None:
        """Append rows: ids (a,), keys (a, dim), values (a, value_dim), copied.

        The ids / key / value tensors are views of buffers with room to grow (:class:`RowWindow`), so an append copies
        the new rows, not the whole table. Ids larger than every held one keep the table sorted (new ids always
        are); otherwise it is sorted again.
        """
        n = len(self.ids)
        if self.keys is None:
            self.keys, self.values = keys[:0], values[:0]  # (0, dim), (0, value_dim): the windows copy what comes
        ids_rows, key_rows, value_rows = self._windows
        sorted_after = not n or not len(ids) or int(ids.min()) > int(self.ids[n - 1])
        self.ids = ids_rows.extend(self.ids, ids)  # (n + a,)
        self.keys = key_rows.extend(self.keys, keys)  # (n + a, dim)
        self.values = value_rows.extend(self.values, values)  # (n + a, value_dim)
        if not sorted_after:
            order = torch.argsort(self.ids)  # (n + a,)
            self.ids = self.ids[order]
            self.keys, self.values = self.keys[order.to(self.device)], self.values[order.to(self.device)]

    def drop(self, ids: Sequence[int], views: Views | None = None) -> None:
        """Drop rows by id (committed deletes).

        With ``views`` (the store's records after the delete on its shared mappings) they are adopted. Otherwise the
        oldest rows (the smallest ids, as a memory at capacity drops them) are dropped in O(len(ids)), without
        copying the rest; any other ids in O(n).
        """
        if not len(ids):
            return
        if views is not None:
            self.adopt(views)
            return
        self._own()
        drop = torch.as_tensor(list(ids), dtype=torch.long)  # (r,)
        r = len(drop)
        if r <= len(self.ids) and torch.equal(torch.sort(drop).values, self.ids[:r]):  # the oldest r rows
            windows, rows = self._windows, (self.ids, self.keys, self.values)
            self.ids, self.keys, self.values = (w.extend(t, t[:0], drop=r) for w, t in zip(windows, rows))
        else:
            keep = ~torch.isin(self.ids, drop)  # (n,)
            self.ids = self.ids[keep]
            keep_dev = keep.to(self.device)
            self.keys = self.keys[keep_dev]
            self.values = self.values[keep_dev]

    # ------------------------------------------------------------------ finding and gathering by id

    def missing_ids(self, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` that are not held, in order (one vectorised look-up, not one per id)."""
        ids = [int(i) for i in ids]
        if any(not 0 <= i < 2**63 for i in ids):  # never stored: SQLite holds int64 ids only
            return [i for i in ids if not self.contains_id(i)]
        rows = self.rows_of(torch.tensor(ids, dtype=torch.long)).tolist()  # (r,) -1 where not held
        return [i for i, row in zip(ids, rows) if row < 0]

    def contains_id(self, id_: int) -> bool:
        """Whether a record with this id is held (never one outside int64, which SQLite cannot hold)."""
        if not 0 <= int(id_) < 2**63:
            return False
        pos = int(torch.searchsorted(self.ids, torch.tensor(int(id_))))
        return pos < len(self.ids) and int(self.ids[pos]) == int(id_)

    def rows_of(self, ids: Tensor) -> Tensor:
        """Row positions of ids (LongTensor, any shape) in the tensors; -1 where an id is -1 or not held. Same
        shape, on the CPU."""
        return find_rows(self.ids, ids)

    def rows_array(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`rows_of` for a numpy array of ids (n,), in numpy: (n,) int64 rows, -1 where not held."""
        return find_rows_array(self.ids.numpy(), ids)

    def gather(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings for ids (any shape, -1 allowed), gathered by id.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) with zeros where ids are missing,
            and a keep-mask of ids.shape — all on the table's device.
        """
        return self.gather_rows(self.rows_of(ids).to(self.device))  # (*shape)

    def gather_rows(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`gather` by row positions (any shape, -1 where none), as an exact index over these tensors found
        them: no id lookup.

        Returns:
            keys (*rows.shape, dim), values (*rows.shape, value_dim) with zeros where rows are -1, and a keep-mask of
            rows.shape — all on the table's device.
        """
        return gather_rows(self.keys, self.values, rows)

    def take(self, at: Tensor, later: tuple[np.ndarray, np.ndarray] | None) -> tuple[Tensor, Tensor]:
        """The embeddings at rows ``at`` (r,) (-1: not held), on the CPU: keys (r, dim), values (r, value_dim); the
        rows not held are filled from ``later`` (keys (g, dim), values (g, value_dim) in their order), if given."""
        keys = self.keys[at.clamp(min=0).to(self.device)].cpu()  # (r, dim)
        values = self.values[at.clamp(min=0).to(self.device)].cpu()  # (r, value_dim)
        if later is not None:
            gaps = (at < 0).nonzero().squeeze(1)  # (g,) in the ids' order, as ``later``
            keys[gaps], values[gaps] = torch.from_numpy(later[0]), torch.from_numpy(later[1])
        return keys, values

    def values_of(self, ids: list[int]) -> dict[int, Tensor | None]:
        """id -> its value embedding (value_dim,) on the CPU, of its own storage; None for an id not held."""
        rows = self.rows_of(torch.tensor(ids))  # (r,) -1 for an id not held
        values = self.values[rows.clamp(min=0).to(self.device)].cpu().numpy()  # (r, value_dim)
        return {  # each row its own storage, not a view of the batch (numpy: ~1 us a row, a tensor's clone ~5)
            i: torch.from_numpy(values[n].copy()) if present else None
            for n, (i, present) in enumerate(zip(ids, (rows >= 0).tolist()))
        }


def find_rows(stored: Tensor, ids: Tensor) -> Tensor:
    """The row of each id (any shape, -1 allowed) among ``stored`` (m,) sorted CPU ids; -1 where absent. On the CPU.

    numpy: a search's few ids cost ~1 us per op there, ~3 in torch.
    """
    return torch.from_numpy(find_rows_array(stored.numpy(), ids.reshape(-1).cpu().numpy())).reshape(ids.shape)


def find_rows_array(known: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """:func:`find_rows` in numpy: the row of each id of ``flat`` (n,) among ``known`` (m,) sorted ids (every one
    >= 0, so a -1 never matches), -1 where absent: (n,) int64."""
    if len(known) == 0:
        return np.full(len(flat), -1, dtype=np.int64)
    pos = known.searchsorted(flat)  # (n,) the method: no array-function dispatch
    pos[known.take(pos, mode="clip") != flat] = -1  # (n,) clip: past the end reads the last id
    return pos  # (n,)


def gather_rows(keys: Tensor, values: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The keys and values at row positions (any shape, -1 where none), zeros there, and the keep-mask.

    Args:
        keys: (m, dim). values: (m, value_dim), on the keys' device. rows: row positions, any device.

    Returns:
        keys (*rows.shape, dim), values (*rows.shape, value_dim), mask (*rows.shape), on the keys' device.
    """
    rows = rows.to(keys.device)  # (*shape)
    mask = rows >= 0
    if len(keys) == 0:  # nothing stored: every row is missing (no row 0 to clamp to)
        return keys.new_zeros(*rows.shape, keys.shape[-1]), values.new_zeros(*rows.shape, values.shape[-1]), mask
    flat = rows.clamp(min=0).reshape(-1)  # (n,) index_select: far cheaper than fancy indexing for small n
    out_k = keys.index_select(0, flat).reshape(*rows.shape, keys.shape[-1])  # (*shape, dim)
    out_v = values.index_select(0, flat).reshape(*rows.shape, values.shape[-1])  # (*shape, value_dim)
    if not host_reads(keys.device) or not bool(mask.all()):  # a GPU reads nothing back: masked either way
        out_k = out_k * mask.unsqueeze(-1)  # (*shape, dim) zeros where missing
        out_v = out_v * mask.unsqueeze(-1)  # (*shape, value_dim)
    return out_k, out_v, mask
