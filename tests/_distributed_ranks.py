"""The ranks of ``tests/test_distributed.py``, and the data and cases they share with the reference.

The test module spawns the ranks once (``torch.multiprocessing``, spawn start method, gloo on
``tcp://127.0.0.1:<free port>``); each rank runs every phase of a scenario against a
:class:`~kvsearch.distributed.ShardedDatabase` and pickles what it saw to ``<root>/<scenario>-rank<r>.pkl``
after each phase. The parent runs the same cases (:func:`run_case`) on one plain :class:`~kvsearch.Database`
built from the same records, and compares. Nothing is asserted here: a rank records results and errors
(``("ok", result)`` or ``("err", type name, message)``) and the tests judge them.

A rank that meets an unexpected exception, or a ``DistributedError`` outside the phase that expects one,
records the traceback under ``"crash"`` and exits at once: its peers then fail fast instead of running
collectives out of step.
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch

DIM = 64  # n-gram encoder dim (text database)
BUCKETS = 4096
N_RECORDS = 300  # surnames stored at first; N_RECORDS .. N_RECORDS + N_NEW come in by upsert
N_NEW = 20
K = 8
TIMEOUT = 60.0  # seconds: the process group's and the sharded database's timeout
SCORES = ("dot", "scaled_dot", "cosine", "gaussian")
POOLINGS = ("softmax", "normalize", "hard", "exact", "average")
# mutations of the text database, by record number
DEL_BY_KEY = (5, 17, 40, 41, 90, 150, 299)  # deleted by key text, by another rank than the one that added it
DEL_BY_ID = (7, 33, 120, 201)  # deleted by global id, by the rank that added it (it knows the id)
UPSERT_OLD = (2, 60, 61, 250)  # stored keys given new values and metadata
# embeddings database
E_N, E_DIM, E_VALUE_DIM = 200, 16, 4
# approximate indexes: per shard well above IVF16's training minimum (39 * 16)
A_PER_SHARD, A_DIM, A_QUERIES, A_SPECS = 700, 16, 40, ("IVF16,Flat", "HNSW16")
WRITE_KEYS, WRITE_ROUNDS = 400, 10


def num_shards(world: int) -> int:
    """Shards for a world size: 4 (2 and 4 ranks), 6 for 3 ranks (the count must be a multiple of the world)."""
    return 6 if world == 3 else 4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def encoder():
    import kvsearch

    return kvsearch.NgramEncoder(dim=DIM, num_buckets=BUCKETS, device="cpu")


# ----------------------------------------------------------------------------- data


@dataclass
class Queries:
    """Queries shared by every rank and the reference: texts (may be empty), tensors (n, dim), grad weights."""

    texts: list[str]
    q: torch.Tensor  # (n, dim)
    g: torch.Tensor  # (n, value_dim): the loss is (output * g).sum()


def text_records() -> tuple[list[str], list[str], list[dict[str, int]]]:
    """N_RECORDS + N_NEW distinct surnames, their first names and metadata."""
    from kvsearch.datasets import surname_directory

    keys, values = surname_directory(N_RECORDS + N_NEW)
    meta = [{"group": i % 3, "len": len(k)} for i, k in enumerate(keys)]
    return keys, values, meta


def text_queries() -> Queries:
    """Exact stored names (and one only stored later) and one-edit misspellings of stored ones."""
    from kvsearch.datasets import noisy_query

    keys, _, _ = text_records()
    avoid = set(keys)
    texts = [keys[0], keys[60], keys[305]]
    for seed, i in enumerate((2, 5, 7, 17, 33, 90, 120, 150, 250)):
        texts.append(noisy_query(keys[i], "edit", seed=seed, avoid=avoid) or keys[i] + "x")
    q = encoder().encode(texts)  # (n, DIM)
    g = torch.randn(len(texts), DIM, generator=torch.Generator().manual_seed(1))  # (n, DIM)
    return Queries(texts, q, g)


def embedding_records() -> tuple[torch.Tensor, torch.Tensor, list[dict[str, int]]]:
    """E_N key embeddings of varied norms (so dot, cosine and gaussian rank differently), values (col 0: number)."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(E_N, E_DIM, generator=gen) * (0.5 + 1.5 * torch.rand(E_N, 1, generator=gen))  # (n, E_DIM)
    values = torch.randn(E_N, E_VALUE_DIM, generator=gen)  # (n, E_VALUE_DIM)
    values[:, 0] = torch.arange(E_N, dtype=torch.float32)
    return keys, values, [{"group": i % 3} for i in range(E_N)]


def embedding_queries() -> Queries:
    """Four stored keys exactly (for exact pooling), and random queries."""
    keys, _, _ = embedding_records()
    gen = torch.Generator().manual_seed(3)
    q = torch.cat([keys[[3, 50, 101, 199]], torch.randn(8, E_DIM, generator=gen)])  # (12, E_DIM)
    return Queries([], q, torch.randn(12, E_VALUE_DIM, generator=gen))


def approx_data(shards: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clustered keys (A_PER_SHARD per shard), values (col 0: the record number), queries near the clusters."""
    gen = torch.Generator().manual_seed(4)
    n = A_PER_SHARD * shards
    centers = 2 * torch.randn(32, A_DIM, generator=gen)  # (32, A_DIM)
    keys = centers[torch.randint(0, 32, (n,), generator=gen)] + 0.5 * torch.randn(n, A_DIM, generator=gen)
    values = torch.zeros(n, 2)
    values[:, 0] = torch.arange(n, dtype=torch.float32)
    queries = centers[torch.randint(0, 32, (A_QUERIES,), generator=gen)]
    queries = queries + 0.5 * torch.randn(A_QUERIES, A_DIM, generator=gen)  # (A_QUERIES, A_DIM)
    return keys, values, queries


def split(n: int, world: int, how: str) -> list[list[int]]:
    """Query indices per rank: ``"one"`` all on the last rank (the others none), ``"uneven"`` the last rank double."""
    if how == "one":
        return [list(range(n)) if r == world - 1 else [] for r in range(world)]
    owner = [min(i % (world + 1), world - 1) for i in range(n)]
    return [[i for i in range(n) if owner[i] == r] for r in range(world)]


# ----------------------------------------------------------------------------- cases


def text_cases(phase: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, kind, kwargs) of the calls compared on the text database in a phase."""
    if phase == "initial":
        cases = [
            ("search", "search", {"k": 5}),
            ("search-where", "search", {"k": 5, "where": {"group": 1}}),
            ("query-where", "query", {"k": K, "where": {"len": {"$gte": 6}}}),
            ("query-text-softmax", "query_text", {"k": K}),
            ("query-text-exact", "query_text", {"k": K, "pooling": "exact"}),
            ("candidates", "candidates", {"k": K}),
            ("kvattention", "kvattention", {"k": K}),
        ]
        cases += [(f"query-{s}-{p}", "query", {"k": K, "score": s, "pooling": p}) for s in SCORES for p in POOLINGS]
        return cases
    if phase == "after":
        return [
            ("search", "search", {"k": 5}),
            ("search-where", "search", {"k": 5, "where": {"group": 1}}),
            ("query-dot-softmax", "query", {"k": K, "score": "dot", "pooling": "softmax"}),
            ("query-gaussian-hard", "query", {"k": K, "score": "gaussian", "pooling": "hard"}),
            ("query-cosine-normalize", "query", {"k": K, "score": "cosine", "pooling": "normalize"}),
            ("query-scaled_dot-average", "query", {"k": K, "score": "scaled_dot", "pooling": "average"}),
            ("query-where", "query", {"k": K, "where": {"group": 9}}),
            ("query-text-exact", "query_text", {"k": K, "pooling": "exact"}),
            ("candidates", "candidates", {"k": K}),
        ]
    # after refresh / after a reopen: the same answers as "after"
    return [
        ("search", "search", {"k": 5}),
        ("query-text-exact", "query_text", {"k": K, "pooling": "exact"}),
        ("query-dot-softmax", "query", {"k": K, "score": "dot", "pooling": "softmax"}),
    ]


def embedding_cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = [
        ("search-where", "search", {"k": 5, "where": {"group": {"$in": [0, 2]}}}),
        ("candidates", "candidates", {"k": K}),
        ("kvattention", "kvattention", {"k": K}),
    ]
    return cases + [(f"query-{s}-{p}", "query", {"k": K, "score": s, "pooling": p}) for s in SCORES for p in POOLINGS]


def _value(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def _answer(ans: Any) -> dict[str, Any]:
    return {
        "output": ans.output.detach().cpu(),  # (b, value_dim)
        "weights": ans.weights.detach().cpu(),  # (b, k)
        "ids": ans.ids.detach().cpu(),  # (b, k)
        "keys": [list(row) for row in ans.keys],
        "value": [_value(v) for v in ans.value],
        "found": [bool(f) for f in ans.found],
    }


def run_case(db: Any, kind: str, data: Queries, idx: list[int], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One call on ``db`` (a Database or a rank's ShardedDatabase) with the queries ``idx``; plain results."""
    import kvsearch

    rows = torch.tensor(idx, dtype=torch.long)
    q = data.q[rows].clone().requires_grad_(True)  # (n, dim), (0, dim) on a rank without queries
    g = data.g[rows]  # (n, value_dim)
    texts = [data.texts[i] for i in idx] if data.texts else []
    if kind == "search":
        hits = db.search(texts if data.texts else q.detach(), **kwargs)
        return {"hits": [[(h.id, h.key, _value(h.value), float(h.score)) for h in row] for row in hits]}
    if kind == "query_text":
        return _answer(db.query(texts, **kwargs))
    if kind == "candidates":
        cand = db.candidates(q.detach(), kwargs["k"])
        return {"ids": cand.ids.cpu(), "keys": cand.keys.cpu(), "values": cand.values.cpu(), "mask": cand.mask.cpu()}
    if kind == "kvattention":
        output = kvsearch.KVAttention(db, k=kwargs["k"])(q)  # (n, value_dim)
        if output.requires_grad:
            (output * g).sum().backward()
        grad = q.grad if q.grad is not None else torch.zeros_like(q)
        return {"output": output.detach().cpu(), "grad": grad.cpu()}
    assert kind == "query", kind
    ans = db.query(q, **kwargs)
    if ans.output.requires_grad:
        (ans.output * g).sum().backward()
    result = _answer(ans)
    result["grad"] = (q.grad if q.grad is not None else torch.zeros_like(q)).cpu()  # (n, dim)
    return result


def other_rank_record(rank: int, world: int, shards: int) -> int:
    """The first stored record whose shard another rank serves (this rank's own for one process)."""
    from kvsearch.distributed.layout import shard_of_key

    keys, _, _ = text_records()
    return next(i for i in range(N_RECORDS) if shard_of_key(keys[i], shards) % world == (rank + 1) % world)


def run_cases(
    db: Any, data: Queries, idx: list[int], cases: list[tuple[str, str, dict[str, Any]]], tag: tuple, into: dict
) -> None:
    """Run ``cases`` with the queries ``idx``; results under ``into[(*tag, name)] = (idx, attempt(...))``."""
    for name, kind, kwargs in cases:
        into[(*tag, name)] = (idx, attempt(partial(run_case, db, kind, data, idx, kwargs)))


def attempt(fn: Callable[[], Any]) -> tuple:
    """``("ok", result)`` or ``("err", type name, message)`` for a KVSearchError (other exceptions propagate).

    A DistributedError propagates too: outside the phase that expects one, the run cannot continue in step.
    """
    from kvsearch.errors import DistributedError, KVSearchError

    try:
        return ("ok", fn())
    except DistributedError:
        raise
    except KVSearchError as exc:
        return ("err", type(exc).__name__, str(exc))


def mutate(db: Any, rank: int | None, world: int, ids_of: dict[int, int]) -> dict[str, Any]:
    """Deletes and upserts of the text database: rank ``rank``'s part (None: all of it, on a single database)."""
    keys, values, meta = text_records()

    def mine(i: int, shift: int = 0) -> bool:
        return rank is None or (i + shift) % world == rank

    items: list[str | int] = [keys[i] for i in DEL_BY_KEY if mine(i, 1)]
    items += [ids_of[i] if rank is not None else keys[i] for i in DEL_BY_ID if mine(i)]
    deleted = attempt(lambda: db.delete(items))
    nums = [i for i in UPSERT_OLD + tuple(range(N_RECORDS, N_RECORDS + N_NEW)) if mine(i)]
    new_values = [f"Renamed{i}" if i in UPSERT_OLD else values[i] for i in nums]
    new_meta = [{"group": 9, "len": meta[i]["len"]} if i in UPSERT_OLD else meta[i] for i in nums]
    upserted = attempt(lambda: db.upsert([keys[i] for i in nums], new_values, new_meta))
    return {"items": items, "deleted": deleted, "upsert_nums": nums, "upserted": upserted}


# ----------------------------------------------------------------------------- the ranks


class Results(dict):
    """What a rank saw, pickled (atomically) to its file after each phase."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(dict(self), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def result_path(root: str | Path, scenario: str, rank: int) -> Path:
    return Path(root) / f"{scenario.replace(':', '-')}-rank{rank}.pkl"


def join_group(rank: int, world: int, port: int, hang_after: float, one_thread: bool = True) -> None:
    """A spawned rank's start: one thread (torch and FAISS; unless ``one_thread`` is False: then as a rank started
    by hand has them), a traceback dump if it hangs past ``hang_after`` seconds (it never outlives the test), then
    the default gloo group on localhost."""
    import faiss
    import torch.distributed as dist

    if one_thread:
        torch.set_num_threads(1)
        faiss.omp_set_num_threads(1)
    faulthandler.dump_traceback_later(hang_after, exit=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT)
    )


def rank_main(rank: int, world: int, port: int, root: str, scenario: str) -> None:
    """The entry point of a spawned rank: one thread, gloo on localhost, then the scenario's phases."""
    out = Results(result_path(root, scenario, rank))
    try:
        sys.path.insert(0, str(Path(__file__).parent))  # a "module:function" scenario's module lives here
        join_group(rank, world, port, hang_after=280, one_thread=scenario not in OWN_THREADS)
        scenario_of(scenario)(rank, world, Path(root), out)
    except BaseException:
        out["crash"] = traceback.format_exc()
        out.save()
        sys.stderr.write(f"rank {rank} of {world} crashed:\n{out['crash']}")
        sys.stderr.flush()
        os._exit(3)
    out.save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no process-group teardown: a dead peer (the kill phase) could make it wait


def _phase(out: Results, name: str, fn: Callable[[], Any]) -> None:
    """Run a phase and save; a KVSearchError that escapes it (agreed on every rank) is recorded, and the run goes on."""
    from kvsearch.errors import DistributedError, KVSearchError

    start = time.perf_counter()
    try:
        out[name] = fn()
    except KVSearchError as exc:
        if isinstance(exc, DistributedError):
            raise
        out.setdefault("phase_errors", {})[name] = traceback.format_exc()
    out.setdefault("timing", {})[name] = time.perf_counter() - start
    out.save()


def main_scenario(rank: int, world: int, root: Path, out: Results) -> None:
    from kvsearch.distributed import ShardedDatabase
    from kvsearch.distributed.layout import ID_SHIFT, shard_of_id

    shards = num_shards(world)
    common = {"device": "cpu", "timeout": TIMEOUT}

    def layout() -> dict[str, Any]:
        # a shard count that is not a multiple of the world size: refused on every rank
        return {"bad_count": attempt(lambda: ShardedDatabase(root / "bad", num_shards=world + 1, dim=8, value_dim=2))}

    def text() -> dict[str, Any]:
        keys, values, meta = text_records()
        data = text_queries()
        res: dict[str, Any] = {}
        sdb = ShardedDatabase(root / "text", num_shards=shards, encoder=encoder(), index="Flat", score="dot", **common)
        res["who"] = (sdb.rank, sdb.world_size, sdb.num_shards, sorted(sdb.shards))
        nums = [i for i in range(N_RECORDS) if i % world == rank]
        ids = sdb.add([keys[i] for i in nums], [values[i] for i in nums], [meta[i] for i in nums])
        res["added"] = list(zip(nums, ids))
        ids_of = dict(res["added"])
        res["len"] = len(sdb)
        # each rank asks about records that live on another rank's shards; odd ranks ask a stored key where even
        # ranks ask a missing one (an answer must be the asking rank's own, never a peer's)
        other = other_rank_record(rank, world, shards)
        maybe = keys[other] if rank % 2 else "Nobody-at-all"
        res["contains"] = (attempt(lambda: keys[other] in sdb), attempt(lambda: maybe in sdb))
        res["lookup"] = (attempt(lambda: sdb.lookup(keys[other])), attempt(lambda: sdb.lookup(maybe, default=None)))
        away = [i for n, i in res["added"] if shard_of_id(i) % world != rank]
        record = attempt(lambda: sdb.get(away[0] if away else ids[0]))
        res["get"] = (
            record
            if record[0] == "err"
            else ("ok", (record[1].id, record[1].key, record[1].value, dict(record[1].metadata)))
        )
        res["get_missing"] = attempt(lambda: sdb.get((shards - 1) << ID_SHIFT | 10**9))
        res["cases"] = {}
        for how in ("one", "uneven"):
            idx = split(len(data.texts), world, how)[rank]
            run_cases(sdb, data, idx, text_cases("initial"), ("initial", how), res["cases"])
        res["mutations"] = mutate(sdb, rank, world, ids_of)
        res["len_after"] = len(sdb)
        idx = split(len(data.texts), world, "uneven")[rank]
        run_cases(sdb, data, idx, text_cases("after"), ("after", "uneven"), res["cases"])
        res["refresh"] = attempt(sdb.refresh)
        run_cases(sdb, data, idx, text_cases("refresh"), ("refresh", "uneven"), res["cases"])
        sdb.close()
        sdb = ShardedDatabase(root / "text", **common)  # reopened by the same world
        run_cases(sdb, data, idx, text_cases("reopen"), ("reopen", "uneven"), res["cases"])
        sdb.close()
        return res

    def embeddings() -> dict[str, Any]:
        keys, values, meta = embedding_records()
        data = embedding_queries()
        sdb = ShardedDatabase(
            root / "emb", num_shards=shards, dim=E_DIM, value_dim=E_VALUE_DIM, index="Flat", score="dot", **common
        )
        nums = [i for i in range(E_N) if i % world == rank]
        ids = sdb.add(keys[nums], values[nums], [meta[i] for i in nums])
        res: dict[str, Any] = {"added": list(zip(nums, ids)), "cases": {}}
        idx = split(len(data.q), world, "uneven")[rank]
        run_cases(sdb, data, idx, embedding_cases(), ("initial", "uneven"), res["cases"])
        sdb.close()
        return res

    def approx() -> dict[str, Any]:
        keys, values, queries = approx_data(shards)
        nums = [i for i in range(len(keys)) if i % world == rank]
        idx = split(A_QUERIES, world, "uneven")[rank]
        res: dict[str, Any] = {"idx": idx}
        for spec in A_SPECS:
            params = {"nprobe": 4} if spec.startswith("IVF") else {"efSearch": 32}
            sdb = ShardedDatabase(
                root / spec.replace(",", "-"),
                num_shards=shards,
                dim=A_DIM,
                value_dim=2,
                index=spec,
                score="dot",
                search_params=params,
                **common,
            )
            sdb.add(keys[nums], values[nums])
            hits = sdb.search(queries[idx], k=10)
            trained = [not getattr(db.index, "is_fallback", False) for db in sdb.shards.values()]
            res[spec] = {"found": [[int(h.value[0]) for h in row] for row in hits], "trained": trained}
            sdb.close()
        return res

    def writes() -> dict[str, Any]:
        from kvsearch.datasets import load_surnames

        names = load_surnames()[1000 : 1000 + WRITE_KEYS]
        sdb = ShardedDatabase(root / "writes", num_shards=shards, encoder=encoder(), **common)
        added = []
        per_round = WRITE_KEYS // WRITE_ROUNDS
        for j in range(WRITE_ROUNDS):
            nums = [
                i
                for i in range(j * per_round, (j + 1) * per_round)
                if (world - 1 if j == 3 else min((i + j) % (world + 1), world - 1)) == rank
            ]
            ids = sdb.add([names[i] for i in nums], [f"v{i}" for i in nums], [{"i": i} for i in nums])
            added += list(zip(nums, ids))
        sdb.close()
        rr = ShardedDatabase(root / "rr", num_shards=shards, dim=8, value_dim=2, **common)
        rr_added = []
        for c, n in ((0, 10), (1, 13)):
            gen = torch.Generator().manual_seed(100 * c + rank)
            nums = [c * 1000 + rank * 100 + j for j in range(n)]
            vals = torch.tensor([[float(i), float(rank)] for i in nums])  # (n, 2)
            rr_added += list(zip(nums, rr.add(torch.randn(n, 8, generator=gen), vals)))
        rr.close()
        return {"added": added, "rr_added": rr_added}

    def reopen() -> dict[str, Any]:
        # created and filled by the parent alone (one process, every shard); now opened by this world
        data = text_queries()
        sdb = ShardedDatabase(root / "reopen", **common)
        idx = split(len(data.texts), world, "uneven")[rank]
        res = {"who": (sdb.rank, sdb.world_size, sorted(sdb.shards)), "len": len(sdb), "cases": {}}
        run_cases(sdb, data, idx, text_cases("initial")[:6], ("initial", "uneven"), res["cases"])
        sdb.close()
        return res

    def errors() -> dict[str, Any]:
        return error_phase(rank, world, root, shards)

    for name, fn in (
        ("layout", layout),
        ("text", text),
        ("embeddings", embeddings),
        ("approx", approx),
        ("writes", writes),
        ("reopen", reopen),
        ("errors", errors),
    ):
        _phase(out, name, fn)
    kill_phase(rank, world, root, shards, out)


def error_phase(rank: int, world: int, root: Path, shards: int) -> dict[str, Any]:
    """Bad input on one rank only: every rank must raise the same error type, and the next call must work."""
    import kvsearch
    from kvsearch.datasets import load_surnames
    from kvsearch.distributed import ShardedDatabase

    last = world - 1
    names = load_surnames()[:50]
    sdb = ShardedDatabase(root / "errs", num_shards=shards, encoder=encoder(), device="cpu", timeout=TIMEOUT)
    sdb.add(names if rank == 0 else [], [f"v{i}" for i in range(50)] if rank == 0 else [])
    good = encoder().encode(["Smith", "Jonson"])  # (2, DIM)
    nan = torch.full((1, DIM), math.nan)

    def probe() -> tuple:
        return attempt(lambda: [[h.key for h in row] for row in sdb.search(["Smith", "Jonson"], k=3)])

    res: dict[str, Any] = {"baseline": probe(), "len": len(sdb), "cases": {}}
    bad_calls: dict[str, Callable[[], Any]] = {
        "nan-search": lambda: sdb.search(nan if rank == last else good, k=3),
        "nan-query": lambda: sdb.query(nan if rank == last else good, k=3),
        "wrong-dim": lambda: sdb.search(torch.ones(1, DIM + 1) if rank == 0 else good, k=3),
        "bad-k": lambda: sdb.search(good, k=0 if rank == last else 3),
        "duplicate-key": lambda: sdb.add(["Smith"] if rank == last else ["Qwertyuiopname"], ["x"]),
        "missing-key": lambda: sdb.delete(["Not-a-stored-name"] if rank == 0 else []),
        "k-all": lambda: sdb.query(good, k="all"),
        "finetune-values": lambda: kvsearch.finetune(sdb, [("Smith", "Smith")], train_values=True, epochs=1),
    }
    for name, call in bad_calls.items():
        res["cases"][name] = (attempt(call), probe(), attempt(lambda: len(sdb)))
    res["stray_written"] = attempt(lambda: "Qwertyuiopname" in sdb)
    sdb.close()
    return res


def kill_phase(rank: int, world: int, root: Path, shards: int, out: Results) -> None:
    """The last rank exits hard between two collectives; the others must get DistributedError, not hang."""
    from kvsearch.datasets import load_surnames
    from kvsearch.distributed import ShardedDatabase
    from kvsearch.errors import DistributedError, KVSearchError

    names = load_surnames()[2000:2060]
    sdb = ShardedDatabase(root / "kill", num_shards=shards, encoder=encoder(), device="cpu", timeout=TIMEOUT)
    nums = [i for i in range(40) if i % world == rank]
    ids = sdb.add([names[i] for i in nums], [f"k{i}" for i in nums])
    res: dict[str, Any] = {"committed": list(zip(nums, ids)), "len": len(sdb)}  # len: every rank is past the add
    out["kill"] = res
    out.save()
    if rank == world - 1:
        out.save()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # exit code 0: the parent must not take this for a crash
    late = [i for i in range(40, 60) if i % world == rank]
    time.sleep(0.5)  # the peer is gone (or going) before the next collective
    for name, call in (
        ("add", lambda: sdb.add([names[i] for i in late], [f"late{i}" for i in late])),
        ("search", lambda: sdb.search(["Smith"], k=3)),
    ):
        start = time.perf_counter()
        try:
            call()
            res[name] = ("no error", time.perf_counter() - start, "")
        except KVSearchError as exc:
            kind = "DistributedError" if isinstance(exc, DistributedError) else type(exc).__name__
            res[name] = (kind, time.perf_counter() - start, str(exc))
        except Exception as exc:  # noqa: BLE001 - reported: the test expects DistributedError
            res[name] = (type(exc).__name__, time.perf_counter() - start, str(exc))
        out.save()
    try:
        sdb.close()
        res["close"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported
        res["close"] = f"{type(exc).__name__}: {exc}"
    out.save()


def silent_scenario(rank: int, world: int, root: Path, out: Results) -> None:
    """A live peer that skips a collective: the others get DistributedError within the database's timeout."""
    from kvsearch.distributed import ShardedDatabase
    from kvsearch.errors import KVSearchError

    timeout = 5.0
    sdb = ShardedDatabase(
        root / "silent", num_shards=num_shards(world), encoder=encoder(), device="cpu", timeout=timeout
    )
    sdb.add(["Smith", "Jones"] if rank == 0 else [], ["a", "b"] if rank == 0 else [])
    res: dict[str, Any] = {"timeout": timeout}
    out["silent"] = res
    out.save()
    if rank == world - 1:
        time.sleep(timeout + 20)  # alive, but never calls
        return
    start = time.perf_counter()
    try:
        sdb.search(["Smith"], k=1)
        res["search"] = ("no error", time.perf_counter() - start, "")
    except KVSearchError as exc:
        res["search"] = (type(exc).__name__, time.perf_counter() - start, str(exc))
    out.save()


# ----------------------------------------------------------------------------- fine-tuning across ranks

FT_NAMES, FT_K, FT_LR = 600, 16, 0.5


def finetune_data() -> tuple[list[str], list[str], list[tuple[str, str]], list[tuple[str, str]]]:
    """Names and first names, Cyrillic-script training pairs and held-out pairs (the test_training task, small)."""
    from kvsearch.datasets import noisy_queries, split_names, surname_directory

    keys, values = surname_directory(FT_NAMES)
    train, held = split_names(keys, 0.2, seed=0)
    stored = set(keys)
    return keys, values, noisy_queries(train, "cyrillic", avoid=stored), noisy_queries(held, "cyrillic", avoid=stored)


def grad_options() -> dict[str, Any]:
    """One plain SGD step over every pair in one batch: the weights' change is -lr times the full-batch gradient."""
    return {
        "loss": "retrieval",
        "epochs": 1,
        "batch_size": 10_000,
        "optimizer": "sgd",
        "lr": FT_LR,
        "k": FT_K,
        "generated": 0,  # a sharded database generates no pairs (yet): the single-process reference must not either
        "keep": "last",  # the step is committed whatever it does to recall (keep="best" would judge it first)
        "verbose": False,
    }


def improve_options() -> dict[str, Any]:
    # the options of before issue 22: without generated pairs (none across shards yet), a query-side copy learns
    return {
        "loss": "retrieval",
        "k": FT_K,
        "epochs": 2,
        "batch_size": 64,
        "train": "query",
        "lr": 1e-2,
        "lr_decay": "none",
        "generated": 0,
        "verbose": False,
    }


def finetune_scenario(rank: int, world: int, root: Path, out: Results) -> None:
    """finetune on a sharded database, each rank with its own (uneven) share of the pairs."""
    import kvsearch
    from kvsearch.distributed import ShardedDatabase

    keys, values, train, held = finetune_data()

    def build(name: str) -> ShardedDatabase:
        sdb = ShardedDatabase(root / name, num_shards=num_shards(world), encoder=encoder(), device="cpu")
        sdb.add(keys if rank == 0 else [], values if rank == 0 else [])  # rank 0 brings every record
        return sdb

    def grad() -> dict[str, Any]:
        sdb = build("grad")
        mine = [train[i] for i in split(len(train), world, "uneven")[rank]]
        history = kvsearch.finetune(sdb, mine, train="query+keys", **grad_options())
        state = {n: t.detach().clone() for n, t in sdb.encoder.state_dict().items()}
        res = {"state": state, "losses": history.losses, "committed": history.committed}
        res["generations"] = (sdb.generation, {s: db.generation for s, db in sdb.shards.items()})
        sdb.close()
        return res

    def improve() -> dict[str, Any]:
        sdb = build("improve")
        mine = [train[i] for i in split(len(train), world, "uneven")[rank]]
        mine_held = [held[i] for i in split(len(held), world, "uneven")[rank]]
        history = kvsearch.finetune(sdb, mine, eval_pairs=mine_held, **improve_options())
        asked = [q for q, _ in held[:10]]
        res = {
            "metrics": history.metrics,
            "committed": history.committed,
            "kept_epoch": history.kept_epoch,
            "generations": (sdb.generation, {s: db.generation for s, db in sdb.shards.items()}),
            "search": [[h.key for h in row] for row in sdb.search(asked, k=3)],
            "evaluate": kvsearch.evaluate(sdb, mine_held, k=FT_K),
        }
        sdb.close()
        return res

    _phase(out, "grad", grad)
    _phase(out, "improve", improve)


# ----------------------------------------------------------------------------- mismatched calls, threads per rank


def mismatch_scenario(rank: int, world: int, root: Path, out: Results) -> None:
    """Ranks that call different methods (or one method with arguments that must agree, differing): what each rank
    raised and how long it took; then the thread count of a rank started by hand (not by torchrun)."""
    import warnings

    from kvsearch.distributed import ShardedDatabase

    os.environ.pop("OMP_NUM_THREADS", None)
    threads: dict[str, Any] = {"before": torch.get_num_threads()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sdb = ShardedDatabase(root / "mismatch", num_shards=num_shards(world), encoder=encoder(), timeout=TIMEOUT)
    threads["after"] = torch.get_num_threads()
    threads["warnings"] = [str(w.message) for w in caught if "OMP_NUM_THREADS" in str(w.message)]
    sdb.add(["Smith", "Jones", "Li", "Lipton"] if rank == 0 else [], ["a", "b", "c", "d"] if rank == 0 else [])
    q = encoder().encode(["Smith", "Li"])  # (2, DIM)
    first = rank == 0
    calls: dict[str, Callable[[], Any]] = {
        "search-vs-query": lambda: sdb.search(q, k=2) if first else sdb.query(q[:1], k=2),
        "len-vs-candidates": lambda: len(sdb) if first else sdb.candidates(q, 2),
        "add-vs-delete": lambda: sdb.add(["Zed"], ["z"]) if first else sdb.delete(["Li"]),
        "k-differs": lambda: sdb.search(["Smith"], k=1 if first else 3),
        "exact-on-one-rank": lambda: sdb.query(q, k=2, pooling="exact" if first else "softmax"),
        "draft-refresh-vs-candidates": lambda: in_draft(lambda d: d.refresh() if first else d.candidates(q, 2)),
    }

    def in_draft(call: Callable[[Any], Any]) -> Any:  # a fine-tuning run's draft (collective methods of its own)
        with sdb.begin_generation() as draft:
            return call(draft)

    res: dict[str, Any] = {"threads": threads, "timeout": TIMEOUT}

    def outcome(call: Callable[[], Any]) -> tuple:  # DistributedError included
        from kvsearch.errors import KVSearchError

        try:
            call()
            return ("ok",)
        except KVSearchError as exc:
            return ("err", type(exc).__name__, str(exc))

    for name, call in calls.items():
        start = time.perf_counter()
        got = outcome(call)
        res[name] = (got, time.perf_counter() - start, attempt(lambda: [h.key for h in sdb.search("Smith", k=1)]))
        out["mismatch"] = res
        out.save()
    res["len"] = attempt(lambda: len(sdb))  # nothing was written by the refused add
    sdb.close()
    # a thread count chosen with OMP_NUM_THREADS is left alone
    os.environ["OMP_NUM_THREADS"] = "2"
    torch.set_num_threads(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ShardedDatabase(root / "mismatch", timeout=TIMEOUT).close()
    threads["omp_set"] = (torch.get_num_threads(), [str(w.message) for w in caught if "OMP_NUM_THREADS" in str(w)])
    out["mismatch"] = res
    out.save()


SCENARIOS: dict[str, Callable[[int, int, Path, Results], None]] = {
    "main": main_scenario,
    "silent": silent_scenario,
    "finetune": finetune_scenario,
    "mismatch": mismatch_scenario,
}
OWN_THREADS = {"mismatch"}  # scenarios whose ranks keep the thread counts a rank started by hand has


def scenario_of(name: str) -> Callable[[int, int, Path, Results], None]:
    """A scenario by name: one of :data:`SCENARIOS`, or ``"module:function"`` for one kept in another test module
    (``"test_sharded_where:where_scenario"``; the module is imported from this folder)."""
    if ":" not in name:
        return SCENARIOS[name]
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


def start_ranks(world: int, root: Path, scenario: str) -> list[Any]:
    """Spawn the ranks (spawn start method); they run while the caller computes its references."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(root), scenario)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def join_ranks(procs: list[Any], root: Path, scenario: str, deadline_s: float) -> tuple[list[int | None], list[dict]]:
    """Wait for the ranks (killing any still alive at the deadline); their exit codes and results."""
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
        codes.append(p.exitcode)
    results = []
    for r in range(len(procs)):
        path = result_path(root, scenario, r)
        results.append(pickle.loads(path.read_bytes()) if path.exists() else {})
    return codes, results
