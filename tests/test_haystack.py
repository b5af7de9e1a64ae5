"""The Haystack document store: every test class Haystack ships for document stores, in memory and on disk, and
kvsearch's own paths, each against a reference.

Haystack's classes (``haystack.testing.document_store``: the base and extended tests, the by-filter and the metadata
aggregation tests) run whole over an empty store in memory and in a folder. They compare documents with ``==``;
embeddings are stored as float32 (as FAISS and most vector databases keep them), so the one override compares each
expected document with its embedding rounded to float32 — exactly, every other field as written. Then: Haystack
filters against Haystack's own evaluator (``document_matches_filter``) on seeded random documents and filters, the
translation and its errors, write policies, what a Document carries beyond id / content / meta, the retriever
against a brute-force numpy ranking, serialisation round trips, a store whose dim comes with its documents, and a
plain (and fine-tuned) kvsearch database serving as documents.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import random
import sys
import unicodedata
from datetime import datetime

import numpy as np
import pytest
import torch

pytest.importorskip("haystack")

import haystack.testing.document_store as haystack_tests  # noqa: E402
from conftest import AUTHORS  # noqa: E402
from haystack import Document, Pipeline  # noqa: E402
from haystack.dataclasses import ByteStream, SparseEmbedding  # noqa: E402
from haystack.document_stores.errors import DuplicateDocumentError  # noqa: E402
from haystack.document_stores.types import DuplicatePolicy, FilterPolicy  # noqa: E402
from haystack.errors import FilterError  # noqa: E402
from haystack.testing.document_store import (  # noqa: E402
    CountDocumentsByFilterTest,
    CountUniqueMetadataByFilterTest,
    DocumentStoreBaseExtendedTests,
    GetMetadataFieldMinMaxTest,
    GetMetadataFieldsInfoTest,
    GetMetadataFieldUniqueValuesTest,
)
from haystack.utils.filters import document_matches_filter  # noqa: E402

import kvsearch  # noqa: E402
from kvsearch.integrations.haystack import (  # noqa: E402
    KVSearchDocumentStore,
    KVSearchEmbeddingRetriever,
    KVSearchFilterError,
    KVSearchTextEmbedder,
)
from kvsearch.integrations.haystack_filters import NOTHING, to_where  # noqa: E402


def as_float32(doc: Document) -> Document:
    """The document as the store gives it back: its embedding rounded to float32, nothing else changed."""
    if doc.embedding is None:
        return doc
    return dataclasses.replace(doc, embedding=np.asarray(doc.embedding, dtype=np.float32).tolist())


class _HaystackSuite(
    DocumentStoreBaseExtendedTests,
    CountDocumentsByFilterTest,
    CountUniqueMetadataByFilterTest,
    GetMetadataFieldsInfoTest,
    GetMetadataFieldMinMaxTest,
    GetMetadataFieldUniqueValuesTest,
):
    """Every Haystack document store test class, over an empty store; the subclasses pick where it lives."""

    on_disk = False

    @pytest.fixture
    def document_store(self, tmp_path):
        store = KVSearchDocumentStore(tmp_path / "docs" if self.on_disk else None)
        try:
            yield store
        finally:
            store.close()

    @staticmethod
    def assert_documents_are_equal(received: list[Document], expected: list[Document]) -> None:
        assert received == [as_float32(d) for d in expected]

    def test_write_documents(self, document_store):
        """Haystack leaves the default policy to the store: NONE is FAIL here, as in its in-memory store."""
        doc = Document(content="test doc", embedding=[0.5, 0.25])
        assert document_store.write_documents([doc]) == 1
        with pytest.raises(DuplicateDocumentError):
            document_store.write_documents([doc])
        self.assert_documents_are_equal(document_store.filter_documents(), [doc])


class TestInMemory(_HaystackSuite):
    pass


class TestOnDisk(_HaystackSuite):
    on_disk = True


def test_every_haystack_document_store_test_class_runs():
    shipped = [
        cls
        for _, cls in inspect.getmembers(haystack_tests, inspect.isclass)
        if cls.__module__ == haystack_tests.__name__ and any(name.startswith("test_") for name in vars(cls))
    ]
    assert len(shipped) >= 12  # count, write, delete, filter; delete-all, delete / update by filter; five aggregations
    assert [cls.__name__ for cls in shipped if not issubclass(_HaystackSuite, cls)] == []


# ---------------------------------------------------------------------------------------------- filters


DATES = ["1969-07-21T20:17:40", "1972-12-11", "1972-12-11T00:00:00", "1989-11-09 17:53:00", "2001-01-01T10:00:00"]
NUMBERS = [-3, -1, 0, 1, 1.0, 2.5, 3]
TEXTS = ["a", "b", "B", "ab", ""]


def random_documents(rng: random.Random, n: int) -> list[Document]:
    """Documents whose meta fields keep one kind each (so Haystack's evaluator never raises on them), with values
    missing or None now and then, ISO dates in three spellings and as datetimes, and a nested dict."""

    def pick(pool: list, missing: float = 0.2) -> object:
        r = rng.random()
        return "MISSING" if r < missing else None if r < missing + 0.1 else rng.choice(pool)

    docs = []
    for i in range(n):
        meta = {
            "n": pick(NUMBERS),
            "s": pick(TEXTS),
            "d": pick(DATES + [datetime(1972, 12, 11), datetime(1995, 5, 5, 12)]),
            "x": pick([{"y": 1}, {"y": 2}, {"y": -1}, {"z": 1}]),
            "flag": pick([True, False]),
        }
        meta = {k: v for k, v in meta.items() if v != "MISSING"}
        content = rng.choice(TEXTS + ["long text", None])
        embedding = None if rng.random() < 0.2 else [rng.uniform(-1, 1) for _ in range(4)]
        docs.append(Document(id=f"doc-{i}", content=content, meta=meta, embedding=embedding))
    return docs


def random_filter(rng: random.Random, depth: int = 0) -> dict:
    if depth < 2 and rng.random() < 0.4:
        conditions = [random_filter(rng, depth + 1) for _ in range(rng.randint(1, 3))]
        return {"operator": rng.choice(["AND", "OR", "NOT"]), "conditions": conditions}
    field, pool, ordered = rng.choice(
        [
            ("meta.n", NUMBERS + [None], True),
            ("meta.s", TEXTS + [None, 1], False),
            ("meta.d", DATES + [None, datetime(1980, 1, 1)], True),
            ("meta.x.y", [-1, 1, 2, None], True),
            ("meta.flag", [True, False, None], False),
            ("meta.nothing", [None, 1], False),
            ("nothing.at.all", [None, 1], False),
            ("n", NUMBERS + [None], True),
            ("content", TEXTS + ["long text", None], False),
            ("id", ["doc-1", "doc-2", "doc-30", "nope", None], False),
        ]
    )
    operator = rng.choice(["==", "!=", "in", "not in"] + ([">", ">=", "<", "<="] if ordered else []))
    value = rng.sample(pool, rng.randint(0, min(3, len(pool)))) if operator in ("in", "not in") else rng.choice(pool)
    return {"field": field, "operator": operator, "value": value}


@pytest.mark.parametrize("on_disk", [False, True])
def test_filters_select_what_haystack_selects(tmp_path, on_disk):
    rng = random.Random(7)
    docs = random_documents(rng, 40)
    store = KVSearchDocumentStore(tmp_path / "docs" if on_disk else None)
    store.write_documents(docs)
    for _ in range(250 if not on_disk else 60):
        filters = random_filter(rng)
        expected = [d.id for d in docs if document_matches_filter(filters, d)]
        assert [d.id for d in store.filter_documents(filters)] == expected, filters
        assert store.count_documents_by_filter(filters) == len(expected), filters
    store.close()


@pytest.mark.parametrize(
    ("filters", "where"),
    [
        (None, {}),
        ({}, {}),
        ({"field": "meta.year", "operator": ">=", "value": 2000}, {"year": {"$gte": 2000}}),
        ({"field": "year", "operator": "<", "value": 2000}, {"year": {"$lt": 2000}}),  # Haystack's legacy field
        ({"field": "meta.a.b", "operator": "!=", "value": None}, {"a.b": {"$ne": None}}),
        ({"field": "meta.tag", "operator": "in", "value": ["x", None]}, {"tag": {"$in": ["x", None]}}),
        ({"field": "meta.tag", "operator": "not in", "value": ["x"]}, {"tag": {"$ne": "x"}}),
        ({"field": "content", "operator": "==", "value": "hi"}, {"$value": "hi"}),
        ({"field": "content", "operator": "==", "value": None}, {"$value": None}),
        ({"field": "id", "operator": "in", "value": ["a", "a "]}, {"$key": {"$in": ["a", '"a "']}}),
        ({"field": "id", "operator": "==", "value": 3}, NOTHING),  # no document has a non-str id
        ({"field": "embedding", "operator": "==", "value": None}, {"_haystack.no_embedding": True}),
        ({"field": "meta.n", "operator": ">", "value": None}, NOTHING),
        ({"field": "other.field", "operator": "!=", "value": None}, NOTHING),  # names nothing: None, as Haystack
        ({"operator": "OR", "conditions": []}, NOTHING),
        ({"operator": "AND", "conditions": []}, {}),
        (
            {"operator": "NOT", "conditions": [{"field": "meta.a", "operator": "==", "value": 1}]},
            {"$not": {"a": 1}},
        ),
        (
            {"field": "meta.when", "operator": ">", "value": "2024-01-31"},
            {
                "$or": [
                    {"when": {"$gt": datetime(2024, 1, 31)}},
                    {"_haystack:when": {"$gt": datetime(2024, 1, 31)}},
                ]
            },
        ),
    ],
)
def test_translation(filters, where):
    assert to_where(filters) == where


@pytest.mark.parametrize(
    "filters",
    [
        {"conditions": []},
        {"operator": "AND"},
        {"operator": "XOR", "conditions": []},
        {"operator": "AND", "conditions": {"field": "meta.a", "operator": "==", "value": 1}},
        {"operator": "AND", "conditions": ["meta.a"]},
        {"field": "meta.a", "value": 1},
        {"field": "meta.a", "operator": "=="},
        {"field": "meta.a", "operator": "~", "value": 1},
        {"field": 3, "operator": "==", "value": 1},
        {"field": "meta.a", "operator": ">", "value": "1"},  # strings compare only as ISO dates
        {"field": "meta.a", "operator": ">", "value": [1]},
        {"field": "meta.a", "operator": ">", "value": True},
        {"field": "meta.a", "operator": "in", "value": (1, 2)},
        {"field": "meta.a", "operator": "not in", "value": 1},
        {"field": "meta.a", "operator": "==", "value": [1, 2]},  # kvsearch compares scalars
        {"field": "meta.a", "operator": "==", "value": {"b": 1}},
        {"field": "id", "operator": ">", "value": "a"},
        {"field": "content", "operator": "<", "value": "a"},
        {"field": "embedding", "operator": "==", "value": [1.0]},
        {"field": "meta", "operator": "==", "value": {}},
        {"field": "meta._haystack", "operator": "==", "value": 1},
        {"field": "meta.$bad", "operator": "==", "value": 1},  # refused by kvsearch's filter check
        {"field": "meta.a", "operator": "==", "value": float("nan")},
    ],
)
def test_bad_filters_raise_filter_errors(filters):
    store = KVSearchDocumentStore()
    store.write_documents([Document(content="x", meta={"a": 1})])
    with pytest.raises(FilterError) as info:
        store.filter_documents(filters)
    assert isinstance(info.value, KVSearchFilterError) and isinstance(info.value, kvsearch.InvalidArgumentError)


def test_delete_and_update_by_filter_refuse_an_empty_filter():
    store = KVSearchDocumentStore()
    store.write_documents([Document(content="x")])
    for call in (lambda: store.delete_by_filter({}), lambda: store.update_by_filter({}, {"a": 1})):
        with pytest.raises(FilterError):
            call()
    assert store.count_documents() == 1


def test_update_keeps_date_comparisons_true():
    store = KVSearchDocumentStore()
    store.write_documents([Document(id=str(i), content=str(i), meta={"when": "2020-01-01", "i": i}) for i in range(3)])
    later = {"field": "meta.when", "operator": ">", "value": "2021-06-01T00:00:00"}
    assert store.update_by_filter({"field": "meta.i", "operator": "==", "value": 1}, {"when": "2022-02-02"}) == 1
    assert [d.id for d in store.filter_documents(later)] == ["1"]
    store.update_by_filter({"field": "meta.i", "operator": "==", "value": 1}, {"when": 5})  # no longer a date
    assert store.filter_documents(later) == []
    assert store.filter_documents({"field": "meta.i", "operator": "==", "value": 1})[0].meta == {"when": 5, "i": 1}
    store.update_by_filter({"field": "meta.i", "operator": "==", "value": 2}, {"note": "x"})  # no date in it
    stored = store.database.metadata_of(store.database.ids())
    assert [sorted(name for name in m if name.startswith("_haystack:")) for m in stored.values()] == [
        ["_haystack:when"],
        ["_haystack:when"],  # the twin of a date no more is null: no date compares with it
        ["_haystack:when"],  # no twin written for "note"
    ]
    assert stored[2]["_haystack:when"] is None


# ---------------------------------------------------------------------------------------------- writing and reading


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_document_comes_back_whole(tmp_path, on_disk):
    docs = [
        Document(
            id="full",
            content="text",
            blob=ByteStream(b"\x00\xffbytes", meta={"source": "x"}, mime_type="application/octet-stream"),
            meta={"a": {"b": [1, "two", None]}, "when": "2024-05-06T07:08:09+02:00", "at": datetime(2020, 1, 1, 12)},
            score=0.25,
            embedding=[0.5, -0.25, 1.0],
            sparse_embedding=SparseEmbedding(indices=[3, 7], values=[0.1, 0.2]),
        ),
        Document(id="bare", content=None, meta={}),  # no content, no embedding
        Document(id="empty", content="", embedding=[0.0, 0.0, 0.0]),
    ]
    store = KVSearchDocumentStore(tmp_path / "docs" if on_disk else None)
    store.write_documents(docs)
    assert store.filter_documents() == docs
    if on_disk:
        store.close()
        store = KVSearchDocumentStore(tmp_path / "docs")
        assert store.filter_documents() == docs
    assert store.filter_documents({"field": "content", "operator": "==", "value": None}) == [docs[1]]
    assert store.filter_documents({"field": "content", "operator": "==", "value": ""}) == [docs[2]]
    assert store.filter_documents({"field": "blob", "operator": "!=", "value": None}) == [docs[0]]
    assert store.filter_documents({"field": "score", "operator": "<", "value": 0.5}) == [docs[0]]
    assert store.get_metadata_fields_info() == {
        "a": {"type": "object"},
        "when": {"type": "keyword"},
        "at": {"type": "date"},
    }
    store.close()


def test_ids_are_opaque():
    ids = ["doc-7", "doc-7 ", unicodedata.normalize("NFC", "Müller"), unicodedata.normalize("NFD", "Müller"), '"q"']
    store = KVSearchDocumentStore()
    store.write_documents([Document(id=i, content=f"c{n}") for n, i in enumerate(ids)])
    assert [d.id for d in store.filter_documents()] == ids
    for n, i in enumerate(ids):
        assert [d.content for d in store.filter_documents({"field": "id", "operator": "==", "value": i})] == [f"c{n}"]
    store.delete_documents(["doc-7 ", "nope"])
    assert [d.id for d in store.filter_documents()] == [i for i in ids if i != "doc-7 "]


def test_write_policies():
    store = KVSearchDocumentStore()
    a1, a2, b = Document(id="a", content="1"), Document(id="a", content="2"), Document(id="b", content="3")
    with pytest.raises(DuplicateDocumentError):
        store.write_documents([a1, b, a2])  # repeated in one write, under the default (FAIL)
    assert store.count_documents() == 0  # nothing written
    assert store.write_documents([a1, b, a2], policy=DuplicatePolicy.SKIP) == 2  # the first of repeated ids
    assert [d.content for d in store.filter_documents()] == ["1", "3"]
    assert store.write_documents([a2, Document(id="c", content="4")], policy=DuplicatePolicy.SKIP) == 1
    with pytest.raises(DuplicateDocumentError):
        store.write_documents([Document(id="d", content="5"), a2], policy=DuplicatePolicy.FAIL)
    assert store.count_documents() == 3
    assert store.write_documents([a2, Document(id="b", content=None), a1], policy=DuplicatePolicy.OVERWRITE) == 3
    assert [(d.id, d.content) for d in store.filter_documents()] == [("a", "1"), ("b", None), ("c", "4")]  # in place


@pytest.mark.parametrize("bad", ["not a list", ["not a document"], [Document(content="x", meta={"_haystack": 1})]])
def test_bad_writes_raise_value_errors(bad):
    with pytest.raises(ValueError):
        KVSearchDocumentStore().write_documents(bad)


def test_embeddings_of_the_wrong_dim_are_refused_before_anything_is_written():
    store = KVSearchDocumentStore(dim=3)
    with pytest.raises(kvsearch.DimensionMismatchError):
        store.write_documents(
            [Document(content="a", embedding=[1.0, 2.0, 3.0]), Document(content="b", embedding=[1.0])]
        )
    with pytest.raises(kvsearch.DimensionMismatchError):
        store.write_documents([Document(content="a"), Document(content="b", embedding=[1.0, 2.0])])
    assert store.count_documents() == 0


@pytest.mark.parametrize("on_disk", [False, True])
def test_the_dim_comes_with_the_first_embedding(tmp_path, on_disk):
    path = tmp_path / "docs" if on_disk else None
    store = KVSearchDocumentStore(path)
    early = [Document(id="x", content="no embedding yet", meta={"k": 1}), Document(id="y", content=None)]
    store.write_documents(early)
    assert store.database.dim == 1  # a stand-in, while no document has an embedding
    late = Document(id="z", content="now one", embedding=[1.0, 0.0, 0.0, 0.0])
    store.write_documents([late])
    assert store.database.dim == 4 and store.filter_documents() == [*early, late]  # re-made, documents kept
    assert store.embedding_retrieval([1.0, 0.0, 0.0, 0.0])[0].id == "z"
    with pytest.raises(kvsearch.DimensionMismatchError):
        store.write_documents([Document(id="w", content="w", embedding=[1.0, 2.0])])
    store.close()
    if on_disk:
        assert [p.name for p in tmp_path.iterdir()] == ["docs"]  # nothing left beside the folder
        assert KVSearchDocumentStore(path).filter_documents() == [*early, late]


# ---------------------------------------------------------------------------------------------- retrieval


def brute_force(docs: list[Document], query: np.ndarray, top_k: int, score: str, keep) -> list[tuple[str, float]]:
    """The reference ranking: every document with an embedding that ``keep`` accepts, scored in float64."""
    kept = [d for d in docs if d.embedding is not None and keep(d)]
    if not kept:
        return []
    embs = np.asarray([np.float32(d.embedding) for d in kept], dtype=np.float64)  # (m, dim)
    if score == "cosine":
        embs = embs / np.maximum(np.linalg.norm(embs, axis=1, keepdims=True), 1e-12)
        query = query / np.linalg.norm(query)
    scores = embs @ query  # (m,)
    order = np.argsort(-scores, kind="stable")[:top_k]
    return [(kept[i].id, float(scores[i])) for i in order]


@pytest.mark.parametrize("index", ["Flat", "HNSW32", "IVF4,Flat"])
@pytest.mark.parametrize("score", ["cosine", "dot"])
@pytest.mark.parametrize("top_k", [1, 5, 100])
@pytest.mark.parametrize("with_filter", [False, True])
def test_retriever_matches_a_brute_force_ranking(index, score, top_k, with_filter):
    rng = np.random.default_rng(3)
    docs = [
        Document(
            id=f"d{i}",
            content=f"c{i}",
            meta={"group": i % 3},
            embedding=None if i % 5 == 0 else rng.standard_normal(8).tolist(),  # every fifth without one
        )
        for i in range(40)
    ]
    store = KVSearchDocumentStore(score=score, index=index)
    store.write_documents(docs)
    retriever = KVSearchEmbeddingRetriever(store, top_k=top_k)
    query = rng.standard_normal(8)
    filters = {"field": "meta.group", "operator": "!=", "value": 1} if with_filter else None
    got = retriever.run(query_embedding=query.tolist(), filters=filters)["documents"]
    want = brute_force(docs, query, top_k, score, lambda d: not with_filter or d.meta["group"] != 1)
    assert [d.id for d in got] == [i for i, _ in want]
    np.testing.assert_allclose([d.score for d in got], [s for _, s in want], rtol=1e-5, atol=1e-5)
    assert all(d.embedding is None for d in got)


def test_retriever_options():
    rng = np.random.default_rng(4)
    docs = [
        Document(
            id=f"d{i}", content=str(i), meta={"i": i, "even": i % 2 == 0}, embedding=rng.standard_normal(4).tolist()
        )
        for i in range(9)
    ]
    store = KVSearchDocumentStore()
    store.write_documents(docs + [Document(id="none", content="no embedding")])
    query = rng.standard_normal(4).tolist()
    low = {"field": "meta.i", "operator": "<", "value": 5}
    even = {"field": "meta.even", "operator": "==", "value": True}
    merge = KVSearchEmbeddingRetriever(store, filters=low, top_k=9, filter_policy=FilterPolicy.MERGE)
    replace = KVSearchEmbeddingRetriever(store, filters=low, top_k=9, filter_policy="replace", return_embedding=True)
    assert sorted(d.meta["i"] for d in merge.run(query, filters=even)["documents"]) == [0, 2, 4]
    got = replace.run(query, filters=even)["documents"]
    assert sorted(d.meta["i"] for d in got) == [0, 2, 4, 6, 8]
    assert all(d.embedding == as_float32(docs[d.meta["i"]]).embedding for d in got)
    assert replace.run(query, top_k=0)["documents"] == []
    assert KVSearchEmbeddingRetriever(KVSearchDocumentStore()).run(query)["documents"] == []  # no database yet
    only_bare = KVSearchDocumentStore()
    only_bare.write_documents([Document(content="no embedding")])
    assert KVSearchEmbeddingRetriever(only_bare).run(query)["documents"] == []  # of another dim, and excluded
    for bad in ({"top_k": 0}, {"top_k": 1.5}):
        with pytest.raises(ValueError):
            KVSearchEmbeddingRetriever(store, **bad)
    with pytest.raises(ValueError):
        merge.run([])


# ---------------------------------------------------------------------------------------------- serialisation


def test_serialisation_round_trips(tmp_path):
    store = KVSearchDocumentStore(tmp_path / "docs", index="HNSW32", score="dot")
    docs = [Document(id=f"d{i}", content=str(i), meta={"i": i}, embedding=[float(i), 1.0]) for i in range(5)]
    store.write_documents(docs)
    data = store.to_dict()
    assert data == {
        "type": "kvsearch.integrations.haystack.KVSearchDocumentStore",
        "init_parameters": {"path": str(tmp_path / "docs"), "index": "HNSW32", "score": "dot"},
    }
    retriever = KVSearchEmbeddingRetriever(store, filters={"field": "meta.i", "operator": ">", "value": 0}, top_k=2)
    pipeline = Pipeline()
    pipeline.add_component("retriever", retriever)
    dumped = pipeline.dumps()
    expected = pipeline.run({"retriever": {"query_embedding": [1.0, 0.0]}})["retriever"]["documents"]
    store.close()
    loaded = Pipeline.loads(dumped, allowed_modules=["kvsearch.integrations.haystack"])  # reopens the folder
    again = loaded.run({"retriever": {"query_embedding": [1.0, 0.0]}})["retriever"]["documents"]
    assert [d.id for d in again] == [d.id for d in expected] == ["d4", "d3"]
    restored = loaded.get_component("retriever")
    assert (restored.top_k, restored.filters, restored.filter_policy) == (2, retriever.filters, FilterPolicy.REPLACE)
    restored.document_store.close()
    in_memory = KVSearchDocumentStore(dim=3, score="dot")
    assert KVSearchDocumentStore.from_dict(in_memory.to_dict()).database.score == "dot"
    served = KVSearchDocumentStore(database=in_memory.database).to_dict()["init_parameters"]
    assert (served["path"], served["dim"], served["score"]) == (None, 3, "dot")
    embedder = KVSearchTextEmbedder(in_memory)
    assert KVSearchTextEmbedder.from_dict(embedder.to_dict()).to_dict() == embedder.to_dict()


def test_missing_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "haystack.document_stores.types", None)  # as if haystack-ai were missing
    monkeypatch.delitem(sys.modules, "kvsearch.integrations.haystack")
    with pytest.raises(ImportError, match=r"pip install 'kvsearch\[haystack\]'") as info:
        importlib.import_module("kvsearch.integrations.haystack")
    assert isinstance(info.value, kvsearch.MissingDependencyError)


def test_constructor_refuses_mixed_arguments():
    db = kvsearch.Database(None, dim=2, value_dim=2)
    for bad in (lambda: KVSearchDocumentStore("x", database=db), lambda: KVSearchDocumentStore(database="db")):
        with pytest.raises(kvsearch.InvalidArgumentError):
            bad()
    with pytest.raises(kvsearch.InvalidArgumentError):
        KVSearchEmbeddingRetriever(db)


# ---------------------------------------------------------------------------------------------- a kvsearch database


def test_a_kvsearch_database_serves_its_records_as_documents(tmp_path):
    db = kvsearch.Database(tmp_path / "names", encoder=kvsearch.NgramEncoder())
    db.add(list(AUTHORS), list(AUTHORS.values()), [{"born": 1900 + i} for i in range(6)])
    kvsearch.finetune(db, [("Lipto", "Lipton"), ("Smolla", "Smola")], epochs=1, verbose=False)
    store = KVSearchDocumentStore(database=db)
    docs = store.filter_documents({"field": "meta.born", "operator": ">=", "value": 1904})
    assert [(d.id, d.content, d.meta) for d in docs] == [
        ("Hu", "Rachel", {"born": 1904}),
        ("Werness", "Brent", {"born": 1905}),
    ]
    keys = db.embeddings(db.ids_of_keys(["Hu"]))[0][0].cpu()
    assert docs[0].embedding == keys.tolist()  # the key embedding itself
    pipeline = Pipeline()
    pipeline.add_component("embedder", KVSearchTextEmbedder(store))
    pipeline.add_component("retriever", KVSearchEmbeddingRetriever(store, top_k=3))
    pipeline.connect("embedder.embedding", "retriever.query_embedding")
    got = pipeline.run({"embedder": {"text": "Lipto"}})["retriever"]["documents"]
    want = db.search("Lipto", k=3)
    assert [(d.id, d.content) for d in got] == [(h.key, h.value) for h in want]
    np.testing.assert_allclose([d.score for d in got], [h.score for h in want], rtol=1e-5, atol=1e-6)
    store.write_documents([Document(id="Zhao", content="Xin")])  # no embedding: the key encoder's, on the content
    assert store.filter_documents({"field": "id", "operator": "==", "value": "Zhao"})[0].embedding is None
    with pytest.raises(kvsearch.MissingEncoderError):
        KVSearchTextEmbedder(KVSearchDocumentStore(dim=2)).run("text")
    db.close()


def test_records_without_key_text_are_documents_too():
    db = kvsearch.Database(None, dim=2, value_dim=2)
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # keys as embeddings: no key text
    db.add(keys, ["first", "second"], [{"n": 1}, {"n": 2}], value_embeddings=keys)
    store = KVSearchDocumentStore(database=db)
    assert [(d.id, d.content, d.meta, d.embedding) for d in store.filter_documents()] == [
        ("#1", "first", {"n": 1}, [1.0, 0.0]),
        ("#2", "second", {"n": 2}, [0.0, 1.0]),
    ]
    assert [d.id for d in store.embedding_retrieval([0.1, 0.9], top_k=1)] == ["#2"]
    assert [d.id for d in store.filter_documents({"field": "meta.n", "operator": ">", "value": 1})] == ["#2"]


@pytest.mark.parametrize("score", [lambda q, k: q @ k.T, "additive", "euclid", 3])
def test_a_score_no_database_has_is_refused_at_construction(tmp_path, score):
    with pytest.raises(kvsearch.UnknownOptionError, match=r"'dot', 'scaled_dot', 'cosine', 'gaussian'"):
        KVSearchDocumentStore(tmp_path / "h", score=score)  # not at the first write, which makes the database
    assert not (tmp_path / "h").exists()
