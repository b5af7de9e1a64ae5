"""Datetimes and dates in the ``kvsearch`` command's JSON: one tagged form, read and written alike.

JSON has no datetime, so the command writes one as ``{"$datetime": "<ISO 8601>"}`` and a date as
``{"$date": "YYYY-MM-DD"}`` — in ``--where``, in a JSONL file's metadata fields (``build``), and in every ``--json``
output (``list``, ``query``) — so what ``list --json`` prints, pasted back, means the same value:

    kvsearch count DB --where '{"at": {"$lt": {"$datetime": "2018-01-01T00:00:00+00:00"}}}'
    kvsearch count DB --where '{"day": {"$date": "2017-12-04"}}'

:func:`decode` turns the tags into :class:`datetime.datetime` / :class:`datetime.date` (the text read by
``datetime.fromisoformat`` / ``date.fromisoformat``), so a filter compares exactly as Python's ``where=`` does with
the same value (as instants: a naive datetime is UTC, a date its midnight UTC; see :mod:`kvsearch.metadata.codec`).
:func:`tagged` writes them back.

A bare string is a string: ``{"at": {"$lt": "2018-01-01"}}`` compares texts (CSV metadata stores dates as text, and
texts in ISO form sort as their dates do). Compared with a field that holds datetimes it would match nothing (or, with
``$ne`` / ``$nin``, everything) without a word, so :func:`refuse_bare_datetimes` refuses it when the string reads as
an ISO date or datetime and some record holds a datetime or date in that field, and says how to write it.

It knows nothing of argument parsing or of the commands (it is handed a database through
:class:`~kvsearch.contract.DatabaseProtocol`), nor of how metadata is stored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

from kvsearch.errors import InvalidArgumentError
from kvsearch.metadata.codec import DATE, DATETIME
from kvsearch.metadata.filters import Field, check_where

if TYPE_CHECKING:
    from kvsearch.contract import DatabaseProtocol

__all__ = ["TAGS", "HINT", "decode", "decode_tag", "tagged", "reads_as_datetime", "refuse_bare_datetimes"]

#: The two tags: a JSON object with one of them as its only key is a datetime or a date.
TAGS = (DATETIME, DATE)
#: How to write them, as the help and the errors say it.
HINT = '{"$datetime": "2018-01-01T00:00:00+00:00"} (a naive datetime is UTC) or {"$date": "2018-01-01"}'
#: The operators whose string operand is compared with the field's value (``$contains`` looks for a substring).
_COMPARED = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def decode_tag(obj: Mapping[str, Any], at: str) -> date | None:
    """The datetime or date of a tagged object, or None when ``obj`` holds neither tag.

    Args:
        obj: a JSON object.
        at: where it is, for errors (``where.at.$lt``, ``line 3, field 'at'``).

    Returns:
        ``datetime.fromisoformat(text)`` for ``{"$datetime": text}``, ``date.fromisoformat(text)`` for
        ``{"$date": text}``; None for an object with neither key.

    Raises:
        InvalidArgumentError: a tag beside other keys, a tag whose value is not a str, or a text that is not ISO 8601.
    """
    tags = [t for t in TAGS if t in obj]
    if not tags:
        return None
    tag = tags[0]
    if len(obj) != 1:
        raise InvalidArgumentError(f"expected {tag} as the only key of its object at {at} ({HINT}), got {dict(obj)!r}")
    text = obj[tag]
    parse = datetime.fromisoformat if tag == DATETIME else date.fromisoformat
    what = "an ISO 8601 datetime" if tag == DATETIME else "an ISO 8601 date (YYYY-MM-DD)"
    try:
        if not isinstance(text, str):
            raise TypeError
        return parse(text)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"expected {what} as the text of {tag} at {at}, got {text!r}") from None


def decode(value: Any, at: str = "where") -> Any:
    """A parsed JSON value with every tagged object replaced by its datetime or date, at any depth.

    Args:
        value: what ``json.loads`` gave (a filter, a metadata value).
        at: where it is, for errors; a member's path is appended (``where.at.$lt``).

    Returns:
        A copy, tags decoded (untagged dicts and lists rebuilt, scalars as they are).

    Raises:
        InvalidArgumentError: as :func:`decode_tag`, naming the path of the bad tag.
    """
    if isinstance(value, Mapping):
        found = decode_tag(value, at)
        if found is not None:
            return found
        return {key: decode(item, f"{at}.{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [decode(item, f"{at}[{i}]") for i, item in enumerate(value)]
    return value


def tagged(value: Any) -> Any:
    """A value made JSON-ready for ``--json`` output: datetimes as ``{"$datetime": iso}``, dates as
    ``{"$date": iso}`` (the ISO text gives the same value back: an aware datetime keeps its offset, a naive one stays
    naive), at any depth; everything else as it is."""
    if isinstance(value, datetime):
        return {DATETIME: value.isoformat()}
    if isinstance(value, date):
        return {DATE: value.isoformat()}
    if isinstance(value, Mapping):
        return {key: tagged(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [tagged(item) for item in value]
    return value


def reads_as_datetime(text: str) -> bool:
    """Whether ``datetime.fromisoformat`` reads ``text`` (``2018-01-01``, ``2018-01-01T00:00:00Z``, ``20180101``)."""
    try:
        datetime.fromisoformat(text)
    except ValueError:
        return False
    return True


def _bare_strings(node: tuple, out: dict[str, tuple[str, str]]) -> None:
    """Collect, per metadata field name, the first (operator, string) of the checked filter ``node`` whose string
    operand reads as a datetime."""
    tag = node[0]
    if tag == "not":
        _bare_strings(node[1], out)
    elif tag in ("and", "or", "nor"):
        for sub in node[1]:
            _bare_strings(sub, out)
    else:
        field: Field = node[1]
        op, operand = node[2], node[3]
        if field.part is not None or op not in _COMPARED:
            return
        for item in operand if op in ("$in", "$nin") else [operand]:
            if isinstance(item, str) and reads_as_datetime(item):
                out.setdefault(".".join(field.path), (op, item))


def refuse_bare_datetimes(db: DatabaseProtocol, where: Mapping[str, Any] | None) -> None:
    """Refuse a filter that compares a string in ISO date / datetime form with a field that holds datetimes.

    Such a comparison is typed (a string never equals nor orders with a datetime), so it would match no record
    holding a datetime there (``$ne`` / ``$nin``: every one) without a word. The filter is refused only when the
    database has a record whose field holds a datetime or a date: on a field of texts the same string is a fine
    text comparison. A field that holds both is refused too: write the datetime with its tag.

    Args:
        db: the open database the filter will run on.
        where: the decoded, checked filter (``--where``), or None.

    Raises:
        InvalidArgumentError: naming the field, the operator and the string, and how to write a datetime.
    """
    if not where:
        return
    suspects: dict[str, tuple[str, str]] = {}
    _bare_strings(check_where(where), suspects)
    for name, (op, text) in suspects.items():
        holds = {"$or": [{name: {"$gte": _EPOCH}}, {name: {"$lt": _EPOCH}}]}  # every datetime and date, only them
        if db.where(holds).count():
            example = json.dumps({DATETIME: datetime.fromisoformat(text).isoformat()})
            raise InvalidArgumentError(
                f"expected a datetime or date for field {name!r}, which holds datetimes, got the string {text!r} "
                f"with {op} (a string never matches a datetime): write {example}, or a date as "
                '{"$date": "YYYY-MM-DD"}'
            )
