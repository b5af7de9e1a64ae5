"""Stores of the chunk format (every embedding in SQLite chunk blobs, tests/data/make_chunk_stores.py) open with every
record as that version read it back: moved to a file set when the folder can be written, read as they are when it
cannot, and a reader opened before a writer moved the store follows the move."""

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

STORES = Path(__file__).resolve().parent / "data" / "chunk_format"
NAMES = ["texts", "embeddings"]


def expected(name: str) -> dict[int, dict]:
    """id -> the record as the chunk-format version read it back, embeddings decoded."""
    out = {}
    for r in json.loads((STORES / name / "expected.json").read_text())["records"]:
        r["key_embedding"] = np.frombuffer(bytes.fromhex(r["key_embedding"]), dtype=np.float32)
        r["value_embedding"] = np.frombuffer(bytes.fromhex(r["value_embedding"]), dtype=np.float32)
        out[r["id"]] = r
    return out


def check_records(db: kvsearch.Database, want: dict[int, dict]) -> None:
    """Every record bit for bit, and a search equal to a brute force over the expected embeddings."""
    assert db.ids().tolist() == sorted(want)
    for id_, r in want.items():
        got = db.get(id_)
        assert (got.key, got.value, got.metadata) == (r["key"], r["value"], r["metadata"])
        assert np.array_equal(got.key_embedding.numpy(), r["key_embedding"])
        assert np.array_equal(got.value_embedding.numpy(), r["value_embedding"])
    keys = np.stack([want[i]["key_embedding"] for i in sorted(want)])  # (n, dim) in id order
    probes = keys[[0, len(keys) // 2, -1]] + 0.01  # (3, dim)
    if db.score == "cosine":
        keys = keys / np.linalg.norm(keys, axis=1, keepdims=True)
    best = np.array(sorted(want))[(probes @ keys.T).argmax(axis=1)]
    assert [row[0].id for row in db.search(torch.from_numpy(probes), k=1)] == best.tolist()


def chunk_rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path / "store.sqlite")) as conn:
        return conn.execute("SELECT count(*) FROM chunk_data").fetchone()[0]


@pytest.mark.parametrize("name", NAMES)
def test_a_chunk_store_is_moved_to_a_file_set_with_every_record_kept(tmp_path, name):
    path = tmp_path / name
    shutil.copytree(STORES / name, path)
    assert chunk_rows(path) > 0
    db = kvsearch.Database(path)
    check_records(db, expected(name))
    assert chunk_rows(path) == 0 and sorted(p.suffix for p in path.glob("store.sqlite.v1.*")) == [
        ".ids",
        ".keys",
        ".values",
    ]
    db.close()
    again = kvsearch.Database(path)
    check_records(again, expected(name))
    assert again.store.table.keys_shared  # moved in id order: one run, shared


@pytest.mark.parametrize("name", NAMES)
def test_a_chunk_store_opened_read_only_is_read_as_it_is(tmp_path, name):
    path = tmp_path / name
    shutil.copytree(STORES / name, path)
    db = kvsearch.Database(path, read_only=True)
    check_records(db, expected(name))
    assert chunk_rows(path) > 0 and not list(path.glob("store.sqlite.v*"))


def test_a_reader_of_the_chunk_format_follows_the_move_made_by_a_writer(tmp_path):
    path = tmp_path / "texts"
    shutil.copytree(STORES / "texts", path)
    reader = kvsearch.Database(path, read_only=True)
    want = expected("texts")
    check_records(reader, want)
    writer = kvsearch.Database(path)  # moves the store
    ids = writer.add(["Chen"], ["Danqi"])
    assert chunk_rows(path) == 0
    assert reader.lookup("Chen") == "Danqi" and reader.ids().tolist() == sorted(want) + ids
    reader.close()
    reader = kvsearch.Database(path, read_only=True)
    assert reader.lookup("Chen") == "Danqi"
