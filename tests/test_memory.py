"""Issue 21, part 6: a database in memory as a kNN memory that keeps up with training.

- ``capacity=`` against a reference ``collections.deque(maxlen=capacity)`` of (id, key, value) rows: a hypothesis
  state machine of adds (smaller and larger than the capacity), deletes, ``clear()`` and adds rolled back inside
  ``atomic()``; after every step the ids in order, ``len``, the stored embeddings, ``candidates`` and ``search``
  equal a brute force over the deque, and no dropped record can be found (dot, cosine and gaussian scores: the
  exact index's inner-product, cosine-over-raw-keys and L2 paths). Random float keys: no ties.
- ``clear()`` in memory and on disk (one transaction; another handle on the folder sees it; ids keep increasing).
- ``capacity`` checked: a positive int, in memory only (typed errors, nothing created).
- What an add costs, counted (not timed): the stored tensors and the exact index's derived norms move to a new
  buffer once per many adds (growth, or dropped rows outnumbering the live ones), never once per add.
- On CUDA (``-m gpu``): the memory, its exact index and the candidates stay on the device.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvsearch import (
    Database,
    EmptyDatabaseError,
    InvalidArgumentError,
    KeyNotFoundError,
    NgramEncoder,
    NotSupportedError,
)

DIM, VALUE_DIM = 6, 3
QUERIES = torch.randn(3, DIM, generator=torch.Generator().manual_seed(21))  # (3, DIM)


def brute_force(queries: torch.Tensor, keys: torch.Tensor, ids: list[int], k: int, score: str) -> list[list[int]]:
    """The ids of the top ``min(k, n)`` rows per query, best first (equal scores: the smaller id first, as the
    index orders them; ``ids`` ascend), in float64: (batch, k) as lists."""
    q, K = queries.double(), keys.double()  # (b, dim), (n, dim)
    if score == "cosine":
        s = F.normalize(q, dim=-1) @ F.normalize(K, dim=-1).T  # (b, n)
    elif score == "gaussian":
        s = -(torch.cdist(q, K) ** 2)  # (b, n) the L2 index ranks by squared distance
    else:
        s = q @ K.T  # (b, n)
    top = torch.sort(-s, dim=1, stable=True).indices[:, :k]  # (b, k)
    return [[ids[i] for i in row] for row in top.tolist()]


def rows(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random keys (n, DIM) and values (n, VALUE_DIM)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randn(n, VALUE_DIM, generator=g)


class Memory(RuleBasedStateMachine):
    """A capacity-bounded database in memory against a deque(maxlen=capacity) of (id, key, value)."""

    @initialize(capacity=st.sampled_from([1, 4, 37]), score=st.sampled_from(["dot", "cosine", "gaussian"]))
    def start(self, capacity: int, score: str) -> None:
        self.capacity, self.score = capacity, score
        self.db = Database(None, dim=DIM, value_dim=VALUE_DIM, capacity=capacity, score=score, device="cpu")
        self.ref: deque[tuple[int, torch.Tensor, torch.Tensor]] = deque(maxlen=capacity)
        self.next_id = 1  # ids are never reused: the next add starts here
        self.gone: list[int] = []  # ids dropped, deleted or cleared

    def _forget(self, ids: list[int]) -> None:
        self.gone = (self.gone + ids)[-50:]

    @rule(n=st.sampled_from([1, 3, 36, 37, 38, 90]), seed=st.integers(0, 2**16))
    def add(self, n: int, seed: int) -> None:
        keys, values = rows(seed * 100_003 + self.next_id, n)  # rows of their own: generic data, no ties
        before = [r[0] for r in self.ref]
        ids = self.db.add(keys, values)
        assert ids == list(range(self.next_id, self.next_id + n))  # every row gets an id, kept or not
        self.next_id += n
        self.ref.extend(zip(ids, keys, values))
        kept = {r[0] for r in self.ref}
        self._forget([i for i in before + ids if i not in kept])

    @rule(pick=st.integers(0, 10**6))
    def delete(self, pick: int) -> None:
        if not self.ref:
            return
        at = pick % len(self.ref)
        id_ = self.ref[at][0]
        assert self.db.delete(id_) == [id_]
        del self.ref[at]
        self._forget([id_])

    @rule()
    def clear(self) -> None:
        self._forget([r[0] for r in self.ref])
        self.db.clear()
        self.ref.clear()

    @rule(n=st.sampled_from([1, 37, 90]), seed=st.integers(0, 2**16))
    def add_rolled_back(self, n: int, seed: int) -> None:
        """An add that drops the oldest records, inside atomic() and then failing: nothing of it is kept."""
        keys, values = rows(seed, n)
        with pytest.raises(RuntimeError, match="rolled back"), self.db.atomic():
            self.db.add(keys, values)
            raise RuntimeError("rolled back")  # the ids it took are never committed: the next add takes them

    @invariant()
    def agrees(self) -> None:
        ids = [r[0] for r in self.ref]
        db = self.db
        assert len(db) == len(ids) <= self.capacity
        assert db.ids().tolist() == ids
        if self.gone:
            assert not db.embeddings(self.gone)[2].any()  # a dropped record is gone for good
        if not ids:
            assert db.search(QUERIES, 3) == [[], [], []]
            with pytest.raises(EmptyDatabaseError):
                db.candidates(QUERIES, 3)
            return
        keys = torch.stack([r[1] for r in self.ref])  # (n, DIM)
        values = torch.stack([r[2] for r in self.ref])  # (n, VALUE_DIM)
        got_keys, got_values, mask = db.embeddings(ids)
        assert mask.all() and torch.equal(got_keys, keys) and torch.equal(got_values, values)
        for k in (1, 4, self.capacity + 2):
            expected = brute_force(QUERIES, keys, ids, k, self.score)
            assert db.candidates(QUERIES, k).ids.tolist() == expected
            assert [[hit.id for hit in hits] for hits in db.search(QUERIES, k)] == expected


Memory.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemory = Memory.TestCase


def test_memory_at_training_sizes() -> None:
    """Adds of 256 to 4,096 rows through a memory of 3,000, k = 32: the newest rows, searched exactly."""
    db = Database(None, dim=DIM, value_dim=VALUE_DIM, capacity=3_000, score="dot", device="cpu")
    ref: deque[tuple[int, torch.Tensor]] = deque(maxlen=3_000)
    queries = torch.randn(16, DIM, generator=torch.Generator().manual_seed(1))  # (16, DIM)
    added = 0
    for step, n in enumerate([256, 1_000, 4_096, 256, 2_999, 3_001, 512]):
        keys, _ = rows(step, n)
        ids = db.add(keys, torch.zeros(n, VALUE_DIM))
        ref.extend(zip(ids, keys))
        added += n
        stored = [r[0] for r in ref]
        assert db.ids().tolist() == stored and len(db) == min(added, 3_000)
        expected = brute_force(queries, torch.stack([r[1] for r in ref]), stored, 32, "dot")
        assert db.candidates(queries, 32).ids.tolist() == expected


def test_capacity_with_texts() -> None:
    """Records with key texts: a dropped key is gone from the key maps; an upsert keeps the record's place."""
    db = Database(None, encoder=NgramEncoder(), capacity=3, device="cpu")
    assert db.add(["a1", "b2", "c3", "d4"], ["x", "y", "z", "w"]) == [1, 2, 3, 4]
    assert "a1" not in db and db.lookup("a1", None) is None and db.lookup("b2") == "y"
    assert db.upsert(["c3", "e5"], ["zz", "v"]) == [3, 5]  # c3 replaced in place; e5 new: b2, the oldest, goes
    assert db.ids().tolist() == [3, 4, 5] and db.lookup("b2", None) is None and db.lookup("c3") == "zz"
    assert db.key_texts([3, 4, 5]) == ["c3", "d4", "e5"]
    assert db.add(["b2"], ["again"]) == [6] and db.lookup("b2") == "again"  # a dropped key may come back


@pytest.mark.parametrize("capacity", [0, -5, 2.5, True, "100", 10**3 + 0.0])
def test_capacity_must_be_a_positive_int(capacity: object) -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        Database(None, dim=DIM, value_dim=VALUE_DIM, capacity=capacity)


def test_capacity_is_for_memory_only(tmp_path) -> None:
    with pytest.raises(NotSupportedError, match="in memory"):
        Database(tmp_path / "db", dim=DIM, value_dim=VALUE_DIM, capacity=10)
    assert not (tmp_path / "db").exists()  # refused before anything was made


def test_clear_in_memory_keeps_ids_increasing() -> None:
    db = Database(None, dim=DIM, value_dim=VALUE_DIM, score="dot", device="cpu")
    keys, values = rows(0, 20)
    assert db.add(keys, values) == list(range(1, 21))
    db.clear()
    assert len(db) == 0 and db.ids().tolist() == [] and db.search(QUERIES, 2) == [[], [], []]
    with pytest.raises(KeyNotFoundError):
        db.get(5)
    assert db.add(keys[:3], values[:3]) == [21, 22, 23]  # never reused
    assert db.candidates(QUERIES, 5).ids.tolist() == brute_force(QUERIES, keys[:3], [21, 22, 23], 5, "dot")
    db.clear()
    db.clear()  # clearing an empty database is harmless
    assert len(db) == 0


def test_clear_on_disk(tmp_path) -> None:
    """One transaction: another handle catches up on it, a reopen finds the database empty, ids keep growing."""
    path = tmp_path / "db"
    keys, values = rows(1, 30)
    with Database(path, dim=DIM, value_dim=VALUE_DIM, score="dot") as db, Database(path) as other:
        db.add(keys, values, metadata=[{"i": i} for i in range(30)])
        assert len(other) == 30
        db.clear()
        assert len(other) == 0 and other.search(QUERIES, 2) == [[], [], []]
        assert db.add(keys[:2], values[:2]) == [31, 32]
        assert other.ids().tolist() == [31, 32] and other.metadata_of([31]) == {31: {}}
    with Database(path) as db:
        assert db.ids().tolist() == [31, 32]
        assert db.candidates(QUERIES, 2).ids.tolist() == brute_force(QUERIES, keys[:2], [31, 32], 2, "dot")


def test_clear_inside_atomic_is_rolled_back() -> None:
    db = Database(None, dim=DIM, value_dim=VALUE_DIM, capacity=10, device="cpu")
    keys, values = rows(2, 12)
    db.add(keys, values)
    with pytest.raises(RuntimeError, match="undo"), db.atomic():
        db.clear()
        assert len(db) == 0
        raise RuntimeError("undo")
    assert db.ids().tolist() == list(range(3, 13))


def _storages(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("capacity", [None, 500])
def test_adds_do_not_copy_the_memory(capacity: int | None) -> None:
    """Counted, not timed: 120 adds of 50 rows (with a search after each, the index following) move the stored
    keys and the index's derived norms (cosine) to a new buffer a few times (growth by an eighth; or once the
    dropped rows outnumber the live ones), never once per add; the index never derives every row again."""
    db = Database(None, dim=DIM, value_dim=VALUE_DIM, capacity=capacity, score="cosine", device="cpu")
    buffers: dict[str, set[int]] = {"keys": set(), "values": set(), "ids": set(), "norms": set()}
    for step in range(120):
        keys, values = rows(step, 50)
        db.add(keys, values)
        db.candidates(QUERIES, 4)
        derived = db.index.derived()
        assert derived.keys is db.store.table.keys  # the index searches the store's own keys, no copy
        buffers["keys"].add(_storages(db.store.table.keys))
        buffers["values"].add(_storages(db.store.table.values))
        buffers["ids"].add(_storages(db.store.table.ids))
        buffers["norms"].add(_storages(derived.norm_term))
    assert len(db) == (6_000 if capacity is None else capacity)
    # growth by an eighth from 114 rows to 6,000: ~34 buffers; a window of 500: ~20 while it grows, then one per
    # ~500 rows dropped (~11). A copy per add would be 120.
    assert all(len(seen) <= 45 for seen in buffers.values()), {name: len(seen) for name, seen in buffers.items()}


@pytest.mark.gpu
def test_memory_stays_on_the_gpu() -> None:
    """A memory on CUDA: stored tensors, the exact index's derived data and the candidates on the device; the
    device ids and norms grown in place (no copy of every id to the device per add); answers equal a float64
    brute force on the CPU."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    db = Database(None, dim=16, value_dim=8, capacity=700, score="cosine", device=device)
    ref: deque[tuple[int, torch.Tensor]] = deque(maxlen=700)
    queries = torch.randn(32, 16, device=device)  # (32, 16)
    buffers: dict[str, set[int]] = {"keys": set(), "device_ids": set(), "norms": set()}
    for _ in range(60):
        keys = torch.randn(64, 16, device=device)  # (64, 16)
        ids = db.add(keys, torch.randn(64, 8, device=device))
        ref.extend(zip(ids, keys.cpu()))
        found = db.candidates(queries, 8)
        assert found.keys.is_cuda and found.values.is_cuda and found.ids.is_cuda
        derived = db.index.derived()
        assert db.store.table.keys.is_cuda and db.store.table.values.is_cuda
        assert derived.keys.is_cuda and derived.device_ids.is_cuda and derived.norm_term.is_cuda
        buffers["keys"].add(_storages(db.store.table.keys))
        buffers["device_ids"].add(_storages(derived.device_ids))
        buffers["norms"].add(_storages(derived.norm_term))
        stored = [r[0] for r in ref]
        expected = brute_force(queries.cpu(), torch.stack([r[1] for r in ref]), stored, 8, "cosine")
        assert found.ids.tolist() == expected
    assert all(len(seen) <= 30 for seen in buffers.values()), {name: len(seen) for name, seen in buffers.items()}
