"""What one process pays to serve many shards: creation and reopen time, open file descriptors, memory.

    python benchmarks/bench_shards_open.py                       # 16, 128 and 1,024 shards (MAX_SHARDS)
    python benchmarks/bench_shards_open.py --shards 64 256 --no-append

Each count runs in a fresh process (so its memory is its own), after the peer (one plain ``Database``, the same
records, in its own fresh process): a ``ShardedDatabase`` of that many shards is created
empty (8-d keys and values, no encoder), 64 records added, searched once, closed, then reopened. Reported: the
seconds to create and to reopen, the descriptors the process holds with the database open (``/proc/self/fd``) and
per shard, the growth of the resident set per shard, and the descriptors held after ``close()`` (0 expected). This is
what ``MAX_SHARDS`` (``kvsearch/distributed/layout.py``) and ``FILES_PER_DATABASE`` (``kvsearch/checks.py``) are
chosen from. Replaces its section of RESULTS.md unless ``--no-append``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def open_shards(num_shards: int) -> dict[str, Any]:
    """Create, fill, search, close and reopen a sharded database of ``num_shards`` shards in this process; with
    ``num_shards=0``, one plain ``Database`` (the peer: what one shard costs when it is a database of its own)."""
    import torch

    from kvsearch import Database
    from kvsearch.checks import open_files
    from kvsearch.distributed import ShardedDatabase

    def make(path: Path) -> Any:
        if num_shards == 0:
            return Database(path, dim=8, value_dim=8)
        return ShardedDatabase(path, num_shards=num_shards, dim=8, value_dim=8)

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base_fds, base_kib = open_files(), common.status_kib("VmRSS")
        start = time.perf_counter()
        db = make(Path(tmp) / "s")
        create_s = time.perf_counter() - start
        db.add(keys=torch.randn(64, 8), values=torch.randn(64, 8))
        db.search(torch.randn(8), k=3)
        fds = open_files() - base_fds
        rss_mib = (common.status_kib("VmRSS") - base_kib) / 1024
        db.close()
        closed_fds = open_files() - base_fds
        start = time.perf_counter()
        again = Database(Path(tmp) / "s") if num_shards == 0 else ShardedDatabase(Path(tmp) / "s")
        reopen_s = time.perf_counter() - start
        again.close()
    return {"create_s": create_s, "reopen_s": reopen_s, "fds": fds, "rss_mib": rss_mib, "closed_fds": closed_fds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[16, 128, 1024])
    parser.add_argument("--no-append", action="store_true", help="print only; do not write RESULTS.md")
    args = parser.parse_args()
    info = common.machine()
    rows = []
    for n in [0, *args.shards]:  # 0: the peer, one plain Database, in the same run
        got = common.run_fresh(__file__, "open_shards", {"num_shards": n})
        label = "1 plain Database (peer)" if n == 0 else n
        n = max(n, 1)
        if "error" in got:
            rows.append([label, got["error"], "", "", "", "", "", ""])
            continue
        rows.append(
            [
                label,
                got["create_s"],
                got["create_s"] / n * 1000,
                got["reopen_s"],
                got["fds"],
                got["fds"] / n,
                got["rss_mib"] / n,
                got["closed_fds"],
            ]
        )
    headers = [
        "shards",
        "create s",
        "ms per shard",
        "reopen s",
        "open fds",
        "fds per shard",
        "RSS MiB per shard",
        "fds after close",
    ]
    soft, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)
    note = f"Open-file limit of the run: soft {soft:,}, hard {hard:,} (raised for the shards when needed)."
    common.report(
        "bench_shards_open",
        common.command_line(),
        info,
        [("One process serving every shard", common.table(headers, rows) + "\n\n" + note)],
        append=not args.no_append,
    )


if __name__ == "__main__":
    if not common.worker_main({"open_shards": open_shards}):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        main()
