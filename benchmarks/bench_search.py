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
import numpy as np  # noqa: E402

K = 10
METHODS = ("flat", "torch", "torch:bfloat16", "torch:float16", "faiss", "faiss-default", "st")
METHOD_NAMES = {
    "flat": "ours: default index Flat (path per call, kvsearch.index.exact_path)",
    "torch": "ours: TorchIndex float32",
    "torch:bfloat16": "ours: TorchIndex bfloat16 scan + exact rescoring",
    "torch:float16": "ours: TorchIndex float16 scan + exact rescoring",
    "faiss": "FAISS IndexFlatIP, BLAS threshold 20 (kvsearch's)",
    "faiss-default": "FAISS IndexFlatIP, default threshold",
    "st": "sentence_transformers.util.semantic_search",
}
FAISS_DEFAULT_THRESHOLD = 128_000


def _torch_search(index, q: np.ndarray) -> np.ndarray:
    """Ours, with FAISS's BLAS threshold as kvsearch sets it (``faiss-default`` rounds, interleaved with ours in
    the same process, leave FAISS's default behind; a float32 batch of 32+ queries runs in ``faiss.knn``)."""
    import faiss
    import torch

    faiss.cvar.distance_compute_blas_threshold = 20
    return index.search(torch.from_numpy(q), K).ids.numpy()


def _methods(data, nq: int, only: str | None = None) -> dict:
    """Each method's (index, search function) on the same data, for nq queries per call (or just ``only``)."""
    import faiss
    import torch

    from kvsearch.index.torch_index import TorchIndex

    keys = torch.from_numpy(data)
    out = {}
    if only in (None, "flat"):
        from kvsearch.index.factory import make_index

        flat_index = make_index("Flat", common.DIM)
        flat_index.build(torch.arange(len(data)), keys)  # the keys tensor itself; a half copy at first use
        out["flat"] = (flat_index, lambda q, index=flat_index: _torch_search(index, q))
        if only == "flat":
            return out
    for method in ("torch", "torch:bfloat16", "torch:float16"):
        if only is not None and method != only:
            continue
        if method == "torch:float16" and nq > 64:
            continue  # this CPU has no float16 matmul: a batch runs a slow generic loop (shown at nq <= 64)
        index = TorchIndex(common.DIM, dtype=method.partition(":")[2] or "float32")
        index.build(torch.arange(len(data)), keys)  # float32: this very tensor, no copy; half: + a half copy
        out[method] = (index, lambda q, index=index: _torch_search(index, q))
    if only is not None and only.startswith("torch"):
        return out
    flat = faiss.IndexFlatIP(common.DIM)
    flat.add(data)

    def faiss_with(threshold: int):
        def run(q):
            faiss.cvar.distance_compute_blas_threshold = threshold
            return flat.search(q, K)[1]

        return run

    out["faiss"] = (flat, faiss_with(20))
    if nq * common.DIM <= FAISS_DEFAULT_THRESHOLD:  # above it the default takes the same BLAS path
        out["faiss-default"] = (flat, faiss_with(FAISS_DEFAULT_THRESHOLD))

    def st(q):
        from sentence_transformers import util

        hits = util.semantic_search(torch.from_numpy(q), keys, top_k=K)
        return np.array([[h["corpus_id"] for h in row] for row in hits])

    out["st"] = (None, st)
    return out


def w_exact(m: int, nq: int, rounds: int) -> dict:
    """Every exact method on the same m vectors and nq queries, timed in interleaved rounds (the order rotates
    each round), so that other work on the machine perturbs them alike; ids checked against FAISS Flat."""
    import torch

    data = np.array(common.random_vectors(m))  # (m, d) in memory
    queries = common.random_queries(nq)
    methods = _methods(data, nq)
    truth = methods["faiss"][1](queries)
    checks = {}
    for name, (index, run) in methods.items():
        found = run(queries)  # also the warm-up (first touch, half copy built)
        same = float(np.mean([set(a.tolist()) == set(b.tolist()) for a, b in zip(found, truth)]))
        checks[name] = {"same_ids": same, "rechecked": getattr(index, "last_rechecked", None)}
    times = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            methods[name][1](queries)
            times[name].append(time.perf_counter() - start)
    # memory read bandwidth in the same process: a reduction over the same keys, 2 threads (the best of 5)
    keys = torch.from_numpy(data)
    bandwidth = data.nbytes / min(common.timeit(lambda: keys.sum(), repeat=1, warmup=0) for _ in range(5)) / 1e9
    return {
        "seconds": {name: float(np.median(t)) for name, t in times.items()},
        "checks": checks,
        "bandwidth_gbs": bandwidth,
        "key_bytes": data.nbytes,
    }


def w_exact_memory(method: str, m: int, nq: int) -> dict:
    """Peak extra memory of one search call of one method (a fresh process per method)."""
    data = np.array(common.random_vectors(m))
    queries = common.random_queries(nq)
    methods = _methods(data, nq, only=method)
    index, run = methods[method] if method in methods else methods["faiss"]
    run(queries)  # warm-up: lazily built parts (a half copy) are part of the index, not of a search
    with common.PeakMemory() as peak:
        run(queries)
    return {"peak_extra_mib": peak.extra_mib}


def w_ann(dataset: str, m: int, nq: int, hnsw: bool = True) -> dict:
    """Build HNSW32 and IVF indexes on structured data; QPS (batch nq) and recall@10 at several settings."""
    import faiss
    import numpy as np

    from kvsearch.index.faiss_spec import default_search_params, tune_faiss

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
    default = default_search_params(ivf)["nprobe"]
    for nprobe in sorted({1, 4, 16, 64, default}):
        ivf.nprobe = nprobe
        s = common.timeit(lambda: ivf.search(queries, K), repeat=1, warmup=1)
        setting = f"nprobe={nprobe}" + (" (kvsearch default)" if nprobe == default else "")
        rows.append([f"IVF{nlist},Flat", setting, build, nq / s, common.recall_at(ivf.search(queries, K)[1], truth)])
    ivf.reset()
    if not hnsw:
        return {"rows": rows, "m": m, "flat_qps": nq / flat_s}
    start = time.perf_counter()
    hnsw = faiss.IndexHNSWFlat(common.DIM, 32, faiss.METRIC_INNER_PRODUCT)
    hnsw.add(data)
    build = time.perf_counter() - start
    default = default_search_params(hnsw)["efSearch"]
    for ef in sorted({16, 32, 64, 128, 256, default}):
        hnsw.hnsw.efSearch = ef
        s = common.timeit(lambda: hnsw.search(queries, K), repeat=1, warmup=1)
        setting = f"efSearch={ef}" + (" (kvsearch default)" if ef == default else "")
        rows.append(["HNSW32", setting, build, nq / s, common.recall_at(hnsw.search(queries, K)[1], truth)])
    return {"rows": rows, "m": m, "flat_qps": nq / flat_s}


WORKERS = {"exact": w_exact, "exact_memory": w_exact_memory, "ann": w_ann}


def exact_section(sizes: list[int], nqs: list[int], rounds: int) -> tuple[str, str]:
    """All exact methods at every (m, nq), interleaved in one process; peak memory per method in its own."""
    rows, ratios, notes = [], [], []
    for m in sizes:
        for nq in nqs:
            r = common.run_fresh(__file__, "exact", {"m": m, "nq": nq, "rounds": rounds}, timeout=3600)
            if "error" in r:
                rows.append([f"{m:,}", nq, "all", "-", "-", "-", "-", "-", r["error"]])
                continue
            seconds = r["seconds"]
            for name, sec in seconds.items():
                mem = common.run_fresh(__file__, "exact_memory", {"method": name, "m": m, "nq": nq})
                check = r["checks"][name]
                rechecked = check["rechecked"]
                rows.append(
                    [
                        f"{m:,}",
                        nq,
                        METHOD_NAMES[name],
                        sec * 1000,
                        nq / sec,
                        seconds["faiss"] / sec,
                        mem.get("peak_extra_mib", float("nan")),
                        check["same_ids"],
                        "-" if rechecked is None else f"{rechecked}/{nq}",
                    ]
                )
                print("  ".join(map(str, rows[-1][:4])), "ms", file=sys.stderr, flush=True)  # progress
            gbs = r["bandwidth_gbs"]
            for name in ("torch", "torch:bfloat16", "torch:float16", "faiss"):
                if nq == 1 and name in seconds:
                    read = r["key_bytes"] / (2 if ":" in name else 1)  # a half copy reads half the bytes
                    achieved = read / seconds[name] / 1e9
                    notes.append(
                        f"m={m:,}, 1 query, {METHOD_NAMES[name]}: {achieved:.1f} GB/s read = "
                        f"{100 * achieved / gbs:.0f}% of the {gbs:.1f} GB/s measured in the same process"
                    )
            for name in ("flat", "torch", "torch:bfloat16"):
                for other in ("faiss", "faiss-default", "st"):
                    if name in seconds and other in seconds:
                        ratios.append(
                            [
                                f"{m:,}",
                                nq,
                                f"{METHOD_NAMES[name]} / {METHOD_NAMES[other]}",
                                seconds[other] / seconds[name],
                            ]
                        )
    body = common.table(
        [
            "m",
            "nq",
            "method",
            "ms per call",
            "QPS",
            "x FAISS Flat (tuned)",
            "peak extra MiB",
            "same top-10 as FAISS",
            "rechecked in float32",
        ],
        rows,
    )
    body += "\n\nQPS ratios (ours over the other, same process, interleaved rounds):\n\n"
    body += common.table(["m", "nq", "ratio", "x"], ratios)
    body += "\n\nMemory bandwidth:\n\n" + "\n".join(f"- {n}" for n in notes)
    return f"Exact search, random unit vectors, d=384, k=10 (median of {rounds} interleaved rounds)", body


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
    """Parse the arguments, run the sections, print the tables and make them its section of RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1_000_000, help="largest database size (default 1M)")
    parser.add_argument("--quick", action="store_true", help="m = 100k only, nq = 1 and 64 (< 3 min)")
    parser.add_argument("--section", choices=("exact", "ann", "all"), default="all")
    parser.add_argument("--hnsw-at-m", action="store_true", help="also build HNSW32 on the m clustered vectors")
    parser.add_argument("--rounds", type=int, default=0, help="timing rounds per method (default 7, quick 5)")
    parser.add_argument("--no-append", action="store_true", help="print only, do not write RESULTS.md")
    args = parser.parse_args()
    info = common.machine()
    sizes = [100_000] if args.quick else sorted({100_000, args.m})
    nqs = [1, 64] if args.quick else [1, 64, 1024]
    sections = []
    if args.section in ("exact", "all"):
        sections.append(exact_section(sizes, nqs, args.rounds or (5 if args.quick else 7)))
    if args.section in ("ann", "all"):
        sections += ann_section(20_000 if args.quick else args.m, 1024, args.hnsw_at_m)
    common.report("bench_search", common.command_line(), info, sections, not args.no_append)


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
