"""The in-memory mirror of a store: its key / value tensors sorted by id, and the key maps beside them.

:class:`Mirror` holds what a search reads without touching SQLite: the ids (n,), the key embeddings (n, dim) and the
value embeddings (n, value_dim) in id order on the store's device, the key text <-> id maps, and which records' texts
came with their own embedding. It reads them whole (:meth:`Mirror.load`), catches up on other processes' commits
from the change log (:meth:`Mirror.catch_up`, which says what changed in a :class:`CatchUp`), follows the store's own
committed writes (:meth:`Mirror.apply_write`, :meth:`Mirror.drop`, :meth:`Mirror.replace_all`, :meth:`Mirror.clear`),
finds ids by key text (:meth:`Mirror.id_of`, :meth:`Mirror.resolve`), and finds and gathers rows by id
(:meth:`Mirror.rows_of`, :meth:`Mirror.gather`, :meth:`Mirror.locate`).

It reads through its :class:`~kvsearch.storage.store.Store` (the connection, the version, the lock) and writes
nothing to SQLite: the store commits a write first, then changes the mirror. It knows nothing of transactions,
metadata, FAISS or autograd: its tensors are plain (no grad).
"""

from __future__ import annotations

import sqlite3
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from kvsearch.errors import CorruptDatabaseError, DuplicateKeyError, KeyNotFoundError
from kvsearch.inputs import normalize_key
from kvsearch.storage import changelog, legacy
from kvsearch.storage.buffers import MIN_ROOM, RowWindow, row_buffer
from kvsearch.storage.key_texts import KeyTexts, id_of_key_map
from kvsearch.storage.schema import GIVEN_KEY, GIVEN_VALUE, SUMMARY_MOD, SUMMARY_SCAN, select_in

if TYPE_CHECKING:
    from kvsearch.storage.store import Store

__all__ = ["Mirror", "CatchUp", "find_rows", "gather_rows"]


@dataclass(frozen=True)
class CatchUp:
    """What :meth:`Mirror.catch_up` changed in the mirror, for the index to follow.

    Attributes:
        removed: ids that left the mirror or were replaced in it (the index removes them).
        added: ids added or replaced, in the order of ``keys`` (the index adds them).
        keys: (len(added), dim) their key embeddings, on the store's device.
    """

    removed: list[int]
    added: list[int]
    keys: Tensor


class Mirror:
    """The in-memory key / value tensors of a store, sorted by id, with the key maps beside them.

    Args:
        store: the store mirrored: the mirror reads through its connection, under its lock.

    The ids, keys and values are views of buffers with room (:class:`~kvsearch.storage.buffers.RowWindow`): appending
    new rows (larger ids) copies the new rows only, and dropping the oldest rows (:meth:`drop` of the smallest ids, a
    memory at capacity) copies nothing; the live rows are copied once the dropped ones outnumber them. Every append
    and such a drop is therefore O(rows added or dropped), amortised, whatever the number of rows held.

    Attributes:
        ids: (n,) int64 ids on the CPU, sorted.
        keys: (n, dim) key embeddings on the store's device; None before the first load or write.
        values: (n, value_dim) value embeddings on the store's device; None before the first load or write.
        id_of_key: the normalised key text (:func:`~kvsearch.inputs.normalize_key`) -> id.
        key_of_id: id -> the key text as stored.
        given_keys, given_values: ids of records whose key / value text came with its embedding (re-encoding from
            the text skips them).
        loaded_version: the store version the mirror (and the index) reflect.
        full_loads: how many times the mirror was read whole (:meth:`load`: the open, and catch-ups that could not
            use the change log) — a counter to observe, e.g. in tests.
        catch_ups: how many times the mirror caught up on another process's commits row by row (:meth:`catch_up`).
        seen_data_version: ``PRAGMA data_version`` when :attr:`loaded_version` was last checked (None: not yet on
            this process's connection).
    """

    def __init__(self, store: Store) -> None:
        # the store owns its mirror: a weak proxy back, so that a dropped store is freed (and its file closed) at once
        self.store: Store = weakref.proxy(store)
        self.device = store.device
        self.loaded_version = 0
        self.full_loads = 0
        self.catch_ups = 0
        self.seen_data_version: int | None = None
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        #: Whether ids / keys / values are views of the store's shared file mappings (no copy of this process's own).
        self.mapped = False
        # The key texts and given flags, read from the store at their first use (None: not yet): a process that only
        # searches by vector never holds them.
        self._texts: KeyTexts | None = None
        # the buffers ids / keys / values are views of (room to grow), each used while it holds them
        self._windows = (RowWindow(), RowWindow(), RowWindow())

    def __len__(self) -> int:
        return len(self.ids)

    # ------------------------------------------------------------------ loading

    def load(self, dim: int, value_dim: int) -> None:
        """Read every record into the in-memory tensors, in one snapshot: on the CPU, views of the store's shared
        file mappings when the records hold one run of slots (nothing copied), else copies.

        Raises:
            CorruptDatabaseError: the embeddings do not have the expected dims, or do not match the records.
        """
        buffers: list[Tensor] = []

        def alloc(rows: int, width: int) -> np.ndarray:
            buffer = row_buffer(rows + max(MIN_ROOM, rows // 8), width, like=torch.empty(0))  # (capacity, width)
            buffers.append(buffer)
            return buffer[:rows].numpy()

        store = self.store
        with store.lock:
            conn = store.conn
            own = not conn.in_transaction
            if own:
                conn.execute("BEGIN")  # one snapshot: the rows and the version they are at
            try:
                data_version = self._data_version()  # first: it starts the snapshot the version is read in
                version = store.version
                views = None
                if store.still_legacy():  # read-only, earlier format: the embeddings are in the rows
                    ids, keys, values, _ = legacy.read_all(conn, dim, value_dim)
                else:
                    views = self._views(dim, value_dim)
                    if views is not None:
                        ids, keys, values, first = views
                        self._check_ids(ids, np.arange(first, first + len(ids), dtype=np.int64))
                    else:
                        ids, slots, keys, values = store.embeddings.read_all(conn, dim, value_dim, alloc=alloc)
                        self._check_ids(ids, slots)
            finally:
                if own:
                    conn.execute("COMMIT")
            if views is not None:
                self.adopt(views)
            else:
                if len(ids) > 1 and not bool((np.diff(ids) > 0).all()):
                    order = np.argsort(ids, kind="stable")  # a replaced record moved to a later slot: sort by id
                    ids, keys, values = ids[order], keys[order], values[order]
                    buffers.clear()
                self.mapped = False
                self.ids = torch.from_numpy(ids)
                self.keys = torch.from_numpy(keys).to(self.device)  # (n, dim)
                self.values = torch.from_numpy(values).to(self.device)  # (n, value_dim)
                # read into buffers with room to grow: the first append after a load does not copy the keys and values
                self._windows = (RowWindow(), RowWindow(), RowWindow())
                for window, buffer, read in zip(self._windows[1:], buffers, (self.keys, self.values)):
                    if buffer.data_ptr() == read.data_ptr():
                        window.adopt(buffer, len(read))
            self._texts = None  # read again at their first use
            self.loaded_version = version
            self.seen_data_version = data_version
            self.full_loads += 1

    def _views(self, dim: int, value_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
        """The records on the store's shared mappings (inside the caller's snapshot), or None: not on the CPU, not
        in file sets, or not one run of slots (see :meth:`VectorFiles.views`)."""
        embeddings = self.store.embeddings
        embeddings.follow(self.store.conn)
        if self.device.type != "cpu":
            return None
        return embeddings.views(self.store.conn, dim, value_dim)

    def adopt(self, views: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> None:
        """Make ids / keys / values the views (ids (n,), keys (n, dim), values (n, value_dim), first slot) of the
        store's shared file mappings: nothing is copied."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a mapping torch may warn of: it is copy-on-write
            self.ids = torch.from_numpy(views[0])
            self.keys = torch.from_numpy(views[1])
            self.values = torch.from_numpy(views[2])
        self.mapped = True
        self._windows = (RowWindow(), RowWindow(), RowWindow())

    def _own(self) -> None:
        """Copy mapped tensors into this process's memory, before changing them row by row."""
        if self.mapped:
            self.ids, self.keys, self.values = self.ids.clone(), self.keys.clone(), self.values.clone()
            self.mapped = False

    def _check_ids(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Check that the embeddings hold the records the records table lists, each in the slot it names.

        Compared with the records summary the triggers keep (:data:`~kvsearch.storage.schema.SUMMARY`): the count
        and the sums of the ids, of the slots and of ``id XOR slot`` — no row of the records table is read. A
        store without a summary (read-only, written before it) is compared by one scan of the records table.

        Raises:
            CorruptDatabaseError: they differ (the file was damaged or changed by hand).
        """
        expected = _summary(np.asarray(ids, dtype=np.int64), slots)
        try:
            found = self.store.conn.execute("SELECT n, ids, slots, pairs FROM records_summary").fetchone()
        except sqlite3.OperationalError:  # a store written before the summary, opened read-only
            found = None
        if found is None:
            found = self.store.conn.execute(SUMMARY_SCAN).fetchone()
        if tuple(found) != expected:
            raise CorruptDatabaseError(
                f"{self.store.path or 'the store'}: the embeddings hold {len(ids)} records that are not the "
                f"{found[0]} records of the records table (the file was damaged or changed from outside)"
            )

    def _data_version(self) -> int:
        """SQLite's ``PRAGMA data_version``: changes when another connection commits (no table is read)."""
        return int(self.store.conn.execute("PRAGMA data_version").fetchone()[0])

    def is_stale(self) -> bool:
        """Whether another connection (another process) committed since this mirror was loaded.

        When no other connection committed since the last check (``PRAGMA data_version`` unchanged), the version
        is not read at all.
        """
        data_version = self._data_version()
        if data_version == self.seen_data_version:
            return False
        stale = self.store.version != self.loaded_version
        if not stale:
            self.seen_data_version = data_version
        return stale

    def catch_up(self, dim: int, value_dim: int) -> CatchUp | None:
        """Bring the mirror up to the store's version: row by row from the change log, else by a full :meth:`load`.

        Reads only the rows the log names (added or replaced since :attr:`loaded_version`), drops the deleted ones,
        in one snapshot. Falls back to :meth:`load` when the log does not reach back (compacted, or older than the
        log), when a change of every row (a generation switch) is in the range, or when more rows changed than
        half the mirror holds (reading everything is then as cheap).

        Args:
            dim: the key dimension. value_dim: the value dimension.

        Returns:
            What changed, for the index to follow; None after a full :meth:`load` (the index is rebuilt or served).

        Raises:
            CorruptDatabaseError: an embedding blob has the wrong size.
        """
        store = self.store
        with store.lock:
            conn = store.conn
            own = not conn.in_transaction
            if own:
                conn.execute("BEGIN")  # one snapshot: the log, the rows and the version they are at
            try:
                data_version = self._data_version()
                version = store.version
                changes = None if self.keys is None else changelog.read(conn, self.loaded_version, version)
                if changes is not None and len(changes) > max(1024, len(self.ids) // 2):
                    changes = None
                if store.still_legacy():
                    changes = None  # an earlier format, read-only: read whole
                rows: list[tuple] = []
                views = None
                if changes is not None:
                    rows, keys, values = self._read_rows(changes.upserted, dim, value_dim)
                    views = self._views(dim, value_dim)  # the records of this snapshot, shared, when one run
                flags = {} if changes is None else _given_of_ids(conn, changes.upserted)
            finally:
                if own:
                    conn.execute("COMMIT")
            if changes is None or len(rows) != len(changes.upserted):
                self.load(dim, value_dim)
                return None
            keys = torch.from_numpy(keys).to(self.device, torch.float32)  # (u, dim)
            values = torch.from_numpy(values).to(self.device, torch.float32)  # (u, value_dim)
            upserted = changes.upserted  # sorted, as the rows
            present = (self.rows_of(torch.tensor(upserted, dtype=torch.long)) >= 0).tolist()  # replaced in place
            gone = [i for i in changes.deleted if self.contains_id(i)]
            removed = sorted(gone + [id_ for id_, here in zip(upserted, present) if here])
            self.drop(gone, views=views)
            # the same path as this process's own writes: rows replaced in place, new rows appended (or the shared
            # views adopted), key maps and the given flags as the writer recorded them
            self.apply_write(
                upserted,
                [key for _, key, _ in rows],
                keys,
                values,
                replaced=[n for n, here in enumerate(present) if here],
                added=[n for n, here in enumerate(present) if not here],
                given=[(id_, flags[id_]) for id_ in upserted if flags.get(id_)],
                views=views,
            )
            self.loaded_version = version
            self.seen_data_version = data_version
            self.catch_ups += 1
            return CatchUp(removed=removed, added=upserted, keys=keys)

    def _read_rows(
        self, ids: Sequence[int], dim: int, value_dim: int
    ) -> tuple[list[tuple[int, str | None, int]], np.ndarray, np.ndarray]:
        """The stored records among ``ids``, read from the store in id order (ids not stored are left out).

        Returns:
            rows (id, key, slot), and their keys (r, dim) and values (r, value_dim) as float32 arrays.

        Raises:
            CorruptDatabaseError: a record names a slot that holds nothing, or a chunk is damaged.
        """
        conn = self.store.conn
        if self.store.still_legacy():  # the earlier format (read-only): the embeddings are in the rows
            return legacy.read_rows(conn, ids, dim, value_dim)
        rows = sorted(select_in(conn, "SELECT id, key, slot FROM records WHERE id IN ({})", ids))
        self.store.embeddings.follow(conn)
        keys, values = self.store.embeddings.read(conn, np.array([r[2] for r in rows], dtype=np.int64), dim, value_dim)
        return rows, keys, values

    # ------------------------------------------------------------------ following the store's writes

    def apply_write(
        self,
        ids: Sequence[int],
        texts: Sequence[str | None],
        key_embs: Tensor,
        value_embs: Tensor,
        replaced: Sequence[int],
        added: Sequence[int],
        given: Sequence[tuple[int, int]],
        views: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None,
    ) -> None:
        """Follow a committed write of records (the caller holds the store's lock: readers never see half of it).

        Args:
            ids: the records' ids, in order. texts: their key texts (None: no text).
            key_embs: (n, dim). value_embs: (n, value_dim).
            replaced: positions (into ``ids``) of the records replaced in place. added: positions of the new ones.
            given: (id, ``GIVEN_KEY | GIVEN_VALUE`` bits) of the records whose texts came with their embedding.
            views: the store's records after the write on its shared mappings (:meth:`adopt`), or None: the
                tensors are changed row by row (copied into this process first if they were mapped).
        """
        if self._texts is not None:  # else read at their first use
            self._texts.follow(ids, texts, [ids[i] for i in replaced], given)
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
            # copied: the mirror never shares memory with the caller's tensors (.to() may return them as they are)
            self._append(torch.tensor([ids[i] for i in added], dtype=torch.long), add_keys, add_values)

    def clear(self) -> None:
        """Follow a committed deletion of every record: no rows (the dims kept), no keys, no flags."""
        width = (0, 0) if self.keys is None else (self.keys.shape[1], self.values.shape[1])
        self._windows = (RowWindow(), RowWindow(), RowWindow())
        self.ids = torch.empty(0, dtype=torch.long)
        self.keys = torch.empty(0, width[0], device=self.device)
        self.values = torch.empty(0, width[1], device=self.device)
        self.mapped = False
        self._texts = KeyTexts({}, {}, set(), set())

    def replace_all(
        self,
        keys: Tensor | None,
        values: Tensor | None,
        views: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None,
    ) -> None:
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
        """Append rows to the mirror: ids (a,), keys (a, dim), values (a, value_dim), copied.

        The ids / key / value tensors are views of buffers with room to grow (:class:`RowWindow`), so an append copies
        the new rows, not the whole mirror. Ids larger than every stored one keep the mirror sorted (new ids always
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

    def drop(self, ids: Sequence[int], views: tuple[np.ndarray, np.ndarray, np.ndarray, int] | None = None) -> None:
        """Drop records from the mirror by id (committed deletes), with their keys and given flags.

        With ``views`` (the store's records after the delete on its shared mappings) they are adopted. Otherwise the
        oldest records (the smallest ids, as a memory at capacity drops them) are dropped in O(len(ids)), without
        copying the rest; any other ids in O(n).
        """
        if not len(ids):
            return
        if self._texts is not None:
            for id_ in ids:
                self._texts.forget(int(id_))
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

    # ------------------------------------------------------------------ the key texts and given flags (lazy)

    @property
    def texts(self) -> KeyTexts:
        """The key maps and given flags of the records in the mirror, read from the store at their first use."""
        if self._texts is None:
            with self.store.lock, self.store.snapshot():
                rows = self.store.conn.execute("SELECT id, key FROM records WHERE key IS NOT NULL").fetchall()
                given = self.store.conn.execute("SELECT id, side FROM given").fetchall()
            held = self._held([r[0] for r in rows] + [g[0] for g in given])  # ids the mirror holds
            key_of_id = {i: key for i, key in rows if i in held}
            self._texts = KeyTexts(
                id_of_key=id_of_key_map(key_of_id, self.store.path),
                key_of_id=key_of_id,
                given_keys={i for i, bits in given if bits & GIVEN_KEY and i in held},
                given_values={i for i, bits in given if bits & GIVEN_VALUE and i in held},
            )
        return self._texts

    def _held(self, ids: list[int]) -> set[int]:
        """Those of ``ids`` the mirror holds (a store ahead of the mirror names records it does not hold yet)."""
        if not ids:
            return set()
        found = self.rows_of(torch.tensor(ids, dtype=torch.long)) >= 0  # (r,)
        return set(np.asarray(ids)[found.numpy()].tolist())

    @property
    def id_of_key(self) -> dict[str, int]:
        """The normalised key text (:func:`~kvsearch.inputs.normalize_key`) -> id."""
        return self.texts.id_of_key

    @property
    def key_of_id(self) -> dict[int, str]:
        """id -> the key text as stored."""
        return self.texts.key_of_id

    @property
    def given_keys(self) -> set[int]:
        """Ids of records whose key text came with its embedding (re-encoding from the text skips them)."""
        return self.texts.given_keys

    @property
    def given_values(self) -> set[int]:
        """Ids of records whose value text came with its embedding."""
        return self.texts.given_values

    # ------------------------------------------------------------------ finding by id and by key

    def missing_ids(self, ids: Sequence[int]) -> list[int]:
        """Those of ``ids`` that are not stored, in order (one vectorised look-up, not one per id)."""
        ids = [int(i) for i in ids]
        if any(not 0 <= i < 2**63 for i in ids):  # never stored: SQLite holds int64 ids only
            return [i for i in ids if not self.contains_id(i)]
        rows = self.rows_of(torch.tensor(ids, dtype=torch.long)).tolist()  # (r,) -1 where not stored
        return [i for i, row in zip(ids, rows) if row < 0]

    def contains_id(self, id_: int) -> bool:
        """Whether a record with this id is stored (never one outside int64, which SQLite cannot hold)."""
        if not 0 <= int(id_) < 2**63:
            return False
        pos = int(torch.searchsorted(self.ids, torch.tensor(int(id_))))
        return pos < len(self.ids) and int(self.ids[pos]) == int(id_)

    def stored_ids_of_keys(self, keys: Sequence[str | None], *, allow: bool) -> list[int | None]:
        """The stored id of each key text (None for a new key or no text).

        Args:
            keys: key texts, or None for keys given as embeddings.
            allow: whether stored keys are allowed (an upsert); else one raises.

        Raises:
            DuplicateKeyError: a key is already stored and ``allow`` is False.
        """
        out: list[int | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            id_ = -1 if key is None else self.id_of(key)
            if id_ >= 0:
                if not allow:
                    raise DuplicateKeyError(
                        f"expected new keys, got {key!r} (record {i}) which is already stored; use upsert"
                    )
                out[i] = id_
        return out

    def id_of(self, key: str) -> int:
        """The id of the record with this key text, -1 if none: compared after :func:`normalize_key`.

        Keys stored by an earlier version that did not normalise are found by their normalised text too.
        """
        return self.id_of_key.get(normalize_key(key), -1)

    def resolve(self, items: Sequence[str | int], consequence: str) -> list[int]:
        """The stored ids of key texts and ids, in order, without repeats.

        Args:
            items: key texts and int ids.
            consequence: what the error message adds, e.g. ``"nothing was deleted"``.

        Raises:
            KeyNotFoundError: a key or an id is not stored.
        """
        ids: list[int] = []
        for item in items:
            if isinstance(item, str):
                id_ = self.id_of(item)
                if id_ < 0:
                    raise KeyNotFoundError(f"expected a stored key, got {item!r}; {consequence}")
                ids.append(id_)
            else:
                if not self.contains_id(item):
                    raise KeyNotFoundError(f"expected a stored id, got {item}; {consequence}")
                ids.append(int(item))
        return list(dict.fromkeys(ids))

    def rows_of(self, ids: Tensor) -> Tensor:
        """Row positions of ids in the in-memory tensors; -1 where an id is -1 or not stored.

        Args:
            ids: LongTensor of any shape.

        Returns:
            LongTensor of the same shape, on the CPU.
        """
        return find_rows(self.ids, ids)

    def gather(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings for ids (any shape, -1 allowed), gathered by id.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) with zeros where ids are missing,
            and a keep-mask of ids.shape — all on the store's device.
        """
        return self.gather_rows(self.rows_of(ids).to(self.device))  # (*shape)

    def gather_rows(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`gather` by row positions in the in-memory tensors (any shape, -1 where none), as an exact index
        over these tensors found them: no id lookup.

        Returns:
            keys (*rows.shape, dim), values (*rows.shape, value_dim) with zeros where rows are -1, and a keep-mask of
            rows.shape — all on the store's device.
        """
        return gather_rows(self.keys, self.values, rows)

    def locate(self, ids: list[int]) -> tuple[Tensor, tuple[np.ndarray, np.ndarray] | None]:
        """Where stored ids are in memory; those committed since the mirror was loaded are read from the store.

        Called inside the caller's snapshot, the one the ids were read in; :meth:`take` then gathers the rows.

        Args:
            ids: stored ids, sorted.

        Returns:
            (r,) their rows in memory (-1: not in memory yet), and the keys (g, dim) and values (g, value_dim) of
            those not in memory, in id order (None when every id is in memory).
        """
        at = self.rows_of(torch.tensor(ids, dtype=torch.long))  # (r,) -1: not in memory yet
        later = [id_ for id_, row in zip(ids, at.tolist()) if row < 0]
        if not later:
            return at, None
        _, later_keys, later_values = self._read_rows(later, self.keys.shape[1], self.values.shape[1])
        return at, (later_keys, later_values)

    def take(self, at: Tensor, later: tuple[np.ndarray, np.ndarray] | None) -> tuple[Tensor, Tensor]:
        """The embeddings of what :meth:`locate` found, on the CPU: keys (r, dim), values (r, value_dim)."""
        keys = self.keys[at.clamp(min=0).to(self.device)].cpu()  # (r, dim)
        values = self.values[at.clamp(min=0).to(self.device)].cpu()  # (r, value_dim)
        if later is not None:
            gaps = (at < 0).nonzero().squeeze(1)  # (g,) in the ids' order, as ``later``
            keys[gaps], values[gaps] = torch.from_numpy(later[0]), torch.from_numpy(later[1])
        return keys, values

    def values_of(self, ids: list[int]) -> dict[int, Tensor | None]:
        """id -> its value embedding (value_dim,) on the CPU, of its own storage; None for an id no longer stored."""
        rows = self.rows_of(torch.tensor(ids))  # (r,) -1 for an id no longer stored
        values = self.values[rows.clamp(min=0).to(self.device)].cpu()  # (r, value_dim)
        return {
            i: row.clone() if present else None  # its own storage, not a view of the batch
            for i, row, present in zip(ids, values, (rows >= 0).tolist())
        }


def _given_of_ids(conn: sqlite3.Connection, ids: Sequence[int]) -> dict[int, int]:
    """id -> its ``given`` bits, for those of the ids that have any."""
    return dict(select_in(conn, "SELECT id, side FROM given WHERE id IN ({})", ids))


def _summary(ids: np.ndarray, slots: np.ndarray) -> tuple[int, int, int, int]:
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


def find_rows(stored: Tensor, ids: Tensor) -> Tensor:
    """The row of each id (any shape, -1 allowed) among ``stored`` (m,) sorted CPU ids; -1 where absent. On the CPU.

    numpy: a search's few ids cost ~1 us per op there, ~3 in torch.
    """
    flat = ids.reshape(-1).cpu().numpy()  # (n,)
    known = stored.numpy()  # (m,) sorted
    if len(known) == 0:
        return torch.full_like(ids.cpu(), -1)
    pos = np.minimum(np.searchsorted(known, flat), len(known) - 1)  # (n,)
    found = (known[pos] == flat) & (flat >= 0)
    return torch.from_numpy(np.where(found, pos, -1)).reshape(ids.shape)


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
    if not bool(mask.all()):
        out_k = out_k * mask.unsqueeze(-1)  # (*shape, dim) zeros where missing
        out_v = out_v * mask.unsqueeze(-1)  # (*shape, value_dim)
    return out_k, out_v, mask
