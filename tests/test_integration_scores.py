"""Scores as relevances in [0, 1] (LangChain's relevance, Haystack's ``scale_score``), each against its promise.

The maps of :mod:`kvsearch.integrations.relevance` over generated scores spanning every float (±1e308, the
exponential's overflow at ±709.8 and underflow at ±745, 0, the smallest subnormal, ±inf) for every database score:
defined, finite, in [0, 1], non-decreasing, and equal to their formulas where those are computable. Then end to end
on unnormalised embeddings (norm 40, scores down to -1600): LangChain's ``similarity_search_with_relevance_scores``
and ``similarity_score_threshold`` retriever rank as a brute-force numpy ranking and keep what the threshold says,
and Haystack's ``scale_score`` gives what Haystack's own ``InMemoryDocumentStore`` gives on the same documents.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import kvsearch
from kvsearch.integrations.relevance import RELEVANCES, relevance_fn, scaled_score_fn
from kvsearch.nn.scores import DB_SCORES

EDGES = [1e308, 1e6, 745.2, 745.0, 709.8, 709.0, 37.0, 1.0, 1e-3, 5e-324, 0.0]
SCORES = sorted({s for e in EDGES for s in (e, -e)} | {math.inf, -math.inf})  # every scale, both signs


def generated_scores(seed: int) -> list[float]:
    """The edges, plus 2,000 seeded scores spread over every scale (|s| from 1e-12 to 1e12), sorted."""
    rng = np.random.default_rng(seed)
    spread = rng.choice([-1.0, 1.0], 2000) * 10.0 ** rng.uniform(-12, 12, 2000)
    return sorted(SCORES + spread.tolist())


@pytest.mark.parametrize("score", DB_SCORES)
@pytest.mark.parametrize("kind", ["relevance", "scaled"])
def test_every_score_maps_every_float_into_0_1_monotonically(score, kind):
    fn = relevance_fn(score) if kind == "relevance" else scaled_score_fn(score)
    scores = generated_scores(7)
    got = [fn(s) for s in scores]  # no OverflowError at any scale
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in got)
    assert all(a <= b for a, b in zip(got, got[1:], strict=False)), "not non-decreasing in the score"
    assert got[-1] == 1.0 and fn(math.nan) == 0.0
    if score != "gaussian":  # a similarity of -1e308 is as far as it gets
        assert got[0] == pytest.approx(0.0, abs=1e-300)


def test_every_database_score_has_a_relevance():
    assert set(RELEVANCES) == set(DB_SCORES)
    with pytest.raises(kvsearch.UnknownOptionError, match="'cosine'"):
        relevance_fn("additive")


def test_the_maps_are_their_formulas():
    for s in np.linspace(-30, 30, 121).tolist() + [-700.0, 700.0]:
        logistic = 1.0 / (1.0 + math.exp(-s))
        assert relevance_fn("dot")(s) == relevance_fn("scaled_dot")(s) == pytest.approx(logistic, rel=1e-12)
        assert scaled_score_fn("dot")(s * 100) == pytest.approx(logistic, rel=1e-12)  # Haystack: expit(s / 100)
    for s in np.linspace(-1, 1, 41).tolist():
        assert relevance_fn("cosine")(s) == scaled_score_fn("cosine")(s) == pytest.approx((1 + s) / 2)
    for d in [0.0, 0.1, 1.0, math.sqrt(2), 2.0, 10.0, 50.0, 1e5]:  # a gaussian score is -d^2 / 2
        r = relevance_fn("gaussian")(-(d**2) / 2)
        assert r == scaled_score_fn("gaussian")(-(d**2) / 2) == pytest.approx(1 / (1 + d / math.sqrt(2)))
    assert relevance_fn("gaussian")(-1.0) == 0.5  # orthogonal unit vectors: d = sqrt(2), as the cosine's 0.5
    assert relevance_fn("cosine")(1.0 + 1e-7) == 1.0 and relevance_fn("gaussian")(1e-7) == 1.0  # rounding


# ---------------------------------------------------------------------- LangChain, end to end


def table_embeddings(table: dict[str, list[float]]) -> object:
    """A LangChain ``Embeddings`` that reads each text's embedding from a table (the test skips without LangChain)."""
    embeddings = pytest.importorskip("langchain_core.embeddings")

    class TableEmbeddings(embeddings.Embeddings):
        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return [table[t] for t in texts]

        def embed_query(self, text: str) -> list[float]:
            return table[text]

    return TableEmbeddings()


def brute_force(keys: np.ndarray, query: np.ndarray, score: str) -> np.ndarray:
    """Every key's score for the query, in float64 from the float32 embeddings the database stores."""
    keys, query = keys.astype(np.float32).astype(np.float64), query.astype(np.float32).astype(np.float64)
    if score == "gaussian":
        return -0.5 * ((keys - query) ** 2).sum(1)
    if score == "cosine":
        keys = keys / np.linalg.norm(keys, axis=1, keepdims=True)
        query = query / np.linalg.norm(query)
    dots = keys @ query  # (n,)
    return dots / math.sqrt(keys.shape[1]) if score == "scaled_dot" else dots


@pytest.fixture(scope="module")
def norm_40():
    """24 embeddings of norm 40 (dim 16) and two queries: near the first one, and its opposite (scores to -1600)."""
    rng = np.random.default_rng(11)
    keys = rng.normal(size=(24, 16))
    keys = 40 * keys / np.linalg.norm(keys, axis=1, keepdims=True)  # (24, 16)
    table = {f"doc {i}": key.tolist() for i, key in enumerate(keys)}
    queries = {"near": keys[0] + rng.normal(size=16), "opposite": -keys[0]}
    return keys, table | {name: q.tolist() for name, q in queries.items()}, queries


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "gaussian", "cosine"])
@pytest.mark.parametrize("query", ["near", "opposite"])
def test_langchain_relevance_on_unnormalised_embeddings(norm_40, score, query):
    keys, table, queries = norm_40
    embeddings = table_embeddings(table)
    from kvsearch.integrations.langchain import KVSearchVectorStore

    texts = [f"doc {i}" for i in range(len(keys))]
    store = KVSearchVectorStore.from_texts(texts, embeddings, score=score)
    want = brute_force(keys, queries[query], score)  # (24,)
    order = [texts[i] for i in np.argsort(-want, kind="stable")]
    relevance = relevance_fn(score)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Relevance scores must be")  # LangChain's: outside [0, 1]
        got = store.similarity_search_with_relevance_scores(query, k=len(texts))
    assert [d.page_content for d, _ in got] == order
    np.testing.assert_allclose([r for _, r in got], [relevance(s) for s in sorted(want, reverse=True)], atol=1e-6)
    assert all(0.0 <= r <= 1.0 for _, r in got) and all(a[1] >= b[1] for a, b in zip(got, got[1:], strict=False))
    if score == "gaussian":  # far points stay apart instead of all scoring 0.0
        assert min(r for _, r in got) > 0.01 and len({r for _, r in got}) == len(texts)
    threshold = float(np.median([r for _, r in got]))
    retriever = store.as_retriever(
        search_type="similarity_score_threshold", search_kwargs={"k": len(texts), "score_threshold": threshold}
    )
    kept = [d.page_content for d in retriever.invoke(query)]
    assert kept == [t for t, s in zip(order, sorted(want, reverse=True), strict=True) if relevance(s) >= threshold]
    assert kept == [d.page_content for d, r in got if r >= threshold] and kept
    store.close()


# ---------------------------------------------------------------------- Haystack's scale_score


def _documents(norm: float | None, seed: int) -> list:
    """30 Haystack documents (every seventh without an embedding) with float32-exact embeddings, optionally of one
    norm (the test skips without Haystack)."""
    Document = pytest.importorskip("haystack").Document  # noqa: N806
    rng = np.random.default_rng(seed)
    embs = rng.normal(size=(30, 8)).astype(np.float32)
    if norm is not None:
        embs = (norm * embs / np.linalg.norm(embs, axis=1, keepdims=True)).astype(np.float32)
    return [
        Document(id=f"d{i}", content=f"c{i}", meta={"g": i % 3}, embedding=None if i % 7 == 0 else embs[i].tolist())
        for i in range(30)
    ]


@pytest.mark.parametrize(("score", "similarity"), [("cosine", "cosine"), ("dot", "dot_product")])
@pytest.mark.parametrize("norm", [None, 40.0])
@pytest.mark.parametrize("scale_score", [True, False])
@pytest.mark.parametrize("filters", [None, {"field": "meta.g", "operator": "!=", "value": 1}])
def test_haystack_scale_score_as_the_in_memory_store(score, similarity, norm, scale_score, filters):
    docs = _documents(norm, 5)
    from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever
    from haystack.document_stores.in_memory import InMemoryDocumentStore

    from kvsearch.integrations.haystack import KVSearchDocumentStore, KVSearchEmbeddingRetriever

    reference = InMemoryDocumentStore(embedding_similarity_function=similarity)
    reference.write_documents(docs)
    store = KVSearchDocumentStore(score=score)
    store.write_documents(docs)
    rng = np.random.default_rng(6)
    for query in [rng.normal(size=8) * (1 if norm is None else 40) for _ in range(3)]:
        query = query.astype(np.float32).tolist()
        options = {"filters": filters, "top_k": 12, "scale_score": scale_score}
        want = reference.embedding_retrieval(query, **options)
        got = store.embedding_retrieval(query, **options)
        assert [d.id for d in got] == [d.id for d in want]
        np.testing.assert_allclose([d.score for d in got], [d.score for d in want], rtol=1e-5, atol=1e-5)
        assert not scale_score or all(0.0 <= d.score <= 1.0 for d in got)
        component = KVSearchEmbeddingRetriever(store, top_k=12, filters=filters, scale_score=scale_score)
        ref_component = InMemoryEmbeddingRetriever(reference, top_k=12, filters=filters, scale_score=scale_score)
        assert component.run(query)["documents"] == got
        assert [d.id for d in ref_component.run(query)["documents"]] == [d.id for d in got]
        flipped = component.run(query, scale_score=not scale_score)["documents"]
        assert [d.id for d in flipped] == [d.id for d in got]  # the run's own choice; the order never changes


@pytest.mark.parametrize("score", ["scaled_dot", "gaussian"])
def test_haystack_scale_score_of_the_other_scores(score):
    docs = _documents(40.0, 8)
    from kvsearch.integrations.haystack import KVSearchDocumentStore

    store = KVSearchDocumentStore(score=score)
    store.write_documents(docs)
    query = (40 * np.random.default_rng(9).normal(size=8)).tolist()
    raw = store.embedding_retrieval(query, top_k=30)
    scaled = store.embedding_retrieval(query, top_k=30, scale_score=True)
    assert [d.id for d in scaled] == [d.id for d in raw]
    assert [d.score for d in scaled] == [scaled_score_fn(score)(d.score) for d in raw]
    assert all(0.0 < d.score <= 1.0 for d in scaled) and len({d.score for d in scaled}) == len(scaled)
    with pytest.raises(kvsearch.InvalidArgumentError, match="scale_score"):
        store.embedding_retrieval(query, scale_score="yes")


def test_haystack_retriever_serialises_scale_score():
    pytest.importorskip("haystack")
    from kvsearch.integrations.haystack import KVSearchDocumentStore, KVSearchEmbeddingRetriever

    retriever = KVSearchEmbeddingRetriever(KVSearchDocumentStore(dim=4, score="dot"), scale_score=True)
    assert retriever.to_dict()["init_parameters"]["scale_score"] is True
    assert KVSearchEmbeddingRetriever.from_dict(retriever.to_dict()).scale_score is True
    old = retriever.to_dict()
    del old["init_parameters"]["scale_score"]  # a pipeline saved before scale_score existed
    assert KVSearchEmbeddingRetriever.from_dict(old).scale_score is False
    with pytest.raises(kvsearch.InvalidArgumentError, match="scale_score"):
        KVSearchEmbeddingRetriever(retriever.document_store, scale_score=1)
