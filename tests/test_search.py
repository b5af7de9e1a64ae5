"""Search answers on the lean per-call path: after another process's commits a reader answers as a fresh open of
the folder does (ids, scores, values, metadata), a value given as an embedding comes back as a tensor of its own,
and metadata is read the same with or without the index of the records that have any (also when that index goes
while a reader has the store open)."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys

import numpy as np
import pytest
import torch

import kvsearch

DIM, VALUE_DIM = 16, 3

WRITER = r"""
import sys
import numpy as np
import kvsearch

db = kvsearch.Database(sys.argv[1])
rng = np.random.default_rng(1)
keys = rng.standard_normal((30, 16)).astype(np.float32)
values = rng.standard_normal((30, 3)).astype(np.float32)
ids = db.add(keys, values, [{"by": "writer", "i": i} if i % 3 == 0 else None for i in range(30)])
db.delete(ids[:4] + [1, 2])
db.upsert(keys[10:12], values[10:12] + 1, [{}, {"by": "upsert"}])  # same ids: one cleared, one replaced
db.close()
"""


def _hits_equal(a: list[list[kvsearch.Hit]], b: list[list[kvsearch.Hit]]) -> None:
    assert [[(h.id, h.score, h.metadata) for h in row] for row in a] == [
        [(h.id, h.score, h.metadata) for h in row] for row in b
    ]
    for row_a, row_b in zip(a, b):
        for x, y in zip(row_a, row_b):
            assert torch.equal(x.value, y.value)
            assert x.value.untyped_storage().nbytes() == VALUE_DIM * 4  # its own storage, not the batch's


@pytest.mark.parametrize("index", ["Flat", "HNSW32"])
def test_a_reader_answers_as_a_fresh_open_after_another_process_commits(tmp_path, rng, index):
    path = tmp_path / "db"
    params = {"efSearch": 256} if index == "HNSW32" else None  # more than the records: the graph answers exactly
    reader = kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM, index=index, search_params=params)
    keys = rng.standard_normal((60, DIM)).astype(np.float32)
    values = rng.standard_normal((60, VALUE_DIM)).astype(np.float32)
    reader.add(keys, values, [{"by": "reader", "i": i} if i % 2 else None for i in range(60)])
    queries = torch.from_numpy(rng.standard_normal((8, DIM)).astype(np.float32))
    for q in queries:
        reader.search(q, k=5)  # warm: the view is current, no SQL beyond the version check and the hits' rows
    writer = subprocess.run([sys.executable, "-c", WRITER, str(path)], capture_output=True, text=True, timeout=120)
    assert writer.returncode == 0, writer.stderr[-2000:]
    fresh = kvsearch.Database(path, read_only=True, search_params=params)
    stored = fresh.ids()
    assert len(stored) == 60 + 30 - 6
    for q in queries:
        _hits_equal([reader.search(q, k=7)], [fresh.search(q, k=7)])  # single queries, one call each
    _hits_equal(reader.search(queries, k=7), fresh.search(queries, k=7))  # and the batch
    exact = (
        torch.nn.functional.normalize(queries, dim=-1)
        @ torch.nn.functional.normalize(fresh.embeddings(stored)[0], dim=-1).T
    )  # (8, m) cosine over every stored key
    top = stored[exact.topk(7, dim=-1).indices]  # (8, 7)
    assert [sorted(h.id for h in row) for row in reader.search(queries, k=7)] == [sorted(r) for r in top.tolist()]
    by_id = fresh.metadata_of(stored)
    assert all(h.metadata == by_id[h.id] for row in reader.search(queries, k=20) for h in row)
    assert any(h.metadata.get("by") == "writer" for row in reader.search(queries, k=40) for h in row)
    answer = reader.query(queries, k=7)
    again = fresh.query(queries, k=7)
    assert torch.equal(answer.ids, again.ids) and torch.equal(answer.output, again.output)
    assert all(torch.equal(a, b) for a, b in zip(answer.value, again.value))
    assert answer.metadata.tolist() == again.metadata.tolist()
    fresh.close()
    reader.close()


def test_metadata_is_read_the_same_from_a_store_without_the_metadata_index(tmp_path, rng):
    path = tmp_path / "db"
    db = kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM)
    keys = rng.standard_normal((50, DIM)).astype(np.float32)
    db.add(
        keys, rng.standard_normal((50, VALUE_DIM)).astype(np.float32), [{"i": i} if i % 4 else None for i in range(50)]
    )
    queries = torch.from_numpy(keys[:6])
    expected = [[(h.id, h.metadata) for h in row] for row in db.search(queries, k=10)]
    assert any(meta == {} for row in expected for _, meta in row)  # some hits have none
    db.close()
    with contextlib.closing(sqlite3.connect(path / "store.sqlite")) as conn, conn:  # as an earlier version left it
        conn.execute("DROP INDEX records_with_metadata")
    with kvsearch.Database(path, read_only=True) as old:  # nothing is written: read without the index
        assert [[(h.id, h.metadata) for h in row] for row in old.search(queries, k=10)] == expected
    with kvsearch.Database(path) as again:  # a writable open makes the index again
        assert [[(h.id, h.metadata) for h in row] for row in again.search(queries, k=10)] == expected
        again.add(keys[:1] + 1, np.zeros((1, VALUE_DIM), np.float32), [{"new": True}])
        assert again.search(torch.from_numpy(keys[0] + 1), k=1)[0].metadata == {"new": True}
        expected = [[(h.id, h.metadata) for h in row] for row in again.search(queries, k=10)]
    with contextlib.closing(sqlite3.connect(path / "store.sqlite")) as conn:
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'records_with_metadata'").fetchone() == (1,)
    with kvsearch.Database(path, read_only=True) as reader:  # the index goes while it reads (a table rebuilt)
        assert [[(h.id, h.metadata) for h in row] for row in reader.search(queries, k=10)] == expected
        with contextlib.closing(sqlite3.connect(path / "store.sqlite")) as conn, conn:
            conn.execute("DROP INDEX records_with_metadata")
        assert [[(h.id, h.metadata) for h in row] for row in reader.search(queries, k=10)] == expected
