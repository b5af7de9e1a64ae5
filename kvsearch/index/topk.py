"""Exact top-k in torch, the result and key-source types, and the argument checks both index modules share.

This module owns :class:`SearchResult` (what every search returns: scores, ids, and the rows and path where a
torch index scanned its source's keys), :class:`KeySource` (what an index may read keys from: the store),
:func:`chunked_topk` (the one chunked top-k, memory O(batch x chunk)) and :func:`exact_search`, the id tie-break
every exact path ends with (:func:`best_by_score_then_id`: equal scores ordered by id, so that every path returns the
same ids; :func:`best_of_sorted`, :func:`settled`), and the checks of what comes in at an index's torch boundary.
It knows nothing of FAISS, SQLite, text or autograd.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import COSINE_EPS, check_dense, check_dim, check_finite, check_real_tensor
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, UnknownOptionError
from kvsearch.nn.precision import autocast_off
from kvsearch.nn.scores import compute_scores

__all__ = [
    "Metric",
    "merge_candidates",
    "SearchResult",
    "no_result",
    "KeySource",
    "EXACT_FILTER_MAX",
    "SCAN_CHUNK_ELEMENTS",
    "chunked_topk",
    "best_by_score_then_id",
    "best_of_sorted",
    "settled",
    "exact_search",
    "check_queries",
    "check_ids",
    "check_allowed",
    "check_pairs",
    "check_index_args",
]

Metric = Literal["ip", "l2"]

#: Score elements (batch x chunk) an exact index scan computes at once: 2^27 float32 = 512 MiB. Bare
#: ``torch.topk(q @ K.T, k)`` makes the whole (batch, n) matrix; small chunks pay a top-k and a merge per chunk
#: (2^22 made a 1,024-query scan over 20k x 64 keys 3.5x slower than bare torch, 2^25 4,096 queries over 100k x 64
#: 1.3x slower), 2^27 ran as fast as bare torch up to 4,096 x 25,600 x 256 at a bounded memory.
SCAN_CHUNK_ELEMENTS = 1 << 27

#: A filtered search whose admitted set (live allowed ids) is at most ``max(8 k, EXACT_FILTER_MAX)`` ids scans
#: those rows exactly instead of searching the index with a selector: the default of
#: :attr:`kvsearch.index.base.CandidateIndex.exact_filter_max`.
EXACT_FILTER_MAX = 4096


@dataclass(frozen=True, slots=True)
class SearchResult:
    """What a search returns: everything it found, so that nothing is left on the index for a later reader.

    It unpacks as the pair ``scores, ids = index.search(queries, k)``; :attr:`rows` and :attr:`path` are read by name.

    Attributes:
        scores: (batch, k) float32 on the queries' device: the inner product (of unit vectors for a ``normalize``
            index), or the squared L2 distance for metric ``"l2"``; NaN where ``ids`` is -1.
        ids: (batch, k) int64 global ids on the queries' device, best first, -1 padded.
        rows: where the index scanned its source's own key tensor (a source-bound
            :class:`~kvsearch.index.torch_index.TorchIndex` that found k rows): (batch, k) int64, the row of each
            id in the source's ``keys`` (-1 where none), on the keys' device, valid for the source's version the
            search read, so that the source can gather the candidates without looking the ids up. None otherwise
            (a FAISS index, a standalone index, fewer than k rows).
        path: the exact path a torch index took: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"faiss"``
            (:mod:`kvsearch.index.exact_path`); ``""`` where it scanned nothing (no keys, no queries) and for a FAISS
            index.
    """

    scores: Tensor
    ids: Tensor
    rows: Tensor | None = None
    path: str = ""

    def __iter__(self) -> Iterator[Tensor]:
        """``scores`` then ``ids``: a result unpacks as the pair it is."""
        return iter((self.scores, self.ids))


def no_result(batch: int, k: int, device: torch.device, *, path: str = "") -> SearchResult:
    """A result with no ids: scores (batch, k) NaN, ids (batch, k) -1, no rows; ``path`` the scan took."""
    return SearchResult(
        torch.full((batch, k), math.nan, dtype=torch.float32, device=device),
        torch.full((batch, k), -1, dtype=torch.long, device=device),
        path=path,
    )


class KeySource(Protocol):
    """What an index may read its keys from: a store's table (:class:`kvsearch.storage.table.VectorTable`).

    Attributes:
        ids: (n,) int64 ids on the CPU, sorted.
        keys: (n, dim) float32 raw keys (not normalised) on the database's device, or None when empty.

    A :class:`~kvsearch.index.torch_index.TorchIndex` reads :attr:`version` at every search (a table holds it as a
    plain attribute: free to read). A source may have ``keys_shared``: True when ``keys`` is memory other processes
    share (a file mapping), which an index should read in place rather than copy.
    """

    ids: Tensor
    keys: Tensor | None

    def rows_of(self, ids: Tensor) -> Tensor:
        """The row of each id in :attr:`keys` (same shape as ``ids``, on the CPU), -1 where absent."""
        ...

    @property
    def version(self) -> int:
        """The store version the tensors reflect (a counter bumped by every committed write)."""
        ...


# ---------------------------------------------------------------------- checks shared by the index modules


def check_queries(queries: object, dim: int) -> Tensor:
    """``queries`` if it is a (batch, dim) tensor of real, finite numbers.

    Raises:
        InvalidArgumentError: not a torch tensor, or a complex or bool one.
        DimensionMismatchError: not of shape (batch, dim).
        NonFiniteError: NaN or Inf.
    """
    if not isinstance(queries, Tensor):
        raise InvalidArgumentError(f"expected queries as a torch.Tensor (batch, {dim}), got {type(queries).__name__}")
    check_real_tensor(queries, "queries")  # its layout first: a nested tensor has no shape to compare
    if queries.dim() != 2 or queries.shape[1] != dim:
        raise DimensionMismatchError(f"expected queries of shape (batch, {dim}), got {tuple(queries.shape)}")
    check_finite(queries, "queries")
    return queries


def check_ids(ids: object, name: str = "ids") -> Tensor:
    """``ids`` as an (n,) int64 CPU tensor (any shape of integer tensor is flattened).

    Raises:
        InvalidArgumentError: not an integer torch tensor.
    """
    if isinstance(ids, Tensor):
        check_dense(ids, name)
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        got = type(ids).__name__ if not isinstance(ids, Tensor) else f"a {ids.dtype} tensor"
        raise InvalidArgumentError(f"expected {name} as an integer torch.Tensor, got {got}")
    return ids.detach().reshape(-1).to("cpu", torch.long).contiguous()  # (n,)


def check_allowed(allowed: object) -> Tensor:
    """The ids of a filter as an (m,) int64 CPU tensor, sorted and without repeats.

    Raises:
        InvalidArgumentError: not an integer torch tensor.
    """
    allowed = check_ids(allowed, "allowed")  # (m,)
    if len(allowed) > 1 and not bool((allowed[1:] > allowed[:-1]).all()):
        allowed = torch.unique(allowed)  # (m',) sorted
    return allowed


def check_pairs(ids: object, keys: object, dim: int) -> tuple[Tensor, Tensor]:
    """``ids`` as (n,) int64 on the CPU and ``keys`` as (n, dim) float32 (detached, on their device).

    Raises:
        InvalidArgumentError: not tensors (ids: not integers, keys: complex or bool), or not dense
            (:func:`~kvsearch.checks.check_dense`).
        DimensionMismatchError: keys are not (n, dim), or not one id per key.
    """
    ids = check_ids(ids)  # (n,)
    if not isinstance(keys, Tensor):
        raise InvalidArgumentError(f"expected keys as a torch.Tensor (n, {dim}), got {type(keys).__name__}")
    check_real_tensor(keys, "keys")
    if keys.dim() != 2 or keys.shape[1] != dim:
        raise DimensionMismatchError(f"expected vectors of shape (n, {dim}), got {tuple(keys.shape)}")
    if len(ids) != len(keys):
        raise DimensionMismatchError(f"expected one id per vector, got {len(ids)} ids for {len(keys)} vectors")
    return ids, keys.detach().float()  # (n,), (n, dim)


def check_index_args(dim: object, metric: object, normalize: object) -> None:
    """The options every index takes: a positive integer ``dim``, a known ``metric``, ``normalize`` only for ``"ip"``.

    Raises:
        InvalidArgumentError: ``dim`` is not a positive integer, or ``normalize`` with metric ``"l2"``.
        UnknownOptionError: ``metric`` is not ``"ip"`` or ``"l2"``.
    """
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise InvalidArgumentError(f"expected a positive integer dim, got {dim!r}")
    check_dim(dim)  # FAISS takes a C int: a dim past MAX_DIM is refused, not handed on
    if metric not in ("ip", "l2"):
        raise UnknownOptionError(f"expected metric 'ip' or 'l2', got {metric!r}")
    if normalize and metric != "ip":
        raise InvalidArgumentError(f"normalize=True (cosine) needs metric 'ip', got metric {metric!r}")


# ---------------------------------------------------------------------- exact search in torch (both indexes)


@torch.no_grad()
def chunked_topk(
    queries: Tensor,
    keys: Tensor,
    k: int,
    *,
    metric: Metric = "ip",
    rows: Tensor | None = None,
    norm_term: Tensor | None = None,
    normalize_keys: bool = False,
    keep: Tensor | None = None,
    chunk_elements: int = SCAN_CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """The ``k`` largest scores of ``queries`` against ``keys``, computed a chunk of keys at a time.

    The score maximised is ``q.k`` for ``"ip"`` and ``2 q.k - |k|^2`` (= ``|q|^2 - |q - k|^2``) for ``"l2"``.
    The first chunk's top-k seeds each query's list; a later chunk only merges its entries above the list's
    current last score (usually a handful), so the selection costs little beside the matmul, and memory is
    O(batch x chunk).

    Args:
        queries: (batch, dim) in the keys' compute dtype, on the keys' device.
        keys: (n, dim).
        k: how many to keep per query (at most the number of rows scanned).
        metric: ``"ip"`` or ``"l2"``.
        rows: (m,) key rows to scan (gathered a chunk at a time), on the keys' device; None: every row.
        norm_term: (n,) per key row: a factor on ``q.k`` for ``"ip"`` (inverse norms: cosine over raw keys),
            ``|k|^2`` for ``"l2"`` (computed per chunk where None).
        normalize_keys: score against unit keys (cosine over raw keys, normalised per chunk).
        keep: (n,) bool per key row: rows not kept never come back.
        chunk_elements: how many scores (batch x chunk) are computed at once.

    Returns:
        values (batch, k) float32, best first, -inf where fewer exist; positions (batch, k) int64 in the
        scanned sequence (the key row, or the index into ``rows``), -1 there.
    """
    batch = queries.shape[0]
    n = keys.shape[0] if rows is None else rows.shape[0]
    device = keys.device
    step = max(1, chunk_elements // max(1, batch))
    best_vals = torch.full((batch, k), -math.inf, dtype=torch.float32, device=device)  # (batch, k)
    best_pos = torch.full((batch, k), -1, dtype=torch.long, device=device)  # (batch, k)
    queries, keys = queries.detach(), keys.detach()
    for start in range(0, n, step):
        at = slice(start, start + step) if rows is None else rows[start : start + step]  # c key rows
        chunk = keys[at]  # (c, dim)
        if normalize_keys:
            chunk = F.normalize(chunk.float(), dim=-1, eps=COSINE_EPS)  # (c, dim)
        if chunk.dtype != queries.dtype:
            chunk = chunk.to(queries.dtype)  # (c, dim)
        scores = _chunk_scores(queries, chunk)  # (batch, c) in the compute dtype
        if norm_term is not None or keep is not None or metric == "l2" or scores.dtype != torch.float32:
            scores = scores.float()  # (batch, c)
        if metric == "l2":
            term = norm_term[at] if norm_term is not None else chunk.float().pow(2).sum(-1)  # (c,)
            scores = scores.mul_(2).sub_(term)  # (batch, c)
        elif norm_term is not None:
            scores = scores.mul_(norm_term[at])  # (batch, c)
        if keep is not None:
            scores = scores.masked_fill_(~keep[at], -math.inf)  # (batch, c)
        if start == 0:
            vals, idx = _row_topk(scores, min(k, scores.shape[1]))  # (batch, t)
            best_vals[:, : vals.shape[1]] = vals
            best_pos[:, : vals.shape[1]] = torch.where(torch.isneginf(vals), -1, idx)
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
        new_pos = torch.full((batch, width), -1, dtype=torch.long, device=device)  # (batch, width)
        new_vals[row_of, slot] = scores[row_of, col_of]
        new_pos[row_of, slot] = col_of + start
        vals, pick = torch.topk(torch.cat([best_vals, new_vals], 1), k, dim=1)  # (batch, k)
        best_pos = torch.cat([best_pos, new_pos], 1).gather(1, pick)  # (batch, k)
        best_vals = vals
    return best_vals, best_pos


def _row_topk(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``torch.topk(scores, k, dim=1)``, sorted, with the rows split across the CPU's threads when there are fewer
    rows than threads: torch's CPU top-k runs one thread per row (one query: 2x faster on 2 cores, split in 2)."""
    batch, c = scores.shape
    parts = torch.get_num_threads() if scores.device.type == "cpu" else 1
    if parts < 2 or batch >= parts or c < max(4 * parts * k, 1 << 16):  # small: the split costs more than it saves
        return torch.topk(scores, k, dim=1)
    seg = -(-c // parts)  # columns per part; the last part is padded with -inf (never picked: >= 4k real each)
    if seg * parts != c:
        scores = F.pad(scores, (0, seg * parts - c), value=-math.inf)  # (batch, parts * seg)
    vals, idx = torch.topk(scores.view(batch * parts, seg), k, dim=1)  # (batch * parts, k)
    idx = idx + (torch.arange(parts, device=idx.device) * seg).repeat(batch).unsqueeze(1)  # columns of scores
    vals, pick = torch.topk(vals.view(batch, parts * k), k, dim=1)  # (batch, k)
    return vals, idx.view(batch, parts * k).gather(1, pick)


def _chunk_scores(queries: Tensor, chunk: Tensor) -> Tensor:
    """queries (batch, dim) @ chunk.T (dim, c) -> (batch, c), in torch on every device and dtype.

    Not numpy's BLAS on the CPU: its OpenBLAS threads spin after each call and fight torch's OpenMP threads for the
    cores, so the torch ops that follow (the norm term, the top-k) ran 10-30x slower (measured: a (1, 51,200)
    multiply 8 ms after a numpy matmul, 0.02 ms after a torch one, 2 cores).
    """
    return queries @ chunk.T  # (batch, c)


@torch.no_grad()
def exact_search(
    queries: Tensor,
    keys: Tensor,
    ids: Tensor,
    k: int,
    *,
    metric: Metric = "ip",
    rows: Tensor | None = None,
    norm_term: Tensor | None = None,
    normalize_keys: bool = False,
    chunk_elements: int = SCAN_CHUNK_ELEMENTS,
) -> SearchResult:
    """Brute-force top-k of ``queries`` over ``keys`` (or the rows ``rows`` of them), as an index answers.

    Args:
        queries: (batch, dim) float, on any device (scored on the keys' device, as given: not normalised).
        keys: (n, dim) float32.
        ids: the id of each scanned row: (n,) for ``keys[i]``, or (m,) for ``keys[rows[i]]``.
        k: 1 <= k; where fewer rows exist, ids are -1.
        metric, rows, norm_term, normalize_keys, chunk_elements: as for :func:`chunked_topk`.

    Returns:
        :class:`SearchResult` on the keys' device: scores are the inner product (cosine with
        ``normalize_keys``) or the squared L2 distance, NaN where ids are -1.
    """
    device = keys.device
    q = queries.detach().to(device, torch.float32)  # (batch, dim)
    batch, m = q.shape[0], (keys.shape[0] if rows is None else rows.shape[0])
    scores = torch.full((batch, k), math.nan, dtype=torch.float32, device=device)  # (batch, k)
    found = torch.full((batch, k), -1, dtype=torch.long, device=device)  # (batch, k)
    take = min(k, m)
    if take == 0 or batch == 0:
        return SearchResult(scores, found)
    vals, pos = chunked_topk(
        q,
        keys,
        take,
        metric=metric,
        rows=None if rows is None else rows.to(device),
        norm_term=norm_term,
        normalize_keys=normalize_keys,
        chunk_elements=chunk_elements,
    )  # (batch, take) each
    if metric == "l2":
        vals = (q.pow(2).sum(-1, keepdim=True) - vals).clamp_(min=0)  # (batch, take): |q|^2 - (2 q.k - |k|^2)
    missing = pos < 0  # (batch, take)
    scores[:, :take] = vals.masked_fill(missing, math.nan)
    found[:, :take] = ids.to(device)[pos.clamp(min=0)].masked_fill(missing, -1)
    return SearchResult(scores, found)


def merge_candidates(
    q: Tensor, ids: Tensor, keys: Tensor, values: Tensor, targets: Tensor, take: int, score: str
) -> tuple[Tensor, Tensor, Tensor]:
    """The best ``take`` of each query's candidates by score (desc), then id (asc); a target is always kept (in the
    last place when it ranks lower, as a single database's :meth:`~kvsearch.retrieval.Retriever.candidates` does).

    Merges candidates found in several places (a sharded database's shards and ranks).

    Args:
        q: (b, dim). ids: (b, c) -1 where empty. keys: (b, c, dim). values: (b, c, value_dim). targets: (b,)
            (-1 for none). take: how many to keep. score: the score name that ranks them.

    Returns:
        ids (b, take), keys (b, take, dim), values (b, take, value_dim), padded with -1 / zeros.
    """
    b, c = ids.shape
    if c < take:  # pad to at least take columns
        ids = torch.cat([ids, torch.full((b, take - c), -1, dtype=torch.long)], 1)
        keys = torch.cat([keys, torch.zeros(b, take - c, keys.shape[-1])], 1)
        values = torch.cat([values, torch.zeros(b, take - c, values.shape[-1])], 1)
    if b == 0:
        return ids[:, :take], keys[:, :take], values[:, :take]
    with torch.no_grad(), autocast_off(q.device, keys.device):  # ranked in float32, as one database ranks them
        scores = compute_scores(q.unsqueeze(1).float(), keys.float(), score).squeeze(1)  # (b, c')
        scores = scores.masked_fill(ids < 0, -math.inf)
        by_id = torch.argsort(torch.where(ids < 0, torch.iinfo(torch.long).max, ids), dim=1, stable=True)  # (b, c')
        order = by_id.gather(1, torch.argsort(scores.gather(1, by_id), dim=1, descending=True, stable=True))
        # a target below the top take replaces the worst kept candidate, as a single database does
        is_target = (ids == targets.unsqueeze(1)) & (ids >= 0)  # (b, c')
        late = is_target.gather(1, order)[:, take:].any(1)  # (b,)
        where_target = is_target.float().argmax(1)  # (b,)
        order = order[:, :take].clone()  # (b, take)
        order[late, -1] = where_target[late]
    return (
        ids.gather(1, order),
        keys.gather(1, order.unsqueeze(-1).expand(-1, -1, keys.shape[-1])),
        values.gather(1, order.unsqueeze(-1).expand(-1, -1, values.shape[-1])),
    )


# ---------------------------------------------------------------------- ties: equal scores ordered by id


def best_by_score_then_id(vals: Tensor, rows: Tensor, ids: Tensor, take: int) -> tuple[Tensor, Tensor]:
    """The ``take`` best of each query's candidates: larger value first, equal values by smaller id.

    Args:
        vals: (batch, t) maximised values, -inf where absent. rows: (batch, t) key rows, -1 where absent.
        ids: (n,) the id of each key row, on the rows' device.
        take: how many to keep, <= t.

    Returns:
        values (batch, take) and rows (batch, take), in that order.
    """
    cand_ids = ids[rows.clamp(min=0)].masked_fill(rows < 0, torch.iinfo(torch.long).max)  # (batch, t)
    by_id = torch.sort(cand_ids, dim=1, stable=True).indices  # (batch, t)
    by_score = torch.sort(vals.gather(1, by_id), dim=1, descending=True, stable=True).indices  # (batch, t)
    order = by_id.gather(1, by_score)[:, :take]  # (batch, take)
    return vals.gather(1, order), rows.gather(1, order)


def best_of_sorted(vals: Tensor, rows: Tensor, ids: Tensor, take: int) -> tuple[Tensor, Tensor]:
    """:func:`best_by_score_then_id` for candidates already sorted best first (a scan's top-k): where no two
    present values are equal (the usual case) the first ``take`` are the answer as they are, without the sorts."""
    present = vals[:, 1:]  # (batch, t - 1)
    if not bool(((present == vals[:, :-1]) & torch.isfinite(present)).any()):
        return vals[:, :take], rows[:, :take]
    return best_by_score_then_id(vals, rows, ids, take)


def settled(vals: Tensor, take: int, ceiling: Tensor) -> Tensor:
    """Queries (batch,) whose ``take``-th best value is above the ceiling of everything left out.

    Args:
        vals: (batch, t) candidate values, any order, -inf where absent; t >= take.
        take: the k of the search.
        ceiling: (batch,) the most a left-out key can score (-inf: nothing was left out).
    """
    kth = torch.topk(vals, take, dim=1).values[:, -1]  # (batch,)
    return (kth > ceiling) | torch.isneginf(ceiling)  # (batch,)
