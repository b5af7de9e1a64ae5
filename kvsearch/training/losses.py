"""The losses of fine-tuning, and the :class:`Batch` every loss reads.

A loss is a function ``(Batch) -> 0-dim tensor``: the trainer gathers a batch of queries, their ``k``
candidates and the attention over them into a :class:`Batch`, and a loss reduces it to one number that
gradients flow back from. Three are built in and registered by name (:data:`LOSS_FNS`):

    "retrieval"   cross-entropy over the candidates' scores, the target record being the class
    "answer"      1 - cosine(pooled answer, target value embedding)
    "answer_mse"  mean squared error between the pooled answer and the target value embedding

This module owns the batch, the losses and their registry. It knows nothing of the database, the index,
encoders, text or the training loop: it sees tensors only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

import torch.nn.functional as F
from torch import Tensor

from kvsearch.errors import InvalidArgumentError, UnknownOptionError

__all__ = [
    "LossName",
    "LossFn",
    "LOSSES",
    "ANSWER_LOSSES",
    "LOSS_FNS",
    "Batch",
    "retrieval_loss",
    "answer_loss",
    "answer_mse_loss",
    "get_loss",
]

LossName = Literal["retrieval", "answer", "answer_mse"]
#: The names of the built-in losses.
LOSSES: tuple[str, ...] = get_args(LossName)
#: The losses taken on the pooled answer: they need no label of which record is right (value targets do).
ANSWER_LOSSES: tuple[str, ...] = ("answer", "answer_mse")


@dataclass
class Batch:
    """What a loss sees for one batch of b queries and their k candidates.

    Attributes:
        queries: (b, dim) query embeddings, with grad when the query encoder trains.
        scores: (b, k) raw scores of the candidates (before the temperature); -inf never appears.
        weights: (b, k) attention weights (0 on missing candidates).
        output: (b, value_dim) the pooled answer ``weights @ values``.
        ids: (b, k) candidate ids, -1 where none.
        mask: (b, k) True where the candidate exists.
        match: (b, k) True on the target record (key targets), else None.
        target_values: (b, value_dim) the embedding of the right answer.
        temperature: the softmax temperature of the run.
    """

    queries: Tensor
    scores: Tensor
    weights: Tensor
    output: Tensor
    ids: Tensor
    mask: Tensor
    match: Tensor | None
    target_values: Tensor
    temperature: float


#: A loss: a :class:`Batch` in, a 0-dim tensor out (the trainer refuses anything else).
LossFn = Callable[[Batch], Tensor]


def retrieval_loss(batch: Batch) -> Tensor:
    """Cross-entropy over the candidates' scores / temperature, the target record being the class.

    The retriever learns to rank the right record first among the ``k`` the index picked: for each query,
    ``-log softmax(scores / temperature)[target]`` over the existing candidates, averaged over the queries
    whose target is among them. A query without its target takes no part (it gets no gradient).

    Requirements:
        Key targets: ``batch.match`` marks the right record. The trainer forces the target among the
        candidates when the index missed it (RAG / REALM style), so every query of a training batch has one.

    Inputs:
        ``scores`` (b, k), ``mask`` (b, k), ``match`` (b, k), ``temperature``.

    Relations:
        Like sentence-transformers' MultipleNegativesRankingLoss, with the index's other candidates as the
        negatives (hard negatives, not in-batch ones) and ``1 / temperature`` as the scale.
        :func:`answer_loss` needs no record label instead.

    Args:
        batch: a :class:`Batch` with ``match``.

    Returns:
        The mean loss over the queries whose target is among the candidates (a 0-dim tensor); a zero that
        keeps the graph when no query has one.

    Raises:
        InvalidArgumentError: ``batch.match`` is None (targets given as values).
    """
    if batch.match is None:
        raise InvalidArgumentError('the retrieval loss needs key targets (targets="key"), got value targets')
    logits = (batch.scores / batch.temperature).masked_fill(~batch.mask, -math.inf)  # (b, k)
    has = batch.match.any(-1)  # (b,)
    target = batch.match.float().argmax(-1)  # (b,)
    if not bool(has.any()):
        return batch.scores.sum() * 0.0  # () no target in this batch: a zero that keeps the graph
    return F.cross_entropy(logits[has], target[has])  # ()


def answer_loss(batch: Batch) -> Tensor:
    """One minus the cosine between the pooled answer and the target value's embedding, averaged.

    The gradient reaches the queries only through the attention weights: the answer moves towards the
    target value by weighting the candidates that hold it (or a similar value) more.

    Requirements:
        The target value's embedding; no label of which record is right (several records may share the value).

    Inputs:
        ``output`` (b, value_dim), ``target_values`` (b, value_dim).

    Relations:
        :func:`answer_mse_loss` is the same with a squared error, for values whose norm matters (regression).

    Args:
        batch: a :class:`Batch`.

    Returns:
        A 0-dim tensor in [0, 2].
    """
    return (1 - F.cosine_similarity(batch.output, batch.target_values, dim=-1, eps=1e-8)).mean()  # ()


def answer_mse_loss(batch: Batch) -> Tensor:
    """The mean squared error between the pooled answer and the target value's embedding.

    Requirements:
        The target value's embedding (a text pair's value encoded, or a tensor pair's value).

    Inputs:
        ``output`` (b, value_dim), ``target_values`` (b, value_dim).

    Relations:
        With the gaussian score and softmax pooling this is Nadaraya-Watson kernel regression fitted by least
        squares (see ``kvsearch.nn.scores.GaussianKernel``). :func:`answer_loss` ignores the norm.

    Args:
        batch: a :class:`Batch`.

    Returns:
        A 0-dim tensor.
    """
    return F.mse_loss(batch.output, batch.target_values)  # ()


#: The registry of the built-in losses, by name (read-only).
LOSS_FNS: Mapping[str, LossFn] = MappingProxyType(
    {"retrieval": retrieval_loss, "answer": answer_loss, "answer_mse": answer_mse_loss}
)


def get_loss(loss: LossName | LossFn) -> LossFn:
    """The loss function of a name from :data:`LOSSES`, or the callable itself.

    Args:
        loss: a built-in loss name or a callable ``(Batch) -> 0-dim tensor``.

    Returns:
        The loss function.

    Raises:
        UnknownOptionError: a name that is not registered (or neither a name nor a callable).
    """
    if callable(loss):
        return loss
    if not isinstance(loss, str) or loss not in LOSS_FNS:
        raise UnknownOptionError(f"expected loss among {LOSSES} or a callable, got {loss!r}")
    return LOSS_FNS[loss]
