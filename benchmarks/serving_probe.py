"""A quick serving probe at 1M x 384 (the figures of RESULTS.md "Issue 23: serving"): build, reader memory, open.

    python benchmarks/serving_probe.py build DIR            # 1M random unit keys, 8-d values: ~30 s
    python benchmarks/serving_probe.py readers DIR 1        # one reader process: PSS / private over the keys' size
    python benchmarks/serving_probe.py readers DIR 4        # four at once: per extra reader = (sum4 - sum1) / 3
    python benchmarks/serving_probe.py open DIR FAISS_FILE  # open + first answer, kvsearch and FAISS mmap, alternating

A reader imports torch and kvsearch, opens the database read-only, runs 21 single-query searches and one batch of
256, reads /proc/self/smaps_rollup and waits until every reader has reported. ``bench_serving.py`` is the full
comparison with every peer; this is its short form for the kvsearch side.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

N, DIM = 1_000_000, 384


def build(folder: str) -> None:
    import torch

    import kvsearch

    gen = torch.Generator().manual_seed(0)
    db = kvsearch.Database(folder, dim=DIM, value_dim=8, score="dot")
    for _ in range(0, N, 100_000):
        db.add(torch.nn.functional.normalize(torch.randn(100_000, DIM, generator=gen), dim=-1), torch.randn(100_000, 8))
    db.close()


def memory() -> dict[str, int]:
    wanted = ("Rss:", "Pss:", "Private_Clean:", "Private_Dirty:")
    lines = [line.split() for line in Path("/proc/self/smaps_rollup").read_text().splitlines()]
    return {p[0][:-1]: int(p[1]) * 1024 for p in lines if p[0] in wanted}


def reader(folder: str) -> None:
    import torch

    import kvsearch

    queries = torch.nn.functional.normalize(torch.randn(256, DIM, generator=torch.Generator().manual_seed(1)), dim=-1)
    db = kvsearch.Database(folder, read_only=True)
    for i in range(21):
        db.search(queries[i], k=10)
    db.search(queries, k=10)
    print(json.dumps({**memory(), "keys_shared": db.store.table.keys_shared}), flush=True)
    sys.stdin.readline()


def readers(folder: str, count: int) -> None:
    procs = [
        subprocess.Popen([sys.executable, __file__, "reader", folder], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for _ in range(count)
    ]
    got = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.communicate(b"\n")
    raw = N * DIM * 4
    for g in got:
        print({k: round(v / raw, 3) if k != "keys_shared" else v for k, v in g.items()})
    print(f"{count} readers: sum of PSS / keys = {sum(g['Pss'] for g in got) / raw:.3f}")


def open_first(kind: str, path: str) -> float:
    code = (
        "import time, torch, kvsearch; q = torch.randn(384); t = time.perf_counter(); "
        f"kvsearch.Database({path!r}, read_only=True).search(q, k=10); print(time.perf_counter() - t)"
        if kind == "kvsearch"
        else "import time, faiss, numpy as np; q = np.random.rand(1, 384).astype('float32'); t = time.perf_counter(); "
        f"faiss.read_index({path!r}, faiss.IO_FLAG_MMAP_IFC).search(q, 10); print(time.perf_counter() - t)"
    )
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "build":
        build(sys.argv[2])
    elif what == "reader":
        reader(sys.argv[2])
    elif what == "readers":
        readers(sys.argv[2], int(sys.argv[3]))
    elif what == "open":
        times = {"kvsearch": [], "faiss": []}
        for _ in range(5):
            times["kvsearch"].append(open_first("kvsearch", sys.argv[2]))
            times["faiss"].append(open_first("faiss", sys.argv[3]))
        print(
            {k: f"median {statistics.median(v):.3f} s ({', '.join(f'{x:.3f}' for x in v)})" for k, v in times.items()}
        )
