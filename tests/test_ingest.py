"""Streaming file ingest: formats, batching, bad rows with line numbers, all-or-nothing writes."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import kvsearch
from kvsearch.cli.ingest import ingest_file, read_rows
from kvsearch.errors import BadFileError, InvalidArgumentError, UnknownOptionError

RECORDS = [("Zhang", "Aston"), ("Lipton", "Zachary"), ("Li", "Mu"), ("Smola", "Alex"), ("Hu", "Rachel")]


def small_db() -> kvsearch.Database:
    return kvsearch.Database(None, encoder=kvsearch.NgramEncoder(dim=16, num_buckets=512), device="cpu")


def write(path, fmt: str, records, key: str = "last", value: str = "first") -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        if fmt == "jsonl":
            for k, v in records:
                f.write(json.dumps({key: k, value: v, "other": 1}) + "\n")
        else:
            writer = csv.writer(f, delimiter="," if fmt == "csv" else "\t")
            writer.writerow(["id", key, value])
            writer.writerows([i, k, v] for i, (k, v) in enumerate(records))


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
@pytest.mark.parametrize("batch_size", [1, 2, 1024])
def test_ingest_matches_a_direct_add(tmp_path, fmt, batch_size):
    path = tmp_path / f"authors.{fmt}"
    write(path, fmt, RECORDS)
    db = small_db()
    assert ingest_file(db, path, key="last", value="first", batch_size=batch_size, progress=False) == len(RECORDS)
    reference = small_db()
    reference.add(keys=[k for k, _ in RECORDS], values=[v for _, v in RECORDS])
    assert len(db) == len(RECORDS)
    for k, v in RECORDS:
        assert db.lookup(k) == v
    torch.testing.assert_close(db.store.table.keys, reference.store.table.keys)  # same embeddings, same order
    assert [h.key for h in db.search("Lipto", k=3)] == [h.key for h in reference.search("Lipto", k=3)]


def test_writes_in_batches_of_at_most_batch_size(tmp_path, monkeypatch):
    path = tmp_path / "a.csv"
    write(path, "csv", RECORDS)
    db = small_db()
    sizes = []
    real_add = db.add

    def spy(keys, values, metadata=None):
        sizes.append(len(keys))
        return real_add(keys=keys, values=values, metadata=metadata)

    monkeypatch.setattr(db, "add", spy)
    ingest_file(db, path, key="last", value="first", batch_size=2, progress=False)
    assert sizes == [2, 2, 1]


def test_read_rows_streams_without_reading_the_whole_file(tmp_path):
    path = tmp_path / "a.jsonl"
    good = json.dumps({"key": "a", "value": "b"}) + "\n"
    path.write_bytes(good.encode() * 20_000 + b"\xff\xfe broken utf-8\n")  # ~550 kB, bad bytes at the end
    rows = read_rows(path, ("key", "value"))
    assert next(rows).fields == ("a", "b")  # read one buffer, not the file: the bad bytes are not reached
    with pytest.raises(BadFileError, match="not UTF-8"):
        list(rows)


def test_bad_rows_are_all_reported_with_line_numbers_and_nothing_is_written(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('last,first\nZhang,Aston\n,Nobody\nZhang,Again\nShort\n"Multi\nline",x\nHu,Rachel\n   ,blank\n')
    db = small_db()
    db.add(keys=["Hu"], values=["Rachel"])
    version = db.store.version
    with pytest.raises(BadFileError) as info:
        ingest_file(db, path, key="last", value="first", progress=False)
    assert info.value.problems == [
        (3, "empty key ''"),
        (4, "duplicate key 'Zhang' (first on line 2)"),
        (5, "missing column 'first' (1 field, header has 2)"),
        (8, "key 'Hu' is already stored in the database"),
        (9, "empty key '   '"),
    ]
    assert "5 bad rows" in str(info.value) and "\n" not in str(info.value)
    assert len(db) == 1 and db.store.version == version


def test_jsonl_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = ['{"key": "a", "value": "1"}', "{not json", "", "[1, 2]", '{"key": "b"}', '{"key": 3, "value": "x"}']
    path.write_text("\n".join(lines) + "\n")
    db = small_db()
    with pytest.raises(BadFileError) as info:
        ingest_file(db, path, progress=False)
    assert [line for line, _ in info.value.problems] == [2, 4, 5, 6]
    assert info.value.problems[0][1].startswith("bad JSON")
    assert "missing column 'value'" in info.value.problems[2][1]
    assert len(db) == 0


def test_missing_header_column_names_the_columns(tmp_path):
    path = tmp_path / "a.tsv"
    write(path, "tsv", RECORDS)
    with pytest.raises(BadFileError, match=r"line 1: the header has no column 'key' \(columns: id, last, first\)"):
        ingest_file(small_db(), path, progress=False)


def test_a_failing_write_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    path = tmp_path / "a.csv"
    write(path, "csv", RECORDS)
    db = small_db()
    db.add(keys=["Werness"], values=["Brent"])
    real_add = db.add
    calls = []

    def flaky(keys, values, metadata=None):
        calls.append(len(keys))
        if len(calls) == 2:
            raise OSError("disk full")
        return real_add(keys=keys, values=values, metadata=metadata)

    monkeypatch.setattr(db, "add", flaky)
    with pytest.raises(OSError, match="disk full"):
        ingest_file(db, path, key="last", value="first", batch_size=2, progress=False)
    assert calls == [2, 2]
    assert len(db) == 1 and "Werness" in db and "Zhang" not in db
    assert db.index.ntotal == 1  # the index forgot them too
    assert [h.key for h in db.search("Zhang", k=5)] == ["Werness"]


def test_format_from_suffix_or_argument(tmp_path):
    path = tmp_path / "authors.txt"
    write(path, "tsv", RECORDS)
    with pytest.raises(UnknownOptionError, match="suffix"):
        ingest_file(small_db(), path, key="last", value="first", progress=False)
    assert ingest_file(small_db(), path, key="last", value="first", format="tsv", progress=False) == len(RECORDS)


def test_empty_file_and_bad_arguments(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    db = small_db()
    assert ingest_file(db, path, progress=False) == 0
    with pytest.raises(InvalidArgumentError):
        ingest_file(db, path, batch_size=0)
    with pytest.raises(BadFileError, match="cannot open"):
        ingest_file(db, tmp_path / "missing.csv", progress=False)


def test_progress_bar_on_stderr(tmp_path, capsys):
    path = tmp_path / "a.csv"
    write(path, "csv", RECORDS)
    ingest_file(small_db(), path, key="last", value="first", progress=True)
    err = capsys.readouterr().err
    assert "encoding + indexing" in err and f"{len(RECORDS)}/{len(RECORDS)}" in err


# ----------------------------------------------------------------------------- rows that do not fit the header


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_a_row_with_extra_fields_is_reported_not_truncated(tmp_path, fmt):
    sep = "," if fmt == "csv" else "\t"
    path = tmp_path / f"authors.{fmt}"
    lines = ["last", "Zhang" + sep + "Aston", sep.join(["Smith", "John", " Jr."]), "Li" + sep + "Mu"]
    path.write_text("\n".join([lines[0] + sep + "first", *lines[1:]]) + "\n")
    db = small_db()
    with pytest.raises(BadFileError) as info:
        ingest_file(db, path, key="last", value="first", progress=False)
    expected = "3 fields, header has 2: expected one field per column (an unquoted delimiter?)"
    assert info.value.problems == [(3, expected)] and f"line 3: {expected}" in str(info.value)
    assert len(db) == 0  # nothing written, not "John"


@pytest.mark.parametrize(
    "text, line",
    [
        ('last,first\nZhang,Aston\nSmith,"John\nLi,Mu\nHu,Rachel\n', 3),  # in the value: it would swallow the rest
        ('last,first\nZhang,Aston\n"Smith,John\nLi,Mu\n', 3),  # in the key
        ('last,first\nZhang,Aston\nLi,Mu\nSmith,"John', 4),  # on the last line, no newline
    ],
)
def test_an_unterminated_quote_is_reported_as_such(tmp_path, text, line):
    path = tmp_path / "a.csv"
    path.write_text(text)
    db = small_db()
    with pytest.raises(BadFileError) as info:
        ingest_file(db, path, key="last", value="first", progress=False)
    assert info.value.problems == [(line, "unterminated quote: a quoted field opened here runs to the end of the file")]
    assert "missing column" not in str(info.value)
    assert len(db) == 0


def test_a_quoted_field_over_several_lines_and_a_last_line_without_newline_still_read(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text('last,first\n"Multi\nline",x\nLi,"Mu, Jr."\nHu,Rachel')
    assert [row.fields for row in read_rows(path, ("last", "first"))] == [
        ("Multi\nline", "x"),
        ("Li", "Mu, Jr."),
        ("Hu", "Rachel"),
    ]


def test_the_cli_build_reports_extra_fields_and_quotes_on_one_line(tmp_path, capsys):
    from kvsearch.cli.program import main

    path = tmp_path / "a.csv"
    path.write_text('last,first\nZhang,Aston\nSmith,John, Jr.\nLi,Mu\nHu,"Rachel\n')
    argv = ["build", str(tmp_path / "db"), "--from", str(path), "--key", "last", "--value", "first", "--quiet"]
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"kvsearch build: error: '{path}' has 2 bad rows, nothing was written: "
        "line 3: 3 fields, header has 2: expected one field per column (an unquoted delimiter?); "
        "line 5: unterminated quote: a quoted field opened here runs to the end of the file"
    )
    assert not (tmp_path / "db").exists()
