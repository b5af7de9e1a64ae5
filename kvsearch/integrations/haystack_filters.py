"""Haystack filters as kvsearch ``where=`` filters: a pure translation, and the metadata layout it relies on.

    to_where({"field": "meta.year", "operator": ">=", "value": 2000})   ->  {"year": {"$gte": 2000}}
    to_where({"operator": "NOT", "conditions": [{"field": "content", "operator": "==", "value": "x"}]})
                                                                        ->  {"$not": {"$value": "x"}}

**Fields.** ``id`` is the record's key text (:func:`~kvsearch.integrations.doc_ids.key_of_id`: ids are opaque, so
only ``==``, ``!=``, ``in`` and ``not in`` apply), ``content`` its value text (``$value``; the same four operators),
``meta.a.b`` the metadata path ``a.b`` (as is a bare name that is no Document field: Haystack's legacy form),
``score`` the stored score, and ``embedding`` / ``blob`` / ``sparse_embedding`` compare with None only (whether the
document has one). A dotted field outside ``meta`` names nothing and is treated as missing, as Haystack does.

**Semantics** are Haystack's (``haystack.utils.filters``) on kvsearch's typed comparison: ``==`` / ``in`` match
missing fields only through None, ``!=`` / ``not in`` match missing fields, ``>`` ``>=`` ``<`` ``<=`` with None
match nothing and take a number, a datetime / date, or a string that is an ISO 8601 date (YYYY-MM-DD, optionally
with a time): another string, a list or a bool raises :class:`KVSearchFilterError`, as does a non-list operand of
``in`` / ``not in`` and any malformed filter. Dates compare as instants: a metadata string that is an ISO date is
mirrored as a datetime in a hidden field when written (:func:`hidden_metadata`), and a filter's ISO date compares
against the mirror and against stored datetimes. Where kvsearch differs: comparison is typed (``True`` is not ``1``,
``"1"`` is not ``1``), a naive datetime is UTC (Haystack gives it the other side's zone), and ``==`` with a list
or dict operand raises (kvsearch compares scalars).

**Hidden metadata.** One top-level field, :data:`RESERVED` (``"_haystack"``), holds what a Document has beyond id,
content, meta and embedding (blob, sparse embedding, score, whether it had an embedding), and each date mirror is a
top-level field ``"_haystack:" + name``; none of them is ever part of a Document's meta.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

from kvsearch.errors import InvalidArgumentError, MissingDependencyError
from kvsearch.integrations.doc_ids import key_of_id

try:
    from haystack.errors import FilterError
except ImportError as exc:  # the optional extra is missing
    raise MissingDependencyError(
        f"kvsearch.integrations.haystack needs haystack-ai ({exc}): pip install 'kvsearch[haystack]'"
    ) from exc

__all__ = [
    "KVSearchFilterError",
    "RESERVED",
    "DATES",
    "NO_EMBEDDING",
    "NOTHING",
    "to_where",
    "iso_datetime",
    "hidden_metadata",
    "is_hidden",
    "all_of",
]

RESERVED = "_haystack"  #: the hidden metadata field of a document's extras
DATES = RESERVED + ":"  #: the prefix of a hidden date mirror: "_haystack:date" mirrors "date"
NO_EMBEDDING = RESERVED + ".no_embedding"  #: the path that is True for a document stored without an embedding
NOTHING: dict[str, Any] = {"$id": {"$in": []}}  #: a kvsearch filter that no record matches

LOGICAL = ("AND", "OR", "NOT")
COMPARISONS = ("==", "!=", ">", ">=", "<", "<=", "in", "not in")
_ORDER = {">": "$gt", ">=": "$gte", "<": "$lt", "<=": "$lte"}
_SCALARS = (str, bool, int, float)
_NONE_ONLY = {"embedding": (NO_EMBEDDING, True), "blob": (RESERVED + ".blob", None)}
_NONE_ONLY["sparse_embedding"] = (RESERVED + ".sparse_embedding", None)

Node = dict[str, Any] | bool  # a kvsearch filter, or a constant: True (every record) / False (none)


class KVSearchFilterError(InvalidArgumentError, FilterError):
    """A Haystack filter that is malformed or that kvsearch cannot evaluate (a Haystack ``FilterError`` too)."""


def to_where(filters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kvsearch ``where=`` filter that selects the records whose documents match a Haystack filter.

    Args:
        filters: a Haystack filter (a comparison ``{"field", "operator", "value"}`` or a logic
            ``{"operator": "AND" | "OR" | "NOT", "conditions": [...]}``); None or ``{}`` matches every document.

    Returns:
        A kvsearch filter: ``{}`` for every record, :data:`NOTHING` for none.

    Raises:
        KVSearchFilterError: a malformed filter, an unknown operator or field, or an operand the operator does not
            take; the message names the place in the filter (``filters.conditions[1].value``).
    """
    if filters is None or (isinstance(filters, Mapping) and not filters):
        return {}
    node = _node(filters, "filters")
    if node is True:
        return {}
    return NOTHING if node is False else node


def all_of(*filters: Mapping[str, Any]) -> dict[str, Any]:
    """The kvsearch filters ANDed (``{}`` parts dropped; :data:`NOTHING` wins)."""
    parts: list[Node] = [False if f == NOTHING else (dict(f) if f else True) for f in filters]
    node = _all(parts)
    if node is True:
        return {}
    return NOTHING if node is False else node


# ---------------------------------------------------------------------------------------------- dates


def iso_datetime(value: object) -> datetime | None:
    """The datetime an ISO 8601 date string names (``YYYY-MM-DD``, optionally followed by ``T`` or a space and a
    time), else None (as Haystack reads dates: a year alone or ``20240101`` is no date)."""
    if not isinstance(value, str) or len(value) < 10:
        return None
    shape = value[:4].isdigit() and value[4] == "-" and value[5:7].isdigit() and value[7] == "-"
    if not (shape and value[8:10].isdigit() and (len(value) == 10 or value[10] in "Tt ")):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _mirror(value: Any) -> Any:
    """A value's date mirror: an ISO date string as its datetime, a dict as the mirrors of its items; else None."""
    if isinstance(value, str):
        return iso_datetime(value)
    if isinstance(value, Mapping):
        out = {k: m for k, v in value.items() if isinstance(k, str) and (m := _mirror(v)) is not None}
        return out or None
    return None


def hidden_metadata(meta: Mapping[str, Any], *, clear: bool = False) -> dict[str, Any]:
    """The hidden date mirrors of a document's meta: ``{"_haystack:name": mirror}`` for each top-level name whose
    value is (or holds, in nested dicts) an ISO date string.

    Args:
        meta: the document's meta.
        clear: also give None for the names without one (an update that must drop a stale mirror).
    """
    out = {}
    for name, value in meta.items():
        if not isinstance(name, str) or "." in name or name.startswith("$"):
            continue  # a name no filter can reach (kvsearch refuses "$" names anyway)
        mirror = _mirror(value)
        if mirror is not None or clear:
            out[DATES + name] = mirror
    return out


def is_hidden(name: str) -> bool:
    """Whether a top-level metadata name is the adapter's own (never part of a Document's meta)."""
    return name.startswith(RESERVED)


# ---------------------------------------------------------------------------------------------- logic


def _all(parts: list[Node]) -> Node:
    if any(p is False for p in parts):
        return False
    kept = [p for p in parts if p is not True]
    if not kept:
        return True
    return kept[0] if len(kept) == 1 else {"$and": kept}


def _any(parts: list[Node]) -> Node:
    if any(p is True for p in parts):
        return True
    kept = [p for p in parts if p is not False]
    if not kept:
        return False
    return kept[0] if len(kept) == 1 else {"$or": kept}


def _negate(node: Node) -> Node:
    return (not node) if isinstance(node, bool) else {"$not": node}


def _node(f: object, at: str) -> Node:
    if not isinstance(f, Mapping):
        raise KVSearchFilterError(f"expected a filter dict at {at}, got {type(f).__name__}")
    if "field" in f:
        return _comparison(f, at)
    for needed in ("operator", "conditions"):
        if needed not in f:
            raise KVSearchFilterError(f"expected an '{needed}' key in the logic filter at {at}, got keys {sorted(f)}")
    op, conditions = f["operator"], f["conditions"]
    if op not in LOGICAL:
        raise KVSearchFilterError(f"expected a logical operator among {LOGICAL} at {at}.operator, got {op!r}")
    if not isinstance(conditions, (list, tuple)):
        raise KVSearchFilterError(f"expected a list of conditions at {at}.conditions, got {type(conditions).__name__}")
    parts = [_node(c, f"{at}.conditions[{i}]") for i, c in enumerate(conditions)]
    if op == "OR":
        return _any(parts)
    return _all(parts) if op == "AND" else _negate(_all(parts))


# ---------------------------------------------------------------------------------------------- comparisons


def _comparison(f: Mapping[str, Any], at: str) -> Node:
    for needed in ("operator", "value"):
        if needed not in f:
            raise KVSearchFilterError(f"expected a '{needed}' key in the comparison at {at}, got keys {sorted(f)}")
    field, op, value = f["field"], f["operator"], f["value"]
    if op not in COMPARISONS:
        raise KVSearchFilterError(f"expected a comparison operator among {COMPARISONS} at {at}.operator, got {op!r}")
    if not isinstance(field, str) or not field:
        raise KVSearchFilterError(f"expected a field name (str) at {at}.field, got {field!r}")
    if op in ("in", "not in") and not isinstance(value, list):
        raise KVSearchFilterError(f"expected a list as the value of '{op}' at {at}.value, got {type(value).__name__}")
    here = f"{at}.value"
    if field == "id":
        return _opaque("$key", op, value, here, key_of_id)
    if field == "content":
        return _opaque("$value", op, value, here, lambda v: v)
    if field in _NONE_ONLY:
        return _none_only(field, op, value, here)
    if field == "score":
        return _meta(RESERVED + ".score", op, value, here)
    if field == "meta" or field.startswith(RESERVED) or field.startswith("meta." + RESERVED):
        raise KVSearchFilterError(f"expected a field 'meta.<name>' of the documents at {at}.field, got {field!r}")
    if field.startswith("meta."):
        return _meta(field[5:], op, value, here)
    if "." in field:  # a dotted field outside meta names nothing: its value is None, as in Haystack
        return _on_none(op, value, here)
    return _meta(field, op, value, here)  # a bare name: Haystack's legacy spelling of meta.<name>


def _on_none(op: str, value: Any, at: str) -> bool:
    """The comparison of a missing value (None) with ``value``, evaluated here: a constant."""
    if op in ("==", "!="):
        return (value is None) == (op == "==")
    if op in ("in", "not in"):
        return (None in value) == (op == "in")
    return False  # order comparisons with None hold for nothing


def _opaque(name: str, op: str, value: Any, at: str, text: Any) -> Node:
    """``id`` / ``content``: text compared whole (==, !=, in, not in); ``text`` maps an operand to the stored text."""
    if op in _ORDER:
        if value is None:
            return False
        raise KVSearchFilterError(f"expected ==, !=, in or not in for {name} (ordering texts is not supported) at {at}")
    if op in ("==", "!="):
        values = [value]
    else:
        values = value
    kept = [None if v is None else text(v) for v in values if v is None or isinstance(v, str)]
    if name == "$key":
        kept = [v for v in kept if v is not None]  # every document has an id
    if not kept:
        return op in ("!=", "not in")  # no document has such an id or content
    if op in ("==", "!="):
        return {name: kept[0]} if op == "==" else {name: {"$ne": kept[0]}}
    return {name: {"$in": kept}} if op == "in" else {name: {"$nin": kept}}


def _none_only(field: str, op: str, value: Any, at: str) -> Node:
    path, absent = _NONE_ONLY[field]
    if op not in ("==", "!=") or value is not None:
        raise KVSearchFilterError(f"expected == None or != None for {field} at {at}, got {op!r} {value!r}")
    return {path: absent} if op == "==" else {path: {"$ne": absent}}


def _equal(path: str, value: Any, at: str) -> Node:
    """``path == value`` as Haystack means it: an ISO date string or a datetime equal as an instant too."""
    if value is None:
        return {path: None}
    if isinstance(value, date):
        return _any([{path: value}, {DATES + path: value}])
    if not isinstance(value, _SCALARS):
        raise KVSearchFilterError(
            f"expected a str, number, bool, None or datetime to compare {path!r} with at {at}, got "
            f"{type(value).__name__} (lists and dicts compare whole in Haystack; kvsearch compares scalars)"
        )
    when = iso_datetime(value)
    if when is None:
        return {path: value}
    return _any([{path: value}, {path: when}, {DATES + path: when}])


def _meta(path: str, op: str, value: Any, at: str) -> Node:
    if op in _ORDER:
        return _order(path, _ORDER[op], value, at)
    values = [value] if op in ("==", "!=") else value
    parts = [_equal(path, v, f"{at}[{i}]" if op in ("in", "not in") else at) for i, v in enumerate(values)]
    plain = [p[path] for p in parts if isinstance(p, dict) and list(p) == [path]]
    if len(plain) == len(parts) and len(parts) != 1:
        node: Node = {path: {"$in": plain}}  # scalars: one $in (None in it matches a missing field too)
    else:
        node = _any(parts)
    if op in ("==", "in"):
        return node
    if isinstance(node, dict) and list(node) == [path] and not isinstance(node[path], Mapping):
        return {path: {"$ne": node[path]}}  # != a scalar (or None): $ne matches a missing field, as Haystack
    if isinstance(node, dict) and list(node) == [path] and "$in" in node[path]:
        return {path: {"$nin": node[path]["$in"]}}
    return _negate(node)


def _order(path: str, op: str, value: Any, at: str) -> Node:
    if value is None:
        return False  # Haystack: None is not ordered; nothing matches
    if isinstance(value, str):
        when = iso_datetime(value)
        if when is None:
            raise KVSearchFilterError(
                f"expected a number, a datetime or an ISO 8601 date string to order {path!r} by at {at}, got the "
                f"string {value!r} (strings compare only as dates)"
            )
        value = when
    if isinstance(value, date):
        return _any([{path: {op: value}}, {DATES + path: {op: value}}])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {path: {op: value}}
    raise KVSearchFilterError(
        f"expected a number, a datetime or an ISO 8601 date string to order {path!r} by at {at}, got "
        f"{type(value).__name__}"
    )
