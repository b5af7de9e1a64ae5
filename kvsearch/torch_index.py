"""Exact search in torch: chunked matmul + top-k merge over the store's key tensor, on its device.

``TorchIndex`` has the interface of :class:`kvsearch.index.Index` that the database uses (``build``, ``add``,
``remove``, ``search``, ``ntotal``, ``needs_rebuild``, ``set_params``, ``ids``). It is exact, like FAISS's
``Flat``, but:

- bound to a *source* (the :class:`~kvsearch.store.Store`), it searches the store's own key tensor: no second
  copy of the keys, no CPU round trip on a GPU. It keeps only one (m,) vector beside it: the inverse key norms
  for cosine, the squared key norms for L2. ``build`` / ``add`` / ``remove`` only mark that vector stale;
- with ``dtype="bfloat16"`` or ``"float16"`` it also keeps a half-size copy of the keys and scans that (half the
  memory read, and on CPUs with bf16 dot-product instructions twice the arithmetic rate), then rescores the best
  ``2k + 48`` candidates of each query exactly in float32 and *checks* the result: a half-precision score is
  within a proven bound ``E`` of the exact one, so when the k-th exact score beats the best score left out
  plus ``E``, nothing left out can belong to the top k. A query that fails the check is searched again in
  float32. The ids are therefore those of the float32 search, at half-precision speed;
- without a source (standalone) it holds the vectors given to ``build`` / ``add`` itself.

Scores are computed a chunk of keys at a time, ``(batch, chunk)``. The first chunk's top-k seeds each query's
list; later chunks are compared with the list's current k-th score and only the few entries above it are merged
(what a heap does in FAISS), so top-k costs little beside the matmul and memory is O(batch x chunk).
On the CPU the float32 matmul goes through numpy's BLAS (OpenBLAS), which runs at full speed on every x86 vendor;
half precision and CUDA go through torch. A batch of at least ``FAISS_MIN_BATCH`` float32 inner-product queries on
the CPU, unfiltered, is handed to FAISS's exhaustive search (``faiss.knn``) over the same key memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, UnknownOptionError

__all__ = ["TorchIndex", "KeySource", "TORCH_DTYPES", "parse_torch_spec"]

#: Key storage dtypes a TorchIndex accepts, by name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

#: Score elements (batch x chunk) computed at once: 2^22 float32 = 16 MiB, cache-friendly for the merge.
_CHUNK_ELEMENTS = 1 << 22
#: From this many queries per call, a float32 inner-product search on the CPU without a filter runs in FAISS's
#: exhaustive kernels (``faiss.knn``, blocked sgemm + heaps) over the same key memory, no copy: its BLAS blocks
#: ran batches of 64 and 1,024 queries 1.5-2x faster here than numpy's matmul per chunk (benchmarks/RESULTS.md).
#: One query (a matrix-vector product) stays in :func:`_scan`, which reads the keys at twice FAISS's bandwidth.
FAISS_MIN_BATCH = 32
_MAX_K = 65_536
_COSINE_EPS = 1e-12
#: Unit roundoff of each half type (round to nearest): a stored value is within u * |x| of the float32 one.
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: float16 range: a score or element beyond this overflows; such queries are searched in float32.
_FP16_SAFE = 3.0e4
#: Extra candidates a half-precision scan keeps for the exact rescoring: K' = 2k + _HALF_EXTRA.
_HALF_EXTRA = 48


class KeySource(Protocol):
    """What a TorchIndex reads: the store's ids (n,) sorted int64 on the CPU and keys (n, dim) on its device."""

    ids: Tensor
    keys: Tensor | None

    @property
    def version(self) -> int:
        """A counter bumped by every committed write."""
        ...


def parse_torch_spec(spec: str) -> torch.dtype | None:
    """The key dtype of a ``"torch"`` index spec, or None when ``spec`` is not one.

    ``"torch"`` searches the float32 keys; ``"torch:bfloat16"`` and ``"torch:float16"`` scan a half-precision
    copy and rescore exactly (see the module docstring).

    Raises:
        UnknownOptionError: ``spec`` starts with ``"torch"`` but names no known dtype.
    """
    if not isinstance(spec, str) or not spec.startswith("torch"):
        return None
    if spec == "torch":
        return torch.float32
    name = spec[len("torch:") :] if spec.startswith("torch:") else None
    if name not in TORCH_DTYPES:
        raise UnknownOptionError(
            f"expected a torch index spec 'torch', 'torch:float16' or 'torch:bfloat16', got {spec!r}"
        )
    return TORCH_DTYPES[name]


@dataclass
class _Derived:
    """What a search reads, derived from the keys and rebuilt when they change.

    Attributes:
        ids: (n,) int64 CPU ids.
        keys: (n, dim) float32 keys as stored (the source's own tensor, or the standalone vectors).
        norm_term: (n,) inverse norms (cosine over a source's raw keys) or squared norms (l2), else None.
        half: (n, dim) half-precision copy of the keys as scored (unit rows for cosine), or None.
        half_max_norm: the largest row norm of ``half`` (bounds the rounding error of a half score).
        half_max_abs: the largest element magnitude of ``half`` (float16 overflow check).
    """

    ids: Tensor
    keys: Tensor
    norm_term: Tensor | None = None
    half: Tensor | None = None
    half_max_norm: float = 0.0
    half_max_abs: float = 0.0


class TorchIndex:
    """Exact top-k search in torch over a store's key tensor (or over vectors it is given).

    Args:
        dim: vector dimension.
        metric: ``"ip"`` (inner product, larger is better) or ``"l2"`` (squared distance, smaller is better).
        source: an object with ``ids`` (n,) sorted int64 and ``keys`` (n, dim) — the store. Without one, the
            index holds the vectors passed to ``build`` / ``add``.
        normalize: score against unit-normalised keys (cosine); the caller normalises the queries. With a
            source this costs an (n,) vector of inverse norms, not a normalised copy.
        dtype: ``"float32"``, or ``"bfloat16"`` / ``"float16"`` to also keep a half-precision copy that is
            scanned first; the results stay those of the float32 search (checked per query, see above).
        chunk_elements: how many scores (batch x chunk) are computed at once.

    Raises:
        InvalidArgumentError: ``dim`` or ``chunk_elements`` is not a positive integer.
        UnknownOptionError: an unknown metric or dtype.
        InvalidArgumentError: ``normalize`` with metric ``"l2"``.
    """

    def __init__(
        self,
        dim: int,
        metric: Literal["ip", "l2"] = "ip",
        *,
        source: KeySource | None = None,
        normalize: bool = False,
        dtype: str | torch.dtype = "float32",
        chunk_elements: int = _CHUNK_ELEMENTS,
    ) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise InvalidArgumentError(f"expected a positive integer dim, got {dim!r}")
        if metric not in ("ip", "l2"):
            raise UnknownOptionError(f"expected metric 'ip' or 'l2', got {metric!r}")
        if isinstance(dtype, str):
            if dtype not in TORCH_DTYPES:
                raise UnknownOptionError(f"expected dtype among {tuple(TORCH_DTYPES)}, got {dtype!r}")
            dtype = TORCH_DTYPES[dtype]
        if dtype not in TORCH_DTYPES.values():
            raise UnknownOptionError(f"expected dtype among {tuple(TORCH_DTYPES)}, got {dtype!r}")
        if not isinstance(chunk_elements, int) or isinstance(chunk_elements, bool) or chunk_elements < 1:
            raise InvalidArgumentError(f"expected a positive integer chunk_elements, got {chunk_elements!r}")
        if normalize and metric != "ip":
            raise InvalidArgumentError("normalize=True (cosine) needs metric 'ip', got metric 'l2'")
        self.dim = dim
        self.metric: Literal["ip", "l2"] = metric
        self.normalize = bool(normalize)
        self.dtype = dtype
        self.chunk_elements = chunk_elements
        self.source = source
        self.spec = "torch" if dtype == torch.float32 else f"torch:{str(dtype).removeprefix('torch.')}"
        self.params: dict[str, float] = {}
        self.min_train = 0
        self.removable = True
        #: Queries of the last half-precision search that failed the check and were searched in float32.
        self.last_rechecked = 0
        # Standalone storage (no source): ids (n,) int64 CPU, vectors (n, dim) float32.
        self._ids = torch.empty(0, dtype=torch.long)
        self._vectors = torch.empty(0, dim)
        # Derived from the keys, rebuilt when the tag (what the keys were) changes.
        self._tag: Any = None
        self._derived: _Derived | None = None

    # ------------------------------------------------------------------ state

    @property
    def ntotal(self) -> int:
        """The number of searchable vectors."""
        return len(self._current().ids)

    @property
    def is_fallback(self) -> bool:
        """Always False: an exact index needs no training."""
        return False

    @property
    def needs_rebuild(self) -> bool:
        """Always False: removal is exact, nothing accumulates."""
        return False

    def ids(self) -> np.ndarray:
        """The live ids, sorted."""
        return np.sort(self._current().ids.numpy())

    # ------------------------------------------------------------------ writing

    def build(self, ids: np.ndarray | Tensor, vectors: np.ndarray | Tensor) -> None:
        """Replace the content with ``vectors`` (n, dim) under ``ids`` (n,); with a source, just mark it stale.

        Raises:
            DimensionMismatchError: vectors are not (n, dim) or ids not (n,).
        """
        ids, vectors = self._check(ids, vectors)
        self._tag = None
        if self.source is None:
            self._ids = ids
            self._vectors = vectors.contiguous()

    def add(self, ids: np.ndarray | Tensor, vectors: np.ndarray | Tensor) -> None:
        """Add ``vectors`` (n, dim) under new ``ids`` (n,); with a source, just mark it stale.

        Raises:
            DimensionMismatchError: vectors are not (n, dim) or ids not (n,).
        """
        ids, vectors = self._check(ids, vectors)
        self._tag = None
        if self.source is None and len(ids):
            device = self._vectors.device if len(self._vectors) else vectors.device
            self._ids = torch.cat([self._ids, ids])
            self._vectors = torch.cat([self._vectors.to(device), vectors.to(device)])

    def remove(self, ids: np.ndarray | Tensor) -> None:
        """Remove ``ids`` (absent ones are ignored); with a source, just mark it stale."""
        self._tag = None
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
        if self.source is None and len(ids) and len(self._ids):
            keep = ~torch.isin(self._ids, ids)  # (n,)
            self._ids = self._ids[keep]
            self._vectors = self._vectors[keep.to(self._vectors.device)]

    def refresh(self) -> None:
        """Mark the derived parts (norms, half-precision copy) stale: the next search recomputes them."""
        self._tag = None

    def set_params(self, **params: float) -> None:
        """Exact search has no search parameters.

        Raises:
            UnknownOptionError: any parameter is given.
        """
        if params:
            raise UnknownOptionError(f"the torch exact index takes no search parameters, got {sorted(params)}")

    # ------------------------------------------------------------------ reading

    def search(
        self, queries: np.ndarray | Tensor, k: int, *, allowed: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best ids for each query, as :meth:`kvsearch.index.Index.search` returns them.

        Args:
            queries: float (batch, dim), numpy or torch.
            k: candidates per query, 1 <= k <= 65,536. Where fewer than k vectors exist, ids are -1.
            allowed: if given, only these ids may come back.

        Returns:
            scores (batch, k) float32 numpy — inner product, or squared L2 distance — NaN where ids are -1,
            and ids (batch, k) int64 numpy, best first.

        Raises:
            InvalidArgumentError: k is out of range.
            DimensionMismatchError: queries are not (batch, dim).
        """
        scores, ids = self.search_tensors(torch.as_tensor(queries), k, allowed=allowed)
        return scores.cpu().numpy(), ids.cpu().numpy()

    @torch.no_grad()
    def search_tensors(
        self, queries: Tensor, k: int, *, allowed: np.ndarray | Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Like :meth:`search`, with torch tensors on the keys' device (no CPU round trip on a GPU).

        Returns:
            scores (batch, k) float32 and ids (batch, k) int64, on the keys' device.
        """
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= _MAX_K:
            raise InvalidArgumentError(f"expected an integer k in [1, {_MAX_K}], got {k!r}")
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected queries of shape (batch, {self.dim}), got {tuple(queries.shape)}")
        d = self._current()
        batch, n, k = queries.shape[0], len(d.ids), int(k)
        device = d.keys.device
        out_scores = torch.full((batch, k), math.nan, dtype=torch.float32, device=device)  # (batch, k)
        out_ids = torch.full((batch, k), -1, dtype=torch.long, device=device)  # (batch, k)
        self.last_rechecked = 0
        if n == 0 or batch == 0:
            return out_scores, out_ids
        keep = None
        if allowed is not None:
            keep = torch.isin(d.ids, torch.as_tensor(np.asarray(allowed, dtype=np.int64))).to(device)  # (n,)
        q = queries.detach().to(device, torch.float32)  # (batch, dim)
        take = min(k, n)
        if d.half is None:
            vals, rows = self._exact_scan(q, d, take, keep)  # (batch, take) each
        else:
            vals, rows = self._half_search(q, d, take, keep)  # (batch, take) each
        if self.metric == "l2":
            q_sq = q.pow(2).sum(-1, keepdim=True)  # (batch, 1)
            vals = (q_sq - vals).clamp_(min=0)  # (batch, take): |q|^2 - (2 q.k - |k|^2); -inf -> inf
        missing = rows < 0  # (batch, take) filtered out or absent
        out_scores[:, :take] = vals.masked_fill(missing, math.nan)
        out_ids[:, :take] = d.ids.to(device)[rows.clamp(min=0)].masked_fill(missing, -1)
        return out_scores, out_ids

    # ------------------------------------------------------------------ the scans

    def _exact_scan(self, q: Tensor, d: _Derived, take: int, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """Top ``take`` of the float32 scores: values (batch, take) (maximised: ip, or 2 q.k - |k|^2), rows."""
        if (
            q.shape[0] >= FAISS_MIN_BATCH
            and q.device.type == "cpu"
            and self.metric == "ip"
            and d.norm_term is None
            and keep is None
            and d.keys.dtype == torch.float32
            and d.keys.is_contiguous()
        ):
            import faiss

            from kvsearch.index import tune_faiss

            tune_faiss()  # FAISS's default BLAS threshold would send a batch under ~334 queries to a scalar loop
            vals, rows = faiss.knn(q.contiguous().numpy(), d.keys.numpy(), take, faiss.METRIC_INNER_PRODUCT)
            return torch.from_numpy(vals), torch.from_numpy(rows)  # (batch, take) each, best first
        return _scan(q, d.keys, take, self._rows_per_chunk(q.shape[0]), d.norm_term, self.metric, keep)

    def _half_search(self, q: Tensor, d: _Derived, take: int, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """Scan the half copy for K' candidates, rescore them in float32, check the bound; redo failures exactly.

        The check, per query: every key left out scored at most ``a`` (the K'-th half-precision score kept),
        and a half-precision score is within ``E`` of the exact one, so a left-out key scores at most
        ``a + E`` exactly. If the k-th exact score among the kept candidates is above that, the kept
        candidates hold the exact top k. A query that kept every admissible key passes trivially. Queries
        with no finite bound (float16 could overflow) skip the half scan.
        """
        batch, n = q.shape[0], len(d.ids)
        bound = self._half_error(q, d)  # (batch,)
        vals = torch.full((batch, take), -math.inf, device=q.device)  # (batch, take)
        rows = torch.full((batch, take), -1, dtype=torch.long, device=q.device)  # (batch, take)
        checked = torch.zeros(batch, dtype=torch.bool, device=q.device)  # (batch,)
        safe = torch.isfinite(bound)  # (batch,)
        if safe.any():
            qs = q[safe]  # (s, dim)
            extra = min(n, 2 * take + _HALF_EXTRA)  # K'
            scan_norm = d.norm_term if self.metric == "l2" else None  # cosine: the copy holds unit rows already
            approx, cand = _scan(
                qs.to(d.half.dtype), d.half, extra, self._rows_per_chunk(qs.shape[0]), scan_norm, self.metric, keep
            )  # (s, K') float32, rows (s, K')
            # exact float32 scores of the kept candidates, computed as the float32 scan computes them
            exact = torch.einsum("bd,bkd->bk", qs, d.keys[cand.clamp(min=0)].float())  # (s, K')
            if d.norm_term is not None:
                term = d.norm_term[cand.clamp(min=0)]  # (s, K')
                exact = exact * term if self.metric == "ip" else exact.mul_(2).sub_(term)  # (s, K')
            exact = exact.masked_fill(cand < 0, -math.inf)  # (s, K')
            top, pick = torch.topk(exact, take, dim=1)  # (s, take)
            vals[safe] = top
            rows[safe] = cand.gather(1, pick).masked_fill(torch.isinf(top), -1)
            least_kept = approx[:, -1]  # (s,) -inf when fewer than K' admissible keys exist: all were kept
            checked[safe] = (cand[:, -1] < 0) | (top[:, -1] > least_kept + bound[safe])
        redo = ~checked  # (batch,)
        self.last_rechecked = int(redo.sum())
        if self.last_rechecked:
            v, r = self._exact_scan(q[redo], d, take, keep)  # (r, take)
            vals[redo], rows[redo] = v, r
        return vals, rows

    def _half_error(self, q: Tensor, d: _Derived) -> Tensor:
        """A proven bound (batch,) on |half-precision score - exact score| of any key, for each query.

        Rounding q and k to the half type moves each product q_i k_i by at most (2u + u^2) |q_i k_i|; the
        float32 accumulation by at most dim * 2^-24 * sum |q_i k_i|; rounding the half output by u |s|. With
        sum |q_i k_i| <= |q| |k| (Cauchy-Schwarz) that is at most c |q| max|k|, c = 3u + 3u^2 + 2 dim 2^-24.
        Below the type's smallest normal number ``tiny`` rounding is absolute (or a flush to zero on some
        hardware): an element smaller than ``tiny`` may be lost whole, at most tiny (1 + u) sqrt(dim) (|q| +
        max|k|) over the sum, and the output at most ``tiny``. For l2 the maximised score is
        2 q.k - |k|^2 (|k|^2 exact): twice the error. Where a float16 score or element could overflow the
        bound is infinite (the query is searched in float32).
        """
        dtype = d.half.dtype
        u, tiny = _UNIT_ROUNDOFF[dtype], float(torch.finfo(dtype).tiny)
        q_norm = q.norm(dim=1)  # (batch,)
        c = 3 * u + 3 * u * u + 2 * self.dim * 2.0**-24
        lost = tiny * (1 + u) * math.sqrt(self.dim) * (q_norm + d.half_max_norm) + tiny  # (batch,)
        bound = 1.01 * (c * q_norm * d.half_max_norm + lost)  # (batch,)
        if dtype == torch.float16:
            unsafe = (q.abs().amax(dim=1) > _FP16_SAFE) | (q_norm * d.half_max_norm > _FP16_SAFE)  # (batch,)
            unsafe |= d.half_max_abs > _FP16_SAFE
            bound = bound.masked_fill(unsafe, math.inf)
        return bound * (2.0 if self.metric == "l2" else 1.0)

    def _rows_per_chunk(self, batch: int) -> int:
        return max(1, self.chunk_elements // max(1, batch))

    # ------------------------------------------------------------------ helpers

    def _current(self) -> _Derived:
        """ids, keys, norm term and half copy; the derived parts are recomputed when the keys changed."""
        if self.source is None:
            ids, keys = self._ids, self._vectors
            tag = ("own", id(keys), keys.data_ptr(), tuple(keys.shape))
        else:
            ids = self.source.ids
            keys = self.source.keys
            if keys is None:
                keys = torch.empty(0, self.dim)
            version = getattr(self.source, "loaded_version", None)
            version = self.source.version if version is None else version
            tag = ("source", version, id(keys), keys.data_ptr(), tuple(keys.shape))
        if tag != self._tag or self._derived is None:
            self._derived = self._derive(ids, keys)
            self._tag = tag
        else:
            self._derived.ids = ids
        return self._derived

    def _derive(self, ids: Tensor, keys: Tensor) -> _Derived:
        """Norm term and half copy of ``keys`` (n, dim), computed a block of rows at a time."""
        raw_cosine = self.normalize and self.source is not None  # standalone vectors are normalised on the way in
        need_norms = self.metric == "l2" or raw_cosine
        keep_half = self.dtype != torch.float32
        norm_parts, half_parts = [], []
        max_norm, max_abs = 0.0, 0.0
        if not need_norms and not keep_half:  # float32 inner product: the keys are scanned as they are
            return _Derived(ids, keys, None, None, max_norm, max_abs)
        step = 65_536
        for start in range(0, len(keys), step):
            block = keys[start : start + step].float()  # (c, dim)
            if need_norms:
                norm = torch.linalg.vector_norm(block, dim=-1)  # (c,) without a squared copy of the block
                norm_parts.append(norm.clamp(min=_COSINE_EPS).reciprocal() if raw_cosine else norm.square())  # (c,)
            if keep_half:
                scored = F.normalize(block, dim=-1, eps=_COSINE_EPS) if raw_cosine else block  # (c, dim)
                half = scored.to(self.dtype)  # (c, dim)
                half_parts.append(half)
                as_float = half.float()  # (c, dim)
                max_norm = max(max_norm, float(as_float.norm(dim=-1).max()))
                max_abs = max(max_abs, float(as_float.abs().max()))
        device = keys.device
        norm_term = (torch.cat(norm_parts) if norm_parts else torch.empty(0, device=device)) if need_norms else None
        half = None
        if keep_half:
            half = torch.cat(half_parts) if half_parts else torch.empty(0, self.dim, dtype=self.dtype, device=device)
        return _Derived(ids, keys, norm_term, half, max_norm, max_abs)

    def _check(self, ids: np.ndarray | Tensor, vectors: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
        vectors = torch.as_tensor(vectors)
        if vectors.dim() != 2 or vectors.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected vectors of shape (n, {self.dim}), got {tuple(vectors.shape)}")
        if len(ids) != len(vectors):
            raise DimensionMismatchError(f"expected one id per vector, got {len(ids)} ids for {len(vectors)} vectors")
        vectors = vectors.detach().float()
        if self.source is None and self.normalize:
            vectors = F.normalize(vectors, dim=-1, eps=_COSINE_EPS)  # (n, dim)
        return ids, vectors


# ---------------------------------------------------------------------- the chunked top-k scan


def _scan(
    q: Tensor,
    keys: Tensor,
    take: int,
    rows: int,
    norm_term: Tensor | None,
    metric: str,
    keep: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """The ``take`` largest scores of ``q`` (batch, dim) against ``keys`` (n, dim), a chunk of rows at a time.

    The score is ``q.k`` (times ``norm_term`` for cosine over raw keys) for ``ip``, and ``2 q.k - norm_term``
    (= ``|q|^2 - |q - k|^2``) for ``l2``. The first chunk's top-k seeds each query's list; a later chunk only
    merges its entries above the list's current last score (usually a handful), so the selection costs little
    beside the matmul. Rows not in ``keep`` never come back.

    Returns:
        values (batch, take) float32, best first, -inf where fewer exist; rows (batch, take) int64, -1 there.
    """
    batch, n = q.shape[0], keys.shape[0]
    device = keys.device
    best_vals = torch.full((batch, take), -math.inf, dtype=torch.float32, device=device)  # (batch, take)
    best_rows = torch.full((batch, take), -1, dtype=torch.long, device=device)  # (batch, take)
    for start in range(0, n, rows):
        scores = _chunk_scores(q, keys[start : start + rows])  # (batch, c) in the keys' compute dtype
        if norm_term is not None or keep is not None or scores.dtype != torch.float32:
            scores = scores.float()  # (batch, c)
        if norm_term is not None:
            term = norm_term[start : start + rows]  # (c,)
            scores = scores.mul_(term) if metric == "ip" else scores.mul_(2).sub_(term)  # (batch, c)
        if keep is not None:
            scores = scores.masked_fill_(~keep[start : start + rows], -math.inf)  # (batch, c)
        if start == 0:
            vals, idx = torch.topk(scores, min(take, scores.shape[1]), dim=1)  # (batch, t)
            best_vals[:, : vals.shape[1]] = vals
            best_rows[:, : vals.shape[1]] = torch.where(torch.isinf(vals), -1, idx)
            continue
        hit = scores > best_vals[:, -1:]  # (batch, c): could enter the list
        row_of, col_of = hit.nonzero(as_tuple=True)  # (h,), (h,) in row-major order
        if len(row_of) == 0:
            continue
        counts = torch.bincount(row_of, minlength=batch)  # (batch,)
        width = int(counts.max())
        first = torch.cumsum(counts, 0) - counts  # (batch,) where each query's hits begin
        slot = torch.arange(len(row_of), device=device) - first[row_of]  # (h,)
        new_vals = torch.full((batch, width), -math.inf, dtype=torch.float32, device=device)  # (batch, width)
        new_rows = torch.full((batch, width), -1, dtype=torch.long, device=device)  # (batch, width)
        new_vals[row_of, slot] = scores[row_of, col_of]
        new_rows[row_of, slot] = col_of + start
        vals, pick = torch.topk(torch.cat([best_vals, new_vals], 1), take, dim=1)  # (batch, take)
        best_rows = torch.cat([best_rows, new_rows], 1).gather(1, pick)  # (batch, take)
        best_vals = vals
    return best_vals, best_rows


def _chunk_scores(q: Tensor, chunk: Tensor) -> Tensor:
    """q (batch, dim) @ chunk.T (dim, c) -> (batch, c). float32 on the CPU through numpy's BLAS.

    torch's CPU build uses MKL, which runs a slow generic code path on non-Intel CPUs (measured: a 1M x 384
    matrix-vector product 2.5x slower than OpenBLAS on an AMD EPYC); numpy's OpenBLAS picks the CPU's kernels.
    Half precision and CUDA stay in torch (oneDNN / cuBLAS).
    """
    if chunk.device.type == "cpu" and chunk.dtype == torch.float32:
        return torch.from_numpy(np.matmul(q.numpy(), chunk.numpy().T))  # (batch, c)
    return q @ chunk.T  # (batch, c)
