"""store.py: records in SQLite, tensors in memory, ids gathered by id."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest
import torch

from kvsearch.errors import CorruptDatabaseError, KeyNotFoundError
from kvsearch.storage.store import Store


def make(path=None, n=5, dim=3, value_dim=2):
    store = Store(path)
    store.load(dim, value_dim)
    keys = torch.arange(n * dim, dtype=torch.float32).reshape(n, dim)
    values = -torch.arange(n * value_dim, dtype=torch.float32).reshape(n, value_dim)
    ids = store.write(
        [f"k{i}" for i in range(n)], [f"v{i}" for i in range(n)], [{"i": i} for i in range(n)], keys, values
    )
    return store, ids, keys, values


def test_write_then_gather_by_id():
    store, ids, keys, values = make()
    assert ids == [1, 2, 3, 4, 5]
    query = torch.tensor([[5, -1, 2], [1, 1, 4]])
    k, v, mask = store.table.gather(query)
    assert k.shape == (2, 3, 3) and v.shape == (2, 3, 2)
    assert mask.tolist() == [[True, False, True], [True, True, True]]
    torch.testing.assert_close(k[0, 0], keys[4])
    torch.testing.assert_close(k[0, 1], torch.zeros(3))  # missing -> zeros, masked
    torch.testing.assert_close(v[1, 2], values[3])


def test_ids_are_never_reused(tmp_path):
    store, ids, _, _ = make(tmp_path / "s.sqlite")
    store.delete([5, 4])
    new = store.write(["x"], ["y"], [None], torch.zeros(1, 3), torch.zeros(1, 2))
    assert new == [6]  # AUTOINCREMENT: the deleted 5 does not come back
    store.close()
    reopened = Store(tmp_path / "s.sqlite")
    reopened.load(3, 2)
    assert reopened.table.ids.tolist() == [1, 2, 3, 6]
    assert reopened.texts.id_of_key == {"k0": 1, "k1": 2, "k2": 3, "x": 6}


def test_update_in_place_keeps_id():
    store, ids, keys, _ = make()
    out = store.write(["k1"], ["new"], [None], torch.ones(1, 3), torch.ones(1, 2), ids=[2])
    assert out == [2] and len(store.table) == 5
    torch.testing.assert_close(store.table.gather(torch.tensor([2]))[0][0], torch.ones(3))
    assert store.fetch([2])[2].value == "new"


def test_fetch_records_and_metadata():
    store, ids, keys, values = make()
    records = store.fetch([1, 3, -1, 99])
    assert set(records) == {1, 3}
    assert records[3].key == "k2" and records[3].value == "v2" and records[3].metadata == {"i": 2}
    torch.testing.assert_close(records[3].key_embedding, keys[2])


def test_version_bumps_on_every_write():
    store, _, _, _ = make()
    v = store.version
    store.delete([1])
    assert store.version == v + 1


def test_delete_unknown_changes_nothing():
    store, _, _, _ = make()
    v = store.version
    with pytest.raises(KeyNotFoundError, match=r"\[42\]"):
        store.delete([1, 42])
    assert len(store.table) == 5 and store.version == v and 1 in store.texts.key_of_id


def test_failed_transaction_rolls_back(tmp_path):
    store, _, _, _ = make(tmp_path / "s.sqlite")
    with pytest.raises(sqlite3.IntegrityError):  # a duplicate key slips past (the database checks first)
        store.write(["new", "k0"], ["a", "b"], [None, None], torch.zeros(2, 3), torch.zeros(2, 2))
    assert len(store.table) == 5 and "new" not in store.texts.id_of_key
    with closing(sqlite3.connect(tmp_path / "s.sqlite")) as conn:  # what is on disk, read from outside
        assert conn.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 5


def test_not_a_database(tmp_path):
    path = tmp_path / "s.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(CorruptDatabaseError, match="not a kvsearch store"):
        Store(path)
