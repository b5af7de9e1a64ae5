"""Query-time re-ranking of search hits by an edit similarity (``search(..., rerank=...)``, issue 22).

The reference: the database's own top ``max(k, RERANK_DEPTH)`` (a plain search), sorted by rapidfuzz's similarity
of the case-folded texts (Python's sort is stable: ties keep the database's order), hits without key text last.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable

import pytest
import torch
from rapidfuzz.distance import OSA, Indel, JaroWinkler, Levenshtein

import kvsearch
from kvsearch import Database, NgramEncoder
from kvsearch.distributed import ShardedDatabase
from kvsearch.text.rerank import RERANK_DEPTH, RERANKERS, check_rerank

SYLLABLES = ["li", "pa", "ton", "mo", "ra", "ski", "ber", "ne", "zha", "ng", "wer", "ss", "ko", "vi", "ch", "an"]
FUNCTIONS = {
    "osa": OSA.normalized_similarity,
    "levenshtein": Levenshtein.normalized_similarity,
    "jaro_winkler": JaroWinkler.normalized_similarity,
    "indel": Indel.normalized_similarity,
}


def make_names(n: int, seed: int) -> list[str]:
    """n distinct made-up names, the same for a seed."""
    rng = random.Random(seed)
    names: dict[str, None] = {}
    while len(names) < n:
        names["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()] = None
    return list(names)


def misspell(name: str, rng: random.Random) -> str:
    """One edit: two neighbours swapped, a letter dropped or a letter replaced."""
    i = rng.randrange(len(name) - 1)
    edit = rng.randrange(3)
    if edit == 0:
        return name[:i] + name[i + 1] + name[i] + name[i + 2 :]
    if edit == 1:
        return name[:i] + name[i + 1 :]
    return name[:i] + rng.choice("aeiouxyz") + name[i + 1 :]


NAMES = make_names(150, seed=3)
QUERIES = [misspell(name, random.Random(i)) for i, name in enumerate(NAMES[:12])]


def encoder() -> NgramEncoder:
    return NgramEncoder(dim=64, num_buckets=4096)


def fill(db: Database | ShardedDatabase) -> None:
    db.add(NAMES, [n.upper() for n in NAMES], [{"group": i % 2} for i in range(len(NAMES))])


@pytest.fixture(scope="module")
def db() -> Database:
    out = Database(None, encoder=encoder(), device="cpu")
    fill(out)
    return out


def reference(db, query: str, k: int, similarity: Callable[[str, str], float], where=None) -> list[int]:
    """The ids a re-ranked search should return: the plain top max(k, depth), sorted by similarity, the first k."""
    candidates = db.search(query, k=max(k, RERANK_DEPTH), where=where)
    ranked = sorted((h for h in candidates if h.key is not None), key=lambda h: -similarity(query, h.key))
    ranked += [h for h in candidates if h.key is None]
    return [h.id for h in ranked[:k]]


def folded(name: str) -> Callable[[str, str], float]:
    return lambda query, key: FUNCTIONS[name](query.casefold(), key.casefold())


@pytest.mark.parametrize("name", RERANKERS)
@pytest.mark.parametrize("k", [1, 5, 40])  # 40: more than the depth, so k candidates are fetched
def test_named_rerankers_match_the_brute_force_reference(db, name, k):
    reordered = 0
    for query in QUERIES:
        hits = db.search(query, k=k, rerank=name)
        assert [h.id for h in hits] == reference(db, query, k, folded(name))
        plain = {h.id: h.score for h in db.search(query, k=max(k, RERANK_DEPTH))}
        assert all(h.score == plain[h.id] for h in hits)  # the database's score, the re-ranker's order
        reordered += [h.id for h in hits] != [h.id for h in db.search(query, k=k)]
    assert reordered > 0  # the queries are such that re-ranking changes something


def test_a_misspelt_name_second_by_the_index_comes_first_with_osa():
    db = Database(None, encoder=encoder(), device="cpu")
    db.add(["Lipton", "Lipotnik", "Lipsky", "Lupton", "Smola", "Zhang"], ["a", "b", "c", "d", "e", "f"])
    plain = [h.key for h in db.search("Lipotn", k=3)]
    assert plain[:2] == ["Lipotnik", "Lipton"]  # the n-gram index shares more with the longer name
    assert OSA.normalized_similarity("lipotn", "lipton") > OSA.normalized_similarity("lipotn", "lipotnik")
    reranked = db.search("Lipotn", k=3, rerank="osa")
    assert [h.key for h in reranked][:2] == ["Lipton", "Lipotnik"]
    assert db.search("LIPOTN", k=1, rerank="osa")[0].key == "Lipton"  # compared case-insensitively


def test_the_reranker_sees_the_top_depth_candidates_and_a_callable_orders_them(db):
    seen: list[str] = []

    def by_length(query: str, key: str) -> float:
        seen.append(key)
        return -abs(len(key) - len(query))  # an int is a real number too

    query = QUERIES[0]
    hits = db.search(query, k=3, rerank=by_length)
    assert sorted(seen) == sorted(h.key for h in db.search(query, k=RERANK_DEPTH))
    assert [h.id for h in hits] == reference(db, query, 3, by_length)


def test_a_batch_is_reranked_query_by_query(db):
    batch = db.search(QUERIES[:4], k=5, rerank="jaro_winkler")
    assert [[h.id for h in row] for row in batch] == [reference(db, q, 5, folded("jaro_winkler")) for q in QUERIES[:4]]
    assert batch[1] == db.search(QUERIES[1], k=5, rerank="jaro_winkler")


def test_rerank_with_a_metadata_filter(db):
    where = {"group": 1}
    for query in QUERIES[:6]:
        hits = db.search(query, k=4, where=where, rerank="levenshtein")
        assert all(h.metadata == {"group": 1} for h in hits) and len(hits) == 4
        assert [h.id for h in hits] == reference(db, query, 4, folded("levenshtein"), where=where)


def test_hits_without_key_text_go_last():
    db = Database(None, encoder=encoder(), device="cpu")
    db.add(["Lipten", "Smola", "Zhang"], ["a", "b", "c"])
    [given] = db.add(db.encoder.encode(["Lipton"]), ["by embedding"])  # the query's very embedding, no key text
    plain = db.search("Lipton", k=4)
    assert plain[0].id == given and plain[0].key is None
    reranked = db.search("Lipton", k=4, rerank="indel")
    assert [h.id for h in reranked] == reference(db, "Lipton", 4, folded("indel"))
    assert reranked[0].key == "Lipten" and reranked[-1].id == given


def test_rerank_needs_text_queries(db):
    q = db.encoder.encode(["Lipton"])  # (1, dim)
    with pytest.raises(kvsearch.InvalidArgumentError, match="rerank needs text queries"):
        db.search(q, k=3, rerank="osa")
    with pytest.raises(kvsearch.InvalidArgumentError, match="rerank needs text queries"):
        db.search(q[0], k=3, rerank=lambda a, b: 1.0)


@pytest.mark.parametrize(
    "rerank, error",
    [
        ("soundex", kvsearch.UnknownOptionError),
        ("OSA", kvsearch.UnknownOptionError),
        (3, kvsearch.InvalidArgumentError),
        (True, kvsearch.InvalidArgumentError),
    ],
)
def test_a_bad_rerank_is_refused_before_anything_else(db, rerank, error):
    with pytest.raises(error, match="rerank"):
        db.search(torch.zeros(7), k=0, rerank=rerank)  # a bad query and a bad k too: the rerank is checked first
    with pytest.raises(error):
        check_rerank(rerank)


@pytest.mark.parametrize("value", [float("nan"), math.inf, "0.5", None, torch.tensor(0.5)])
def test_a_callable_that_returns_no_finite_real_number_is_refused(db, value):
    with pytest.raises(kvsearch.InvalidArgumentError, match=r"finite real number.*'Lipton'"):
        db.search("Lipton", k=3, rerank=lambda query, key: value)


def test_named_rerankers_need_rapidfuzz_callables_do_not(db, monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidfuzz", None)  # as if it were not installed
    with pytest.raises(kvsearch.MissingDependencyError, match=r"kvsearch\[fuzzy\]"):
        db.search("Lipton", k=3, rerank="osa")
    assert len(db.search("Lipton", k=3, rerank=lambda q, key: 0.0)) == 3


def test_an_empty_database_gives_empty_lists():
    db = Database(None, encoder=encoder(), device="cpu")
    assert db.search("Li", k=3, rerank="osa") == [] and db.search(["Li", "Mu"], rerank="osa") == [[], []]


def test_a_sharded_database_reranks_as_one_database(db, tmp_path):
    with ShardedDatabase(tmp_path / "s", num_shards=2, encoder=encoder(), device="cpu") as sdb:
        fill(sdb)
        for k in (3, 40):
            sharded = sdb.search(QUERIES[:5], k=k, rerank="osa")
            single = db.search(QUERIES[:5], k=k, rerank="osa")
            assert [[h.key for h in row] for row in sharded] == [[h.key for h in row] for row in single]
        assert [h.key for h in sdb.search(QUERIES[0], k=3, where={"group": 0}, rerank="osa")] == [
            h.key for h in db.search(QUERIES[0], k=3, where={"group": 0}, rerank="osa")
        ]
        with pytest.raises(kvsearch.InvalidArgumentError, match="rerank needs text queries"):
            sdb.search(sdb.encoder.encode(["Li"]), k=3, rerank="osa")
        with pytest.raises(kvsearch.UnknownOptionError):
            sdb.search("Li", k=3, rerank="soundex")
        with pytest.raises(kvsearch.InvalidArgumentError, match="finite real number"):
            sdb.search("Li", k=3, rerank=lambda q, key: math.nan)
        pairs = list(zip(QUERIES, NAMES[:12]))
        assert kvsearch.evaluate(sdb, pairs, k=3, rerank="osa") == kvsearch.evaluate(db, pairs, k=3, rerank="osa")


def metrics_from_search(db, pairs, k, rerank=None) -> dict[str, float]:
    """recall@1, recall@k and MRR recomputed from the hits of search."""
    ranks = []
    for query, target in pairs:
        keys = [h.key for h in db.search(query, k=k, rerank=rerank)]
        ranks.append(keys.index(target) if target in keys else None)
    return {
        "recall@1": sum(r == 0 for r in ranks) / len(ranks),
        "recall@k": sum(r is not None for r in ranks) / len(ranks),
        "mrr": sum(1 / (r + 1) for r in ranks if r is not None) / len(ranks),
    }


@pytest.mark.parametrize("rerank", [None, "osa", "jaro_winkler"])
@pytest.mark.parametrize("k", [1, 3])
def test_evaluate_measures_the_reranked_order(db, rerank, k):
    pairs = list(zip(QUERIES, NAMES[:12]))
    got = kvsearch.evaluate(db, pairs, k=k, rerank=rerank, batch_size=5)
    assert got == pytest.approx(metrics_from_search(db, pairs, k, rerank), abs=1e-12)
    if rerank is not None:  # the misspellings are such that the re-ranked order scores differently
        assert got != kvsearch.evaluate(db, pairs, k=k, batch_size=5)


def test_evaluate_with_value_targets_and_a_bad_rerank(db):
    pairs = [(q, n.upper()) for q, n in zip(QUERIES, NAMES[:12])]
    got = kvsearch.evaluate(db, pairs, k=2, targets="value", rerank="osa")
    assert got == pytest.approx(metrics_from_search(db, list(zip(QUERIES, NAMES[:12])), 2, "osa"), abs=1e-12)
    with pytest.raises(kvsearch.UnknownOptionError):
        kvsearch.evaluate(db, pairs, k=2, rerank="soundex")
    with pytest.raises(kvsearch.InvalidArgumentError, match="finite real number"):
        kvsearch.evaluate(db, pairs, k=2, targets="value", rerank=lambda q, key: math.inf)
