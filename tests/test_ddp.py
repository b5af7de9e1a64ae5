"""A model with :class:`~kvsearch.KVAttention` trained under ``DistributedDataParallel`` on 2 gloo ranks.

``nn.Sequential(nn.Linear(32, 64), KVAttention(db, k=16), nn.Linear(32, 5))`` takes a few SGD steps on each rank's
own batches (of different sizes), over an in-memory database that each rank holds a copy of, then over one
:class:`~kvsearch.distributed.ShardedDatabase` the ranks share (``tests/_ddp_ranks.py`` runs the ranks). Checked:
the ranks start from rank 0's weights (DDP's broadcast) though each drew its own, their weights stay equal after
every step and change at every step, and they are the weights of one process that averages the ranks' losses
(what DDP's gradient averaging computes) over one plain database, in this process, as the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _ddp_ranks as ranks  # noqa: E402
from _distributed_ranks import join_ranks  # noqa: E402

WORLD = 2
DEADLINE_S = 120.0  # every rank is killed after this long: a hang fails the test, it never blocks the suite
TOL = 1e-5


def reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One process, one database: rank 0's initial weights, and the weights after each step of the mean loss."""
    net = ranks.model(ranks.memory_db(), seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=ranks.LR)
    start, steps = ranks.flat(net), []
    for step in range(ranks.STEPS):
        losses = [nn.functional.cross_entropy(net(x), y) for x, y in (ranks.batch(r, step) for r in range(WORLD))]
        opt.zero_grad(set_to_none=True)
        (sum(losses) / WORLD).backward()  # DDP averages the ranks' gradients, each of its own mean loss
        opt.step()
        steps.append(ranks.flat(net))
    return start, steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    procs = ranks.start_ranks(WORLD, root)
    try:
        ref = reference()  # while the ranks run
    finally:
        codes, results = join_ranks(procs, root, ranks.SCENARIO, DEADLINE_S)
    crashes = [f"rank {r}: {res.get('crash', '(no result)')}" for r, res in enumerate(results) if "seconds" not in res]
    assert codes == [0] * WORLD and not crashes, f"exit codes {codes}:\n" + "\n".join(crashes)
    return results, ref


@pytest.mark.parametrize("phase", ranks.PHASES)
def test_ranks_start_from_rank_0s_weights(run, phase):
    results, (start, _) = run
    own = [res[phase]["own"] for res in results]
    assert not torch.equal(own[0], own[1])  # each rank drew its own weights
    for res in results:
        assert all(torch.equal(w, own[0]) for w in res[phase]["start"])  # DDP broadcast rank 0's
    torch.testing.assert_close(own[0], start)


@pytest.mark.parametrize("phase", ranks.PHASES)
def test_weights_stay_equal_across_ranks_and_change_every_step(run, phase):
    results, (_, ref_steps) = run
    before = results[0][phase]["start"][0]
    for step in range(ranks.STEPS):
        seen = [w for res in results for w in res[phase]["steps"][step]]  # every rank's gather of every rank
        assert all(torch.equal(w, seen[0]) for w in seen), f"step {step}: the ranks' weights differ"
        assert (seen[0] - before).abs().max() > 1e-4, f"step {step} changed nothing"
        torch.testing.assert_close(seen[0], ref_steps[step], atol=TOL, rtol=TOL)  # the one-process reference
        before = seen[0]
    losses = [res[phase]["losses"] for res in results]
    assert losses[0] != losses[1]  # the ranks saw different data


def test_a_shared_sharded_database_trains_as_the_per_rank_copies(run):
    results, _ = run
    assert results[0]["sharded_len"] == ranks.N_RECORDS
    for res in results:
        for memory, sharded in zip(res["memory"]["steps"], res["sharded"]["steps"]):
            torch.testing.assert_close(memory[0], sharded[0], atol=TOL, rtol=TOL)
        assert res["memory"]["losses"] == pytest.approx(res["sharded"]["losses"], rel=1e-5)
