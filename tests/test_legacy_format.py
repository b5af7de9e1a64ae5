"""Stores written by the earlier format (every embedding in its records row, tests/data/make_legacy_stores.py) open
with every record as that version read it back: moved to chunks when the folder can be written, read as they are
when it cannot."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsearch

LEGACY = Path(__file__).resolve().parent / "data" / "legacy"
STORES = ["texts", "embeddings", "unnormalised_keys"]


def expected(name: str) -> dict[int, dict]:
    """id -> the record as the earlier version read it back, embeddings decoded."""
    out = {}
    for r in json.loads((LEGACY / name / "expected.json").read_text())["records"]:
        r["key_embedding"] = np.frombuffer(bytes.fromhex(r["key_embedding"]), dtype=np.float32)
        r["value_embedding"] = np.frombuffer(bytes.fromhex(r["value_embedding"]), dtype=np.float32)
        out[r["id"]] = r
    return out


def check_records(db: kvsearch.Database, want: dict[int, dict]) -> None:
    assert db.ids().tolist() == sorted(want) and len(db) == len(want)
    for id_, r in want.items():
        got = db.get(id_)
        assert (got.key, got.value, got.metadata) == (r["key"], r["value"], r["metadata"])
        assert np.array_equal(got.key_embedding.numpy(), r["key_embedding"])  # bit for bit
        assert np.array_equal(got.value_embedding.numpy(), r["value_embedding"])
    keys = np.stack([r["key_embedding"] for r in want.values()])  # (n, dim) in id order
    probes = torch.from_numpy(keys[[0, len(keys) // 2, -1]] + 0.01)  # (3, dim)
    hits = db.search(probes, k=1)
    reference = db.score  # the stored score: compare with a brute force over the expected embeddings
    assert reference in ("cosine", "dot")
    normed = keys / np.linalg.norm(keys, axis=1, keepdims=True) if reference == "cosine" else keys
    queries = probes.numpy()
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True) if reference == "cosine" else queries
    best = np.array(sorted(want))[(queries @ normed.T).argmax(axis=1)]
    assert [row[0].id for row in hits] == best.tolist()
    assert [row[0].metadata for row in hits] == [want[i]["metadata"] for i in best.tolist()]


def columns(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path / "store.sqlite")) as conn:
        return {row[1] for row in conn.execute("PRAGMA table_info(records)")}


def indexes(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path / "store.sqlite")) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}


@pytest.mark.filterwarnings("ignore:kvsearch.*equal after normalisation:RuntimeWarning")
@pytest.mark.parametrize("name", STORES)
def test_an_earlier_store_is_moved_to_chunks_with_every_record_kept(tmp_path, name):
    path = tmp_path / name
    shutil.copytree(LEGACY / name, path)
    assert "key_emb" in columns(path)
    want = expected(name)
    with kvsearch.Database(path) as db:
        check_records(db, want)
        added = db.add(torch.ones(1, db.dim), torch.ones(1, db.value_dim)) if db.encoder is None else None
        if added is None:
            added = db.add(["a new key"], ["a new value"])
        assert added[0] > max(want)  # ids go on after the earlier version's, never reused
    assert "key_emb" not in columns(path) and "slot" in columns(path)  # one copy of each embedding
    assert "records_with_metadata" in indexes(path)  # made again on the moved table: searches read metadata by it
    with kvsearch.Database(path) as again:
        assert len(again) == len(want) + 1
        again.delete(added)
        check_records(again, want)


@pytest.mark.filterwarnings("ignore:kvsearch.*equal after normalisation:RuntimeWarning")
@pytest.mark.parametrize("name", STORES)
def test_an_earlier_store_opened_read_only_is_read_as_it_is(tmp_path, name):
    path = tmp_path / name
    shutil.copytree(LEGACY / name, path)
    before = (path / "store.sqlite").read_bytes()
    with kvsearch.Database(path, read_only=True) as db:
        check_records(db, expected(name))
        with pytest.raises(kvsearch.ReadOnlyDatabaseError):
            db.delete(db.ids()[:1].tolist())
    assert (path / "store.sqlite").read_bytes() == before and "key_emb" in columns(path)


def test_a_reader_of_the_earlier_format_follows_the_move_made_by_a_writer(tmp_path):
    path = tmp_path / "texts"
    shutil.copytree(LEGACY / "texts", path)
    want = expected("texts")
    reader = kvsearch.Database(path, read_only=True)
    check_records(reader, want)
    writer = kvsearch.Database(path)  # moves the store to chunks
    check_records(reader, want)  # nothing changed for the reader: it reads the moved store
    writer.delete(["Li"])
    del want[1]
    check_records(reader, want)  # and catches up on the delete
    writer.close()
    reader.close()
