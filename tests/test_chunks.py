"""One copy of each embedding, in the store's file set on disk (kvsearch.storage.vector_file) or its chunks in memory
(kvsearch.storage.chunks): what is read back, by the writer after a reopen and by a second handle catching up, is what
a reference dict holds, through adds, replacements (new slots on disk, in place in memory), deletes and repacks; and
the bytes on disk stay near the raw embeddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import kvsearch

DIM, VALUE_DIM = 6, 3


class StoredEmbeddings(RuleBasedStateMachine):
    """A writer and a reader handle on one folder against ``{id: (key, value)}``."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.path = f"{self.tmp.name}/db"
        self.writer = kvsearch.Database(self.path, dim=DIM, value_dim=VALUE_DIM, score="dot")
        self.reader = kvsearch.Database(self.path)
        self.ref: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.rng = np.random.default_rng(0)

    @initialize(seed=st.integers(0, 2**16))
    def seed(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def teardown(self) -> None:
        self.writer.close()
        self.reader.close()
        self.tmp.cleanup()

    def stored(self, fraction: float) -> list[int]:
        ids = sorted(self.ref)
        take = int(round(fraction * len(ids)))
        return sorted(self.rng.choice(ids, size=take, replace=False).tolist()) if take else []

    @rule(n=st.sampled_from([1, 2, 7, 63, 64, 65, 200]))
    def add(self, n: int) -> None:
        keys = self.rng.standard_normal((n, DIM)).astype(np.float32)
        values = self.rng.standard_normal((n, VALUE_DIM)).astype(np.float32)
        ids = self.writer.add(torch.from_numpy(keys), torch.from_numpy(values))
        assert len(ids) == n and min(ids) > max(self.ref, default=0)
        self.ref.update({id_: (keys[i], values[i]) for i, id_ in enumerate(ids)})

    @rule(fraction=st.sampled_from([0.05, 0.3, 1.0]))
    def replace_values(self, fraction: float) -> None:
        ids = self.stored(fraction)
        if not ids:
            return
        keys = np.stack([self.ref[i][0] for i in ids])  # (m, DIM): equal stored keys, replaced in place
        values = self.rng.standard_normal((len(ids), VALUE_DIM)).astype(np.float32)
        assert self.writer.upsert(torch.from_numpy(keys), torch.from_numpy(values)) == ids
        self.ref.update({id_: (keys[i], values[i]) for i, id_ in enumerate(ids)})

    @rule(fraction=st.sampled_from([0.02, 0.5, 0.9, 1.0]))
    def delete(self, fraction: float) -> None:
        ids = self.stored(fraction)
        if ids:
            assert self.writer.delete(ids) == ids
            for id_ in ids:
                del self.ref[id_]

    @rule()
    def reopen_writer(self) -> None:
        self.writer.close()
        self.writer = kvsearch.Database(self.path)
        self.check(self.writer)

    @rule()
    def reader_catches_up(self) -> None:
        self.check(self.reader)

    @invariant()
    def writer_agrees(self) -> None:
        assert len(self.writer) == len(self.ref)
        for id_ in self.stored(0.1):
            got = self.writer.get(id_)
            assert np.array_equal(got.key_embedding.numpy(), self.ref[id_][0])

    def check(self, db: kvsearch.Database) -> None:
        ids = sorted(self.ref)
        assert db.ids().tolist() == ids
        for id_ in ids:
            got = db.get(id_)
            assert np.array_equal(got.key_embedding.numpy(), self.ref[id_][0])
            assert np.array_equal(got.value_embedding.numpy(), self.ref[id_][1])
        if ids:  # the in-memory tensors the search and pooling read agree too
            keys = np.stack([self.ref[i][0] for i in ids])  # (n, DIM)
            probe = torch.from_numpy(keys[len(ids) // 2])  # (DIM,)
            top = db.search(probe, k=1)[0].id
            assert top == ids[int((keys @ keys[len(ids) // 2]).argmax())]


StoredEmbeddings.TestCase.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_stored_embeddings_match_a_reference = StoredEmbeddings.TestCase


@pytest.mark.parametrize("n", [1_000, 20_000])
def test_bytes_on_disk_stay_near_the_raw_embeddings(tmp_path, n):
    """384-d keys and values, no text: the folder holds ~one copy of each embedding (issue 15's <= 1.15x)."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "db"
    with kvsearch.Database(path, dim=384, value_dim=384, score="dot") as db:
        for lo in range(0, n, 5_000):
            m = min(5_000, n - lo)
            db.add(torch.randn(m, 384, generator=gen), torch.randn(m, 384, generator=gen))
    on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    raw = n * 2 * 384 * 4
    assert on_disk <= 1.15 * raw + 2**20, f"{on_disk / n:.0f} bytes a record for {raw / n:.0f} of embeddings"


def test_deleting_most_records_gives_the_space_back_to_new_ones(tmp_path):
    """A delete that leaves more emptied slots than records writes the records again: the file stops growing."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "db"
    with kvsearch.Database(path, dim=64, value_dim=64, score="dot") as db:
        ids = db.add(torch.randn(4_000, 64, generator=gen), torch.randn(4_000, 64, generator=gen))

    def folder_bytes() -> int:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    size = folder_bytes()  # closed: the WAL is in the file
    with kvsearch.Database(path) as db:
        rng = np.random.default_rng(0)
        for _ in range(5):  # delete 90% (some of every chunk), add as many: without repacking, 5 x 3,600 slots more
            gone = sorted(rng.choice(ids, size=int(0.9 * len(ids)), replace=False).tolist())
            db.delete(gone)
            new = db.add(torch.randn(len(gone), 64, generator=gen), torch.randn(len(gone), 64, generator=gen))
            ids = sorted(set(ids) - set(gone)) + new
        kept = {i: db.get(i).key_embedding.clone() for i in ids[::97]}
    with kvsearch.Database(path) as again:
        assert len(again) == 4_000 and all(torch.equal(again.get(i).key_embedding, k) for i, k in kept.items())
    assert folder_bytes() <= 2.5 * size  # the store and its file set (the old sets removed at each repack)


@pytest.mark.parametrize("reserved", ["keys and values", "keys only"])
def test_a_reserved_mirror_grows_without_a_copy(monkeypatch, reserved):
    """In memory (nothing to map: an on-disk store's tensors are views of its file set, tests/test_vector_files.py),
    past RESERVE_FROM_BYTES the keys / values are views of reserved memory: appends write the new rows in place, and
    what is read equals what was written (also when only the wider keys pass the threshold and the values grow as a
    plain buffer)."""
    import kvsearch.storage.buffers

    threshold = 0 if reserved == "keys and values" else DIM * 4 * 1_000  # a buffer of 1,000+ rows of keys
    monkeypatch.setattr(kvsearch.storage.buffers, "RESERVE_FROM_BYTES", threshold)
    gen = torch.Generator().manual_seed(0)
    db = kvsearch.Database(None, dim=DIM, value_dim=VALUE_DIM, score="dot")
    keys, values = torch.randn(3_000, DIM, generator=gen), torch.randn(3_000, VALUE_DIM, generator=gen)
    db.add(keys[:1_000], values[:1_000])
    where = (db.store.table.keys.data_ptr(), db.store.table.values.data_ptr())
    for lo in (1_000, 2_000):
        db.add(keys[lo : lo + 1_000], values[lo : lo + 1_000])
    now = (db.store.table.keys.data_ptr(), db.store.table.values.data_ptr())
    assert now == where if reserved == "keys and values" else now[0] == where[0]
    assert torch.equal(db.store.table.keys, keys) and torch.equal(db.store.table.values, values)


def test_a_record_committed_after_the_tensors_were_loaded_is_fetched_from_the_store(tmp_path):
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "db"
    reader = kvsearch.Database(path, dim=DIM, value_dim=VALUE_DIM, score="dot")
    reader.add(torch.randn(10, DIM, generator=gen), torch.randn(10, VALUE_DIM, generator=gen))
    writer = kvsearch.Database(path)
    keys, values = torch.randn(3, DIM, generator=gen), torch.randn(3, VALUE_DIM, generator=gen)
    new = writer.add(keys, values)
    fetched = reader.store.fetch([1, *new])  # the store's own read: no catch-up first
    assert sorted(fetched) == [1, *new]
    for i, id_ in enumerate(new):
        assert torch.equal(fetched[id_].key_embedding, keys[i]) and torch.equal(fetched[id_].value_embedding, values[i])
    assert torch.equal(fetched[1].key_embedding, writer.get(1).key_embedding)
    writer.close()
    reader.close()
