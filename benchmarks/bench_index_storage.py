"""One copy with an ANN index: an HNSW32 database's bytes on disk and a reader's memory, against a peer checkout.

    python benchmarks/bench_index_storage.py --peer main=/work/main          # m = 100k random unit vectors, d = 384
    python benchmarks/bench_index_storage.py --peer main=/work/main --quick  # m = 20k

Each side (this checkout, and each ``--peer NAME=ROOT``: another checkout of kvsearch) builds its own HNSW32
database of the same ``m`` random unit vectors (value_dim 1, so the folder is mostly keys and index) in a fresh
process with that side's code (``PYTHONPATH``), saves and closes it. Then, interleaved ``--repeat`` times, a fresh
process of each side opens its database and runs 100 single searches (k = 10); it reads ``/proc/self/smaps_rollup``
(Rss, Pss, Anonymous) after its imports and again after the searches: the difference is what opening and
searching the database costs. The figures are bytes, not timings: they hardly move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import numpy as np  # noqa: E402

BATCH = 20_000
SEARCHES = 100


def smaps() -> dict[str, int]:
    """Rss, Pss and Anonymous of this process in KiB (``/proc/self/smaps_rollup``)."""
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Anonymous"):
            out[name] = int(rest.split()[0])
    return out


def folder_files(path: str) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in Path(path).rglob("*") if p.is_file()}


def w_build(path: str, m: int, dim: int) -> dict:
    import torch

    import kvsearch

    shutil.rmtree(path, ignore_errors=True)
    keys = common.random_vectors(m, dim)  # (m, dim) unit rows
    start = time.perf_counter()
    db = kvsearch.Database(path, dim=dim, value_dim=1, index="HNSW32", score="dot")
    for lo in range(0, m, BATCH):
        hi = min(m, lo + BATCH)
        db.add(keys=torch.from_numpy(np.ascontiguousarray(keys[lo:hi])), values=torch.zeros(hi - lo, 1))
    db.save()
    db.close()
    return {"seconds": time.perf_counter() - start, "files": folder_files(path), "kvsearch": kvsearch.__file__}


def w_open(path: str, dim: int) -> dict:
    import faiss  # noqa: F401 - imported before the baseline, as the database will
    import torch

    import kvsearch

    queries = torch.from_numpy(common.random_queries(SEARCHES, dim))  # (SEARCHES, dim)
    before = smaps()
    db = kvsearch.Database(path)
    for q in queries:
        db.search(q, k=10)
    after = smaps()
    shares = getattr(db.index, "shares_storage", None)
    db.close()
    return {"before": before, "after": after, "shares_storage": shares, "kvsearch": kvsearch.__file__}


def run(root: str, worker: str, kwargs: dict) -> dict:
    """``worker(**kwargs)`` in a fresh process that imports kvsearch from ``root``."""
    env = {**os.environ, "PYTHONPATH": root, "BENCH_KVSEARCH_ROOT": root}
    cmd = [sys.executable, __file__, "--worker", worker, "--kwargs", json.dumps(kwargs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{worker} under {root} failed: {proc.stderr.strip()[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--peer", action="append", required=True, help="NAME=ROOT: another kvsearch checkout to compare with"
    )
    parser.add_argument("--m", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=common.DIM)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reuse", action="store_true", help="keep the databases an earlier run built")
    parser.add_argument("--no-append", action="store_true", help="print only, do not write RESULTS.md")
    args = parser.parse_args()
    m = 20_000 if args.quick else args.m
    info = common.machine()
    sides = {name: str(Path(root).resolve()) for name, _, root in (p.partition("=") for p in args.peer)}
    sides["this"] = str(common.REPO)
    raw = m * args.dim * 4
    built, rows = {}, []
    for name, root in sides.items():
        path = str(common.CACHE / f"index_storage_{name}_{m}")
        if args.reuse and Path(path, "index.npz").exists():
            built[name] = {"files": folder_files(path)}
        else:
            built[name] = run(root, "w_build", {"path": path, "m": m, "dim": args.dim})
        built[name]["path"] = path
    opened: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.repeat):  # interleaved
        for name, root in sides.items():
            opened[name].append(run(root, "w_open", {"path": built[name]["path"], "dim": args.dim}))
    for name in sides:
        files = built[name]["files"]
        total = sum(files.values())
        index = files.get("index.npz", 0)

        def grow(field: str, name: str = name) -> float:
            return float(np.median([(o["after"][field] - o["before"][field]) / 1024 for o in opened[name]]))

        rows.append(
            [
                f"{name} ({sides[name]})",
                f"{total / 2**20:,.1f}",
                f"{total / raw:.2f}",
                f"{index / 2**20:,.1f}",
                f"{index / raw:.2f}",
                f"{grow('Rss'):,.0f}",
                f"{grow('Pss'):,.0f}",
                f"{grow('Anonymous'):,.0f}",
                f"{grow('Rss') * 2**20 / raw:.2f}",
                str(opened[name][0]["shares_storage"]),
            ]
        )
    headers = [
        "side",
        "folder MiB",
        "folder / raw",
        "index.npz MiB",
        "index / raw",
        "open+search RSS MiB",
        "PSS MiB",
        "anon MiB",
        "RSS / raw",
        "shares_storage",
    ]
    body = common.table(headers, rows)
    body += (
        f"\n\nm = {m:,} random unit vectors, d = {args.dim}: raw keys {raw / 2**20:,.1f} MiB. Memory: medians of "
        f"{args.repeat} fresh processes per side (interleaved), growth of /proc/self/smaps_rollup from after the "
        f"imports to after opening the database and {SEARCHES} searches."
    )
    common.report(
        "bench_index_storage",
        common.command_line(),
        info,
        [("HNSW32 database: disk and a reader's memory", body)],
        not args.no_append,
    )


if __name__ == "__main__":
    if "BENCH_KVSEARCH_ROOT" in os.environ:  # a worker: that side's kvsearch, before common's checkout
        sys.path.insert(0, os.environ["BENCH_KVSEARCH_ROOT"])
    if not common.worker_main({"w_build": w_build, "w_open": w_open}):
        main()
