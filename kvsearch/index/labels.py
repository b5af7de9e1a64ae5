"""The labels of a graph index: the id each label (insertion position) holds, its tombstones, and id -> live label.

A FAISS graph (HNSW) numbers its vectors by insertion: label ``n`` is the ``n``-th vector added, and it cannot
remove one. :class:`Labels` records the id of each label (``ids``), which labels are tombstones (``dead``) and finds
the live label of an id with one vectorised look-up, without a Python dict of every id: a graph built from a store
adds its ids in increasing order, so the id array is its own sorted index (nothing more is held); labels added out
of order (an id re-added after its removal, a build from unsorted ids) wait in a small dict until they are many,
then a sorted permutation is made once.

It knows nothing of FAISS, vectors, files or the store.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Labels", "EXTRA_MIN", "EXTRA_FRACTION"]

#: Labels added out of id order are looked up in a dict until it holds more than ``max(EXTRA_MIN, labels //
#: EXTRA_FRACTION)`` of them; then every label is indexed again by one stable argsort (amortised O(log n) an add).
EXTRA_MIN = 1024
EXTRA_FRACTION = 16


class Labels:
    """The id of each label of a graph, its tombstones, and the live label of an id.

    The live label of an id is its latest label unless that one is a tombstone: an id removed and added again holds
    two labels, the first one dead.

    Args:
        ids: (L,) int64 the id of each label (kept, not copied). dead: (L,) bool tombstones (kept), or None: none.

    Attributes:
        ids: (L,) int64, the id of each label. dead: (L,) bool, the tombstones. tombstones: how many are dead.
    """

    def __init__(self, ids: np.ndarray | None = None, dead: np.ndarray | None = None) -> None:
        self.ids = np.empty(0, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
        self.dead = np.zeros(len(self.ids), dtype=bool) if dead is None else np.asarray(dead, dtype=bool)
        self.tombstones = int(self.dead.sum())
        self._keys: np.ndarray | None = None  # sorted ids of labels [0, _covered); None: ids[:_covered] itself
        self._perm: np.ndarray | None = None  # the label of each of _keys; None: _keys is ids[:_covered]
        self._covered = 0
        self._extra: dict[int, int] = {}  # id -> its latest label, for labels >= _covered
        self._index_all()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def live(self) -> int:
        """How many labels are live (one per live id)."""
        return len(self.ids) - self.tombstones

    @property
    def in_order(self) -> bool:
        """Whether the labels hold strictly increasing ids (then the live ids are sorted as they stand)."""
        return self._perm is None and not self._extra

    def _index_all(self) -> None:
        """Index every label: the ids themselves where they increase, else a stable sorted permutation."""
        ids = self.ids
        if len(ids) < 2 or bool((ids[1:] > ids[:-1]).all()):
            self._keys = self._perm = None
        else:
            self._perm = np.argsort(ids, kind="stable")  # equal ids keep label order: the latest last
            self._keys = ids[self._perm]
        self._covered = len(ids)
        self._extra = {}

    def append(self, ids: np.ndarray) -> None:
        """Give the next labels to ``ids`` (a,) int64, in order (new ids, or ids whose labels are all dead)."""
        if not len(ids):
            return
        start = len(self.ids)
        ids = np.asarray(ids, dtype=np.int64)
        self.ids = np.concatenate([self.ids, ids])
        self.dead = np.concatenate([self.dead, np.zeros(len(ids), dtype=bool)])
        in_order = bool((ids[1:] > ids[:-1]).all()) and (start == 0 or int(ids[0]) > self._top())
        if in_order and self._covered == start and not self._extra:
            if self._perm is not None:
                self._keys = np.concatenate([self._keys, ids])
                self._perm = np.concatenate([self._perm, np.arange(start, start + len(ids))])
            self._covered = len(self.ids)
            return
        for offset, id_ in enumerate(ids.tolist()):
            self._extra[id_] = start + offset
        if len(self._extra) > max(EXTRA_MIN, len(self.ids) // EXTRA_FRACTION):
            self._index_all()

    def _top(self) -> int:
        """The largest id among the indexed labels (only asked while nothing waits in the dict)."""
        keys = self.ids[: self._covered] if self._perm is None else self._keys
        return int(keys[-1]) if len(keys) else -(2**63)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """The live label of each of ``ids`` (r,) int64, -1 where it has none: (r,) int64."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        keys = self.ids[: self._covered] if self._perm is None else self._keys
        found = np.full(len(ids), -1, dtype=np.int64)
        if len(keys) and len(ids):
            pos = np.searchsorted(keys, ids, side="right") - 1  # (r,) the last equal key: the latest label
            at = np.maximum(pos, 0)
            hit = (pos >= 0) & (keys[at] == ids)
            found = np.where(hit, at if self._perm is None else self._perm[at], -1)
        if self._extra:
            for n, id_ in enumerate(ids.tolist()):
                label = self._extra.get(id_)
                if label is not None:
                    found[n] = label
        if self.tombstones:
            found[(found >= 0) & self.dead[np.maximum(found, 0)]] = -1
        return found

    def kill(self, ids: np.ndarray) -> None:
        """Make the live labels of ``ids`` (r,) tombstones; ids without one are ignored."""
        labels = np.unique(self.find(ids))
        labels = labels[labels >= 0]
        self.dead[labels] = True
        self.tombstones += len(labels)

    def live_ids(self, *, sort: bool = True) -> np.ndarray:
        """The live ids (n,) int64, a new array: sorted (or in label order with ``sort=False``)."""
        ids = self.ids[~self.dead] if self.tombstones else self.ids.copy()
        return np.sort(ids) if sort and not self.in_order else ids
