"""A sentence-encoder database fine-tuned with ``finetune(db, pairs)``'s defaults answers held-out queries better.

The study's stdlib task (``benchmarks/semantic_tasks.py``, ``pydoc``: a function's docstring -> its qualified name)
needs nothing but this interpreter, so it runs offline. The held-out queries name targets that no training pair
names; recall@10 and MRR@10 are read through ``db.search`` after the database is closed and reopened, against the
same database before the run. In ``bash .ci/run``: 500 keys, 200 pairs; with ``-m slow``: every key (3,642 on
CPython 3.11), 2,000 pairs, 1,000 held-out queries (``benchmarks/bench_semantic.py`` gives the peer's figures).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _semantic import semantic_tasks

import kvsearch


@pytest.fixture(scope="module")
def entries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(semantic_tasks, "CACHE", tmp_path_factory.mktemp("semantic"))
        return semantic_tasks.pydoc_entries()


def _held_out(db: kvsearch.Database, pairs: list[tuple[str, str]]) -> tuple[float, float]:
    """recall@10 and MRR@10 (a target below rank 10 counts 0) of ``pairs`` through ``db.search``."""
    hits = db.search([q for q, _ in pairs], k=10)
    ranks = [next((r for r, hit in enumerate(row) if hit.key == key), None) for row, (_, key) in zip(hits, pairs)]
    recall = sum(r is not None for r in ranks) / len(pairs)
    mrr = sum(1 / (r + 1) for r in ranks if r is not None) / len(pairs)
    return recall, mrr


def _run(tmp_path: Path, entries: dict[str, list[str]], n_train: int, n_eval: int, max_keys: int | None) -> dict:
    task = semantic_tasks.split("pydoc", entries, n_train, n_eval, 0, max_keys)
    path = tmp_path / "pydoc"
    with kvsearch.Database(path, encoder=kvsearch.SentenceEncoder(), value_dim=1, index="Flat") as db:
        db.add(keys=task.keys, values=torch.zeros(len(task.keys), 1))
        before = _held_out(db, task.eval)
        history = kvsearch.finetune(db, task.train, verbose=False)  # the defaults, nothing else
    with kvsearch.Database(path) as db:
        after = _held_out(db, task.eval)
    return {"before": before, "after": after, "history": history}


def test_defaults_improve_held_out_recall(tmp_path, entries):
    torch.manual_seed(0)
    run = _run(tmp_path, entries, n_train=200, n_eval=100, max_keys=500)
    (recall_0, mrr_0), (recall_1, mrr_1) = run["before"], run["after"]
    assert run["history"].committed, run["history"].summary()
    print("held-out recall@10, MRR@10 before / after:", run["before"], run["after"])
    assert recall_1 >= recall_0 + 0.03, (run["before"], run["after"])
    assert mrr_1 > mrr_0, (run["before"], run["after"])


@pytest.mark.slow
def test_defaults_improve_held_out_recall_with_2000_pairs(tmp_path, entries):
    torch.manual_seed(0)
    run = _run(tmp_path, entries, n_train=2000, n_eval=1000, max_keys=None)
    (recall_0, mrr_0), (recall_1, mrr_1) = run["before"], run["after"]
    assert run["history"].committed, run["history"].summary()
    assert recall_1 >= recall_0 + 0.05, (run["before"], run["after"])  # the bar: +5 points of acc@10
    assert mrr_1 > mrr_0, (run["before"], run["after"])
