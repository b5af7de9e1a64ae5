"""Retrieval metrics on (query, target) pairs: recall@1, recall@k and MRR, and the pairs they are measured on.

    metrics = evaluate(db, [("Липтон", "Lipton"), ...], k=10)   # {"recall@1": ..., "recall@k": ..., "mrr": ...}
    metrics = evaluate(db, pairs, k=10, retriever=draft)          # search a draft generation instead of the db

A pair is ``(query text, target text)``; ``targets="key"`` reads the target as the key of the right record,
``targets="value"`` as the value text of the answer (any record holding it counts). Fine-tuning measures its
runs with :func:`evaluate` (searching its draft generation through ``retriever=``), checks its pairs with
:func:`check_pairs` and their targets with :func:`check_targets`, and picks the epoch to keep by one of
:data:`METRICS` (:func:`higher_is_better` says which way is better).

This module owns the metrics, their names, their ranking helpers and the checks of the pairs. It talks to the
database through its public methods only (``candidates``, ``ids_of_keys``, ``values_present``, ``value_texts``,
``key_texts``, the encoders); it knows nothing of the store, the index, the losses or the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import torch
from torch import Tensor

from kvsearch.checks import all_finite, check_int, check_k, check_real_tensor, check_unicode
from kvsearch.encoders.base import Encoder
from kvsearch.errors import (
    DimensionMismatchError,
    InvalidArgumentError,
    NonFiniteError,
    UnknownOptionError,
    UnknownTargetError,
)
from kvsearch.inputs import normalize_key
from kvsearch.nn.attend import Candidates
from kvsearch.nn.scores import ScoreFn, compute_scores
from kvsearch.text.rerank import Rerank, Similarity, check_rerank, rerank_depth, rerank_order
from kvsearch.training.team import Team, batches, team_of

if TYPE_CHECKING:
    from kvsearch.contract import DatabaseProtocol
    from kvsearch.encoders.base import Encoder

__all__ = [
    "TargetKind",
    "TARGET_KINDS",
    "Pairs",
    "MetricName",
    "METRICS",
    "TEXT_METRICS",
    "TENSOR_METRICS",
    "CandidateSource",
    "higher_is_better",
    "check_metric",
    "is_tensor_pairs",
    "check_pairs",
    "check_targets",
    "target_ids",
    "hit_matrix",
    "ranked_ids",
    "evaluate",
]

TargetKind = Literal["key", "value"]
#: How a pair's target text is read: the right record's key, or the answer's value text.
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)
#: ``[(query text, target text), ...]``, or ``(queries (n, dim), values (n, value_dim))`` for databases without text.
Pairs = Sequence[tuple[str, str]] | tuple[Tensor, Tensor]

MetricName = Literal["recall@1", "recall@k", "mrr", "loss"]
#: Every metric a run can be judged by.
METRICS: tuple[str, ...] = get_args(MetricName)
#: The metrics of text pairs (:func:`evaluate`): fractions in [0, 1], higher is better.
TEXT_METRICS: tuple[str, ...] = ("recall@1", "recall@k", "mrr")
#: The metric of tensor pairs: the training loss on them, lower is better.
TENSOR_METRICS: tuple[str, ...] = ("loss",)
#: How many target texts an error message shows.
SHOWN_TARGETS = 5


class CandidateSource(Protocol):
    """Anything that picks candidates for query embeddings: a :class:`~kvsearch.Database`, a draft generation."""

    def candidates(self, queries: Tensor, k: int) -> Candidates:
        """ids (b, t), keys (b, t, dim), values (b, t, value_dim), mask (b, t) for queries (b, dim)."""
        ...


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better (the recalls and MRR), or a smaller one (``"loss"``)."""
    return metric != "loss"


def check_metric(metric: object, pairs: object, name: str = "eval_pairs") -> str:
    """``metric`` if it can be measured on ``pairs``; None picks the default for their kind.

    Args:
        metric: one of :data:`METRICS`, or None.
        pairs: the evaluation pairs (text pairs or a tensor pair).
        name: the pairs' argument name, for the message.

    Returns:
        The metric: ``"recall@1"`` for text pairs, ``"loss"`` for tensor pairs when None was given.

    Raises:
        UnknownOptionError: not one of :data:`METRICS`.
        InvalidArgumentError: a metric of the other kind of pairs (``"loss"`` on text pairs, a recall on tensors).
    """
    if metric is not None and (not isinstance(metric, str) or metric not in METRICS):
        raise UnknownOptionError(f"expected metric among {METRICS} or None, got {metric!r}")
    tensors = is_tensor_pairs(pairs)
    fitting = TENSOR_METRICS if tensors else TEXT_METRICS
    if metric is None:
        return fitting[0]
    if metric not in fitting:
        kind = "(queries, values) tensor pairs" if tensors else "(query text, target text) pairs"
        raise InvalidArgumentError(f"expected metric among {fitting} for {name} given as {kind}, got {metric!r}")
    return metric


def is_tensor_pairs(pairs: object) -> bool:
    """Whether ``pairs`` is a ``(queries, values)`` pair of tensors (rather than a list of text pairs)."""
    return isinstance(pairs, tuple) and len(pairs) == 2 and all(isinstance(p, Tensor) for p in pairs)


def check_pairs(pairs: object, name: str, db: DatabaseProtocol) -> None:
    """Check training or evaluation pairs against a database, before any work.

    Args:
        pairs: ``[(query text, target text), ...]`` or ``(queries (n, dim), values (n, value_dim))``.
        name: the argument's name, for the messages.
        db: the database the pairs are for.

    Raises:
        InvalidArgumentError: not pairs, no pairs, a malformed pair, or text pairs for a database without an
            encoder of query text.
        DimensionMismatchError: tensor pairs of the wrong shape.
    """
    if is_tensor_pairs(pairs):
        queries, values = pairs
        check_real_tensor(queries, f"{name} queries")
        check_real_tensor(values, f"{name} values")
        if queries.dim() != 2 or queries.shape[1] != db.dim:
            raise DimensionMismatchError(f"expected {name} queries of shape (n, {db.dim}), got {tuple(queries.shape)}")
        if values.dim() != 2 or values.shape != (queries.shape[0], db.value_dim):
            raise DimensionMismatchError(
                f"expected {name} values of shape ({queries.shape[0]}, {db.value_dim}), got {tuple(values.shape)}"
            )
        if queries.shape[0] == 0:
            raise InvalidArgumentError(f"expected at least one {name} pair, got none")
        return
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Sequence):
        raise InvalidArgumentError(
            f"expected {name} as a list of (query text, target text) or a (queries, values) tensor pair, "
            f"got {type(pairs).__name__}"
        )
    if not pairs:
        raise InvalidArgumentError(f"expected at least one {name} pair, got none")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise InvalidArgumentError(f"expected {name}[{i}] as (query text, target text), got {pair!r:.80}")
        if not pair[0].strip():
            raise InvalidArgumentError(f"expected a non-empty query text in {name}[{i}], got {pair[0]!r}")
        check_unicode(pair[0], f"the query of {name}[{i}]")
        check_unicode(pair[1], f"the target of {name}[{i}]")
    if db.encoder is None and db.query_encoder is None:
        raise InvalidArgumentError(f"expected {name} as tensors: this database has no encoder for query text")


def _shown(texts: Sequence[str]) -> str:
    """Up to :data:`SHOWN_TARGETS` distinct texts, quoted, for a message."""
    unique = list(dict.fromkeys(texts))[:SHOWN_TARGETS]
    return ", ".join(repr(t) for t in unique)


def _hint(matched: int, total: int, what: str, option: str) -> str:
    """The hint for targets of the other kind: when all or most of the missing texts are of that kind."""
    if total == 0 or 2 * matched < total:
        return ""
    share = "they are" if matched == total else f"most of them ({matched} of {total}) are"
    return f"; {share} {what}: pass {option}"


def check_targets(
    db: DatabaseProtocol, texts: Sequence[str], targets: TargetKind, name: str = "pairs"
) -> Tensor | None:
    """Check that every target text matches a stored record, before any work.

    With ``targets="key"`` a target must be a stored key; with ``targets="value"`` the value text of some
    stored record. When the missing ones (all, or most) are of the other kind, the message says to pass the
    other ``targets=``.

    Args:
        db: the database.
        texts: n target texts.
        targets: ``"key"`` or ``"value"``.
        name: the pairs' argument name, for the message.

    Returns:
        (n,) int64 ids on the CPU for key targets; None for value targets.

    Raises:
        UnknownTargetError: a target text is no stored key (key targets) or no stored value text (value
            targets); the message says how many of how many, shows a few, says where (the error's ``positions``)
            and hints at the other ``targets=`` when they are of the other kind. It is a KeyNotFoundError and an
            InvalidArgumentError, the types the two sides raised before.
    """
    if targets == "key":
        return _key_ids(db, list(texts), name)  # (n,)
    _check_value_texts(db, list(texts), name)
    return None


def _key_ids(db: DatabaseProtocol, texts: list[str], name: str) -> Tensor:
    """(n,) ids of key texts; UnknownTargetError (with a hint at value targets) when one is not stored."""
    ids = db.ids_of_keys(texts)  # (n,)
    at = [i for i, id_ in enumerate(ids.tolist()) if id_ < 0]
    unique = list(dict.fromkeys(texts[i] for i in at))
    other = int(db.values_present(unique).sum())  # always called: collective on a sharded database
    if at:
        raise _unknown(texts, at, name, "key", other, len(unique))
    return ids  # (n,)


def _check_value_texts(db: DatabaseProtocol, texts: list[str], name: str) -> None:
    """UnknownTargetError (with a hint at key targets) when a text is the value text of no stored record."""
    present = db.values_present(texts)  # (n,) bool
    at = [i for i, ok in enumerate(present.tolist()) if not ok]
    unique = list(dict.fromkeys(texts[i] for i in at))
    other = int((db.ids_of_keys(unique) >= 0).sum())  # always called: collective on a sharded database
    if at:
        raise _unknown(texts, at, name, "value", other, len(unique))


def _unknown(texts: list[str], at: list[int], name: str, targets: str, other: int, unique: int) -> UnknownTargetError:
    """The error for the targets at positions ``at`` of ``texts`` that match no stored key / value text: how many,
    a few of them, where, and a hint at the other ``targets=`` when ``other`` of the ``unique`` are of that kind."""
    if targets == "key":
        what, hint = "stored key", _hint(other, unique, "stored value texts", 'targets="value" (with an answer loss)')
    else:
        what, hint = "stored value text", _hint(other, unique, "stored keys", 'targets="key"')
    where = ", ".join(map(str, at[:SHOWN_TARGETS])) + (
        f" and {len(at) - SHOWN_TARGETS} more" if len(at) > SHOWN_TARGETS else ""
    )
    return UnknownTargetError(
        f"{name}: {len(at)} of {len(texts)} target texts are no {what} (e.g. {_shown([texts[i] for i in at])}), "
        f"at position{'s' if len(at) > 1 else ''} {where}{hint}",
        pairs=name,
        positions=at,
        targets=targets,
        other_kind=bool(hint),
    )


def target_ids(db: DatabaseProtocol, keys: Sequence[str], name: str = "pairs") -> Tensor:
    """The ids of the records with these keys.

    Args:
        db: the database.
        keys: n key texts.
        name: the pairs' argument name, for the message.

    Returns:
        (n,) int64 ids on the CPU.

    Raises:
        UnknownTargetError: a key is not stored (see :func:`check_targets`: how many, a few of them, where, a hint).
    """
    return _key_ids(db, list(keys), name)  # (n,)


def hit_matrix(db: DatabaseProtocol, ids: Tensor, targets: Tensor | None, texts: Sequence[str] | None) -> Tensor:
    """Where a candidate is a right answer: the target record, or a record holding the target value text.

    Args:
        db: the database (read for the value texts when ``targets`` is None).
        ids: (b, k) candidate ids, -1 where none.
        targets: (b,) target ids (key targets), or None.
        texts: b target value texts (value targets), used when ``targets`` is None.

    Returns:
        (b, k) bool on the device of ``ids``; False on -1.
    """
    if targets is not None:
        return (ids == targets.to(ids.device).unsqueeze(1)) & (ids >= 0)  # (b, k)
    if texts is None:
        raise InvalidArgumentError("expected target ids or target value texts, got neither")
    flat = ids.reshape(-1).cpu().tolist()  # b * k ids
    value_of = db.value_texts([i for i in flat if i >= 0])
    k = ids.shape[1]
    hits = [i >= 0 and value_of.get(i) == texts[pos // k] for pos, i in enumerate(flat)]
    return torch.tensor(hits, dtype=torch.bool, device=ids.device).reshape(ids.shape)  # (b, k)


def ranked_ids(retriever: CandidateSource, queries: Tensor, k: int, score: str | ScoreFn) -> Tensor:
    """The ``k`` candidates the index picks for each query, best first by ``score`` recomputed in torch.

    Args:
        retriever: what picks the candidates: the database, or a draft generation of it (anything with
            ``candidates(queries, k)``).
        queries: (b, dim) query embeddings.
        k: candidates per query.
        score: the score that orders them (a name or a callable); missing candidates (-1) come last.

    Returns:
        (b, t) ids, t = min(k, records), -1 where none.
    """
    cand = retriever.candidates(queries, k)  # ids (b, t), keys (b, t, dim), mask (b, t)
    scores = compute_scores(queries.to(cand.keys.device).unsqueeze(1), cand.keys, score).squeeze(1)  # (b, t)
    scores = scores.masked_fill(~cand.mask, -math.inf)  # (b, t)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)  # (b, t)
    return cand.ids.gather(1, order.to(cand.ids.device))  # (b, t)


def _reranked_ids(
    db: DatabaseProtocol, team: Team, similarity: Similarity, texts: list[str], ids: Tensor, k: int
) -> Tensor:
    """(b, min(k, t)) of ``ids`` (b, t): each row re-ordered by ``similarity`` of its key texts to the query text."""
    keys = db.key_texts(ids)  # b * t texts, None for -1 and keys given as embeddings; collective when sharded
    t = ids.shape[1]
    orders = team.agree(
        lambda: [rerank_order(similarity, text, keys[i * t : (i + 1) * t]) for i, text in enumerate(texts)]
    )
    order = torch.tensor(orders, dtype=torch.long, device=ids.device).reshape(len(texts), t)  # (b, t)
    return ids.gather(1, order)[:, :k]  # (b, min(k, t))


@torch.no_grad()
def evaluate(
    db: DatabaseProtocol,
    pairs: Sequence[tuple[str, str]],
    *,
    k: int = 10,
    targets: TargetKind = "key",
    query_encoder: Encoder | None = None,
    score: str | ScoreFn | None = None,
    batch_size: int = 512,
    retriever: CandidateSource | None = None,
    rerank: Rerank | None = None,
) -> dict[str, float]:
    """Retrieval metrics of a database on (query text, target) pairs: recall@1, recall@k and MRR over the top k.

    A query counts as answered at rank r when the r-th best candidate (by ``score``, among the ``k`` the index
    picks) is the target record (``targets="key"``) or holds the target value text (``targets="value"``). With
    ``rerank``, the candidates are the top ``max(k, 32)`` re-ordered by the re-ranker, the first ``k`` kept, as
    ``db.search(query, k, rerank=rerank)`` returns them (:mod:`kvsearch.text.rerank`; not differentiable: a measure,
    not a training signal).

    Args:
        db: the database.
        pairs: ``(query text, target key)`` or ``(query text, target value text)`` pairs.
        k: candidates per query.
        targets: how the target is given, ``"key"`` or ``"value"``.
        query_encoder: encodes the queries; default ``db.query_encoder``, else ``db.encoder``.
        score: re-ranks the candidates; default the database's score.
        batch_size: queries per index search.
        retriever: what picks the candidates (anything with ``candidates(queries, k)``, such as the draft
            generation of a fine-tuning run); default the database.
        rerank: a re-ranker name of :data:`~kvsearch.text.rerank.RERANKERS` or a callable ``(query_text, key_text) ->
            float``; default none (the order of ``score``).

    Returns:
        ``{"recall@1": ..., "recall@k": ..., "mrr": ...}``, fractions in [0, 1].

    Raises:
        InvalidArgumentError: bad pairs, k, batch size or retriever.
        UnknownTargetError: a target key is not stored (a KeyNotFoundError; see :func:`check_targets`).
        UnknownOptionError: an unknown ``targets`` or ``rerank`` name.
        MissingDependencyError: a ``rerank`` name and no rapidfuzz (``pip install "kvsearch[fuzzy]"``).
        NonFiniteError: the query encoder gives NaN or Inf (e.g. diverged weights).
    """
    team = team_of(db)  # a sharded database's ranks: each evaluates its own pairs, the metrics are over all

    def check() -> tuple[int, int, Any, Similarity | None]:
        similarity = None if rerank is None else check_rerank(rerank)
        check_pairs(pairs, "pairs", db)
        if is_tensor_pairs(pairs):
            raise InvalidArgumentError("expected (query text, target) pairs for retrieval metrics, got tensors")
        if not isinstance(targets, str) or targets not in TARGET_KINDS:
            raise UnknownOptionError(f"expected targets among {TARGET_KINDS}, got {targets!r}")
        source: Any = db if retriever is None else retriever
        if not callable(getattr(source, "candidates", None)):
            raise InvalidArgumentError(f"expected a retriever with candidates(queries, k), got {type(source).__name__}")
        if query_encoder is not None and not isinstance(query_encoder, Encoder):
            raise InvalidArgumentError(
                f"expected a kvsearch Encoder or None as query_encoder, got {type(query_encoder).__name__}"
            )
        return check_k(k), check_int(batch_size, "batch_size"), source, similarity

    k, batch_size, source, similarity = team.agree(check)
    encoder = next(e for e in (query_encoder, db.query_encoder, db.encoder) if e is not None)
    score = db.score if score is None else score
    queries = [normalize_key(q) for q, _ in pairs]  # as Database.query encodes text queries
    wanted = team.agree(lambda: target_ids(db, [t for _, t in pairs], "pairs")) if targets == "key" else None
    sums = torch.zeros(4, dtype=torch.float64)  # queries, hits at 1, hits in the top k, reciprocal ranks
    for rows in batches(team, len(pairs), batch_size):
        chunk = queries[rows]
        q = encoder.encode(chunk).float() if chunk else torch.zeros(0, db.dim)  # (b, dim)
        if team.max(int(not all_finite(q))):
            raise NonFiniteError(f"expected finite query embeddings, got NaN or Inf for pairs[{rows.start}:]")
        if similarity is None:
            ids = ranked_ids(source, q, k, score)  # (b, t)
        else:  # the top max(k, 32), re-ordered by the re-ranker, the first k kept
            ids = _reranked_ids(db, team, similarity, chunk, ranked_ids(source, q, rerank_depth(k), score), k)
        tid = None if wanted is None else wanted[rows]  # (b,)
        texts = None if wanted is not None else [t for _, t in pairs[rows]]
        hits = hit_matrix(db, ids, tid, texts).cpu()  # (b, t)
        rank = torch.where(hits.any(-1), hits.float().argmax(-1), -1)  # (b,) 0-based, -1 = missed
        found = rank >= 0  # (b,)
        reciprocal = torch.where(found, 1.0 / (rank + 1).clamp(min=1), 0.0)  # (b,)
        sums += torch.tensor(
            [len(rank), float((rank == 0).sum()), float(found.sum()), float(reciprocal.double().sum())],
            dtype=torch.float64,
        )
    total = team.sum(sums)
    return {
        "recall@1": float(total[1] / total[0]),
        "recall@k": float(total[2] / total[0]),
        "mrr": float(total[3] / total[0]),
    }
