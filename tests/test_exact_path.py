"""The default exact index ("Flat"): every path it can take gives a brute force's ids and scores, ties by id;
the half-precision path settles near-duplicate data without searching queries again; ANN build parameters."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

import kvsearch
from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.index.exact_path import (
    ENV_VAR,
    HALF_MARGIN,
    HALF_MIN_BATCH,
    RETRY_EVERY,
    TRIALS,
    PathChooser,
    fast_half_dtypes,
    forced_path,
    set_exact_path,
)
from kvsearch.index.factory import make_index

PATHS = ["float32", "bfloat16", "float16", "faiss", "auto"]


@pytest.fixture
def forced():
    """Force a path for the test; back to the rule afterwards."""
    yield set_exact_path
    set_exact_path(None)


def _data(rng: np.random.Generator, kind: str, n: int = 1500, dim: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """keys (n, dim), queries (20, dim) float32 of one kind (20 >= HALF_MIN_BATCH: ``auto`` times the half path)."""
    if kind in ("random", "unit", "norms"):  # unnormalised (what a model makes), unit-norm, norms spread 100x
        keys = rng.standard_normal((n, dim)).astype(np.float32)
        queries = rng.standard_normal((20, dim)).astype(np.float32)
        if kind == "unit":
            keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        elif kind == "norms":
            keys *= (10.0 ** rng.uniform(-1, 1, (n, 1))).astype(np.float32)
    elif kind == "clusters":  # near-duplicate clusters: 15 centres x 100, noise 1e-2 per coordinate
        centres = rng.standard_normal((15, dim)) / np.sqrt(dim)
        noise = 1e-2 * rng.standard_normal((n // 15 * 15, dim))
        keys = (np.repeat(centres, n // 15, axis=0) + noise).astype(np.float32)
        queries = (centres[rng.integers(0, 15, 20)] + 1e-2 * rng.standard_normal((20, dim))).astype(np.float32)
    else:  # "ties": entries in {-1, 0, 1} / 4 and many repeated rows: every score is exact, many are equal
        base = rng.integers(-1, 2, (40, dim)) / 4
        keys = base[rng.integers(0, 40, n)].astype(np.float32)
        queries = (rng.integers(-1, 2, (20, dim)) / 4).astype(np.float32)
    return keys, queries


def _brute(queries, keys, ids, k, metric, allowed=None):
    """float64 brute force: (20, k) scores and ids, best first, equal scores by smaller id."""
    q, v = queries.astype(np.float64), keys.astype(np.float64)
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        v = v / np.linalg.norm(v, axis=1, keepdims=True)
    s = q @ v.T if metric != "l2" else ((q[:, None, :] - v[None]) ** 2).sum(-1)  # (20, n)
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
@pytest.mark.parametrize("kind", ["random", "unit", "norms", "clusters", "ties"])
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
                assert torch.equal(found.ids, torch.from_numpy(ref_i)), (k, found.path)
            else:  # ids equal wherever float32 rounding cannot swap them (no other score within 1e-5)
                ext, _ = _brute(queries, keys, ids, k + 1, metric, allowed)  # (20, k + 1): the first left out too
                gaps = np.abs(ext[:, :k, None] - ext[:, None, :]) + np.eye(k, ext.shape[1]) > 1e-5  # (20, k, k+1)
                clear = gaps.all(-1)  # (20, k)
                assert np.array_equal(found.ids.numpy()[clear], ref_i[clear]), (k, found.path)
            if path not in ("auto", "faiss") and allowed is not small and 8 * k < len(big):
                assert found.path == path  # forced paths run as forced (faiss: only where it applies)


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
    assert half.path == "bfloat16"
    assert index.last_widened > 0 and index.last_rechecked == 0
    assert torch.equal(half.ids, exact.ids)
    torch.testing.assert_close(half.scores, exact.scores, rtol=0, atol=1e-5)
    half = index.search(torch.from_numpy(queries), 10)  # starts from the wider k' that settled the data
    assert index.last_rechecked == 0 and torch.equal(half.ids, exact.ids)


def test_the_overrides(forced, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert forced_path() == "auto"
    chooser = PathChooser()
    assert chooser.choose(1, 1000, cpu, faiss_ok=True) == "float32"  # one query: the matrix-vector scan
    if torch.float16 not in fast_half_dtypes(cpu):
        picks = {chooser.choose(b, 1000, cpu, faiss_ok=ok) for b in (1, 16, 64, 4096) for ok in (True, False)}
        assert "float16" not in picks and "faiss" not in picks  # FAISS only when forced
    monkeypatch.setenv(ENV_VAR, "faiss")
    assert chooser.choose(1, 1000, cpu, faiss_ok=True) == "faiss"
    assert chooser.choose(256, 1000, cpu, faiss_ok=False) == "float32"  # forced FAISS where it cannot run: float32
    forced("bfloat16")  # the process-wide override wins over the environment
    assert chooser.choose(1, 1000, cpu, faiss_ok=True) == "bfloat16"
    forced(None)
    monkeypatch.setenv(ENV_VAR, "float8")
    with pytest.raises(UnknownOptionError):
        chooser.choose(1, 1000, cpu, faiss_ok=True)
    with pytest.raises(UnknownOptionError):
        set_exact_path("fast")


def _timed(chooser: PathChooser, half_cost: float, calls: int, batch: int = 64, rows: int = 5000) -> list[str]:
    """The paths ``chooser`` picks over ``calls`` calls where float32 costs 1 and the half path ``half_cost``."""
    picks = []
    for _ in range(calls):
        path = chooser.choose(batch, rows, torch.device("cuda"), faiss_ok=False)  # CUDA: float16 is fast there
        picks.append(path)
        chooser.record(batch, rows, path, half_cost if path != "float32" else 1.0)
    return picks


@pytest.mark.parametrize("half_cost", [0.3, 0.8, HALF_MARGIN + 0.01, 2.0, 6.0])
def test_the_chooser_keeps_the_half_path_only_where_it_was_measured_faster(forced, monkeypatch, half_cost):
    """Both paths are timed first; the half one is kept only at most HALF_MARGIN of float32's time, and the path not
    taken is timed again every RETRY_EVERY calls (so a slower path costs at most 1 / RETRY_EVERY of the calls)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    picks = _timed(PathChooser(), half_cost, 4 * RETRY_EVERY)
    assert picks[:TRIALS] == ["float32"] * TRIALS and picks[TRIALS : 2 * TRIALS] == ["float16"] * TRIALS
    kept = "float16" if half_cost <= HALF_MARGIN else "float32"
    others = [i for i, p in enumerate(picks) if i >= 2 * TRIALS and p != kept]
    assert others == [i for i in range(2 * TRIALS, len(picks)) if i % RETRY_EVERY == RETRY_EVERY - 1]


def test_the_chooser_follows_a_change_and_keeps_classes_apart(forced, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    chooser = PathChooser()
    # (the last call of each block of RETRY_EVERY is a retry of the other path)
    assert set(_timed(chooser, 0.3, 3 * RETRY_EVERY)[-RETRY_EVERY // 2 : -1]) == {"float16"}
    # the keys changed: the half path now needs searching again (timed at 3x); the retries and the last 5 times
    # per path bring float32 back
    assert set(_timed(chooser, 3.0, 12 * RETRY_EVERY)[-RETRY_EVERY // 2 : -1]) == {"float32"}
    # another batch size or key count is a class of its own: timed afresh
    assert _timed(chooser, 0.3, 2 * TRIALS, batch=1024)[TRIALS:] == ["float16"] * TRIALS
    assert _timed(chooser, 0.3, 2 * TRIALS, rows=50_000)[TRIALS:] == ["float16"] * TRIALS
    assert _timed(chooser, 0.3, 3, batch=HALF_MIN_BATCH - 1) == ["float32"] * 3  # a few queries: float32, untimed


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
