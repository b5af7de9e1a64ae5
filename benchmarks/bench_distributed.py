"""ShardedDatabase on torch.distributed (gloo, CPU): memory per rank, query latency, time in collectives.

    python benchmarks/bench_distributed.py               # m = 1M random records, 4 shards, 1 / 2 / 4 ranks
    python benchmarks/bench_distributed.py --quick       # m = 100k
    python benchmarks/bench_distributed.py --m 300000 --worlds 1,2 --no-append

The records are m random unit 384-d keys given as embeddings, with random unit 384-d values, index "Flat", score
"dot". The sharded database (4 shards) is built once from one process, in batches of 50k (kept under
benchmarks/.cache, git-ignored, reused by later runs; ``--rebuild`` builds again), and a single-process
``kvsearch.Database`` holding the same records is built beside it for reference (while ``ShardedDatabase``
passes ``dim`` and the other options to its first new shard only, the build creates the shard folders itself, as
``ShardedDatabase._open`` would, and says so in the notes). Then, for each world size, W
ranks are spawned (gloo on tcp://127.0.0.1, ``torch.set_num_threads(1)`` and one FAISS thread per rank) and each:

- reopens the database (rank r opens the shards s with s % W == r) and answers one query; its resident memory
  (VmRSS, split into anonymous and file-backed) is read then, and its peak (VmHWM) at the end. The RSS of a bare
  ``import torch, kvsearch`` process is measured too and subtracted ("extra");
- times ``sdb.candidates(q, k)`` and ``sdb.query(q, k)`` for batches of 1 / 64 / 1,024 queries per rank
  (median of a few rounds, a barrier before each; the slowest rank is reported), with the time spent inside the
  collectives ``all_gather``, ``all_gather_object``, ``all_to_all_single`` and ``all_reduce`` (torch.distributed
  is monkeypatched with timing wrappers in the rank) and inside the rank's own shard search (``_local_top``);
- checks its candidates for 64 queries against the single Database (same keys, same order);
- times the bare collectives with the same sizes (all_gather of the queries, all_to_all of the candidates),
  after a barrier, to separate transfer from waiting for a slower peer.

``sdb.query`` with values given as embeddings pickles every candidate's value row through ``all_gather_object``,
and each row is a view of one (r, value_dim) tensor, which pickle serialises whole: r^2 x value_dim x 4 bytes
(see the notes printed with the tables). Calls whose estimate exceeds ``--max-pickle-mib`` are not run; the
same call is also timed with the rows cloned (a benchmark-local patch of ``Database.values_of``) to show the cost
once that is fixed. A rank whose resident memory passes ``--max-rank-mib`` (8 GiB) stops, naming the call it was in
(the machine is shared).

On a 2-core machine 2 ranks use both cores and 4 ranks are oversubscribed (2 processes per core): the 4-rank
timings measure time-sharing, not what 4 machines would do. Each rank searches all W x b gathered queries over
m / W records, so its search work is b x m whatever W is.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BATCH = 50_000
SHARDS = 4
COLLECTIVES = ("all_gather", "all_gather_object", "all_to_all_single", "all_reduce")
CHECK_BATCH = 64


def sharded_path(m: int) -> Path:
    return common.CACHE / f"sharded_{m}_{SHARDS}_Flat"


def single_path(m: int) -> Path:
    return common.CACHE / f"single_{m}_Flat"


def done_file(path: Path) -> Path:
    """Written after a complete build (with its figures): a torn build is never reused."""
    return path.with_name(path.name + ".built.json")


def ref_file(m: int, k: int) -> Path:
    return common.CACHE / f"sharded_ref_keys_{m}_{k}.npy"


def memory() -> dict[str, float]:
    """This process's VmRSS, VmHWM, RssAnon, RssFile in MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":")[0]
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[name] = int(line.split()[1]) / 1024
    return out


def one_thread() -> None:
    import faiss
    import torch

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)


def all_queries(batches: list[int]) -> Any:
    """(SHARDS x max batch, dim) query rows: rank r of any world uses rows [r * bmax, (r + 1) * bmax)."""
    import torch

    return torch.from_numpy(common.random_queries(SHARDS * max(batches), seed=1))


def disk_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def pickle_estimate_mib(world: int, b: int, k: int, value_dim: int) -> float:
    """Bytes one rank pickles in sdb.query's value fetch: per shard r^2 x value_dim x 4 (row views of one tensor).

    r = the ids of that shard wanted by all ranks, W x b x k / shards (random data: few duplicates).
    """
    if world == 1:
        return 0.0
    r = world * b * k / SHARDS
    return (SHARDS // world) * r * r * value_dim * 4 / 2**20


# --------------------------------------------------------------------------------------------- workers


def w_bare() -> dict:
    """The resident memory of a process that only imported torch and kvsearch."""
    import torch  # noqa: F401

    import kvsearch  # noqa: F401

    return memory()


def w_build(m: int, kind: str) -> dict:
    """Build the sharded (4 shards, one process) or the single database of m random records, batches of 50k."""
    import numpy as np
    import torch

    from kvsearch import Database
    from kvsearch.distributed import ShardedDatabase
    from kvsearch.distributed.layout import ID_SHIFT, shard_dir
    from kvsearch.errors import InvalidArgumentError

    workaround = None
    keys = common.random_vectors(m)
    values = common.random_vectors(m, seed=7)
    path = sharded_path(m) if kind == "sharded" else single_path(m)
    done_file(path).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
    options = {"dim": common.DIM, "value_dim": common.DIM, "index": "Flat", "score": "dot", "device": "cpu"}
    with common.PeakMemory() as peak:
        start = time.perf_counter()
        if kind == "sharded":
            try:
                db: Any = ShardedDatabase(path, num_shards=SHARDS, **options)
            except InvalidArgumentError as exc:
                # ShardedDatabase._open passes dim / value_dim / index / score to its first shard only, so a
                # new database with keys given as embeddings (no encoder) fails on its second shard: create
                # the shard folders as _open would (same options, id range seeded), then let it reopen them.
                workaround = str(exc)
                shutil.rmtree(path, ignore_errors=True)
                for s in range(SHARDS):
                    shard = Database(shard_dir(path, s), **options)
                    shard.store.start_ids_after(s << ID_SHIFT)
                    shard.close()
                db = ShardedDatabase(path, num_shards=SHARDS, device="cpu")
        else:
            db = Database(path, **options)
        for lo in range(0, m, BATCH):
            db.add(
                torch.from_numpy(np.array(keys[lo : lo + BATCH])), torch.from_numpy(np.array(values[lo : lo + BATCH]))
            )
        db.close()
        seconds = time.perf_counter() - start
    result = {
        "kind": kind,
        "m": m,
        "seconds": seconds,
        "rate": m / seconds,
        "disk_mib": disk_mib(path),
        "peak_extra_mib": peak.extra_mib,
        "built": common.machine()["date"],
        "workaround": workaround,
    }
    done_file(path).write_text(json.dumps(result))
    return result


def _timed_rounds(call: Any, rounds: int, sync: Any, probe: Any = None) -> dict:
    """``rounds`` timed calls, each after ``sync()``, after one warm-up call; a warm-up call of a second or more
    counts as the first round (its time is the same as the next ones' at that size, and it saves a call).

    Returns the median (and min) time, and the medians of the shares of it spent in collectives and own search.
    """
    import numpy as np

    times, comm, local, calls = [], [], [], []
    warm = False
    while len(times) < rounds:
        sync()
        if probe is not None:
            probe.reset()
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        if not warm:
            warm = True
            if elapsed < 1.0:
                continue
        times.append(elapsed)
        if probe is not None:
            comm.append(probe.comm_s / elapsed)
            local.append(probe.local_s / elapsed)
            calls.append(probe.calls)
    out = {"s": float(np.median(times)), "min_s": float(np.min(times))}
    if probe is not None:
        out |= {"comm_share": float(np.median(comm)), "local_share": float(np.median(local)), "calls": max(calls)}
    return out


def w_single(m: int, k: int, batches: list[int], rounds: list[int]) -> dict:
    """The single-process Database with the same records: open, first query, candidates and query per batch."""
    import numpy as np
    import torch

    from kvsearch import Database

    one_thread()
    queries = all_queries(batches)
    bmax = max(batches)
    start = time.perf_counter()
    db = Database(single_path(m))
    opened = time.perf_counter() - start
    db.candidates(queries[:1], k)
    first = time.perf_counter() - start
    mem_open = memory()
    # reference candidates for the check: CHECK_BATCH queries of each of SHARDS ranks' slices
    check = min(CHECK_BATCH, bmax)
    ref = np.stack(
        [db.candidates(queries[r * bmax : r * bmax + check], k).keys.numpy() for r in range(SHARDS)]
    )  # (SHARDS, CHECK_BATCH, k, dim)
    np.save(ref_file(m, k), ref)
    timings = {}
    with torch.no_grad():
        for b, n in zip(batches, rounds):
            timings[f"candidates/{b}"] = _timed_rounds(lambda b=b: db.candidates(queries[:b], k), n, lambda: None)
        mem_candidates = memory()
        for b, n in zip(batches, rounds):
            timings[f"query/{b}"] = _timed_rounds(lambda b=b: db.query(queries[:b], k), n, lambda: None)
    db.close()
    return {"open_s": opened, "first_s": first, "mem_open": mem_open, "mem_candidates": mem_candidates,
            "mem_end": memory(), "timings": timings}  # fmt: skip


class Probe:
    """Time spent in torch.distributed collectives and in the rank's own shard search, per timed call."""

    def __init__(self) -> None:
        self.depth = 0
        self.count_bytes = False
        self.reset()

    def reset(self) -> None:
        self.comm_s = 0.0
        self.local_s = 0.0
        self.calls = 0
        self.object_bytes = 0
        self.per_kind: dict[str, int] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # a collective built on another one: count the outer only
                return fn(*args, **kwargs)
            if self.count_bytes and name == "all_gather_object":
                self.object_bytes += len(pickle.dumps(args[1]))
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.comm_s += time.perf_counter() - start
                self.calls += 1
                self.per_kind[name] = self.per_kind.get(name, 0) + 1
                self.depth -= 1

        return timed

    def wrap_local(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.local_s += time.perf_counter() - start

        return timed


def _clone_values(fn: Any) -> Any:
    """Database.values_of returning clones instead of row views (the fix the notes describe)."""
    import torch

    def values_of(self: Any, ids: Any) -> Any:
        return {i: (v.clone() if isinstance(v, torch.Tensor) else v) for i, v in fn(self, ids).items()}

    return values_of


def _watch_memory(limit_mib: float, state: dict[str, Any], out: str) -> None:
    """Stop this rank (exit 3) when its resident memory passes ``limit_mib``: the machine is shared."""
    import threading

    def run() -> None:
        while True:
            rss = memory()["VmRSS"]
            if rss > limit_mib:
                message = (
                    f"rank {state['rank']}: resident memory {rss:,.0f} MiB passed --max-rank-mib {limit_mib:,.0f} "
                    f"during {state['phase']}; stopped"
                )
                Path(out, f"rank{state['rank']}.failed").write_text(message)
                print(message, file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=run, daemon=True).start()


def _rank(rank: int, world: int, port: int, m: int, k: int, batches: list[int], rounds: list[int], cap: float,
          limit_mib: float, out: str) -> None:  # fmt: skip
    """One rank: open, first query, check, timed calls, bare collectives; writes out/rank<r>.json."""
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import kvsearch.database
    import kvsearch.distributed.sharded_database
    from kvsearch.distributed import ShardedDatabase

    state: dict[str, Any] = {"rank": rank, "phase": "open"}
    _watch_memory(limit_mib, state, out)
    one_thread()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=900),
    )  # fmt: skip
    barrier = dist.barrier  # not timed
    bare = {name: getattr(dist, name) for name in COLLECTIVES}
    probe = Probe()
    for name in COLLECTIVES:
        setattr(dist, name, probe.wrap(name, getattr(dist, name)))
    cls = kvsearch.distributed.ShardedDatabase
    cls._local_top = probe.wrap_local(cls._local_top)  # type: ignore[method-assign]

    queries = all_queries(batches)
    bmax = max(batches)
    mine = queries[rank * bmax : (rank + 1) * bmax]  # (bmax, dim)
    barrier()
    start = time.perf_counter()
    sdb = ShardedDatabase(sharded_path(m), timeout=900)
    opened = time.perf_counter() - start
    sdb.candidates(mine[:1], k)
    first = time.perf_counter() - start
    mem_open = memory()
    result: dict[str, Any] = {
        "rank": rank, "world": world, "shards": sorted(sdb.shards),
        "records": sum(len(db) for db in sdb.shards.values()), "open_s": opened, "first_s": first, "mem_open": mem_open,
    }  # fmt: skip

    # the check: the same candidates (keys, in order) as the single Database for CHECK_BATCH queries
    state["phase"] = "the check against the single Database"
    ref_path = ref_file(m, k)
    got = sdb.candidates(mine[: min(CHECK_BATCH, bmax)], k).keys.numpy()
    result["same_as_single"] = bool(ref_path.exists() and np.array_equal(got, np.load(ref_path)[rank]))

    # object-collective bytes of one call each (untimed diagnostic: pickling again costs time)
    values_of = kvsearch.database.Database.values_of
    probe.count_bytes = True
    for b in (1, 16):
        for name in ("candidates", "query", "query-cloned"):
            state["phase"] = f"{name} with {b} queries (pickled bytes)"
            if name == "query-cloned":
                kvsearch.database.Database.values_of = _clone_values(values_of)  # type: ignore[method-assign]
            probe.reset()
            with torch.no_grad():
                (sdb.candidates if name == "candidates" else sdb.query)(mine[:b], k)
            kvsearch.database.Database.values_of = values_of  # type: ignore[method-assign]
            result[f"object_bytes/{name}/{b}"] = probe.object_bytes
            result[f"per_kind/{name}"] = dict(probe.per_kind)
    probe.count_bytes = False

    timings: dict[str, Any] = {}
    with torch.no_grad():
        for b, n in zip(batches, rounds):  # candidates first: the peak memory after them is read apart
            q = mine[:b]
            state["phase"] = f"candidates with {b} queries"
            timings[f"candidates/{b}"] = _timed_rounds(lambda q=q: sdb.candidates(q, k), n, barrier, probe)
        result["mem_candidates"] = memory()
        for b, n in zip(batches, rounds):
            q = mine[:b]
            if world > 1:
                state["phase"] = f"query with {b} queries, value rows cloned"
                kvsearch.database.Database.values_of = _clone_values(values_of)  # type: ignore[method-assign]
                try:
                    timings[f"query-cloned/{b}"] = _timed_rounds(lambda q=q: sdb.query(q, k), n, barrier, probe)
                finally:
                    kvsearch.database.Database.values_of = values_of  # type: ignore[method-assign]
            estimate = pickle_estimate_mib(world, b, k, sdb.value_dim)
            if estimate <= cap:
                state["phase"] = f"query with {b} queries"
                timings[f"query/{b}"] = _timed_rounds(lambda q=q: sdb.query(q, k), n, barrier, probe)
            else:
                timings[f"query/{b}"] = {"skipped_mib": estimate}
    result["timings"] = timings
    result["mem_end"] = memory()

    # bare collectives of the same sizes: queries (b, dim) gathered; candidates b x k x (dim + value_dim) per peer
    collectives: dict[str, Any] = {}
    state["phase"] = "bare collectives"
    if world > 1:
        for b in batches:
            x = torch.randn(b, sdb.dim)
            parts = [torch.empty_like(x) for _ in range(world)]
            per_peer = b * k * (sdb.dim + sdb.value_dim)
            send = torch.randn(world * per_peer)
            recv = torch.empty_like(send)
            collectives[f"all_gather/{b}"] = _timed_rounds(
                lambda parts=parts, x=x: bare["all_gather"](parts, x), 7, barrier
            )
            collectives[f"all_to_all/{b}"] = _timed_rounds(
                lambda recv=recv, send=send: bare["all_to_all_single"](recv, send), 7, barrier
            )
    result["collectives"] = collectives
    sdb.close()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def w_world(m: int, world: int, k: int, batches: list[int], rounds: list[int], cap: float, limit_mib: float) -> dict:
    """Spawn ``world`` gloo ranks on 127.0.0.1 and collect their results."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        args = (world, port, m, k, batches, rounds, cap, limit_mib, out)
        try:
            mp.start_processes(_rank, args=args, nprocs=world, join=True, start_method="spawn")
        except Exception as exc:
            failed = sorted(Path(out).glob("rank*.failed"))
            return {"error": failed[0].read_text() if failed else f"{type(exc).__name__}: {exc}"}
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return {"ranks": ranks}


WORKERS = {"bare": w_bare, "build": w_build, "single": w_single, "world": w_world}


# --------------------------------------------------------------------------------------------- report


def _ms(t: dict | None, key: str = "s") -> float:
    return float("nan") if not t or key not in t else t[key] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1_000_000, help="records (default 1M)")
    parser.add_argument("--quick", action="store_true", help="m = 100k")
    parser.add_argument("--k", type=int, default=10, help="candidates per query (default 10)")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes (divisors of 4; default 1,2,4)")
    parser.add_argument("--batches", default="1,64,1024", help="queries per rank per call (default 1,64,1024)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (3 for batches >= 1,024)")
    parser.add_argument("--max-pickle-mib", type=float, default=512, help="skip sdb.query above this estimate")
    parser.add_argument("--max-rank-mib", type=float, default=8192, help="stop a rank whose RSS passes this")
    parser.add_argument("--rebuild", action="store_true", help="build the databases again")
    parser.add_argument("--no-append", action="store_true", help="print only, do not write RESULTS.md")
    args = parser.parse_args()
    m = 100_000 if args.quick else args.m
    k = args.k
    worlds = [int(w) for w in args.worlds.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rounds = [args.rounds if b < 1024 else min(3, args.rounds) for b in batches]
    cap = args.max_pickle_mib
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every worker and rank (each also sets it at run time)
    info = common.machine()
    info["torch_threads"] = 1
    script = __file__
    wall = time.perf_counter()

    builds = {}
    for kind, path in (("sharded", sharded_path(m)), ("single", single_path(m))):
        if not args.rebuild and done_file(path).exists() and path.exists():
            builds[kind] = json.loads(done_file(path).read_text()) | {"reused": True}
        else:
            builds[kind] = common.run_fresh(script, "build", {"m": m, "kind": kind}, timeout=3600)
        print(kind, builds[kind], flush=True)
    bare = common.run_fresh(script, "bare", {})
    print("bare", bare, flush=True)
    single = common.run_fresh(script, "single", {"m": m, "k": k, "batches": batches, "rounds": rounds}, timeout=3600)
    print("single", json.dumps(single)[:400], flush=True)
    runs = {}
    for world in worlds:
        kwargs = {"m": m, "world": world, "k": k, "batches": batches, "rounds": rounds, "cap": cap,
                  "limit_mib": args.max_rank_mib}  # fmt: skip
        runs[world] = common.run_fresh(script, "world", kwargs, timeout=3600)
        print(world, json.dumps(runs[world])[:400], flush=True)
    minutes = (time.perf_counter() - wall) / 60

    base = bare.get("VmRSS", float("nan"))
    d = vd = common.DIM

    # memory per rank
    mem_rows = []
    if "error" not in single:
        mo, me = single["mem_open"], single["mem_end"]
        mem_rows.append(["single Database", "-", m, 1, single["open_s"], single["first_s"], mo["VmRSS"],
                         mo["RssFile"], base, mo["VmRSS"] - base, single["mem_candidates"]["VmHWM"],
                         me["VmHWM"]])  # fmt: skip
    for world, run in runs.items():
        if "error" in run:
            mem_rows.append([f"{world} rank(s)", run["error"], *[float("nan")] * 10])
            continue
        for r in run["ranks"]:
            mo, mc, me = r["mem_open"], r["mem_candidates"], r["mem_end"]
            mem_rows.append([f"{world} rank(s)", r["rank"], r["records"], len(r["shards"]), r["open_s"],
                             r["first_s"], mo["VmRSS"], mo["RssFile"], base, mo["VmRSS"] - base, mc["VmHWM"],
                             me["VmHWM"]])  # fmt: skip
    mem_table = common.table(
        ["setup", "rank", "records", "shards", "open s", "open + first query s", "RSS MiB", "of which file-backed",
         "bare import RSS", "RSS - bare", "peak RSS after candidates calls", "peak RSS (end)"],
        mem_rows,
    )  # fmt: skip

    # latency
    lat_rows = []
    for b in batches:
        for method in ("candidates", "query"):
            t = single.get("timings", {}).get(f"{method}/{b}")
            lat_rows.append(["single Database", b, method, _ms(t), _ms(t, "min_s"), b / t["s"] if t else float("nan"),
                             "-", "-", "-", "-", 0])  # fmt: skip
        for world, run in runs.items():
            if "error" in run:
                continue
            ranks = run["ranks"]
            gathered = world * b * d * 4
            cand_bytes = b * world * k * ((d + vd) * 4 + 8)
            for method in ("candidates", "query", "query-cloned"):
                ts = [r["timings"].get(f"{method}/{b}") for r in ranks]
                if any(t is None for t in ts):
                    continue
                label = {"query-cloned": "query, value rows cloned (patched)"}.get(method, method)
                if any("skipped_mib" in t for t in ts):
                    est = max(t.get("skipped_mib", 0) for t in ts)
                    lat_rows.append([f"{world} rank(s)", b, label, f"not run: ~{est:,.0f} MiB pickled per rank",
                                     *["-"] * 7])  # fmt: skip
                    continue
                slow = max(t["s"] for t in ts)
                lat_rows.append(
                    [f"{world} rank(s)", b, label, slow * 1000, min(t["s"] for t in ts) * 1000, world * b / slow,
                     100 * sum(t["comm_share"] for t in ts) / world, 100 * sum(t["local_share"] for t in ts) / world,
                     max(t["calls"] for t in ts), f"{(gathered + cand_bytes) / 2**20:.3g}",
                     pickle_estimate_mib(world, b, k, vd) if method == "query" else 0]
                )  # fmt: skip
    lat_table = common.table(
        ["setup", "queries per rank", "call", "ms (slowest rank)", "ms (fastest rank)", "queries/s (all ranks)",
         "% in collectives", "% in own shard search", "collectives per call",
         "MiB in: gathered queries + candidates (formula)", "value pickling estimate MiB"],
        lat_rows,
    )  # fmt: skip

    # bare collectives
    coll_rows = []
    for world, run in runs.items():
        if "error" in run or world == 1:
            continue
        for b in batches:
            ag = [r["collectives"][f"all_gather/{b}"]["s"] for r in run["ranks"]]
            a2a = [r["collectives"][f"all_to_all/{b}"]["s"] for r in run["ranks"]]
            ag_bytes = world * b * d * 4
            a2a_bytes = world * b * k * (d + vd) * 4
            coll_rows.append([world, b, f"{ag_bytes / 2**20:.3g}", max(ag) * 1000, ag_bytes / max(ag) / 1e9,
                              f"{a2a_bytes / 2**20:.3g}", max(a2a) * 1000, a2a_bytes / max(a2a) / 1e9])  # fmt: skip
    coll_table = common.table(
        ["ranks", "queries per rank", "all_gather MiB received", "all_gather ms", "GB/s", "all_to_all MiB received",
         "all_to_all ms", "GB/s"],
        coll_rows,
    )  # fmt: skip

    build_rows = [
        [kind, r.get("rate", float("nan")), r.get("seconds", float("nan")), r.get("disk_mib", float("nan")),
         r.get("peak_extra_mib", float("nan")), f"reused (built {r.get('built')})" if r.get("reused") else "now"]
        for kind, r in builds.items()
    ]  # fmt: skip
    build_table = common.table(
        ["database", "records/s", "seconds", "MiB on disk", "peak extra MiB", "built"], build_rows
    )

    checks = []
    if builds["sharded"].get("workaround"):
        checks.append(
            "- Build: `ShardedDatabase(path, num_shards=4, dim=..., value_dim=..., index=..., score=...)` failed on "
            f"its second shard ({builds['sharded']['workaround']!r}: `_open` passes the options to the first shard "
            "only); the shard folders were created as `_open` would (same options, id ranges seeded) and then "
            "opened with `ShardedDatabase(path, num_shards=4)`."
        )
    for world, run in runs.items():
        if "error" not in run:
            same = all(r["same_as_single"] for r in run["ranks"])
            r0 = run["ranks"][0]
            checks.append(
                f"- {world} rank(s): candidates of {min(CHECK_BATCH, max(batches))} queries per rank equal the "
                f"single Database's (keys, in order): {same}; collectives per call, rank 0: candidates "
                f"{r0['per_kind/candidates']}, query {r0['per_kind/query']}; bytes rank 0 pickled in "
                "all_gather_object per call with 1 / 16 queries per rank: candidates "
                f"{r0['object_bytes/candidates/1']:,} / {r0['object_bytes/candidates/16']:,}, query "
                f"{r0['object_bytes/query/1']:,} / {r0['object_bytes/query/16']:,}, query with value rows cloned "
                f"{r0['object_bytes/query-cloned/1']:,} / {r0['object_bytes/query-cloned/16']:,}."
            )
    notes = "\n".join(
        [
            f"- m = {m:,} random unit keys (d = {d}) given as embeddings, values {vd}-d, index Flat (FAISS "
            f"IndexFlatIP per shard), score dot, k = {k}, {SHARDS} shards; rank r of W serves the shards s % W == r. "
            f"Each rank: gloo on 127.0.0.1, torch.set_num_threads(1), one FAISS thread. The single Database runs "
            f"with one thread too.",
            f"- Rounds: median of {rounds} (per batch) after one warm-up call (which counts as the first round when "
            "it took 1 s or more), a barrier before each; "
            "'ms (slowest rank)' is the largest per-rank median. '% in collectives' is the wall time inside the "
            "torch.distributed calls (pickling of object collectives and waiting for slower peers included), mean "
            "over ranks; '% in own shard search' is the rank's `_local_top` (search of its shards for all gathered "
            "queries, gather of keys and values, its top-k).",
            "- Oversubscribed: this machine has 2 cores, so 4 ranks time-share them (2 processes per core) and the "
            "4-rank rows are not what 4 machines would give. Every rank searches all W x b gathered queries over "
            "m / W records: b x m work per rank whatever W is, so on one machine more ranks add total work.",
            f"- Memory: 'bare import RSS' is a process that only ran `import torch, kvsearch` ({base:,.0f} MiB). "
            "RSS is read after open + the first query; 'file-backed' is the memory-mapped embeddings side files "
            "(copy-on-write, read whole by the CRC check at open); the peak is VmHWM at the end of the run (after "
            "the 1,024-query calls), also read after the `candidates` calls, before any `query` call.",
            "- `sdb.query` fetches the value of every candidate of every rank's queries through all_gather_object; "
            "with values given as embeddings each value is a row view of one (r, value_dim) tensor, which pickle "
            "serialises with its whole storage: ~r^2 x value_dim x 4 bytes per shard (r ~ W x b x k / shards). "
            f"Calls estimated above {cap:,.0f} MiB are not run; 'value rows cloned (patched)' rows patch "
            "`Database.values_of` in the rank to return clones, which is what the call would cost once fixed.",
            f"- Whole run {minutes:.1f} min.",
            *checks,
        ]
    )
    common.report(
        "bench_distributed",
        common.command_line(),
        info,
        [
            ("Memory per rank", mem_table),
            (f"Query latency (k = {k})", lat_table),
            ("Bare gloo collectives, same sizes (127.0.0.1, after a barrier)", coll_table),
            ("Build (one process)", build_table),
            ("Notes", notes),
        ],
        not args.no_append,
    )


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
