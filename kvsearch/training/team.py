"""The processes a fine-tuning run or an evaluation works with: this one alone, or the ranks of a sharded database.

A plain :class:`~kvsearch.Database` trains alone (:data:`SOLO`: every operation is the identity). A
:class:`~kvsearch.distributed.ShardedDatabase` served by several ranks has a team whose operations are
collectives: every rank calls them, the same number of times, in the same order. The training loop is written
once against this protocol:

    team = team_of(db)
    for rows in batches(team, n, batch_size):      # the same number of steps on every rank (empty ones at the end)
        ...
        loss = average_gradients(team, params, loss, len(rows))   # what DDP's reducer does, weighted by batch size

Gradients are averaged with one ``all_reduce`` per step rather than by wrapping the encoders in
``DistributedDataParallel``: one encoder object is both the query and the key encoder of a run (``train=
"query+keys"``), used twice in one forward, which DDP's reducer refuses without ``static_graph``; and batches may
be uneven (or empty on some ranks), which DDP's plain mean would weight wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

__all__ = ["SOLO", "Team", "average_gradients", "batches", "team_of"]

T = TypeVar("T")


class Team(Protocol):
    """The ranks that run a loop together (see the module docstring)."""

    rank: int
    world: int

    def max(self, value: int) -> int:
        """The largest ``value`` of every rank."""
        ...

    def sum(self, values: Tensor) -> Tensor:
        """``values`` (n,) float64 summed over the ranks (on the CPU)."""
        ...

    def agree(self, fn: Callable[[], T]) -> T:
        """Run ``fn``; if it raised a kvsearch error on any rank, raise it on every rank."""
        ...


class _Solo:
    """This process alone: every operation is the identity."""

    rank = 0
    world = 1

    def max(self, value: int) -> int:
        return value

    def sum(self, values: Tensor) -> Tensor:
        return values

    def agree(self, fn: Callable[[], T]) -> T:
        return fn()


#: The team of a plain database.
SOLO: Team = _Solo()


def team_of(db: Any) -> Team:
    """The team a database trains with: its ``team`` (a sharded database's ranks), else :data:`SOLO`."""
    return getattr(db, "team", None) or SOLO


def batches(team: Team, n: int, size: int) -> Iterator[slice]:
    """Slices of ``range(n)`` of ``size`` rows; as many on every rank as the rank with the most (empty ones last).

    Args:
        team: the ranks looping together.
        n: this rank's rows.
        size: rows per batch (> 0).

    Returns:
        An iterator of slices (``stop - start`` may be 0 on a rank with fewer rows).
    """
    for step in range(team.max(math.ceil(n / size))):
        yield slice(min(n, step * size), min(n, (step + 1) * size))


def average_gradients(team: Team, params: Sequence[nn.Parameter], loss: float, rows: int) -> float:
    """Make every rank's gradients the full batch's: sum over ranks of ``rows * grad``, divided by all rows.

    Each rank's loss is a mean over its ``rows`` queries, so this is the gradient of the mean over every rank's
    queries (as one process with the whole batch would compute), on every rank alike. One ``all_reduce``.

    Args:
        team: the ranks.
        params: the trained parameters, in the same order on every rank (a missing grad counts as zeros).
        loss: this rank's batch loss (ignored when ``rows`` is 0).
        rows: this rank's batch size (may be 0).

    Returns:
        The mean loss over every rank's rows (this rank's loss alone for :data:`SOLO`).
    """
    if team.world == 1:
        return loss
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    flat = [g.detach().reshape(-1).to("cpu", torch.float64) * rows for g in grads]
    head = torch.tensor([loss * rows if rows else 0.0, float(rows)], dtype=torch.float64)  # (2,)
    total = team.sum(torch.cat([head, *flat]))  # (2 + sum numel,)
    count = float(total[1])
    start = 2
    for p, g in zip(params, grads):
        part = (total[start : start + g.numel()] / count).reshape(g.shape)
        start += g.numel()
        p.grad = part.to(device=p.device, dtype=p.dtype)
    return float(total[0]) / count
