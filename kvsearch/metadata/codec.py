"""Record metadata as stored: a JSON object, with datetimes and dates as tagged objects, checked on the way in.

What metadata may hold: dicts with str keys, lists, str, bool, None, finite floats, integers within 64 bits (what
SQLite's JSON functions read exactly, hence what a filter can compare), and :class:`datetime.datetime` /
:class:`datetime.date` values, at any depth. A key may not start with ``$`` (the filter language's and the tags'
namespace), as in MongoDB. A key holding ``.`` is stored but cannot be named by a filter's dot path.

A datetime is stored as ``{"$datetime": "<ISO 8601>", "$epoch_us": <microseconds since 1970-01-01 UTC>}`` and a date
as ``{"$date": "<ISO date>", "$epoch_us": <its midnight UTC>}``: the ISO text gives the same value back (an aware
datetime with its offset, a naive one naive, a date a date), the instant is what filters compare. A **naive** datetime
is taken as UTC (as pymongo does); a date is its midnight UTC. So ``date(2024, 1, 1)`` equals
``datetime(2024, 1, 1, tzinfo=timezone.utc)`` and ``datetime(2024, 1, 1)`` in a filter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import UTC, date, datetime
from typing import Any

from kvsearch.errors import InvalidArgumentError, NonFiniteError

__all__ = ["encode", "decode", "from_json", "check", "to_json", "epoch_us", "DATETIME", "DATE", "EPOCH_US", "INT64"]

DATETIME, DATE, EPOCH_US = "$datetime", "$date", "$epoch_us"
INT64 = (-(2**63), 2**63 - 1)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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


def _checked(value: Any, path: str) -> Any:
    """``value`` in its JSON form (datetimes tagged), checked; ``path`` names it in errors."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        if not INT64[0] <= value <= INT64[1]:
            raise InvalidArgumentError(f"expected an integer within 64 bits in metadata at {path}, got {value}")
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NonFiniteError(f"expected finite numbers in metadata, got {path}={value}")
        return value
    if isinstance(value, date):  # datetime is a date
        return _tagged(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidArgumentError(f"expected metadata with str keys, got {key!r} in {path}")
            if key.startswith("$"):
                raise InvalidArgumentError(
                    f"expected metadata keys that do not start with '$' (the filter language's), got {key!r} in {path}"
                )
            out[key] = _checked(item, f"{path}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_checked(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise InvalidArgumentError(
        f"expected JSON-like metadata (dict, list, str, int, float, bool, None, datetime, date) at {path}, "
        f"got {type(value).__name__}"
    )


def check(metadata: Mapping[str, Any], where: str = "metadata") -> str:
    """Check one record's metadata and return the JSON text it is stored as.

    Args:
        metadata: a dict with str keys.
        where: how errors name it (e.g. "metadata at position 3").

    Returns:
        The JSON text (UTF-8 encodable; datetimes and dates tagged).

    Raises:
        InvalidArgumentError: a key that is not a str or starts with ``$``, an integer beyond 64 bits, a value of
            another type, text that is not valid Unicode (a lone surrogate).
        NonFiniteError: a NaN or infinite number.
    """
    text = json.dumps(_checked(metadata, where), allow_nan=False, ensure_ascii=False)
    try:  # UTF-8 as stored: a lone surrogate in a string is refused
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"expected valid Unicode text in {where}: {exc}") from None
    return text


def encode(metadata: Mapping[str, Any] | None) -> str | None:
    """The stored JSON text of metadata already checked (:func:`check`): None for none or ``{}``."""
    return check(metadata) if metadata else None


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
