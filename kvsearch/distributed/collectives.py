"""The collectives a sharded database needs, on a gloo group of its own, with a timeout and typed errors.

:class:`Comm` wraps ``torch.distributed`` (gather of objects and of uneven rows, all_reduce, all_to_all_single,
barrier) and :meth:`Comm.agree`, which raises an error of one rank on every rank so that nobody hangs. In one
process (no process group) every operation is the identity.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from kvsearch import errors
from kvsearch.errors import DistributedError, KVSearchError

__all__ = ["DEFAULT_TIMEOUT", "Comm"]

T = TypeVar("T")
#: Seconds a collective may wait for a peer before :class:`DistributedError` (torch's own default is 30 minutes).
DEFAULT_TIMEOUT = 120.0


class Comm:
    """The collectives a sharded database needs, on a gloo group of its own (identity in one process).

    Every exception torch.distributed raises (a dead peer, a timeout) becomes :class:`DistributedError`.
    """

    def __init__(self, group: Any, timeout: float) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group = None
        self.rank, self.world = 0, 1
        if self.active:
            base = group if group is not None else dist.group.WORLD
            ranks = dist.get_process_group_ranks(base)
            self.world = len(ranks)
            self.rank = dist.get_rank(base)
            # a CPU group with this database's timeout (the default group may be NCCL, or have torch's 30 minutes)
            self.group = self._call(
                lambda: dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
            )

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (RuntimeError, ValueError, OSError) as exc:  # DistBackendError, DistNetworkError, timeouts
            if isinstance(exc, KVSearchError):
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(f"rank {self.rank}: a collective with the other ranks failed: {message}") from None

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self._call(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def all_sum(self, value: int) -> int:
        """The sum of every rank's ``value``."""
        return int(self.all_reduce(torch.tensor([value], dtype=torch.long))[0])

    def all_max(self, value: int) -> int:
        """The largest of every rank's ``value``."""
        return int(self.all_reduce(torch.tensor([value], dtype=torch.long), dist.ReduceOp.MAX)[0])

    def all_reduce(self, values: Tensor, op: Any = None) -> Tensor:
        """``values`` (a CPU tensor) reduced over the ranks (default: summed); a new tensor."""
        if self.world == 1:
            return values
        out = values.detach().cpu().clone()
        self._call(lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM if op is None else op, group=self.group))
        return out

    def gather_rows(self, rows: Tensor) -> tuple[Tensor, list[int]]:
        """Every rank's rows (n_r, ...) concatenated in rank order, and the counts n_r (uneven sizes allowed)."""
        if self.world == 1:
            return rows, [rows.shape[0]]
        counts = [int(c) for c in self.gather_sizes(rows.shape[0])]
        biggest = max(counts) if counts else 0
        padded = torch.zeros((biggest, *rows.shape[1:]), dtype=rows.dtype)
        padded[: rows.shape[0]] = rows
        out = [torch.empty_like(padded) for _ in range(self.world)]
        self._call(lambda: dist.all_gather(out, padded, group=self.group))
        return torch.cat([part[:n] for part, n in zip(out, counts)]), counts

    def gather_sizes(self, n: int) -> list[int]:
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        self._call(lambda: dist.all_gather(sizes, torch.tensor([n], dtype=torch.long), group=self.group))
        return [int(s) for s in sizes]

    def exchange(self, rows: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """``all_to_all_single``: rows (sum send_counts, ...) go to the ranks in order; returns what came back."""
        if self.world == 1:
            return rows
        tail = tuple(rows.shape[1:])
        width = math.prod(tail)
        out = torch.empty(sum(recv_counts) * width, dtype=rows.dtype)
        flat = rows.reshape(-1).contiguous()
        self._call(
            lambda: dist.all_to_all_single(
                out,
                flat,
                output_split_sizes=[c * width for c in recv_counts],
                input_split_sizes=[c * width for c in send_counts],
                group=self.group,
            )
        )
        return out.reshape(sum(recv_counts), *tail)

    def barrier(self) -> None:
        if self.world > 1:
            self._call(lambda: dist.barrier(group=self.group))

    def agree(self, local: Callable[[], T]) -> T:
        """Run ``local`` on every rank, then raise on every rank if it raised a kvsearch error on any (the first
        rank's error, with its type, on the others)."""
        result, failure = None, None
        try:
            result = local()
        except KVSearchError as exc:
            failure = exc
        outcomes = self.gather_objects(None if failure is None else (type(failure).__name__, str(failure)))
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                if failure is not None and rank == self.rank:
                    raise failure
                kind = getattr(errors, outcome[0], KVSearchError)
                kind = kind if isinstance(kind, type) and issubclass(kind, KVSearchError) else KVSearchError
                raise kind(f"rank {rank}: {outcome[1]}")
        return result
