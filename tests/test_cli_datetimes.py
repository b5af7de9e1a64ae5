"""Datetimes and dates in the ``kvsearch`` command: ``--where`` compares them as Python's ``where=`` does.

The one form, ``{"$datetime": "<ISO 8601>"}`` / ``{"$date": "YYYY-MM-DD"}``, is read by ``--where`` and by ``build``
from JSONL, and printed by ``list --json`` / ``query --json``. Checked on generated records (aware datetimes with
several offsets, naive ones, dates, instants shared between the forms) and generated comparisons: ``count`` and
``list`` against the pure-Python rule (:func:`kvsearch.metadata.filters.matches`) and against Python's
``db.where(...)`` on the same folder, plain and sharded; ``list --json`` pasted back as ``--where`` and as a JSONL
file for ``build``; a bare ISO string compared with a field that holds datetimes refused with the way to write it,
and kept as a string on a field of texts. Run in process through ``main()``.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, date, datetime, timedelta, timezone

import pytest

import kvsearch
from kvsearch.cli.datetimes import tagged
from kvsearch.cli.program import main
from kvsearch.distributed import ShardedDatabase
from kvsearch.metadata.filters import matches

SEED = 35
OFFSETS = [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8))]
COMPARED = ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin"]


def _instant(rng: random.Random) -> datetime:
    """An instant (UTC) on a coarse grid, so that records share instants in different forms."""
    return datetime(2016, 1, 1, tzinfo=UTC) + timedelta(days=rng.randrange(0, 1500, 50), hours=rng.choice([0, 0, 6]))


def _form(rng: random.Random, instant: datetime) -> date:
    """The instant as an aware datetime (one of :data:`OFFSETS`), a naive one (UTC), or a date when at midnight."""
    kind = rng.choice(["aware", "naive", "date"])
    if kind == "date" and instant.hour == 0:
        return instant.date()
    if kind == "naive":
        return instant.replace(tzinfo=None)
    return instant.astimezone(rng.choice(OFFSETS))


def _rows(n: int = 40) -> list[dict]:
    rng = random.Random(SEED)
    rows = []
    for i in range(n):
        instant = _instant(rng)
        row = {"key": f"k{i}", "value": f"v{i}", "s": instant.date().isoformat()}  # a date written as text
        if rng.random() < 0.85:
            row["d"] = _form(rng, instant)
        rows.append(row)
    return rows


ROWS = _rows()


def _metadata(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("key", "value")}


def _write_jsonl(path, rows) -> None:
    """Rows as a JSONL file, datetimes and dates in the tagged form."""
    path.write_text("".join(json.dumps(tagged(r)) + "\n" for r in rows))


def _build(tmp, shards: int):
    source = tmp / "rows.jsonl"
    _write_jsonl(source, ROWS)
    db = tmp / "db"
    argv = ["build", str(db), "--from", str(source), "--metadata", "all", "--encoder", "ngram", "--quiet"]
    assert main(argv + (["--shards", str(shards)] if shards > 1 else [])) == 0
    return db


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The generated rows built by ``kvsearch build`` from JSONL (the tagged form) into a plain database."""
    return _build(tmp_path_factory.mktemp("cli-datetimes"), 1)


@pytest.fixture(scope="module", params=[1, 2], ids=["plain", "sharded"])
def folder(request, plain, tmp_path_factory):
    """The plain database, then the same rows in a sharded one (``build --shards 2``)."""
    return plain if request.param == 1 else _build(tmp_path_factory.mktemp("cli-datetimes-sharded"), 2)


def _open(folder):
    return ShardedDatabase(folder) if (folder / "shards.json").exists() else kvsearch.Database(folder)


def _rule(where: dict) -> list[str]:
    """The keys the pure-Python rule selects, in file order (a plain database's id order)."""
    return [r["key"] for r in ROWS if matches(_metadata(r), where, key=r["key"], value=r["value"])]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _filters(n: int) -> list[dict]:
    """Generated comparisons of the field ``d`` with datetimes and dates: stored values (equality hits), fresh
    instants in every form, lists for ``$in`` / ``$nin``, some under ``$not`` / ``$or``."""
    rng = random.Random(SEED + 1)
    stored = [r["d"] for r in ROWS if "d" in r]

    def operand() -> date:
        return rng.choice(stored) if rng.random() < 0.4 else _form(rng, _instant(rng))

    out = []
    for _ in range(n):
        op = rng.choice(COMPARED)
        value = [operand() for _ in range(rng.randint(1, 3))] if op in ("$in", "$nin") else operand()
        where = {"d": {op: value}} if op != "$eq" or rng.random() < 0.5 else {"d": value}
        shape = rng.random()
        if shape < 0.15:
            where = {"d": {"$not": {op: value}}} if op != "$eq" else {"$not": where}
        elif shape < 0.3:
            where = {"$or": [where, {"d": {"$gte": _form(rng, _instant(rng))}, "s": {"$lt": "2017-06-01"}}]}
        out.append(where)
    return out


@pytest.mark.parametrize("where", _filters(14))
def test_count_and_list_compare_datetimes_as_python(folder, where, capsys):
    text = json.dumps(tagged(where))
    want = sorted(_rule(where))
    with _open(folder) as db:  # Python's where= on the same folder, with the datetimes themselves
        assert sorted(r.key for r in db.where(where).records()) == want
    status, out, _ = _cli(capsys, "count", str(folder), "--where", text, "--json")
    assert (status, json.loads(out)) == (0, {"count": len(want)})
    status, out, _ = _cli(capsys, "list", str(folder), "--where", text, "--json")
    assert status == 0 and sorted(r["key"] for r in json.loads(out)) == want


def test_the_issue_example(tmp_path, capsys):
    """The reproduction of issue 35: one record at 2017-01-01 UTC; ``$lt`` 2018-01-01 counts it, as in Python."""
    source = tmp_path / "one.jsonl"
    source.write_text('{"key": "a", "value": "b", "d": {"$datetime": "2017-01-01T00:00:00+00:00"}}\n')
    db = str(tmp_path / "db")
    assert main(["build", db, "--from", str(source), "--metadata", "all", "--quiet"]) == 0
    with kvsearch.Database(db) as python:
        assert python.where({"d": {"$lt": datetime(2018, 1, 1, tzinfo=UTC)}}).count() == 1
    status, out, _ = _cli(capsys, "list", db, "--json")
    assert json.loads(out)[0]["metadata"] == {"d": {"$datetime": "2017-01-01T00:00:00+00:00"}}
    for written in [
        '{"$datetime": "2018-01-01T00:00:00+00:00"}',
        '{"$datetime": "2018-01-01"}',
        '{"$date": "2018-01-01"}',
    ]:
        status, out, _ = _cli(capsys, "count", db, "--where", f'{{"d": {{"$lt": {written}}}}}')
        assert (status, out) == (0, "1\n")
    status, out, _ = _cli(capsys, "count", db, "--where", '{"d": {"$datetime": "2017-01-01T00:00:00Z"}}')
    assert (status, out) == (0, "1\n")  # a tag as a plain value: equality, same instant
    for bare in ['{"d": {"$lt": "2018-01-01"}}', '{"d": "2017-01-01T00:00:00+00:00"}']:
        status, out, err = _cli(capsys, "count", db, "--where", bare)
        assert (status, out) == (1, "")
        assert "holds datetimes" in err and '{"$datetime": "20' in err and len(err.splitlines()) == 1


def test_list_json_round_trips_into_where(plain, capsys):
    """A record's datetime as ``list --json`` prints it, pasted back as ``$eq`` / ``$in`` / ``$lte``, selects what
    Python's ``where=`` selects with the datetime itself (every record printed, a sample pasted back)."""
    status, out, _ = _cli(capsys, "list", str(plain), "--json")
    rows = json.loads(out)
    assert status == 0 and [r["key"] for r in rows] == [r["key"] for r in ROWS]
    assert [r["metadata"] for r in rows] == [tagged(_metadata(row)) for row in ROWS]
    sample = random.Random(SEED + 2).sample([i for i, row in enumerate(ROWS) if "d" in row], 5)
    for printed, row in [(rows[i], ROWS[i]) for i in sample]:
        for where, python in [
            ({"d": printed["metadata"]["d"]}, {"d": row["d"]}),
            ({"d": {"$in": [printed["metadata"]["d"]]}}, {"d": {"$in": [row["d"]]}}),
            ({"d": {"$lte": printed["metadata"]["d"]}}, {"d": {"$lte": row["d"]}}),
        ]:
            status, out, _ = _cli(capsys, "list", str(plain), "--where", json.dumps(where), "--json")
            keys = [r["key"] for r in json.loads(out)]
            assert status == 0 and row["key"] in keys and keys == _rule(python)


def test_list_json_round_trips_through_build(plain, tmp_path, capsys):
    """``list --json`` turned into JSONL (key, value, the metadata fields) builds a database that lists the same,
    and ``build --upsert`` of it again changes nothing."""
    _, out, _ = _cli(capsys, "list", str(plain), "--json")
    rows = json.loads(out)
    source = tmp_path / "again.jsonl"
    source.write_text("".join(json.dumps({"key": r["key"], "value": r["value"], **r["metadata"]}) + "\n" for r in rows))
    copy = str(tmp_path / "copy")
    assert main(["build", copy, "--from", str(source), "--metadata", "all", "--quiet"]) == 0
    _, again, _ = _cli(capsys, "list", copy, "--json")
    assert [(r["key"], r["metadata"]) for r in json.loads(again)] == [(r["key"], r["metadata"]) for r in rows]
    with kvsearch.Database(copy) as db:
        for record, row in zip(db.where({}).records(), ROWS):  # the Python values themselves, offsets kept
            want = _metadata(row)
            assert record.metadata == want
            assert [type(v) for v in record.metadata.values()] == [type(v) for v in want.values()]
    status, out, _ = _cli(capsys, "build", copy, "--from", str(source), "--metadata", "all", "--upsert", "--quiet")
    assert status == 0 and f"0 added, 0 replaced, {len(rows)} unchanged" in out
    changed = rows[0]["key"]
    source.write_text(
        "".join(
            json.dumps({"key": r["key"], "value": r["value"], **r["metadata"]}) + "\n"
            for r in [{**rows[0], "metadata": {"d": {"$date": "1999-12-31"}}}, *rows[1:]]
        )
    )
    status, out, _ = _cli(capsys, "build", copy, "--from", str(source), "--metadata", "all", "--upsert", "--quiet")
    assert status == 0 and f"0 added, 1 replaced, {len(rows) - 1} unchanged" in out
    with kvsearch.Database(copy) as db:
        assert db.where({"d": date(1999, 12, 31)}).records()[0].key == changed


@pytest.mark.parametrize("op", COMPARED)
def test_a_bare_iso_string_against_datetimes_is_refused(folder, op, capsys):
    """On ``d`` (it holds datetimes) an ISO string is refused with the way to write it, nothing printed on
    stdout, exit status 1 — also inside ``$or`` / ``$not``, in each command that takes ``--where`` (one per
    operator, in turn)."""
    operand = ["2018-01-01"] if op in ("$in", "$nin") else "2018-01-01T00:00:00+00:00"
    where = [{"d": {op: operand}}, {"$or": [{"s": "x"}, {"d": {"$not": {op: operand}}}]}][COMPARED.index(op) % 2]
    command = (["count"], ["list", "--json"], ["query", "k1"])[COMPARED.index(op) % 3]
    status, out, err = _cli(capsys, command[0], str(folder), *command[1:], "--where", json.dumps(where))
    assert (status, out) == (1, ""), (command, where)
    assert err.startswith(f"kvsearch {command[0]}: error: expected a datetime or date for field 'd'")
    assert '{"$datetime": "2018-01-01T00:00:00' in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("op", COMPARED + ["$contains"])
def test_a_bare_iso_string_on_texts_stays_a_string(plain, op, capsys):
    """On ``s`` (dates written as text) and on a field no record has, an ISO string is a string comparison, as in
    Python; ``$contains`` on ``d`` (a substring test) is never refused."""
    operand = (
        ["2017-05-15", "2018-04-30"] if op in ("$in", "$nin") else "2017-05" if op == "$contains" else "2017-05-15"
    )
    where = {"$or": [{"s": {op: operand}}, {"absent": {op: operand}}]}
    status, out, _ = _cli(capsys, "count", str(plain), "--where", json.dumps(where), "--json")
    assert (status, json.loads(out)) == (0, {"count": len(_rule(where))})
    assert 0 < len(_rule({"s": {op: operand}})) < len(ROWS)  # a comparison that selects some texts, not all
    if op == "$contains":
        status, out, _ = _cli(capsys, "count", str(plain), "--where", '{"d": {"$contains": "2017"}}')
        assert (status, out) == (0, "0\n")


@pytest.mark.parametrize(
    "where, says",
    [
        ('{"d": {"$lt": {"$datetime": "2018-13-01"}}}', "expected an ISO 8601 datetime as the text of $datetime at "
         "where.d.$lt, got '2018-13-01'"),
        ('{"d": {"$in": [1, {"$date": "2018-01-01T00:00:00"}]}}', "expected an ISO 8601 date (YYYY-MM-DD) as the text "
         "of $date at where.d.$in[1]"),
        ('{"d": {"$datetime": 20180101}}', "as the text of $datetime at where.d, got 20180101"),
        ('{"d": {"$datetime": "2018-01-01", "$epoch_us": 0}}', "expected $datetime as the only key of its object at "
         "where.d"),
        ('{"d": {"$lt": {"$date": "2018-01-01", "x": 1}}}', "expected $date as the only key"),
        ('{"d": {"$contains": {"$date": "2018-01-01"}}}', "at where.d.$contains"),
    ],
)  # fmt: skip
def test_bad_tags_are_usage_errors(plain, where, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["count", str(plain), "--where", where])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1


def test_query_json_tags_datetimes(plain, capsys):
    status, out, _ = _cli(capsys, "query", str(plain), "k3", "--k", "all", "--json")
    assert status == 0
    for candidate in json.loads(out)[0]["candidates"]:
        row = next(r for r in ROWS if r["key"] == candidate["key"])
        assert candidate["metadata"] == tagged(_metadata(row))
    status, out, _ = _cli(capsys, "list", str(plain), "--limit", "1")  # the table stays human: ISO text
    assert status == 0 and "{" not in out and "s=" in out


def test_jsonl_build_refuses_bad_tags_with_their_lines(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    lines = [
        {"key": "a", "value": "x", "d": {"$datetime": "2018-01-01T00:00:00Z"}},
        {"key": "b", "value": "y", "d": {"$datetime": "yesterday"}},
        {"key": "c", "value": "z", "d": {"at": "2018-01-01"}},
        {"key": "e", "value": "w", "d": {"$date": "2018-01-01", "$epoch_us": 0}},
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    db = tmp_path / "db"
    status, out, err = _cli(capsys, "build", str(db), "--from", str(source), "--metadata", "all", "--quiet")
    assert (status, out) == (1, "")
    assert "3 bad rows" in err and "line 2: expected an ISO 8601 datetime as the text of $datetime" in err
    assert "line 3: expected a JSON scalar (text, number, true, false or null) or a tagged datetime" in err
    assert "line 4: expected $date as the only key" in err
    assert not db.exists()  # nothing written


def test_count_json_and_the_help(plain, capsys):
    status, out, _ = _cli(capsys, "count", str(plain), "--json")
    assert (status, out) == (0, json.dumps({"count": len(ROWS)}) + "\n")
    for command in ("count", "list", "query"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert '{"$datetime": "2018-01-01T00:00:00+00:00"}' in text and '{"$date": "2018-01-01"}' in text, command
        if command == "count":
            assert 'print {"count": N}' in text
