"""Score functions: how strongly each query attends to each candidate key, before any pooling.

It owns the one registry of built-in scores, :data:`SCORE_KINDS`: a name maps to a :class:`ScoreKind` holding
everything any reader needs of that score — its torch function (``compute_scores`` dispatches through it), the
index metric a database with it as default needs (``retrieval.metric_of``) and whether that index stores unit keys,
its streaming form (:class:`StreamForm`, what ``nn.streaming`` computes chunk by chunk), its relevance in [0, 1]
(the LangChain store) and whether it is never positive (the pooling check of ``attend``). The name lists derive
from it: ``SCORES`` (every name, ``ScoreName``), ``DB_SCORES`` (those a database can search by: they decide its
index metric); the CLI's ``--score`` choices and ``nn.streaming.STREAMING_SCORES`` read it too. **Adding a
built-in score is one entry in** :data:`SCORE_KINDS`.

``compute_scores(queries, keys, score)`` gives (..., n, m) scores for a built-in name (``dot``, ``scaled_dot``,
``cosine``, ``gaussian``) or calls a score callable; :class:`AdditiveScore` (Bahdanau) and :class:`GaussianKernel`
(Nadaraya-Watson with a learnable bandwidth) are learned score callables (``additive`` is registered by name only
to say so). It also owns the small argument checks the rest of the nn wing shares (``describe``, ``check_option``,
``check_float_tensor``).

It knows nothing of pooling, masks, candidates, FAISS, SQLite or text: the metric and relevance it records are
plain values the index and integration layers read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsearch.checks import COSINE_EPS, all_finite, check_dense, check_dim
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, UnknownOptionError
from kvsearch.nn.precision import host_reads

__all__ = [
    "ScoreName",
    "ScoreFn",
    "ScoreKind",
    "StreamForm",
    "SCORE_KINDS",
    "SCORES",
    "DB_SCORES",
    "check_score",
    "check_db_score",
    "compute_scores",
    "checked_scores",
    "AdditiveScore",
    "GaussianKernel",
    "describe",
    "check_option",
    "check_float_tensor",
]

ScoreFn = Callable[[Tensor, Tensor], Tensor]

# ----------------------------------------------------------------------------- checks


def describe(x: object) -> str:
    """A short description of an argument for error messages."""
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"


def check_option(value: object, valid: tuple[str, ...], what: str) -> str:
    """Return ``value`` if it is one of ``valid``, else raise UnknownOptionError."""
    if not isinstance(value, str) or value not in valid:
        raise UnknownOptionError(f"unknown {what}: expected one of {', '.join(valid)}, got {value!r}")
    return value


def check_float_tensor(x: object, name: str) -> None:
    """Raise InvalidArgumentError unless ``x`` is a dense floating-point tensor (:func:`~kvsearch.checks.check_dense`:
    not sparse, nested, quantized or on the meta device; non-contiguous is fine)."""
    if not isinstance(x, Tensor):
        raise InvalidArgumentError(f"{name} must be a floating-point tensor, got {describe(x)}")
    check_dense(x, name)
    if not x.is_floating_point():
        raise InvalidArgumentError(f"{name} must be a floating-point tensor, got {describe(x)}")


def check_score(score: object) -> None:
    """Accept a callable or a built-in score name; "additive" needs its module."""
    if callable(score):
        return
    if not isinstance(score, str):
        raise InvalidArgumentError(
            f"score must be one of {', '.join(SCORES)} or a callable (queries, keys) -> scores, got {describe(score)}"
        )
    kind = SCORE_KINDS.get(score)
    if kind is None:
        check_option(score, SCORES, "score")  # raises: an unknown name
    elif kind.fn is None:
        raise InvalidArgumentError(kind.hint)


def check_db_score(score: object) -> str:
    """``score`` if a database can use it as its default score.

    Raises:
        UnknownOptionError: anything else.
    """
    if score not in DB_SCORES:
        raise UnknownOptionError(f"expected a database score among {DB_SCORES}, got {score!r}")
    return score


def _check_pair(queries: Tensor, keys: Tensor) -> None:
    """Check queries (..., n, dim) and keys (..., m, dim) for a built-in score."""
    check_float_tensor(queries, "queries")
    check_float_tensor(keys, "keys")
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


# ----------------------------------------------------------------------------- built-in scores


def _unit_rows(x: Tensor, reads: bool) -> Tensor:
    """Rows scaled to unit norm as ``F.normalize`` does (norms clamped to ``COSINE_EPS``: a zero row stays zero).

    A row whose squared norm overflows (entries near 1e19 and above in float32) is first divided by its largest
    entry, which the cosine does not see: its norm is then finite and its direction exact (where values are read
    back, :func:`~kvsearch.nn.precision.host_reads`: under ``torch.compile`` and on a GPU such a row is not looked
    for, and scores 0). ``reads``: :func:`~kvsearch.nn.precision.host_reads` for ``x``'s device, asked once by
    the caller for both sides.
    """
    norms = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # (..., 1)
    # checks.all_finite's first test inline (a query's scores run this twice)
    if reads and not math.isfinite(norms.sum().item()) and not all_finite(norms):
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


def _dot(queries: Tensor, keys: Tensor) -> Tensor:
    """q.k for queries (..., n, dim) and keys (..., m, dim): (..., n, m)."""
    return queries @ keys.transpose(-2, -1)  # (..., n, m)


def _scaled_dot(queries: Tensor, keys: Tensor) -> Tensor:
    """q.k / sqrt(dim) for queries (..., n, dim) and keys (..., m, dim): (..., n, m)."""
    dots = queries @ keys.transpose(-2, -1)  # (..., n, m)
    return dots / math.sqrt(queries.shape[-1])  # (..., n, m)


def _cosine(queries: Tensor, keys: Tensor) -> Tensor:
    """The dot of the unit rows (:func:`_unit_rows`) of queries (..., n, dim) and keys (..., m, dim): (..., n, m)."""
    reads = host_reads(queries.device)  # the keys are on the queries' device
    queries = _unit_rows(queries, reads)  # (..., n, dim)
    keys = _unit_rows(keys, reads)  # (..., m, dim)
    return queries @ keys.transpose(-2, -1)  # (..., n, m)


_MAX_EXP = 709.0  # math.exp(709.0) ~ 8.2e307 is finite; math.exp(709.8) overflows


def _sigmoid(score: float) -> float:
    """An unbounded similarity as ``1 / (1 + exp(-score))`` in [0, 1], for every float: ``-score`` clipped at 709 so
    that ``math.exp`` never overflows (a score below -709 gives ~1e-308, not an OverflowError); NaN gives 0.0."""
    if math.isnan(score):
        return 0.0
    return 1.0 / (1.0 + math.exp(min(-score, _MAX_EXP)))


def _cosine_relevance(score: float) -> float:
    """A cosine in [-1, 1] as ``(1 + score) / 2``, clamped to [0, 1] (float32 rounding may pass 1 by an ulp); NaN:
    0.0. LangChain's ``1 - distance`` on the cosine distance."""
    if math.isnan(score):
        return 0.0
    return min(1.0, max(0.0, (1.0 + score) / 2.0))


def _gaussian_relevance(score: float) -> float:
    """A gaussian score ``-d^2 / 2 <= 0`` as ``1 / (1 + d / sqrt(2)) = 1 / (1 + sqrt(-score))`` in [0, 1]; NaN: 0.0.

    LangChain's relevance of a Euclidean distance, ``1 - d / sqrt(2)``, assumes unit embeddings and is negative past
    ``d = sqrt(2)``; this one has its value and slope at ``d = 0``, gives 0.5 at ``d = sqrt(2)`` (orthogonal unit
    vectors, as the cosine's relevance does) and decays as ``sqrt(2) / d`` instead of reaching 0, so that hits on
    unnormalised embeddings (distances in the tens) stay apart (distance 10: 0.12; 50: 0.028) where ``exp(score)``
    gave every one but near-duplicates 0.0. A threshold ``r`` keeps the hits within ``sqrt(2) (1 - r) / r``.
    """
    if math.isnan(score):
        return 0.0
    return 1.0 / (1.0 + math.sqrt(max(0.0, -score)))


# ----------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class StreamForm:
    """How :func:`~kvsearch.nn.streaming.streaming_attention` computes a score a chunk of keys at a time.

    Its kernel scores ``scale * q.k`` (``scale`` = 1 / temperature) and knows three building blocks, which a score
    switches on here; its backward differentiates each.

    Attributes:
        sqrt_dim: divide the scale by sqrt(dim) (``scaled_dot``).
        unit: scale the queries and each chunk of keys to unit rows, norms clamped to ``COSINE_EPS`` (``cosine``).
        distance: ``-|q - k|^2 / 2`` instead of ``q.k``, computed as ``q'.k' - |k'|^2 / 2 - |q'|^2 / 2`` on
            points centred on a common reference (the query itself for one query, else the keys' mean) so that
            it stays accurate far from the origin (``gaussian``).
    """

    sqrt_dim: bool = False
    unit: bool = False
    distance: bool = False


@dataclass(frozen=True)
class ScoreKind:
    """One built-in score: everything the package needs to know of it, in one place.

    Attributes:
        fn: the torch function (queries (..., n, dim), keys (..., m, dim)) -> (..., n, m) on checked inputs of one
            dtype; None for a learned score, which cannot be named by a string (``hint`` says why).
        metric: the index metric a database with this default score builds (``"ip"`` inner product, ``"l2"``
            squared L2); None: it cannot be a database's default.
        unit_keys: the index stores the keys scaled to unit norm (cosine).
        stream: its :class:`StreamForm` for streaming softmax over every record; None: attention over every
            record is dense for it.
        relevance: the score of one hit as a relevance in [0, 1] (higher is more relevant), for a database score:
            defined, finite and non-decreasing for every float (LangChain's relevance reads it).
        never_positive: its values are never positive (pooling that keeps the positive part would give all-zero
            weights); ``formula`` is then shown in the refusal.
        formula: the score as a formula, for messages.
        hint: why the name alone is refused (``fn`` None).
    """

    fn: ScoreFn | None
    metric: Literal["ip", "l2"] | None = None
    unit_keys: bool = False
    stream: StreamForm | None = None
    relevance: Callable[[float], float] | None = None
    never_positive: bool = False
    formula: str = ""
    hint: str = ""

    @property
    def db_default(self) -> bool:
        """Whether a database can use this score as its default (it decides the index metric)."""
        return self.metric is not None


#: Every built-in score by name. A new built-in score is one entry here: the name lists below, ``compute_scores``,
#: the index metric, streaming attention, the CLI's choices and LangChain's relevance all read it.
SCORE_KINDS: dict[str, ScoreKind] = {
    "dot": ScoreKind(_dot, metric="ip", stream=StreamForm(), relevance=_sigmoid, formula="q.k"),
    "scaled_dot": ScoreKind(
        _scaled_dot, metric="ip", stream=StreamForm(sqrt_dim=True), relevance=_sigmoid, formula="q.k / sqrt(dim)"
    ),
    "cosine": ScoreKind(
        _cosine,
        metric="ip",
        unit_keys=True,
        stream=StreamForm(unit=True),
        relevance=_cosine_relevance,
        formula="q.k / (|q| |k|)",
    ),
    "gaussian": ScoreKind(
        _gaussian,
        metric="l2",
        stream=StreamForm(distance=True),
        relevance=_gaussian_relevance,
        never_positive=True,
        formula="-|q - k|^2 / 2",
    ),
    "additive": ScoreKind(
        None,
        formula="w_v^T tanh(W_q q + W_k k)",
        hint=(
            "the additive score has learned weights, so it cannot be named by a string here: "
            "expected a callable such as AdditiveScore(query_dim, key_dim, hidden), got 'additive' "
            "(KVAttention(score='additive') creates the module for you)"
        ),
    ),
}

#: Every built-in score name (``additive`` included: it names a learned module).
SCORES: tuple[str, ...] = tuple(SCORE_KINDS)
ScoreName = Literal[SCORES]  # the names of SCORE_KINDS, as a type

#: Score functions a database can use as its default (they decide the index metric).
DB_SCORES: tuple[str, ...] = tuple(name for name, kind in SCORE_KINDS.items() if kind.db_default)


def compute_scores(queries: Tensor, keys: Tensor, score: str | ScoreFn) -> Tensor:
    """Score every query against every key.

    ``dot`` is q.k, ``scaled_dot`` q.k / sqrt(dim), ``cosine`` the dot of the unit vectors
    (a zero vector scores 0; rows too large to square are scaled down first), ``gaussian``
    -||q - k||^2 / 2: the direct difference for a query with keys of its own (n = 1), else
    -(|q'|^2 - 2 q'.k' + |k'|^2) / 2 clamped to <= 0 on q' = q - r, k' = k - r with r the keys'
    mean — accurate however far the points are from the origin, with memory O(n m) plus one
    centred copy of each side. A built-in score promotes queries and keys to a common dtype. A callable is called
    as is, with these very shapes (not flattened to 2-D): it must handle leading dims, e.g. with
    ``keys.transpose(-2, -1)`` rather than ``keys.T``, and return (..., n, m).

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
    if queries.dtype != keys.dtype:  # promoted as attend does: float32 queries with float64 keys -> float64
        dtype = torch.promote_types(queries.dtype, keys.dtype)
        queries, keys = queries.to(dtype), keys.to(dtype)
    return checked_scores(queries, keys, score)  # (..., n, m)


def checked_scores(queries: Tensor, keys: Tensor, score: str | ScoreFn) -> Tensor:
    """:func:`compute_scores` of inputs already checked: dense floating-point tensors of one dtype, (..., n, dim)
    and (..., m, dim), and a valid score. ``attend`` and ``streaming_attention`` check their inputs once and call
    this, so their hot path pays each check once.

    Returns:
        Scores (..., n, m).
    """
    if callable(score):
        return score(queries, keys)  # (..., n, m)
    return SCORE_KINDS[score].fn(queries, keys)  # (..., n, m)


# ----------------------------------------------------------------------------- learned scores


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
        check_float_tensor(queries, "queries")
        check_float_tensor(keys, "keys")
        for name, x, rows, dim in (
            ("queries", queries, "n", self.query_dim),
            ("keys", keys, "m", self.key_dim),
        ):
            if x.dim() < 2 or x.shape[-1] != dim:
                raise DimensionMismatchError(
                    f"AdditiveScore expected {name} of shape (..., {rows}, {dim}), got {tuple(x.shape)}"
                )
        if queries.dtype == keys.dtype == self.w_v.weight.dtype:
            features = self.w_q(queries).unsqueeze(-2) + self.w_k(keys).unsqueeze(-3)  # (..., n, m, hidden)
            return self.w_v(torch.tanh(features)).squeeze(-1)  # (..., n, m)
        # inputs of another dtype than the weights: all promoted to a common one, as attend promotes its inputs
        dtype = torch.promote_types(torch.promote_types(queries.dtype, keys.dtype), self.w_v.weight.dtype)
        w_q, w_k, w_v = (layer.weight.to(dtype) for layer in (self.w_q, self.w_k, self.w_v))
        features = F.linear(queries.to(dtype), w_q).unsqueeze(-2) + F.linear(keys.to(dtype), w_k).unsqueeze(-3)
        return F.linear(torch.tanh(features), w_v).squeeze(-1)  # (..., n, m)


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
        check_float_tensor(queries, "queries")
        check_float_tensor(keys, "keys")
        if queries.shape[-1] != keys.shape[-1]:
            raise DimensionMismatchError(f"expected keys of dim {queries.shape[-1]}, got {keys.shape[-1]}")
        diff = queries.unsqueeze(-2) - keys.unsqueeze(-3)  # (..., n, m, dim)
        return -0.5 * (diff * self.w).pow(2).sum(-1)  # (..., n, m)
