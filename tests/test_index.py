"""index.py against a brute-force torch search: tensors in, (scores, ids) out on the queries' device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _key_table import KeyTable  # the fake key source the index tests share

from kvsearch.checks import MAX_K
from kvsearch.errors import (
    CorruptDatabaseError,
    DimensionMismatchError,
    InvalidArgumentError,
    MemoryLimitError,
    UnknownOptionError,
)
from kvsearch.index.factory import load_index, make_index
from kvsearch.index.faiss_index import Index
from kvsearch.index.topk import SearchResult
from kvsearch.index.torch_index import TorchIndex


def tensors(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def true_scores(queries, keys, metric):
    """float64 scores (b, n): inner product, or squared distance."""
    q, v = queries.double(), keys.double()
    return q @ v.T if metric == "ip" else torch.cdist(q, v).square()


def brute(keys, ids, queries, k, metric):
    """Reference ids (b, min(k, n)), best first: a stable sort of float64 scores."""
    scores = true_scores(queries, keys, metric)
    order = torch.argsort(-scores if metric == "ip" else scores, dim=1, stable=True)[:, :k]  # (b, k)
    return ids[order]


def assert_valid(result, queries, k, allowed_keys, allowed_ids, metric, exact):
    """``result`` holds min(k, admitted) distinct admitted ids per query, best first, -1 / NaN after, and scores
    that are the ids' true scores; where ``exact``, the ids are the reference's (ties within 1e-4 may swap)."""
    want = min(k, len(allowed_ids))
    assert isinstance(result, SearchResult) and result.ids.shape == (len(queries), k) == result.scores.shape
    assert result.ids.dtype == torch.int64 and result.scores.dtype == torch.float32
    found = result.ids[:, :want]
    assert (found >= 0).all() and (result.ids[:, want:] == -1).all() and result.scores[:, want:].isnan().all()
    assert torch.isin(found, allowed_ids).all()
    assert all(len(set(row.tolist())) == want for row in found)
    row_of = {int(i): n for n, i in enumerate(allowed_ids)}
    rows = torch.tensor([[row_of[int(i)] for i in row] for row in found], dtype=torch.long).reshape(-1, want)
    scores = true_scores(queries, allowed_keys, metric).gather(1, rows)  # (b, want) the ids' true scores
    torch.testing.assert_close(result.scores[:, :want].double(), scores, atol=1e-4, rtol=1e-5)
    ordered = scores.diff(dim=1)
    assert (ordered <= 1e-5).all() if metric == "ip" else (ordered >= -1e-5).all()  # best first
    if exact:
        expect = true_scores(queries, allowed_keys, metric)
        best = expect.sort(dim=1, descending=metric == "ip").values[:, :want]  # (b, want)
        torch.testing.assert_close(scores, best, atol=1e-4, rtol=0)  # as good as the reference at every rank


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("k", [1, 10, 101])
def test_flat_matches_brute_force(rng, metric, k):
    vectors = tensors(rng, 60, 8)
    ids = torch.arange(1000, 1060)
    queries = tensors(rng, 5, 8)
    index = Index(8, "Flat", metric)
    index.add(ids, vectors)
    scores, found = index.search(queries, k)
    assert found.shape == (5, k) and scores.shape == (5, k)
    expect = brute(vectors, ids, queries, k, metric)
    kk = min(k, 60)
    assert torch.equal(found[:, :kk], expect[:, :kk])
    assert (found[:, kk:] == -1).all() and scores[:, kk:].isnan().all()  # fewer than k exist: -1 padded
    expect_scores = true_scores(queries, vectors, metric).gather(1, found[:, :kk] - 1000)  # (5, kk)
    torch.testing.assert_close(scores[:, :kk].double(), expect_scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "IVF4,Flat", "PQ4", "IVF4,PQ4", "OPQ4,IVF4,PQ4"])
def test_remove_for_every_type(rng, spec):
    """Deleted ids never come back, whatever the index type (HNSW keeps tombstones)."""
    vectors = tensors(rng, 400, 16)
    ids = torch.arange(400) * 3 + 7
    index = Index(16, spec, "l2")
    index.build(ids, vectors)
    gone = ids[::2]
    index.remove(gone)
    assert index.ntotal == 200
    assert torch.equal(index.ids(), torch.sort(ids[1::2]).values)
    _, found = index.search(vectors[:50], 20)
    assert not torch.isin(found, gone).any()
    # re-adding an id that was removed (an upsert) makes it searchable again
    index.add(gone[:1], vectors[:1])
    _, found = index.search(vectors[:1], 1)
    assert found[0, 0] == gone[0]


def test_hnsw_recall_against_brute_force(rng):
    vectors = tensors(rng, 2000, 16)
    ids = torch.arange(2000)
    queries = vectors[:100] + 0.01 * tensors(rng, 100, 16)
    index = Index(16, "HNSW32", "l2", params={"efSearch": 128})
    index.build(ids, vectors)
    _, found = index.search(queries, 10)
    expect = brute(vectors, ids, queries, 10, "l2")
    recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / 10 for a, b in zip(found, expect)])
    assert recall >= 0.95


def test_untrained_type_serves_flat_until_trainable(rng):
    index = Index(8, "IVF4,Flat", "l2")
    assert index.min_train == 39 * 4
    small = tensors(rng, 10, 8)
    index.add(torch.arange(10), small)
    assert index.is_fallback and not index.needs_rebuild
    _, found = index.search(small, 1)
    assert torch.equal(found[:, 0], torch.arange(10))  # exact while it is a flat fallback
    big = tensors(rng, 200, 8)
    index.add(torch.arange(10, 210), big)
    assert index.needs_rebuild
    index.build(torch.arange(210), torch.cat([small, big]))
    assert not index.is_fallback and index.ntotal == 210


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "IVF4,Flat"])
def test_save_load_round_trip(tmp_path, rng, spec):
    vectors = tensors(rng, 300, 8)
    index = Index(8, spec, "ip", params={"nprobe": 4} if spec.startswith("IVF") else None)
    index.build(torch.arange(300), vectors)
    index.remove(torch.tensor([0, 1, 2]))
    index.save(tmp_path / "index.npz")
    loaded = load_index(tmp_path / "index.npz", spec, 8, metric="ip", params=index.params)
    a, b = index.search(vectors[:20], 7), loaded.search(vectors[:20], 7)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)
    assert loaded.ntotal == 297 and torch.equal(loaded.ids(), index.ids())


@pytest.mark.parametrize("content", [b"", b"\x00" * 100, b"garbage" * 50])
def test_load_damaged_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "index.npz"
    path.write_bytes(content)
    with pytest.raises(CorruptDatabaseError, match="cannot be read"):
        load_index(path, "Flat", 8, metric="ip")


def test_load_truncated_file(tmp_path, rng):
    index = Index(8, "HNSW16", "ip")
    index.build(torch.arange(100), tensors(rng, 100, 8))
    index.save(tmp_path / "index.npz")
    data = (tmp_path / "index.npz").read_bytes()
    (tmp_path / "index.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptDatabaseError):
        load_index(tmp_path / "index.npz", "HNSW16", 8, metric="ip")


def test_load_another_dim_or_metric_is_corrupt(tmp_path, rng):
    index = Index(8, "HNSW16", "ip")
    index.build(torch.arange(100), tensors(rng, 100, 8))
    index.save(tmp_path / "index.npz")
    with pytest.raises(CorruptDatabaseError, match="does not match"):
        load_index(tmp_path / "index.npz", "HNSW16", 8, metric="l2")
    with pytest.raises(CorruptDatabaseError):
        load_index(tmp_path / "index.npz", "HNSW16", 16, metric="ip")


def test_errors():
    with pytest.raises(UnknownOptionError, match="Bogus"):
        Index(8, "Bogus")
    with pytest.raises(UnknownOptionError, match="IDMap"):
        Index(8, "IDMap,Flat")
    with pytest.raises(UnknownOptionError, match="metric"):
        Index(8, "Flat", "cosine")
    with pytest.raises(InvalidArgumentError, match="dim"):
        Index(0)
    with pytest.raises(InvalidArgumentError, match="normalize"):
        Index(8, "Flat", "l2", normalize=True)
    index = Index(8)
    with pytest.raises(InvalidArgumentError, match="k"):
        index.search(torch.zeros(1, 8), 0)
    with pytest.raises(InvalidArgumentError, match="k"):
        index.search(torch.zeros(1, 8), MAX_K + 1)
    with pytest.raises(DimensionMismatchError, match=r"\(batch, 8\)"):
        index.search(torch.zeros(1, 9), 1)
    with pytest.raises(InvalidArgumentError, match="torch.Tensor"):
        index.search(np.zeros((1, 8), np.float32), 1)  # the boundary is torch
    with pytest.raises(DimensionMismatchError, match=r"\(n, 8\)"):
        index.add(torch.arange(2), torch.zeros(2, 7))
    with pytest.raises(DimensionMismatchError, match="one id per vector"):
        index.add(torch.arange(3), torch.zeros(2, 8))
    with pytest.raises(InvalidArgumentError, match="integer"):
        index.add(torch.zeros(2), torch.zeros(2, 8))
    with pytest.raises(InvalidArgumentError, match="allowed"):
        index.search(torch.zeros(1, 8), 1, allowed=[1, 2])
    with pytest.raises(UnknownOptionError, match="search parameters"):
        index.set_params(bogus=1)
    with pytest.raises(InvalidArgumentError, match="source"):
        index.rebuild()  # nothing to rebuild from


def test_empty_index_search_is_all_missing():
    scores, ids = Index(4).search(torch.zeros(2, 4), 3)
    assert (ids == -1).all() and scores.isnan().all()
    scores, ids = Index(4).search(torch.zeros(2, 4), 3, allowed=torch.tensor([1, 2]))
    assert (ids == -1).all() and scores.isnan().all()


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
    assert torch.equal(db.index.ids(), db.store.table.ids)
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
    import faiss

    index = Index(16, "IVF4,Flat")
    vectors = tensors(rng, 400, 16)
    index.add(torch.arange(10), vectors[:10])
    assert index.is_fallback
    with pytest.raises(UnknownOptionError, match="efSearch"):
        index.set_params(efSearch=64)  # HNSW's parameter: refused although nothing is applied yet
    index.set_params(nprobe=3)
    index.build(torch.arange(400), vectors)
    assert not index.is_fallback and index.params == {"nprobe": 3}
    assert faiss.extract_index_ivf(index.faiss_index).nprobe == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, float("nan"), "4", True, 2**40])
def test_a_rejected_search_param_changes_nothing(rng, bad):
    index = Index(16, "HNSW8", "l2")  # under l2 each vector's nearest is itself
    vectors = tensors(rng, 300, 16)
    index.add(torch.arange(300), vectors)
    index.set_params(efSearch=40)
    before = index.search(vectors[:5], 5)
    with pytest.raises(InvalidArgumentError):
        index.set_params(efSearch=bad)
    with pytest.raises(UnknownOptionError):
        index.set_params(nprobe=4)
    assert index.params == {"efSearch": 40}
    index.remove(torch.arange(250))  # a rebuild-triggering delete still works afterwards
    index.build(torch.arange(250, 300), vectors[250:])
    assert torch.equal(before.ids[:, 0], torch.arange(5))
    assert set(index.search(vectors[250:255], 1).ids[:, 0].tolist()) == set(range(250, 255))


def test_kvsearch_default_search_params_apply_unless_set(rng):
    """HNSW gets efSearch 64 and IVF a sixteenth of its lists (at least 8) unless the user sets them."""
    import faiss

    vectors = tensors(rng, 2000, 16)
    hnsw = Index(16, "HNSW8")
    hnsw.add(torch.arange(2000), vectors)
    assert hnsw.search_params == {"efSearch": 64} and faiss.downcast_index(hnsw.faiss_index).hnsw.efSearch == 64
    hnsw.set_params(efSearch=20)
    assert faiss.downcast_index(hnsw.faiss_index).hnsw.efSearch == 20
    for spec, nprobe in (("IVF4,Flat", 4), ("IVF32,Flat", 8), ("IVF256,Flat", 16)):
        ivf = Index(16, spec)
        n = ivf.min_train
        ivf.build(torch.arange(n), tensors(rng, n, 16))
        assert not ivf.is_fallback and ivf.search_params == {"nprobe": nprobe}
        assert faiss.extract_index_ivf(ivf.faiss_index).nprobe == nprobe


@pytest.mark.parametrize("filtered", [False, True])
def test_trained_ivf_shrunk_below_min_train_probes_every_list(rng, filtered):
    """Deletes that take a trained IVF below min_train leave a few vectors per list: every search, filtered
    (a FAISS selector: exact_filter_max 0 and 20 allowed > 8 k) or not, then probes every list and finds the
    brute-force top-k."""
    vectors = tensors(rng, 700, 8)
    index = Index(8, "IVF16,Flat", "ip", params={"nprobe": 1})
    index.exact_filter_max = 0
    index.build(torch.arange(700), vectors)
    assert not index.is_fallback and index.min_train == 624
    index.remove(torch.arange(40, 700))  # 40 left, still the trained IVF
    queries = tensors(rng, 20, 8)
    allowed = torch.arange(0, 40, 2) if filtered else None
    live = torch.arange(40) if allowed is None else allowed
    _, ids = index.search(queries, 2, allowed=allowed)
    assert index.last_redone == 0  # the selector search alone found them
    assert torch.equal(ids, brute(vectors[live], live, queries, 2, "ip"))


# ------------------------------------------------------------------ the protocol: make_index, filters, devices

FILTER_SPECS = ["Flat", "HNSW16", "IVF16,Flat", "torch"]


def _clustered(rng, n=3000, dim=32, clusters=30):
    """Keys in tight clusters far apart: a filter that admits one cluster is selective for a graph."""
    centers = 10 * rng.standard_normal((clusters, dim))
    label = rng.integers(0, clusters, n)
    keys = torch.from_numpy((centers[label] + rng.standard_normal((n, dim))).astype(np.float32))
    return keys, torch.from_numpy(label), torch.from_numpy(centers.astype(np.float32))


def _filtered_setup(rng, spec, bound, metric="l2"):
    """An index over clustered keys with 1 in 10 ids deleted, and its live ids / keys."""
    keys, label, centers = _clustered(rng)
    ids = torch.arange(len(keys)) * 2 + 1  # odd ids: even ones were never stored
    source = KeyTable(ids, keys) if bound else None
    index = make_index(spec, keys.shape[1], metric=metric, source=source)
    if bound:
        index.rebuild()
    else:
        index.build(ids, keys)
    gone = ids[::10]
    index.remove(gone)
    if bound:
        source.drop(gone)  # the store deletes them too (a torch index reads the store: remove() marked it stale)
    live = ~torch.isin(ids, gone)  # (n,)
    return index, ids, keys, label, centers, live


@pytest.mark.parametrize("spec", FILTER_SPECS)
@pytest.mark.parametrize("bound", [True, False], ids=["source", "standalone"])
@pytest.mark.parametrize("path", ["exact", "index"])
@pytest.mark.parametrize("k", [1, 5, 500])
def test_filtered_search_gives_min_k_admitted_live_ids(rng, spec, bound, path, k):
    """Every query gets min(k, live allowed ids) distinct allowed ids, best first, with their true scores; an
    exact type (or the exact scan of a small admitted set) gives the brute-force top-k. The filter admits one
    cluster (far from the queries: a graph's selector search can come back short), deleted ids and ids never
    stored; k = 500 is more than it admits."""
    index, ids, keys, label, centers, live = _filtered_setup(rng, spec, bound)
    if path == "index":
        index.exact_filter_max = 0  # a FAISS selector search wherever the admitted set exceeds 8 k
    queries = centers[3:9] + torch.from_numpy(rng.standard_normal((6, keys.shape[1])).astype(np.float32))
    admitted = label == 1  # (n,) one cluster
    allowed = torch.cat([ids[admitted], torch.tensor([0, 2, 4])])  # + ids never stored
    allowed = torch.sort(allowed).values
    result = index.search(queries, k, allowed=allowed)
    keep = admitted & live
    exact = spec in ("Flat", "torch") or path == "exact" or int(keep.sum()) <= 8 * k
    assert_valid(result, queries, k, keys[keep], ids[keep], "l2", exact)


def test_a_graphs_short_selector_search_is_redone_exactly(rng):
    """HNSW under a selective filter returns fewer than k for some queries; those are searched again exactly,
    from the source's keys when there is one, else from the graph's own flat storage."""
    for bound in (True, False):
        index, ids, keys, label, centers, live = _filtered_setup(np.random.default_rng(0), "HNSW8", bound)
        index.exact_filter_max = 0
        queries = centers[label[:60]] + torch.from_numpy(rng.standard_normal((60, keys.shape[1])).astype(np.float32))
        keep = (label == 2) & live
        shortfalls = 0
        for k in (5, 8):
            result = index.search(queries, k, allowed=ids[label == 2])
            shortfalls += index.last_redone
            assert_valid(result, queries, k, keys[keep], ids[keep], "l2", exact=False)
        assert shortfalls > 0


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "IVF16,Flat", "torch", "torch:bfloat16"])
@pytest.mark.parametrize("bound", [True, False], ids=["source", "standalone"])
def test_normalize_equals_searching_unit_vectors(rng, spec, bound):
    """normalize=True over raw keys and queries answers as a plain index over unit keys searched with unit
    queries: the same ids and scores, unfiltered and filtered."""
    keys = tensors(rng, 1000, 16) * torch.from_numpy(rng.uniform(0.1, 10, (1000, 1)).astype(np.float32))
    queries = tensors(rng, 9, 16) * 7
    ids = torch.arange(1000) + 5
    unit_keys, unit_queries = F.normalize(keys, dim=-1), F.normalize(queries, dim=-1)
    cosine = make_index(spec, 16, normalize=True, source=KeyTable(ids, keys) if bound else None)
    plain = make_index(spec, 16, source=KeyTable(ids, unit_keys) if bound else None)
    for index, data in ((cosine, keys), (plain, unit_keys)):
        index.build(ids, data)
    allowed = ids[::7]
    for kwargs in ({}, {"allowed": allowed}):
        a, b = cosine.search(queries, 10, **kwargs), plain.search(unit_queries, 10, **kwargs)
        assert torch.equal(a.ids, b.ids)
        torch.testing.assert_close(a.scores, b.scores, atol=1e-5, rtol=1e-5)
    assert_valid(cosine.search(queries, 10, allowed=allowed), unit_queries, 10, unit_keys[::7], allowed, "ip", True)


@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "torch", "torch:float16"])
def test_results_on_the_queries_device_without_a_gradient(rng, spec):
    keys = tensors(rng, 100, 8)
    index = make_index(spec, 8, metric="l2")
    index.build(torch.arange(100), keys)
    queries = keys[:3].clone().requires_grad_()
    scores, ids = index.search(queries, 4, allowed=torch.arange(50))
    assert scores.device == queries.device == ids.device and not scores.requires_grad
    assert torch.equal(ids[:, 0], torch.arange(3))


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["Flat", "HNSW16", "torch", "torch:bfloat16"])
def test_results_on_the_queries_cuda_device(rng, spec):
    """CUDA queries get CUDA results; a torch index bound to CUDA keys computes them there."""
    keys = tensors(rng, 500, 8).cuda()
    ids = torch.arange(500) * 2
    index = make_index(spec, 8, metric="l2", source=KeyTable(ids, keys))
    index.rebuild()
    queries = keys[:3] + 0.001
    for allowed in (None, ids[:300], ids[:20]):
        scores, found = index.search(queries, 4, allowed=allowed)
        assert scores.device.type == found.device.type == "cuda"
        assert torch.equal(found[:, 0].cpu(), ids[:3])
    cpu = index.search(queries.cpu(), 4)
    assert cpu.ids.device.type == "cpu" and torch.equal(cpu.ids, index.search(queries, 4).ids.cpu())


@pytest.mark.parametrize(
    "spec,persisted",
    [("Flat", False), ("HNSW16", True), ("IVF4,Flat", True), ("PQ4", True), ("SQ8", True), ("PCA8,Flat", True)]
    + [("torch", False), ("torch:bfloat16", False), ("torch:float16", False)],
)
def test_make_index_picks_the_class_and_persisted_per_type(spec, persisted):
    index = make_index(spec, 16, metric="ip", params=None)
    assert isinstance(index, TorchIndex if spec.startswith("torch") or spec == "Flat" else Index)
    assert index.persisted is persisted and index.spec == spec and index.dim == 16
    assert index.exact_filter_max == 4096


@pytest.mark.parametrize("spec", ["HNSW16", "IVF16,Flat", "IVF16,PQ4"])
def test_make_index_and_load_index_round_trip(tmp_path, rng, spec):
    """A source-bound cosine index saved and loaded answers as before, filtered and not, with its parameters."""
    keys = tensors(rng, 2000, 16)
    ids = torch.arange(2000) * 3
    source = KeyTable(ids, keys)
    params = {"nprobe": 4} if spec.startswith("IVF") else None
    index = make_index(spec, 16, normalize=True, source=source, params=params)
    index.rebuild()
    index.remove(ids[:10])
    source.drop(ids[:10])
    index.save(tmp_path / "index.npz")
    loaded = load_index(tmp_path / "index.npz", spec, 16, metric="ip", normalize=True, source=source, params=params)
    assert isinstance(loaded, Index) and loaded.search_params == index.search_params
    assert loaded.is_fallback == index.is_fallback and torch.equal(loaded.ids(), index.ids())
    queries = tensors(rng, 8, 16)
    for allowed in (None, ids[::5], ids[::50]):
        a, b = index.search(queries, 9, allowed=allowed), loaded.search(queries, 9, allowed=allowed)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.scores, b.scores)


def test_torch_specs_are_made_not_loaded(tmp_path, rng):
    keys = tensors(rng, 50, 4)
    index = make_index("torch:bfloat16", 4, metric="ip", normalize=True, source=KeyTable(torch.arange(50), keys))
    assert isinstance(index, TorchIndex) and index.normalize and index.ntotal == 50
    with pytest.raises(InvalidArgumentError, match="persisted"):
        index.save(tmp_path / "index.npz")
    with pytest.raises(InvalidArgumentError, match="make_index"):
        load_index(tmp_path / "index.npz", "torch", 4, metric="ip")
    with pytest.raises(UnknownOptionError):
        make_index("torch", 4, params={"nprobe": 2})
    with pytest.raises(UnknownOptionError, match="torch:float16"):
        make_index("torch:int8", 4)
    with pytest.raises(UnknownOptionError, match="Bogus"):
        make_index("Bogus", 4)


def test_rebuild_reads_the_source_and_checks_memory_first(rng, monkeypatch):
    keys = tensors(rng, 300, 8)
    source = KeyTable(torch.arange(300), keys)
    index = make_index("IVF4,Flat", 8, metric="l2", source=source)
    assert index.ntotal == 0 and not index.needs_rebuild
    index.rebuild()
    assert index.ntotal == 300 and not index.is_fallback
    assert torch.equal(index.search(keys[:5], 1).ids[:, 0], torch.arange(5))
    source.drop(torch.arange(100))
    monkeypatch.setenv("KVSEARCH_MEMORY_LIMIT", "1000")  # far below the index's size
    with pytest.raises(MemoryLimitError, match="building the IVF4,Flat index"):
        index.rebuild()
    assert index.ntotal == 300  # refused before anything was replaced
    monkeypatch.delenv("KVSEARCH_MEMORY_LIMIT")
    index.rebuild()
    assert torch.equal(index.ids(), torch.arange(100, 300))
