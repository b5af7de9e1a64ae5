"""The facade's single-query and small-batch calls beside bare torch, as medians: one line per process.

    python benchmarks/bench_single_query.py                              # this tree
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_single_query.py --label before

It uses the public API only (``Database(None, ...)``, ``add``, ``search``, ``query``, ``candidates``), so the same
script times two checkouts of kvsearch: run it alternately in each, a few times, and compare the lines (the machine
is shared; medians over many calls and several fresh processes tell noise from a change).

Data: m random unit keys (d = 384, seeded), 8-dim random values, the default index; unit queries, seeded.
Prints the median milliseconds of each call and the load average; writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

import kvsearch


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, default=100_000, help="records (default 100k)")
    parser.add_argument("--calls", type=int, default=60, help="timed single-query calls per figure (default 60)")
    parser.add_argument("--label", default="this tree", help="the name printed at the start of the line")
    args = parser.parse_args()

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
