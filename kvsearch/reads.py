"""The answers of one database, each read in one store snapshot: search hits, query answers, exact lookups.

:class:`Reads` is what :class:`~kvsearch.Database` hands ``search``, ``query``, ``candidates``, ``lookup``, ``get``,
``in`` and the reads by id (``ids``, ``key_texts``, ``embeddings``...) to. Each read checks what came once, here (a
query embedding by :func:`kvsearch.checks.query_tensor`; the retriever and the index below trust it), encodes text
queries (with the encoders another process may have fine-tuned since: the view is brought up to date first), then,
inside the read context (:meth:`View.reading <kvsearch.view.View.reading>`: one SQLite snapshot, the view up to
date with it; or, where the view is current and nothing is to be read from SQLite, from memory without one:
:meth:`View.current <kvsearch.view.View.current>`), asks the retriever and makes the answer: hits of the ids and
scores it ranked (:meth:`Reads.search`: :meth:`~kvsearch.retrieval.Retriever.search`, the hits' value and metadata
texts read in one statement where any may exist, a value embedding made a tensor and the metadata decoded when a
hit's is read), attention over the candidates it gathered (:meth:`Reads.query`), or the one record with a key.
Values are shown as answers show them (:meth:`Reads.answer_values`): their text, or their embedding when they have
none.

It knows nothing of writes, generations, file formats or how the snapshot is taken: it is given the database's
:class:`~kvsearch.view.View` (the store, the encoders, the retriever, the dim, the read context), its score and
its device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import check_finite, check_k, check_temperature, check_unicode, query_tensor
from kvsearch.errors import (
    EmptyDatabaseError,
    InvalidArgumentError,
    KeyNotFoundError,
    MissingEncoderError,
    UnknownOptionError,
)
from kvsearch.inputs import Queries, id_tensor, query_batch, query_texts, text_list
from kvsearch.metadata.codec import decode as decode_metadata
from kvsearch.metadata.filters import check_where
from kvsearch.nn.attend import Candidates, attend_candidates, check_pairing
from kvsearch.nn.pooling import POOLINGS
from kvsearch.nn.scores import ScoreFn, check_score
from kvsearch.nn.streaming import attend_candidates as attend_every
from kvsearch.results import Answer, Hit, hits_at, make_answer
from kvsearch.storage import queries
from kvsearch.text.rerank import Rerank, check_rerank, require_texts, rerank_depth, rerank_hits

if TYPE_CHECKING:  # annotations only
    from kvsearch.encoders.encoder_set import EncoderSet
    from kvsearch.retrieval import Retriever
    from kvsearch.storage.store import Record, Store
    from kvsearch.view import View

__all__ = ["Reads", "MISSING"]

#: The default of ``Database.lookup``'s ``default``: none was given, a miss raises.
MISSING: Any = object()


def gather_values(values: Tensor, rows: Tensor | np.ndarray) -> np.ndarray:
    """The value embeddings at ``rows`` (any shape, a tensor or a numpy array; -1 where none, which reads some row
    the caller skips) as one float32 numpy block (n, value_dim), for a non-empty table: read in numpy on the CPU (a
    search's few rows: ~1 us, a torch op ~3), else gathered on the values' device and copied once."""
    if values.device.type == "cpu":
        flat = rows.reshape(-1) if isinstance(rows, np.ndarray) else rows.reshape(-1).cpu().numpy()  # (n,)
        return values.detach().numpy()[flat]  # (n, value_dim): numpy reads row -1 as the last
    at = torch.as_tensor(rows).reshape(-1).clamp(min=0).to(values.device)  # (n,)
    return values.index_select(0, at).cpu().numpy()  # (n, value_dim)


def _no_metadata(ids: list[int]) -> dict[int, str]:
    """The metadata texts of a store where no record has any."""
    return {}


class Reads:
    """The answers of one open database (see the module docstring).

    Args:
        view: the database's view: its store, encoders and retriever (read at each query: an encoder reloaded
            later is used), its dim, score and device, its read context (:meth:`~kvsearch.view.View.reading`: one
            store snapshot, the view up to date with it) and :meth:`~kvsearch.view.View.catch_up` (the view brought
            up to date outside a snapshot, before text queries are encoded); both raise DatabaseClosedError.
    """

    def __init__(self, view: View) -> None:
        self.view = view
        self.dim, self.score, self.device = view.dim, view.score, view.store.device  # where the pooling runs

    @property
    def store(self) -> Store:
        return self.view.store

    @property
    def encoders(self) -> EncoderSet:
        return self.view.encoders

    @property
    def retriever(self) -> Retriever:
        """The database's retriever now."""
        return self.view.retriever

    def search(
        self, queries: Queries, k: int, where: Mapping[str, Any] | None, rerank: Rerank | None = None
    ) -> list[Hit] | list[list[Hit]]:
        """``Database.search``: the k nearest records to each query, best first (re-ranked: see
        :mod:`kvsearch.text.rerank`). Checked here once; the retriever and the index trust what came.

        When the view is current and the hits need nothing from SQLite (no filter; values without text, no record
        with metadata, the key texts in memory) they are answered from memory without a snapshot; else in one
        snapshot, the hits' value and metadata texts read in one statement."""
        similarity = None if rerank is None else check_rerank(rerank)
        k = check_k(k)
        if where is not None:
            check_where(where)
        q, texts, single = self.prepare_queries(queries)
        if similarity is not None:
            texts = require_texts(texts, q.shape[0])  # InvalidArgumentError for query embeddings
        depth = k if similarity is None else rerank_depth(k)
        view, store = self.view, self.view.store
        with store.lock:
            if self._from_memory(where, texts=True):
                hits = self._hits(q, depth, None, value_texts=False)
            else:
                with view.reading():
                    hits = self._hits(q, depth, where)
        if similarity is not None:
            hits = rerank_hits(similarity, texts, hits, k)  # outside the snapshot: the user's callable may be slow
        return hits[0] if single else hits

    def _hits(
        self, q: Tensor, k: int, where: Mapping[str, Any] | None, *, value_texts: bool | None = None
    ) -> list[list[Hit]]:
        """The hits of each query (b, dim), ranked by the retriever, their values and metadata read in one statement
        where any may be stored. Callers hold the store lock, and a snapshot unless :meth:`_from_memory` said none
        is needed (then nothing is read from SQLite here). ``value_texts``: whether some value may have text, where
        the caller knows (None: asked here)."""
        view = self.view
        store = view.store
        value_texts = self._values_have_text() if value_texts is None else value_texts
        if store.table.ids.shape[0] == 0:
            return [[] for _ in range(q.shape[0])]
        ranked = view.retriever.search(q, k, where=where)
        ids = ranked.ids.tolist()
        metadata = not store.metadata_known_absent() and store.has_metadata()
        texts: dict[int, str] = {}
        meta: dict[int, str] = {}
        every_text = False  # whether every hit's value has text (no value embedding to gather)
        if value_texts or metadata:  # one statement for what may exist (in the caller's snapshot)
            found = [i for row in ids for i in row if i >= 0]
            texts, meta = store.hit_texts(found, values=value_texts, metadata=metadata)
            every_text = len(texts) == len(found)
        block = None if every_text else gather_values(store.table.values, ranked.rows)  # (b * t, value_dim)
        return hits_at(ids, ranked.scores.tolist(), store.texts.key_of_id, texts, block, meta)

    def query(
        self,
        queries: Queries,
        k: int | Literal["all"],
        *,
        score: str | ScoreFn | None,
        pooling: str,
        temperature: float,
        where: Mapping[str, Any] | None,
    ) -> Answer:
        """``Database.query``: attention over the k candidates the index picks."""
        k = check_k(k, allow_all=True)
        if score is not None:
            check_score(score)
        if pooling not in POOLINGS:
            raise UnknownOptionError(f"expected pooling among {POOLINGS}, got {pooling!r}")
        check_pairing(self.score if score is None else score, pooling)
        temperature = check_temperature(temperature)
        if where is not None:
            check_where(where)
        q, texts, single = self.prepare_queries(queries)
        out_device = q.device
        q = q.to(self.device)  # (b, dim)
        options = {"score": self.score if score is None else score, "pooling": pooling, "temperature": temperature}
        view, store = self.view, self.store
        with store.lock:
            if self._from_memory(where, texts=True):
                answer = self._answer(q, texts, k, options, None, out_device, metadata=False)
            else:
                with view.reading():
                    answer = self._answer(q, texts, k, options, where, out_device, metadata=True)
        return answer.row(0) if single else answer

    def _from_memory(self, where: Mapping[str, Any] | None, *, texts: bool) -> bool:
        """Whether this call can be answered from this process's memory, without a SQLite snapshot (callers hold the
        store lock).

        Memory is asked first: no filter, and where the answer shows texts and metadata (``texts``) the key texts
        held, no value with text and no record with metadata (as known at the table's version). Only then is the view
        asked whether it is current (:meth:`View.current <kvsearch.view.View.current>`: a ``stat`` and ``PRAGMA
        data_version``), so a call that needs a snapshot anyway goes straight to :meth:`View.reading
        <kvsearch.view.View.reading>`, whose sync asks the store once.

        Raises:
            DatabaseClosedError: the database was closed (a call going to :meth:`View.reading` is told there).
        """
        if where is not None:
            return False
        store = self.store
        if texts and not (store.texts_held and store.metadata_known_absent() and not self._values_have_text()):
            return False
        self.view.check_open()
        return self.view.current()

    def _values_have_text(self) -> bool:
        """Whether some value may have text: with a value encoder, or values given with their embeddings."""
        return self.encoders.value is not None or bool(self.store.texts.given_values)

    def _answer(
        self,
        q: Tensor,
        texts: list[str] | None,
        k: int | Literal["all"],
        options: dict[str, Any],
        where: Mapping[str, Any] | None,
        out_device: torch.device,
        *,
        metadata: bool,
    ) -> Answer:
        """:meth:`query`'s attention and answer (callers hold the lock, and a snapshot where ``metadata``: the
        candidates' metadata is read there, unless no record has any)."""
        self.check_not_empty()
        metadata = metadata and self.store.has_metadata()
        targets = None
        if options["pooling"] == "exact":  # text equality for text queries, else equal embeddings
            if texts is None:
                targets = self.retriever.exact_targets(q)  # (b,)
            else:
                targets = torch.tensor([self.store.texts.id_of(t) for t in texts], dtype=torch.long)
        cand = self.retriever.candidates(q, k, targets=targets, where=where)
        if k == "all":  # every record: streamed where it can be
            output, weights = attend_every(q, cand, every=True, **options)  # (b, value_dim), (b, m)
        else:  # checked above and at the door, the candidates the store's own: nothing checked again
            output, weights = attend_candidates(q, cand, dropout=0.0, **options)  # (b, value_dim), (b, t)
        return make_answer(
            output,
            weights,
            cand.ids,
            k=None if k == "all" else k,
            key_of_id=self.store.texts.key_of_id,
            values_of=self.answer_values if k == "all" else lambda ids: self.answer_values(ids, gathered=cand),
            device=out_device,
            metadata_of=None if k == "all" else self.store.metadata_texts if metadata else _no_metadata,  # snapshot
        )

    def candidates(
        self, queries: Tensor, k: int | Literal["all"], *, targets: Tensor | None, where: Mapping[str, Any] | None
    ) -> Candidates:
        """``Database.candidates``: the candidates for a batch of query embeddings, in one snapshot (none where the
        view is current and no filter is given: they are gathered from memory alone, as a search's)."""
        queries, targets = query_batch(queries, self.dim, targets)
        view = self.view
        with view.store.lock:
            if self._from_memory(where, texts=False):
                self.check_not_empty()
                return self.retriever.candidates(queries, k, targets=targets)
            with view.reading():
                self.check_not_empty()
                return self.retriever.candidates(queries, k, targets=targets, where=where)

    def get(self, id: int) -> Record:
        """``Database.get``: the record with this id."""
        if isinstance(id, bool) or not isinstance(id, (int, np.integer)):
            raise InvalidArgumentError(f"expected an int id, got {type(id).__name__}")
        with self.view.reading():
            record = self.store.fetch([int(id)]).get(int(id))
        if record is None:
            raise KeyNotFoundError(f"expected a stored id, got {int(id)}")
        return record

    def lookup(self, key: str | Tensor | np.ndarray, default: Any = MISSING) -> str | Tensor | None:
        """``Database.lookup``: the value stored under this key, else ``default`` (KeyNotFoundError without)."""
        q = None
        if isinstance(key, (Tensor, np.ndarray)):
            q, _ = query_tensor(key, self.dim)
            if q.shape[0] != 1:
                raise InvalidArgumentError(f"expected one key embedding (dim,), got shape {tuple(q.shape)}")
        elif not isinstance(key, str):
            raise InvalidArgumentError(f"expected a key text or a key embedding, got {type(key).__name__}")
        else:
            check_unicode(key, "the key to look up")
        count = 0
        with self.view.reading():
            if q is None:
                id_ = self.store.texts.id_of(key)
            else:
                first, counts = self.retriever.key_matches(q)  # (1,), (1,)
                id_, count = (int(first[0]) if int(counts[0]) == 1 else -1), int(counts[0])
            if id_ >= 0:
                return self.answer_values([id_])[id_]
        if default is MISSING:
            if count > 1:
                raise KeyNotFoundError(
                    f"no record has the key <embedding> unambiguously: expected one stored key with that embedding, "
                    f"got {count} stored keys with it"
                )
            shown = key if isinstance(key, str) else "<embedding>"
            raise KeyNotFoundError(f"no record has the key {shown!r}")
        return default

    def contains(self, key: object) -> bool:
        """``key in db``: a stored key text, or a key embedding that exactly one stored key has (each, for a batch)."""
        q = query_tensor(key, self.dim)[0] if isinstance(key, (Tensor, np.ndarray)) else None
        with self.view.reading():
            if isinstance(key, str):
                return self.store.texts.id_of(key) >= 0
            return q is not None and bool((self.retriever.exact_targets(q) >= 0).all())

    def exact_targets(self, queries: Tensor) -> Tensor:
        """``Database.exact_targets``: the id of the one record whose key embedding equals each query, else -1."""
        queries, _ = query_batch(queries, self.dim)  # (batch, dim) floating point, finite
        with self.view.reading():
            return self.retriever.exact_targets(queries)

    # ------------------------------------------------------------------ reads by id (for training and tools)

    def ids(self) -> Tensor:
        """``Database.ids``: every stored id, sorted: (m,) int64 on the CPU."""
        with self.view.reading():
            return self.store.table.ids.clone()

    def ids_of_keys(self, texts: Sequence[str]) -> Tensor:
        """``Database.ids_of_keys``: the id of each key text, -1 where it is not stored: (n,) int64 on the CPU."""
        texts = text_list(texts, "key texts")
        with self.view.reading():
            return torch.tensor([self.store.texts.id_of(t) for t in texts], dtype=torch.long)

    def values_present(self, texts: Sequence[str]) -> Tensor:
        """``Database.values_present``: whether some stored record has each value text: (n,) bool on the CPU."""
        texts = text_list(texts, "value texts")
        with self.view.reading():
            return torch.tensor(queries.values_present(self.store.conn, texts), dtype=torch.bool)  # (n,)

    def key_texts(self, ids: Tensor | Sequence[int], *, encoded_only: bool) -> list[str | None]:
        """``Database.key_texts``: the key text of each id, in order (None: no key text, not stored, or given
        with its embedding when ``encoded_only``)."""
        flat = id_tensor(ids).reshape(-1).tolist()
        with self.view.reading():
            key_of, given = self.store.texts.key_of_id, self.store.texts.given_keys if encoded_only else ()
            return [None if i in given else key_of.get(i) for i in flat]

    def value_texts(self, ids: Tensor | Sequence[int]) -> dict[int, str | None]:
        """``Database.value_texts``: id -> the value text (None for a value given as an embedding)."""
        ids = id_tensor(ids).reshape(-1).tolist()
        with self.view.reading():
            return self.store.value_texts(ids)

    def embeddings(self, ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``Database.embeddings``: keys (*ids.shape, dim), values (*ids.shape, value_dim), mask (*ids.shape)."""
        ids = id_tensor(ids)
        with self.view.reading():
            return self.store.table.gather(ids)

    def values_of(self, ids: Sequence[int]) -> dict[int, str | Tensor | None]:
        """``Database.values_of``: id -> the value as answers show it (see :meth:`answer_values`)."""
        ids = id_tensor(ids).reshape(-1).tolist()
        with self.view.reading():
            return self.answer_values(ids)

    def metadata_of(self, ids: Tensor | Sequence[int]) -> dict[int, dict[str, Any]]:
        """``Database.metadata_of``: id -> the record's metadata dict ({} when it has none), for the stored ones."""
        wanted = [i for i in id_tensor(ids).reshape(-1).tolist() if i >= 0]
        with self.view.reading():
            texts = self.store.metadata_texts(wanted)
            return {i: decode_metadata(texts.get(i)) for i in wanted if self.store.table.contains_id(i)}

    def check_not_empty(self) -> None:
        """EmptyDatabaseError when the database holds no records (callers hold a snapshot)."""
        if len(self.store.table) == 0:
            raise EmptyDatabaseError("expected a database with records to search, got an empty one")

    def answer_values(
        self, ids: Sequence[int], *, gathered: Candidates | None = None
    ) -> dict[int, str | Tensor | None]:
        """id -> the value as answers show it (see :meth:`Store.answer_values`). Callers hold a snapshot.

        Args:
            ids: stored ids.
            gathered: top-k candidates gathered in this snapshot that hold these ids: where no value has text,
                each value is its embedding, taken from them instead of being looked up by id again.
        """
        store = self.view.store
        # without a value encoder, only values given with their embeddings have text
        texts = self.view.encoders.value is not None or bool(store.texts.given_values)
        if texts or gathered is None:
            return store.answer_values(ids, texts=texts)
        out: dict[int, str | Tensor | None] = dict.fromkeys(ids)
        if not out:
            return out
        at: dict[int, int] = {}  # id -> its first place among the gathered candidates
        for n, (id_, here) in enumerate(zip(gathered.ids.reshape(-1).tolist(), gathered.mask.reshape(-1).tolist())):
            if here and id_ in out:
                at.setdefault(id_, n)
        rows = gathered.values.detach().reshape(-1, gathered.values.shape[-1]).cpu().numpy()  # (b * t, value_dim)
        for id_, n in at.items():
            out[id_] = torch.from_numpy(rows[n].copy())  # (value_dim,) its own storage, not a view of the batch
        return out

    def prepare_queries(self, queries: Queries) -> tuple[Tensor, list[str] | None, bool]:
        """Queries as (batch, dim) on their own device (text: the encoder's), texts, and whether single.

        Raises:
            MissingEncoderError: text queries and no encoder for them. InvalidArgumentError,
            DimensionMismatchError, NonFiniteError: queries of the wrong kind or shape, or not finite.
        """
        texts = None
        if not isinstance(queries, Tensor) and not (isinstance(queries, np.ndarray) and queries.dtype.kind in "fiubc"):
            texts = query_texts(queries)  # None: not text either (query_tensor says what came)
        if texts is None:
            q, single = query_tensor(queries, self.dim)
            return q, None, single
        self.view.catch_up()  # encode with the encoders another process may have fine-tuned since
        encoder = self.encoders.for_queries
        if encoder is None:
            raise MissingEncoderError(
                "this database has no encoder for query texts; pass query embeddings (batch, "
                f"{self.dim}) or set db.query_encoder"
            )
        q = encoder.encode(texts)  # (b, dim)
        check_finite(q, "query embeddings")
        return q, texts, isinstance(queries, str)
