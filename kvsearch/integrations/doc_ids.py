"""Document ids as key texts, both ways, without the key's normalisation ever merging two ids.

A framework's document id is an opaque string: "doc-7" and "doc-7 ", or "Müller" in NFC and in NFD, are two
documents. A kvsearch key text is compared after :func:`~kvsearch.inputs.normalize_key` (NFC, surrounding whitespace
stripped), which would make them one. So an id that normalisation would change is stored as its JSON string literal
(ASCII only, quoted: nothing left for normalisation to change), and so is an id that starts with a double quote (so
that the two forms never meet). Every other id — the usual ones, uuids, hashes, "doc-1" — is its own key text, so a
database built by kvsearch itself serves its keys as document ids unchanged.

    key_of_id("doc-1") == "doc-1"          key_of_id("doc-7 ") == '"doc-7 "'
    id_of_key(key_of_id(x)) == x           for every str x
"""

from __future__ import annotations

import json
import unicodedata

__all__ = ["key_of_id", "id_of_key"]


def key_of_id(doc_id: str) -> str:
    """The key text that stores a document id (one to one: two different ids never share a key text).

    Args:
        doc_id: the document's id, any non-empty str.

    Returns:
        The id itself when normalisation leaves it unchanged and it does not start with ``"``; else its JSON
        string literal (ASCII).
    """
    if doc_id.startswith('"') or unicodedata.normalize("NFC", doc_id).strip() != doc_id:
        return json.dumps(doc_id, ensure_ascii=True)
    return doc_id


def id_of_key(key: str) -> str:
    """The document id that a key text stores (the inverse of :func:`key_of_id`).

    Args:
        key: a stored key text.

    Returns:
        The id: the JSON string a key starting with ``"`` holds, else the key itself.
    """
    if key.startswith('"'):
        try:
            value = json.loads(key)
        except ValueError:  # a key that kvsearch did not write this way: served as it is
            return key
        if isinstance(value, str):
            return value
    return key
