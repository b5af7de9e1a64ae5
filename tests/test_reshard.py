"""Resharding (``kvsearch.reshard``, ``kvsearch reshard``): the result equals the source on every read, ids are kept
and never reused, the source is untouched, a bad destination is refused, and a killed reshard leaves the
destination absent or whole.

The reference is always the source itself, opened beside the result: every id read back (texts, metadata,
embeddings bit for bit), searches (scores equal, ids equal above the last score: ties at the cut may differ), query
outputs, exact lookups by text and by embedding, filtered searches.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import warnings
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch import Database, NgramEncoder
from kvsearch.cli.program import main
from kvsearch.distributed import ShardedDatabase

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
DIM = 16
QUERIES = ["alpha 3", "beta", "gamma 12", "delta 7 x", "omega", "alp"]


def encoder(seed: int = 0) -> NgramEncoder:
    return NgramEncoder(dim=DIM, num_buckets=512, seed=seed)


def fill(db: Database | ShardedDatabase, handed: set[int], n: int = 60, seed: int = 0) -> None:
    """Records of every kind: texts with nested / datetime metadata, keys and values given as embeddings, texts with
    their own embeddings; some deleted (the last one added among them). ``handed`` gets every id handed out."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta"]
    keys = [f"{words[i % 4]} {i}" for i in range(n)]
    meta = [
        {
            "lang": "en" if i % 3 else "fr",
            "n": i,
            "nested": {"tags": [i % 5, "x"], "deep": {"ok": i % 2 == 0}},
            "when": datetime(2024, 1, 1) + timedelta(hours=i),
            "aware": datetime(2023, 5, 1, tzinfo=timezone(timedelta(hours=2))),
            "day": date(2020, 1, 1 + i % 28),
        }
        if i % 4
        else None
        for i in range(n)
    ]
    handed.update(db.add(keys, [f"value {i}" for i in range(n)], meta))
    handed.update(db.add(torch.randn(6, DIM, generator=g), [f"loose {i}" for i in range(6)], [{"lang": "en"}] * 6))
    handed.update(db.add([f"embval {i}" for i in range(4)], torch.randn(4, DIM, generator=g)))
    handed.update(db.add(["given key"], ["given value"], key_embeddings=torch.randn(1, DIM, generator=g)))
    last = db.add(["the last one"], ["deleted"])
    handed.update(last)
    db.delete([keys[1], keys[7], last[0]])


def make_plain(path: Path, handed: set[int], *, index: str | None = None, query_encoder: bool = False) -> None:
    """A plain database of :func:`fill`'s records at generation 3: trained key encoder weights saved (a fine-tune:
    weights file), then a refresh; with a query-side encoder of its own if asked."""
    params = {"nprobe": 4} if index else None
    db = Database(path, encoder=encoder(), index=index, device="cpu", search_params=params)
    fill(db, handed)
    with torch.no_grad():
        for p in db.encoder.parameters():
            p.mul_(1.5)
    if query_encoder:
        db.query_encoder = encoder(seed=3)
    db.save_encoders()
    db.refresh()
    db.close()


def same_value(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def all_ids(db: Database | ShardedDatabase) -> list[int]:
    if isinstance(db, ShardedDatabase):
        return sorted(i for shard in db.shards.values() for i in shard.ids().tolist())
    return db.ids().tolist()


def open_db(path: Path) -> Database | ShardedDatabase:
    if (path / "shards.json").is_file():
        return ShardedDatabase(path, device="cpu")
    return Database(path, device="cpu")


def assert_hits_equal(a: list, b: list) -> None:
    """Scores equal; the ids equal above the last score (records tied at the cut may differ)."""
    assert [round(h.score, 5) for h in a] == [round(h.score, 5) for h in b]
    if a:
        cut = round(a[-1].score, 5)
        assert {h.id for h in a if round(h.score, 5) > cut} == {h.id for h in b if round(h.score, 5) > cut}
        for x in a:
            same = [y for y in b if y.id == x.id]
            if same:
                assert (same[0].key, same[0].metadata) == (x.key, x.metadata)


def assert_same(source: Path, result: Path, *, exact: bool = True, index: str | None = None) -> None:
    """The result answers every read as the source does (with the index spec ``index``, when given)."""
    src, dst = open_db(source), open_db(result)
    try:
        ids = all_ids(src)
        assert all_ids(dst) == ids and len(dst) == len(src)
        assert dst.generation == src.generation
        assert (dst.dim, dst.value_dim, dst.score, dst.index_spec) == (
            src.dim,
            src.value_dim,
            src.score,
            index or src.index_spec,
        )
        for e in ("encoder", "query_encoder"):
            a, b = getattr(src, e), getattr(dst, e)
            assert (a is None) == (b is None)
            if a is not None:
                assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
        for i in ids:
            a, b = src.get(i), dst.get(i)
            assert (a.key, a.value, a.metadata) == (b.key, b.value, b.metadata)
            assert torch.equal(a.key_embedding, b.key_embedding) and torch.equal(a.value_embedding, b.value_embedding)
            key = a.key if a.key is not None else a.key_embedding  # a key given as an embedding: found by equality
            assert same_value(src.lookup(key), dst.lookup(key))
        g = torch.Generator().manual_seed(1)
        vectors = torch.randn(4, DIM, generator=g)
        for queries in (QUERIES, vectors):
            for k in (1, 5, 200):
                for a, b in zip(src.search(queries, k=k), dst.search(queries, k=k)):
                    if exact:
                        assert_hits_equal(a, b)
                    else:  # an approximate index: what it finds is found in both (recall, not order)
                        assert len({h.id for h in a} & {h.id for h in b}) >= 0.8 * len(a)
            where = {"lang": "en", "n": {"$gte": 10}}
            for a, b in zip(src.search(queries, k=5, where=where), dst.search(queries, k=5, where=where)):
                assert_hits_equal(a, b)
            for pooling in ("softmax", "exact"):
                a, b = src.query(queries, k=8, pooling=pooling), dst.query(queries, k=8, pooling=pooling)
                assert torch.allclose(a.output, b.output, atol=1e-5)
                assert a.found == b.found
        exact_keys = ["alpha 4", "gamma 2", "nobody", "given key"]
        a, b = src.query(exact_keys, k=4, pooling="exact"), dst.query(exact_keys, k=4, pooling="exact")
        assert a.found == b.found == [True, True, False, True] and a.value == b.value
    finally:
        src.close()
        dst.close()


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def new_ids_avoid(path: Path, handed: set[int]) -> set[int]:
    """Add records whose keys spread over the shards, check none takes an id ever handed out, delete one; the
    new ids (added to ``handed`` by the caller)."""
    db = open_db(path)
    try:
        new = db.add([f"fresh {path.name} {i}" for i in range(12)], [f"new {i}" for i in range(12)])
        assert not set(new) & handed, f"ids reused: {sorted(set(new) & handed)}"
        assert len(set(new)) == 12
        db.delete(new[-1])  # its id must not come back either
    finally:
        db.close()
    return set(new)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[int]]:
    path = tmp_path_factory.mktemp("reshard") / "plain"
    handed: set[int] = set()
    make_plain(path, handed)
    return path, handed


def test_plain_to_4_to_2_to_3_to_plain(plain: tuple[Path, set[int]], tmp_path: Path) -> None:
    """Each hop equals its source, leaves it untouched, and its new ids avoid every id of its lineage."""
    source, handed = plain
    source_copy = tmp_path / "plain"
    shutil.copytree(source, source_copy)
    handed = set(handed)
    chain = [(source_copy, None)]
    for shards in (4, 2, 3, 1):
        src = chain[-1][0]
        before = digest(src)
        dst = tmp_path / f"s{shards}"
        report = kvsearch.reshard(src, dst, num_shards=shards)
        assert digest(src) == before, "the source was written"
        assert report.num_shards == shards and report.records == len(open_db(src))
        assert ((dst / "shards.json").is_file()) == (shards > 1)
        assert not list(tmp_path.glob(".*.reshard-*")), "a staging folder was left"
        assert_same(src, dst)
        handed |= new_ids_avoid(dst, handed)  # now the result has ids of its own (one deleted): the next hop's
        chain.append((dst, shards))
    with open_db(chain[-1][0]) as db:
        assert db.generation == 3


def test_native_shards_to_2_and_plain(tmp_path: Path) -> None:
    """A sharded database made by ShardedDatabase (banded ids, one refresh) into 2 shards and into one."""
    source = tmp_path / "native"
    handed: set[int] = set()
    sdb = ShardedDatabase(source, num_shards=4, encoder=encoder(), device="cpu")
    fill(sdb, handed)
    sdb.refresh()
    sdb.close()
    for shards in (2, 1):
        dst = tmp_path / f"to{shards}"
        before = digest(source)
        kvsearch.reshard(source, dst, num_shards=shards)
        assert digest(source) == before
        assert_same(source, dst)
        handed |= new_ids_avoid(dst, handed)
    with ShardedDatabase(tmp_path / "to2", device="cpu") as sdb:
        assert sdb.banded_ids is False
        gone, count = all_ids(sdb)[:3], len(sdb)
        assert sorted(sdb.delete(gone)) == gone and len(sdb) == count - 3
        with pytest.raises(kvsearch.KeyNotFoundError):
            sdb.delete(gone[0])
        with pytest.raises(kvsearch.KeyNotFoundError):
            sdb.get(gone[0])


def test_query_encoder_and_generation_carried(tmp_path: Path) -> None:
    """A database with a query-side encoder of its own: its files come along, each shard at the source's generation."""
    source = tmp_path / "q"
    make_plain(source, set(), query_encoder=True)
    kvsearch.reshard(source, tmp_path / "one", num_shards=1)
    assert_same(source, tmp_path / "one")
    kvsearch.reshard(source, tmp_path / "two", num_shards=2)
    with Database(source, device="cpu") as src:
        query_state = src.query_encoder.state_dict()
        for s in range(2):  # each shard alone: its encoders, generation and no previous one to roll back to
            with Database(tmp_path / "two" / f"shard-{s:04d}", device="cpu") as shard:
                assert shard.generation == src.generation == 3 and shard.previous_generation is None
                assert all(torch.equal(query_state[n], t) for n, t in shard.query_encoder.state_dict().items())
                every = [{h.id: h.score for h in row} for row in src.search(QUERIES, k=len(src))]
                for scores, row in zip(every, shard.search(QUERIES, k=3)):  # text queries: the query encoder's
                    assert row and all(abs(scores[h.id] - h.score) < 1e-5 for h in row)
    assert json.loads((tmp_path / "two" / "shards.json").read_text())["generation"] == 3
    for _ in range(3):  # opened whole, again and again: the shards share one query encoder, and nothing changes
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "a switch was interrupted" at the next open
            with ShardedDatabase(tmp_path / "two", device="cpu") as both:
                assert both.generation == 3 and {db.generation for db in both.shards.values()} == {3}
                assert len({id(db.query_encoder) for db in both.shards.values()}) == 1


def test_layouts_written_before_are_banded(tmp_path: Path) -> None:
    """A shards.json without ``banded_ids`` (written before resharding existed) reads as banded; a reshard's is not."""
    from kvsearch.distributed.layout import ShardLayout

    layout = ShardLayout(2, DIM, DIM, "cosine", "Flat", generation=1)
    layout.write(tmp_path)
    data = json.loads((tmp_path / "shards.json").read_text())
    del data["banded_ids"]
    (tmp_path / "shards.json").write_text(json.dumps(data))
    assert ShardLayout.read(tmp_path).banded_ids is True
    with pytest.raises(kvsearch.InvalidArgumentError, match="banded_ids"):
        ShardLayout(2, DIM, DIM, "cosine", "Flat", banded_ids="no")  # type: ignore[arg-type]


def test_two_ranks_serve_a_resharded_database(plain: tuple[Path, set[int]], tmp_path: Path) -> None:
    """2 gloo ranks, one shard each, ids not banded: reads by id, exact targets and deletes by id find their owner on
    the other rank; a missing id is refused on every rank; new ids are new."""
    import _distributed_ranks as ranks
    import _reshard_ranks

    source, handed = plain
    kvsearch.reshard(source, tmp_path / "two", num_shards=2)
    with Database(tmp_path / "two" / "shard-0001", device="cpu") as shard:
        victim = int(shard.ids()[0])
    assert victim >> 40 != 1  # outside shard 1's band: only asking the shards finds it
    with Database(source, device="cpu") as src:
        ids = src.ids().tolist()
        (tmp_path / "ids.txt").write_text(" ".join(map(str, ids)))
        (tmp_path / "victim.txt").write_text(str(victim))
        procs = _reshard_ranks.start(tmp_path)
        try:
            records = {i: (r.key, r.value, r.metadata) for i in ids for r in [src.get(i)]}
            key_texts, embeddings = src.key_texts(ids), src.embeddings(torch.tensor(ids))
            exact = src.query(_reshard_ranks.QUERIES, k=4, pooling="exact")
            hits = src.search(_reshard_ranks.QUERIES, k=5)
            count = len(src)
        finally:
            codes, results = ranks.join_ranks(procs, tmp_path, "reshard", 300.0)
    assert codes == [0, 0], [r.get("crash") for r in results]
    added: set[int] = set()
    for rank, seen in enumerate(results):
        assert seen["get"] == records and seen["key_texts"] == key_texts
        assert all(torch.equal(a, b) for a, b in zip(seen["embeddings"], embeddings))
        found, value, output = seen["exact"]
        assert found == exact.found and all(same_value(a, b) for a, b in zip(value, exact.value))
        assert torch.allclose(output, exact.output, atol=1e-6)
        for row, ref in zip(seen["search"], hits):
            assert [score for _, score in row] == [round(h.score, 5) for h in ref]
            assert {i for i, score in row if score > row[-1][1]} == {
                h.id for h in ref if round(h.score, 5) > row[-1][1]
            }
        assert seen["deleted"] == ([victim] if rank == 0 else [])
        assert seen["get_deleted"] == seen["delete_again"] == "KeyNotFoundError"
        assert not set(seen["added"]) & handed
        added |= set(seen["added"])
        assert seen["len"] == count - 1 + 12
    assert len(added) == 12


def test_approximate_index(tmp_path: Path) -> None:
    """IVF: the options (index, search parameters) carried, records and lookups equal, search found in both."""
    handed: set[int] = set()
    source = tmp_path / "ivf"
    make_plain(source, handed, index="IVF4,Flat")
    kvsearch.reshard(source, tmp_path / "ivf3", num_shards=3)
    assert_same(source, tmp_path / "ivf3", exact=False)
    with ShardedDatabase(tmp_path / "ivf3", device="cpu") as sdb:
        assert sdb.index_spec == "IVF4,Flat"


def test_another_index(plain: tuple[Path, set[int]], tmp_path: Path) -> None:
    """``index=``: the one way to change a database's index (a reopen with another says so). The records, ids and
    every read are the source's; the new spec is the one served and recorded (plain and sharded results)."""
    source, handed = plain
    with pytest.raises(kvsearch.ConfigMismatchError, match="kvsearch reshard SRC DST --shards 1 --index SPEC"):
        Database(source, index="HNSW32", device="cpu")
    kvsearch.reshard(source, tmp_path / "hnsw", num_shards=1, index="HNSW32", search_params={"efSearch": 256})
    assert_same(source, tmp_path / "hnsw", exact=False, index="HNSW32")
    with Database(tmp_path / "hnsw", device="cpu") as db:  # reopened as recorded, no index= needed
        assert db.index_spec == "HNSW32" and db.retriever.params == {"efSearch": 256}
        for key in ("alpha 4", "gamma 2", "delta 11"):  # a stored key is its own nearest record
            assert db.search(key, k=1)[0].key == key
    kvsearch.reshard(source, tmp_path / "ivf3", num_shards=3, index="IVF2,Flat")
    assert_same(source, tmp_path / "ivf3", exact=False, index="IVF2,Flat")
    with ShardedDatabase(tmp_path / "ivf3", device="cpu") as sdb:
        assert sdb.index_spec == "IVF2,Flat" and sdb.shards[0].retriever.params == {}
    before = digest(source)
    for bad, error in (("NoSuchIndex7", kvsearch.UnknownOptionError), ("", kvsearch.InvalidArgumentError)):
        with pytest.raises(error):
            kvsearch.reshard(source, tmp_path / "bad", num_shards=2, index=bad)
        assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.reshard-*"))
    assert digest(source) == before


def test_refusals(plain: tuple[Path, set[int]], tmp_path: Path) -> None:
    """A destination that is a database, someone's folder, a file or inside the source: typed, nothing written."""
    source, _ = plain
    before = digest(source)
    made = tmp_path / "made"
    kvsearch.reshard(source, made, num_shards=2)
    made_digest = digest(made)
    with pytest.raises(kvsearch.DatabaseExistsError, match="sharded kvsearch database"):
        kvsearch.reshard(source, made, num_shards=3)
    assert digest(made) == made_digest
    with pytest.raises(kvsearch.DatabaseExistsError):
        kvsearch.reshard(made, source, num_shards=1)
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "README.txt").write_text("mine")
    with pytest.raises(kvsearch.ForeignFolderError, match="README.txt"):
        kvsearch.reshard(source, foreign, num_shards=2)
    assert sorted(p.name for p in foreign.iterdir()) == ["README.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(kvsearch.InvalidArgumentError, match="a file"):
        kvsearch.reshard(source, tmp_path / "file", num_shards=2)
    for inside in (source / "sub", source, source.parent):
        with pytest.raises(kvsearch.InvalidArgumentError, match="outside the source"):
            kvsearch.reshard(source, inside, num_shards=2)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(kvsearch.InvalidArgumentError, match="num_shards"):
            kvsearch.reshard(source, tmp_path / "x", num_shards=bad)  # type: ignore[arg-type]
    with pytest.raises(kvsearch.InvalidArgumentError, match="expected a kvsearch database"):
        kvsearch.reshard(foreign, tmp_path / "y", num_shards=2)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (source / "sub").exists()
    assert digest(source) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    kvsearch.reshard(source, empty, num_shards=1)  # an empty folder is taken
    assert_same(source, empty)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "kvsearch", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli(plain: tuple[Path, set[int]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvsearch reshard``: one run as a user types it, the rest in-process (one torch import less each)."""
    source, _ = plain
    done = run_cli("reshard", str(source), str(tmp_path / "c3"), "--shards", "3")
    assert done.returncode == 0, done.stderr
    assert f"-> {tmp_path / 'c3'} (3 shards)" in done.stdout and "ids kept, generation 3" in done.stdout
    assert main(["info", str(tmp_path / "c3"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["shards"] == 3 and info["records"] == len(open_db(source))
    assert main(["reshard", str(tmp_path / "c3"), str(tmp_path / "one"), "--shards", "1"]) == 0
    assert f"(3 shards) -> {tmp_path / 'one'} (plain)" in capsys.readouterr().out
    assert main(["reshard", str(source), str(tmp_path / "hnsw"), "--shards", "1", "--index", "HNSW16"]) == 0
    assert f"-> {tmp_path / 'hnsw'} (plain, index HNSW16)" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "hnsw"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["index"] == "HNSW16"
    assert main(["reshard", str(source), str(tmp_path / "bad"), "--shards", "1", "--index", "Nope9"]) == 1
    assert "Nope9" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main(["reshard", str(source), str(tmp_path / "c3"), "--shards", "2"]) == 1
    assert "already holds a sharded kvsearch database" in capsys.readouterr().err
    for bad in (["--shards", "0"], ["--shards", "x"], []):
        with pytest.raises(SystemExit) as exit_:
            main(["reshard", str(source), str(tmp_path / "c4"), *bad])
        assert exit_.value.code == 2
        assert "--shards" in capsys.readouterr().err
    assert not (tmp_path / "c4").exists()


# ---------------------------------------------------------------------- killed reshards


def kill_reshards(tmp_path: Path, kills: int, seed: int) -> tuple[int, float]:
    """SIGKILL reshards at times spread over one run's duration; after each, the destination is absent or equal to
    the source; then a full run succeeds and no staging folder is left. (runs started to get ``kills`` kills, seconds
    of the measured run)."""
    source = tmp_path / "src"
    sdb = ShardedDatabase(source, num_shards=3, encoder=encoder(), device="cpu")
    fill(sdb, set(), n=40)
    sdb.refresh()
    sdb.close()
    before = digest(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "_reshard_child.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )

    def run(dst: Path, delay: float | None) -> dict:
        server.stdin.write(json.dumps({"src": str(source), "dst": str(dst), "shards": 2, "delay": delay}) + "\n")
        server.stdin.flush()
        return json.loads(server.stdout.readline())

    try:
        measured = run(tmp_path / "measure", None)
        assert measured["status"] == 0 and not measured["killed"]
        duration = measured["seconds"]
        rng = random.Random(seed)
        dst = tmp_path / "dst"
        hit = rounds = 0
        while hit < kills:  # one kill in each slice of the run; a run that finished first does not count
            rounds += 1
            assert rounds <= 3 * kills, f"only {hit} of {rounds} runs were killed before they finished"
            reply = run(dst, duration * (hit + rng.random()) / kills)
            if reply["killed"]:
                hit += 1
            else:  # it ran faster than the measured run: spread the rest over this shorter one
                duration = min(duration, reply["seconds"])
            if dst.exists():  # renamed before the kill: whole
                assert_same(source, dst)
                shutil.rmtree(dst)
            assert digest(source) == before
        final = run(dst, None)
        assert final["status"] == 0
        assert_same(source, dst)
        assert not list(tmp_path.glob(".dst.reshard-*")), "a killed run's staging folder was not removed"
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    assert digest(source) == before
    return rounds, measured["seconds"]


def test_killed_reshard_leaves_dst_absent_or_whole(tmp_path: Path) -> None:
    kill_reshards(tmp_path, kills=20, seed=0)


@pytest.mark.slow
def test_killed_reshard_many(tmp_path: Path) -> None:
    kill_reshards(tmp_path, kills=100, seed=1)
