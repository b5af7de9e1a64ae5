"""index.py against a brute-force numpy search."""

from __future__ import annotations

import numpy as np
import pytest

from kvsearch.errors import (
    CorruptDatabaseError,
    DimensionMismatchError,
    InvalidArgumentError,
    UnknownOptionError,
)
from kvsearch.index import MAX_K, Index


def brute(vectors, ids, queries, k, metric):
    if metric == "ip":
        scores = queries @ vectors.T
    else:
        scores = -((queries[:, None, :] - vectors[None]) ** 2).sum(-1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[order]


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("k", [1, 10, 101])
def test_flat_matches_brute_force(rng, metric, k):
    vectors = rng.standard_normal((60, 8)).astype(np.float32)
    ids = np.arange(1000, 1060)
    queries = rng.standard_normal((5, 8)).astype(np.float32)
    index = Index(8, "Flat", metric)
    index.add(ids, vectors)
    scores, found = index.search(queries, k)
    assert found.shape == (5, k) and scores.shape == (5, k)
    expect = brute(vectors, ids, queries, k, metric)
    kk = min(k, 60)
    np.testing.assert_array_equal(found[:, :kk], expect[:, :kk])
    assert (found[:, kk:] == -1).all()  # fewer than k exist: -1 padded


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "IVF4,Flat", "PQ4", "IVF4,PQ4", "OPQ4,IVF4,PQ4"])
def test_remove_for_every_type(rng, spec):
    """Deleted ids never come back, whatever the index type (HNSW keeps tombstones)."""
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    ids = np.arange(400) * 3 + 7
    index = Index(16, spec, "l2")
    index.build(ids, vectors)
    gone = ids[::2]
    index.remove(gone)
    assert index.ntotal == 200
    np.testing.assert_array_equal(index.ids(), np.sort(ids[1::2]))
    _, found = index.search(vectors[:50], 20)
    assert not np.isin(found, gone).any()
    # re-adding an id that was removed (an upsert) makes it searchable again
    index.add(gone[:1], vectors[:1])
    _, found = index.search(vectors[:1], 1)
    assert found[0, 0] == gone[0]


def test_hnsw_recall_against_brute_force(rng):
    vectors = rng.standard_normal((2000, 16)).astype(np.float32)
    ids = np.arange(2000)
    queries = vectors[:100] + 0.01 * rng.standard_normal((100, 16)).astype(np.float32)
    index = Index(16, "HNSW32", "l2", params={"efSearch": 128})
    index.build(ids, vectors)
    _, found = index.search(queries, 10)
    expect = brute(vectors, ids, queries, 10, "l2")
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, expect)])
    assert recall >= 0.95


def test_untrained_type_serves_flat_until_trainable(rng):
    index = Index(8, "IVF4,Flat", "l2")
    assert index.min_train == 39 * 4
    small = rng.standard_normal((10, 8)).astype(np.float32)
    index.add(np.arange(10), small)
    assert index.is_fallback and not index.needs_rebuild
    _, found = index.search(small, 1)
    np.testing.assert_array_equal(found[:, 0], np.arange(10))  # exact while it is a flat fallback
    big = rng.standard_normal((200, 8)).astype(np.float32)
    index.add(np.arange(10, 210), big)
    assert index.needs_rebuild
    index.build(np.arange(210), np.concatenate([small, big]))
    assert not index.is_fallback and index.ntotal == 210


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "IVF4,Flat"])
def test_save_load_round_trip(tmp_path, rng, spec):
    vectors = rng.standard_normal((300, 8)).astype(np.float32)
    index = Index(8, spec, "ip", params={"nprobe": 4} if spec.startswith("IVF") else None)
    index.build(np.arange(300), vectors)
    index.remove(np.array([0, 1, 2]))
    index.save(tmp_path / "index.npz")
    loaded = Index.load(tmp_path / "index.npz", 8, spec, "ip", index.params)
    a, b = index.search(vectors[:20], 7), loaded.search(vectors[:20], 7)
    np.testing.assert_array_equal(a[1], b[1])
    assert loaded.ntotal == 297


@pytest.mark.parametrize("content", [b"", b"\x00" * 100, b"garbage" * 50])
def test_load_damaged_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "index.npz"
    path.write_bytes(content)
    with pytest.raises(CorruptDatabaseError, match="cannot be read"):
        Index.load(path, 8, "Flat", "ip")


def test_load_truncated_file(tmp_path, rng):
    index = Index(8, "HNSW16", "ip")
    index.build(np.arange(100), rng.standard_normal((100, 8)).astype(np.float32))
    index.save(tmp_path / "index.npz")
    data = (tmp_path / "index.npz").read_bytes()
    (tmp_path / "index.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDatabaseError):
        Index.load(tmp_path / "index.npz", 8, "HNSW16", "ip")


def test_errors():
    with pytest.raises(UnknownOptionError, match="Bogus"):
        Index(8, "Bogus")
    with pytest.raises(UnknownOptionError, match="IDMap"):
        Index(8, "IDMap,Flat")
    with pytest.raises(UnknownOptionError, match="metric"):
        Index(8, "Flat", "cosine")
    with pytest.raises(InvalidArgumentError, match="dim"):
        Index(0)
    index = Index(8)
    with pytest.raises(InvalidArgumentError, match="k"):
        index.search(np.zeros((1, 8), np.float32), 0)
    with pytest.raises(InvalidArgumentError, match="k"):
        index.search(np.zeros((1, 8), np.float32), MAX_K + 1)
    with pytest.raises(DimensionMismatchError, match=r"\(batch, 8\)"):
        index.search(np.zeros((1, 9), np.float32), 1)
    with pytest.raises(DimensionMismatchError, match=r"\(n, 8\)"):
        index.add(np.arange(2), np.zeros((2, 7), np.float32))
    with pytest.raises(UnknownOptionError, match="search parameters"):
        index.set_params(bogus=1)


def test_empty_index_search_is_all_missing():
    scores, ids = Index(4).search(np.zeros((2, 4), np.float32), 3)
    assert (ids == -1).all()


# ------------------------------------------------------------------ index families and search parameters

SUPPORTED = ["Flat", "HNSW16", "IVF4,Flat", "PCA8,Flat", "PQ4", "SQ8", "PCA8,IVF4,Flat", "IVF4,SQ8", "HNSW16,SQ8"]


@pytest.mark.parametrize("spec", SUPPORTED)
def test_every_supported_family_adds_deletes_and_never_returns_deleted(tmp_path, rng, spec):
    """Add in batches, delete, reopen: the index holds exactly the store's ids; deleted ids never come back."""
    from kvsearch import Database

    db = Database(tmp_path / "db", dim=16, value_dim=2, index=spec, score="dot")
    keys = rng.standard_normal((400, 16)).astype(np.float32)
    ids = db.add(keys[:150], np.zeros((150, 2), np.float32)) + db.add(keys[150:], np.zeros((250, 2), np.float32))
    gone = ids[::3]
    db.delete(gone)
    db.close()
    db = Database(tmp_path / "db")
    np.testing.assert_array_equal(db.index.ids(), db.store.ids.numpy())
    found = db.query(keys[:40], k=10).ids.numpy()
    assert not np.isin(found, gone).any()
    assert ((found >= 0).sum(1) == 10).all()
    db.close()


@pytest.mark.parametrize("spec", ["NSG16,Flat", "IVF4,Flat,RFlat", "Flat,RFlat", "PQ4x4fs"])
def test_families_that_cannot_grow_by_id_are_refused_up_front(spec):
    with pytest.raises(UnknownOptionError, match="cannot add and delete"):
        Index(16, spec)


def test_search_params_set_during_the_fallback_apply_once_trained(rng):
    """nprobe given while an untrained IVF serves exact results is checked then, and applied after training."""
    index = Index(16, "IVF4,Flat")
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    index.add(np.arange(10), vectors[:10])
    assert index.is_fallback
    with pytest.raises(UnknownOptionError, match="efSearch"):
        index.set_params(efSearch=64)  # HNSW's parameter: refused although nothing is applied yet
    index.set_params(nprobe=3)
    index.build(np.arange(400), vectors)
    assert not index.is_fallback and index.params == {"nprobe": 3}
    import faiss

    assert faiss.extract_index_ivf(index._faiss).nprobe == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, float("nan"), "4", True, 2**40])
def test_a_rejected_search_param_changes_nothing(rng, bad):
    index = Index(16, "HNSW8", "l2")  # under l2 each vector's nearest is itself
    vectors = rng.standard_normal((300, 16)).astype(np.float32)
    index.add(np.arange(300), vectors)
    index.set_params(efSearch=40)
    before = index.search(vectors[:5], 5)
    with pytest.raises(InvalidArgumentError):
        index.set_params(efSearch=bad)
    with pytest.raises(UnknownOptionError):
        index.set_params(nprobe=4)
    assert index.params == {"efSearch": 40}
    index.remove(np.arange(250))  # a rebuild-triggering delete still works afterwards
    index.build(np.arange(250, 300), vectors[250:])
    np.testing.assert_array_equal(before[1][:, 0], np.arange(5))
    assert set(index.search(vectors[250:255], 1)[1][:, 0]) == set(range(250, 255))


def test_kvsearch_default_search_params_apply_unless_set(rng):
    """HNSW gets efSearch 64 and IVF a sixteenth of its lists (at least 8) unless the user sets them."""
    import faiss

    vectors = rng.standard_normal((2000, 16)).astype(np.float32)
    hnsw = Index(16, "HNSW8")
    hnsw.add(np.arange(2000), vectors)
    assert hnsw.search_params == {"efSearch": 64} and faiss.downcast_index(hnsw._faiss).hnsw.efSearch == 64
    hnsw.set_params(efSearch=20)
    assert faiss.downcast_index(hnsw._faiss).hnsw.efSearch == 20
    for spec, nprobe in (("IVF4,Flat", 4), ("IVF32,Flat", 8), ("IVF256,Flat", 16)):
        ivf = Index(16, spec)
        n = ivf.min_train
        ivf.build(np.arange(n), rng.standard_normal((n, 16)).astype(np.float32))
        assert not ivf.is_fallback and ivf.search_params == {"nprobe": nprobe}
        assert faiss.extract_index_ivf(ivf._faiss).nprobe == nprobe


@pytest.mark.parametrize("filtered", [False, True])
def test_trained_ivf_shrunk_below_min_train_probes_every_list(rng, filtered):
    """Deletes that take a trained IVF below min_train leave a few vectors per list: every search, filtered
    (a FAISS selector) or not, then probes every list and finds the brute-force top-k."""
    vectors = rng.standard_normal((700, 8)).astype(np.float32)
    index = Index(8, "IVF16,Flat", "ip", params={"nprobe": 1})
    index.build(np.arange(700), vectors)
    assert not index.is_fallback and index.min_train == 624
    index.remove(np.arange(40, 700))  # 40 left, still the trained IVF
    queries = rng.standard_normal((20, 8)).astype(np.float32)
    allowed = np.arange(0, 40, 2) if filtered else None
    live = np.arange(40) if allowed is None else allowed
    _, ids = index.search(queries, 5, allowed=allowed)
    expected = live[np.argsort(-(queries @ vectors[live].T), axis=1, kind="stable")[:, :5]]
    assert np.array_equal(ids, expected)
