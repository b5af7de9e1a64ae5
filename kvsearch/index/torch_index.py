"""Exact candidate search in torch: chunked matmul + top-k merge over the store's key tensor, on its device.

This module owns :class:`TorchIndex`, an implementation of :class:`kvsearch.index.base.CandidateIndex`.
:func:`kvsearch.index.factory.make_index` makes one from the spec ``"Flat"`` (the default
index: its path picked per call) or ``"torch"``, ``"torch:float16"``, ``"torch:bfloat16"`` (a fixed path); every
other spec makes a FAISS index (:mod:`kvsearch.index.faiss_index`). It knows nothing of SQLite, text or autograd (no
search takes a gradient). It is exact, like FAISS's ``Flat``, but:

- bound to a *source* (the store's :class:`~kvsearch.storage.table.VectorTable`), it searches that key tensor: no
  second copy of the keys, no CPU round trip on a GPU (results are made on the keys' device and moved to the queries'
  device only if it differs). It keeps only one (n,) vector beside it: the inverse key norms for cosine, the
  squared key norms for L2. ``build`` / ``add`` / ``remove`` / ``rebuild`` only mark that vector stale;
- with ``dtype="bfloat16"`` or ``"float16"`` it also keeps a half-size copy of the keys and scans that (half the
  memory read, and on CPUs with bf16 dot-product instructions twice the arithmetic rate), then rescores the best
  ``2k + 48`` candidates of each query exactly in float32 and *checks* the result: a half-precision score is
  within a proven bound ``E`` (:meth:`TorchIndex.half_error_bound`) of the exact one, so when the k-th exact
  score beats the best score left out plus ``E``, nothing left out can belong to the top k. A query that fails
  the check (near-duplicate keys) is rescored again with a wider k' (at least 2,048 candidates), and only one
  that fails that too is searched again in float32. The ids are therefore those of the float32 search, at
  half-precision speed (:attr:`TorchIndex.last_widened`, :attr:`TorchIndex.last_rechecked` count them);
- made from the spec ``"Flat"`` (``dtype="auto"``) it picks the path of each CPU call -- float32 scan or
  half-precision scan + exact rescoring -- from the batch size and timings of its own recent calls
  (:mod:`kvsearch.index.exact_path`); the half copy is made at the first call that takes it. Over keys that processes
  share (``source.keys_shared``) it stays float32 (a half copy would be each process's own; spec ``"torch:bfloat16"``);
- every path returns the same ids and scores: keys whose scores tie are ordered by id (smaller first); the
  :class:`~kvsearch.index.topk.SearchResult` says which path it took, and with a source the rows of its ids in the
  source's key tensor. On a GPU a search reads nothing back to the host (no host-device sync,
  :func:`~kvsearch.nn.precision.host_reads`): float32 unless a path is forced, and the ties are ordered by id among
  the best ``k + 8`` (where more than 8 keys tie exactly with the k-th score, ``torch.topk`` picks which come back);
- without a source (standalone) it holds the vectors given to ``build`` / ``add`` itself.

Scores are computed a chunk of keys at a time by :func:`kvsearch.index.topk.chunked_topk` (memory O(batch x chunk)),
in torch on every device. FAISS's exhaustive search (``faiss.knn``) over the same key memory runs only when forced
(``KVSEARCH_EXACT_PATH=faiss``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import faiss
import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import COSINE_EPS, check_k
from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.index.exact_path import PathChooser, forced_path
from kvsearch.index.faiss_spec import check_search_param, tune_faiss
from kvsearch.index.half_scan import half_candidates, half_error, half_keys
from kvsearch.index.topk import (
    EXACT_FILTER_MAX,
    SCAN_CHUNK_ELEMENTS,
    KeySource,
    Metric,
    SearchResult,
    best_by_score_then_id,
    best_of_sorted,
    check_allowed,
    check_ids,
    check_index_args,
    check_pairs,
    check_queries,
    chunked_topk,
    settled,
)
from kvsearch.index.topk import no_result as _nothing
from kvsearch.nn.precision import host_reads
from kvsearch.storage.buffers import RowWindow

__all__ = ["TorchIndex", "DerivedKeys", "KeySource", "TORCH_DTYPES"]

#: Key storage dtypes a TorchIndex accepts, by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

#: Extra candidates a half-precision scan keeps for the exact rescoring: k' = 2k + _HALF_EXTRA.
_HALF_EXTRA = 48
#: The wider k' (at least) for the queries the first k' did not settle (near-duplicate keys): rescoring a few
#: thousand candidates costs far less than searching the query again in float32.
_HALF_WIDE = 2048
#: Extra rows a float32 / FAISS scan keeps so that keys tied with the k-th can be ordered by id.
_TIE_EXTRA = 8
#: The most queries :meth:`TorchIndex._direct_top` scans as one product: above, the chunked scan's merge was as fast
#: or faster (20,480 x 64 keys, 2 cores: 1 query 0.26 vs 0.57 ms, 64 queries 2.9 vs 3.5, 1,024 queries 60 vs 53).
_DIRECT_MAX_BATCH = 64


@dataclass
class DerivedKeys:
    """What a search reads, derived from the keys and recomputed when they change (see :meth:`TorchIndex.derived`).

    Attributes:
        ids: (n,) int64 CPU ids of the key rows.
        device_ids: the same ids on the keys' device.
        keys: (n, dim) float32 keys as stored (the source's own tensor, or the standalone vectors).
        norm_term: (n,) inverse norms (cosine over a source's raw keys) or squared norms (l2), else None.
        half: (n, dim) half-precision copy of the keys as scored (unit rows for cosine), or None.
        half_max_norm: the largest row norm of ``half`` (bounds the rounding error of a half score).
        half_max_abs: the largest element magnitude of ``half`` (float16 overflow check).
    """

    ids: Tensor
    device_ids: Tensor
    keys: Tensor
    norm_term: Tensor | None = None
    half: Tensor | None = None
    half_max_norm: float = 0.0
    half_max_abs: float = 0.0


class TorchIndex:
    """Exact top-k search in torch over a store's key tensor (or over vectors it is given).

    Implements :class:`kvsearch.index.base.CandidateIndex`.

    Args:
        dim: key dimension.
        metric: ``"ip"`` (inner product, larger is better) or ``"l2"`` (squared distance, smaller is better).
        source: the store (:class:`~kvsearch.index.topk.KeySource`): the index searches its ``keys`` under its ``ids``.
            Without one, the index holds the vectors passed to ``build`` / ``add``.
        normalize: score unit keys and unit queries (cosine); both are normalised here. With a source this costs
            an (n,) vector of inverse norms, not a normalised copy.
        dtype: ``"float32"``, or ``"bfloat16"`` / ``"float16"`` to also keep a half-precision copy that is
            scanned first; the results stay those of the float32 search (checked per query, see above); or
            ``"auto"`` (spec ``"Flat"``): the path is chosen per call (:mod:`kvsearch.index.exact_path`).
        chunk_elements: how many scores (batch x chunk) are computed at once.

    Raises:
        InvalidArgumentError: ``dim`` or ``chunk_elements`` is not a positive integer, or ``normalize`` with
            metric ``"l2"``.
        UnknownOptionError: an unknown metric or dtype.
    """

    def __init__(
        self,
        dim: int,
        metric: Metric = "ip",
        *,
        source: KeySource | None = None,
        normalize: bool = False,
        dtype: str | torch.dtype = "float32",
        chunk_elements: int = SCAN_CHUNK_ELEMENTS,
    ) -> None:
        check_index_args(dim, metric, normalize)
        auto = dtype == "auto"
        if auto:
            dtype = "float32"
        if isinstance(dtype, str):
            if dtype not in TORCH_DTYPES:
                raise UnknownOptionError(f"expected dtype among {tuple(TORCH_DTYPES)}, got {dtype!r}")
            dtype = TORCH_DTYPES[dtype]
        if dtype not in TORCH_DTYPES.values():
            raise UnknownOptionError(f"expected dtype among {tuple(TORCH_DTYPES)}, got {dtype!r}")
        if not isinstance(chunk_elements, int) or isinstance(chunk_elements, bool) or chunk_elements < 1:
            raise InvalidArgumentError(f"expected a positive integer chunk_elements, got {chunk_elements!r}")
        self.dim = dim
        self.metric: Metric = metric
        self.normalize = bool(normalize)
        #: The keys' scan dtype, or None for ``"auto"`` (the ``"Flat"`` spec: chosen per call).
        self.dtype: torch.dtype | None = None if auto else dtype
        self.chunk_elements = chunk_elements
        self.source = source
        self.spec = "torch" if dtype == torch.float32 else f"torch:{str(dtype).removeprefix('torch.')}"
        if auto:
            self.spec = "Flat"
        self.params: dict[str, int] = {}
        self.exact_filter_max = EXACT_FILTER_MAX
        self.min_train = 0
        self.removable = True
        #: Queries of the last half-precision search whose first k' the bound did not settle (rescored wider).
        self.last_widened = 0
        #: Queries of the last half-precision search that the wider k' did not settle either: searched in float32.
        self.last_rechecked = 0
        self._half_width = 0  # the k' that settled near-duplicate data last time (speed only)
        #: Times this index's own calls to pick the path of a ``"Flat"`` search (see ``exact_path``).
        self.paths = PathChooser()
        # Standalone storage (no source): ids (n,) int64 CPU, vectors (n, dim) float32.
        self._ids = torch.empty(0, dtype=torch.long)
        self._vectors = torch.empty(0, dim)
        # Derived from the keys, recomputed when the tag (what the keys were) changes.
        self._tag: Any = None
        self._derived: DerivedKeys | None = None
        # Whether only add() was called since the last derive: the rows derived then are still the first rows.
        self._only_appended = False
        self._front = 0  # of the rows derived, how many of the oldest remove() dropped since (a memory at capacity)
        self._windows: dict[str, RowWindow] = {}  # what derived rows are views of: appended to, dropped from in front

    # ------------------------------------------------------------------ state

    @property
    def ntotal(self) -> int:
        """The number of searchable vectors."""
        return len(self._raw()[0])

    @property
    def is_fallback(self) -> bool:
        """Always False: an exact index needs no training."""
        return False

    @property
    def exact_scores(self) -> bool:
        """Always True: every path returns float32 scores of the keys as stored (a half scan is rescored)."""
        return True

    @property
    def needs_rebuild(self) -> bool:
        """Always False: removal is exact, nothing accumulates."""
        return False

    @property
    def persisted(self) -> bool:
        """Always False: a torch index is derived from its keys as fast as a file could be read."""
        return False

    @property
    def search_params(self) -> dict[str, int]:
        """Always empty: exact search has no search parameters."""
        return {}

    def ids(self) -> Tensor:
        """The live ids, sorted: (n,) int64 on the CPU."""
        ids = self._raw()[0]  # (n,)
        return ids.clone() if self.source is not None else torch.sort(ids).values  # a source's ids are sorted

    # ------------------------------------------------------------------ writing

    def build(self, ids: Tensor, keys: Tensor) -> None:
        """Replace the content with raw ``keys`` (n, dim) under ``ids`` (n,); with a source, just mark it stale.

        Raises:
            InvalidArgumentError: not tensors.
            DimensionMismatchError: keys are not (n, dim) or ids not (n,).
        """
        ids, keys = self._check(ids, keys)  # (n,), (n, dim)
        self._tag = None
        self._only_appended = False
        if self.source is None:
            self._ids = ids
            self._vectors = keys.contiguous()

    def add(self, ids: Tensor, keys: Tensor) -> None:
        """Add raw ``keys`` (n, dim) under new ``ids`` (n,); with a source, just mark it stale.

        Raises:
            InvalidArgumentError: not tensors.
            DimensionMismatchError: keys are not (n, dim) or ids not (n,).
        """
        ids, keys = self._check(ids, keys)  # (n,), (n, dim)
        self._tag = None
        if self.source is None and len(ids):
            device = self._vectors.device if len(self._vectors) else keys.device
            self._ids = torch.cat([self._ids, ids])  # (n',)
            self._vectors = torch.cat([self._vectors.to(device), keys.to(device)])  # (n', dim)

    def remove(self, ids: Tensor) -> None:
        """Remove ``ids`` (absent ones are ignored); with a source, just mark it stale.

        Raises:
            InvalidArgumentError: ``ids`` is not an integer tensor.
        """
        ids = check_ids(ids)  # (r,)
        self._tag = None
        d, front, r = self._derived, self._front, len(ids)
        if self.source is not None and self._only_appended and d is not None and 0 < r <= len(d.ids) - front:
            if torch.equal(torch.sort(ids).values, d.ids[front : front + r]):  # the oldest rows derived: O(r)
                self._front = front + r  # derived() drops their rows in front, derives nothing again
                return
        self._only_appended = self._only_appended and not r
        if self.source is None and len(ids) and len(self._ids):
            keep = ~torch.isin(self._ids, ids)  # (n,)
            self._ids = self._ids[keep]
            self._vectors = self._vectors[keep.to(self._vectors.device)]

    def rebuild(self) -> None:
        """Take the source's keys as they are now: only marks the derived parts (norms, half copy) stale, the next
        search recomputes them.

        Raises:
            InvalidArgumentError: the index has no source (a standalone index is replaced with :meth:`build`).
        """
        if self.source is None:
            raise InvalidArgumentError("rebuild() reads the index's source, and this index has none: use build()")
        self._tag = None
        self._only_appended = False

    def set_params(self, **params: float) -> None:
        """Exact search has no search parameters.

        Raises:
            InvalidArgumentError: a known parameter with a bad value (checked first, as a FAISS index does).
            UnknownOptionError: any parameter is given.
        """
        for name, value in params.items():
            check_search_param(name, value)  # a bad name or value says so first, as a FAISS index does
        if params:
            raise UnknownOptionError(
                f"expected no search parameters, got {sorted(params)}: a search parameter does not apply to the "
                f"exact index {self.spec!r}"
            )

    def save(self, path: str | os.PathLike[str]) -> None:
        """A torch index is never saved (:attr:`persisted` is False): make it again from its source.

        Raises:
            InvalidArgumentError: always.
        """
        raise InvalidArgumentError(
            f"a {self.spec!r} index is not saved (persisted is False): it is rebuilt from its keys, got path {path}"
        )

    # ------------------------------------------------------------------ reading

    @torch.no_grad()
    def search(self, queries: Tensor, k: int, *, allowed: Tensor | None = None, checked: bool = False) -> SearchResult:
        """The ``k`` best ids for each query, exactly.

        Args:
            queries: (batch, dim) raw float queries on any device (normalised here for a ``normalize`` index).
            k: candidates per query, 1 <= k <= MAX_K. Where fewer vectors exist, ids are -1.
            allowed: (m,) int64 ids (sorted, any device): only these may come back; every query gets
                ``min(k, live allowed ids)``. At most ``max(8 k, exact_filter_max)`` live ids: their rows are
                gathered and scanned in float32; more: the whole key tensor is scanned with a mask.
            checked: the caller has checked the arguments (see :meth:`kvsearch.index.base.CandidateIndex.search`):
                nothing is checked again.

        Returns:
            :class:`~kvsearch.index.topk.SearchResult` on ``queries.device`` (computed on the keys' device): inner
            product, or squared L2 distance, NaN where ids are -1; with a source and k rows found, their ``rows`` in
            its key tensor; the ``path`` the scan took.

        Raises:
            InvalidArgumentError: k is out of range, or queries are not a tensor.
            DimensionMismatchError: queries are not (batch, dim).
        """
        if not checked:
            k = check_k(k)
            check_queries(queries, self.dim)
            allowed = None if allowed is None else check_allowed(allowed)
        d = self.derived()
        batch, n = queries.shape[0], len(d.ids)
        device = d.keys.device
        q = queries.detach().to(device, torch.float32)  # (batch, dim)
        if self.normalize:
            # F.normalize's very arithmetic (equal bits), without its Python path through torch.norm (~5 us a call)
            q = q / torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min(COSINE_EPS)  # (batch, dim)
        self.last_rechecked = self.last_widened = 0
        if n == 0 or batch == 0:
            return self._on(_nothing(batch, k, device), queries.device)
        keep = None
        if allowed is not None:
            rows = self._rows_of(d, allowed)  # (m,) CPU rows of the live allowed ids
            if len(rows) <= max(8 * k, self.exact_filter_max):  # few: score exactly those rows, all of them
                return self._search_rows(q, d, rows, k, queries.device)
            keep = torch.zeros(n, dtype=torch.bool, device=device).index_fill_(0, rows.to(device), True)  # (n,)
        vals, found, path, complete = self._top(q, d, min(k, n), keep)  # (batch, take) each
        return self._finish(q, d, vals, found, k, queries.device, path, complete=complete)

    def _search_rows(self, q: Tensor, d: DerivedKeys, rows: Tensor, k: int, device: torch.device) -> SearchResult:
        """The exact top ``k`` among the key ``rows`` (m,) (CPU, ascending) of a small admitted set, scanned whole in
        float32 (every query gets ``min(k, m)``), on ``device``."""
        take = min(k, len(rows))
        if take == 0:
            return self._on(_nothing(q.shape[0], k, d.keys.device, path="float32"), device)
        rows = rows.to(d.keys.device)  # (m,)
        vals, pos = chunked_topk(
            q,
            d.keys,
            len(rows),
            metric=self.metric,
            rows=rows,
            norm_term=d.norm_term,
            chunk_elements=self.chunk_elements,
        )  # (batch, m) each
        found = rows[pos.clamp(min=0)].masked_fill(pos < 0, -1)  # (batch, m) key rows
        vals, found = best_by_score_then_id(vals, found, d.device_ids, take)  # (batch, take) each
        return self._finish(q, d, vals, found, k, device, "float32")

    def _finish(
        self,
        q: Tensor,
        d: DerivedKeys,
        vals: Tensor,
        rows: Tensor,
        k: int,
        device: torch.device,
        path: str,
        *,
        complete: bool = False,
    ) -> SearchResult:
        """Scores (l2: distances) and ids (batch, k) of the top rows (batch, take), padded past take, on ``device``;
        with a source and ``take == k``, the rows themselves (batch, k) (its reader gathers by them, no id lookup).
        ``complete``: no row is -1 (nothing to mask)."""
        take = vals.shape[1]
        if self.metric == "l2":
            q_sq = q.pow(2).sum(-1, keepdim=True)  # (batch, 1)
            vals = (q_sq - vals).clamp_(min=0)  # (batch, take): |q|^2 - (2 q.k - |k|^2); -inf -> inf
        if complete:
            scores = vals  # (batch, take)
            ids = d.device_ids.index_select(0, rows.reshape(-1)).view(rows.shape)  # (batch, take)
        else:
            missing = rows < 0  # (batch, take) filtered out or absent
            scores = vals.masked_fill(missing, math.nan)  # (batch, take)
            ids = d.device_ids[rows.clamp(min=0)].masked_fill(missing, -1)  # (batch, take)
        if take == k:
            return self._on(SearchResult(scores, ids, rows if self.source is not None else None, path), device)
        out = _nothing(len(ids), k, ids.device, path=path)  # (batch, k) each: NaN / -1 beyond take
        out.scores[:, :take], out.ids[:, :take] = scores, ids
        return self._on(out, device)

    def half_error_bound(self, queries: Tensor) -> Tensor:
        """A proven bound (batch,) on |half-precision score - float32 score| of any key, for each query (the
        derivation: :func:`~kvsearch.index.half_scan.half_error`).

        Args:
            queries: (batch, dim) raw queries, as given to :meth:`search` (normalised here for cosine).

        Returns:
            (batch,) float32 on the keys' device.

        Raises:
            InvalidArgumentError: a float32 index (it keeps no half copy).
            DimensionMismatchError: queries are not (batch, dim).
        """
        check_queries(queries, self.dim)
        d = self.derived()
        if self.dtype in (None, torch.float32):
            raise InvalidArgumentError(
                f"expected a half-precision index ('torch:float16', 'torch:bfloat16'), got {self.spec!r}"
            )
        q = queries.detach().to(d.keys.device, torch.float32)  # (batch, dim)
        if self.normalize:
            q = F.normalize(q, dim=-1, eps=COSINE_EPS)  # (batch, dim)
        _, max_norm, max_abs = self._half_copy(d, self.dtype)
        return half_error(q, self.dtype, max_norm, max_abs, self.metric)

    def derived(self) -> DerivedKeys:
        """The keys a search reads and what is derived from them (norm term, half copy), brought up to date:
        recomputed when the keys changed (another tensor, shape or source version) or were marked stale; when
        rows were only appended since (add() alone, the same ids first) or the oldest rows removed (a memory at
        capacity), the new rows only: O(rows added or removed), amortised (:meth:`_appended`)."""
        ids, keys = self._raw()
        if self.source is None:
            tag: Any = ("own", id(ids), id(keys), keys.data_ptr(), tuple(keys.shape))
        else:
            tag = ("source", self.source.version, id(ids), id(keys), keys.data_ptr(), tuple(keys.shape))
        if tag != self._tag or self._derived is None:
            grown = self._appended(self._derived, ids, keys) if self._only_appended else None
            self._derived = self._derive(ids, keys) if grown is None else grown
            self._tag, self._front = tag, 0
            self._only_appended = True
            if self.dtype is not None and self.dtype != torch.float32:  # a fixed half spec: its copy up front
                self._half_copy(self._derived, self.dtype)
        return self._derived

    # ------------------------------------------------------------------ the scans

    def _path(self, batch: int, device: torch.device, d: DerivedKeys, filtered: bool) -> tuple[str, bool]:
        """The path of this call, and whether it is timed for the chooser: the spec's dtype; for ``"Flat"`` float32
        over keys other processes share (a half copy would be this process's own 0.5x of them), float32 where there
        is nothing to choose (a few queries, no fast half type) and on a GPU (timing a call would wait for the
        device: a host sync in every step of a model), unless a path is forced; else the pick of
        :class:`~kvsearch.index.exact_path.PathChooser`, timed."""
        if self.dtype is not None:
            return str(self.dtype).removeprefix("torch."), False
        if not self._chooses():
            return "float32", False
        timed = device.type == "cpu" and PathChooser.times(batch, device)
        if not timed and forced_path() == "auto":
            return "float32", False
        faiss_ok = self.metric == "ip" and d.norm_term is None and not filtered and d.keys.is_contiguous()
        return self.paths.choose(batch, len(d.ids), device, faiss_ok=faiss_ok), timed

    def _chooses(self) -> bool:
        """Whether the path chooser picks this index's paths: a ``"Flat"`` index over keys of its own."""
        return self.dtype is None and not getattr(self.source, "keys_shared", False)

    def _top(self, q: Tensor, d: DerivedKeys, take: int, keep: Tensor | None) -> tuple[Tensor, Tensor, str, bool]:
        """The exact top ``take`` rows of every query, ties by id: values (batch, take) (maximised: ip, or
        2 q.k - |k|^2; -inf where absent) and rows (batch, take) (-1 there), on the keys' path of this call, that
        path, and whether every row is present (the direct scan's)."""
        batch, n = q.shape[0], len(d.ids)
        path, timed = self._path(batch, q.device, d, keep is not None)
        chosen, timed = path, timed and keep is None
        started = time.perf_counter() if timed else 0.0
        if path in ("bfloat16", "float16"):
            vals, rows, todo = self._top_half(q, d, take, keep, TORCH_DTYPES[path])
            path = "float32"
        elif path == "float32" and not host_reads(q.device):  # a GPU: nothing waits for the device
            vals, rows = self._device_top(q, d, take, keep)  # (batch, take) each
            return vals, rows, chosen, False
        elif path == "float32" and keep is None and (direct := self._direct_top(q, d, take)) is not None:
            if timed:
                self.paths.record(batch, n, chosen, time.perf_counter() - started)
            return direct[0], direct[1], chosen, True  # (batch, take) each, every row present
        else:  # the whole batch at once first (no indexing): it almost always settles
            vals, rows, ok = self._scan_top(q, d, min(n, take + _TIE_EXTRA), keep, path, take)  # (batch, take) each
            todo = None if ok is None else ~ok  # (batch,)
        width = min(n, 8 * (take + _TIE_EXTRA))
        while todo is not None and todo.any():  # widened until the take-th value is above everything left out
            at = todo.nonzero().squeeze(1)  # (r,)
            v, r, ok = self._scan_top(q[at], d, width, keep, path, take)  # (r, take) each, (r,) or None
            ok = torch.ones_like(at, dtype=torch.bool) if ok is None else ok  # (r,)
            vals[at[ok]], rows[at[ok]] = v[ok], r[ok]
            todo[at[ok]] = False
            width = min(n, 8 * width)
        if timed:  # a CPU call: the time is the call's
            self.paths.record(batch, n, chosen, time.perf_counter() - started)
        return vals, rows, chosen, False

    def _device_top(self, q: Tensor, d: DerivedKeys, take: int, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """The float32 scan where nothing is read back to the host (a GPU): the best ``take + 8``, ordered by score
        then id; values and rows (batch, take), -inf / -1 where absent (see the module docstring on ties)."""
        v, r = self._scan32(q, d, min(len(d.ids), take + _TIE_EXTRA), keep, "float32")  # (batch, width) each
        return best_by_score_then_id(v, r, d.device_ids, take)  # (batch, take) each

    def _direct_top(self, q: Tensor, d: DerivedKeys, take: int) -> tuple[Tensor, Tensor] | None:
        """An unfiltered float32 scan of a few queries (at most ``_DIRECT_MAX_BATCH``) that fits one chunk, as bare
        torch runs it: one product and one top-k of ``take + 1`` (the same values as
        :func:`~kvsearch.index.topk.chunked_topk`'s single chunk); values and rows (batch, take), or None where equal
        values among them need the id tie-break (:meth:`_scan_top` orders them)."""
        n = len(d.ids)
        if q.shape[0] > _DIRECT_MAX_BATCH or q.shape[0] * n > self.chunk_elements or d.keys.dtype != torch.float32:
            return None
        scores = q @ d.keys.T  # (batch, n)
        if self.metric == "l2":
            scores = scores.mul_(2).sub_(d.keys.pow(2).sum(-1) if d.norm_term is None else d.norm_term)  # (batch, n)
        elif d.norm_term is not None:
            scores = scores.mul_(d.norm_term)  # (batch, n)
        vals, rows = torch.topk(scores, min(n, take + 1), dim=1)  # (batch, take + 1) each, best first
        # strictly decreasing (a difference of two -inf is NaN: refused) and no -inf among the first take (a row a
        # scan counts absent); one reduction and one number read
        if not bool((vals.diff(dim=1) < 0).all()) or (n <= take and bool(torch.isneginf(vals[:, -1]).any())):
            return None
        return vals[:, :take], rows[:, :take]

    def _scan_top(
        self, q: Tensor, d: DerivedKeys, width: int, keep: Tensor | None, path: str, take: int
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The top ``take`` rows of a float32 / FAISS scan kept ``width`` wide, ties by id: values and rows (batch,
        take), and which queries (batch,) it settled -- the ``take``-th value above the best one left out (ties
        with it could not be ordered by id) -- or None where the scan kept every row."""
        v, r = self._scan32(q, d, width, keep, path)  # (batch, width) each, best first
        vals, rows = best_of_sorted(v, r, d.device_ids, take)  # (batch, take) each
        if width >= len(d.ids):
            return vals, rows, None
        left_out = torch.where(r[:, -1] < 0, -math.inf, v[:, -1])  # (batch,) -inf: nothing admissible left out
        return vals, rows, settled(v, take, left_out)

    def _top_half(
        self, q: Tensor, d: DerivedKeys, take: int, keep: Tensor | None, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The half-precision scan with exact rescoring: values and rows (batch, take) of the settled queries, and
        which queries (batch,) are left for the float32 scan (not settled, or a float16 score could overflow)."""
        batch, n = q.shape[0], len(d.ids)
        vals = torch.full((batch, take), -math.inf, device=q.device)  # (batch, take)
        rows = torch.full((batch, take), -1, dtype=torch.long, device=q.device)  # (batch, take)
        half, max_norm, max_abs = self._half_copy(d, dtype)
        bound = half_error(q, dtype, max_norm, max_abs, self.metric)  # (batch,)
        pending = torch.isfinite(bound)  # (batch,) float16 could overflow elsewhere: float32 for those
        width = min(n, max(2 * take + _HALF_EXTRA, self._half_width))  # k'
        for attempt in range(2):  # k', then once a wider k' for the queries the bound did not settle
            if not pending.any():
                break
            if attempt == 1:
                width = min(n, max(16 * (2 * take + _HALF_EXTRA), _HALF_WIDE))  # not compounded
                self.last_widened = int(pending.sum())
                self._half_width = width  # later calls on such data start wide (speed only: same ids)
            at = pending.nonzero().squeeze(1)  # (r,)
            scan_norm = d.norm_term if self.metric == "l2" else None  # cosine: the copy holds unit rows
            exact, cand, ceiling = half_candidates(
                q[at],
                d.keys,
                half,
                width,
                bound[at],
                metric=self.metric,
                norm_term=d.norm_term,
                scan_norm=scan_norm,
                keep=keep,
                chunk_elements=self.chunk_elements,
            )  # (r, width) each, (r,)
            ok = settled(exact, take, ceiling if width < n else torch.full_like(ceiling, -math.inf))  # (r,)
            v, r = best_by_score_then_id(exact, cand, d.device_ids, take)  # (r, take) each
            vals[at[ok]], rows[at[ok]] = v[ok], r[ok]
            pending[at[ok]] = False
        todo = ~torch.isfinite(bound) | pending  # (batch,)
        self.last_rechecked = int(todo.sum())
        return vals, rows, todo

    def _scan32(self, q: Tensor, d: DerivedKeys, width: int, keep: Tensor | None, path: str) -> tuple[Tensor, Tensor]:
        """Top ``width`` of the float32 scores, unordered ties: values (batch, width), rows (batch, width)."""
        if path == "faiss":
            tune_faiss()  # FAISS's default BLAS threshold would send a batch under ~334 queries to a scalar loop
            vals, rows = faiss.knn(q.contiguous().numpy(), d.keys.numpy(), width, faiss.METRIC_INNER_PRODUCT)
            return torch.from_numpy(vals), torch.from_numpy(rows)  # (batch, width) each, best first
        return chunked_topk(
            q,
            d.keys,
            width,
            metric=self.metric,
            norm_term=d.norm_term,
            keep=keep,
            chunk_elements=self.chunk_elements,
        )  # (batch, width) each

    def _half_copy(self, d: DerivedKeys, dtype: torch.dtype) -> tuple[Tensor, float, float]:
        """The half copy of the keys in ``dtype`` (made at first use: a ``"Flat"`` index keeps none until a call
        takes a half path), its largest row norm and element."""
        if d.half is None or d.half.dtype != dtype:
            unit = self.normalize and self.source is not None  # cosine over raw keys: the copy holds unit rows
            d.half, d.half_max_norm, d.half_max_abs = half_keys(d.keys, dtype, unit=unit)
        return d.half, d.half_max_norm, d.half_max_abs

    # ------------------------------------------------------------------ helpers

    def _raw(self) -> tuple[Tensor, Tensor]:
        """ids (n,) CPU and keys (n, dim) as they are now, nothing derived."""
        if self.source is None:
            return self._ids, self._vectors
        keys = self.source.keys
        return self.source.ids, (torch.empty(0, self.dim) if keys is None else keys)

    def _rows_of(self, d: DerivedKeys, allowed: Tensor) -> Tensor:
        """Rows (m,) int64 CPU, ascending, of the ids of ``allowed`` (sorted, CPU) that are live."""
        if self.source is not None:
            rows = self.source.rows_of(allowed).reshape(-1).cpu()  # (m,)
            return rows[rows >= 0]  # (m',)
        return torch.isin(d.ids, allowed).nonzero().squeeze(1)  # (m',)

    def _appended(self, before: DerivedKeys | None, ids: Tensor, keys: Tensor) -> DerivedKeys | None:
        """``before`` without the ``_front`` oldest rows remove() dropped and with the rows appended since (ids (n,),
        keys (n, dim) now), or None if the rows are not those. Only the new rows are derived (norm terms, half
        rows); the kept ones are views of :class:`~kvsearch.storage.buffers.RowWindow` buffers, not copied: O(rows
        added or dropped), amortised. Checked in O(1), by the first and last kept ids: ids are sorted, and every
        other change reaches the index through remove() or rebuild(), which make the next derive a full one."""
        front = self._front
        kept = -1 if before is None else len(before.ids) - front  # rows of ``before`` still first
        if kept < 0 or len(ids) < kept:
            return None
        if kept and (int(ids[0]) != int(before.ids[front]) or int(ids[kept - 1]) != int(before.ids[-1])):
            return None
        new = self._derive(ids[kept:], keys[kept:])  # the appended rows only (a,)
        windows = self._windows
        device_ids = ids  # (n,) the ids themselves on the CPU; on a GPU their device copy, grown
        if keys.device != ids.device:
            device_ids = windows.setdefault("ids", RowWindow()).extend(before.device_ids, new.device_ids, drop=front)
        norm_term = before.norm_term
        if norm_term is not None:
            norm_term = windows.setdefault("norm", RowWindow()).extend(norm_term, new.norm_term, drop=front)  # (n,)
        grown = DerivedKeys(ids, device_ids, keys, norm_term)
        if before.half is not None:  # the half copy follows too: its new rows, the bounds of both (upper bounds)
            half, max_norm, max_abs = self._half_copy(new, before.half.dtype)  # (a, dim)
            grown.half = windows.setdefault("half", RowWindow()).extend(before.half, half, drop=front)  # (n, dim)
            grown.half_max_norm = max(before.half_max_norm, max_norm)
            grown.half_max_abs = max(before.half_max_abs, max_abs)
        return grown

    def _derive(self, ids: Tensor, keys: Tensor) -> DerivedKeys:
        """Norm term of ``keys`` (n, dim), computed a block of rows at a time (the half copy: at first use)."""
        raw_cosine = self.normalize and self.source is not None  # standalone vectors are normalised on the way in
        device = keys.device
        # (n,) once per change, not per search; to a GPU from page-locked memory, not waited for (a plain copy of a
        # CPU tensor waits for the device: a memory's every add would sync its next search)
        device_ids = ids if device.type == "cpu" else ids.pin_memory().to(device, non_blocking=True)
        if self.metric != "l2" and not raw_cosine:  # inner product: the keys are scanned as they are
            return DerivedKeys(ids, device_ids, keys)
        parts = []
        for start in range(0, len(keys), 16_384):
            block = keys[start : start + 16_384].float()  # (c, dim)
            if raw_cosine:
                norm = torch.linalg.vector_norm(block, dim=-1)  # (c,)
                parts.append(norm.clamp(min=COSINE_EPS).reciprocal())  # (c,)
            else:  # summed squares, not a squared norm: equal rows get equal terms (exact ties stay ties)
                parts.append(block.mul(block).sum(-1))  # (c,)
        norm_term = torch.cat(parts) if parts else torch.empty(0, device=device)  # (n,)
        return DerivedKeys(ids, device_ids, keys, norm_term)

    def _check(self, ids: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """Checked ids (n,) int64 CPU and keys (n, dim) float32 (unit rows for a standalone cosine index)."""
        ids, keys = check_pairs(ids, keys, self.dim)  # (n,), (n, dim)
        if self.source is None and self.normalize:
            keys = F.normalize(keys, dim=-1, eps=COSINE_EPS)  # (n, dim)
        return ids, keys

    @staticmethod
    def _on(result: SearchResult, device: torch.device) -> SearchResult:
        """``result`` on ``device`` (moved only if it is elsewhere); its rows stay on the keys' device."""
        if result.ids.device == device:
            return result
        return SearchResult(result.scores.to(device), result.ids.to(device), result.rows, result.path)
