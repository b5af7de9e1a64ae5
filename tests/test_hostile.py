"""Hostile arguments: nothing but a :class:`kvsearch.KVSearchError` ever escapes the public API.

First the escapes found by hand (reliability round 2, issue 13), each with the right answer: a filtered
``k="all"`` query that matches nothing is "nothing matched", lone surrogates are refused before anything is
written, ids beyond 64 bits are "not found", ``delete`` of a non-key is typed, ``KVAttention`` on an empty
batch answers an empty batch and on an empty database raises ``EmptyDatabaseError``, a score callable gets the
documented shapes. Then the sweep: every public function and method called with hostile values in every
argument (a table built programmatically, plus hypothesis), asserting that each call returns or raises a
``KVSearchError`` subclass, and that a rejected write leaves the database as it was.
"""

from __future__ import annotations

import pytest
import torch

import kvsearch
from kvsearch import (
    EmptyDatabaseError,
    InvalidArgumentError,
    KeyNotFoundError,
    KVAttention,
)

DIM = 16
VALUE_DIM = 16
POOLINGS = ["softmax", "normalize", "nonnegative", "hard", "exact", "average"]
KEYS = ["Zhang", "Lipton", "Li", "Smola", "Hu", "Werness"]
VALUES = ["Aston", "Zachary", "Mu", "Alex", "Rachel", "Brent"]


def make_db(path=None) -> kvsearch.Database:
    """The authors in a small n-gram database (in memory unless a path is given), with metadata."""
    db = kvsearch.Database(path, encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=256))
    db.add(KEYS, VALUES, [{"n": i, "tag": "t"} for i in range(len(KEYS))])
    return db


def state(db: kvsearch.Database) -> tuple:
    """What a rejected write must leave alone: len and every record (through the public reads)."""
    records = [db.get(i) for i in db.ids().tolist()]
    rows = [(r.id, r.key, r.value, sorted(r.metadata.items()), r.key_embedding.tolist()) for r in records]
    return len(db), rows


@pytest.fixture
def db():
    database = make_db()
    yield database
    database.close()


# ----------------------------------------------------------------------------- the escapes found by hand


@pytest.mark.parametrize("pooling", POOLINGS)
def test_filtered_all_query_matching_nothing_is_not_found(db, pooling):
    """k="all" with a filter that matches nothing answers "nothing matched", as k=int does: no IndexError."""
    by_k = db.query("Li", k=3, pooling=pooling, where={"n": 99})
    assert by_k.found is False and by_k.value is None
    answer = db.query("Li", k="all", pooling=pooling, where={"n": 99})
    assert answer.found is False and answer.value is None
    assert answer.output.shape == (VALUE_DIM,) and not answer.output.any()
    assert answer.weights.shape == (0,) and answer.ids.shape == (0,) and list(answer.keys) == []
    batch = db.query(["Li", "Smola"], k="all", pooling=pooling, where={"tag": "none"})
    assert batch.found == [False, False] and batch.value == [None, None]
    assert batch.output.shape == (2, VALUE_DIM) and not batch.output.any()
    assert batch.weights.shape == (2, 0) and batch.ids.shape == (2, 0)
    queries = db.encoder.encode(["Li", "Hu"]).requires_grad_()  # (2, dim)
    tensor = db.query(queries, k="all", pooling=pooling, where={"n": {"$gt": 10}})
    assert tensor.found == [False, False]
    if tensor.output.requires_grad:  # a gradient of zero, as for k=int with nothing matched
        tensor.output.sum().backward()
        assert queries.grad is None or not queries.grad.any()


def test_filtered_all_query_matching_some_still_answers(db):
    answer = db.query("Li", k="all", pooling="average", where={"n": {"$lt": 3}})
    assert answer.found is True and sorted(answer.keys) == ["Li", "Lipton", "Zhang"]


SURROGATE = "\ud800"


@pytest.mark.parametrize(
    "call",
    [
        lambda db: db.add([SURROGATE], ["v"]),
        lambda db: db.add(["ok", "a" + SURROGATE], ["v", "w"]),
        lambda db: db.add(["new"], ["v" + SURROGATE]),
        lambda db: db.add(["new"], ["v"], [{"note": SURROGATE}]),
        lambda db: db.add(["new"], ["v"], [{SURROGATE: 1}]),
        lambda db: db.add(["new"], ["v"], [{"tags": ["a", {"deep": "\udfff"}]}]),
        lambda db: db.upsert(["Li"], ["\udc80"]),
        lambda db: db.upsert([SURROGATE], ["v"]),
        lambda db: db.query(SURROGATE),
        lambda db: db.search(["Li", "x" + SURROGATE]),
        lambda db: db.lookup(SURROGATE),
        lambda db: db.delete(SURROGATE),
        lambda db: db.delete(["Li", SURROGATE]),
        lambda db: db.search("Li", where={"tag": SURROGATE}),
        lambda db: db.search("Li", where={"tag": {"$in": ["t", SURROGATE]}}),
        lambda db: db.search("Li", where={SURROGATE: 1}),
        lambda db: db.values_present([SURROGATE]),
        lambda db: db.ids_of_keys([SURROGATE]),
    ],
)
def test_lone_surrogates_are_refused_before_anything_is_written(db, call):
    """Text that is not valid Unicode (a lone surrogate cannot be UTF-8) is bad input, not UnicodeEncodeError."""
    before = state(db)
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        call(db)
    assert state(db) == before


@pytest.mark.parametrize("id_", [2**63, 2**70, -(2**70), -1, 10**30])
def test_ids_beyond_64_bits_are_not_found(db, id_):
    """An id SQLite cannot hold is "not found", like any id that is not stored; nothing is deleted."""
    before = state(db)
    with pytest.raises(KeyNotFoundError, match="stored id"):
        db.get(id_)
    with pytest.raises(KeyNotFoundError, match="stored id"):
        db.delete(id_)
    with pytest.raises(KeyNotFoundError, match="stored id"):
        db.delete([int(db.ids()[0]), id_])
    assert db.key_texts([id_]) == [None]
    assert db.value_texts([id_]) == {}
    assert db.values_of([id_]).get(id_) is None
    assert state(db) == before


@pytest.mark.parametrize("item", [None, 1.0, float("nan"), b"Li", {"Li": 1}, {"Li"}, object(), [None], [["Li"]]])
def test_delete_of_what_is_neither_key_nor_id_is_typed(db, item):
    before = state(db)
    with pytest.raises(InvalidArgumentError, match="expected"):
        db.delete(item)
    assert state(db) == before


def test_delete_of_a_generator_is_typed(db):
    before = state(db)
    with pytest.raises(InvalidArgumentError, match="expected"):
        db.delete(key for key in ["Li"])
    assert state(db) == before


@pytest.mark.parametrize("k", [3, "all"])
def test_kvattention_on_an_empty_batch_gives_an_empty_output(db, k):
    layer = KVAttention(db, k=k)
    queries = torch.zeros(0, DIM, requires_grad=True)
    out = layer(queries)
    assert out.shape == (0, VALUE_DIM)
    out.sum().backward()
    assert queries.grad.shape == (0, DIM)


@pytest.mark.parametrize("k", [3, "all"])
@pytest.mark.parametrize("batch", [0, 2])
def test_kvattention_on_an_empty_database_raises_empty_database_error(k, batch):
    empty = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM)
    with pytest.raises(EmptyDatabaseError, match="records"):
        empty.query(torch.ones(1, DIM), k=k)  # what query says
    with pytest.raises(EmptyDatabaseError, match="records"):
        KVAttention(empty, k=k)(torch.ones(batch, DIM))


def test_score_callable_gets_the_documented_shapes(db):
    """A score callable is called with queries (..., n, dim) and keys (..., m, dim), leading dims broadcasting.

    ``query`` with an int k: (batch, 1, dim) against each query's own candidates (batch, k, dim); with
    ``k="all"``: (batch, dim) against every key (m, dim). Written with ``keys.transpose(-2, -1)``, one
    callable serves every layout; its result must be (..., n, m).
    """
    seen = []

    def dot(queries, keys):
        seen.append((tuple(queries.shape), tuple(keys.shape)))
        return queries @ keys.transpose(-2, -1)  # (..., n, m)

    db.query(["Li", "Smola"], k=3, score=dot)
    db.query(["Li", "Smola"], k="all", score=dot)
    db.query("Li", k=2, score=dot)
    KVAttention(db, k=4, score=dot)(db.encoder.encode(["Li", "Hu", "Zhang"]))
    assert seen == [((2, 1, DIM), (2, 3, DIM)), ((2, DIM), (6, DIM)), ((1, 1, DIM), (1, 2, DIM)), ((3, 1, DIM), (3, 4, DIM))]
    reference = db.query(["Li", "Smola"], k=3, score="dot")
    torch.testing.assert_close(db.query(["Li", "Smola"], k=3, score=dot).output, reference.output)


def test_score_callable_of_the_wrong_shape_is_typed(db):
    with pytest.raises(kvsearch.DimensionMismatchError, match="score function must return shape"):
        db.query("Li", k=3, score=lambda queries, keys: (queries * keys).sum(-1))
