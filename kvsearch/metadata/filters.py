"""Filters on records, in Chroma / MongoDB syntax, compiled to bound SQL over SQLite's JSON functions.

    {"lang": "en", "year": {"$gte": 2000}}                         two conditions, both must hold
    {"$or": [{"tag": {"$in": ["a", "b"]}}, {"author.country": "FR"}]}
    {"$not": {"$value": {"$contains": "draft"}}}

**Shape.** A filter is a dict of clauses, all of which must hold ({} holds for every record). A clause is
``"$and"`` / ``"$or"`` / ``"$nor"`` with a list of filters, ``"$not"`` with one filter, or ``field: condition``.

**Fields.** A metadata field by dot path (``"author.country"``: the ``country`` of the dict ``author``; a name holding
``.`` cannot be named; no array indexes), or the record's own parts, whose names cannot clash with metadata (metadata
keys never start with ``$``): ``"$id"`` (its integer id), ``"$key"`` (its key text; None for a key given as an
embedding; equality, ``$in`` and order compare after the key's normalisation, NFC and stripped; a ``$contains``
substring is NFC-normalised, not stripped) and ``"$value"`` (its value text, never normalised; None for a value given
as an embedding).

**Conditions.** A plain value (equality), or a dict of operators that must all hold: ``$eq $ne $gt $gte $lt $lte
$in $nin $exists $contains``, and ``$not`` with a dict of operators. Comparison is typed: a number matches numbers
(``1`` equals ``1.0``), a string strings, a bool bools, a datetime or date datetimes and dates (as instants, see
:mod:`kvsearch.metadata.codec`: naive is UTC); a numpy scalar is the Python value it holds. Order operators take a
number, a string or a datetime / date and never match a value of another type. ``$contains`` holds for a string
field that contains the operand string, and for a list field with a member equal to the operand (a str, number, bool
or None). No operand text may hold a NUL character: no stored text holds one (:mod:`kvsearch.metadata.codec`), and
SQLite compares text only up to it.

**Missing fields**, as MongoDB: ``{"f": None}`` matches null or missing, ``{"f": {"$ne": None}}`` only present and not
null, ``$ne`` and ``$nin`` match a missing field (``$in`` with None in its list matches it too), every other operator
does not; ``{"f": {"$exists": True}}`` matches present fields, null included.

**SQL.** Every user value — each JSON path and each operand — is a bound parameter; no user text is ever spliced into
the SQL. A ``$in`` / ``$nin`` list of any length is one JSON array per type (read with ``json_each``), and long
``$and`` / ``$or`` lists nest as balanced trees, so neither meets SQLite's limits. :func:`matches` is the same rule
in plain Python: the tests compare the two. A bad filter raises before anything runs, and the error names the path
in the filter where it is (``where.$or[1].year.$gt``).
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

from kvsearch.checks import check_unicode
from kvsearch.errors import InvalidArgumentError, NonFiniteError, UnknownOptionError
from kvsearch.metadata.codec import EPOCH_US, INT64, epoch_us, python_scalar

__all__ = ["OPERATORS", "LOGICAL", "RECORD_FIELDS", "check_where", "where_sql", "matches", "Field", "parse_field"]

OPERATORS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists", "$contains", "$not")
LOGICAL = ("$and", "$or", "$nor", "$not")
RECORD_FIELDS = ("$id", "$key", "$value")
_ORDER = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
#: At most this many conditions and this nesting depth in one filter (SQLite's expression limits stay far off).
MAX_CONDITIONS, MAX_DEPTH = 1000, 32
_BAD_NAME_CHARS = set('"\\[]')


@dataclass(frozen=True)
class Field:
    """A field a condition names: a metadata path (``path``) or a record part (``part``: "id", "key", "value")."""

    path: tuple[str, ...] = ()
    part: str | None = None

    @property
    def json_path(self) -> str:
        """The SQLite JSON path (``$."a"."b"``), bound as a parameter."""
        return "$" + "".join(f'."{name}"' for name in self.path)


def parse_field(name: object, at: str = "where") -> Field:
    """A field name (a dot path, or ``$id`` / ``$key`` / ``$value``) checked.

    Raises:
        InvalidArgumentError: not a str, an empty segment, a segment starting with ``$``, or one holding a quote,
            a backslash, a bracket or a control character.
    """
    if not isinstance(name, str):
        raise InvalidArgumentError(f"expected a field name (str) at {at}, got {type(name).__name__}")
    if name in RECORD_FIELDS:
        return Field(part=name[1:])
    check_unicode(name, f"the field name at {at}")
    path = tuple(name.split("."))
    for segment in path:
        if (
            not segment
            or segment.startswith("$")
            or _BAD_NAME_CHARS & set(segment)
            or any(ord(c) < 0x20 for c in segment)
        ):
            raise InvalidArgumentError(
                f"expected a metadata field name as a dot path of names (non-empty; none starting with '$'; no quotes, "
                f"brackets, backslashes or control characters) or one of {RECORD_FIELDS} at {at}, got {name!r}"
            )
    return Field(path=path)


# ---------------------------------------------------------------------------------------------- checking


def _kind(value: Any) -> str:
    """The type class a filter compares by: null, bool, number, text, datetime (or array / object, stored only)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, date):
        return "datetime"
    return "array" if isinstance(value, (list, tuple)) else "object"


def _scalar(value: object, at: str, field: Field | None) -> Any:
    """A scalar operand checked; for a record field (``field`` given), of that field's type (a key normalised)."""
    value = python_scalar(value)  # np.int64(3) is 3, as in metadata
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        raise InvalidArgumentError(f"expected an integer within 64 bits at {at}, got {value}")
    if isinstance(value, float) and not math.isfinite(value):
        raise NonFiniteError(f"expected a finite number at {at}, got {value}")
    if isinstance(value, str):
        check_unicode(value, f"the filter value at {at}")
        if "\x00" in value:
            raise InvalidArgumentError(
                f"expected filter text without NUL characters at {at} (no stored text holds one: metadata, keys and "
                f"values refuse NUL, as SQLite compares text only up to it), got {value[:60]!r}"
            )
    if not (value is None or isinstance(value, (str, bool, int, float, date))):
        raise InvalidArgumentError(
            f"expected a str, int, float, bool, None, datetime or date at {at}, got {type(value).__name__}"
        )
    if field is None:
        return value
    if field.part == "id" and (value is None or _kind(value) != "number"):
        raise InvalidArgumentError(f"expected a number for $id at {at}, got {value!r}")
    if field.part in ("key", "value") and _kind(value) not in ("text", "null"):
        raise InvalidArgumentError(f"expected a str or None for ${field.part} at {at}, got {value!r}")
    if field.part == "key" and isinstance(value, str):
        return unicodedata.normalize("NFC", value).strip()  # as keys are stored (kvsearch.inputs.normalize_key)
    return value


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def one(self, at: str) -> None:
        self.n += 1
        if self.n > MAX_CONDITIONS:
            raise InvalidArgumentError(f"expected at most {MAX_CONDITIONS} conditions in a filter, got more at {at}")


def _check_ops(field: Field, cond: Any, at: str, count: _Counter, depth: int) -> tuple:
    """A field's condition as ``("and", [("cond", field, op, operand), ...])``."""
    if not isinstance(cond, Mapping):
        return ("cond", field, "$eq", _scalar(cond, at, field))
    if not cond:
        raise InvalidArgumentError(f"expected at least one operator at {at}, got an empty dict")
    out = []
    for op, operand in cond.items():
        here = f"{at}.{op}"
        count.one(here)
        operand = python_scalar(operand)
        if op not in OPERATORS:
            raise UnknownOptionError(f"expected a filter operator among {OPERATORS} at {here}, got {op!r}")
        if op == "$not":
            if depth >= MAX_DEPTH:
                raise InvalidArgumentError(f"expected filters nested at most {MAX_DEPTH} deep, got deeper at {here}")
            if not isinstance(operand, Mapping):
                raise InvalidArgumentError(f"expected a dict of operators at {here}, got {type(operand).__name__}")
            out.append(("not", _check_ops(field, operand, here, count, depth + 1)))
        elif op in ("$in", "$nin"):
            if not isinstance(operand, (list, tuple, set, frozenset)):
                raise InvalidArgumentError(f"expected a list at {here}, got {type(operand).__name__}")
            out.append(("cond", field, op, [_scalar(v, f"{here}[{i}]", field) for i, v in enumerate(operand)]))
        elif op == "$exists":
            if not isinstance(operand, bool):
                raise InvalidArgumentError(f"expected True or False at {here}, got {operand!r}")
            out.append(("cond", field, op, operand))
        elif op in _ORDER:
            if _kind(operand) not in ("number", "text", "datetime"):
                raise InvalidArgumentError(f"expected a number, a string or a datetime at {here}, got {operand!r}")
            out.append(("cond", field, op, _scalar(operand, here, field)))
        elif op == "$contains":
            if field.part == "id":
                raise InvalidArgumentError(f"expected no $contains on $id at {here}: it is an integer")
            if _kind(operand) == "datetime" or (field.part is not None and not isinstance(operand, str)):
                raise InvalidArgumentError(
                    f"expected a str (or, for a list field, a number, bool or None) at {here}, got {operand!r}"
                )
            operand = _scalar(operand, here, None)  # a substring: never stripped
            if field.part == "key":  # keys are stored NFC: the substring is looked for in that form
                operand = unicodedata.normalize("NFC", operand)
            out.append(("cond", field, op, operand))
        else:
            out.append(("cond", field, op, _scalar(operand, here, field)))
    return out[0] if len(out) == 1 else ("and", out)


def _check(where: object, at: str, count: _Counter, depth: int) -> tuple:
    if not isinstance(where, Mapping):
        raise InvalidArgumentError(f"expected a filter as a dict of field -> condition at {at}, got {where!r}")
    if depth > MAX_DEPTH:
        raise InvalidArgumentError(f"expected filters nested at most {MAX_DEPTH} deep, got deeper at {at}")
    parts = []
    for name, cond in where.items():
        here = f"{at}.{name}"
        if name in ("$and", "$or", "$nor"):
            if not isinstance(cond, Sequence) or isinstance(cond, str) or not cond:
                raise InvalidArgumentError(f"expected a non-empty list of filters at {here}, got {cond!r}")
            subs = [_check(sub, f"{here}[{i}]", count, depth + 1) for i, sub in enumerate(cond)]
            parts.append((name[1:], subs))
        elif name == "$not":
            parts.append(("not", _check(cond, here, count, depth + 1)))
        elif isinstance(name, str) and name.startswith("$") and name not in RECORD_FIELDS:
            raise InvalidArgumentError(
                f"expected a metadata field name (not starting with '$'), one of {RECORD_FIELDS}, or a logical "
                f"operator among {LOGICAL} at {at}, got {name!r}"
            )
        else:
            count.one(here)
            parts.append(_check_ops(parse_field(name, here), cond, here, count, depth + 1))
    return parts[0] if len(parts) == 1 else ("and", parts)


def check_where(where: object) -> tuple:
    """Validate a filter and return its tree (what :func:`where_sql` and :func:`matches` read).

    Args:
        where: the user's filter.

    Returns:
        The filter as nested tuples: ``("and" | "or" | "nor", [nodes])``, ``("not", node)``,
        ``("cond", Field, op, operand)``.

    Raises:
        InvalidArgumentError: not a dict, a bad field name or operand, an empty list, too many conditions or too deep
            (each names the path in the filter).
        UnknownOptionError: an operator that is not in :data:`OPERATORS` / :data:`LOGICAL`.
        NonFiniteError: a NaN or Inf operand.
    """
    return _check(where, "where", _Counter(), 0)


# ---------------------------------------------------------------------------------------------- SQL

_JSON_TYPES = {
    "null": "('null')",
    "bool": "('true', 'false')",
    "number": "('integer', 'real')",
    "text": "('text')",
    "array": "('array')",
}


def _join(parts: list[str], op: str) -> str:
    """``parts`` joined by AND / OR as a balanced tree (SQLite's parser nests a flat chain as deep as it is long)."""
    if len(parts) == 1:
        return parts[0]
    mid = len(parts) // 2
    return f"({_join(parts[:mid], op)} {op} {_join(parts[mid:], op)})"


class _Sql:
    """The SQL of one field's tests, appending bound parameters to ``params`` in the order the text uses them."""

    def __init__(self, field: Field, params: list[Any]) -> None:
        self.field, self.params = field, params
        self.column = {"id": "id", "key": "key", "value": "value"}.get(field.part or "")

    def _p(self, *values: Any) -> None:
        self.params.extend(values)

    def missing(self) -> str:
        if self.column:
            return "0"
        self._p(self.field.json_path)
        return "json_type(metadata, ?) IS NULL"

    def of_kind(self, kind: str) -> str:
        if self.column == "id":
            return "1" if kind == "number" else "0"
        if self.column:
            return {"null": f"{self.column} IS NULL", "text": f"{self.column} IS NOT NULL"}.get(kind, "0")
        if kind == "datetime":
            self._p(self.field.json_path + f'."{EPOCH_US}"')
            return "json_type(metadata, ?) = 'integer'"
        self._p(self.field.json_path)
        return f"json_type(metadata, ?) IN {_JSON_TYPES[kind]}"

    def value(self, kind: str) -> str:
        if self.column:
            return self.column
        self._p(self.field.json_path + (f'."{EPOCH_US}"' if kind == "datetime" else ""))
        return "json_extract(metadata, ?)"

    def compare(self, kind: str, sql_op: str, operand: Any) -> str:
        test = self.of_kind(kind)
        if kind == "null":
            return test
        value = self.value(kind)
        self._p(_bound(operand))
        return f"({test} AND {value} {sql_op} ?)"


def _bound(value: Any) -> Any:
    """A scalar as SQLite compares it: bools as 0 / 1, datetimes as their instant."""
    if isinstance(value, bool):
        return int(value)
    return epoch_us(value) if isinstance(value, date) else value


def _cond_sql(field: Field, op: str, operand: Any, params: list[Any]) -> str:
    sql = _Sql(field, params)
    if op in ("$eq", "$ne"):
        if operand is None:
            expr = f"({sql.missing()} OR {sql.of_kind('null')})"
        else:
            expr = sql.compare(_kind(operand), "=", operand)
        return f"NOT COALESCE({expr}, 0)" if op == "$ne" else f"COALESCE({expr}, 0)"
    if op in ("$in", "$nin"):
        by_kind: dict[str, list[Any]] = {}
        for value in operand:
            by_kind.setdefault(_kind(value), []).append(_bound(value))
        parts = []
        for kind, values in by_kind.items():
            if kind == "null":
                parts.append(f"({sql.missing()} OR {sql.of_kind('null')})")
                continue
            test, value = sql.of_kind(kind), sql.value(kind)
            params.append(json.dumps(values))  # SQLite builds the subquery's list once, as an index
            parts.append(f"({test} AND {value} IN (SELECT value FROM json_each(?)))")
        expr = f"COALESCE({_join(parts, 'OR') if parts else '0'}, 0)"
        return f"NOT {expr}" if op == "$nin" else expr
    if op == "$exists":
        return f"{'NOT ' if operand else ''}COALESCE({sql.missing()}, 0)"
    if op in _ORDER:
        return f"COALESCE({sql.compare(_kind(operand), _ORDER[op], operand)}, 0)"
    # $contains
    if sql.column:
        params.append(operand)
        return f"COALESCE(instr({sql.column}, ?) > 0, 0)"
    kind = _kind(operand)
    parts = []
    if kind == "text":
        parts.append(f"({sql.of_kind('text')} AND instr({sql.value('text')}, ?) > 0)")
        params.append(operand)
    member = f"type IN {_JSON_TYPES[kind]}" + ("" if kind == "null" else " AND value = ?")
    is_array = sql.of_kind("array")  # json_each would walk an object's members, or a scalar as one row
    params.append(field.json_path)
    parts.append(f"({is_array} AND EXISTS (SELECT 1 FROM json_each(metadata, ?) WHERE {member}))")
    if kind != "null":
        params.append(_bound(operand))
    return f"COALESCE({_join(parts, 'OR')}, 0)"


def _node_sql(node: tuple, params: list[Any]) -> str:
    tag = node[0]
    if tag == "cond":
        return _cond_sql(node[1], node[2], node[3], params)
    if tag == "not":
        return f"NOT {_node_sql(node[1], params)}"
    parts = [_node_sql(sub, params) for sub in node[1]]
    if not parts:  # an empty filter: {} holds for every record
        return "1" if tag == "and" else "0"
    if tag == "nor":
        return f"NOT {_join(parts, 'OR')}"
    return _join(parts, "AND" if tag == "and" else "OR")


def where_sql(where: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """SQL for ``SELECT ... FROM records WHERE <sql>`` and its bound parameters.

    Args:
        where: a filter (validated here).

    Returns:
        ``(sql, params)``: the SQL holds only ``?`` placeholders for user values (field paths included); it reads
        the columns ``id``, ``key``, ``value`` and ``metadata`` of ``records``.

    Raises:
        As :func:`check_where`.
    """
    tree = check_where(where)
    if tree == ("and", []):
        return "1", []
    params: list[Any] = []
    return _node_sql(tree, params), params


# ---------------------------------------------------------------------------------------------- Python

_ABSENT = object()


def _lookup(field: Field, record: Mapping[str, Any]) -> Any:
    if field.part is not None:
        return record[field.part]
    value: Any = record["metadata"] or {}
    for name in field.path:
        if not isinstance(value, Mapping) or name not in value:
            return _ABSENT
        value = value[name]
    return value


def _equal(stored: Any, operand: Any) -> bool:
    kind = _kind(stored)
    if kind != _kind(operand):
        return False
    if kind == "datetime":
        return epoch_us(stored) == epoch_us(operand)
    return kind == "null" or stored == operand


def _cond(field: Field, op: str, operand: Any, record: Mapping[str, Any]) -> bool:
    stored = _lookup(field, record)
    present = stored is not _ABSENT
    if op in ("$eq", "$ne"):
        hit = (not present or stored is None) if operand is None else present and _equal(stored, operand)
        return hit if op == "$eq" else not hit
    if op in ("$in", "$nin"):
        hit = any((not present or stored is None) if v is None else present and _equal(stored, v) for v in operand)
        return hit if op == "$in" else not hit
    if op == "$exists":
        return present == operand
    if op in _ORDER:
        kind = _kind(operand)
        if not present or _kind(stored) != kind:
            return False
        a, b = (epoch_us(stored), epoch_us(operand)) if kind == "datetime" else (stored, operand)
        return {"$gt": a > b, "$gte": a >= b, "$lt": a < b, "$lte": a <= b}[op]
    # $contains
    if isinstance(stored, str) and isinstance(operand, str):
        return operand in stored
    return isinstance(stored, list) and any(_kind(m) != "datetime" and _equal(m, operand) for m in stored)


def _node(node: tuple, record: Mapping[str, Any]) -> bool:
    tag = node[0]
    if tag == "cond":
        return _cond(node[1], node[2], node[3], record)
    if tag == "not":
        return not _node(node[1], record)
    results = (_node(sub, record) for sub in node[1])
    if tag == "and":
        return all(results)
    return any(results) if tag == "or" else not any(results)


def matches(
    metadata: Mapping[str, Any] | None,
    where: Mapping[str, Any],
    *,
    id: int | None = None,
    key: str | None = None,
    value: str | None = None,
) -> bool:
    """The filter rule in plain Python: whether one record satisfies ``where`` (the reference of :func:`where_sql`).

    Args:
        metadata: the record's metadata dict as it reads back (None or {} for none).
        where: a filter.
        id, key, value: the record's id, key text and value text, for filters on ``$id`` / ``$key`` / ``$value``.

    Returns:
        True when the filter holds.
    """
    record = {"metadata": metadata, "id": id, "key": key, "value": value}
    return _node(check_where(where), record)
