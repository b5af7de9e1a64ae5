"""Encoder files carry a SHA-256 recorded in the store: every load checks it; a new generation switches whole.

A commit (``save_encoders``, ``refresh``, a fine-tuning run) writes the new encoder files into ``generations/<G>``
(``kvsearch.storage.encoder_files.write_generation``: a staging folder renamed into place), replaces the key / value
embeddings and records the generation's digests in ONE store transaction (``kvsearch.generations.switch``), then
removes the generations other than the current and the previous one (``remove_old``). These tests stop a commit at
each point — an exception raised by a patched step (the half-committed database object is then abandoned, as a
killed process would leave it), or a real writer SIGKILLed — and reopen: the database opens with the old or the new
generation whole (its stored key embeddings are its key encoder applied to its keys, with no repair on open, and
every key is found).

A database written before generations is generation 0: its encoder files at the top of the folder, recorded
with digests (possibly with the *pending* digests of a save that stopped), or with none at all (older still).
It opens, and its first commit moves to ``generations/1`` keeping generation 0 as the previous one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kvsearch
import kvsearch.generations
import kvsearch.storage.encoder_files
from kvsearch import CorruptDatabaseError, NothingToRollBackError
from kvsearch.storage.encoder_files import (
    ENCODER_FILES_META,
    current_generation_dir,
    generation_dir,
    load_encoder,
    save_encoder,
)
from kvsearch.storage.folder import GENERATIONS_DIR
from kvsearch.storage.store import Store

DIM = 16
KEYS = [f"key{i}word" for i in range(60)]


class Crash(Exception):
    """Stands for a process killed at this point."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def meta(folder: Path, name: str) -> dict | None:
    with contextlib.closing(sqlite3.connect(folder / "store.sqlite")) as conn:
        row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
    return None if row is None else json.loads(row[0])


def set_meta(folder: Path, name: str, value: dict | None) -> None:
    """Write (or with None delete) a meta entry directly, as an older version of kvsearch left it."""
    with contextlib.closing(sqlite3.connect(folder / "store.sqlite")) as conn, conn:
        conn.execute("DELETE FROM meta WHERE name = ?", (name,))
        if value is not None:
            conn.execute("INSERT INTO meta (name, value) VALUES (?, ?)", (name, json.dumps(value)))


def record(folder: Path) -> dict | None:
    return meta(folder, ENCODER_FILES_META)


def generations_on_disk(folder: Path) -> list[str]:
    """Everything in ``generations/``: the numbered folders, and any staging leftover."""
    root = folder / GENERATIONS_DIR
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def digests_of(directory: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in directory.iterdir() if p.is_file()}


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
    return {name: t.detach().cpu().clone() for name, t in db.encoder.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].cpu(), b[n].cpu()) for n in a)


def keys_match_encoder(db: kvsearch.Database) -> bool:
    """The stored key embeddings equal the loaded key encoder applied to every stored key text."""
    ids = db.ids()
    keys, _, _ = db.embeddings(ids)  # (m, dim)
    with torch.no_grad():
        fresh = db.encoder.encode(db.key_texts(ids))  # (m, dim)
    return torch.allclose(keys.cpu(), fresh.cpu(), atol=1e-5)


def finds_every_key(db: kvsearch.Database) -> bool:
    return [row[0].key for row in db.search(KEYS, k=1)] == KEYS


def open_whole(folder: Path) -> kvsearch.Database:
    """Open a database and check it needed no repair: its stored key embeddings already were its encoder's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db = kvsearch.Database(folder)
    repairs = [str(w.message) for w in caught if "re-encoded" in str(w.message)]
    assert not repairs, repairs
    return db


def test_saved_encoder_files_have_their_digests_recorded(tmp_path):
    folder = tmp_path / "db"
    make(folder, trained=True)
    rec = record(folder)
    assert rec["generation"] == 1 and rec["previous"] is None and rec["pending"] is None
    current = current_generation_dir(folder)
    assert current == generation_dir(folder, 1) == folder / GENERATIONS_DIR / "1"
    assert rec["current"] == digests_of(current)  # every file of the generation, each with its SHA-256
    assert {"encoder.json", "encoder.safetensors"} <= set(rec["current"])
    assert generations_on_disk(folder) == ["1"]  # no staging folder left behind
    assert not (folder / "encoder.json").exists()  # nothing at the top of the folder any more

    with kvsearch.Database(folder) as db:  # a new generation whose key encoder changed replaced the embeddings
        nudge(db.encoder, 0.25)
        db.save_encoders()
    rec = record(folder)
    assert rec["generation"] == 2 and rec["pending"] is None
    assert rec["current"] == digests_of(current_generation_dir(folder))
    assert set(rec["current"]) == {"encoder.json", "encoder.safetensors", "previous_values.safetensors"}
    assert rec["previous"]["generation"] == 1 and rec["previous"]["current"] == digests_of(generation_dir(folder, 1))
    assert generations_on_disk(folder) == ["1", "2"]


def test_value_and_query_encoder_files_are_checked_too(tmp_path):
    folder = tmp_path / "db"
    db = kvsearch.Database(
        folder, encoder=kvsearch.NgramEncoder(dim=DIM), value_encoder=kvsearch.NgramEncoder(dim=8, seed=3)
    )
    db.add(KEYS[:5], ["a", "b", "c", "d", "e"])
    db.query_encoder = kvsearch.NgramEncoder(dim=DIM, seed=7)
    db.close()
    current = current_generation_dir(folder)
    assert set(record(folder)["current"]) == {"encoder.json", "value_encoder.json", "query_encoder.json"}
    assert record(folder)["current"] == digests_of(current)
    for name in ("value_encoder.json", "query_encoder.json"):
        path = current / name
        text = path.read_text()
        path.write_text(text.replace('"seed": ', '"seed": 1'))
        with pytest.raises(CorruptDatabaseError, match=name.replace(".", "[.]") + ".*expected SHA-256.*found"):
            kvsearch.Database(folder)
        path.write_text(text)
    with kvsearch.Database(folder) as again:
        assert again.query_encoder is not None and again.query_encoder.seed == 7
        assert again.value_encoder is not again.encoder and again.value_encoder.seed == 3


STOPS = ["after write_generation", "inside the switch, before COMMIT", "after the switch, before remove_old"]


@pytest.mark.parametrize("trained_before", [True, False])
@pytest.mark.parametrize("stop", STOPS)
def test_a_commit_stopped_at_each_point_opens_with_the_old_or_the_new_generation_whole(
    tmp_path, monkeypatch, trained_before, stop
):
    folder = tmp_path / "db"
    old = make(folder, trained=trained_before)
    db = kvsearch.Database(folder)
    assert db.generation == 1
    nudge(db.encoder, 0.5)
    new = weights(db)
    if stop == "after write_generation":
        real_write = kvsearch.storage.encoder_files.write_generation

        def write_then_stop(*args, **kwargs):
            real_write(*args, **kwargs)
            raise Crash("stopped after the new generation's files were written")

        monkeypatch.setattr(kvsearch.storage.encoder_files, "write_generation", write_then_stop)
    elif stop == "inside the switch, before COMMIT":

        def bump_version(self):
            raise Crash("stopped inside the switch transaction, before its COMMIT")

        monkeypatch.setattr(Store, "bump_version", bump_version)
    else:
        real_switch = kvsearch.generations.switch

        def switch_then_stop(*args, **kwargs):
            real_switch(*args, **kwargs)
            raise Crash("stopped after the switch, before the old generations were removed")

        monkeypatch.setattr(kvsearch.generations, "switch", switch_then_stop)
    with pytest.raises(Crash):
        db.save_encoders()
    monkeypatch.undo()
    del db  # abandoned, as by a killed process (never closed)

    switched = stop == "after the switch, before remove_old"
    assert record(folder)["generation"] == (2 if switched else 1)
    assert generations_on_disk(folder) == ["1", "2"]  # the new generation's files were written either way
    with open_whole(folder) as again:
        assert again.generation == (2 if switched else 1)
        assert same(weights(again), new if switched else old)
        assert keys_match_encoder(again) and finds_every_key(again)
        nudge(again.encoder, 0.25)
        later = weights(again)
        # closing commits the next generation over whatever the stopped commit left
    rec = record(folder)
    assert rec["generation"] == (3 if switched else 2) and rec["previous"]["generation"] == rec["generation"] - 1
    assert rec["current"] == digests_of(current_generation_dir(folder))
    assert generations_on_disk(folder) == [str(rec["generation"] - 1), str(rec["generation"])]
    with open_whole(folder) as third:
        assert same(weights(third), later) and keys_match_encoder(third) and finds_every_key(third)
        assert third.rollback_encoders() == rec["generation"] - 1
        assert same(weights(third), new if switched else old)  # the previous generation, whole
        assert keys_match_encoder(third) and finds_every_key(third)


def test_another_process_s_new_generation_is_checked_when_reloaded(tmp_path):
    folder = tmp_path / "db"
    make(folder, trained=True)
    reader = kvsearch.Database(folder)
    writer = kvsearch.Database(folder)
    nudge(writer.encoder, 0.25)
    writer.save_encoders()
    writer.add(["fresh"], ["x"])
    reader.search(KEYS[:3], k=1)  # the store version moved: the reader reloads, checked
    assert reader.generation == writer.generation == 2
    assert same(weights(reader), weights(writer)) and keys_match_encoder(reader)

    nudge(writer.encoder, 0.25)
    writer.save_encoders()
    path = current_generation_dir(folder) / "encoder.safetensors"
    assert path.parent.name == "3"
    data = bytearray(path.read_bytes())
    data[-40] ^= 0x01  # one bit inside the float weights
    path.write_bytes(bytes(data))
    writer.add(["fresher"], ["y"])
    with pytest.raises(CorruptDatabaseError, match=r"generations.3.encoder\.safetensors.*expected SHA-256.*found"):
        reader.search(KEYS[:3], k=1)
    writer.close()
    reader.close()


KILL_SCRIPT = """
import os, signal, sys
from pathlib import Path
import torch
import kvsearch
import kvsearch.storage.encoder_files
import kvsearch.generations
from kvsearch.storage.store import Store

folder, point = Path(sys.argv[1]), sys.argv[2]
db = kvsearch.Database(folder)
with torch.no_grad():
    next(db.encoder.parameters()).add_(0.5)
real_replace, real_write = os.replace, kvsearch.storage.encoder_files.write_generation
real_bump, real_switch = Store.bump_version, kvsearch.generations.switch

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def replace(src, dst):
    if point == "staged, not renamed" and Path(dst).parent == folder / "generations":
        die()  # the new generation's files are complete in the staging folder
    return real_replace(src, dst)

def write_generation(*args, **kwargs):
    digests = real_write(*args, **kwargs)
    if point == "after write_generation":
        die()
    return digests

def bump_version(self):
    real_bump(self)
    if point == "inside the switch":
        die()  # the embeddings and the record written, the transaction not committed

def switch(*args, **kwargs):
    real_switch(*args, **kwargs)
    if point == "after the switch":
        die()

os.replace, kvsearch.storage.encoder_files.write_generation = replace, write_generation
Store.bump_version, kvsearch.generations.switch = bump_version, switch
db.save_encoders()
sys.exit(3)  # not reached: killed inside the commit
"""

KILL_POINTS = ["staged, not renamed", "after write_generation", "inside the switch", "after the switch"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_writer_killed_inside_a_commit_leaves_a_database_that_opens(tmp_path, point):
    folder = tmp_path / "db"
    old = make(folder, trained=True)
    done = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(folder), point], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    switched = point == "after the switch"
    assert record(folder)["generation"] == (2 if switched else 1)
    left = generations_on_disk(folder)
    if point == "staged, not renamed":  # killed before its cleanup: a staging folder, no generations/2
        assert left[-1] == "1" and len(left) == 2 and left[0].startswith(".2.") and left[0].endswith(".staging")
    else:
        assert left == ["1", "2"]
    with open_whole(folder) as again:
        assert again.generation == (2 if switched else 1)
        assert same(weights(again), old) != switched  # the new weights exactly when the switch committed
        assert keys_match_encoder(again) and finds_every_key(again)
        nudge(again.encoder, 0.1)  # committed at close: what the killed writer left is removed
    rec = record(folder)
    assert rec["pending"] is None and rec["current"] == digests_of(current_generation_dir(folder))
    assert generations_on_disk(folder) == [str(rec["generation"] - 1), str(rec["generation"])]
    with open_whole(folder) as third:
        assert keys_match_encoder(third) and finds_every_key(third)


# --------------------------------------------------------------------------- databases written before generations


def make_legacy(folder: Path, *, digests: bool = True) -> dict[str, torch.Tensor]:
    """A database as the version before generations wrote it: the encoder files at the top of the folder, the
    record ``{"current": digests, "pending": None}`` (or none at all), no ``"generation"`` in the config.
    The stored key embeddings are the encoder's. Returns the encoder's weights."""
    saved = make(folder, trained=True)
    encoder = load_encoder(current_generation_dir(folder), "encoder", device="cpu")
    shutil.rmtree(folder / GENERATIONS_DIR)
    save_encoder(encoder, folder, "encoder")
    config = meta(folder, "config")
    del config["generation"]
    set_meta(folder, "config", config)
    files = {name: sha256(folder / name) for name in ("encoder.json", "encoder.safetensors")}
    set_meta(folder, ENCODER_FILES_META, {"current": files, "pending": None} if digests else None)
    return saved


@pytest.mark.parametrize("digests", [True, False], ids=["with digests", "without digests"])
def test_a_legacy_database_opens_and_its_first_commit_moves_to_generation_one(tmp_path, digests):
    folder = tmp_path / "db"
    saved = make_legacy(folder, digests=digests)
    legacy = {n: sha256(folder / n) for n in ("encoder.json", "encoder.safetensors")}
    with open_whole(folder) as db:
        assert db.generation == 0 and db.previous_generation is None
        assert current_generation_dir(folder) == generation_dir(folder, 0) == folder
        assert same(weights(db), saved) and keys_match_encoder(db) and finds_every_key(db)
    assert generations_on_disk(folder) == []  # opening writes no generation

    if digests:  # generation 0's files are checked against the digests it recorded
        path = folder / "encoder.safetensors"
        data = path.read_bytes()
        path.write_bytes(data[:-40] + bytes([data[-40] ^ 0x01]) + data[-39:])
        with pytest.raises(CorruptDatabaseError, match=r"encoder\.safetensors.*expected SHA-256.*found"):
            kvsearch.Database(folder)
        path.write_bytes(data)

    with open_whole(folder) as db:
        nudge(db.encoder, 0.5)
        new = weights(db)
        db.save_encoders()
        assert db.generation == 1
        assert keys_match_encoder(db) and finds_every_key(db)
    rec = record(folder)
    assert rec["generation"] == 1 and rec["current"] == digests_of(generation_dir(folder, 1))
    assert generations_on_disk(folder) == ["1"]
    assert {n: sha256(folder / n) for n in legacy} == legacy  # generation 0's files are kept, untouched
    if digests:
        assert rec["previous"]["generation"] == 0 and rec["previous"]["current"] == legacy
        with open_whole(folder) as db:
            assert db.generation == 1 and db.previous_generation == 0 and same(weights(db), new)
            assert db.rollback_encoders() == 0  # back to the legacy files at the top of the folder
            assert same(weights(db), saved) and keys_match_encoder(db) and finds_every_key(db)
        assert generations_on_disk(folder) == []
        with open_whole(folder) as db:
            assert db.generation == 0 and same(weights(db), saved) and keys_match_encoder(db)
            with pytest.raises(NothingToRollBackError):
                db.rollback_encoders()  # once


def test_a_legacy_database_without_digests_can_roll_back_its_first_commit(tmp_path):
    folder = tmp_path / "db"
    saved = make_legacy(folder, digests=False)
    with open_whole(folder) as db:
        nudge(db.encoder, 0.5)
        db.save_encoders()
        assert db.generation == 1
        assert db.rollback_encoders() == 0
        assert same(weights(db), saved) and keys_match_encoder(db) and finds_every_key(db)


@pytest.mark.parametrize("files", ["the pending save's", "the current ones"])
def test_a_legacy_save_stopped_between_its_phases_is_settled(tmp_path, files):
    """The version before generations recorded the digests of a save as pending, moved the files into place,
    then made them current. Stopped in between, the files on disk are the pending or the current ones: the open
    accepts either and settles the record."""
    folder = tmp_path / "db"
    saved = make_legacy(folder)
    current = record(folder)["current"]
    staged = tmp_path / "staged"
    encoder = load_encoder(folder, "encoder", device="cpu")
    nudge(encoder, 0.5)
    save_encoder(encoder, staged, "encoder")
    pending = digests_of(staged)
    assert pending["encoder.safetensors"] != current["encoder.safetensors"]
    set_meta(folder, ENCODER_FILES_META, {"current": current, "pending": pending})
    if files == "the pending save's":
        for name in pending:
            shutil.copyfile(staged / name, folder / name)
        # the stored keys are the old encoder's (that version re-encoded them separately): the open re-encodes
        with pytest.warns(RuntimeWarning, match="re-encoded"):
            db = kvsearch.Database(folder)
        with db:
            assert db.generation == 1 and same(weights(db), dict(encoder.state_dict()))
            assert keys_match_encoder(db) and finds_every_key(db)
        rec = record(folder)
        assert rec["previous"]["generation"] == 0 and rec["previous"]["current"] == pending  # settled, then kept
    else:
        with open_whole(folder) as db:
            assert db.generation == 0 and same(weights(db), saved)
            assert keys_match_encoder(db) and finds_every_key(db)
        assert record(folder) == {"current": current, "pending": None}  # the open settled the record
