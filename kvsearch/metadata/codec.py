"""Record metadata as stored: a JSON object, with datetimes and dates as tagged objects, checked on the way in.

What metadata may hold: dicts with str keys, lists, str, bool, None, finite floats, integers within 64 bits (what
SQLite's JSON functions read exactly, hence what a filter can compare), and :class:`datetime.datetime` /
:class:`datetime.date` values, at most :data:`MAX_DEPTH` levels of dicts and lists deep. numpy scalars (and 0-d
arrays) of bool, integer, floating and str dtypes are taken as the Python value they hold (``np.int64(3)`` is ``3``);
other numpy values, arrays included, are refused (store ``array.tolist()``). A key may not start with ``$`` (the
filter language's and the tags' namespace), as in MongoDB. A key holding ``.`` (or a quote, a backslash, a bracket,
a control character) is stored and read back, but no filter can name it: a filter's dot path names nested fields. No
text (a key or a string, at any depth) may hold a NUL character: SQLite compares text only up to a NUL, so a filter
would see such a string cut there (keys and values refuse NUL too). Metadata that contains itself (a cycle) is
refused, naming where.

A datetime is stored as ``{"$datetime": "<ISO 8601>", "$epoch_us": <microseconds since 1970-01-01 UTC>}`` and a date
as ``{"$date": "<ISO date>", "$epoch_us": <its midnight UTC>}``: the ISO text gives the same value back (an aware
datetime with its offset, a naive one naive, a date a date), the instant is what filters compare. A **naive** datetime
is taken as UTC (as pymongo does); a date is its midnight UTC. So ``date(2024, 1, 1)`` equals
``datetime(2024, 1, 1, tzinfo=timezone.utc)`` and ``datetime(2024, 1, 1)`` in a filter.

The check is one walk (:func:`check`), done once per record at the door: :func:`checked` keeps the stored text with
the dict (:class:`Checked`) and :func:`encode` writes that text without walking again. The walk recurses at most
:data:`MAX_DEPTH` deep and builds a field's path only when it refuses something there; a NUL is looked for in the
JSON text (one scan), and located only when found.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from typing import Any

import numpy as np

from kvsearch.errors import InvalidArgumentError, NonFiniteError

__all__ = [
    "encode",
    "decode",
    "from_json",
    "check",
    "checked",
    "Checked",
    "python_scalar",
    "to_json",
    "epoch_us",
    "DATETIME",
    "DATE",
    "EPOCH_US",
    "INT64",
    "MAX_DEPTH",
]

DATETIME, DATE, EPOCH_US = "$datetime", "$date", "$epoch_us"
INT64 = (-(2**63), 2**63 - 1)
#: Metadata nests at most this many levels of dicts and lists (the record's own dict is level 1), as MongoDB's
#: documents: far below Python's recursion limit (1,000, which ``json.loads`` meets reading it back) and SQLite's
#: JSON depth limit (1,000 or 2,000 by version).
MAX_DEPTH = 100
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NUL_ESCAPED = "\\u0000"  # how JSON writes a NUL, in keys and strings alike
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, check_circular=False)  # the walk refuses cycles
#: numpy dtype kinds taken as the Python value they hold.
_NUMPY_KINDS: dict[str, type] = {"b": bool, "i": int, "u": int, "f": float, "U": str}
_WHY_NUL = "SQLite compares text only up to a NUL, so a filter would see the text cut there"


def epoch_us(value: date) -> int:
    """The instant of a datetime or date in microseconds since 1970-01-01 UTC (naive and dates as UTC)."""
    if not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    if value.tzinfo is None or value.utcoffset() is None:
        value = value.replace(tzinfo=UTC)
    delta = value - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _tagged(value: date) -> dict[str, Any]:
    if isinstance(value, datetime):
        return {DATETIME: value.isoformat(), EPOCH_US: epoch_us(value)}
    return {DATE: value.isoformat(), EPOCH_US: epoch_us(value)}


class _Refused(Exception):
    """A refusal deep in the walk: each dict or list it leaves adds its key or index to ``path`` (innermost first),
    so the path is built only for the field refused."""

    def __init__(self, error: type[Exception], message: Callable[[str], str]) -> None:
        super().__init__()
        self.error, self.message, self.path = error, message, []


class _TooDeep(_Refused):
    """A dict or list deeper than :data:`MAX_DEPTH`: too deep, or a cycle (told apart by :func:`_too_deep`)."""

    def __init__(self) -> None:
        super().__init__(InvalidArgumentError, str)


def _path_text(path: list[str | int]) -> str:
    """A field's path as errors name it: ``.name`` for a plain key, ``['odd key']`` for another, ``[3]`` for an
    index."""
    out = []
    for step in path:
        if isinstance(step, int):
            out.append(f"[{step}]")
        elif step and step.isprintable() and "." not in step and "[" not in step:
            out.append(f".{step}")
        else:
            out.append(f"[{step!r}]")
    return "".join(out)


def _checked(value: Any, depth: int) -> Any:
    """``value`` in its JSON form (datetimes tagged, numpy scalars as Python's), checked; ``depth``: the levels of
    dicts and lists it is in. Exact types first (the common case costs a type test or two), the rest in
    :func:`_other`."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is int:
        if INT64[0] <= value <= INT64[1]:
            return value
        raise _Refused(
            InvalidArgumentError, lambda at: f"expected an integer within 64 bits in metadata at {at}, got {value}"
        )
    if kind is float:
        if math.isfinite(value):
            return value
        raise _Refused(NonFiniteError, lambda at: f"expected finite numbers in metadata, got {at}={value}")
    if kind is dict:
        return _mapping(value, depth + 1)
    if kind is list:
        return _sequence(value, depth + 1)
    return _other(value, depth)


def _other(value: Any, depth: int) -> Any:
    """:func:`_checked` for subclasses (``np.float64``, ``np.str_``, an ``IntEnum``), dates, other mappings and
    sequences, numpy scalars."""
    if isinstance(value, str):
        return str.__str__(value)  # its characters: str() of an np.str_ drops a trailing NUL
    if isinstance(value, (int, float)):  # bool is final: not here
        return _checked((int if isinstance(value, int) else float)(value), depth)
    if isinstance(value, date):  # datetime is a date
        return _tagged(value)
    if isinstance(value, Mapping):
        return _mapping(value, depth + 1)
    if isinstance(value, (list, tuple)):
        return _sequence(value, depth + 1)
    plain = python_scalar(value)
    if plain is not value:
        return _checked(plain, depth)
    if isinstance(value, np.ndarray):
        shape = tuple(value.shape)
        raise _Refused(
            InvalidArgumentError,
            lambda at: f"expected JSON-like metadata at {at}, got a numpy array of shape {shape}: store its .tolist()",
        )
    name = f"numpy {value.dtype}" if isinstance(value, np.generic) else type(value).__name__
    raise _Refused(
        InvalidArgumentError,
        lambda at: (
            f"expected JSON-like metadata (dict, list, str, int, float, bool, None, datetime, date, or a numpy "
            f"bool, integer, floating or str scalar) at {at}, got {name}"
        ),
    )


def python_scalar(value: Any) -> Any:
    """A numpy scalar or 0-d array of a bool, integer, floating or str dtype as the Python value it holds
    (``np.bool_`` a bool, an integer an int, a floating a float, ``np.str_`` a str); anything else as it is."""
    if isinstance(value, (np.generic, np.ndarray)) and value.ndim == 0 and value.dtype.kind in _NUMPY_KINDS:
        if isinstance(value, str):  # np.str_: its characters (its str() drops trailing NULs)
            return str.__str__(value)
        return _NUMPY_KINDS[value.dtype.kind](value)
    return value


def _mapping(value: Mapping[Any, Any], depth: int) -> dict[str, Any]:
    if depth > MAX_DEPTH:
        raise _TooDeep()
    out = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise _Refused(
                InvalidArgumentError, lambda at, key=key: f"expected metadata with str keys, got {key!r} in {at}"
            )
        if key[:1] == "$":
            raise _Refused(
                InvalidArgumentError,
                lambda at, key=key: (
                    f"expected metadata keys that do not start with '$' (the filter language's), got {key!r} in {at}"
                ),
            )
        try:
            out[key] = _checked(item, depth)
        except _Refused as exc:
            exc.path.append(key)
            raise
    return out


def _sequence(value: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
    if depth > MAX_DEPTH:
        raise _TooDeep()
    out = []
    for i, item in enumerate(value):
        try:
            out.append(_checked(item, depth))
        except _Refused as exc:
            exc.path.append(i)
            raise
    return out


def _too_deep(metadata: Any, path: list[str | int], where: str) -> InvalidArgumentError:
    """The error for a walk that went past :data:`MAX_DEPTH` along ``path``: a cycle when a dict or list on the
    path comes again (named at both places), else nesting too deep."""
    node, seen = metadata, {id(metadata): (0, metadata)}  # the nodes kept alive: their ids stay theirs
    for i, step in enumerate(path, start=1):
        node = node[step]
        first, _ = seen.setdefault(id(node), (i, node))
        if first != i:
            return InvalidArgumentError(
                f"expected metadata without cycles, got metadata that contains itself: {where}{_path_text(path[:i])} "
                f"is {where}{_path_text(path[:first])}, a {type(node).__name__} inside itself"
            )
    text = _path_text(path)
    shown = text if len(text) <= 120 else f"{text[:60]}...{text[-40:]}"
    return InvalidArgumentError(
        f"expected metadata nested at most {MAX_DEPTH} levels deep (dicts and lists; the record's dict is level 1), "
        f"got deeper at {where}{shown}"
    )


def _nul_error(tree: Any, where: str) -> InvalidArgumentError | None:
    """The error for the first NUL in a checked tree's keys and strings, in walk order; None if there is none (the
    text only held a backslash followed by ``u0000``)."""
    stack: list[tuple[Any, list[str | int]]] = [(tree, [])]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if "\x00" in node:
                return InvalidArgumentError(
                    f"expected metadata text without NUL characters ({_WHY_NUL}), got one in the string at "
                    f"{where}{_path_text(path)}: {node[:60]!r}"
                )
        elif isinstance(node, dict):
            for key in node:
                if "\x00" in key:
                    return InvalidArgumentError(
                        f"expected metadata field names without NUL characters ({_WHY_NUL}), got the field name "
                        f"{key[:60]!r} at {where}{_path_text(path)}"
                    )
            stack.extend((node[key], [*path, key]) for key in reversed(node))
        elif isinstance(node, list):
            stack.extend((item, [*path, i]) for i, item in reversed(list(enumerate(node))))
    return None


def check(metadata: Mapping[str, Any], where: str = "metadata") -> str:
    """Check one record's metadata and return the JSON text it is stored as.

    Args:
        metadata: a dict with str keys.
        where: how errors name it (e.g. "metadata at position 3"); a field's path follows it (``.author.tags[2]``).

    Returns:
        The JSON text (UTF-8 encodable; datetimes and dates tagged; numpy scalars as Python's).

    Raises:
        InvalidArgumentError: a key that is not a str or starts with ``$``, an integer beyond 64 bits, a value of
            another type (a numpy array included), text that is not valid Unicode (a lone surrogate), a NUL
            character in a key or a string, nesting deeper than :data:`MAX_DEPTH`, metadata that contains itself.
        NonFiniteError: a NaN or infinite number.
    """
    try:
        tree = _checked(metadata, 0)
    except _TooDeep as exc:
        raise _too_deep(metadata, exc.path[::-1], where) from None
    except _Refused as exc:
        raise exc.error(exc.message(where + _path_text(exc.path[::-1]))) from None
    text = _ENCODER.encode(tree)
    if _NUL_ESCAPED in text:
        error = _nul_error(tree, where)
        if error is not None:
            raise error
    try:  # UTF-8 as stored: a lone surrogate in a string is refused
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"expected valid Unicode text in {where}: {exc}") from None
    return text


class Checked(dict):  # type: ignore[type-arg]
    """A record's metadata as :func:`checked` let it in: the dict as given (a shallow copy) and ``text``, the JSON it
    is stored as, which :func:`encode` writes without walking the dict again."""

    text: str


def checked(metadata: Mapping[str, Any], where: str = "metadata") -> Checked:
    """:func:`check` one record's metadata, keeping its stored text with it (:class:`Checked`).

    Raises:
        As :func:`check`.
    """
    out = Checked(metadata)
    out.text = check(metadata, where)
    return out


def encode(metadata: Mapping[str, Any] | None) -> str | None:
    """The stored JSON text of metadata: None for none or ``{}``; a :class:`Checked` dict's own text, else checked
    here (:func:`check`)."""
    if not metadata:
        return None
    return metadata.text if type(metadata) is Checked else check(metadata)


def _hook(obj: dict[str, Any]) -> Any:
    if EPOCH_US in obj and len(obj) == 2:
        if DATETIME in obj:
            return datetime.fromisoformat(obj[DATETIME])
        if DATE in obj:
            return date.fromisoformat(obj[DATE])
    return obj


def from_json(text: str) -> Any:
    """Stored JSON text (metadata, or one value of it) back to Python: tagged datetimes and dates as such."""
    return json.loads(text, object_hook=_hook)


def decode(text: str | None) -> dict[str, Any]:
    """Stored metadata text back to the dict ({} for none)."""
    return from_json(text) if text else {}


def to_json(value: Any) -> Any:
    """A metadata value (decoded) in plain JSON form, for printing: datetimes and dates as ISO text."""
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value
