"""The ranks of ``tests/test_product_keys.py``'s DDP test: a model holding a :class:`~kvsearch.ProductKeyMemory`
trained under ``DistributedDataParallel`` on 2 gloo ranks, and the one-process reference.

The model is ``nn.Sequential(nn.Linear(12, 10), ProductKeyMemory(10, num_keys=8, ...), nn.Linear(5, 3))`` with the
BatchNorm query norm (each rank's batch statistics; its buffers broadcast by DDP) and :data:`FROZEN` slots frozen.
Each rank builds it with its own seed (DDP must broadcast rank 0's weights), takes :data:`STEPS` SGD steps on its own
batches (of different sizes), all-gathers every rank's weights after each step, and records the frozen slots' values
before and after. The ranks are spawned, joined and their results kept by ``tests/_distributed_ranks.py``
(:data:`SCENARIO` names :func:`scenario` for its ``start_ranks``); it records, never asserts.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from _distributed_ranks import Results
from torch import nn

IN, DIM, VALUE_DIM, CLASSES = 12, 10, 5, 3
STEPS, LR, WORLD = 3, 0.5, 2
FROZEN = [0, 9, 18, 27, 36, 45, 54, 63]
SCENARIO = "_pkm_ddp_ranks:scenario"  # _distributed_ranks' start_ranks / rank_main / join_ranks run it
DEADLINE_S = 120.0  # every rank is killed after this long: a hang fails the test, it never blocks the suite


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs (b, IN) and labels (b,) at ``step``: 8 rows on rank 0, 5 on rank 1."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    b = 8 - 3 * rank
    return torch.randn(b, IN, generator=gen), torch.randint(0, CLASSES, (b,), generator=gen)


def model(seed: int) -> nn.Sequential:
    """The model, its weights drawn with ``seed``, its :data:`FROZEN` slots frozen."""
    from kvsearch import ProductKeyMemory

    torch.manual_seed(seed)
    memory = ProductKeyMemory(DIM, num_keys=8, heads=2, k=4, key_dim=6, value_dim=VALUE_DIM, query_norm="batchnorm")
    memory.slots.freeze(FROZEN)
    return nn.Sequential(nn.Linear(IN, DIM), memory, nn.Linear(VALUE_DIM, CLASSES))


def flat(module: nn.Module) -> torch.Tensor:
    """Every parameter of ``module``, in order, as one detached vector."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One process: rank 0's initial weights, and the weights after each step of the ranks' mean loss."""
    net = model(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    start, steps = flat(net), []
    for step in range(STEPS):
        losses = [nn.functional.cross_entropy(net(x), y) for x, y in (batch(r, step) for r in range(WORLD))]
        opt.zero_grad(set_to_none=True)
        (sum(losses) / WORLD).backward()  # DDP averages the ranks' gradients, each of its own mean loss
        opt.step()
        steps.append(flat(net))
    return start, steps


def train(rank: int, world: int) -> dict[str, Any]:
    """Wrap the model in DDP and take the steps; every rank's weights before and after each step."""
    import torch.distributed as dist

    net = model(seed=rank)
    own = flat(net)
    ddp = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)

    def gathered() -> list[torch.Tensor]:
        mine = flat(net)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return every

    res: dict[str, Any] = {"own": own, "start": gathered(), "steps": [], "losses": []}
    res["frozen_values_before"] = net[1].values.detach()[FROZEN].clone()
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        res["losses"].append(float(loss.detach()))
        res["steps"].append(gathered())
    res["frozen_values"] = net[1].values.detach()[FROZEN].clone()
    return res


def scenario(rank: int, world: int, root: Path, out: Results) -> None:
    """The ranks' work, as ``_distributed_ranks.rank_main`` runs it (:data:`SCENARIO`): the steps, and their time."""
    start = time.perf_counter()
    out.update(train(rank, world))
    out["seconds"] = time.perf_counter() - start
