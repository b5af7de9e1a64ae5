"""The distributed wing: a database split into shards served by ranks on torch.distributed.

It owns :class:`ShardedDatabase` (``sharded_database``: the facade's API over shards), this rank's part that the
helpers hold instead of the facade (``local``: its shards, the layout, the collectives), the candidates merged by
torch score (``search``), its writes routed to their owner shard (``writes``), its reads by id or exact key
(``reads``), its selections by filter (``selection``: ``where()`` collectively), the layout on disk (``layout``:
``shards.json``, shard folders, global ids, the stable key hash, which rank serves which shard), the collectives on
the database's own gloo group (``collectives``), the sharded generations (``generations``: the switch of every
shard together, a fine-tuning run's draft on every shard, the ranks as a training loop's team), opening a sharded
root (``opening``), threads per rank (``threads``) and resharding (``reshard``: a database copied into N shards).

It uses each shard's public :class:`~kvsearch.database.Database` methods and knows nothing of a shard's internals.
"""

from __future__ import annotations

from kvsearch.distributed.sharded_database import ShardedDatabase

__all__ = ["ShardedDatabase"]
