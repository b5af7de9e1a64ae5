"""The study behind ``finetune``'s defaults (issue 22): ``python benchmarks/bench_finetune.py --study``.

A database of the N most frequent surnames (default 10,000; the default ``NgramEncoder()``, in memory), the names
split 80 / 20 into train and held-out names. Three tasks, each a noise kind of :mod:`kvsearch.datasets`:

- ``typo``: one uniformly random edit (substitute, insert, delete, transpose), the ``edit`` kind — not the
  keyboard-weighted slips of ``kvsearch.text.noise`` that the generated pairs use;
- ``phonetic``: one or two respelling rules (the same rule set as the generated pairs' ``phonetic`` model);
- ``cyrillic``: a fixed Latin -> Cyrillic letter map (the generated pairs hold no Cyrillic by default).

For each task: ``--eval`` held-out queries on held-out names (seed 0) measure recall@1; the user's pairs are
0 / 500 / 2,000 / 10,000 noisy queries of *train* names only (noise seeds 1, 2, ...). A row is a set of options
given to ``finetune(db, pairs, eval_pairs=held)`` (``finetune(db, eval_pairs=held)`` for 0 pairs): the defaults
(marked), the defaults of before this issue, and the defaults with one option changed. The eval pairs are the
monitor of keep-best too, so a row's figure is the kept epoch's (the start when no epoch beat it): as a user with
held-out pairs sees it. Every run is seeded; two workers run side by side (one thread each).
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

TASKS = {"typo": "edit", "phonetic": "phonetic", "cyrillic": "cyrillic"}
COUNTS = (0, 500, 2000, 10000)
DEFAULTS = "defaults"
#: (row name, finetune options, pair counts it runs at)
ROWS: list[tuple[str, dict[str, Any], tuple[int, ...]]] = [
    (DEFAULTS, {}, COUNTS),
    (
        "before issue 22 (train=query, lr 1e-2, batch 64, constant lr, no generated pairs)",
        {"train": "query", "lr": 1e-2, "batch_size": 64, "lr_decay": "none", "generated": 0},
        COUNTS[1:],
    ),
    ("generated=0 (the user's pairs only)", {"generated": 0}, COUNTS[1:]),
    ('train="query" (a query-side copy learns)', {"train": "query"}, (0, 2000)),
    ("lr 1e-3", {"lr": 1e-3}, (2000,)),
    ("lr 1e-2", {"lr": 1e-2}, (2000,)),
    ('lr_decay="none"', {"lr_decay": "none"}, (2000,)),
    ("temperature 0.02", {"temperature": 0.02}, (2000,)),
    ("temperature 0.1", {"temperature": 0.1}, (2000,)),
    ("k 16", {"k": 16}, (2000,)),
    ("epochs 1", {"epochs": 1}, (2000,)),
    ("epochs 5", {"epochs": 5}, (2000,)),
    ("batch 64", {"batch_size": 64}, (2000,)),
    ('noise + "case"', {"noise": ("typos", "phonetic", "case")}, (2000,)),
]


def _data(names: int, eval_count: int) -> tuple[list[str], list[str], dict, dict]:
    from kvsearch.datasets import noisy_queries, split_names, surname_directory

    keys, values = surname_directory(names)
    train_names, held_names = split_names(keys, held_out=0.2, seed=0)
    stored = set(keys)
    held, user = {}, {}
    for task, kind in TASKS.items():
        queries = noisy_queries(held_names, kind, seed=0, avoid=stored)
        held[task] = random.Random(0).sample(queries, min(eval_count, len(queries)))
        pool: list[tuple[str, str]] = []
        for seed in range(1, 4):  # up to three noisy queries per train name, for the 10,000-pair runs
            pool += noisy_queries(train_names, kind, seed=seed, avoid=stored)
        pool = list(dict.fromkeys(pool))
        random.Random(1).shuffle(pool)
        user[task] = pool
    return keys, values, held, user


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """One fine-tuning run in a worker: build the database, measure, fine-tune with the row's options, measure."""
    import faiss
    import torch

    from kvsearch import Database, NgramEncoder, evaluate, finetune

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    keys, values, held, user = _data(job["names"], job["eval"])
    task, count = job["task"], job["count"]
    db = Database(None, encoder=NgramEncoder(device="cpu"), device="cpu")
    db.add(keys=keys, values=values)
    before = evaluate(db, held[task], k=10)["recall@1"]
    pairs = user[task][:count] or None
    start = time.perf_counter()
    history = finetune(db, pairs, eval_pairs=held[task], verbose=False, **job["options"])
    seconds = time.perf_counter() - start
    after = evaluate(db, held[task], k=10)["recall@1"]
    db.close()
    return {
        **job,
        "before": before,
        "after": after,
        "seconds": seconds,
        "kept": history.kept_epoch,
        "generated": history.generated,
        "pairs": 0 if pairs is None else len(pairs),
    }


def study(names: int, eval_count: int, workers: int, only: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Run every row (or only those whose name holds ``only``) x task x count.

    Returns:
        The Markdown table and the raw results.
    """
    rows = [r for r in ROWS if only is None or only in r[0]]
    jobs = [
        {"row": row, "options": options, "task": task, "count": count, "names": names, "eval": eval_count}
        for row, options, counts in rows
        for count in counts
        for task in TASKS
    ]
    results = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for result in pool.map(_run, jobs):
            print(json.dumps({k: v for k, v in result.items() if k not in ("names", "eval")}), flush=True)
            results.append(result)
    return _table(results), results


def _table(results: list[dict[str, Any]]) -> str:
    columns = [(task, count) for count in COUNTS for task in TASKS]
    header = "| options | " + " | ".join(f"{task}, {count:,} pairs" for task, count in columns) + " | seconds (mean) |"
    lines = [header, "|" + "---|" * (len(columns) + 2)]
    start = {}
    for r in results:
        start[r["task"]] = r["before"]
    lines.append("| start (untrained) | " + " | ".join(f"{100 * start[t]:.1f}" for t, _ in columns) + " | |")
    for row in dict.fromkeys(r["row"] for r in results):
        mine = {(r["task"], r["count"]): r for r in results if r["row"] == row}
        cells = []
        for key in columns:
            r = mine.get(key)
            cells.append("" if r is None else f"{100 * r['after']:.1f} ({100 * (r['after'] - r['before']):+.1f})")
        seconds = sum(r["seconds"] for r in mine.values()) / max(len(mine), 1)
        name = f"**{row}** (the defaults)" if row == DEFAULTS else row
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {seconds:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    table, _ = study(2000, 100, 2)
    print(table)


# ----------------------------------------------------------------------------- the headline check (issue 22)

_KEYBOARD = ("qwertyuiop", "asdfghjkl", "zxcvbnm")


def keyboard_typo(name: str, rng: random.Random) -> str:
    """The headline's own typo model: 1 (70 %) or 2 of a neighbouring key, a doubled, dropped or swapped letter."""
    s = name.lower()
    for _ in range(1 if rng.random() < 0.7 else 2):
        i = rng.randrange(len(s))
        op = rng.choice(("near", "double", "drop", "swap"))
        row = next((r for r in _KEYBOARD if s[i] in r), None)
        if op == "near" and row is not None:
            j = row.index(s[i])
            s = s[:i] + row[max(0, j - 1) if rng.random() < 0.5 and j > 0 else min(len(row) - 1, j + 1)] + s[i + 1 :]
        elif op == "double":
            s = s[:i] + s[i] + s[i:]
        elif op == "drop" and len(s) > 2:
            s = s[:i] + s[i + 1 :]
        elif op == "swap" and i < len(s) - 1:
            s = s[:i] + s[i + 1] + s[i] + s[i + 2 :]
    return s.capitalize()


def random_typo(name: str, rng: random.Random) -> str:
    """A second typo model: 1 (60 %) or 2 of any letter replaced or inserted at random, a letter dropped or doubled."""
    s = name.lower()
    for _ in range(1 if rng.random() < 0.6 else 2):
        i = rng.randrange(len(s))
        op = rng.randrange(4)
        if op == 0:
            s = s[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz") + s[i + 1 :]
        elif op == 1:
            s = s[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz") + s[i:]
        elif op == 2 and len(s) > 3:
            s = s[:i] + s[i + 1 :]
        else:
            s = s[:i] + s[i] + s[i:]
    return s.capitalize()


TYPO_MODELS = {"keyboard": keyboard_typo, "random": random_typo}


def _typo_pairs(names: list[str], seed: int, stored: set[str], model: str = "keyboard") -> list[tuple[str, str]]:
    pairs = []
    for name in names:
        rng = random.Random(f"{seed}:{name}")
        for _ in range(10):
            query = TYPO_MODELS[model](name, rng)
            if query != name and query not in stored:
                pairs.append((query, name))
                break
    return pairs


def _headline_run(job: dict[str, Any]) -> dict[str, Any]:
    import shutil
    import tempfile

    import faiss
    import torch

    from kvsearch import Database, NgramEncoder, evaluate, finetune
    from kvsearch.datasets import surname_directory

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    keys, values = surname_directory(job["names"])
    stored = set(keys)
    order = list(keys)
    random.Random(0).shuffle(order)
    held = _typo_pairs(order[:2000], 1, stored, job["model"])[: job["eval"]]  # no user pair names these names
    user = _typo_pairs(order[2000:], 0, stored, job["model"])[: job["pairs"]]
    folder = tempfile.mkdtemp(prefix="kvsearch-headline-")
    try:
        db = Database(folder, encoder=NgramEncoder(device="cpu"), device="cpu")
        db.add(keys=keys, values=values)
        before = evaluate(db, held)["recall@1"]
        start = time.perf_counter()
        history = finetune(db, user * job["repeat"] or None, eval_pairs=held, verbose=False)
        seconds = time.perf_counter() - start
        db.close()
        with Database(folder) as reopened:
            after = evaluate(reopened, held)["recall@1"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**job, "before": before, "after": after, "seconds": seconds, "summary": history.summary(),
            "generated": history.generated}  # fmt: skip


def headline(names: int, eval_count: int, pairs: int, model: str = "keyboard", repeat: int = 1) -> str:
    """The issue's two checks side by side: the defaults with ``pairs`` typo pairs (of ``model``; each given
    ``repeat`` times: the user's pairs oversampled among the generated ones), and with none."""
    jobs = [{"names": names, "eval": eval_count, "pairs": n, "model": model, "repeat": repeat} for n in (pairs, 0)]
    with ProcessPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_headline_run, jobs))
    lines = [
        "| run | held-out recall@1 before | after reopening | gain | fine-tuning | kept |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        times = f" x {r['repeat']}" if r["repeat"] > 1 else ""
        what = f"`finetune(db, pairs{times}, eval_pairs=held)`, {r['pairs']:,} typo pairs" if r["pairs"] else (
            "`finetune(db, eval_pairs=held)`, no pair (self-supervised)")  # fmt: skip
        lines.append(
            f"| {what} | {100 * r['before']:.1f} | {100 * r['after']:.1f} | {100 * (r['after'] - r['before']):+.1f} "
            f"| {r['seconds']:.0f} s, {r['generated']:,} generated pairs per epoch | {r['summary']} |"
        )
    return "\n".join(lines)
