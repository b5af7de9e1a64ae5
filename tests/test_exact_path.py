"""The default exact index ("Flat"): every path it can take gives a brute force's ids and scores, ties by id;
the half-precision path settles near-duplicate data without searching queries again; ANN build parameters."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

import kvsearch
from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.index.exact_path import ENV_VAR, choose_path, fast_half_dtypes, forced_path, set_exact_path
from kvsearch.index.factory import make_index

PATHS = ["float32", "bfloat16", "float16", "faiss", "auto"]


@pytest.fixture
def forced():
    """Force a path for the test; back to the rule afterwards."""
    yield set_exact_path
    set_exact_path(None)


def _data(rng: np.random.Generator, kind: str, n: int = 1500, dim: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """keys (n, dim), queries (12, dim) float32 of one kind."""
    if kind == "random":
        keys = rng.standard_normal((n, dim)).astype(np.float32)
        queries = rng.standard_normal((12, dim)).astype(np.float32)
    elif kind == "clusters":  # near-duplicate clusters: 15 centres x 100, noise 1e-2 per coordinate
        centres = rng.standard_normal((15, dim)) / np.sqrt(dim)
        noise = 1e-2 * rng.standard_normal((n // 15 * 15, dim))
        keys = (np.repeat(centres, n // 15, axis=0) + noise).astype(np.float32)
        queries = (centres[rng.integers(0, 15, 12)] + 1e-2 * rng.standard_normal((12, dim))).astype(np.float32)
    else:  # "ties": entries in {-1, 0, 1} / 4 and many repeated rows: every score is exact, many are equal
        base = rng.integers(-1, 2, (40, dim)) / 4
        keys = base[rng.integers(0, 40, n)].astype(np.float32)
        queries = (rng.integers(-1, 2, (12, dim)) / 4).astype(np.float32)
    return keys, queries


def _brute(queries, keys, ids, k, metric, allowed=None):
    """float64 brute force: (12, k) scores and ids, best first, equal scores by smaller id."""
    q, v = queries.astype(np.float64), keys.astype(np.float64)
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        v = v / np.linalg.norm(v, axis=1, keepdims=True)
    s = q @ v.T if metric != "l2" else ((q[:, None, :] - v[None]) ** 2).sum(-1)  # (12, n)
    sign = -1.0 if metric != "l2" else 1.0
    admitted = np.ones(len(ids), dtype=bool) if allowed is None else np.isin(ids, allowed)
    out_s, out_i = [], []
    for row in s:
        cand = np.flatnonzero(admitted)
        order = np.lexsort((ids[cand], sign * row[cand]))[:k]  # by score, then id
        out_s.append(row[cand][order])
        out_i.append(ids[cand][order])
    return np.array(out_s), np.array(out_i)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["random", "clusters", "ties"])
@pytest.mark.parametrize("metric", ["ip", "l2", "cosine"])
def test_every_path_gives_the_brute_force_ids_and_scores(rng, forced, path, kind, metric):
    keys, queries = _data(rng, kind)
    ids = rng.permutation(10 * len(keys))[: len(keys)].astype(np.int64)  # unsorted ids: ties must go by id
    forced(path)
    index = make_index("Flat", keys.shape[1], metric="l2" if metric == "l2" else "ip", normalize=metric == "cosine")
    assert index.spec == "Flat"
    index.build(torch.from_numpy(ids), torch.from_numpy(keys))
    index.exact_filter_max = 100  # at most max(8 k, 100) live admitted ids: their rows are scored directly
    big = np.sort(ids[rng.random(len(ids)) < 0.6])  # a filter scanned with a mask
    small = np.sort(ids[:50])  # a filter whose rows are scored directly
    for k in (1, 10, 40):
        for allowed in (None, big, small):
            found = index.search(
                torch.from_numpy(queries), k, allowed=None if allowed is None else torch.from_numpy(allowed)
            )
            ref_s, ref_i = _brute(queries, keys, ids, k, metric, allowed)
            tol = 1e-4 * max(1.0, float(np.abs(ref_s).max()))
            np.testing.assert_allclose(found.scores.numpy(), ref_s, rtol=0, atol=tol)
            if kind == "ties" and metric != "cosine":  # every score exact in float32: equal ids, ties by id
                assert torch.equal(found.ids, torch.from_numpy(ref_i)), (k, index.last_path)
            else:  # ids equal wherever float32 rounding cannot swap them (no other score within 1e-5)
                ext, _ = _brute(queries, keys, ids, k + 1, metric, allowed)  # (12, k + 1): the first left out too
                gaps = np.abs(ext[:, :k, None] - ext[:, None, :]) + np.eye(k, ext.shape[1]) > 1e-5  # (12, k, k+1)
                clear = gaps.all(-1)  # (12, k)
                assert np.array_equal(found.ids.numpy()[clear], ref_i[clear]), (k, index.last_path)
            if path not in ("auto", "faiss") and allowed is not small and 8 * k < len(big):
                assert index.last_path == path  # forced paths run as forced (faiss: only where it applies)


def test_half_path_rescores_near_duplicates_without_searching_again(rng, forced):
    """Near-duplicate clusters (20 x 400, noise 1e-2): the bound cannot settle the first k' but a wider k'
    does; no query is searched again in float32, and the ids are float32's."""
    dim = 64
    centres = rng.standard_normal((20, dim)) / np.sqrt(dim)  # unit-ish: the noise moves scores by ~1e-2
    keys = np.repeat(centres, 400, axis=0) + 1e-2 * rng.standard_normal((8000, dim))
    keys = (keys / np.linalg.norm(keys, axis=1, keepdims=True)).astype(np.float32)
    queries = keys[rng.integers(0, 8000, 32)] + (1e-2 * rng.standard_normal((32, dim))).astype(np.float32)
    ids = torch.arange(8000)
    index = make_index("Flat", dim)
    index.build(ids, torch.from_numpy(keys))
    forced("float32")
    exact = index.search(torch.from_numpy(queries), 10)
    forced("bfloat16")
    half = index.search(torch.from_numpy(queries), 10)
    assert index.last_path == "bfloat16"
    assert index.last_widened > 0 and index.last_rechecked == 0
    assert torch.equal(half.ids, exact.ids)
    torch.testing.assert_close(half.scores, exact.scores, rtol=0, atol=1e-5)
    half = index.search(torch.from_numpy(queries), 10)  # starts from the wider k' that settled the data
    assert index.last_rechecked == 0 and torch.equal(half.ids, exact.ids)


def test_the_rule_and_its_overrides(forced, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert forced_path() == "auto"
    assert choose_path(1, cpu, faiss_ok=True) == "float32"  # one query: the matrix-vector scan
    big = choose_path(256, cpu, faiss_ok=True)
    half = fast_half_dtypes(cpu)
    assert big == ("bfloat16" if torch.bfloat16 in half and torch.float16 not in half[:1] else big)
    if torch.float16 not in half:
        assert all(choose_path(b, cpu, faiss_ok=ok) != "float16" for b in (1, 16, 64, 4096) for ok in (True, False))
    if not half:
        assert big == "faiss" and choose_path(256, cpu, faiss_ok=False) == "float32"
    monkeypatch.setenv(ENV_VAR, "faiss")
    assert choose_path(1, cpu, faiss_ok=True) == "faiss"
    assert choose_path(256, cpu, faiss_ok=False) == "float32"  # forced FAISS where it cannot run: float32
    forced("bfloat16")  # the process-wide override wins over the environment
    assert choose_path(1, cpu, faiss_ok=True) == "bfloat16"
    forced(None)
    monkeypatch.setenv(ENV_VAR, "float8")
    with pytest.raises(UnknownOptionError):
        choose_path(1, cpu, faiss_ok=True)
    with pytest.raises(UnknownOptionError):
        set_exact_path("fast")


def test_database_default_index_is_the_exact_flat(tmp_path, rng):
    db = kvsearch.Database(None, dim=16, value_dim=4, score="dot")
    assert db.index.spec == "Flat"
    keys = torch.from_numpy(rng.standard_normal((300, 16)).astype(np.float32))
    db.add(keys, torch.zeros(300, 4))
    queries = torch.from_numpy(rng.standard_normal((5, 16)).astype(np.float32))
    found = db.index.search(queries, 7)
    ref = torch.topk(queries.double() @ keys.double().T, 7, dim=1)
    ids = db.index.ids()
    assert torch.equal(found.ids, ids[ref.indices])


def test_hnsw_ef_construction_is_applied():
    index = make_index("HNSW16", 8, params={"efConstruction": 80})
    index.build(torch.arange(300), torch.randn(300, 8, generator=torch.Generator().manual_seed(0)))
    assert faiss.downcast_index(index.faiss_index).hnsw.efConstruction == 80
    assert index.search_params["efConstruction"] == 80


def test_ivf_train_size_is_applied_and_seeded():
    keys = torch.randn(3000, 16, generator=torch.Generator().manual_seed(1))
    centroids = []
    for _ in range(2):
        index = make_index("IVF16,Flat", 16, params={"train_size": 700})
        index.build(torch.arange(3000), keys)
        assert index.train_size == 700 and not index.is_fallback
        centroids.append(faiss.extract_index_ivf(index.faiss_index).quantizer.reconstruct_n(0, 16))
    everything = make_index("IVF16,Flat", 16)
    everything.build(torch.arange(3000), keys)
    assert everything.train_size is None
    full = faiss.extract_index_ivf(everything.faiss_index).quantizer.reconstruct_n(0, 16)
    assert np.array_equal(centroids[0], centroids[1]) and not np.array_equal(centroids[0], full)


@pytest.mark.parametrize(
    "spec,params,error",
    [
        ("IVF16,Flat", {"train_size": 10}, InvalidArgumentError),  # below what 16 lists need
        ("IVF16,Flat", {"train_size": 1.5}, InvalidArgumentError),
        ("HNSW16", {"efConstruction": 0}, InvalidArgumentError),
        ("HNSW16", {"efConstruction": "80"}, InvalidArgumentError),
        ("HNSW16", {"train_size": 1000}, UnknownOptionError),  # a graph does not train
        ("Flat", {"efConstruction": 80}, UnknownOptionError),
    ],
)
def test_bad_build_parameters_get_a_typed_error(spec, params, error):
    with pytest.raises(error):
        make_index(spec, 16, params=params)
