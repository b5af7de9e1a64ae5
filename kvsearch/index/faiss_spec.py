"""FAISS index specs and parameters: what an ``index_factory`` string may be, and how an index of it is tuned.

It owns the spec checks (:func:`parse_spec`: length, characters, no ``IDMap``, FAISS's own parser; then
:func:`check_supported`, :func:`can_remove`, :func:`min_train`), the search and build parameters
(:func:`check_search_param`, :data:`BUILD_PARAMS`, :func:`default_search_params`, :data:`DEFAULT_EF_SEARCH`), the
parameters of one search (:func:`search_parameters`: efSearch / nprobe under a filter or tombstones), the
metric codes (:data:`METRICS`) and FAISS's global BLAS threshold (:func:`tune_faiss`).

It knows nothing of ids, vectors, tombstones or files: :class:`~kvsearch.index.faiss_index.Index` holds those.
"""

from __future__ import annotations

import faiss
import numpy as np

from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.index.topk import Metric

__all__ = [
    "METRICS",
    "BUILD_PARAMS",
    "DEFAULT_EF_SEARCH",
    "MAX_SPEC",
    "tune_faiss",
    "check_search_param",
    "default_search_params",
    "search_parameters",
    "parse_spec",
    "inner_index",
    "check_supported",
    "can_remove",
    "min_train",
]

#: FAISS's metric code of each kvsearch metric.
METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
_SEARCH_PARAMS = ("nprobe", "efSearch", "efConstruction", "quantizer_efSearch", "ht", "train_size")
#: Build parameters among them: ``efConstruction`` (HNSW: candidates kept while linking a new vector; FAISS's
#: default 40) applies to the vectors added after it is set; ``train_size`` (types that train: IVF, PQ, OPQ) is
#: how many vectors, sampled with a fixed seed, the index trains on (default: every stored vector, which FAISS's
#: k-means subsamples to 256 per centroid). kvsearch handles ``train_size``; FAISS never sees it.
BUILD_PARAMS = ("efConstruction", "train_size")


def tune_faiss() -> None:
    """Set FAISS's global BLAS threshold so small query batches use the BLAS path.

    FAISS compares ``nq * d`` with ``distance_compute_blas_threshold`` (128,000 by default): at d=384 every
    batch under ~334 queries takes a scalar loop that is ~10x slower than BLAS. 20 sends every batch of
    two or more queries to BLAS. Called when an index is created and before each ``faiss.knn`` a torch index
    runs (an assignment: cheap, and idempotent).
    """
    faiss.cvar.distance_compute_blas_threshold = 20


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
    inner = inner_index(index)
    if isinstance(inner, faiss.IndexHNSW):
        return {"efSearch": DEFAULT_EF_SEARCH}
    if isinstance(inner, faiss.IndexIVF):
        return {"nprobe": min(inner.nlist, max(8, inner.nlist // 16))}
    return {}


def search_parameters(
    core: faiss.Index, k: int, selector: faiss.IDSelector | None, admitted: int, *, entries: int, probe_all: bool
) -> faiss.SearchParameters | None:
    """The search parameters of one search of ``core`` whose ``selector`` (None: every entry) admits ``admitted``
    of its ``entries``.

    Graph (HNSW): a search explores ``efSearch`` nodes, of which only the admitted fraction of the graph's
    entries (tombstones count as entries) can be answers; below a fraction of 1, efSearch is raised to
    ``max(efSearch, 4 k)`` divided by that fraction (at most the graph's size) to keep the recall of a clean
    graph searched without a filter (which keeps FAISS's own efSearch).

    IVF: ``nprobe`` lists are probed, every list with ``probe_all`` (the index's owner sets it while deletes keep a
    trained IVF below the vectors it needs to train: its lists then hold a few vectors each, so ``nprobe`` of them
    miss most neighbours, and probing all costs no more than a flat search over so few vectors).

    Args:
        core: the index that does the search (under the id map and the pre-transform, downcast).
        k: results per query. selector: which entries may come back (None: all). admitted: how many it admits.
        entries: the graph's entries, live and dead (at least 1). probe_all: probe every IVF list.

    Returns:
        None where FAISS's own settings already do that (no selector, nothing raised).
    """
    if isinstance(core, faiss.IndexHNSW):
        if admitted >= entries and selector is None:
            return None  # before reading efSearch: each SWIG attribute read costs a few us
        ef0 = int(core.hnsw.efSearch)
        if admitted >= entries:
            return faiss.SearchParametersHNSW(sel=selector, efSearch=ef0)
        ef = max(ef0, min(entries, int(np.ceil(max(ef0, 4 * k) * entries / max(admitted, 1)))))
        return faiss.SearchParametersHNSW(sel=selector, efSearch=ef)
    if isinstance(core, faiss.IndexIVF):
        nprobe = int(core.nlist) if probe_all else int(core.nprobe)
        if selector is None and nprobe == core.nprobe:
            return None
        return faiss.SearchParametersIVF(sel=selector, nprobe=nprobe)
    return None if selector is None else faiss.SearchParameters(sel=selector)


#: The longest index_factory string accepted (real ones are a few dozen characters).
MAX_SPEC = 256


def parse_spec(dim: int, spec: str, metric: Metric) -> faiss.Index:
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownOptionError(f"expected an index_factory string such as 'Flat' or 'HNSW32', got {spec!r}")
    if len(spec) > MAX_SPEC or not spec.isascii() or not spec.isprintable():  # FAISS's parser crashes on long ones
        shown = spec if len(spec) <= 80 else f"{spec[:80]}... ({len(spec):,} characters)"
        raise UnknownOptionError(
            f"expected an index_factory string of at most {MAX_SPEC} printable ASCII characters, got {shown!r}"
        )
    if "IDMap" in spec:
        raise UnknownOptionError(f"index spec {spec!r}: leave out IDMap, kvsearch maps ids itself")
    try:
        return faiss.index_factory(dim, spec, METRICS[metric])
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        raise UnknownOptionError(
            f"FAISS cannot build an index from the spec {spec!r} (dim {dim}); expected an index_factory string "
            f"such as 'Flat', 'HNSW32', 'IVF256,Flat' or 'IVF256,PQ16'. FAISS said: {first}"
        ) from None


def inner_index(index: faiss.Index) -> faiss.Index:
    """The index under a pre-transform (PCA, OPQ...), or the index itself."""
    return faiss.downcast_index(index.index) if isinstance(index, faiss.IndexPreTransform) else index


def check_supported(index: faiss.Index, spec: str) -> None:
    """Refuse index types that cannot grow by id and lose records (NSG is built once; refine wrappers cannot
    add by id or remove); a database adds and deletes records one batch at a time.

    Raises:
        UnknownOptionError: the type is not one of the flat-coded (Flat, PQ, SQ, RQ), IVF or HNSW families.
    """
    if not isinstance(inner_index(index), (faiss.IndexFlatCodes, faiss.IndexIVF, faiss.IndexHNSW)):
        raise UnknownOptionError(
            f"index spec {spec!r} builds a {type(inner_index(index)).__name__}, which cannot add and delete records by "
            "id; expected a flat-coded, IVF or HNSW spec such as 'Flat', 'PQ16', 'IVF256,Flat', 'IVF256,PQ16', "
            "'OPQ16,IVF256,PQ16' or 'HNSW32'"
        )


def can_remove(index: faiss.Index) -> bool:
    """Whether FAISS can remove vectors from an index of this type (graphs cannot: they keep tombstones)."""
    return not isinstance(inner_index(index), faiss.IndexHNSW)


def min_train(index: faiss.Index, spec: str) -> int:
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
