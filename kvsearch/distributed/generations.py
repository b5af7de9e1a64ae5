"""Generations and training loops across the shards of a sharded database.

:class:`ShardedDraft` is a fine-tuning run's draft generation on every shard (made by
:meth:`~kvsearch.distributed.ShardedDatabase.begin_generation`); :class:`ShardTeam` is the database's ranks as the
:class:`~kvsearch.training.team.Team` a training loop works with; :func:`switch_every_shard` moves every
shard to a new generation together (two phases, :func:`one_generation` checks the outcome), and
:func:`check_generations` rolls back, on opening, the shards a crashed switch left one generation ahead.

It knows nothing of the facade (a draft holds this rank's :class:`~kvsearch.distributed.local.LocalShards`, a team
the ranks' collectives), of a shard's internals (each shard's public :class:`~kvsearch.database.Database` methods
only) nor of the training loop that uses the team.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from torch import Tensor

from kvsearch import errors
from kvsearch.distributed.collectives import Comm, collective
from kvsearch.distributed.layout import ShardLayout
from kvsearch.distributed.search import sharded_candidates
from kvsearch.errors import NotSupportedError

if TYPE_CHECKING:
    from kvsearch.database import Database
    from kvsearch.distributed.local import LocalShards
    from kvsearch.nn.attend import Candidates

__all__ = ["ShardTeam", "ShardedDraft", "check_generations", "one_generation", "switch_every_shard"]

T = TypeVar("T")


class ShardedDraft:
    """A fine-tuning run's draft generation on every shard of a sharded database (see :class:`kvsearch.generations.
    Draft`): nothing on disk changes until :meth:`commit`, which switches every shard together. Collective.

    Made by :meth:`ShardedDatabase.begin_generation`. The shards of a rank share one encoder object, which the run
    trains (with its gradients averaged over the ranks: :mod:`kvsearch.training.team`), so every shard's draft sees it.

    Args:
        local: this rank's shards and the ranks' collectives (not the facade: references point down).
        drafts: shard number -> that shard's :class:`~kvsearch.generations.Draft`.
    """

    def __init__(self, local: LocalShards, drafts: dict[int, Any]) -> None:
        self.local = local
        self.drafts = drafts
        self.generation: int | None = None

    @property
    def state(self) -> str:
        """``"open"``, ``"committed"`` or ``"discarded"``."""
        return next(iter(self.drafts.values())).state

    @property
    def comm(self) -> Comm:
        """The ranks' collectives (the sharded database's): a call's signature is checked on them."""
        return self.local.comm

    @collective()
    def refresh(self) -> None:
        """Re-encode every shard's keys with the training key encoder into its working index, then a barrier."""
        self.local.comm.agree(lambda: [draft.refresh() for draft in self.drafts.values()])
        self.local.comm.barrier()

    @collective("k")
    def candidates(
        self, queries: Tensor, k: int | Literal["all"], *, targets: Tensor | None = None, where: Any = None
    ) -> Candidates:
        """As :meth:`ShardedDatabase.candidates`, over the drafts' working keys once :meth:`refresh` ran."""
        return sharded_candidates(self.local, self.drafts, queries, k, targets=targets, where=where)

    @collective()
    def commit(
        self,
        *,
        values: tuple[Tensor, Tensor] | None = None,
        summary: Mapping[str, Any] | None = None,
        refreshed: bool = False,
    ) -> int:
        """Record the encoders as they are now as every shard's new generation (:meth:`ShardedDatabase.
        switch_generation`); ``refreshed`` as :meth:`kvsearch.generations.Draft.commit` says, for every shard.

        Raises:
            NotSupportedError: trained values (not supported across shards yet).
            NonFiniteError: weights or embeddings are not finite: no shard changed and the draft is discarded.
        """
        try:
            if values is not None:
                raise NotSupportedError("train_values=True is not supported across shards yet")

            def commit(shard: int, db: Any) -> int:
                return self.drafts[shard].commit(summary=summary, refreshed=refreshed)

            self.generation = switch_every_shard(self.local, commit)
        except BaseException:
            self.discard()
            raise
        return self.generation

    def discard(self, *, summary: Mapping[str, Any] | None = None) -> None:
        """Put the encoders back as they were at the start on every shard (and record ``summary``, a run that
        committed nothing, as each shard's last run: see :meth:`kvsearch.generations.Draft.discard`). Harmless after
        commit."""
        for draft in self.drafts.values():
            draft.discard(summary=summary)

    def __enter__(self) -> ShardedDraft:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


class ShardTeam:
    """The ranks of a sharded database as a :class:`~kvsearch.training.team.Team`."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self.rank, self.world = comm.rank, comm.world

    def max(self, value: int) -> int:
        return self._comm.all_max(value)

    def sum(self, values: Tensor) -> Tensor:
        return self._comm.all_reduce(values)

    def agree(self, fn: Callable[[], T]) -> T:
        return self._comm.agree(fn)


def switch_every_shard(local: LocalShards, step: Callable[[int, Database], Any]) -> int:
    """Move every shard to a new generation together (see
    :meth:`~kvsearch.distributed.ShardedDatabase.switch_generation`). Collective.

    Args:
        local: this rank's shards, the root folder and the ranks' collectives.
        step: ``step(shard, db)`` commits one shard's new generation.

    Returns:
        The new generation.

    Raises:
        InconsistentDatabaseError: the shards did not all move to one new generation.
        What ``step`` raised on any rank (the shards that moved are rolled back).
    """
    comm = local.comm
    before = local.generation()
    moved: list[Database] = []

    def phase_one() -> None:
        for s, db in local.shards.items():
            step(s, db)
            moved.append(db)

    try:
        comm.agree(phase_one)
    except BaseException:
        for db in moved:
            db.rollback_encoders()
        raise
    after = {db.generation for db in local.shards.values()}
    new = comm.agree(lambda: one_generation(comm.gather_objects(sorted(after)), before))
    if local.rank == 0:
        replace(ShardLayout.read(local.path), generation=new).write(local.path)
    comm.barrier()
    return new


def one_generation(per_rank: list[list[int]], before: int) -> int:
    """The generation every shard moved to, or InconsistentDatabaseError."""
    seen = {g for gens in per_rank for g in gens}
    if len(seen) != 1 or next(iter(seen)) <= before:
        raise errors.InconsistentDatabaseError(
            f"expected every shard at one new generation after {before}, got {sorted(seen)}"
        )
    return next(iter(seen))


def check_generations(layout: ShardLayout, shards: dict[int, Database]) -> None:
    """Roll back shards a crashed switch left one generation ahead of ``shards.json`` (with a warning).

    Raises:
        InconsistentDatabaseError: a shard is at another generation than ``shards.json`` (and not one ahead).
    """
    if layout.generation is None:
        return
    for s, db in shards.items():
        if db.generation == layout.generation + 1:
            warnings.warn(
                f"shard {s} is at generation {db.generation}, shards.json at {layout.generation} (a switch "
                "was interrupted): rolling the shard back",
                RuntimeWarning,
                stacklevel=3,
            )
            db.rollback_encoders()
        if db.generation != layout.generation:
            raise errors.InconsistentDatabaseError(
                f"expected shard {s} at generation {layout.generation} (shards.json), got {db.generation}"
            )
