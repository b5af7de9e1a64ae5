"""Encoder files carry a SHA-256 recorded in the store: every load checks it; a save stays crash-safe.

``save_encoders`` stages the files, records their digests as pending, moves them into place and then records them
as current. These tests stop a save at each point (an exception raised by the patched ``os.replace`` or by the
final meta write; the half-saved database object is then abandoned, as a killed process would leave it) and
reopen: the database opens with the old or the new encoder, and its answers agree with that encoder.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch import CorruptDatabaseError
from kvsearch.folder import ENCODER_FILES_META
from kvsearch.store import Store

DIM = 16
KEYS = [f"key{i}word" for i in range(60)]


class Crash(Exception):
    """Stands for a process killed at this point."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(folder: Path) -> dict | None:
    with sqlite3.connect(folder / "store.sqlite") as conn:
        row = conn.execute("SELECT value FROM meta WHERE name = ?", (ENCODER_FILES_META,)).fetchone()
    return None if row is None else json.loads(row[0])


def nudge(encoder: kvsearch.NgramEncoder, amount: float) -> None:
    """Change the weights as a fine-tuning step would (so that encoder.safetensors is written)."""
    with torch.no_grad():
        next(encoder.parameters()).add_(amount)


def make(folder: Path, *, trained: bool) -> dict[str, torch.Tensor]:
    encoder = kvsearch.NgramEncoder(dim=DIM, num_buckets=512)
    if trained:
        nudge(encoder, 0.01)
    db = kvsearch.Database(folder, encoder=encoder, score="dot")
    db.add(KEYS, [f"v{i}" for i in range(len(KEYS))])
    db.close()
    return {name: t.clone() for name, t in encoder.state_dict().items()}


def weights(db: kvsearch.Database) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in db.encoder.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_saved_encoder_files_have_their_digests_recorded(tmp_path):
    folder = tmp_path / "db"
    make(folder, trained=True)
    rec = record(folder)
    assert rec["pending"] is None
    assert rec["current"] == {name: sha256(folder / name) for name in ("encoder.json", "encoder.safetensors")}
    assert not list(folder.glob(".encoders.*"))  # no staging folder left behind


def test_value_and_query_encoder_files_are_checked_too(tmp_path):
    folder = tmp_path / "db"
    db = kvsearch.Database(
        folder, encoder=kvsearch.NgramEncoder(dim=DIM), value_encoder=kvsearch.NgramEncoder(dim=8, seed=3)
    )
    db.add(KEYS[:5], ["a", "b", "c", "d", "e"])
    db.query_encoder = kvsearch.NgramEncoder(dim=DIM, seed=7)
    db.close()
    assert set(record(folder)["current"]) == {"encoder.json", "value_encoder.json", "query_encoder.json"}
    for name in ("value_encoder.json", "query_encoder.json"):
        path = folder / name
        text = path.read_text()
        path.write_text(text.replace('"seed": ', '"seed": 1'))
        with pytest.raises(CorruptDatabaseError, match=name.replace(".", "[.]")):
            kvsearch.Database(folder)
        path.write_text(text)
    with kvsearch.Database(folder) as again:
        assert again.query_encoder is not None and again.query_encoder.seed == 7


@pytest.mark.parametrize("trained_before", [True, False])
@pytest.mark.parametrize("stop", ["before the moves", "after the weights move", "after the moves"])
def test_a_save_stopped_between_phases_opens_with_the_old_or_the_new_encoder(
    tmp_path, monkeypatch, trained_before, stop
):
    folder = tmp_path / "db"
    old = make(folder, trained=trained_before)
    db = kvsearch.Database(folder)
    nudge(db.encoder, 0.5)
    new = weights(db)
    moves = []
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).parent == folder and Path(dst).name.startswith("encoder."):
            if stop == "before the moves" or (stop == "after the weights move" and moves):
                raise Crash(f"stopped before moving {Path(dst).name}")
            moves.append(Path(dst).name)
        return real_replace(src, dst)

    real_set_meta = Store.set_meta

    def set_meta(self, name, value):
        if stop == "after the moves" and name == ENCODER_FILES_META and value.get("pending") is None:
            raise Crash("stopped before the digests were recorded as current")
        return real_set_meta(self, name, value)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Store, "set_meta", set_meta)
    with pytest.raises(Crash):
        db.save_encoders()
    monkeypatch.undo()
    assert record(folder)["pending"] is not None  # stopped between recording pending and recording current
    del db  # abandoned, as by a killed process (never closed)

    with kvsearch.Database(folder) as again:
        loaded = weights(again)
        assert same(loaded, old) or same(loaded, new)
        if stop == "after the moves" or (stop == "after the weights move" and trained_before):
            assert same(loaded, new)  # every file, or the same json with the new weights, is the new save's
        if stop == "before the moves":
            assert same(loaded, old)
        again.refresh()  # the stored keys re-encoded with the encoder it opened with: it finds every key
        assert [row[0].key for row in again.search(KEYS, k=1)] == KEYS
    assert record(folder)["pending"] is None  # the open settled the record (it could take the write lock)
    with kvsearch.Database(folder) as third:
        assert same(weights(third), loaded)
        third.save_encoders()
    assert record(folder)["current"]["encoder.json"] == sha256(folder / "encoder.json")


def test_a_database_without_digests_opens_as_before(tmp_path):
    """Databases saved before digests were recorded have none in the store: their files load unchecked."""
    folder = tmp_path / "db"
    saved = make(folder, trained=True)
    with sqlite3.connect(folder / "store.sqlite") as conn:
        conn.execute("DELETE FROM meta WHERE name = ?", (ENCODER_FILES_META,))
    assert record(folder) is None
    with kvsearch.Database(folder) as db:
        assert same(weights(db), saved)
        assert [row[0].key for row in db.search(KEYS[:20], k=1)] == KEYS[:20]
        nudge(db.encoder, 0.1)  # a changed encoder is saved at close, now with digests
    assert set(record(folder)["current"]) == {"encoder.json", "encoder.safetensors"}


def test_another_process_s_new_encoders_are_checked_when_reloaded(tmp_path):
    folder = tmp_path / "db"
    make(folder, trained=True)
    reader = kvsearch.Database(folder)
    writer = kvsearch.Database(folder)
    nudge(writer.encoder, 0.25)
    writer.save_encoders()
    writer.add(["fresh"], ["x"])  # moves the store version: the reader reloads on its next read
    reader.search(KEYS[:3], k=1)
    assert same(weights(reader), weights(writer))

    nudge(writer.encoder, 0.25)
    writer.save_encoders()
    path = folder / "encoder.safetensors"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # one bit inside the float weights
    path.write_bytes(bytes(data))
    writer.add(["fresher"], ["y"])
    with pytest.raises(CorruptDatabaseError, match=r"encoder\.safetensors.*expected SHA-256.*found"):
        reader.search(KEYS[:3], k=1)
    writer.close()
    reader.close()


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
import torch
import kvsearch
from kvsearch.folder import ENCODER_FILES_META
from kvsearch.store import Store

folder, point = Path(sys.argv[1]), sys.argv[2]
db = kvsearch.Database(folder)
with torch.no_grad():
    next(db.encoder.parameters()).add_(0.5)
real_replace, real_set_meta = os.replace, Store.set_meta

def replace(src, dst):
    if point == "mid-moves" and Path(dst) == folder / "encoder.json":
        os.kill(os.getpid(), signal.SIGKILL)  # the new weights are in place, the json not yet
    return real_replace(src, dst)

def set_meta(self, name, value):
    if point == "before-current" and name == ENCODER_FILES_META and value.get("pending") is None:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_set_meta(self, name, value)

os.replace, Store.set_meta = replace, set_meta
db.save_encoders()
sys.exit(3)  # not reached: killed inside the save
"""


@pytest.mark.parametrize("point", ["mid-moves", "before-current"])
def test_a_writer_killed_inside_save_encoders_leaves_a_database_that_opens(tmp_path, point):
    folder = tmp_path / "db"
    old = make(folder, trained=True)
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(folder), point], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert record(folder)["pending"] is not None
    assert bool(list(folder.glob(".encoders.*.staging"))) == (point == "mid-moves")  # killed before its cleanup
    with kvsearch.Database(folder) as again:
        assert not same(weights(again), old)  # the weights moved into place are the new save's
        again.refresh()
        assert [row[0].key for row in again.search(KEYS, k=1)] == KEYS
        nudge(again.encoder, 0.1)  # saved at close: the staging folder the killed writer left is removed
    assert record(folder)["pending"] is None and not list(folder.glob(".encoders.*"))
    with kvsearch.Database(folder) as third:
        assert third.encoder is not None
