"""Candidate search behind one protocol that speaks torch: :class:`CandidateIndex`, and where indexes are made.

This module owns the protocol every index implements — FAISS :class:`~kvsearch.index.faiss_index.Index` and exact
:class:`~kvsearch.index.torch_index.TorchIndex` — and :func:`make_index` / :func:`load_index`, the one place where a
spec string becomes an index class; nothing outside the index modules dispatches on index types. The boundary
is torch: ids and keys come in as tensors and a :class:`~kvsearch.index.topk.SearchResult` ``(scores, ids)`` goes
back on the queries' device. It knows nothing of SQLite, text or autograd.

Where to add an index type: a class with the methods of :class:`CandidateIndex` in a module of its own, and a
branch for its spec in :func:`make_index` (and :func:`load_index` if it is saved).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
from torch import Tensor

from kvsearch.checks import MAX_K
from kvsearch.errors import InvalidArgumentError
from kvsearch.index.faiss_index import Index, check_search_param, default_search_params, tune_faiss
from kvsearch.index.topk import EXACT_FILTER_MAX, KeySource, Metric, SearchResult
from kvsearch.index.torch_index import TorchIndex, parse_torch_spec

__all__ = [
    "CandidateIndex",
    "SearchResult",
    "KeySource",
    "Metric",
    "Index",
    "TorchIndex",
    "make_index",
    "load_index",
    "EXACT_FILTER_MAX",
    "MAX_K",
    "tune_faiss",
    "check_search_param",
    "default_search_params",
]


class CandidateIndex(Protocol):
    """Candidate search over ``(id, key)`` pairs: the one interface the retrieval code uses.

    Implemented by :class:`Index` (FAISS) and :class:`~kvsearch.index.torch_index.TorchIndex` (exact, in torch); make
    one with :func:`make_index`. Keys and queries come in raw: a ``normalize`` (cosine) index normalises both.
    An index bound to a :class:`KeySource` can :meth:`rebuild` itself from it and guarantees filtered results
    by reading its keys.

    Attributes:
        spec: what the index was made from (``"Flat"``, ``"HNSW32"``, ``"torch:bfloat16"``...).
        dim: key dimension.
        metric: ``"ip"`` (inner product, larger is better) or ``"l2"`` (squared distance, smaller is better).
        normalize: keys and queries are scored as unit vectors (cosine; metric ``"ip"``).
        exact_filter_max: a filtered search whose admitted set holds at most ``max(8 k, exact_filter_max)`` live
            ids scans exactly those rows; above, the index searches with the filter and redoes exactly the
            queries that got too few. Public to tune, and for tests to force either path. Default 4096.
        params: the search parameters set by the user (empty for exact indexes).
    """

    spec: str
    dim: int
    metric: Metric
    normalize: bool
    exact_filter_max: int
    params: dict[str, int]

    @property
    def ntotal(self) -> int:
        """The number of live (searchable) vectors."""
        ...

    @property
    def needs_rebuild(self) -> bool:
        """True when a :meth:`rebuild` would pay off (tombstones piled up, or an untrained spec can now train)."""
        ...

    @property
    def is_fallback(self) -> bool:
        """True while an untrained spec is served by an exact flat index."""
        ...

    @property
    def persisted(self) -> bool:
        """True when :meth:`save` is worth it (trained or graph FAISS types); False where rebuilding from the
        source is as fast as reading a file ("Flat", every torch index)."""
        ...

    @property
    def search_params(self) -> dict[str, int]:
        """The search parameters in effect: the defaults for this type, overridden by those set."""
        ...

    def search(self, queries: Tensor, k: int, *, allowed: Tensor | None = None) -> SearchResult:
        """The ``k`` best ids for each query, best first.

        Args:
            queries: (batch, dim) raw float queries on any device; no gradient is taken.
            k: candidates per query, 1 <= k <= MAX_K; where fewer exist, ids are -1.
            allowed: (m,) int64 ids, sorted, on any device: only these may come back, and every query gets
                ``min(k, live allowed ids)`` results (exactly scanned where the index alone would give fewer).

        Returns:
            :class:`SearchResult` on ``queries.device``.

        Raises:
            InvalidArgumentError: k is out of range, or queries are not a tensor.
            DimensionMismatchError: queries are not (batch, dim).
        """
        ...

    def add(self, ids: Tensor, keys: Tensor) -> None:
        """Add raw ``keys`` (n, dim) under new ``ids`` (n,)."""
        ...

    def remove(self, ids: Tensor) -> None:
        """Remove ``ids`` (n,); absent ids are ignored."""
        ...

    def build(self, ids: Tensor, keys: Tensor) -> None:
        """Replace everything with raw ``keys`` (n, dim) under ``ids`` (n,)."""
        ...

    def rebuild(self) -> None:
        """Replace everything with what the source holds now.

        Raises:
            InvalidArgumentError: the index has no source.
            MemoryLimitError: the rebuilt index would not fit in memory.
        """
        ...

    def set_params(self, **params: float) -> None:
        """Set search parameters (``nprobe``, ``efSearch``...); every one is checked before any is kept."""
        ...

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to ``path`` atomically (only where :attr:`persisted`)."""
        ...

    def ids(self) -> Tensor:
        """The live ids, sorted: (n,) int64 on the CPU."""
        ...


def make_index(
    spec: str,
    dim: int,
    *,
    metric: Metric = "ip",
    normalize: bool = False,
    source: KeySource | None = None,
    params: dict[str, float] | None = None,
) -> CandidateIndex:
    """An empty index of ``spec``: the one place that maps a spec string to an index class.

    Args:
        spec: ``"Flat"`` (the default: exact, the path chosen per call by :mod:`kvsearch.index.exact_path`),
            ``"torch"``, ``"torch:float16"`` or ``"torch:bfloat16"`` for exact search in torch on a fixed path
            (all :class:`~kvsearch.index.torch_index.TorchIndex`), anything else an ``index_factory`` string for
            :class:`Index` (``"HNSW32"``, ``"IVF256,Flat"``...; ``Index(dim, "Flat")`` is FAISS's flat index).
        dim: key dimension.
        metric: ``"ip"`` or ``"l2"``.
        normalize: score unit vectors (cosine); needs metric ``"ip"``.
        source: the store to read keys from (a torch index searches its key tensor directly).
        params: search parameters (a torch index takes none), and the build parameters ``efConstruction``
            (HNSW) and ``train_size`` (IVF / PQ: vectors sampled to train on), see :class:`Index`.

    Returns:
        The index, empty (a source-bound torch index already sees the source's keys).

    Raises:
        UnknownOptionError: an unknown spec, metric or search parameter.
        InvalidArgumentError: a bad dim or parameter value, or ``normalize`` with metric ``"l2"``.
    """
    dtype: torch.dtype | str | None = "auto" if spec == "Flat" else parse_torch_spec(spec)
    if dtype is None:
        return Index(dim, spec, metric, normalize=normalize, source=source, params=params)
    index = TorchIndex(dim, metric, source=source, normalize=normalize, dtype=dtype)
    index.set_params(**(params or {}))
    return index


def load_index(
    path: str | os.PathLike[str],
    spec: str,
    dim: int,
    *,
    metric: Metric,
    normalize: bool = False,
    source: KeySource | None = None,
    params: dict[str, float] | None = None,
) -> CandidateIndex:
    """Read an index that :meth:`CandidateIndex.save` wrote, with the options it is to be used under.

    Args:
        path: the file. spec, dim, metric, normalize, source, params: as for :func:`make_index`; the search
            parameters in effect are ``params`` (and the type's defaults), not the file's.

    Returns:
        The index as saved.

    Raises:
        CorruptDatabaseError: the file is missing, truncated, foreign or of another dim / metric.
        InvalidArgumentError: a torch spec (a torch index is never saved: it reads its source).
        UnknownOptionError: an unknown spec or metric.
    """
    if parse_torch_spec(spec) is not None:
        raise InvalidArgumentError(
            f"expected a FAISS spec to load, got {spec!r}: a torch index is not saved, make it with make_index()"
        )
    return Index.load(path, dim, spec, metric, params, normalize=normalize, source=source)
