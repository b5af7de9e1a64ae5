"""The LangChain vector store: LangChain's whole standard suite in four configurations, and kvsearch's own paths.

``VectorStoreIntegrationTests`` (from langchain-tests) adds, searches, replaces, deletes and gets documents by id,
sync and async, with its own deterministic fake embeddings; it runs here over a database in memory and on disk,
with a Flat (exact) and an HNSW index. Then: the database's own encoder instead of LangChain embeddings, the
message when the extra is missing, metadata filters, and a fine-tuned database serving as a retriever. Then the
behaviours LangChain users expect, each against a reference: ids are opaque strings and re-adding an id replaces the
whole document (both as ``InMemoryVectorStore`` on the same calls), and maximal marginal relevance (as a brute-force
MMR computed here from the same embeddings).
"""

from __future__ import annotations

import importlib
import sys
import unicodedata

import numpy as np
import pytest

pytest.importorskip("langchain_tests")

from conftest import AUTHORS  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding, Embeddings  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402
from langchain_tests.integration_tests import VectorStoreIntegrationTests  # noqa: E402

import kvsearch  # noqa: E402
from kvsearch.integrations.langchain import KVSearchVectorStore  # noqa: E402


class _Standard(VectorStoreIntegrationTests):
    """The standard suite over an empty store; the subclasses pick where the database lives and its index."""

    index = "Flat"
    on_disk = False

    @pytest.fixture
    def vectorstore(self, tmp_path):
        path = tmp_path / "store" if self.on_disk else None
        store = KVSearchVectorStore(self.get_embeddings(), path=path, index=self.index)
        try:
            yield store
        finally:
            store.close()


class TestInMemoryFlat(_Standard):
    pass


class TestInMemoryHNSW(_Standard):
    index = "HNSW32"


class TestOnDiskFlat(_Standard):
    on_disk = True


class TestOnDiskHNSW(_Standard):
    index = "HNSW32"
    on_disk = True


# ---------------------------------------------------------------------- kvsearch's own paths


def test_database_encoder_instead_of_langchain_embeddings(tmp_path):
    store = KVSearchVectorStore(path=tmp_path / "db", encoder=kvsearch.NgramEncoder(dim=64, num_buckets=512))
    ids = store.add_texts(["Zachary Lipton", "Mu Li", "Alex Smola"], [{"n": 0}, {"n": 1}, {"n": 2}])
    assert store.embeddings is None and len(store.database) == 3
    [best] = store.similarity_search("Lipton Zachary", k=1)
    assert best == Document(id=ids[0], page_content="Zachary Lipton", metadata={"n": 0})
    assert [d.page_content for d in store.similarity_search("Mu", k=3, filter={"n": {"$gte": 1}})] == [
        "Mu Li",
        "Alex Smola",
    ]
    store.add_documents([Document(page_content="Mu Li (edited)", metadata={"n": 5})], ids=[ids[1]])
    assert store.get_by_ids([ids[1], "nobody"]) == [
        Document(id=ids[1], page_content="Mu Li (edited)", metadata={"n": 5})
    ]
    store.close()
    again = KVSearchVectorStore(path=tmp_path / "db", encoder=kvsearch.NgramEncoder(dim=64, num_buckets=512))
    assert again.similarity_search("Lipton Zachary", k=1)[0].id == ids[0]  # the documents' embeddings were kept
    again.close()


def test_langchain_embeddings_with_filters_and_scores():
    store = KVSearchVectorStore.from_texts(
        ["alpha", "beta", "gamma"],
        DeterministicFakeEmbedding(size=8),
        [{"lang": "en"}, {"lang": "de"}, {"lang": "en"}],
        ids=["a", "b", "c"],
    )
    scored = store.similarity_search_with_relevance_scores("alpha", k=3)
    assert scored[0][0].id == "a" and scored[0][1] == pytest.approx(1.0) and all(0 <= s <= 1 for _, s in scored)
    assert sorted(d.id for d in store.similarity_search("beta", k=3, filter={"lang": "en"})) == ["a", "c"]
    assert store.delete(["a", "zz"]) is True and store.get_by_ids(["a", "b"]) == [
        Document(id="b", page_content="beta", metadata={"lang": "de"})
    ]
    with pytest.raises(kvsearch.InvalidArgumentError, match="keyword"):
        store.similarity_search("alpha", k=1, fetch_k=3)


def test_missing_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "langchain_core.vectorstores", None)  # as if langchain-core were not installed
    monkeypatch.delitem(sys.modules, "kvsearch.integrations.langchain")
    with pytest.raises(ImportError, match=r"pip install 'kvsearch\[langchain\]'") as info:
        importlib.import_module("kvsearch.integrations.langchain")
    assert isinstance(info.value, kvsearch.MissingDependencyError)


def test_fine_tuned_database_as_a_retriever(tmp_path):
    db = kvsearch.Database(tmp_path / "names", encoder=kvsearch.NgramEncoder())
    db.add(list(AUTHORS), list(AUTHORS.values()), [{"born": 1900 + i} for i in range(6)])
    kvsearch.finetune(db, [("Lipto", "Lipton"), ("Smolla", "Smola")], targets="key", epochs=1, verbose=False)
    docs = KVSearchVectorStore(database=db).as_retriever(search_kwargs={"k": 2}).invoke("Lipto")
    assert docs[0] == Document(id="Lipton", page_content="Zachary", metadata={"born": 1901}) and len(docs) == 2
    db.close()


# ---------------------------------------------------------------------- ids are opaque strings

NFC, NFD = unicodedata.normalize("NFC", "Müller"), unicodedata.normalize("NFD", "Müller")
# ids that a key's normalisation would merge (Unicode forms, surrounding spaces), ids that start with a quote, and
# '"doc-7 "': the JSON literal that stores "doc-7 ", as an id of its own
ODD_IDS = [NFC, NFD, "doc-7", "doc-7 ", " doc-7", '"doc-7', '"doc-7 "', '"', "  ", "\u00a0", "doc-8"]


def _stores(tmp_path, on_disk: bool) -> tuple[KVSearchVectorStore, InMemoryVectorStore]:
    """A kvsearch store and LangChain's in-memory one (the reference), with the same embeddings."""
    embedding = DeterministicFakeEmbedding(size=16)
    store = KVSearchVectorStore(embedding, path=tmp_path / "store" if on_disk else None)
    return store, InMemoryVectorStore(embedding)


@pytest.mark.parametrize("on_disk", [False, True])
def test_ids_that_differ_in_any_character_are_two_documents(tmp_path, on_disk):
    store, reference = _stores(tmp_path, on_disk)
    documents = [Document(page_content=f"text {n}", metadata={"n": n}) for n in range(len(ODD_IDS))]
    assert store.add_documents(documents, ids=ODD_IDS) == reference.add_documents(documents, ids=ODD_IDS) == ODD_IDS
    assert len(store.database) == len(ODD_IDS)
    got = store.get_by_ids(ODD_IDS[::-1])
    assert got == reference.get_by_ids(ODD_IDS[::-1]) and [d.id for d in got] == ODD_IDS[::-1]
    for n, id_ in enumerate(ODD_IDS):  # the id a search hit comes back with
        [(best, score)] = store.similarity_search_with_score(f"text {n}", k=1)
        assert best == reference.similarity_search(f"text {n}", k=1)[0] and best.id == id_
        assert score == pytest.approx(1.0)
    if on_disk:  # the ids survive a reopen
        store.close()
        store = KVSearchVectorStore(DeterministicFakeEmbedding(size=16), path=tmp_path / "store")
        assert store.get_by_ids(ODD_IDS) == reference.get_by_ids(ODD_IDS)
    gone = [NFD, "doc-7 ", '"doc-7', '"doc-7 "', "nobody"]
    assert store.delete(gone) is True and reference.delete(gone) is None
    assert store.get_by_ids(ODD_IDS) == reference.get_by_ids(ODD_IDS)
    assert [d.id for d in store.get_by_ids(ODD_IDS)] == [i for i in ODD_IDS if i not in gone]
    assert {d.id for d in store.similarity_search("text 2", k=len(ODD_IDS))} == {i for i in ODD_IDS if i not in gone}
    store.close()


def test_a_database_built_by_kvsearch_serves_its_keys_as_ids():
    db = kvsearch.Database(None, encoder=kvsearch.NgramEncoder(dim=64, num_buckets=512))
    db.add([" doc-1", NFD, '"quoted"'], ["one", "two", "three"])  # kvsearch's keys: stripped, NFC
    store = KVSearchVectorStore(database=db)
    assert [d.id for d in store.get_by_ids(["doc-1", " doc-1", NFC, NFD])] == ["doc-1", NFC]
    assert [d.id for d in store.similarity_search("doc-1", k=3)][0] == "doc-1"
    assert {d.id for d in store.similarity_search("Müller", k=3)} == {"doc-1", NFC, "quoted"}
    db.close()


# ---------------------------------------------------------------------- re-adding an id replaces the whole document


def _replacements(store: KVSearchVectorStore | InMemoryVectorStore) -> list[Document]:
    """The same calls on either store: ids re-added with no metadata, other metadata, a Document's default."""
    store.add_documents(
        [Document(page_content="v1", metadata={"a": 1}), Document(page_content="w1", metadata={"b": 2})],
        ids=["x", "y"],
    )
    store.add_texts(["v2"], ids=["x"])  # no metadata: x has none now
    store.add_texts(["w2"], [{"c": 3}], ids=["y"])  # replaced, not merged
    store.add_documents([Document(page_content="z1", metadata={"d": 4})], ids=["z"])
    store.add_documents([Document(page_content="z2")], ids=["z"])  # a Document's default metadata: {}
    store.add_texts(["u1", "u2"], [{"e": 5}, {"f": 6}], ids=["u", "u"])  # the last of repeated ids wins
    return store.get_by_ids(["x", "y", "z", "u"])


@pytest.mark.parametrize("on_disk", [False, True])
def test_re_adding_an_id_replaces_the_whole_document_metadata_included(tmp_path, on_disk):
    store, reference = _stores(tmp_path, on_disk)
    got = _replacements(store)
    assert got == _replacements(reference)
    assert [d.metadata for d in got] == [{}, {"c": 3}, {}, {"f": 6}]
    assert store.similarity_search("v2", k=1) == [Document(id="x", page_content="v2", metadata={})]
    store.close()


# ---------------------------------------------------------------------- maximal marginal relevance


class TableEmbeddings(Embeddings):
    """Each text's embedding (documents and queries alike) read from a table: deterministic and known to the test."""

    def __init__(self, table: dict[str, list[float]]) -> None:
        self.table = table

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [self.table[t] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.table[text]


def reference_mmr(
    query: np.ndarray, keys: np.ndarray, allowed: list[bool], k: int, fetch_k: int, lambda_mult: float
) -> list[int]:
    """Brute-force MMR: the fetch_k allowed keys most cosine-similar to the query, then greedily the one that
    maximises ``lambda * sim(query) - (1 - lambda) * max sim(picked)`` (the most similar first; ties: the nearer)."""
    keys = keys.astype(np.float64) / np.linalg.norm(keys, axis=1, keepdims=True)  # (n, dim)
    query = query.astype(np.float64) / np.linalg.norm(query)  # (dim,)
    sims = keys @ query  # (n,)
    candidates = [int(i) for i in np.argsort(-sims, kind="stable") if allowed[i]][:fetch_k]
    picked = candidates[:1]
    while len(picked) < min(k, len(candidates)):
        rest = [i for i in candidates if i not in picked]
        picked.append(
            max(rest, key=lambda i: lambda_mult * sims[i] - (1 - lambda_mult) * max(keys[i] @ keys[j] for j in picked))
        )
    return picked


@pytest.fixture(scope="module")
def clustered():
    """30 documents in 6 tight clusters (near-duplicates), a group across clusters, and a query near cluster 0."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(6, 8))  # (6, 8)
    keys = np.repeat(centres, 5, axis=0) + 0.15 * rng.normal(size=(30, 8))  # (30, 8)
    query = centres[0] + 0.2 * rng.normal(size=8)  # (8,)
    texts = [f"doc {i}" for i in range(30)]
    table = {t: key.tolist() for t, key in zip(texts, keys, strict=True)} | {"query": query.tolist()}
    store = KVSearchVectorStore.from_texts(texts, TableEmbeddings(table), [{"group": i % 3} for i in range(30)])
    yield store, keys, query
    store.close()


@pytest.mark.parametrize("lambda_mult", [0.0, 0.3, 1.0])
@pytest.mark.parametrize(("k", "fetch_k"), [(1, 5), (4, 12), (7, 50), (10, 4)])
@pytest.mark.parametrize("where", [None, {"group": {"$in": [0, 2]}}])
def test_mmr_matches_a_brute_force_mmr(clustered, lambda_mult, k, fetch_k, where):
    store, keys, query = clustered
    allowed = [where is None or i % 3 in (0, 2) for i in range(30)]
    expected = [f"doc {i}" for i in reference_mmr(query, keys, allowed, k, fetch_k, lambda_mult)]
    options = {"k": k, "fetch_k": fetch_k, "lambda_mult": lambda_mult, "filter": where}
    by_text = store.max_marginal_relevance_search("query", **options)
    assert [d.page_content for d in by_text] == expected
    assert store.max_marginal_relevance_search_by_vector(query.tolist(), **options) == by_text
    assert store.as_retriever(search_type="mmr", search_kwargs=options).invoke("query") == by_text
    assert all(d.metadata["group"] in (0, 2) for d in by_text if where is not None)


def test_mmr_diversifies_where_similarity_does_not(clustered):
    store, _, _ = clustered
    nearest = store.similarity_search("query", k=4)
    diverse = store.max_marginal_relevance_search("query", k=4, fetch_k=30, lambda_mult=0.3)
    assert diverse[0] == nearest[0] and len({int(d.page_content[4:]) // 5 for d in nearest}) == 1  # one cluster
    assert len({int(d.page_content[4:]) // 5 for d in diverse}) == 4  # four clusters


def test_mmr_with_the_database_encoder(tmp_path):
    texts = ["Lipton", "Lipton Z", "Lipton Zachary", "Zachary Lipton", "Li", "Li Mu", "Smola", "Alex Smola", "Hu"]
    store = KVSearchVectorStore(path=tmp_path / "db", encoder=kvsearch.NgramEncoder(dim=64, num_buckets=512))
    store.add_texts(texts, ids=texts)
    encoder = store.database.encoder
    keys, query = encoder.encode(texts).numpy(), encoder.encode(["Liptn Zach"])[0].numpy()  # (9, 64), (64,)
    for k, fetch_k, lambda_mult in [(3, 9, 0.5), (4, 6, 0.2), (9, 9, 0.7), (2, 9, 1.0)]:
        expected = [texts[i] for i in reference_mmr(query, keys, [True] * 9, k, fetch_k, lambda_mult)]
        got = store.max_marginal_relevance_search("Liptn Zach", k=k, fetch_k=fetch_k, lambda_mult=lambda_mult)
        assert [d.id for d in got] == expected
        options = {"k": k, "fetch_k": fetch_k, "lambda_mult": lambda_mult}
        assert store.as_retriever(search_type="mmr", search_kwargs=options).invoke("Liptn Zach") == got
    store.close()


@pytest.mark.parametrize(
    "options",
    [{"k": 0}, {"fetch_k": 0}, {"k": True}, {"lambda_mult": 1.5}, {"lambda_mult": -0.1}, {"score_threshold": 0.5}],
)
def test_mmr_refuses_bad_arguments(clustered, options):
    store, _, query = clustered
    with pytest.raises(kvsearch.InvalidArgumentError, match=next(iter(options))):
        store.max_marginal_relevance_search("query", **options)
    with pytest.raises(kvsearch.InvalidArgumentError, match=next(iter(options))):
        store.max_marginal_relevance_search_by_vector(query.tolist(), **options)


def test_mmr_on_an_empty_store():
    store = KVSearchVectorStore(DeterministicFakeEmbedding(size=8))  # no database until the first add
    assert store.max_marginal_relevance_search("anything") == []
    store = KVSearchVectorStore(encoder=kvsearch.NgramEncoder(dim=64, num_buckets=512))
    assert store.max_marginal_relevance_search("anything", filter={"n": 1}) == []
    store.close()


# ---------------------------------------------------------------------- ids as given, sizes and options refused early


def test_a_given_id_is_kept_and_an_empty_one_refused():
    store, reference = _stores(None, on_disk=False)
    ids = store.add_texts(["zero", "int zero", "numpy zero", "seven", "none"], ids=["0", 0, np.int64(0), 7, None])
    assert ids[:4] == ["0", "0", "0", "7"] and len(ids[4]) == 36  # 0 is the id "0"; None gets a uuid4
    assert [(d.id, d.page_content) for d in store.get_by_ids(["0", 0, "7", ids[4]])] == [
        ("0", "numpy zero"),  # the last of repeated ids wins
        ("7", "seven"),
        (ids[4], "none"),
    ]
    assert store.add_documents([Document(page_content="doc zero")], ids=[0]) == ["0"]
    assert store.add_documents([Document(page_content="eight", id="8"), Document(page_content="new")])[0] == "8"
    assert reference.add_texts(["int zero"], ids=[0])[0] != "0"  # LangChain's own store makes 0 a uuid
    count = len(store.database)
    for bad in ([""], ["a", ""], [True], [np.bool_(False)]):
        with pytest.raises(kvsearch.InvalidArgumentError, match=r"non-empty str .* at position"):
            store.add_texts([f"t{i}" for i in range(len(bad))], ids=bad)
    with pytest.raises(kvsearch.InvalidArgumentError, match="non-empty str"):
        store.add_documents([Document(page_content="x", id="")])
    assert len(store.database) == count and store.get_by_ids(["", "a"]) == [] and store.delete([""]) is True
    assert len(store.database) == count


@pytest.mark.parametrize("on_disk", [False, True])
def test_embeddings_of_another_size_are_refused_as_search_refuses_them(tmp_path, on_disk):
    store = KVSearchVectorStore(DeterministicFakeEmbedding(size=8), path=tmp_path / "s" if on_disk else None)
    store.add_texts(["alpha", "beta"], ids=["a", "b"])
    if on_disk:  # reopened with embeddings of another size
        store.close()
        store = KVSearchVectorStore(DeterministicFakeEmbedding(size=12), path=tmp_path / "s")
    else:  # the same store, its model now of another size
        store.embeddings.size = 12
    for call in (
        lambda: store.add_texts(["gamma"], ids=["c"]),
        lambda: store.add_documents([Document(page_content="gamma")]),
        lambda: store.similarity_search("alpha"),
        lambda: store.similarity_search_with_relevance_scores("alpha"),
        lambda: store.max_marginal_relevance_search("alpha"),
    ):
        with pytest.raises(kvsearch.DimensionMismatchError, match=r"\b8\b.*\b12\b"):
            call()
    assert len(store.database) == 2 and [d.id for d in store.get_by_ids(["a", "b", "c"])] == ["a", "b"]
    store.close()


class _BrokenEmbeddings(Embeddings):
    """Embeddings that give too few rows, or rows of two sizes."""

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.rows

    def embed_query(self, text: str) -> list[float]:
        return self.rows[0]


@pytest.mark.parametrize("rows", [[[1.0, 0.0, 0.0, 0.0]], [[1.0, 0.0], [0.0, 1.0, 0.0]]])
def test_embeddings_of_the_wrong_shape_are_refused(rows):
    store = KVSearchVectorStore(_BrokenEmbeddings(rows))
    with pytest.raises(kvsearch.DimensionMismatchError, match="one embedding per text"):
        store.add_texts(["x", "y"])  # (1, 4) was silently read as (2, 2) before
    assert store.database is None


@pytest.mark.parametrize("score", [lambda q, k: q @ k.T, "additive", "euclid", 3])
def test_a_score_no_database_has_is_refused_at_construction(tmp_path, score):
    with pytest.raises(kvsearch.UnknownOptionError, match=r"'dot', 'scaled_dot', 'cosine', 'gaussian'"):
        KVSearchVectorStore(DeterministicFakeEmbedding(size=8), path=tmp_path / "s", score=score)
    assert not (tmp_path / "s").exists()
