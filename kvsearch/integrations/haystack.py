"""Haystack: a kvsearch database as a Haystack ``DocumentStore``, with an embedding retriever and a text embedder.

    store = KVSearchDocumentStore()                                  # in memory; path= for a folder
    store.write_documents([Document(id="doc-1", content="...", meta={"lang": "en"}, embedding=[...])])
    store.filter_documents({"field": "meta.lang", "operator": "==", "value": "en"})
    KVSearchEmbeddingRetriever(store, top_k=5).run(query_embedding=[...])["documents"]
    KVSearchDocumentStore(database=db)                               # an open database, fine-tuned or not

A Document is one record: its id is the key text (:mod:`kvsearch.integrations.doc_ids`: any two different ids are
two documents), its content the value text (None: a value given as an embedding), its meta the record's metadata
at the top level, and its embedding the key embedding (float32, never re-encoded). So a database built by kvsearch
itself (keys, values, metadata) serves its records as documents as they are. What else a Document carries (blob,
sparse embedding, score, whether it had an embedding) is kept in one hidden metadata field, ``"_haystack"``, and an
ISO date string in meta gets a hidden datetime twin for date comparisons (``"_haystack:<name>"``): meta names
starting with ``_haystack`` are the adapter's. Haystack filters become kvsearch ``where=`` filters
(:mod:`kvsearch.integrations.haystack_filters` says how, and where the semantics differ).

**Documents without an embedding** are stored with a stand-in key embedding (the database's key encoder on the
content when it has one, else zeros) and are never returned by :class:`KVSearchEmbeddingRetriever`.
**The dim**: a store given ``dim=``, an ``encoder=``, a ``database=`` or the folder of an existing database knows it.
Otherwise the database is created at the first write, with the dim of the first embedding written, or with dim 1
when that write has no embedding; while every stored document lacks an embedding (and the store made the database
itself, in memory or in a folder it created), the first embedding of another dim re-creates it with that dim,
documents kept. Otherwise an embedding of the wrong dim raises ``DimensionMismatchError`` before anything is written.

It owns the mapping between documents and records, and nothing else: it uses the :class:`~kvsearch.Database`'s
public methods only. It needs the ``haystack`` extra (``pip install 'kvsearch[haystack]'``); without it, importing
this module raises :class:`~kvsearch.MissingDependencyError` (an ImportError) that says so.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvsearch.contract import DatabaseProtocol
from kvsearch.database import Database
from kvsearch.errors import (
    DimensionMismatchError,
    DuplicateKeyError,
    InvalidArgumentError,
    MissingDependencyError,
    MissingEncoderError,
    NonFiniteError,
    UnknownOptionError,
)
from kvsearch.integrations.doc_ids import key_of_id
from kvsearch.integrations.haystack_filters import (
    NO_EMBEDDING,
    KVSearchFilterError,
    all_of,
    hidden_metadata,
    is_hidden,
    to_where,
)
from kvsearch.integrations.haystack_records import (
    Row,
    check_meta,
    checked_documents,
    checked_ids,
    dim_of,
    document_of,
    first_repeated,
    put_rows,
    rows_of,
)
from kvsearch.integrations.relevance import check_score_name, scaled_score_fn
from kvsearch.storage.folder import is_database

if TYPE_CHECKING:  # annotations only
    from kvsearch.selection import Selection

try:
    from haystack import component, default_from_dict, default_to_dict
    from haystack.dataclasses import Document
    from haystack.document_stores.errors import DuplicateDocumentError
    from haystack.document_stores.types import DuplicatePolicy, FilterPolicy, apply_filter_policy
except ImportError as exc:  # the optional extra is missing
    raise MissingDependencyError(
        f"kvsearch.integrations.haystack needs haystack-ai ({exc}): pip install 'kvsearch[haystack]'"
    ) from exc

__all__ = [
    "KVSearchDocumentStore",
    "KVSearchEmbeddingRetriever",
    "KVSearchTextEmbedder",
    "KVSearchFilterError",
    "KVSearchDuplicateDocumentError",
]

_FILTER_ERRORS = (InvalidArgumentError, UnknownOptionError, NonFiniteError)
_SERIALISABLE = ("dim", "value_dim", "index", "score", "device", "search_params", "lock_timeout", "read_only")
_CHUNK = 4096  # ids per metadata read of a Python pass (get_metadata_field_unique_values)
_TYPES = {"text": "keyword", "number": "float", "bool": "boolean", "datetime": "date", "array": "list"}


class KVSearchDuplicateDocumentError(DuplicateKeyError, DuplicateDocumentError):
    """A document id is already stored (or repeated in one write) under ``DuplicatePolicy.FAIL``."""


class KVSearchDocumentStore:
    """A Haystack ``DocumentStore`` over a kvsearch database: document ids as keys, contents as values.

    Args:
        path: the folder of a database (created, or reopened with what it was created with); None in memory.
        database: an open :class:`~kvsearch.Database` to serve instead (not closed by :meth:`close`).
        **database_options: passed to :class:`~kvsearch.Database` (``dim=768``, ``index="HNSW32"``,
            ``score="dot"``, ``encoder=...``); ``score`` is the retriever's similarity (cosine by default).

    Raises:
        InvalidArgumentError: both ``database`` and ``path`` / options, or a ``database`` that is no Database.
        UnknownOptionError: a ``score=`` that is not a database score's name (refused here, not at the first write).
        KVSearchError: what :class:`~kvsearch.Database` raises for the folder and options.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        database: Database | None = None,
        **database_options: Any,
    ) -> None:
        if database is not None and (path is not None or database_options):
            raise InvalidArgumentError("expected either database= or path= and database options, got both")
        if database is not None and not isinstance(database, DatabaseProtocol):
            raise InvalidArgumentError(f"expected a kvsearch Database as database=, got {type(database).__name__}")
        check_score_name(database_options.get("score"))
        self._path = None if path is None else Path(path)
        self._options = database_options
        self._owned = database is None  # a database this store opened, and closes
        self._made_folder = False  # whether this store created the database's folder (so may replace it)
        self._db = database
        existing = path is not None and is_database(path)
        given = set(database_options)
        if database is None and not existing and "dim" in given and not {"encoder", "value_encoder"} & given:
            database_options.setdefault("value_dim", 1)  # Haystack has no value vectors: one zero each
        if database is None and ({"dim", "encoder"} & given or existing):
            self._db = Database(path, **database_options)

    @property
    def database(self) -> Database | None:
        """The kvsearch database (None until the first write, for a new one whose dim the documents decide)."""
        return self._db

    def close(self) -> None:
        """Close the database if this store opened it (one passed as ``database=`` stays open)."""
        if self._db is not None and self._owned:
            self._db.close()

    # ------------------------------------------------------------------ serialisation

    def to_dict(self) -> dict[str, Any]:
        """The store as Haystack serialises components: its folder and its JSON-able database options.

        Encoders are not serialised: a database on disk reopens with its own; one in memory comes back empty, with
        the same dim, index and score (its documents are not serialised either, as Haystack's in-memory store).
        """
        if not self._owned:
            db = self._db
            init: dict[str, Any] = {"path": None if db.path is None else str(db.path)}
            if db.path is None:
                init.update(dim=db.dim, value_dim=db.value_dim, index=db.index_spec, score=db.score)
        else:
            init = {"path": None if self._path is None else str(self._path)}
            init.update({k: v for k, v in self._options.items() if k in _SERIALISABLE and v is not None})
            if "device" in init:
                init["device"] = str(init["device"])
        return default_to_dict(self, **init)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSearchDocumentStore:
        """A store from :meth:`to_dict`'s output (``DeserializationError`` for another class's)."""
        return default_from_dict(cls, data)

    # ------------------------------------------------------------------ the protocol

    def count_documents(self) -> int:
        """How many documents are stored."""
        return 0 if self._db is None else len(self._db)

    def filter_documents(self, filters: dict[str, Any] | None = None) -> list[Document]:
        """The documents that match a Haystack filter, in the order they were first written.

        Args:
            filters: a Haystack filter (see :mod:`kvsearch.integrations.haystack_filters`); None or ``{}``: all.

        Returns:
            The documents, with their embeddings (float32 values); the score is the one written, if any.

        Raises:
            KVSearchFilterError: a malformed filter, or one kvsearch cannot evaluate (a Haystack ``FilterError``).
        """
        selection = self._select(filters)
        if selection is None:
            return []
        return [document_of(r.id, r.key, r.value, r.metadata, r.key_embedding) for r in selection.records()]

    def write_documents(self, documents: list[Document], policy: DuplicatePolicy = DuplicatePolicy.NONE) -> int:
        """Write documents; an id already stored is failed, skipped or overwritten as ``policy`` says.

        Args:
            documents: Haystack Documents.
            policy: ``NONE`` (the same as ``FAIL``), ``FAIL``, ``SKIP`` (the first of repeated ids is kept) or
                ``OVERWRITE`` (the whole document is replaced, in place; the last of repeated ids wins).

        Returns:
            How many were written: ``len(documents)`` under OVERWRITE, fewer under SKIP.

        Raises:
            InvalidArgumentError: not a list of Documents, or a meta name starting with ``_haystack``.
            KVSearchDuplicateDocumentError: an id stored or repeated under FAIL (a Haystack DuplicateDocumentError).
            DimensionMismatchError: embeddings of another dim than the database's (or of two dims).
            KVSearchError: what the database refuses (non-finite embeddings, metadata it cannot store...).
            Nothing is written when any of these is raised.
        """
        docs = checked_documents(documents)
        if not isinstance(policy, DuplicatePolicy):
            raise UnknownOptionError(f"expected a DuplicatePolicy, got {policy!r}")
        if policy == DuplicatePolicy.NONE:
            policy = DuplicatePolicy.FAIL
        keys = [key_of_id(d.id) for d in docs]
        if policy == DuplicatePolicy.FAIL and len(set(keys)) < len(keys):
            raise KVSearchDuplicateDocumentError(
                f"expected distinct ids, got {first_repeated([d.id for d in docs])!r} twice"
            )
        kept = list({k: i for i, k in enumerate(keys)}.values())  # the last of repeated ids (OVERWRITE)
        if policy == DuplicatePolicy.SKIP:
            kept = sorted({k: i for i, k in reversed(list(enumerate(keys)))}.values())  # the first of them
        docs = [docs[i] for i in kept]
        dim = dim_of(docs)
        if policy != DuplicatePolicy.OVERWRITE and self._db is not None:
            stored = self._db.ids_of_keys([key_of_id(d.id) for d in docs]).tolist()
            if policy == DuplicatePolicy.FAIL and max(stored) >= 0:
                taken = [d.id for d, i in zip(docs, stored, strict=True) if i >= 0]
                raise KVSearchDuplicateDocumentError(f"expected new ids, got ids already stored: {taken[:5]!r}")
            docs = [d for d, i in zip(docs, stored, strict=True) if i < 0]
        if not docs:
            return 0
        db = self._writable_database(dim)  # made, or re-made with this dim, or DimensionMismatchError
        put_rows(db, rows_of(db, docs), upsert=policy == DuplicatePolicy.OVERWRITE)
        return len(documents) if policy == DuplicatePolicy.OVERWRITE else len(docs)

    def delete_documents(self, document_ids: list[str]) -> None:
        """Delete documents by id; ids that are not stored are skipped.

        Raises:
            InvalidArgumentError: an id that is not a str.
        """
        ids = checked_ids(document_ids)
        if self._db is not None and ids:
            self._db.delete([key_of_id(i) for i in ids if i], missing="ignore")

    # ------------------------------------------------------------------ by filter

    def delete_all_documents(self) -> None:
        """Delete every document, in one transaction."""
        if self._db is not None:
            self._db.clear()

    def delete_by_filter(self, filters: dict[str, Any]) -> int:
        """Delete the documents that match a filter (not empty: :meth:`delete_all_documents` deletes all), in one
        transaction.

        Returns:
            How many were deleted.

        Raises:
            KVSearchFilterError: an empty or bad filter.
        """
        selection = self._select(_not_empty(filters, "delete_by_filter"))
        return 0 if selection is None else len(selection.delete())

    def update_by_filter(self, filters: dict[str, Any], meta: dict[str, Any]) -> int:
        """Merge ``meta`` into the meta of the documents that match a filter (its names replace or join theirs), in
        one transaction; nothing is re-encoded.

        Returns:
            How many were updated.

        Raises:
            KVSearchFilterError: an empty or bad filter. InvalidArgumentError: ``meta`` is no dict, or holds a name
                starting with ``_haystack``, or a value the database cannot store (nothing is written).
        """
        if not isinstance(meta, Mapping):
            raise InvalidArgumentError(f"expected meta as a dict, got {type(meta).__name__}")
        check_meta(meta)
        selection = self._select(_not_empty(filters, "update_by_filter"))
        if selection is None:
            return 0
        dates = hidden_metadata(meta)
        with self._db.atomic():  # the ids read and both updates: one transaction under the write lock
            ids = selection.ids()
            if len(ids) == 0:
                return 0
            self._db.where(ids=ids).update({**meta, **dates}, merge=True)
            for name in hidden_metadata(meta, clear=True).keys() - dates.keys():  # a date no more: its twin goes
                stale = self._db.where({name: {"$exists": True}}, ids=ids)
                if stale.count():
                    stale.update({name: None}, merge=True)
        return len(ids)

    def count_documents_by_filter(self, filters: dict[str, Any]) -> int:
        """How many documents match a filter (None or ``{}``: all)."""
        selection = self._select(filters)
        return 0 if selection is None else selection.count()

    # ------------------------------------------------------------------ metadata aggregation

    def count_unique_metadata_by_filter(self, filters: dict[str, Any], metadata_fields: list[str]) -> dict[str, int]:
        """For each field (``"meta."`` optional), how many distinct non-null values it has among the documents that
        match a filter, as kvsearch counts them (``1`` and ``1.0`` are one value; a list counts each member).

        Returns:
            ``{field without "meta.": count}``.
        """
        if isinstance(metadata_fields, str) or not all(isinstance(f, str) for f in metadata_fields):
            raise InvalidArgumentError(f"expected metadata_fields as a list of str, got {metadata_fields!r}")
        selection = self._select(filters)
        out = {}
        for field in metadata_fields:
            name = _meta_name(field)
            values = [] if selection is None or name is None else selection.distinct(name)
            out[field.removeprefix("meta.")] = sum(1 for value, _ in values if value is not None)
        return out

    def get_metadata_fields_info(self) -> dict[str, dict[str, str]]:
        """The top-level meta fields stored, each as ``{"type": ...}``: ``"keyword"`` (text), ``"float"`` (numbers),
        ``"boolean"``, ``"date"``, ``"list"``, ``"object"``, or ``"keyword"`` for a field of several kinds."""
        if self._db is None:
            return {}
        out = {}
        for name, kinds in self._db.where().fields().items():
            kinds = [k for k in kinds if k != "null"]
            if kinds and not is_hidden(name):
                out[name] = {"type": _TYPES.get(kinds[0], kinds[0]) if len(kinds) == 1 else "keyword"}
        return out

    def get_metadata_field_min_max(self, metadata_field: str) -> dict[str, Any]:
        """The smallest and largest value of a meta field (``"meta."`` optional): over its numbers when it holds any,
        else its datetimes, else its strings; ``{"min": None, "max": None}`` when no document has one."""
        name = _meta_name(metadata_field)
        found = None if self._db is None or name is None else self._db.where().min_max(name)
        return {"min": None, "max": None} if found is None else {"min": found[0], "max": found[1]}

    def get_metadata_field_unique_values(
        self,
        metadata_field: str,
        search_term: str | None = None,
        from_: int = 0,
        size: int = 10,
        filters: dict[str, Any] | None = None,
    ) -> tuple[list[Any], int]:
        """The distinct non-null values of a meta field among the documents that match ``filters``, as Haystack's
        in-memory store gives them: typed (``1``, ``1.0``, ``"1"`` and ``True`` are four values), a list as one
        value, sorted by their text, paged by ``from_`` / ``size``, and filtered by ``search_term`` (a
        case-insensitive substring of the value's text). Read by a pass over the matching documents' metadata.

        Returns:
            (the page of values, how many distinct values there are in all).
        """
        name = _meta_name(metadata_field)
        selection = self._select(filters)
        if selection is None or name is None:
            return [], 0
        ids = self._where(all_of(selection.where, {name: {"$ne": None}})).ids()
        unique: dict[tuple[str, Any], Any] = {}
        for start in range(0, len(ids), _CHUNK):
            for metadata in self._db.metadata_of(ids[start : start + _CHUNK]).values():
                value = _at_path(metadata, name)
                if value is not None:
                    unique.setdefault((type(value).__name__, _hashable(value)), value)
        if search_term:
            unique = {k: v for k, v in unique.items() if search_term.lower() in str(v).lower()}
        order = sorted(unique, key=lambda k: (str(unique[k]), k[0]))
        return [unique[k] for k in order[from_ : from_ + size]], len(order)

    # ------------------------------------------------------------------ retrieval

    def embedding_retrieval(
        self,
        query_embedding: Sequence[float],
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        return_embedding: bool = False,
        scale_score: bool = False,
    ) -> list[Document]:
        """The ``top_k`` documents with an embedding nearest to a query embedding, best first, scored.

        Args:
            query_embedding: the query's embedding (dim,).
            filters: a Haystack filter on the candidates.
            top_k: how many (0: none); fewer when fewer match.
            return_embedding: give each document its embedding.
            scale_score: scale the scores to [0, 1] as Haystack's ``InMemoryDocumentStore`` does: a cosine ``s`` to
                ``(s + 1) / 2``, a dot product (``dot``, ``scaled_dot``) to ``expit(s / 100)``, a ``gaussian`` to
                ``1 / (1 + sqrt(-s))`` (:mod:`kvsearch.integrations.relevance`); the order does not change.

        Returns:
            Documents whose ``score`` is the database's (its ``score``: cosine by default; higher is closer), or
            that score scaled.

        Raises:
            InvalidArgumentError: an empty or non-numeric query, a negative ``top_k``, or a ``scale_score`` that is
                not a bool.
            DimensionMismatchError: a query of another dim than the stored embeddings'.
            KVSearchFilterError: a bad filter.
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidArgumentError(f"expected top_k as an int >= 0, got {top_k!r}")
        if not isinstance(scale_score, bool):
            raise InvalidArgumentError(f"expected scale_score as a bool, got {scale_score!r}")
        where = all_of(to_where(filters), {NO_EMBEDDING: {"$ne": True}})  # documents with an embedding only
        query = _query_tensor(query_embedding)  # (dim,)
        if self._db is None or top_k == 0:
            return []
        candidates = self._where(where)  # the filter checked (KVSearchFilterError)
        if query.shape[0] != self._db.dim and candidates.count() == 0:
            return []  # nothing to compare with (a stand-in dim while no document has an embedding)
        hits = self._db.search(query, k=top_k, where=where)
        keys = self._db.embeddings([h.id for h in hits])[0].cpu() if return_embedding and hits else None  # (k, dim)
        scaled = scaled_score_fn(self._db.score) if scale_score else float
        return [
            document_of(h.id, h.key, h.value, h.metadata, None if keys is None else keys[i], score=scaled(h.score))
            for i, h in enumerate(hits)
        ]

    # ------------------------------------------------------------------ the database

    def _where(self, where: Mapping[str, Any]) -> Selection:
        try:
            return self._db.where(where)
        except _FILTER_ERRORS as exc:
            raise KVSearchFilterError(f"expected a filter kvsearch can evaluate: {exc}") from exc

    def _select(self, filters: Mapping[str, Any] | None) -> Selection | None:
        """The records a Haystack filter selects (None while there is no database); the filter is checked anyway."""
        where = to_where(filters)
        return None if self._db is None else self._where(where)

    def _create(self, dim: int, path: Path | None) -> Database:
        options = dict(self._options)
        if "value_encoder" not in options:
            options.setdefault("value_dim", 1)  # Haystack has no value vectors: one zero each
        return Database(path, dim=dim, **options)

    def _writable_database(self, dim: int | None) -> Database:
        """The database to write documents of this dim to (None: no embedding among them), made or re-made."""
        if self._db is None:
            self._made_folder = self._path is not None and (not self._path.exists() or not any(self._path.iterdir()))
            self._db = self._create(dim or 1, self._path)
        elif dim is not None and dim != self._db.dim and self._resizable():
            self._resize(dim)
        elif dim is not None and dim != self._db.dim:
            raise DimensionMismatchError(f"expected embeddings of dim {self._db.dim} (the database's), got dim {dim}")
        return self._db

    def _resizable(self) -> bool:
        """Whether the database may be re-made with another dim: this store sized it itself and no document in it
        has an embedding."""
        sized_here = self._owned and not ({"dim", "encoder"} & set(self._options)) and self._db.encoder is None
        in_place = self._path is None or self._made_folder
        return sized_here and in_place and self._db.where({NO_EMBEDDING: {"$ne": True}}).count() == 0

    def _resize(self, dim: int) -> None:
        """Re-make the database with this dim, its documents (none with an embedding) copied in id order."""
        old = self._db
        rows = [Row(r.key, r.value, r.metadata, torch.zeros(dim)) for r in old.where().records()]
        if self._path is None:
            new = self._create(dim, None)
            put_rows(new, rows, upsert=False)
            old.close()
            self._db = new
            return
        tag = uuid.uuid4().hex[:8]
        staging = self._path.with_name(f".{self._path.name}.resized-{tag}")
        new = self._create(dim, staging)
        put_rows(new, rows, upsert=False)
        new.close()
        old.close()
        self._db = None
        trash = self._path.with_name(f".{self._path.name}.old-{tag}")
        self._path.rename(trash)  # the new folder takes the old one's place; then the old one goes
        staging.rename(self._path)
        shutil.rmtree(trash)
        self._db = self._create(dim, self._path)


# ---------------------------------------------------------------------------------------------- helpers


def _not_empty(filters: Any, where: str) -> Any:
    if not filters:
        raise KVSearchFilterError(f"expected a filter for {where}, got {filters!r} (delete_all_documents deletes all)")
    return filters


def _meta_name(field: str) -> str | None:
    """A meta field name without its ``"meta."`` (None for a hidden one)."""
    name = field.removeprefix("meta.")
    return None if is_hidden(name) or name.startswith("$") else name


def _at_path(metadata: Mapping[str, Any], path: str) -> Any:
    value: Any = metadata
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_hashable(v) for v in value))
    if isinstance(value, Mapping):
        return ("dict", frozenset((k, _hashable(v)) for k, v in value.items()))
    return value


def _query_tensor(query: object) -> Tensor:
    if isinstance(query, (str, bytes)) or not isinstance(query, Sequence) or not query:
        raise InvalidArgumentError(f"expected a query embedding as a non-empty list of floats, got {query!r:.80}")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in query):
        raise InvalidArgumentError("expected a query embedding as a list of floats, got other items")
    return torch.tensor(list(query), dtype=torch.float32)  # (dim,)


# ---------------------------------------------------------------------------------------------- components


@component
class KVSearchEmbeddingRetriever:
    """A Haystack component: the documents of a :class:`KVSearchDocumentStore` nearest to a query embedding.

    Documents stored without an embedding are never returned. Scores are the database's (cosine similarity by
    default: higher is closer).

    Args:
        document_store: the store to search.
        filters: a Haystack filter applied to every query (see ``filter_policy``).
        top_k: how many documents a query returns at most (> 0).
        filter_policy: ``REPLACE`` (the run's filters replace ``filters``) or ``MERGE`` (both apply).
        return_embedding: give each document its embedding.
        scale_score: scale the scores to [0, 1] as Haystack's in-memory retriever does (see
            :meth:`KVSearchDocumentStore.embedding_retrieval`).

    Raises:
        InvalidArgumentError: a store of another type, ``top_k`` < 1, or a ``scale_score`` that is not a bool.
    """

    def __init__(
        self,
        document_store: KVSearchDocumentStore,
        filters: dict[str, Any] | None = None,
        top_k: int = 10,
        filter_policy: FilterPolicy | str = FilterPolicy.REPLACE,
        return_embedding: bool = False,
        scale_score: bool = False,
    ) -> None:
        if not isinstance(document_store, KVSearchDocumentStore):
            raise InvalidArgumentError(f"expected a KVSearchDocumentStore, got {type(document_store).__name__}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise InvalidArgumentError(f"expected top_k as an int >= 1, got {top_k!r}")
        if not isinstance(scale_score, bool):
            raise InvalidArgumentError(f"expected scale_score as a bool, got {scale_score!r}")
        self.document_store = document_store
        self.filters = filters
        self.top_k = top_k
        self.filter_policy = (
            filter_policy if isinstance(filter_policy, FilterPolicy) else FilterPolicy.from_str(filter_policy)
        )
        self.return_embedding = return_embedding
        self.scale_score = scale_score

    def to_dict(self) -> dict[str, Any]:
        """The component as Haystack serialises it (the store by its own ``to_dict``)."""
        return default_to_dict(
            self,
            document_store=self.document_store.to_dict(),
            filters=self.filters,
            top_k=self.top_k,
            filter_policy=self.filter_policy.value,
            return_embedding=self.return_embedding,
            scale_score=self.scale_score,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSearchEmbeddingRetriever:
        """The component from :meth:`to_dict`'s output."""
        return default_from_dict(cls, _with_store(data))

    @component.output_types(documents=list[Document])
    def run(
        self,
        query_embedding: list[float],
        filters: dict[str, Any] | None = None,
        top_k: int | None = None,
        return_embedding: bool | None = None,
        scale_score: bool | None = None,
    ) -> dict[str, list[Document]]:
        """The documents nearest to ``query_embedding``, best first.

        Args:
            query_embedding: the query's embedding.
            filters: a Haystack filter for this run (replacing or merged with the component's, by its policy).
            top_k: how many at most (None: the component's; 0: none).
            return_embedding: None: the component's.
            scale_score: None: the component's.

        Returns:
            ``{"documents": [...]}``.
        """
        return {
            "documents": self.document_store.embedding_retrieval(
                query_embedding,
                filters=apply_filter_policy(self.filter_policy, self.filters, filters),
                top_k=self.top_k if top_k is None else top_k,
                return_embedding=self.return_embedding if return_embedding is None else return_embedding,
                scale_score=self.scale_score if scale_score is None else scale_score,
            )
        }


@component
class KVSearchTextEmbedder:
    """A Haystack component: a query text embedded by the store's database itself, with its query-side encoder
    (the fine-tuned one after :func:`kvsearch.finetune`) or else its key encoder — the embedding a
    :class:`KVSearchEmbeddingRetriever` of the same database expects.

    Args:
        document_store: the store whose database embeds the text.

    Raises:
        InvalidArgumentError: a store of another type.
    """

    def __init__(self, document_store: KVSearchDocumentStore) -> None:
        if not isinstance(document_store, KVSearchDocumentStore):
            raise InvalidArgumentError(f"expected a KVSearchDocumentStore, got {type(document_store).__name__}")
        self.document_store = document_store

    def to_dict(self) -> dict[str, Any]:
        """The component as Haystack serialises it (the store by its own ``to_dict``)."""
        return default_to_dict(self, document_store=self.document_store.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSearchTextEmbedder:
        """The component from :meth:`to_dict`'s output."""
        return default_from_dict(cls, _with_store(data))

    @component.output_types(embedding=list[float])
    def run(self, text: str) -> dict[str, list[float]]:
        """``{"embedding": [...]}``: the text's query embedding (float32 values).

        Raises:
            InvalidArgumentError: ``text`` is no str. MissingEncoderError: the database has no encoder for texts.
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"expected a str to embed, got {type(text).__name__}")
        db = self.document_store.database
        encoder = None if db is None else (db.query_encoder or db.encoder)
        if encoder is None:
            raise MissingEncoderError(
                "expected a database with a key or query encoder to embed texts with; it has none"
            )
        with torch.no_grad():
            embedding = encoder.encode([text]).detach().float().cpu()[0]  # (dim,)
        return {"embedding": embedding.tolist()}


def _with_store(data: dict[str, Any]) -> dict[str, Any]:
    """Serialised component data with its document store deserialised (what ``default_from_dict`` takes)."""
    init = dict(data.get("init_parameters", {}))
    if isinstance(init.get("document_store"), Mapping):
        init["document_store"] = KVSearchDocumentStore.from_dict(init["document_store"])
    return {**data, "init_parameters": init}
