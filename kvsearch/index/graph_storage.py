"""Where an HNSW graph's vectors live: in the store's own key tensor (one copy), or in a copy of the graph's own.

FAISS's ``IndexHNSWFlat`` keeps its vectors in a flat storage index (an ``IndexFlat``, whose ``codes`` are the
float32 rows). Here that storage can be a *view* over a float32 tensor's memory (FAISS's ``MaybeOwnedVector``
view): a graph built over, or loaded beside, the store reads the store's keys and holds no second copy, and its
saved file holds the graph only (:func:`graph_blob`), the vectors being re-attached on load.

A view cannot grow or shrink: FAISS *aborts the process* (an assertion, not an exception) when a view storage is
asked to add, reset or remove (and when a graph whose neighbour lists are mapped from its file grows:
:func:`~kvsearch.index.graph_file.own_graph` copies them first, wherever a graph is added to).
:class:`~kvsearch.index.faiss_index.Index` therefore never adds to a graph whose storage is a view: its new vectors
go to a small exact *delta* (:func:`delta_search`, merged by score with :func:`merge_results`) until it is folded in
(the storage copied back, the graph grown, then shared again).

It knows nothing of ids, tombstones, files or the store: the index holds those.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import faiss
import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import COSINE_EPS
from kvsearch.errors import CorruptDatabaseError
from kvsearch.index.graph_file import own_graph
from kvsearch.index.topk import KeySource, Metric, exact_search

__all__ = [
    "UNIT_TOLERANCE",
    "UNIT_SAMPLE",
    "DELTA_MIN",
    "DELTA_FRACTION",
    "DELTA_MAX",
    "is_flat_graph",
    "view_storage",
    "owned_storage",
    "set_storage",
    "storage_vectors",
    "same_vectors",
    "is_unit",
    "graph_blob",
    "delta_bound",
    "delta_search",
    "merge_results",
    "GraphVectors",
    "return_freed_memory",
]

#: How far from unit length (and, row by row, from the normalised vector) a source's key may be for a cosine
#: (``normalize``) graph to read it as it is instead of holding a normalised copy: scores then differ from the
#: exactly normalised ones by at most about this much times the query's norm.
UNIT_TOLERANCE = 1e-5
#: A delta is folded into the graph once it holds more than ``max(DELTA_MIN, min(graph // DELTA_FRACTION,
#: DELTA_MAX))`` vectors: each fold copies the graph's vectors once (then shares them again), and each search scans
#: the delta exactly (at most ``DELTA_MAX`` rows, a fraction of an HNSW search's cost in a batch).
DELTA_MIN = 256
DELTA_FRACTION = 8
DELTA_MAX = 8192
#: Rows at each end of the source's keys checked for unit length when a cosine graph re-attaches the keys it read as
#: they are when it was saved, at the same source version (the same keys): a guard against another source.
UNIT_SAMPLE = 512

_malloc_trim = None  # glibc's malloc_trim once looked up (False: none)
_COMPARE_ROWS = 4096  # rows compared at a time by same_vectors: a mismatch is usually seen in the first block


def is_flat_graph(index: faiss.Index) -> bool:
    """Whether ``index`` is an ``IndexHNSWFlat`` (raw float32 vectors in an ``IndexFlat`` storage, no transform)."""
    return type(index) is faiss.IndexHNSWFlat


def view_storage(keys: Tensor, metric_code: int) -> faiss.IndexFlat | None:
    """An ``IndexFlat`` whose vectors are ``keys``'s own memory (a view: nothing copied), or None where it cannot be.

    Args:
        keys: (n, dim) float32, contiguous, on the CPU. The caller keeps a reference to it for as long as FAISS may
            read the storage, and never adds to, resets or removes from the storage (FAISS aborts on a view).
        metric_code: FAISS's metric (``faiss.METRIC_INNER_PRODUCT`` or ``faiss.METRIC_L2``).

    Returns:
        The storage with ``ntotal = n``; None for a tensor on another device, of another dtype, not contiguous or
        empty.
    """
    if keys.device.type != "cpu" or keys.dtype != torch.float32 or keys.dim() != 2 or not keys.is_contiguous():
        return None
    n, dim = keys.shape
    if n == 0:
        return None
    storage = faiss.IndexFlat(dim, metric_code)
    owner = faiss.MaybeOwnedVectorUInt8().owner  # an empty owner: the tensor's memory is kept alive by the caller
    address = faiss.cast_integer_to_uint8_ptr(keys.data_ptr())
    storage.codes = faiss.MaybeOwnedVectorUInt8.create_view(address, n * dim * 4, owner)
    storage.ntotal = n
    return storage


def owned_storage(vectors: np.ndarray, metric_code: int) -> faiss.IndexFlat:
    """An ``IndexFlat`` holding a copy of ``vectors`` (n, dim) float32."""
    storage = faiss.IndexFlat(vectors.shape[1], metric_code)
    storage.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return storage


def set_storage(graph: faiss.IndexHNSW, storage: faiss.Index | None) -> None:
    """Make ``storage`` the graph's storage (None: none), freeing the one the graph owned.

    The graph no longer owns its storage afterwards: the caller keeps ``storage`` alive as long as the graph.
    """
    old = graph.storage
    owned = bool(graph.own_fields)
    graph.own_fields = False
    graph.storage = storage
    if old is not None and owned:
        old.thisown = True  # this proxy now deletes the old storage (and its vectors) when it goes
        del old
        return_freed_memory()


def return_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    Once a process has freed a large block, glibc raises its mmap threshold (up to 32 MiB) and serves later large
    blocks from the heap, which keeps them in the resident set after they are freed: a freed storage copy would
    still count, though unused (a storage copy just dropped, a file's bytes just deserialised).
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


def storage_vectors(graph: faiss.IndexHNSW) -> np.ndarray:
    """The graph's stored vectors as a (ntotal, dim) float32 numpy view of its flat storage (no copy)."""
    storage = faiss.downcast_index(graph.storage)
    n, dim = int(storage.ntotal), int(storage.d)
    if n == 0:
        return np.empty((0, dim), dtype=np.float32)
    return faiss.rev_swig_ptr(storage.codes.data(), n * dim * 4).view(np.float32).reshape(n, dim)


def same_vectors(a: np.ndarray, b: np.ndarray, tolerance: float) -> bool:
    """Whether (n, dim) ``a`` and ``b`` are equal (within ``tolerance`` per value; 0: bit for bit), block by block."""
    if a.shape != b.shape:
        return False
    for start in range(0, len(a), _COMPARE_ROWS):
        x, y = a[start : start + _COMPARE_ROWS], b[start : start + _COMPARE_ROWS]  # (block, dim) each
        if tolerance == 0:
            if not np.array_equal(x, y):
                return False
        elif not np.abs(x - y).max(initial=0.0) <= tolerance:
            return False
    return True


def is_unit(keys: Tensor, *, sample: bool = False) -> bool:
    """Whether every row of ``keys`` (n, dim) has length 1 within :data:`UNIT_TOLERANCE` (with ``sample``: the first
    and the last :data:`UNIT_SAMPLE` rows; contiguous rows: few pages of a mapping touched)."""
    if len(keys) == 0:
        return True
    if sample and len(keys) > 2 * UNIT_SAMPLE:
        keys = torch.cat([keys[:UNIT_SAMPLE], keys[-UNIT_SAMPLE:]])  # (2 UNIT_SAMPLE, dim)
    norms = torch.linalg.vector_norm(keys, dim=-1)  # (n,)
    return bool(((norms - 1).abs() <= UNIT_TOLERANCE).all())


def graph_blob(graph: faiss.IndexHNSW) -> np.ndarray:
    """The graph serialised without its storage's vectors (FAISS's ``IO_FLAG_SKIP_STORAGE``): a uint8 array."""
    return faiss.serialize_index(graph, faiss.IO_FLAG_SKIP_STORAGE)


def delta_bound(graph_size: int) -> int:
    """How many vectors a delta beside a graph of ``graph_size`` vectors may hold before it is folded in."""
    return max(DELTA_MIN, min(graph_size // DELTA_FRACTION, DELTA_MAX))


def delta_search(
    queries: np.ndarray, k: int, delta: np.ndarray, first_label: int, rows: np.ndarray, metric: Metric
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k over the delta's rows ``rows`` (labels ``first_label + rows``).

    Args:
        queries: (batch, dim) float32 (normalised already for cosine). delta: (m, dim) float32.
        rows: (r,) int64 rows of ``delta`` to scan. metric: ``"ip"`` or ``"l2"`` (squared distance).

    Returns:
        (batch, k) scores (NaN where none) and labels (-1 where none).
    """
    found = exact_search(
        torch.from_numpy(queries),
        torch.from_numpy(delta),
        torch.from_numpy(rows + first_label),
        k,
        metric=metric,
        rows=torch.from_numpy(rows),
    )  # (batch, k) each
    return found.scores.numpy(), found.ids.numpy()


def merge_results(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int, metric: Metric
) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of two (batch, ka) / (batch, kb) (scores, labels) results, best first; -1 labels last."""
    scores = np.concatenate([a[0], b[0]], axis=1)  # (batch, ka + kb)
    labels = np.concatenate([a[1], b[1]], axis=1)  # (batch, ka + kb)
    rank = np.where(labels >= 0, -scores if metric == "ip" else scores, np.inf)  # smaller is better
    order = np.argsort(rank, axis=1, kind="stable")[:, :k]  # (batch, k)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(labels, order, axis=1)


class GraphVectors:
    """Where the vectors of an :class:`~kvsearch.index.faiss_index.Index`'s ``IndexHNSWFlat`` graph are, and its delta.

    The graph's storage is either a view over the first rows of its source's key tensor (:attr:`shared`: FAISS
    holds no copy) or a flat storage of its own. Labels are insertion positions: the graph holds labels
    ``[0, graph.ntotal)`` and the delta (only beside a view) the labels after them, in order.

    Args:
        metric: ``"ip"`` or ``"l2"``. normalize: the graph holds unit vectors (cosine): a view only of unit keys.
    """

    def __init__(self, metric: Metric, normalize: bool) -> None:
        self.metric: Metric = metric
        self.normalize = normalize
        self.keys: Tensor | None = None  # the source's key tensor the storage views: kept alive while FAISS reads it
        self.storage: faiss.Index | None = None  # a storage attached here (the graph does not own it): kept alive
        self.delta: np.ndarray | None = None  # (m, dim) float32 vectors added since the graph was shared

    @property
    def shared(self) -> bool:
        """Whether the graph reads its vectors from the source's key tensor (a view, no copy)."""
        return self.keys is not None

    def reset(self) -> None:
        """Forget the storage and delta of a graph that is no longer used (a new one replaced it)."""
        self.keys = self.storage = self.delta = None

    def share(self, graph: faiss.Index, source: KeySource | None, labels: np.ndarray) -> bool:
        """Replace the graph's own storage by a view over its source's keys if they are the very vectors it holds.

        They are when the source's first ``graph.ntotal`` ids are the graph's labels' ids in order and its keys are
        the stored vectors (bit for bit; within :data:`UNIT_TOLERANCE` for a cosine graph, which holds normalised
        copies). Compared block by block: a mismatch costs little, a match one read of the vectors.

        Returns:
            Whether the graph now reads the source's keys (already did: True).
        """
        if self.shared:
            return True
        if self.delta is not None or source is None or not is_flat_graph(graph) or graph.storage is None:
            return False
        n = int(graph.ntotal)
        keys = source.keys
        if n == 0 or keys is None or len(keys) < n or len(source.ids) < n:
            return False
        if not np.array_equal(source.ids[:n].numpy(), labels[:n]):
            return False
        rows = keys[:n].detach()  # (n, dim)
        storage = view_storage(rows, graph.metric_type)
        if storage is None:
            return False
        if not same_vectors(storage_vectors(graph), rows.numpy(), UNIT_TOLERANCE if self.normalize else 0.0):
            return False
        set_storage(graph, storage)
        self.keys, self.storage = keys, storage
        return True

    def attach(
        self,
        graph: faiss.Index,
        graph_size: int,
        source: KeySource,
        labels: np.ndarray,
        dead: np.ndarray,
        dead_vectors: np.ndarray,
        *,
        same_keys: bool = False,
    ) -> None:
        """Give a graph loaded without vectors (:func:`graph_blob`) its storage, and the delta its vectors.

        A view over the source's keys where its first ids are the graph's labels' ids in order, none is a tombstone
        and (cosine) they are unit; otherwise a copy gathered by id from the source, tombstones' vectors from
        ``dead_vectors``. Labels past the graph are the delta: kept beside a view, added to a copy (a mapped
        graph's neighbour lists copied first: :func:`~kvsearch.index.graph_file.own_graph`).

        Args:
            graph: the loaded graph without storage, of ``graph_size`` vectors. labels: (L,) the id of each label.
            dead: (L,) bool tombstones. dead_vectors: (dead.sum(), dim) float32 their vectors, in label order.
            same_keys: the graph read these very keys when it was saved (the source is at the version it was
                then): a cosine graph checks a sample of them for unit length, not every row.

        Raises:
            CorruptDatabaseError: the parts disagree, or a live label's id is not in the source.
        """
        n, dim = int(graph.ntotal), int(graph.d)
        if not is_flat_graph(graph) or n != graph_size or n > len(labels) or len(labels) != len(dead):
            raise CorruptDatabaseError(f"it holds a graph of {n} vectors that does not match its {len(labels)} labels")
        shape = (int(dead.sum()), dim)
        if dead_vectors.shape != shape or dead_vectors.dtype != np.float32:
            raise CorruptDatabaseError(f"expected tombstone vectors of shape {shape}, got {dead_vectors.shape}")
        try:
            self._attach(graph, source, labels, dead, dead_vectors, same_keys)
        except CorruptDatabaseError:
            self.reset()
            raise
        except (RuntimeError, ValueError, IndexError) as exc:  # FAISS and numpy on inconsistent input
            self.reset()
            raise CorruptDatabaseError(f"its vectors cannot be attached: {exc}".splitlines()[0]) from None

    def _attach(
        self,
        graph: faiss.Index,
        source: KeySource,
        labels: np.ndarray,
        dead: np.ndarray,
        dead_vectors: np.ndarray,
        same_keys: bool,
    ) -> None:
        n = int(graph.ntotal)
        keys, ids = source.keys, source.ids
        dead_in_graph = int(dead[:n].sum())
        if (
            not dead_in_graph
            and keys is not None
            and len(ids) >= n
            and np.array_equal(ids[:n].numpy(), labels[:n])
            and (not self.normalize or is_unit(keys[:n], sample=same_keys))
        ):
            self.storage = view_storage(keys[:n].detach(), graph.metric_type)
            if self.storage is not None:
                self.keys = keys
        if self.storage is None:
            vectors = self._gather(source, labels[:n], dead[:n], dead_vectors[:dead_in_graph], graph.d)
            self.storage = owned_storage(vectors, graph.metric_type)
        set_storage(graph, self.storage)
        if len(labels) > n:
            vectors = self._gather(source, labels[n:], dead[n:], dead_vectors[dead_in_graph:], graph.d)
            if self.shared:
                self.delta = vectors
            else:
                own_graph(graph)  # a mapped graph cannot grow: its neighbour lists copied first
                graph.add(vectors)  # the storage is a copy: it grows

    def _gather(
        self, source: KeySource, labels: np.ndarray, dead: np.ndarray, dead_vectors: np.ndarray, dim: int
    ) -> np.ndarray:
        """(len(labels), dim) float32: the source's keys of the live labels' ids, ``dead_vectors`` for the others."""
        out = np.empty((len(labels), dim), dtype=np.float32)
        live = ~dead
        rows = source.rows_of(torch.from_numpy(np.ascontiguousarray(labels[live]))).reshape(-1).cpu()  # (a,)
        if bool((rows < 0).any()):
            raise CorruptDatabaseError("the index holds ids its source does not")
        if len(rows):
            keys = source.keys[rows.to(source.keys.device)].detach().float()  # (a, dim)
            if self.normalize:
                keys = torch.nn.functional.normalize(keys, dim=-1, eps=COSINE_EPS)  # (a, dim)
            out[live] = keys.cpu().numpy()
        out[dead] = dead_vectors
        return out

    def dead_vectors(self, graph: faiss.Index, dead: np.ndarray) -> np.ndarray:
        """(d, dim) the vectors of the tombstoned labels ``dead`` (sorted): what a graph saved without vectors keeps
        of the ids its source no longer holds (the graph still walks through them)."""
        n = int(graph.ntotal)
        parts = [storage_vectors(graph)[dead[dead < n]]]  # (d1, dim)
        if self.delta is not None:
            parts.append(self.delta[dead[dead >= n] - n])  # (d2, dim)
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    def with_delta(
        self,
        queries: np.ndarray,
        found: tuple[np.ndarray, np.ndarray],
        labels: np.ndarray,
        dead: np.ndarray,
        allowed: np.ndarray | None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The graph's (batch, k) scores and labels ``found`` merged with an exact search of the delta.

        Args:
            queries: (batch, dim) float32 as the graph got them. labels: (L,) each label's id; dead: (L,) tombstones
                (the delta's labels are the last ``len(delta)``). allowed: live ids that may come back, or None.
        """
        first = len(labels) - len(self.delta)
        keep = ~dead[first:]  # (m,)
        if allowed is not None:
            keep &= np.isin(labels[first:], allowed)
        rows = np.flatnonzero(keep)
        if not len(rows):
            return found
        k = found[1].shape[1]
        return merge_results(found, delta_search(queries, k, self.delta, first, rows, self.metric), k, self.metric)

    def add(self, vectors: np.ndarray) -> None:
        """Append (a, dim) ``vectors`` to the delta (a copy: never the caller's memory)."""
        vectors = np.array(vectors, dtype=np.float32, copy=True)  # (a, dim)
        self.delta = vectors if self.delta is None else np.concatenate([self.delta, vectors])

    def fold(self, graph: faiss.Index) -> None:
        """Add the delta to the graph: its vectors are copied into a storage of its own first (a view cannot grow),
        and a mapped graph's neighbour lists too."""
        own = owned_storage(storage_vectors(graph), graph.metric_type)  # (n, dim) copied
        set_storage(graph, own)
        self.keys, self.storage = None, own
        delta, self.delta = self.delta, None
        if delta is not None:
            own_graph(graph)  # a mapped graph cannot grow either
            graph.add(delta)
