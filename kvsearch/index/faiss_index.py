"""FAISS candidate search: :class:`Index`, built from an ``index_factory`` spec, behind the torch protocol.

An implementation of :class:`kvsearch.index.base.CandidateIndex`: add / remove by id, search, save / load,
normalisation for cosine, and filtered search with a guaranteed number of results (an exact top-up from the
key source, :mod:`kvsearch.index.topk`). The boundary is torch; numpy and FAISS's ``D`` / ``I`` names stay inside
this module. Ids are the store's global integer ids, never row positions. What a spec may be and the search /
build parameters are :mod:`kvsearch.index.faiss_spec`'s. It knows nothing of SQLite, text or autograd.

Every FAISS index type supports removal. Types that FAISS can remove from (Flat, IVF*) remove for real; graph
indexes that cannot (HNSW) keep tombstones that a search excludes with an ``IDSelector``, so a deleted record
never appears; :attr:`Index.needs_rebuild` turns true when tombstones outnumber live vectors. Types that need
training (IVF, PQ, OPQ) are served by an exact flat index until enough vectors exist to train them
(:attr:`Index.min_train`), then trained on everything stored and switched over through :meth:`Index.rebuild`
(or :meth:`Index.build`).

An HNSW graph (``IndexHNSWFlat``) bound to a source reads the source's keys instead of holding its own copy where
they are its vectors in order (:attr:`Index.shares_storage`, :mod:`kvsearch.index.graph_storage`), and it is saved
without the vectors, the graph in a file of its own that a reader maps (:mod:`kvsearch.index.graph_file`). A graph's
labels (insertion positions) and the id each holds are :class:`~kvsearch.index.labels.Labels`.
"""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import COSINE_EPS, check_fits, check_k, index_bytes
from kvsearch.errors import (
    CorruptDatabaseError,
    InvalidArgumentError,
    UnknownOptionError,
)
from kvsearch.index.faiss_spec import (
    METRICS,
    can_remove,
    check_search_param,
    check_supported,
    default_search_params,
    inner_index,
    min_train,
    parse_spec,
    search_parameters,
    tune_faiss,
)
from kvsearch.index.graph_file import own_graph, read_index_file, write_index_file
from kvsearch.index.graph_storage import (
    GraphVectors,
    delta_bound,
    graph_blob,
    is_flat_graph,
    return_freed_memory,
)
from kvsearch.index.labels import Labels
from kvsearch.index.topk import (
    EXACT_FILTER_MAX,
    KeySource,
    Metric,
    SearchResult,
    check_allowed,
    check_ids,
    check_index_args,
    check_pairs,
    check_queries,
    exact_search,
)

__all__ = ["Index"]

#: Seed of the training sample (``train_size``): the same vectors give the same index.
_TRAIN_SEED = 1234


#: Flat-coded types whose search takes an ``IDSelector`` (PQ, RQ, LSH codes refuse one).
_SELECTOR_FLAT = (faiss.IndexFlat, faiss.IndexScalarQuantizer)


class Index:
    """A FAISS index over ``(id, key)`` pairs with removal, tombstones, a flat fallback and guaranteed filters.

    Implements :class:`~kvsearch.index.base.CandidateIndex`.

    Args:
        dim: key dimension.
        spec: an ``index_factory`` string: ``"Flat"``, ``"HNSW32"``, ``"IVF256,Flat"``, ``"IVF256,PQ16"``...
        metric: ``"ip"`` (inner product) or ``"l2"`` (squared Euclidean distance).
        normalize: hold unit keys and normalise queries (cosine); needs metric ``"ip"``.
        source: the store: :meth:`rebuild` reads it, and filtered searches top up from its exact keys. Without
            one, filtered searches top up by an exhaustive search over the index's own codes.
        params: search parameters such as ``{"nprobe": 16}`` or ``{"efSearch": 128}``.

    Raises:
        UnknownOptionError: the spec or metric is not one FAISS knows.
        InvalidArgumentError: ``dim`` is not a positive integer, or ``normalize`` with metric ``"l2"``.
    """

    def __init__(
        self,
        dim: int,
        spec: str = "Flat",
        metric: Metric = "ip",
        *,
        normalize: bool = False,
        source: KeySource | None = None,
        params: dict[str, float] | None = None,
    ) -> None:
        check_index_args(dim, metric, normalize)
        tune_faiss()
        self.dim = dim
        self.spec = spec
        self.metric: Metric = metric
        self.normalize = bool(normalize)
        self.source = source
        self.exact_filter_max = EXACT_FILTER_MAX
        #: Queries of the last filtered search that the FAISS selector search gave too few results and that were
        #: searched again exactly (0 when the admitted set was small enough to be scanned exactly outright).
        self.last_redone = 0
        self.params: dict[str, int] = {}
        template = parse_spec(dim, spec, metric)
        check_supported(template, spec)
        self._template = template  # what search parameters are checked against (never holds vectors)
        self.removable = can_remove(template)
        self.min_train = min_train(template, spec)
        self._faiss: faiss.Index = template
        self._labels = Labels()  # label -> id, tombstones, id -> live label: where FAISS cannot remove (graphs)
        self._core_of: tuple[faiss.Index, faiss.Index] | None = None  # (_faiss, its core): see _core
        self._exact_of: tuple[faiss.Index, bool] | None = None  # (_faiss, whether exact): see exact_scores
        self._fallback = False  # serving an exact flat index until enough vectors exist to train
        self._vectors = GraphVectors(metric, self.normalize)  # an HNSW graph's storage (a view?) and delta
        self._build(np.empty(0, dtype=np.int64), np.empty((0, dim), dtype=np.float32))
        if params:
            self.set_params(**params)

    # ------------------------------------------------------------------ state

    @property
    def ntotal(self) -> int:
        """The number of live (searchable) vectors."""
        if self._removable_now:
            return int(self._faiss.ntotal)
        return self._labels.live

    @property
    def is_fallback(self) -> bool:
        """True while an untrained spec is served by an exact flat index."""
        return self._fallback

    @property
    def needs_rebuild(self) -> bool:
        """True when tombstones outnumber live vectors, or when an untrained spec could now be trained."""
        if self._fallback:
            return self.ntotal >= self.min_train
        return self._labels.tombstones > max(self.ntotal, 1024)

    @property
    def persisted(self) -> bool:
        """True unless the spec is a plain ``"Flat"``: trained and graph types are worth a :meth:`save`."""
        return not isinstance(self._template, faiss.IndexFlat)

    @property
    def train_size(self) -> int | None:
        """How many vectors the next training samples (``train_size`` build parameter); None: every vector."""
        return self.params.get("train_size")

    @property
    def shares_storage(self) -> bool:
        """True when the HNSW graph reads its vectors from the source's key tensor: its FAISS storage is a view over
        ``source.keys``'s first rows (no copy). False for other types, without a source, and where the graph holds a
        copy: its labels are not the source's first ids in order (tombstones in a reopened graph, a build from other
        keys), the keys are not float32 on the CPU, or (cosine) not unit within ``UNIT_TOLERANCE``.

        A shared graph's file holds the graph only (:meth:`save`); vectors added to it wait in a small exact delta
        searched beside the graph until it is folded in (copy, grow, share again).
        """
        return self._vectors.shared

    @property
    def faiss_index(self) -> faiss.Index:
        """The underlying FAISS index (read it, do not change it): under an ``IndexIDMap2`` for flat-coded types
        and during the flat fallback; with labels in insertion order (not ids) for graph types."""
        return self._faiss

    # ------------------------------------------------------------------ writing

    def _new_faiss(self, vectors: np.ndarray) -> faiss.Index:
        index = parse_spec(self.dim, self.spec, self.metric)
        self._fallback = False
        if not index.is_trained:
            if len(vectors) >= self.min_train and len(vectors) > 0:
                size = self.params.get("train_size", len(vectors))
                if size < len(vectors):
                    pick = np.random.default_rng(_TRAIN_SEED).choice(len(vectors), size, replace=False)
                    index.train(np.ascontiguousarray(vectors[np.sort(pick)]))  # (size, dim)
                else:
                    index.train(vectors)
            else:
                index = faiss.IndexFlat(self.dim, METRICS[self.metric])
                self._fallback = True
        if (self.removable or self._fallback) and not isinstance(inner_index(index), faiss.IndexIVF):
            # Flat / PQ / SQ codes (pre-transformed or not) renumber on removal, which is what IndexIDMap2
            # expects; IVF indexes (pre-transformed or not) store ids themselves.
            index = faiss.IndexIDMap2(index)
        return index

    def build(self, ids: Tensor, keys: Tensor) -> None:
        """Replace the whole content with raw ``keys`` (n, dim) under ``ids`` (n,), training if needed.

        Args:
            ids: (n,) int64 global ids, unique, on any device.
            keys: (n, dim) float, on any device (normalised here for a ``normalize`` index).

        Raises:
            InvalidArgumentError: not tensors.
            DimensionMismatchError: keys are not (n, dim) or ids not (n,).
        """
        self._build(*self._to_numpy(ids, keys))

    def rebuild(self) -> None:
        """Replace the whole content with the source's ids and keys, training if needed.

        Raises:
            InvalidArgumentError: the index has no source.
            MemoryLimitError: the index would not fit in memory (checked before anything is replaced).
        """
        if self.source is None:
            raise InvalidArgumentError("rebuild() reads the index's source, and this index has none: use build()")
        ids, keys = self.source.ids, self.source.keys
        check_fits(index_bytes(self.spec, len(ids), self.dim), f"building the {self.spec} index")
        self.build(ids, keys if keys is not None else torch.empty(0, self.dim))

    def add(self, ids: Tensor, keys: Tensor) -> None:
        """Add raw ``keys`` (n, dim) under new ``ids`` (n,).

        Raises:
            InvalidArgumentError: not tensors.
            DimensionMismatchError: keys are not (n, dim) or ids not (n,).
        """
        self._add(*self._to_numpy(ids, keys))

    def remove(self, ids: Tensor) -> None:
        """Remove ``ids`` (n,); ids that are not present are ignored.

        Raises:
            InvalidArgumentError: ``ids`` is not an integer tensor.
        """
        ids = np.ascontiguousarray(check_ids(ids).numpy())
        if not len(ids):
            return
        if self._removable_now:
            self._faiss.remove_ids(faiss.IDSelectorBatch(ids))
            return
        self._labels.kill(ids)

    def _build(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        self._faiss = self._new_faiss(vectors)
        self._vectors.reset()  # after the old graph went: it read the storage kept there
        self._removable_now = self.removable or self._fallback
        self._labels = Labels()
        self._apply_params()
        if len(ids):
            self._add(ids, vectors)
        self._vectors.share(self._faiss, self.source, self._labels.ids)  # built from the source: read its keys

    def _add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        if not len(ids):
            return
        if self._removable_now:
            self._faiss.add_with_ids(vectors, ids)
            return
        if self._vectors.shared:  # a view cannot grow: the new vectors wait in the delta
            self._vectors.add(vectors)
        else:
            own_graph(self._faiss)  # a mapped graph cannot grow either: its neighbour lists copied first
            self._faiss.add(vectors)
        self._labels.append(ids)
        if self._vectors.delta is not None and len(self._vectors.delta) > delta_bound(self._faiss.ntotal):
            self._vectors.fold(self._faiss)
            self._vectors.share(self._faiss, self.source, self._labels.ids)

    # ------------------------------------------------------------------ reading

    def search(self, queries: Tensor, k: int, *, allowed: Tensor | None = None, checked: bool = False) -> SearchResult:
        """The ``k`` best ids for each query.

        Args:
            queries: (batch, dim) raw float queries on any device (normalised here for a ``normalize`` index).
            k: candidates per query, 1 <= k <= MAX_K. Where fewer vectors exist, ids are -1.
            allowed: (m,) int64 ids (sorted, any device): only these may come back, and each query gets
                ``min(k, live allowed ids)`` of them. Live means in the source when the index has one (read
                exactly from its keys where needed), else in the index. At most ``max(8 k, exact_filter_max)``
                live ids: those rows are scanned exactly; more: a FAISS ``IDSelector`` search, redone exactly
                for each query that got too few (a graph can, under a selective filter).
            checked: the caller has checked the arguments (see :meth:`kvsearch.index.base.CandidateIndex.search`):
                nothing is checked again.

        Returns:
            :class:`SearchResult` on ``queries.device``: inner product, or squared L2 distance for
            ``metric="l2"``, NaN where ids are -1; no ``rows`` (FAISS ids are not rows of the source's keys: the
            source gathers by id).

        Raises:
            InvalidArgumentError: k is out of range, or queries are not a tensor.
            DimensionMismatchError: queries are not (batch, dim).
        """
        if not checked:
            k = check_k(k)
            check_queries(queries, self.dim)
            allowed = None if allowed is None else check_allowed(allowed)
        q = queries.detach()  # (batch, dim)
        if q.dtype != torch.float32:
            q = q.float()  # (batch, dim)
        if q.device.type != "cpu":
            q = q.cpu()  # (batch, dim)
        if self.normalize:  # FAISS's own row-by-row renormalisation, on a copy: one C call (a zero row stays zero)
            q = np.array(q.numpy(), dtype=np.float32, order="C")  # (batch, dim) a copy: the caller's memory untouched
            faiss.fvec_renorm_L2(self.dim, q.shape[0], faiss.swig_ptr(q))
        else:
            q = np.ascontiguousarray(q.numpy())  # (batch, dim) float32
        if allowed is None:
            D, I = self._search(q, k, None)  # noqa: E741 - FAISS's own names, kept inside this module
        else:
            D, I = self._filtered_search(q, k, allowed)  # noqa: E741
        scores, ids = torch.from_numpy(D), torch.from_numpy(I)  # (batch, k) each, on the CPU
        device = queries.device
        if device.type != "cpu":
            scores, ids = scores.to(device), ids.to(device)
        return SearchResult(scores, ids)

    def _search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """FAISS's search (with a selector admitting only ``allowed`` live ids): (batch, k) D and I, -1 padded."""
        batch, ntotal = queries.shape[0], self.ntotal
        search_k = min(k, ntotal)
        if search_k == 0 or batch == 0:
            return np.full((batch, k), np.nan, dtype=np.float32), np.full((batch, k), -1, dtype=np.int64)
        if allowed is not None:
            params = self._allowed_parameters(allowed, search_k)
        elif (self._removable_now or not self._labels.tombstones) and (self._fallback or ntotal >= self.min_train):
            params = None  # nothing to skip, no IVF to probe whole (_search_parameters' first case, without its call)
        else:
            params = self._search_parameters(search_k)
        d, i = self._faiss.search(queries, search_k, params=params) if params else self._faiss.search(queries, search_k)
        if self._vectors.delta is not None:
            d, i = self._vectors.with_delta(queries, (d, i), self._labels.ids, self._labels.dead, allowed)
        valid = i >= 0  # (batch, search_k)
        if not np.logical_and.reduce(valid, axis=None):  # the ufunc itself: ndarray.all goes through Python
            d = np.where(valid, d, np.float32(np.nan))  # (batch, search_k)
            if not self._removable_now:
                i = np.where(valid, self._labels.ids[np.where(valid, i, 0)], -1)
        elif not self._removable_now:
            i = self._labels.ids[i]  # (batch, search_k) label -> id
        if search_k == k:
            return d, i
        D = np.full((batch, k), np.nan, dtype=np.float32)
        I = np.full((batch, k), -1, dtype=np.int64)  # noqa: E741
        D[:, :search_k], I[:, :search_k] = d, i
        return D, I

    def _filtered_search(self, queries: np.ndarray, k: int, allowed: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Top-k among the live ids of ``allowed`` (m,): min(k, live) of them for every query."""
        batch = queries.shape[0]
        live, rows = self._live(allowed)  # (a,) ids, (a,) their source rows or None
        want = min(k, len(live))
        D = np.full((batch, k), np.nan, dtype=np.float32)
        I = np.full((batch, k), -1, dtype=np.int64)  # noqa: E741
        self.last_redone = 0
        if want == 0 or batch == 0:
            return D, I
        redo = np.ones(batch, dtype=bool)  # (batch,)
        if len(live) > max(8 * k, self.exact_filter_max) and self._takes_selector():
            D, I = self._search(queries, k, live)  # noqa: E741
            redo = (I >= 0).sum(1) < want  # (batch,)
            self.last_redone = int(redo.sum())
        if redo.any():
            if self.source is not None:
                d, i = self._source_search(queries[redo], want, live, rows)
            else:
                d, i = self._codes_search(queries[redo], want, live)
            D[redo] = np.nan
            I[redo] = -1
            D[redo, :want], I[redo, :want] = d, i
        return D, I

    def _live(self, allowed: Tensor) -> tuple[np.ndarray, Tensor | None]:
        """The ids of ``allowed`` that are live (in the source if there is one, else in the index) and, with a
        source, their rows in its keys."""
        if self.source is not None:
            rows = self.source.rows_of(allowed).reshape(-1).cpu()  # (m,)
            present = rows >= 0  # (m,)
            return np.ascontiguousarray(allowed[present].numpy()), rows[present]
        ids = allowed.numpy()
        if self._removable_now:
            present = np.isin(ids, self._id_array())
        else:
            present = self._labels.find(ids) >= 0
        return np.ascontiguousarray(ids[present]), None

    def _source_search(
        self, queries: np.ndarray, k: int, live: np.ndarray, rows: Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the source's keys at ``rows`` (ids ``live``), normalised for cosine."""
        keys = self.source.keys
        result = exact_search(
            torch.from_numpy(queries),
            keys,
            torch.from_numpy(live),
            k,
            metric=self.metric,
            rows=rows,
            normalize_keys=self.normalize,
        )  # (r, k) each, on the keys' device
        return result.scores.cpu().numpy(), result.ids.cpu().numpy()

    def _codes_search(self, queries: np.ndarray, k: int, live: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exhaustive search over the index's own codes admitting only ``live`` ids (every one is scored).

        IVF: every list probed, with a selector. Flat-coded types and a graph's storage: a selector search of
        the flat codes where the type takes one, else the admitted vectors decoded and scanned in torch.
        """
        core = self._core()
        if isinstance(core, faiss.IndexIVF):
            selector = faiss.IDSelectorBatch(live)
            params = faiss.SearchParametersIVF(sel=selector, nprobe=int(core.nlist))
            D, I = self._faiss.search(queries, k, params=params)  # noqa: E741
            return np.where(I >= 0, D, np.nan), I
        if self._removable_now:  # an IndexIDMap2 over flat codes: labels are positions in its id map
            label_ids = faiss.vector_to_array(self._faiss.id_map).astype(np.int64)
            labels = np.flatnonzero(np.isin(label_ids, live)).astype(np.int64)
            inner = faiss.downcast_index(self._faiss.index)
        else:  # a graph: labels in insertion order
            label_ids = self._labels.ids
            labels = self._labels.find(live)
            inner = self._faiss
        if isinstance(inner, faiss.IndexPreTransform):
            for step in range(inner.chain.size()):
                queries = inner.chain.at(step).apply(queries)  # (batch, d') the codes' space
            inner = faiss.downcast_index(inner.index)
        flat = faiss.downcast_index(inner.storage) if isinstance(inner, faiss.IndexHNSW) else inner
        if isinstance(flat, _SELECTOR_FLAT):
            selector = faiss.IDSelectorBatch(labels)
            D, L = flat.search(np.ascontiguousarray(queries), k, params=faiss.SearchParameters(sel=selector))
        else:
            vectors = torch.from_numpy(flat.reconstruct_batch(labels))  # (a, d') decoded codes
            found = exact_search(torch.from_numpy(queries), vectors, torch.from_numpy(labels), k, metric=self.metric)
            D, L = found.scores.numpy(), found.ids.numpy()
        I = np.where(L >= 0, label_ids[np.maximum(L, 0)], -1)  # noqa: E741
        return np.where(I >= 0, D, np.nan), I

    @property
    def exact_scores(self) -> bool:
        """Whether this type scores the float32 vectors as stored: Flat, HNSW over a flat storage, IVF-Flat (and
        the flat index an untrained spec falls back to); not SQ / PQ codes nor a PCA / OPQ pre-transform."""
        if self._exact_of is not None and self._exact_of[0] is self._faiss:  # its layers never change
            return self._exact_of[1]
        index = self._faiss
        if isinstance(index, faiss.IndexIDMap):
            index = faiss.downcast_index(index.index)
        core = self._core()
        if isinstance(index, faiss.IndexPreTransform):
            exact = False
        elif isinstance(core, faiss.IndexHNSW):
            exact = isinstance(faiss.downcast_index(core.storage), faiss.IndexFlat)
        else:
            exact = isinstance(core, (faiss.IndexFlat, faiss.IndexIVFFlat))
        self._exact_of = (self._faiss, exact)
        return exact

    def _takes_selector(self) -> bool:
        """Whether a FAISS search of this type takes an ``IDSelector`` (IVF, HNSW, Flat, SQ do; PQ, RQ don't)."""
        return isinstance(self._core(), (faiss.IndexIVF, faiss.IndexHNSW, *_SELECTOR_FLAT))

    def _core(self) -> faiss.Index:
        """The index that does the search: under the id map and the pre-transform (PCA, OPQ), downcast.

        Kept for as long as :attr:`_faiss` is the same object (its layers never change): downcasting costs more
        than a small search's own Python work.
        """
        if self._core_of is None or self._core_of[0] is not self._faiss:
            index = self._faiss
            if isinstance(index, faiss.IndexIDMap):
                index = faiss.downcast_index(index.index)
            self._core_of = (self._faiss, faiss.downcast_index(inner_index(index)))
        return self._core_of[1]

    def _allowed_parameters(self, allowed: np.ndarray, k: int) -> faiss.SearchParameters:
        """Search parameters whose selector admits only ``allowed`` ids (live ones, for graph indexes)."""
        allowed = np.ascontiguousarray(np.asarray(allowed, dtype=np.int64).reshape(-1))
        if not self._removable_now:  # graphs search by label: map live ids to their labels
            allowed = self._labels.find(allowed)
            allowed = np.ascontiguousarray(allowed[allowed >= 0])
        selector = faiss.IDSelectorBatch(allowed)
        params = self._parameters(k, selector, len(allowed))
        params._keep = (selector, allowed)  # keep the selector and its ids alive as long as the parameters
        return params

    def _search_parameters(self, k: int) -> faiss.SearchParameters | None:
        """Parameters of an unfiltered search: a selector that skips a graph's tombstones, if it has any."""
        if self._removable_now or not self._labels.tombstones:
            if self._fallback or self.ntotal >= self.min_train:  # no IVF to probe whole: FAISS's own settings
                return None
            return self._parameters(k, None, self.ntotal)
        dead = np.flatnonzero(self._labels.dead).astype(np.int64)
        selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(dead))
        params = self._parameters(k, selector, self.ntotal)
        params._keep = selector  # keep the selector alive as long as the parameters
        return params

    def _parameters(self, k: int, selector: faiss.IDSelector | None, admitted: int) -> faiss.SearchParameters | None:
        """The search parameters of one search whose ``selector`` (None: every entry) admits ``admitted`` entries
        (:func:`~kvsearch.index.faiss_spec.search_parameters`; every IVF list probed while deletes keep a trained
        IVF below :attr:`min_train` vectors)."""
        core = self._core()
        probe_all = isinstance(core, faiss.IndexIVF) and not self._fallback and self.ntotal < self.min_train
        return search_parameters(core, k, selector, admitted, entries=max(len(self._labels), 1), probe_all=probe_all)

    def set_params(self, **params: float) -> None:
        """Set search parameters, e.g. ``nprobe=16`` (IVF) or ``efSearch=128`` (HNSW), and build parameters
        (:data:`BUILD_PARAMS`): ``efConstruction=80`` (HNSW; for the vectors added from now on: set it when the
        index is made, e.g. ``Database(..., index="HNSW32", search_params={"efConstruction": 80})``) or
        ``train_size=50_000`` (IVF / PQ: the next training samples that many vectors). Read back from
        :attr:`faiss_index` (``hnsw.efConstruction``) and :attr:`train_size`.

        Every parameter is checked before any is kept: its name, its value (an integer >= 1; ``ht`` >= 0;
        ``train_size`` >= :attr:`min_train`) and that it applies to this spec's index type (even while an
        untrained spec is served by a flat fallback).

        Raises:
            UnknownOptionError: a parameter name FAISS does not know, or one that does not apply to this type
                (``train_size`` for a type that does not train).
            InvalidArgumentError: a value that is not a positive integer, or ``train_size`` below
                :attr:`min_train` (too few vectors to train the index).
        """
        checked = {name: check_search_param(name, value) for name, value in params.items()}
        if "train_size" in checked:
            if not self.min_train:
                raise UnknownOptionError(f"build parameter 'train_size' does not apply to index {self.spec!r}")
            if checked["train_size"] < self.min_train:
                raise InvalidArgumentError(
                    f"expected train_size >= {self.min_train} (the vectors {self.spec!r} needs to train), "
                    f"got {checked['train_size']}"
                )
        space = faiss.ParameterSpace()
        for name, value in checked.items():
            if name == "train_size":
                continue
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
            if name != "train_size":
                space.set_index_parameter(target, name, value)  # checked against the same type by set_params

    # ------------------------------------------------------------------ persistence

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to ``path`` atomically (a temporary file, then a rename); read it with :func:`load_index`.

        An HNSW graph (``IndexHNSWFlat``) with a source is written without its vectors (they are the source's
        keys): the graph to a file of its own beside ``path``, which readers map (:mod:`kvsearch.index.graph_file`),
        and in ``path`` the id of each label, the tombstones, the tombstones' vectors (ids the source no longer
        holds) and the source's version where the graph reads its keys; the delta's labels are written, their
        vectors read back from the source on load. Its storage is shared with the source first where it can be
        (:attr:`shares_storage`: a writer's graph reads the store's keys from its first save on). Other types, or
        without a source, hold their vectors in ``path``.

        Raises:
            OSError: a file cannot be written (the files it made are removed; ``path`` is as it was).
        """
        labels = self._labels
        arrays = {"labels": labels.ids, "dead": labels.dead, "fallback": np.array(self._fallback)}
        graph = None
        if is_flat_graph(self._faiss) and self.source is not None:
            shared = self._vectors.share(self._faiss, self.source, labels.ids)
            graph = graph_blob(self._faiss)  # uint8 array: the graph only
            arrays["graph_size"] = np.array(int(self._faiss.ntotal))
            arrays["dead_vectors"] = self._vectors.dead_vectors(self._faiss, np.flatnonzero(labels.dead))
            arrays["source_version"] = np.array(int(self.source.version) if shared else -1)
        else:
            arrays["faiss"] = faiss.serialize_index(self._faiss)  # uint8 array
        write_index_file(Path(path), arrays, graph)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        dim: int,
        spec: str,
        metric: Metric,
        params: dict[str, float] | None = None,
        *,
        normalize: bool = False,
        source: KeySource | None = None,
    ) -> Index:
        """Read an index written by :meth:`save` (see :func:`load_index`).

        A graph saved without its vectors is read from its own file with its neighbour lists mapped (shared with
        every process that reads it; copied before the graph first grows) and re-attaches its vectors from
        ``source`` (a view over its keys where they are the graph's in order, else a copy gathered by id: see
        :attr:`shares_storage`).

        Raises:
            CorruptDatabaseError: the file (or the graph file it names) is missing, truncated, damaged, foreign or of
                another dim / metric; or it holds a graph without vectors and ``source`` is None or lacks ids the
                graph holds.
        """
        index = cls(dim, spec, metric, normalize=normalize, source=source)
        arrays, loaded = read_index_file(Path(path))
        try:
            labels, dead = np.asarray(arrays["labels"], dtype=np.int64), np.asarray(arrays["dead"], dtype=bool)
            fallback = bool(arrays["fallback"])
            graph_size = int(arrays["graph_size"]) if "graph_size" in arrays else None
            saved_version = int(arrays.get("source_version", -1))
        except (ValueError, TypeError) as exc:
            raise CorruptDatabaseError(f"index file {path} cannot be read: {exc}".splitlines()[0]) from None
        if loaded.d != dim or loaded.metric_type != METRICS[metric] or labels.shape != dead.shape or labels.ndim != 1:
            raise CorruptDatabaseError(f"index file {path} does not match dim {dim} and metric {metric!r}")
        if graph_size is not None:  # a graph without vectors: they are the source's keys
            if source is None:
                raise CorruptDatabaseError(f"index file {path} holds a graph without vectors, and no source is given")
            same = saved_version >= 0 and saved_version == int(source.version)  # the keys the graph read when saved
            try:
                index._vectors.attach(loaded, graph_size, source, labels, dead, arrays["dead_vectors"], same_keys=same)
            except (CorruptDatabaseError, KeyError) as exc:
                raise CorruptDatabaseError(f"index file {path}: {exc}") from None
        index._faiss = loaded
        index._fallback = fallback
        index._removable_now = index.removable or fallback
        index._labels = Labels(labels, dead)
        if graph_size is None:  # a file that holds its vectors: shared from now on if they are the source's
            index._vectors.share(index._faiss, index.source, labels)
        index.set_params(**(params or {}))  # the parameters in effect, defaults included, not the file's
        return_freed_memory()  # the file's bytes, read and deserialised, are freed: out of the resident set too
        return index

    def ids(self) -> Tensor:
        """The live ids, sorted: (n,) int64 on the CPU (for consistency checks against the store)."""
        if not self._removable_now:
            return torch.from_numpy(self._labels.live_ids())  # (n,) sorted
        return torch.from_numpy(np.sort(self._id_array()))  # (n,)

    def _id_array(self) -> np.ndarray:
        """The live ids, unsorted."""
        if self._removable_now:
            target = self._faiss
            if isinstance(target, faiss.IndexIDMap):
                return faiss.vector_to_array(target.id_map).astype(np.int64)
            invlists = faiss.extract_index_ivf(target).invlists
            parts = [
                faiss.rev_swig_ptr(invlists.get_ids(lst), invlists.list_size(lst)).copy()
                for lst in range(invlists.nlist)
                if invlists.list_size(lst)
            ]
            return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)
        return self._labels.live_ids(sort=False)

    # ------------------------------------------------------------------ helpers

    def _to_numpy(self, ids: Tensor, keys: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Checked ids (n,) int64 and keys (n, dim) float32 as FAISS reads them (unit rows for cosine)."""
        ids, keys = check_pairs(ids, keys, self.dim)  # (n,), (n, dim)
        if self.normalize:
            keys = F.normalize(keys, dim=-1, eps=COSINE_EPS)  # (n, dim)
        return np.ascontiguousarray(ids.numpy()), np.ascontiguousarray(keys.cpu().numpy())
