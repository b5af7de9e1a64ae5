"""Reads and writes of ``records`` by filter, in SQL: count, ids in pages, distinct values, min / max, fields, and
metadata updates.

Each function runs a few statements on the caller's connection (inside the caller's snapshot or transaction) and
the filter is :func:`kvsearch.metadata.filters.where_sql`'s bound SQL: no Python pass over the rows that do not
match. It
knows nothing of embeddings, versions or the index: a metadata update changes no vector (nothing to catch up on).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from kvsearch.errors import InvalidArgumentError
from kvsearch.metadata.codec import EPOCH_US, check, decode, encode, from_json
from kvsearch.metadata.filters import Field, parse_field, where_sql
from kvsearch.storage.schema import select_in

__all__ = ["count", "ids", "distinct", "min_max", "fields", "set_metadata"]

#: A field's JSON type ``t`` as the kinds filters compare by; an object holding ``$epoch_us`` is a datetime or date
#: (CASE evaluates lazily: ``v`` is read as JSON only where it is an object).
_KIND = (
    "CASE WHEN {t} IN ('integer', 'real') THEN 'number' WHEN {t} IN ('true', 'false') THEN 'bool' "
    "WHEN {t} = 'object' THEN CASE WHEN json_type({v}, '$.\"" + EPOCH_US + "\"') = 'integer' THEN 'datetime' "
    "ELSE 'object' END ELSE {t} END"
)
#: What a value groups and orders by: a datetime by its instant, others as SQLite holds them.
_ORDER_BY = "CASE WHEN {k} = 'datetime' THEN json_extract({v}, '$.\"" + EPOCH_US + "\"') ELSE {v} END"


def count(conn: sqlite3.Connection, where: Mapping[str, Any]) -> int:
    """How many records match a filter."""
    sql, params = where_sql(where)
    return int(conn.execute(f"SELECT count(*) FROM records WHERE {sql}", params).fetchone()[0])


def ids(conn: sqlite3.Connection, where: Mapping[str, Any], limit: int | None = None, offset: int = 0) -> list[int]:
    """The ids of the matching records in id order, ``offset`` of them skipped, at most ``limit`` (None: all)."""
    sql, params = where_sql(where)
    rows = conn.execute(
        f"SELECT id FROM records WHERE {sql} ORDER BY id LIMIT ? OFFSET ?",
        [*params, -1 if limit is None else limit, offset],
    )
    return [r[0] for r in rows]


def _values(field: Field, where: Mapping[str, Any], unwind: bool) -> tuple[str, list[Any]]:
    """SQL of ``(kind, value, raw)`` rows: the field's value in each matching record (list members one by one
    when ``unwind``), ``value`` what it orders by, ``raw`` its stored JSON text or SQL value."""
    sql, params = where_sql(where)
    if field.part is not None:
        col = field.part
        kind = f"CASE WHEN {col} IS NULL THEN 'null' WHEN typeof({col}) = 'integer' THEN 'number' ELSE 'text' END"
        return f"SELECT {kind} AS kind, {col} AS value, {col} AS raw FROM records WHERE {sql}", params
    kind = _KIND.format(t="t", v="v")
    one = f"SELECT {kind} AS kind, {_ORDER_BY.format(k=kind, v='v')} AS value, v AS raw FROM f WHERE t IS NOT NULL"
    if unwind:
        member_kind = _KIND.format(t="e.type", v="e.value")
        member = _ORDER_BY.format(k=member_kind, v="e.value")
        one += (
            f" AND t <> 'array' UNION ALL SELECT {member_kind}, {member}, e.value "
            "FROM f, json_each(f.v) AS e WHERE f.t = 'array'"
        )
    sql = (
        f"WITH f AS (SELECT json_type(metadata, ?) AS t, json_extract(metadata, ?) AS v FROM records WHERE {sql}) "
        + one
    )
    return sql, [field.json_path, field.json_path, *params]


def _value(kind: str, raw: Any) -> Any:
    """A value as metadata reads back: bools as bools, datetimes, lists and objects decoded."""
    if kind == "bool":
        return bool(raw)
    return from_json(raw) if kind in ("datetime", "array", "object") else raw


def distinct(conn: sqlite3.Connection, name: str, where: Mapping[str, Any]) -> list[tuple[Any, int]]:
    """The distinct values of a field among the matching records, with how many records hold each.

    A list field counts each member (as MongoDB's ``distinct``); ``1`` and ``1.0`` are one value, ``True`` another;
    datetimes are one value per instant.

    Returns:
        ``[(value, count), ...]``, most frequent first (ties in kind, then value order).

    Raises:
        InvalidArgumentError: a bad field name. As :func:`kvsearch.metadata.filters.check_where` for the filter.
    """
    field = parse_field(name, "field")
    sql, params = _values(field, where, unwind=True)
    rows = conn.execute(
        f"SELECT kind, value, min(raw), count(*) AS n FROM ({sql}) GROUP BY kind, value ORDER BY n DESC, kind, value",
        params,
    )
    return [(_value(kind, raw), n) for kind, _, raw, n in rows]


def min_max(conn: sqlite3.Connection, name: str, where: Mapping[str, Any]) -> tuple[Any, Any] | None:
    """The smallest and largest value of a field among the matching records: over its numbers if it holds any,
    else its datetimes / dates (as instants), else its strings; bools, nulls, lists and objects are not compared.

    Returns:
        ``(min, max)``, or None when no matching record holds such a value.

    Raises:
        InvalidArgumentError: a bad field name. As :func:`kvsearch.metadata.filters.check_where` for the filter.
    """
    field = parse_field(name, "field")
    sql, params = _values(field, where, unwind=False)
    for kind in ("number", "datetime", "text"):
        ends = []
        for order in ("ASC", "DESC"):
            row = conn.execute(
                f"SELECT raw FROM ({sql}) WHERE kind = ? ORDER BY value {order} LIMIT 1", [*params, kind]
            ).fetchone()
            if row is None:
                break
            ends.append(_value(kind, row[0]))
        if ends:
            return ends[0], ends[1]
    return None


def fields(conn: sqlite3.Connection, where: Mapping[str, Any]) -> dict[str, list[str]]:
    """The top-level metadata fields of the matching records, each with the kinds of value it holds, sorted
    (``"text"``, ``"number"``, ``"bool"``, ``"null"``, ``"datetime"``, ``"array"``, ``"object"``)."""
    sql, params = where_sql(where)
    kind = _KIND.format(t="e.type", v="e.value")
    rows = conn.execute(
        f"SELECT DISTINCT e.key, {kind} FROM (SELECT metadata AS m FROM records WHERE {sql}) AS r, json_each(r.m) AS e",
        params,
    )
    out: dict[str, list[str]] = {}
    for key, k in rows:
        out.setdefault(key, []).append(k)
    return {key: sorted(kinds) for key, kinds in sorted(out.items())}


def set_metadata(conn: sqlite3.Connection, ids: Sequence[int], metadata: Mapping[str, Any], *, merge: bool) -> None:
    """Set the metadata of stored records (inside the caller's transaction): merged into what each holds (its
    top-level keys replaced or added) or replacing it.

    Raises:
        InvalidArgumentError, NonFiniteError: metadata that cannot be stored (see
            :func:`kvsearch.metadata.codec.check`),
            before anything is written.
    """
    if not isinstance(metadata, Mapping):
        raise InvalidArgumentError(f"expected metadata as a dict, got {type(metadata).__name__}")
    text = check(metadata)
    if not merge:
        conn.executemany("UPDATE records SET metadata = ? WHERE id = ?", ((text if metadata else None, i) for i in ids))
        return
    rows = select_in(conn, "SELECT id, metadata FROM records WHERE id IN ({})", ids)
    merged = ((id_, {**decode(stored), **metadata}) for id_, stored in rows)
    conn.executemany("UPDATE records SET metadata = ? WHERE id = ?", ((encode(m), id_) for id_, m in merged))


def values_present(conn: sqlite3.Connection, texts: Sequence[str]) -> list[bool]:
    """Whether some record has each value text, in order."""
    wanted = sorted(set(texts))
    found = {r[0] for r in select_in(conn, "SELECT DISTINCT value FROM records WHERE value IN ({})", wanted)}
    return [t in found for t in texts]
