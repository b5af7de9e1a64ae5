"""Hostile arguments: nothing but a :class:`kvsearch.KVSearchError` ever escapes the public API.

First the escapes found by hand (reliability round 2, issue 13), each with the right answer: a filtered
``k="all"`` query that matches nothing is "nothing matched", lone surrogates are refused before anything is
written, ids beyond 64 bits are "not found", ``delete`` of a non-key is typed, ``KVAttention`` on an empty
batch answers an empty batch and on an empty database raises ``EmptyDatabaseError``, a score callable gets the
documented shapes. Then the sweep: every public function and method called with hostile values in every
argument (a table built programmatically, plus hypothesis), asserting that each call returns or raises a
``KVSearchError`` subclass, and that a rejected write leaves the database as it was. Text slots also get a NUL
character (keys, values, query texts, metadata strings and field names, filter values and field names: each refused
typed, nothing written), metadata slots also get metadata that contains itself, metadata nested 1,000 deep and numpy
values (scalars are stored as the Python value they hold: checked apart). Every tensor argument given
the same numbers in every layout (sparse, nested, quantized, complex, ``meta``, non-contiguous torch and numpy):
``tests/test_tensor_layouts.py``, a layout x argument matrix of its own.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsearch
from kvsearch import (
    EmptyDatabaseError,
    InvalidArgumentError,
    KeyNotFoundError,
    KVAttention,
    KVSearchError,
)
from kvsearch.checks import MAX_K
from kvsearch.cli.parser import CommandError
from kvsearch.cli.program import main
from kvsearch.storage.encoder_files import save_encoder

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
# a tqdm line: "desc:  42%|####      | 5/12 [00:01<00:02, 3.9it/s]" or "desc: 4rec [00:00, 6660.27rec/s]"
PROGRESS_BAR = re.compile(r"^[^\[]*\[\d+:\d\d(:\d\d)?[<,]")


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
    assert seen == [
        ((2, 1, DIM), (2, 3, DIM)),
        ((2, DIM), (6, DIM)),
        ((1, 1, DIM), (1, 2, DIM)),
        ((3, 1, DIM), (3, 4, DIM)),
    ]
    reference = db.query(["Li", "Smola"], k=3, score="dot")
    torch.testing.assert_close(db.query(["Li", "Smola"], k=3, score=dot).output, reference.output)


def test_score_callable_of_the_wrong_shape_is_typed(db):
    with pytest.raises(kvsearch.DimensionMismatchError, match="score function must return shape"):
        db.query("Li", k=3, score=lambda queries, keys: (queries * keys).sum(-1))


# ----------------------------------------------------------------------------- the sweep

NAN, INF = float("nan"), float("inf")


def cyclic(through_list: bool = False) -> dict:
    """Metadata that contains itself, directly or through a list."""
    m: dict = {"n": 1, "items": []}
    if through_list:
        m["items"].append(m)
    else:
        m["self"] = m
    return m


def nested(levels: int, kind: type = dict) -> dict:
    """Metadata nested ``levels`` deep, in dicts or in lists."""
    node: Any = 1
    for _ in range(levels):
        node = {"a": node} if kind is dict else [node]
    return {"deep": node}


#: Hostile metadata of one record (beyond HOSTILE's values): cycles, depth, NUL in each text slot, numpy values.
BAD_METADATA: dict[str, Callable[[], object]] = {
    "cyclic metadata": lambda: cyclic(),
    "cyclic through a list": lambda: cyclic(through_list=True),
    "1,000-deep dicts": lambda: nested(1000),
    "1,000-deep lists": lambda: nested(1000, list),
    "NUL in a metadata string": lambda: {"s": "a\x00b"},
    "NUL in a field name": lambda: {"a\x00b": 1},
    "NUL deep inside": lambda: {"n": {"tags": ["ok", {"x\x00": None}]}},
    "numpy array": lambda: {"v": np.zeros(3)},
    "numpy complex": lambda: {"v": np.complex64(1)},
    "numpy NaN": lambda: {"v": [np.float32("nan")]},
    "numpy scalars": lambda: {"i": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True), "s": np.str_("x")},
}
#: Hostile filters (beyond HOSTILE's values): a NUL in a filter's text matches no stored text; refused.
NUL_FILTERS: dict[str, Callable[[], object]] = {
    "NUL in a filter value": lambda: {"tag": "t\x00"},
    "NUL in $contains": lambda: {"tag": {"$contains": "\x00"}},
    "NUL in $in": lambda: {"tag": {"$in": ["t", "\x00"]}},
    "NUL in a $key filter": lambda: {"$key": {"$contains": "L\x00"}},
    "NUL in a field name": lambda: {"ta\x00g": "t"},
}
#: A NUL in a text argument (a key, a value, a query, a field name).
NUL_TEXTS: dict[str, Callable[[], object]] = {
    "NUL str": lambda: "Li\x00",
    "list with NUL": lambda: ["Li", "H\x00u"],
}

#: Hostile values, each made fresh for every call (a generator is spent once).
HOSTILE: dict[str, Callable[[], object]] = {
    "None": lambda: None,
    "float": lambda: 1.5,
    "nan": lambda: NAN,
    "inf": lambda: INF,
    "huge int": lambda: 2**70,
    "negative int": lambda: -1,
    "zero": lambda: 0,
    "bool": lambda: True,
    "empty str": lambda: "",
    "lone surrogate": lambda: SURROGATE,
    "long str": lambda: "x" * 100_000,
    "empty list": lambda: [],
    "nested list": lambda: [["Li"], ["Hu"]],
    "dict": lambda: {"Li": 1},
    "generator": lambda: (t for t in ["Li", "Hu"]),
    "set": lambda: {"Li", "Hu"},
    "object": lambda: object(),
    "bytes": lambda: b"Li",
    "list with surrogate": lambda: ["Li", SURROGATE],
    "list with None": lambda: ["Li", None],
    "empty tensor": lambda: torch.empty(0),
    "int tensor": lambda: torch.ones(2, DIM, dtype=torch.long),
    "complex tensor": lambda: torch.ones(2, DIM, dtype=torch.complex64),
    "bool tensor": lambda: torch.ones(2, DIM, dtype=torch.bool),
    "float64 wrong dim": lambda: torch.ones(2, DIM + 1, dtype=torch.float64),
    "3-D tensor": lambda: torch.ones(2, 2, DIM),
    "nan tensor": lambda: torch.full((2, DIM), NAN),
    "inf tensor": lambda: torch.full((2, DIM), INF),
    # the layouts every tensor argument refuses (the full layout x argument matrix: tests/test_tensor_layouts.py)
    "sparse tensor": lambda: torch.ones(2, DIM).to_sparse(),
    "meta tensor": lambda: torch.ones(2, DIM, device="meta"),
    "nested tensor": lambda: torch.nested.nested_tensor([torch.ones(DIM), torch.ones(DIM - 1)], layout=torch.jagged),
}


@dataclass(frozen=True)
class Slot:
    """One argument of one public callable, to be given every hostile value in turn.

    Attributes:
        name: ``callable.argument``, the test id.
        call: ``(target, value) -> anything``: the call with ``value`` in that argument, the others valid.
        make: builds the target (a database, or None for the pure functions).
        may_pass: labels of :data:`HOSTILE` this argument legitimately accepts; every other must be refused.
        writes: a refused call must leave the database as it was (same len, same records).
        extra: hostile values of this argument only (e.g. malformed pairs), beyond :data:`HOSTILE`.
    """

    name: str
    call: Callable[[Any, object], object]
    make: Callable[[], Any] = lambda: None
    may_pass: frozenset[str] = frozenset()
    writes: bool = False
    extra: dict[str, Callable[[], object]] = field(default_factory=dict)

    def values(self) -> dict[str, Callable[[], object]]:
        """Every hostile value this argument gets."""
        return {**HOSTILE, **self.extra}


def slot(
    name: str, call, make=lambda: None, may_pass: str = "", writes: bool = False, extra: dict | None = None
) -> Slot:
    """A :class:`Slot`; ``may_pass`` as comma-separated labels."""
    labels = frozenset(label.strip() for label in may_pass.split(",") if label.strip())
    assert labels <= set(HOSTILE) | set(extra or {}), labels - set(HOSTILE)
    return Slot(name, call, make, labels, writes, dict(extra or {}))


def two(value: object, one: object, pair: object) -> object:
    """A partner argument that fits ``value``'s count: one record for a str, two otherwise."""
    return one if isinstance(value, str) else pair


def texts_db() -> kvsearch.Database:
    return make_db()


def ivf_db() -> kvsearch.Database:
    db = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM, index="IVF2,Flat")
    db.add(torch.randn(8, DIM, generator=torch.Generator().manual_seed(1)), torch.zeros(8, VALUE_DIM))
    return db


def q2() -> torch.Tensor:
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(2))


def database_slots() -> list[Slot]:
    """Every argument of every public Database method, and of its constructor."""
    query_ok = "long str, int tensor"
    ids_ok = "empty list, int tensor"
    out = []
    for method in ("add", "upsert"):
        out += [
            slot(
                f"Database.{method}.keys",
                lambda db, v, m=method: getattr(db, m)(v, two(v, "v", ["v1", "v2"])),
                texts_db,
                "long str, int tensor",
                writes=True,
                extra=NUL_TEXTS,
            ),
            slot(
                f"Database.{method}.values",
                lambda db, v, m=method: getattr(db, m)(two(v, "new", ["n1", "n2"]), v),
                texts_db,
                "empty str, long str, int tensor",
                writes=True,
                extra=NUL_TEXTS,
            ),
            slot(
                f"Database.{method}.metadata",
                lambda db, v, m=method: getattr(db, m)(["n1", "n2"], ["v1", "v2"], v),
                texts_db,
                "None, numpy scalars",
                writes=True,
                extra={label: lambda make=make: [{"ok": 1}, make()] for label, make in BAD_METADATA.items()},
            ),
        ]
        for side in ("key_embeddings", "value_embeddings"):
            out.append(
                slot(
                    f"Database.{method}.{side}",
                    lambda db, v, m=method, s=side: getattr(db, m)(["n1", "n2"], ["v1", "v2"], **{s: v}),
                    texts_db,
                    "None, int tensor",  # integer embeddings are converted, as keys and values given as tensors
                    writes=True,
                )
            )
    out += [
        slot("Database.delete.missing", lambda db, v: db.delete("Li", missing=v), texts_db, writes=True),
        slot("Database.exact_targets.queries", lambda db, v: db.exact_targets(v), texts_db),
        slot("Database.metadata_of.ids", lambda db, v: db.metadata_of(v), texts_db, ids_ok),
        slot("Database.where.filter", lambda db, v: db.where(v).count(), texts_db, "None, dict", extra=NUL_FILTERS),
        slot(
            "Database.where.delete",
            lambda db, v: db.where(v).delete(),
            texts_db,
            "None, dict",  # {"Li": 1} matches nothing: nothing deleted
            writes=True,
            extra=NUL_FILTERS,
        ),
        slot("Database.where.ids", lambda db, v: db.where(ids=v).count(), texts_db, "None, " + ids_ok),
        slot(
            "Database.where.update",
            lambda db, v: db.where().update(v),
            texts_db,
            "dict, numpy scalars",
            writes=True,
            extra=BAD_METADATA,
        ),
        slot("Database.where.limit", lambda db, v: db.where().records(limit=v), texts_db, "None, zero"),
        slot("Database.where.distinct", lambda db, v: db.where().distinct(v), texts_db, "long str", extra=NUL_TEXTS),
        slot(
            "Database.delete.key_or_keys",
            lambda db, v: db.delete(v),
            texts_db,
            "zero, empty list, int tensor",
            writes=True,
        ),
        slot("Database.get.id", lambda db, v: db.get(v), texts_db, "zero"),
        slot("Database.lookup.key", lambda db, v: db.lookup(v), texts_db),
        slot("Database.lookup.default", lambda db, v: db.lookup("nobody", default=v), texts_db, ",".join(HOSTILE)),
        slot("Database.search.queries", lambda db, v: db.search(v), texts_db, query_ok, extra=NUL_TEXTS),
        slot("Database.search.k", lambda db, v: db.search("Li", k=v), texts_db),
        slot(
            "Database.search.where", lambda db, v: db.search("Li", where=v), texts_db, "None, dict", extra=NUL_FILTERS
        ),
        slot("Database.query.queries", lambda db, v: db.query(v), texts_db, query_ok, extra=NUL_TEXTS),
        slot("Database.query.k", lambda db, v: db.query("Li", k=v), texts_db),
        slot("Database.query.score", lambda db, v: db.query("Li", score=v), texts_db, "None"),
        slot("Database.query.pooling", lambda db, v: db.query("Li", pooling=v), texts_db),
        slot("Database.query.temperature", lambda db, v: db.query("Li", temperature=v), texts_db, "float, huge int"),
        slot(
            "Database.query.where",
            lambda db, v: db.query("Li", k="all", where=v),
            texts_db,
            "None, dict",
            extra=NUL_FILTERS,
        ),
        slot("Database.candidates.queries", lambda db, v: db.candidates(v, 3), texts_db),
        slot("Database.candidates.k", lambda db, v: db.candidates(q2(), v), texts_db),
        slot("Database.candidates.targets", lambda db, v: db.candidates(q2(), 3, targets=v), texts_db, "None"),
        slot(
            "Database.candidates.where",
            lambda db, v: db.candidates(q2(), 3, where=v),
            texts_db,
            "None, dict",
            extra=NUL_FILTERS,
        ),
        slot("Database.ids_of_keys.texts", lambda db, v: db.ids_of_keys(v), texts_db, "empty list"),
        slot("Database.values_present.texts", lambda db, v: db.values_present(v), texts_db, "empty list"),
        slot("Database.key_texts.ids", lambda db, v: db.key_texts(v), texts_db, ids_ok),
        slot("Database.value_texts.ids", lambda db, v: db.value_texts(v), texts_db, ids_ok),
        slot("Database.embeddings.ids", lambda db, v: db.embeddings(v), texts_db, ids_ok),
        slot("Database.values_of.ids", lambda db, v: db.values_of(v), texts_db, ids_ok),
        slot("Database.__contains__.key", lambda db, v: v in db, texts_db, ",".join(HOSTILE)),
        slot("Database.set_search_params.nprobe", lambda db, v: db.set_search_params(nprobe=v), ivf_db, "huge int"),
        slot("Database.query_encoder.encoder", lambda db, v: setattr(db, "query_encoder", v), texts_db, "None"),
        slot("Database.value_encoder.encoder", lambda db, v: setattr(db, "value_encoder", v), texts_db, "None"),
        slot("Database.commit_generation.values", lambda db, v: db.commit_generation(values=v), texts_db, "None"),
        slot(
            "Database.commit_generation.summary", lambda db, v: db.commit_generation(summary=v), texts_db, "None, dict"
        ),
        slot(
            "Database.commit_generation.reencode",
            lambda db, v: db.commit_generation(reencode=v),
            texts_db,
            "None, empty list",
        ),
    ]
    make = dict(dim=DIM, value_dim=VALUE_DIM)
    out.append(slot("Database.__init__.path", lambda _, v: kvsearch.Database(v, **make), may_pass="None"))
    for option, ok in [
        ("dim", ""),
        ("value_dim", ""),
        ("index", "None"),
        ("score", "None"),
        ("device", "None"),
        ("search_params", "None"),
        ("lock_timeout", "float, zero"),
        ("encoder", "None"),
        ("value_encoder", "None"),
        ("read_only", ""),
        ("capacity", "None, huge int"),
    ]:
        out.append(
            slot(
                f"Database.__init__.{option}",
                lambda _, v, o=option: kvsearch.Database(None, **{**make, o: v}),
                may_pass=ok,
            )
        )
    return out


PAIRS = [("Lipto", "Lipton"), ("Smolla", "Smola")]  # (query, target key)
VALUE_PAIRS = [("Lipto", "Zachary"), ("Smolla", "Alex")]  # (query, target value): finetune's default loss


def bad_pairs(target: str) -> dict[str, Callable[[], object]]:
    """Hostile (query, target) pairs, beyond the generic values; ``target`` is a valid target text."""
    return {
        "target surrogate": lambda: [("Li", target + SURROGATE)],
        "query surrogate": lambda: [(SURROGATE, target)],
        "empty query": lambda: [("", target)],
        "blank query": lambda: [(" \t", target)],
        "unknown target": lambda: [("Li", "nobody")],
        "int pair": lambda: [(1, 2)],
        "triple": lambda: [("Li", target, target)],
        "nan tensor pair": lambda: (torch.full((2, DIM), NAN), torch.zeros(2, VALUE_DIM)),
        "int tensor pair": lambda: (torch.ones(2, DIM, dtype=torch.long), torch.zeros(2, VALUE_DIM, dtype=torch.long)),
        "complex tensor pair": lambda: (torch.ones(2, DIM, dtype=torch.cfloat), torch.zeros(2, VALUE_DIM)),
        "tensor pair of other lengths": lambda: (torch.ones(2, DIM), torch.zeros(3, VALUE_DIM)),
    }


def finetune_slots() -> list[Slot]:
    """``kvsearch.finetune``: the database, the pairs, the config and every option; ``evaluate``'s arguments."""
    base = dict(epochs=1, k=3, batch_size=2, loss="answer", verbose=False)  # VALUE_PAIRS: (query, value text)

    def run(db, **given):
        return kvsearch.finetune(db, given.pop("train_pairs", VALUE_PAIRS), **{**base, **given})

    out = [
        slot("finetune.db", lambda _, v: kvsearch.finetune(v, VALUE_PAIRS, **base)),
        slot(
            "finetune.train_pairs",
            lambda db, v: run(db, train_pairs=v),
            texts_db,
            "int tensor pair",
            writes=True,
            extra=bad_pairs("Zachary"),
        ),
        slot(
            "finetune.eval_pairs",
            lambda db, v: run(db, eval_pairs=v),
            texts_db,
            "None, int tensor pair",
            True,
            bad_pairs("Zachary"),
        ),
        slot("finetune.config", lambda db, v: run(db, config=v), texts_db, "None", writes=True),
    ]
    for option, ok in [
        ("loss", ""),
        ("targets", "None"),
        ("k", ""),
        ("epochs", ""),
        ("refresh_every", "huge int"),
        ("train", "None"),  # None: by the key encoder's kind
        ("train_values", "bool"),
        ("score", "None"),
        ("pooling", ""),
        ("optimizer", ""),
        ("lr", "None, float, huge int"),
        ("batch_size", "None, huge int"),  # None: by whether pairs are generated
        ("temperature", "float, huge int"),
        ("seed", "zero, huge int"),
        ("verbose", "bool"),
        ("keep", ""),
        ("metric", "None"),
        ("lr_decay", ""),
        ("noise", "None"),  # None: nothing generated (the user's pairs alone)
        ("generated", "zero, huge int"),  # a huge count: as many as the keys give (up to MAX_GENERATED)
    ]:
        out.append(slot(f"finetune.{option}", lambda db, v, o=option: run(db, **{o: v}), texts_db, ok, writes=True))
    out += [
        slot("evaluate.pairs", lambda db, v: kvsearch.evaluate(db, v, k=3), texts_db, extra=bad_pairs("Li")),
        slot("evaluate.k", lambda db, v: kvsearch.evaluate(db, PAIRS, k=v), texts_db),
        slot("evaluate.targets", lambda db, v: kvsearch.evaluate(db, PAIRS, targets=v), texts_db),
        slot("evaluate.query_encoder", lambda db, v: kvsearch.evaluate(db, PAIRS, query_encoder=v), texts_db, "None"),
        slot("evaluate.score", lambda db, v: kvsearch.evaluate(db, PAIRS, score=v), texts_db, "None"),
        slot("evaluate.batch_size", lambda db, v: kvsearch.evaluate(db, PAIRS, batch_size=v), texts_db, "huge int"),
        slot("evaluate.retriever", lambda db, v: kvsearch.evaluate(db, PAIRS, retriever=v), texts_db, "None"),
    ]
    return out


def keys5() -> torch.Tensor:
    return torch.randn(5, DIM, generator=torch.Generator().manual_seed(3))


def values5() -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(4))


def attention_slots() -> list[Slot]:
    """``attend``, ``compute_scores``, ``pool``, ``streaming_attention``, ``KVAttention`` and the score modules."""
    temperature_ok = "float, huge int"
    out = []
    attend_args = {"queries": q2, "keys": keys5, "values": values5}
    for name in attend_args:
        out.append(
            slot(
                f"attend.{name}",
                lambda _, v, n=name: kvsearch.attend(**{**{k: f() for k, f in attend_args.items()}, n: v}),
            )
        )
    for option, ok in [
        ("score", ""),
        ("pooling", ""),
        ("valid_lens", "None"),
        ("mask", "None"),
        ("temperature", temperature_ok),
        ("match", "None"),
        ("dropout", "zero"),
    ]:
        out.append(
            slot(
                f"attend.{option}",
                lambda _, v, o=option: kvsearch.attend(q2(), keys5(), values5(), **{o: v}),
                may_pass=ok,
            )
        )
    finite_not_checked = "nan tensor, inf tensor"  # pure torch functions: NaN in, NaN out (attend checks)
    out += [
        slot(
            "compute_scores.queries",
            lambda _, v: kvsearch.compute_scores(v, keys5(), "dot"),
            may_pass=f"3-D tensor, {finite_not_checked}",
        ),
        slot(
            "compute_scores.keys",
            lambda _, v: kvsearch.compute_scores(q2(), v, "dot"),
            may_pass=f"3-D tensor, {finite_not_checked}",
        ),
        slot("compute_scores.score", lambda _, v: kvsearch.compute_scores(q2(), keys5(), v)),
        slot(
            "pool.scores",
            lambda _, v: kvsearch.pool(v),
            may_pass=f"empty tensor, float64 wrong dim, 3-D tensor, {finite_not_checked}",
        ),
        slot("pool.mask", lambda _, v: kvsearch.pool(torch.zeros(2, DIM), v), may_pass="None, bool tensor"),
        slot("pool.pooling", lambda _, v: kvsearch.pool(torch.zeros(2, DIM), pooling=v)),
        slot(
            "pool.temperature", lambda _, v: kvsearch.pool(torch.zeros(2, DIM), temperature=v), may_pass=temperature_ok
        ),
        slot(
            "pool.match",
            lambda _, v: kvsearch.pool(torch.zeros(2, DIM), pooling="exact", match=v),
            may_pass="bool tensor",
        ),
    ]
    stream_args = {"queries": q2, "keys": keys5, "values": values5}
    for name in stream_args:
        out.append(
            slot(
                f"streaming_attention.{name}",
                lambda _, v, n=name: kvsearch.streaming_attention(**{**{k: f() for k, f in stream_args.items()}, n: v}),
                may_pass=finite_not_checked,
            )
        )
    for option, ok in [("score", ""), ("temperature", temperature_ok), ("chunk", "None, huge int")]:
        out.append(
            slot(
                f"streaming_attention.{option}",
                lambda _, v, o=option: kvsearch.streaming_attention(q2(), keys5(), values5(), **{o: v}),
                may_pass=ok,
            )
        )
    for option, ok in [
        ("db", ""),
        ("k", ""),
        ("score", ""),
        ("pooling", ""),
        ("temperature", temperature_ok),
        ("dropout", "zero"),
    ]:
        out.append(
            slot(
                f"KVAttention.__init__.{option}",
                lambda db, v, o=option: KVAttention(**{"db": db, o: v}),
                texts_db,
                ok,
            )
        )
    out += [
        slot("KVAttention.forward.queries", lambda db, v: KVAttention(db, k=3)(v), texts_db),
        slot("KVAttention.forward.queries[k=all]", lambda db, v: KVAttention(db, k="all")(v), texts_db),
    ]
    for i, name in enumerate(["query_dim", "key_dim", "hidden"]):
        out.append(
            slot(
                f"AdditiveScore.__init__.{name}",
                lambda _, v, i=i: kvsearch.AdditiveScore(*[v if j == i else 4 for j in range(3)]),
            )
        )
    out += [
        slot(
            "AdditiveScore.forward.queries",
            lambda _, v: kvsearch.AdditiveScore(DIM, DIM)(v, keys5()),
            may_pass=f"3-D tensor, {finite_not_checked}",
        ),
        slot(
            "AdditiveScore.forward.keys",
            lambda _, v: kvsearch.AdditiveScore(DIM, DIM)(q2(), v),
            may_pass=f"3-D tensor, {finite_not_checked}",
        ),
        slot(
            "GaussianKernel.__init__.bandwidth",
            lambda _, v: kvsearch.GaussianKernel(v),
            may_pass="float, huge int, negative int, zero",
        ),
        slot(
            "GaussianKernel.forward.queries",
            lambda _, v: kvsearch.GaussianKernel()(v, keys5()),
            may_pass=f"3-D tensor, {finite_not_checked}",
        ),
        slot(
            "GaussianKernel.forward.keys",
            lambda _, v: kvsearch.GaussianKernel()(q2(), v),
            may_pass=f"3-D tensor, {finite_not_checked}",
        ),
    ]
    return out + memory_layer_slots()


def small_memory() -> kvsearch.ProductKeyMemory:
    torch.manual_seed(0)
    return kvsearch.ProductKeyMemory(DIM, num_keys=4, k=2, key_dim=4)


def memory_layer_slots() -> list[Slot]:
    """``ProductKeyMemory`` (its options, its inputs, its slots' methods) and ``memory_param_groups``."""
    given = {"dim": DIM, "num_keys": 4, "k": 2, "key_dim": 4}
    options = [("dim", ""), ("num_keys", ""), ("heads", ""), ("k", ""), ("key_dim", ""), ("value_dim", "None")]
    options += [("query_norm", "None"), ("sparse", "bool")]
    out = [
        slot(
            f"ProductKeyMemory.__init__.{option}",
            lambda _, v, o=option: kvsearch.ProductKeyMemory(**{**given, o: v}),
            may_pass=ok,
        )
        for option, ok in options
    ]
    ids_ok = "zero, empty list, int tensor"  # slot 0; no slot; slot 1 (ones)
    out += [
        slot("ProductKeyMemory.forward.inputs", lambda m, v: m(v), small_memory, "3-D tensor"),
        slot("ProductKeyMemory.slots.read.ids", lambda m, v: m.slots.read(v), small_memory, ids_ok),
        slot("ProductKeyMemory.slots.freeze.ids", lambda m, v: m.slots.freeze(v), small_memory, ids_ok),
        slot("ProductKeyMemory.slots.metadata.ids", lambda m, v: m.slots.metadata(v), small_memory, ids_ok),
        slot(
            "ProductKeyMemory.slots.update_values.ids",
            lambda m, v: m.slots.update_values(v, torch.zeros(2, DIM)),
            small_memory,
        ),
        slot(
            "ProductKeyMemory.slots.update_values.values",
            lambda m, v: m.slots.update_values([0, 1], v),
            small_memory,
        ),
        slot(
            "ProductKeyMemory.slots.where.filter",
            lambda m, v: m.slots.where(v),
            small_memory,
            "dict",
            extra=NUL_FILTERS,
        ),
        slot(
            "ProductKeyMemory.slots.observe.ids",
            lambda m, v: m.slots.observe(v, torch.ones(2, DIM)),
            small_memory,
            "int tensor",
        ),
        slot("ProductKeyMemory.slots.protect.optimizer", lambda m, v: m.slots.protect(v), small_memory),
        slot("memory_param_groups.model", lambda _, v: kvsearch.memory_param_groups(v, lr=0.1, value_lr=0.1)),
    ]
    for rate in ("lr", "value_lr"):
        out.append(
            slot(
                f"memory_param_groups.{rate}",
                lambda m, v, r=rate: kvsearch.memory_param_groups(m, **{"lr": 0.1, "value_lr": 0.1, r: v}),
                small_memory,
                "float, zero, huge int",
            )
        )
    return out


def hostile_memory_folders() -> dict[str, Callable[[], object]]:
    """Folders no memory opens (made in the test's working folder): a file, a database's, someone else's files, and
    manifests that are not JSON, not a memory's, or hold hostile values where numbers, a config or files belong."""
    torch.manual_seed(0)
    config = kvsearch.ProductKeyMemory(DIM, num_keys=4, k=2, key_dim=4).config
    good = {"kind": "kvsearch.ProductKeyMemory", "format": 1, "config": config, "generation": 1, "previous": None}
    good |= {"latest": 1, "files": {"1": {"bytes": 10, "sha256": "0" * 64}}}

    def folder(name: str, manifest: object = None, other: str | None = None) -> Callable[[], object]:
        def make() -> Path:
            path = Path(f"memory-{name}")
            path.mkdir(exist_ok=True)
            if other is not None:
                (path / other).write_text("someone's")
            if manifest is not None:
                text = manifest if isinstance(manifest, str) else json.dumps(manifest)
                (path / "memory.json").write_text(text)
            return path

        return make

    def file() -> Path:
        Path("memory-file").write_text("x")
        return Path("memory-file")

    def database() -> Path:
        make_db(Path("memory-database").absolute()).close()
        return Path("memory-database")

    out: dict[str, Callable[[], object]] = {"a file": file, "a database": database}
    out["someone's files"] = folder("foreign", other="notes.txt")
    out["manifest not JSON"] = folder("garbage", "{not json")
    out["manifest 100,000 deep"] = folder("deep", "[" * 100_000 + "]" * 100_000)
    out["manifest a list"] = folder("list", [1, 2])
    out["manifest of another kind"] = folder("kind", good | {"kind": "other"})
    out["manifest of a newer format"] = folder("format", good | {"format": 2})
    bad_fields = {
        "generation": ["x", -1, 0, None, 1e308, float("inf"), float("nan"), 2**70, [1]],
        "latest": ["x", 0, None],
        "previous": ["x", {"a": 1}, 7],
        "config": ["x", None, {}, {"dim": "x"}, config | {"num_keys": 2**70}],
        "files": ["x", None, [], {"1": "x"}, {"1": {"bytes": "x", "sha256": 1}}, {}],
    }
    for name, values in bad_fields.items():
        for i, value in enumerate(values):
            out[f"manifest {name} {value!r}"[:60]] = folder(f"{name}-{i}", good | {name: value})
    return out


def memory_folder_slots() -> list[Slot]:
    """``ProductKeyMemory(folder=)``: hostile paths, and folders that hold no memory it may open."""
    given = {"dim": DIM, "num_keys": 4, "k": 2, "key_dim": 4}
    return [
        slot(
            "ProductKeyMemory.__init__.folder",
            lambda _, v: kvsearch.ProductKeyMemory(**given, folder=v() if callable(v) else v),
            may_pass="None",
            extra={name: (lambda make=make: make) for name, make in hostile_memory_folders().items()},
        )
    ]


def saved_encoder_folder() -> str:
    """A folder (in the test's working folder) with an n-gram encoder saved as ``encoder``."""
    folder = Path("saved-encoder")
    folder.mkdir(exist_ok=True)
    save_encoder(kvsearch.NgramEncoder(dim=DIM, num_buckets=64), folder, "encoder")
    return str(folder)


def small_index(cls=kvsearch.Index):
    index = cls(DIM) if cls is kvsearch.TorchIndex else cls(DIM, "Flat")
    index.add(torch.arange(5), keys5())
    return index


def component_slots() -> list[Slot]:
    """Encoders, ``load_encoder``, ``Index`` and ``TorchIndex``."""
    out = []
    given = {"dim": DIM, "num_buckets": 64}
    for option, ok in [
        ("dim", ""),
        ("ngram_range", ""),
        ("num_buckets", ""),
        ("seed", "zero"),
        ("lowercase", "bool"),
        ("sparse", "bool"),
        ("device", "None"),
    ]:
        out.append(
            slot(
                f"NgramEncoder.__init__.{option}",
                lambda _, v, o=option: kvsearch.NgramEncoder(**{**given, o: v}),
                may_pass=ok,
            )
        )
    out += [
        slot(
            "NgramEncoder.encode.texts",
            lambda _, v: kvsearch.NgramEncoder(dim=DIM, num_buckets=64).encode(v),
            may_pass="empty list",
        ),
        slot("load_encoder.folder", lambda _, v: kvsearch.load_encoder(v, "encoder")),
        slot("load_encoder.prefix", lambda folder, v: kvsearch.load_encoder(folder, v), saved_encoder_folder),
        slot(
            "load_encoder.device",
            lambda folder, v: kvsearch.load_encoder(folder, "encoder", v),
            saved_encoder_folder,
            "None",
        ),
        slot("Index.__init__.dim", lambda _, v: kvsearch.Index(v)),
        slot("Index.__init__.spec", lambda _, v: kvsearch.Index(DIM, v)),
        slot("Index.__init__.metric", lambda _, v: kvsearch.Index(DIM, "Flat", v)),
        slot("Index.search.queries", lambda index, v: index.search(v, 2), small_index, "int tensor"),
        slot("Index.search.k", lambda index, v: index.search(q2(), v), small_index),
        slot(
            "Index.search.allowed", lambda index, v: index.search(q2(), 2, allowed=v), small_index, "None, int tensor"
        ),
        slot("Index.add.ids", lambda index, v: index.add(v, keys5()), small_index),
        slot("Index.add.keys", lambda index, v: index.add(torch.arange(10, 15), v), small_index),
        slot("Index.remove.ids", lambda index, v: index.remove(v), small_index, "int tensor"),
        slot("TorchIndex.__init__.dim", lambda _, v: kvsearch.TorchIndex(v)),
        slot("FinetuneConfig.__init__.k", lambda _, v: kvsearch.FinetuneConfig(k=v)),
        slot("FinetuneConfig.__init__.loss", lambda _, v: kvsearch.FinetuneConfig(loss=v)),
        slot("TorchIndex.__init__.dtype", lambda _, v: kvsearch.TorchIndex(DIM, dtype=v)),
        slot(
            "TorchIndex.search.queries",
            lambda index, v: index.search(v, 2),
            lambda: small_index(kvsearch.TorchIndex),
            "int tensor",
        ),
        slot("TorchIndex.search.k", lambda index, v: index.search(q2(), v), lambda: small_index(kvsearch.TorchIndex)),
        slot("reshard.src", lambda _, v: kvsearch.reshard(v, "resharded", num_shards=2)),
        slot("reshard.dst", lambda src, v: kvsearch.reshard(src, v, num_shards=2), reshard_source),
        slot("reshard.num_shards", lambda src, v: kvsearch.reshard(src, "resharded", num_shards=v), reshard_source),
    ]
    return out


def reshard_source() -> Path:
    """A small plain database on disk, in the test's working folder, to reshard."""
    path = Path("reshard-source").absolute()
    if not path.exists():
        make_db(path).close()
    return path


SLOTS = database_slots() + finetune_slots() + attention_slots() + component_slots() + memory_folder_slots()


@pytest.mark.parametrize("case", SLOTS, ids=lambda s: s.name)
def test_hostile_arguments_raise_only_kvsearch_errors(case, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a path argument that is accepted creates nothing outside the test's folder
    problems = []
    target = case.make()
    before = state(target) if case.writes else None
    for label, value in case.values().items():
        try:
            case.call(target, value())
        except KVSearchError as exc:
            assert str(exc), f"{case.name} <- {label}: an empty message"
            if case.writes and state(target) != before:
                problems.append(f"{label}: refused with {type(exc).__name__} but the database changed")
            continue
        except Exception as exc:  # noqa: BLE001 - what the sweep is looking for
            problems.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if label not in case.may_pass:
            problems.append(f"{label}: accepted")
        if case.writes:
            target = case.make()
            before = state(target)
    assert not problems, f"{case.name}:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- hostile states


#: One valid call of every public Database method and property (the baseline the slots vary one argument of).
def _add_atomically(db: kvsearch.Database) -> None:
    with db.atomic():
        db.add(["in-a-block"], ["v"])


VALID_CALLS: dict[str, Callable[[kvsearch.Database], object]] = {
    "add": lambda db: db.add(["new"], ["v"], [{"n": 9}]),
    "upsert": lambda db: db.upsert(["Li"], ["Mu!"]),
    "delete": lambda db: db.delete("Hu"),
    "clear": lambda db: db.clear(),
    "get": lambda db: db.get(int(db.ids_of_keys(["Li"])[0])),
    "lookup": lambda db: db.lookup("Li"),
    "search": lambda db: db.search("Li", k=2, where={"tag": "t"}),
    "query": lambda db: db.query(["Li", "Hu"], k=3, pooling="hard", temperature=0.5),
    "candidates": lambda db: db.candidates(q2(), 3),
    "refresh": lambda db: db.refresh(),
    "save_encoders": lambda db: db.save_encoders(),
    "commit_generation": lambda db: db.commit_generation(summary={"note": "x"}),
    "begin_generation": lambda db: db.begin_generation().discard(),
    "rollback_encoders": lambda db: (db.refresh(), db.rollback_encoders()),
    "set_search_params": lambda db: db.set_search_params(),
    "save": lambda db: db.save(),
    "ids": lambda db: db.ids(),
    "ids_of_keys": lambda db: db.ids_of_keys(["Li", "nobody"]),
    "values_present": lambda db: db.values_present(["Mu", "nothing"]),
    "key_texts": lambda db: db.key_texts(db.ids()),
    "value_texts": lambda db: db.value_texts(db.ids().tolist()),
    "embeddings": lambda db: db.embeddings(db.ids()),
    "values_of": lambda db: db.values_of(db.ids().tolist()),
    "encoders_info": lambda db: db.encoders_info(),
    "atomic": lambda db: _add_atomically(db),
    "read_only": lambda db: db.read_only,
    "exact_targets": lambda db: db.exact_targets(q2()),
    "metadata_of": lambda db: db.metadata_of(db.ids()),
    "where": lambda db: db.where({"lang": "en"}).count(),
    "generation": lambda db: db.generation,
    "previous_generation": lambda db: db.previous_generation,
    "index": lambda db: db.index,
    "retriever": lambda db: db.retriever,
    "store": lambda db: db.store,
    "encoder": lambda db: db.encoder,
    "value_encoder": lambda db: db.value_encoder,
    "query_encoder": lambda db: db.query_encoder,
    "__len__": lambda db: len(db),
    "__contains__": lambda db: "Li" in db,
    "__repr__": lambda db: repr(db),
    "close": lambda db: db.close(),
}
#: What must refuse a closed database (the others are attributes, repr and close, which answer).
NEEDS_OPEN = set(VALID_CALLS) - {"index", "retriever", "store", "encoder", "value_encoder", "query_encoder"}
NEEDS_OPEN -= {"__repr__", "close", "read_only"}


@pytest.mark.parametrize("name", list(VALID_CALLS))
def test_the_baseline_calls_are_valid(tmp_path, name):
    """Each slot varies one argument of a call that works: the sweep tests the argument, not a broken baseline."""
    db = make_db(tmp_path / "db")
    try:
        VALID_CALLS[name](db)
    finally:
        db.close()


def test_a_closed_database_refuses_every_call_typed(tmp_path):
    db = make_db(tmp_path / "db")
    db.close()
    for name, call in VALID_CALLS.items():
        if name in NEEDS_OPEN:
            with pytest.raises(kvsearch.DatabaseClosedError, match="closed"):
                call(db)
        else:
            call(db)  # an attribute, repr, a second close: they answer


def test_an_empty_database_answers_typed(tmp_path):
    empty = kvsearch.Database(tmp_path / "empty", encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=64))
    assert empty.search("Li") == [] and empty.search(["Li", "Hu"]) == [[], []]  # a search engine: no hits
    for call in (
        lambda: empty.query("Li", k="all", where={"n": 1}),
        lambda: empty.candidates(q2(), 3),
        lambda: KVAttention(empty, k=3)(q2()),
        lambda: kvsearch.finetune(empty, VALUE_PAIRS, epochs=1, verbose=False),
        lambda: kvsearch.evaluate(empty, PAIRS),
        lambda: empty.rollback_encoders(),
        lambda: empty.delete("Li"),
        lambda: empty.get(0),
    ):
        with pytest.raises(KVSearchError):
            call()
    assert empty.key_texts([0]) == [None] and empty.embeddings(torch.tensor([0, -1]))[2].tolist() == [False, False]
    assert len(empty) == 0
    empty.close()


def test_diverged_encoder_weights_are_refused_typed_and_change_nothing(tmp_path):
    """An encoder whose weights became NaN (a diverged run done by hand): typed errors, the store untouched."""
    db = make_db(tmp_path / "db")
    before = state(db)
    with torch.no_grad():
        db.encoder.embedding.weight.fill_(NAN)
    for call in (
        lambda: db.search("Li"),
        lambda: db.query("Li"),
        lambda: db.add(["new"], ["v"]),
        lambda: db.upsert(["Li"], ["v"]),
        lambda: db.refresh(),
        lambda: db.save_encoders(),
        lambda: kvsearch.evaluate(db, PAIRS),
        lambda: kvsearch.finetune(db, VALUE_PAIRS, loss="answer", epochs=1, verbose=False),
    ):
        with pytest.raises(kvsearch.NonFiniteError):
            call()
    assert state(db) == before
    with pytest.warns(RuntimeWarning, match="not saved"):
        db.close()  # the changed encoder is not saved: the folder keeps its last good generation
    with kvsearch.Database(tmp_path / "db") as again:
        assert state(again) == before and again.lookup("Li") == "Mu"


# ----------------------------------------------------------------------------- hypothesis

#: Any code point, lone surrogates included (and drawn often: they are 2,048 of 1.1 million), NUL and combining marks.
ANY_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=())
    | st.sampled_from(["\ud800", "\udfff", "\x00", "\u0301", "\U0001f600"]),
    max_size=12,
)


def test_any_text_is_stored_found_or_refused_typed():
    """Random text (lone surrogates, controls, NUL, astral planes) as key, value, query, lookup and delete."""
    db = make_db()

    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(key=ANY_TEXT, value=ANY_TEXT)
    def check(key: str, value: str) -> None:
        before = state(db)
        bad = any(0xD800 <= ord(c) <= 0xDFFF for c in key + value) or "\x00" in key + value
        try:
            db.upsert([key], [value])
        except KVSearchError as exc:
            assert state(db) == before
            assert not bad or isinstance(exc, (InvalidArgumentError, kvsearch.EmptyKeyError))  # "" comes first
        else:
            assert not bad and db.lookup(key) == value
            if key not in KEYS:
                assert db.delete(key) and state(db) == before
        for call in (lambda: db.search(key, k=2), lambda: db.lookup(key, default=None)):
            try:
                call()
            except KVSearchError as exc:
                assert not bad or isinstance(exc, InvalidArgumentError)
        if "\x00" in key and key.strip() and not any(0xD800 <= ord(c) <= 0xDFFF for c in key):
            with pytest.raises(InvalidArgumentError, match="NUL"):  # a query is compared with keys: none holds NUL
                db.search(key)
            assert db.lookup(key, default=None) is None  # a lookup: not stored

    check()


def test_any_text_in_metadata_is_stored_or_refused_typed():
    """Random text (lone surrogates, controls, NUL, astral planes) as a metadata field name and a string, at the top
    and nested: read back equal and found by an equality filter, or refused typed (NUL, a surrogate, a leading $)
    with nothing written."""
    db = make_db()

    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(name=ANY_TEXT, text=ANY_TEXT)
    def check(name: str, text: str) -> None:
        before = state(db)
        surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in name + text)
        refused = surrogate or "\x00" in name + text or name.startswith("$")
        meta = {name: text, "n": {name: [text]}}
        try:
            (new,) = db.add(["fresh"], ["v"], [meta])
        except KVSearchError as exc:
            assert refused and isinstance(exc, InvalidArgumentError), exc
            reasons = {"surrogate": surrogate, "NUL": "\x00" in name + text, "'$'": name.startswith("$")}
            assert any(word in str(exc) for word, applies in reasons.items() if applies), exc
            assert state(db) == before
            return
        assert not refused
        assert db.get(new).metadata == meta
        if name and "." not in name and not set('"\\[]') & set(name) and all(ord(c) >= 0x20 for c in name):
            assert new in db.where({name: text}).ids().tolist()  # a name a filter can say
        db.delete(new)

    check()


def test_nul_in_every_text_slot_is_refused_typed_naming_it():
    """A NUL character where text goes: a typed refusal that says so, nothing written."""
    db = make_db()
    before = state(db)
    for call in (
        lambda: db.add(["Li\x00"], ["v"]),
        lambda: db.add(["new"], ["v\x00"]),
        lambda: db.upsert(["Li"], ["Mu\x00"]),
        lambda: db.add(["new"], ["v"], [{"s": "a\x00b"}]),
        lambda: db.add(["new"], ["v"], [{"a\x00b": 1}]),
        lambda: db.upsert(["Li"], ["Mu"], [{"n": [{"s": "\x00"}]}]),
        lambda: db.where({"n": 0}).update({"s": "a\x00"}),
        lambda: db.where({"n": 0}).update({"s\x00": 1}, merge=True),
        lambda: db.where({"tag": "t\x00"}).delete(),
        lambda: db.where({"tag": {"$contains": "\x00"}}).delete(),
        lambda: db.where({"$key": {"$in": ["Li", "Li\x00"]}}).delete(),
        lambda: db.where({"ta\x00g": "t"}).delete(),
        lambda: db.search("Li\x00"),
        lambda: db.query(["Li", "\x00"]),
        lambda: db.search("Li", where={"tag": "t\x00"}),
    ):
        with pytest.raises(InvalidArgumentError, match="NUL|control characters"):
            call()
        assert state(db) == before


def test_numpy_scalars_in_metadata_are_stored_as_python_values():
    """numpy scalars, at any depth, through add, upsert and update: read back as the Python values they hold."""
    db = make_db()
    given = {"i": np.int64(3), "u": np.uint8(7), "f": np.float32(0.5), "b": np.bool_(True), "s": np.str_("x")}
    plain = {"i": 3, "u": 7, "f": 0.5, "b": True, "s": "x"}
    meta = {**given, "nested": [given, {"zero-d": np.array(2)}]}
    expected = {**plain, "nested": [plain, {"zero-d": 2}]}
    (new,) = db.add(["fresh"], ["v"], [meta])
    db.upsert(["Li"], ["Mu"], [meta])
    db.where({"n": 3}).update(meta, merge=False)
    for key in ("fresh", "Li", KEYS[3]):
        back = db.get(int(db.ids_of_keys([key])[0])).metadata
        assert back == expected
        assert [type(back[k]) for k in plain] == [int, int, float, bool, str]
    assert db.where({"i": np.int64(3), "b": np.bool_(True)}).count() == 3


def test_any_integer_id_is_found_or_not_found():
    db = make_db()
    stored = set(db.ids().tolist())
    before = state(db)

    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(st.integers() | st.sampled_from([2**63 - 1, 2**63, -(2**63), 2**64]))
    def check(id_: int) -> None:
        if id_ in stored:
            assert db.get(id_).id == id_
            return
        with pytest.raises(KeyNotFoundError):
            db.get(id_)
        with pytest.raises(KeyNotFoundError):
            db.delete(id_)
        assert db.key_texts([id_]) == [None] and db.value_texts([id_]) == {}
        assert state(db) == before

    check()


SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4) | st.lists(st.integers(), max_size=2)
)


def test_any_scalar_as_k_or_temperature_is_checked():
    db = make_db()

    @settings(max_examples=80, derandomize=True, deadline=None)
    @given(k=SCALARS, temperature=SCALARS)
    def check(k: object, temperature: object) -> None:
        k_ok = isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_K
        t_ok = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        t_ok = t_ok and math.isfinite(temperature) and temperature > 0
        try:
            db.query("Li", k=k, temperature=temperature)
        except KVSearchError:
            assert not (k_ok and t_ok)
        else:
            assert k_ok and t_ok

    check()


# ----------------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory) -> Path:
    """A small database folder, a CSV of records and one of pairs, for the command line."""
    folder = tmp_path_factory.mktemp("cli-hostile")
    make_db(folder / "db").close()
    (folder / "authors.csv").write_text("key,value\nZhang,Aston\nLi,Mu\n")
    (folder / "pairs.csv").write_text("query,target\nLipto,Lipton\n")
    (folder / "a-file").write_text("not a database")
    return folder


def cli_cases(folder: Path) -> list[list[str]]:
    """Bad command lines: usage errors, bad options, bad texts and paths, missing files."""
    db, csv, pairs, new = (
        str(folder / "db"),
        str(folder / "authors.csv"),
        str(folder / "pairs.csv"),
        str(folder / "new"),
    )
    cases: list[list[str]] = [[], ["nope"], ["--nope"], ["query"], ["query", db], ["demo", "--nope"]]
    for option, values in {
        "--k": ["0", "-1", "1.5", "x", "", str(2**70), "nan"],
        "--pooling": ["nope", ""],
        "--temperature": ["nan", "0", "-1", "inf", "1e400", "x"],
        "--score": ["nope", "additive"],
    }.items():
        cases += [["query", db, "Li", option, value] for value in values]
    cases += [["query", db, text] for text in ["", "  ", SURROGATE, "\udcff"]]
    cases += [["query", path, "Li"] for path in ["/nonexistent/db", str(folder / "a-file"), "", "a\x00b", "x" * 5000]]
    cases += [["query", db, "nobody", "--pooling", "exact"]]
    cases += [["info", path] for path in ["/nonexistent/db", "", "x" * 5000, str(folder / "a-file")]]
    cases += [["delete", db, key] for key in ["nobody", SURROGATE, ""]]
    cases += [
        ["build", new, "--from", "/nonexistent.csv"],
        ["build", new, "--from", csv, "--batch-size", "0"],
        ["build", new, "--from", csv, "--shards", "0"],
        ["build", new, "--from", csv, "--index", "x" * 1000],
        ["build", new, "--from", csv, "--index", "IDMap,Flat"],
        ["build", new, "--from", csv, "--key", "nope"],
        ["build", new, "--from", csv, "--format", "xml"],
        ["build", new, "--from", csv, "--score", "nope"],
        ["build", "", "--from", csv],
        ["build", "x" * 5000, "--from", csv],
        ["finetune", db, "--pairs", "/nonexistent.csv"],
        ["finetune", db, "--pairs", pairs, "--epochs", "0"],
        ["finetune", db, "--pairs", pairs, "--epochs", str(2**70)],
        ["finetune", db, "--pairs", pairs, "--lr", "nan"],
        ["finetune", db, "--pairs", pairs, "--batch-size", "-1"],
        ["finetune", db, "--pairs", pairs, "--k", "0"],
        ["finetune", db, "--pairs", pairs, "--seed", str(2**70)],
        ["finetune", db, "--pairs", csv],
        ["rollback", db],
        ["rollback", "/nonexistent/db"],
    ]
    return cases


def error_lines(stderr: str) -> list[str]:
    """stderr without tqdm's progress bar lines (redrawn with carriage returns)."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS_BAR.match(line)]


def test_bad_command_lines_exit_with_one_line_and_no_traceback(cli_folder, capsys, monkeypatch, tmp_path):
    """main(argv) with bad arguments: a non-zero status and one line on stderr; under --debug, a typed error."""
    monkeypatch.chdir(tmp_path)  # a command that wrongly took "" for the working folder would write here
    with kvsearch.Database(cli_folder / "db") as db:
        before = state(db)
    problems = []
    for argv in cli_cases(cli_folder):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            status = exc.code
        _, err = capsys.readouterr()
        lines = error_lines(err)
        if status in (0, None) or len(lines) != 1 or "Traceback" in err or not lines[0].startswith("kvsearch"):
            problems.append(f"{argv!r:.120}: status {status}, stderr {err!r:.300}")
        try:
            main(["--debug", *argv])
        except SystemExit as exc:
            if exc.code in (0, None):
                problems.append(f"--debug {argv!r:.120}: exit status {exc.code}")
        except (KVSearchError, CommandError):
            pass
        except Exception as exc:  # noqa: BLE001 - what the sweep is looking for
            problems.append(f"--debug {argv!r:.120}: {type(exc).__name__}: {str(exc)[:200]}")
        capsys.readouterr()
    assert not problems, "\n".join(problems)
    assert list(tmp_path.iterdir()) == []
    with kvsearch.Database(cli_folder / "db") as db:
        assert state(db) == before


# ----------------------------------------------------------------------------- coverage and figures


def public_callables() -> set[str]:
    """The public functions and classes of ``kvsearch`` (exceptions aside)."""
    out = set()
    for name in kvsearch.__all__:
        obj = getattr(kvsearch, name)
        if callable(obj) and not (isinstance(obj, type) and issubclass(obj, BaseException)):
            out.add(name)
    return out


#: Public names the sweep does not call, and why.
NOT_SWEPT = {
    "Answer": "a result object, made by query",
    "Hit": "a result object, made by search",
    "Candidates": "a plain dataclass of tensors, made by candidates",
    "Record": "a result object, made by get",
    "History": "a result object, made by finetune",
    "Encoder": "the abstract base of the encoders",
    "SentenceEncoder": "loads a sentence-transformers model (too slow here); its texts pass the same checks",
}


def swept_functions() -> set[str]:
    """The public functions and methods the slots call: ``Database.add``, ``attend``, ``Index.__init__``..."""
    return {case.name.rsplit(".", 1)[0] for case in SLOTS}


def test_the_sweep_covers_the_public_api():
    swept = {case.name.split(".")[0] for case in SLOTS}
    missing = public_callables() - set(NOT_SWEPT) - swept
    assert not missing, missing
    methods = {m for m in dir(kvsearch.Database) if not m.startswith("_")} | {"__init__", "__len__", "__contains__"}
    covered = {case.name.split(".")[1] for case in SLOTS if case.name.startswith("Database.")} | set(VALID_CALLS)
    assert methods <= covered, methods - covered
    constructor = {"path", "encoder", "value_encoder", "dim", "value_dim", "index", "score", "device"}
    constructor |= {"search_params", "lock_timeout", "read_only", "capacity"}
    assert {f"Database.__init__.{option}" for option in constructor} <= {case.name for case in SLOTS}


def test_sweep_figures(cli_folder):
    calls = sum(len(case.values()) for case in SLOTS)
    cli = len(cli_cases(cli_folder))
    print(
        f"\nhostile sweep: {calls:,} calls over {len(SLOTS)} arguments of {len(swept_functions())} public functions "
        f"and methods ({len(HOSTILE)} generic hostile values, and malformed pairs); {len(VALID_CALLS)} calls on a "
        f"closed database; {cli} bad command lines, each with and without --debug"
    )
    assert calls >= 200 and len(SLOTS) >= 100
