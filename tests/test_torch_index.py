"""torch_index.py: the same ids as FAISS Flat (ties aside), standalone and bound to a database's store."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsearch import Database
from kvsearch.errors import CorruptDatabaseError, DimensionMismatchError, InvalidArgumentError, UnknownOptionError
from kvsearch.index.factory import parse_torch_spec
from kvsearch.index.faiss_index import Index
from kvsearch.index.topk import SearchResult
from kvsearch.index.torch_index import TorchIndex


def assert_same_as_flat(ours: SearchResult, flat: SearchResult, atol=1e-4):
    """Same ids as FAISS Flat except where neighbouring scores tie within atol; same scores."""
    scores, ids = ours.scores.numpy(), ours.ids.numpy()
    ref_scores, ref_ids = flat.scores.numpy(), flat.ids.numpy()
    valid = ref_ids >= 0
    np.testing.assert_array_equal(ids >= 0, valid)
    np.testing.assert_allclose(scores[valid], ref_scores[valid], atol=atol, rtol=1e-5)
    assert np.isnan(scores[~valid]).all()
    differ = ids != ref_ids
    for row, col in zip(*np.nonzero(differ)):
        # a swapped pair is only allowed where FAISS's own scores tie
        assert abs(ref_scores[row, col] - scores[row, col]) <= atol
        assert ids[row, col] in set(ref_ids[row].tolist()) or col == ids.shape[1] - 1


def tensors(rng, *shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


class _Source:
    """A key source (what the store offers): sorted ids, raw keys, rows by id, a version."""

    def __init__(self, ids, keys):
        self.ids, self.keys, self.version = ids, keys, 1

    def rows_of(self, ids):
        flat = ids.reshape(-1).cpu()  # (m,)
        pos = torch.searchsorted(self.ids, flat).clamp(max=max(len(self.ids) - 1, 0))  # (m,)
        return torch.where(self.ids[pos] == flat, pos, -1).reshape(ids.shape)


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("k", [1, 10, 101])
@pytest.mark.parametrize("chunk_elements", [7, 1 << 25])
def test_standalone_matches_faiss_flat(rng, metric, k, chunk_elements):
    vectors = tensors(rng, 300, 16)
    ids = torch.arange(300) * 7 + 5
    queries = tensors(rng, 9, 16)
    ours = TorchIndex(16, metric, chunk_elements=chunk_elements)
    ours.build(ids, vectors)
    flat = Index(16, "Flat", metric)
    flat.build(ids, vectors)
    assert_same_as_flat(ours.search(queries, k), flat.search(queries, k))


@pytest.mark.parametrize("batch", [1, 31, 32, 200])
@pytest.mark.parametrize("bound", [False, True])
@pytest.mark.parametrize("path", ["auto", "faiss"])
def test_batches_equal_dense_topk_on_either_path(rng, monkeypatch, batch, bound, path):
    """A float32 search runs in the chunked torch scan; ``faiss.knn`` over the same key memory only when forced (for
    the ``"Flat"`` spec, ``dtype="auto"``). Both give the dense ``torch.topk`` ids (random data: no ties), standalone
    and bound to a store."""
    import faiss

    from kvsearch.index.exact_path import ENV_VAR

    monkeypatch.setenv(ENV_VAR, path)
    monkeypatch.setattr(faiss.cvar, "distance_compute_blas_threshold", 128_000)  # as FAISS starts
    calls = []
    real = faiss.knn
    monkeypatch.setattr(faiss, "knn", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    keys = tensors(rng, 500, 16)  # (500, 16)
    queries = tensors(rng, batch, 16)  # (batch, 16)
    ids = torch.arange(500) * 3 + 1
    if bound:
        index = TorchIndex(16, "ip", source=_Source(ids, keys), dtype="auto")
        assert index.derived().keys is keys  # the store's own tensor
    else:
        index = TorchIndex(16, "ip", dtype="auto")
        index.build(ids, keys)
    got = index.search(queries, 10).ids
    expected = ids[(queries @ keys.T).topk(10, dim=1).indices]  # (batch, 10)
    assert torch.equal(got, expected)
    assert len(calls) == (1 if path == "faiss" else 0)
    if calls:  # the FAISS path tunes the BLAS threshold itself (a scalar loop under ~334 queries otherwise)
        assert faiss.cvar.distance_compute_blas_threshold == 20


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("batch", [1, 5, 64, 65])
@pytest.mark.parametrize("k", [1, 10, 100])
@pytest.mark.parametrize("spread", [3, 50])
def test_a_few_queries_rank_exactly_with_ties_by_id(metric, batch, k, spread):
    """A few queries take one product and one top-k, more take the chunked merge; either way the ids are the exact
    ranking, equal scores ordered by id. Integer keys and queries make every float32 score exact (so the reference is
    exact too) and give ties: many with entries in [-3, 3], a few planted duplicates with entries in [-50, 50]."""
    g = torch.Generator().manual_seed(batch * 1000 + k + spread)
    keys = torch.randint(-spread, spread + 1, (1000, 8), generator=g).float()  # (1000, 8)
    at = torch.arange(0, 990, 9)  # (110,)
    keys[at] = keys[at + 4]  # exact duplicates: ties
    ids = torch.randperm(1000, generator=g) + 1  # (1000,)
    queries = torch.randint(-spread, spread + 1, (batch, 8), generator=g).float()  # (batch, 8)
    index = TorchIndex(8, metric, dtype=torch.float32)
    index.build(ids, keys)
    q, kk = queries.long(), keys.long()
    ref = 2 * q @ kk.T - (kk * kk).sum(1) if metric == "l2" else q @ kk.T  # (batch, 1000) exact, larger is better
    for row, found in zip(ref, index.search(queries, k).ids):
        order = sorted(range(1000), key=lambda n: (-int(row[n]), int(ids[n])))[:k]
        assert found.tolist() == [int(ids[n]) for n in order]


def test_fewer_vectors_than_k_are_padded(rng):
    ours = TorchIndex(4)
    ours.add(torch.tensor([3, 9]), tensors(rng, 2, 4))
    scores, ids = ours.search(tensors(rng, 2, 4), 5)
    assert (ids[:, 2:] == -1).all() and scores[:, 2:].isnan().all()
    assert sorted(ids[0, :2].tolist()) == [3, 9]
    empty = TorchIndex(4)
    _, none = empty.search(torch.zeros(1, 4), 3)
    assert (none == -1).all()
    _, none = empty.search(torch.zeros(1, 4), 3, allowed=torch.tensor([3]))
    assert (none == -1).all()


@pytest.mark.parametrize("exact_filter_max", [4096, 0])
def test_add_remove_and_allowed_match_faiss(rng, exact_filter_max):
    """Filters give FAISS Flat's answer on either path: the allowed rows gathered and scanned (at most
    max(8 k, exact_filter_max) of them), or the whole key tensor scanned with a mask."""
    vectors = tensors(rng, 200, 8)
    ids = torch.arange(200)
    ours, flat = TorchIndex(8, chunk_elements=64), Index(8, "Flat")
    for index in (ours, flat):
        index.exact_filter_max = exact_filter_max
        index.add(ids[:150], vectors[:150])
        index.add(ids[150:], vectors[150:])
        index.remove(torch.tensor([0, 5, 77, 12345]))
    assert ours.ntotal == flat.ntotal == 197
    assert torch.equal(ours.ids(), flat.ids())
    queries = vectors[[0, 5, 10]] + 0.01  # the removed ids would be the nearest
    assert_same_as_flat(ours.search(queries, 12), flat.search(queries, 12))
    for allowed in (torch.arange(0, 200, 3), torch.arange(0, 200, 2)):  # 67 / 100 ids: <= and > 8 k
        assert_same_as_flat(ours.search(queries, 12, allowed=allowed), flat.search(queries, 12, allowed=allowed))
    _, few = ours.search(queries, 12, allowed=torch.tensor([3, 6, 5]))  # 5 was removed
    assert (few[:, 2:] == -1).all() and set(few[:, :2].ravel().tolist()) == {3, 6}


@pytest.mark.parametrize("dtype,tol", [("float16", 2e-3), ("bfloat16", 2e-2)])
def test_half_precision_keys_find_the_clear_winners(rng, dtype, tol):
    vectors = tensors(rng, 500, 32)
    ids = torch.arange(500)
    queries = vectors[:20] + 0.05 * tensors(rng, 20, 32)
    ours = TorchIndex(32, dtype=dtype)
    ours.build(ids, vectors)
    assert ours.derived().half.dtype == getattr(torch, dtype)
    scores, found = ours.search(queries, 1)
    assert torch.equal(found[:, 0], ids[:20])  # the perturbed point is far ahead
    torch.testing.assert_close(scores[:, 0], (queries * vectors[:20]).sum(1), rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_bound_to_a_source_reads_its_keys_without_copying(rng, dtype):
    keys = tensors(rng, 100, 8)
    source = _Source(torch.arange(100) * 2, keys)
    ours = TorchIndex(8, source=source, normalize=True, dtype=dtype)
    queries = 3 * (keys[:4] + 0.01)  # raw: the index normalises them
    flat = Index(8, "Flat")
    flat.build(source.ids, torch.nn.functional.normalize(keys, dim=-1))
    unit_queries = torch.nn.functional.normalize(queries, dim=-1)
    scores, ids = ours.search(queries, 5)
    assert torch.equal(ids[:, 0], torch.tensor([0, 2, 4, 6]))
    if dtype == "float32":
        assert ours.derived().keys is keys  # the source's own tensor, no second copy
        assert_same_as_flat(ours.search(queries, 5), flat.search(unit_queries, 5))
    # the source changes (a new version): the norms are recomputed
    source.keys = torch.cat([keys, 100 * keys[:1]])
    source.ids = torch.arange(101) * 2
    source.version = 2
    _, ids = ours.search(queries, 5)
    assert ours.ntotal == 101 and 200 in ids[0].tolist()  # same direction as key 0: cosine ties it


def test_rebuild_marks_derived_keys_stale_and_needs_a_source(rng):
    """Keys changed in place under the same version (as an in-place update of the store's tensor would be):
    rebuild() makes the next search recompute the norms."""
    keys = tensors(rng, 50, 4)
    source = _Source(torch.arange(50), keys)
    index = TorchIndex(4, "l2", source=source)
    before = index.derived().norm_term.clone()
    keys[:5] *= 3
    assert torch.equal(index.derived().norm_term, before)  # same tensor, same version: not noticed
    index.rebuild()
    torch.testing.assert_close(index.derived().norm_term, keys.square().sum(-1))
    with pytest.raises(InvalidArgumentError, match="source"):
        TorchIndex(4).rebuild()


def test_database_with_torch_index_matches_flat(tmp_path, rng):
    keys = tensors(rng, 300, 16)
    values = tensors(rng, 300, 4)
    queries = keys[:7] + 0.1 * tensors(rng, 7, 16)
    for score in ("cosine", "dot", "gaussian"):
        ours = Database(tmp_path / f"t-{score}", dim=16, value_dim=4, index="torch", score=score)
        flat = Database(tmp_path / f"f-{score}", dim=16, value_dim=4, index="Flat", score=score)
        for db in (ours, flat):
            db.add(keys, values)
            db.delete([3, 4])
        a, b = ours.query(queries, k=8), flat.query(queries, k=8)
        torch.testing.assert_close(a.output, b.output)
        assert torch.equal(a.ids, b.ids) and a.keys == b.keys
        ours.close()
        reopened = Database(tmp_path / f"t-{score}")
        assert isinstance(reopened.index, TorchIndex) and not (tmp_path / f"t-{score}" / "index.npz").exists()
        assert torch.equal(reopened.query(queries, k=8).ids, b.ids)
        reopened.close()
        flat.close()


def test_specs_and_arguments_are_checked():
    assert parse_torch_spec("Flat") is None
    assert parse_torch_spec("torch") is torch.float32 and parse_torch_spec("torch:bfloat16") is torch.bfloat16
    with pytest.raises(UnknownOptionError, match="torch:float16"):
        parse_torch_spec("torch:int8")
    with pytest.raises(InvalidArgumentError):
        TorchIndex(0)
    with pytest.raises(UnknownOptionError):
        TorchIndex(4, "cos")
    with pytest.raises(InvalidArgumentError):
        TorchIndex(4, "l2", normalize=True)
    with pytest.raises(UnknownOptionError):
        TorchIndex(4, dtype="int8")
    with pytest.raises(InvalidArgumentError):
        TorchIndex(4, chunk_elements=0)
    index = TorchIndex(4)
    with pytest.raises(DimensionMismatchError):
        index.add(torch.arange(2), torch.zeros(2, 5))
    with pytest.raises(DimensionMismatchError):
        index.search(torch.zeros(1, 3), 1)
    with pytest.raises(InvalidArgumentError):
        index.search(torch.zeros(1, 4), 0)
    with pytest.raises(InvalidArgumentError, match="torch.Tensor"):
        index.search(np.zeros((1, 4), dtype=np.float32), 1)
    with pytest.raises(UnknownOptionError):
        index.set_params(nprobe=4)
    with pytest.raises(InvalidArgumentError, match="half-precision"):
        index.half_error_bound(torch.zeros(1, 4))
    assert index.search_params == {} and not index.persisted and not index.needs_rebuild


# ----------------------------------------------------------------------------- the embeddings side file


WRITE_THEN_DIE = """
import os, sys, torch
from kvsearch import Database
db = Database(sys.argv[1])
db.delete([1, 2])
new = db.add(torch.ones(2, 8), torch.ones(2, 3))
torch.save((db.store.table.keys.clone(), new), sys.argv[2])
os._exit(0)  # gone without closing: what was committed is all there is
"""


def _stored_db(path, n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    db = Database(path, dim=8, value_dim=3, score="dot", index="torch")
    db.add(torch.randn(n, 8, generator=gen), torch.randn(n, 3, generator=gen))
    return db


def test_reopen_reads_what_was_committed_last(tmp_path):
    path = tmp_path / "db"
    db = _stored_db(path)
    keys, values, ids = db.store.table.keys.clone(), db.store.table.values.clone(), db.store.table.ids.clone()
    db.close()
    db = Database(path)
    assert torch.equal(db.store.table.keys, keys) and torch.equal(db.store.table.values, values)
    assert torch.equal(db.store.table.ids, ids)
    db.close()
    # a write by a process that dies without closing: the next open reads it
    crashed = subprocess.run([sys.executable, "-c", WRITE_THEN_DIE, str(path), str(tmp_path / "out.pt")], timeout=120)
    assert crashed.returncode == 0
    expect_keys, new = torch.load(tmp_path / "out.pt")
    reopened = Database(path)
    assert torch.equal(reopened.store.table.keys, expect_keys) and reopened.store.table.ids[-2:].tolist() == new
    assert 1 not in reopened.store.table.ids.tolist()
    reopened.close()
    names = sorted(p.name for p in path.iterdir() if p.name.startswith("store.sqlite"))
    vectors = [n for n in names if n.startswith("store.sqlite.v")]  # the embeddings' file set: one, whole
    assert [n for n in names if n not in vectors] == ["store.sqlite"]  # no WAL or journal left behind
    assert len(vectors) == 3 and len({n.rsplit(".", 1)[0] for n in vectors}) == 1


@pytest.mark.parametrize("change", ["delete_one", "renumber_two", "add_one"])
def test_records_changed_behind_the_embeddings_back_are_refused(tmp_path, change):
    """The embeddings' ids are checked against the records table's (count, min, max, sum) at open: a records row
    changed from outside, without its embeddings, is reported as damage, never served with another's embedding."""
    import sqlite3

    path = tmp_path / "db"
    _stored_db(path).close()
    con = sqlite3.connect(path / "store.sqlite")
    with con:  # a change that leaves the embeddings as they were (as no kvsearch write would)
        if change == "delete_one":
            con.execute("DELETE FROM records WHERE id = 7")
        elif change == "renumber_two":
            con.execute("UPDATE records SET id = 100 WHERE id = 7")
        else:
            con.execute("INSERT INTO records (slot) SELECT slot FROM records WHERE id = 1")
    con.close()
    with pytest.raises(CorruptDatabaseError, match="records of the records table"):
        Database(path)


def test_answer_keys_are_lazy_and_compare_as_lists(names_db):
    ans = names_db.query(["Li", "Lipton"], k=3)
    plain = [[names_db.store.texts.key_of_id.get(i) for i in row] for row in ans.ids.tolist()]
    assert ans.keys == plain and ans.keys.tolist() == plain and len(ans.keys) == 2
    assert ans.keys[1] == plain[1] and ans.keys[1][0] == plain[1][0] and ans.keys[-1][-1] == plain[-1][-1]
    assert list(ans.keys[0]) == plain[0] and ans.keys[0:1] == [plain[0]]
    single = names_db.query("Li", k=2)
    expected = [names_db.store.texts.key_of_id.get(i) for i in single.ids.tolist()]
    assert single.keys == expected and "Li" in expected


# ----------------------------------------------------------------------------- the chunked scan and half precision


def _brute_topk(queries, vectors, k, metric):
    """Reference: dense scores and torch.topk (the maximised score: q.k, or -|q - k|^2)."""
    q, v = torch.as_tensor(queries, dtype=torch.float64), torch.as_tensor(vectors, dtype=torch.float64)
    scores = q @ v.T if metric == "ip" else -torch.cdist(q, v).square()  # (b, n)
    return torch.topk(scores, min(k, v.shape[0]), dim=1)


def _assert_ids_match_reference(ids, ref_vals, ref_ids, queries, vectors, metric, atol=1e-5):
    """Every returned id scores as well as the reference's id at its rank (ties within atol may swap)."""
    q, v = torch.as_tensor(queries, dtype=torch.float64), torch.as_tensor(vectors, dtype=torch.float64)
    ids = torch.as_tensor(ids)[:, : ref_ids.shape[1]]
    assert (ids >= 0).all()
    got = (q.unsqueeze(1) * v[ids]).sum(-1) if metric == "ip" else -(q.unsqueeze(1) - v[ids]).square().sum(-1)
    torch.testing.assert_close(got, ref_vals, atol=atol, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch=st.integers(1, 9),
    k=st.integers(1, 40),
    rows=st.integers(1, 120),
    metric=st.sampled_from(["ip", "l2"]),
    seed=st.integers(0, 2**16),
)
def test_chunked_scan_equals_dense_topk(n, batch, k, rows, metric, seed):
    """The threshold-pruned merge returns the dense top-k for any chunk size, k and database size."""
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.randn(n, 6, generator=gen)
    queries = torch.randn(batch, 6, generator=gen)
    index = TorchIndex(6, metric, chunk_elements=rows * batch)
    index.build(torch.arange(n) + 100, vectors)
    scores, ids = index.search(queries, k)
    ref_vals, ref_ids = _brute_topk(queries, vectors, k, metric)
    _assert_ids_match_reference(ids - 100, ref_vals, ref_ids, queries, vectors, metric, atol=1e-4)
    assert (ids[:, ref_ids.shape[1] :] == -1).all()
    expect = -ref_vals if metric == "l2" else ref_vals
    np.testing.assert_allclose(scores[:, : ref_ids.shape[1]].numpy(), expect.numpy(), atol=1e-4, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 200),
    k=st.integers(1, 40),
    rows=st.integers(1, 50),
    every=st.integers(1, 9),
    metric=st.sampled_from(["ip", "l2"]),
    seed=st.integers(0, 2**16),
)
def test_gathered_scan_equals_dense_topk_over_the_allowed_rows(n, k, rows, every, metric, seed):
    """A small filter gathers its rows a chunk at a time: the dense top-k over exactly those rows."""
    gen = torch.Generator().manual_seed(seed)
    vectors = torch.randn(n, 6, generator=gen)
    queries = torch.randn(3, 6, generator=gen)
    index = TorchIndex(6, metric, chunk_elements=rows * 3)
    index.build(torch.arange(n) + 100, vectors)
    allowed = torch.arange(0, n, every)  # rows admitted
    scores, ids = index.search(queries, k, allowed=allowed + 100)
    ref_vals, ref_pos = _brute_topk(queries, vectors[allowed], k, metric)
    got = ids[:, : ref_pos.shape[1]] - 100
    assert torch.isin(got, allowed).all() and (ids[:, ref_pos.shape[1] :] == -1).all()
    _assert_ids_match_reference(got, ref_vals, ref_pos, queries, vectors, metric, atol=1e-4)
    expect = -ref_vals if metric == "l2" else ref_vals
    np.testing.assert_allclose(scores[:, : ref_pos.shape[1]].numpy(), expect.numpy(), atol=1e-4, rtol=1e-5)


def _hard_data(rng, kind, n=3000, dim=48):
    """Data on which half precision alone gets the order wrong: near-duplicates, big norms, tiny values."""
    if kind == "random":
        return rng.standard_normal((n, dim)).astype(np.float32), rng.standard_normal((7, dim)).astype(np.float32)
    if kind == "near_duplicates":  # many keys within 1e-3 of each other: their half scores tie
        base = rng.standard_normal((30, dim)).astype(np.float32)
        keys = base[rng.integers(0, 30, n)] + 1e-3 * rng.standard_normal((n, dim)).astype(np.float32)
        return keys, base[:7] + 1e-3 * rng.standard_normal((7, dim)).astype(np.float32)
    if kind == "big_norms":  # float16 would overflow on these scores
        keys = rng.standard_normal((n, dim)).astype(np.float32) * rng.uniform(1, 3e3, (n, 1)).astype(np.float32)
        return keys, 300 * rng.standard_normal((7, dim)).astype(np.float32)
    keys = rng.standard_normal((n, dim)).astype(np.float32) * 1e-6  # "tiny": float16 subnormals
    return keys, rng.standard_normal((7, dim)).astype(np.float32) * 1e-6


@pytest.mark.parametrize("kind", ["random", "near_duplicates", "big_norms", "tiny"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_half_precision_search_gives_the_exact_ids(rng, kind, dtype, metric):
    """Scanning a half copy, rescoring in float32 and checking the bound gives exact top-k ids.

    Compared with a float64 brute force: each returned id scores what the reference's id at that rank scores,
    up to float32 rounding of the score (l2 scores cancel: |q|^2 - (2 q.k - |k|^2)), so only ties may swap.
    """
    keys, queries = _hard_data(rng, kind)
    index = TorchIndex(keys.shape[1], metric, dtype=dtype, chunk_elements=4096)
    index.build(torch.arange(len(keys)), torch.from_numpy(keys))
    q_norm, k_norm = np.linalg.norm(queries, axis=1).max(), np.linalg.norm(keys, axis=1).max()
    scale = (q_norm + k_norm) ** 2 if metric == "l2" else q_norm * k_norm
    for k in (1, 10, 100):
        _, ids = index.search(torch.from_numpy(queries), k)
        ref_vals, ref_ids = _brute_topk(queries, keys, k, metric)
        _assert_ids_match_reference(ids, ref_vals, ref_ids, queries, keys, metric, atol=1e-5 * scale)
        if kind == "near_duplicates" and k == 1:
            # ~100 keys within 1e-3 of each query's base: the first k' = 50 kept cannot be told from the rest by
            # the bound, so those queries are rescored with a wider k' -- not searched again in float32
            assert index.last_widened > 0 and index.last_rechecked == 0
        if kind == "random":
            assert index.last_rechecked == 0  # well-separated scores: the half scan alone suffices


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["random", "big_norms", "tiny"])
def test_half_error_bound_holds(rng, dtype, kind):
    """|half-precision score - float32 score| never exceeds the bound the check relies on."""
    keys, queries = _hard_data(rng, kind, n=2000)
    index = TorchIndex(keys.shape[1], dtype=dtype)
    index.build(torch.arange(len(keys)), torch.from_numpy(keys))
    derived = index.derived()
    q = torch.from_numpy(queries)
    approx = (q.to(derived.half.dtype) @ derived.half.T).double()  # (b, n), rounded as the scan rounds
    exact = q.double() @ torch.from_numpy(keys).double().T  # (b, n)
    bound = index.half_error_bound(q).double()  # (b,)
    worst = (approx - exact).abs().amax(dim=1)  # (b,)
    finite = torch.isfinite(bound)
    assert (worst[finite] <= bound[finite]).all()
    if dtype == "float16" and kind == "big_norms":
        assert not finite.any()  # would overflow: these queries are searched in float32
    else:
        assert finite.all()


def test_half_precision_database_matches_flat(tmp_path, rng):
    """A database with index "torch:bfloat16" answers with the ids of FAISS Flat, for every score."""
    keys = tensors(rng, 400, 16) * 3
    values = tensors(rng, 400, 4)
    queries = keys[:9] + 0.3 * tensors(rng, 9, 16)
    for score in ("cosine", "dot", "gaussian"):
        half = Database(None, dim=16, value_dim=4, index="torch:bfloat16", score=score)
        flat = Database(None, dim=16, value_dim=4, index="Flat", score=score)
        for db in (half, flat):
            db.add(keys, values)
            db.delete([5, 6, 7])
        a, b = half.query(queries, k=20), flat.query(queries, k=20)
        assert torch.equal(a.ids, b.ids)
        torch.testing.assert_close(a.output, b.output)


@pytest.mark.parametrize("score", ["cosine", "gaussian"])
def test_a_reader_appending_rows_scores_them_as_a_fresh_open(tmp_path, score):
    """The exact index derives norm terms once; rows appended by a catch-up get theirs added, and a replaced or
    deleted row makes them derived again: every answer equals a brute force over what is stored."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "db"
    writer = Database(path, dim=8, value_dim=2, score=score, index="Flat")
    names = [f"k{i}" for i in range(400)]

    def put(first: int, n: int, scale: float, *, upsert: bool = False) -> None:
        keys, values = torch.randn(n, 8, generator=gen) * scale, torch.randn(n, 2, generator=gen)
        (writer.upsert if upsert else writer.add)(names[first : first + n], values, key_embeddings=keys)

    put(0, 300, 3.0)
    reader = Database(path)
    queries = torch.randn(5, 8, generator=gen)

    def check() -> None:
        ids = writer.ids()
        keys = torch.stack([writer.get(i).key_embedding for i in ids.tolist()])  # (n, 8)
        if score == "cosine":
            scores = F.normalize(queries, dim=-1) @ F.normalize(keys, dim=-1).T  # (5, n)
        else:
            scores = -torch.cdist(queries, keys)  # (5, n)
        assert [row[0].id for row in reader.search(queries, k=1)] == ids[scores.argmax(dim=1)].tolist()

    check()
    for first in (300, 340):  # appended only: the reader extends what it derived
        put(first, 40, 5.0)
        check()
    put(0, 200, 0.2, upsert=True)  # key embeddings replaced in place: same ids, other norms
    put(380, 5, 5.0)
    check()
    writer.delete(writer.ids()[100:130].tolist())  # the rows after them move up
    put(385, 10, 5.0)
    check()
    reader.close()
    writer.close()


@pytest.mark.parametrize("n", [40_000, 40_001])
def test_one_query_over_many_keys_equals_dense_topk(rng, n):
    """A few queries over many keys split their top-k across the CPU's threads (torch's runs one thread per row):
    the ids are still the dense ``torch.topk``'s, whether the key count splits evenly or not."""
    keys = tensors(rng, n, 8)  # (n, 8)
    index = TorchIndex(8, "ip")
    index.build(torch.arange(n), keys)
    for batch in (1, 3):
        queries = tensors(rng, batch, 8)  # (batch, 8)
        expected = (queries @ keys.T).topk(50, dim=1).indices  # (batch, 50)
        assert torch.equal(index.search(queries, 50).ids, expected)
