"""Metadata filters: ``where={"field": value, "n": {"$gt": 3}, "tag": {"$in": ["a", "b"]}}``.

A filter is a dict of conditions on top-level metadata fields, all of which must hold (AND). A condition is
a plain value (equality) or a dict of operators: ``$eq``, ``$ne``, ``$gt``, ``$gte``, ``$lt``, ``$lte``,
``$in``, ``$nin``.

Typed comparison: a number matches only numbers (``1`` equals ``1.0``), a string only strings, a bool only
bools, ``None`` only JSON null. Order operators take a number or a string and never match another type. A
missing field matches only ``$ne`` and ``$nin``.

The filter becomes SQL over SQLite's JSON functions in which *every* user value — the field's JSON path and
each operand — is a bound parameter; no user text is ever spliced into the SQL string. A ``$in`` / ``$nin`` list
of any length is bound as one JSON array per type of value (read with ``json_each``), so it never meets SQLite's
limit on bound parameters. :func:`matches` is the same rule in plain Python (the tests compare the two).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kvsearch.checks import check_unicode
from kvsearch.errors import InvalidArgumentError, NonFiniteError, UnknownOptionError

__all__ = ["OPERATORS", "check_where", "where_sql", "matches"]

OPERATORS = ("$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin")
_ORDER = {"$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}
_FIELD = re.compile(r"^[^\x00-\x1f\"\\$.\[\]][^\x00-\x1f\"\\.\[\]]*$")
Scalar = str | int | float | bool | None


def _check_scalar(value: object, where: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        raise InvalidArgumentError(f"expected an integer within 64 bits in the filter at {where}, got {value}")
    if isinstance(value, str):
        check_unicode(value, f"the filter value at {where}")
    if value is None or isinstance(value, (str, bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NonFiniteError(f"expected a finite number in the filter at {where}, got {value}")
        return
    raise InvalidArgumentError(
        f"expected a str, int, float, bool or None in the filter at {where}, got {type(value).__name__}"
    )


def check_where(where: object) -> dict[str, dict[str, Any]]:
    """Validate a filter and normalise it to ``{field: {op: operand}}``.

    Args:
        where: the user's filter.

    Returns:
        The normalised filter.

    Raises:
        InvalidArgumentError: not a dict, an unsafe or empty field name, a bad operand.
        UnknownOptionError: an operator that is not in :data:`OPERATORS`.
        NonFiniteError: a NaN or Inf operand.
    """
    if not isinstance(where, Mapping):
        raise InvalidArgumentError(f"expected where as a dict of field -> condition, got {type(where).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for field, cond in where.items():
        if not isinstance(field, str) or not _FIELD.match(field):
            raise InvalidArgumentError(
                f"expected a metadata field name (non-empty; no '.', '$' first, quotes, brackets, backslashes "
                f"or control characters), got {field!r}"
            )
        check_unicode(field, "a metadata field name")
        ops = dict(cond) if isinstance(cond, Mapping) else {"$eq": cond}
        if not ops:
            raise InvalidArgumentError(f"expected at least one operator for field {field!r}, got an empty dict")
        for op, operand in ops.items():
            if op not in OPERATORS:
                raise UnknownOptionError(f"expected a filter operator among {OPERATORS}, got {op!r} for {field!r}")
            at = f"{field}.{op}"
            if op in ("$in", "$nin"):
                if not isinstance(operand, (list, tuple, set, frozenset)):
                    raise InvalidArgumentError(f"expected a list for {at}, got {type(operand).__name__}")
                for value in operand:
                    _check_scalar(value, at)
                ops[op] = list(operand)
            elif op in _ORDER:
                if isinstance(operand, bool) or not isinstance(operand, (int, float, str)):
                    raise InvalidArgumentError(f"expected a number or a string for {at}, got {operand!r}")
                _check_scalar(operand, at)
            else:
                _check_scalar(operand, at)
        out[field] = ops
    return out


def _kind(value: Scalar) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "text"


_SQL_TYPES = {"null": "('null')", "bool": "('true', 'false')", "number": "('integer', 'real')", "text": "('text')"}


def _eq_sql(path: str, value: Scalar, params: list[Any]) -> str:
    """SQL for ``field == value`` (typed), appending its bound parameters to ``params``."""
    kind = _kind(value)
    params.append(path)
    cond = f"json_type(metadata, ?) IN {_SQL_TYPES[kind]}"
    if kind == "null":
        return f"({cond})"
    params += [path, int(value) if kind == "bool" else value]
    return f"({cond} AND json_extract(metadata, ?) = ?)"


def _in_sql(path: str, operand: list[Scalar], params: list[Any]) -> str:
    """SQL for ``field in operand`` (typed), appending its bound parameters: one JSON array per kind of value."""
    by_kind: dict[str, list[Any]] = {}
    for value in operand:
        by_kind.setdefault(_kind(value), []).append(int(value) if isinstance(value, bool) else value)
    parts = []
    for kind, values in by_kind.items():
        params.append(path)
        cond = f"json_type(metadata, ?) IN {_SQL_TYPES[kind]}"
        if kind != "null":  # SQLite builds the subquery's list once, as an index
            params += [path, json.dumps(values)]
            cond += " AND json_extract(metadata, ?) IN (SELECT value FROM json_each(?))"
        parts.append(f"({cond})")
    return "(" + (" OR ".join(parts) or "0") + ")"


def where_sql(where: Mapping[str, Any]) -> tuple[str, list[Any]]:
    """SQL for ``SELECT id FROM records WHERE <sql>`` and its bound parameters.

    Args:
        where: a filter (validated here).

    Returns:
        ``(sql, params)``: the SQL holds only ``?`` placeholders for user values (field paths included).

    Raises:
        As :func:`check_where`.
    """
    parts: list[str] = []
    params: list[Any] = []
    for field, ops in check_where(where).items():
        path = '$."' + field + '"'  # bound as a parameter, never part of the SQL text
        for op, operand in ops.items():
            if op in ("$eq", "$ne"):
                sql = _eq_sql(path, operand, params)
            elif op in ("$in", "$nin"):
                sql = _in_sql(path, operand, params)
            else:
                params += [path, path, operand]
                types = _SQL_TYPES[_kind(operand)]  # our own literals, as is _ORDER[op]
                sql = f"(json_type(metadata, ?) IN {types} AND json_extract(metadata, ?) {_ORDER[op]} ?)"
            # json_type of a missing field is NULL: COALESCE makes "missing" false, and NOT of it true.
            sql = f"COALESCE({sql}, 0)"
            parts.append(f"NOT {sql}" if op in ("$ne", "$nin") else sql)
    return " AND ".join(parts) or "1", params


def matches(metadata: Mapping[str, Any] | None, where: Mapping[str, Any]) -> bool:
    """The filter rule in plain Python: whether one record's metadata satisfies ``where``.

    Args:
        metadata: the record's metadata dict (None or {} for none).
        where: a filter.

    Returns:
        True when every condition holds.
    """
    metadata = metadata or {}
    for field, ops in check_where(where).items():
        present = field in metadata
        value = metadata.get(field)
        for op, operand in ops.items():
            if op == "$eq":
                ok = present and _equal(value, operand)
            elif op == "$ne":
                ok = not (present and _equal(value, operand))
            elif op == "$in":
                ok = present and any(_equal(value, v) for v in operand)
            elif op == "$nin":
                ok = not (present and any(_equal(value, v) for v in operand))
            else:
                ok = present and _kind_of_stored(value) == _kind(operand) and _compare(value, op, operand)
            if not ok:
                return False
    return True


def _kind_of_stored(value: Any) -> str:
    if isinstance(value, (list, dict)):
        return "other"
    return _kind(value)


def _equal(stored: Any, operand: Scalar) -> bool:
    kind = _kind_of_stored(stored)
    return kind == _kind(operand) and (kind == "null" or stored == operand)


def _compare(stored: Any, op: str, operand: Any) -> bool:
    return {"$gt": stored > operand, "$gte": stored >= operand, "$lt": stored < operand, "$lte": stored <= operand}[op]
