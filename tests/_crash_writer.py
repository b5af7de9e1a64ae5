"""The writer that ``test_crash.py`` kills: a fork server plus the workload each forked child runs.

Run as ``python tests/_crash_writer.py``. It imports torch / FAISS / kvsearch once (with one thread each, so
that fork() is safe), then reads one JSON command per line on stdin:

    {"path": db folder, "acks": ack file, "round": r, "seed": s, "mode": m, "delay": seconds}

and for each forks a child that opens the database and writes to it until it is killed: by the server with
SIGKILL after ``delay`` seconds (``mode="timer"``), or by itself with SIGKILL at a chosen point of the
write / save path (the other modes). The server answers one JSON line per command.

The child appends to the ack file, *after* each call returned, what it completed:
``add <batch> <size>`` or ``del <batch>``; before a delete it writes ``pre-del <batch>`` (the delete may
then have committed or not). Every added batch's records carry ``{"batch": name, "size": n}`` metadata.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import faiss
import numpy as np
import torch

torch.set_num_threads(1)  # no OpenMP pool in the server: fork() stays safe
faiss.omp_set_num_threads(1)

import kvsearch  # noqa: E402
from kvsearch import index as index_module  # noqa: E402
from kvsearch import store as store_module  # noqa: E402

DIM, VALUE_DIM, SPEC = 8, 4, "IVF4,Flat"
MODES = ("timer", "in_transaction", "after_commit", "index_tmp_written", "index_renamed", "index_torn")


def open_db(path: str) -> kvsearch.Database:
    """The database the test and the writer share: IVF with every list probed (exact), dot score."""
    return kvsearch.Database(
        path, dim=DIM, value_dim=VALUE_DIM, index=SPEC, score="dot", search_params={"nprobe": 4}, lock_timeout=30
    )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(mode: str, rng: np.random.Generator) -> None:
    """Make the child SIGKILL itself at the n-th pass through one point of the write / save path."""
    if mode == "timer":
        return
    countdown = [int(rng.integers(1, 6))]

    def due() -> bool:
        countdown[0] -= 1
        return countdown[0] <= 0

    if mode == "in_transaction":  # records inserted, version bumped, COMMIT not yet run
        bump = store_module.Store._bump

        def bump_then_die(self):
            bump(self)
            if due():
                _die()

        store_module.Store._bump = bump_then_die
    elif mode == "after_commit":  # committed to the store; memory mirror, index and index save not done
        exit_ = store_module._Transaction.__exit__

        def exit_then_die(self, *exc):
            exit_(self, *exc)
            if self.depth_owner and exc[0] is None and due():
                _die()

        store_module._Transaction.__exit__ = exit_then_die
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
    else:
        raise ValueError(f"unknown mode {mode!r}")


def child(cmd: dict) -> None:
    """Open the database and write to it until killed."""
    rng = np.random.default_rng(cmd["seed"])
    ack = os.open(cmd["acks"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    db = open_db(cmd["path"])
    _arm(cmd["mode"], rng)
    added: list[str] = []
    for j in range(10_000):
        name = f"r{cmd['round']}b{j}"
        n = int(rng.choice([1, 3, 17, 40]))
        keys = rng.standard_normal((n, DIM)).astype(np.float32)
        values = rng.standard_normal((n, VALUE_DIM)).astype(np.float32)
        db.add(keys=keys, values=values, metadata=[{"batch": name, "size": n}] * n)
        os.write(ack, f"add {name} {n}\n".encode())
        added.append(name)
        roll = rng.random()
        if roll < 0.15 and len(added) > 1:
            victim = added.pop(int(rng.integers(0, len(added) - 1)))
            os.write(ack, f"pre-del {victim}\n".encode())
            ids = [int(i) for i in db.store.ids_where({"batch": victim})]
            db.delete(ids)
            os.write(ack, f"del {victim}\n".encode())
        elif roll < 0.45:
            db.save()
    os._exit(0)


def main() -> None:
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                child(cmd)
            finally:
                os._exit(1)
        killed_by = "self"
        deadline = time.monotonic() + cmd["delay"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                killed_by = "server"
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.002)
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        print(json.dumps({"pid": pid, "killed_by": killed_by, "signal": signum}), flush=True)


if __name__ == "__main__":
    main()
