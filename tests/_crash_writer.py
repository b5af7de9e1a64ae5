"""The writer that ``test_crash.py`` kills: a fork server plus the workload each forked child runs.

Run as ``python tests/_crash_writer.py``. It imports torch / FAISS / kvsearch once (with one thread each, so
that fork() is safe), then reads one JSON command per line on stdin:

    {"path": db folder, "acks": ack file, "round": r, "seed": s, "mode": m, "delay": seconds,
     "batches": {batch: [size, gen], ...}}   # the live batches, as the test read them from the store

and for each forks a child that opens the database and writes to it until it is killed: by the server with
SIGKILL after ``delay`` seconds (``mode="timer"``), or by itself with SIGKILL at a chosen point of the
write / save path (the other modes; ``in_files``: inside the vector files' write path: a column half written,
every file written but not named, holes listed, a new file set written, a switch committed but not tidied). The server
answers one JSON line per command.

The workload: add a batch; then now and then delete a whole batch, upsert a whole batch (same keys, so the
same ids; new values), re-encode every key with new encoder weights (``Database.refresh``: same ids, new key
vectors) or save the index. A batch ``b`` of ``n`` records has keys ``b-0`` ... ``b-(n-1)``; its generation
``g`` (0 when added, +1 per upsert) is in every record's metadata ``{"batch": b, "size": n, "gen": g}`` and
in its value text ``<key>-g<g>``.

The child appends to the ack file, *after* each call returned, what it completed: ``add <batch> <size>``,
``del <batch>``, ``ups <batch> <gen> <size>`` or ``refresh``; before a delete, an upsert or a refresh it writes
``pre-del <batch>``, ``pre-ups <batch> <gen>`` or ``pre-refresh`` (the call may then have committed or not).
"""

from __future__ import annotations

import os
import signal

import faiss
import numpy as np
import torch

torch.set_num_threads(1)  # no OpenMP pool in the server: fork() stays safe
faiss.omp_set_num_threads(1)

from _fork_server import serve  # noqa: E402

import kvsearch  # noqa: E402
from kvsearch.index import factory as index_module  # noqa: E402
from kvsearch.storage import store as store_module  # noqa: E402
from kvsearch.storage import vector_file  # noqa: E402

DIM, SPEC = 8, "IVF4,Flat"
MODES = (
    "timer",
    "in_transaction",
    "after_commit",
    "index_tmp_written",
    "index_renamed",
    "index_torn",
    "after_upsert",
    "after_refresh",
    "in_files",
)


def open_db(path: str) -> kvsearch.Database:
    """The database the test and the writer share: text keys and values (n-gram encoder), IVF with every
    list probed (exact), dot score."""
    return kvsearch.Database(
        path,
        encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=256, seed=0),
        index=SPEC,
        score="dot",
        search_params={"nprobe": 4},
        lock_timeout=30,
    )


def batch_records(name: str, size: int, gen: int) -> tuple[list[str], list[str], list[dict]]:
    """Keys, values and metadata of one batch at one generation."""
    keys = [f"{name}-{i}" for i in range(size)]
    return keys, [f"{k}-g{gen}" for k in keys], [{"batch": name, "size": size, "gen": gen}] * size


def reencode(db: kvsearch.Database, rng: np.random.Generator) -> None:
    """New key encoder weights, then ``refresh``: every key keeps its id and gets a new vector."""
    weight = db.encoder.embedding.weight  # (num_buckets, dim)
    with torch.no_grad():
        weight.copy_(torch.from_numpy(rng.standard_normal(tuple(weight.shape)).astype(np.float32)))
    db.refresh()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


#: The kill points of mode ``in_files``, one per round in turn.
FILE_POINTS = ("write_at", "append", "erase", "rewrite", "remove_stale")


def _arm(mode: str, due, round_: int = 0) -> None:
    """Make the child SIGKILL itself at the n-th pass through one point of the write / save path."""
    if mode in ("timer", "after_upsert", "after_refresh"):  # the last two are handled by the workload itself
        return
    if mode == "in_transaction":  # records inserted, version bumped, COMMIT not yet run
        bump = store_module.Store.bump_version

        def bump_then_die(self, *args, **kwargs):
            bump(self, *args, **kwargs)
            if due():
                _die()

        store_module.Store.bump_version = bump_then_die
    elif mode == "after_commit":  # committed to the store; memory mirror, index and index save not done
        exit_ = store_module.Transaction.__exit__

        def exit_then_die(self, *exc):
            exit_(self, *exc)
            if self.depth_owner and exc[0] is None and due():
                _die()

        store_module.Transaction.__exit__ = exit_then_die
    elif mode in ("index_tmp_written", "index_renamed"):
        replace = os.replace

        def replace_and_maybe_die(src, dst, *a, **kw):
            dst_name = os.path.basename(os.fspath(dst))
            if mode == "index_tmp_written" and dst_name == "index.npz" and due():
                _die()  # the new index is in its temporary file; the old index and manifest are in place
            replace(src, dst, *a, **kw)
            if mode == "index_renamed" and dst_name == "index.npz" and due():
                _die()  # the new index is in place, the manifest still describes the old one

        index_module.os.replace = replace_and_maybe_die
    elif mode == "index_torn":  # a whole save (index + manifest) done, then the index file torn in half
        save = kvsearch.Database.save

        def save_then_tear(self):
            save(self)
            index_path = os.path.join(self.path, "index.npz")
            if os.path.exists(index_path) and due():
                with open(index_path, "r+b") as f:
                    f.truncate(os.path.getsize(index_path) // 2)
                _die()

        kvsearch.Database.save = save_then_tear
    elif mode == "in_files":  # inside the vector files' write path: part of it on disk, the rest not, no COMMIT
        files = vector_file.VectorFiles
        point = FILE_POINTS[round_ % len(FILE_POINTS)]

        def due_at(name: str) -> bool:  # only this round's point counts down
            return name == point and due()

        write_at, append, erase, rewrite, remove_stale = (
            files._write_at,
            files.append,
            files.erase,
            files.rewrite,
            files.remove_stale,
        )

        def write_at_then_die(self, seq, column, offset, data):  # half a column's bytes written, not synced
            if len(data) > 1 and due_at("write_at"):
                write_at(self, seq, column, offset, data[: len(data) // 2])
                _die()
            write_at(self, seq, column, offset, data)

        def append_then_die(self, conn, ids, keys, values):  # every file written, the state not yet
            slots = append(self, conn, ids, keys, values)
            if due_at("append"):
                _die()
            return slots

        def erase_then_die(conn, slots):  # holes listed, no COMMIT
            erase(conn, slots)
            if due_at("erase"):
                _die()

        def rewrite_then_die(self, conn, ids, keys, values):  # a whole new file set written and named, no COMMIT
            slots = rewrite(self, conn, ids, keys, values)
            if due_at("rewrite"):
                _die()
            return slots

        def remove_stale_then_die(self, conn):  # a switch committed, the old file set not yet removed
            if due_at("remove_stale"):
                _die()
            return remove_stale(self, conn)

        files._write_at, files.append, files.rewrite, files.remove_stale = (
            write_at_then_die,
            append_then_die,
            rewrite_then_die,
            remove_stale_then_die,
        )
        files.erase = staticmethod(erase_then_die)
        files.needs_repack = staticmethod(lambda conn: True)  # every delete writes a new file set (legal any time)
    else:
        raise ValueError(f"unknown mode {mode!r}")


def child(cmd: dict) -> None:
    """Open the database and write to it until killed."""
    rng = np.random.default_rng(cmd["seed"])
    ack = os.open(cmd["acks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(ack, (line + "\n").encode())

    db = open_db(cmd["path"])
    countdown = [int(rng.integers(1, 6))]

    def due() -> bool:
        countdown[0] -= 1
        return countdown[0] <= 0

    mode = cmd["mode"]
    _arm(mode, due, cmd["round"])
    live: dict[str, list[int]] = {b: list(sg) for b, sg in cmd.get("batches", {}).items()}  # batch -> [size, gen]
    mine: list[str] = []  # batches this child added (deleted from these, as before)

    def upsert(batch: str) -> None:
        size, gen = live[batch][0], live[batch][1] + 1
        note(f"pre-ups {batch} {gen}")
        keys, values, metadata = batch_records(batch, size, gen)
        ids = db.upsert(keys, values, metadata=metadata)
        assert len(ids) == size
        note(f"ups {batch} {gen} {size}")
        live[batch][1] = gen

    def refresh() -> None:
        note("pre-refresh")
        reencode(db, rng)
        note("refresh")

    for j in range(10_000):
        name = f"r{cmd['round']}b{j}"
        n = int(rng.choice([1, 3, 17, 40]))
        keys, values, metadata = batch_records(name, n, 0)
        db.add(keys, values, metadata=metadata)
        note(f"add {name} {n}")
        live[name] = [n, 0]
        mine.append(name)
        if mode in ("after_upsert", "after_refresh") and due():
            # The index is saved, then the store changes under the same ids (new values / new key vectors)
            # and the child dies before the index is saved again: only the manifest's version tells.
            db.save()
            if mode == "after_upsert":
                upsert(sorted(live)[int(rng.integers(len(live)))])
            else:
                refresh()
            _die()
        roll = rng.random()
        if roll < 0.12 and len(mine) > 1:
            victim = mine.pop(int(rng.integers(0, len(mine) - 1)))
            note(f"pre-del {victim}")
            ids = [int(i) for i in db.store.ids_where({"batch": victim})]
            db.delete(ids)
            note(f"del {victim}")
            del live[victim]
        elif roll < 0.32:
            upsert(sorted(live)[int(rng.integers(len(live)))])
        elif roll < 0.34:
            refresh()
        elif roll < 0.55:
            db.save()
    os._exit(0)


def main() -> None:
    serve(child, ready=False)


if __name__ == "__main__":
    main()
