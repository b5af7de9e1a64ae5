"""Haystack Documents as kvsearch records and back: the rows a write stores, and the Document a record is.

A Document is one record: id -> key text (:func:`~kvsearch.integrations.doc_ids.key_of_id`), content -> value text (a
document without content has its value given as an embedding, so ``$value`` is None), meta -> the metadata's top
level, embedding -> the key embedding (float32); blob, sparse embedding, score and "no embedding" go in the hidden
``"_haystack"`` field, and ISO date strings get hidden datetime twins (:mod:`kvsearch.integrations.haystack_filters`).
A write is one transaction (:func:`put_rows`). Used by :mod:`kvsearch.integrations.haystack`.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvsearch.database import Database
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, MissingDependencyError
from kvsearch.integrations.doc_ids import id_of_key, key_of_id
from kvsearch.integrations.haystack_filters import RESERVED, hidden_metadata, is_hidden

try:
    from haystack.dataclasses import ByteStream, Document, SparseEmbedding
except ImportError as exc:  # the optional extra is missing
    raise MissingDependencyError(
        f"kvsearch.integrations.haystack needs haystack-ai ({exc}): pip install 'kvsearch[haystack]'"
    ) from exc

__all__ = [
    "Row",
    "checked_documents",
    "check_meta",
    "checked_ids",
    "first_repeated",
    "dim_of",
    "stored_metadata",
    "rows_of",
    "put_rows",
    "document_of",
]


class Row(NamedTuple):
    """One record to write: key text, value text (None: a value given as an embedding), metadata, key embedding."""

    key: str
    content: str | None
    metadata: dict[str, Any]
    embedding: Tensor  # (dim,)


def checked_documents(documents: object) -> list[Document]:
    """The documents of a write, as a list.

    Raises:
        InvalidArgumentError: not a list (or iterable) of Documents, or a meta name starting with ``_haystack``.
    """
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Iterable):
        raise InvalidArgumentError(f"expected a list of Documents, got {type(documents).__name__}")
    docs = list(documents)
    for i, doc in enumerate(docs):
        if not isinstance(doc, Document):
            raise InvalidArgumentError(f"expected a list of Documents, got {type(doc).__name__} at position {i}")
        check_meta(doc.meta)
    return docs


def check_meta(meta: Mapping[str, Any]) -> None:
    """Refuse meta names the adapter keeps for itself.

    Raises:
        InvalidArgumentError: a name starting with ``_haystack``.
    """
    for name in meta:
        if isinstance(name, str) and is_hidden(name):
            raise InvalidArgumentError(
                f"expected meta names that do not start with {RESERVED!r} (the adapter's), got {name!r}"
            )


def checked_ids(ids: object) -> list[str]:
    """Document ids as a list.

    Raises:
        InvalidArgumentError: not a list of str.
    """
    if isinstance(ids, str) or not isinstance(ids, Iterable):
        raise InvalidArgumentError(f"expected a list of document ids, got {type(ids).__name__}")
    ids = list(ids)
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise InvalidArgumentError(f"expected document ids as str, got {bad[0]!r}")
    return ids


def first_repeated(ids: list[str]) -> str:
    """The first id that repeats an earlier one (there must be one)."""
    seen: set[str] = set()
    return next(i for i in ids if i in seen or seen.add(i))  # type: ignore[func-returns-value]


def dim_of(docs: list[Document]) -> int | None:
    """The dim of the documents' embeddings (None: none has one)."""
    dims = {len(d.embedding) for d in docs if d.embedding is not None}
    if len(dims) > 1:
        raise DimensionMismatchError(f"expected embeddings of one dim in a write, got dims {sorted(dims)}")
    return dims.pop() if dims else None


def stored_metadata(doc: Document) -> dict[str, Any]:
    """A document's record metadata: its meta, the hidden date twins, and its extras under ``"_haystack"``."""
    extras: dict[str, Any] = {}
    if doc.embedding is None:
        extras["no_embedding"] = True
    if doc.blob is not None:
        data = base64.b64encode(bytes(doc.blob.data)).decode("ascii")
        extras["blob"] = {"data": data, "mime_type": doc.blob.mime_type, "meta": doc.blob.meta}
    if doc.sparse_embedding is not None:
        extras["sparse_embedding"] = doc.sparse_embedding.to_dict()
    if doc.score is not None:
        extras["score"] = doc.score
    return {**doc.meta, **hidden_metadata(doc.meta), **({RESERVED: extras} if extras else {})}


def rows_of(db: Database, docs: list[Document]) -> list[Row]:
    """The records of documents; a document without an embedding gets the key encoder's embedding of its content
    (when the database has a key encoder and the content is text), else zeros."""
    embeddings = [None if d.embedding is None else torch.tensor(d.embedding, dtype=torch.float32) for d in docs]
    stand_in = [i for i, d in enumerate(docs) if d.embedding is None and d.content and db.encoder is not None]
    if stand_in:
        with torch.no_grad():
            encoded = db.encoder.encode([docs[i].content for i in stand_in]).detach().float().cpu()  # (m, dim)
        for row, i in enumerate(stand_in):
            embeddings[i] = encoded[row]
    zeros = torch.zeros(db.dim)
    return [
        Row(key_of_id(d.id), d.content, stored_metadata(d), zeros if e is None else e)
        for d, e in zip(docs, embeddings, strict=True)
    ]


def put_rows(db: Database, rows: list[Row], *, upsert: bool) -> None:
    """Write rows in one transaction, in order.

    A row's value is its text, or, without one (a document without content), an embedding. Haystack documents
    carry no value embedding: the value encoder's of the text is stored when the database has one, else the key
    embedding when the dims agree, else zeros (a database the store creates has value_dim 1: one zero a record).

    Raises:
        DimensionMismatchError: a key embedding that is not (dim,). KVSearchError: what the database refuses.
            Nothing is written when any is raised.
    """
    for r in rows:
        if r.embedding.shape != (db.dim,):
            raise DimensionMismatchError(f"expected embeddings of dim {db.dim}, got {tuple(r.embedding.shape)}")
    write = db.upsert if upsert else db.add
    with db.atomic():
        start = 0
        while start < len(rows):
            text = rows[start].content is not None
            end = start
            while end < len(rows) and (rows[end].content is not None) == text:
                end += 1
            run = rows[start:end]
            keys = torch.stack([r.embedding for r in run])  # (m, dim)
            values = keys if db.value_dim == db.dim else torch.zeros(len(run), db.value_dim)  # (m, value_dim)
            metadata = [r.metadata for r in run]
            if text and db.value_encoder is not None:
                write([r.key for r in run], [r.content for r in run], metadata, key_embeddings=keys)
            elif text:
                texts = [r.content for r in run]
                write([r.key for r in run], texts, metadata, key_embeddings=keys, value_embeddings=values)
            else:
                write([r.key for r in run], values, metadata, key_embeddings=keys)
            start = end


def document_of(
    id_: int,
    key: str | None,
    value: Any,
    metadata: Mapping[str, Any],
    key_embedding: Tensor | None,
    score: float | None = None,
) -> Document:
    """A record as a Haystack Document (the hidden metadata taken out of meta)."""
    extras = metadata.get(RESERVED)
    extras = extras if isinstance(extras, Mapping) else {}
    blob = extras.get("blob")
    if isinstance(blob, Mapping):
        blob = ByteStream(
            data=base64.b64decode(blob["data"]), meta=dict(blob.get("meta") or {}), mime_type=blob.get("mime_type")
        )
    sparse = extras.get("sparse_embedding")
    return Document(
        id=id_of_key(key) if key is not None else f"#{id_}",
        content=value if isinstance(value, str) else None,
        blob=blob if isinstance(blob, ByteStream) else None,
        meta={k: v for k, v in metadata.items() if not is_hidden(k)},
        score=score if score is not None else extras.get("score"),
        embedding=None if extras.get("no_embedding") or key_embedding is None else key_embedding.tolist(),
        sparse_embedding=SparseEmbedding.from_dict(sparse) if isinstance(sparse, Mapping) else None,
    )
