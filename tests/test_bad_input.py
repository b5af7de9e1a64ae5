"""Requirement 3, bad input changes nothing: each bad call raises a typed error naming what was expected,
and the database is byte-for-byte the same afterwards (len, records, search results, file hashes).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsearch
from kvsearch import (
    DimensionMismatchError,
    DuplicateKeyError,
    EmptyDatabaseError,
    EmptyKeyError,
    InvalidArgumentError,
    KVSearchError,
    NonFiniteError,
    UnknownOptionError,
)
from kvsearch.checks import MAX_BATCH, MAX_K
from kvsearch.storage.encoder_files import load_encoder, save_encoder

DIM = 16
NAN, INF = float("nan"), float("inf")


@pytest.fixture
def db(tmp_path):
    """A text database (n-gram encoder) with metadata, on disk."""
    db = kvsearch.Database(tmp_path / "db", encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=1024))
    keys = ["Zhang", "Lipton", "Li", "Smola", "Hu", "Werness"]
    db.add(keys, ["Aston", "Zachary", "Mu", "Alex", "Rachel", "Brent"], [{"n": i, "tag": "t"} for i in range(6)])
    db.save()
    yield db
    db.close()


def snapshot(db: kvsearch.Database) -> tuple:
    """Everything a bad call must leave alone: len, records, search results and the files' bytes."""
    records = db.store.fetch(db.store.table.ids.tolist())
    rows = [
        (r.id, r.key, r.value, sorted(r.metadata.items()), r.key_embedding.numpy().tobytes()) for r in records.values()
    ]
    hits = [[(h.id, round(h.score, 6)) for h in row] for row in db.search(["Li", "Smol", "x"], k=4)]
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(db.path).iterdir())
        if p.is_file() and p.name != "write.lock"  # the lock file holds the last writer's pid
    }
    return len(db), rows, hits, files


def q(*shape: int, fill: float | None = None) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    if fill is not None:
        t.view(-1)[0] = fill
    return t


BAD_CALLS = {
    # NaN / Inf in embeddings, queries, numeric metadata
    "nan key embedding": (lambda db: db.add(q(2, DIM, fill=NAN), ["a", "b"]), NonFiniteError, "finite"),
    "inf value embedding": (lambda db: db.add(["a"], q(1, DIM, fill=INF)), NonFiniteError, "finite"),
    "nan query search": (lambda db: db.search(q(DIM, fill=NAN)), NonFiniteError, "finite"),
    "inf query query": (lambda db: db.query(q(3, DIM, fill=-INF), k=2), NonFiniteError, "finite"),
    "nan metadata": (lambda db: db.add(["new"], ["v"], [{"x": NAN}]), NonFiniteError, "finite"),
    "inf metadata": (lambda db: db.add(["new"], ["v"], [{"x": INF}]), NonFiniteError, "finite"),
    "nested nan metadata": (lambda db: db.add(["new"], ["v"], [{"x": [1.0, NAN]}]), KVSearchError, "expected"),
    "nan filter value": (lambda db: db.search("Li", where={"n": {"$gt": NAN}}), NonFiniteError, "finite"),
    "nan temperature": (lambda db: db.query("Li", temperature=math.nan), InvalidArgumentError, "temperature"),
    # wrong dimension
    "key dim": (lambda db: db.add(q(2, DIM + 1), ["a", "b"]), DimensionMismatchError, f"{DIM}"),
    "value dim": (lambda db: db.add(["a"], q(1, DIM - 1)), DimensionMismatchError, f"{DIM}"),
    "query dim": (lambda db: db.search(q(DIM + 3)), DimensionMismatchError, f"{DIM}"),
    "query 3-d": (lambda db: db.query(q(2, 2, DIM)), DimensionMismatchError, f"{DIM}"),
    "values count": (lambda db: db.add(["a", "b"], ["v"]), DimensionMismatchError, "one value per key"),
    "empty query batch": (lambda db: db.search(q(0, DIM)), InvalidArgumentError, "at least one"),
    "empty query list": (lambda db: db.search([]), InvalidArgumentError, "at least one"),
    # empty or non-string keys
    "empty key": (lambda db: db.add([""], ["v"]), EmptyKeyError, "non-empty"),
    "blank key": (lambda db: db.add(["ok", "  \t"], ["v", "w"]), EmptyKeyError, "non-empty"),
    "int key": (lambda db: db.add([3], ["v"]), InvalidArgumentError, "str"),
    "none key": (lambda db: db.add(["ok", None], ["v", "w"]), InvalidArgumentError, "str"),
    "bytes key": (lambda db: db.add([b"x"], ["v"]), InvalidArgumentError, "str"),
    "nul in key": (lambda db: db.add(["a\x00b"], ["v"]), InvalidArgumentError, "NUL"),
    "dict keys": (lambda db: db.add({"a": 1}, ["v"]), InvalidArgumentError, "str"),
    "int query": (lambda db: db.search(5), InvalidArgumentError, "expected"),
    "non-str in query list": (lambda db: db.search(["Li", 5]), InvalidArgumentError, "texts"),
    # duplicates
    "duplicate in batch": (lambda db: db.add(["a", "b", "a"], ["1", "2", "3"]), DuplicateKeyError, "unique"),
    "duplicate of stored": (lambda db: db.add(["new", "Li"], ["1", "2"]), DuplicateKeyError, "upsert"),
    "duplicate in upsert batch": (lambda db: db.upsert(["Li", "Li"], ["1", "2"]), DuplicateKeyError, "unique"),
    # k
    "k zero": (lambda db: db.search("Li", k=0), InvalidArgumentError, "k as an integer"),
    "k negative": (lambda db: db.query("Li", k=-3), InvalidArgumentError, "k as an integer"),
    "k bool": (lambda db: db.search("Li", k=True), InvalidArgumentError, "k as an integer"),
    "k float": (lambda db: db.search("Li", k=2.5), InvalidArgumentError, "k as an integer"),
    "k string": (lambda db: db.search("Li", k="10"), InvalidArgumentError, "k as an integer"),
    "k huge": (lambda db: db.search("Li", k=MAX_K + 1), InvalidArgumentError, f"{MAX_K}"),
    "k astronomically huge": (lambda db: db.query("Li", k=10**18), InvalidArgumentError, f"{MAX_K}"),
    # huge batches (the documented cap)
    "batch over cap": (
        lambda db: db.add(torch.zeros(MAX_BATCH + 1, DIM), torch.zeros(MAX_BATCH + 1, DIM)),
        InvalidArgumentError,
        "MAX_BATCH",
    ),
    "query batch over cap": (lambda db: db.search(torch.ones(MAX_BATCH + 1, DIM)), InvalidArgumentError, "MAX_BATCH"),
    # unknown options
    "unknown pooling": (lambda db: db.query("Li", pooling="max"), UnknownOptionError, "pooling"),
    "unknown score": (lambda db: db.query("Li", score="manhattan"), UnknownOptionError, "score"),
    "unknown search param": (lambda db: db.set_search_params(bogus=3), UnknownOptionError, "search parameters"),
    "search param zero": (lambda db: db.set_search_params(nprobe=0), InvalidArgumentError, "integer"),
    "search param negative": (lambda db: db.set_search_params(efSearch=-1), InvalidArgumentError, "integer"),
    "search param nan": (lambda db: db.set_search_params(nprobe=NAN), InvalidArgumentError, "integer"),
    "search param text": (lambda db: db.set_search_params(nprobe="4"), InvalidArgumentError, "integer"),
    "search param of another type": (lambda db: db.set_search_params(nprobe=4), UnknownOptionError, "does not apply"),
    "blank query text": (lambda db: db.query(["Li", "  "]), InvalidArgumentError, "non-empty query"),
    "empty query text": (lambda db: db.search(""), InvalidArgumentError, "non-empty query"),
    "gaussian with normalize": (
        lambda db: db.query("Li", score="gaussian", pooling="normalize"),
        InvalidArgumentError,
        "never positive",
    ),
    "float ids to delete": (lambda db: db.delete(torch.tensor([1.0])), InvalidArgumentError, "integer ids"),
    "unknown filter operator": (lambda db: db.search("Li", where={"n": {"$regex": "."}}), UnknownOptionError, "$in"),
    "bad filter type": (lambda db: db.search("Li", where=["n"]), InvalidArgumentError, "dict"),
    "filter int over 64 bits": (lambda db: db.search("Li", where={"n": 10**20}), InvalidArgumentError, "64 bits"),
    "bad $in operand": (lambda db: db.search("Li", where={"n": {"$in": 3}}), InvalidArgumentError, "list"),
    "temperature zero": (lambda db: db.query("Li", temperature=0), InvalidArgumentError, "temperature"),
    "bool temperature": (lambda db: db.query("Li", temperature=True), InvalidArgumentError, "temperature"),
    "metadata not dict": (lambda db: db.add(["new"], ["v"], ["meta"]), InvalidArgumentError, "dict"),
    "metadata count": (lambda db: db.add(["n1", "n2"], ["v", "w"], [{}]), InvalidArgumentError, "2 metadata"),
    "metadata non-json": (lambda db: db.add(["new"], ["v"], [{"x": object()}]), InvalidArgumentError, "JSON"),
    "delete unknown key": (lambda db: db.delete(["Li", "nobody"]), KeyError, "stored key"),
    "delete unknown id": (lambda db: db.delete(10_000), KeyError, "stored id"),
    "delete float": (lambda db: db.delete([1.5]), InvalidArgumentError, "int ids"),
    "get bad id": (lambda db: db.get("1"), InvalidArgumentError, "int id"),
    # unsafe names and paths where a name is expected
    "field dotdot": (lambda db: db.search("Li", where={"..": 1}), InvalidArgumentError, "field name"),
    "field path": (lambda db: db.search("Li", where={"a..b": 1}), InvalidArgumentError, "field name"),
    "field quote": (lambda db: db.search("Li", where={'a"b': 1}), InvalidArgumentError, "field name"),
    "field nul": (lambda db: db.search("Li", where={"a\x00": 1}), InvalidArgumentError, "field name"),
    "field dollar": (lambda db: db.search("Li", where={"$where": 1}), InvalidArgumentError, "field name"),
    "encoder prefix dotdot": (
        lambda db: save_encoder(db.encoder, db.path, "../escape"),
        InvalidArgumentError,
        "prefix",
    ),
    "encoder prefix absolute": (
        lambda db: save_encoder(db.encoder, db.path, "/tmp/abs"),
        InvalidArgumentError,
        "prefix",
    ),
    "encoder load dotdot": (lambda db: load_encoder(db.path, "../encoder"), InvalidArgumentError, "prefix"),
    "encoder prefix nul": (lambda db: load_encoder(db.path, "enc\x00"), InvalidArgumentError, "prefix"),
    # texts with their own embeddings (key_embeddings= / value_embeddings=)
    "key_embeddings dim": (
        lambda db: db.add(["new"], ["v"], key_embeddings=q(1, DIM + 1)),
        DimensionMismatchError,
        f"key_embeddings of shape (n, {DIM})",
    ),
    "key_embeddings rows": (
        lambda db: db.add(["n1", "n2"], ["v", "w"], key_embeddings=q(3, DIM)),
        DimensionMismatchError,
        "one row of key_embeddings per key (2)",
    ),
    "nan key_embeddings": (
        lambda db: db.upsert(["Li"], ["v"], key_embeddings=q(1, DIM, fill=NAN)),
        NonFiniteError,
        "finite",
    ),
    "inf value_embeddings": (
        lambda db: db.add(["new"], ["v"], value_embeddings=q(1, DIM, fill=INF)),
        NonFiniteError,
        "finite",
    ),
    "key_embeddings with tensor keys": (
        lambda db: db.add(q(1, DIM), ["v"], key_embeddings=q(1, DIM)),
        InvalidArgumentError,
        "keys as texts when key_embeddings= is given",
    ),
    "key_embeddings not a tensor": (
        lambda db: db.add(["new"], ["v"], key_embeddings=[[0.0] * DIM]),
        InvalidArgumentError,
        "key_embeddings as a tensor",
    ),
    # upsert of keys given as embeddings: never a second record with the same key
    "upsert embedding equal to a text key": (
        lambda db: db.upsert(db.embeddings(torch.tensor([3]))[0], q(1, DIM)),
        DuplicateKeyError,
        "delete(3) then add",
    ),
    "upsert equal embeddings in one batch": (
        lambda db: db.upsert(q(1, DIM).repeat(2, 1), q(2, DIM)),
        DuplicateKeyError,
        "unique key embeddings",
    ),
    "delete unknown missing option": (lambda db: db.delete("Li", missing="skip"), UnknownOptionError, "ignore"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_changes_nothing(db, name):
    call, error, says = BAD_CALLS[name]
    before = snapshot(db)
    with pytest.raises(error) as info:
        call(db)
    assert isinstance(info.value, KVSearchError), f"{name}: untyped {type(info.value).__name__}: {info.value}"
    assert says.lower() in str(info.value).lower(), f"{name}: the message does not say what was expected"
    assert snapshot(db) == before


def test_reopened_database_is_the_same_after_all_bad_calls(db):
    before = snapshot(db)
    for call, error, _ in BAD_CALLS.values():
        with pytest.raises(error):
            call(db)
    db.close()
    again = kvsearch.Database(db.path)
    try:
        assert snapshot(again)[:3] == before[:3]  # closing checkpoints the WAL into the file: compare content
    finally:
        again.close()


def test_k_larger_than_database_returns_everything_not_an_error(db):
    hits = db.search("Li", k=100)
    assert sorted(h.id for h in hits) == sorted(db.store.table.ids.tolist())
    answer = db.query("Li", k=100)
    assert int((answer.ids >= 0).sum()) == len(db)


def test_injection_in_filter_value_matches_nothing(db):
    before = snapshot(db)
    for value in ["x' OR '1'='1' --", '" OR 1=1 --', "t' --", "1; DROP TABLE records; --"]:
        assert db.search("Li", k=6, where={"tag": value}) == []
        assert db.search("Li", k=6, where={"tag": {"$in": [value]}}) == []
    assert len(db.search("Li", k=6, where={"tag": "t"})) == 6  # the filter itself works
    assert snapshot(db) == before


def test_query_on_empty_database(tmp_path):
    empty = kvsearch.Database(tmp_path / "empty", encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=64))
    for call in (lambda: empty.query("x"), lambda: empty.query(q(DIM), k="all")):
        with pytest.raises(EmptyDatabaseError, match="expected a database with records"):
            call()
    assert empty.search("x") == [] and empty.search(["x", "y"]) == [[], []]  # nothing found, not an error
    assert len(empty) == 0
    empty.close()


@pytest.mark.parametrize("path", ["a\x00b", "", 3, b"bytes"])
def test_unsafe_database_path(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="expected"):
        kvsearch.Database(path, dim=4, value_dim=4)
    assert list(tmp_path.iterdir()) == []


def test_unknown_options_at_creation(tmp_path):
    cases = [
        (dict(index="Bogus42"), UnknownOptionError),
        (dict(index="IDMap,Flat"), UnknownOptionError),  # message: "leave out IDMap"
        (dict(score="manhattan"), UnknownOptionError),
        (dict(search_params={"bogus": 1}), UnknownOptionError),
        (dict(dim=0), InvalidArgumentError),
        (dict(dim=None), InvalidArgumentError),
    ]
    for i, (options, error) in enumerate(cases):
        options = {"dim": 4, "value_dim": 4, **options}
        with pytest.raises(error, match="expected|leave out"):
            kvsearch.Database(tmp_path / f"db{i}", **options)


def test_nonfinite_numpy_inputs(tmp_path):
    db = kvsearch.Database(None, dim=4, value_dim=2)
    keys = np.ones((3, 4), dtype=np.float32)
    keys[1, 2] = np.nan
    with pytest.raises(NonFiniteError):
        db.add(keys, np.zeros((3, 2), dtype=np.float32))
    assert len(db) == 0


@pytest.mark.parametrize(
    "options,error",
    [
        ({"index": "Bogus"}, UnknownOptionError),
        ({"index": "NSG16,Flat"}, UnknownOptionError),  # cannot grow by id: refused, not half-built
        ({"index": "IVF4,Flat,RFlat"}, UnknownOptionError),
        ({"score": "manhattan"}, UnknownOptionError),
        ({"search_params": {"efSearch": 8}, "index": "IVF4,Flat"}, UnknownOptionError),
        ({"search_params": {"nprobe": 0}, "index": "IVF4,Flat"}, InvalidArgumentError),
        ({"dim": None}, InvalidArgumentError),
        ({"device": "tpu"}, InvalidArgumentError),
        ({"device": "cuda:7"}, InvalidArgumentError),
        ({"lock_timeout": "soon"}, InvalidArgumentError),
        ({"lock_timeout": -1}, InvalidArgumentError),
    ],
)
def test_a_failed_creation_leaves_nothing_behind(tmp_path, options, error):
    """Bad creation options raise a typed error, and no folder or file is left where the database would be."""
    target = tmp_path / "parent" / "db"
    with pytest.raises(error):
        kvsearch.Database(target, **{"dim": 4, "value_dim": 4, **options})
    assert not (tmp_path / "parent").exists()
    existing = tmp_path / "existing"  # an (empty) folder that was there before keeps what it had, and only that
    existing.mkdir()
    (existing / ".gitkeep").write_text("mine")
    with pytest.raises(error):
        kvsearch.Database(existing, **{"dim": 4, "value_dim": 4, **options})
    assert sorted(p.name for p in existing.iterdir()) == [".gitkeep"]


def test_a_query_that_cannot_fit_is_refused_up_front(db, monkeypatch):
    """k far above the database size gathers only what exists; a batch x k that cannot fit is refused."""
    before = snapshot(db)
    answer = db.query(["Li"] * 50, k=MAX_K)  # 6 records: 6 candidates gathered, padded to k in the answer
    assert answer.weights.shape == (50, MAX_K) and answer.ids.shape == (50, MAX_K)
    assert (answer.ids[:, 6:] == -1).all() and (answer.weights[:, 6:] == 0).all()
    torch.testing.assert_close(answer.weights.sum(-1), torch.ones(50))
    monkeypatch.setenv("KVSEARCH_MEMORY_LIMIT", str(1 << 16))  # 64 KiB
    with pytest.raises(kvsearch.MemoryLimitError, match="candidates"):
        db.query(["Li"] * 1000, k=6)
    with pytest.raises(kvsearch.MemoryLimitError, match="every record"):
        db.query(q(5000, DIM), k="all", pooling="average")
    monkeypatch.delenv("KVSEARCH_MEMORY_LIMIT")
    assert snapshot(db) == before


def test_ids_to_delete_may_come_as_an_integer_tensor(db):
    ids = db.store.table.ids[:2].clone()
    assert db.delete(ids) == ids.tolist() and len(db) == 4
    assert db.delete(np.array([int(db.store.table.ids[0])], dtype=np.int32)) and len(db) == 3
