"""kvsearch vs Chroma (PersistentClient, the embedded vector store) on the same vectors.

    python benchmarks/bench_chroma.py              # the ~94k MiniLM name embeddings (the full run)
    python benchmarks/bench_chroma.py --quick      # the first 20,000 of them (< 3 min)

Both stores get the same vectors (ids + 384-d embeddings; our value is one float, the row number) and the same
queries (MiniLM embeddings of misspelt names). Measured: ingest records/s (into a new on-disk store, closed at the
end), single-query QPS (200 queries one call each), batched QPS (1,024 queries in one call), recall@10 against
exact cosine search. Needs ``pip install -e .[bench]`` (chromadb).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

K = 10
SINGLE = 200


def _data(n: int | None):
    import numpy as np

    _, data, queries = common.name_embeddings(1024)
    data = np.array(data if n is None else data[:n])
    truth = common.exact_topk(data, queries, K)
    return data, queries, truth


def w_ours(n: int | None, index: str, ef: int | None) -> dict:
    """Ingest, single and batched queries, recall@10 of a kvsearch database (score cosine)."""
    import numpy as np
    import torch

    from kvsearch import Database

    data, queries, truth = _data(n)
    folder = Path(tempfile.mkdtemp(prefix="kvs-chroma-"))
    try:
        with common.PeakMemory() as peak:
            start = time.perf_counter()
            db = Database(folder / "db", dim=common.DIM, value_dim=1, index=index)
            for lo in range(0, len(data), 50_000):
                chunk = torch.from_numpy(data[lo : lo + 50_000])
                db.add(chunk, torch.arange(lo, lo + len(chunk), dtype=torch.float32).unsqueeze(1))
            db.close()
            ingest = time.perf_counter() - start
        db = Database(folder / "db")
        if ef is not None:
            db.set_search_params(efSearch=ef)
        q = torch.from_numpy(queries)
        db.search(q[:8], k=K)
        start = time.perf_counter()
        for i in range(SINGLE):
            db.search(q[i], k=K)
        single = (time.perf_counter() - start) / SINGLE
        batched = common.timeit(lambda: db.search(q, k=K), repeat=3, warmup=1)
        hits = db.search(q, k=K)
        found = np.array([[h.id - 1 for h in row] + [-1] * (K - len(row)) for row in hits])  # ids start at 1
        db.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "ingest_rate": len(data) / ingest,
        "single_qps": 1 / single,
        "batched_qps": len(queries) / batched,
        "recall": common.recall_at(found, truth),
        "peak_extra_mib": peak.extra_mib,
        "n": len(data),
    }


def w_chroma(n: int | None) -> dict:
    """The same with chromadb.PersistentClient (HNSW, cosine space, its defaults otherwise)."""
    import chromadb
    import numpy as np

    data, queries, truth = _data(n)
    folder = Path(tempfile.mkdtemp(prefix="chroma-"))
    try:
        with common.PeakMemory() as peak:
            start = time.perf_counter()
            client = chromadb.PersistentClient(path=str(folder))
            col = client.create_collection("names", metadata={"hnsw:space": "cosine"})
            step = min(5_000, client.get_max_batch_size())
            for lo in range(0, len(data), step):
                chunk = data[lo : lo + step]
                col.add(ids=[str(i) for i in range(lo, lo + len(chunk))], embeddings=chunk)
            ingest = time.perf_counter() - start
        col.query(query_embeddings=queries[:8], n_results=K)
        start = time.perf_counter()
        for i in range(SINGLE):
            col.query(query_embeddings=queries[i : i + 1], n_results=K)
        single = (time.perf_counter() - start) / SINGLE
        batched = common.timeit(lambda: col.query(query_embeddings=queries, n_results=K), repeat=3, warmup=1)
        res = col.query(query_embeddings=queries, n_results=K)
        found = np.array([[int(i) for i in row] + [-1] * (K - len(row)) for row in res["ids"]])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "ingest_rate": len(data) / ingest,
        "single_qps": 1 / single,
        "batched_qps": len(queries) / batched,
        "recall": common.recall_at(found, truth),
        "peak_extra_mib": peak.extra_mib,
        "n": len(data),
    }


WORKERS = {"ours": w_ours, "chroma": w_chroma}


def main() -> None:
    """Run kvsearch (exact torch index, HNSW32) and Chroma in fresh processes; print and append the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first 20,000 names only (< 3 min)")
    parser.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = parser.parse_args()
    info = common.machine()
    n = 20_000 if args.quick else None
    configs = [
        ("kvsearch, index=torch (exact, float32)", "ours", {"n": n, "index": "torch", "ef": None}),
        (
            "kvsearch, index=torch:bfloat16 (exact: bf16 scan, checked)",
            "ours",
            {"n": n, "index": "torch:bfloat16", "ef": None},
        ),
        ("kvsearch, index=Flat (FAISS exact)", "ours", {"n": n, "index": "Flat", "ef": None}),
        ("kvsearch, index=HNSW32 (default efSearch=64)", "ours", {"n": n, "index": "HNSW32", "ef": None}),
        ("kvsearch, index=HNSW32, efSearch=128", "ours", {"n": n, "index": "HNSW32", "ef": 128}),
        ("kvsearch, index=HNSW32, efSearch=256", "ours", {"n": n, "index": "HNSW32", "ef": 256}),
        ("Chroma PersistentClient (HNSW, cosine)", "chroma", {"n": n}),
    ]
    rows, got = [], {}
    for label, worker, kwargs in configs:
        r = common.run_fresh(__file__, worker, kwargs, timeout=1200)
        got[label] = r
        rows.append(
            [
                label,
                r.get("n", "-"),
                r.get("ingest_rate", float("nan")),
                r.get("single_qps", float("nan")),
                r.get("batched_qps", float("nan")),
                r.get("recall", float("nan")),
                r.get("peak_extra_mib", float("nan")),
                r.get("error", ""),
            ]
        )
        print(rows[-1], flush=True)
    chroma = got[configs[-1][0]]
    ratios = []
    for label, *_ in configs[:-1]:
        r = got[label]
        if "error" in r or "error" in chroma:
            continue
        ratios.append(
            [
                label,
                r["ingest_rate"] / chroma["ingest_rate"],
                r["single_qps"] / chroma["single_qps"],
                r["batched_qps"] / chroma["batched_qps"],
                f"{r['recall']:.3f} vs {chroma['recall']:.3f}",
            ]
        )
    body = common.table(
        [
            "store",
            "records",
            "ingest rec/s",
            "single QPS",
            "batched QPS (1,024)",
            "recall@10",
            "ingest peak MiB",
            "err",
        ],
        rows,
    )
    body += "\n\nRatios to Chroma:\n\n" + common.table(
        ["store", "ingest x", "single QPS x", "batched QPS x", "recall@10"], ratios
    )
    if "error" not in chroma:  # the fastest of ours whose recall is at least Chroma's, for each query mode
        fair = [(label, got[label]) for label, *_ in configs[:-1] if got[label].get("recall", 0) >= chroma["recall"]]
        lines = []
        for mode in ("single_qps", "batched_qps"):
            if fair:
                label, r = max(fair, key=lambda item: item[1][mode])
                lines.append(
                    f"- {mode.replace('_', ' ')} at recall@10 >= Chroma's ({chroma['recall']:.3f}): {label}, "
                    f"{r[mode]:,.0f} vs {chroma[mode]:,.0f} = {r[mode] / chroma[mode]:.2f}x (recall {r['recall']:.3f})"
                )
        body += "\n\nAt equal or better recall:\n\n" + "\n".join(lines)
    common.report(
        "bench_chroma",
        common.command_line(),
        info,
        [("kvsearch vs Chroma, MiniLM name embeddings (d=384, k=10)", body)],
        not args.no_append,
    )


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
