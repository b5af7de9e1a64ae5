"""Copies and pickles of a model holding KVAttention, and of a database itself (issue 21).

A database is a resource like a dataset: ``copy.copy`` / ``copy.deepcopy`` return it itself, so copies of a model
(``deepcopy``, ``AveragedModel``) share it; a database on disk pickles as its folder and options and is reopened on
load; one in memory (and a sharded one) refuses with a typed error that names ``state_dict()``.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import kvsearch
from kvsearch import KVAttention
from kvsearch.distributed import ShardedDatabase
from kvsearch.errors import NotPicklableError

DIM, VALUE_DIM, N = 64, 32, 200
AUTHORS = {"Zhang": "Aston", "Lipton": "Zachary", "Li": "Mu", "Smola": "Alex", "Hu": "Rachel", "Werness": "Brent"}


def fill(db: kvsearch.Database, seed: int = 0) -> kvsearch.Database:
    gen = torch.Generator().manual_seed(seed)
    db.add(torch.randn(N, DIM, generator=gen), torch.randn(N, VALUE_DIM, generator=gen))  # (N, DIM), (N, VALUE_DIM)
    return db


def make_model(db: kvsearch.Database, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, DIM), KVAttention(db, k=16), nn.Linear(VALUE_DIM, 5))


def inputs(seed: int = 1) -> torch.Tensor:
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))  # (8, 32)


@pytest.fixture
def memory_db() -> kvsearch.Database:
    return fill(kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM, device="cpu"))


@pytest.fixture
def disk_db(tmp_path: Path):
    db = fill(kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=VALUE_DIM, device="cpu"))
    yield db
    db.close()


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_copy_of_a_database_is_the_database_itself(where, memory_db, disk_db):
    db = memory_db if where == "memory" else disk_db
    assert copy.copy(db) is db and copy.deepcopy(db) is db
    assert copy.deepcopy({"a": db, "b": [db]})["b"][0] is db


def test_the_state_dict_holds_no_database(memory_db):
    state = make_model(memory_db).state_dict()
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(isinstance(t, torch.Tensor) for t in state.values())


def test_deepcopy_of_a_model_shares_the_database_and_answers_equally(memory_db):
    model = make_model(memory_db)
    twin = copy.deepcopy(model)
    assert twin[1].db is memory_db and twin[0].weight is not model[0].weight
    x = inputs()
    assert torch.equal(twin(x), model(x))
    twin(x).sum().backward()  # the copy trains its own weights only
    assert twin[0].weight.grad is not None and model[0].weight.grad is None


def test_averaged_model_averages_the_weights_over_the_shared_database(memory_db):
    model = make_model(memory_db)
    averaged = AveragedModel(model)
    assert averaged.module[1].db is memory_db
    averaged.update_parameters(model)  # the first update copies the weights
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(inputs(2)).square().sum().backward()
    optimizer.step()
    averaged.update_parameters(model)
    reference = make_model(memory_db, seed=9)  # other weights, replaced by the hand-made average
    reference.load_state_dict({n: (first[n] + p.detach()) / 2 for n, p in model.named_parameters()})
    x = inputs()
    torch.testing.assert_close(averaged(x), reference(x))
    assert not torch.allclose(averaged(x), model(x))  # the step moved the weights: the average is its own


def test_torch_save_and_load_of_a_model_over_a_database_on_disk(tmp_path, disk_db):
    model = make_model(disk_db)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    db = loaded[1].db
    try:
        assert isinstance(db, kvsearch.Database) and db is not disk_db  # a fresh handle on the same folder
        assert db.path.resolve() == disk_db.path.resolve() and len(db) == N and not db.read_only
        assert (db.dim, db.value_dim, db.index_spec, db.score) == (DIM, VALUE_DIM, disk_db.index_spec, disk_db.score)
        x = inputs()
        assert torch.equal(loaded(x), model(x))
    finally:
        db.close()


def test_pickling_a_database_in_memory_is_refused_with_a_typed_error(memory_db):
    model = make_model(memory_db)
    for obj in (memory_db, model):
        with pytest.raises(NotPicklableError, match=r"state_dict\(\)") as caught:
            pickle.dumps(obj)
        assert isinstance(caught.value, kvsearch.KVSearchError) and isinstance(caught.value, TypeError)
        assert "in memory" in str(caught.value)
    with pytest.raises(NotPicklableError, match=r"state_dict\(\)"):
        torch.save(model, io.BytesIO())
    rebuilt = make_model(memory_db, seed=3)  # what the message says: the state_dict, the database passed again
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(rebuilt(inputs()), model(inputs()))


@pytest.mark.parametrize(("index", "params"), [("Flat", None), ("HNSW32", {"efSearch": 64})])
def test_a_database_on_disk_pickles_as_its_folder_and_answers_equally(tmp_path, index, params):
    encoder = kvsearch.NgramEncoder(dim=32, num_buckets=256, seed=0)
    db = kvsearch.Database(tmp_path / "names", encoder=encoder, index=index, search_params=params, lock_timeout=2.5)
    db.add(list(AUTHORS), list(AUTHORS.values()))
    back = pickle.loads(pickle.dumps(db))
    try:
        assert back is not db and back.path.resolve() == db.path.resolve() and back.device == db.device
        assert (back.index_spec, back.score, back.read_only) == (index, db.score, False)
        assert back.retriever.params == (params or {}) and back.store.write_lock.timeout == 2.5  # the options
        hits, again = db.search(["Lipto", "Smol"], k=3), back.search(["Lipto", "Smol"], k=3)
        assert [[(h.id, h.key, h.value) for h in row] for row in hits] == [
            [(h.id, h.key, h.value) for h in row] for row in again
        ]
        # Hit.score is the index's own score where it holds the stored vectors (DESIGN: "the same numbers up to float
        # rounding"): the writer's graph scores its newest vectors in an exact delta, the copy's graph holds them
        assert [[h.score for h in row] for row in hits] == [
            [pytest.approx(h.score, rel=1e-6, abs=1e-7) for h in row] for row in again
        ]
        answer, answer_back = db.query(["Lipto", "Smol"], k=4), back.query(["Lipto", "Smol"], k=4)
        assert torch.equal(answer.output, answer_back.output) and torch.equal(answer.ids, answer_back.ids)
        assert answer.value == answer_back.value
        back.add(["Mu"], ["Li"])  # writable like the original (the write lock waits lock_timeout at most)
        assert db.lookup("Mu") == "Li"
    finally:
        back.close()
        db.close()


def test_a_read_only_database_pickles_read_only(tmp_path, disk_db):
    disk_db.close()
    reader = kvsearch.Database(tmp_path / "db", read_only=True)
    back = pickle.loads(pickle.dumps(reader))
    try:
        assert reader.read_only and back.read_only and len(back) == N
        with pytest.raises(kvsearch.ReadOnlyDatabaseError):
            back.add(torch.zeros(1, DIM), torch.zeros(1, VALUE_DIM))
    finally:
        back.close()
        reader.close()


def test_a_closed_database_refuses_to_pickle(disk_db):
    disk_db.close()
    with pytest.raises(kvsearch.DatabaseClosedError):
        pickle.dumps(disk_db)


def test_pickling_warns_when_the_encoders_changed_unsaved(tmp_path):
    encoder = kvsearch.NgramEncoder(dim=16, num_buckets=64, seed=0)
    with kvsearch.Database(tmp_path / "names", encoder=encoder) as db:
        db.add(list(AUTHORS), list(AUTHORS.values()))
        with torch.no_grad():
            encoder.embedding.weight.mul_(2.0)  # trained in memory, not saved
        with pytest.warns(RuntimeWarning, match=r"save_encoders\(\)"):
            pickle.dumps(db)
        db.save_encoders()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pickle.dumps(db)  # saved: nothing to warn about


def test_a_sharded_database_is_shared_by_copies_and_refuses_to_pickle(tmp_path):
    with ShardedDatabase(tmp_path / "s", num_shards=2, dim=8, value_dim=8, device="cpu") as sdb:
        assert copy.copy(sdb) is sdb and copy.deepcopy(sdb) is sdb
        with pytest.raises(NotPicklableError, match=r"state_dict\(\).*reopen") as caught:
            pickle.dumps(sdb)
        assert isinstance(caught.value, kvsearch.KVSearchError)
