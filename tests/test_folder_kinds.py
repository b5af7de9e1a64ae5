"""One folder, one kind, and someone else's folder left alone (reliability round 3, issue 25).

A plain database and a sharded one are never made on top of each other: ``ShardedDatabase`` on a plain database's
folder and ``Database`` on a sharded root raise :class:`kvsearch.WrongKindError` naming what is there and how to open
it, with or without an encoder, options or ``num_shards``, and the records already there stay. A new database is
made only in an absent or empty folder outside other databases: a folder of someone else's files raises
:class:`kvsearch.ForeignFolderError` naming them, and not one file is added, changed or removed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch import ForeignFolderError, InvalidArgumentError, MissingFileError, WrongKindError
from kvsearch.cli.program import main
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.layout import MAX_SHARDS, shard_dir

KEYS = ["Zhang", "Lipton", "Li", "Smola", "Hu", "Werness"]
VALUES = ["Aston", "Zachary", "Mu", "Alex", "Rachel", "Brent"]


def encoder() -> kvsearch.NgramEncoder:
    return kvsearch.NgramEncoder(dim=32, num_buckets=512)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> SHA-256 of its bytes), and every folder (-> "dir")."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def plain(tmp_path) -> Path:
    path = tmp_path / "plain"
    with kvsearch.Database(path, encoder=encoder()) as db:
        db.add(KEYS, VALUES)
    return path


@pytest.fixture
def sharded(tmp_path) -> Path:
    path = tmp_path / "sharded"
    with ShardedDatabase(path, num_shards=4, encoder=encoder()) as db:
        db.add(KEYS, VALUES)
    return path


# ----------------------------------------------------------------------------- one folder, one kind

SHARDED_ON_PLAIN = {
    "create with an encoder": lambda: {"num_shards": 4, "encoder": encoder()},
    "create with dims": lambda: {"num_shards": 2, "dim": 32, "value_dim": 32},
    "create bare": lambda: {"num_shards": 4},
    "reopen": lambda: {},
    "reopen with options": lambda: {"index": "Flat", "score": "cosine"},
}


@pytest.mark.parametrize("given", SHARDED_ON_PLAIN, ids=list(SHARDED_ON_PLAIN))
def test_a_sharded_database_on_a_plain_folder_is_refused(plain, given):
    before = snapshot(plain)
    with pytest.raises(WrongKindError) as raised:
        ShardedDatabase(plain, **SHARDED_ON_PLAIN[given]())
    message = str(raised.value)
    assert "plain database" in message and f"kvsearch.Database('{plain}')" in message and "reshard" in message
    assert snapshot(plain) == before  # no shards.json, no shard folder, the store untouched
    with kvsearch.Database(plain) as db:
        assert len(db) == len(KEYS) and db.lookup("Li") == "Mu"


PLAIN_ON_SHARDED = {
    "with an encoder": lambda: {"encoder": encoder()},
    "with dims": lambda: {"dim": 32, "value_dim": 32},
    "bare": lambda: {},
    "read-only": lambda: {"read_only": True},
}


@pytest.mark.parametrize("given", PLAIN_ON_SHARDED, ids=list(PLAIN_ON_SHARDED))
def test_a_plain_database_on_a_sharded_root_is_refused(sharded, given):
    before = snapshot(sharded)
    with pytest.raises(WrongKindError) as raised:
        kvsearch.Database(sharded, **PLAIN_ON_SHARDED[given]())
    message = str(raised.value)
    assert "sharded database (4 shards" in message and f"ShardedDatabase('{sharded}')" in message
    assert "encoder" not in message  # not the misleading "expected an encoder or an explicit dim"
    assert snapshot(sharded) == before  # no store.sqlite at the root
    with ShardedDatabase(sharded) as db:
        assert len(db) == len(KEYS) and db.lookup("Li") == "Mu"


def test_a_plain_database_on_an_unfinished_sharded_root_is_refused(tmp_path):
    """Shard folders without shards.json (a sharded creation that stopped) are not an empty folder."""
    root = tmp_path / "unfinished"
    with kvsearch.Database(shard_dir(root, 0), dim=8, value_dim=8):
        pass  # (a shard made by hand: allowed where no sharded root says otherwise)
    with pytest.raises(WrongKindError, match="creation did not finish"):
        kvsearch.Database(root, dim=8, value_dim=8)
    assert not (root / "store.sqlite").exists()


@pytest.mark.parametrize("outer", ["plain", "sharded"])
@pytest.mark.parametrize("inner", ["new", "beyond the shard count"])
def test_a_new_database_inside_another_one_is_refused(plain, sharded, outer, inner):
    root = plain if outer == "plain" else sharded
    path = root / "inner" if inner == "new" else shard_dir(root, 7)
    before = snapshot(root)
    with pytest.raises(WrongKindError, match="inside the"):
        kvsearch.Database(path, dim=8, value_dim=8)
    with pytest.raises(WrongKindError):
        ShardedDatabase(path / "deeper", num_shards=2, dim=8, value_dim=8)
    assert snapshot(root) == before


def test_an_existing_database_inside_a_folder_of_other_files_still_opens(plain):
    """Files a user puts beside an existing database later do not stop it from opening."""
    (plain / "notes.txt").write_text("mine")
    with kvsearch.Database(plain) as db:
        assert db.lookup("Lipton") == "Zachary"
    assert (plain / "notes.txt").read_text() == "mine"


def test_a_missing_shard_is_reported_not_made_anew(sharded):
    import shutil

    shutil.rmtree(shard_dir(sharded, 2))
    before = snapshot(sharded)
    with pytest.raises(MissingFileError, match="shard-0002"):
        ShardedDatabase(sharded)
    assert snapshot(sharded) == before


@pytest.mark.parametrize("count", [0, -1, True, 1.5, "4", MAX_SHARDS + 1])
def test_a_bad_shard_count_is_refused_before_anything_is_written(tmp_path, count):
    path = tmp_path / "bad"
    with pytest.raises(InvalidArgumentError, match="num_shards"):
        ShardedDatabase(path, num_shards=count, dim=8, value_dim=8)
    assert not path.exists()


@pytest.mark.parametrize("path", [None, "", "a\x00b", 5])
def test_a_sharded_database_needs_a_folder_path(path):
    with pytest.raises(InvalidArgumentError, match="folder path"):
        ShardedDatabase(path, num_shards=2, dim=8, value_dim=8)


def test_the_largest_shard_count_is_a_count_a_normal_machine_opens():
    """The cap is where one process serving every shard stays within common open-file limits (see its docstring)."""
    assert 64 <= MAX_SHARDS <= 4096
    assert kvsearch.checks.FILES_PER_DATABASE * MAX_SHARDS <= 65536


# ----------------------------------------------------------------------------- someone else's folder


def users_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    (folder / "raw").mkdir(parents=True)
    (folder / "README.txt").write_text("my notes\n")
    (folder / "data.csv").write_text("key,value\nLi,Mu\n")
    (folder / "raw" / "part-0.bin").write_bytes(bytes(range(256)))
    return folder


MAKERS = {
    "Database with an encoder": lambda p: kvsearch.Database(p, encoder=encoder()),
    "Database with dims": lambda p: kvsearch.Database(p, dim=8, value_dim=8),
    "ShardedDatabase": lambda p: ShardedDatabase(p, num_shards=2, encoder=encoder()),
}


@pytest.mark.parametrize("maker", MAKERS, ids=list(MAKERS))
def test_someone_elses_folder_is_left_alone(tmp_path, maker):
    folder = users_folder(tmp_path)
    before = snapshot(folder)
    with pytest.raises(ForeignFolderError) as raised:
        MAKERS[maker](folder)
    message = str(raised.value)
    assert "README.txt" in message and "data.csv" in message and "raw" in message
    assert snapshot(folder) == before  # no store, no lock, no generations among them


def test_many_foreign_files_are_counted_not_listed(tmp_path):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(12):
        (folder / f"file{i:02d}.txt").write_text("x")
    with pytest.raises(ForeignFolderError, match="and 7 more"):
        kvsearch.Database(folder, dim=8, value_dim=8)


@pytest.mark.parametrize("marks", [[], [".DS_Store"], [".gitkeep", "Thumbs.db"]])
def test_an_empty_folder_and_its_placeholder_marks_take_a_new_database(tmp_path, marks):
    folder = tmp_path / "empty"
    folder.mkdir()
    for name in marks:
        (folder / name).write_text("")
    with kvsearch.Database(folder, encoder=encoder()) as db:
        db.add(KEYS, VALUES)
    with kvsearch.Database(folder) as db:
        assert db.lookup("Li") == "Mu"
    for name in marks:
        assert (folder / name).read_text() == ""


def test_the_cli_refuses_someone_elses_folder_and_tells_the_kind(tmp_path, plain, sharded, capsys):
    folder = users_folder(tmp_path)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("key,value\nLi,Mu\n")
    before = snapshot(folder)
    assert main(["build", str(folder), "--from", str(pairs), "--key", "key", "--value", "value", "--quiet"]) == 1
    assert "README.txt" in capsys.readouterr().err
    assert snapshot(folder) == before
    assert main(["info", str(plain)]) == 0
    assert "kind           a database (kvsearch.Database)" in capsys.readouterr().out
    assert main(["info", str(sharded)]) == 0
    assert "a sharded database (kvsearch.distributed.ShardedDatabase)" in capsys.readouterr().out


def test_embeddings_only_database_in_an_empty_folder_round_trips(tmp_path):
    """The refusals do not get in the way of the plain path: keys and values given as embeddings, reopened."""
    torch.manual_seed(0)
    keys, values = torch.randn(5, 8), torch.randn(5, 4)
    with kvsearch.Database(tmp_path / "vectors", dim=8, value_dim=4) as db:
        ids = db.add(keys=keys, values=values)
    with kvsearch.Database(tmp_path / "vectors") as db:
        assert db.search(keys[2], k=1)[0].id == int(ids[2])
