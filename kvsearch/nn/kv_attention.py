"""The :class:`KVAttention` layer: attention over a database as a torch module, queries in, output out.

    layer = KVAttention(db, k=16, score="scaled_dot", pooling="softmax")
    output = layer(queries)                  # (batch, dim) -> (batch, value_dim); layer.last_weights, last_ids

It owns the layer's options (k, score, pooling, temperature, dropout; ``score="additive"`` creates an
:class:`~kvsearch.nn.scores.AdditiveScore` submodule) and its door: the queries are checked here once, the database
is asked for candidates and they go to :func:`~kvsearch.nn.attend.attend_candidates`, which checks nothing again (the
call into the database runs eagerly: under ``torch.compile`` it is the layer's one graph break; under
``torch.func.vmap`` a custom op whose vmap rule searches every example's queries as one batch). On a GPU the forward
and backward read nothing back to the host (:func:`~kvsearch.nn.precision.host_reads`). The database is duck-typed
(``dim``, ``candidates``, optionally ``exact_targets``): this module knows nothing of FAISS, SQLite, text or files.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Literal

import torch
from torch import Tensor, nn

from kvsearch.checks import check_finite, check_k, check_temperature
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError
from kvsearch.nn.attend import Candidates, attend_candidates, check_dropout, check_pairing
from kvsearch.nn.pooling import POOLINGS
from kvsearch.nn.precision import host_reads, vmapping
from kvsearch.nn.scores import AdditiveScore, ScoreFn, check_float_tensor, check_option, check_score

__all__ = ["KVAttention"]


class KVAttention(nn.Module):
    """Attention over a database as a torch layer: queries (batch, dim) -> output (batch, value_dim).

    The database is duck-typed: it needs ``dim`` and ``candidates(queries, k) -> Candidates``
    (it detaches the queries for its index search itself). With exact pooling, a database that
    also has ``exact_targets(queries) -> ids`` (and ``candidates(..., targets=ids)``) decides
    which stored key each query is, as ``Database.query`` does (one equal key embedding, else not
    found, also when several are equal); without it, the candidates' embeddings are compared.
    The last weights and ids are kept on ``last_weights`` / ``last_ids`` (detached; ids are
    expanded to the weights' shape for ``k="all"``).

    Under ``torch.autocast`` (CPU bfloat16, CUDA float16 / bfloat16) the index searches in its own
    dtype (autocast off), and the scores, pooling and weighted sum run in float32 with autocast off, as
    fused ``scaled_dot_product_attention`` does; the output comes out in the autocast dtype
    (``torch.get_autocast_dtype(device_type)`` of the queries' device) and ``last_weights`` in float32.
    Without autocast the output has the promoted dtype of queries, keys and values (float32 for a
    ``Database``). Gradients reach low-precision queries in their own dtype.

    On a GPU (where :func:`~kvsearch.nn.precision.host_reads` is False) forward and backward make no host-device
    synchronisation, so a model's step never waits for the device: the queries are not looked at for NaN / Inf and
    the scores and output not for overflow (as torch's own ops do not look: NaN comes out), and the candidates stay
    on the device (with a ``Database`` whose torch index is on that device).

    Under ``torch.compile`` the call into the database (``candidates``, ``exact_targets``) is a graph
    break (``torch.compiler.disable``): it runs eagerly and checks the queries for NaN / Inf there; the
    scores, pooling and blend compile, without the host-syncing overflow checks of eager mode (a
    compiled model raises no ``NonFiniteError`` for an overflow, as torch's own ops do not).

    Under ``torch.func.vmap`` (per-example queries (batch, dim); ``vmap(grad(...))`` for per-example gradients) the
    layer gives what a Python loop over the examples gives: the database is searched once, outside vmap, with every
    example's queries as one batch (checked for NaN / Inf there: ``NonFiniteError`` names the flattened shape), and
    the scores, pooling and blend run batched without the overflow checks (nothing can be read back under vmap).
    ``last_weights`` / ``last_ids`` are None after a vmapped call (a batched tensor cannot outlive vmap), and
    dropout in training needs vmap's ``randomness="different"`` or ``"same"``.

    The database is a resource, not state: ``state_dict()`` never holds it, ``copy.deepcopy`` / ``AveragedModel``
    share it by reference, and pickling the layer pickles it as it pickles itself (a ``Database`` on disk as its
    folder, reopened on load; one in memory raises ``NotPicklableError``: save the ``state_dict()`` instead).
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
        self.pooling = check_option(pooling, POOLINGS, "pooling")
        check_pairing(score, self.pooling)
        self.temperature = check_temperature(temperature)
        self.dropout = check_dropout(dropout)
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
            Output (batch, value_dim): in the autocast dtype under autocast, else the promoted dtype.

        Raises:
            InvalidArgumentError: queries are not a floating-point tensor.
            DimensionMismatchError: queries are not (batch, db.dim), or the candidates do not line up.
            NonFiniteError: queries hold NaN or Inf (where values are read back: not on a GPU; under vmap, every
                example's queries at once).
            EmptyDatabaseError: (raised by a Database's ``candidates``) the database holds no records; an empty
                batch (0, dim) is answered with an empty output (0, value_dim).
        """
        check_float_tensor(queries, "queries")
        batched = vmapping()  # under torch.func.vmap the search runs outside it, on the examples' queries flattened
        if batched:
            self._check_queries(queries)  # each example's shape, before the flattening hides it
            cand = Candidates(*_CandidatesUnderVmap.apply(queries, self))
        else:
            cand = self._candidates(queries)  # eager: a graph break under torch.compile
        output, weights = attend_candidates(
            queries,
            cand,
            score=self.score_fn,
            pooling=self.pooling,
            temperature=self.temperature,
            dropout=self.dropout if self.training else 0.0,
        )  # (batch, value_dim), (batch, k | m): nothing checked again below this door
        if batched:  # a batched tensor must not outlive vmap
            self.last_weights = self.last_ids = None
            return output  # (batch, value_dim)
        ids = cand.ids if cand.ids.dim() == 2 else cand.ids.expand_as(weights)  # (batch, k | m)
        self.last_weights = weights.detach()  # (batch, k | m)
        self.last_ids = ids.detach()  # (batch, k | m)
        return output  # (batch, value_dim)

    # torch.compiler.disable, imported at the first call: decorating at import would import torch._dynamo (and sympy,
    # ~1.7 s and ~70 MB) in every process that imports kvsearch, compiling or not
    @torch._disable_dynamo
    def _candidates(self, queries: Tensor) -> Candidates:
        """The database's candidates for checked queries (batch, db.dim), searched in eager mode.

        ``torch.compile`` breaks its graph here: the index search (FAISS, SQLite reads, Python bookkeeping) is not
        torch math, and it runs eagerly, its checks of the queries included; the attention around it compiles.
        """
        self._check_queries(queries)
        if host_reads(queries.device):  # on a GPU nothing is read back (see nn.precision.host_reads)
            check_finite(queries)  # before the index sees them
        exact_targets = getattr(self.db, "exact_targets", None)
        if self.pooling == "exact" and callable(exact_targets):  # the database's rule: one equal stored key
            return self.db.candidates(queries, self.k, targets=exact_targets(queries))
        return self.db.candidates(queries, self.k)

    def _check_queries(self, queries: Tensor) -> None:
        """DimensionMismatchError unless the queries are (batch, db.dim) (under vmap: each example's shape)."""
        if queries.dim() != 2 or queries.shape[-1] != self.db.dim:
            raise DimensionMismatchError(
                f"expected queries of shape (batch, {self.db.dim}), got {tuple(queries.shape)}"
            )

    def extra_repr(self) -> str:
        """The options, for ``repr``."""
        score = self.score_fn if isinstance(self.score_fn, str) else type(self.score_fn).__name__
        return (
            f"k={self.k!r}, score={score!r}, pooling={self.pooling!r}, "
            f"temperature={self.temperature}, dropout={self.dropout}"
        )


_CandidateTensors = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]  # Candidates' fields, in order


class _CandidatesUnderVmap(torch.autograd.Function):
    """The database's candidates for queries under ``torch.func.vmap`` (torch's rule for a custom op: the ``vmap``
    staticmethod): the examples' queries, (vmapped, batch, dim), are searched as one batch (vmapped * batch, dim)
    outside vmap -- their NaN / Inf check included -- and the candidates come back batched like them (shared ones,
    ``k="all"``, unbatched). The search has no gradient (the database detaches the queries); neither has its output.
    """

    @staticmethod
    def forward(queries: Tensor, layer: KVAttention) -> _CandidateTensors:
        cand = layer._candidates(queries)
        return cand.ids, cand.keys, cand.values, cand.mask, cand.match

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: _CandidateTensors) -> None:
        ctx.mark_non_differentiable(*(t for t in output if t is not None))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, None]:
        return None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, queries: Tensor, layer: KVAttention) -> tuple[_CandidateTensors, tuple]:
        if in_dims[0] is None:  # the queries are not batched at this level: one search, as it is
            return _CandidatesUnderVmap.apply(queries, layer), (None,) * 5
        examples = queries.movedim(in_dims[0], 0)  # (vmapped, batch, dim)
        size, batch = examples.shape[0], examples.shape[1]
        flat = examples.reshape(size * batch, examples.shape[-1])  # (size * batch, dim)
        found = _CandidatesUnderVmap.apply(flat, layer)  # (size * batch, ...) each
        if found[1].dim() == 2:  # k="all": the same candidates for every query of every example
            return found, (None,) * 5
        per_example = tuple(None if t is None else t.reshape(size, batch, *t.shape[1:]) for t in found)
        return per_example, tuple(None if t is None else 0 for t in found)  # (size, batch, ...) each
