"""The LangChain vector store: LangChain's whole standard suite in four configurations, and kvsearch's own paths.

``VectorStoreIntegrationTests`` (from langchain-tests) adds, searches, replaces, deletes and gets documents by id,
sync and async, with its own deterministic fake embeddings; it runs here over a database in memory and on disk,
with a Flat (exact) and an HNSW index. Then: the database's own encoder instead of LangChain embeddings, the
message when the extra is missing, metadata filters, and a fine-tuned database serving as a retriever.
"""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("langchain_tests")

from conftest import AUTHORS  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402
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
