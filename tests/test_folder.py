"""Tests of kvsearch.storage.folder: the file names of a database folder, the rollback of a failed creation, the index
manifest, and the encoder files with their digests in the store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch.errors import CorruptDatabaseError, InvalidArgumentError
from kvsearch.generations import switch
from kvsearch.storage import folder
from kvsearch.storage.encoder_files import (
    ENCODER_FILES_META,
    EncoderFiles,
    current_generation_dir,
    generation_dir,
    remove_generations,
    save_encoder,
    write_generation,
)
from kvsearch.storage.folder import (
    GENERATIONS_DIR,
    INDEX_FILE,
    MANIFEST_FILE,
    STORE_FILE,
    Creation,
    files_of_database,
    is_database,
    saved_index_path,
    sha256_file,
    write_index,
)
from kvsearch.storage.store import Store

DIM = 8


def touch(path: Path, data: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------- the files of a database folder


def test_file_names() -> None:
    assert (STORE_FILE, INDEX_FILE, MANIFEST_FILE) == ("store.sqlite", "index.npz", "manifest.json")
    assert folder.ENCODER_PREFIXES == ("encoder", "value_encoder", "query_encoder")
    assert ENCODER_FILES_META == "encoder_files"


def test_is_database(tmp_path: Path) -> None:
    assert not is_database(tmp_path / "missing")
    assert not is_database(tmp_path)
    (tmp_path / STORE_FILE).mkdir()
    assert not is_database(tmp_path)  # a folder of that name is not a store
    (tmp_path / STORE_FILE).rmdir()
    touch(tmp_path / STORE_FILE)
    assert is_database(tmp_path) and is_database(str(tmp_path))


def test_files_of_database_lists_ours_and_only_ours(tmp_path: Path) -> None:
    assert files_of_database(tmp_path / "missing") == []
    assert files_of_database(touch(tmp_path / "a-file")) == []
    db = tmp_path / "db"
    ours = [
        "store.sqlite",
        "store.sqlite-wal",
        "store.sqlite-shm",
        "store.sqlite-journal",
        "store.sqlite.emb.json",
        "store.sqlite.emb-3.keys.npy",
        "write.lock",
        "encoder.json",
        "encoder.safetensors",
        "value_encoder.json",
        "query_encoder.json",
        "index.npz",
        "manifest.json",
        "manifest.json.123.tmp",  # leftovers of interrupted writes
        ".encoder.json.k2j3.tmp",
    ]
    for name in ours:
        touch(db / name)
    touch(db / "query_encoder_model" / "modules.json")
    touch(db / ".encoders.abc.staging" / "encoder.json")
    touch(db / "generations" / "1" / "encoder.json")
    theirs = ["notes.txt", "encoder_notes.txt", "store.sqlite3", "my_model", "manifest.json.bak"]
    for name in theirs:
        touch(db / name)
    found = files_of_database(db)
    assert [p.name for p in found] == sorted([*ours, "query_encoder_model", ".encoders.abc.staging", "generations"])
    assert all(p.parent == db for p in found)


def test_files_of_database_lists_every_file_a_database_writes(tmp_path: Path) -> None:
    path = tmp_path / "db"
    encoder = kvsearch.NgramEncoder(dim=DIM, num_buckets=64, device="cpu")
    with torch.no_grad():
        encoder.embedding.weight.add_(0.1)  # trained: its weights are written too
    db = kvsearch.Database(path, encoder=encoder, value_encoder=kvsearch.NgramEncoder(dim=4, num_buckets=32))
    db.add([f"k{i}" for i in range(50)], [f"v{i}" for i in range(50)])
    db.query_encoder = kvsearch.NgramEncoder(dim=DIM, num_buckets=64, seed=5)
    db.close()
    touch(path / "notes.txt")
    assert {p.name for p in files_of_database(path)} == set(names(path)) - {"notes.txt"}
    assert GENERATIONS_DIR in names(path)  # the encoder files are in the generations folder, listed as one
    assert {"encoder.safetensors", "value_encoder.json", "query_encoder.json"} <= set(
        names(current_generation_dir(path))
    )


# --------------------------------------------------------------------------- the rollback of a creation


def test_creation_rollback_removes_new_folders_and_files(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "db"
    creation = Creation(target)
    for name in (STORE_FILE, STORE_FILE + "-wal", "write.lock", "encoder.json", "index.npz"):
        touch(target / name)
    touch(target / "encoder_model" / "config.json")
    creation.rollback()
    assert names(tmp_path) == []
    creation.rollback()  # a second call finds nothing to do


def test_creation_rollback_never_removes_what_existed_before(tmp_path: Path) -> None:
    existing = tmp_path / "existing"
    touch(existing / "notes.txt", b"mine")
    touch(existing / "encoder.json", b"an older file of ours")  # there before: kept
    creation = Creation(existing)
    touch(existing / STORE_FILE)
    touch(existing / "encoder.json", b"overwritten")
    touch(existing / "value_encoder.json")
    creation.rollback()
    assert names(existing) == ["encoder.json", "notes.txt"]
    assert (existing / "notes.txt").read_bytes() == b"mine"

    empty = tmp_path / "empty"
    empty.mkdir()
    creation = Creation(empty)
    touch(empty / STORE_FILE)
    creation.rollback()
    assert empty.is_dir() and names(empty) == []  # the folder was there: it stays


def test_creation_rollback_keeps_a_made_folder_that_holds_other_files(tmp_path: Path) -> None:
    target = tmp_path / "new"
    creation = Creation(target)
    touch(target / STORE_FILE)
    touch(target / "theirs.txt")
    creation.rollback()
    assert names(target) == ["theirs.txt"]


def test_creation_of_an_existing_database_or_in_memory_rolls_back_nothing(tmp_path: Path) -> None:
    touch(tmp_path / STORE_FILE)
    creation = Creation(tmp_path)
    touch(tmp_path / "write.lock")
    creation.rollback()
    assert names(tmp_path) == [STORE_FILE, "write.lock"]
    Creation(None).rollback()


# --------------------------------------------------------------------------- the saved index and its manifest


class FakeIndex:
    """What write_index needs of an index: spec, ntotal, save(path)."""

    def __init__(self, spec: str = "HNSW8", ntotal: int = 3, data: bytes = b"index bytes") -> None:
        self.spec, self.ntotal, self.data = spec, ntotal, data

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_bytes(self.data)


def test_write_index_then_saved_index_path(tmp_path: Path) -> None:
    write_index(tmp_path, FakeIndex(), version=7)
    assert names(tmp_path) == [INDEX_FILE, MANIFEST_FILE]  # no temporary file left
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    sha = sha256_file(tmp_path / INDEX_FILE)
    assert manifest == {"version": 7, "spec": "HNSW8", "ntotal": 3, "sha256": sha}
    assert saved_index_path(tmp_path, version=7, spec="HNSW8", ntotal=3) == tmp_path / INDEX_FILE


@pytest.mark.parametrize(
    "asked",
    [{"version": 8}, {"version": 6}, {"spec": "IVF4,Flat"}, {"ntotal": 4}, {"ntotal": 0}],
    ids=["newer version", "older version", "other spec", "more records", "no records"],
)
def test_saved_index_path_is_none_for_another_index(tmp_path: Path, asked: dict) -> None:
    write_index(tmp_path, FakeIndex(), version=7)
    assert saved_index_path(tmp_path, **{"version": 7, "spec": "HNSW8", "ntotal": 3, **asked}) is None


def changed_byte(folder: Path) -> None:
    path = folder / INDEX_FILE
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        changed_byte,
        lambda f: (f / INDEX_FILE).write_bytes(b""),
        lambda f: (f / INDEX_FILE).unlink(),
        lambda f: (f / MANIFEST_FILE).unlink(),
        lambda f: (f / MANIFEST_FILE).write_text("{not json"),
        lambda f: (f / MANIFEST_FILE).write_bytes(b"\xff\xfe\x00garbage"),
        lambda f: (f / MANIFEST_FILE).write_text("[7, 3]"),
        lambda f: (f / MANIFEST_FILE).write_text(""),
        lambda f: (f / MANIFEST_FILE).unlink() or (f / MANIFEST_FILE).mkdir(),
    ],
    ids=[
        "changed byte",
        "empty index",
        "missing index",
        "missing manifest",
        "garbage manifest",
        "binary manifest",
        "manifest not an object",
        "empty manifest",
        "manifest a folder",
    ],
)
def test_saved_index_path_is_none_for_damaged_side_files(tmp_path: Path, damage) -> None:
    write_index(tmp_path, FakeIndex(), version=7)
    damage(tmp_path)
    assert saved_index_path(tmp_path, version=7, spec="HNSW8", ntotal=3) is None


def test_saved_index_path_in_a_missing_folder(tmp_path: Path) -> None:
    assert saved_index_path(tmp_path / "missing", version=0, spec="Flat", ntotal=0) is None


# --------------------------------------------------------------------------- encoder files and their digests


@pytest.fixture
def store(tmp_path: Path):
    store = Store(tmp_path / STORE_FILE, "cpu")
    yield store
    store.close()


def trained(seed: int = 0) -> kvsearch.NgramEncoder:
    encoder = kvsearch.NgramEncoder(dim=DIM, num_buckets=64, seed=seed, device="cpu")
    with torch.no_grad():
        encoder.embedding.weight.add_(0.25)
    return encoder


def record_of(digests: dict[str, str], generation: int) -> dict:
    return {"generation": generation, "current": digests, "previous": None, "pending": None}


def test_generation_dirs(tmp_path: Path, store: Store) -> None:
    assert GENERATIONS_DIR == "generations"
    assert generation_dir(tmp_path, 0) == tmp_path  # generation 0: the files at the top of the folder
    assert generation_dir(str(tmp_path), 3) == tmp_path / "generations" / "3"
    assert current_generation_dir(tmp_path) == tmp_path  # no record: generation 0
    store.set_meta(ENCODER_FILES_META, {"current": {}, "pending": None})  # a record of before generations
    assert current_generation_dir(tmp_path) == tmp_path
    store.set_meta(ENCODER_FILES_META, record_of({}, 2))
    assert current_generation_dir(tmp_path) == tmp_path / "generations" / "2"
    assert EncoderFiles(tmp_path, store).current_dir() == tmp_path / "generations" / "2"


def test_write_generation_writes_whole_folders_and_records_every_digest(tmp_path: Path, store: Store) -> None:
    files = EncoderFiles(tmp_path, store)
    assert not files.has("encoder") and files.record() == {}
    encoder = trained()
    before = {"ids": torch.arange(3), "values": torch.ones(3, 2)}
    digests = write_generation(
        tmp_path,
        1,
        {"encoder": encoder, "query_encoder": kvsearch.NgramEncoder(dim=DIM, num_buckets=64)},
        tensors={"previous_values": before},
    )
    target = generation_dir(tmp_path, 1)
    written = ("encoder.json", "encoder.safetensors", "query_encoder.json", "previous_values.safetensors")
    assert names(target) == sorted(written)
    assert digests == {name: sha256_file(target / name) for name in written}
    assert names(tmp_path / GENERATIONS_DIR) == ["1"]  # no staging folder left behind
    assert not files.has("encoder")  # not part of the database until the switch records it
    switch(store, keys=None, values=None, meta={"config": {"dim": DIM}, ENCODER_FILES_META: record_of(digests, 1)})
    assert store.get_meta("config") == {"dim": DIM} and files.record() == record_of(digests, 1)  # one transaction
    assert files.has("encoder") and files.has("query_encoder") and not files.has("value_encoder")
    loaded = files.load("encoder", "cpu")
    assert torch.equal(loaded.embedding.weight, encoder.embedding.weight) and loaded.trained
    other = files.load_generation(1, digests, "query_encoder", "cpu")
    assert not other.trained

    stale = write_generation(tmp_path, 2, {"encoder": trained(1)})  # never recorded (a writer that stopped)
    again = write_generation(tmp_path, 2, {"encoder": trained(2)})  # replaced whole
    assert stale != again and digests_of_dir(generation_dir(tmp_path, 2)) == again
    with pytest.raises(InvalidArgumentError, match="generation"):
        write_generation(tmp_path, 0, {"encoder": trained()})


def digests_of_dir(directory: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in directory.iterdir()}


def test_remove_generations_keeps_only_what_is_asked(tmp_path: Path) -> None:
    for name in ("encoder.json", "encoder.safetensors", "query_encoder.json", "notes.txt", STORE_FILE):
        touch(tmp_path / name)
    touch(tmp_path / "encoder_model" / "config.json")
    for generation in ("1", "2", "3", ".4.abc.staging"):
        touch(tmp_path / GENERATIONS_DIR / generation / "encoder.json")
    remove_generations(tmp_path, {0, 3})
    assert names(tmp_path / GENERATIONS_DIR) == ["3"]  # staging leftovers go too
    assert {"encoder.json", "encoder.safetensors", "query_encoder.json", "encoder_model"} <= set(names(tmp_path))
    remove_generations(tmp_path, {3})  # generation 0 no longer kept: the files at the top go
    assert names(tmp_path) == sorted([GENERATIONS_DIR, "notes.txt", STORE_FILE])
    remove_generations(tmp_path / "missing", {1})  # nothing there: nothing to do


def test_encoder_files_refuse_a_changed_file(tmp_path: Path, store: Store) -> None:
    files = EncoderFiles(tmp_path, store)
    digests = write_generation(tmp_path, 1, {"encoder": trained()})
    store.set_meta(ENCODER_FILES_META, record_of(digests, 1))
    path = generation_dir(tmp_path, 1) / "encoder.safetensors"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDatabaseError, match=r"generations.1.encoder\.safetensors.*expected SHA-256.*found"):
        files.load("encoder", "cpu")
    with pytest.raises(CorruptDatabaseError, match=r"encoder\.safetensors.*expected SHA-256.*found"):
        files.load_generation(1, digests, "encoder", "cpu")  # another generation's files are checked too


def test_encoder_files_reread_the_record_once_on_a_mismatch(tmp_path: Path, store: Store) -> None:
    """A reader inside a read snapshot sees the old digests of generation 2; on disk, generation 2 is another
    process's newer one (a generation number is used again after a rollback removed it)."""
    store.set_meta(ENCODER_FILES_META, record_of(write_generation(tmp_path, 2, {"encoder": trained(0)}), 2))
    other = Store(tmp_path / STORE_FILE, "cpu")
    try:
        with store.snapshot():
            store.get_meta(ENCODER_FILES_META)  # the snapshot starts at the first read
            other.set_meta(ENCODER_FILES_META, record_of(write_generation(tmp_path, 2, {"encoder": trained(1)}), 2))
            assert store.get_meta(ENCODER_FILES_META)["current"] != other.get_meta(ENCODER_FILES_META)["current"]
            assert EncoderFiles(tmp_path, store).load("encoder", "cpu").seed == 1
    finally:
        other.close()


def test_encoder_files_settle_a_stopped_save(tmp_path: Path, store: Store) -> None:
    """A save by the version before generations (generation 0, files at the top) recorded the digests as pending,
    moved the files, then made them current; stopped in between, the next open settles the record."""
    files = EncoderFiles(tmp_path, store)
    save_encoder(trained(), tmp_path, "encoder")
    record = {"current": {n: sha256_file(tmp_path / n) for n in ("encoder.json", "encoder.safetensors")}}
    record["pending"] = None
    store.set_meta(ENCODER_FILES_META, {"current": {}, "pending": record["current"]})  # stopped before current
    assert files.load("encoder", "cpu").trained  # pending digests are accepted before settling
    files.settle()
    assert store.get_meta(ENCODER_FILES_META) == record
    store.set_meta(ENCODER_FILES_META, {"current": record["current"], "pending": {"encoder.json": "0" * 64}})
    files.settle()  # the files are the current ones: pending is dropped
    assert store.get_meta(ENCODER_FILES_META) == record
    neither = {"current": {"encoder.json": "1" * 64}, "pending": {"encoder.json": "0" * 64}}
    store.set_meta(ENCODER_FILES_META, neither)
    files.settle()  # the files match neither: the record is left as it is
    assert store.get_meta(ENCODER_FILES_META) == neither
    generation = {**record_of(record["current"], 1), "pending": {"encoder.json": "0" * 64}}
    store.set_meta(ENCODER_FILES_META, generation)
    files.settle()  # a record of generations is not the older save's: left alone
    assert store.get_meta(ENCODER_FILES_META) == generation


def test_encoder_files_in_memory_write_nothing(tmp_path: Path) -> None:
    store = Store(None, "cpu")
    try:
        files = EncoderFiles(None, store)
        files.settle()
        assert not files.has("encoder") and files.record() == {}
        with pytest.raises(InvalidArgumentError, match="memory"):
            files.current_dir()
        with pytest.raises(InvalidArgumentError, match="memory"):
            files.load("encoder", "cpu")
        with pytest.raises(InvalidArgumentError, match="memory"):
            files.load_generation(1, {}, "encoder", "cpu")
        assert store.get_meta(ENCODER_FILES_META) is None
    finally:
        store.close()
    db = kvsearch.Database(None, encoder=trained())  # a database in memory has generations, and no folder
    try:
        db.add(["a", "b"], ["c", "d"])
        with torch.no_grad():
            db.encoder.embedding.weight.add_(0.5)
        db.save_encoders()
        assert db.generation == 2 and db.previous_generation is None
    finally:
        db.close()
