"""Streaming dense softmax attention over every record: memory O(batch x chunk), not O(batch x m).

``output = softmax(score(queries, keys) / temperature) @ values`` over all m keys, computed a chunk of keys at
a time with an online (log-sum-exp) softmax — the running maximum and normaliser are rescaled as each chunk
arrives, as FlashAttention does. A custom :class:`torch.autograd.Function` saves only the inputs, the output
and the per-query log-sum-exp (batch,); its backward recomputes each chunk's probabilities from them, so
neither pass ever holds a (batch, m) tensor.

Scores supported: those with a streaming form in the registry :data:`~kvsearch.nn.scores.SCORE_KINDS`
(``STREAMING_SCORES``: ``dot``, ``scaled_dot``, ``cosine``, ``gaussian``). The kernel scores ``scale * q.k`` and
knows three building blocks a :class:`~kvsearch.nn.scores.StreamForm` switches on: a scale divided by sqrt(dim)
(``scaled_dot``), unit query and keys (``cosine``) and the distance ``-||q - k||^2 / 2``, computed as
``q'.k' - |k'|^2 / 2 - |q'|^2 / 2`` on points centred on a common reference, the query itself for one query, else
the keys' mean — each chunk of keys is centred as it is read — so that it stays accurate far from the origin
(``gaussian``). It knows no score by name. Gradients flow to queries, keys and values.

Under ``torch.autocast`` both passes run in float32 with autocast off, and the output comes out in the autocast
dtype (see :func:`streaming_attention`), as fused ``scaled_dot_product_attention`` does. Inside a ``torch.func``
transform (``vmap``, ``grad``) it refuses with ``NotSupportedError``: its custom backward has no functorch rule.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import CHUNK_ELEMENTS, COSINE_EPS, all_finite, check_dense, check_fits, check_temperature
from kvsearch.errors import (
    DimensionMismatchError,
    InvalidArgumentError,
    NonFiniteError,
    NotSupportedError,
    UnknownOptionError,
)
from kvsearch.nn.attend import Candidates, attend
from kvsearch.nn.precision import autocast_dtype, compute_dtype, full_precision, functorch_transformed, output_dtype
from kvsearch.nn.scores import SCORE_KINDS, ScoreFn, checked_scores

__all__ = ["streaming_attention", "streaming_attend", "attend_candidates", "STREAMING_SCORES", "default_chunk"]

#: Score functions streaming attention computes: those with a streaming form in the registry.
STREAMING_SCORES: tuple[str, ...] = tuple(name for name, kind in SCORE_KINDS.items() if kind.stream is not None)


def default_chunk(batch: int) -> int:
    """Keys per chunk for a batch size: about 4M scores at once, at least 256 keys."""
    return max(256, CHUNK_ELEMENTS // max(1, batch))


def _chunk_keys(keys: Tensor, normalize: bool, center: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk of keys: as scored (unit rows for a unit form), raw (minus ``center`` for a distance), and the norms
    (clamped as F.normalize does) or None."""
    if center is not None:
        keys = keys - center  # (c, dim): a distance score on centred points
    if not normalize:
        return keys, keys, None
    norms = keys.norm(dim=-1, keepdim=True).clamp(min=COSINE_EPS)  # (c, 1)
    return keys / norms, keys, norms  # (c, dim), (c, dim), (c, 1)


def _chunk_scores(
    q: Tensor, unit: Tensor, raw: Tensor, scale: float, distance: bool, shift: Tensor | None = None
) -> Tensor:
    """Scores (batch, c) of queries (batch, dim) against one chunk of keys (c, dim), minus ``shift`` (batch, 1).

    For a distance, ``shift`` already holds the queries' ``scale * |q|^2 / 2``.
    """
    if shift is None:
        scores = torch.mm(q, unit.T).mul_(scale)  # (batch, c)
    else:
        scores = torch.addmm(shift, q, unit.T, beta=-1.0, alpha=scale)  # (batch, c): one pass, no temporaries
    if distance:
        scores -= (0.5 * scale) * raw.pow(2).sum(-1)  # (batch, c): - |k|^2 / 2, scaled
    return scores


def _query_shift(queries: Tensor, scale: float, distance: bool) -> Tensor | None:
    """The queries' part of a distance score, ``scale * |q|^2 / 2`` (batch, 1), or None for the other scores."""
    return (0.5 * scale) * queries.pow(2).sum(-1, keepdim=True) if distance else None  # (batch, 1)


class _StreamingSoftmaxAttention(torch.autograd.Function):
    """softmax(scale * score(q, k)) @ v over all keys, chunked; the backward recomputes per chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        scale: float,
        normalize: bool,
        distance: bool,
        chunk: int,
        center: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch, m = queries.shape[0], keys.shape[0]
        dtype = queries.dtype
        running_max = torch.full((batch, 1), -math.inf, dtype=dtype, device=queries.device)  # (batch, 1)
        total = torch.zeros(batch, 1, dtype=dtype, device=queries.device)  # (batch, 1)
        acc = torch.zeros(batch, values.shape[1], dtype=dtype, device=queries.device)  # (batch, value_dim)
        best_score = torch.full((batch,), -math.inf, dtype=dtype, device=queries.device)  # (batch,)
        best_row = torch.zeros(batch, dtype=torch.long, device=queries.device)  # (batch,)
        query_shift = _query_shift(queries, scale, distance)  # (batch, 1) | None
        for start in range(0, m, chunk):
            unit, raw, _ = _chunk_keys(keys[start : start + chunk], normalize, center)  # (c, dim), (c, dim)
            scores = _chunk_scores(queries, unit, raw, scale, distance, shift=query_shift)  # (batch, c)
            chunk_max, chunk_arg = scores.max(dim=1)  # (batch,), (batch,)
            better = chunk_max > best_score  # (batch,) first maximum wins ties, as argmax does
            best_row = torch.where(better, chunk_arg + start, best_row)  # (batch,)
            best_score = torch.where(better, chunk_max, best_score)  # (batch,)
            new_max = torch.maximum(running_max, chunk_max.unsqueeze(1))  # (batch, 1)
            rescale = torch.exp(running_max - new_max)  # (batch, 1); exp(-inf) = 0 on the first chunk
            probs = scores.sub_(new_max).exp_()  # (batch, c) unnormalised, in place
            total = total * rescale + probs.sum(dim=1, keepdim=True)  # (batch, 1)
            acc.mul_(rescale).addmm_(probs, values[start : start + chunk])  # (batch, value_dim)
            running_max = new_max
        output = acc / total  # (batch, value_dim)
        lse = (running_max + total.log()).squeeze(1)  # (batch,)
        ctx.save_for_backward(queries, keys, values, output, lse, center)
        ctx.scale, ctx.normalize, ctx.distance, ctx.chunk = scale, normalize, distance, chunk
        ctx.mark_non_differentiable(lse, best_row)
        return output, lse, best_row

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor, _grad_lse: Tensor, _grad_best: Tensor) -> tuple:
        queries = ctx.saved_tensors[0]
        with full_precision(queries.device, autocast_dtype(queries.device)):  # a backward() called under autocast
            return _StreamingSoftmaxAttention._backward(ctx, grad_output.to(queries.dtype))

    @staticmethod
    def _backward(ctx: Any, grad_output: Tensor) -> tuple:
        queries, keys, values, output, lse, center = ctx.saved_tensors
        scale, normalize, distance, chunk = ctx.scale, ctx.normalize, ctx.distance, ctx.chunk
        want_q, want_k, want_v = ctx.needs_input_grad[:3]
        grad_q = torch.zeros_like(queries) if want_q else None  # (batch, dim)
        grad_k = torch.empty_like(keys) if want_k else None  # (m, dim)
        grad_v = torch.empty_like(values) if want_v else None  # (m, value_dim)
        delta = (grad_output * output).sum(dim=1, keepdim=True)  # (batch, 1): sum_j p_j (dO . v_j)
        lse = lse.unsqueeze(1)  # (batch, 1)
        if distance:
            lse = lse + _query_shift(queries, scale, distance)  # (batch, 1): the scores' query part, as forward
        for start in range(0, keys.shape[0], chunk):
            stop = start + chunk
            unit, raw, norms = _chunk_keys(keys[start:stop], normalize, center)  # (c, dim), (c, dim), (c, 1) | None
            probs = _chunk_scores(queries, unit, raw, scale, distance, shift=lse).exp_()  # (batch, c)
            if want_v:
                grad_v[start:stop] = probs.T @ grad_output  # (c, value_dim)
            if not (want_q or want_k):
                continue
            grad_probs = torch.addmm(delta, grad_output, values[start:stop].T, beta=-1.0)  # (batch, c): dP - delta
            grad_scores = grad_probs.mul_(probs)  # (batch, c): softmax backward, in place
            if want_q:
                grad_q.addmm_(grad_scores, unit, alpha=scale)  # (batch, dim)
            if want_k:
                grad_unit = (grad_scores.T @ queries) * scale  # (c, dim)
                if normalize:
                    # d(k / max(|k|, eps)): project out the radial part, divide by the norm (not below eps).
                    radial = (grad_unit * unit).sum(-1, keepdim=True)  # (c, 1)
                    tiny = raw.norm(dim=-1, keepdim=True) < COSINE_EPS  # (c, 1)
                    grad_unit = torch.where(tiny, grad_unit, grad_unit - unit * radial) / norms  # (c, dim)
                if distance:
                    grad_unit = grad_unit - scale * grad_scores.sum(0).unsqueeze(1) * raw  # (c, dim)
                grad_k[start:stop] = grad_unit
        # A distance's query part -scale |q|^2 / 2 adds -scale q sum_j grad_scores to grad_q: 0, as a softmax's
        # gradient sums to 0 over each row (it is the same for every key of a query).
        return grad_q, grad_k, grad_v, None, None, None, None, None


def streaming_attention(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    score: str = "scaled_dot",
    temperature: float = 1.0,
    chunk: int | None = None,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, Tensor, Tensor]:
    """Softmax attention of every query over every key, in chunks: memory O(batch x chunk).

    Equal (up to rounding) to ``attend(queries, keys, values, score=score, pooling="softmax",
    temperature=temperature)[0]`` with shared keys, in value and in gradient.

    Args:
        queries: (batch, dim) floating point; may require grad.
        keys: (m, dim), m >= 1; may require grad.
        values: (m, value_dim); may require grad.
        score: one of ``STREAMING_SCORES``.
        temperature: divides the scores; finite and > 0.
        chunk: keys per step; default :func:`default_chunk` of the batch size.
        return_stats: also return the log-sum-exp of the scaled scores (batch,) and the row of the best key
            (batch,) — the argmax of the weights — both without gradient.

    Returns:
        output (batch, value_dim); with ``return_stats``, ``(output, lse, best_row)``. Under ``torch.autocast``
        enabled for the queries' device type, the inputs are upcast to float32 (float64 stays float64), every
        chunk's scores, softmax and blend run in float32 with autocast off (the backward too), and the output
        comes out in the autocast dtype (``torch.get_autocast_dtype(device_type)``), the log-sum-exp in float32;
        without autocast everything is in the inputs' promoted dtype.

    Raises:
        UnknownOptionError: a score not in ``STREAMING_SCORES``.
        InvalidArgumentError: a bad temperature or chunk, non-float inputs, or no keys.
        DimensionMismatchError: shapes that do not line up.
        NonFiniteError: the scores overflowed (finite inputs too large for the dtype).
        NotSupportedError: called inside a ``torch.func`` transform (``vmap``, ``grad``, ...): its custom backward
            has no functorch rule; :func:`~kvsearch.nn.attend.attend` with softmax pooling computes the same there.
    """
    if functorch_transformed():
        raise NotSupportedError(
            "streaming_attention inside torch.func transforms (vmap, grad, jacrev, ...): expected a call outside "
            "them, got one inside (its chunked custom backward has no functorch rule); use attend(queries, keys, "
            "values, pooling='softmax'), which gives the same output and gradients, or a Python loop"
        )
    form = SCORE_KINDS[score].stream if isinstance(score, str) and score in SCORE_KINDS else None
    if form is None:
        raise UnknownOptionError(f"expected score among {STREAMING_SCORES} for streaming attention, got {score!r}")
    temperature = check_temperature(temperature)
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if isinstance(x, Tensor):
            check_dense(x, name)  # before its dtype and shape: a nested tensor has no shape
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 2:
            got = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise InvalidArgumentError(f"expected {name} as a 2-D floating-point tensor, got {got}")
    if queries.shape[1] != keys.shape[1]:
        raise DimensionMismatchError(f"expected keys of the queries' dim {queries.shape[1]}, got {keys.shape[1]}")
    if values.shape[0] != keys.shape[0]:
        raise DimensionMismatchError(f"expected one value per key ({keys.shape[0]}), got {values.shape[0]} values")
    if keys.shape[0] == 0:
        raise InvalidArgumentError("expected at least one key, got none")
    if chunk is None:
        chunk = default_chunk(queries.shape[0])
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgumentError(f"expected a positive integer chunk, got {chunk!r}")
    device = queries.device
    amp = autocast_dtype(device)  # None unless autocast is on for the queries' device
    dtype = torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), values.dtype)
    dtype = compute_dtype(dtype, amp)  # at least float32 under autocast
    queries = queries.to(dtype)  # (batch, dim)
    keys = keys.to(device, dtype)  # (m, dim)
    values = values.to(device, dtype)  # (m, value_dim)
    scale = 1.0 / float(temperature)
    if form.sqrt_dim:
        scale /= math.sqrt(queries.shape[1])
    with full_precision(device, amp):  # autocast off: every chunk's scores, softmax and blend in ``dtype``
        if form.unit:
            queries = F.normalize(queries, dim=-1, eps=COSINE_EPS)  # (batch, dim), differentiable
        center = None
        if form.distance:  # a common reference, subtracted from the queries here and from each chunk of keys
            center = queries.detach()[0] if queries.shape[0] == 1 else keys.detach().mean(0)  # (dim,)
            queries = queries - center  # (batch, dim), differentiable
        output, lse, best_row = _StreamingSoftmaxAttention.apply(
            queries, keys, values, scale, form.unit, form.distance, int(chunk), center
        )  # (batch, value_dim), (batch,), (batch,)
    output = output.to(output_dtype(dtype, amp))  # (batch, value_dim): the autocast dtype under autocast
    if not all_finite(output):
        raise NonFiniteError(
            f"the {score} scores overflowed: expected queries and keys whose scores fit in {output.dtype}, got "
            f"a non-finite output for {int((~torch.isfinite(output.detach())).any(1).sum())} queries; "
            "scale them down or use float64"
        )
    return (output, lse, best_row) if return_stats else output


def streaming_attend(
    queries: Tensor, keys: Tensor, values: Tensor, *, score: str, temperature: float
) -> tuple[Tensor, Tensor]:
    """Softmax attention over every key with :func:`streaming_attention`, and the weights as an answer shows them.

    Args:
        queries: (batch, dim). keys: (m, dim). values: (m, value_dim). score: one of ``STREAMING_SCORES``.
        temperature: finite and > 0.

    Returns:
        output (batch, value_dim), differentiable, whose autograd graph holds O(batch x chunk) memory (in the
        autocast dtype under autocast, see :func:`streaming_attention`); and weights (batch, m), detached — the
        answer's own size, filled a chunk at a time, in the dtype the scores were computed in (float32 under
        autocast).

    Raises:
        As :func:`streaming_attention`.
    """
    output, lse, _ = streaming_attention(
        queries, keys, values, score=score, temperature=temperature, return_stats=True
    )  # (batch, value_dim), (batch,)
    dtype = lse.dtype  # the dtype the scores were computed in: float32 under autocast
    weights = torch.empty(queries.shape[0], keys.shape[0], dtype=dtype, device=queries.device)  # (batch, m)
    step = max(1024, CHUNK_ELEMENTS // queries.shape[0])
    q = queries.detach().to(dtype)  # (batch, dim)
    with torch.no_grad(), full_precision(queries.device, autocast_dtype(queries.device)):
        for start in range(0, keys.shape[0], step):
            chunk = keys[start : start + step].to(queries.device, dtype)  # (c, dim)
            scores = checked_scores(q, chunk, score) / temperature  # (batch, c): checked by streaming_attention
            weights[:, start : start + step] = torch.exp(scores - lse.unsqueeze(1))  # (batch, c)
    return output, weights


def attend_candidates(
    queries: Tensor, cand: Candidates, *, every: bool, score: str | ScoreFn, pooling: str, temperature: float
) -> tuple[Tensor, Tensor]:
    """Score and pool gathered candidates: ``attend``, or over every record streaming where it can.

    Softmax over every record (``every``) with a built-in score streams in chunks (memory O(batch x chunk)
    instead of O(batch x m) for the autograd graph); other poolings over every record are dense, refused
    up front if their (batch, m) scores, weights and gradients cannot fit.

    Returns:
        output (batch, value_dim) and weights (batch, t).

    Raises:
        MemoryLimitError: dense attention over every record would not fit; as :func:`~kvsearch.attend`.
    """
    if every and pooling == "softmax" and isinstance(score, str) and score in STREAMING_SCORES and len(cand.keys):
        return streaming_attend(queries, cand.keys, cand.values, score=score, temperature=temperature)
    if every:  # dense over every record: scores, weights and their gradients, (b, m) each
        batch = queries.shape[0]
        check_fits(batch * len(cand.keys) * 16, f"attention of {batch:,} queries over every record")
    return attend(
        queries,
        cand.keys,
        cand.values,
        score=score,
        pooling=pooling,
        mask=cand.mask,
        match=cand.match,
        temperature=temperature,
    )
