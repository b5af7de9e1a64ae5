"""The collectives a sharded database needs, on a gloo group of its own, with a timeout and typed errors.

:class:`Comm` wraps ``torch.distributed`` (gather of objects and of uneven rows, all_reduce, all_to_all_single,
barrier) and :meth:`Comm.agree`, which raises an error of one rank on every rank so that nobody hangs. In one
process (no process group) every operation is the identity.

Ranks that call different methods would wait in collectives that do not match until the timeout (or exchange
garbage). So every public collective method is wrapped by :func:`collective`: its call's :class:`Signature` (the
method's name, its arguments' shapes, and the arguments every rank must give alike, such as ``k``) rides on the
call's first collective, which is made an object gather (:meth:`Comm.gather_objects`; it already is for nearly
every method, so the check adds no round trip). Every rank sees every rank's signature there, and if they differ
every rank raises :class:`DistributedError` naming both calls ("rank 0 called search(queries=(2, 16), k=5), rank
1 called query(queries=(1, 16), k=5)") at once. A collective method called inside another (``search`` calls
``len`` and ``candidates``) is not checked again: the outer call was.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from kvsearch import errors
from kvsearch.errors import DistributedError, KVSearchError

__all__ = ["DEFAULT_TIMEOUT", "Comm", "Signature", "collective", "describe"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
#: Seconds a collective may wait for a peer before :class:`DistributedError` (torch's own default is 30 minutes).
DEFAULT_TIMEOUT = 120.0


class Comm:
    """The collectives a sharded database needs, on a gloo group of its own (identity in one process).

    Every exception torch.distributed raises (a dead peer, a timeout) becomes :class:`DistributedError`.
    """

    def __init__(self, group: Any, timeout: float) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group = None
        self.calling = False  # inside a collective method (see :meth:`call`)
        self.pending: Signature | None = None  # the call's signature, until its first collective carries it
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
        #: how many ranks of the group run on this machine (by host name), this one included
        self.local_world = 1
        if self.world > 1:
            hosts = self.gather_objects(socket.gethostname())
            self.local_world = hosts.count(hosts[self.rank])

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (RuntimeError, ValueError, OSError) as exc:  # DistBackendError, DistNetworkError, timeouts
            if isinstance(exc, KVSearchError):
                raise
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(f"rank {self.rank}: a collective with the other ranks failed: {message}") from None

    @contextmanager
    def call(self, signature: Signature) -> Iterator[None]:
        """The span of a collective method's call: its first collective carries ``signature`` and raises
        :class:`DistributedError` on every rank if the ranks' signatures differ. Inside another call (a method
        that calls another) nothing more is checked; in one process nothing at all."""
        if self.world == 1 or self.calling:
            yield
            return
        self.calling, self.pending = True, signature
        try:
            yield
        finally:
            self.calling, self.pending = False, None

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (with the pending call signature, checked: see :meth:`call`)."""
        if self.world == 1:
            return [obj]
        out, signatures = self._gather_signed(obj)
        check_signatures(signatures)
        return out

    def _gather_signed(self, obj: Any) -> tuple[list[Any], list[Signature | None]]:
        """Every rank's ``obj`` and the signature of its call (None: none pending), in rank order."""
        signature, self.pending = self.pending, None
        out: list[Any] = [None] * self.world
        self._call(lambda: dist.all_gather_object(out, (signature, obj), group=self.group))
        return [got for _, got in out], [sent for sent, _ in out]

    def _check_call(self) -> None:
        """Before a collective that cannot carry the pending signature: one object gather that does."""
        if self.pending is not None:
            self.gather_objects(None)

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
        self._check_call()
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
        self._check_call()
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        self._call(lambda: dist.all_gather(sizes, torch.tensor([n], dtype=torch.long), group=self.group))
        return [int(s) for s in sizes]

    def exchange(self, rows: Tensor, send_counts: list[int], recv_counts: list[int]) -> Tensor:
        """``all_to_all_single``: rows (sum send_counts, ...) go to the ranks in order; returns what came back."""
        if self.world == 1:
            return rows
        self._check_call()
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
            self._check_call()
            self._call(lambda: dist.barrier(group=self.group))

    def agree(self, local: Callable[[], T]) -> T:
        """Run ``local`` on every rank, then raise on every rank if it raised a kvsearch error on any (the first
        rank's error, with its type, on the others)."""
        result, failure = None, None
        try:
            result = local()
        except KVSearchError as exc:
            failure = exc
        sent = None if failure is None else (type(failure).__name__, str(failure))
        outcomes, signatures = self._gather_signed(sent) if self.world > 1 else ([sent], [None])
        check_signatures(signatures, methods_only=True)  # other methods: their outcomes mean nothing here
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                if failure is not None and rank == self.rank:
                    raise failure
                kind = getattr(errors, outcome[0], KVSearchError)
                kind = kind if isinstance(kind, type) and issubclass(kind, KVSearchError) else KVSearchError
                raise kind(f"rank {rank}: {outcome[1]}")
        check_signatures(signatures)  # one method, arguments that must agree differ (a bad one was raised above)
        return result


# ---------------------------------------------------------------------- call signatures


@dataclass(frozen=True)
class Signature:
    """What one rank called: the method, its arguments as shown, and what every rank must give alike.

    Attributes:
        name: the method, e.g. ``"search"``.
        shown: the call as a message shows it: ``"search(queries=(2, 16), k=5)"``.
        alike: (argument, value) pairs that must be equal on every rank (``("k", 5)``).
    """

    name: str
    shown: str
    alike: tuple[tuple[str, Any], ...] = ()


def check_signatures(signatures: list[Signature | None], *, methods_only: bool = False) -> None:
    """Raise :class:`DistributedError` when the ranks' calls (None: a collective outside any method) differ in
    method or (unless ``methods_only``) in an argument that must agree.

    Raises:
        DistributedError: naming every rank's call and, for one method, the arguments that must agree.
    """
    calls = [None if s is None else (s.name, None if methods_only else s.alike) for s in signatures]
    if all(c == calls[0] for c in calls):
        return
    shown = ", ".join(
        f"rank {r} called " + ("a collective outside any ShardedDatabase method" if s is None else s.shown)
        for r, s in enumerate(signatures)
    )
    if any(s is None or s.name != signatures[0].name for s in signatures):
        raise DistributedError(f"expected every rank to call the same collective method, got: {shown}")
    first = signatures[0].alike
    differ = [a for j, (a, _) in enumerate(first) if any(s.alike[j][1] != first[j][1] for s in signatures)]
    raise DistributedError(
        f"expected every rank to call {signatures[0].name} with the same {', '.join(differ)}, got: {shown}"
    )


def describe(value: Any) -> str:
    """An argument as a mismatch message shows it: a tensor or array by its shape, a list by its length and kind,
    a short text in full; never the data of a large one."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, type):
        return str(tuple(shape))
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 24 else repr(value[:21] + "...")
    if isinstance(value, (list, tuple)):
        kind = "text" if value and all(isinstance(v, str) for v in value) else "item"
        return f"[{len(value)} {kind}{'' if len(value) == 1 else 's'}]"
    if isinstance(value, Mapping):
        return f"{{{len(value)} entr{'y' if len(value) == 1 else 'ies'}}}"
    return getattr(value, "__name__", None) or type(value).__name__


def collective(*alike: str, **derived: Callable[[Any], Any]) -> Callable[[F], F]:
    """Mark a public method of an object with a ``comm`` (:class:`Comm`) as collective: its call's signature is
    checked across the ranks at its first collective (see :meth:`Comm.call`).

    Args:
        alike: names of arguments every rank must pass with equal values (``"k"``).
        derived: argument name -> a function of its value that must be equal on every rank
            (``pooling=lambda p: p == "exact"``: exact pooling on every rank or on none).

    Returns:
        The decorator.
    """

    def decorate(method: F) -> F:
        parameters = inspect.signature(method)

        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            comm: Comm = self.comm
            if comm.world == 1 or comm.calling:
                return method(self, *args, **kwargs)
            try:
                bound = parameters.bind_partial(self, *args, **kwargs)
            except TypeError:  # a wrong call: the method raises Python's own TypeError
                return method(self, *args, **kwargs)
            given = dict(list(bound.arguments.items())[1:])
            for name in (*alike, *derived):  # defaults of the arguments that must agree are shown too
                if name not in given and name in parameters.parameters:
                    given[name] = parameters.parameters[name].default
            shown = ", ".join(f"{name}={describe(value)}" for name, value in given.items())
            agreed = tuple((name, _comparable(given.get(name))) for name in alike) + tuple(
                (name, _comparable(fn(given.get(name)))) for name, fn in derived.items()
            )
            name = method.__name__.strip("_")  # __len__ -> len
            with comm.call(Signature(name, f"{name}({shown})", agreed)):
                return method(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _comparable(value: Any) -> Any:
    """A value that must agree across ranks as one that compares plainly (a tensor ``k`` by its description)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else describe(value)
