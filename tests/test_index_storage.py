"""An HNSW graph over the store's own keys: one copy in memory, the graph only on disk, the same results.

``Index.shares_storage`` says when the graph's FAISS storage is a view over its source's key tensor; these tests
check that it is one where it can be (and that its memory is the source's), that results equal a graph with its
own copy and a brute-force reference over the live ids through adds (a delta, then folded in), removals
(tombstones), saves and reloads, and that a saved graph is a fraction of the vectors it indexes.
"""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _key_table import KeyTable

import kvsearch
from kvsearch.errors import CorruptDatabaseError
from kvsearch.index.factory import load_index
from kvsearch.index.faiss_index import Index
from kvsearch.index.graph_storage import DELTA_MIN, UNIT_TOLERANCE
from kvsearch.storage.folder import INDEX_FILE


def random_keys(rng, n, dim, unit=False):
    keys = torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32))  # (n, dim)
    return F.normalize(keys, dim=-1) if unit else keys


def address_of(graph: faiss.Index) -> int:
    """Where the graph's flat storage keeps its vectors (their first byte)."""
    codes = faiss.downcast_index(graph.storage).codes
    return faiss.rev_swig_ptr(codes.data(), 1).__array_interface__["data"][0]


def brute(source: KeyTable, queries: torch.Tensor, k: int, metric: str, allowed=None):
    """Reference (ids, scores) over the source's keys (only ``allowed`` ids if given), in float64."""
    ids, keys = source.ids, source.keys
    if allowed is not None:
        keep = torch.isin(ids, allowed)
        ids, keys = ids[keep], keys[keep]
    q, v = queries.double(), keys.double()
    scores = q @ v.T if metric == "ip" else torch.cdist(q, v).square()  # (b, n)
    top = scores.topk(min(k, len(ids)), dim=1, largest=metric == "ip")
    return ids[top.indices], top.values.float()


@pytest.mark.parametrize(("metric", "normalize"), [("ip", False), ("l2", False), ("ip", True)])
def test_a_graph_over_the_sources_keys_equals_one_with_its_own_copy(rng, one_thread, metric, normalize):
    ids, keys = torch.arange(0, 3000, 3), random_keys(rng, 1000, 24, unit=normalize)
    source = KeyTable(ids, keys)
    shared = Index(24, "HNSW16", metric, normalize=normalize, source=source)
    shared.rebuild()
    own = Index(24, "HNSW16", metric, normalize=normalize)
    own.build(ids, keys)
    assert shared.shares_storage and not own.shares_storage
    start, size = source.keys.data_ptr(), source.keys.numel() * 4
    assert start <= address_of(shared.faiss_index) < start + size  # FAISS reads the source's memory
    queries = random_keys(rng, 30, 24)
    a, b = shared.search(queries, 10), own.search(queries, 10)
    assert torch.equal(a.ids, b.ids) and torch.allclose(a.scores, b.scores, atol=2 * UNIT_TOLERANCE, rtol=0)
    if not normalize:
        assert torch.equal(a.scores, b.scores)  # the very vectors: bit for bit


def test_a_copy_where_the_sources_keys_are_not_the_graphs_vectors(rng):
    ids, keys = torch.arange(200), random_keys(rng, 200, 8)
    cosine = Index(8, "HNSW16", "ip", normalize=True, source=KeyTable(ids, keys))
    cosine.rebuild()  # raw keys are not unit: the graph holds normalised copies
    other = Index(8, "HNSW16", "ip", source=KeyTable(ids, keys))
    other.build(ids, keys + 1)  # not the source's keys
    flat = Index(8, "IVF4,Flat", "ip", source=KeyTable(ids, keys))
    flat.rebuild()
    assert not cosine.shares_storage and not other.shares_storage and not flat.shares_storage
    queries = random_keys(rng, 5, 8)
    ref_ids, ref_scores = brute(KeyTable(ids, F.normalize(keys, dim=-1)), F.normalize(queries, dim=-1), 5, "ip")
    cosine.set_params(efSearch=256)
    found = cosine.search(queries, 5)
    assert torch.equal(found.ids, ref_ids) and torch.allclose(found.scores, ref_scores, atol=1e-5)


def test_a_saved_graph_is_a_fraction_of_its_vectors(tmp_path, rng):
    n, dim = 2000, 384
    ids, keys = torch.arange(n), random_keys(rng, n, dim, unit=True)
    index = Index(dim, "HNSW32", "ip", source=KeyTable(ids, keys))
    index.rebuild()
    index.save(tmp_path / "graph.npz")
    standalone = Index(dim, "HNSW32", "ip")
    standalone.build(ids, keys)
    standalone.save(tmp_path / "whole.npz")  # no source to read them back from: it keeps its vectors
    raw = n * dim * 4
    assert (tmp_path / "graph.npz").stat().st_size <= 0.3 * raw < raw < (tmp_path / "whole.npz").stat().st_size


def test_a_reloaded_graph_shares_the_sources_keys_and_searches_as_before(tmp_path, rng):
    ids, keys = torch.arange(5, 805), random_keys(rng, 800, 16)
    source = KeyTable(ids, keys)
    index = Index(16, "HNSW16", "l2", source=source)
    index.rebuild()
    queries = random_keys(rng, 20, 16)
    before = index.search(queries, 8)
    index.save(tmp_path / "index.npz")
    loaded = load_index(tmp_path / "index.npz", "HNSW16", 16, metric="l2", source=source)
    assert loaded.shares_storage and torch.equal(loaded.ids(), ids)
    after = loaded.search(queries, 8)
    assert torch.equal(before.ids, after.ids) and torch.equal(before.scores, after.scores)
    with pytest.raises(CorruptDatabaseError, match="without vectors"):
        load_index(tmp_path / "index.npz", "HNSW16", 16, metric="l2")  # no source: nothing to attach
    with pytest.raises(CorruptDatabaseError, match="does not"):
        load_index(tmp_path / "index.npz", "HNSW16", 16, metric="l2", source=KeyTable(ids[1:], keys[1:]))


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_adds_and_removes_match_brute_force_over_live_ids(tmp_path, rng, metric):
    dim = 12
    source = KeyTable(torch.arange(300), random_keys(rng, 300, dim))
    index = Index(dim, "HNSW16", metric, source=source, params={"efSearch": 2048})
    index.rebuild()
    queries = random_keys(rng, 16, dim)
    next_id = 300

    def check(allowed=None):
        want_ids, want_scores = brute(source, queries, 10, metric, allowed)
        got = index.search(queries, 10, allowed=allowed)
        assert torch.equal(got.ids[:, : want_ids.shape[1]], want_ids)
        assert torch.allclose(got.scores[:, : want_ids.shape[1]], want_scores, atol=1e-4, rtol=1e-5)

    for _ in range(8):  # adds: a delta beside the shared graph, folded in past DELTA_MIN, shared again
        new_ids, new_keys = torch.arange(next_id, next_id + 50), random_keys(rng, 50, dim)
        next_id += 50
        source.append(new_ids, new_keys)
        index.add(new_ids, new_keys)
        assert index.shares_storage
        check()
        check(allowed=torch.arange(0, next_id, 7))
    assert 8 * 50 > DELTA_MIN  # at least one fold happened above
    for _ in range(4):  # removals and replacements: tombstones, in the graph and in the delta
        gone = torch.from_numpy(rng.choice(source.ids.numpy(), 30, replace=False))
        source.drop(gone)
        index.remove(gone)
        again = gone[:10]  # upserts: the same ids with new keys
        again_keys = random_keys(rng, 10, dim)
        source.drop(again)
        source.append(again, again_keys)
        order = torch.argsort(source.ids)
        source.ids, source.keys = source.ids[order], source.keys[order].contiguous()
        index.add(again, again_keys)
        fresh = torch.arange(next_id, next_id + 20)
        next_id += 20
        fresh_keys = random_keys(rng, 20, dim)
        source.append(fresh, fresh_keys)
        index.add(fresh, fresh_keys)
        check()
        check(allowed=torch.arange(0, next_id, 5))
    assert torch.equal(index.ids(), source.ids)
    before = index.search(queries, 10)
    index.save(tmp_path / "index.npz")
    loaded = load_index(tmp_path / "index.npz", "HNSW16", dim, metric=metric, source=source, params=index.params)
    after = loaded.search(queries, 10)
    assert torch.equal(before.ids, after.ids) and torch.allclose(before.scores, after.scores)
    assert not loaded.shares_storage  # tombstones in the graph: a copy gathered by id (their vectors from the file)


def test_a_delta_saved_beside_a_shared_graph_comes_back(tmp_path, rng):
    source = KeyTable(torch.arange(400), random_keys(rng, 400, 8))
    index = Index(8, "HNSW16", "ip", source=source, params={"efSearch": 1024})
    index.rebuild()
    new_ids, new_keys = torch.arange(400, 420), random_keys(rng, 20, 8)
    source.append(new_ids, new_keys)
    index.add(new_ids, new_keys)  # fewer than DELTA_MIN: beside the graph, not in it
    index.remove(torch.tensor([401]))  # a tombstone in the delta
    source.drop(torch.tensor([401]))
    index.save(tmp_path / "index.npz")
    loaded = load_index(tmp_path / "index.npz", "HNSW16", 8, metric="ip", source=source, params=index.params)
    assert loaded.shares_storage and torch.equal(loaded.ids(), source.ids)
    queries = torch.cat([new_keys, random_keys(rng, 5, 8)])  # (25, 8)
    want_ids, _ = brute(source, queries, 5, "ip")
    assert torch.equal(loaded.search(queries, 5).ids, want_ids)


def test_a_reopened_hnsw_database_is_small_on_disk_and_searches_as_before(tmp_path, rng):
    n, dim = 1500, 256
    keys = F.normalize(torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32)), dim=-1)
    db = kvsearch.Database(tmp_path / "db", dim=dim, value_dim=2, index="HNSW32", score="dot")
    db.add(keys=keys, values=torch.zeros(n, 2))
    queries = random_keys(rng, 10, dim)
    before = [[h.id for h in db.search(q, k=5)] for q in queries]
    db.save()
    assert db.index.shares_storage  # saved: the writer's graph reads the store's keys from now on
    db.close()
    assert (tmp_path / "db" / INDEX_FILE).stat().st_size <= 0.3 * n * dim * 4
    db = kvsearch.Database(tmp_path / "db")
    assert db.index.shares_storage
    assert [[h.id for h in db.search(q, k=5)] for q in queries] == before
    db.close()
