"""The facade users hold: a store, a retriever, encoders and attention behind one object.

    db = Database("indexes/names", encoder=NgramEncoder())
    db.add(keys=["Li", "Lipton"], values=["Mu", "Zachary"])
    db.lookup("Li")                                  # "Mu": an exact database lookup
    db.query("Lipto", k=4, pooling="softmax")        # Answer: a differentiable blend of candidate values

It checks what it is given, opens the folder (:mod:`kvsearch.view`) and hands each operation to the part that does
it: locks, snapshots, catch-up, ``atomic()``, switches, saving and closing to the :class:`~kvsearch.view.View`; writes
to :class:`~kvsearch.writes.Writes`; searches, queries, lookups and reads by id to :class:`~kvsearch.reads.Reads`;
generations to :mod:`kvsearch.generations`. It knows nothing of training loops or file formats.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from kvsearch import generations
from kvsearch.checks import check_device, check_path, check_seconds
from kvsearch.encoders.base import Encoder
from kvsearch.generations import Draft
from kvsearch.index.base import CandidateIndex
from kvsearch.inputs import KeysIn, Queries, generation_args
from kvsearch.nn.attend import Candidates
from kvsearch.nn.scores import DB_SCORES, ScoreFn
from kvsearch.reads import MISSING, Reads
from kvsearch.results import Answer, Hit, LazyKeys
from kvsearch.retrieval import Retriever
from kvsearch.selection import Selection
from kvsearch.storage.locking import DEFAULT_LOCK_TIMEOUT
from kvsearch.storage.store import Record, Store
from kvsearch.text.rerank import Rerank
from kvsearch.view import Given, View, check_options, open_store, open_view, reduce_database, same_object
from kvsearch.writes import Writes, check_capacity

__all__ = ["Database", "Hit", "Answer", "LazyKeys", "DB_SCORES"]


class Database:
    """A differentiable key-value database; a resource like a dataset: copies of a model share it (deepcopy: itself).

    Args:
        path: a folder: a new database is made in one absent or empty; one that holds a database reopens with
            what it was created with. None: in memory only (a pickle refuses it; on disk: pickled as folder + options).
        encoder: encodes key texts and query texts (e.g. :class:`~kvsearch.NgramEncoder`). Optional when
            keys and queries are given as embeddings.
        value_encoder: encodes value texts; by default the key encoder, when its dim fits ``value_dim``.
        dim, value_dim: key and value dimensions; needed only without an encoder (a value encoder) to tell them.
        index: an index spec (:data:`~kvsearch.index.factory.INDEX_KINDS`): ``"Flat"``, the default, exact in torch over
            the store's own key tensor (:class:`~kvsearch.TorchIndex`, its path picked per call); ``"torch"`` or
            ``"torch:float16"`` / ``"torch:bfloat16"`` a fixed path; any other a FAISS ``index_factory`` string.
        score: the default score, ``"cosine"`` for a new one; it decides the index metric (L2 for gaussian, else IP).
        device: the torch device of the embeddings and the pooling; CUDA when present, else CPU.
        search_params: FAISS search parameters such as ``{"nprobe": 16}`` or ``{"efSearch": 128}``.
        lock_timeout: seconds a write waits for another writer's lock before ``DatabaseLockedError``.
        read_only: open an existing database for reading only: nothing in its folder is written (not even the index
            on close); writes raise ``ReadOnlyDatabaseError``. An unwritable folder or store opens so, with a warning.
        capacity: keep the newest ``capacity`` records, the oldest dropped first (in memory; NotSupportedError on disk).
        create: False: open an existing database only (unpickling does): none at ``path`` is DatabaseNotFoundError.

    Raises:
        InvalidArgumentError: no encoder and no dim, or a bad argument (``read_only`` without a database).
        WrongKindError: the folder holds a sharded database, or a new one would lie inside another database;
            ForeignFolderError: a new one in a folder of someone else's files. UnknownOptionError: an unknown option.
        ConfigMismatchError: reopening with a dim, index, score or encoder that differs from the stored one.
        MissingFileError: kvsearch files but no ``store.sqlite``, or no encoder json (the message says how to restore
            it). CorruptDatabaseError: a file damaged beyond rebuilding. DiskFullError, ReadOnlyDatabaseError: a new
            database cannot be written (nothing of it is left). DatabaseNotFoundError: see ``create``.
    """

    _shard: ClassVar[bool] = False  # a shard's folder lies inside its sharded root (kvsearch.distributed)

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        encoder: Encoder | None = None,
        value_encoder: Encoder | None = None,
        dim: int | None = None,
        value_dim: int | None = None,
        index: str | None = None,
        score: str | None = None,
        device: str | torch.device | None = None,
        search_params: Mapping[str, float] | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        read_only: bool = False,
        capacity: int | None = None,
        create: bool = True,
    ) -> None:
        self.device = check_device(device)
        check_path(path)
        lock_timeout = check_seconds(lock_timeout, "lock_timeout")
        check_options(search_params, read_only, create)
        self.path = None if path is None else Path(path)
        capacity = check_capacity(capacity, self.path)  # InvalidArgumentError; NotSupportedError on disk
        store, creation = open_store(self.path, self.device, read_only, lock_timeout, create, inside_ok=self._shard)
        self._view = view = View(self.path, store)  # the store, encoders, retriever; the locks and the catch-up
        given = Given(encoder, value_encoder, dim, value_dim, index, score, search_params)
        open_view(view, creation, self.device, given)  # create or reopen; the store closed if it fails
        self.dim, self.value_dim = view.dim, view.value_dim
        self.score, self.index_spec = view.score, view.index_spec
        self._writes = Writes(view, capacity)  # add, upsert, delete, clear
        self._reads = Reads(view)  # search, query, lookup, reads by id

    @property
    def read_only(self) -> bool:
        """Whether the database is read-only (asked for, or its folder cannot be written): writes raise."""
        return self._view.store.read_only is not None

    def atomic(self) -> AbstractContextManager[None]:
        """``with db.atomic(): ...``: its writes (``add``, ``upsert``, ``delete``) are one transaction: all or none.

        The write lock is held for the whole block: other processes read what was committed before it and wait to
        write (``lock_timeout``); other threads of this process wait too (they would see the writes uncommitted).
        An exception inside, or a commit the file system refuses (a full disk), rolls every write of the block back:
        the store, the in-memory tensors and the index are as they were before it. New generations (``refresh``,
        fine-tuning, ``save_encoders``, ``rollback_encoders``) are refused inside: their files are not rolled back.

        Raises:
            ReadOnlyDatabaseError: the database is read-only. DatabaseLockedError: another writer holds the lock.
            DiskFullError: the commit failed for lack of space; nothing of the block was kept.
        """
        return self._view.atomic()

    # ------------------------------------------------------------------ small things
    __copy__ = __deepcopy__ = same_object  # a resource: model copies share it (deepcopy, AveragedModel)

    def __reduce__(self) -> tuple[Any, ...]:  # as its folder and options; NotPicklableError in memory
        return reduce_database(self._view, self.device, type(self))

    def __len__(self) -> int:
        with self._view.reading():
            return len(self._view.store.table)

    def __contains__(self, key: object) -> bool:
        return self._reads.contains(key)

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return self._view.summary(self.device)

    @property
    def index(self) -> CandidateIndex:
        """The candidate index (derived from the store; see :mod:`kvsearch.index.factory`)."""
        return self._view.retriever.index

    @property
    def retriever(self) -> Retriever:
        """The retrieval seam: query tensors -> candidates (see :class:`~kvsearch.retrieval.Retriever`)."""
        return self._view.retriever

    @property
    def store(self) -> Store:
        """The record store (the single source of truth)."""
        return self._view.store

    @property
    def encoder(self) -> Encoder | None:
        """The key encoder (also encodes query texts unless :attr:`query_encoder` is set), or None."""
        return self._view.encoders.key

    @property
    def value_encoder(self) -> Encoder | None:
        """The value encoder (often the key encoder itself), or None when values are given as embeddings.

        Raises (on assignment): InvalidArgumentError (not an Encoder or None), DimensionMismatchError (not value_dim).
        """
        return self._view.encoders.value

    @value_encoder.setter
    def value_encoder(self, encoder: Encoder | None) -> None:
        self._view.encoders.set_value(encoder, self.value_dim)

    @property
    def query_encoder(self) -> Encoder | None:
        """The encoder of text queries when it differs from the key encoder (a fine-tuned query side), else None.

        Text queries are encoded with it when set, else with :attr:`encoder`; saved by :meth:`save_encoders`.

        Raises (on assignment): InvalidArgumentError (not an Encoder or None), DimensionMismatchError (not dim).
        """
        return self._view.encoders.query

    @query_encoder.setter
    def query_encoder(self, encoder: Encoder | None) -> None:
        self._view.encoders.set_query(encoder, self.dim)

    # ------------------------------------------------------------------ writing

    def add(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        key_embeddings: Tensor | np.ndarray | None = None,
        value_embeddings: Tensor | np.ndarray | None = None,
    ) -> list[int]:
        """Add records. Keys must be new.

        Args:
            keys: key texts (a list, numpy array or pandas Series of str; a str adds one record), or key embeddings
                (n, dim) (a tensor or numeric array). Key texts are stored NFC-normalised and stripped of surrounding
                whitespace (see :func:`~kvsearch.inputs.normalize_key`); values are stored as given.
            values: value texts, or value embeddings (n, value_dim) (or (n,) when value_dim is 1).
            metadata: one JSON-serialisable dict (or None) per record.
            key_embeddings: the key texts' own embeddings (n, dim), computed elsewhere (e.g. by another
                library's model): the key encoder is not called, and is not needed. They are kept as given
                (:meth:`refresh` and a new generation do not re-encode these keys).
            value_embeddings: the value texts' own embeddings (n, value_dim), likewise.

        Returns:
            The new ids, in order.

        Raises:
            EmptyKeyError, DuplicateKeyError, DimensionMismatchError, NonFiniteError, InvalidArgumentError,
                MissingEncoderError (texts for a side with no encoder and no embeddings given): raised before
                anything is written.
        """
        self._view.check_open()
        return self._writes.write(keys, values, metadata, key_embeddings, value_embeddings, upsert=False)

    def upsert(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        key_embeddings: Tensor | np.ndarray | None = None,
        value_embeddings: Tensor | np.ndarray | None = None,
    ) -> list[int]:
        """Add records, replacing (in place, same id) those whose key is already stored.

        A replaced record takes the new key text, value and embeddings. Its metadata is replaced only where
        metadata is given: ``metadata=None`` (or a None entry in the list) keeps what is stored, ``{}`` clears it.

        A key text is the same key as a stored key text (compared after normalisation, see :meth:`add`). A key
        given as an embedding (no text) is the same key as a stored key embedding equal to it (bit for bit) that
        has no text: that record is replaced. It is never added a second time: when the equal stored key has a
        text, or several records have it, nothing is written and :class:`~kvsearch.DuplicateKeyError` says how to
        replace one (by id: ``delete(id)`` then :meth:`add`).

        Args:
            keys: as :meth:`add`; stored keys are allowed.
            values: as :meth:`add`.
            metadata: one dict or None per record (a single dict for a single record), or None for all: None
                keeps a replaced record's stored metadata (a new record gets none), a dict replaces it, ``{}``
                clears it.
            key_embeddings, value_embeddings: as :meth:`add`.

        Returns:
            The ids, in order: the existing id for a replaced key, a new id otherwise.

        Raises:
            As :meth:`add`, except that stored keys are allowed.
        """
        self._view.check_open()
        return self._writes.write(keys, values, metadata, key_embeddings, value_embeddings, upsert=True)

    def delete(
        self, key_or_keys: str | int | Sequence[str | int], *, missing: Literal["raise", "ignore"] = "raise"
    ) -> list[int]:
        """Delete records by key text or by id.

        Args:
            key_or_keys: a key (compared after normalisation, see :meth:`lookup`), an id, or a list of them (or an
                integer tensor / array of ids).
            missing: what a key or id that is not stored does: ``"raise"`` (nothing is deleted) or ``"ignore"``
                (the stored ones are deleted).

        Returns:
            The deleted ids.

        Raises:
            KeyNotFoundError: a key or id is not stored and ``missing="raise"`` (then nothing is deleted).
            InvalidArgumentError: an item is neither str nor int.
            UnknownOptionError: ``missing`` is neither ``"raise"`` nor ``"ignore"``.
        """
        self._view.check_open()
        return self._writes.delete(key_or_keys, missing=missing)

    def clear(self) -> None:
        """Delete every record in one transaction (ids are never reused); see :meth:`Writes.clear`."""
        self._writes.clear()

    def set_search_params(self, **params: float) -> None:
        """Set the index's search parameters (FAISS: ``nprobe``, ``efSearch``...) and keep them with the database.

        Raises:
            UnknownOptionError: a parameter that does not apply to this index type.
        """
        self._view.set_search_params(params)

    def save_encoders(self) -> None:
        """Record the encoders as they are now, if one changed since it was loaded or saved, as a new generation.

        The encoders (key, value of its own, query-side; see :attr:`query_encoder`) and the embeddings computed
        with them are one generation (see :mod:`kvsearch.generations`): when the key encoder changed, every key
        is re-encoded (and the values, when their encoder changed), and the new files and embeddings switch in
        one store transaction. :meth:`close` calls it. Nothing changed, nothing is written.

        Raises:
            NonFiniteError: an encoder's weights are not finite (nothing is written).
            DatabaseLockedError: another writer held the write lock for longer than ``lock_timeout``.
            DatabaseClosedError: the database was closed (as :meth:`save`).
        """
        self._view.check_open()
        if self._view.encoders.changed():
            self.commit_generation()

    def refresh(self) -> None:
        """Re-encode every key from its text with the key encoder, as a new generation, and rebuild the index.

        Call it after changing the key encoder yourself: the stored key embeddings, the index and the saved
        encoder are then those of the current encoder. Keys stored as embeddings (no text) keep theirs.

        Raises:
            NonFiniteError: the encoder's weights or outputs are not finite (nothing is written).
            DatabaseClosedError: the database was closed.
        """
        self.commit_generation(reencode={"keys"})

    def commit_generation(
        self,
        *,
        values: tuple[Tensor, Tensor] | None = None,
        summary: Mapping[str, Any] | None = None,
        reencode: set[str] | None = None,
    ) -> int:
        """Record the encoders as they are now as a new generation and switch to it atomically.

        Keys are re-encoded when the key encoder changed (values when theirs did). Fine-tuning calls it through a
        :class:`~kvsearch.generations.Draft` (:meth:`begin_generation`); see :func:`kvsearch.generations.commit`.

        Args:
            values: (ids (n,), value embeddings (n, value_dim)) to write for those ids (e.g. trained ones).
            summary: a JSON-able description of the run that made it (see :meth:`encoders_info`).
            reencode: ``{"keys", "values"}``: re-encode these from their texts whatever changed.

        Returns:
            The new generation.

        Raises:
            NonFiniteError: weights or embeddings are not finite (nothing is written).
            DatabaseLockedError: another writer held the write lock for longer than ``lock_timeout``.
            InvalidArgumentError, DimensionMismatchError: ``values``, ``summary`` or ``reencode`` of the wrong kind.
        """
        values, summary, reencode = generation_args(values, summary, reencode, self.value_dim)
        options = {"force": reencode, "values": values, "summary": summary}
        return int(self._view.switch("a new generation", generations.commit, **options)["generation"])

    def begin_generation(self) -> Draft:
        """Start preparing a new generation in memory (a fine-tuning run): see :class:`~kvsearch.generations.Draft`.

        Returns:
            The draft; the run ends with its ``commit()`` or ``discard()`` (which puts the encoders back).
        """
        self._view.check_open()
        return Draft(self._view, candidates=self._reads.candidates)

    def rollback_encoders(self) -> int:
        """Return to the previous generation of encoders (once): keys re-encoded with them, values restored.

        Returns:
            The generation now current.

        Raises:
            NothingToRollBackError: there is no previous generation (or it was already rolled back).
            CorruptDatabaseError: a file of the previous generation is missing or damaged.
        """
        self._view.switch("rolling back the encoders", generations.rollback)
        return self.generation

    @property
    def generation(self) -> int:
        """The current generation of encoders and embeddings (0: written before generations existed)."""
        with self._view.reading():
            return int(self._view.config.get("generation") or 0)

    @property
    def previous_generation(self) -> int | None:
        """The generation :meth:`rollback_encoders` returns to, or None."""
        return self._view.describe()["previous"]

    def encoders_info(self) -> dict[str, Any]:
        """The encoders and their generation (see :func:`kvsearch.generations.describe`)."""
        return self._view.describe()

    def save(self) -> None:
        """Write what changed since it was loaded or saved: the encoders, and a trained / graph index.

        Flat and torch indexes are not written: rebuilding them from the store is as fast as reading them.
        The manifest tags the index with the store version it reflects and the SHA-256 of its bytes; an index
        that another process's writes made stale is not written (the next open rebuilds it).

        Raises:
            DatabaseLockedError: another writer held the write lock for longer than ``lock_timeout``.
            ReadOnlyDatabaseError: the database is read-only.
            DiskFullError: no space for a file (none is left half written; the index is rebuilt at the next open).
            StoreChangedError: ``store.sqlite`` was deleted or replaced: nothing is saved beside another store.
        """
        self._view.check_open()
        self._view.check_writable()
        self._view.save(wait=True)

    def close(self) -> None:
        """Save what changed (see :meth:`save`) and close the store. Closing twice is harmless.

        A process that only read writes nothing and takes no lock; a read-only database writes nothing at all.

        Raises:
            DatabaseLockedError: an encoder changed and another writer held the lock past ``lock_timeout``.
            DiskFullError: no space to save the index or the encoders (the store is closed all the same).
            StoreChangedError: ``store.sqlite`` was deleted or replaced: nothing was saved (the store is closed).
        """
        self._view.close()

    # ------------------------------------------------------------------ reading

    def get(self, id: int) -> Record:
        """The record with this id.

        Raises:
            KeyNotFoundError: no record has this id (an id outside int64 never has one).
            InvalidArgumentError: ``id`` is not an int.
        """
        return self._reads.get(id)

    def lookup(self, key: str | Tensor | np.ndarray, default: Any = MISSING) -> str | Tensor | None:
        """Exact lookup: the value stored under this key (a traditional database query).

        Args:
            key: a key text, compared after Unicode NFC normalisation and stripping surrounding whitespace (see
                :func:`~kvsearch.inputs.normalize_key`; keys stored by earlier versions as given are found by
                their normalised text too), or a key embedding (dim,) matched by equality — ambiguous, hence not
                found, when several stored keys have that very embedding.
            default: returned when the key is not stored; without it, a miss raises.

        Returns:
            The value text, or the value embedding (CPU tensor) for a value given as an embedding.

        Raises:
            KeyNotFoundError: the key is not stored (or, for an embedding, stored more than once) and no default
                was given.
        """
        return self._reads.lookup(key, default)

    def search(
        self, queries: Queries, k: int = 10, *, where: Mapping[str, Any] | None = None, rerank: Rerank | None = None
    ) -> list[Hit] | list[list[Hit]]:
        """The k nearest records to each query, best first.

        Args:
            queries: a text, a list of texts, a query embedding (dim,) or a batch (batch, dim).
            k: how many; fewer come back when the database holds fewer.
            where: a metadata filter (:mod:`kvsearch.metadata.filters`) such as ``{"lang": "en", "year":
                {"$gte": 2000}}``: k matching records come back when k exist.
            rerank: (text queries) re-order the top ``max(k, 32)`` by the similarity of key and query text: ``"osa"``,
                ``"levenshtein"``, ``"jaro_winkler"``, ``"indel"`` (rapidfuzz) or ``(query_text, key_text) -> float``;
                ``Hit.score`` stays the database's. Not differentiable: :mod:`kvsearch.text.rerank`.

        Returns:
            A list of :class:`Hit` for one query, a list of lists for a batch; empty lists when the database is
            empty. Each hit carries its record's metadata, read in the same snapshot as the search.

        Raises:
            InvalidArgumentError, DimensionMismatchError, NonFiniteError, MissingEncoderError (text queries and no
            encoder for them); for ``rerank``: UnknownOptionError, MissingDependencyError (``kvsearch[fuzzy]``).
        """
        self._view.check_open()
        return self._reads.search(queries, k, where, rerank)

    def query(
        self,
        queries: Queries,
        k: int | Literal["all"] = 10,
        *,
        score: str | ScoreFn | None = None,
        pooling: str = "softmax",
        temperature: float = 1.0,
        where: Mapping[str, Any] | None = None,
    ) -> Answer:
        """Attention over the k candidates the index picks: ``output = sum_i weights_i * values_i``.

        Args:
            queries: a text, a list of texts, a query embedding (dim,) or a batch (batch, dim); a tensor
                that requires grad gets a gradient through ``output``. Text queries are encoded without
                gradient (to fine-tune, use :class:`~kvsearch.KVAttention` or :func:`~kvsearch.finetune`).
            k: candidates per query, or ``"all"`` for every record.
            score: a score name or a callable ``(queries, keys) -> scores``; default the database's. The
                index picks candidates with the database's metric; this only rescores them. A callable gets
                queries (batch, 1, dim) and each query's candidates (batch, k, dim) and returns (batch, 1, k);
                with ``k="all"``, queries (batch, dim) and every key (m, dim), returning (batch, m).
            pooling: ``softmax``, ``normalize``, ``nonnegative``, ``hard``, ``exact`` or ``average``.
                ``exact`` is a database lookup: one-hot on the record whose key equals the query (text
                equality after normalisation, or equal embedding), else "not found" (zero output, value None,
                found False) — also for an embedding that several stored keys have (ambiguous).
            temperature: softmax temperature (softmax and hard), > 0.
            where: a metadata filter (as in :meth:`search`): only matching records are candidates.

        Returns:
            An :class:`Answer`, unbatched for one query; with the candidates' metadata (read in the same snapshot)
            unless ``k="all"``.

        Raises:
            EmptyDatabaseError (it has nothing to pool), InvalidArgumentError, UnknownOptionError,
            DimensionMismatchError, NonFiniteError, MissingEncoderError (text queries and no encoder for them).
        """
        self._view.check_open()
        return self._reads.query(queries, k, score=score, pooling=pooling, temperature=temperature, where=where)

    def candidates(
        self,
        queries: Tensor,
        k: int | Literal["all"],
        *,
        targets: Tensor | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> Candidates:
        """The candidates for a batch of query embeddings (see :meth:`kvsearch.retrieval.Retriever.candidates`).

        The seam :class:`~kvsearch.KVAttention` and the trainer use, read in one consistent snapshot.

        Args:
            queries: (batch, dim); detached for the index search.
            k: candidates per query, or ``"all"``.
            targets: (batch,) ids that must be among the candidates (-1 for none).
            where: a metadata filter: only matching records are candidates.

        Returns:
            :class:`~kvsearch.nn.attend.Candidates`: ids (batch, t), keys (batch, t, dim), values
            (batch, t, value_dim), mask (batch, t), t = min(k, records); for ``k="all"`` (m,)-shaped ones.

        Raises:
            InvalidArgumentError, DimensionMismatchError, NonFiniteError, MemoryLimitError.
            EmptyDatabaseError: the database holds no records (as :meth:`query`).
        """
        self._view.check_open()
        return self._reads.candidates(queries, k, targets=targets, where=where)

    def exact_targets(self, queries: Tensor) -> Tensor:
        """For each query embedding, the id of the one record whose key embedding equals it, else -1.

        The rule of ``pooling="exact"`` for embeddings: several stored keys with that very embedding are ambiguous,
        hence -1 (not found), as none is. :class:`~kvsearch.KVAttention` with exact pooling uses it.

        Args:
            queries: (batch, dim).

        Returns:
            (batch,) int64 ids on the CPU.

        Raises:
            InvalidArgumentError: not a floating-point tensor. DimensionMismatchError: queries are not (batch, dim).
            NonFiniteError: NaN or Inf in the queries.
        """
        return self._reads.exact_targets(queries)

    def where(self, filter: Mapping[str, Any] | None = None, *, ids: Any = None) -> Selection:
        """The records a filter selects, to read, count, aggregate, delete or update without a query.

        ``db.where({"lang": "en"}).count()``, ``.records(limit=, offset=)`` (id order), ``.ids()``,
        ``.distinct(field)``, ``.min_max(field)``, ``.fields()``, ``.delete()``, ``.update(metadata, merge=True)``: see
        :class:`~kvsearch.selection.Selection`. Each call runs the filter again on what is committed then.

        Args:
            filter: a filter (:mod:`kvsearch.metadata.filters`); None selects every record.
            ids: only these ids as well (None: no such limit).

        Raises:
            InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter or ids (at once).
        """
        self._view.check_open()
        return Selection(self._view, self._writes, filter, ids)

    # ------------------------------------------------------------------ reads by id (for training and tools)

    def ids(self) -> Tensor:
        """Every stored id, sorted: (m,) int64 on the CPU (``db.where(filter).ids()`` for some)."""
        return self._reads.ids()

    def ids_of_keys(self, texts: Sequence[str]) -> Tensor:
        """The id of each key text (compared after normalisation, see :meth:`lookup`): (n,) int64 on the CPU, -1
        where the key is not stored.

        Raises:
            InvalidArgumentError: not a list of str, or text that is not valid Unicode.
        """
        return self._reads.ids_of_keys(texts)

    def values_present(self, texts: Sequence[str]) -> Tensor:
        """Whether some stored record has each value text: (n,) bool on the CPU (InvalidArgumentError: not str)."""
        return self._reads.values_present(texts)

    def key_texts(self, ids: Tensor | Sequence[int], *, encoded_only: bool = False) -> list[str | None]:
        """The key text of each id, in order: None where the record has no key text or is not stored.

        Args:
            ids: record ids.
            encoded_only: None also for key texts that came with their own embedding (``key_embeddings=``): the
                texts whose key embedding is the key encoder's, which a trainer may re-encode.

        Raises:
            InvalidArgumentError: ``ids`` are not integers (see :func:`kvsearch.inputs.id_tensor`).
        """
        return self._reads.key_texts(ids, encoded_only=encoded_only)

    def value_texts(self, ids: Tensor | Sequence[int]) -> dict[int, str | None]:
        """id -> the value text (None for a value given as an embedding), for the stored ones among ``ids``."""
        return self._reads.value_texts(ids)

    def embeddings(self, ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings gathered by id (any shape, -1 allowed), on :attr:`device`.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) — zeros where an id is -1 or not stored —
            and the mask (*ids.shape) of the stored ones.

        Raises:
            InvalidArgumentError: ``ids`` are not integers.
        """
        return self._reads.embeddings(ids)

    def values_of(self, ids: Sequence[int]) -> dict[int, str | Tensor | None]:
        """id -> the value as answers show it: its text, or its embedding (CPU tensor) when it has no text."""
        return self._reads.values_of(ids)

    def metadata_of(self, ids: Tensor | Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> the record's metadata dict ({} when it has none), for the stored ones among ``ids``.

        The reads by id raise InvalidArgumentError for ids that are not integers (:func:`kvsearch.inputs.id_tensor`).
        """
        return self._reads.metadata_of(ids)
