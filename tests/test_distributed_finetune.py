"""Fine-tuning a sharded database on 2 gloo ranks, against one plain Database fine-tuned on every pair.

The ranks (``tests/_distributed_ranks.py``, scenario ``"finetune"``) each hold an uneven share of the pairs:

1. One plain SGD step over every pair in one batch: the encoder's weights after it (``w0 - lr * gradient``)
   equal the single database's, so the gradient averaged over the ranks is the full-batch gradient.
2. A short run with held-out pairs split across the ranks: the metrics before training equal the single
   database's on all held-out pairs (the evaluation sums over ranks), held-out recall rises like the single
   run's, and every shard ends at the generation ``shards.json`` records; one process reopening the folder
   answers like the ranks did.
3. (one process) A switch interrupted between a shard's commit and ``shards.json``: opening rolls the shard back.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch import Database
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.layout import shard_dir

sys.path.insert(0, str(Path(__file__).parent))
import _distributed_ranks as ranks  # noqa: E402

WORLD = 2
DEADLINE_S = 420.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The ranks' results and the single-database references (computed while the ranks run)."""
    root = tmp_path_factory.mktemp("finetune")
    procs = ranks.start_ranks(WORLD, root, "finetune")
    try:
        keys, values, train, held = ranks.finetune_data()
        ref = {}
        db = Database(None, encoder=ranks.encoder(), device="cpu")
        db.add(keys, values)
        initial = {n: t.detach().clone() for n, t in db.encoder.state_dict().items()}
        history = kvsearch.finetune(db, train, train="query+keys", **ranks.grad_options())
        ref["grad"] = {"initial": initial, "state": db.encoder.state_dict(), "losses": history.losses}
        db = Database(None, encoder=ranks.encoder(), device="cpu")
        db.add(keys, values)
        history = kvsearch.finetune(db, train, eval_pairs=held, **ranks.improve_options())
        ref["improve"] = {"metrics": history.metrics, "committed": history.committed}
    finally:
        codes, results = ranks.join_ranks(procs, root, "finetune", DEADLINE_S)
    for rank, res in enumerate(results):
        assert "crash" not in res, f"rank {rank} crashed:\n{res['crash']}"
        assert not res.get("phase_errors"), f"rank {rank}: {res.get('phase_errors')}"
    assert codes == [0] * WORLD, codes
    return root, results, ref


def test_one_step_equals_the_full_batch_gradient(run):
    _, results, ref = run
    initial, want = ref["grad"]["initial"], ref["grad"]["state"]
    for rank, res in enumerate(results):
        got = res["grad"]
        assert got["committed"]
        assert got["losses"] == pytest.approx(ref["grad"]["losses"], rel=1e-5)  # the mean loss over every pair
        for name, tensor in want.items():
            step = (tensor - initial[name]).abs().max().item()
            assert step > 1e-4, f"{name}: the reference step changed nothing (the test would prove nothing)"
            diff = (got["state"][name] - tensor).abs().max().item()
            assert diff <= 1e-5 * max(1.0, step), f"rank {rank} {name}: weights differ by {diff} (step {step})"
        generation, per_shard = got["generations"]
        assert set(per_shard.values()) == {generation}


def test_held_out_recall_rises_like_a_single_run(run):
    root, results, ref = run
    single = ref["improve"]["metrics"]
    for res in results:
        got = res["improve"]
        before, after = got["metrics"][0], got["metrics"][got["kept_epoch"]]
        assert before == pytest.approx(single[0], abs=1e-9)  # the same held-out pairs, evaluated over the ranks
        assert got["committed"] and got["kept_epoch"] >= 1
        assert after["recall@1"] > before["recall@1"] + 0.2
        best_single = max(m["recall@1"] for m in single[1:])
        assert after["recall@1"] >= best_single - 0.1, (after, best_single)
        assert got["metrics"] == results[0]["improve"]["metrics"]  # every rank saw the same (global) metrics
        generation, per_shard = got["generations"]
        assert set(per_shard.values()) == {generation}
        # the kept encoders answer: evaluating on this rank's share after the commit gives the kept metrics
        assert got["evaluate"] == pytest.approx({k: after[k] for k in ("recall@1", "recall@k", "mrr")}, abs=1e-9)
    assert ref["improve"]["committed"]

    _, _, _, held = ranks.finetune_data()
    with ShardedDatabase(root / "improve", device="cpu") as sdb:  # one process, every shard
        assert sdb.generation == results[0]["improve"]["generations"][0]
        assert [[h.key for h in row] for row in sdb.search([q for q, _ in held[:10]], k=3)] == results[0]["improve"][
            "search"
        ]


def test_an_interrupted_switch_is_rolled_back_on_open(tmp_path):
    keys, values, _, _ = ranks.finetune_data()
    with ShardedDatabase(tmp_path / "s", num_shards=2, encoder=ranks.encoder(), device="cpu") as sdb:
        sdb.add(keys[:100], values[:100])
        sdb.refresh()
        before = sdb.generation
        answers = [[h.key for h in row] for row in sdb.search(["Smith", "Li"], k=3)]
    # a crash after shard 1 committed its new generation and before shards.json recorded it
    with Database(shard_dir(tmp_path / "s", 1), device="cpu") as shard:
        with torch.no_grad():
            for p in shard.encoder.parameters():
                p.mul_(-1.0)
        shard.save_encoders()
        assert shard.generation == before + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sdb = ShardedDatabase(tmp_path / "s", device="cpu")
    with sdb:
        assert any("rolling the shard back" in str(w.message) for w in caught)
        assert sdb.generation == before
        assert {db.generation for db in sdb.shards.values()} == {before}
        assert [[h.key for h in row] for row in sdb.search(["Smith", "Li"], k=3)] == answers
