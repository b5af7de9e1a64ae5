"""Per-call time of small ShardedDatabase calls on 2 gloo ranks: ranks started by hand or by torchrun.

    python benchmarks/bench_rank_calls.py                          # 2 ranks started by hand (spawn), no thread setting
    OMP_NUM_THREADS=2 python benchmarks/bench_rank_calls.py        # by hand, the user's thread count kept
    torchrun --nproc_per_node 2 benchmarks/bench_rank_calls.py     # torchrun (it sets OMP_NUM_THREADS=1)

Each rank opens a fresh 2-shard database of ``--records`` random 64-d keys (rank 0 adds them), then times
``len``, ``search`` and ``query`` of ``--queries`` random queries per rank (4) with k = 10: the median of
``--calls`` calls, each after a barrier, the slower rank's figure. Rank 0 prints one JSON line: the launcher,
each rank's torch threads after opening, the medians in milliseconds. Nothing is appended to RESULTS.md (the
figures are in docs/SCALE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def worker(rank: int, world: int, init: str, root: str, records: int, calls: int, queries: int) -> None:
    import torch
    import torch.distributed as dist

    from kvsearch.distributed import ShardedDatabase

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sdb = ShardedDatabase(Path(root) / "db", num_shards=2, dim=64, value_dim=8, device="cpu")
    gen = torch.Generator().manual_seed(rank)
    n = records if rank == 0 else 0
    sdb.add(torch.randn(n, 64, generator=gen), torch.randn(n, 8, generator=gen))
    q = torch.randn(queries, 64, generator=gen)  # (queries, 64)
    timings: dict[str, float] = {}
    for name, call in (
        ("len", lambda: len(sdb)),
        ("search", lambda: sdb.search(q, k=10)),
        ("query", lambda: sdb.query(q, k=10)),
    ):
        call()  # warm
        seconds = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        timings[name] = statistics.median(seconds) * 1000
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, (torch.get_num_threads(), timings))
    if rank == 0:
        slowest = {name: round(max(t[name] for _, t in per_rank), 3) for name in timings}
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "by hand"
        threads = [t for t, _ in per_rank]
        print(json.dumps({"launcher": launcher, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                          "threads": threads, "ms_per_call": slowest}))  # fmt: skip
    sdb.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--queries", type=int, default=4, help="queries per rank and call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: this process is one rank
            shared = Path(tempfile.gettempdir()) / f"bench_rank_calls_{os.environ['TORCHELASTIC_RUN_ID']}"
            worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", str(shared), args.records,
                   args.calls, args.queries)  # fmt: skip
            return
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://127.0.0.1:{port}"
        every = (2, init, root, args.records, args.calls, args.queries)
        mp.start_processes(worker, args=every, nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
