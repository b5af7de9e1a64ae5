"""Streaming ingest of CSV, TSV and JSONL files into a database, batch by batch, all or nothing.

    from kvsearch.cli.ingest import ingest_file, upsert_file
    n = ingest_file(db, "authors.csv", key="last", value="first", metadata=["year", "lang"])   # records added
    counts = upsert_file(db, "authors.csv", key="last", value="first", metadata="all")  # added / replaced / unchanged

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

``upsert_file`` makes the database hold what the file holds: a new key is added, a stored key whose value or
metadata differs is replaced (same id), a stored record equal to its row is left alone (not rewritten). Each
batch is written whole; a run that fails or is killed midway keeps the batches it wrote, and running it again
finishes the job (that is how ``kvsearch build --upsert`` resumes a build killed midway).

Metadata (``metadata=["year", "lang"]`` or ``"all"``: every column but the key and the value) is stored with
each record, for ``where=`` filters. A CSV / TSV field is a number when it reads as one — an integer
(``2001``, ``-3``; not ``007`` or ``+3``, which stay text) or a finite decimal number (``1.5``, ``-2e3``) —, else
the text as it is (see :func:`csv_scalar`); an empty field is left out of the record's metadata (CSV cannot
say null). A JSONL field keeps its JSON type (text, number, true / false, null), and the tagged objects
``{"$datetime": "<ISO 8601>"}`` and ``{"$date": "YYYY-MM-DD"}`` are a datetime and a date (what ``kvsearch list
--json`` prints: see :mod:`kvsearch.cli.datetimes`); a named field that an object lacks is left out; an array,
another object or a tag whose text is not ISO 8601 is a bad row.

Line numbers are 1-based physical lines of the file (a CSV header is line 1; a quoted CSV field that
spans lines is reported at the line where its record starts).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tqdm import tqdm

from kvsearch.cli.datetimes import decode_tag, tagged
from kvsearch.cli.printing import counted
from kvsearch.contract import parts_of
from kvsearch.errors import BadFileError, InvalidArgumentError, KVSearchError, UnknownOptionError
from kvsearch.inputs import normalize_key
from kvsearch.metadata.codec import check as check_metadata

if TYPE_CHECKING:
    from kvsearch.contract import DatabaseProtocol
    from kvsearch.storage.store import Record

__all__ = [
    "FORMATS",
    "Row",
    "IngestCounts",
    "ingest_file",
    "upsert_file",
    "read_rows",
    "detect_format",
    "csv_scalar",
    "stored_records",
]

Format = Literal["csv", "tsv", "jsonl"]
#: The file formats ingest reads, and the suffixes that name them.
FORMATS: dict[str, Format] = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl"}
MAX_PROBLEMS = 1000  # bad rows kept on the error (all are counted); the message shows the first few
_SHOWN = 5
#: Which columns become metadata: a list of names, or "all" (every column but the key and the value).
MetadataColumns = Sequence[str] | Literal["all"] | None
_INT = re.compile(r"-?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")


@dataclass(frozen=True)
class Row:
    """One record of an input file.

    Attributes:
        line: the 1-based line number where the record starts.
        fields: the chosen columns' texts, in the order asked for (None where ``problem`` is set).
        problem: what is wrong with the row, or None.
        metadata: the metadata columns asked for, as JSON scalars (see :func:`csv_scalar` for CSV / TSV);
            None when none were asked for or ``problem`` is set.
    """

    line: int
    fields: tuple[str, ...] | None
    problem: str | None = None
    metadata: dict[str, Any] | None = None


@dataclass(frozen=True)
class IngestCounts:
    """What :func:`upsert_file` did.

    Attributes:
        added: records whose key was not stored.
        replaced: stored records whose value or metadata differed from the file's (rewritten, same id).
        unchanged: stored records equal to the file's row (key, value and metadata): not rewritten.
    """

    added: int = 0
    replaced: int = 0
    unchanged: int = 0


def csv_scalar(text: str) -> str | int | float:
    """A CSV / TSV field as a metadata value: an int or a float when the text is one, else the text itself.

    An int is ``-?(0|[1-9][0-9]*)`` within 64 bits (``"2001"``, ``"-3"``; not ``"007"``, ``"+3"`` or ``" 3"``,
    which stay text, so codes with leading zeros keep them); a float is that with a fraction and/or an exponent
    (``"1.5"``, ``"2e3"``) and finite. ``"true"``, ``"nan"`` and everything else stay text.
    """
    if _INT.fullmatch(text):
        number = int(text)
        return number if -(2**63) <= number < 2**63 else text
    if _FLOAT.fullmatch(text):
        number = float(text)
        return number if math.isfinite(number) else text
    return text


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


def read_rows(
    path: str | os.PathLike[str],
    columns: tuple[str, ...],
    *,
    format: str | None = None,
    metadata: MetadataColumns = None,
) -> Iterator[Row]:
    """Stream the chosen columns of a CSV, TSV or JSONL file, one :class:`Row` at a time.

    Rows with a missing column, more fields than the header (CSV / TSV), a quote that is never closed (CSV /
    TSV: reported at its record, not read as a field running to the end of the file), a non-text JSON field, a
    JSON metadata field that is an array or an object, or a line that is not a JSON object come with a
    ``problem`` instead of fields; blank lines are skipped. The file is never read whole.

    Args:
        path: the file.
        columns: the column names (CSV/TSV header names, JSON object fields) to read.
        format: ``"csv"``, ``"tsv"``, ``"jsonl"``, or None for the suffix's.
        metadata: the columns to read as each row's ``metadata`` (see the module docstring for their types),
            ``"all"`` for every column not in ``columns``, or None for none.

    Yields:
        One Row per record, in file order.

    Raises:
        BadFileError: the file cannot be opened or decoded as UTF-8, or a CSV/TSV header lacks a column.
        UnknownOptionError: the format is unknown.
        InvalidArgumentError: empty column names, or ``metadata`` neither a list of names nor ``"all"``.
    """
    fmt = detect_format(path, format)
    if not columns or not all(isinstance(c, str) and c for c in columns):
        raise InvalidArgumentError(f"expected non-empty column names, got {columns!r}")
    metadata = _check_metadata_columns(metadata)
    try:
        handle = open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - closed in the finally below
    except OSError as exc:
        raise BadFileError(f"cannot open {os.fspath(path)!r}: {exc.strerror or exc}") from None
    try:
        if fmt == "jsonl":
            yield from _jsonl_rows(handle, columns, metadata)
        else:
            yield from _delimited_rows(handle, columns, "," if fmt == "csv" else "\t", os.fspath(path), metadata)
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


def _check_metadata_columns(metadata: object) -> tuple[str, ...] | Literal["all"] | None:
    """``metadata=`` of :func:`read_rows` checked: None, ``"all"``, or a tuple of non-empty names."""
    if metadata is None or metadata == "all":
        return metadata  # type: ignore[return-value]
    if isinstance(metadata, str) or not isinstance(metadata, Sequence):
        raise InvalidArgumentError(f'expected metadata as a list of column names or "all", got {metadata!r}')
    if not all(isinstance(c, str) and c for c in metadata):
        raise InvalidArgumentError(f"expected non-empty metadata column names, got {list(metadata)!r}")
    return tuple(dict.fromkeys(metadata))


def _delimited_rows(
    handle, columns: tuple[str, ...], delimiter: str, name: str, metadata: tuple[str, ...] | str | None = None
) -> Iterator[Row]:
    lines = _Lines(handle)
    reader = csv.reader(lines, delimiter=delimiter)
    header = next(reader, None)
    if header is None:
        return
    header = [h.strip() for h in header]
    if metadata == "all":  # every named column but the chosen ones, each once (its first position)
        metadata = tuple(h for h in dict.fromkeys(header) if h and h not in columns)
    missing = [c for c in (*columns, *(metadata or ())) if c not in header]
    if missing:
        raise BadFileError(
            f"{name!r} line 1: the header has no column {missing[0]!r} (columns: {', '.join(header) or 'none'})",
            [(1, f"no column {c!r} in the header") for c in missing],
        )
    positions = [header.index(c) for c in columns]
    meta_positions = [(c, header.index(c)) for c in metadata or ()]
    names = [*columns, *(c for c, _ in meta_positions)]
    positions_read = [*positions, *(p for _, p in meta_positions)]
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
                f"{counted(len(fields), 'field')}, header has {len(header)}: expected one field per column "
                "(an unquoted delimiter?)",
            )
            continue
        if len(fields) <= max(positions_read):
            absent = [c for c, p in zip(names, positions_read) if p >= len(fields)]
            got = f"{counted(len(fields), 'field')}, header has {len(header)}"
            yield Row(line, None, f"missing column {absent[0]!r} ({got})")
            continue
        meta = None
        if metadata is not None:  # an empty field is left out: CSV cannot say null
            meta = {c: csv_scalar(fields[p]) for c, p in meta_positions if fields[p] != ""}
        yield Row(line, tuple(fields[p] for p in positions), metadata=meta)


def _jsonl_rows(handle, columns: tuple[str, ...], metadata: tuple[str, ...] | str | None = None) -> Iterator[Row]:
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
        meta = None
        if metadata is not None:
            names = [c for c in obj if c not in columns] if metadata == "all" else [c for c in metadata if c in obj]
            meta, problem = _json_metadata({c: obj[c] for c in names})
            if problem is not None:
                yield Row(line, None, problem)
                continue
        yield Row(line, tuple(obj[c] for c in columns), metadata=meta)


def _json_metadata(meta: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A JSONL row's metadata fields, tagged datetimes and dates decoded, and what is wrong with the first bad one
    (or None)."""
    out = {}
    for name, value in meta.items():
        if isinstance(value, dict):
            try:
                value = decode_tag(value, f"metadata field {name!r}")
            except InvalidArgumentError as exc:
                return out, str(exc)
            if value is None:
                return out, (
                    f"expected a JSON scalar (text, number, true, false or null) or a tagged datetime "
                    f'({{"$datetime": "<ISO 8601>"}} or {{"$date": "YYYY-MM-DD"}}) in metadata field {name!r}, '
                    "got an object"
                )
        problem = _json_scalar_problem(name, value)
        if problem is not None:
            return out, problem
        out[name] = value
    return out, None


def _json_scalar_problem(name: str, value: Any) -> str | None:
    """What is wrong with a JSON metadata value (an array, an object, NaN or Infinity), or None; a datetime or a
    date (a decoded tag) is fine."""
    if value is None or isinstance(value, (str, bool, date)):
        return None
    if isinstance(value, int):
        return None if -(2**63) <= value < 2**63 else f"expected an integer within 64 bits in {name!r}, got {value}"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"expected a finite number in metadata field {name!r}, got {value}"
    kind = {"list": "an array", "dict": "an object"}.get(type(value).__name__, type(value).__name__)
    return f"expected a JSON scalar (text, number, true, false or null) in metadata field {name!r}, got {kind}"


def _metadata_problem(metadata: dict[str, Any] | None) -> str | None:
    """Why the database would refuse a row's metadata (a NUL, nesting too deep...), or None: found in the first
    pass, so that no batch of an ``--upsert`` is written before a bad row that comes after it."""
    if not metadata:
        return None
    try:
        check_metadata(metadata, "metadata")
    except KVSearchError as exc:
        return str(exc)
    return None


def _validate(
    db: DatabaseProtocol,
    path: str | os.PathLike[str],
    key: str,
    value: str,
    fmt: Format,
    progress: bool,
    metadata: MetadataColumns,
    upsert: bool,
) -> int:
    """First pass: count the good rows; raise BadFileError listing every bad one.

    Without ``upsert``, a key that is already stored is a bad row (and the message says how to upsert).
    """
    problems: list[tuple[int, str]] = []
    total_bad = 0
    stored = 0  # bad rows because their key is already stored
    seen: dict[str, int] = {}  # key -> the line where it first appeared
    columns = (key, value) if key != value else (key,)
    count = 0

    def bad(line: int, problem: str) -> None:
        nonlocal total_bad
        total_bad += 1
        if len(problems) < MAX_PROBLEMS:
            problems.append((line, problem))

    rows = read_rows(path, columns, format=fmt, metadata=metadata)
    for row in tqdm(rows, desc="validating", unit="rec", disable=not progress):
        if row.problem is not None:
            bad(row.line, row.problem)
            continue
        k = normalize_key(row.fields[0])  # as the database compares and stores it
        v = row.fields[-1]
        if not k:
            bad(row.line, f"empty key {row.fields[0]!r}")
        elif "\x00" in k or "\x00" in v:
            bad(row.line, "a NUL character in the key or value")
        elif (refused := _metadata_problem(row.metadata)) is not None:
            bad(row.line, refused)
        elif k in seen:
            bad(row.line, f"duplicate key {k!r} (first on line {seen[k]})")
        elif not upsert and k in db:
            stored += 1
            bad(row.line, f"key {k!r} is already stored in the database")
        else:
            seen[k] = row.line
            count += 1
    if total_bad:
        shown = "; ".join(f"line {line}: {problem}" for line, problem in problems[:_SHOWN])
        more = f"; and {total_bad - _SHOWN} more" if total_bad > _SHOWN else ""
        hint = ""
        if stored:
            hint = (
                f" ({stored} with a key already stored: to add the new records and replace the changed ones, "
                "upsert with 'kvsearch build --upsert' or kvsearch.cli.ingest.upsert_file)"
            )
        raise BadFileError(
            f"{os.fspath(path)!r} has {counted(total_bad, 'bad row')}, nothing was written{hint}: {shown}{more}",
            problems,
        )
    return count


def _check_arguments(db: DatabaseProtocol, key: str, value: str, batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"expected batch_size as a positive int, got {batch_size!r}")
    for name, column in (("key", key), ("value", value)):
        if not isinstance(column, str) or not column:
            raise InvalidArgumentError(f"expected the {name} column as a non-empty name, got {column!r}")
    if db.encoder is None or db.value_encoder is None:
        raise InvalidArgumentError("expected a database with encoders for key and value texts, got one without")


def ingest_file(
    db: DatabaseProtocol,
    path: str | os.PathLike[str],
    *,
    key: str = "key",
    value: str = "value",
    format: str | None = None,
    batch_size: int = 1024,
    progress: bool = True,
    metadata: MetadataColumns = None,
) -> int:
    """Add every record of a CSV, TSV or JSONL file to a database: validated first, then written in batches.

    Args:
        db: an open database with an encoder for key and value texts.
        path: the file; CSV and TSV need a header row naming the columns, JSON Lines one object per line.
        key: the column (or JSON field) holding the keys.
        value: the column holding the values.
        format: ``"csv"``, ``"tsv"``, ``"jsonl"``, or None to take it from the suffix (.csv, .tsv/.tab,
            .jsonl/.ndjson).
        batch_size: records encoded and added at once; memory grows with it, not with the file.
        progress: show tqdm bars (on stderr) for validation and for encoding + indexing.
        metadata: the columns stored as each record's metadata (a list of names, or ``"all"`` for every
            column but the key and the value), or None; their types are in the module docstring.

    Returns:
        How many records were added (0 for a file without records).

    Raises:
        BadFileError: the file cannot be read, or has bad rows (missing column, extra fields, unterminated
            quote, empty key, duplicate key in the file or already stored, bad JSON, a JSON metadata field
            that is an array or object); ``.problems`` lists them with line numbers, and nothing was written.
        UnknownOptionError: an unknown format, or a suffix that names none.
        InvalidArgumentError: a bad argument (such as ``batch_size < 1``).
        KVSearchError: a write failed (``DiskFullError``: no space left); nothing of the file was kept.
    """
    return _ingest(db, path, key, value, format, batch_size, progress, metadata, upsert=False).added


def upsert_file(
    db: DatabaseProtocol,
    path: str | os.PathLike[str],
    *,
    key: str = "key",
    value: str = "value",
    format: str | None = None,
    batch_size: int = 1024,
    progress: bool = True,
    metadata: MetadataColumns = None,
) -> IngestCounts:
    """Make the database hold the records of a file: add the new keys, replace the changed records, leave the
    equal ones alone. Running it again after it was interrupted (or killed) finishes the job.

    A record is unchanged when its key is stored with the same value text and the same metadata. With
    ``metadata=None`` the file brings no metadata: only values are compared, and a replaced record keeps its
    stored metadata (as ``Database.upsert`` with ``metadata=None`` does). Rows are validated
    first as in :func:`ingest_file` (a key already stored is fine here), then written in batches of
    ``batch_size`` with :meth:`~kvsearch.Database.upsert`; only the added and replaced records are encoded.

    Args:
        db, path, key, value, format, batch_size, progress, metadata: as :func:`ingest_file`.

    Returns:
        :class:`IngestCounts`: how many records were added, replaced and left unchanged.

    Raises:
        BadFileError, UnknownOptionError, InvalidArgumentError: as :func:`ingest_file`; nothing was written.
        KVSearchError: a write failed. The batches written before it stay (each batch is all or nothing):
            call it again to finish.
    """
    return _ingest(db, path, key, value, format, batch_size, progress, metadata, upsert=True)


def _ingest(
    db: DatabaseProtocol,
    path: str | os.PathLike[str],
    key: str,
    value: str,
    format: str | None,
    batch_size: int,
    progress: bool,
    metadata: MetadataColumns,
    *,
    upsert: bool,
) -> IngestCounts:
    """Both ingests: validate every row, then write batch by batch (add: undone on failure; upsert: kept)."""
    _check_arguments(db, key, value, batch_size)
    fmt = detect_format(path, format)
    count = _validate(db, path, key, value, fmt, progress, metadata, upsert)
    if count == 0:
        return IngestCounts()

    columns = (key, value) if key != value else (key,)
    added: list[int] = []
    counts = {"added": 0, "replaced": 0, "unchanged": 0}
    bar = tqdm(total=count, desc="encoding + indexing", unit="rec", disable=not progress, dynamic_ncols=True)

    def write(batch: list[Row]) -> None:
        if upsert:
            for name, n in _upsert_batch(db, batch, with_metadata=metadata is not None).items():
                counts[name] += n
        else:
            keys, values, metas = _columns_of(batch, with_metadata=metadata is not None)
            added.extend(db.add(keys=keys, values=values, metadata=metas))
            counts["added"] = len(added)
        bar.update(len(batch))

    # add: one transaction, so a full disk or a kill leaves nothing of the file; upsert: batch by batch, so a
    # re-run after a failure finishes the job
    atomic = None if upsert else getattr(db, "atomic", None)
    try:
        with contextlib.nullcontext() if atomic is None else atomic():
            batch: list[Row] = []
            for row in read_rows(path, columns, format=fmt, metadata=metadata):
                if row.problem is not None:
                    raise BadFileError(f"{os.fspath(path)!r} line {row.line} changed during ingest: {row.problem}")
                batch.append(row)
                if len(batch) == batch_size:
                    write(batch)
                    batch = []
            if batch:
                write(batch)
    except BaseException:
        if not upsert and atomic is None:
            _undo(db, added)
        raise
    finally:
        bar.close()
    return IngestCounts(**counts)


def _columns_of(
    rows: Sequence[Row], *, with_metadata: bool
) -> tuple[list[str], list[str], list[dict[str, Any] | None] | None]:
    """The keys, values and metadata (None when no metadata columns were asked for) of rows."""
    keys = [row.fields[0] for row in rows]
    values = [row.fields[-1] for row in rows]
    return keys, values, ([row.metadata or None for row in rows] if with_metadata else None)


def _upsert_batch(db: DatabaseProtocol, rows: list[Row], *, with_metadata: bool) -> dict[str, int]:
    """Upsert the rows that differ from what is stored; count the added, replaced and unchanged ones."""
    stored = stored_records(db, [row.fields[0] for row in rows])
    changed: list[Row] = []
    unchanged = replaced = 0
    for row in rows:
        record = stored.get(row.fields[0])
        if record is None:
            changed.append(row)
        elif record.value == row.fields[-1] and (not with_metadata or _same_metadata(record.metadata, row.metadata)):
            unchanged += 1
        else:
            changed.append(row)
            replaced += 1
    if changed:
        keys, values, metas = _columns_of(changed, with_metadata=with_metadata)
        db.upsert(keys=keys, values=values, metadata=metas)
    return {"added": len(changed) - replaced, "replaced": replaced, "unchanged": unchanged}


def _same_metadata(stored: dict[str, Any] | None, given: dict[str, Any] | None) -> bool:
    """Equal as JSON (so 1, 1.0 and true differ, as they do to a filter); None and {} are both "none"."""

    def text(metadata: dict[str, Any] | None) -> str:  # datetimes by their ISO text, as they are stored
        return json.dumps(tagged(metadata or {}), sort_keys=True)

    return text(stored) == text(given)


def stored_records(db: DatabaseProtocol, keys: Sequence[str]) -> dict[str, Record]:
    """The stored record of each of ``keys`` that is stored (text, metadata, embeddings), by key.

    For a :class:`~kvsearch.distributed.ShardedDatabase`, the shards this process holds are read.
    """
    keys = list(keys)
    out: dict[str, Record] = {}
    for part in parts_of(db):
        ids = part.ids_of_keys(keys).tolist()  # (n,) -1 where not stored here
        records = part.store.fetch([i for i in ids if i >= 0])
        out.update((text, records[i]) for text, i in zip(keys, ids) if i in records)
    return out


def _undo(db: DatabaseProtocol, ids: list[int]) -> None:
    """Delete what this ingest added (best effort in chunks: the original error is the one raised)."""
    for start in range(0, len(ids), 65536):
        try:
            db.delete(ids[start : start + 65536])
        except KVSearchError:  # pragma: no cover - a failing store while undoing; the first error wins
            pass
