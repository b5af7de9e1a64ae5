"""A saved HNSW graph is read mapped: shared by readers, the same answers, grown only once copied, damage refused.

A graph saved without its vectors lives in a file of its own that :func:`kvsearch.index.graph_file.map_graph` maps
(FAISS's ``IO_FLAG_MMAP_IFC``): these tests check that a reader of a saved database answers as the graph it saved and
as a fresh build of the same vectors, that adds, deletes and upserts after opening a mapped graph (in this process
and in a reader process following another's commits) answer exactly as a reference, that a mapped file is never
written again (a new save writes a new file; a reader of the old one keeps answering), and that a damaged graph file
is a :class:`~kvsearch.errors.CorruptDatabaseError` (a database rebuilds from its store). And that
:class:`~kvsearch.index.labels.Labels` finds an id's live label as a dict would, through any order of writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _key_table import KeyTable

import kvsearch
from kvsearch.errors import CorruptDatabaseError
from kvsearch.index.factory import load_index
from kvsearch.index.faiss_index import Index
from kvsearch.index.graph_file import GRAPH_SUFFIX, is_mapped, own_graph
from kvsearch.index.graph_storage import DELTA_MIN
from kvsearch.index.labels import EXTRA_MIN, Labels
from kvsearch.storage.folder import INDEX_FILE

DIM = 16
#: efSearch above the number of vectors: the graph search visits every reachable vector, so its top-k is exact
EXACT = {"efSearch": 1024}


def unit_keys(rng: np.random.Generator, n: int, dim: int = DIM) -> torch.Tensor:
    return F.normalize(torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32)), dim=-1)  # (n, dim)


def graph_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{INDEX_FILE}.*{GRAPH_SUFFIX}"))


def exact_ids(ids: torch.Tensor, keys: torch.Tensor, queries: torch.Tensor, k: int) -> torch.Tensor:
    """(b, k) the ids of the k best inner products, in float64 (no ties among random floats)."""
    scores = queries.double() @ keys.double().T  # (b, n)
    return ids[scores.topk(k, dim=1).indices]


def same_answers(a: Index, b: Index, queries: torch.Tensor, k: int = 10) -> bool:
    x, y = a.search(queries, k), b.search(queries, k)
    return torch.equal(x.ids, y.ids) and torch.equal(x.scores, y.scores)


# ---------------------------------------------------------------------- 1. a reader answers as the saved graph


@pytest.mark.parametrize("normalize", [False, True], ids=["dot", "cosine"])
def test_a_loaded_graph_is_mapped_and_answers_as_a_fresh_build(tmp_path, rng, one_thread, normalize):
    ids, keys = torch.arange(5, 1205, 2), unit_keys(rng, 600)
    source = KeyTable(ids, keys)
    saved = Index(DIM, "HNSW16", "ip", normalize=normalize, source=source)
    saved.rebuild()
    saved.save(tmp_path / INDEX_FILE)
    assert len(graph_files(tmp_path)) == 1
    loaded = load_index(tmp_path / INDEX_FILE, "HNSW16", DIM, metric="ip", normalize=normalize, source=source)
    assert is_mapped(loaded.faiss_index) and not is_mapped(saved.faiss_index)
    assert loaded.shares_storage and torch.equal(loaded.ids(), ids)
    fresh = Index(DIM, "HNSW16", "ip", normalize=normalize, source=source)
    fresh.rebuild()  # the same vectors in the same order on one thread: the same graph
    queries = unit_keys(rng, 40)
    assert same_answers(loaded, saved, queries) and same_answers(loaded, fresh, queries)
    where = ids[::3].clone()
    a, b = loaded.search(queries, 10, allowed=where), fresh.search(queries, 10, allowed=where)
    assert torch.equal(a.ids, b.ids)


def test_a_reopened_database_reads_its_graph_mapped_and_answers_as_before(tmp_path, rng):
    keys = unit_keys(rng, 500)
    queries = unit_keys(rng, 20)
    with kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=2, index="HNSW16", score="dot") as db:
        db.add(keys=keys, values=torch.zeros(500, 2))
        before = [[h.id for h in row] for row in db.search(queries, k=10)]
    assert len(graph_files(tmp_path / "db")) == 1
    with kvsearch.Database(tmp_path / "db") as db:
        assert is_mapped(db.index.faiss_index) and db.index.shares_storage
        assert [[h.id for h in row] for row in db.search(queries, k=10)] == before


# ---------------------------------------------------------------------- 2. writes after a mapped open


@pytest.mark.parametrize("tombstones", [False, True], ids=["shared-storage", "copied-storage"])
def test_writes_to_a_mapped_graph_answer_as_to_one_in_memory(tmp_path, rng, tombstones):
    """Adds past the delta's bound (a fold), removals, re-adds of removed ids: the mapped graph is copied before it
    grows, and answers bit for bit as the same graph held in memory from the start. With tombstones saved, the
    storage is a copy and the graph grows at the first add."""
    ids, keys = torch.arange(400), unit_keys(rng, 400)
    source = KeyTable(ids, keys)
    writer = Index(DIM, "HNSW16", "ip", source=source, params=EXACT)
    writer.rebuild()
    if tombstones:
        gone = torch.arange(0, 400, 7)
        source.drop(gone)
        writer.remove(gone)
    writer.save(tmp_path / INDEX_FILE)
    mapped = load_index(tmp_path / INDEX_FILE, "HNSW16", DIM, metric="ip", source=source, params=EXACT)
    owned = load_index(tmp_path / INDEX_FILE, "HNSW16", DIM, metric="ip", source=source, params=EXACT)
    own_graph(owned.faiss_index)  # the reference: the same graph in memory of its own
    assert is_mapped(mapped.faiss_index) and not is_mapped(owned.faiss_index)
    assert mapped.shares_storage == (not tombstones)
    queries = unit_keys(rng, 25)
    steps = [
        ("add", torch.arange(1000, 1000 + DELTA_MIN + 50)),  # past the delta's bound: folded into the graph
        ("remove", torch.arange(1, 300, 5)),
        ("add", torch.arange(1, 60, 5)),  # removed ids back, with new keys
        ("remove", torch.arange(1000, 1100)),
        ("add", torch.arange(2000, 2010)),
    ]
    for what, step in steps:
        if what == "add":
            new = unit_keys(rng, len(step))
            source.append(step, new)
            mapped.add(step, new)
            owned.add(step, new)
        else:
            source.drop(step)
            mapped.remove(step)
            owned.remove(step)
        assert not is_mapped(mapped.faiss_index) or what == "remove"
        assert torch.equal(mapped.ids(), source.ids) and torch.equal(owned.ids(), source.ids)
        assert same_answers(mapped, owned, queries)
        assert torch.equal(mapped.search(queries, 10).ids, exact_ids(source.ids, source.keys, queries, 10))


_READER = """
import json, sys
import torch
import kvsearch
db = kvsearch.Database(sys.argv[1])
queries = torch.load(sys.argv[2])
from kvsearch.index.graph_file import is_mapped
print(json.dumps({"mapped": is_mapped(db.index.faiss_index)}), flush=True)
for line in sys.stdin:
    rows = [[h.id for h in row] for row in db.search(queries, k=10)]
    print(json.dumps({"ids": rows, "mapped": is_mapped(db.index.faiss_index), "n": len(db)}), flush=True)
"""


def test_a_reader_process_with_a_mapped_graph_follows_another_process_commits(tmp_path, rng):
    folder = tmp_path / "db"
    params = EXACT
    writer = kvsearch.Database(folder, dim=DIM, value_dim=2, index="HNSW16", score="dot", search_params=params)
    writer.add(keys=unit_keys(rng, 400), values=torch.zeros(400, 2))
    writer.save()
    queries = unit_keys(rng, 12)
    torch.save(queries, tmp_path / "queries.pt")
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_READER), str(folder), str(tmp_path / "queries.pt")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(reader.stdout.readline())["mapped"]

        def ask() -> dict:
            reader.stdin.write("go\n")
            reader.stdin.flush()
            line = reader.stdout.readline()
            assert line, reader.stderr.read()
            return json.loads(line)

        def expected() -> list[list[int]]:
            table = writer.store.table
            return exact_ids(table.ids, table.keys, queries, 10).tolist()

        assert ask()["ids"] == expected()
        writer.add(keys=unit_keys(rng, DELTA_MIN + 40), values=torch.zeros(DELTA_MIN + 40, 2))  # a fold there
        got = ask()
        assert got["ids"] == expected() and not got["mapped"] and got["n"] == 400 + DELTA_MIN + 40
        writer.delete(writer.store.table.ids[::4].tolist())
        assert ask()["ids"] == expected()
        writer.save()  # a new graph file; the reader's copy is its own
        writer.add(keys=unit_keys(rng, 5), values=torch.zeros(5, 2))
        assert ask()["ids"] == expected()
    finally:
        reader.stdin.close()
        reader.wait(timeout=60)
        writer.close()
    assert reader.returncode == 0, reader.stderr.read()


# ---------------------------------------------------------------------- 3. files: never rewritten, damage refused


def test_a_new_save_writes_a_new_graph_file_and_a_reader_of_the_old_one_keeps_answering(tmp_path, rng):
    ids, keys = torch.arange(300), unit_keys(rng, 300)
    source = KeyTable(ids, keys)
    writer = Index(DIM, "HNSW16", "ip", source=source)
    writer.rebuild()
    writer.save(tmp_path / INDEX_FILE)
    first = graph_files(tmp_path)
    reader = load_index(tmp_path / INDEX_FILE, "HNSW16", DIM, metric="ip", source=source)
    queries = unit_keys(rng, 10)
    before = reader.search(queries, 10)
    writer.remove(ids[:50])
    writer.save(tmp_path / INDEX_FILE)
    second = graph_files(tmp_path)
    assert len(first) == len(second) == 1 and first != second  # the old file removed, never written again
    after = reader.search(queries, 10)  # it still maps the removed file
    assert torch.equal(before.ids, after.ids) and torch.equal(before.scores, after.scores)


def damage_graph(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "one byte flipped":
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "zeroed":
        path.write_bytes(bytes(len(data)))
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()


HOW = ["truncated", "one byte flipped", "zeroed", "empty", "deleted"]


@pytest.mark.parametrize("how", HOW)
def test_a_damaged_graph_file_is_a_typed_error(tmp_path, rng, how):
    ids, keys = torch.arange(300), unit_keys(rng, 300)
    source = KeyTable(ids, keys)
    index = Index(DIM, "HNSW16", "ip", source=source)
    index.rebuild()
    index.save(tmp_path / INDEX_FILE)
    damage_graph(graph_files(tmp_path)[0], how)
    with pytest.raises(CorruptDatabaseError, match="graph file"):
        load_index(tmp_path / INDEX_FILE, "HNSW16", DIM, metric="ip", source=source)


def test_an_index_file_naming_a_foreign_file_is_a_typed_error(tmp_path, rng):
    ids, keys = torch.arange(100), unit_keys(rng, 100)
    source = KeyTable(ids, keys)
    index = Index(DIM, "HNSW16", "ip", source=source)
    index.rebuild()
    index.save(tmp_path / INDEX_FILE)
    with np.load(tmp_path / INDEX_FILE) as data:
        arrays = {name: data[name] for name in data.files}
    (tmp_path / "elsewhere.graph").write_bytes(graph_files(tmp_path)[0].read_bytes())
    arrays["graph_file"] = np.array("../" + tmp_path.name + "/elsewhere.graph")
    np.savez(tmp_path / INDEX_FILE, **arrays)
    with pytest.raises(CorruptDatabaseError, match="foreign graph file"):
        load_index(tmp_path / INDEX_FILE, "HNSW16", DIM, metric="ip", source=source)


@pytest.mark.parametrize("how", HOW)
def test_a_database_with_a_damaged_graph_file_rebuilds_from_its_store(tmp_path, rng, how):
    keys = unit_keys(rng, 300)
    with kvsearch.Database(tmp_path / "db", dim=DIM, value_dim=2, index="HNSW16", score="dot") as db:
        db.add(keys=keys, values=torch.zeros(300, 2))
    damage_graph(graph_files(tmp_path / "db")[0], how)
    queries = unit_keys(rng, 10)
    with kvsearch.Database(tmp_path / "db", search_params=EXACT) as db:
        assert not is_mapped(db.index.faiss_index)  # rebuilt from the store
        table = db.store.table
        got = [[h.id for h in row] for row in db.search(queries, k=10)]
        assert got == exact_ids(table.ids, table.keys, queries, 10).tolist()
    assert len(graph_files(tmp_path / "db")) == 1  # the rebuilt graph saved at close; the damaged file gone


# ---------------------------------------------------------------------- 4. labels as a dict would find them


@pytest.mark.parametrize("seed", range(4))
def test_labels_find_live_labels_as_a_dict_does(seed):
    rng = np.random.default_rng(seed)
    start = np.sort(rng.choice(10_000, 300, replace=False)) if seed % 2 else rng.permutation(300)
    labels = Labels(start.astype(np.int64))
    reference = {int(i): n for n, i in enumerate(start.tolist())}
    count, top = len(start), 10_000
    for _ in range(60):
        move = rng.integers(3)
        if move == 0:  # new ids, increasing (the usual add)
            new = np.arange(top, top + int(rng.integers(1, 50)))
            top += len(new)
        elif move == 1:  # removed ids (and never-seen ones) added back out of order
            new = np.unique(rng.integers(0, top, int(rng.integers(1, EXTRA_MIN // 8))))
            new = np.array([i for i in new.tolist() if i not in reference], dtype=np.int64)
            rng.shuffle(new)
        else:
            gone = rng.integers(0, top, int(rng.integers(1, 80)))
            labels.kill(gone)
            for i in gone.tolist():
                reference.pop(i, None)
            new = np.empty(0, dtype=np.int64)
        labels.append(new)
        for offset, i in enumerate(new.tolist()):
            reference[i] = count + offset
        count += len(new)
        probe = np.concatenate([rng.integers(-5, top + 5, 200), np.array(list(reference)[:50], dtype=np.int64)])
        want = np.array([reference.get(i, -1) for i in probe.tolist()])
        assert np.array_equal(labels.find(probe), want)
        assert labels.live == len(reference) and len(labels) == count
        assert np.array_equal(labels.live_ids(), np.sort(np.array(list(reference), dtype=np.int64)))
