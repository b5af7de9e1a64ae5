"""Attention in pure torch: score functions, pooling, the functional ``attend`` and the layers.

Queries are scored against candidate keys, the scores are pooled into weights, and the
weights blend the candidates' values:

    output = pool(score(queries, keys), mask) @ values

This module knows nothing of FAISS, SQLite or text: the database hands it gathered
candidate tensors (a ``Candidates``) and gets back torch tensors that gradients flow
through.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsearch.checks import COSINE_EPS, all_finite, check_dim, check_finite, check_k, check_temperature
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, NonFiniteError, UnknownOptionError

__all__ = [
    "ScoreName",
    "PoolingName",
    "ScoreFn",
    "SCORES",
    "POOLINGS",
    "Candidates",
    "check_score",
    "compute_scores",
    "pool",
    "attend",
    "AdditiveScore",
    "GaussianKernel",
    "KVAttention",
]

ScoreName = Literal["dot", "scaled_dot", "cosine", "gaussian", "additive"]
PoolingName = Literal["softmax", "normalize", "nonnegative", "hard", "exact", "average"]
ScoreFn = Callable[[Tensor, Tensor], Tensor]

SCORES: tuple[str, ...] = get_args(ScoreName)
POOLINGS: tuple[str, ...] = get_args(PoolingName)

_MATCH_CHUNK = 1 << 24  # elements of the (..., n, m, dim) comparison that _exact_matches builds at once
_ADDITIVE_HINT = (
    "the additive score has learned weights, so it cannot be named by a string here: "
    "expected a callable such as AdditiveScore(query_dim, key_dim, hidden), got 'additive' "
    "(KVAttention(score='additive') creates the module for you)"
)


@dataclass
class Candidates:
    """The candidates a database gathered for a batch of queries.

    Per query (``k`` an int): ``ids`` (batch, k) with -1 where no candidate exists,
    ``keys`` (batch, k, dim) and ``values`` (batch, k, value_dim) with zeros there, ``mask``
    (batch, k) True where the candidate exists, ``match`` (batch, k) True where the key
    matches the query exactly (None: ``attend`` compares the embeddings).
    Shared by every query (``k="all"``): ``ids`` (m,), ``keys`` (m, dim), ``values``
    (m, value_dim), ``mask`` None or (m,).
    """

    ids: Tensor
    keys: Tensor
    values: Tensor
    mask: Tensor | None
    match: Tensor | None = None


# ----------------------------------------------------------------------------- checks


def _describe(x: object) -> str:
    """A short description of an argument for error messages."""
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"


def _check_option(value: object, valid: tuple[str, ...], what: str) -> str:
    """Return ``value`` if it is one of ``valid``, else raise UnknownOptionError."""
    if not isinstance(value, str) or value not in valid:
        raise UnknownOptionError(f"unknown {what}: expected one of {', '.join(valid)}, got {value!r}")
    return value


def check_score(score: object) -> None:
    """Accept a callable or a built-in score name; "additive" needs its module."""
    if callable(score):
        return
    if not isinstance(score, str):
        raise InvalidArgumentError(
            f"score must be one of {', '.join(SCORES)} or a callable (queries, keys) -> scores, got {_describe(score)}"
        )
    if score == "additive":
        raise InvalidArgumentError(_ADDITIVE_HINT)
    _check_option(score, SCORES, "score")


def _check_dropout(dropout: object) -> float:
    """Return ``dropout`` as a float if it is a probability in [0, 1)."""
    if isinstance(dropout, bool) or not isinstance(dropout, Real) or not 0 <= dropout < 1:
        raise InvalidArgumentError(f"dropout must be a number in [0, 1), got {dropout!r}")
    return float(dropout)


def _check_float_tensor(x: object, name: str) -> None:
    """Raise InvalidArgumentError unless ``x`` is a floating-point tensor."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise InvalidArgumentError(f"{name} must be a floating-point tensor, got {_describe(x)}")


def _check_pairing(score: object, pooling: str) -> None:
    """Refuse a score whose values the pooling would turn into all-zero weights.

    The gaussian score ``-|q - k|^2 / 2`` is never positive, and ``normalize`` / ``nonnegative`` keep only the
    positive part of the scores: every weight would be 0 and every answer "nothing found".

    Raises:
        InvalidArgumentError: ``score="gaussian"`` with ``pooling`` ``normalize`` or ``nonnegative``.
    """
    if isinstance(score, str) and score == "gaussian" and pooling in ("normalize", "nonnegative"):
        raise InvalidArgumentError(
            f"pooling {pooling!r} keeps the non-negative part of the scores, but the gaussian score "
            "-|q - k|^2 / 2 is never positive, so every weight would be 0; expected softmax (Nadaraya-Watson), "
            "hard, exact or average pooling with the gaussian score, or a score that can be positive"
        )


def _check_pair(queries: Tensor, keys: Tensor) -> None:
    """Check queries (..., n, dim) and keys (..., m, dim) for a built-in score."""
    _check_float_tensor(queries, "queries")
    _check_float_tensor(keys, "keys")
    if queries.dim() < 2 or keys.dim() < 2:
        raise DimensionMismatchError(
            f"expected queries (..., n, dim) and keys (..., m, dim), "
            f"got queries {tuple(queries.shape)} and keys {tuple(keys.shape)}"
        )
    if queries.shape[-1] != keys.shape[-1]:
        raise DimensionMismatchError(
            f"keys must have the queries' dim: expected {queries.shape[-1]}, got {keys.shape[-1]}"
        )
    if queries.shape[-1] == 0:
        raise DimensionMismatchError("embeddings must have dim >= 1, got 0")


def _keep_mask(mask: object, shape: torch.Size, name: str, device: torch.device) -> Tensor:
    """Check a bool mask broadcastable to ``shape`` and return it expanded to ``shape`` on ``device``."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise InvalidArgumentError(f"{name} must be a bool tensor, got {_describe(mask)}")
    try:
        broadcast = torch.broadcast_shapes(mask.shape, shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise InvalidArgumentError(
            f"{name} must broadcast to the weights' shape: expected {tuple(shape)}, got {tuple(mask.shape)}"
        )
    return mask.to(device).expand(shape)  # shape


def _valid_lens_mask(valid_lens: object, shape: torch.Size, device: torch.device) -> Tensor:
    """Turn valid lengths into a keep-mask of ``shape``: positions >= valid_len are dropped."""
    if (
        not isinstance(valid_lens, Tensor)
        or valid_lens.dtype == torch.bool
        or valid_lens.is_floating_point()
        or valid_lens.is_complex()
    ):
        raise InvalidArgumentError(f"valid_lens must be an integer tensor, got {_describe(valid_lens)}")
    allowed = [tuple(shape[:-1])]
    if len(shape) == 3:
        allowed.insert(0, (shape[0],))
    if tuple(valid_lens.shape) not in allowed:
        raise InvalidArgumentError(
            f"valid_lens must have shape {' or '.join(map(str, allowed))}, got {tuple(valid_lens.shape)}"
        )
    if valid_lens.numel() and int(valid_lens.min()) < 0:
        raise InvalidArgumentError(f"valid_lens must be >= 0, got {int(valid_lens.min())}")
    trailing = (1,) * (len(shape) - valid_lens.dim())
    lens = valid_lens.to(device).reshape(*valid_lens.shape, *trailing)  # (batch, 1, 1) | (..., n, 1)
    positions = torch.arange(shape[-1], device=device)  # (m,)
    return (positions < lens).expand(shape)  # shape


def _exact_matches(queries: Tensor, keys: Tensor) -> Tensor:
    """Where each key embedding equals the query embedding exactly.

    Args:
        queries: (..., n, dim).
        keys: (..., m, dim).

    Returns:
        Bool tensor (..., n, m), built a chunk of queries at a time to bound memory.
    """
    if queries.shape[-1] != keys.shape[-1]:
        raise DimensionMismatchError(
            "exact pooling without match compares embeddings, so keys need the queries' dim: "
            f"expected {queries.shape[-1]}, got {keys.shape[-1]}"
        )
    lead = math.prod(torch.broadcast_shapes(queries.shape[:-2], keys.shape[:-2]))
    step = max(1, _MATCH_CHUNK // max(1, lead * keys.shape[-2] * keys.shape[-1]))
    parts = [
        torch.all(chunk.unsqueeze(-2) == keys.unsqueeze(-3), dim=-1)  # (..., step, m)
        for chunk in queries.split(step, dim=-2)
    ]
    return torch.cat(parts, dim=-2)  # (..., n, m)


def _first_true(x: Tensor) -> Tensor:
    """Keep only the first True along the last dim: bool (..., m) -> bool (..., m)."""
    return x & (x.cumsum(-1) == 1)  # (..., m)


def _masked_softmax(scores: Tensor, keep: Tensor, temperature: float) -> Tensor:
    """softmax(scores / temperature) over kept entries; dropped entries and fully dropped rows get exactly 0.

    The row's best kept score is subtracted before dividing by the temperature (softmax does not change), so a
    tiny temperature cannot overflow: every kept entry is <= 0, the best is 0. Never NaN, forward or backward.
    """
    if scores.shape[-1] == 0:
        return torch.softmax(scores, dim=-1)  # (..., 0)
    low = torch.finfo(scores.dtype).min
    top = scores.detach().masked_fill(~keep, low).amax(-1, keepdim=True)  # (..., 1) the best kept score
    scaled = ((scores - top) / temperature).nan_to_num(nan=0.0, posinf=0.0, neginf=low)  # (..., m) <= 0 where kept
    weights = torch.softmax(scaled.masked_fill(~keep, low), dim=-1)  # (..., m) finite; uniform on a dropped row
    return torch.where(keep, weights, 0)  # (..., m)


def _peak(x: Tensor) -> float:
    """The largest absolute entry of a non-empty tensor, in one reduction pass (no copy of ``x``)."""
    low, high = torch.aminmax(x.detach())
    return max(-float(low), float(high))


def _count_nonfinite(x: Tensor) -> int:
    """How many entries of ``x`` are NaN or infinite (for error messages)."""
    return int((~torch.isfinite(x.detach())).sum())


def _largest(x: Tensor) -> float:
    """The largest absolute entry of ``x`` (0 for an empty tensor), for error messages."""
    return _peak(x) if x.numel() else 0.0


def _keep_finite_scores(scores: Tensor, keep: Tensor) -> Tensor:
    """The keep-mask with the candidates scored -inf dropped; NaN or +inf on a kept candidate raises.

    Raises:
        NonFiniteError: a kept candidate's score is NaN or +inf.
    """
    if all_finite(scores):
        return keep
    bad = (torch.isnan(scores) | (scores == math.inf)) & keep  # (..., m)
    if bool(bad.any()):
        raise NonFiniteError(
            "scores must be finite, or -inf for a candidate to drop: expected no NaN or +inf, "
            f"got {int(bad.sum())} in scores of shape {tuple(scores.shape)}"
        )
    return keep & (scores != -math.inf)  # (..., m)


def _unit_rows(x: Tensor) -> Tensor:
    """Rows scaled to unit norm as ``F.normalize`` does (norms clamped to ``COSINE_EPS``: a zero row stays zero).

    A row whose squared norm overflows (entries near 1e19 and above in float32) is first divided by its largest
    entry, which the cosine does not see: its norm is then finite and its direction exact.
    """
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (..., 1)
    if not all_finite(norms):
        peak = x.detach().abs().amax(-1, keepdim=True)  # (..., 1)
        x = x / torch.where(peak > 1, peak, 1)  # (..., dim) huge rows brought to [-1, 1]; small rows as they are
        norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (..., 1)
    return x / norms.clamp(min=COSINE_EPS)  # (..., dim)


def _gaussian(queries: Tensor, keys: Tensor) -> Tensor:
    """-|q - k|^2 / 2 for queries (..., n, dim) and keys (..., m, dim), accurate far from the origin: (..., n, m).

    The expanded form ``|q|^2 - 2 q.k + |k|^2`` cancels catastrophically in float32 when the norms are large next
    to the distance. A query that is the only one of its keys (gathered candidates) is scored by the direct
    difference ``|k - q|^2`` (memory: one copy of its keys). Otherwise both sides are first moved by the same
    vector, the keys' mean (detached): the distance, and its gradient, do not change, and what rounding is left
    is that of the points' spread around their mean, not of their distance to the origin (memory O(n m) plus one
    centred copy of each side).
    """
    if queries.shape[-2] == 1 and torch.broadcast_shapes(queries.shape[:-2], keys.shape[:-2]) == keys.shape[:-2]:
        distances = torch.linalg.vector_norm(keys - queries, dim=-1)  # (..., m): no second copy of the keys
        return -0.5 * distances.square().unsqueeze(-2)  # (..., 1, m)
    reference = keys.detach().mean(-2, keepdim=True)  # (..., 1, dim)
    queries, keys = queries - reference, keys - reference  # (..., n, dim), (..., m, dim)
    dots = queries @ keys.transpose(-2, -1)  # (..., n, m)
    query_sq = queries.pow(2).sum(-1).unsqueeze(-1)  # (..., n, 1)
    key_sq = keys.pow(2).sum(-1).unsqueeze(-2)  # (..., 1, m)
    return -0.5 * (query_sq - 2 * dots + key_sq).clamp(min=0)  # (..., n, m)


# ----------------------------------------------------------------------------- functions


def compute_scores(queries: Tensor, keys: Tensor, score: str | ScoreFn) -> Tensor:
    """Score every query against every key.

    ``dot`` is q.k, ``scaled_dot`` q.k / sqrt(dim), ``cosine`` the dot of the unit vectors
    (a zero vector scores 0; rows too large to square are scaled down first), ``gaussian``
    -||q - k||^2 / 2: the direct difference for a query with keys of its own (n = 1), else
    -(|q'|^2 - 2 q'.k' + |k'|^2) / 2 clamped to <= 0 on q' = q - r, k' = k - r with r the keys'
    mean — accurate however far the points are from the origin, with memory O(n m) plus one
    centred copy of each side. A callable is called as is, with these very shapes (not flattened to 2-D): it must handle
    leading dims, e.g. with ``keys.transpose(-2, -1)`` rather than ``keys.T``, and return (..., n, m).

    Args:
        queries: (..., n, dim).
        keys: (..., m, dim); leading dims broadcast with the queries'.
        score: a name from ``SCORES`` (not "additive") or a callable (queries, keys) -> scores.

    Returns:
        Scores (..., n, m).

    Raises:
        UnknownOptionError: ``score`` is an unknown name.
        InvalidArgumentError: ``score`` is "additive" (pass an ``AdditiveScore``) or neither a
            name nor a callable, or the inputs are not floating-point tensors.
        DimensionMismatchError: queries and keys differ in dim or have fewer than 2 dims.
    """
    if callable(score):
        return score(queries, keys)  # (..., n, m)
    check_score(score)
    _check_pair(queries, keys)
    if score == "gaussian":
        return _gaussian(queries, keys)  # (..., n, m)
    if score == "cosine":
        queries = _unit_rows(queries)  # (..., n, dim)
        keys = _unit_rows(keys)  # (..., m, dim)
    dots = queries @ keys.transpose(-2, -1)  # (..., n, m)
    if score == "scaled_dot":
        return dots / math.sqrt(queries.shape[-1])  # (..., n, m)
    return dots  # (..., n, m): dot, cosine


def pool(
    scores: Tensor,
    mask: Tensor | None = None,
    pooling: str = "softmax",
    *,
    temperature: float = 1.0,
    match: Tensor | None = None,
) -> Tensor:
    """Turn scores into attention weights over the last dim.

    ``softmax``: softmax(scores / temperature). ``normalize``: relu(scores) over its sum (a
    row summing to 0 gets zeros). ``nonnegative``: relu(scores), not normalised. ``hard``:
    one-hot on the best candidate (the first on ties) with the softmax's straight-through
    gradient. ``exact``: one-hot on the first candidate where ``match`` is True, zeros where
    none is (constant weights). ``average``: 1 / count. In every mode a dropped entry gets
    exactly 0 and a row with nothing kept gets all zeros, never NaN, forward and backward.
    A score of -inf drops its candidate like the mask does (so a row scored -inf everywhere
    gets zeros); NaN or +inf on a kept candidate raises.

    Args:
        scores: floating-point (..., m).
        mask: bool keep-mask broadcastable to ``scores`` (True = the candidate exists/is allowed).
        pooling: a name from ``POOLINGS``.
        temperature: divides the scores for ``softmax`` and ``hard``; finite and > 0.
        match: bool, broadcastable to ``scores``; required for ``exact``.

    Returns:
        Weights (..., m), same dtype and device as ``scores``.

    Raises:
        UnknownOptionError: ``pooling`` is unknown.
        InvalidArgumentError: bad temperature, scores not floating point, mask or match not a
            bool tensor of a broadcastable shape, or ``exact`` without ``match``.
        NonFiniteError: a kept candidate's score is NaN or +inf.
    """
    _check_option(pooling, POOLINGS, "pooling")
    temperature = check_temperature(temperature)
    _check_float_tensor(scores, "scores")
    if scores.dim() < 1:
        raise InvalidArgumentError(f"scores must have at least 1 dim (..., m), got {_describe(scores)}")
    shape, device = scores.shape, scores.device
    if mask is None:
        keep = torch.ones(shape, dtype=torch.bool, device=device)  # (..., m)
    else:
        keep = _keep_mask(mask, shape, "mask", device)  # (..., m)
    if pooling == "exact":
        if match is None:
            raise InvalidArgumentError("exact pooling needs match: expected a bool tensor, got None")
        keep = keep & _keep_mask(match, shape, "match", device)  # (..., m)
    keep = _keep_finite_scores(scores, keep)  # (..., m) a -inf score drops its candidate

    if pooling == "softmax":
        return _masked_softmax(scores, keep, temperature)  # (..., m)
    if pooling in ("normalize", "nonnegative"):
        positive = torch.where(keep, scores.relu(), 0)  # (..., m)
        if pooling == "nonnegative":
            return positive  # (..., m)
        total = positive.sum(-1, keepdim=True)  # (..., 1)
        return positive / torch.where(total > 0, total, 1)  # (..., m); a zero row stays zero, no 0/0
    if pooling == "hard":
        soft = _masked_softmax(scores, keep, temperature)  # (..., m)
        if shape[-1] == 0:
            return soft  # (..., 0): no candidate, no weight (and no maximum to take)
        filled = scores.masked_fill(~keep, -math.inf)  # (..., m)
        best = keep & (filled == filled.amax(-1, keepdim=True))  # (..., m) every kept maximum
        onehot = _first_true(best).to(scores.dtype)  # (..., m)
        return onehot + (soft - soft.detach())  # (..., m) forward exactly one-hot, backward softmax's
    if pooling == "exact":
        return _first_true(keep).to(scores.dtype)  # (..., m)
    count = keep.sum(-1, keepdim=True).clamp(min=1)  # (..., 1)
    return keep.to(scores.dtype) / count  # (..., m)


def attend(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    score: str | ScoreFn = "scaled_dot",
    pooling: str = "softmax",
    valid_lens: Tensor | None = None,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    match: Tensor | None = None,
    dropout: float = 0.0,
    training: bool = False,
) -> tuple[Tensor, Tensor]:
    """Score queries against keys, pool the scores into weights and blend the values.

    Three layouts:

    - shared keys: queries (n, dim), keys (m, dim), values (m, value_dim)
      -> output (n, value_dim), weights (n, m);
    - gathered candidates: queries (b, dim), keys (b, k, dim), values (b, k, value_dim)
      -> output (b, value_dim), weights (b, k), each query with its own k candidates;
    - batched: queries (b, n, dim), keys (b, m, dim), values (b, m, value_dim)
      -> output (b, n, value_dim), weights (b, n, m).

    Keys, values, masks and lengths are moved to the queries' device and the three
    embedding tensors promoted to a common dtype, so the results are on the queries' device.

    Args:
        queries: the queries (see the layouts).
        keys: the keys.
        values: the values.
        score: a name from ``SCORES`` (not "additive") or a callable (queries, keys) -> scores,
            such as an ``AdditiveScore``. It is called with queries (..., n, dim) and keys
            (..., m, dim) and returns (..., n, m): (n, dim) with (m, dim) for shared keys,
            (b, 1, dim) with (b, k, dim) for gathered candidates, (b, n, dim) with (b, m, dim) batched.
        pooling: a name from ``POOLINGS``.
        valid_lens: integer lengths; keys at positions >= the length are dropped. Shape (n,)
            for shared keys, (b,) for gathered candidates, (b,) or (b, n) when batched.
        mask: bool keep-mask broadcastable to the weights; ANDed with ``valid_lens``.
        temperature: see ``pool``.
        match: bool, broadcastable to the weights, for ``exact``; None compares the key and
            query embeddings for exact equality.
        dropout: probability in [0, 1) of dropping a weight, applied only when ``training``.
        training: whether dropout applies.

    Returns:
        ``(output, weights)``, with ``output == weights @ values`` (the weights after dropout).

    Raises:
        DimensionMismatchError: the shapes fit no layout, or batch, m or dim disagree.
        NonFiniteError: the queries, keys or values hold NaN or Inf; a built-in score overflowed
            (finite inputs too large for the dtype); a callable score gave NaN or +inf on a kept
            candidate (-inf drops the candidate, see ``pool``); or the output overflowed.
        InvalidArgumentError: a bad option value, non-float embeddings, a valid_lens, mask or match of the
            wrong dtype or shape, or the gaussian score with normalize / nonnegative pooling (all weights 0).
        UnknownOptionError: an unknown score or pooling name.
    """
    check_score(score)
    _check_option(pooling, POOLINGS, "pooling")
    temperature = check_temperature(temperature)
    dropout = _check_dropout(dropout)
    _check_float_tensor(queries, "queries")
    _check_float_tensor(keys, "keys")
    _check_float_tensor(values, "values")

    gathered = queries.dim() == 2 and keys.dim() == 3
    if not ((queries.dim() == 2 and keys.dim() == 2) or gathered or (queries.dim() == 3 and keys.dim() == 3)):
        raise DimensionMismatchError(
            "expected queries (n, dim) with keys (m, dim), queries (batch, dim) with keys "
            "(batch, k, dim), or queries (batch, n, dim) with keys (batch, m, dim); "
            f"got queries {tuple(queries.shape)} and keys {tuple(keys.shape)}"
        )
    if keys.dim() == 3 and keys.shape[0] != queries.shape[0]:
        raise DimensionMismatchError(
            f"keys must have the queries' batch size: expected {queries.shape[0]}, got {keys.shape[0]}"
        )
    if values.shape[:-1] != keys.shape[:-1] or values.dim() != keys.dim():
        expected = (*keys.shape[:-1], "value_dim")
        raise DimensionMismatchError(
            f"values must line up with the keys: expected shape {expected}, got {tuple(values.shape)}"
        )
    if isinstance(score, str):
        if queries.shape[-1] != keys.shape[-1]:
            raise DimensionMismatchError(
                f"keys must have the queries' dim: expected {queries.shape[-1]}, got {keys.shape[-1]}"
            )
        if queries.shape[-1] == 0:
            raise DimensionMismatchError("embeddings must have dim >= 1, got 0")
    _check_pairing(score, pooling)
    check_finite(queries)
    check_finite(keys, "keys")
    check_finite(values, "values")

    device = queries.device
    dtype = torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), values.dtype)
    queries = queries.to(dtype)  # as given
    keys = keys.to(device, dtype)  # (m, dim) | (b, k, dim) | (b, m, dim)
    values = values.to(device, dtype)  # (m, value_dim) | (b, k, value_dim) | (b, m, value_dim)
    shape = torch.Size((*queries.shape[:-1], keys.shape[-2]))  # weights: (n, m) | (b, k) | (b, n, m)

    keep = None if valid_lens is None else _valid_lens_mask(valid_lens, shape, device)  # weights' shape
    if mask is not None:
        given = _keep_mask(mask, shape, "mask", device)  # weights' shape
        keep = given if keep is None else keep & given  # weights' shape
    if match is not None:
        match = _keep_mask(match, shape, "match", device)  # weights' shape
    if gathered:
        queries = queries.unsqueeze(-2)  # (b, 1, dim)
        keep = None if keep is None else keep.unsqueeze(-2)  # (b, 1, k)
        match = None if match is None else match.unsqueeze(-2)  # (b, 1, k)

    scores = compute_scores(queries, keys, score)  # (n, m) | (b, 1, k) | (b, n, m)
    expected = torch.Size((*queries.shape[:-1], keys.shape[-2]))
    if not isinstance(scores, Tensor) or scores.shape != expected:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else _describe(scores)
        raise DimensionMismatchError(f"the score function must return shape {tuple(expected)}, got {got}")
    if isinstance(score, str) and not all_finite(scores):
        raise NonFiniteError(
            f"the {score} scores overflowed: expected queries and keys whose scores fit in {scores.dtype}, got "
            f"{_count_nonfinite(scores)} non-finite scores from finite inputs (largest entry "
            f"{max(_largest(queries), _largest(keys)):.3g}); scale them down or use float64"
        )
    if pooling == "exact" and match is None:
        match = _exact_matches(queries, keys)  # (n, m) | (b, 1, k) | (b, n, m)

    weights = pool(scores, keep, pooling, temperature=temperature, match=match)  # like scores
    if training and dropout > 0:
        weights = F.dropout(weights, p=dropout, training=True)  # like scores
    output = weights @ values  # (n, value_dim) | (b, 1, value_dim) | (b, n, value_dim)
    if not all_finite(output):
        raise NonFiniteError(
            f"the output overflowed: expected weights @ values to fit in {output.dtype}, got "
            f"{_count_nonfinite(output)} non-finite entries (largest weight {_largest(weights):.3g}, "
            f"largest value {_largest(values):.3g})"
        )
    if gathered:
        output = output.squeeze(-2)  # (b, value_dim)
        weights = weights.squeeze(-2)  # (b, k)
    return output, weights


# ----------------------------------------------------------------------------- modules


class AdditiveScore(nn.Module):
    """Learned MLP attention (Bahdanau): score(q, k) = w_v^T tanh(W_q q + W_k k).

    The linear layers have no bias. Queries and keys may have different dims.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden: int = 64) -> None:
        """Create the three projections.

        Args:
            query_dim: the queries' dim.
            key_dim: the keys' dim.
            hidden: the width of the hidden layer.

        Raises:
            InvalidArgumentError: a size is not a positive integer.
        """
        super().__init__()
        for name, size in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden", hidden)):
            if isinstance(size, bool) or not isinstance(size, Integral) or size < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {size!r}")
            check_dim(size, name)  # at most MAX_DIM: a weight matrix torch can allocate
        self.query_dim, self.key_dim, self.hidden = int(query_dim), int(key_dim), int(hidden)
        self.w_q = nn.Linear(self.query_dim, self.hidden, bias=False)
        self.w_k = nn.Linear(self.key_dim, self.hidden, bias=False)
        self.w_v = nn.Linear(self.hidden, 1, bias=False)

    def forward(self, queries: Tensor, keys: Tensor) -> Tensor:
        """Score every query against every key.

        Args:
            queries: (..., n, query_dim).
            keys: (..., m, key_dim); leading dims broadcast with the queries'.

        Returns:
            Scores (..., n, m).

        Raises:
            DimensionMismatchError: a dim differs from the one this module was built for.
            InvalidArgumentError: queries or keys are not floating-point tensors.
        """
        _check_float_tensor(queries, "queries")
        _check_float_tensor(keys, "keys")
        for name, x, rows, dim in (
            ("queries", queries, "n", self.query_dim),
            ("keys", keys, "m", self.key_dim),
        ):
            if x.dim() < 2 or x.shape[-1] != dim:
                raise DimensionMismatchError(
                    f"AdditiveScore expected {name} of shape (..., {rows}, {dim}), got {tuple(x.shape)}"
                )
        features = self.w_q(queries).unsqueeze(-2) + self.w_k(keys).unsqueeze(-3)  # (..., n, m, hidden)
        return self.w_v(torch.tanh(features)).squeeze(-1)  # (..., n, m)


class KVAttention(nn.Module):
    """Attention over a database as a torch layer: queries (batch, dim) -> output (batch, value_dim).

    The database is duck-typed: it needs ``dim`` and ``candidates(queries, k) -> Candidates``
    (it detaches the queries for its index search itself). With exact pooling, a database that
    also has ``exact_targets(queries) -> ids`` (and ``candidates(..., targets=ids)``) decides
    which stored key each query is, as ``Database.query`` does (one equal key embedding, else not
    found, also when several are equal); without it, the candidates' embeddings are compared.
    The last weights and ids are kept on ``last_weights`` / ``last_ids`` (detached; ids are
    expanded to the weights' shape for ``k="all"``).
    """

    def __init__(
        self,
        db: Any,
        k: int | Literal["all"] = 16,
        score: str | ScoreFn = "scaled_dot",
        pooling: str = "softmax",
        temperature: float = 1.0,
        dropout: float = 0.0,
    ) -> None:
        """Check the options and build the score function.

        Args:
            db: an object with ``dim`` and ``candidates(queries, k)``.
            k: candidates per query, or "all" to attend over every record.
            score: a name from ``SCORES`` ("additive" creates an ``AdditiveScore(db.dim, db.dim,
                hidden=64)`` submodule) or a callable (queries, keys) -> scores, called as ``attend`` calls it:
                (batch, 1, dim) with (batch, k, dim) for an int k, (batch, dim) with (m, dim) for "all".
            pooling: a name from ``POOLINGS``.
            temperature: see ``pool``.
            dropout: attention dropout, applied in training mode only.

        Raises:
            InvalidArgumentError: a bad db, k, score, temperature or dropout.
            UnknownOptionError: an unknown score or pooling name.
        """
        super().__init__()
        if not callable(getattr(db, "candidates", None)) or not hasattr(db, "dim"):
            raise InvalidArgumentError(f"db must have dim and a candidates(queries, k) method, got {type(db).__name__}")
        if not (
            (isinstance(k, str) and k == "all") or (isinstance(k, Integral) and not isinstance(k, bool) and k >= 1)
        ):
            raise InvalidArgumentError(f"k must be a positive integer or 'all', got {k!r}")
        k = check_k(k, allow_all=True)  # at most MAX_K, as every search
        if isinstance(score, str) and score == "additive":
            score_fn: str | ScoreFn = AdditiveScore(db.dim, db.dim, hidden=64)
        else:
            check_score(score)
            score_fn = score
        self.pooling = _check_option(pooling, POOLINGS, "pooling")
        _check_pairing(score, self.pooling)
        self.temperature = check_temperature(temperature)
        self.dropout = _check_dropout(dropout)
        self.db = db
        self.k = k if k == "all" else int(k)
        self.score_fn = score_fn  # a module is registered, so its parameters train
        self.last_weights: Tensor | None = None
        self.last_ids: Tensor | None = None

    def forward(self, queries: Tensor) -> Tensor:
        """Attend from each query over its candidates.

        Args:
            queries: (batch, dim).

        Returns:
            Output (batch, value_dim).

        Raises:
            InvalidArgumentError: queries are not a floating-point tensor.
            DimensionMismatchError: queries are not (batch, db.dim), or the candidates do not line up.
            NonFiniteError: queries hold NaN or Inf.
            EmptyDatabaseError: (raised by a Database's ``candidates``) the database holds no records; an empty
                batch (0, dim) is answered with an empty output (0, value_dim).
        """
        _check_float_tensor(queries, "queries")
        if queries.dim() != 2 or queries.shape[-1] != self.db.dim:
            raise DimensionMismatchError(
                f"expected queries of shape (batch, {self.db.dim}), got {tuple(queries.shape)}"
            )
        check_finite(queries)  # before the index sees them
        exact_targets = getattr(self.db, "exact_targets", None)
        if self.pooling == "exact" and callable(exact_targets):  # the database's rule: one equal stored key
            cand = self.db.candidates(queries, self.k, targets=exact_targets(queries))
        else:
            cand = self.db.candidates(queries, self.k)
        output, weights = attend(
            queries,
            cand.keys,
            cand.values,
            score=self.score_fn,
            pooling=self.pooling,
            mask=cand.mask,
            match=cand.match,
            temperature=self.temperature,
            dropout=self.dropout,
            training=self.training,
        )  # (batch, value_dim), (batch, k | m)
        ids = cand.ids if cand.ids.dim() == 2 else cand.ids.expand_as(weights)  # (batch, k | m)
        self.last_weights = weights.detach()  # (batch, k | m)
        self.last_ids = ids.detach()  # (batch, k | m)
        return output  # (batch, value_dim)

    def extra_repr(self) -> str:
        """The options, for ``repr``."""
        score = self.score_fn if isinstance(self.score_fn, str) else type(self.score_fn).__name__
        return (
            f"k={self.k!r}, score={score!r}, pooling={self.pooling!r}, "
            f"temperature={self.temperature}, dropout={self.dropout}"
        )


class GaussianKernel(nn.Module):
    """The Gaussian (Nadaraya-Watson) score with a learnable bandwidth: ``-((q - k) * w)^2 / 2`` summed over dim.

    A score callable for ``attend``, ``Database.query(score=...)`` and ``kvsearch.finetune`` (which trains ``w``).
    With ``w = 1`` it equals the ``"gaussian"`` score. Memory is O(n m dim): it is meant for low-dimensional keys
    (kernel regression), not text embeddings.

    Args:
        bandwidth: the initial ``w`` (finite).

    Raises:
        InvalidArgumentError: ``bandwidth`` is not a finite number.
    """

    def __init__(self, bandwidth: float = 1.0) -> None:
        super().__init__()
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, Real) or not math.isfinite(bandwidth):
            raise InvalidArgumentError(f"expected a finite number as bandwidth, got {bandwidth!r}")
        self.w = nn.Parameter(torch.tensor(float(bandwidth)))

    def forward(self, queries: Tensor, keys: Tensor) -> Tensor:
        """Score every query against every key.

        Args:
            queries: (..., n, dim).
            keys: (..., m, dim), leading dims broadcasting with the queries'.

        Returns:
            Scores (..., n, m).

        Raises:
            DimensionMismatchError: the dims differ.
            InvalidArgumentError: queries or keys are not floating-point tensors.
        """
        _check_float_tensor(queries, "queries")
        _check_float_tensor(keys, "keys")
        if queries.shape[-1] != keys.shape[-1]:
            raise DimensionMismatchError(f"expected keys of dim {queries.shape[-1]}, got {keys.shape[-1]}")
        diff = queries.unsqueeze(-2) - keys.unsqueeze(-3)  # (..., n, m, dim)
        return -0.5 * (diff * self.w).pow(2).sum(-1)  # (..., n, m)
