"""The half-precision scan with exact float32 rescoring.

This module owns :func:`half_keys` (the half-precision copy of the keys and the norms its bound needs),
:func:`half_candidates` (scan a bfloat16 / float16 copy of the keys for the best ``k'`` rows,
rescore those in float32, check per query that nothing left out can belong to the top k),
:func:`half_error` (the proven bound that check uses); the id tie-break every exact path ends with is
:mod:`kvsearch.index.topk`'s. :class:`kvsearch.index.torch_index.TorchIndex` drives them; this module knows nothing of
sources, ids' storage, FAISS or autograd.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import COSINE_EPS
from kvsearch.index.topk import Metric, chunked_topk

__all__ = [
    "UNIT_ROUNDOFF",
    "FP16_SAFE",
    "half_error",
    "half_keys",
    "half_candidates",
]

#: Unit roundoff of each half type (round to nearest): a stored value is within u * |x| of the float32 one.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
#: float16 range: a score or element beyond this overflows; such queries are searched in float32.
FP16_SAFE = 3.0e4


def half_keys(keys: Tensor, dtype: torch.dtype, *, unit: bool) -> tuple[Tensor, float, float]:
    """The half-precision copy of ``keys`` (n, dim) in ``dtype`` (unit rows where ``unit``: cosine over raw keys),
    made 65,536 rows at a time, with its largest row norm and largest element (what :func:`half_error` needs).

    Returns:
        half (n, dim) on the keys' device, max_norm, max_abs (0.0 for no keys).
    """
    parts, max_norm, max_abs = [], 0.0, 0.0
    for start in range(0, len(keys), 65_536):
        block = keys[start : start + 65_536].float()  # (c, dim)
        scored = F.normalize(block, dim=-1, eps=COSINE_EPS) if unit else block  # (c, dim)
        half = scored.to(dtype)  # (c, dim)
        parts.append(half)
        as_float = half.float()  # (c, dim)
        max_norm = max(max_norm, float(as_float.norm(dim=-1).max()))
        max_abs = max(max_abs, float(as_float.abs().max()))
    if not parts:
        return torch.empty(0, keys.shape[1], dtype=dtype, device=keys.device), 0.0, 0.0
    return torch.cat(parts), max_norm, max_abs


def half_error(q: Tensor, dtype: torch.dtype, max_norm: float, max_abs: float, metric: Metric) -> Tensor:
    """A proven bound (batch,) on |half-precision score - float32 score| of any key.

    Rounding q and k to the half type moves each product q_i k_i by at most (2u + u^2) |q_i k_i|; the
    float32 accumulation by at most dim * 2^-24 * sum |q_i k_i|; rounding the half output by u |s|. With
    sum |q_i k_i| <= |q| |k| (Cauchy-Schwarz) that is at most c |q| max|k|, c = 3u + 3u^2 + 2 dim 2^-24.
    Below the type's smallest normal number ``tiny`` rounding is absolute (or a flush to zero on some
    hardware): an element smaller than ``tiny`` may be lost whole, at most tiny (1 + u) sqrt(dim) (|q| +
    max|k|) over the sum, and the output at most ``tiny``. For l2 the maximised score is
    2 q.k - |k|^2 (|k|^2 exact): twice the error. Where a float16 score or element could overflow the
    bound is infinite (such a query is searched in float32).

    Args:
        q: (batch, dim) float32 queries as scored (normalised for cosine), on the keys' device.
        dtype: the half type of the key copy.
        max_norm: the largest row norm of the half copy.
        max_abs: its largest element magnitude.
        metric: ``"ip"`` or ``"l2"`` (twice the bound: the maximised score is 2 q.k - |k|^2).

    Returns:
        (batch,) float32; inf where a float16 score or element could overflow.
    """
    dim = q.shape[1]
    u, tiny = UNIT_ROUNDOFF[dtype], float(torch.finfo(dtype).tiny)
    q_norm = q.norm(dim=1)  # (batch,)
    c = 3 * u + 3 * u * u + 2 * dim * 2.0**-24
    lost = tiny * (1 + u) * math.sqrt(dim) * (q_norm + max_norm) + tiny  # (batch,)
    bound = 1.01 * (c * q_norm * max_norm + lost)  # (batch,)
    if dtype == torch.float16:
        unsafe = (q.abs().amax(dim=1) > FP16_SAFE) | (q_norm * max_norm > FP16_SAFE)  # (batch,)
        unsafe |= max_abs > FP16_SAFE
        bound = bound.masked_fill(unsafe, math.inf)  # (batch,)
    return bound * (2.0 if metric == "l2" else 1.0)  # (batch,)


def half_candidates(
    q: Tensor,
    keys: Tensor,
    half: Tensor,
    width: int,
    bound: Tensor,
    *,
    metric: Metric,
    norm_term: Tensor | None,
    scan_norm: Tensor | None,
    keep: Tensor | None,
    chunk_elements: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The ``width`` best rows of a half-precision scan, rescored exactly, and whether each query is settled.

    Every key left out scored at most ``a`` (the ``width``-th half score kept), so at most ``a + E`` exactly
    (``E`` = ``bound``). The candidates hold every key of the exact top ``take`` -- ties at the ``take``-th
    score included -- wherever the ``take``-th exact score among them is above ``a + E`` (checked by the
    caller with :func:`kvsearch.index.topk.settled`), or where fewer than ``width`` admissible keys exist (all were
    kept).

    Args:
        q: (s, dim) float32 queries as scored, on the keys' device.
        keys: (n, dim) float32 keys. half: (n, dim) their half copy (unit rows for cosine over raw keys).
        width: ``k'`` candidates to keep, <= n.
        bound: (s,) the error bound per query.
        metric: ``"ip"`` or ``"l2"``. norm_term: (n,) the float32 scan's per-key term (inverse norms for cosine
            over raw keys, squared norms for l2) or None. scan_norm: what the half scan applies (l2 only).
        keep: (n,) bool rows admitted, or None. chunk_elements: scores computed at once.

    Returns:
        exact (s, width) float32 scores of the candidates (maximised: ip, or 2 q.k - |k|^2; -inf where absent),
        rows (s, width) int64 (-1 where absent), and the left-out ceiling (s,) ``a + E`` (-inf where every
        admissible key was kept).
    """
    approx, cand = chunked_topk(
        q.to(half.dtype),
        half,
        width,
        metric=metric,
        norm_term=scan_norm,
        keep=keep,
        chunk_elements=chunk_elements,
    )  # (s, width) float32, rows (s, width)
    safe_rows = cand.clamp(min=0)  # (s, width)
    step = max(1, (1 << 24) // max(1, width * q.shape[1]))  # queries per gather: <= 2^24 elements (64 MiB)
    exact = torch.cat(
        [
            torch.einsum("bd,bkd->bk", q[i : i + step], keys[safe_rows[i : i + step]].float())  # (b, width)
            for i in range(0, q.shape[0], step)
        ]
    )  # (s, width) as the float32 scan computes
    if norm_term is not None:
        term = norm_term[safe_rows]  # (s, width)
        exact = exact * term if metric == "ip" else exact.mul_(2).sub_(term)  # (s, width)
    exact = exact.masked_fill(cand < 0, -math.inf)  # (s, width)
    ceiling = torch.where(cand[:, -1] < 0, -math.inf, approx[:, -1] + bound)  # (s,)
    return exact, cand, ceiling
