"""Ingest (records/s with and without encoding), size on disk, and the time to open a database and answer.

    python benchmarks/bench_ingest.py --m 1000000        # the full run (builds benchmarks/.cache/db_1000000)
    python benchmarks/bench_ingest.py --quick            # m = 100,000, small encoder samples

Every configuration runs in a fresh process (peak memory is its own). The database built here is kept under
benchmarks/.cache (git-ignored) and reused by bench_attention.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BATCH = 50_000


def db_path(m: int, index: str) -> Path:
    """Where the benchmark database of m random records with this index lives."""
    return common.CACHE / f"db_{m}_{index.replace(':', '-')}"


def w_ingest(m: int, index: str) -> dict:
    """Add m random (key, value) embedding pairs in batches of 50k to a new database on disk."""
    import torch

    from kvsearch import Database

    keys = common.random_vectors(m)
    values = common.random_vectors(m, seed=7)
    path = db_path(m, index)
    shutil.rmtree(path, ignore_errors=True)
    with common.PeakMemory() as peak:
        start = time.perf_counter()
        db = Database(path, dim=common.DIM, value_dim=common.DIM, score="dot", index=index)
        for lo in range(0, m, BATCH):
            hi = min(m, lo + BATCH)  # each batch read from the cache file: its pages are not counted as ours
            db.add(torch.from_numpy(common.read_rows(keys, lo, hi)), torch.from_numpy(common.read_rows(values, lo, hi)))
        final_mib = (common.status_kib("VmRSS") - peak.start_kib) / 1024  # the database in memory, ingest done
        db.close()
        seconds = time.perf_counter() - start
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {
        "seconds": seconds,
        "rate": m / seconds,
        "disk_mib": size / 2**20,
        "disk_bytes": size,
        "peak_extra_mib": peak.extra_mib,
        "final_mib": final_mib,
    }


def w_open(m: int, index: str) -> dict:
    """Open the database built by w_ingest and answer one query (k=10); time each step."""
    import torch

    from kvsearch import Database

    query = torch.from_numpy(common.random_queries(1))[0]
    with common.PeakMemory() as peak:
        start = time.perf_counter()
        db = Database(db_path(m, index))
        opened = time.perf_counter() - start
        db.search(query, k=10)
        answered = time.perf_counter() - start
    db.close()
    return {"open_s": opened, "first_answer_s": answered, "peak_extra_mib": peak.extra_mib, "n": m}


def w_encode(encoder: str, n: int) -> dict:
    """Add n names (key = name, value = name) encoded by the n-gram or the MiniLM encoder (in memory)."""
    from kvsearch import Database, NgramEncoder, SentenceEncoder

    names = common.name_list()[:n]
    enc = NgramEncoder() if encoder == "ngram" else SentenceEncoder()
    db = Database(None, encoder=enc)
    enc.encode(names[:64])  # warm the model
    with common.PeakMemory() as peak:
        start = time.perf_counter()
        for lo in range(0, n, 10_000):
            db.add(names[lo : lo + 10_000], names[lo : lo + 10_000])
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "rate": n / seconds, "peak_extra_mib": peak.extra_mib}


WORKERS = {"ingest": w_ingest, "open": w_open, "encode": w_encode}


def main() -> None:
    """Run every configuration, print the tables and make them its section of RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=1_000_000, help="records in the database (default 1M)")
    parser.add_argument("--quick", action="store_true", help="m = 100k and small encoder samples (< 3 min)")
    parser.add_argument("--index", default="torch", help="index of the database (default torch)")
    parser.add_argument("--no-append", action="store_true", help="print only, do not write RESULTS.md")
    args = parser.parse_args()
    m = 100_000 if args.quick else args.m
    info = common.machine()
    script = __file__
    rows = []
    ingest = common.run_fresh(script, "ingest", {"m": m, "index": args.index}, timeout=1800)
    opened = common.run_fresh(script, "open", {"m": m, "index": args.index}) if "error" not in ingest else ingest
    again = common.run_fresh(script, "open", {"m": m, "index": args.index}) if "error" not in ingest else ingest
    rows.append(
        [
            f"embeddings, {m:,} x {common.DIM} keys + values, index={args.index}",
            ingest.get("rate", float("nan")),
            ingest.get("seconds", float("nan")),
            ingest.get("peak_extra_mib", float("nan")),
        ]
    )
    n_ngram, n_minilm = (20_000, 2_000) if args.quick else (94_000, 10_000)
    for encoder, n in (("ngram", n_ngram), ("minilm", n_minilm)):
        r = common.run_fresh(script, "encode", {"encoder": encoder, "n": n})
        rows.append(
            [
                f"texts encoded by {encoder}, {n:,} names",
                r.get("rate", float("nan")),
                r.get("seconds", float("nan")),
                r.get("peak_extra_mib", float("nan")),
            ]
        )
    ingest_table = common.table(["what", "records/s", "seconds", "peak extra MiB"], rows)
    open_rows = [
        [
            f"{m:,} records, index={args.index} ({label})",
            ingest.get("disk_mib", float("nan")),
            r.get("open_s", float("nan")),
            r.get("first_answer_s", float("nan")),
            r.get("peak_extra_mib", float("nan")),
            r.get("error", ""),
        ]
        for label, r in (("first open after ingest", opened), ("second open", again))
    ]
    open_table = common.table(
        ["database", "size on disk MiB", "open s", "open + first answer s", "peak extra MiB", "error"], open_rows
    )
    raw = m * 2 * common.DIM * 4  # float32 keys + values
    batches_mib = 2 * BATCH * 2 * common.DIM * 4 / 2**20
    per_record = ingest.get("disk_bytes", float("nan")) / m
    budget = ingest.get("final_mib", float("nan")) + batches_mib
    first = max(opened.get("first_answer_s", float("nan")), again.get("first_answer_s", float("nan")))
    targets = [
        [
            "bytes on disk per record (keys + values, no text)",
            f"{per_record:,.0f} = {per_record / (raw / m):.3f}x raw ({raw / m:,.0f} B)",
            "<= 1.15x raw",
            _verdict(per_record / (raw / m) <= 1.15),
        ],
        [
            f"peak extra memory ingesting in batches of {BATCH:,}",
            f"{ingest.get('peak_extra_mib', float('nan')):,.0f} MiB (final in memory "
            f"{ingest.get('final_mib', float('nan')):,.0f} + 2 batches {batches_mib:,.0f} = {budget:,.0f})",
            "<= final in-memory size + 2 batches",
            _verdict(ingest.get("peak_extra_mib", float("inf")) <= budget),
        ],
        ["open + first answer, fresh process (slower of two)", f"{first:.2f} s", "<= 2 s", _verdict(first <= 2)],
    ]
    target_table = common.table(["figure", "measured", "target", "met"], targets)
    common.report(
        "bench_ingest",
        common.command_line(),
        info,
        [
            ("Ingest", ingest_table),
            ("Size on disk, open and first answer (fresh process)", open_table),
            ("Targets (issue 15)", target_table),
        ],
        not args.no_append,
    )


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
