"""Exact search (ours in torch vs FAISS Flat vs sentence-transformers) and ANN (HNSW / IVF) QPS vs recall@10.

    python benchmarks/bench_search.py --m 1000000        # the full run: exact at m = 100k and 1M; ANN: IVF at
                                                         # 1M and IVF + HNSW32 at 100k clustered and 92k names
    python benchmarks/bench_search.py --quick            # exact at m = 100k (nq 1, 64), ANN at 20k (< 3 min)
    python benchmarks/bench_search.py --section exact    # one section only (--hnsw-at-m: HNSW32 at 1M too)

Exact search runs on random unit vectors (d = 384, k = 10) at nq = 1, 64, 1024 queries per call; every
(method, m, nq) runs in a fresh process and reports its median time and the peak memory of one search above
the loaded data. ANN runs on clustered vectors (a Gaussian mixture, queries perturbed from data points) and on
real MiniLM name embeddings; recall@10 is against the exact top-10.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

K = 10
METHODS = ("torch", "torch:bfloat16", "faiss", "faiss-default", "st")
METHOD_NAMES = {
    "torch": "ours: TorchIndex (float32)",
    "torch:bfloat16": "ours: TorchIndex (bfloat16 keys)",
    "faiss": "FAISS IndexFlatIP, BLAS threshold 20 (kvsearch's)",
    "faiss-default": "FAISS IndexFlatIP, default threshold",
    "st": "sentence_transformers.util.semantic_search",
}


def w_exact(method: str, m: int, nq: int) -> dict:
    """Time one exact-search method at (m, nq); peak extra memory of one search call."""
    import faiss
    import numpy as np
    import torch

    data = np.array(common.random_vectors(m))  # (m, d) in memory
    queries = common.random_queries(nq)
    if method.startswith("torch"):
        from kvsearch.torch_index import TorchIndex

        index = TorchIndex(common.DIM, dtype="float32" if method == "torch" else method.split(":")[1])
        index.build(np.arange(m), torch.from_numpy(data))
        del data  # the float32 index holds this very tensor; a half index its own copy
        q = torch.from_numpy(queries)

        def run():
            return index.search_tensors(q, K)[1]
    elif method.startswith("faiss"):
        from kvsearch.index import tune_faiss

        if method == "faiss":
            tune_faiss()
        index = faiss.IndexFlatIP(common.DIM)
        index.add(data)
        del data

        def run():
            return index.search(queries, K)[1]
    else:
        from sentence_transformers import util

        corpus, q = torch.from_numpy(data), torch.from_numpy(queries)

        def run():
            return util.semantic_search(q, corpus, top_k=K)

    run()  # warm-up (first touch of the data, lazy set-up) outside the measurement
    with common.PeakMemory() as peak:
        start = time.perf_counter()
        run()
        first = time.perf_counter() - start
    seconds = first if first > 3 else common.timeit(run, repeat=3, warmup=0)
    return {"seconds": seconds, "qps": nq / seconds, "peak_extra_mib": peak.extra_mib}


def w_ann(dataset: str, m: int, nq: int, hnsw: bool = True) -> dict:
    """Build HNSW32 and IVF indexes on structured data; QPS (batch nq) and recall@10 at several settings."""
    import faiss
    import numpy as np

    from kvsearch.index import tune_faiss

    tune_faiss()
    if dataset == "clustered":
        data, queries = common.clustered(m, nq)
        data = np.array(data)
    else:
        _, data, queries = common.name_embeddings(nq)
        data = np.array(data[:m] if m else data)
        m = len(data)
    truth = common.exact_topk(data, queries, K)
    rows = []
    flat = faiss.IndexFlatIP(common.DIM)
    flat.add(data)
    flat_s = common.timeit(lambda: flat.search(queries, K), repeat=1, warmup=1)
    rows.append(["Flat (exact)", "-", 0.0, nq / flat_s, 1.0])
    flat.reset()  # free its copy of the data
    nlist = int(2 ** round(np.log2(np.sqrt(m))))
    start = time.perf_counter()
    ivf = faiss.index_factory(common.DIM, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(0)
    ivf.train(data[rng.choice(m, min(m, 64 * nlist), replace=False)])
    ivf.add(data)
    build = time.perf_counter() - start
    for nprobe in (1, 4, 16, 64):
        ivf.nprobe = nprobe
        s = common.timeit(lambda: ivf.search(queries, K), repeat=1, warmup=1)
        rows.append(
            [f"IVF{nlist},Flat", f"nprobe={nprobe}", build, nq / s, common.recall_at(ivf.search(queries, K)[1], truth)]
        )
    ivf.reset()
    if not hnsw:
        return {"rows": rows, "m": m, "flat_qps": nq / flat_s}
    start = time.perf_counter()
    hnsw = faiss.IndexHNSWFlat(common.DIM, 32, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(data)
    build = time.perf_counter() - start
    for ef in (16, 32, 64, 128, 256):
        hnsw.hnsw.efSearch = ef
        s = common.timeit(lambda: hnsw.search(queries, K), repeat=1, warmup=1)
        rows.append(["HNSW32", f"efSearch={ef}", build, nq / s, common.recall_at(hnsw.search(queries, K)[1], truth)])
    return {"rows": rows, "m": m, "flat_qps": nq / flat_s}


WORKERS = {"exact": w_exact, "ann": w_ann}


def exact_section(sizes: list[int], nqs: list[int]) -> tuple[str, str]:
    """Every method at every (m, nq) in fresh processes; a table and the ratios to FAISS."""
    rows, got = [], {}
    for m in sizes:
        for nq in nqs:
            for method in METHODS:
                if method == "faiss-default" and nq * common.DIM > 128_000:
                    continue  # the same BLAS path as the tuned threshold
                if method == "torch:bfloat16" and nq > 64:
                    continue  # converted a chunk at a time on a CPU without bf16 matmul: slower, shown at 1 and 64
                r = common.run_fresh(__file__, "exact", {"method": method, "m": m, "nq": nq})
                got[(method, m, nq)] = r
                rows.append(
                    [
                        f"{m:,}",
                        nq,
                        METHOD_NAMES[method],
                        r.get("seconds", float("nan")) * 1000,
                        r.get("qps", float("nan")),
                        r.get("peak_extra_mib", float("nan")),
                        r.get("error", ""),
                    ]
                )
                print(rows[-1], flush=True)
    ratios = []
    for m in sizes:
        for nq in nqs:
            ours = got.get(("torch", m, nq), {}).get("qps")
            for other in ("faiss", "faiss-default", "st", "torch:bfloat16"):
                theirs = got.get((other, m, nq), {}).get("qps")
                if ours and theirs:
                    ratios.append([f"{m:,}", nq, f"ours / {METHOD_NAMES[other]}", ours / theirs])
    body = common.table(["m", "nq", "method", "ms per call", "QPS", "peak extra MiB", "error"], rows)
    body += "\n\nQPS ratios (ours float32 over the other):\n\n" + common.table(["m", "nq", "ratio", "x"], ratios)
    return "Exact search, random unit vectors, d=384, k=10 (fresh process per row)", body


def ann_section(m: int, nq: int, hnsw_at_m: bool = False) -> list[tuple[str, str]]:
    """IVF and HNSW on clustered data (100k, and m with IVF only unless hnsw_at_m) and on the name embeddings."""
    out = []
    runs = [("clustered", min(m, 100_000), True), ("names", 0 if m >= 100_000 else m, True)]
    if m > 100_000:  # HNSW builds at ~2-4k vectors/s here: at 1M it alone would take 4-8 minutes of the run
        runs.insert(1, ("clustered", m, hnsw_at_m))
    for dataset, size, hnsw in runs:
        r = common.run_fresh(__file__, "ann", {"dataset": dataset, "m": size, "nq": nq, "hnsw": hnsw}, timeout=1800)
        if "error" in r:
            out.append((f"ANN on {dataset}", f"error: {r['error']}"))
            continue
        rows = [[*row[:3], row[3], row[3] / r["flat_qps"], row[4]] for row in r["rows"]]
        body = common.table(["index", "setting", "build s", "QPS", "x Flat QPS", "recall@10"], rows)
        title = (
            f"ANN, {dataset} data, m={r['m']:,}, batch of {nq} queries, k=10 "
            f"(recall against exact search; Flat = FAISS IndexFlatIP in the same process)"
        )
        out.append((title, body))
    return out


def main() -> None:
    """Parse the arguments, run the sections, print and append the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1_000_000, help="largest database size (default 1M)")
    parser.add_argument("--quick", action="store_true", help="m = 100k only, nq = 1 and 64 (< 3 min)")
    parser.add_argument("--section", choices=("exact", "ann", "all"), default="all")
    parser.add_argument("--hnsw-at-m", action="store_true", help="also build HNSW32 on the m clustered vectors")
    parser.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")
    args = parser.parse_args()
    info = common.machine()
    sizes = [100_000] if args.quick else sorted({100_000, args.m})
    nqs = [1, 64] if args.quick else [1, 64, 1024]
    sections = []
    if args.section in ("exact", "all"):
        sections.append(exact_section(sizes, nqs))
    if args.section in ("ann", "all"):
        sections += ann_section(20_000 if args.quick else args.m, 1024, args.hnsw_at_m)
    common.report("bench_search", common.command_line(), info, sections, not args.no_append)


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
