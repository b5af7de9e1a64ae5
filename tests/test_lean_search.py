"""``Database.search`` on its lean path (issue 34): the hits' scores are the index's own where it scores the stored
vectors, recomputed in torch where it is lossy; a search that needs nothing from SQLite answers from memory, and
still sees what another handle or a transaction wrote (metadata included); a hit's value embedding is made a tensor
of its own storage when first read. Every answer is checked against a brute-force reference in torch."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvsearch
from kvsearch.errors import StoreChangedError
from kvsearch.index.factory import make_index

DIM, VALUE_DIM, N = 16, 3, 300


def _reference(q: torch.Tensor, keys: torch.Tensor, score: str, k: int) -> tuple[list[int], list[float]]:
    """Brute force in float64: the rows and scores of the k best keys for ``score``."""
    q64, k64 = q.double(), keys.double()
    if score == "cosine":
        s = F.normalize(k64, dim=-1) @ F.normalize(q64, dim=-1)
    elif score == "dot":
        s = k64 @ q64
    elif score == "scaled_dot":
        s = k64 @ q64 / math.sqrt(DIM)
    else:  # gaussian
        s = -((k64 - q64) ** 2).sum(-1) / 2
    top = torch.topk(s, k)
    return top.indices.tolist(), top.values.tolist()


def _clustered(rng: np.random.Generator, n: int) -> torch.Tensor:
    """Keys in 10 clusters of various norms (a second kind of data beside Gaussian keys)."""
    centres = rng.standard_normal((10, DIM)) * 3
    keys = centres[rng.integers(0, 10, n)] + rng.standard_normal((n, DIM)) * 0.3
    return torch.from_numpy(keys.astype(np.float32))


@pytest.mark.parametrize("data", ["gaussian", "clustered"])
@pytest.mark.parametrize("score", ["cosine", "dot", "scaled_dot", "gaussian"])
@pytest.mark.parametrize("index", ["Flat", "HNSW32", "IVF4,Flat", "IVF4,SQ8"])
def test_hit_scores_are_the_database_score_alone_and_in_a_batch(tmp_path, rng, index, score, data):
    keys = (
        torch.from_numpy(rng.standard_normal((N, DIM)).astype(np.float32)) if data == "gaussian" else _clustered(rng, N)
    )
    params = {"efSearch": 512} if index.startswith("HNSW") else {"nprobe": 4} if index.startswith("IVF") else None
    db = kvsearch.Database(
        tmp_path / "db", dim=DIM, value_dim=VALUE_DIM, index=index, score=score, search_params=params
    )
    ids = db.add(keys, keys[:, :VALUE_DIM].clone())
    queries = torch.from_numpy(rng.standard_normal((5, DIM)).astype(np.float32))  # (5, dim)
    batched = db.search(queries, k=7)
    lossy = index.endswith("SQ8")
    for q, row in zip(queries, batched):
        single = db.search(q, k=7)
        assert [(h.id, h.score) for h in single] == [(h.id, h.score) for h in row]  # bit for bit
        rows, ref = _reference(q, keys, score, 7)
        if not lossy:  # exhaustive settings: the exact top 7
            assert [h.id for h in single] == [ids[r] for r in rows]
        tol = 1e-4 * max(1.0, max(abs(s) for s in ref))
        stored = {ids[r]: r for r in range(N)}
        for hit in single:  # the database's score of the hit's stored key, whichever index found it
            want = _reference(q, keys[stored[hit.id]].unsqueeze(0), score, 1)[1][0]
            assert hit.score == pytest.approx(want, abs=tol)
            assert torch.equal(hit.value, keys[stored[hit.id], :VALUE_DIM])
        assert [h.score for h in single] == sorted((h.score for h in single), reverse=True)
    db.close()


def test_a_search_from_memory_sees_metadata_another_handle_writes(tmp_path, rng):
    path = tmp_path / "db"
    reader = kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM)
    keys = torch.from_numpy(rng.standard_normal((50, DIM)).astype(np.float32))
    reader.add(keys, keys[:, :VALUE_DIM].clone())  # no metadata: later searches answer from memory
    q = keys[7] + 0.1 * torch.from_numpy(rng.standard_normal(DIM).astype(np.float32))  # (dim,) no stored key's
    assert [h.metadata for h in reader.search(q, k=3)] == [{}, {}, {}]
    assert reader.search(q, k=1)[0].metadata == {}
    writer = kvsearch.Database(path)
    (new_id,) = writer.add((2 * q).unsqueeze(0), torch.ones(1, VALUE_DIM), [{"by": "writer"}])
    hits = reader.search(q, k=3)
    assert hits[0].id == new_id and hits[0].metadata == {"by": "writer"} and torch.equal(hits[0].value, torch.ones(3))
    assert writer.upsert((2 * q).unsqueeze(0), torch.ones(1, VALUE_DIM), [{}]) == [new_id]  # {} clears it
    again = reader.search(q, k=3)
    assert again[0].id == new_id and all(h.metadata == {} for h in again)
    for db in (writer, reader):
        db.close()


def test_a_search_sees_metadata_written_in_this_process_and_not_a_rolled_back_one(rng):
    db = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM)
    keys = torch.from_numpy(rng.standard_normal((40, DIM)).astype(np.float32))
    db.add(keys, keys[:, :VALUE_DIM].clone())
    q = keys[3] + 0.1 * torch.from_numpy(rng.standard_normal(DIM).astype(np.float32))  # (dim,) no stored key's
    assert db.search(q, k=2)[0].metadata == {}
    assert db.search(q, k=2)[0].metadata == {}  # from memory now
    with pytest.raises(RuntimeError, match="undo"):
        with db.atomic():
            db.add((3 * q).unsqueeze(0), torch.zeros(1, VALUE_DIM), [{"rolled": "back"}])
            assert db.search(q, k=1)[0].metadata == {"rolled": "back"}  # inside: what the transaction wrote
            raise RuntimeError("undo")
    assert all(h.metadata == {} for h in db.search(q, k=5))
    (kept,) = db.add((3 * q).unsqueeze(0), torch.zeros(1, VALUE_DIM), [{"kept": True}])
    hit = db.search(q, k=1)[0]
    assert (hit.id, hit.metadata) == (kept, {"kept": True})


def test_a_search_from_memory_refuses_a_store_deleted_from_the_folder(tmp_path, rng):
    path = tmp_path / "db"
    db = kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM)
    keys = torch.from_numpy(rng.standard_normal((20, DIM)).astype(np.float32))
    db.add(keys, keys[:, :VALUE_DIM].clone())
    db.search(keys[0], k=2)
    db.search(keys[0], k=2)  # from memory
    (path / "store.sqlite").rename(tmp_path / "moved.sqlite")
    with pytest.raises(StoreChangedError):
        db.search(keys[0], k=2)


def test_a_hit_value_is_its_own_tensor_when_read_and_pickles_unread(rng):
    db = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM)
    keys = torch.from_numpy(rng.standard_normal((30, DIM)).astype(np.float32))
    values = torch.from_numpy(rng.standard_normal((30, VALUE_DIM)).astype(np.float32))
    ids = db.add(keys, values)
    hits = db.search(keys[:4], k=5)
    copied = pickle.loads(pickle.dumps(hits))  # no value read yet
    for row, row_copy in zip(hits, copied):
        for hit, hit_copy in zip(row, row_copy):
            expected = values[ids.index(hit.id)]
            assert torch.equal(hit.value, expected) and torch.equal(hit_copy.value, expected)
            assert hit.value.untyped_storage().nbytes() == VALUE_DIM * 4  # its own storage, not the batch's
            assert hit.value is hit.value  # made once
            assert (hit.id, hit.key, hit.score, hit.metadata) == (
                hit_copy.id,
                hit_copy.key,
                hit_copy.score,
                hit_copy.metadata,
            )
    hits[0][0].value.add_(1)  # a hit's tensor is the caller's: the stored value is untouched
    assert torch.equal(db.search(keys[0], k=5)[0].value, values[ids.index(hits[0][0].id)])


@pytest.mark.parametrize(
    ("spec", "exact"),
    [("Flat", True), ("HNSW32", True), ("HNSW32,Flat", True), ("IVF8,Flat", True), ("IVF8,SQ8", False),
     ("HNSW32,SQ8", False), ("SQ8", False), ("PCA8,Flat", False)],
)  # fmt: skip
def test_an_index_says_whether_its_scores_are_those_of_the_stored_vectors(rng, spec, exact):
    keys = torch.from_numpy(rng.standard_normal((2000, DIM)).astype(np.float32))  # (2000, dim)
    index = make_index(spec, DIM, metric="ip", normalize=False, source=None, params=None)
    index.build(torch.arange(2000), keys)
    assert not index.is_fallback and index.exact_scores is exact
    q = torch.from_numpy(rng.standard_normal((3, DIM)).astype(np.float32))  # (3, dim)
    scores, ids = index.search(q, 5)  # (3, 5) each
    true = (keys[ids] * q.unsqueeze(1)).sum(-1)  # (3, 5) inner products of the stored vectors found
    assert torch.allclose(scores, true, atol=1e-4) is exact  # lossy codes / a projected space: other numbers


def test_query_and_candidates_from_memory_see_another_handles_writes(tmp_path, rng):
    path = tmp_path / "db"
    reader = kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM, score="dot")
    keys = torch.from_numpy(rng.standard_normal((40, DIM)).astype(np.float32))
    ids = reader.add(keys, keys[:, :VALUE_DIM].clone())
    q = keys[5] * 3  # (dim,) its best key by dot: keys[5], unless a larger one comes
    for _ in range(2):  # the second answers from memory
        answer = reader.query(q, k=3, pooling="hard")
        assert int(answer.ids[0]) == ids[5] and answer.metadata.tolist() == [{}, {}, {}]
        assert int(reader.candidates(q.unsqueeze(0), k=3).ids[0, 0]) == ids[5]
    writer = kvsearch.Database(path)
    (new_id,) = writer.add((10 * keys[5]).unsqueeze(0), torch.ones(1, VALUE_DIM), [{"by": "writer"}])
    answer = reader.query(q, k=3, pooling="hard")
    assert int(answer.ids[0]) == new_id and answer.metadata[0] == {"by": "writer"}
    assert torch.equal(answer.value, torch.ones(VALUE_DIM)) and torch.equal(answer.output, torch.ones(VALUE_DIM))
    assert int(reader.candidates(q.unsqueeze(0), k=3).ids[0, 0]) == new_id
    writer.delete([new_id])
    assert int(reader.candidates(q.unsqueeze(0), k=3).ids[0, 0]) == ids[5]
    assert int(reader.query(q, k=3, pooling="hard").ids[0]) == ids[5]
    for db in (writer, reader):
        db.close()
