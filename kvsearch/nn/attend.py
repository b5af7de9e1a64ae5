"""The functional ``attend``: score queries against keys, pool the scores and blend the values.

    output, weights = attend(queries, keys, values, score="scaled_dot", pooling="softmax", mask=mask)

It owns :class:`Candidates` (the gathered tensors a database hands over), the layouts ``attend`` accepts (shared
keys, gathered candidates, batched), valid lengths, dropout, the score / pooling pairing check, the overflow
checks of scores and output (in eager mode, outside ``torch.func.vmap``) and the precision rule under autocast
(float32 math inside, see :mod:`kvsearch.nn.precision`). Scores come from the registry
:data:`~kvsearch.nn.scores.SCORE_KINDS` (which also says which scores are never positive, for the pairing check),
weights from :mod:`kvsearch.nn.pooling`.

It knows nothing of FAISS, SQLite or text: it takes already-gathered tensors and gives back tensors that gradients
flow through.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Real

import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import all_finite, check_dense, check_finite, check_temperature
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, NonFiniteError
from kvsearch.nn.pooling import POOLINGS, exact_matches, keep_mask, pool_checked
from kvsearch.nn.precision import (
    autocast_dtype,
    compute_dtype,
    eager_checks,
    full_precision,
    host_reads,
    output_dtype,
)
from kvsearch.nn.scores import SCORE_KINDS, ScoreFn, check_float_tensor, check_option, check_score, describe

__all__ = ["Candidates", "attend", "attend_candidates", "check_pairing", "check_dropout"]


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


def check_dropout(dropout: object) -> float:
    """Return ``dropout`` as a float if it is a probability in [0, 1)."""
    if isinstance(dropout, bool) or not isinstance(dropout, Real) or not 0 <= dropout < 1:
        raise InvalidArgumentError(f"dropout must be a number in [0, 1), got {dropout!r}")
    return float(dropout)


def check_pairing(score: object, pooling: str) -> None:
    """Refuse a score whose values the pooling would turn into all-zero weights.

    A score registered as never positive (:attr:`~kvsearch.nn.scores.ScoreKind.never_positive`: the gaussian
    ``-|q - k|^2 / 2``), and ``normalize`` / ``nonnegative`` keep only the positive part of the scores: every
    weight would be 0 and every answer "nothing found".

    Raises:
        InvalidArgumentError: such a score (``"gaussian"``) with ``pooling`` ``normalize`` or ``nonnegative``.
    """
    kind = SCORE_KINDS.get(score) if isinstance(score, str) else None
    if kind is not None and kind.never_positive and pooling in ("normalize", "nonnegative"):
        raise InvalidArgumentError(
            f"pooling {pooling!r} keeps the non-negative part of the scores, but the {score} score "
            f"{kind.formula} is never positive, so every weight would be 0; expected softmax (Nadaraya-Watson), "
            f"hard, exact or average pooling with the {score} score, or a score that can be positive"
        )


def _valid_lens_mask(valid_lens: object, shape: torch.Size, device: torch.device) -> Tensor:
    """Turn valid lengths into a keep-mask of ``shape``: positions >= valid_len are dropped."""
    if isinstance(valid_lens, Tensor):
        check_dense(valid_lens, "valid_lens")
    if (
        not isinstance(valid_lens, Tensor)
        or valid_lens.dtype == torch.bool
        or valid_lens.is_floating_point()
        or valid_lens.is_complex()
    ):
        raise InvalidArgumentError(f"valid_lens must be an integer tensor, got {describe(valid_lens)}")
    allowed = [tuple(shape[:-1])]
    if len(shape) == 3:
        allowed.insert(0, (shape[0],))
    if tuple(valid_lens.shape) not in allowed:
        raise InvalidArgumentError(
            f"valid_lens must have shape {' or '.join(map(str, allowed))}, got {tuple(valid_lens.shape)}"
        )
    if eager_checks() and valid_lens.numel() and int(valid_lens.min()) < 0:
        raise InvalidArgumentError(f"valid_lens must be >= 0, got {int(valid_lens.min())}")
    trailing = (1,) * (len(shape) - valid_lens.dim())
    lens = valid_lens.to(device).reshape(*valid_lens.shape, *trailing)  # (batch, 1, 1) | (..., n, 1)
    positions = torch.arange(shape[-1], device=device)  # (m,)
    return (positions < lens).expand(shape)  # shape


def _check_layout(queries: Tensor, keys: Tensor, values: Tensor, score: str | ScoreFn) -> bool:
    """Check that the shapes fit one of ``attend``'s layouts; True for gathered candidates.

    Raises:
        DimensionMismatchError: the shapes fit no layout, or batch, m or dim (for a built-in score) disagree.
    """
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
    return gathered


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


def _score_pool_blend(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    score: str | ScoreFn,
    pooling: str,
    keep: Tensor | None,
    match: Tensor | None,
    temperature: float,
    dropout: float,
    reads: bool,
) -> tuple[Tensor, Tensor]:
    """``attend``'s math on checked inputs of one dtype: queries (..., n, dim), keys (..., m, dim) -> output
    (..., n, value_dim) and weights (..., n, m); ``keep`` and ``match`` None or of the weights' shape. ``reads``:
    the overflow checks of a built-in score (and the NaN / +inf check of a callable's) may read back to the host."""
    score_fn = score if callable(score) else SCORE_KINDS[score].fn  # checked_scores' dispatch, without its frame
    scores = score_fn(queries, keys)  # (..., n, m): checked by attend, one dtype
    expected = torch.Size((*queries.shape[:-1], keys.shape[-2]))
    if not isinstance(scores, Tensor) or scores.shape != expected:
        got = tuple(scores.shape) if isinstance(scores, Tensor) else describe(scores)
        raise DimensionMismatchError(f"the score function must return shape {tuple(expected)}, got {got}")
    finite = isinstance(score, str) and reads  # a built-in score's scores are checked here: finite below
    if finite and not all_finite(scores):
        raise NonFiniteError(
            f"the {score} scores overflowed: expected queries and keys whose scores fit in {scores.dtype}, got "
            f"{_count_nonfinite(scores)} non-finite scores from finite inputs (largest entry "
            f"{max(_largest(queries), _largest(keys)):.3g}); scale them down or use float64"
        )
    if pooling == "exact" and match is None:
        match = exact_matches(queries, keys)  # (..., n, m)
    if keep is None:
        keep = torch.ones(expected, dtype=torch.bool, device=scores.device)  # (..., n, m)
    if pooling == "exact":
        keep = keep & match  # (..., n, m)
    weights = pool_checked(scores, keep, pooling, temperature=temperature, finite=finite, reads=reads)  # (..., n, m)
    if dropout > 0:
        weights = F.dropout(weights, p=dropout, training=True)  # (..., n, m)
    return weights @ values, weights  # (..., n, value_dim), (..., n, m)


# ----------------------------------------------------------------------------- attend


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

    Precision, as fused ``scaled_dot_product_attention``: under ``torch.autocast`` enabled for the
    queries' device type, the inputs are upcast to float32 (float64 stays float64) and the scores,
    the pooling (a callable score included, called with autocast off) and the weighted sum run in
    float32 with autocast off; the output comes out in the autocast dtype
    (``torch.get_autocast_dtype(device_type)``: bfloat16 or float16, float64 for float64 inputs) and
    the weights in float32. Gradients flow back to low-precision queries in their own dtype. Without
    autocast both come out in the inputs' promoted dtype.

    Under ``torch.compile`` the checks that read tensor values back to the host (NaN / Inf inputs,
    overflow, negative ``valid_lens``) are skipped, as torch's own ops do not check: a compiled model
    gets no ``NonFiniteError``. So are they under ``torch.func.vmap`` (where no value can be read back):
    a vmapped ``attend`` gives what a Python loop over the examples gives, unchecked for finiteness, and
    ``vmap(grad(...))`` gives per-example gradients. The options and shapes are checked either way.

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
        ``(output, weights)``, with ``output == weights @ values`` (the weights after dropout); output in
        the autocast dtype under autocast, weights in float32 (see Precision).

    Raises:
        DimensionMismatchError: the shapes fit no layout, or batch, m or dim disagree.
        NonFiniteError: (eager mode, outside vmap) the queries, keys or values hold NaN or Inf; a built-in score
            overflowed (finite inputs too large for the dtype); a callable score gave NaN or +inf on a
            kept candidate (-inf drops the candidate, see ``pool``); or the output overflowed (in its
            output dtype: float16 under CUDA float16 autocast).
        InvalidArgumentError: a bad option value, non-float embeddings, a valid_lens, mask or match of the
            wrong dtype or shape, or the gaussian score with normalize / nonnegative pooling (all weights 0).
        UnknownOptionError: an unknown score or pooling name.
    """
    check_score(score)
    check_option(pooling, POOLINGS, "pooling")
    temperature = check_temperature(temperature)
    dropout = check_dropout(dropout)
    check_float_tensor(queries, "queries")
    check_float_tensor(keys, "keys")
    check_float_tensor(values, "values")
    gathered = _check_layout(queries, keys, values, score)
    check_pairing(score, pooling)
    reads = eager_checks()
    if reads:
        check_finite(queries)
        check_finite(keys, "keys")
        check_finite(values, "values")

    device = queries.device
    amp = autocast_dtype(device)  # None unless autocast is on for the queries' device
    dtype = torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), values.dtype)
    dtype = compute_dtype(dtype, amp)  # at least float32 under autocast
    queries = queries.to(dtype)  # as given
    keys = keys.to(device, dtype)  # (m, dim) | (b, k, dim) | (b, m, dim)
    values = values.to(device, dtype)  # (m, value_dim) | (b, k, value_dim) | (b, m, value_dim)
    shape = torch.Size((*queries.shape[:-1], keys.shape[-2]))  # weights: (n, m) | (b, k) | (b, n, m)

    keep = None if valid_lens is None else _valid_lens_mask(valid_lens, shape, device)  # weights' shape
    if mask is not None:
        given = keep_mask(mask, shape, "mask", device)  # weights' shape
        keep = given if keep is None else keep & given  # weights' shape
    if match is not None:
        match = keep_mask(match, shape, "match", device)  # weights' shape
    if gathered:
        queries = queries.unsqueeze(-2)  # (b, 1, dim)
        keep = None if keep is None else keep.unsqueeze(-2)  # (b, 1, k)
        match = None if match is None else match.unsqueeze(-2)  # (b, 1, k)

    with full_precision(device, amp):  # autocast off: scores, pooling and the blend in ``dtype``
        output, weights = _score_pool_blend(
            queries, keys, values, score, pooling, keep, match, temperature, dropout if training else 0.0, reads
        )  # (n, value_dim) | (b, 1, value_dim) | (b, n, value_dim), like the scores
    output = output.to(output_dtype(dtype, amp))  # the autocast dtype under autocast
    if reads:
        _check_output(output, weights, values)
    if gathered:
        output = output.squeeze(-2)  # (b, value_dim)
        weights = weights.squeeze(-2)  # (b, k)
    return output, weights


def _check_output(output: Tensor, weights: Tensor, values: Tensor) -> None:
    """NonFiniteError where the output overflowed (a read back to the host)."""
    if not all_finite(output):
        raise NonFiniteError(
            f"the output overflowed: expected weights @ values to fit in {output.dtype}, got "
            f"{_count_nonfinite(output)} non-finite entries (largest weight {_largest(weights):.3g}, "
            f"largest value {_largest(values):.3g})"
        )


def attend_candidates(
    queries: Tensor, cand: Candidates, *, score: str | ScoreFn, pooling: str, temperature: float, dropout: float
) -> tuple[Tensor, Tensor]:
    """:func:`attend` over the candidates a database gathered (``KVAttention``'s call), one pass: nothing that was
    checked is checked again.

    The options were checked when the layer was made, the queries at its door (a floating-point (batch, dim),
    finite where :func:`~kvsearch.nn.precision.host_reads`), and the keys and values are the database's own (finite:
    checked when they were added); only the layout the database handed back is looked at (shapes: nothing read).
    Where :func:`~kvsearch.nn.precision.host_reads` is False (a GPU) nothing is read back to the host: the scores
    and the output are not checked for overflow.

    Args:
        queries: (batch, dim). cand: gathered candidates (keys (batch, k, dim), values (batch, k, value_dim), mask and
            match (batch, k) or None), or shared ones (k="all": keys (m, dim)), which go through :func:`attend`.
        score, pooling, temperature: checked options. dropout: the probability applied (0 outside training).

    Returns:
        ``(output, weights)`` as :func:`attend`'s: (batch, value_dim), (batch, k | m).

    Raises:
        DimensionMismatchError: the candidates do not line up with the queries.
        NonFiniteError: (where values are read back) a built-in score or the output overflowed; a callable score
            gave NaN or +inf on a kept candidate.
    """
    keys, values = cand.keys, cand.values
    if keys.dim() != 3 or not keys.is_floating_point() or not values.is_floating_point():
        return attend(queries, keys, values, score=score, pooling=pooling, mask=cand.mask, match=cand.match,
                      temperature=temperature, dropout=dropout, training=dropout > 0)  # fmt: skip
    _check_layout(queries, keys, values, score)  # shapes only
    device = queries.device
    amp = autocast_dtype(device)  # None unless autocast is on for the queries' device
    dtype = compute_dtype(torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), values.dtype), amp)
    q = queries.to(dtype).unsqueeze(-2)  # (b, 1, dim)
    keys, values = keys.to(device, dtype), values.to(device, dtype)  # (b, k, dim), (b, k, value_dim)
    keep = None if cand.mask is None else cand.mask.to(device).unsqueeze(-2)  # (b, 1, k)
    match = None if cand.match is None else cand.match.to(device).unsqueeze(-2)  # (b, 1, k)
    reads = host_reads(device)
    with full_precision(device, amp):  # autocast off: scores, pooling and the blend in ``dtype``
        output, weights = _score_pool_blend(
            q, keys, values, score, pooling, keep, match, temperature, dropout, reads
        )  # (b, 1, value_dim), (b, 1, k)
    output = output.to(output_dtype(dtype, amp))  # the autocast dtype under autocast
    if reads:
        _check_output(output, weights, values)
    return output.squeeze(-2), weights.squeeze(-2)  # (b, value_dim), (b, k)
