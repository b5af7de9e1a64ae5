"""A parent that uses torch's and FAISS's OpenMP threads at the default count, then forks children that search and
write (run by ``tests/test_fork.py`` in a process of its own: ``python tests/_fork_child.py FOLDER``).

The parent never lowers its thread count: it adds texts with an n-gram encoder and searches a large batch in a
Flat database (torch's pool), and builds and searches an HNSW database (FAISS's pool). Each child searches both
databases, runs a large matmul and writes a record; the parent waits for it with a deadline and kills it when
the deadline passes (a hang is reported, not waited on). Three children:

- ``default``: forked as a user would; reports its thread count and the threads it started (its own pools).
- ``more_threads``: sets ``torch.set_num_threads(3)`` first (a count the parent never used).
- ``fallback``: forked while ``release_openmp_threads`` reports failure (a libgomp that cannot stop its workers):
  the child runs single-threaded.

Prints one JSON object: the parent's thread facts and each child's report (or ``{"hung": true}``).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

import kvsearch
import kvsearch.nn.forking as forking

DEADLINE = 60.0  # seconds a child may take before it counts as hung


def tasks() -> int:
    """The threads of this process now (Linux)."""
    return len(os.listdir("/proc/self/task"))


def use_the_pools(flat: kvsearch.Database, hnsw: kvsearch.Database) -> None:
    """Run parallel regions in torch's and FAISS's OpenMP runtimes (their worker pools start and stay)."""
    flat.search(torch.randn(256, 64), k=20)  # torch: the scan and top-k over 1,000 keys, 256 queries
    hnsw.search(torch.randn(256, 16), k=20)  # FAISS: an HNSW search of 256 queries
    x = torch.randn(600, 600)
    (x @ x).sum()


def child(flat: kvsearch.Database, hnsw: kvsearch.Database, mode: str) -> dict:
    """The child's work: search both databases, a large matmul, one write to each; its facts."""
    out: dict = {"tasks_at_start": tasks()}  # the forking thread alone
    if mode == "more_threads":
        torch.set_num_threads(3)
    out["threads"] = torch.get_num_threads()
    start = time.monotonic()
    out["flat_hits"] = [len(row) for row in flat.search(["name00007", "nmae01234", "child"], k=5)]
    out["flat_top"] = flat.search("name00007", k=1)[0].key
    out["hnsw_hits"] = [len(row) for row in hnsw.search(torch.randn(256, 16), k=5)][:3]
    x = torch.randn(600, 600)
    out["matmul_ok"] = bool(torch.allclose(x @ x, (x.double() @ x.double()).float(), atol=1e-3))
    out["tasks_after_work"] = tasks()  # > 1 where the child started worker threads of its own
    flat.add([f"child-{mode}"], [mode])
    hnsw.add(np.full((1, 16), 0.5, dtype=np.float32), np.ones((1, 2), dtype=np.float32))
    out["flat_len"], out["hnsw_len"] = len(flat), len(hnsw)
    out["seconds"] = round(time.monotonic() - start, 2)
    return out


def fork_and_wait(flat: kvsearch.Database, hnsw: kvsearch.Database, mode: str) -> dict:
    """Fork a child running ``child``; its report, or ``{"hung": True}`` if it is not done by the deadline."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            report = child(flat, hnsw, mode)
        except BaseException as exc:
            report = {"error": repr(exc)}
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            with os.fdopen(read_end, "rb") as pipe:
                report = json.loads(pipe.read() or b"{}")
            report["exit_status"] = status
            return report
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    os.close(read_end)
    return {"hung": True}


def main(folder: str) -> None:
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    flat = kvsearch.Database(
        os.path.join(folder, "flat"), encoder=kvsearch.NgramEncoder(dim=64, num_buckets=4096), index="Flat"
    )
    names = [f"name{i:05d}" for i in range(1000)]
    flat.add(names, names)  # the text encoder runs in torch, at the default thread count
    hnsw = kvsearch.Database(os.path.join(folder, "hnsw"), dim=16, value_dim=2, index="HNSW16")
    hnsw.add(rng.standard_normal((1000, 16)).astype(np.float32), np.zeros((1000, 2), dtype=np.float32))
    result: dict = {"parent_threads": torch.get_num_threads()}
    reports: dict = {}
    for mode in ("default", "more_threads", "fallback"):
        if any(report.get("hung") for report in reports.values()):
            reports[mode] = {"not_run": "an earlier child hung"}  # fail in one deadline, not three
            continue
        use_the_pools(flat, hnsw)
        result.setdefault("parent_tasks_before_fork", tasks())
        if mode == "fallback":
            real = forking.release_openmp_threads
            forking.release_openmp_threads = lambda: False  # a libgomp that cannot stop its workers
            try:
                reports[mode] = fork_and_wait(flat, hnsw, mode)
            finally:
                forking.release_openmp_threads = real
        else:
            reports[mode] = fork_and_wait(flat, hnsw, mode)
    result["children"] = reports
    result["flat_len"], result["hnsw_len"] = len(flat), len(hnsw)  # the children's writes, seen by the parent
    flat.close()
    hnsw.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
