"""Requirement 2, corrupt or foreign files: a clear error or a rebuild from the store, never a crash, never an
empty or stale index served as if it were right, and never a pickle loaded.

Each damage (truncated, zeroed, garbage, empty, a pickle payload, an older copy) is applied to each file of
a saved database; reopening must either rebuild the derived file from the store (index, manifest) or raise
CorruptDatabaseError (the store itself, the current generation's encoder files). A pickle payload whose
unpickling would create a marker file is planted wherever a file is read: the marker must never appear.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import sqlite3
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsearch
from kvsearch import CorruptDatabaseError
from kvsearch.storage.encoder_files import current_generation_dir
from kvsearch.storage.folder import GENERATIONS_DIR

DIM = 16


class Payload:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickle_bytes(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def npz_with_pickle(marker: Path) -> bytes:
    """An .npz whose arrays are object arrays (numpy stores those with pickle)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in ("faiss", "labels", "dead", "fallback"):
            arr = np.empty(1, dtype=object)
            arr[0] = Payload(marker)
            inner = io.BytesIO()
            np.save(inner, arr, allow_pickle=True)
            z.writestr(f"{name}.npy", inner.getvalue())
    return buf.getvalue()


def damage(path: Path, kind: str, marker: Path, older: bytes | None = None) -> None:
    data = path.read_bytes()
    rng = np.random.default_rng(len(data))
    out = {
        "truncated": lambda: data[: len(data) // 2],
        "zeroed": lambda: bytes(len(data)),
        "garbage": lambda: rng.integers(0, 256, len(data), dtype=np.uint8).tobytes(),
        "empty": lambda: b"",
        "pickle": lambda: npz_with_pickle(marker) if path.suffix == ".npz" else pickle_bytes(marker),
        "one byte flipped": lambda: data[:-40] + bytes([data[-40] ^ 0xFF]) + data[-39:],
        "older copy": lambda: older,
    }[kind]()
    path.write_bytes(out)


def build(folder: Path, index: str) -> tuple[np.ndarray, np.ndarray, bytes]:
    """A saved database; returns ids, keys and the bytes of an older saved index file."""
    encoder = kvsearch.NgramEncoder(dim=DIM, num_buckets=512)
    with torch.no_grad():  # "fine-tuned" weights, so that encoder.safetensors is written too
        next(encoder.parameters()).add_(0.01)
    params = {"nprobe": 4} if index.startswith("IVF") else None  # IVF: every list probed, exact
    db = kvsearch.Database(folder, encoder=encoder, index=index, score="dot", search_params=params)
    db.add([f"k{i}" for i in range(150)], [f"v{i}" for i in range(150)])
    db.save()
    older = (folder / "index.npz").read_bytes() if index != "Flat" else b""
    db.add([f"late{i}" for i in range(100)], [f"w{i}" for i in range(100)])
    ids, keys = db.store.table.ids.numpy().copy(), db.store.table.keys.numpy().copy()
    db.close()
    return ids, keys, older


_BUILT: dict[str, tuple[Path, np.ndarray, np.ndarray, bytes]] = {}


@pytest.fixture
def saved(tmp_path_factory, tmp_path):
    """``saved(index)``: a fresh copy (under tmp_path / "db") of a database built once per index type."""

    def copy(index: str) -> tuple[np.ndarray, np.ndarray, bytes]:
        if index not in _BUILT:
            folder = tmp_path_factory.mktemp("built") / "db"
            _BUILT[index] = (folder, *build(folder, index))
        folder, ids, keys, older = _BUILT[index]
        shutil.copytree(folder, tmp_path / "db")
        return ids, keys, older

    return copy


def check_rebuilt(folder: Path, ids: np.ndarray, keys: np.ndarray) -> None:
    """Reopen: the index serves exactly the store, as a brute-force search does."""
    with kvsearch.Database(folder) as db:
        assert len(db) == len(ids) and db.index.ntotal == len(ids)
        assert np.array_equal(db.index.ids(), ids)
        q = np.random.default_rng(1).standard_normal((8, DIM)).astype(np.float32)
        for qv, row in zip(q, db.search(torch.from_numpy(q), k=5)):
            truth = set(ids[np.argsort(-(keys @ qv))[:5]].tolist())
            assert len(truth & {h.id for h in row}) >= 4  # HNSW: approximate; IVF with nprobe=all: exact


KINDS = ["truncated", "zeroed", "garbage", "empty", "pickle", "one byte flipped"]


@pytest.mark.parametrize("index", ["HNSW16", "IVF4,Flat"])
@pytest.mark.parametrize("target", ["index.npz", "manifest.json"])
@pytest.mark.parametrize("kind", KINDS + ["older copy", "deleted"])
def test_damaged_index_files_are_rebuilt_from_the_store(tmp_path, saved, index, target, kind):
    if kind == "older copy" and target != "index.npz":
        pytest.skip("an older copy applies to the index file")
    folder, marker = tmp_path / "db", tmp_path / "PICKLE_RAN"
    ids, keys, older = saved(index)
    if kind == "deleted":
        (folder / target).unlink()
    else:
        damage(folder / target, kind, marker, older)
    check_rebuilt(folder, ids, keys)
    assert not marker.exists(), "a pickle payload was executed"
    check_rebuilt(folder, ids, keys)  # and the rebuilt index, saved at close, loads again


ENCODER_CASES = [(target, kind) for target in ("encoder.json", "encoder.safetensors") for kind in KINDS]


@pytest.mark.parametrize("target,kind", ENCODER_CASES)
def test_damaged_encoder_files_give_a_clear_error(tmp_path, saved, target, kind):
    """Every damage, down to one byte flipped inside the float weights or in a still-valid json, is refused:
    the store records the SHA-256 of each file of the current generation (``generations/<G>/``), and every
    load checks it."""
    folder, marker = tmp_path / "db", tmp_path / "PICKLE_RAN"
    saved("HNSW16")
    current = current_generation_dir(folder)
    assert current.parent == folder / GENERATIONS_DIR and (current / target).is_file()
    damage(current / target, kind, marker)
    with pytest.raises(CorruptDatabaseError, match=f"encoder.*{target.replace('.', '[.]')}") as err:
        kvsearch.Database(folder).close()
    assert "SHA-256" in str(err.value) and "expected" in str(err.value) and "found" in str(err.value)
    assert not marker.exists(), "a pickle payload was executed"


def test_an_encoder_config_changed_by_one_bit_is_refused(tmp_path):
    """'"seed": 0' -> '"seed": 1' is one bit (0x30 -> 0x31) and still a valid config: the encoder's weights come
    from the seed when it was never trained, so without a check the database would open and encode queries
    unlike its stored keys. The recorded SHA-256 of the current generation's encoder.json refuses it, naming
    the file."""
    folder = tmp_path / "db"
    keys = [f"key{i}word" for i in range(200)]
    db = kvsearch.Database(folder, encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=512), index="HNSW16")
    db.add(keys, [f"v{i}" for i in range(200)])
    db.close()
    current = current_generation_dir(folder)
    config = current / "encoder.json"
    text = config.read_text()
    assert '"seed": 0' in text and not (current / "encoder.safetensors").exists()
    with kvsearch.Database(folder) as again:  # untouched: opens and finds its keys
        assert [row[0].key for row in again.search(keys[:50], k=1)] == keys[:50]
    config.write_text(text.replace('"seed": 0', '"seed": 1'))
    with pytest.raises(
        CorruptDatabaseError, match=r"encoder file .*encoder\.json.*expected SHA-256 [0-9a-f]{64}"
    ) as err:
        kvsearch.Database(folder)
    assert str(config) in str(err.value)  # the file of the current generation
    config.write_text(text)  # the original bytes open again
    with kvsearch.Database(folder) as again:
        assert [row[0].key for row in again.search(keys[:50], k=1)] == keys[:50]


@pytest.mark.parametrize("kind", ["truncated", "zeroed", "garbage", "empty-header", "pickle"])
def test_damaged_store_gives_a_clear_error(tmp_path, saved, kind):
    folder, marker = tmp_path / "db", tmp_path / "PICKLE_RAN"
    saved("Flat")
    store = folder / "store.sqlite"
    for side in ("store.sqlite-wal", "store.sqlite-shm"):
        (folder / side).unlink(missing_ok=True)
    if kind == "empty-header":
        store.write_bytes(b"SQLite format 3\x00" + bytes(84))
    else:
        damage(store, kind, marker)
    with pytest.raises(CorruptDatabaseError, match="store|SQLite|expected"):
        kvsearch.Database(folder)
    assert not marker.exists()


def test_foreign_folder_files_are_refused(tmp_path):
    folder = tmp_path / "db"
    folder.mkdir()
    (folder / "store.sqlite").write_text("just some text, not a database")
    with pytest.raises(CorruptDatabaseError):
        kvsearch.Database(folder, dim=4, value_dim=4)
    other = tmp_path / "file"
    other.write_text("x")
    with pytest.raises(kvsearch.InvalidArgumentError, match="folder"):
        kvsearch.Database(other, dim=4, value_dim=4)


def test_no_pickle_anywhere_in_the_package():
    """Nothing in kvsearch loads pickles: no pickle / torch.load / allow_pickle=True in the source."""
    package = Path(kvsearch.__file__).parent
    for source in package.glob("*.py"):
        text = source.read_text()
        for banned in ("import pickle", "pickle.load", "torch.load(", "allow_pickle=True", "import dill"):
            assert banned not in text, f"{source.name} uses {banned}"


def test_index_with_wrong_dimension_is_rebuilt(tmp_path, saved):
    folder = tmp_path / "db"
    ids, keys, _ = saved("HNSW16")
    other = tmp_path / "other"
    db = kvsearch.Database(other, dim=DIM * 2, value_dim=4, index="HNSW16")
    db.add(torch.randn(300, DIM * 2), torch.randn(300, 4))
    db.close()
    os.replace(other / "index.npz", folder / "index.npz")  # a foreign index under our manifest
    check_rebuilt(folder, ids, keys)


VECTOR_DAMAGE = {  # SQL run on the store, or (file suffix, what is done to it)
    "the keys file cut short": ("keys", lambda f: os.truncate(f, 100)),
    "the ids file deleted": ("ids", os.unlink),
    "ids zeroed": ("ids", lambda f: f.write_bytes(bytes(f.stat().st_size))),
    "a key changed in the last segment": ("keys", lambda f: _flip(f, f.stat().st_size - 4)),
    "a hole for a stored record": "INSERT INTO vector_holes (slot) VALUES (50)",
    "the committed count lowered": "UPDATE vector_files SET used = used - 1",
    "the file set's state deleted": "DELETE FROM vector_files",
    "a record pointed at another slot": "UPDATE records SET slot = slot + 1 WHERE id = 3",
    "two records' slots swapped": "UPDATE records SET slot = CASE id WHEN 3 THEN 4 ELSE 3 END WHERE id IN (3, 4)",
}


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("kind", list(VECTOR_DAMAGE))
def test_damaged_vector_files_are_refused(tmp_path, kind):
    """The embeddings live once, in the store's file set (kvsearch.storage.vector_file), named by its SQLite state: a
    file cut short or gone, ids that are not the records', a committed segment changed on disk, a state or holes that
    disagree with the records, or records naming other slots are reported as damage at open, never served."""
    folder = tmp_path / "db"
    gen = torch.Generator().manual_seed(0)
    db = kvsearch.Database(folder, dim=DIM, value_dim=3, score="dot")
    db.add(torch.randn(100, DIM, generator=gen), torch.randn(100, 3, generator=gen))
    db.close()
    damage = VECTOR_DAMAGE[kind]
    if isinstance(damage, str):
        with contextlib.closing(sqlite3.connect(folder / "store.sqlite")) as conn, conn:
            assert conn.execute(damage).rowcount >= 1
    else:
        files = sorted(folder.glob(f"store.sqlite.v*.{damage[0]}"))
        assert len(files) == 1
        damage[1](files[0])
    with pytest.raises(CorruptDatabaseError):
        kvsearch.Database(folder)
