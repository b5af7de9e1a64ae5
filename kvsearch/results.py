"""What a search or a query returns: :class:`Hit`, :class:`Answer` and the lazily read keys of an answer.

These are plain result objects: they hold tensors, ids and texts, and know nothing of how they were computed
(the index, the store, attention) — :class:`~kvsearch.Database` builds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Hit", "Answer", "LazyKeys", "make_hits", "make_answer"]


@dataclass(frozen=True)
class Hit:
    """One search result.

    Attributes:
        id: the record's global id.
        key: the key text (None for a key given as an embedding).
        value: the value text, or the value embedding (CPU tensor) for a value given as an embedding.
        score: the score function of the database, recomputed in torch on the stored key.
    """

    id: int
    key: str | None
    value: str | Tensor | None
    score: float


@dataclass
class Answer:
    """The result of :meth:`Database.query`: one query unbatched, a list or 2-D tensor batched.

    Attributes:
        output: (value_dim,) or (batch, value_dim): ``sum_i weights_i * values_i``, differentiable.
        weights: (k,) or (batch, k): the attention weights, 0 on missing candidates.
        ids: (k,) or (batch, k): candidate ids, -1 where there was no candidate.
        keys: the candidates' key texts (None where there is no candidate or no text), per query: a
            :class:`LazyKeys` sequence that looks the texts up when read (``.tolist()`` for plain lists).
        value: the value of the highest-weight candidate (text, or a CPU tensor for embedding values);
            None where nothing was found.
        found: whether the query found anything (for ``pooling="exact"``: whether the key is stored).
    """

    output: Tensor
    weights: Tensor
    ids: Tensor
    keys: LazyKeys | list[str | None] | list[list[str | None]]
    value: str | Tensor | None | list[str | Tensor | None]
    found: bool | list[bool]

    def row(self, i: int) -> Answer:
        """The answer of query ``i`` of a batched answer, unbatched (tensors (k,), one value, one found flag)."""
        return Answer(
            output=self.output[i],
            weights=self.weights[i],
            ids=self.ids[i],
            keys=self.keys[i],
            value=self.value[i],
            found=self.found[i],
        )

    def plot(self, *, top: int | None = None, figsize: tuple[float, float] | None = None) -> Any:
        """Draw this answer's candidates and their attention weights (see :func:`kvsearch.plot.plot_answer`).

        Args:
            top: show at most this many candidates per query; default all.
            figsize: the figure size in inches.

        Returns:
            The matplotlib Figure.

        Raises:
            MissingDependencyError: matplotlib is not installed (``pip install kvsearch[plot]``).
        """
        from kvsearch.plot import plot_answer  # matplotlib stays optional: imported only when plotting

        return plot_answer(self, top=top, figsize=figsize)


class LazyKeys(Sequence):
    """The candidates' key texts of an :class:`Answer`, looked up when read rather than built per row.

    Indexing a batch gives one query's row (itself lazy); indexing a row gives a key text (None where the
    candidate is missing or has no text). Compares equal to the list it stands for.

    Args:
        ids: (k,) or (batch, k) int64 CPU ids, -1 where there is no candidate.
        key_of_id: id -> key text.
    """

    def __init__(self, ids: Tensor, key_of_id: Mapping[int, str]) -> None:
        self._ids = ids
        self._key_of_id = key_of_id

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __getitem__(self, index: int | slice) -> str | None | LazyKeys | list:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self._ids[index]
        if row.dim() == 0:
            return self._key_of_id.get(int(row))
        return LazyKeys(row, self._key_of_id)

    def __iter__(self) -> Iterator:
        if self._ids.dim() == 1:
            get = self._key_of_id.get
            return iter([get(i) for i in self._ids.tolist()])
        return (LazyKeys(row, self._key_of_id) for row in self._ids)

    def tolist(self) -> list:
        """The plain list (a list of lists for a batch) of key texts."""
        return [x.tolist() if isinstance(x, LazyKeys) else x for x in self]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyKeys):
            other = other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None  # compares by content, like a list

    def __repr__(self) -> str:
        return repr(self.tolist())


def make_hits(
    ids: Tensor, scores: Tensor, key_of_id: Mapping[int, str], values: Mapping[int, str | Tensor | None]
) -> list[list[Hit]]:
    """One list of :class:`Hit` per query, best first, from ranked ids and scores.

    Args:
        ids: (batch, k) int64 CPU ids, best first, -1 where there is no candidate (skipped).
        scores: (batch, k) float scores.
        key_of_id: id -> key text. values: id -> value (text or CPU tensor).
    """
    return [
        [Hit(id=i, key=key_of_id.get(i), value=values.get(i), score=s) for i, s in zip(row, row_s) if i >= 0]
        for row, row_s in zip(ids.tolist(), scores.tolist())
    ]


def make_answer(
    output: Tensor,
    weights: Tensor,
    ids: Tensor,
    *,
    k: int | None,
    key_of_id: Mapping[int, str],
    values_of: Callable[[list[int]], Mapping[int, str | Tensor | None]],
    device: torch.device,
) -> Answer:
    """A batched :class:`Answer` from pooled attention over candidates.

    Args:
        output: (batch, value_dim). weights: (batch, t). ids: (batch, t) or (t,) shared by every query.
        k: pad to k candidates ("no candidate": weight 0, id -1) when fewer came; None for every record.
        key_of_id: id -> key text, read lazily. values_of: ids -> their values, for the best candidates.
        device: where the tensors of the answer go (the queries' device).
    """
    ids = ids if ids.dim() == 2 else ids.unsqueeze(0).expand(weights.shape[0], -1)  # (batch, t)
    if k is not None and weights.shape[1] < k:
        weights = F.pad(weights, (0, k - weights.shape[1]))  # (batch, k) zeros
        ids = F.pad(ids, (0, k - ids.shape[1]), value=-1)  # (batch, k)
    found = weights.detach().sum(-1) > 0  # (batch,)
    if weights.shape[1] == 0:  # no candidate at all (k="all" with a filter that matched nothing): not found
        best = torch.full((weights.shape[0],), -1, dtype=torch.long)  # (batch,)
    else:
        best = ids.gather(1, weights.detach().argmax(-1, keepdim=True)).squeeze(1)  # (batch,)
    best = torch.where(found, best.to(found.device), -1).cpu()  # (batch,)
    values = values_of(best[best >= 0].tolist())
    return Answer(
        output=output.to(device),
        weights=weights.to(device),
        ids=ids.to(device),
        keys=LazyKeys(ids.cpu(), key_of_id),  # texts looked up on access, not per row here
        value=[values.get(i) if i >= 0 else None for i in best.tolist()],
        found=found.cpu().tolist(),
    )
