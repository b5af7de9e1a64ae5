"""Opening what should exist: ``Database(path, create=False)`` and unpickling (a pickled database or a saved model)
never make a database; a path with none raises ``DatabaseNotFoundError`` naming it and what is there instead, and
nothing is created. A new database without an encoder says the path holds none (most often a mistyped path).

The reference is the file system before the call: the same entries after it.
"""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch import Database, NgramEncoder
from kvsearch.errors import DatabaseNotFoundError, InvalidArgumentError, MissingFileError


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "people"
    with Database(path, encoder=NgramEncoder(dim=16, num_buckets=256), device="cpu") as db:
        db.add(["Li", "Lipton"], ["Mu", "Zachary"])
    return path


def test_an_existing_database_opens(folder: Path) -> None:
    with Database(folder, create=False, device="cpu") as db:
        assert db.lookup("Li") == "Mu" and len(db) == 2


@pytest.mark.parametrize("where", ["absent", "nested absent", "empty", "foreign"])
def test_create_false_never_makes_one(tmp_path: Path, where: str) -> None:
    path = {"absent": tmp_path / "peeple", "nested absent": tmp_path / "a" / "b" / "c"}.get(where, tmp_path / "d")
    if where in ("empty", "foreign"):
        path.mkdir()
    if where == "foreign":
        (path / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(DatabaseNotFoundError, match="create=False") as error:
        Database(path, encoder=NgramEncoder(dim=16), create=False)
    assert str(path) in str(error.value) and tree(tmp_path) == before
    assert isinstance(error.value, FileNotFoundError) and isinstance(error.value, kvsearch.KVSearchError)
    there = {"absent": "no such folder", "nested absent": "nearest existing folder", "empty": "an empty folder"}
    assert there.get(where, "without store.sqlite") in str(error.value)


def test_create_false_in_memory_and_bad_kinds() -> None:
    with pytest.raises(DatabaseNotFoundError, match="in memory"):
        Database(None, dim=4, create=False)
    with pytest.raises(InvalidArgumentError, match="expected create as a bool, got 'no'"):
        Database(None, dim=4, create="no")  # type: ignore[arg-type]


def test_what_is_left_of_a_database_is_still_named_as_such(folder: Path) -> None:
    """A folder whose store is gone: the same MissingFileError a plain open gives (not 'not found')."""
    (folder / "store.sqlite").unlink()
    with pytest.raises(MissingFileError):
        Database(folder, create=False)
    with pytest.raises(MissingFileError):
        Database(folder, encoder=NgramEncoder(dim=16))


def test_a_new_database_without_an_encoder_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "mistyped"
    with pytest.raises(InvalidArgumentError, match="holds none") as error:
        Database(path)
    assert str(path) in str(error.value) and "create=False" in str(error.value)
    assert not path.exists()  # nothing was made
    with pytest.raises(InvalidArgumentError, match="expected an encoder or an explicit dim"):
        Database(None)  # in memory: nothing to name


class Holder(torch.nn.Module):
    """A model that holds a database (a kNN memory, a retriever)."""

    def __init__(self, db: Database) -> None:
        super().__init__()
        self.db = db
        self.proj = torch.nn.Linear(16, 16)


def test_a_moved_folder_is_named_on_unpickling(folder: Path, tmp_path: Path) -> None:
    """pickle and torch.save hold the folder's absolute path: after a move, loading names it; nothing is made."""
    with Database(folder, device="cpu") as db:
        pickled = pickle.dumps(db)
        saved = io.BytesIO()
        torch.save(Holder(db), saved)
    again = pickle.loads(pickled)  # where it was: it opens, with its records
    assert again.lookup("Li") == "Mu"
    again.close()
    shutil.move(folder, tmp_path / "moved")
    before = tree(tmp_path)
    with pytest.raises(DatabaseNotFoundError, match="moved or renamed") as error:
        pickle.loads(pickled)
    assert str(folder) in str(error.value)
    saved.seek(0)
    with pytest.raises(DatabaseNotFoundError, match="moved or renamed"):
        torch.load(saved, weights_only=False)
    assert tree(tmp_path) == before and not folder.exists()
