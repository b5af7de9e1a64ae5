"""The facade's single-query and small-batch calls beside bare torch, as medians: one line per process.

    python benchmarks/bench_single_query.py                              # this tree
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_single_query.py --label before
    python benchmarks/bench_single_query.py --overhead --data names      # Database.search above its bare index

``--overhead``: for each index (``--indexes``, default Flat and HNSW32) and database in memory and on disk
(``--where``), the per-call time of ``db.search(q, k=10)`` with a query tensor (dim,) beside the bare search it
runs, one call each in turn per query (the same queries, the same state of the machine): for HNSW the database's
own FAISS index (``db.index.faiss_index.search`` on the query normalised beforehand, as the index sees it); for
Flat the bare ``torch.topk(q @ K.T, 10)`` on unit keys and the database's ``TorchIndex.search`` itself. Prints the
medians and the overhead (``db.search`` minus the bare search, medians of the per-query differences) with the
load average. ``--data names``: the 91,910 MiniLM name embeddings and misspelt-name queries of
``benchmarks/common.py`` (cached in ``benchmarks/.cache``); ``random``: seeded random unit keys.

It uses the public API only (``Database(None, ...)``, ``add``, ``search``, ``query``, ``candidates``), so the same
script times two checkouts of kvsearch: run it alternately in each, a few times, and compare the lines (the machine
is shared; medians over many calls and several fresh processes tell noise from a change).

Data: m random unit keys (d = 384, seeded), 8-dim random values, the default index; unit queries, seeded.
Prints the median milliseconds of each call and the load average; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import kvsearch  # noqa: E402


def median_ms(fn: Callable[[int], object], calls: int, warmup: int = 5) -> float:
    """The median wall time of ``fn(i)`` over ``calls`` calls, in ms, after ``warmup`` calls."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def interleaved_us(calls: dict[str, Callable[[int], object]], n: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds of each ``call(i)``, i = 0..n-1, the calls taking turns per query (the first of each turn
    rotating), ``rounds`` times; after 10 warm-up turns. name -> (rounds * n,) per-call times."""
    names = list(calls)
    for i in range(10):
        for name in names:
            calls[name](i)
    times: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter_ns
    for r in range(rounds):
        for i in range(n):
            turn = names[(i + r) % len(names) :] + names[: (i + r) % len(names)]
            for name in turn:
                start = clock()
                calls[name](i)
                times[name].append((clock() - start) / 1e3)
    return times


def overhead(args: argparse.Namespace) -> None:
    """Per-call time of ``db.search`` with one query tensor beside the bare index search it runs."""
    if args.data == "names":
        _, data, queries = common.name_embeddings(1024)
        keys = torch.from_numpy(np.ascontiguousarray(data[: args.m]))  # (m, dim)
        queries = torch.from_numpy(np.ascontiguousarray(queries))  # (nq, dim)
    else:
        torch.manual_seed(0)
        keys = F.normalize(torch.randn(args.m, 384), dim=-1)  # (m, dim)
        queries = torch.randn(1024, 384)  # (nq, dim)
    m, dim = keys.shape
    unit_keys = F.normalize(keys, dim=-1)  # (m, dim) as a cosine index scores them
    unit = F.normalize(queries, dim=-1)  # (nq, dim)
    unit_np = np.ascontiguousarray(unit.numpy())  # (nq, dim)
    values = torch.arange(m, dtype=torch.float32).unsqueeze(1)  # (m, 1)
    folder = Path(tempfile.mkdtemp(prefix="kvs-single-"))
    try:
        for spec in args.indexes.split(","):
            for where in args.where.split(","):
                path = None if where == "memory" else folder / f"{spec}-{where}"
                db = kvsearch.Database(path, dim=dim, value_dim=1, index=spec)
                for lo in range(0, m, 50_000):
                    db.add(keys[lo : lo + 50_000], values[lo : lo + 50_000])
                if path is not None:  # reopened: the saved index, as a served database has it
                    db.close()
                    db = kvsearch.Database(path)
                calls: dict[str, Callable[[int], object]] = {"db.search": lambda i, db=db: db.search(queries[i], k=10)}
                faiss_index = getattr(db.index, "faiss_index", None)
                if faiss_index is not None:
                    calls["bare FAISS"] = lambda i, index=faiss_index: index.search(unit_np[i : i + 1], 10)
                else:
                    calls["bare topk"] = lambda i: torch.topk(unit[i : i + 1] @ unit_keys.T, 10)
                    calls["TorchIndex.search"] = lambda i, index=db.index: index.search(queries[i : i + 1], 10)
                times = interleaved_us(calls, args.calls, args.rounds)
                load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
                ours = times["db.search"]
                shown = "  ".join(f"{name} {statistics.median(t):,.1f}" for name, t in times.items())
                above = "  ".join(
                    f"db.search - {name} {statistics.median(a - b for a, b in zip(ours, t)):,.1f}"
                    for name, t in times.items()
                    if name != "db.search"
                )
                print(
                    f"{args.label}: {spec} {where}, m={m:,} ({args.data}), k=10, median us/call: {shown};  "
                    f"overhead us: {above}  (load {load}; kvsearch at {os.path.dirname(kvsearch.__file__)})",
                    flush=True,
                )
                db.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=100_000, help="records (default 100k; names: at most 91,910)")
    parser.add_argument("--calls", type=int, default=60, help="timed single-query calls per figure (default 60)")
    parser.add_argument("--label", default="this tree", help="the name printed at the start of the line")
    parser.add_argument("--overhead", action="store_true", help="db.search above its bare index (see above)")
    parser.add_argument("--data", choices=("random", "names"), default="random", help="--overhead's keys")
    parser.add_argument("--indexes", default="Flat,HNSW32", help="--overhead's index specs, comma-separated")
    parser.add_argument("--where", default="memory,disk", help="--overhead's databases: memory, disk or both")
    parser.add_argument("--rounds", type=int, default=3, help="--overhead's rounds over the queries (default 3)")
    args = parser.parse_args()
    if args.overhead:
        overhead(args)
        return

    torch.manual_seed(0)
    dim, batch = 384, 64
    keys = torch.nn.functional.normalize(torch.randn(args.m, dim), dim=-1)  # (m, dim)
    queries = torch.nn.functional.normalize(torch.randn(args.calls + 5, dim), dim=-1)  # (calls + 5, dim)
    db = kvsearch.Database(None, dim=dim, value_dim=8)
    db.add(keys, torch.randn(args.m, 8))

    figures = {
        "search nq=1 k=10": median_ms(lambda i: db.search(queries[i], k=10), args.calls),
        "query nq=1 k=32": median_ms(lambda i: db.query(queries[i], k=32), args.calls),
        "candidates nq=1 k=32": median_ms(lambda i: db.candidates(queries[i : i + 1], 32), args.calls),
        "bare torch.topk(q @ K.T) nq=1 k=32": median_ms(
            lambda i: torch.topk(queries[i : i + 1] @ keys.T, 32), args.calls
        ),
        f"query nq={batch} k=32": median_ms(lambda i: db.query(queries[:batch], k=32), max(5, args.calls // 4)),
    }
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    shown = "  ".join(f"{name}: {ms:.3f} ms" for name, ms in figures.items())
    print(f"{args.label} (kvsearch at {os.path.dirname(kvsearch.__file__)}; m={args.m:,}; load {load})  {shown}")


if __name__ == "__main__":
    main()
