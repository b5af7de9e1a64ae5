"""Query-time re-ranking of search hits by a string similarity between the query text and each key text.

    db.search("Lipten", k=5, rerank="osa")                      # the top 32 by the index, re-ordered by spelling
    db.search("Lipten", k=5, rerank=lambda q, key: my_sim(q, key))

The index ranks by embeddings; a misspelt query may find the right key among its candidates but not first. A
re-ranker fetches the top ``max(k, RERANK_DEPTH)`` candidates in the database's order, re-orders them by a
similarity of their key text to the query text (higher first; ties keep the database's order; hits without a key
text, keys given as embeddings, go last) and keeps the first ``k``. ``Hit.score`` stays the database's score: the
order of the hits is the re-ranker's, not the scores'.

The named similarities (:data:`RERANKERS`) are those of `rapidfuzz <https://rapidfuzz.github.io/RapidFuzz/>`_
(``pip install "kvsearch[fuzzy]"``), ``normalized_similarity`` in [0, 1] of the case-folded texts:

- ``"osa"``: optimal string alignment — Levenshtein plus the swap of two adjacent characters ("Lipotn").
- ``"levenshtein"``: insertions, deletions and substitutions.
- ``"jaro_winkler"``: Jaro similarity with a bonus for a common prefix (short names, typos late in the word).
- ``"indel"``: insertions and deletions only (a substitution costs two).

A callable ``(query_text, key_text) -> float`` (higher is more similar) may be given instead.

Re-ranking is outside the differentiable path: it orders plain search hits (:meth:`Database.search
<kvsearch.Database.search>`, and :func:`~kvsearch.training.metrics.evaluate` to measure it); ``query()``,
:class:`~kvsearch.KVAttention` and fine-tuning are unaffected, and no gradient flows through a similarity.

This module knows nothing of the index, the store or torch: it is handed query texts and hits (or key texts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Real

from kvsearch.errors import InvalidArgumentError, MissingDependencyError, UnknownOptionError
from kvsearch.results import Hit

__all__ = [
    "Similarity",
    "Rerank",
    "RERANKERS",
    "RERANK_DEPTH",
    "check_rerank",
    "rerank_depth",
    "require_texts",
    "rerank_order",
    "rerank_hits",
]

#: ``(query_text, key_text) -> similarity``, higher is more similar.
Similarity = Callable[[str, str], float]
#: What ``rerank=`` takes: a name of :data:`RERANKERS` or a :data:`Similarity`.
Rerank = str | Similarity

#: The named similarities -> their ``rapidfuzz.distance`` module (``normalized_similarity`` of case-folded texts).
_MODULES = {"osa": "OSA", "levenshtein": "Levenshtein", "jaro_winkler": "JaroWinkler", "indel": "Indel"}
#: The names ``rerank=`` accepts.
RERANKERS: tuple[str, ...] = tuple(_MODULES)
#: How many candidates a re-ranked search fetches at least: the top ``max(k, RERANK_DEPTH)`` are re-ordered.
RERANK_DEPTH = 32


def check_rerank(rerank: object) -> Similarity:
    """The similarity function that ``rerank=`` names, checked before any work.

    Args:
        rerank: a name of :data:`RERANKERS`, or a callable ``(query_text, key_text) -> float``.

    Returns:
        A function ``(query_text, key_text) -> float``: for a name, rapidfuzz's ``normalized_similarity`` of the
        case-folded texts; a callable is returned as it is.

    Raises:
        UnknownOptionError: a name that is not in :data:`RERANKERS`.
        InvalidArgumentError: neither a str nor a callable.
        MissingDependencyError: a name, and rapidfuzz is not installed (``pip install "kvsearch[fuzzy]"``).
    """
    if isinstance(rerank, str):
        if rerank not in _MODULES:
            raise UnknownOptionError(f"expected rerank among {RERANKERS} or a callable, got {rerank!r}")
        try:
            from rapidfuzz import distance  # optional: only a named re-ranker needs it
        except ImportError as exc:
            raise MissingDependencyError(
                f'rerank={rerank!r} needs rapidfuzz: pip install "kvsearch[fuzzy]" ({exc})'
            ) from exc
        return _casefolded(getattr(distance, _MODULES[rerank]).normalized_similarity, rerank)
    if not callable(rerank):
        raise InvalidArgumentError(
            f"expected rerank as a name among {RERANKERS} or a callable (query_text, key_text) -> float, "
            f"got {type(rerank).__name__}"
        )
    return rerank


def _casefolded(similarity: Callable[..., float], name: str) -> Similarity:
    """``similarity`` of the case-folded texts."""

    def folded(query_text: str, key_text: str) -> float:
        return float(similarity(query_text.casefold(), key_text.casefold()))

    folded.__name__ = folded.__qualname__ = name
    return folded


def rerank_depth(k: int) -> int:
    """How many candidates a re-ranked search of ``k`` hits fetches: ``max(k, RERANK_DEPTH)``."""
    return max(k, RERANK_DEPTH)


def require_texts(texts: Sequence[str] | None, count: int) -> list[str]:
    """The query texts of a re-ranked search: InvalidArgumentError for query embeddings.

    Args:
        texts: the query texts, or None when the queries came as embeddings.
        count: how many queries came (0: nothing to re-rank, embeddings or not).

    Raises:
        InvalidArgumentError: embeddings came (a re-ranker compares texts).
    """
    if texts is None:
        if count == 0:
            return []
        raise InvalidArgumentError(
            "rerank needs text queries (it compares the query text with the key texts), got query embeddings"
        )
    return list(texts)


def _similarity(similarity: Similarity, query_text: str, key_text: str) -> float:
    """``similarity(query_text, key_text)`` as a float; InvalidArgumentError when it is not a finite real."""
    value = similarity(query_text, key_text)
    if isinstance(value, Real) and math.isfinite(value):
        return float(value)
    raise InvalidArgumentError(
        f"expected the reranker to return a finite real number, got {value!r:.60} for the query {query_text!r:.80} "
        f"and the key {key_text!r:.80}"
    )


def rerank_order(similarity: Similarity, query_text: str, keys: Sequence[str | None]) -> list[int]:
    """The positions of ``keys``, most similar to ``query_text`` first.

    Args:
        similarity: ``(query_text, key_text) -> float``, higher is more similar.
        query_text: the query.
        keys: the candidates' key texts in the database's order; None for a candidate without one (a key given as
            an embedding, or no candidate).

    Returns:
        ``range(len(keys))`` re-ordered: by similarity, descending, ties in the given order; None keys last, in
        the given order.

    Raises:
        InvalidArgumentError: ``similarity`` returned something that is not a finite real number.
    """
    scored = [(-_similarity(similarity, query_text, key), pos) for pos, key in enumerate(keys) if key is not None]
    return [pos for _, pos in sorted(scored)] + [pos for pos, key in enumerate(keys) if key is None]


def rerank_hits(similarity: Similarity, texts: Sequence[str], hits: Sequence[list[Hit]], k: int) -> list[list[Hit]]:
    """Each query's hits re-ordered by ``similarity`` (see :func:`rerank_order`), the first ``k`` kept.

    Args:
        similarity: ``(query_text, key_text) -> float``.
        texts: one query text per list of hits.
        hits: per query, its candidates in the database's order (typically the top :func:`rerank_depth`).
        k: how many hits to keep per query.

    Returns:
        One list of at most ``k`` hits per query; each hit as it came (its ``score`` the database's).

    Raises:
        InvalidArgumentError: ``similarity`` returned something that is not a finite real number.
    """
    out = []
    for text, row in zip(texts, hits, strict=True):
        order = rerank_order(similarity, text, [hit.key for hit in row])
        out.append([row[pos] for pos in order[:k]])
    return out
