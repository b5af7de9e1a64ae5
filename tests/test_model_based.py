"""Requirement 4, a reference model: hypothesis state machines against a plain-Python dict + brute force.

Random sequences of add / upsert / delete / lookup / search / query / close-and-reopen run on a database
on disk and on a dict ``key -> value`` with a numpy brute-force search over the same embeddings; they must
agree. Flat index: exact lookups, and every search result a valid top-k (same scores as the brute-force
top-k, tie-tolerant). HNSW / IVF: recall@10 >= 0.95 over the run. Small (1-3) and large (up to 48) batches.

Default run: 500 Flat sequences (250 small-batch + 250 large-batch), plus 60 HNSW and 60 IVF sequences.
``pytest -m slow`` runs 3,000 Flat and 400 HNSW / IVF sequences.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvsearch
from kvsearch import DuplicateKeyError, EmptyDatabaseError, KeyNotFoundError

KEYS = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
VALUES = st.sampled_from(["x", "y", "zz", "mu", "alex"])
ENCODER = dict(dim=8, num_buckets=256, seed=0)
# A RAM-backed folder where there is one: the store fsyncs every commit (synchronous=FULL), which is what
# makes it crash-safe and what would make 500 sequences slow on a disk.
_EMBEDDINGS: dict[str, np.ndarray] = {}
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: small ops are ~5x faster without the thread pool's overhead."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Model(RuleBasedStateMachine):
    """The database against a dict; subclasses pick the index and the batch size."""

    spec = "Flat"
    max_batch = 3
    exact = True
    sequences = 0
    searches = 0
    found = 0
    wanted = 0
    trained_searches = 0
    seed_records = 0

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.mkdtemp(prefix="kvmodel-", dir=SCRATCH)
        self.db = kvsearch.Database(self.folder, encoder=kvsearch.NgramEncoder(**ENCODER), index=self.spec)
        if self.spec.startswith("IVF"):
            self.db.set_search_params(nprobe=2)
        self.model: dict[str, str] = {}
        self.ids: dict[str, int] = {}
        self.max_id = 0
        if self.seed_records:  # approximate indexes start non-trivial (an IVF is trained from 78 vectors)
            keys = [f"{i:03d}" for i in range(self.seed_records)]
            values = [["x", "y", "zz", "mu", "alex"][i % 5] for i in range(self.seed_records)]
            ids = self.db.add(keys, values)
            self.model.update(zip(keys, values))
            self.ids.update(zip(keys, ids))
            self.max_id = max(ids)
        type(self).sequences += 1

    def teardown(self) -> None:
        self.db.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -------------------------------------------------------------- reference

    def embed(self, texts: list[str]) -> np.ndarray:
        """The encoder's embeddings (n, dim), cached per text (the encoder is deterministic)."""
        cache = _EMBEDDINGS
        missing = [t for t in dict.fromkeys(texts) if t not in cache]
        if missing:
            cache.update(zip(missing, self.db.encoder.encode(missing).detach().numpy()))
        return np.stack([cache[t] for t in texts])

    def brute_force(self, query: str, k: int) -> tuple[list[str], np.ndarray]:
        """Stored keys and their cosine scores (the database's default score), best first, top k."""
        keys = sorted(self.model)
        e = self.embed(keys)
        q = self.embed([query])[0]
        e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
        q = q / max(np.linalg.norm(q), 1e-12)
        scores = e @ q
        order = np.argsort(-scores, kind="stable")[:k]
        return [keys[i] for i in order], scores[order]

    # -------------------------------------------------------------- rules

    @rule(data=st.data())
    def add(self, data) -> None:
        keys = data.draw(st.lists(KEYS, min_size=1, max_size=self.max_batch, unique=True))
        values = data.draw(st.lists(VALUES, min_size=len(keys), max_size=len(keys)))
        if any(k in self.model for k in keys):
            with pytest.raises(DuplicateKeyError):
                self.db.add(keys, values)
            return
        ids = self.db.add(keys, values)
        assert len(set(ids)) == len(ids) and min(ids) > self.max_id  # fresh ids, never reused
        self.max_id = max(ids)
        self.model.update(zip(keys, values))
        self.ids.update(zip(keys, ids))

    @rule(data=st.data())
    def add_duplicate_in_batch(self, data) -> None:
        key = data.draw(KEYS)
        with pytest.raises(DuplicateKeyError):
            self.db.add([key, key], ["x", "y"])

    @rule(data=st.data())
    def upsert(self, data) -> None:
        keys = data.draw(st.lists(KEYS, min_size=1, max_size=self.max_batch, unique=True))
        values = data.draw(st.lists(VALUES, min_size=len(keys), max_size=len(keys)))
        ids = self.db.upsert(keys, values)
        for key, value, id_ in zip(keys, values, ids):
            if key in self.ids:
                assert id_ == self.ids[key]  # replaced in place
            else:
                assert id_ > self.max_id
                self.max_id = max(self.max_id, id_)
            self.ids[key] = id_
            self.model[key] = value

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=self.max_batch))
        deleted = self.db.delete(keys)
        assert sorted(deleted) == sorted({self.ids[k] for k in keys})
        for key in set(keys):
            del self.model[key]
            del self.ids[key]

    @rule(key=KEYS)
    def delete_missing(self, key) -> None:
        if key in self.model:
            return
        with pytest.raises(KeyNotFoundError):
            self.db.delete(key)

    @rule(key=KEYS)
    def lookup(self, key) -> None:
        if key in self.model:
            assert self.db.lookup(key) == self.model[key]
            assert key in self.db
        else:
            with pytest.raises(KeyNotFoundError):
                self.db.lookup(key)
            assert self.db.lookup(key, default=None) is None

    @rule(query=KEYS, k=st.sampled_from([1, 3, 10]))
    def search(self, query, k) -> None:
        if not self.model:
            with pytest.raises(EmptyDatabaseError):
                self.db.search(query, k=k)
            return
        hits = self.db.search(query, k=k)
        ref_keys, ref_scores = self.brute_force(query, k)
        got = [h.key for h in hits]
        assert len(set(got)) == len(got) and set(got) <= set(self.model)  # no deleted id comes back
        assert all(h.value == self.model[h.key] and h.id == self.ids[h.key] for h in hits)
        if self.exact:
            assert len(hits) == len(ref_keys)
            np.testing.assert_allclose([h.score for h in hits], ref_scores, atol=1e-5)  # a valid top-k
        else:
            self.count_recall(query, k, hits)
        type(self).searches += 1

    def count_recall(self, query: str, k: int, hits: list) -> None:
        """Add one search to the run's recall@k against the brute-force top-k (ties count as found)."""
        _, ref_scores = self.brute_force(query, k)
        kth = ref_scores[-1] - 1e-5
        type(self).found += sum(1 for h in hits if h.score >= kth)
        type(self).wanted += len(ref_scores)

    @precondition(lambda self: not self.exact and self.model)
    @rule(queries=st.lists(KEYS, min_size=4, max_size=8))
    def recall_at_10(self, queries) -> None:
        for query, hits in zip(queries, self.db.search(queries, k=10)):
            self.count_recall(query, 10, hits)
        type(self).trained_searches += not self.db.index.is_fallback

    @rule(query=KEYS, k=st.sampled_from([2, 5]))
    def query_softmax(self, query, k) -> None:
        if not self.model:
            return
        answer = self.db.query(query, k=k, pooling="softmax")
        ids = answer.ids[answer.ids >= 0].tolist()
        id_to_key = {v: key for key, v in self.ids.items()}
        keys = [id_to_key[i] for i in ids]
        assert len(keys) == min(k, len(self.model))
        # the answer is the softmax blend of those candidates' value embeddings
        e = self.embed(keys)
        q = self.embed([query])[0]
        scores = (e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)) @ (q / max(np.linalg.norm(q), 1e-12))
        w = np.exp(scores - scores.max())
        w /= w.sum()
        values = self.embed([self.model[key] for key in keys])
        np.testing.assert_allclose(answer.output.detach().numpy(), w @ values, atol=1e-4)

    @rule(key=KEYS)
    def query_exact(self, key) -> None:
        if not self.model:
            return
        answer = self.db.query(key, k=3, pooling="exact")
        assert answer.found == (key in self.model)
        assert answer.value == self.model.get(key)

    @rule()
    def reopen(self) -> None:
        self.db.close()
        self.db = kvsearch.Database(self.folder)

    @invariant()
    def same_size(self) -> None:
        assert len(self.db) == len(self.model)


class SmallBatches(Model):
    max_batch = 3


class LargeBatches(Model):
    max_batch = 48


class Hnsw(Model):
    spec = "HNSW8"
    max_batch = 24
    exact = False
    seed_records = 80


class Ivf(Model):
    spec = "IVF2,Flat"  # trained once 78 vectors exist; nprobe=2 (all lists) is then exact
    max_batch = 48
    exact = False
    seed_records = 80


def _run(machine: type[Model], examples: int, steps: int = 12) -> None:
    machine.sequences = machine.searches = machine.found = machine.wanted = machine.trained_searches = 0
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        ),
    )


@pytest.mark.parametrize("machine", [SmallBatches, LargeBatches], ids=["small-batches", "large-batches"])
def test_flat_matches_reference(machine):
    _run(machine, 250)
    print(f"{machine.__name__}: {machine.sequences} sequences, {machine.searches} searches")
    assert machine.sequences >= 250


@pytest.mark.parametrize("machine", [Hnsw, Ivf], ids=["hnsw", "ivf"])
def test_approximate_recall(machine):
    _run(machine, 30, steps=15)
    recall = machine.found / max(machine.wanted, 1)
    print(
        f"{machine.__name__}: {machine.sequences} sequences, {machine.searches} searches, "
        f"recall@k {recall:.3f}, {machine.trained_searches} on a trained index"
    )
    assert machine.wanted > 200 and machine.trained_searches > 10  # the real (trained) index was searched
    assert recall >= 0.95


@pytest.mark.slow
@pytest.mark.parametrize("machine", [SmallBatches, LargeBatches, Hnsw, Ivf])
def test_long_runs(machine):
    _run(machine, 1500 if machine.exact else 400)
    if not machine.exact:
        assert machine.found / max(machine.wanted, 1) >= 0.95
