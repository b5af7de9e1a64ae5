"""How far one call wanders: the kvsearch frames, modules and repeated functions of one search / query / add.

Traced with ``sys.setprofile`` (every Python ``call`` event whose code lives under ``kvsearch/``), after two
warm-up calls so that lazy first-use work (imports, key texts, the index's first build) is not counted. Prints one
table; nothing is timed (the tracer itself is slow), so the figures are machine-independent.

    python benchmarks/trace_calls.py             # Flat and HNSW32, on disk, 2,000 records of dim 64: vectors, texts
    python benchmarks/trace_calls.py --show search-HNSW32-texts   # the frames of one row, in order (stderr)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

import kvsearch

PACKAGE = str(Path(kvsearch.__file__).resolve().parent)


def trace(fn) -> list[tuple[str, str]]:
    """(module, qualified function) of every kvsearch frame entered while ``fn()`` runs, in order."""
    frames: list[tuple[str, str]] = []

    def profile(frame, event, arg):  # noqa: ARG001
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            module = "kvsearch" + path[len(PACKAGE) : -3].replace("/", ".").removesuffix(".__init__")
            frames.append((module, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return frames


def summary(frames: list[tuple[str, str]]) -> tuple[int, int, int, str]:
    """(frames, modules, the most any function ran, which functions ran more than twice)."""
    counts = Counter(frames)
    repeated = sorted(
        ((n, f"{m.removeprefix('kvsearch.')}.{q}") for (m, q), n in counts.items() if n > 2), reverse=True
    )
    return (
        len(frames),
        len({m for m, _ in frames}),
        max(counts.values(), default=0),
        ", ".join(f"{name} x{n}" for n, name in repeated) or "-",
    )


def calls(index: str, folder: Path, m: int, dim: int, data: str) -> dict[str, object]:
    """The calls traced, on one database of ``m`` records with index ``index``, on disk: ``"vectors"``, random keys
    and values given as embeddings; ``"texts"``, key and value texts encoded by an ``NgramEncoder``, each record
    with metadata (the queries are still embeddings: the encoder is not what is traced)."""
    gen = torch.Generator().manual_seed(0)
    if data == "texts":
        db = kvsearch.Database(folder, encoder=kvsearch.NgramEncoder(dim=dim), index=index)
        names = [f"name {i}" for i in range(m)]
        db.add(keys=names, values=[n.upper() for n in names], metadata=[{"i": i} for i in range(m)])
        q = db.encoder.encode(["name 17"])[0]  # (dim,)
        fresh = itertools.count(m)  # a new key text for every add
        return {
            "search": lambda: db.search(q, k=10),
            "query": lambda: db.query(q, k=10),
            "add": lambda: db.add(keys=[f"name {next(fresh)}"], values=["NEW"], metadata=[{"i": -1}]),
        }
    keys = torch.randn(m, dim, generator=gen)
    db = kvsearch.Database(folder, dim=dim, value_dim=dim, index=index)
    db.add(keys=keys, values=keys)
    q = torch.randn(dim, generator=gen)
    one = torch.randn(1, dim, generator=gen)
    return {
        "search": lambda: db.search(q, k=10),
        "query": lambda: db.query(q, k=10),
        "add": lambda: db.add(keys=one, values=one),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=2000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--indexes", nargs="+", default=["Flat", "HNSW32"])
    parser.add_argument("--data", nargs="+", default=["vectors", "texts"], choices=["vectors", "texts"])
    parser.add_argument("--show", help="print the frames of one row, e.g. search-Flat-vectors")
    args = parser.parse_args(argv)
    print("| call | index | data | kvsearch frames | modules | most runs of one function | functions run > 2 times |")
    print("|---|---|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for data in args.data:
            for index in args.indexes:
                for name, fn in calls(index, Path(tmp) / f"{index}-{data}", args.m, args.dim, data).items():
                    fn()
                    fn()
                    frames = trace(fn)
                    n, mods, most, repeated = summary(frames)
                    print(f"| {name} | {index} | {data} | {n} | {mods} | {most} | {repeated} |")
                    if args.show == f"{name}-{index}-{data}":
                        for module, qual in frames:
                            print(f"    {module}.{qual}", file=sys.stderr)


if __name__ == "__main__":
    main()
