"""Requirement 7, resource limits: refuse up front what cannot fit; stream a big file with bounded memory.

- An add, or an index build, whose estimated memory exceeds the budget (a share of MemAvailable, or
  ``KVSEARCH_MEMORY_LIMIT``) raises MemoryLimitError before anything is written.
- ``kvsearch.cli.ingest.ingest_file`` on a file much larger than one batch: the peak Python heap (tracemalloc)
  and the growth of the peak resident set (ru_maxrss) stay far below the file size. Measured in a
  subprocess; the figures are printed (run with ``-s``) and quoted in docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import kvsearch
from kvsearch.checks import available_memory, check_fits, index_bytes, memory_budget
from kvsearch.errors import MemoryLimitError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_available_memory_is_read():
    available = available_memory()
    assert available is not None and available > 0
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert available <= total
    assert 0 < memory_budget() <= available


def test_an_index_larger_than_memory_is_refused_up_front():
    budget = memory_budget()
    # 1e9 vectors of dim 768 in a flat index: ~3 TB, far beyond this machine.
    need = index_bytes("Flat", 10**9, 768)
    assert need > budget
    with pytest.raises(MemoryLimitError, match="needs about .* MiB, expected at most"):
        check_fits(need, "building the Flat index")
    assert index_bytes("HNSW32", 1000, 64) > index_bytes("Flat", 1000, 64) > index_bytes("IVF64,PQ8", 1000, 64)


def test_add_that_cannot_fit_is_refused_and_nothing_is_written(tmp_path, monkeypatch):
    db = kvsearch.Database(tmp_path / "db", dim=64, value_dim=64, index="HNSW16")
    db.add(torch.randn(100, 64), torch.randn(100, 64))
    before = (len(db), db.store.version, db.store.table.ids.tolist())
    monkeypatch.setenv("KVSEARCH_MEMORY_LIMIT", str(1 << 20))  # 1 MiB for this process
    with pytest.raises(MemoryLimitError, match="adding 5,000 records"):
        db.add(torch.randn(5000, 64), torch.randn(5000, 64))
    assert (len(db), db.store.version, db.store.table.ids.tolist()) == before
    db.add(torch.randn(10, 64), torch.randn(10, 64))  # a small add still fits
    db.close()
    # Reopening needs an index rebuild of ~110 x (256 + 136) bytes: refused under a 10 KiB budget, with
    # the reason, instead of a half-built index.
    os.remove(tmp_path / "db" / "manifest.json")
    monkeypatch.setenv("KVSEARCH_MEMORY_LIMIT", str(10 << 10))
    with pytest.raises(MemoryLimitError, match="building the HNSW16 index"):
        kvsearch.Database(tmp_path / "db")
    monkeypatch.delenv("KVSEARCH_MEMORY_LIMIT")
    with kvsearch.Database(tmp_path / "db") as again:
        assert len(again) == 110


INGEST = """
import json, os, resource, sys, time, tracemalloc
import torch
torch.set_num_threads(1)
import kvsearch
from kvsearch.cli.ingest import ingest_file

path, rows, batch, trace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "heap"
csv_path = os.path.join(path, "big.csv")
with open(csv_path, "w") as f:  # keys and values are short; a wide unused column makes the file big
    f.write("key,value,notes\\n")
    for i in range(rows):
        f.write(f"k{i},v{i % 97},{'x' * 6000}\\n")
size = os.path.getsize(csv_path)
db = kvsearch.Database(os.path.join(path, "db"), encoder=kvsearch.NgramEncoder(dim=16, num_buckets=4096))
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
rss0, now0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss()
if trace:  # tracemalloc's own bookkeeping inflates the RSS: heap and RSS are measured in separate runs
    tracemalloc.start()
start = time.perf_counter()
n = ingest_file(db, csv_path, key="key", value="value", batch_size=batch, progress=False)
seconds = time.perf_counter() - start
_, peak = tracemalloc.get_traced_memory() if trace else (None, None)
tracemalloc.stop()
rss1, now1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss()
assert n == rows and len(db) == rows
assert db.lookup(f"k{rows - 1}") == f"v{(rows - 1) % 97}"
db.close()
print(json.dumps({"rows": rows, "batch_size": batch, "file_bytes": size, "heap_peak": peak,
                  "rss_peak_growth": rss1 - rss0,
                  "rss_growth": now1 - now0, "seconds": round(seconds, 2)}))
"""


def run_ingest(tmp_path, rows: int, batch: int, measure: str) -> dict:
    """Ingest a generated CSV in a fresh process; ``measure``: "heap" (tracemalloc peak) or "rss"."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(INGEST), str(tmp_path), str(rows), str(batch), measure],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ingest_streams_a_big_file_with_bounded_memory(tmp_path):
    pytest.importorskip("kvsearch.cli.ingest")
    heap = run_ingest(tmp_path / "heap", rows=8_000, batch=512, measure="heap")
    rss = run_ingest(tmp_path / "rss", rows=8_000, batch=512, measure="rss")
    print("ingest:", heap, rss)
    # One batch of rows is ~3 MiB of file; the file is ~46 MiB. Memory must not follow the file's bytes; it
    # grows with the number of records (key maps, embeddings, the encoder's bounded LRU cache: ~1 KB each).
    assert heap["file_bytes"] > 45 * 2**20
    assert heap["heap_peak"] < heap["file_bytes"] / 4
    assert rss["rss_peak_growth"] < rss["file_bytes"] / 2 and rss["rss_growth"] < rss["file_bytes"] / 2


@pytest.mark.slow
def test_ingest_memory_does_not_grow_with_the_file(tmp_path):
    big = run_ingest(tmp_path / "heap", rows=100_000, batch=512, measure="heap")
    rss = run_ingest(tmp_path / "rss", rows=100_000, batch=512, measure="rss")
    print("ingest big:", big, rss)
    # A 573 MiB file: the heap holds per-record state (~1 KB a record: key maps, ids, the encoder's LRU
    # cache), never the file's bytes.
    assert big["file_bytes"] > 570 * 2**20
    assert big["heap_peak"] < big["file_bytes"] / 4
    assert big["heap_peak"] / big["rows"] < 2048
    assert rss["rss_peak_growth"] < rss["file_bytes"] / 2


def test_memory_limit_error_is_typed():
    assert issubclass(MemoryLimitError, kvsearch.KVSearchError) and issubclass(MemoryLimitError, MemoryError)
    assert np.isfinite(memory_budget())
