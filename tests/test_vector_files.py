"""The embeddings of an on-disk store live once, in a file set every process maps (kvsearch.storage.vector_file): a
reader's tensors are views of the mapping, not copies; what a reader in another process sees after each commit is
exactly what was committed; a delete inside the run of records gives the process a private copy until the records
are one run again; the folder stays near the raw vectors' size."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsearch

DIM, VALUE_DIM = 16, 4


def mapped_files(tensor: torch.Tensor) -> set[str]:
    """The names of the files whose mappings (in /proc/self/maps) hold the tensor's memory."""
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if len(parts) >= 6 and lo <= start and end <= hi:
            names.add(Path(parts[5]).name)
    return names


def brute_force_top1(keys: torch.Tensor, ids: torch.Tensor, queries: torch.Tensor) -> list[int]:
    return ids[(queries @ keys.T).argmax(dim=1)].tolist()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)")
def test_readers_map_the_vectors_and_appends_stay_mapped(tmp_path):
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3_000, DIM, generator=gen), torch.randn(3_000, VALUE_DIM, generator=gen)
    writer = kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=VALUE_DIM, score="dot")
    writer.add(keys[:1_000], values[:1_000])
    reader = kvsearch.Database(tmp_path / "db", read_only=True)
    for step, lo in enumerate((1_000, 2_000, 3_000)):
        for db in (writer, reader):
            assert mapped_files(db.store.table.keys) == {"store.sqlite.v1.keys"}, step
            assert mapped_files(db.store.table.values) == {"store.sqlite.v1.values"}, step
        assert torch.equal(reader.store.table.keys, keys[:lo]) and torch.equal(reader.store.table.values, values[:lo])
        queries = torch.randn(5, DIM, generator=gen)
        hits = reader.search(queries, k=1)
        assert [row[0].id for row in hits] == brute_force_top1(keys[:lo], reader.ids(), queries)
        if lo < 3_000:
            writer.add(keys[lo : lo + 1_000], values[lo : lo + 1_000])
            assert len(reader) == lo + 1_000  # caught up: the new rows are on the mapping too


def test_a_delete_inside_the_run_copies_until_the_records_are_one_run_again(tmp_path):
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(600, DIM, generator=gen), torch.randn(600, VALUE_DIM, generator=gen)
    writer = kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=VALUE_DIM, score="dot")
    ids = writer.add(keys, values)
    reader = kvsearch.Database(tmp_path / "db")
    ref = dict(zip(ids, range(600)))

    def check(db: kvsearch.Database) -> None:
        kept = sorted(ref)
        assert db.ids().tolist() == kept
        assert torch.equal(db.store.table.keys, keys[[ref[i] for i in kept]])
        assert torch.equal(db.store.table.values, values[[ref[i] for i in kept]])

    writer.delete(ids[:100])  # the oldest: still one run, still mapped
    for i in ids[:100]:
        del ref[i]
    len(reader)
    assert writer.store.table.keys_shared and reader.store.table.keys_shared
    check(writer), check(reader)
    writer.delete(ids[300:320])  # inside the run: each process copies
    for i in ids[300:320]:
        del ref[i]
    len(reader)
    assert not writer.store.table.keys_shared and not reader.store.table.keys_shared
    check(writer), check(reader)
    writer.delete(ids[320:600])  # holes outnumber the records: a new file set in id order, mapped again
    for i in ids[320:600]:
        del ref[i]
    len(reader)
    assert writer.store.table.keys_shared and reader.store.table.keys_shared
    check(writer), check(reader)
    assert sorted(p.name for p in (tmp_path / "db").glob("store.sqlite.v*")) == [
        "store.sqlite.v2.ids",
        "store.sqlite.v2.keys",
        "store.sqlite.v2.values",
    ]


def test_the_folder_is_near_the_raw_vectors(tmp_path):
    gen = torch.Generator().manual_seed(2)
    n, dim, value_dim = 8_000, 384, 8  # MiniLM's width: the records table adds ~50 bytes a record to ~1.6 KB
    db = kvsearch.Database(tmp_path / "db", dim=dim, value_dim=value_dim, score="dot")
    for _ in range(0, n, 2_000):
        db.add(torch.randn(2_000, dim, generator=gen), torch.randn(2_000, value_dim, generator=gen))
    db.close()
    raw = n * (dim + value_dim) * 4
    on_disk = sum(p.stat().st_size for p in (tmp_path / "db").rglob("*") if p.is_file())
    assert on_disk <= 1.1 * raw, (on_disk, raw)


def _reader(path: str, requests: mp.Queue, replies: mp.Queue) -> None:
    torch.set_num_threads(1)
    db = kvsearch.Database(path, read_only=True)
    while requests.get() is not None:
        ids = db.ids()
        keys, values, _ = db.embeddings(ids)
        digest = hashlib.sha256(keys.numpy().tobytes() + values.numpy().tobytes()).hexdigest()
        replies.put((ids.tolist(), digest, db.key_texts(ids)))


def test_a_reader_in_another_process_sees_each_committed_write_exactly(tmp_path):
    """After every commit (adds, upserts, deletes at the oldest end and inside, a repack, a clear) a reader process
    holds exactly the writer's records: the same ids, the same bytes of every key and value embedding."""
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "db"
    writer = kvsearch.Database(path, encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=128), value_dim=VALUE_DIM)
    counter = iter(range(10**6))

    def fresh(n: int) -> list[str]:
        return [f"key {next(counter)}" for _ in range(n)]

    writer.add(fresh(50), torch.randn(50, VALUE_DIM, generator=gen))
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_reader, args=(str(path), requests, replies), daemon=True)
    child.start()
    rng = np.random.default_rng(3)
    try:
        for step in range(24):
            ids = writer.ids().tolist()
            kind = ["add", "add", "upsert", "delete_oldest", "delete_inside", "clear"][step % 6]
            if kind == "add" or not ids:
                n = int(rng.integers(1, 40))
                writer.add(fresh(n), torch.randn(n, VALUE_DIM, generator=gen))
            elif kind == "upsert":  # the same keys: same ids, new values, new slots in the file set
                chosen = writer.key_texts(sorted(rng.choice(ids, size=min(5, len(ids)), replace=False).tolist()))
                writer.upsert(chosen + fresh(2), torch.randn(len(chosen) + 2, VALUE_DIM, generator=gen))
            elif kind == "delete_oldest":
                writer.delete(ids[: max(1, len(ids) // 4)])
            elif kind == "delete_inside" and len(ids) > 2:
                writer.delete(ids[1 : 1 + len(ids) // 2])
            elif kind == "clear" and step > 12:
                writer.clear()
            want_ids = writer.ids()
            keys, values, _ = writer.embeddings(want_ids)
            want = hashlib.sha256(keys.numpy().tobytes() + values.numpy().tobytes()).hexdigest()
            requests.put(True)
            got_ids, got, texts = replies.get(timeout=120)
            assert got_ids == want_ids.tolist(), (step, kind)
            assert got == want, (step, kind)
            assert texts == writer.key_texts(want_ids), (step, kind)
    finally:
        requests.put(None)
        child.join(timeout=60)
