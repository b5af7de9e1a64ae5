"""The ranks of ``tests/test_ddp.py``: a model with :class:`~kvsearch.KVAttention` trained under DDP, and its data.

The model is ``nn.Sequential(nn.Linear(32, 64), KVAttention(db, k=16), nn.Linear(32, 5))``. Each rank builds it with
its own seed (so its weights start different: DDP must broadcast rank 0's), wraps it in
``torch.nn.parallel.DistributedDataParallel`` and takes :data:`STEPS` SGD steps on its own batches (of different
sizes on each rank), twice:

- ``"memory"``: each rank holds its own in-memory ``Database(None, dim=64, value_dim=32)`` with the same seeded
  records;
- ``"sharded"``: the ranks share one :class:`~kvsearch.distributed.ShardedDatabase` (rank 0 adds every record; a
  query's candidates come from every rank's shards, a collective inside the forward).

After each step a rank all-gathers every rank's weights (on the default group, which DDP uses too) and records
them. It spawns and joins as ``tests/_distributed_ranks.py`` does (spawn start method, gloo on
``tcp://127.0.0.1:<free port>``, its timeout, its result files), and records, never asserts: the test judges.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _distributed_ranks import TIMEOUT, Results, free_port, join_group, result_path
from torch import nn

IN, DIM, VALUE_DIM, CLASSES = 32, 64, 32, 5
N_RECORDS, K = 300, 16
STEPS, LR = 3, 0.5
SCENARIO = "ddp"
PHASES = ("memory", "sharded")


def batch_size(rank: int) -> int:
    """Uneven batches: 8 rows on rank 0, 5 on rank 1, ..."""
    return 8 - 3 * rank


def records() -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded keys (N_RECORDS, DIM) and values (N_RECORDS, VALUE_DIM) every database holds."""
    gen = torch.Generator().manual_seed(5)
    return torch.randn(N_RECORDS, DIM, generator=gen), torch.randn(N_RECORDS, VALUE_DIM, generator=gen)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs (b, IN) and labels (b,) at ``step``: different on every rank and step."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    b = batch_size(rank)
    return torch.randn(b, IN, generator=gen), torch.randint(0, CLASSES, (b,), generator=gen)


def model(db: Any, seed: int) -> nn.Sequential:
    """The model of the issue over ``db``, its weights drawn with ``seed``."""
    from kvsearch import KVAttention

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, DIM), KVAttention(db, k=K), nn.Linear(VALUE_DIM, CLASSES))


def flat(module: nn.Module) -> torch.Tensor:
    """Every parameter of ``module``, in order, as one detached vector."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def memory_db() -> Any:
    from kvsearch import Database

    db = Database(None, dim=DIM, value_dim=VALUE_DIM, device="cpu")
    db.add(*records())
    return db


def train(db: Any, rank: int, world: int) -> dict[str, Any]:
    """Wrap the model in DDP and take the steps; every rank's weights before and after each step."""
    import torch.distributed as dist

    net = model(db, seed=rank)
    own = flat(net)  # this rank's own draw, before DDP broadcast rank 0's
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)

    def gathered() -> list[torch.Tensor]:
        mine = flat(net)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return every

    res: dict[str, Any] = {"own": own, "start": gathered(), "steps": [], "losses": []}
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        res["losses"].append(float(loss.detach()))
        res["steps"].append(gathered())
    return res


def rank_main(rank: int, world: int, port: int, root: str) -> None:
    """The entry point of a spawned rank: one thread, gloo on localhost, then both phases."""
    out = Results(result_path(root, SCENARIO, rank))
    try:
        join_group(rank, world, port, hang_after=120)
        start = time.perf_counter()
        out["memory"] = train(memory_db(), rank, world)
        out.save()
        from kvsearch.distributed import ShardedDatabase

        sdb = ShardedDatabase(
            Path(root) / "shards", num_shards=world, dim=DIM, value_dim=VALUE_DIM, device="cpu", timeout=TIMEOUT
        )
        keys, values = records()
        sdb.add(keys if rank == 0 else keys[:0], values if rank == 0 else values[:0])  # rank 0 brings every record
        out["sharded"] = train(sdb, rank, world)
        out["sharded_len"] = len(sdb)
        sdb.close()
        out["seconds"] = time.perf_counter() - start
    except BaseException:
        out["crash"] = traceback.format_exc()
        out.save()
        sys.stderr.write(f"rank {rank} of {world} crashed:\n{out['crash']}")
        sys.stderr.flush()
        os._exit(3)
    out.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown, as the other ranks' scripts


def start_ranks(world: int, root: Path) -> list[Any]:
    """Spawn the ranks (spawn start method); they run while the caller computes its reference."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(root))) for r in range(world)]
    for p in procs:
        p.start()
    return procs
