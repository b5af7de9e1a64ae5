"""Requirement 5, concurrency: threads, processes and fork().

- Many threads query while one thread writes: no error, and no torn read (each batch all or nothing).
- Two processes on one folder: one writer at a time (a file lock with a bounded wait, then
  DatabaseLockedError), readers keep working while another process holds the lock, no write is lost when
  two processes write at once, and a writer whose view is stale reloads the store before it writes.
- fork(): a child uses the parent's open database safely (its own SQLite connection and lock). These parents run
  one thread; a child forked after the default thread count (torch's and FAISS's OpenMP workers live) is
  tests/test_fork.py's.
- A reader beside a writer process catches up on its commits from the change log: whole batches, no full reload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import kvsearch
from kvsearch import DatabaseLockedError

DIM, BATCH = 8, 25
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch(b: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """BATCH random keys whose values carry the batch number (value[:, 0] == b)."""
    keys = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    values = np.full((BATCH, 2), float(b), dtype=np.float32)
    return keys, values


@pytest.mark.parametrize("index", ["Flat", "IVF4,Flat"])  # exact searches (IVF: all lists probed)
def test_readers_never_see_a_torn_batch(tmp_path, index):
    rng = np.random.default_rng(0)
    params = {"nprobe": 4} if index.startswith("IVF") else None  # IVF trains at 156 records, mid-run
    db = kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=2, index=index, score="dot", search_params=params)
    db.add(*batch(0, rng))
    n_batches, errors, reads = 40, [], [0]
    done = threading.Event()

    def reader(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            while not done.is_set():
                q = torch.from_numpy(r.standard_normal((2, DIM)).astype(np.float32))
                hits = db.search(q, k=2000)
                for row in hits:
                    counts = np.bincount([int(h.value[0]) for h in row], minlength=n_batches)
                    if not set(counts.tolist()) <= {0, BATCH}:
                        errors.append(f"torn read: batch sizes {counts.tolist()}")
                    seen = np.flatnonzero(counts)  # added in order, oldest deleted first: a contiguous run
                    if len(seen) and seen.max() - seen.min() + 1 != len(seen):
                        errors.append(f"batches seen out of order: {seen.tolist()}")
                answer = db.query(q, k=16)
                if not torch.isfinite(answer.output).all():
                    errors.append("non-finite answer")
                reads[0] += 1
        except Exception as exc:  # any error in a reader fails the test
            errors.append(repr(exc))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for b in range(1, n_batches):
        db.add(*batch(b, rng))
        if b % 10 == 0:
            db.delete(db.store.table.ids[:BATCH].tolist())  # delete the whole oldest batch (ids are in batch order)
    done.set()
    for t in threads:
        t.join(timeout=60)
    print(f"{index}: 4 reader threads, {reads[0]} reads during {n_batches - 1} batch adds + 3 batch deletes")
    assert not errors, errors[:5]
    assert reads[0] >= 20, f"only {reads[0]} reads overlapped the writes"
    assert len(db) == (n_batches - 3) * BATCH
    db.close()


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO},
    )


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, str(os.getpid()).encode(), 0)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_second_writer_gets_locked_error_and_readers_keep_working(tmp_path):
    rng = np.random.default_rng(1)
    db = kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=2, score="dot", lock_timeout=0.3)
    db.add(*batch(0, rng))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "db" / "write.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        q = torch.from_numpy(rng.standard_normal((3, DIM)).astype(np.float32))
        before = [[h.id for h in row] for row in db.search(q, k=5)]
        start = time.monotonic()
        with pytest.raises(DatabaseLockedError, match=f"pid {holder.pid}"):
            db.add(*batch(1, rng))
        waited = time.monotonic() - start
        assert 0.3 <= waited < 5  # a bounded wait, not a hang
        with pytest.raises(DatabaseLockedError):
            db.delete(db.store.table.ids[:1].tolist())
        assert [[h.id for h in row] for row in db.search(q, k=5)] == before  # readers are never blocked
        assert len(db) == BATCH
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=10)
    db.add(*batch(1, rng))  # the holder died / released: writes go through again
    assert len(db) == 2 * BATCH
    db.close()


WRITER = """
import sys, json, numpy as np, torch, kvsearch
torch.set_num_threads(1)
path, who, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
db = kvsearch.Database(path, lock_timeout=60)
rng = np.random.default_rng(who)
for b in range(n):
    keys = rng.standard_normal((5, 8)).astype(np.float32)
    db.add(keys=keys, values=np.full((5, 2), who * 1000 + b, dtype=np.float32), metadata=[{"w": who, "b": b}] * 5)
db.close()
print(json.dumps({"who": who, "done": n}))
"""


def test_two_writer_processes_lose_nothing(tmp_path):
    path = tmp_path / "db"
    db = kvsearch.Database(path, dim=DIM, value_dim=2, index="HNSW16", score="dot")
    db.add(np.ones((1, DIM), dtype=np.float32), np.zeros((1, 2), dtype=np.float32))
    writers = [_python(WRITER, str(path), str(w), "15") for w in (1, 2)]
    outs = [w.communicate(timeout=120) for w in writers]
    for w, (_, err) in zip(writers, outs):
        assert w.returncode == 0, err[-2000:]
    # This process's view is stale: its next write reloads the store first, then nothing is lost.
    db.add(np.full((1, DIM), 2, dtype=np.float32), np.zeros((1, 2), dtype=np.float32))
    assert len(db) == 2 + 2 * 15 * 5
    for who in (1, 2):
        for b in range(15):
            assert len(db.store.ids_where({"w": who, "b": b})) == 5
    ids = db.store.table.ids.numpy()
    assert np.array_equal(db.index.ids(), ids)
    db.close()
    again = kvsearch.Database(path)
    keys = again.store.table.keys.numpy()
    q = np.random.default_rng(3).standard_normal((10, DIM)).astype(np.float32)
    for qv, row in zip(q, again.search(torch.from_numpy(q), k=10)):
        truth = set(ids[np.argsort(-(keys @ qv))[:10]].tolist())
        assert len(truth & {h.id for h in row}) >= 9  # HNSW recall on 302 records
    again.close()


FORK = """
import os, sys, json, numpy as np, torch, kvsearch
torch.set_num_threads(1)
db = kvsearch.Database(sys.argv[1], dim=8, value_dim=2, score="dot")
db.add(np.eye(8, dtype=np.float32), np.zeros((8, 2), dtype=np.float32))
db.search(torch.ones(8), k=3)
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the child uses the parent's open database object
    try:
        hits = db.search(torch.ones(8), k=3)
        db.add(np.full((2, 8), 5, dtype=np.float32), np.ones((2, 2), dtype=np.float32))
        os.write(w, json.dumps({"hits": len(hits), "len": len(db)}).encode())
        db.close()
    finally:
        os._exit(0)
os.close(w)
_, status = os.waitpid(pid, 0)
child = json.loads(os.read(r, 1000) or b"{}")
db.add(np.full((1, 8), 7, dtype=np.float32), np.ones((1, 2), dtype=np.float32))  # reloads: sees the child's
print(json.dumps({"status": status, "child": child, "parent_len": len(db)}))
db.close()
again = kvsearch.Database(sys.argv[1])
print(json.dumps({"reopened_len": len(again)}))
"""


def test_database_used_after_fork(tmp_path):
    proc = _python(FORK, str(tmp_path / "db"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    first, second = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert first["status"] == 0
    assert first["child"] == {"hits": 3, "len": 10}
    assert first["parent_len"] == 11
    assert second["reopened_len"] == 11


FORK_WHILE_A_THREAD_WRITES = """
import os, sys, json, threading, time, numpy as np, torch, kvsearch
from kvsearch import DatabaseLockedError
torch.set_num_threads(1)
db = kvsearch.Database(sys.argv[1], dim=8, value_dim=2, score="dot", lock_timeout=30)
db.add(np.eye(8, dtype=np.float32), np.zeros((8, 2), dtype=np.float32))
held, release = threading.Event(), threading.Event()

def a_write_in_progress():  # a thread of the parent holds both locks, as in the middle of a write
    with db.store.lock, db.store.write_lock:
        held.set()
        release.wait()

thread = threading.Thread(target=a_write_in_progress)
thread.start()
held.wait()
to_parent_r, to_parent_w = os.pipe()
to_child_r, to_child_w = os.pipe()
pid = os.fork()
if pid == 0:  # fork() copied the locks as held by a thread that does not exist in the child
    out = {}
    try:
        start = time.monotonic()
        out["hits"] = len(db.search(torch.ones(8), k=3))  # the thread locks are fresh in the child
        db.store.write_lock.timeout = 0.3
        try:
            db.add(np.full((1, 8), 3, dtype=np.float32), np.ones((1, 2), dtype=np.float32))
            out["first_write"] = "went through while the parent held the lock"
        except DatabaseLockedError as exc:
            out["first_write"] = str(exc)
        out["seconds"] = round(time.monotonic() - start, 2)
        os.write(to_parent_w, b"x")  # the parent may now finish its write
        os.read(to_child_r, 1)
        db.store.write_lock.timeout = 30
        db.add(np.full((2, 8), 5, dtype=np.float32), np.ones((2, 2), dtype=np.float32))
        out["len"] = len(db)
        db.close()
    except BaseException as exc:
        out["error"] = repr(exc)
    finally:
        os.write(to_parent_w, json.dumps(out).encode())
        os._exit(0)
os.read(to_parent_r, 1)
release.set()
thread.join()
os.write(to_child_w, b"x")
_, status = os.waitpid(pid, 0)
child = json.loads(os.read(to_parent_r, 10000) or b"{}")
print(json.dumps({"status": status, "child": child, "parent_pid": os.getpid(), "parent_len": len(db)}))
db.close()
"""


def test_fork_while_another_thread_holds_the_locks(tmp_path):
    """fork() while a thread of the parent is inside a write: the child does not inherit that thread's locks
    (no deadlock), its own write waits for the parent's file lock — bounded, then DatabaseLockedError naming
    the parent — and goes through once the parent is done; the parent then sees the child's records."""
    proc = _python(FORK_WHILE_A_THREAD_WRITES, str(tmp_path / "db"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    child = result["child"]
    assert result["status"] == 0 and "error" not in child, child
    assert child["hits"] == 3
    assert f"pid {result['parent_pid']}" in child["first_write"], child["first_write"]
    assert child["seconds"] < 10  # a bounded wait, not a hang on a lock copied from the parent
    assert child["len"] == 10 and result["parent_len"] == 10


def _run(code: str, *args: str) -> None:
    """Run a snippet in another Python process (as another program using the same folder would)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_reader_sees_another_process_writes_consistently(tmp_path):
    """Process A keeps its database open while process B deletes and upserts: A's next reads see B's state
    whole — no stale key answered from a changed record, no KeyError for a record B deleted."""
    path = tmp_path / "db"
    a = kvsearch.Database(path, encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512))
    a.add(["Li", "Lipton", "Smola"], ["Mu", "Zachary", "Alex"])
    assert a.lookup("Li") == "Mu"
    _run(
        """
        import sys, kvsearch
        b = kvsearch.Database(sys.argv[1])
        b.delete("Li")
        b.upsert(["Smola", "Hu"], ["CHANGED", "Rachel"])
        b.close()
        """,
        str(path),
    )
    assert len(a) == 3 and "Li" not in a and "Hu" in a
    assert a.lookup("Li", default=None) is None and a.lookup("Smola") == "CHANGED"
    assert [(h.key, h.value) for h in a.search("Li", k=3)][0] == ("Lipton", "Zachary")
    assert a.query("Li", k=3, pooling="exact").found is False
    fresh = a.encoder.encode(["Smola"])[0]
    row = a.store.table.ids.tolist().index(a.store.texts.id_of_key["Smola"])
    torch.testing.assert_close(a.store.table.values[row], a.encoder.encode(["CHANGED"])[0])  # the new value embedding
    torch.testing.assert_close(a.store.table.keys[row], fresh)
    a.close()


def test_a_stale_process_never_overwrites_another_process_fine_tuned_encoder(tmp_path):
    """A opens, B fine-tunes the key encoder and re-encodes the keys, then A closes: B's encoder stays, and A
    itself answers with it once it notices the change."""
    path = tmp_path / "db"
    first = kvsearch.Database(path, encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512))
    first.add(["Li", "Lipton", "Smola"], ["Mu", "Zachary", "Alex"])
    first.close()
    a = kvsearch.Database(path)
    _run(
        """
        import sys, torch, kvsearch
        b = kvsearch.Database(sys.argv[1])
        with torch.no_grad():
            next(b.encoder.parameters()).mul_(-1.0).add_(0.3)  # stands for a fine-tuning step
        b.refresh()  # keys re-encoded with the trained encoder
        b.close()  # saves the changed encoder
        """,
        str(path),
    )
    assert a.search("Li", k=1)[0].key == "Li"  # A reloaded B's encoder and keys before answering
    a.close()  # A changed nothing: it writes nothing
    c = kvsearch.Database(path)
    stored = c.store.table.keys[c.store.table.ids.tolist().index(c.store.texts.id_of_key["Li"])]
    torch.testing.assert_close(c.encoder.encode(["Li"])[0], stored)  # the trained encoder, not A's old one
    c.close()


def test_a_process_that_only_reads_closes_without_the_write_lock(tmp_path):
    """close() of a reader writes nothing, so another process holding the write lock never delays it."""
    path = tmp_path / "db"
    db = kvsearch.Database(path, dim=DIM, value_dim=2, score="dot", index="HNSW8")
    db.add(*batch(0, np.random.default_rng(0)))
    db.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path / "write.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    derived = ("index.npz", "manifest.json")  # what a close() that saved would rewrite

    def stamps() -> dict[str, int]:
        return {name: (path / name).stat().st_mtime_ns for name in derived}

    try:
        assert holder.stdout.readline().strip() == "locked"
        before = stamps()
        start = time.monotonic()
        reader = kvsearch.Database(path, lock_timeout=30)
        reader.search(torch.zeros(DIM), k=3)
        reader.close()
        assert time.monotonic() - start < 5  # no 30 s wait for the lock
        assert stamps() == before
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=10)


RANDOM_WRITER = """
import sys, time, numpy as np, torch, kvsearch
db = kvsearch.Database(sys.argv[1])
rng, live, b = np.random.default_rng(int(sys.argv[2])), [], 1000
for step in range(40):
    op = rng.choice(["add", "upsert", "delete"] if live else ["add"], p=[0.5, 0.3, 0.2] if live else None)
    if op == "add":
        b += 1
        db.add([f"b{b}-{i}" for i in range(5)], torch.tensor([[b, 0.0]] * 5))
        live.append(b)
    else:
        old = live[int(rng.integers(len(live)))]
        if op == "upsert":  # the whole batch, values tagged with the step
            db.upsert([f"b{old}-{i}" for i in range(5)], torch.tensor([[old, step + 1.0]] * 5))
        else:
            db.delete([f"b{old}-{i}" for i in range(5)])
            live.remove(old)
    time.sleep(float(rng.uniform(0, 0.02)))
db.close()
"""


@pytest.mark.parametrize("index", ["Flat", "HNSW8"])
def test_a_reader_catches_up_on_a_random_writer_process(tmp_path, index):
    """Another process adds, upserts and deletes whole batches of 5 at random while this one reads: every read
    sees whole batches (one batch number and one upsert tag per batch, index ids == store ids), and the reader
    ends equal to a fresh open of the folder — having caught up from the change log, not reloaded."""
    path = tmp_path / "db"
    reader = kvsearch.Database(path, encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=64), value_dim=2, index=index)
    first = torch.tensor([[b, 0.0] for b in range(3) for _ in range(5)])  # (15, 2): batches 0, 1, 2 of 5
    reader.add([f"b{b}-{i}" for b in range(3) for i in range(5)], first)
    writer = _python(RANDOM_WRITER, str(path), "7")
    reads = 0
    while writer.poll() is None or reads == 0:
        ids = reader.ids()
        assert torch.equal(reader.index.ids(), ids)
        _, values, found = reader.embeddings(ids)  # (n, 2): (batch, upsert tag), in one snapshot
        values = values[found]  # the ids read a call earlier: a batch may have been deleted since
        for b in values[:, 0].unique().tolist():
            tags = values[values[:, 0] == b, 1]
            assert len(tags) == 5 and bool((tags == tags[0]).all()), f"batch {b} seen torn: {tags.tolist()}"
        reads += 1
    assert writer.wait() == 0, writer.stderr.read()[-2000:]
    reader.ids()  # the last commits
    fresh = kvsearch.Database(path, read_only=True)
    ids = fresh.ids()
    assert torch.equal(reader.ids(), ids) and torch.equal(reader.index.ids(), ids)
    assert reader.key_texts(ids) == fresh.key_texts(ids)
    assert all(torch.equal(a, b) for a, b in zip(reader.embeddings(ids), fresh.embeddings(ids)))
    assert reader.store.full_loads == 1 and reader.store.catch_ups > 0, (reads, reader.store.catch_ups)
    fresh.close()
    reader.close()
