"""Encoding texts with a sentence encoder on the CPU: kvsearch's length batches against the model's own batches.

``SentenceEncoder.encode`` (what ``db.add``, ``db.search``, ``evaluate`` and fine-tuning's refresh and judge call)
cuts its batches on the CPU at about ``CPU_BATCH_CHARS`` characters, the texts longest first
(``kvsearch.encoders.sentence.length_batches``). The peer is sentence-transformers' own ``model.encode`` on the same
model and texts, at its default batch of 32 and at 256 (what kvsearch did before). Texts from ``semantic_tasks``:
single words (GCIDE's headwords), dictionary definitions, Python docstrings, Debian package descriptions, passages
of eight definitions, and a shuffled mix of the five. Each measure is the median of ``--repeat`` calls, the three
methods taken in turn in each round (the machine is shared); the largest difference between kvsearch's embeddings
and the model's is reported (float rounding: the batches differ).

    python benchmarks/bench_encode.py                 # 600 texts of each kind (~3 min on 2 cores)
    python benchmarks/bench_encode.py --texts 200 --repeat 1 --no-append
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(1, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402
import numpy as np  # noqa: E402
import semantic_tasks  # noqa: E402


def text_sets(n: int, seed: int) -> dict[str, list[str]]:
    """``n`` texts of each kind, seeded."""
    rng = random.Random(seed)
    gcide = semantic_tasks.load_task("gcide", 0, n_eval=max(n, 1000), seed=seed)
    pydoc = semantic_tasks.load_task("pydoc", 0, n_eval=min(n, 1000), seed=seed)
    debian = semantic_tasks.load_task("debian", 0, n_eval=min(n, 1000), seed=seed)
    definitions = [q for q, _ in gcide.eval]
    sets = {
        "words": rng.sample(gcide.keys, n),
        "definitions": definitions[:n],
        "docstrings": [q for q, _ in pydoc.eval][:n],
        "package descriptions": [q for q, _ in debian.eval][:n],
        "passages (8 definitions)": [" ".join(rng.sample(definitions, 8)) for _ in range(n // 2)],
    }
    mixed = [text for texts in sets.values() for text in texts[: n // 5]]
    rng.shuffle(mixed)
    sets["a shuffled mix of the five"] = mixed
    return sets


def measure(n: int, repeat: int, seed: int, threads: int) -> tuple[common.Table, dict[str, Any]]:
    """texts/s of the three methods on each set, and the largest difference from the model's embeddings."""
    import torch

    from kvsearch import SentenceEncoder
    from kvsearch.encoders.sentence import CPU_BATCH_CHARS

    torch.set_num_threads(threads)
    encoder = SentenceEncoder(device="cpu")

    def model_encode(texts: list[str], batch: int) -> Any:
        return encoder.model.encode(texts, batch_size=batch, convert_to_tensor=True, normalize_embeddings=True)

    methods = {
        f"kvsearch encode (length batches, {CPU_BATCH_CHARS} chars)": lambda texts: encoder.encode(texts),
        "sentence-transformers encode, batch 32 (its default)": lambda texts: model_encode(texts, 32),
        "sentence-transformers encode, batch 256": lambda texts: model_encode(texts, 256),
    }
    rows, points = [], {}
    for kind, texts in text_sets(n, seed).items():
        chars = float(np.mean([len(t) for t in texts]))
        ours = encoder.encode(texts)  # also the warm-up
        diff = float((ours - model_encode(texts, 32)).abs().max())
        times: dict[str, list[float]] = {name: [] for name in methods}
        for r in range(repeat):
            names = list(methods)
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each method first in turn
                started = time.perf_counter()
                methods[name](texts)
                times[name].append(time.perf_counter() - started)
        speeds = {name: len(texts) / float(np.median(t)) for name, t in times.items()}
        first = next(iter(speeds.values()))
        for name, speed in speeds.items():
            rows.append([kind, len(texts), round(chars), name, round(speed), round(first / speed, 2), f"{diff:.1e}"])
        points[kind] = {"texts": len(texts), "mean_chars": chars, "texts_per_s": speeds, "max_abs_diff": diff}
        print(kind, {k: round(v) for k, v in speeds.items()}, flush=True)
    headers = ["texts", "n", "mean chars", "method", "texts/s", "kvsearch's speed-up", "max |diff| (kvsearch)"]
    return common.table(headers, rows), points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=600, help="texts of each kind")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--no-append", action="store_true", help="print only")
    args = parser.parse_args()
    info = common.machine()
    table, points = measure(args.texts, args.repeat, args.seed, args.threads)
    common.report(
        "Encoding on the CPU: length batches against sentence-transformers' encode",
        common.command_line(),
        info,
        [("all-MiniLM-L6-v2, one process", table)],
        append=not args.no_append,
        points=points,
    )


if __name__ == "__main__":
    main()
