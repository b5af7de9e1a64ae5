"""The differentiable query (top-k search + pooling) vs the bare search, and dense attention over every key:
our streaming attention vs dense torch vs torch's fused scaled_dot_product_attention (SDPA).

    python benchmarks/bench_attention.py --m 1000000     # m = 100k and 1M, batches 64 and 1,024 (full run)
    python benchmarks/bench_attention.py --quick         # m = 100k, batch 64 (< 3 min)

Data: random unit keys and values (d = 384), random unit queries. Every configuration runs in a fresh process;
"peak extra MiB" is the high-water mark of the measured call above the loaded data. Dense configurations whose
estimated memory exceeds --max-gib are not run and are reported as not fitting.

The top-k rows use a :class:`kvsearch.Database` (score "dot", k = 32, softmax pooling) whose store mirror is
filled directly with the vectors (no SQLite ingest, which bench_ingest.py measures); ``query`` is the full
public call: search, gather, score, pool, Answer (ids, lazy keys, decoded best value).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

K = 32


def _measure(fn) -> dict:
    """Time fn (one call under the peak-memory probe; median of 3 when a call is under 2 s)."""
    with common.PeakMemory() as peak:
        start = time.perf_counter()
        fn()
        first = time.perf_counter() - start
    seconds = first if first > 2 else common.timeit(fn, repeat=3, warmup=0)
    return {"seconds": seconds, "peak_extra_mib": peak.extra_mib}


def _data(m: int, nq: int):
    import numpy as np
    import torch

    keys = torch.from_numpy(np.array(common.random_vectors(m)))  # (m, d)
    values = torch.from_numpy(np.array(common.random_vectors(m, seed=7)))  # (m, d)
    queries = torch.from_numpy(common.random_queries(nq))  # (nq, d)
    return keys, values, queries


def w_topk(m: int, nq: int, mode: str, index: str) -> dict:
    """The bare index search, the query forward, or forward + backward, on a database of m records."""
    import torch

    from kvsearch import Database

    keys, values, queries = _data(m, nq)
    db = Database(None, dim=common.DIM, value_dim=common.DIM, score="dot", index=index)
    store = db.store
    store.table.ids, store.table.keys, store.table.values = torch.arange(1, m + 1), keys, values
    db.index.rebuild()  # from the store's tensors set above
    db.index.search(queries[:1], K)  # norms / first-touch outside the measurement
    if mode == "search":
        return _measure(lambda: db.index.search(queries, K))
    if mode == "query":
        return _measure(lambda: db.query(queries, k=K))

    def forward_backward():
        q = queries.clone().requires_grad_()
        db.query(q, k=K).output.sum().backward()

    return _measure(forward_backward)


def w_dense(m: int, nq: int, kind: str, backward: bool, max_gib: float) -> dict:
    """Softmax attention of nq queries over all m keys: dense torch, SDPA, or ours streaming."""
    import torch.nn.functional as F

    from kvsearch.nn.attend import attend
    from kvsearch.nn.streaming import streaming_attention

    gib = nq * m * 4 / 2**30
    estimate = {"dense": (3 if not backward else 5) * gib, "sdpa": (0.1 if not backward else 1.5) * gib}.get(kind, 0)
    if estimate > max_gib:
        return {"error": f"does not fit: needs ~{estimate:.1f} GiB > {max_gib} GiB budget"}
    keys, values, queries = _data(m, nq)

    def call():
        q = queries.clone().requires_grad_(backward)
        if kind == "dense":
            out = attend(q, keys, values, score="scaled_dot", pooling="softmax")[0]
        elif kind == "sdpa":
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None])[0]
        else:
            out = streaming_attention(q, keys, values, score="scaled_dot")
        if backward:
            out.sum().backward()
        return out

    if kind != "dense":  # equal to dense within 1e-5 (checked on a slice that fits)
        sub = slice(0, min(m, 20_000))
        q = queries[:8]
        ref = attend(q, keys[sub], values[sub], score="scaled_dot", pooling="softmax")[0]
        if kind == "sdpa":
            got = F.scaled_dot_product_attention(q[None], keys[sub][None], values[sub][None])[0]
        else:
            got = streaming_attention(q, keys[sub], values[sub], score="scaled_dot")
        err = float((got - ref).abs().max())
    else:
        err = 0.0
    r = _measure(call)
    r["max_abs_diff_vs_dense"] = err
    return r


def w_ann(m: int, nq: int, index: str, params: dict | None) -> dict:
    """Top-k attention forward + backward on clustered data with an approximate index, and its recall@K.

    The same clustered keys and queries as bench_search's ANN section; recall@K is against the exact top K by
    the same score (dot), over the same queries. SDPA over every key on these very keys is the comparison.
    """
    import numpy as np
    import torch
    import torch.nn.functional as F

    from kvsearch import Database

    data, qs = common.clustered(m, nq)
    keys = torch.from_numpy(np.ascontiguousarray(data)).float()  # (m, d)
    values = torch.from_numpy(np.array(common.random_vectors(m, seed=7))).float()  # (m, d)
    queries = torch.from_numpy(np.ascontiguousarray(qs)).float()  # (nq, d)
    if index == "sdpa":

        def sdpa() -> None:
            q = queries.clone().requires_grad_()
            F.scaled_dot_product_attention(q[None], keys[None], values[None])[0].sum().backward()

        return _measure(sdpa)
    db = Database(None, dim=common.DIM, value_dim=common.DIM, score="dot", index=index)
    store = db.store
    store.table.ids, store.table.keys, store.table.values = torch.arange(1, m + 1), keys, values
    start = time.perf_counter()
    db.index.rebuild()  # from the store's tensors set above (trains IVF, builds the HNSW graph)
    build = time.perf_counter() - start
    if params:
        db.set_search_params(**params)
    found = db.index.search(queries, K)[1]  # (nq, K) ids, 1-based
    truth = torch.topk(queries @ keys.T, K, dim=1).indices + 1  # (nq, K) exact by dot
    recall = float(np.mean([len(set(a.tolist()) & set(b.tolist())) / K for a, b in zip(found, truth)]))

    def forward_backward() -> None:
        q = queries.clone().requires_grad_()
        db.query(q, k=K).output.sum().backward()

    r = _measure(forward_backward)
    r.update(recall=recall, build_seconds=build)
    return r


WORKERS = {"topk": w_topk, "dense": w_dense, "ann": w_ann}

#: Approximate indexes for the ANN attention rows, with their search parameters (chosen for recall@32 >= 0.95).
ANN_SPECS = [("IVF1024,Flat", {"nprobe": 8}), ("HNSW32", {"efSearch": 64}), ("HNSW32", {"efSearch": 160})]


def main() -> None:
    """Parse the arguments, run every configuration in a fresh process, print the tables and write its section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1_000_000, help="largest number of records (default 1M)")
    parser.add_argument("--quick", action="store_true", help="m = 100k, batch 64 (< 3 min)")
    parser.add_argument("--index", default="torch", help="the database's index for the top-k rows")
    parser.add_argument("--max-gib", type=float, default=7.0, help="skip dense runs estimated above this")
    parser.add_argument("--no-append", action="store_true", help="print only, do not write RESULTS.md")
    parser.add_argument("--ann-only", action="store_true", help="only the ANN attention rows (clustered data, m)")
    parser.add_argument(
        "--ann-specs", nargs="+", default=None, help="only these ANN index specs, e.g. IVF1024,Flat (default: all)"
    )
    args = parser.parse_args()
    info = common.machine()
    if args.ann_only:
        ann_section(args, info)
        return
    sizes = [100_000] if args.quick else sorted({100_000, args.m})
    batches = [64] if args.quick else [64, 1024]
    topk_rows, dense_rows, got = [], [], {}
    for m in sizes:
        for nq in batches:
            for mode in ("search", "query", "query+backward"):
                r = common.run_fresh(__file__, "topk", {"m": m, "nq": nq, "mode": mode, "index": args.index})
                got[("topk", mode, m, nq)] = r
                topk_rows.append(
                    [
                        f"{m:,}",
                        nq,
                        mode,
                        r.get("seconds", math.nan) * 1000,
                        r.get("peak_extra_mib", math.nan),
                        r.get("error", ""),
                    ]
                )
                print(topk_rows[-1], flush=True)
            for kind in ("dense", "sdpa", "streaming"):
                for backward in (False, True):
                    kw = {"m": m, "nq": nq, "kind": kind, "backward": backward, "max_gib": args.max_gib}
                    r = common.run_fresh(__file__, "dense", kw)
                    got[(kind, backward, m, nq)] = r
                    dense_rows.append(
                        [
                            f"{m:,}",
                            nq,
                            kind,
                            "forward+backward" if backward else "forward",
                            r.get("seconds", math.nan) * 1000,
                            r.get("peak_extra_mib", math.nan),
                            r.get("max_abs_diff_vs_dense", math.nan),
                            r.get("error", ""),
                        ]
                    )
                    print(dense_rows[-1], flush=True)
    ratios = []
    for m in sizes:
        for nq in batches:
            s = got[("topk", "search", m, nq)].get("seconds")
            for mode in ("query", "query+backward"):
                t = got[("topk", mode, m, nq)].get("seconds")
                if s and t:
                    ratios.append([f"{m:,}", nq, f"top-k {mode} / bare search (time)", t / s])
            fb, sd = got[("topk", "query+backward", m, nq)], got[("sdpa", True, m, nq)]
            if fb.get("seconds") and sd.get("seconds"):
                ratios.append(
                    [f"{m:,}", nq, "SDPA fwd+bwd / top-k query fwd+bwd (time)", sd["seconds"] / fb["seconds"]]
                )
                ratios.append(
                    [
                        f"{m:,}",
                        nq,
                        "SDPA fwd+bwd / top-k fwd+bwd (peak extra memory)",
                        sd["peak_extra_mib"] / max(fb["peak_extra_mib"], 1.0),
                    ]
                )
            st = got[("streaming", True, m, nq)]
            if st.get("seconds") and sd.get("seconds"):
                ratios.append([f"{m:,}", nq, "SDPA fwd+bwd / streaming fwd+bwd (time)", sd["seconds"] / st["seconds"]])
    topk_table = common.table(["m", "batch", "call", "ms", "peak extra MiB", "error"], topk_rows)
    dense_table = common.table(
        ["m", "batch", "attention", "pass", "ms", "peak extra MiB", "max |diff| vs dense", "error"], dense_rows
    )
    ratio_table = common.table(["m", "batch", "ratio", "x"], ratios)
    common.report(
        "bench_attention",
        common.command_line(),
        info,
        [
            (f"Top-k differentiable query (k={K}, index={args.index}) vs the bare search", topk_table),
            ("Attention over every key: dense torch vs SDPA vs ours streaming (scaled_dot, d=384)", dense_table),
            ("Ratios", ratio_table),
        ],
        not args.no_append,
    )


def ann_section(args: argparse.Namespace, info: dict) -> None:
    """Top-k attention fwd+bwd with IVF and HNSW (recall@K stated) beside SDPA over every key, on clustered data."""
    nq, rows, got = 1024, [], {}
    chosen = [(spec, params) for spec, params in ANN_SPECS if args.ann_specs is None or spec in args.ann_specs]
    for spec, params in [("sdpa", None), ("torch", None), *chosen]:
        r = common.run_fresh(__file__, "ann", {"m": args.m, "nq": nq, "index": spec, "params": params})
        got.setdefault(spec, r)
        shown = ", ".join(f"{k} {v}" for k, v in (params or {}).items())
        name = "SDPA over every key" if spec == "sdpa" else f"top-{K} query, index {spec}"
        name += f" ({shown})" if shown else ""
        rows.append(
            [
                f"{args.m:,}",
                nq,
                name,
                r.get("seconds", math.nan) * 1000,
                r.get("peak_extra_mib", math.nan),
                r.get("recall", math.nan),
                r.get("build_seconds", math.nan),
                got["sdpa"].get("seconds", math.nan) / r.get("seconds", math.nan),
                got["sdpa"].get("peak_extra_mib", math.nan) / max(r.get("peak_extra_mib", math.nan), 1.0),
                r.get("error", ""),
            ]
        )
        print(rows[-1], flush=True)
    headers = ["m", "batch", "forward + backward", "ms", "peak extra MiB", f"recall@{K}", "index build s"]
    headers += ["SDPA / this (time)", "SDPA / this (memory)", "error"]
    common.report(
        "bench_attention (ANN rows)",
        common.command_line(),
        info,
        [
            (
                f"Top-{K} attention fwd+bwd on clustered data (score dot, d=384) vs SDPA over every key",
                common.table(headers, rows),
            )
        ],
        not args.no_append,
        name="bench_attention-ann",
    )


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
