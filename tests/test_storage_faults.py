"""Reliability, round 2: full disks, read-only folders, and damage done to a database folder from outside.

Each fault is tested twice where it can be: for real — a 3 MB tmpfs that fills up, a tmpfs remounted read-only
(only where this process may mount: root on Linux; skipped elsewhere with the reason) — and portably, by making
the boundary fail as the file system would: SQLite's connections (``sqlite3.connect`` with a connection class
whose COMMIT answers "database or disk is full"), ``numpy.savez`` raising ``ENOSPC``, ``os.access`` saying the
folder cannot be written.

1. A full disk gives :class:`~kvsearch.errors.DiskFullError` naming the cause and the path; the write is rolled
   back (the build's whole ingest too), no temporary file stays behind, the database opens with what was
   committed before.
2. A read-only database (asked for, or a folder that cannot be written) opens for reading, warns once when it was
   not asked for, refuses writes with :class:`~kvsearch.errors.ReadOnlyDatabaseError`, and never says "corrupt".
3. A deleted ``encoder.json`` is rewritten from the encoder passed in when its digest is the one the store
   records, else a typed error says how to restore it.
4. ``store.sqlite`` deleted or replaced while open: writes are refused; a folder with kvsearch files but no store
   is never given a fresh empty one.
5. Every file and folder kvsearch writes follows the process umask.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsearch
from kvsearch import CorruptDatabaseError, DiskFullError, KVSearchError, MissingFileError, ReadOnlyDatabaseError
from kvsearch.cli.program import main
from kvsearch.errors import StoreChangedError
from kvsearch.storage.encoder_files import current_generation_dir

DIM = 16
REAL_CONNECT = sqlite3.connect


def small_encoder() -> kvsearch.NgramEncoder:
    return kvsearch.NgramEncoder(dim=DIM, num_buckets=512)


def keys_values(n: int, prefix: str = "k") -> tuple[list[str], list[str]]:
    return [f"{prefix}{i}" for i in range(n)], [f"value {i}" for i in range(n)]


#: SQLite's own files beside the store: made by any connection (a read-only one too), removed by the last writer.
SQLITE_OWN = ("store.sqlite-wal", "store.sqlite-shm")


def digests(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under ``folder`` (SQLite's WAL and shared memory aside)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in SQLITE_OWN
    }


def names(folder: Path) -> list[str]:
    """Every file and folder under ``folder`` (SQLite's WAL and shared memory aside)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name not in SQLITE_OWN)


def write_csv(path: Path, n: int, prefix: str) -> Path:
    path.write_text("key,value\n" + "".join(f"{prefix}{i},value number {i} of {prefix}\n" for i in range(n)))
    return path


# ---------------------------------------------------------------------- real file systems (root on Linux only)


def mount_tmpfs(where: Path, size: str) -> None:
    """Mount a tmpfs of ``size`` at ``where``, or skip the test saying why it cannot be done here."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root on Linux (the portable tests cover the same logic)")
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


def unmount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_read_only(where: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount the tmpfs read-only: {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "3m")
    yield disk
    unmount(disk)


@pytest.fixture
def ro_disk(tmp_path):
    """A tmpfs that the test fills, then remounts read-only (``remount_read_only``)."""
    disk = tmp_path / "ro"
    mount_tmpfs(disk, "16m")
    yield disk
    unmount(disk)


# ---------------------------------------------------------------------- portable fault injection at the boundary


class FullDiskConnection(sqlite3.Connection):
    """A SQLite connection whose COMMIT of a write fails as on a full disk once ``fail_after`` writes committed.

    The failing COMMIT leaves the transaction open, as SQLite may do; a real full disk may instead roll it back
    itself (the tmpfs tests cover that case).
    """

    fail_after: int | None = None  # commits of writes still allowed; None: never fail
    failures = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.wrote = False

    def execute(self, sql, *args):
        verb = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
        if verb in ("INSERT", "UPDATE", "DELETE"):
            self.wrote = True
        if verb == "BEGIN":
            self.wrote = False
        if verb == "COMMIT" and self.wrote and FullDiskConnection.fail_after is not None:
            if FullDiskConnection.fail_after <= 0:
                FullDiskConnection.failures += 1
                raise sqlite3.OperationalError("database or disk is full")
            FullDiskConnection.fail_after -= 1
        return super().execute(sql, *args)

    def executemany(self, sql, *args):
        self.wrote = True
        return super().executemany(sql, *args)


@pytest.fixture
def full_disk(monkeypatch):
    """``arm(n)``: the (n+1)-th commit of a write from now on fails with SQLite's "database or disk is full"."""

    def connect(*args, **kwargs):
        kwargs.setdefault("factory", FullDiskConnection)
        return REAL_CONNECT(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    FullDiskConnection.fail_after, FullDiskConnection.failures = None, 0

    def arm(n: int | None) -> None:
        FullDiskConnection.fail_after = n

    yield arm
    FullDiskConnection.fail_after = None


# ---------------------------------------------------------------------- 1. a full disk


def test_an_add_on_a_full_disk_raises_disk_full_and_rolls_back(tmp_path, full_disk):
    folder = tmp_path / "db"
    db = kvsearch.Database(folder, encoder=small_encoder())
    db.add(*keys_values(20))
    version = db.store.version
    full_disk(0)
    with pytest.raises(DiskFullError) as info:
        db.add(*keys_values(10, "new"))
    message = str(info.value)
    assert "no space left" in message and str(folder) in message and "database or disk is full" in message
    assert isinstance(info.value, KVSearchError) and isinstance(info.value, OSError)
    assert len(db) == 20 and "new0" not in db and db.store.version == version and db.index.ntotal == 20
    full_disk(None)  # space again: the connection is usable, nothing was left half done
    db.add(*keys_values(5, "later"))
    db.close()
    with kvsearch.Database(folder) as again:
        assert len(again) == 25 and "later4" in again and "new0" not in again


def test_atomic_keeps_every_write_of_a_block_or_none(tmp_path, full_disk):
    """What the build relies on: one transaction for many batches; a failure rolls back the store, the in-memory
    tensors and the index, and a full disk at the commit is typed."""
    db = kvsearch.Database(tmp_path / "db", encoder=small_encoder(), index="HNSW16")
    db.add(*keys_values(20))
    version, keys = db.store.version, db.store.table.keys.clone()
    with pytest.raises(RuntimeError, match="stop"):
        with db.atomic():
            db.add(*keys_values(10, "new"))
            db.delete("k3")
            assert len(db) == 29
            raise RuntimeError("stop")
    assert len(db) == 20 and "k3" in db and "new0" not in db and db.store.version == version
    assert db.index.ntotal == 20 and torch.equal(db.store.table.keys, keys)
    full_disk(0)
    with pytest.raises(DiskFullError, match="no space left"):
        with db.atomic():
            db.add(*keys_values(10, "new"))
            db.add(*keys_values(10, "more"))
    assert len(db) == 20 and "new0" not in db and db.index.ntotal == 20
    full_disk(None)
    with db.atomic():
        db.add(*keys_values(10, "new"))
        db.add(*keys_values(10, "more"))
    assert len(db) == 40 and db.store.version == version + 2
    db.close()


def test_the_build_command_undoes_its_whole_ingest_when_the_disk_fills(tmp_path, full_disk, capsys):
    folder = tmp_path / "db"
    assert main(["build", str(folder), "--from", str(write_csv(tmp_path / "a.csv", 100, "a")), "--quiet"]) == 0
    before = names(folder)
    full_disk(0)  # the build's commit fails
    big = write_csv(tmp_path / "b.csv", 1000, "b")
    capsys.readouterr()
    assert main(["build", str(folder), "--from", str(big), "--batch-size", "100", "--quiet"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvsearch build: error: no space left") and str(folder) in line, line
    assert "rollback" not in line  # the cause, not a failed clean-up
    full_disk(None)
    assert names(folder) == before  # no temporary or stray file
    with kvsearch.Database(folder) as db:
        assert len(db) == 100 and "b0" not in db and "a99" in db


def test_the_build_command_on_a_real_full_disk(small_disk, capsys):
    folder = small_disk / "db"
    source = write_csv(small_disk.parent / "a.csv", 100, "a")
    assert main(["build", str(folder), "--from", str(source), "--quiet"]) == 0
    big = write_csv(small_disk.parent / "b.csv", 5000, "b")
    capsys.readouterr()
    assert main(["build", str(folder), "--from", str(big), "--batch-size", "100", "--quiet"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvsearch build: error: no space left") and str(folder) in line, line
    with kvsearch.Database(folder) as db:  # the undo was done: only what the first build committed
        assert len(db) == 100 and "b0" not in db and db.lookup("a7") == "value number 7 of a"
    assert not [p for p in folder.iterdir() if p.name.endswith((".tmp", ".npz.npz"))]


def test_adds_on_a_real_full_disk_keep_what_was_committed(small_disk):
    folder = small_disk / "db"
    db = kvsearch.Database(folder, encoder=kvsearch.NgramEncoder(), index="HNSW16")
    committed = 0
    with pytest.raises(DiskFullError, match="no space left") as info:
        for batch in range(100):
            db.add(*keys_values(100, f"b{batch}_"))
            committed += 100
    assert str(folder) in str(info.value)
    assert len(db) == committed > 0
    with pytest.raises(DiskFullError, match=r"no space left.*index\.npz"):
        db.close()  # the HNSW index cannot be saved either: a typed error, and no stray file
    assert not [p for p in folder.iterdir() if p.name.endswith((".tmp", ".npz.npz"))]
    with kvsearch.Database(folder, read_only=True) as again:
        assert len(again) == committed and again.lookup(f"b0_{7}") == "value 7"


def test_an_index_save_on_a_full_disk_is_typed_and_leaves_no_file(tmp_path, monkeypatch):
    folder = tmp_path / "db"
    db = kvsearch.Database(folder, encoder=small_encoder(), index="HNSW16")
    db.add(*keys_values(50))
    before = names(folder)

    def savez(file, *args, **kwargs):  # a few bytes reach the disk, then it is full
        handle = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
        handle.write(b"PK\x03\x04 partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", savez)
    with pytest.raises(DiskFullError, match=r"no space left.*index\.npz") as info:
        db.close()
    assert info.value.__cause__ is None and info.value.__suppress_context__  # one error, not a chain of four
    assert names(folder) == before  # no index.npz.npz, no temporary file, no manifest
    monkeypatch.undo()
    with kvsearch.Database(folder) as again:  # rebuilt from the store
        assert len(again) == 50 and again.search("k7", k=1)[0].key == "k7"


# ---------------------------------------------------------------------- 2. read-only folders


def saved_hnsw(folder: Path, n: int = 60) -> None:
    with kvsearch.Database(folder, encoder=small_encoder(), index="HNSW16") as db:
        db.add(*keys_values(n))


def test_read_only_when_asked_reads_and_refuses_writes_without_touching_a_file(tmp_path):
    folder = tmp_path / "db"
    saved_hnsw(folder)
    (folder / "write.lock").unlink()
    (folder / "manifest.json").unlink()  # the index is rebuilt at open: a writer would save it on close
    before = digests(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        db = kvsearch.Database(folder, read_only=True)
    assert db.read_only
    assert db.search("k7", k=1)[0].key == "k7" and db.lookup("k3") == "value 3" and len(db) == 60
    for write in (lambda: db.add(["new"], ["x"]), lambda: db.delete("k1"), db.save, db.refresh):
        with pytest.raises(ReadOnlyDatabaseError, match="read-only") as info:
            write()
        assert "corrupt" not in str(info.value).lower()
    db.close()
    assert digests(folder) == before  # nothing written: no index saved on close, no lock file made


def test_read_only_needs_an_existing_database(tmp_path):
    with pytest.raises(kvsearch.InvalidArgumentError, match="read_only"):
        kvsearch.Database(tmp_path / "nothing", encoder=small_encoder(), read_only=True)
    assert not (tmp_path / "nothing").exists()


def test_a_folder_that_cannot_be_written_opens_read_only_with_one_warning(tmp_path, monkeypatch):
    folder = tmp_path / "db"
    saved_hnsw(folder)
    before = digests(folder)
    real_access = os.access

    def access(path, mode, *args, **kwargs):  # as on a read-only mount, whoever we are
        if mode & os.W_OK and Path(path).resolve().is_relative_to(folder.resolve()):
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    with pytest.warns(RuntimeWarning, match="read-only") as caught:
        db = kvsearch.Database(folder)
        assert db.search("k7", k=1)[0].key == "k7" and len(db) == 60
    assert len([w for w in caught if "read-only" in str(w.message)]) == 1
    with pytest.raises(ReadOnlyDatabaseError, match=f"{folder}.*cannot be written"):
        db.add(["new"], ["x"])
    db.close()
    assert digests(folder) == before


def test_a_read_only_file_system(ro_disk, capsys):
    folder = ro_disk / "db"
    saved_hnsw(folder)
    remount_read_only(ro_disk)
    with pytest.warns(RuntimeWarning, match="read-only") as caught:
        db = kvsearch.Database(folder)
    assert len([w for w in caught if "read-only" in str(w.message)]) == 1
    assert db.read_only and db.search("k9", k=1)[0].key == "k9"
    with pytest.raises(ReadOnlyDatabaseError, match="read-only file system") as info:
        db.add(["new"], ["x"])
    assert "corrupt" not in str(info.value).lower()
    db.close()
    with kvsearch.Database(folder, read_only=True) as again:
        assert len(again) == 60
    capsys.readouterr()
    assert main(["query", str(folder), "k5", "--k", "1", "--json"]) == 0
    assert '"k5"' in capsys.readouterr().out
    assert main(["info", str(folder), "--json"]) == 0
    out = capsys.readouterr()
    assert '"records": 60' in out.out and "corrupt" not in out.err.lower()
    assert main(["delete", str(folder), "k5"]) == 1
    assert "read-only" in capsys.readouterr().err


# ---------------------------------------------------------------------- 3. encoder.json deleted


def test_a_deleted_encoder_json_is_rewritten_from_the_same_encoder(tmp_path):
    folder = tmp_path / "db"
    with kvsearch.Database(folder, encoder=small_encoder()) as db:
        db.add(*keys_values(30))
    config = current_generation_dir(folder) / "encoder.json"
    original = config.read_bytes()
    config.unlink()
    with pytest.warns(RuntimeWarning, match="encoder.json") as caught:
        db = kvsearch.Database(folder, encoder=small_encoder())
    assert len([w for w in caught if "encoder.json" in str(w.message)]) == 1
    assert config.read_bytes() == original
    assert db.search("k12", k=1)[0].key == "k12"
    db.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvsearch.Database(folder).close()  # whole again: no warning, no encoder needed


def test_a_deleted_encoder_json_of_a_trained_encoder_is_rewritten(tmp_path):
    folder = tmp_path / "db"
    encoder = small_encoder()
    with torch.no_grad():
        next(encoder.parameters()).add_(0.01)
    with kvsearch.Database(folder, encoder=encoder) as db:
        db.add(*keys_values(30))
    current = current_generation_dir(folder)
    assert (current / "encoder.safetensors").is_file()
    original = (current / "encoder.json").read_bytes()
    (current / "encoder.json").unlink()
    with pytest.warns(RuntimeWarning, match="encoder.json"):
        db = kvsearch.Database(folder, encoder=small_encoder())  # the untrained config: weights come from the file
    assert (current / "encoder.json").read_bytes() == original
    assert db.search("k3", k=1)[0].key == "k3"
    torch.testing.assert_close(next(db.encoder.parameters()), next(encoder.parameters()))
    db.close()


@pytest.mark.parametrize("given", [None, "other"])
def test_a_deleted_encoder_json_without_the_same_encoder_says_how_to_restore_it(tmp_path, given):
    folder = tmp_path / "db"
    with kvsearch.Database(folder, encoder=small_encoder()) as db:
        db.add(*keys_values(30))
    config = current_generation_dir(folder) / "encoder.json"
    config.unlink()
    before = digests(folder)
    encoder = None if given is None else kvsearch.NgramEncoder(dim=DIM, num_buckets=256)
    with pytest.raises(MissingFileError) as info:
        kvsearch.Database(folder, encoder=encoder)
    message = str(info.value)
    assert isinstance(info.value, CorruptDatabaseError)
    assert f"{config} is missing" in message and "encoder=" in message, message
    if given is not None:
        assert "does not match" in message
    assert digests(folder) == before and not config.exists()


# ---------------------------------------------------------------------- 4. store.sqlite deleted or replaced


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_store_deleted_or_replaced_while_open_refuses_writes(tmp_path, how):
    folder = tmp_path / "db"
    db = kvsearch.Database(folder, encoder=small_encoder(), index="HNSW16")
    db.add(*keys_values(40))
    store = folder / "store.sqlite"
    if how == "deleted":
        for path in folder.glob("store.sqlite*"):
            path.unlink()
    else:
        other = tmp_path / "other"
        with kvsearch.Database(other, encoder=small_encoder()) as second:
            second.add(*keys_values(3, "x"))
        os.replace(other / "store.sqlite", store)
    with pytest.raises(StoreChangedError, match=f"{how}") as info:
        db.add(["acknowledged?"], ["no"])
    assert str(store) in str(info.value)
    with pytest.raises(StoreChangedError):
        db.search("k1", k=1)
    with pytest.raises(StoreChangedError):
        db.close()  # nothing saved beside a store that is not this one
    assert not (folder / "index.npz").exists()
    if how == "deleted":
        with pytest.raises(MissingFileError, match="store.sqlite is missing"):
            kvsearch.Database(folder, encoder=small_encoder())
        assert not store.exists()  # no fresh empty store beside the leftover files


def test_a_folder_with_kvsearch_files_but_no_store_is_not_given_a_new_one(tmp_path, capsys):
    folder = tmp_path / "db"
    saved_hnsw(folder)
    (folder / "store.sqlite").unlink()
    before = digests(folder)
    with pytest.raises(MissingFileError, match="store.sqlite is missing") as info:
        kvsearch.Database(folder, encoder=small_encoder())
    assert "generations" in str(info.value)
    assert digests(folder) == before
    source = write_csv(tmp_path / "a.csv", 5, "a")
    assert main(["build", str(folder), "--from", str(source), "--quiet"]) == 1
    assert "store.sqlite is missing" in capsys.readouterr().err
    assert digests(folder) == before  # the build's undo removed nothing that was there
    assert main(["info", str(folder)]) == 1
    assert "store.sqlite is missing" in capsys.readouterr().err


# ---------------------------------------------------------------------- 5. file modes follow the umask


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_every_file_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        folder = tmp_path / "db"
        encoder = small_encoder()
        with torch.no_grad():
            next(encoder.parameters()).add_(0.01)  # trained: encoder.safetensors too
        with kvsearch.Database(folder, encoder=encoder, index="HNSW16") as db:
            db.add(*keys_values(30))
    finally:
        os.umask(old)
    modes = {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*")}
    assert any(name.endswith("encoder.safetensors") for name in modes) and "index.npz" in modes
    for name, mode in modes.items():
        expected = (0o777 if (folder / name).is_dir() else 0o666) & ~umask
        assert mode == expected, f"{name}: {oct(mode)}, expected {oct(expected)}"
