"""Retrieval metrics on (query, target) pairs: recall@1, recall@k and MRR, and the pairs they are measured on.

    metrics = evaluate(db, [("Липтон", "Lipton"), ...], k=10)   # {"recall@1": ..., "recall@k": ..., "mrr": ...}

A pair is ``(query text, target text)``; ``targets="key"`` reads the target as the key of the right record,
``targets="value"`` as the value text of the answer (any record holding it counts). Fine-tuning measures its
runs with :func:`evaluate` and checks its pairs with :func:`check_pairs`.

This module owns the metrics, their ranking helpers and the checks of the pairs. It talks to the database
through its public methods only (``candidates``, ``ids_of_keys``, ``value_texts``, the encoders); it knows
nothing of the store, the index, the losses or the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

import torch
from torch import Tensor

from kvsearch.attention import ScoreFn, compute_scores
from kvsearch.checks import check_int, check_k
from kvsearch.errors import (
    DimensionMismatchError,
    InvalidArgumentError,
    KeyNotFoundError,
    UnknownOptionError,
)

if TYPE_CHECKING:
    from kvsearch.database import Database
    from kvsearch.encoders import Encoder

__all__ = [
    "TargetKind",
    "TARGET_KINDS",
    "Pairs",
    "is_tensor_pairs",
    "check_pairs",
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


def is_tensor_pairs(pairs: object) -> bool:
    """Whether ``pairs`` is a ``(queries, values)`` pair of tensors (rather than a list of text pairs)."""
    return isinstance(pairs, tuple) and len(pairs) == 2 and all(isinstance(p, Tensor) for p in pairs)


def check_pairs(pairs: object, name: str, db: Database) -> None:
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
    if db.encoder is None and db.query_encoder is None:
        raise InvalidArgumentError(f"expected {name} as tensors: this database has no encoder for query text")


def target_ids(db: Database, keys: Sequence[str]) -> Tensor:
    """The ids of the records with these keys.

    Args:
        db: the database.
        keys: n key texts.

    Returns:
        (n,) int64 ids on the CPU.

    Raises:
        KeyNotFoundError: a key is not stored (the message shows the first few).
    """
    ids = db.ids_of_keys(list(keys))  # (n,)
    if bool((ids < 0).any()):
        missing = [key for key, id_ in zip(keys, ids.tolist()) if id_ < 0]
        raise KeyNotFoundError(
            f"expected target keys stored in the database, got {len(missing)} that are not: {missing[:5]!r}"
        )
    return ids  # (n,)


def hit_matrix(db: Database, ids: Tensor, targets: Tensor | None, texts: Sequence[str] | None) -> Tensor:
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


def ranked_ids(db: Database, queries: Tensor, k: int, score: str | ScoreFn) -> Tensor:
    """The ``k`` candidates the index picks for each query, best first by ``score`` recomputed in torch.

    Args:
        db: the database.
        queries: (b, dim) query embeddings.
        k: candidates per query.
        score: the score that orders them (a name or a callable); missing candidates (-1) come last.

    Returns:
        (b, t) ids, t = min(k, records), -1 where none.
    """
    cand = db.candidates(queries, k)  # ids (b, t), keys (b, t, dim), mask (b, t)
    scores = compute_scores(queries.to(cand.keys.device).unsqueeze(1), cand.keys, score).squeeze(1)  # (b, t)
    scores = scores.masked_fill(~cand.mask, -math.inf)  # (b, t)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)  # (b, t)
    return cand.ids.gather(1, order.to(cand.ids.device))  # (b, t)


@torch.no_grad()
def evaluate(
    db: Database,
    pairs: Sequence[tuple[str, str]],
    *,
    k: int = 10,
    targets: TargetKind = "key",
    query_encoder: Encoder | None = None,
    score: str | ScoreFn | None = None,
    batch_size: int = 512,
) -> dict[str, float]:
    """Retrieval metrics of a database on (query text, target) pairs: recall@1, recall@k and MRR over the top k.

    A query counts as answered at rank r when the r-th best candidate (by ``score``, among the ``k`` the index
    picks) is the target record (``targets="key"``) or holds the target value text (``targets="value"``).

    Args:
        db: the database.
        pairs: ``(query text, target key)`` or ``(query text, target value text)`` pairs.
        k: candidates per query.
        targets: how the target is given, ``"key"`` or ``"value"``.
        query_encoder: encodes the queries; default ``db.query_encoder``, else ``db.encoder``.
        score: re-ranks the candidates; default the database's score.
        batch_size: queries per index search.

    Returns:
        ``{"recall@1": ..., "recall@k": ..., "mrr": ...}``, fractions in [0, 1].

    Raises:
        InvalidArgumentError: bad pairs, k or batch size.
        KeyNotFoundError: a target key is not stored.
        UnknownOptionError: an unknown ``targets``.
    """
    check_pairs(pairs, "pairs", db)
    if is_tensor_pairs(pairs):
        raise InvalidArgumentError("expected (query text, target) pairs for retrieval metrics, got tensors")
    if not isinstance(targets, str) or targets not in TARGET_KINDS:
        raise UnknownOptionError(f"expected targets among {TARGET_KINDS}, got {targets!r}")
    k = check_k(k)
    batch_size = check_int(batch_size, "batch_size")
    encoder = next(e for e in (query_encoder, db.query_encoder, db.encoder) if e is not None)
    score = db.score if score is None else score
    queries = [q for q, _ in pairs]
    wanted = target_ids(db, [t for _, t in pairs]) if targets == "key" else None  # (n,)
    first = []
    for start in range(0, len(pairs), batch_size):
        q = encoder.encode(queries[start : start + batch_size]).float()  # (b, dim)
        ids = ranked_ids(db, q, k, score)  # (b, t)
        tid = None if wanted is None else wanted[start : start + batch_size]  # (b,)
        texts = None if wanted is not None else [t for _, t in pairs[start : start + batch_size]]
        hits = hit_matrix(db, ids, tid, texts)  # (b, t)
        rank = torch.where(hits.any(-1), hits.float().argmax(-1), -1)  # (b,) 0-based, -1 = missed
        first.append(rank.cpu())
    rank = torch.cat(first)  # (n,)
    found = rank >= 0  # (n,)
    return {
        "recall@1": float((rank == 0).float().mean()),
        "recall@k": float(found.float().mean()),
        "mrr": float(torch.where(found, 1.0 / (rank + 1).clamp(min=1), 0.0).mean()),
    }
