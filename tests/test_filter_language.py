"""The filter language (issue 24): every operator and rule against the plain-Python reference, on generated filters
and records, through the SQL (``db.where``), through filtered searches on Flat / HNSW / IVF indexes, after reopen.

The reference is :func:`kvsearch.metadata.filters.matches` over each record as it reads back
(``db.where().records()``); the
explicit tests below pin the rules the reference itself must follow (MongoDB's missing fields, datetimes as instants,
what cannot be stored cannot be filtered on).
"""

from __future__ import annotations

from datetime import date, datetime

import numpy as np
import pytest
import torch
from _filter_strategies import FILTERS, INSTANTS, NOON, SCALARS, metadata  # noqa: E402
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsearch
from kvsearch.errors import InvalidArgumentError, NonFiniteError, UnknownOptionError
from kvsearch.metadata.filters import matches

DIM = 8


def _build(db: kvsearch.Database, metas: list[dict], rng: np.random.Generator) -> None:
    """Records with key and value texts, then values given as embeddings (no value text), then keys given as
    embeddings (no key text)."""
    n = len(metas)
    a, b = int(n * 0.7), int(n * 0.85)
    keys = rng.standard_normal((n, DIM)).astype(np.float32)
    values = rng.standard_normal((n, 2)).astype(np.float32)
    db.add([f"k{i}" for i in range(a)], [f"v{i}" for i in range(a)], metas[:a], key_embeddings=keys[:a],
           value_embeddings=values[:a])  # fmt: skip
    db.add([f"k{i}" for i in range(a, b)], values[a:b], metas[a:b], key_embeddings=keys[a:b])
    db.add(keys[b:], values[b:], metas[b:])


def _reference(db: kvsearch.Database, where: dict) -> list[int]:
    return [r.id for r in db.where().records() if matches(r.metadata, where, id=r.id, key=r.key, value=r.value)]


@pytest.fixture(scope="module")
def rich_db():
    rng = np.random.default_rng(24)
    draw_rng = np.random.default_rng(7)
    pool = SCALARS + INSTANTS
    metas = []
    for _ in range(130):
        m = {}
        for name in ("a", "b", "when"):
            if draw_rng.random() < 0.7:
                m[name] = pool[draw_rng.integers(len(pool))]
        if draw_rng.random() < 0.6:
            m["tags"] = [SCALARS[j] for j in draw_rng.integers(len(SCALARS), size=draw_rng.integers(0, 4))]
        if draw_rng.random() < 0.6:
            m["author"] = {k: pool[draw_rng.integers(len(pool))] for k in ("country", "age") if draw_rng.random() < 0.7}
        if draw_rng.random() < 0.1:
            m["author"] = pool[draw_rng.integers(len(pool))]
        metas.append(m)
    db = kvsearch.Database(None, dim=DIM, value_dim=2, score="dot")
    _build(db, metas, rng)
    yield db
    db.close()


@settings(max_examples=400, deadline=None, derandomize=True)
@given(where=FILTERS)
def test_sql_selects_what_the_python_rule_selects(rich_db, where):
    assert rich_db.where(where).ids().tolist() == _reference(rich_db, where)
    assert rich_db.where(where).count() == len(_reference(rich_db, where))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(metas=st.lists(metadata(), min_size=1, max_size=12), where=FILTERS)
def test_generated_records_and_filters(metas, where):
    """Records generated too: each record's metadata reads back equal, and the SQL agrees with the rule."""
    db = kvsearch.Database(None, dim=DIM, value_dim=2, score="dot")
    _build(db, metas, np.random.default_rng(0))
    back = [r.metadata for r in db.where().records()]
    assert back == metas
    assert db.where(where).ids().tolist() == _reference(db, where)
    db.close()


@pytest.fixture(scope="module", params=["Flat", "HNSW16", "IVF4,Flat", "torch"])
def indexed_db(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("filters") / "db"
    rng = np.random.default_rng(3)
    metas = [
        {"a": int(rng.integers(-3, 4)), "tags": ["x", "y"][: int(rng.integers(0, 3))], "when": INSTANTS[i % 6]}
        | ({"author": {"country": ["FR", "DE", None][i % 3]}} if i % 4 else {})
        for i in range(300)
    ]
    db = kvsearch.Database(path, dim=DIM, value_dim=2, index=request.param, score="dot")
    _build(db, metas, rng)
    db.close()
    db = kvsearch.Database(path)  # after reopen: the filter reads what was stored
    yield db
    db.close()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(where=FILTERS, seed=st.integers(0, 2**16))
def test_filtered_search_keeps_min_k_matching_on_every_index(indexed_db, where, seed):
    db = indexed_db
    allowed = _reference(db, where)
    q = torch.from_numpy(np.random.default_rng(seed).standard_normal(DIM).astype(np.float32))
    k = 5
    hits = db.search(q, k=k, where=where) if allowed else []
    ids = [h.id for h in hits]
    assert set(ids) <= set(allowed)
    assert len(ids) == min(k, len(allowed))
    if db.index_spec in ("Flat", "torch") and allowed:  # exact indexes: the brute-force top-k
        keys, _, _ = db.embeddings(allowed)
        scores = (keys @ q).numpy()
        best = [allowed[i] for i in np.argsort(-scores, kind="stable")[:k]]
        assert sorted(ids) == sorted(best)


# ---------------------------------------------------------------------------------------------- the rules


@pytest.fixture
def small():
    db = kvsearch.Database(None, dim=2, value_dim=2, score="dot")
    metas = [{"f": None}, {}, {"f": 0}, {"f": "x"}, {"g": 1}]
    db.add([f"k{i}" for i in range(5)], [f"v{i}" for i in range(5)], metas,
           key_embeddings=np.eye(5, 2, dtype=np.float32), value_embeddings=np.eye(5, 2, dtype=np.float32))  # fmt: skip
    yield db
    db.close()


def test_missing_fields_follow_mongodb(small):
    sel = lambda where: small.where(where).ids().tolist()  # noqa: E731
    assert sel({"f": None}) == [1, 2, 5]  # null or missing
    assert sel({"f": {"$eq": None}}) == [1, 2, 5]
    assert sel({"f": {"$ne": None}}) == [3, 4]  # present and not null
    assert sel({"f": {"$ne": 0}}) == [1, 2, 4, 5]  # $ne matches missing and null
    assert sel({"f": {"$nin": [0]}}) == [1, 2, 4, 5]
    assert sel({"f": {"$in": [None, 0]}}) == [1, 2, 3, 5]
    assert sel({"f": {"$exists": True}}) == [1, 3, 4]  # null is present
    assert sel({"f": {"$exists": False}}) == [2, 5]
    assert sel({"f": {"$gte": 0}}) == [3]  # order operators never match another type, nor missing


def test_record_fields(small):
    assert small.where({"$key": "k3"}).ids().tolist() == [4]
    assert small.where({"$key": " k3 "}).ids().tolist() == [4]  # compared as keys are: normalised
    assert small.where({"$value": {"$contains": "v"}}).count() == 5
    assert small.where({"$id": {"$gt": 3}}).ids().tolist() == [4, 5]
    assert small.where({"$or": [{"$id": 1}, {"g": 1}]}).ids().tolist() == [1, 5]
    with pytest.raises(InvalidArgumentError, match=r"\$id"):
        small.where({"$id": "3"})
    with pytest.raises(InvalidArgumentError, match=r"\$contains on \$id"):
        small.where({"$id": {"$contains": 3}})


def test_datetimes_round_trip_and_compare_as_instants(tmp_path):
    path = tmp_path / "db"
    db = kvsearch.Database(path, dim=2, value_dim=2, score="dot")
    metas = [{"t": t, "nested": {"t": [t]}} for t in INSTANTS]
    ones = np.ones((6, 2), dtype=np.float32)
    db.add([f"k{i}" for i in range(6)], [f"v{i}" for i in range(6)], metas, key_embeddings=ones, value_embeddings=ones)
    db.close()
    db = kvsearch.Database(path)
    back = [r.metadata["t"] for r in db.where().records()]
    for given_, got in zip(INSTANTS, back):
        assert type(got) is type(given_) and got == given_
        if isinstance(given_, datetime):
            assert got.utcoffset() == given_.utcoffset()  # the offset comes back, naive stays naive
    assert db.where({"t": NOON}).ids().tolist() == [1, 2, 3]  # three spellings of one instant
    assert db.where({"t": {"$gt": NOON}}).ids().tolist() == [4]
    assert db.where({"t": {"$lt": date(2024, 3, 1)}}).ids().tolist() == [6]
    assert db.where({"t": date(2024, 3, 1)}).ids().tolist() == [5]
    assert db.where({"t": "2024-03-01T12:00:00+00:00"}).count() == 0  # a string is not a datetime
    assert db.where().min_max("t") == (INSTANTS[5], INSTANTS[3])
    db.close()


@pytest.mark.parametrize(
    "meta, error",
    [
        ({"n": 2**63}, InvalidArgumentError),
        ({"deep": {"list": [1, -(2**63) - 1]}}, InvalidArgumentError),
        ({"$set": 1}, InvalidArgumentError),
        ({"a": {"$datetime": "2024-01-01", "$epoch_us": 0}}, InvalidArgumentError),
        ({"a": [float("nan")]}, NonFiniteError),
        ({"a": {1: "x"}}, InvalidArgumentError),
        ({"a": b"bytes"}, InvalidArgumentError),
        ({"a": "x\x00y"}, InvalidArgumentError),  # SQLite would compare it as "x"
        ({"a": {"b\x00": 1}}, InvalidArgumentError),
    ],
)
def test_what_cannot_be_filtered_on_cannot_be_stored(small, meta, error):
    before = [(r.id, r.metadata) for r in small.where().records()]
    with pytest.raises(error):
        small.add(["new"], ["v"], [meta], key_embeddings=np.ones((1, 2), np.float32),
                  value_embeddings=np.ones((1, 2), np.float32))  # fmt: skip
    with pytest.raises(error):
        small.where().update(meta)
    assert [(r.id, r.metadata) for r in small.where().records()] == before


def test_the_largest_64_bit_integers_are_stored_and_filtered(small):
    small.where(ids=[1]).update({"n": 2**63 - 1})
    small.where(ids=[2]).update({"n": -(2**63)})
    assert small.where({"n": 2**63 - 1}).ids().tolist() == [1]
    assert small.where({"n": {"$lt": -(2**62)}}).ids().tolist() == [2]
    with pytest.raises(InvalidArgumentError, match="64 bits"):
        small.where({"n": 2**63})


@pytest.mark.parametrize(
    "where, error, path",
    [
        ({"$or": [{"a": 1}, {"b": {"$gt": None}}]}, InvalidArgumentError, r"where\.\$or\[1\]\.b\.\$gt"),
        ({"a": {"$in": [1, float("inf")]}}, NonFiniteError, r"where\.a\.\$in\[1\]"),
        ({"$and": [{"x.y": {"$regex": "a"}}]}, UnknownOptionError, r"where\.\$and\[0\]\.x\.y\.\$regex"),
        ({"$not": [{"a": 1}]}, InvalidArgumentError, r"where\.\$not"),
        ({"$or": []}, InvalidArgumentError, r"where\.\$or"),
        ({"a..b": 1}, InvalidArgumentError, r"where\.a\.\.b"),
        ({"a": {"$exists": 1}}, InvalidArgumentError, r"where\.a\.\$exists"),
        ({"a": {"$contains": NOON}}, InvalidArgumentError, r"where\.a\.\$contains"),
        ({"$where": "1"}, InvalidArgumentError, r"where"),
        (
            {"$or": [{"a": {"$in": ["x", "y\x00"]}}]},
            InvalidArgumentError,
            r"NUL characters at where\.\$or\[0\]\.a\.\$in\[1\]",
        ),
    ],
)
def test_errors_name_the_path_in_the_filter(small, where, error, path):
    with pytest.raises(error, match=path):
        small.where(where)
    with pytest.raises(error, match=path):
        small.search(torch.ones(2), k=2, where=where)


def test_filters_nested_too_deep_or_too_long_are_refused_and_long_lists_are_fine(small):
    deep: dict = {"a": 1}
    for _ in range(40):
        deep = {"$not": deep}
    with pytest.raises(InvalidArgumentError, match="nested"):
        small.where(deep)
    with pytest.raises(InvalidArgumentError, match="conditions"):
        small.where({"$or": [{"f": i} for i in range(1001)]})
    assert small.where({"$or": [{"f": i} for i in range(1000)]}).ids().tolist() == [3]  # a balanced tree in SQL
    assert small.where({"f": {"$nin": list(range(50_000))}}).count() == 4
