"""The fine-tuning process that ``test_finetune_crash.py`` kills: a fork server plus the workload each child runs.

Run as ``python tests/_finetune_crash_child.py``. It imports torch / FAISS / kvsearch once (one thread each, so
that fork() is safe), builds the surname directory once, warms the training loop up once (tqdm, autograd, the
optimizer) and then reads one JSON command per line on stdin:

    {"path": db folder, "acks": ack file (one per round), "round": r, "seed": s, "mode": m, "delay": seconds,
     "mutant": false}

For each it forks a child that opens the database and fine-tunes it in a loop until it is killed: by the server
with SIGKILL after ``delay`` seconds (``mode="timer"``), or by itself with SIGKILL at a chosen point of a
generation commit (the other modes, see :data:`MODES`). The server answers one JSON line per command.

The workload: run after run, each on a fresh set of noisy queries (its *tag*; :func:`eval_pairs` rebuilds them
from the tag), trained and evaluated on the same pairs: ``finetune(train="query+keys")`` with a small
``refresh_every``, ``finetune(train="query")``, ``finetune(train="query+keys", train_values=True)``, and now and
then a plain ``db.refresh()`` (which commits a generation the same way). Each run ends with one generation
commit (or none, when the run made the metric worse).

The child appends to its ack file (``os.write`` on an ``O_APPEND`` descriptor: a line written is kept when the
process is killed right after):

    run <tag> <variant> <generation>      a run starts; the database's generation then
    before <tag> <recall@1>               the first evaluation of the run (the current generation's recall)
    pending <tag> <recall@1>              a generation switch begins (before its transaction); the recall is the
                                          last one measured, that of what is being committed
    switched <tag>                        the switch's transaction committed
    done <tag> <generation> <recall@1> <switches> <refreshes>
                                          the run returned: the generation, ``history.metrics[-1]``'s recall,
                                          how many switches the run made (1, or 0 without a commit)
    error <message>                       the child failed (not killed): the test reports it

The crash points are public functions wrapped in the child (no private name is touched):
``kvsearch.generations.write_files`` (the new encoder files are written), ``kvsearch.storage.store.Store.bump_version``
inside ``kvsearch.generations.switch`` (embeddings and record written, not committed), ``switch`` itself (the
switch committed) and ``kvsearch.generations.remove_old`` (the generation before the previous one removed).

``mutant=True`` reproduces the behaviour generations replaced: right before the new encoder files are written,
the re-encoded key embeddings are committed in a transaction of their own (``Store.replace_embeddings``), as the
old ``finetune`` committed refreshed keys before it saved the encoder. The test shows that it is caught.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import traceback
from collections.abc import Callable, Mapping

import faiss
import torch

torch.set_num_threads(1)  # no OpenMP pool in the server: fork() stays safe
faiss.omp_set_num_threads(1)

from _fork_server import serve  # noqa: E402

import kvsearch  # noqa: E402
from kvsearch import datasets  # noqa: E402
from kvsearch.storage import store as store_module  # noqa: E402
from kvsearch.training import metrics as metrics_module  # noqa: E402
from kvsearch.training import run as training_module  # noqa: E402 - the steps of a run: what calls evaluate

NAMES = 3_000  # surnames in the database
EVAL_NAMES = 160  # names per run's query set (trained and evaluated on)
DIM, BUCKETS, K, BATCH, EVAL_BATCH = 64, 4096, 8, 64, 256  # EVAL_BATCH: finetune evaluates max(batch, 256)
MODES = ("timer", "files_written", "in_transaction", "after_switch", "after_remove_old")
VARIANTS = ("query+keys", "query", "query+keys+values", "refresh")
FINETUNE = {
    "query+keys": {"train": "query+keys", "train_values": False},
    "query": {"train": "query", "train_values": False},
    "query+keys+values": {"train": "query+keys", "train_values": True},
}


def directory() -> tuple[list[str], list[str]]:
    """The records: the ``NAMES`` most frequent census surnames -> a first name (deterministic)."""
    return datasets.surname_directory(NAMES)


def eval_pairs(keys: list[str], avoid: set[str], tag: int) -> list[tuple[str, str]]:
    """The noisy queries of one run (its tag): single edits of ``EVAL_NAMES`` surnames drawn by the tag."""
    names = random.Random(tag).sample(keys, EVAL_NAMES)
    return datasets.noisy_queries(names, "edit", seed=tag, avoid=avoid)


def open_db(path: str) -> kvsearch.Database:
    """The database the test and the child share: surnames (n-gram encoder, small), exact Flat index."""
    return kvsearch.Database(
        path,
        encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=BUCKETS, seed=0),
        index="Flat",
        lock_timeout=30,
    )


def create_db(path: str) -> None:
    keys, values = directory()
    with open_db(path) as db:
        db.add(keys, values)


def recall(db: kvsearch.Database, pairs: list[tuple[str, str]]) -> float:
    """recall@1 as ``finetune`` measures it (same k, same evaluation batch)."""
    return metrics_module.evaluate(db, pairs, k=K, batch_size=EVAL_BATCH)["recall@1"]


# ----------------------------------------------------------------------------- the crash points


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _patch(module_attr: str, make: Callable[[Callable], Callable]) -> None:
    """Replace the public function ``kvsearch.generations.<name>`` by ``make(original)``, also where another
    kvsearch module imported it by name."""
    from kvsearch import generations

    original = getattr(generations, module_attr)
    wrapper = make(original)
    for name, module in list(sys.modules.items()):
        if (name == "kvsearch" or name.startswith("kvsearch.")) and getattr(module, module_attr, None) is original:
            setattr(module, module_attr, wrapper)


class Hooks:
    """What the child wraps: the acks around every switch, the self-kill of its mode, the mutant."""

    def __init__(self, note: Callable[[str], None], mode: str, due: Callable[[], bool], mutant: bool, db) -> None:
        self.note, self.mode, self.due, self.mutant, self.db = note, mode, due, mutant, db
        self.tag = -1
        self.measured: list[float] = []  # recall@1 of every evaluation of the current run
        self.switches = 0
        self.in_switch = False
        self.switched = False

    def install(self) -> None:
        hooks = self

        def on_evaluate(original):
            def evaluate(*args, **kwargs):
                out = original(*args, **kwargs)
                if "recall@1" in out:
                    if not hooks.measured:
                        hooks.note(f"before {hooks.tag} {out['recall@1']!r}")
                    hooks.measured.append(out["recall@1"])
                return out

            return evaluate

        training_module.evaluate = on_evaluate(training_module.evaluate)

        def on_write_files(original):
            def write_files(*args, **kwargs):
                if hooks.mutant:
                    hooks.commit_keys_early(args, kwargs)
                out = original(*args, **kwargs)
                if hooks.mode == "files_written" and hooks.due():
                    _die()  # the new generation's encoder files are written; nothing recorded yet
                return out

            return write_files

        def on_switch(original):
            def switch(*args, **kwargs):
                last = hooks.measured[-1] if hooks.measured else float("nan")
                hooks.note(f"pending {hooks.tag} {last!r}")
                hooks.in_switch = True
                try:
                    out = original(*args, **kwargs)
                finally:
                    hooks.in_switch = False
                hooks.switches += 1
                hooks.switched = True  # the next remove_old is the one after the switch
                hooks.note(f"switched {hooks.tag}")
                if hooks.mode == "after_switch" and hooks.due():
                    _die()  # the switch committed; the generation before the previous one not removed yet
                return out

            return switch

        def on_remove_old(original):
            def remove_old(*args, **kwargs):
                out = original(*args, **kwargs)
                after_switch, hooks.switched = hooks.switched, False  # (a commit also clears leftovers first)
                if hooks.mode == "after_remove_old" and after_switch and hooks.due():
                    _die()  # the switch committed and the generation before the previous one is gone
                return out

            return remove_old

        _patch("write_files", on_write_files)
        _patch("switch", on_switch)
        _patch("remove_old", on_remove_old)
        if self.mode == "in_transaction":  # inside the switch's transaction, its last statement run, no COMMIT
            bump = store_module.Store.bump_version

            def bump_then_die(store):
                bump(store)
                if hooks.in_switch and hooks.due():
                    _die()

            store_module.Store.bump_version = bump_then_die

    def commit_keys_early(self, args: tuple, kwargs: dict) -> None:
        """The mutant: the key embeddings re-encoded with the new key encoder, committed on their own."""
        encoder = None
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, Mapping) and isinstance(arg.get("encoder"), kvsearch.Encoder):
                encoder = arg["encoder"]
        encoder = self.db.encoder if encoder is None else encoder
        store = self.db.store
        texts = [store.texts.key_of_id[i] for i in store.table.ids.tolist()]
        store.replace_embeddings(keys=encoder.encode(texts))  # (n, dim), a transaction of its own


# ----------------------------------------------------------------------------- the child


def child(cmd: dict, keys: list[str], avoid: set[str]) -> None:
    """Open the database and fine-tune it, run after run, until killed."""
    ack = os.open(cmd["acks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(ack, (line + "\n").encode())

    try:
        rng = random.Random(cmd["seed"])
        countdown = [rng.randint(1, 3)]

        def due() -> bool:
            countdown[0] -= 1
            return countdown[0] <= 0

        db = open_db(cmd["path"])
        hooks = Hooks(note, cmd["mode"], due, cmd.get("mutant", False), db)
        hooks.install()
        first = rng.randrange(len(VARIANTS))
        for j in range(10_000):
            variant = VARIANTS[(first + j) % len(VARIANTS)]
            tag = cmd["round"] * 1_000 + j
            pairs = eval_pairs(keys, avoid, tag)
            hooks.tag, hooks.measured, hooks.switches = tag, [], 0
            note(f"run {tag} {variant} {db.generation}")
            if variant == "refresh":
                hooks.measured.append(recall(db, pairs))
                note(f"before {tag} {hooks.measured[-1]!r}")
                db.refresh()  # the same encoders: a new generation with the same embeddings
                final, refreshes = hooks.measured[-1], 1
            else:
                history = kvsearch.finetune(
                    db,
                    pairs,
                    eval_pairs=pairs,
                    loss="retrieval",
                    k=K,
                    epochs=1,
                    batch_size=BATCH,
                    refresh_every=2,
                    seed=tag,
                    verbose=False,
                    **FINETUNE[variant],
                )
                measured = [m["recall@1"] for m in history.metrics]
                if measured != hooks.measured:
                    raise AssertionError(f"history.metrics {measured} != the evaluations seen {hooks.measured}")
                final, refreshes = measured[-1], history.refreshes
            note(f"done {tag} {db.generation} {final!r} {hooks.switches} {refreshes}")
        os._exit(0)
    except BaseException as exc:  # not a kill: report it to the test
        message = " | ".join(traceback.format_exception_only(type(exc), exc)).replace("\n", " ")
        where = traceback.extract_tb(exc.__traceback__)[-1]
        note(f"error {message} (at {where.filename}:{where.lineno})")
        os._exit(1)


def main() -> None:
    keys, _ = directory()
    avoid = set(keys)
    warm_up()
    serve(lambda cmd: child(cmd, keys, avoid))


def warm_up() -> None:
    """One tiny fine-tuning run in memory, so that every child starts with the lazy imports done."""
    try:
        db = kvsearch.Database(encoder=kvsearch.NgramEncoder(dim=8, num_buckets=64, seed=0), index="Flat")
        db.add(["Smith", "Jones", "Brown"], ["a", "b", "c"])
        pairs = [("Smyth", "Smith")]
        kvsearch.finetune(db, pairs, loss="retrieval", k=2, epochs=1, train="query+keys", verbose=False)
        metrics_module.evaluate(db, pairs, k=2)
    except Exception:  # noqa: BLE001 - a warm-up only; the children report real failures
        pass


if __name__ == "__main__":
    main()
