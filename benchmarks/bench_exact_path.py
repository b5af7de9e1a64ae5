"""The default exact index ("Flat", path per call) vs FAISS IndexFlatIP tuned / default, and the half-precision
path on near-duplicate clusters: interleaved rounds in one process, medians. Prints a Markdown table.

    python benchmarks/bench_exact_path.py --m 300000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import faiss
import numpy as np
import torch

from kvsearch.index.exact_path import set_exact_path
from kvsearch.index.factory import make_index


def _interleaved(fns: dict, rounds: int) -> dict:
    for f in fns.values():
        f()  # warm-up: first touch, half copy
    times = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    d, k, rng = 384, 10, np.random.default_rng(0)
    keys = rng.standard_normal((args.m, d), dtype=np.float32)
    keys /= np.linalg.norm(keys, axis=1, keepdims=True)
    flat = make_index("Flat", d)
    flat.build(torch.arange(args.m), torch.from_numpy(keys))
    fl = faiss.IndexFlatIP(d)
    fl.add(keys)

    def faiss_with(q, threshold):
        faiss.cvar.distance_compute_blas_threshold = threshold
        return fl.search(q, k)

    print("| m | nq | ours Flat ms (path) | FAISS tuned ms | FAISS default ms | x tuned | x default |")
    print("|---|---|---|---|---|---|---|")
    for nq in (1, 64, 1024):
        q = rng.standard_normal((nq, d), dtype=np.float32)
        fns = {"flat": lambda q=q: flat.search(torch.from_numpy(q), k), "tuned": lambda q=q: faiss_with(q, 20)}
        if nq * d <= 128_000:
            fns["default"] = lambda q=q: faiss_with(q, 128_000)
        t = _interleaved(fns, args.rounds)
        flat.search(torch.from_numpy(q), k)
        found = flat.search(torch.from_numpy(q), k)
        same = np.array_equal(found.ids.numpy(), faiss_with(q, 20)[1])
        dflt = t.get("default", t["tuned"])
        print(
            f"| {args.m:,} | {nq} | {1e3 * t['flat']:.1f} ({found.path}) | {1e3 * t['tuned']:.1f} | "
            f"{1e3 * dflt:.1f} | {t['tuned'] / t['flat']:.2f} | {dflt / t['flat']:.2f} | same ids: {same}",
            flush=True,
        )
    # near-duplicate clusters: m / 10k clusters x 10k, noise 1e-2 per coordinate, queries = keys + noise
    clusters = max(1, args.m // 10_000)
    centres = rng.standard_normal((clusters, d), dtype=np.float32) / np.sqrt(d)
    near = np.repeat(centres, 10_000, axis=0) + 1e-2 * rng.standard_normal((clusters * 10_000, d), dtype=np.float32)
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    index = make_index("Flat", d)
    index.build(torch.arange(len(near)), torch.from_numpy(near))
    print("\n| data | nq | float32 scan ms | bfloat16 scan + rescoring ms | x | widened | re-searched | same ids |")
    print("|---|---|---|---|---|---|---|---|")
    for nq in (64, 1024):
        q = torch.from_numpy(
            near[rng.integers(0, len(near), nq)] + 1e-2 * rng.standard_normal((nq, d), dtype=np.float32)
        )

        def run(path, q=q):
            set_exact_path(path)
            return index.search(q, k)

        t = _interleaved({"float32": lambda: run("float32"), "bfloat16": lambda: run("bfloat16")}, args.rounds)
        set_exact_path("bfloat16")
        set_exact_path(None)
        ref, half = run("float32"), run("bfloat16")
        widened, rechecked = index.last_widened, index.last_rechecked
        set_exact_path(None)
        print(
            f"| near-dup {clusters} x 10k | {nq} | {1e3 * t['float32']:.1f} | {1e3 * t['bfloat16']:.1f} | "
            f"{t['float32'] / t['bfloat16']:.2f} | {widened}/{nq} | {rechecked}/{nq} | "
            f"{bool(torch.equal(ref.ids, half.ids))} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
