"""One query tensor (dim,) answers as its row of a batch and as a brute-force cosine search does: ids, scores,
values (embeddings, or texts with their own embeddings) and metadata, for the exact index and an HNSW graph searched
exhaustively, with a filter, with k above the number of records, and after another handle on the folder wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kvsearch

DIM, VALUE_DIM, N = 16, 3, 80
EXHAUSTIVE = {"efSearch": 512}  # more than the records: the graph answers exactly


def _open(path, index: str, **options) -> kvsearch.Database:
    params = EXHAUSTIVE if index == "HNSW32" else None
    return kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM, index=index, search_params=params, **options)


def _fill(db: kvsearch.Database, rng: np.random.Generator, texts: bool) -> tuple[torch.Tensor, list]:
    """N records (every other with metadata); values as embeddings, or as texts given with their embeddings."""
    keys = torch.from_numpy(rng.standard_normal((N, DIM)).astype(np.float32))  # (N, dim)
    value_embs = torch.from_numpy(rng.standard_normal((N, VALUE_DIM)).astype(np.float32))  # (N, value_dim)
    metadata = [{"group": i % 3, "i": i} if i % 2 else None for i in range(N)]
    if texts:
        ids = db.add(keys, [f"value {i}" for i in range(N)], metadata, value_embeddings=value_embs)
    else:
        ids = db.add(keys, value_embs, metadata)
    values = [f"value {i}" for i in range(N)] if texts else list(value_embs)
    return keys, [(ids[i], values[i], metadata[i] or {}) for i in range(N)]


def _reference(q: torch.Tensor, keys: torch.Tensor, records: list, k: int, where: dict | None = None) -> list:
    """Brute force: (id, cosine score, value, metadata) of the best min(k, matches) records, best first."""
    scores = F.normalize(keys, dim=-1) @ F.normalize(q, dim=-1)  # (N,)
    admitted = [n for n, (_, _, meta) in enumerate(records) if where is None or meta.get("group") == where["group"]]
    best = sorted(admitted, key=lambda n: -float(scores[n]))[:k]
    return [(records[n][0], float(scores[n]), records[n][1], records[n][2]) for n in best]


def _same_hits(hits: list[kvsearch.Hit], expected: list[kvsearch.Hit]) -> None:
    """Equal ids, scores (bit for bit), values and metadata."""
    assert [(h.id, h.score, h.metadata) for h in hits] == [(h.id, h.score, h.metadata) for h in expected]
    for a, b in zip(hits, expected):
        assert torch.equal(a.value, b.value) if isinstance(a.value, torch.Tensor) else a.value == b.value


def _matches(hits: list[kvsearch.Hit], reference: list) -> None:
    assert [h.id for h in hits] == [r[0] for r in reference]
    np.testing.assert_allclose([h.score for h in hits], [r[1] for r in reference], rtol=0, atol=1e-5)
    for hit, (_, _, value, meta) in zip(hits, reference):
        assert torch.equal(hit.value, value) if isinstance(value, torch.Tensor) else hit.value == value
        assert hit.metadata == meta


@pytest.mark.parametrize("texts", [False, True], ids=["embedding-values", "text-values"])
@pytest.mark.parametrize("where_", ["memory", "disk"])
@pytest.mark.parametrize("index", ["Flat", "HNSW32"])
def test_one_query_answers_as_its_batch_row_and_as_brute_force(tmp_path, rng, index, where_, texts):
    db = _open(None if where_ == "memory" else tmp_path / "db", index)
    keys, records = _fill(db, rng, texts)
    queries = torch.from_numpy(rng.standard_normal((6, DIM)).astype(np.float32))  # (6, dim)
    for k in (1, 10, N, N + 7):  # k above the records: every record, once
        batched = db.search(queries, k=k)
        for i, q in enumerate(queries):
            single = db.search(q, k=k)
            _same_hits(single, batched[i])
            _matches(single, _reference(q, keys, records, k))
    db.close()


@pytest.mark.parametrize("index", ["Flat", "HNSW32"])
def test_one_filtered_query_answers_as_its_batch_row_and_as_brute_force(tmp_path, rng, index):
    db = _open(tmp_path / "db", index)
    keys, records = _fill(db, rng, texts=False)
    queries = torch.from_numpy(rng.standard_normal((4, DIM)).astype(np.float32))  # (4, dim)
    for where in ({"group": 1}, {"group": 2}):
        for k in (3, 50):  # 50: more than the ~13 records of a group, every one comes back
            batched = db.search(queries, k=k, where=where)
            for i, q in enumerate(queries):
                single = db.search(q, k=k, where=where)
                _same_hits(single, batched[i])
                _matches(single, _reference(q, keys, records, k, where))
    db.close()


@pytest.mark.parametrize("index", ["Flat", "HNSW32"])
def test_one_query_sees_what_another_handle_wrote(tmp_path, rng, index):
    path = tmp_path / "db"
    reader = _open(path, index)
    keys, records = _fill(reader, rng, texts=False)
    q = torch.from_numpy(rng.standard_normal(DIM).astype(np.float32))  # (dim,)
    assert reader.search(q, k=3)[0].id == _reference(q, keys, records, 3)[0][0]  # the reader's view is current
    writer = kvsearch.Database(path, search_params=EXHAUSTIVE if index == "HNSW32" else None)
    new_value = torch.ones(VALUE_DIM)
    (new_id,) = writer.add((2 * q).unsqueeze(0), new_value.unsqueeze(0), [{"by": "writer"}])  # cosine 1: the best
    gone = _reference(q, keys, records, 1)[0][0]  # the best record before: deleted by the writer
    writer.delete([gone])
    hits = reader.search(q, k=5)
    assert hits[0].id == new_id and hits[0].metadata == {"by": "writer"} and torch.equal(hits[0].value, new_value)
    assert gone not in [h.id for h in hits]
    _same_hits(hits, reader.search(q.unsqueeze(0), k=5)[0])
    fresh = _open(path, index)  # a fresh open of the folder answers the same
    _same_hits(hits, fresh.search(q, k=5))
    for db in (writer, reader, fresh):
        db.close()


def test_one_query_in_an_empty_database_finds_nothing(tmp_path):
    db = _open(tmp_path / "db", "Flat")
    assert db.search(torch.zeros(DIM), k=3) == []
    db.close()
