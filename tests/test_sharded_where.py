"""``ShardedDatabase.where()`` against one plain Database holding the same records: every Selection operation.

Two gloo ranks on 127.0.0.1 are spawned once (``tests/_distributed_ranks.py``, scenario
``test_sharded_where:where_scenario``); each adds half of the records to a sharded database of 4 shards, then runs
every case of :func:`run_cases` — count, ids (with pages), records (with pages), distinct, min / max, fields, update
and delete, with filters on texts, numbers (int and float), bools, lists, datetimes, missing fields and nulls — and
records what it saw. This process runs the same cases on one :class:`kvsearch.Database` holding the same records.
Ids differ between the two (a sharded id holds its shard), so ids are compared through the keys they stand for
(their order checked ascending on its own); the reference adds the records in the order of their sharded ids, so
that pages cut in id order hold the same records in both. Both ranks must see the same answers.

The same cases run on a one-process ``ShardedDatabase`` (no process group) too, and the collective checks:
different filters on the ranks, or a bad field on one rank, raise on every rank.
"""

from __future__ import annotations

import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch

import kvsearch
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.layout import shard_of_key

sys.path.insert(0, str(Path(__file__).parent))
import _distributed_ranks as ranks  # noqa: E402

DEADLINE_S = 240.0
N = 60
SHARDS = 4

FILTERS: dict[str, dict[str, Any] | None] = {
    "all": None,
    "text": {"lang": "en"},
    "text-in": {"lang": {"$in": ["fr", "de"]}},
    "int-range": {"year": {"$gte": 2005, "$lt": 2015}},
    "float": {"score": {"$gt": 0.5}},
    "missing": {"year": {"$exists": False}},
    "null": {"note": None},
    "bool-and-text": {"$and": [{"draft": True}, {"lang": {"$ne": "de"}}]},
    "or-number-text": {"$or": [{"year": {"$lt": 2003}}, {"lang": "fr"}]},
    "list": {"tags": {"$in": ["b"]}},
    "datetime": {"when": {"$gte": datetime(2020, 1, 10, tzinfo=UTC)}},
    "none-match": {"lang": "xx"},
}
FIELDS = ("lang", "year", "score", "tags", "draft", "note", "when", "absent", "$key")
PAGES = ((None, 0), (5, 0), (7, 3), (0, 2), (4, 1000))


def records() -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """N records with varied metadata: texts, ints and floats, a year given as text in some, bools, lists, nulls,
    datetimes, and fields missing from some records."""
    keys = [f"name{i:03d}" for i in range(N)]
    values = [f"value {i}" for i in range(N)]
    meta: list[dict[str, Any]] = []
    for i in range(N):
        m: dict[str, Any] = {"lang": ("en", "fr", "de")[i % 3], "score": round((i * 37 % 100) / 100, 2)}
        if i % 5:
            m["year"] = 2000 + (i * 7) % 20 if i % 11 else f"{1990 + i}"  # a few years as texts
        if i % 4 == 0:
            m["draft"] = bool(i % 8)
        if i % 6 == 0:
            m["note"] = None
        elif i % 6 == 1:
            m["note"] = "checked"
        if i % 3 == 1:
            m["tags"] = ["a", "b"] if i % 2 else ["b", "c", 1]
        if i % 7 == 2:
            m["when"] = datetime(2020, 1, 1 + i % 28, tzinfo=UTC)
        meta.append(m)
    return keys, values, meta


def _meta(metadata: dict[str, Any]) -> list[tuple[str, Any]]:
    return sorted((k, repr(v)) for k, v in metadata.items())


def run_cases(db: Any) -> dict[str, Any]:
    """Every Selection operation on ``db`` (plain or sharded: on every rank), ids shown as keys; then an update and
    a delete, and the records after each. ``("ok", result)`` or ``("err", type name, message)`` per case."""
    key_of = {r.id: r.key for r in db.where().records()}
    out: dict[str, Any] = {"len": len(db)}

    def ids(found: torch.Tensor) -> tuple[list[str], bool]:
        listed = found.tolist()
        return [key_of[i] for i in listed], listed == sorted(listed)

    def recs(found: list[Any]) -> tuple[list[tuple[Any, ...]], bool]:
        listed = [r.id for r in found]
        shown = [(r.key, r.value, _meta(r.metadata), r.key_embedding.shape[0]) for r in found]
        return shown, listed == sorted(listed) and all(key_of[r.id] == r.key for r in found)

    for name, where in FILTERS.items():
        sel = db.where(where)
        out[name, "count"] = ranks.attempt(sel.count)
        for limit, offset in PAGES:
            page = {"limit": limit, "offset": offset}
            out[name, "ids", limit, offset] = ranks.attempt(lambda s=sel, p=page: ids(s.ids(**p)))
            out[name, "records", limit, offset] = ranks.attempt(lambda s=sel, p=page: recs(s.records(**p)))
        for field in FIELDS:
            out[name, "distinct", field] = ranks.attempt(lambda s=sel, f=field: s.distinct(f))
            out[name, "min_max", field] = ranks.attempt(lambda s=sel, f=field: s.min_max(f))
        out[name, "fields"] = ranks.attempt(sel.fields)
    some = [i for i, k in key_of.items() if k in ("name001", "name010", "name033")]
    out["by-ids", "count"] = ranks.attempt(lambda: db.where({"lang": "en"}, ids=some).count())
    out["by-ids", "records"] = ranks.attempt(lambda: recs(db.where(None, ids=some).records()))
    out["bad-field"] = ranks.attempt(lambda: db.where().distinct("$nope"))
    out["bad-page"] = ranks.attempt(lambda: db.where().ids(limit=-1))
    out["bad-metadata"] = ranks.attempt(lambda: db.where({"lang": "en"}).update({"x": float("nan")}))
    out["bad-filter"] = ranks.attempt(lambda: db.where({"year": {"$gte": "x", "$oops": 1}}))
    out["update"] = ranks.attempt(lambda: ids(torch.tensor(db.where(FILTERS["int-range"]).update({"seen": 1}))))
    out["update-replace"] = ranks.attempt(
        lambda: ids(torch.tensor(db.where({"lang": "de"}, ids=some).update({"only": "this"}, merge=False)))
    )
    out["after-update"] = ranks.attempt(lambda: recs(db.where().records()))
    out["delete"] = ranks.attempt(lambda: ids(torch.tensor(db.where(FILTERS["or-number-text"]).delete())))
    out["after-delete"] = ranks.attempt(lambda: (recs(db.where().records()), len(db)))
    out["delete-none"] = ranks.attempt(lambda: db.where(FILTERS["none-match"]).delete())
    return out


def where_scenario(rank: int, world: int, root: Path, out: ranks.Results) -> None:
    """A rank: half of the records added by each rank, every case, then the collective checks."""
    from kvsearch.contract import DatabaseProtocol

    keys, values, meta = records()
    sdb = ShardedDatabase(root / "sharded", num_shards=SHARDS, encoder=ranks.encoder(), timeout=ranks.TIMEOUT)
    mine = [i for i in range(N) if i % world == rank]
    sdb.add([keys[i] for i in mine], [values[i] for i in mine], [meta[i] for i in mine])
    out["protocol"] = isinstance(sdb, DatabaseProtocol)
    out["shards"] = sorted(sdb.shards)
    out["cases"] = run_cases(sdb)
    out["differ"] = outcome(lambda: sdb.where({"lang": "en" if rank == 0 else "fr"}))
    out["differ-update"] = outcome(lambda: sdb.where().update({"rank": rank}))
    out["one-bad-field"] = ranks.attempt(lambda: sdb.where().distinct("lang" if rank == 0 else "$nope"))
    out["after"] = ranks.attempt(lambda: sdb.where().count())
    sdb.close()


def outcome(fn: Any) -> tuple:
    """As ``ranks.attempt``, a DistributedError included (the cases that expect one)."""
    from kvsearch.errors import KVSearchError

    try:
        return ("ok", fn())
    except KVSearchError as exc:
        return ("err", type(exc).__name__, str(exc))


def reference(root: Path, world: int = 1) -> dict[str, Any]:
    """The cases on one Database holding the same records, added in the order of their global ids in the sharded
    database written by ``world`` ranks (by shard, then by the adding rank, then by input order: how the ranks
    commit), so that id order — what pages cut — is the same in both."""
    keys, values, meta = records()
    order = sorted(range(N), key=lambda i: (shard_of_key(keys[i], SHARDS), i % world, i))
    db = kvsearch.Database(root / f"single{world}", encoder=ranks.encoder(), device="cpu")
    db.add([keys[i] for i in order], [values[i] for i in order], [meta[i] for i in order])
    try:
        return run_cases(db)
    finally:
        db.close()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    root = tmp_path_factory.mktemp("where")
    scenario = "test_sharded_where:where_scenario"
    procs = ranks.start_ranks(2, root, scenario)
    try:
        ref = reference(root, 2)  # while the ranks run
    finally:
        codes, results = ranks.join_ranks(procs, root, scenario, DEADLINE_S)
    for rank, res in enumerate(results):
        if "after" not in res:
            pytest.fail(f"rank {rank} did not finish (exit codes {codes}):\n{res.get('crash', '(no traceback)')}")
    return results, ref


def _agreed(outcome: Any) -> Any:
    """An outcome with an agreed error's ``"rank r: "`` prefix dropped (another rank's error, raised on this one)."""
    if isinstance(outcome, tuple) and outcome[:1] == ("err",):
        return (*outcome[:2], re.sub(r"^rank \d+: ", "", outcome[2]))
    return outcome


def _check_cases(got: dict[str, Any], ref: dict[str, Any], who: str) -> None:
    assert got.keys() == ref.keys()
    got = {case: _agreed(outcome) for case, outcome in got.items()}
    wrong = [case for case in ref if got[case] != ref[case]]
    shown = "\n".join(f"{case}: got {got[case]!r}\n    want {ref[case]!r}" for case in wrong[:5])
    assert not wrong, f"{who}: {len(wrong)} cases differ from one Database, e.g.\n{shown}"


def test_reference_cases_mean_something(tmp_path):
    ref = reference(tmp_path)
    assert ref["text", "count"] == ("ok", N // 3)
    assert ref["none-match", "count"] == ("ok", 0)
    assert ref["missing", "count"][1] > 0 and ref["null", "count"][1] > 0 and ref["datetime", "count"][1] > 0
    _, _, meta = records()
    years = [m["year"] for m in meta if isinstance(m.get("year"), int)]
    assert any(isinstance(m.get("year"), str) for m in meta)
    assert ref["all", "min_max", "year"][1] == (min(years), max(years))  # numbers win over the years given as texts
    assert ref["missing", "min_max", "year"] == ("ok", None)
    assert ref["all", "min_max", "when"][1][0].year == 2020
    assert ("a", 10) in ref["all", "distinct", "tags"][1] and (1, 10) in ref["all", "distinct", "tags"][1]
    for case in ("bad-field", "bad-page", "bad-metadata", "bad-filter"):
        assert ref[case][0] == "err", (case, ref[case])
    assert ref["update"][0] == "ok" and ref["update"][1][0]
    assert ref["delete"][0] == "ok" and ref["after-delete"][1][1] == N - len(ref["delete"][1][0])


def test_one_process_sharded_where_matches_one_database(tmp_path):
    keys, values, meta = records()
    sdb = ShardedDatabase(tmp_path / "sharded", num_shards=SHARDS, encoder=ranks.encoder())
    try:
        sdb.add(keys, values, meta)
        assert all(len(db) for db in sdb.shards.values())  # the records are spread over every shard
        got = run_cases(sdb)
    finally:
        sdb.close()
    _check_cases(got, reference(tmp_path), "one process")


def test_two_ranks_where_matches_one_database(spawned):
    results, ref = spawned
    assert [res["shards"] for res in results] == [[0, 2], [1, 3]]
    for rank, res in enumerate(results):
        _check_cases(res["cases"], ref, f"rank {rank}")


def test_every_rank_gets_the_same_answers(spawned):
    results, _ = spawned
    first, second = ({case: _agreed(outcome) for case, outcome in res["cases"].items()} for res in results)
    assert first == second


def test_different_filters_or_metadata_raise_on_every_rank(spawned):
    results, _ = spawned
    for rank, res in enumerate(results):
        for case, what in (
            ("differ", "where with the same filter"),
            ("differ-update", "update with the same metadata"),
        ):
            assert res[case][:2] == ("err", "DistributedError"), (rank, res[case])
            assert what in res[case][2] and "rank 0" in res[case][2] and "rank 1" in res[case][2], res[case]
        assert res["one-bad-field"][:2] == ("err", "InvalidArgumentError"), (rank, res["one-bad-field"])
        assert res["after"] == ("ok", results[0]["cases"]["after-delete"][1][1]), (rank, res["after"])


def test_the_sharded_database_meets_the_protocol_on_two_ranks(spawned):
    results, _ = spawned
    assert [res["protocol"] for res in results] == [True, True]
