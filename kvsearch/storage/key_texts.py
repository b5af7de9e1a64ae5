"""The key texts of a store's records and which texts came with their embedding: the maps a mirror reads lazily.

:class:`KeyTexts` holds the normalised key -> id map, the id -> key map and the given flags; :func:`id_of_key_map`
builds the first from the second (keys an earlier version stored unnormalised are found by their normalised text).
It knows nothing of tensors or SQL.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsearch.inputs import normalize_key
from kvsearch.storage.schema import GIVEN_KEY, GIVEN_VALUE

__all__ = ["KeyTexts", "id_of_key_map"]


@dataclass
class KeyTexts:
    """The key maps and given flags of the records a mirror holds (see :attr:`~kvsearch.storage.mirror.Mirror.texts`).

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
        stacklevel=5,  # the line it named before the mirror left Store: one frame more (Store.load -> Mirror.load)
    )
    return {key: ids[0] for key, ids in groups.items()}
