"""Shared fixtures: each test gets a fresh database and a seeded random generator."""

from __future__ import annotations

import os

import faiss
import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # Haystack pipelines never phone home from tests

AUTHORS = {
    "Zhang": "Aston",
    "Lipton": "Zachary",
    "Li": "Mu",
    "Smola": "Alex",
    "Hu": "Rachel",
    "Werness": "Brent",
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    torch.manual_seed(0)
    return np.random.default_rng(0)


@pytest.fixture
def names_db(tmp_path):
    """The authors database on disk, with the n-gram encoder."""
    import kvsearch

    db = kvsearch.Database(tmp_path / "names", encoder=kvsearch.NgramEncoder())
    db.add(keys=list(AUTHORS), values=list(AUTHORS.values()))
    yield db
    db.close()


def random_db(path, rng, n=200, dim=16, value_dim=8, index="Flat", score="dot"):
    """A database of random key / value embeddings (no text), and the arrays it was built from."""
    import kvsearch

    keys = rng.standard_normal((n, dim)).astype(np.float32)
    values = rng.standard_normal((n, value_dim)).astype(np.float32)
    db = kvsearch.Database(path, dim=dim, value_dim=value_dim, index=index, score=score)
    ids = db.add(keys=keys, values=values)
    return db, np.asarray(ids), keys, values


@pytest.fixture
def one_thread():
    """FAISS builds HNSW in parallel, in an order that varies: one thread makes two builds the same graph."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)
