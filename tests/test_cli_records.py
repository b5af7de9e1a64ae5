"""``kvsearch list`` and ``kvsearch count``: the records a ``--where`` filter selects, paged, as text or JSON —
compared with ``db.where(...)`` on the same folder, plain and sharded (``build --shards``), run in process."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvsearch
from kvsearch.cli.program import main

ROWS = [
    {
        "key": f"name{i}",
        "value": f"first{i}",
        "lang": ["en", "fr", "de"][i % 3],
        "year": 1990 + i,
        "tags": "ab"[: i % 3],
    }
    for i in range(12)
]
FILTERS = [None, {"lang": "en"}, {"$or": [{"year": {"$gte": 1999}}, {"tags": {"$contains": "b"}}]}, {"lang": "xx"}]


@pytest.fixture(scope="module", params=[1, 2], ids=["plain", "sharded"])
def folder(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-records")
    source = tmp / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    db = tmp / "db"
    argv = ["build", str(db), "--from", str(source), "--metadata", "all", "--encoder", "ngram"]
    assert main(argv + (["--shards", "2"] if request.param == 2 else [])) == 0
    return db


def _expected(where):
    picked = [(i + 1, r) for i, r in enumerate(ROWS)]
    if where is not None:  # the reference: the same filter on a plain in-memory database
        db = kvsearch.Database(None, dim=2, value_dim=2)
        ones = np.ones((len(ROWS), 2), np.float32)
        metadata = [{k: v for k, v in r.items() if k not in ("key", "value")} for r in ROWS]
        db.add(
            [r["key"] for r in ROWS], [r["value"] for r in ROWS], metadata, key_embeddings=ones, value_embeddings=ones
        )
        keep = set(db.where(where).ids().tolist())
        picked = [(i, r) for i, r in picked if i in keep]
    return [r["key"] for _, r in picked]


@pytest.mark.parametrize("where", FILTERS)
def test_count_and_list_match_the_filter(folder, where, capsys):
    capsys.readouterr()
    extra = [] if where is None else ["--where", json.dumps(where)]
    assert main(["count", str(folder), *extra]) == 0
    want = _expected(where)
    assert capsys.readouterr().out == f"{len(want)}\n"
    assert main(["list", str(folder), *extra, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["key"] for r in rows) == sorted(want)
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)  # id order (a sharded database's ids interleave)
    for r in rows:
        source = next(s for s in ROWS if s["key"] == r["key"])
        assert r["value"] == source["value"]
        assert r["metadata"] == {k: v for k, v in source.items() if k not in ("key", "value")}
    assert main(["list", str(folder), *extra]) == 0
    text = capsys.readouterr().out
    assert text == "no records\n" if not want else len(text.splitlines()) == len(want)


@pytest.mark.parametrize("limit, offset", [(3, 0), (3, 3), (5, 10), (0, 0), (None, 11)])
def test_list_pages_in_id_order(folder, limit, offset, capsys):
    capsys.readouterr()
    assert main(["list", str(folder), "--json"]) == 0
    every = [r["id"] for r in json.loads(capsys.readouterr().out)]
    args = ["--offset", str(offset)] + ([] if limit is None else ["--limit", str(limit)])
    assert main(["list", str(folder), "--json", *args]) == 0
    page = [r["id"] for r in json.loads(capsys.readouterr().out)]
    assert page == (every[offset:] if limit is None else every[offset : offset + limit])


@pytest.mark.parametrize(
    "argv, says",
    [
        (["count", "DB", "--where", '{"a": {"$regex": "x"}}'], "at where.a.$regex"),
        (["list", "DB", "--where", '{"$or": []}'], "at where.$or"),
        (["list", "DB", "--limit", "-1"], "expected an integer >= 0"),
        (["list", "DB", "--offset", "x"], "expected an integer >= 0"),
    ],
)
def test_bad_arguments_are_usage_errors(folder, argv, says, capsys):
    argv = [str(folder) if a == "DB" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
