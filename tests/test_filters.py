"""Requirement 6, metadata filters: ``where=`` on search / query, against a brute-force reference.

The SQL the filter becomes (bound parameters only) must select exactly the records the plain-Python rule
:func:`kvsearch.metadata.filters.matches` selects; a filtered search must return the brute-force top-k among the
matching records (exact indexes) and k of them whenever k match (every index type, selective filters too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsearch
from kvsearch.metadata.filters import matches, where_sql

DIM = 8
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([0.5, -1.5, 2.0]),
    st.sampled_from(["a", "b", "B", "é", "x' OR '1'='1' --"]),
)
METADATA = st.dictionaries(st.sampled_from(["n", "tag", "flag"]), SCALARS, max_size=3)
OPS = st.sampled_from(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"])


@st.composite
def filters(draw):
    where = {}
    for field in draw(st.lists(st.sampled_from(["n", "tag", "flag", "missing"]), min_size=1, max_size=2, unique=True)):
        op = draw(OPS)
        if op in ("$in", "$nin"):
            operand = draw(st.lists(SCALARS, max_size=3))
        elif op in ("$gt", "$gte", "$lt", "$lte"):
            operand = draw(st.one_of(st.integers(-3, 3), st.sampled_from([0.5, "a", "b"])))
        else:
            operand = draw(SCALARS)
        where[field] = operand if op == "$eq" and draw(st.booleans()) else {op: operand}
    return where


@pytest.fixture(scope="module")
def meta_db():
    """200 records with random metadata (in memory), and the metadata list."""
    rng = np.random.default_rng(0)
    db = kvsearch.Database(None, dim=DIM, value_dim=2, score="dot")
    pool = [None, True, False, -2, 0, 1, 3, 0.5, "a", "b", "B", "é", [1, 2], {"x": 1}]
    metas = []
    for _ in range(200):
        m = {f: pool[int(rng.integers(len(pool)))] for f in ("n", "tag", "flag") if rng.random() < 0.8}
        metas.append(m)
    ids = db.add(rng.standard_normal((200, DIM)).astype(np.float32), rng.standard_normal((200, 2)), metas)
    yield db, dict(zip(ids, metas))
    db.close()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(where=filters())
def test_sql_filter_equals_python_rule(meta_db, where):
    db, metas = meta_db
    sql_ids = set(db.store.ids_where(where).tolist())
    ref_ids = {i for i, m in metas.items() if matches(m, where)}
    assert sql_ids == ref_ids


def test_filter_sql_has_only_placeholders():
    evil = "x' OR '1'='1' --"
    sql, params = where_sql({evil.replace("'", "").replace(" ", "_"): evil, "n": {"$in": [evil, 1]}})
    assert evil not in sql and "OR '1'='1'" not in sql
    assert sql.count("?") == len(params) and evil in params


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "IVF16,Flat"])
@pytest.mark.parametrize("selectivity", [0.01, 0.1, 0.5])
def test_filtered_search_returns_k_matching_best_first(tmp_path, spec, selectivity):
    # Above 40 matches the FAISS IDSelector path runs (the default switch-over is 4096 matches).
    rng = np.random.default_rng(1)
    n, k = 2000, 10
    keys = rng.standard_normal((n, DIM)).astype(np.float32)
    groups = (rng.random(n) < selectivity).astype(int)  # 1 = matching
    metas = [{"g": int(g), "r": float(i % 7)} for i, g in enumerate(groups)]
    db = kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=2, index=spec, score="dot")
    db.index.exact_filter_max = 40  # the documented switch-over between the exact scan and FAISS's selector
    if spec.startswith("IVF"):
        db.set_search_params(nprobe=16)  # all lists: exact, so the top-k can be checked exactly
    ids = np.asarray(db.add(keys, rng.standard_normal((n, 2)).astype(np.float32), metas))
    queries = rng.standard_normal((20, DIM)).astype(np.float32)
    hits = db.search(torch.from_numpy(queries), k=k, where={"g": 1})
    match = groups == 1
    found = recall = 0
    for qv, row in zip(queries, hits):
        assert len(row) == min(k, int(match.sum()))  # k come back when k match
        assert all(metas[h.id - 1]["g"] == 1 for h in row)
        truth = set(ids[match][np.argsort(-(keys[match] @ qv))[:k]].tolist())
        found += len(truth & {h.id for h in row})
        recall += len(truth)
    if spec == "HNSW16":
        assert found / recall >= 0.95
    else:
        assert found == recall
    # combined operators, and the same filter through query(), k="all" and pooling="exact"
    where = {"g": 1, "r": {"$gte": 2, "$lt": 5}}
    allowed = {int(i) for i, m in zip(ids, metas) if matches(m, where)}
    answer = db.query(torch.from_numpy(queries[:3]), k=k, where=where)
    assert set(answer.ids[answer.ids >= 0].tolist()) <= allowed
    all_answer = db.query(torch.from_numpy(queries[:2]), k="all", where=where)
    assert int((all_answer.weights > 0).sum(-1).max()) <= len(allowed)
    db.close()


def test_filter_after_deletes_and_reopen(tmp_path):
    rng = np.random.default_rng(2)
    db = kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=2, index="HNSW8", score="dot")
    ids = db.add(rng.standard_normal((300, DIM)), rng.standard_normal((300, 2)), [{"i": i % 3} for i in range(300)])
    db.delete([i for i in ids if i % 2 == 0])
    db.close()
    db = kvsearch.Database(tmp_path / "db")
    live = set(db.store.table.ids.tolist())
    hits = db.search(torch.from_numpy(rng.standard_normal((5, DIM)).astype(np.float32)), k=20, where={"i": 1})
    for row in hits:
        assert len(row) == 20
        assert all(h.id in live and db.get(h.id).metadata["i"] == 1 for h in row)  # deleted ids never return
    db.close()


@pytest.mark.parametrize("n", [3, 1_001, 40_000])  # past the old cap of 1,000, and past SQLite's 32,766 parameters
def test_in_and_nin_take_any_number_of_values(meta_db, n):
    db, metas = meta_db
    stored = [1, "a", True, None, 0.5]  # values the records hold, among many that none holds (10, 11, ...)
    many = list(range(10, 10 + n)) + stored
    for op, field in (("$in", "n"), ("$nin", "tag")):
        sql_ids = set(db.store.ids_where({field: {op: many}}).tolist())
        reference = {i for i, m in metas.items() if matches(m, {field: {op: stored}})}
        assert sql_ids == reference and sql_ids
    hits = db.search(torch.ones(DIM), k=5, where={"n": {"$in": many}})
    assert len(hits) == 5 and all(matches(metas[h.id], {"n": {"$in": stored}}) for h in hits)
