"""The global top-k candidates of every rank's queries, merged from the shards by the score recomputed in torch.

:func:`sharded_candidates` is the collective step under :meth:`~kvsearch.distributed.ShardedDatabase.candidates`
(and a fine-tuning run's :meth:`~kvsearch.distributed.generations.ShardedDraft.candidates`): the ranks agree on
batch sizes and gather the detached queries (padded: gloo refuses uneven gathers); each rank searches its own
shards, with the filters applied there, and keeps each query's top k by the score recomputed in torch;
``all_to_all_single`` sends every query's candidates (ids, key and value embeddings) back to its rank, which merges
the ``world x k`` of them by score (then id). The gradient to a query never leaves its rank.

It knows nothing of the facade (it is handed this rank's :class:`~kvsearch.distributed.local.LocalShards`), of
texts, pooling or writes, nor of a shard's internals: each source's public ``candidates`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from kvsearch.checks import check_k
from kvsearch.distributed.reads import owner_shards
from kvsearch.errors import NotSupportedError
from kvsearch.index.topk import merge_candidates
from kvsearch.inputs import query_batch
from kvsearch.metadata.filters import check_where
from kvsearch.nn.attend import Candidates

if TYPE_CHECKING:
    from kvsearch.distributed.local import LocalShards

__all__ = ["sharded_candidates"]


def sharded_candidates(
    local: LocalShards,
    sources: Mapping[int, Any],
    queries: Tensor,
    k: int | Literal["all"],
    *,
    targets: Tensor | None = None,
    where: Mapping[str, Any] | None = None,
) -> Candidates:
    """The global top-k candidates of this rank's queries, each shard's part picked by ``sources[shard].candidates``
    (the shard, or a draft generation of it). Collective: every rank calls it, with its own queries.

    Args:
        local: this rank's shards and the ranks' collectives.
        sources: shard number -> what answers that shard's ``candidates`` (every shard of ``local``).
        queries: (batch, dim), possibly (0, dim); detached for the search.
        k: candidates per query (``"all"`` is not supported across shards).
        targets: (batch,) global ids that must be among the candidates (-1 for none).
        where: a metadata filter, applied on the shards.

    Returns:
        :class:`~kvsearch.nn.attend.Candidates`: ids (batch, t), keys (batch, t, dim), values (batch, t, value_dim),
        mask, match — t = min(k, records), best first by the database's score recomputed in torch, ties by id — on
        ``local.device``.

    Raises:
        NotSupportedError: ``k="all"``.
        InvalidArgumentError, DimensionMismatchError: bad arguments (on every rank).
    """
    comm, dim, value_dim = local.comm, local.dim, local.value_dim

    def check() -> int:
        if k == "all":
            raise NotSupportedError('k="all" (attention over every record) is not supported across shards yet')
        kk = check_k(k)
        query_batch(queries, dim, targets)  # dense floating-point (batch, dim), integer targets (batch,)
        if where is not None:
            check_where(where)
        return int(kk)

    take = max(1, min(comm.agree(check), comm.all_sum(local.records())))
    q = queries.detach().to("cpu", torch.float32)  # (b, dim)
    t = torch.full((q.shape[0],), -1, dtype=torch.long) if targets is None else targets.detach().cpu().long()  # (b,)
    all_q, counts = comm.gather_rows(q)  # (B, dim)
    all_t, _ = comm.gather_rows(t)  # (B,)
    filters = comm.gather_objects(None if where is None else dict(where))
    ids, keys, values = comm.agree(lambda: _local_top(local, sources, all_q, all_t, counts, filters, take))
    mine, world = counts[local.rank], comm.world
    send, recv = counts, [mine] * world  # the rows of each source rank go back to it
    got_ids = comm.exchange(ids, send, recv).reshape(world, mine, take)  # (W, b, take)
    got_keys = comm.exchange(keys, send, recv).reshape(world, mine, take, dim)  # (W, b, take, dim)
    got_values = comm.exchange(values, send, recv).reshape(world, mine, take, value_dim)  # (W, b, take, value_dim)
    width = world * take
    ids = got_ids.permute(1, 0, 2).reshape(mine, width)  # (b, W take)
    keys = got_keys.permute(1, 0, 2, 3).reshape(mine, width, dim)  # (b, W take, dim)
    values = got_values.permute(1, 0, 2, 3).reshape(mine, width, value_dim)  # (b, W take, value_dim)
    ids, keys, values = merge_candidates(q, ids, keys, values, t, take, local.score)  # (b, take) ...
    mask = ids >= 0  # (b, take)
    match = None if targets is None else (ids == t.unsqueeze(1)) & mask  # (b, take)
    device = local.device
    return Candidates(
        ids=ids.to(device), keys=keys.to(device), values=values.to(device), mask=mask.to(device),
        match=None if match is None else match.to(device),
    )  # fmt: skip


def _local_top(
    local: LocalShards,
    sources: Mapping[int, Any],
    queries: Tensor,
    targets: Tensor,
    counts: list[int],
    filters: list[Any],
    take: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's best ``take`` candidates for every gathered query: ids (B, take), keys, values (on the CPU)."""
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    start = 0
    for source, n in enumerate(counts):
        q, t = queries[start : start + n], targets[start : start + n]  # (n, dim), (n,)
        start += n
        found = []
        owners = owner_shards(local.shards, t, banded=local.banded_ids) if n else t  # (n,) each target's shard
        for s, db in local.shards.items():
            if n == 0 or len(db) == 0:
                continue
            own = torch.where(owners == s, t, -1)  # (n,) targets on shard s
            cand = sources[s].candidates(q, take, targets=own, where=filters[source])
            found.append((cand.ids.cpu(), cand.keys.cpu(), cand.values.cpu()))
        if found:
            ids = torch.cat([f[0] for f in found], 1)  # (n, shards take)
            keys = torch.cat([f[1] for f in found], 1)  # (n, shards take, dim)
            values = torch.cat([f[2] for f in found], 1)  # (n, shards take, value_dim)
        else:
            ids = torch.full((n, 0), -1, dtype=torch.long)
            keys, values = torch.zeros(n, 0, local.dim), torch.zeros(n, 0, local.value_dim)
        parts.append(merge_candidates(q, ids, keys, values, t, take, local.score))
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]
