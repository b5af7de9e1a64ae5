"""bench_readers: a reader beside a writer — the next call after a foreign commit, and reader ops/s beside a writer.

For each index (Flat, HNSW32, IVF64,Flat) a database of m random keys (d = 384, values d = 16) is built and closed
(the trained / graph index is saved), then, in one fresh process:

- the reader's next call after another handle (another SQLite connection) committed 1 record, against the same call
  with no foreign commit (median of ``--n``): ``get(id)`` (a plain lookup by id) and ``search(q, k=10)``; and the
  same after 2 foreign commits with the change log compacted to 1 version (the full reload that the log replaces);
  the reader runs with 1 torch / FAISS thread, the writer process with OMP_NUM_THREADS=1;
- reader ops/s (``search(q, k=10)``, one query per call) alone for ``--seconds``, then beside a writer *process*
  adding batches of 100 records as fast as it can for as long.

The reader's ``store.full_loads`` / ``store.catch_ups`` counters say which path each phase took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import common
import numpy as np

VALUE_DIM = 16
WRITER = """
import sys, time, numpy as np, torch, kvsearch
db = kvsearch.Database(sys.argv[1])
rng = np.random.default_rng(5)
print("ready", flush=True)
seconds = float(sys.stdin.readline())
batches, start = 0, time.perf_counter()
while time.perf_counter() - start < seconds:
    keys = rng.standard_normal((100, db.dim)).astype(np.float32)
    db.add(torch.from_numpy(keys / np.linalg.norm(keys, axis=1, keepdims=True)), torch.zeros(100, VALUE_DIM))
    batches += 1
db.close()
print(batches, flush=True)
""".replace("VALUE_DIM", str(VALUE_DIM))


def _median_ms(times: list[float]) -> float:
    return float(np.median(times)) * 1e3


def w_reader(spec: str, m: int, n: int, seconds: float) -> dict:
    """Build, then measure the next-call latencies and the ops/s alone and beside a writer process."""
    import faiss
    import torch

    from kvsearch import Database

    torch.set_num_threads(1)  # one core for the reader, one for the writer process (2-core machine)
    faiss.omp_set_num_threads(1)

    folder = tempfile.mkdtemp(prefix="bench-readers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(folder, "db")
    try:
        keys = np.asarray(common.random_vectors(m))
        start = time.perf_counter()
        db = Database(path, dim=common.DIM, value_dim=VALUE_DIM, index=spec)
        for lo in range(0, m, 10_000):
            db.add(torch.from_numpy(keys[lo : lo + 10_000].copy()), torch.zeros(min(10_000, m - lo), VALUE_DIM))
        db.close()
        build_s = time.perf_counter() - start
        writer, reader = Database(path), Database(path)
        ids = reader.ids()
        fresh = torch.from_numpy(common.random_queries(4 * n + 8, seed=3))  # (4n + 8, dim) new keys
        queries = torch.from_numpy(common.random_queries(256, seed=4))  # (256, dim)
        out: dict = {"spec": spec, "m": m, "build_s": build_s}
        taken = iter(range(len(fresh)))

        def foreign_add() -> None:
            i = next(taken)
            writer.add(fresh[i : i + 1], torch.zeros(1, VALUE_DIM))

        calls = {
            "get": lambda i: reader.get(int(ids[(i * 7919) % len(ids)])),
            "search": lambda i: reader.search(queries[i % len(queries)].unsqueeze(0), k=10),
        }
        for name, call in calls.items():
            for i in range(3):
                call(i)  # warm
            quiet, after = [], []
            for i in range(n):
                t = time.perf_counter()
                call(i)
                quiet.append(time.perf_counter() - t)
            loads = reader.store.full_loads
            for i in range(n):
                foreign_add()
                t = time.perf_counter()
                call(i)
                after.append(time.perf_counter() - t)
            out[f"{name}_quiet_ms"] = _median_ms(quiet)
            out[f"{name}_after_ms"] = _median_ms(after)
            out[f"{name}_after_max_ms"] = max(after) * 1e3
            out[f"{name}_full_loads"] = reader.store.full_loads - loads
        writer.store.changelog_keep = 1  # the log no longer reaches back: the full reload (the path before the log)
        full = []
        for i in range(3):
            foreign_add()
            foreign_add()
            t = time.perf_counter()
            calls["get"](i)
            full.append(time.perf_counter() - t)
        out["get_full_reload_ms"] = _median_ms(full)
        writer.store.changelog_keep = 1000
        writer.close()

        def ops_for(duration: float) -> float:
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < duration:
                reader.search(queries[count % len(queries)].unsqueeze(0), k=10)
                count += 1
            return count / (time.perf_counter() - t0)

        ops_for(0.5)
        out["ops_alone"] = ops_for(seconds)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(common.REPO)}
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WRITER), path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # said if it fails (it writes nothing else there)
            text=True,
            env=env,
        )
        assert proc.stdout.readline().strip() == "ready"
        loads, catch_ups = reader.store.full_loads, reader.store.catch_ups
        proc.stdin.write(f"{seconds}\n")
        proc.stdin.flush()
        out["ops_beside_writer"] = ops_for(seconds)
        line = proc.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"the writer process ended without its count: {proc.stderr.read()[-2000:]}")
        out["writer_batches"] = int(line)
        proc.wait()
        out["writer_full_loads"] = reader.store.full_loads - loads
        out["writer_catch_ups"] = reader.store.catch_ups - catch_ups
        reader.close()
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


WORKERS = {"reader": w_reader}


def main() -> None:
    """Run every index, print the tables and make them its section of RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=50_000, help="records in the database (default 50k)")
    parser.add_argument("--specs", nargs="+", default=["Flat", "HNSW32", "IVF64,Flat"], help="index specs")
    parser.add_argument("--n", type=int, default=21, help="calls per median (default 21)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per ops/s phase (default 10)")
    parser.add_argument("--no-append", action="store_true", help="print only, do not write RESULTS.md")
    args = parser.parse_args()
    info = common.machine()
    specs = args.specs
    results = []
    for spec in specs:
        kwargs = {"spec": spec, "m": args.m, "n": args.n, "seconds": args.seconds}
        r = common.run_fresh(__file__, "reader", kwargs, timeout=1800)
        print(json.dumps(r), file=sys.stderr, flush=True)
        results.append((spec, r))
    nan = float("nan")
    latency = common.table(
        [
            "index",
            "m",
            "call",
            "no foreign commit ms",
            "after a foreign 1-record commit ms (max)",
            "ratio",
            "full reloads",
            "after 2 commits, log compacted (full reload) ms",
        ],
        [
            [
                spec,
                f"{r.get('m', args.m):,}",
                call,
                r.get(f"{call}_quiet_ms", nan),
                f"{r.get(f'{call}_after_ms', nan):.3g} ({r.get(f'{call}_after_max_ms', nan):.3g})",
                r.get(f"{call}_after_ms", nan) / r.get(f"{call}_quiet_ms", nan),
                r.get(f"{call}_full_loads", r.get("error", "")),
                r.get("get_full_reload_ms", nan) if call == "get" else "",
            ]
            for spec, r in results
            for call in ("get", "search")
        ],
    )
    throughput = common.table(
        [
            "index",
            "reader ops/s alone",
            "beside a writer (batches of 100)",
            "ratio",
            "writer batches",
            "reader catch-ups",
            "reader full reloads",
        ],
        [
            [
                spec,
                r.get("ops_alone", nan),
                r.get("ops_beside_writer", nan),
                r.get("ops_beside_writer", nan) / r.get("ops_alone", nan),
                r.get("writer_batches", r.get("error", "")),
                r.get("writer_catch_ups", ""),
                r.get("writer_full_loads", ""),
            ]
            for spec, r in results
        ],
    )
    common.report(
        "bench_readers",
        common.command_line(),
        info,
        [
            (f"The reader's next call after a foreign commit (median of {args.n})", latency),
            (
                f"Reader ops/s (search k=10, 1 query per call), alone and beside a writer, {args.seconds:g} s",
                throughput,
            ),
        ],
        not args.no_append,
    )


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
