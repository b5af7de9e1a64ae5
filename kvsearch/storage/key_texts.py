"""The key texts of a store's records and which texts came with their embedding: the maps a store reads lazily.

:class:`KeyTexts` holds the normalised key -> id map, the id -> key map and the given flags, and finds ids by key
text (:meth:`KeyTexts.id_of`, :meth:`KeyTexts.stored_ids_of_keys`, :meth:`KeyTexts.resolve`); :func:`read_key_texts`
reads them in the caller's snapshot; :func:`id_of_key_map` builds the first map from the second (keys an earlier
version stored unnormalised are found by their normalised text). It knows nothing of tensors, transactions or the
in-memory table.
"""

from __future__ import annotations

import sqlite3
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsearch.errors import DuplicateKeyError, KeyNotFoundError
from kvsearch.inputs import normalize_key
from kvsearch.storage.schema import GIVEN_KEY, GIVEN_VALUE

__all__ = ["KeyTexts", "id_of_key_map", "read_key_texts"]


@dataclass
class KeyTexts:
    """The key maps and given flags of the records a store's table holds (:attr:`kvsearch.storage.store.Store.texts`).

    Attributes:
        id_of_key: the normalised key text (:func:`~kvsearch.inputs.normalize_key`) -> id.
        key_of_id: id -> the key text as stored.
        given_keys, given_values: ids of records whose key / value text came with its embedding.
    """

    id_of_key: dict[str, int]
    key_of_id: dict[int, str]
    given_keys: set[int]
    given_values: set[int]

    def forget(self, id_: int) -> None:
        """Drop a record's key (the normalised key only if it names this record) and its given flags."""
        key = self.key_of_id.pop(id_, None)
        if key is not None and self.id_of_key.get(normalize_key(key)) == id_:
            del self.id_of_key[normalize_key(key)]
        self.given_keys.discard(id_)
        self.given_values.discard(id_)

    def follow(
        self, ids: Sequence[int], texts: Sequence[str | None], replaced: Sequence[int], given: Sequence[tuple[int, int]]
    ) -> None:
        """Follow a committed write: ids and their key texts (None: none), the replaced ids, (id, given bits)."""
        for id_ in replaced:
            self.forget(id_)
        for id_, bits in given:
            if bits & GIVEN_KEY:
                self.given_keys.add(id_)
            if bits & GIVEN_VALUE:
                self.given_values.add(id_)
        for id_, key in zip(ids, texts):
            if key is not None:
                self.id_of_key[normalize_key(key)] = id_
                self.key_of_id[id_] = key

    def id_of(self, key: str) -> int:
        """The id of the record with this key text, -1 if none: compared after :func:`normalize_key`.

        Keys stored by an earlier version that did not normalise are found by their normalised text too.
        """
        return self.id_of_key.get(normalize_key(key), -1)

    def stored_ids_of_keys(self, keys: Sequence[str | None], *, allow: bool) -> list[int | None]:
        """The stored id of each key text (None for a new key or no text).

        Args:
            keys: key texts, or None for keys given as embeddings.
            allow: whether stored keys are allowed (an upsert); else one raises.

        Raises:
            DuplicateKeyError: a key is already stored and ``allow`` is False.
        """
        out: list[int | None] = [None] * len(keys)
        for i, key in enumerate(keys):
            id_ = -1 if key is None else self.id_of(key)
            if id_ >= 0:
                if not allow:
                    raise DuplicateKeyError(
                        f"expected new keys, got {key!r} (record {i}) which is already stored; use upsert"
                    )
                out[i] = id_
        return out

    def resolve(self, items: Sequence[str | int], consequence: str, contains_id: Callable[[int], bool]) -> list[int]:
        """The stored ids of key texts and ids, in order, without repeats.

        Args:
            items: key texts and int ids.
            consequence: what the error message adds, e.g. ``"nothing was deleted"``.
            contains_id: whether an id is stored (the store's table's :meth:`contains_id`).

        Raises:
            KeyNotFoundError: a key or an id is not stored.
        """
        ids: list[int] = []
        for item in items:
            if isinstance(item, str):
                id_ = self.id_of(item)
                if id_ < 0:
                    raise KeyNotFoundError(f"expected a stored key, got {item!r}; {consequence}")
                ids.append(id_)
            else:
                if not contains_id(item):
                    raise KeyNotFoundError(f"expected a stored id, got {item}; {consequence}")
                ids.append(int(item))
        return list(dict.fromkeys(ids))


def read_key_texts(conn: sqlite3.Connection, held: Callable[[list[int]], set[int]], where: Path | None) -> KeyTexts:
    """The key maps and given flags of the records ``held`` keeps (inside the caller's snapshot).

    Args:
        conn: the store's connection. held: those of some ids the table holds (a store ahead of its table names
            records the table does not hold yet). where: the store's file, for the warning of clashing keys.
    """
    rows = conn.execute("SELECT id, key FROM records WHERE key IS NOT NULL").fetchall()
    given = conn.execute("SELECT id, side FROM given").fetchall()
    kept = held([r[0] for r in rows] + [g[0] for g in given])
    key_of_id = {i: key for i, key in rows if i in kept}
    return KeyTexts(
        id_of_key=id_of_key_map(key_of_id, where),
        key_of_id=key_of_id,
        given_keys={i for i, bits in given if bits & GIVEN_KEY and i in kept},
        given_values={i for i, bits in given if bits & GIVEN_VALUE and i in kept},
    )


def id_of_key_map(key_of_id: dict[int, str], where: Path | None) -> dict[str, int]:
    """The normalised key -> id map of the stored keys.

    Keys written by this version are normalised already. Keys an earlier version stored as given (surrounding
    whitespace, NFD) are found by their normalised text; should two of them normalise alike, the key names the
    older record (the smaller id), the other stays reachable by id, and a RuntimeWarning names them.
    """
    id_of_key = {normalize_key(key): id_ for id_, key in key_of_id.items()}
    if len(id_of_key) == len(key_of_id):
        return id_of_key
    groups: dict[str, list[int]] = {}
    for id_, key in sorted(key_of_id.items()):
        groups.setdefault(normalize_key(key), []).append(id_)
    clashes = {key: ids for key, ids in groups.items() if len(ids) > 1}
    shown = "; ".join(f"{key!r}: ids {ids}" for key, ids in list(clashes.items())[:5])
    warnings.warn(
        f"kvsearch: {where or 'a database in memory'} holds {len(clashes)} keys stored by an earlier version that "
        f"are equal after normalisation (NFC, surrounding whitespace stripped): {shown}. Each key names its "
        "smallest id; the others are reachable by id only (get / delete by id).",
        RuntimeWarning,
        stacklevel=5,  # past read_key_texts and Store.texts: the caller's line
    )
    return {key: ids[0] for key, ids in groups.items()}
