"""Streaming ingest of CSV, TSV and JSONL files into a database, batch by batch, all or nothing.

    from kvsearch.ingest import ingest_file
    n = ingest_file(db, "authors.csv", key="last", value="first")   # records added

Two streaming passes over the file, so memory stays bounded by one batch (plus the set of keys seen,
which duplicate detection needs):

1. validate every row: the key and value columns exist, a CSV / TSV row has no more fields than the
   header and no unterminated quote, the key is not empty, no key repeats in the file or is already
   stored (keys compared as the database compares them: NFC, surrounding whitespace stripped), JSON
   lines parse. Every bad row is reported with its line number in one
   :class:`~kvsearch.errors.BadFileError`, and nothing is written.
2. write: ``batch_size`` rows at a time are encoded and added (``Database.add``: store, then index),
   with a tqdm bar, all in one transaction of the database (``Database.atomic``): if a write fails midway
   (a full disk too), or the run is interrupted or killed, nothing of the file is kept. A database without
   ``atomic`` (a sharded one) commits batch by batch, and the records this ingest added are deleted again.

Line numbers are 1-based physical lines of the file (a CSV header is line 1; a quoted CSV field that
spans lines is reported at the line where its record starts).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tqdm import tqdm

from kvsearch.errors import BadFileError, InvalidArgumentError, KVSearchError, UnknownOptionError
from kvsearch.inputs import normalize_key

if TYPE_CHECKING:
    from kvsearch.database import Database

__all__ = ["FORMATS", "Row", "ingest_file", "read_rows", "detect_format"]

Format = Literal["csv", "tsv", "jsonl"]
#: The file formats ingest reads, and the suffixes that name them.
FORMATS: dict[str, Format] = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
MAX_PROBLEMS = 1000  # bad rows kept on the error (all are counted); the message shows the first few
_SHOWN = 5


@dataclass(frozen=True)
class Row:
    """One record of an input file.

    Attributes:
        line: the 1-based line number where the record starts.
        fields: the chosen columns' texts, in the order asked for (None where ``problem`` is set).
        problem: what is wrong with the row, or None.
    """

    line: int
    fields: tuple[str, ...] | None
    problem: str | None = None


def detect_format(path: str | os.PathLike[str], format: str | None = None) -> Format:
    """The file format: the one given, else the one the suffix names.

    Raises:
        UnknownOptionError: an unknown format, or a suffix that names none (pass ``format``).
    """
    if format is not None:
        if format not in ("csv", "tsv", "jsonl"):
            raise UnknownOptionError(f"expected format 'csv', 'tsv' or 'jsonl', got {format!r}")
        return format  # type: ignore[return-value]
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise UnknownOptionError(
            f"cannot tell the format of {os.fspath(path)!r} from its suffix {suffix!r}: expected one of "
            f"{sorted(FORMATS)}, or pass format='csv' | 'tsv' | 'jsonl'"
        )
    return FORMATS[suffix]


def read_rows(path: str | os.PathLike[str], columns: tuple[str, ...], *, format: str | None = None) -> Iterator[Row]:
    """Stream the chosen columns of a CSV, TSV or JSONL file, one :class:`Row` at a time.

    Rows with a missing column, more fields than the header (CSV / TSV), a quote that is never closed (CSV /
    TSV: reported at its record, not read as a field running to the end of the file), a non-text JSON field or
    a line that is not a JSON object come with a ``problem`` instead of fields; blank lines are skipped. The
    file is never read whole.

    Args:
        path: the file.
        columns: the column names (CSV/TSV header names, JSON object fields) to read.
        format: ``"csv"``, ``"tsv"``, ``"jsonl"``, or None for the suffix's.

    Yields:
        One Row per record, in file order.

    Raises:
        BadFileError: the file cannot be opened or decoded as UTF-8, or a CSV/TSV header lacks a column.
        UnknownOptionError: the format is unknown.
    """
    fmt = detect_format(path, format)
    if not columns or not all(isinstance(c, str) and c for c in columns):
        raise InvalidArgumentError(f"expected non-empty column names, got {columns!r}")
    try:
        handle = open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - closed in the finally below
    except OSError as exc:
        raise BadFileError(f"cannot open {os.fspath(path)!r}: {exc.strerror or exc}") from None
    try:
        if fmt == "jsonl":
            yield from _jsonl_rows(handle, columns)
        else:
            yield from _delimited_rows(handle, columns, "," if fmt == "csv" else "\t", os.fspath(path))
    except UnicodeDecodeError as exc:
        raise BadFileError(f"{os.fspath(path)!r} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except csv.Error as exc:
        raise BadFileError(f"{os.fspath(path)!r} is not valid {fmt.upper()}: {exc}") from None
    finally:
        handle.close()


class _Lines:
    """The lines of a file as ``csv.reader`` reads them, keeping those of the record being read.

    ``record`` holds the physical lines read since it was last emptied; ``done`` says the file ended.
    """

    def __init__(self, handle: Iterator[str]) -> None:
        self._lines = iter(handle)
        self.record: list[str] = []
        self.done = False

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        try:
            line = next(self._lines)
        except StopIteration:
            self.done = True
            raise
        self.record.append(line)
        return line


def _runs_to_the_end(lines: list[str], delimiter: str) -> bool:
    """Whether a record read up to the end of the file is inside a quoted field there (an unterminated quote).

    Read leniently, such a field silently takes every line after it; read strictly (only this record) it is
    "unexpected end of data".
    """
    try:
        for _ in csv.reader(lines, delimiter=delimiter, strict=True):
            pass
    except csv.Error as exc:
        return "end of data" in str(exc)
    return False


def _delimited_rows(handle, columns: tuple[str, ...], delimiter: str, name: str) -> Iterator[Row]:
    lines = _Lines(handle)
    reader = csv.reader(lines, delimiter=delimiter)
    header = next(reader, None)
    if header is None:
        return
    header = [h.strip() for h in header]
    missing = [c for c in columns if c not in header]
    if missing:
        raise BadFileError(
            f"{name!r} line 1: the header has no column {missing[0]!r} (columns: {', '.join(header) or 'none'})",
            [(1, f"no column {c!r} in the header") for c in missing],
        )
    positions = [header.index(c) for c in columns]
    start = reader.line_num + 1  # the physical line where the next record begins
    lines.record = []
    for fields in reader:
        line, start = start, reader.line_num + 1
        record, lines.record = lines.record, []
        if lines.done and _runs_to_the_end(record, delimiter):
            yield Row(line, None, "unterminated quote: a quoted field opened here runs to the end of the file")
            continue
        if not fields:
            continue  # a blank line
        if len(fields) > len(header):
            yield Row(
                line,
                None,
                f"{len(fields)} fields, header has {len(header)}: expected one field per column "
                "(an unquoted delimiter?)",
            )
            continue
        if len(fields) <= max(positions):
            absent = [c for c, p in zip(columns, positions) if p >= len(fields)]
            yield Row(line, None, f"missing column {absent[0]!r} ({len(fields)} fields, header has {len(header)})")
            continue
        yield Row(line, tuple(fields[p] for p in positions))


def _jsonl_rows(handle, columns: tuple[str, ...]) -> Iterator[Row]:
    for line, text in enumerate(handle, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            yield Row(line, None, f"bad JSON: {exc.msg} at column {exc.colno}")
            continue
        if not isinstance(obj, dict):
            yield Row(line, None, f"expected a JSON object, got {type(obj).__name__}")
            continue
        absent = [c for c in columns if c not in obj]
        if absent:
            yield Row(line, None, f"missing column {absent[0]!r}")
            continue
        bad = [c for c in columns if not isinstance(obj[c], str)]
        if bad:
            yield Row(line, None, f"expected text in {bad[0]!r}, got {type(obj[bad[0]]).__name__}")
            continue
        yield Row(line, tuple(obj[c] for c in columns))


def _validate(db: Database, path: str | os.PathLike[str], key: str, value: str, fmt: Format, progress: bool) -> int:
    """First pass: count the good rows; raise BadFileError listing every bad one."""
    problems: list[tuple[int, str]] = []
    total_bad = 0
    seen: dict[str, int] = {}  # key -> the line where it first appeared
    columns = (key, value) if key != value else (key,)
    count = 0

    def bad(line: int, problem: str) -> None:
        nonlocal total_bad
        total_bad += 1
        if len(problems) < MAX_PROBLEMS:
            problems.append((line, problem))

    rows = tqdm(read_rows(path, columns, format=fmt), desc="validating", unit="rec", disable=not progress)
    for row in rows:
        if row.problem is not None:
            bad(row.line, row.problem)
            continue
        k = normalize_key(row.fields[0])  # as the database compares and stores it
        v = row.fields[-1]
        if not k:
            bad(row.line, f"empty key {row.fields[0]!r}")
        elif "\x00" in k or "\x00" in v:
            bad(row.line, "a NUL character in the key or value")
        elif k in seen:
            bad(row.line, f"duplicate key {k!r} (first on line {seen[k]})")
        elif k in db:
            bad(row.line, f"key {k!r} is already stored in the database")
        else:
            seen[k] = row.line
            count += 1
    if total_bad:
        shown = "; ".join(f"line {line}: {problem}" for line, problem in problems[:_SHOWN])
        more = f"; and {total_bad - _SHOWN} more" if total_bad > _SHOWN else ""
        raise BadFileError(
            f"{os.fspath(path)!r} has {total_bad} bad row{'s' if total_bad > 1 else ''}, nothing was written: "
            f"{shown}{more}",
            problems,
        )
    return count


def ingest_file(
    db: Database,
    path: str | os.PathLike[str],
    *,
    key: str = "key",
    value: str = "value",
    format: str | None = None,
    batch_size: int = 1024,
    progress: bool = True,
) -> int:
    """Add every record of a CSV, TSV or JSONL file to a database: validated first, then written in batches.

    Args:
        db: an open database with an encoder for key and value texts.
        path: the file; CSV and TSV need a header row naming the columns, JSONL one object per line.
        key: the column (or JSON field) holding the keys.
        value: the column holding the values.
        format: ``"csv"``, ``"tsv"``, ``"jsonl"``, or None to take it from the suffix (.csv, .tsv/.tab,
            .jsonl/.ndjson).
        batch_size: records encoded and added at once; memory grows with it, not with the file.
        progress: show tqdm bars (on stderr) for validation and for encoding + indexing.

    Returns:
        How many records were added (0 for a file without records).

    Raises:
        BadFileError: the file cannot be read, or has bad rows (missing column, extra fields, unterminated
            quote, empty key, duplicate key in the file or already stored, bad JSON); ``.problems`` lists
            them with line numbers, and nothing was written.
        UnknownOptionError: an unknown format, or a suffix that names none.
        InvalidArgumentError: a bad argument (such as ``batch_size < 1``).
        KVSearchError: a write failed (``DiskFullError``: no space left); nothing of the file was kept.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"expected batch_size as a positive int, got {batch_size!r}")
    for name, column in (("key", key), ("value", value)):
        if not isinstance(column, str) or not column:
            raise InvalidArgumentError(f"expected the {name} column as a non-empty name, got {column!r}")
    fmt = detect_format(path, format)
    if db.encoder is None or db.value_encoder is None:
        raise InvalidArgumentError("expected a database with encoders for key and value texts, got one without")
    count = _validate(db, path, key, value, fmt, progress)
    if count == 0:
        return 0

    columns = (key, value) if key != value else (key,)
    added: list[int] = []
    bar = tqdm(total=count, desc="encoding + indexing", unit="rec", disable=not progress, dynamic_ncols=True)
    atomic = getattr(db, "atomic", None)  # one transaction: a full disk or a kill leaves nothing of the file
    try:
        with contextlib.nullcontext() if atomic is None else atomic():
            keys: list[str] = []
            values: list[str] = []
            for row in read_rows(path, columns, format=fmt):
                if row.problem is not None:
                    raise BadFileError(f"{os.fspath(path)!r} line {row.line} changed during ingest: {row.problem}")
                keys.append(row.fields[0])
                values.append(row.fields[-1])
                if len(keys) == batch_size:
                    added += db.add(keys=keys, values=values)
                    bar.update(len(keys))
                    keys, values = [], []
            if keys:
                added += db.add(keys=keys, values=values)
                bar.update(len(keys))
    except BaseException:
        if atomic is None:
            _undo(db, added)
        raise
    finally:
        bar.close()
    return len(added)


def _undo(db: Database, ids: list[int]) -> None:
    """Delete what this ingest added (best effort in chunks: the original error is the one raised)."""
    for start in range(0, len(ids), 65536):
        try:
            db.delete(ids[start : start + 65536])
        except KVSearchError:  # pragma: no cover - a failing store while undoing; the first error wins
            pass
