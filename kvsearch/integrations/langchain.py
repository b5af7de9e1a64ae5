"""LangChain: a kvsearch database as a ``langchain_core`` vector store, and so as a retriever.

    store = KVSearchVectorStore(embeddings)                        # a new database in memory; path= for a folder
    store.add_documents([Document(page_content="...", metadata={...})], ids=["doc-1"])
    store.similarity_search("question", k=4, filter={"lang": "en"})
    store.max_marginal_relevance_search("question", k=4, fetch_k=20, lambda_mult=0.5)  # as_retriever(search_type="mmr")
    KVSearchVectorStore(database=db).as_retriever(search_kwargs={"k": 2}).invoke("Lipto")   # an open database

A document is one record: its id is the key text, its page content the value text, its metadata the record's
metadata; LangChain filters are kvsearch ``where=`` filters. Document ids are opaque strings, never normalised: an
id that the key's normalisation would change ("doc-7 ", "Müller" in NFD) is stored as its JSON literal
(:mod:`kvsearch.integrations.doc_ids`), so two ids that differ in any character are two documents, and the keys of a
database built by kvsearch itself are served as they are. Embeddings come from the LangChain ``Embeddings``
(``embed_documents`` for the records, passed as ``key_embeddings=``; ``embed_query`` for queries, searched as
tensors) or, when ``embedding`` is None, from the database's own encoders (a fine-tuned one included). Adding a
document whose id is stored replaces the whole document, metadata included (as LangChain's ``InMemoryVectorStore``);
deleting ids that are not stored is not an error. Scores are the database's similarities (higher is closer), not
distances; LangChain's relevance in [0, 1] is :func:`kvsearch.integrations.relevance.relevance_fn`'s for the
database's score (finite and monotone for every score: a logistic for ``dot`` / ``scaled_dot``, ``1 / (1 + d /
sqrt(2))`` of the distance for ``gaussian``); maximal marginal relevance picks among the filtered ``fetch_k``
nearest by their stored key embeddings. A given id is kept (``0`` becomes ``"0"``); None gets a uuid4; ``""`` and
bools are refused. Embeddings of another size than the database's are refused before anything is written, by
``add_texts`` as by a search (``DimensionMismatchError``).

It owns the mapping between documents and records, and nothing else: search, storage and encoders are the
:class:`~kvsearch.Database`'s. It needs the ``langchain`` extra (``pip install 'kvsearch[langchain]'``); without
it, importing this module raises :class:`~kvsearch.MissingDependencyError` (an ImportError) that says so.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvsearch.contract import DatabaseProtocol
from kvsearch.database import Database
from kvsearch.errors import (
    DimensionMismatchError,
    InvalidArgumentError,
    KeyNotFoundError,
    MissingDependencyError,
    MissingEncoderError,
)
from kvsearch.inputs import normalize_key
from kvsearch.integrations.doc_ids import id_of_key, key_of_id
from kvsearch.integrations.relevance import check_score_name, relevance_fn
from kvsearch.results import Hit
from kvsearch.storage.folder import is_database

try:
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import VectorStore
    from langchain_core.vectorstores.utils import maximal_marginal_relevance
except ImportError as exc:  # the optional extra is missing
    raise MissingDependencyError(
        f"kvsearch.integrations.langchain needs langchain-core ({exc}): pip install 'kvsearch[langchain]'"
    ) from exc

__all__ = ["KVSearchVectorStore"]


class KVSearchVectorStore(VectorStore):
    """A LangChain ``VectorStore`` over a kvsearch database: documents' ids as keys, their page content as values.

    Args:
        embedding: a LangChain ``Embeddings`` that embeds documents and queries; None to use the database's own
            encoders (the key encoder for documents, the query-side one or the key encoder for queries).
        path: the folder of a database (created, or reopened with what it was created with); None in memory.
            With ``embedding`` given, a new database is created at the first add, with the embeddings' dim.
        database: an open :class:`~kvsearch.Database` to serve instead (not closed by :meth:`close`).
        **database_options: passed to :class:`~kvsearch.Database` (``index="HNSW32"``, ``score=...``,
            ``encoder=...`` ...).

    Raises:
        InvalidArgumentError: both ``database`` and ``path`` / options, or an ``embedding`` that is not a LangChain
            ``Embeddings``.
        UnknownOptionError: a ``score=`` that is not a database score's name (a callable included), refused here
            even when the database is made at the first add.
        MissingEncoderError: no ``embedding`` and a database with no key encoder to embed documents with.
    """

    def __init__(
        self,
        embedding: Embeddings | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        database: Database | None = None,
        **database_options: Any,
    ) -> None:
        if embedding is not None and not isinstance(embedding, Embeddings):
            raise InvalidArgumentError(f"expected a LangChain Embeddings or None, got {type(embedding).__name__}")
        if database is not None and (path is not None or database_options):
            raise InvalidArgumentError("expected either database= or path= and database options, got both")
        if database is not None and not isinstance(database, DatabaseProtocol):
            raise InvalidArgumentError(f"expected a kvsearch Database as database=, got {type(database).__name__}")
        check_score_name(database_options.get("score"))  # now, not at the first add that makes the database
        self._embedding = embedding
        self._path = path
        self._options = database_options
        self._owned = database is None  # a database this store opened, and closes
        self._db = database
        known_dim = "dim" in database_options or "encoder" in database_options
        if self._db is None and (embedding is None or known_dim or (path is not None and is_database(path))):
            self._db = Database(path, **database_options)
        if embedding is None and self._db.encoder is None:
            raise MissingEncoderError(
                "expected a LangChain embedding=, or a database with a key encoder to embed documents with; "
                "this database has none"
            )

    # ------------------------------------------------------------------ the database

    @property
    def database(self) -> Database | None:
        """The kvsearch database (None until the first add, for a new one sized by the LangChain embeddings)."""
        return self._db

    @property
    def embeddings(self) -> Embeddings | None:
        """The LangChain embeddings (None when the database's own encoders are used)."""
        return self._embedding

    def close(self) -> None:
        """Close the database if this store opened it (one passed as ``database=`` stays open)."""
        if self._db is not None and self._owned:
            self._db.close()

    def _database_of_dim(self, dim: int) -> Database:
        if self._db is None:  # a new database, sized by the first embeddings
            options = dict(self._options)
            if "value_encoder" not in options:
                options.setdefault("value_dim", dim)
            self._db = Database(self._path, dim=dim, **options)
        return self._db

    def _embed_documents(self, texts: list[str]) -> Tensor:
        """The documents' embeddings (n, dim), float32: one row per text, of one size, that the database's dim
        (once it has one) matches."""
        if self._embedding is None:
            return self._db.encoder.encode(texts).detach().float()  # (n, dim)
        rows = list(self._embedding.embed_documents(texts))  # lists, or a numpy array's rows
        sizes = sorted({len(row) for row in rows})
        if len(sizes) != 1 or len(rows) != len(texts):
            raise DimensionMismatchError(
                f"expected the LangChain embeddings to give one embedding per text ({len(texts)}), all of one "
                f"size, got {len(rows)} of sizes {sizes}"
            )
        if self._db is not None and sizes[0] != self._db.dim:
            raise DimensionMismatchError(
                f"expected document embeddings of dim {self._db.dim} (the database's), got dim {sizes[0]} from "
                f"the LangChain embeddings: embed with the model the database was built with, or use another path"
            )
        return torch.tensor(np.asarray(rows, dtype=np.float32))  # (n, dim)

    # ------------------------------------------------------------------ writing

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str | None] | None = None,
        **kwargs: Any,
    ) -> list[str]:
        """Add texts as documents; a stored id is replaced whole (page content, embedding and metadata: a document
        added without metadata has none). An id that is None gets a uuid4; any other id is kept, as its ``str``
        (``0`` is the id ``"0"``); ``""`` and bools are refused (an empty or a yes/no field passed as an id).

        Args:
            texts: the page contents.
            metadatas: one JSON-serialisable dict per text (or None: no metadata).
            ids: one id per text, opaque strings (never normalised); within one call, the last of repeated ids wins.

        Returns:
            The ids, in order.

        Raises:
            InvalidArgumentError: lengths that differ, an id that is ``""`` or a bool, or an unknown keyword argument.
            DimensionMismatchError: embeddings of another size than the database's (or of two sizes).
            KVSearchError: what the database refuses (non-finite embeddings, bad metadata...). Nothing is written
                when any of these is raised.
        """
        _no_extra(kwargs, "add_texts")
        texts = list(texts)
        n = len(texts)
        for name, given in (("metadatas", metadatas), ("ids", ids)):
            if given is not None and len(given) != n:
                raise InvalidArgumentError(f"expected one of {name} per text ({n}), got {len(given)}")
        ids = [_doc_id(i, at) for at, i in enumerate(ids if ids is not None else [None] * n)]
        if n == 0:
            return []
        last = list({id_: i for i, id_ in enumerate(ids)}.values())  # one row per id: its last occurrence
        kept_texts = [texts[i] for i in last]
        embs = self._embed_documents(kept_texts)  # (m, dim)
        db = self._database_of_dim(embs.shape[1])
        values = None  # the value encoder embeds the page content; else the documents' embeddings are the values
        if db.value_encoder is None:
            if db.value_dim != embs.shape[1]:
                raise MissingEncoderError(
                    f"expected a database with a value encoder, or value_dim {embs.shape[1]} (the documents' "
                    f"embeddings), got value_dim {db.value_dim} and no value encoder"
                )
            values = embs
        metadata = [{} if metadatas is None or metadatas[i] is None else metadatas[i] for i in last]  # {} clears
        keys = [key_of_id(ids[i]) for i in last]
        db.upsert(keys, kept_texts, metadata, key_embeddings=embs, value_embeddings=values)
        return ids

    def add_documents(self, documents: list[Document], **kwargs: Any) -> list[str]:
        """Add documents, each under its own ``id`` (None: a uuid4) unless ``ids=`` is given, as :meth:`add_texts`.

        LangChain's default passes the documents' ids only when one of them is truthy, so a document whose id is
        ``0`` would get a uuid; here every given id is kept.
        """
        if "ids" not in kwargs:
            kwargs["ids"] = [doc.id for doc in documents]
        return self.add_texts([d.page_content for d in documents], [d.metadata for d in documents], **kwargs)

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Delete documents by id; ids that are not stored are skipped. None deletes nothing (as LangChain's
        in-memory store).

        Returns:
            True once the stored ones among ``ids`` are deleted; False for ``ids=None``.
        """
        _no_extra(kwargs, "delete")
        if ids is None:
            return False
        if self._db is not None and ids:
            self._db.delete([key_of_id(str(i)) for i in ids], missing="ignore")
        return True

    # ------------------------------------------------------------------ reading

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The stored documents among ``ids``, in that order (missing ids skipped, repeated ids once)."""
        if self._db is None:
            return []
        wanted = list(dict.fromkeys(str(i) for i in ids))
        documents = []
        for id_ in self._db.ids_of_keys([key_of_id(i) for i in wanted]).tolist():
            try:
                record = self._db.get(id_) if id_ >= 0 else None
            except KeyNotFoundError:  # deleted since its id was read
                record = None
            if record is not None:
                content = record.value if record.value is not None else ""
                doc_id = id_of_key(record.key)
                documents.append(Document(id=doc_id, page_content=content, metadata=record.metadata))
        return documents

    def similarity_search(
        self, query: str, k: int = 4, filter: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[Document]:
        """The k documents most similar to a query text, best first; ``filter`` is a kvsearch ``where=`` filter."""
        return [doc for doc, _ in self.similarity_search_with_score(query, k, filter, **kwargs)]

    def similarity_search_with_score(
        self, query: str, k: int = 4, filter: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[tuple[Document, float]]:
        """As :meth:`similarity_search`, with each document's score: the database's similarity (higher is closer;
        not a distance as in LangChain's Chroma and FAISS stores)."""
        _no_extra(kwargs, "similarity_search")
        if self._db is None:
            return []
        if self._embedding is not None:
            return self.similarity_search_by_vector_with_score(self._embedding.embed_query(query), k, filter)
        return [(_document(h), h.score) for h in self._db.search(query, k=k, where=filter)]

    def similarity_search_by_vector(
        self, embedding: list[float], k: int = 4, filter: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> list[Document]:
        """The k documents most similar to a query embedding, best first."""
        _no_extra(kwargs, "similarity_search_by_vector")
        return [doc for doc, _ in self.similarity_search_by_vector_with_score(embedding, k, filter)]

    def similarity_search_by_vector_with_score(
        self, embedding: list[float], k: int = 4, filter: Mapping[str, Any] | None = None
    ) -> list[tuple[Document, float]]:
        """As :meth:`similarity_search_by_vector`, with each document's score."""
        if self._db is None:
            return []
        q = torch.tensor(embedding, dtype=torch.float32)  # (dim,)
        return [(_document(h), h.score) for h in self._db.search(q, k=k, where=filter)]

    def max_marginal_relevance_search(
        self,
        query: str,
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        *,
        filter: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """The k documents picked by maximal marginal relevance among the ``fetch_k`` nearest to a query text.

        The query is embedded by the LangChain embeddings, or else by the database's encoder for queries; then as
        :meth:`max_marginal_relevance_search_by_vector`.

        Args:
            query: the query text.
            k: how many documents (fewer when fewer match).
            fetch_k: how many nearest documents (that match ``filter``) to choose among.
            lambda_mult: in [0, 1]: 1 ranks by similarity to the query alone, 0 by diversity alone.
            filter: a kvsearch ``where=`` filter.

        Returns:
            The documents, in the order MMR picked them.

        Raises:
            InvalidArgumentError: ``k`` or ``fetch_k`` not an integer >= 1, ``lambda_mult`` outside [0, 1], or an
                unknown keyword argument; what :meth:`~kvsearch.Database.search` raises.
        """
        _no_extra(kwargs, "max_marginal_relevance_search")
        if self._embedding is not None:
            embedding = self._embedding.embed_query(query)
            return self.max_marginal_relevance_search_by_vector(embedding, k, fetch_k, lambda_mult, filter=filter)
        _check_mmr(k, fetch_k, lambda_mult)
        if self._db is None:
            return []
        encoder = self._db.query_encoder or self._db.encoder  # the one a text search encodes with
        q = encoder.encode([normalize_key(query)])[0].detach().float()  # (dim,): encoded once, searched by vector
        return self._pick_mmr(q, self._db.search(q, k=fetch_k, where=filter), k, lambda_mult)

    def max_marginal_relevance_search_by_vector(
        self,
        embedding: list[float],
        k: int = 4,
        fetch_k: int = 20,
        lambda_mult: float = 0.5,
        *,
        filter: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        """The k documents picked by maximal marginal relevance among the ``fetch_k`` nearest to a query embedding.

        The ``fetch_k`` nearest documents that match ``filter`` (by the database's score), then LangChain's
        ``maximal_marginal_relevance`` over their stored key embeddings (cosine similarity, ``lambda_mult``).

        Args:
            embedding: the query embedding (dim,).
            k, fetch_k, lambda_mult, filter: as :meth:`max_marginal_relevance_search`.

        Returns:
            The documents, in the order MMR picked them.

        Raises:
            As :meth:`max_marginal_relevance_search`; DimensionMismatchError, NonFiniteError for the embedding.
        """
        _no_extra(kwargs, "max_marginal_relevance_search_by_vector")
        _check_mmr(k, fetch_k, lambda_mult)
        if self._db is None:
            return []
        q = torch.tensor(embedding, dtype=torch.float32)  # (dim,)
        return self._pick_mmr(q, self._db.search(q, k=fetch_k, where=filter), k, lambda_mult)

    def _pick_mmr(self, query: Tensor, hits: list[Hit], k: int, lambda_mult: float) -> list[Document]:
        """MMR over the hits' stored key embeddings (hits deleted since the search are left out)."""
        if not hits:
            return []
        keys, _, mask = self._db.embeddings([h.id for h in hits])  # (n, dim), _, (n,)
        kept = mask.cpu().tolist()
        hits = [h for h, stored in zip(hits, kept, strict=True) if stored]
        keys = keys[mask].detach().float().cpu()  # (m, dim)
        q = query.detach().float().cpu().numpy()  # (dim,)
        picked = maximal_marginal_relevance(q, keys.numpy(), lambda_mult=lambda_mult, k=k)
        return [_document(hits[i]) for i in picked]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        """The database's score mapped to a relevance in [0, 1] (see ``similarity_search_with_relevance_scores``
        and :func:`kvsearch.integrations.relevance.relevance_fn`): finite, monotone, for every score."""
        score = self._db.score if self._db is not None else self._options.get("score") or "cosine"
        return relevance_fn(score)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings | None,
        metadatas: list[dict[str, Any]] | None = None,
        *,
        ids: list[str] | None = None,
        **kwargs: Any,
    ) -> KVSearchVectorStore:
        """A new store (``path=``, ``database=`` or database options in ``kwargs``) holding these texts."""
        store = cls(embedding, **kwargs)
        store.add_texts(texts, metadatas, ids=ids)
        return store


def _document(hit: Hit) -> Document:
    """A search hit as a LangChain document: the id its key text stores (the record id when it has none)."""
    content = hit.value if isinstance(hit.value, str) else ""
    doc_id = id_of_key(hit.key) if hit.key is not None else str(hit.id)
    return Document(id=doc_id, page_content=content, metadata=hit.metadata)


def _doc_id(given: object, at: int) -> str:
    """A document id as given (its ``str``: ``0`` is ``"0"``), a uuid4 for None; ``""`` and bools refused."""
    if given is None:
        return str(uuid.uuid4())
    if isinstance(given, (bool, np.bool_)) or given == "":
        raise InvalidArgumentError(
            f"expected each id as a non-empty str (or None for a new uuid4), got {given!r} at position {at}"
        )
    return str(given)


def _check_mmr(k: object, fetch_k: object, lambda_mult: object) -> None:
    """Refuse a ``k`` or ``fetch_k`` that is not an integer >= 1, or a ``lambda_mult`` outside [0, 1]."""
    for name, given in (("k", k), ("fetch_k", fetch_k)):
        if isinstance(given, bool) or not isinstance(given, (int, np.integer)) or given < 1:
            raise InvalidArgumentError(f"expected {name} as an integer >= 1, got {given!r}")
    if isinstance(lambda_mult, bool) or not isinstance(lambda_mult, (int, float)) or not 0 <= lambda_mult <= 1:
        raise InvalidArgumentError(f"expected lambda_mult as a number in [0, 1], got {lambda_mult!r}")


def _no_extra(kwargs: Mapping[str, Any], where: str) -> None:
    if kwargs:
        raise InvalidArgumentError(f"expected no other keyword arguments to {where}, got {sorted(kwargs)}")
