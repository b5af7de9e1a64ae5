"""Requirement 1, crash safety: SIGKILL a writer at random moments and at chosen points, reopen, check.

A fork server (``tests/_crash_writer.py``, started once: torch is imported once, not once per kill) forks a
writer child per round. The child adds batches, deletes whole batches and saves the index of an IVF database
until it is killed — by the server after a random delay, or by itself inside a transaction, right after a
commit (before the index is touched), with a new index file written but not renamed, renamed but the
manifest not, or after a whole save with the index file then torn in half. After every kill the test reopens
the database and checks against the child's acknowledgements and a brute-force search over the store.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _crash_writer import MODES, open_db  # noqa: E402

WRITER = Path(__file__).with_name("_crash_writer.py")


def read_acks(path: Path) -> tuple[dict[str, int], set[str], set[str]]:
    """Acknowledged adds {batch: size}, acknowledged deletes, and deletes begun but not acknowledged."""
    added: dict[str, int] = {}
    deleted: set[str] = set()
    begun: set[str] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if not parts or (parts[0] == "add" and len(parts) < 3):
                continue  # a line torn by the kill is not an acknowledgement
            if parts[0] == "add":
                added[parts[1]] = int(parts[2])
            elif parts[0] == "pre-del":
                begun.add(parts[1])
            elif parts[0] == "del":
                deleted.add(parts[1])
    return added, deleted, begun - deleted


def index_is_current(path: Path) -> bool:
    """Whether the saved manifest claims the store's version (then the index file must prove it)."""
    manifest = path / "manifest.json"
    if not manifest.exists():
        return False
    try:
        claimed = json.loads(manifest.read_text()).get("version")
    except ValueError:
        return False
    with sqlite3.connect(path / "store.sqlite") as conn:
        row = conn.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
    return row is not None and claimed == json.loads(row[0])


def check_database(path: Path, acks: Path, rng: np.random.Generator) -> int:
    """Reopen and check everything; return the number of records."""
    added, deleted, maybe_deleted = read_acks(acks)
    with open_db(str(path)) as db:
        store = db.store
        records = store.fetch(store.ids.tolist())
        sizes = Counter(r.metadata["batch"] for r in records.values())
        expected_size = {r.metadata["batch"]: r.metadata["size"] for r in records.values()}
        # No partial batch: every batch present is present in full.
        partial = {b: (sizes[b], expected_size[b]) for b in sizes if sizes[b] != expected_size[b]}
        assert not partial, f"partial batches visible after a crash: {partial}"
        # Every acknowledged batch is there, unless its deletion was acknowledged (or begun).
        for batch, size in added.items():
            if batch in deleted:
                assert batch not in sizes, f"deleted batch {batch} came back"
            elif batch not in maybe_deleted:
                assert sizes.get(batch) == size, f"acknowledged batch {batch} lost: {sizes.get(batch)} != {size}"
        # The index serves exactly the store: same ids, and search == brute force over the stored keys.
        assert len(db) == len(records) == sum(sizes.values())
        assert np.array_equal(db.index.ids(), store.ids.numpy())
        if len(db):
            ids = store.ids.numpy()
            keys = torch.stack([records[i].key_embedding for i in ids.tolist()]).numpy()  # (n, dim)
            queries = rng.standard_normal((8, keys.shape[1])).astype(np.float32)
            k = min(10, len(ids))
            hits = db.search(torch.from_numpy(queries), k=k)
            for q, row in zip(queries, hits):
                truth = set(ids[np.argsort(-(keys @ q), kind="stable")[:k]].tolist())
                assert {h.id for h in row} == truth
        return len(db)


def run_kills(tmp_path: Path, rounds: int, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    path, acks = tmp_path / "db", tmp_path / "acks.txt"
    open_db(str(path)).close()
    server = subprocess.Popen(
        [sys.executable, str(WRITER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    stats: Counter[str] = Counter()
    check_seconds = 0.0
    try:
        for r in range(rounds):
            mode = MODES[1 + (r // 2) % (len(MODES) - 1)] if r % 2 else "timer"
            delay = float(rng.uniform(0.01, 0.25)) if mode == "timer" else 5.0
            cmd = {"path": str(path), "acks": str(acks), "round": r, "seed": seed * 10_000 + r, "mode": mode}
            server.stdin.write(json.dumps({**cmd, "delay": delay}) + "\n")
            server.stdin.flush()
            reply = json.loads(server.stdout.readline())
            assert reply["signal"] == 9, f"round {r} ({mode}): the writer was not SIGKILLed: {reply}"
            stats[f"killed_by_{reply['killed_by']}"] += 1
            stats[f"mode_{mode}"] += 1
            stats["index_loadable"] += index_is_current(path)
            t0 = time.perf_counter()
            stats["records"] = check_database(path, acks, rng)
            check_seconds += time.perf_counter() - t0
            stats["kills"] += 1
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    stats["acked_batches"] = len(read_acks(acks)[0])
    stats["check_seconds"] = round(check_seconds, 1)
    return dict(stats)


def test_sigkill_writer_60_times(tmp_path):
    stats = run_kills(tmp_path, rounds=60, seed=1)
    print("crash stats:", stats)
    assert stats["kills"] == 60
    # Each self-kill mode really fired inside its window (not by the fallback timer).
    assert stats["killed_by_self"] >= 25
    assert stats["acked_batches"] > 60


@pytest.mark.slow
def test_sigkill_writer_300_times(tmp_path):
    stats = run_kills(tmp_path, rounds=300, seed=2)
    print("crash stats:", stats)
    assert stats["kills"] == 300
