"""The ranks of ``test_reshard.py``'s 2-rank test: a resharded database (ids not banded) served by 2 gloo ranks.

Each rank opens ``<root>/two`` (2 shards: rank r serves shard r) and asks, in lockstep, for records held by either
rank: ``get`` of every id (rank 0 from the first, rank 1 from the last), ``key_texts`` and ``embeddings`` of every id,
exact-pooling queries by key text (their targets found by asking the shards), a search; then rank 0 deletes by id a
record the other rank holds, both add records. What it saw is pickled to ``<root>/reshard-rank<r>.pkl``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _distributed_ranks as ranks  # noqa: E402

QUERIES = ["alpha 4", "gamma 2", "nobody", "given key", "beta 9"]


def scenario(rank: int, root: Path, out: ranks.Results) -> None:
    import torch

    import kvsearch
    from kvsearch.distributed import ShardedDatabase

    sdb = ShardedDatabase(root / "two", device="cpu", timeout=ranks.TIMEOUT)
    ids = sorted(int(i) for i in (root / "ids.txt").read_text().split())
    order = ids if rank == 0 else ids[::-1]
    out["get"] = {i: (r.key, r.value, r.metadata) for i in order for r in [sdb.get(i)]}
    out["key_texts"] = sdb.key_texts(ids)
    keys, values, mask = sdb.embeddings(torch.tensor(ids))
    out["embeddings"] = (keys, values, mask)
    answer = sdb.query(QUERIES, k=4, pooling="exact")
    out["exact"] = (answer.found, answer.value, answer.output)
    out["search"] = [[(h.id, round(h.score, 5)) for h in row] for row in sdb.search(QUERIES, k=5)]
    victim = int((root / "victim.txt").read_text())  # a record of shard 1, outside its band
    out["deleted"] = sdb.delete([victim] if rank == 0 else [])
    try:
        sdb.get(victim)
        out["get_deleted"] = "found"
    except kvsearch.KeyNotFoundError:
        out["get_deleted"] = "KeyNotFoundError"
    try:
        sdb.delete(victim)
        out["delete_again"] = "deleted"
    except kvsearch.KeyNotFoundError:
        out["delete_again"] = "KeyNotFoundError"
    out["added"] = sdb.add([f"rank {rank} new {i}" for i in range(6)], [f"v{i}" for i in range(6)])
    out["len"] = len(sdb)
    sdb.close()


def rank_main(rank: int, world: int, port: int, root: str) -> None:
    out = ranks.Results(Path(root) / f"reshard-rank{rank}.pkl")
    try:
        ranks.join_group(rank, world, port, hang_after=200)
        scenario(rank, Path(root), out)
    except BaseException:
        out["crash"] = traceback.format_exc()
        out.save()
        os._exit(3)
    out.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start(root: Path) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = ranks.free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, str(root))) for r in range(2)]
    for p in procs:
        p.start()
    return procs
