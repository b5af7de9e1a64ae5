"""File ingest with metadata columns, and ``upsert_file``: what each kind of field becomes, and the counts of
an upsert (added, replaced, unchanged) against what a direct ``Database.upsert`` stores."""

from __future__ import annotations

import json

import pytest

import kvsearch
from kvsearch.cli.ingest import IngestCounts, csv_scalar, ingest_file, read_rows, upsert_file
from kvsearch.errors import BadFileError, InvalidArgumentError


def small_db() -> kvsearch.Database:
    return kvsearch.Database(None, encoder=kvsearch.NgramEncoder(dim=16, num_buckets=512), device="cpu")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2001", 2001),
        ("-3", -3),
        ("0", 0),
        ("1.5", 1.5),
        ("-2e3", -2000.0),
        ("1E-2", 0.01),
        ("007", "007"),  # a code with leading zeros keeps them
        ("+3", "+3"),
        (" 3", " 3"),
        ("1_000", "1_000"),
        ("nan", "nan"),
        ("inf", "inf"),
        ("1e999", "1e999"),  # not finite as a float
        (str(2**63), str(2**63)),  # beyond 64 bits
        ("true", "true"),
        ("en", "en"),
        ("", ""),
    ],
)
def test_csv_scalar(text, expected):
    value = csv_scalar(text)
    assert value == expected and type(value) is type(expected)


def test_csv_metadata_columns_named_and_all(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("key,value,year,lang,code\nLi,Mu,2013,zh,007\nHu,Rachel,,en,\nWu,Jo,1.5,,x\n")
    rows = list(read_rows(path, ("key", "value"), metadata=["year", "lang"]))
    assert [r.metadata for r in rows] == [{"year": 2013, "lang": "zh"}, {"lang": "en"}, {"year": 1.5}]
    rows = list(read_rows(path, ("key", "value"), metadata="all"))
    assert rows[0].metadata == {"year": 2013, "lang": "zh", "code": "007"}  # empty fields are left out
    assert [r.fields for r in rows] == [("Li", "Mu"), ("Hu", "Rachel"), ("Wu", "Jo")]
    assert [r.metadata for r in read_rows(path, ("key", "value"))] == [None, None, None]
    with pytest.raises(BadFileError, match="the header has no column 'month'"):
        list(read_rows(path, ("key", "value"), metadata=["month"]))
    with pytest.raises(InvalidArgumentError, match='expected metadata as a list of column names or "all"'):
        list(read_rows(path, ("key", "value"), metadata="year"))


def test_jsonl_metadata_keeps_json_types_and_refuses_arrays(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [
        {"key": "Li", "value": "Mu", "year": 2013, "ok": True, "note": None, "lang": "zh"},
        {"key": "Hu", "value": "Rachel", "year": 2020.5},
        {"key": "Wu", "value": "Jo", "tags": ["a"]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"key": "X", "value": "Y", "n": NaN}\n')
    rows = list(read_rows(path, ("key", "value"), metadata="all"))
    assert rows[0].metadata == {"year": 2013, "ok": True, "note": None, "lang": "zh"}
    assert rows[1].metadata == {"year": 2020.5}
    assert (
        rows[2].problem
        == "expected a JSON scalar (text, number, true, false or null) in metadata field 'tags', got an array"
    )
    assert rows[3].problem == "expected a finite number in metadata field 'n', got nan"
    named = list(read_rows(path, ("key", "value"), metadata=["year", "lang"]))
    assert [r.metadata for r in named[:3]] == [{"year": 2013, "lang": "zh"}, {"year": 2020.5}, {}]  # absent: left out
    with pytest.raises(BadFileError) as error:
        ingest_file(small_db(), path, metadata="all", progress=False)
    assert [line for line, _ in error.value.problems] == [3, 4]


def test_ingest_file_stores_metadata_for_where(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("key,value,year,lang\nLi,Mu,2013,zh\nLipton,Zachary,2014,en\nHu,Rachel,2020,en\n")
    db = small_db()
    assert ingest_file(db, path, metadata="all", progress=False) == 3
    assert db.get(db.ids_of_keys(["Li"]).item()).metadata == {"year": 2013, "lang": "zh"}
    hits = db.search("Li", k=3, where={"year": {"$gte": 2014}, "lang": "en"})
    assert sorted(h.key for h in hits) == ["Hu", "Lipton"]


def test_upsert_file_counts_and_converges(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("key,value,lang\nLi,Mu,zh\nHu,Rachel,en\nWu,Jo,en\n")
    db = small_db()
    db.add(keys=["Li", "Hu", "Smola"], values=["Mu", "Rachel", "Alex"], metadata=[{"lang": "zh"}, None, None])
    before = db.ids_of_keys(["Li", "Hu"]).tolist()
    # Li: same value and metadata -> unchanged; Hu: metadata differs -> replaced (same id); Wu: added
    assert upsert_file(db, path, metadata=["lang"], batch_size=2, progress=False) == IngestCounts(1, 1, 1)
    assert db.ids_of_keys(["Li", "Hu"]).tolist() == before
    assert db.lookup("Smola") == "Alex"  # not in the file: an upsert never deletes
    reference = small_db()
    reference.upsert(
        keys=["Li", "Hu", "Wu"],
        values=["Mu", "Rachel", "Jo"],
        metadata=[{"lang": "zh"}, {"lang": "en"}, {"lang": "en"}],
    )
    for key in ("Li", "Hu", "Wu"):
        mine, theirs = db.get(db.ids_of_keys([key]).item()), reference.get(reference.ids_of_keys([key]).item())
        assert (mine.value, mine.metadata) == (theirs.value, theirs.metadata)
        assert mine.key_embedding.tolist() == theirs.key_embedding.tolist()
    assert upsert_file(db, path, metadata=["lang"], progress=False) == IngestCounts(0, 0, 3)  # converged
    # without metadata columns the file brings none: values are compared, the stored metadata stays
    assert upsert_file(db, path, progress=False) == IngestCounts(0, 0, 3)
    path.write_text("key,value,lang\nLi,Mo,zh\nHu,Rachel,en\nWu,Jo,en\n")
    assert upsert_file(db, path, progress=False) == IngestCounts(0, 1, 2)
    assert (db.lookup("Li"), db.get(db.ids_of_keys(["Li"]).item()).metadata) == ("Mo", {"lang": "zh"})
    path.write_text("key,value\nLi,Mu\nLi,Mo\n")
    with pytest.raises(BadFileError, match=r"duplicate key 'Li' \(first on line 2\)"):  # still a bad row
        upsert_file(db, path, progress=False)


def test_add_onto_stored_keys_suggests_upsert(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("key,value\nLi,Mu\nNew,One\n")
    db = small_db()
    db.add(keys=["Li"], values=["Mu"])
    with pytest.raises(BadFileError) as error:
        ingest_file(db, path, progress=False)
    assert str(error.value) == (
        f"'{path}' has 1 bad row, nothing was written (1 with a key already stored: to add the new records and "
        "replace the changed ones, upsert with 'kvsearch build --upsert' or kvsearch.cli.ingest.upsert_file): line 2: "
        "key 'Li' is already stored in the database"
    )
    assert len(db) == 1
