"""FAISS candidate search: build from an ``index_factory`` spec, add / remove by id, search, save / load.

The index only *chooses* candidates. It speaks numpy float32 and int64 ids at its boundary; FAISS's
``D`` / ``I`` names stay inside this module. Ids are the store's global integer ids, never row positions.

Every index type supports removal. Types that FAISS can remove from (Flat, IVF*) remove for real; graph
indexes that cannot (HNSW, NSG) keep tombstones that a search excludes with an ``IDSelector``, so a deleted
record never appears; :attr:`Index.needs_rebuild` turns true when tombstones outnumber live vectors.

Types that need training (IVF, PQ, OPQ) are served by an exact flat index until enough vectors exist to
train them (:attr:`Index.min_train`), then trained on everything stored and switched over by the caller
through :meth:`Index.build`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Literal

import faiss
import numpy as np

from kvsearch.errors import (
    CorruptDatabaseError,
    DimensionMismatchError,
    InvalidArgumentError,
    UnknownOptionError,
)

__all__ = ["Index", "Metric", "MAX_K", "tune_faiss", "check_search_param", "default_search_params"]

Metric = Literal["ip", "l2"]

#: The largest ``k`` a search accepts. FAISS allocates ``batch x k`` results up front, so an unbounded
#: ``k`` is a memory hazard; 65,536 candidates per query is far past any useful attention width.
MAX_K = 65_536

_METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
_SEARCH_PARAMS = ("nprobe", "efSearch", "efConstruction", "quantizer_efSearch", "ht")
_tuned = False
_tune_lock = threading.Lock()


def tune_faiss() -> None:
    """Set FAISS's global BLAS threshold so small query batches use the BLAS path.

    FAISS compares ``nq * d`` with ``distance_compute_blas_threshold`` (128,000 by default): at d=384 every
    batch under ~334 queries takes a scalar loop that is ~10x slower than BLAS. 20 sends every batch of
    two or more queries to BLAS. Called once when the first index is created.
    """
    global _tuned
    with _tune_lock:
        if not _tuned:
            faiss.cvar.distance_compute_blas_threshold = 20
            _tuned = True


def check_search_param(name: object, value: object) -> int:
    """A search parameter's value, checked: a known name and an integer >= 1 (``ht``: >= 0).

    Raises:
        UnknownOptionError: an unknown name.
        InvalidArgumentError: a value that is not such an integer (bool, float with a fraction, NaN, str...).
    """
    if name not in _SEARCH_PARAMS:
        raise UnknownOptionError(f"expected search parameters among {_SEARCH_PARAMS}, got {name!r}")
    low = 0 if name == "ht" else 1
    ok = isinstance(value, (int, np.integer, float)) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = value.is_integer()
    if not ok or not low <= int(value) <= 1 << 30:
        raise InvalidArgumentError(f"expected {name} as an integer in [{low}, 2^30], got {value!r}")
    return int(value)


#: kvsearch's search parameters where the user sets none: FAISS's own defaults (efSearch 16, nprobe 1) trade
#: most of the recall away (recall@10 0.88 and 0.43 on clustered data in benchmarks/RESULTS.md).
DEFAULT_EF_SEARCH = 64


def default_search_params(index: faiss.Index) -> dict[str, int]:
    """kvsearch's default search parameters for an index of this type (empty for exact types).

    HNSW: ``efSearch`` 64. IVF with ``nlist`` lists: ``nprobe`` = min(nlist, max(8, nlist // 16)), a sixteenth
    of the lists (every list for small ``nlist``). Measured against recall@10 in benchmarks/RESULTS.md.
    """
    inner = _inner(index)
    if isinstance(inner, faiss.IndexHNSW):
        return {"efSearch": DEFAULT_EF_SEARCH}
    if isinstance(inner, faiss.IndexIVF):
        return {"nprobe": min(inner.nlist, max(8, inner.nlist // 16))}
    return {}


def _parse_spec(dim: int, spec: str, metric: Metric) -> faiss.Index:
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownOptionError(f"expected an index_factory string such as 'Flat' or 'HNSW32', got {spec!r}")
    if "IDMap" in spec:
        raise UnknownOptionError(f"index spec {spec!r}: leave out IDMap, kvsearch maps ids itself")
    try:
        return faiss.index_factory(dim, spec, _METRICS[metric])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise UnknownOptionError(
            f"FAISS cannot build an index from the spec {spec!r} (dim {dim}); expected an index_factory string "
            f"such as 'Flat', 'HNSW32', 'IVF256,Flat' or 'IVF256,PQ16'. FAISS said: {first}"
        ) from None


def _inner(index: faiss.Index) -> faiss.Index:
    """The index under a pre-transform (PCA, OPQ...), or the index itself."""
    return faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index


def _check_supported(index: faiss.Index, spec: str) -> None:
    """Refuse index types that cannot grow by id and lose records (NSG is built once; refine wrappers cannot
    add by id or remove); a database adds and deletes records one batch at a time.

    Raises:
        UnknownOptionError: the type is not one of the flat-coded (Flat, PQ, SQ, RQ), IVF or HNSW families.
    """
    if not isinstance(_inner(index), (faiss.IndexFlatCodes, faiss.IndexIVF, faiss.IndexHNSW)):
        raise UnknownOptionError(
            f"index spec {spec!r} builds a {type(_inner(index)).__name__}, which cannot add and delete records by "
            "id; expected a flat-coded, IVF or HNSW spec such as 'Flat', 'PQ16', 'IVF256,Flat', 'IVF256,PQ16', "
            "'OPQ16,IVF256,PQ16' or 'HNSW32'"
        )


def _can_remove(index: faiss.Index) -> bool:
    return not isinstance(_inner(index), faiss.IndexHNSW)


def _min_train(index: faiss.Index, spec: str) -> int:
    """How many vectors an index needs before training is sensible (0 when it needs none)."""
    if index.is_trained:
        return 0
    need = 2 * index.d  # a PCA / OPQ rotation needs more points than dimensions
    try:
        need = max(need, 39 * faiss.extract_index_ivf(index).nlist)  # FAISS warns below 39 points per centroid
    except RuntimeError:
        pass
    if "PQ" in spec.upper():
        need = max(need, 39 * 256)  # 256 centroids per PQ sub-quantizer
    return need


class Index:
    """A FAISS index over ``(id, vector)`` pairs with removal, tombstones and a flat fallback.

    Args:
        dim: vector dimension.
        spec: an ``index_factory`` string: ``"Flat"``, ``"HNSW32"``, ``"IVF256,Flat"``, ``"IVF256,PQ16"``...
        metric: ``"ip"`` (inner product) or ``"l2"`` (squared Euclidean distance).
        params: search parameters such as ``{"nprobe": 16}`` or ``{"efSearch": 128}``.

    Raises:
        UnknownOptionError: the spec or metric is not one FAISS knows.
        InvalidArgumentError: ``dim`` is not a positive integer.
    """

    def __init__(
        self, dim: int, spec: str = "Flat", metric: Metric = "ip", *, params: dict[str, float] | None = None
    ) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise InvalidArgumentError(f"expected a positive integer dim, got {dim!r}")
        if metric not in _METRICS:
            raise UnknownOptionError(f"expected metric 'ip' or 'l2', got {metric!r}")
        tune_faiss()
        self.dim = dim
        self.spec = spec
        self.metric: Metric = metric
        self.params: dict[str, float] = {}
        template = _parse_spec(dim, spec, metric)
        _check_supported(template, spec)
        self._template = template  # what search parameters are checked against (never holds vectors)
        self.removable = _can_remove(template)
        self.min_train = _min_train(template, spec)
        self._faiss: faiss.Index = template
        self._labels = np.empty(0, dtype=np.int64)  # label -> id, used where FAISS cannot remove (graphs)
        self._dead = np.zeros(0, dtype=bool)  # label is a tombstone
        self._label_of: dict[int, int] = {}  # live id -> label (graphs only)
        self._fallback = False  # serving an exact flat index until enough vectors exist to train
        self.build(np.empty(0, dtype=np.int64), np.empty((0, dim), dtype=np.float32))
        if params:
            self.set_params(**params)

    # ------------------------------------------------------------------ state

    @property
    def ntotal(self) -> int:
        """The number of live (searchable) vectors."""
        if self._removable_now:
            return int(self._faiss.ntotal)
        return len(self._label_of)

    @property
    def is_fallback(self) -> bool:
        """True while an untrained spec is served by an exact flat index."""
        return self._fallback

    @property
    def needs_rebuild(self) -> bool:
        """True when tombstones outnumber live vectors, or when an untrained spec could now be trained."""
        if self._fallback:
            return self.ntotal >= self.min_train
        return int(self._dead.sum()) > max(self.ntotal, 1024)

    # ------------------------------------------------------------------ writing

    def _new_faiss(self, vectors: np.ndarray) -> faiss.Index:
        index = _parse_spec(self.dim, self.spec, self.metric)
        self._fallback = False
        if not index.is_trained:
            if len(vectors) >= self.min_train and len(vectors) > 0:
                index.train(vectors)
            else:
                index = faiss.IndexFlat(self.dim, _METRICS[self.metric])
                self._fallback = True
        if (self.removable or self._fallback) and not isinstance(_inner(index), faiss.IndexIVF):
            # Flat / PQ / SQ codes (pre-transformed or not) renumber on removal, which is what IndexIDMap2
            # expects; IVF indexes (pre-transformed or not) store ids themselves.
            index = faiss.IndexIDMap2(index)
        return index

    def build(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Replace the whole content with ``vectors`` (n, dim) under ``ids`` (n,), training if needed.

        Args:
            ids: int64 global ids, unique.
            vectors: float32 (n, dim).
        """
        ids, vectors = self._check(ids, vectors)
        self._faiss = self._new_faiss(vectors)
        self._removable_now = self.removable or self._fallback
        self._labels = np.empty(0, dtype=np.int64)
        self._dead = np.zeros(0, dtype=bool)
        self._label_of = {}
        self._apply_params()
        if len(ids):
            self.add(ids, vectors)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add ``vectors`` (n, dim) under new ``ids`` (n,).

        Raises:
            DimensionMismatchError: vectors are not (n, dim) or ids not (n,).
        """
        ids, vectors = self._check(ids, vectors)
        if not len(ids):
            return
        if self._removable_now:
            self._faiss.add_with_ids(vectors, ids)
            return
        start = len(self._labels)
        self._faiss.add(vectors)
        self._labels = np.concatenate([self._labels, ids])
        self._dead = np.concatenate([self._dead, np.zeros(len(ids), dtype=bool)])
        for offset, id_ in enumerate(ids.tolist()):
            self._label_of[id_] = start + offset

    def remove(self, ids: np.ndarray) -> None:
        """Remove ``ids``; ids that are not present are ignored."""
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
        if not len(ids):
            return
        if self._removable_now:
            self._faiss.remove_ids(faiss.IDSelectorBatch(ids))
            return
        for id_ in ids.tolist():
            label = self._label_of.pop(id_, None)
            if label is not None:
                self._dead[label] = True

    # ------------------------------------------------------------------ reading

    def search(
        self, queries: np.ndarray, k: int, *, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best ids for each query.

        Args:
            queries: float32 (batch, dim).
            k: candidates per query, 1 <= k <= MAX_K. Where fewer than k vectors exist, ids are -1.
            allowed: if given, only these ids may come back (a FAISS ``IDSelector`` inside the search; a
                graph index may then return fewer than k — the caller tops up, see ``Database.candidates``).

        Returns:
            scores (batch, k) float32 — inner product, or squared L2 distance for ``metric="l2"`` — and
            ids (batch, k) int64, best first, -1 padded.

        Raises:
            InvalidArgumentError: k is out of range.
            DimensionMismatchError: queries are not (batch, dim).
        """
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= MAX_K:
            raise InvalidArgumentError(f"expected an integer k in [1, {MAX_K}], got {k!r}")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected queries of shape (batch, {self.dim}), got {queries.shape}")
        batch = queries.shape[0]
        live = self.ntotal
        search_k = int(min(k, live))
        D = np.full((batch, k), np.nan, dtype=np.float32)
        I = np.full((batch, k), -1, dtype=np.int64)  # noqa: E741 - FAISS's own name, kept inside this module
        if search_k == 0 or batch == 0:
            return D, I
        params = self._search_parameters(search_k) if allowed is None else self._allowed_parameters(allowed, search_k)
        d, i = self._faiss.search(queries, search_k, params=params) if params else self._faiss.search(queries, search_k)
        if not self._removable_now:
            valid = i >= 0
            i = np.where(valid, self._labels[np.where(valid, i, 0)], -1)
        D[:, :search_k] = d
        I[:, :search_k] = i
        return D, I

    def _core(self) -> faiss.Index:
        """The index that does the search: under the id map and the pre-transform (PCA, OPQ), downcast."""
        index = faiss.downcast_index(self._faiss.index) if isinstance(self._faiss, faiss.IndexIDMap) else self._faiss
        return faiss.downcast_index(_inner(index))

    def _allowed_parameters(self, allowed: np.ndarray, k: int) -> faiss.SearchParameters:
        """Search parameters whose selector admits only ``allowed`` ids (live ones, for graph indexes)."""
        allowed = np.ascontiguousarray(np.asarray(allowed, dtype=np.int64).reshape(-1))
        if not self._removable_now:  # graphs search by label: map live ids to their labels
            allowed = np.fromiter((self._label_of[i] for i in allowed.tolist() if i in self._label_of), dtype=np.int64)
        selector = faiss.IDSelectorBatch(allowed)
        params = self._parameters(k, selector, len(allowed))
        params._keep = (selector, allowed)  # keep the selector and its ids alive as long as the parameters
        return params

    def _search_parameters(self, k: int) -> faiss.SearchParameters | None:
        """Parameters of an unfiltered search: a selector that skips a graph's tombstones, if it has any."""
        if self._removable_now or not self._dead.any():
            return self._parameters(k, None, self.ntotal)
        dead = np.flatnonzero(self._dead).astype(np.int64)
        selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(dead))
        params = self._parameters(k, selector, self.ntotal)
        params._keep = selector  # keep the selector alive as long as the parameters
        return params

    def _parameters(self, k: int, selector: faiss.IDSelector | None, admitted: int) -> faiss.SearchParameters | None:
        """The search parameters of one search whose ``selector`` (None: every entry) admits ``admitted`` entries.

        Graph (HNSW): a search explores ``efSearch`` nodes, of which only the admitted fraction of the graph's
        entries (tombstones count as entries) can be answers; below a fraction of 1, efSearch is raised to
        ``max(efSearch, 4 k)`` divided by that fraction (at most the graph's size) to keep the recall of a clean
        graph searched without a filter (which keeps FAISS's own efSearch).

        IVF: ``nprobe`` lists are probed, every list while deletes keep a trained IVF below :attr:`min_train`
        vectors (its lists then hold a few vectors each, so ``nprobe`` of them miss most neighbours, and probing
        all costs no more than a flat search over fewer than ``min_train`` vectors).

        Returns:
            None where FAISS's own settings already do that (no selector, nothing raised).
        """
        core = self._core()
        if isinstance(core, faiss.IndexHNSW):
            entries, ef0 = max(len(self._labels), 1), int(core.hnsw.efSearch)
            if admitted >= entries:
                return None if selector is None else faiss.SearchParametersHNSW(sel=selector, efSearch=ef0)
            ef = max(ef0, min(entries, int(np.ceil(max(ef0, 4 * k) * entries / max(admitted, 1)))))
            return faiss.SearchParametersHNSW(sel=selector, efSearch=ef)
        if isinstance(core, faiss.IndexIVF):
            nprobe = int(core.nlist) if not self._fallback and self.ntotal < self.min_train else int(core.nprobe)
            if selector is None and nprobe == core.nprobe:
                return None
            return faiss.SearchParametersIVF(sel=selector, nprobe=nprobe)
        return None if selector is None else faiss.SearchParameters(sel=selector)

    def set_params(self, **params: float) -> None:
        """Set search parameters, e.g. ``nprobe=16`` (IVF) or ``efSearch=128`` (HNSW).

        Every parameter is checked before any is kept: its name, its value (an integer >= 1; ``ht`` >= 0) and
        that it applies to this spec's index type (even while an untrained spec is served by a flat fallback).

        Raises:
            UnknownOptionError: a parameter name FAISS does not know, or one that does not apply to this type.
            InvalidArgumentError: a value that is not a positive integer.
        """
        checked = {name: check_search_param(name, value) for name, value in params.items()}
        space = faiss.ParameterSpace()
        for name, value in checked.items():
            try:
                space.set_index_parameter(self._template, name, value)
            except RuntimeError:
                raise UnknownOptionError(f"search parameter {name!r} does not apply to index {self.spec!r}") from None
        self.params.update(checked)
        self._apply_params()

    @property
    def search_params(self) -> dict[str, int]:
        """The search parameters in effect: kvsearch's defaults for this type, overridden by those set."""
        return {**default_search_params(self._template), **self.params}

    def _apply_params(self) -> None:
        params = self.search_params
        if not params or self._fallback:
            return
        space = faiss.ParameterSpace()
        target = self._faiss.index if isinstance(self._faiss, faiss.IndexIDMap) else self._faiss
        for name, value in params.items():
            space.set_index_parameter(target, name, value)  # checked against the same type by set_params

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to ``path`` atomically (a temporary file, then a rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        blob = faiss.serialize_index(self._faiss)  # uint8 array
        np.savez(
            tmp.with_suffix(".npz"),
            faiss=blob,
            labels=self._labels,
            dead=self._dead,
            fallback=np.array(self._fallback),
        )
        os.replace(tmp.with_suffix(".npz"), path)

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], dim: int, spec: str, metric: Metric, params: dict | None = None
    ) -> Index:
        """Read an index written by :meth:`save`.

        Raises:
            CorruptDatabaseError: the file is missing, truncated, foreign or of another dim / spec.
        """
        index = cls(dim, spec, metric)
        try:
            with np.load(path, allow_pickle=False) as data:
                blob, labels, dead = data["faiss"], data["labels"], data["dead"]
                fallback = bool(data["fallback"])
            loaded = faiss.deserialize_index(np.ascontiguousarray(blob, dtype=np.uint8))
        except Exception as exc:  # numpy and FAISS raise many types on damaged input
            raise CorruptDatabaseError(f"index file {path} cannot be read: {exc}".splitlines()[0]) from None
        if loaded.d != dim or loaded.metric_type != _METRICS[metric] or len(labels) != len(dead):
            raise CorruptDatabaseError(f"index file {path} does not match dim {dim} and metric {metric!r}")
        index._faiss = loaded
        index._fallback = fallback
        index._removable_now = index.removable or fallback
        index._labels = labels.astype(np.int64)
        index._dead = dead.astype(bool)
        index._label_of = {int(i): n for n, i in enumerate(index._labels.tolist()) if not index._dead[n]}
        index.set_params(**(params or {}))  # the parameters in effect, defaults included, not the file's
        return index

    def ids(self) -> np.ndarray:
        """The live ids, sorted (for consistency checks against the store)."""
        if self._removable_now:
            target = self._faiss
            if isinstance(target, faiss.IndexIDMap):
                return np.sort(faiss.vector_to_array(target.id_map).astype(np.int64))
            invlists = faiss.extract_index_ivf(target).invlists
            parts = [
                faiss.rev_swig_ptr(invlists.get_ids(lst), invlists.list_size(lst)).copy()
                for lst in range(invlists.nlist)
                if invlists.list_size(lst)
            ]
            return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)
        return np.sort(np.fromiter(self._label_of.keys(), dtype=np.int64, count=len(self._label_of)))

    # ------------------------------------------------------------------ helpers

    def _check(self, ids: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected vectors of shape (n, {self.dim}), got {vectors.shape}")
        if len(ids) != len(vectors):
            raise DimensionMismatchError(f"expected one id per vector, got {len(ids)} ids for {len(vectors)} vectors")
        return ids, vectors
