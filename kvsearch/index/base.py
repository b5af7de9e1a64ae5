"""The protocol every candidate index implements: :class:`CandidateIndex`, search over ``(id, key)`` pairs.

The one interface the retrieval code uses. Two classes implement it: the exact
:class:`~kvsearch.index.torch_index.TorchIndex`, which the specs ``"Flat"`` (the default) and ``"torch[:dtype]"``
build, and FAISS's :class:`~kvsearch.index.faiss_index.Index`, which every other spec (an ``index_factory`` string:
``"HNSW32"``, ``"IVF256,Flat"``...) builds; :mod:`kvsearch.index.factory` lists the kinds and makes them. The
boundary is torch: ids and keys come in as tensors and a :class:`~kvsearch.index.topk.SearchResult` goes back on the
queries' device, holding what the search found (scores, ids, and the source rows where it scanned them): none of
it is left on the index for a later reader.

Arguments are checked at the door: :meth:`CandidateIndex.search` checks what it is given, unless a caller that
has checked them already says so with ``checked=True`` (the retriever, behind the facade's checks).

It knows nothing of any index type, of SQLite, text or autograd.
"""

from __future__ import annotations

import os
from typing import Protocol

from torch import Tensor

from kvsearch.index.topk import KeySource, Metric, SearchResult

__all__ = ["CandidateIndex"]


class CandidateIndex(Protocol):
    """Candidate search over ``(id, key)`` pairs: the one interface the retrieval code uses.

    Implemented by :class:`~kvsearch.index.torch_index.TorchIndex` (exact, in torch: the specs ``"Flat"`` and
    ``"torch[:dtype]"``) and :class:`~kvsearch.index.faiss_index.Index` (FAISS: any other ``index_factory`` spec);
    make one with :func:`~kvsearch.index.factory.make_index`. Keys and queries come in raw: a ``normalize`` (cosine)
    index normalises both. An index bound to a :class:`~kvsearch.index.topk.KeySource` can :meth:`rebuild` itself from
    it and guarantees filtered results by reading its keys.

    Attributes:
        spec: what the index was made from (``"Flat"``, ``"HNSW32"``, ``"torch:bfloat16"``...).
        dim: key dimension.
        metric: ``"ip"`` (inner product, larger is better) or ``"l2"`` (squared distance, smaller is better).
        normalize: keys and queries are scored as unit vectors (cosine; metric ``"ip"``).
        exact_filter_max: a filtered search whose admitted set holds at most ``max(8 k, exact_filter_max)`` live
            ids scans exactly those rows; above, the index searches with the filter and redoes exactly the
            queries that got too few. Public to tune, and for tests to force either path. Default 4096.
        params: the search parameters set by the user (empty for exact indexes).
        source: the :class:`~kvsearch.index.topk.KeySource` the index is bound to, or None (standalone).
    """

    source: KeySource | None
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
    def exact_scores(self) -> bool:
        """True when the scores a search returns are those of the stored float32 vectors themselves (exact inner
        products or squared distances, up to float rounding): a search may report them as they are. False for lossy
        codes (SQ, PQ) and transformed spaces (PCA, OPQ), whose candidates are scored again on the stored keys."""
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

    def search(self, queries: Tensor, k: int, *, allowed: Tensor | None = None, checked: bool = False) -> SearchResult:
        """The ``k`` best ids for each query, best first.

        Args:
            queries: (batch, dim) raw float queries on any device; no gradient is taken.
            k: candidates per query, 1 <= k <= MAX_K; where fewer exist, ids are -1.
            allowed: (m,) int64 ids, sorted, on any device: only these may come back, and every query gets
                ``min(k, live allowed ids)`` results (exactly scanned where the index alone would give fewer).
            checked: the unchecked entry, for a caller that has checked the arguments itself (the
                :class:`~kvsearch.retrieval.Retriever`, behind the facade): ``k`` an int in [1, MAX_K],
                ``queries`` a dense real (batch, dim) tensor of finite numbers, ``allowed`` an (m,) int64 CPU
                tensor of sorted distinct ids. Nothing is checked again; arguments that are not so give wrong
                results or a torch / FAISS error rather than a kvsearch one. False (the default): every argument
                is checked, as a user calling the index needs.

        Returns:
            :class:`~kvsearch.index.topk.SearchResult` on ``queries.device``: scores and ids, and where the index
            scanned its source's own key tensor the rows of the ids in it (for the source to gather by).

        Raises:
            InvalidArgumentError: k is out of range, or queries are not a tensor (unless ``checked``).
            DimensionMismatchError: queries are not (batch, dim) (unless ``checked``).
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
