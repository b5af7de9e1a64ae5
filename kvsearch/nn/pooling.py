"""Pooling: attention scores (..., m) turned into weights over the candidates, with masks.

``pool(scores, mask, pooling)`` owns the modes (``softmax``, ``normalize``, ``nonnegative``, ``hard``, ``exact``,
``average``), the masked softmax that never gives NaN, the keep-mask check (``keep_mask``) and the exact-match
comparison of embeddings (``exact_matches``); ``pool_checked`` is its math on arguments checked by the caller
(``attend``), which nothing checks again. A dropped candidate always gets weight 0; a row with nothing kept
gets zeros, forward and backward.

It knows nothing of how the scores were computed, of candidates, FAISS, SQLite or text.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

from kvsearch.checks import all_finite, check_dense, check_temperature
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, NonFiniteError
from kvsearch.nn.precision import eager_checks
from kvsearch.nn.scores import check_float_tensor, check_option, describe

__all__ = ["PoolingName", "POOLINGS", "pool", "pool_checked", "keep_mask", "exact_matches"]

PoolingName = Literal["softmax", "normalize", "nonnegative", "hard", "exact", "average"]

POOLINGS: tuple[str, ...] = get_args(PoolingName)

_MATCH_CHUNK = 1 << 24  # elements of the (..., n, m, dim) comparison that exact_matches builds at once


# ----------------------------------------------------------------------------- masks


def keep_mask(mask: object, shape: torch.Size, name: str, device: torch.device) -> Tensor:
    """Check a bool mask broadcastable to ``shape`` and return it expanded to ``shape`` on ``device``."""
    if not isinstance(mask, Tensor):
        raise InvalidArgumentError(f"{name} must be a bool tensor, got {describe(mask)}")
    check_dense(mask, name)
    if mask.dtype != torch.bool:
        raise InvalidArgumentError(f"{name} must be a bool tensor, got {describe(mask)}")
    try:
        broadcast = torch.broadcast_shapes(mask.shape, shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise InvalidArgumentError(
            f"{name} must broadcast to the weights' shape: expected {tuple(shape)}, got {tuple(mask.shape)}"
        )
    return mask.to(device).expand(shape)  # shape


def exact_matches(queries: Tensor, keys: Tensor) -> Tensor:
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


def _keep_finite_scores(scores: Tensor, keep: Tensor, reads: bool = True) -> Tensor:
    """The keep-mask with the candidates scored -inf dropped; NaN or +inf on a kept candidate raises.

    Under ``torch.compile`` or without ``reads`` (nothing may be read back to the host) -inf still drops, NaN or
    +inf is not looked for.

    Raises:
        NonFiniteError: (eager mode) a kept candidate's score is NaN or +inf.
    """
    if not reads or not eager_checks():
        return keep & (scores != -math.inf)  # (..., m)
    if all_finite(scores):
        return keep
    bad = (torch.isnan(scores) | (scores == math.inf)) & keep  # (..., m)
    if bool(bad.any()):
        raise NonFiniteError(
            "scores must be finite, or -inf for a candidate to drop: expected no NaN or +inf, "
            f"got {int(bad.sum())} in scores of shape {tuple(scores.shape)}"
        )
    return keep & (scores != -math.inf)  # (..., m)


# ----------------------------------------------------------------------------- pooling


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
    check_option(pooling, POOLINGS, "pooling")
    temperature = check_temperature(temperature)
    check_float_tensor(scores, "scores")
    if scores.dim() < 1:
        raise InvalidArgumentError(f"scores must have at least 1 dim (..., m), got {describe(scores)}")
    shape, device = scores.shape, scores.device
    if mask is None:
        keep = torch.ones(shape, dtype=torch.bool, device=device)  # (..., m)
    else:
        keep = keep_mask(mask, shape, "mask", device)  # (..., m)
    if pooling == "exact":
        if match is None:
            raise InvalidArgumentError("exact pooling needs match: expected a bool tensor, got None")
        keep = keep & keep_mask(match, shape, "match", device)  # (..., m)
    return pool_checked(scores, keep, pooling, temperature=temperature)


def pool_checked(
    scores: Tensor,
    keep: Tensor,
    pooling: str,
    *,
    temperature: float = 1.0,
    finite: bool = False,
    reads: bool = True,
) -> Tensor:
    """:func:`pool` on checked arguments (nothing is checked again): weights (..., m).

    Args:
        scores: floating-point (..., m).
        keep: bool keep-mask of ``scores``' shape (for ``exact``: already ANDed with the matches).
        pooling: a name from ``POOLINGS``. temperature: finite and > 0.
        finite: the scores are known to hold no NaN or Inf (checked by the caller): no candidate is dropped for -inf.
        reads: whether NaN or +inf on a kept candidate may be looked for (a read back to the host).

    Raises:
        NonFiniteError: (``reads``, eager mode) a kept candidate's score is NaN or +inf.
    """
    if not finite:
        keep = _keep_finite_scores(scores, keep, reads)  # (..., m) a -inf score drops its candidate
    shape = scores.shape
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
