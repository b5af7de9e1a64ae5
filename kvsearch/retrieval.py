"""The retrieval seam: query tensors in, :class:`~kvsearch.nn.attend.Candidates` out (and their ranking for a search).

    retriever = Retriever(store, dim=256, spec="Flat", score="cosine", folder=path)
    retriever.open()                                   # the saved index if it is this store version's, else rebuilt
    cand = retriever.candidates(queries, k=16)         # ids (b, k), keys (b, k, dim), values (b, k, value_dim), mask

A :class:`Retriever` owns the candidate index of one store: it creates it from the spec
(:data:`~kvsearch.index.factory.INDEX_KINDS`) and the score's metric (:data:`~kvsearch.nn.scores.SCORE_KINDS`),
serves the saved one or rebuilds it, follows every committed write in it, and answers ``candidates``: the index
picks ids without gradient (filters applied by the index, which guarantees ``min(k, matches)``; the queries were
checked at the facade, so the index is asked with ``checked=True``), and the keys and values are gathered from the
store's vector table, on its device, for attention to score and pool: by the rows the search result carries where
an exact torch index scanned the table's own keys, else by id. ``Database.search`` asks :meth:`Retriever.search`
instead, which gathers nothing it does not need: the index's own scores where it scores the stored vectors
(:attr:`~kvsearch.index.base.CandidateIndex.exact_scores`), else the found rows rescored in torch with the score's own
function (:func:`rank_rows`), so a query scores the same alone and in a batch. :func:`rank_candidates` ranks gathered
candidates the same way (the sharded search). It also finds exact-key targets (``pooling="exact"``, forced training
targets).

It is the one object a sharded retriever replaces: its interface is small and speaks torch tensors. It knows
nothing of text, encoders, locking (the caller holds the store's locks) or training.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import CHUNK_ELEMENTS, check_fits, check_k
from kvsearch.errors import CorruptDatabaseError, DimensionMismatchError
from kvsearch.index.base import CandidateIndex
from kvsearch.index.factory import load_index, make_index
from kvsearch.nn.attend import Candidates
from kvsearch.nn.precision import autocast_off
from kvsearch.nn.scores import SCORE_KINDS, check_db_score, checked_scores
from kvsearch.storage import folder as folders
from kvsearch.storage.store import Store

__all__ = ["Retriever", "Ranked", "metric_of", "database_scores", "rank_rows", "rank_candidates"]


def metric_of(score: str) -> Literal["ip", "l2"]:
    """The index metric a database score needs, as the score registry :data:`~kvsearch.nn.scores.SCORE_KINDS`
    records it: squared L2 for ``gaussian``, inner product for the others.

    Raises:
        UnknownOptionError: ``score`` is not a database score (:data:`~kvsearch.nn.scores.DB_SCORES`).
    """
    return SCORE_KINDS[check_db_score(score)].metric


class Retriever:
    """The candidate index of a store, and candidates gathered by id (or row) for a batch of query tensors.

    Args:
        store: the record store (the single source of truth; its in-memory ids and key / value tensors).
        dim: the key dimension.
        spec: the index spec (:data:`~kvsearch.index.factory.INDEX_KINDS`: ``"Flat"``, ``"torch[:dtype]"`` or a FAISS
            ``index_factory`` string).
        score: the database's score (one of :data:`~kvsearch.nn.scores.DB_SCORES`): it decides the metric, and
            cosine normalises.
        params: search parameters (``nprobe``, ``efSearch``...).
        folder: the database folder whose saved index :meth:`open` may serve and :meth:`save` writes; None in memory.

    Raises:
        UnknownOptionError: an unknown spec, score or search parameter.
    """

    def __init__(
        self,
        store: Store,
        *,
        dim: int,
        spec: str,
        score: str,
        params: Mapping[str, float] | None = None,
        folder: Path | None = None,
    ) -> None:
        self.store = store
        self.dim = dim
        self.spec = spec
        self.score = check_db_score(score)
        self.metric = metric_of(score)
        self.folder = folder
        self.params: dict[str, float] = dict(params or {})
        self.index: CandidateIndex = self._new_index()
        #: Whether the index differs from what is saved in the folder (written by :meth:`save`).
        self.dirty = False

    def _options(self) -> dict[str, Any]:
        """How this store's index is made or loaded: its metric, cosine normalisation, key source, parameters."""
        source = self.store.table  # the key source: the store's in-memory ids and keys
        normalize = SCORE_KINDS[self.score].unit_keys
        return {"metric": self.metric, "normalize": normalize, "source": source, "params": self.params}

    def _new_index(self) -> CandidateIndex:
        return make_index(self.spec, self.dim, **self._options())

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Serve the saved index if it is exactly the index of the store's loaded version, else rebuild it.

        Served only if the manifest names this store version, spec and size, the file has the very bytes the
        manifest was written for, and the index holds the very ids the store holds. A damaged or foreign side
        file is never an error: the store is the truth, the index is rebuilt from it.
        """
        if self.folder is not None:
            path = folders.saved_index_path(
                self.folder, version=self.store.table.version, spec=self.spec, ntotal=len(self.store.table)
            )
            if path is not None:
                try:
                    index = load_index(path, self.spec, self.dim, **self._options())
                    if index.ntotal == len(self.store.table) and torch.equal(index.ids(), self.store.table.ids):
                        self.index, self.dirty = index, False
                        return
                except (CorruptDatabaseError, ValueError, OSError, KeyError, AttributeError, TypeError):
                    pass  # a damaged or foreign side file: rebuild from the store
        self.index = self._new_index()
        self.rebuild()

    def release(self) -> None:
        """Let go of the index (at close): an empty one of the same spec takes its place, so that nothing keeps the
        store's key tensor (and the file mapping under it) alive."""
        self.index = self._new_index()

    def rebuild(self) -> None:
        """Rebuild the index from everything the store holds now (after a refresh, at open, when it asks).

        Raises:
            MemoryLimitError: the index would not fit in memory (checked before building).
        """
        self.index.rebuild()
        self.dirty = True

    def apply(self, *, removed: list[int], added: list[int], keys: Tensor | None) -> None:
        """Mirror a committed store write: remove ids, add ids with their key embeddings (added, dim).

        The store has committed: should the index fail to follow, it is rebuilt from the store (the truth)
        rather than left behind it; it is also rebuilt when it asks (tombstones, or enough vectors to train).
        """
        self.dirty = True
        try:
            self.index.remove(torch.tensor(removed, dtype=torch.long))
            if added:
                self.index.add(torch.tensor(added, dtype=torch.long), keys)
        except (RuntimeError, ValueError):
            self.index = self._new_index()
            self.rebuild()
            return
        if self.index.needs_rebuild:
            self.rebuild()

    def set_params(self, **params: float) -> None:
        """Set search parameters on the index (checked by it) and keep them for later rebuilds.

        Raises:
            UnknownOptionError, InvalidArgumentError: a parameter the index type does not take, or a bad value.
        """
        self.index.set_params(**params)
        self.params.update(params)

    @property
    def needs_save(self) -> bool:
        """Whether :meth:`save` would write anything: the index changed and its type is worth saving."""
        return self.folder is not None and self.dirty and self.index.persisted

    def save(self) -> None:
        """Write the index and its manifest (tagged with the store's loaded version) if :attr:`needs_save`.

        The caller holds the write lock and has checked that no other process committed since (else the
        index would be tagged with a version it does not reflect).
        """
        if self.needs_save:
            folders.write_index(self.folder, self.index, version=self.store.table.version)
            self.dirty = False

    # ------------------------------------------------------------------ reading

    def candidates(
        self,
        queries: Tensor,
        k: int | Literal["all"],
        *,
        targets: Tensor | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> Candidates:
        """The candidates for a batch of query embeddings, gathered by id from the store.

        The queries come checked (a dense floating-point tensor of finite numbers: the facade's
        :func:`~kvsearch.checks.query_tensor` / :func:`~kvsearch.inputs.query_batch`, the fine-tuning loop's finite
        check); ``k`` and the shape are checked here, and the index searches with ``checked=True``: nothing is
        checked again below.

        Args:
            queries: (batch, dim) finite floats; detached for the index search.
            k: candidates per query, or ``"all"``.
            targets: (batch,) ids that must be among the candidates (-1 for none); the worst candidate makes
                room. ``match`` is then ``ids == targets``.
            where: a metadata filter (see :mod:`kvsearch.metadata.filters`): only matching records are candidates.

        Returns:
            :class:`~kvsearch.nn.attend.Candidates` with ids (batch, t), keys (batch, t, dim), values
            (batch, t, value_dim), mask (batch, t), where t = min(k, records) (no more candidates than records
            are gathered); for ``k="all"`` ids (m,), keys (m, dim), values (m, value_dim), mask None.

        Raises:
            InvalidArgumentError: a bad ``k`` or filter.
            DimensionMismatchError: queries are not (batch, dim).
            MemoryLimitError: the gathered candidates would not fit in memory (refused before any work).
        """
        k = check_k(k, allow_all=True)
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected queries (batch, {self.dim}), got {tuple(queries.shape)}")
        store, device = self.store, self.store.device
        allowed = None if where is None else store.ids_where(where)  # (m,) sorted ids
        if allowed is not None and targets is not None:
            targets = torch.where(torch.isin(targets.cpu(), allowed), targets.cpu(), -1)  # (b,)
        if k == "all":
            if allowed is None:
                table = store.table
                ids, keys, values = table.ids.to(device), table.keys, table.values  # (m,), (m, dim), (m, value_dim)
            else:
                rows = store.table.rows_of(allowed).to(device)  # (m,)
                ids, keys, values = allowed.to(device), store.table.keys[rows], store.table.values[rows]
            match = None if targets is None else ids.unsqueeze(0) == targets.to(device).unsqueeze(1)  # (b, m)
            return Candidates(ids=ids, keys=keys, values=values, mask=None, match=match)
        # never gather more candidates than there are records (k may be far larger than the database)
        take = max(1, min(int(k), len(store.table) if allowed is None else len(allowed)))
        value_dim = store.table.values.shape[-1]
        per_candidate = (self.dim + value_dim) * 4 * 3 + 24  # gathered, scored, their gradients; ids
        check_fits(queries.shape[0] * take * per_candidate, lambda: f"gathering {len(queries):,} x {take:,} candidates")
        with _autocast_off(queries.device, device):  # the index scores in its own dtype, never autocast's
            found = self.index.search(queries.detach(), take, allowed=allowed, checked=True)  # checked at the door
        ids = found.ids if targets is None else found.ids.cpu()  # (b, take) without targets: no read to the host
        rows = found.rows if self.index.source is store.table else None  # (b, take) rows of the store's keys, or None
        if targets is not None:
            targets = targets.cpu()
            missing = (targets >= 0) & ~(ids == targets.unsqueeze(1)).any(1)  # (b,)
            ids[missing, -1] = targets[missing]
            rows = None if bool(missing.any()) else rows
        if rows is not None:  # an exact index over the store's own tensors: its rows, no lookup by id
            keys, values, mask = store.table.gather_rows(rows)  # (b, take, dim), (b, take, value_dim), (b, take)
        else:
            keys, values, mask = store.table.gather(ids)  # (b, take, dim), (b, take, value_dim), (b, take)
        ids = ids.to(device)  # (b, take)
        match = None if targets is None else (ids == targets.to(device).unsqueeze(1)) & (ids >= 0)  # (b, take)
        return Candidates(ids=ids, keys=keys, values=values, mask=mask, match=match)

    def search(self, queries: Tensor, k: int, *, where: Mapping[str, Any] | None = None) -> Ranked:
        """``Database.search``'s ranking: the k best records of each query, best first, with their scores.

        The scores never depend on the other queries of a batch (a query scores alike alone and in any batch), and
        nothing is gathered that the ranking does not need:

        - an exact torch index scanned the store's own keys: the few rows it found are scored again in torch with
          the score's own function (:func:`rank_rows`: a matrix product's rounding depends on the batch);
        - another index that scores the stored float32 vectors themselves (:attr:`CandidateIndex.exact_scores
          <kvsearch.index.base.CandidateIndex.exact_scores>`: FAISS HNSW-Flat, IVF-Flat) gives the database's
          scores up to float rounding (:func:`database_scores`), each computed alone: they are reported as they are;
        - a lossy index (SQ, PQ codes, a PCA / OPQ transform), or a filtered FAISS search (which may redo some
          queries exactly, as a batch), picks the ids, whose scores are recomputed in torch on the stored keys
          (:func:`rank_rows`).

        Args:
            queries: (batch, dim) finite floats, checked at the facade. k: an int in [1, MAX_K], checked there.
            where: a metadata filter: only matching records come back.

        Returns:
            :class:`Ranked`: ids and scores (batch, t) on the CPU (t = min(k, records); ids -1, scores -inf or NaN
            where fewer records match), and the rows of the ids in the store's table.
        """
        table, index = self.store.table, self.index
        allowed = None if where is None else self.store.ids_where(where)  # (m,) sorted ids
        take = max(1, min(k, table.ids.shape[0] if allowed is None else len(allowed)))
        if _autocast_on(queries.device, self.store.device):  # the index scores in its own dtype
            with autocast_off(queries.device, self.store.device):
                found = index.search(queries.detach(), take, allowed=allowed, checked=True)  # checked at the door
        else:
            found = index.search(queries.detach(), take, allowed=allowed, checked=True)
        if found.rows is not None and index.source is table:  # the store's own keys, scanned in a batch
            return rank_rows(queries, found.ids, found.rows, table.keys, self.score)
        ids = found.ids if found.ids.device.type == "cpu" else found.ids.cpu()  # (b, take)
        if allowed is None and index.exact_scores:
            rows = table.rows_array(ids.numpy().ravel()).reshape(ids.shape)  # (b, take) in numpy: a few ids
            scores = found.scores if found.scores.device.type == "cpu" else found.scores.cpu()  # (b, take)
            return Ranked(ids, scores if self.score in _AS_IS else database_scores(scores, self.score, self.dim), rows)
        # lossy scores, or a filtered graph search some of whose queries were redone exactly as a batch
        check_fits(queries.shape[0] * take * (self.dim * 4 * 2 + 8), lambda: f"scoring {len(queries):,} x {take:,}")
        return rank_rows(queries, ids, table.rows_of(ids).to(self.store.device), table.keys, self.score)

    def key_matches(self, queries: Tensor) -> tuple[Tensor, Tensor]:
        """For each query embedding, the stored ids whose key embedding equals it (bit for bit, -0.0 == 0.0).

        Rows are compared by an exact integer fingerprint first (one pass over the keys in chunks, no
        (batch, m, dim) comparison), and every fingerprint hit is confirmed by comparing the rows themselves.

        Args:
            queries: (batch, dim).

        Returns:
            The first matching id (batch,) (-1 where none) and how many records match (batch,): int64 CPU.
        """
        keys = self.store.table.keys  # (m, dim)
        q = queries.detach().to(self.store.device, torch.float32)  # (b, dim)
        first = torch.full((q.shape[0],), -1, dtype=torch.long)  # (b,)
        count = torch.zeros(q.shape[0], dtype=torch.long)  # (b,)
        if keys is None or not len(keys) or not len(q):
            return first, count
        weights = _fingerprint_weights(q.shape[1], q.device)  # (dim,)
        fq = _fingerprint(q, weights)  # (b,)
        step = max(1, CHUNK_ELEMENTS // q.shape[1])  # rows per chunk: (c, dim) int64 bits at a time
        for start in range(0, len(keys), step):
            chunk = keys[start : start + step]  # (c, dim)
            fk, order = torch.sort(_fingerprint(chunk, weights))  # (c,), (c,)
            lo = torch.searchsorted(fk, fq, right=False)  # (b,)
            hi = torch.searchsorted(fk, fq, right=True)  # (b,)
            for i in torch.nonzero(hi > lo).flatten().tolist():  # fingerprint hits only: confirmed row by row
                rows = order[int(lo[i]) : int(hi[i])]  # (h,) rows of this chunk, ascending fingerprints
                same = rows[(chunk[rows] == q[i]).all(-1)].sort().values  # (s,) rows of equal keys, by id
                if len(same):
                    if first[i] < 0:
                        first[i] = self.store.table.ids[start + int(same[0])]
                    count[i] += len(same)
        return first, count

    def exact_targets(self, queries: Tensor) -> Tensor:
        """For each query embedding, the id of the one record whose key embedding equals it, else -1.

        A query equal to several stored key embeddings (duplicate embeddings are accepted, and an encoder may map
        two key texts to one vector) is ambiguous: -1, as when none is equal — never one of them picked silently.

        Args:
            queries: (batch, dim).

        Returns:
            (batch,) int64 CPU ids.
        """
        first, count = self.key_matches(queries)  # (batch,), (batch,)
        return torch.where(count == 1, first, -1)  # (batch,)


def _autocast_on(queries: torch.device, store: torch.device) -> bool:
    """Whether autocast is on for either device (asked of torch directly: no context manager where it is off)."""
    try:
        return torch.is_autocast_enabled(queries.type) or torch.is_autocast_enabled(store.type)
    except RuntimeError:  # a device type autocast does not know ("meta"): autocast_off sorts it out
        return True


def _autocast_off(queries: torch.device, store: torch.device) -> contextlib.AbstractContextManager:
    """:func:`~kvsearch.nn.precision.autocast_off` for both devices, or nothing where autocast is off on both (the
    usual case: a search's Python work is most of a single query's cost, so it is asked of torch directly)."""
    try:
        on = torch.is_autocast_enabled(queries.type) or torch.is_autocast_enabled(store.type)
    except RuntimeError:  # a device type autocast does not know ("meta"): autocast_off sorts it out
        on = True
    return autocast_off(queries, store) if on else contextlib.nullcontext()


def _fingerprint_weights(dim: int, device: torch.device) -> Tensor:
    """Fixed odd 64-bit multipliers, one per coordinate (a seeded generator: the same in every process). (dim,)"""
    generator = torch.Generator().manual_seed(0x6B7673)
    weights = torch.randint(-(2**62), 2**62, (dim,), generator=generator, dtype=torch.long) * 2 + 1  # (dim,)
    return weights.to(device)


def _fingerprint(rows: Tensor, weights: Tensor) -> Tensor:
    """An exact integer hash of each float32 row: equal rows get equal fingerprints. (n, dim) -> (n,) int64.

    The float bits (``-0.0`` made ``0.0`` first) times fixed multipliers, summed with int64 wrap-around: integer
    sums do not depend on the order of summation, so a row hashes the same alone or in any batch.
    """
    bits = (rows.float() + 0.0).contiguous().view(torch.int32).long()  # (n, dim)
    return (bits * weights).sum(-1)  # (n,)


@dataclass
class Ranked:
    """A search's ranking (:meth:`Retriever.search`).

    Attributes:
        ids: (batch, t) int64 on the CPU, best first, -1 where fewer records match.
        scores: (batch, t) float32 on the CPU: the database's score (-inf or NaN where ids are -1).
        rows: (batch, t) int64, the row of each id in the store's table (-1 where none): a tensor on any device, or
            a numpy array (a FAISS index's few ids, looked up in numpy).
    """

    ids: Tensor
    scores: Tensor
    rows: Tensor | np.ndarray


#: The database scores an index's inner product is as it is (:func:`database_scores` returns it unchanged).
_AS_IS = frozenset({"dot", "cosine"})


def database_scores(scores: Tensor, score: str, dim: int) -> Tensor:
    """An index's scores of the stored vectors as the database's ``score``: the inner product (of unit vectors for
    cosine) is ``dot`` and ``cosine`` itself, over ``sqrt(dim)`` ``scaled_dot``; a squared distance ``d`` is the
    ``gaussian`` score ``-d / 2``. NaN stays where the index found nothing.

    Args:
        scores: (batch, t) an index's float32 scores. score: a database score.
        dim: the key dimension.

    Returns:
        (batch, t) float32 scores.
    """
    if score == "scaled_dot":
        return scores / math.sqrt(dim)  # (b, t)
    if score == "gaussian":
        return scores * -0.5  # (b, t)
    return scores  # (b, t)


def rank_rows(queries: Tensor, ids: Tensor, rows: Tensor, keys: Tensor, score: str) -> Ranked:
    """The ids an exact torch index found in ``keys``, ranked by their scores recomputed in torch on those rows
    (:func:`rank_candidates`' arithmetic: a query scores alike alone and in a batch).

    Args:
        queries: (batch, dim). ids: (batch, t), -1 where none. rows: (batch, t) their rows in ``keys`` (-1 where
            none), on the keys' device. keys: (m, dim) the store's keys. score: the database's score.

    Returns:
        :class:`Ranked` on the CPU (rows on the keys' device).
    """
    mask = rows >= 0  # (b, t)
    gathered = keys.index_select(0, rows.clamp(min=0).reshape(-1)).reshape(*rows.shape, keys.shape[-1])  # (b, t, dim)
    cand = Candidates(ids=ids.to(keys.device), keys=gathered, values=gathered[..., :0], mask=mask)
    ranked_ids, scores, order = _rank(queries, cand, score)  # (b, t) each
    return Ranked(ranked_ids, scores, rows.gather(1, order))


def rank_candidates(queries: Tensor, cand: Candidates, score: str) -> tuple[Tensor, Tensor]:
    """The candidates of each query ranked by the database's score recomputed in torch on their stored keys.

    One sort gives the order and the sorted scores (a stable sort: ties keep the index's order); missing candidates
    (mask False, id -1) score -inf and come last. The inputs come checked (the queries at the facade, the keys as
    stored), so they go to :func:`~kvsearch.nn.scores.checked_scores` (the registry's function, no check again),
    with the dtypes promoted as :func:`~kvsearch.nn.scores.compute_scores` promotes them.

    Args:
        queries: (batch, dim). cand: candidates (batch, t) of these queries, on the store's device.
        score: the database's score (a name of :data:`~kvsearch.nn.scores.DB_SCORES`).

    Returns:
        ids (batch, t) and scores (batch, t) on the CPU, best first.
    """
    ids, scores, _ = _rank(queries, cand, score)
    return ids, scores


def _rank(queries: Tensor, cand: Candidates, score: str) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`rank_candidates`, and the order (b, t) it sorted the candidates in (on their device)."""
    keys = cand.keys  # (b, t, dim)
    queries = queries.to(keys.device).unsqueeze(1)  # (b, 1, dim)
    if queries.dtype != keys.dtype:
        dtype = torch.promote_types(queries.dtype, keys.dtype)
        queries, keys = queries.to(dtype), keys.to(dtype)
    scores = checked_scores(queries, keys, score).squeeze(1)  # (b, t)
    scores, order = torch.sort(torch.where(cand.mask, scores, -math.inf), dim=-1, descending=True, stable=True)
    return cand.ids.gather(1, order).cpu(), scores.cpu(), order  # (b, t) each
