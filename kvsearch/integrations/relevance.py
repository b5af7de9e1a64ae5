"""A database's similarity scores as relevances in [0, 1]: LangChain's relevance and Haystack's ``scale_score``.

Both frameworks want a hit's score on [0, 1], higher is more relevant, and kvsearch's scores are unbounded
similarities (higher is closer). One map per database score (:data:`~kvsearch.nn.scores.DB_SCORES`; each is the
registry's ``ScoreKind.relevance``, so a new score brings its own), each defined, finite, in [0, 1] and
non-decreasing in the score for every float (``±inf`` included; NaN gives 0.0), computed in forms that never
overflow:

- ``cosine`` (in [-1, 1]): ``(1 + s) / 2``, clamped to [0, 1] (float32 rounding may pass 1 by an ulp) — LangChain's
  ``1 - distance`` on the cosine distance, and Haystack's in-memory store's scaling of a cosine.
- ``dot``, ``scaled_dot`` (unbounded): the logistic ``1 / (1 + exp(-s))``, with ``-s`` clipped at 709 so that
  ``math.exp`` never overflows (a score below -709 gets ~1e-308 instead of an OverflowError). It is 0.5 at ``s = 0``
  and saturates beyond ``|s| ~ 37``. Haystack's ``scale_score`` divides the score by 100 first, as its in-memory
  store does for a dot product (``expit(s / 100)``), so that unnormalised scores do not all saturate.
- ``gaussian`` (``s = -|q - k|^2 / 2 <= 0``, so the distance is ``d = sqrt(-2 s)``): ``1 / (1 + d / sqrt(2))``
  ``= 1 / (1 + sqrt(-s))``. LangChain's own relevance for a Euclidean distance, ``1 - d / sqrt(2)``, assumes unit
  embeddings and is negative past ``d = sqrt(2)``; this one has the same value and slope at ``d = 0`` (1, then
  ``1 - d / sqrt(2)`` to first order), gives 0.5 at ``d = sqrt(2)`` (orthogonal unit vectors, as the cosine's
  relevance does), and decays as ``sqrt(2) / d`` instead of reaching 0: on unnormalised embeddings (distances in
  the tens) hits stay apart (distance 10: 0.12, 50: 0.028) where ``exp(s)`` gave every one but near-duplicates 0.0.
  A relevance threshold ``r`` keeps the hits within distance ``sqrt(2) (1 - r) / r``.

It knows score names and floats only: nothing of databases, documents or either framework.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsearch.errors import UnknownOptionError
from kvsearch.nn.scores import DB_SCORES, SCORE_KINDS

__all__ = ["RELEVANCES", "relevance_fn", "scaled_score_fn", "check_score_name"]

_HAYSTACK_DOT_SCALE = 100.0  # haystack.document_stores.in_memory's DOT_PRODUCT_SCALING_FACTOR

#: A database score's relevance in [0, 1] (LangChain's ``similarity_search_with_relevance_scores``): the registry's.
RELEVANCES: dict[str, Callable[[float], float]] = {name: SCORE_KINDS[name].relevance for name in DB_SCORES}


def _scaled_logistic(score: float) -> float:
    """Haystack's dot-product scaling, ``expit(score / 100)``, in a form that never overflows."""
    return RELEVANCES["dot"](score / _HAYSTACK_DOT_SCALE)


#: A database score scaled to [0, 1] as Haystack's in-memory store does with ``scale_score=True``.
_SCALED: dict[str, Callable[[float], float]] = {
    **RELEVANCES,
    "dot": _scaled_logistic,
    "scaled_dot": _scaled_logistic,
}


def check_score_name(score: object) -> None:
    """Refuse a ``score=`` database option that no database can use (a callable, an unknown name); None is the
    database's default.

    Raises:
        UnknownOptionError: anything but None or a name among :data:`~kvsearch.nn.scores.DB_SCORES`.
    """
    if score is not None and (not isinstance(score, str) or score not in DB_SCORES):
        shown = f"a callable, {score!r}" if callable(score) else repr(score)
        raise UnknownOptionError(
            f"expected score= as one of {', '.join(map(repr, DB_SCORES))} (a database searches by a named score; "
            f"a score callable is for kvsearch.attend and KVAttention), got {shown}"
        )


def relevance_fn(score: str, *, scaled: bool = False) -> Callable[[float], float]:
    """The relevance in [0, 1] of a database score (see the module docstring for each).

    Args:
        score: the database's score name.
        scaled: Haystack's ``scale_score=True`` instead of LangChain's relevance: a dot product (``dot``,
            ``scaled_dot``) as ``expit(s / 100)``, as its in-memory store scales it; the others the same.

    Returns:
        A function of one hit's score: defined, finite, in [0, 1] and non-decreasing for every float.

    Raises:
        UnknownOptionError: a name that is not a database score.
    """
    check_score_name(score)
    return (_SCALED if scaled else RELEVANCES)[score]


def scaled_score_fn(score: str) -> Callable[[float], float]:
    """``relevance_fn(score, scaled=True)``: a database score scaled to [0, 1] as Haystack's in-memory store does."""
    return relevance_fn(score, scaled=True)
