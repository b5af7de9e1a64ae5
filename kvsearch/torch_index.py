"""Exact search in torch: chunked matmul + top-k merge over the store's key tensor, on its device.

``TorchIndex`` has the interface of :class:`kvsearch.index.Index` that the database uses (``build``, ``add``,
``remove``, ``search``, ``ntotal``, ``needs_rebuild``, ``set_params``, ``ids``). It is exact, like FAISS's
``Flat``, but:

- bound to a *source* (the :class:`~kvsearch.store.Store`), it searches the store's own key tensor: no second
  copy of the keys, no CPU round trip on a GPU. It keeps only one (m,) vector beside it: the inverse key norms
  for cosine, the squared key norms for L2. ``build`` / ``add`` / ``remove`` only mark that vector stale;
- with ``dtype="float16"`` or ``"bfloat16"`` it keeps its own half-size copy of the keys (refreshed from the
  source when the store changes), halving the memory read per search at some precision cost;
- without a source (standalone) it holds the vectors given to ``build`` / ``add`` itself.

Scores are computed a chunk of keys at a time, ``(batch, chunk)``, each chunk's top-k is kept and the chunks'
candidates are merged with one last top-k, so memory is O(batch x chunk) whatever the number of keys.
"""

from __future__ import annotations

import math
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

#: Score elements (batch x chunk) computed at once. 2^25 float32 = 128 MiB.
_CHUNK_ELEMENTS = 1 << 25
#: Rows converted at once when the keys are stored in half precision and the CPU computes in float32.
_HALF_CHUNK_ROWS = 16_384
_MAX_K = 65_536
_COSINE_EPS = 1e-12


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

    ``"torch"`` stores float32 keys; ``"torch:float16"`` and ``"torch:bfloat16"`` half-precision copies.

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


class TorchIndex:
    """Exact top-k search in torch over a store's key tensor (or over vectors it is given).

    Args:
        dim: vector dimension.
        metric: ``"ip"`` (inner product, larger is better) or ``"l2"`` (squared distance, smaller is better).
        source: an object with ``ids`` (n,) sorted int64 and ``keys`` (n, dim) — the store. Without one, the
            index holds the vectors passed to ``build`` / ``add``.
        normalize: score against unit-normalised keys (cosine); the caller normalises the queries. With a
            source this costs an (n,) vector of inverse norms, not a normalised copy.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` key storage; a half dtype keeps its own copy.
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
        # Standalone storage (no source): ids (n,) int64 CPU, vectors (n, dim).
        self._ids = torch.empty(0, dtype=torch.long)
        self._vectors = torch.empty(0, dim, dtype=dtype)
        # Derived from the keys, rebuilt when the tag (what the keys were) changes.
        self._tag: Any = None
        self._norm_term: Tensor | None = None  # (n,) inverse norms (cosine) or squared norms (l2)
        self._half: Tensor | None = None  # (n, dim) half-precision copy of a source's keys

    # ------------------------------------------------------------------ state

    @property
    def ntotal(self) -> int:
        """The number of searchable vectors."""
        return len(self._current()[0])

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
        return np.sort(self._current()[0].numpy())

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
            self._vectors = vectors.to(self.dtype).contiguous()

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
            self._vectors = torch.cat([self._vectors.to(device), vectors.to(device, self.dtype)])

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
        ids, keys, norm_term = self._current()
        batch, n, k = queries.shape[0], len(ids), int(k)
        device = keys.device
        out_scores = torch.full((batch, k), float("nan"), dtype=torch.float32, device=device)  # (batch, k)
        out_ids = torch.full((batch, k), -1, dtype=torch.long, device=device)  # (batch, k)
        if n == 0 or batch == 0:
            return out_scores, out_ids
        keep = None
        if allowed is not None:
            keep = torch.isin(ids, torch.as_tensor(np.asarray(allowed, dtype=np.int64))).to(device)  # (n,)
        take = min(k, n)
        compute = keys.dtype if keys.device.type != "cpu" else torch.float32
        q = queries.detach().to(device, compute)  # (batch, dim)
        rows = max(1, self.chunk_elements // batch)
        if keys.dtype != compute:
            rows = min(rows, _HALF_CHUNK_ROWS)  # converted chunks stay cache-sized
        best_vals, best_rows = [], []
        for start in range(0, n, rows):
            chunk = keys[start : start + rows]  # (c, dim)
            if chunk.dtype != compute:
                chunk = chunk.to(compute)  # (c, dim)
            scores = q @ chunk.T  # (batch, c)
            if norm_term is not None:
                term = norm_term[start : start + rows].to(compute)  # (c,)
                scores = scores * term if self.metric == "ip" else scores.mul_(2).sub_(term)  # (batch, c)
            if keep is not None:
                scores = scores.masked_fill(~keep[start : start + rows], -math.inf)  # (batch, c)
            vals, idx = torch.topk(scores, min(take, scores.shape[1]), dim=1)  # (batch, t), (batch, t)
            best_vals.append(vals.float())
            best_rows.append(idx + start)
        vals, rows_ = torch.cat(best_vals, 1), torch.cat(best_rows, 1)  # (batch, t_total)
        if vals.shape[1] > take:
            vals, pick = torch.topk(vals, take, dim=1)  # (batch, take)
            rows_ = rows_.gather(1, pick)  # (batch, take)
        if self.metric == "l2":
            q_sq = q.float().pow(2).sum(-1, keepdim=True)  # (batch, 1)
            vals = (q_sq - vals).clamp_(min=0)  # (batch, take): |q|^2 - (2 q.k - |k|^2); -inf -> inf
        missing = torch.isinf(vals)  # (batch, take) filtered out
        out_scores[:, :take] = vals.masked_fill(missing, math.nan)
        out_ids[:, :take] = ids.to(device)[rows_].masked_fill(missing, -1)
        return out_scores, out_ids

    # ------------------------------------------------------------------ helpers

    def _current(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """ids (n,), keys (n, dim) as searched, and the (n,) norm term; derived parts refreshed when stale."""
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
        if tag != self._tag:
            self._refresh(keys)
            self._tag = tag
        if self.source is not None and self.dtype != keys.dtype:
            keys = self._half
        return ids, keys, self._norm_term

    def _refresh(self, keys: Tensor) -> None:
        self._half = None
        if self.source is not None and keys.dtype != self.dtype:
            self._half = keys.to(self.dtype).contiguous()  # (n, dim)
        self._norm_term = None
        if self.metric == "ip" and (not self.normalize or self.source is None):
            return  # plain inner product, or standalone cosine whose vectors were normalised on the way in
        step = _HALF_CHUNK_ROWS * 4
        parts = []
        for start in range(0, len(keys), step):
            sq = keys[start : start + step].float().pow(2).sum(-1)  # (c,)
            if self.normalize:
                parts.append(sq.sqrt().clamp(min=_COSINE_EPS).reciprocal())  # (c,) as F.normalize divides
            else:
                parts.append(sq)  # (c,)
        self._norm_term = torch.cat(parts) if parts else torch.empty(0, device=keys.device)  # (n,)

    def _check(self, ids: np.ndarray | Tensor, vectors: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(-1))
        vectors = torch.as_tensor(vectors)
        if vectors.dim() != 2 or vectors.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected vectors of shape (n, {self.dim}), got {tuple(vectors.shape)}")
        if len(ids) != len(vectors):
            raise DimensionMismatchError(f"expected one id per vector, got {len(ids)} ids for {len(vectors)} vectors")
        if self.source is None and self.normalize:
            vectors = F.normalize(vectors.float(), dim=-1, eps=_COSINE_EPS)  # (n, dim)
        return ids, vectors.detach()
