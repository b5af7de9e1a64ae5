"""This rank's part of a sharded database: its open shards and what serving them needs, and nothing above them.

:class:`LocalShards` is what the sharded wing's helpers hold instead of the facade
(:class:`~kvsearch.distributed.ShardedDatabase`): the reads by id (:mod:`~kvsearch.distributed.reads`), the writes
(:mod:`~kvsearch.distributed.writes`), the candidates merge (:mod:`~kvsearch.distributed.search`), the selection by
filter (:mod:`~kvsearch.distributed.selection`) and a fine-tuning run's draft
(:mod:`~kvsearch.distributed.generations`) each get it from the facade, so references point down: none of them
can reach the facade, and dropping the facade frees them all (no cycle).

It knows nothing of the operations done with it: it holds the root folder, the ranks' collectives
(:class:`~kvsearch.distributed.collectives.Comm`), this rank's shards (shard number -> open
:class:`~kvsearch.database.Database`) and what ``shards.json`` fixes (shard count, dims, score, id layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvsearch.distributed.collectives import Comm
from kvsearch.distributed.layout import ShardLayout

if TYPE_CHECKING:
    from kvsearch.database import Database
    from kvsearch.encoders.base import Encoder

__all__ = ["LocalShards"]


@dataclass(eq=False)
class LocalShards:
    """This rank's shards of a sharded database and what serving them needs.

    Attributes:
        path: the root folder (``shards.json`` and the shard folders).
        comm: the collectives of the database's ranks.
        shards: shard number -> its open database, this rank's shards only (``s % world == rank``).
        num_shards, dim, value_dim, score: as ``shards.json`` records them.
        banded_ids: whether an id's high bits name its shard (False after a reshard: see
            :func:`~kvsearch.distributed.reads.owner_shards`).
        device: where results are returned.
    """

    path: Path
    comm: Comm
    shards: dict[int, Database]
    num_shards: int
    dim: int
    value_dim: int
    score: str
    banded_ids: bool
    device: torch.device

    @property
    def rank(self) -> int:
        """This rank's number in the database's group."""
        return self.comm.rank

    @property
    def encoder(self) -> Encoder | None:
        """The key encoder (one object shared by this rank's shards), or None."""
        return next(iter(self.shards.values())).encoder

    @property
    def value_encoder(self) -> Encoder | None:
        """The value encoder (shared by this rank's shards), or None."""
        return next(iter(self.shards.values())).value_encoder

    def records(self) -> int:
        """How many records this rank's shards hold (not collective)."""
        return sum(len(db) for db in self.shards.values())

    def generation(self) -> int:
        """The generation every shard is at: ``shards.json``'s commit point (a shard's own before the first
        switch recorded one)."""
        recorded = ShardLayout.read(self.path).generation
        return next(iter(self.shards.values())).generation if recorded is None else recorded
