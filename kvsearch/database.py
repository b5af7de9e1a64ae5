"""The facade users hold: a store, a retriever, encoders and attention behind one object.

    db = Database("indexes/names", encoder=NgramEncoder())
    db.add(keys=["Li", "Lipton"], values=["Mu", "Zachary"])
    db.lookup("Li")                                  # "Mu": an exact database lookup
    db.query("Lipto", k=4, pooling="softmax")        # Answer: a differentiable blend of candidate values

It opens (creates or reopens) a folder, takes the write lock and brings a stale view up to date, checks what
users pass, and delegates: records to the :class:`~kvsearch.storage.store.Store`, candidates to the
:class:`~kvsearch.retrieval.Retriever`, files to :mod:`kvsearch.storage.folder`, scoring and pooling to
:mod:`kvsearch.nn.attention`. It knows nothing of training loops or file formats. The folder layout is in
:mod:`kvsearch.storage.folder`.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from kvsearch import generations
from kvsearch.checks import (
    check_batch,
    check_device,
    check_finite,
    check_k,
    check_path,
    check_seconds,
    check_temperature,
    check_unicode,
)
from kvsearch.encoders.base import Encoder
from kvsearch.encoders.encoder_set import EncoderSet
from kvsearch.errors import (
    CorruptDatabaseError,
    DatabaseClosedError,
    DatabaseLockedError,
    DimensionMismatchError,
    DuplicateKeyError,
    EmptyDatabaseError,
    InconsistentDatabaseError,
    InvalidArgumentError,
    KeyNotFoundError,
    MissingEncoderError,
    NonFiniteError,
    NotSupportedError,
    ReadOnlyDatabaseError,
    UnknownOptionError,
)
from kvsearch.filters import check_where
from kvsearch.generations import Draft
from kvsearch.index.factory import CandidateIndex
from kvsearch.inputs import (
    KeysIn,
    Queries,
    check_metadata,
    delete_items,
    encode_side,
    generation_args,
    id_tensor,
    query_batch,
    query_tensor,
    query_texts,
    record_side,
    text_list,
)
from kvsearch.limits import check_fits, index_bytes
from kvsearch.nn.attention import POOLINGS, Candidates, ScoreFn, check_score, compute_scores
from kvsearch.nn.streaming import attend_candidates
from kvsearch.results import Answer, Hit, LazyKeys, make_answer, make_hits
from kvsearch.retrieval import DB_SCORES, Retriever
from kvsearch.storage import fileio
from kvsearch.storage import folder as folders
from kvsearch.storage.config import check_reopen, new_config
from kvsearch.storage.locking import DEFAULT_LOCK_TIMEOUT
from kvsearch.storage.store import GIVEN_KEY, GIVEN_VALUE, Record, Store

__all__ = ["Database", "Hit", "Answer", "LazyKeys", "DB_SCORES"]

_MISSING: Any = object()


class Database:
    """A differentiable key-value database.

    Args:
        path: a folder (created if missing, reopened with what it was created with if it holds a database),
            or None for a database in memory only.
        encoder: encodes key texts and query texts (e.g. :class:`~kvsearch.NgramEncoder`). Optional when
            keys and queries are given as embeddings.
        value_encoder: encodes value texts; by default the key encoder, when its dim fits ``value_dim``.
        dim: key dimension; needed only without an encoder.
        value_dim: value dimension; needed only without a value encoder.
        index: a FAISS ``index_factory`` string; default ``"Flat"`` (exact) for a new database. ``"torch"``
            (or ``"torch:float16"`` / ``"torch:bfloat16"``) is exact search in torch over the store's own key
            tensor (:class:`~kvsearch.TorchIndex`): no second copy of the keys, nothing to rebuild on open.
            It is not chosen automatically; see benchmarks/RESULTS.md for where it is faster.
        score: the default score function, ``"cosine"`` for a new database; it decides the index metric
            (inner product for dot / scaled_dot / cosine, L2 for gaussian).
        device: the torch device of the embeddings and the pooling; CUDA when present, else CPU.
        search_params: FAISS search parameters such as ``{"nprobe": 16}`` or ``{"efSearch": 128}``.
        lock_timeout: seconds a write waits for another writer's lock before ``DatabaseLockedError``.
        read_only: open an existing database for reading only: nothing in its folder is written (not even the
            index on close) and writes raise ``ReadOnlyDatabaseError``. A database whose folder (or store file)
            cannot be written is opened so anyway, with one ``RuntimeWarning``.

    Raises:
        InvalidArgumentError: no encoder and no dim, or a bad argument (``read_only`` without a database).
        UnknownOptionError: an unknown score or index spec.
        ConfigMismatchError: reopening with a dim, index, score or encoder that differs from the stored one.
        MissingFileError: the folder holds kvsearch files but no ``store.sqlite`` (it is never made anew beside
            them), or an encoder's json is missing (the message says how to restore it).
        CorruptDatabaseError: a file of the database is damaged beyond rebuilding.
        DiskFullError, ReadOnlyDatabaseError: a new database cannot be written (nothing of it is left).
    """

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
    ) -> None:
        self.device = check_device(device)
        check_path(path)
        lock_timeout = check_seconds(lock_timeout, "lock_timeout")
        if search_params is not None and not isinstance(search_params, Mapping):
            got = type(search_params).__name__
            raise InvalidArgumentError(f"expected search_params as a dict such as {{'nprobe': 16}}, got {got}")
        if not isinstance(read_only, bool):
            raise InvalidArgumentError(f"expected read_only as a bool, got {read_only!r}")
        self.path = None if path is None else Path(path)
        self._closed = False
        self._atomic = 0  # depth of atomic() blocks open
        if self.path is not None and self.path.exists() and not self.path.is_dir():
            raise InvalidArgumentError(f"expected a folder for the database, got a file: {self.path}")
        exists = self.path is not None and folders.is_database(self.path)
        if read_only and not exists:
            where = "a database in memory" if self.path is None else f"{self.path} without {folders.STORE_FILE}"
            raise InvalidArgumentError(f"expected an existing database folder to open with read_only=True, got {where}")
        if self.path is not None and not exists:
            folders.check_store_present(self.path)  # what is left of a database whose store is gone: never a new one
        # what a failed creation leaves behind is removed again; a failed reopen touches nothing
        creation = None if exists else folders.Creation(self.path)
        if self.path is not None:
            with fileio.storage_errors(self.path, "creating the database folder", "nothing was created"):
                self.path.mkdir(parents=True, exist_ok=True)
        try:
            self._store = Store(
                None if self.path is None else self.path / folders.STORE_FILE, self.device, read_only=read_only
            )
        except BaseException:
            if creation is not None:
                creation.rollback()
            raise
        self._store.write_lock.timeout = float(lock_timeout)
        self._files = folders.EncoderFiles(self.path, self._store)
        if self._store.read_only is not None and not read_only:
            warnings.warn(
                f"kvsearch: {self.path} was opened read-only ({self._store.read_only}); reads work, writes raise "
                "ReadOnlyDatabaseError",
                RuntimeWarning,
                stacklevel=2,
            )
        try:
            saved = self._store.get_meta("config")
            if saved is not None:
                self._reopen(saved, encoder, value_encoder, dim, value_dim, index, score, search_params)
            elif self._store.read_only is not None:
                raise CorruptDatabaseError(f"{self._store.path} holds no configuration: its creation never finished")
            else:
                with fileio.storage_errors(self.path, "creating the database", "nothing of it was kept"):
                    self._create(encoder, value_encoder, dim, value_dim, index, score, search_params)
        except BaseException:
            self._store.close()
            if creation is not None:
                creation.rollback()
            raise

    # ------------------------------------------------------------------ opening

    def _create(self, encoder, value_encoder, dim, value_dim, index, score, search_params) -> None:
        config, value_encoder = new_config(encoder, value_encoder, dim, value_dim, index, score, search_params)
        self._adopt(config)
        self._retriever = self._new_retriever()
        self._encoders = EncoderSet.create(self._files, self.device, key=encoder, value=value_encoder)
        self._config = {**config, **self._encoders.flags()}
        self._store.set_meta("config", self._config)
        self._store.load(self.dim, self.value_dim)
        self.commit_generation()  # generation 1: the encoders as given

    def _reopen(self, saved, encoder, value_encoder, dim, value_dim, index, score, search_params) -> None:
        given = {"dim": dim, "value_dim": value_dim, "index": index, "score": score}
        self._adopt(check_reopen(saved, self.path, search_params, **given))
        self._encoders = EncoderSet.reopen(
            self._files, self.device, self._config, key=encoder, value=value_encoder, where=self.path
        )
        self._files.settle()
        self._store.load(self.dim, self.value_dim)
        self._retriever = self._new_retriever()
        self._retriever.open()
        mismatch = generations.key_mismatch(self._store, self.encoder)
        if mismatch > generations.KEY_TOLERANCE:  # written by an older version during a run that stopped, or damaged
            self._repair(mismatch)

    def _repair(self, mismatch: float) -> None:
        """Re-encode the keys of a database whose stored key embeddings are not its key encoder's."""
        what = f"{self.path}: the stored key embeddings differ from the key encoder's by up to {mismatch:.3g}"
        try:
            self.commit_generation(reencode={"keys"})
        except (DatabaseLockedError, NonFiniteError, ReadOnlyDatabaseError) as exc:
            raise InconsistentDatabaseError(f"{what}; they could not be re-encoded ({exc})") from None
        warnings.warn(f"kvsearch: {what}; every key was re-encoded with the stored encoder", RuntimeWarning, 3)

    def _new_retriever(self) -> Retriever:
        """The retriever of this store, with the configuration's index spec, score and search parameters."""
        options = {"spec": self.index_spec, "score": self.score, "params": self._config.get("search_params") or {}}
        return Retriever(self._store, dim=self.dim, folder=self.path, **options)

    def _adopt(self, config: dict[str, Any]) -> None:
        self._config = config
        self.dim, self.value_dim = config["dim"], config["value_dim"]
        self.score, self.index_spec = config["score"], config["index"]

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold this folder's write lock (bounded wait) and bring a stale view up to date first.

        Raises:
            DatabaseClosedError: the database was closed.
            ReadOnlyDatabaseError: the database is read-only (nothing is locked or written).
            DatabaseLockedError: another writer held the lock for longer than ``lock_timeout``.
            DiskFullError: the file system refused the write for lack of space (it was rolled back).
            StoreChangedError: ``store.sqlite`` was deleted or replaced since the database was opened.
        """
        self._check_open()
        self._check_writable()
        with self._store.lock, self._store.write_lock:
            self._sync()
            with fileio.storage_errors(self.path, "writing to the database"):
                yield

    @property
    def read_only(self) -> bool:
        """Whether the database is read-only (asked for, or its folder cannot be written): writes raise."""
        return self._store.read_only is not None

    def _check_writable(self) -> None:
        if self._store.read_only is not None:
            raise ReadOnlyDatabaseError(
                f"{self.path} is open read-only ({self._store.read_only}): writes are refused, nothing was written"
            )

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """``with db.atomic(): ...`` — the writes inside (``add``, ``upsert``, ``delete``) are one transaction:
        all kept, or none.

        The write lock is held for the whole block: other processes read what was committed before it and wait to
        write (``lock_timeout``); other threads of this process wait too (they would see the writes uncommitted).
        An exception inside, or a commit the file system refuses (a full disk), rolls every write of the block back:
        the store, the in-memory tensors and the index are as they were before it. New generations (``refresh``,
        fine-tuning, ``save_encoders``, ``rollback_encoders``) are refused inside: their files are not rolled back.

        Raises:
            ReadOnlyDatabaseError: the database is read-only. DatabaseLockedError: another writer holds the lock.
            DiskFullError: the commit failed for lack of space; nothing of the block was kept.
        """
        with self._writing():
            try:
                with self._store.transaction():
                    self._atomic += 1
                    try:
                        yield
                    finally:
                        self._atomic -= 1
            except BaseException:
                self._store.load(self.dim, self.value_dim)  # back to what is committed: the mirror and the index
                self._retriever.open()
                raise

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """A consistent read: one store snapshot, this process's view brought up to date with it first.

        Every read runs in a SQLite read transaction (WAL: it never blocks a writer), so the texts and metadata
        it fetches are those of the same committed state as the in-memory tensors and the index it searches.

        Raises:
            DatabaseClosedError: the database was closed.
        """
        with self._store.lock:
            self._check_open()
            with self._store.snapshot():
                self._sync()
                yield

    def _sync(self) -> None:
        """Reload what another process changed since this view was loaded (callers hold the store lock).

        ``PRAGMA data_version`` says whether another connection committed at all (no table read); only then is
        the store version read. When it moved, the mirror catches up on the rows the change log names and the
        index removes / adds just those ids (:meth:`Store.catch_up`); when the log does not reach back or holds a
        change of every row (a new generation: the encoders are reloaded too, their weights loaded into this
        process's encoder objects), the mirror is reloaded whole and the retriever serves the saved index of that
        version or rebuilds it.
        """
        if self.path is None:
            return
        self._store.check_file()  # raises StoreChangedError: never read or write a store deleted from the folder
        if not self._store.is_stale():
            return
        config = self._store.get_meta("config") or self._config
        encoders_moved = config.get("encoders_version", 0) != self._config.get("encoders_version", 0)
        self._config = dict(config)
        if encoders_moved:
            self._encoders.reload(self._config)
            self._store.load(self.dim, self.value_dim)
            self._retriever.open()
            return
        caught = self._store.catch_up(self.dim, self.value_dim)
        if caught is None:
            self._retriever.open()
        else:
            self._retriever.apply(removed=caught.removed, added=caught.added, keys=caught.keys)

    # ------------------------------------------------------------------ small things

    def __len__(self) -> int:
        with self._reading():
            return len(self._store)

    def __contains__(self, key: object) -> bool:
        q = query_tensor(key, self.dim)[0] if isinstance(key, (Tensor, np.ndarray)) else None
        with self._reading():
            if isinstance(key, str):
                return self._store.id_of(key) >= 0
            return q is not None and bool((self._retriever.exact_targets(q) >= 0).all())

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "memory" if self.path is None else str(self.path)
        state = "closed" if self._closed else f"{len(self._store)} records"
        return (
            f"Database({where!r}, {state}, dim={self.dim}, value_dim={self.value_dim}, "
            f"index={self.index_spec!r}, score={self.score!r}, device={self.device})"
        )

    @property
    def index(self) -> CandidateIndex:
        """The candidate index (derived from the store; see :mod:`kvsearch.index.factory`)."""
        return self._retriever.index

    @property
    def retriever(self) -> Retriever:
        """The retrieval seam: query tensors -> candidates (see :class:`~kvsearch.retrieval.Retriever`)."""
        return self._retriever

    @property
    def store(self) -> Store:
        """The record store (the single source of truth)."""
        return self._store

    @property
    def encoder(self) -> Encoder | None:
        """The key encoder (also encodes query texts unless :attr:`query_encoder` is set), or None."""
        return self._encoders.key

    @property
    def value_encoder(self) -> Encoder | None:
        """The value encoder (often the key encoder itself), or None when values are given as embeddings.

        Raises:
            InvalidArgumentError: (on assignment) not an Encoder or None.
            DimensionMismatchError: (on assignment) its dim differs from the database's ``value_dim``.
        """
        return self._encoders.value

    @value_encoder.setter
    def value_encoder(self, encoder: Encoder | None) -> None:
        if encoder is not None and not isinstance(encoder, Encoder):
            raise InvalidArgumentError(
                f"expected a kvsearch Encoder or None as value_encoder, got {type(encoder).__name__}"
            )
        if encoder is not None and encoder.dim != self.value_dim:
            raise DimensionMismatchError(f"expected a value encoder of dim {self.value_dim}, got dim {encoder.dim}")
        self._encoders.value = encoder

    @property
    def query_encoder(self) -> Encoder | None:
        """The encoder of text queries when it differs from the key encoder (a fine-tuned query side), else None.

        Text queries are encoded with it when it is set, with :attr:`encoder` otherwise. It is saved with the
        database (prefix ``query_encoder``) by :meth:`save_encoders` and :meth:`close`.

        Raises:
            InvalidArgumentError: (on assignment) not an Encoder or None.
            DimensionMismatchError: (on assignment) its dim differs from the database's.
        """
        return self._encoders.query

    @query_encoder.setter
    def query_encoder(self, encoder: Encoder | None) -> None:
        self._encoders.set_query(encoder, self.dim)

    def _check_open(self) -> None:
        if self._closed:
            raise DatabaseClosedError("this database was closed; open the folder again to use it")

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
            keys: key texts (a list of str; a single str adds one record), or key embeddings (n, dim). Key texts
                are stored NFC-normalised and stripped of surrounding whitespace (see
                :func:`~kvsearch.inputs.normalize_key`); values are stored as given.
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
        return self._write(keys, values, metadata, key_embeddings, value_embeddings, upsert=False)

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
        return self._write(keys, values, metadata, key_embeddings, value_embeddings, upsert=True)

    def _write(self, keys, values, metadata, key_embeddings, value_embeddings, *, upsert: bool) -> list[int]:
        self._check_open()
        key_texts, key_embs = record_side(keys, "keys", self.encoder, self.dim, key_embeddings)
        n = len(key_texts)
        value_texts, value_embs = record_side(values, "values", self.value_encoder, self.value_dim, value_embeddings)
        if len(value_texts) != n:
            raise DimensionMismatchError(f"expected one value per key ({n}), got {len(value_texts)} values")
        check_batch(n, "records")
        metadata = check_metadata(metadata, n)
        # Refused up front if the grown mirror (copied once by torch.cat) and the index additions cannot fit.
        need = (len(self._store) + 2 * n) * (self.dim + self.value_dim) * 4 + index_bytes(self.index_spec, n, self.dim)
        check_fits(need, f"adding {n:,} records")
        # which texts came with their own embedding: kept as given, never re-encoded from the text
        given = (GIVEN_KEY if key_embeddings is not None else 0) | (GIVEN_VALUE if value_embeddings is not None else 0)
        with self._writing():
            existing = self._store.stored_ids_of_keys(key_texts, allow=upsert)  # raises DuplicateKeyError
            if upsert and n and key_texts[0] is None:  # keys as embeddings: the same key is an equal embedding
                existing = self._equal_keys(key_embs)  # raises DuplicateKeyError
            if n == 0:
                return []
            key_embs = encode_side(key_texts, key_embs, self.encoder, self.dim, "keys")  # (n, dim)
            value_embs = encode_side(value_texts, value_embs, self.value_encoder, self.value_dim, "values")
            ids = self._store.write(key_texts, value_texts, metadata, key_embs, value_embs, existing, [given] * n)
            self._retriever.apply(removed=[i for i in existing if i is not None], added=ids, keys=key_embs)
        return ids

    def _equal_keys(self, key_embs: Tensor) -> list[int | None]:
        """The stored id each key embedding (n, dim) replaces in an upsert: the one record without key text whose
        key embedding equals it, or None for a new key.

        Raises:
            DuplicateKeyError: two equal rows in the batch; or the equal stored key has a text, or several records
                have it (replace one by id instead).
        """
        _, inverse, counts = torch.unique(key_embs + 0.0, dim=0, return_inverse=True, return_counts=True)
        if bool((counts > 1).any()):
            twice = torch.nonzero(counts[inverse] > 1).flatten().tolist()  # positions of repeated rows
            raise DuplicateKeyError(f"expected unique key embeddings, got equal rows at positions {twice[:10]}")
        first, count = self._retriever.key_matches(key_embs)  # (n,), (n,)
        out: list[int | None] = []
        for i, (id_, c) in enumerate(zip(first.tolist(), count.tolist())):
            how = f"replace a record by id: delete({id_}) then add(...); nothing was written"
            if c > 1:
                raise DuplicateKeyError(
                    f"expected one stored record per key embedding, got {c} records equal to the key at position "
                    f"{i}; {how}"
                )
            text = self._store.key_of_id.get(id_) if c else None
            if text is not None:
                raise DuplicateKeyError(
                    f"expected a key embedding without text, got one equal to the key {text!r} of record {id_} "
                    f"(position {i}): upsert it by its text with key_embeddings=, or {how}"
                )
            out.append(id_ if c else None)
        return out

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
        self._check_open()
        if missing not in ("raise", "ignore"):
            raise UnknownOptionError(f"expected missing='raise' or 'ignore', got {missing!r}")
        items = delete_items(key_or_keys)
        with self._writing():
            if missing == "ignore":
                store = self._store
                items = [i for i in items if (i in store.id_of_key if isinstance(i, str) else store.contains_id(i))]
            ids = self._store.resolve(items, "nothing was deleted")  # raises KeyNotFoundError
            if ids:
                self._store.delete(ids)
                self._retriever.apply(removed=ids, added=[], keys=None)
        return ids

    def set_search_params(self, **params: float) -> None:
        """Set FAISS search parameters (``nprobe``, ``efSearch``...) and remember them with the database.

        Raises:
            UnknownOptionError: a parameter that does not apply to this index type.
        """
        with self._writing():
            self._retriever.set_params(**params)
            self._config["search_params"] = {**self._config.get("search_params", {}), **params}
            self._store.set_meta("config", self._config)

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
        self._check_open()
        if self._encoders.changed():
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
        with self._writing():
            self._refuse_in_atomic("a new generation")
            config = generations.commit(
                self._store, self._files, self._encoders, self._config, force=reencode, values=values, summary=summary
            )
            self._config = config
            self._retriever.rebuild()
        return int(config["generation"])

    def _refuse_in_atomic(self, what: str) -> None:
        if self._atomic:
            raise NotSupportedError(f"{what} inside atomic() is not supported: its files could not be rolled back")

    def begin_generation(self) -> Draft:
        """Start preparing a new generation in memory (a fine-tuning run): see :class:`~kvsearch.generations.Draft`.

        Returns:
            The draft; the run ends with its ``commit()`` or ``discard()`` (which puts the encoders back).
        """
        self._check_open()
        return Draft(self, self._encoders.snapshot(), self._encoders.restore)

    def rollback_encoders(self) -> int:
        """Return to the previous generation of encoders (once): keys re-encoded with them, values restored.

        Returns:
            The generation now current.

        Raises:
            NothingToRollBackError: there is no previous generation (or it was already rolled back).
            CorruptDatabaseError: a file of the previous generation is missing or damaged.
        """
        with self._writing():
            self._refuse_in_atomic("rolling back the encoders")
            self._config = generations.rollback(self._store, self._files, self._encoders, self._config)
            self._retriever.rebuild()
        return self.generation

    @property
    def generation(self) -> int:
        """The current generation of encoders and embeddings (0: written before generations existed)."""
        with self._reading():
            return int(self._config.get("generation") or 0)

    @property
    def previous_generation(self) -> int | None:
        """The generation :meth:`rollback_encoders` returns to, or None."""
        with self._reading():
            return generations.describe(self._files, self._encoders, self._config)["previous"]

    def encoders_info(self) -> dict[str, Any]:
        """The encoders and their generation (see :func:`kvsearch.generations.describe`)."""
        with self._reading():
            return generations.describe(self._files, self._encoders, self._config)

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
        self._check_open()
        self._check_writable()
        self._save(wait=True)

    def _save(self, *, wait: bool) -> None:
        """Write the changed encoders (waiting for the lock) and the changed index (waiting only if ``wait``).

        Nothing changed, nothing is written and no lock is taken: a process that only read never blocks on,
        or overwrites, what another process wrote. The index is derived data: ``close`` writes it only if the
        lock is free at once (else the next open rebuilds it from the store).
        """
        if self.path is None or self.read_only:  # a read-only reader never writes, not even its index
            return
        self._store.check_file()
        if self._encoders.changed():
            try:
                self.save_encoders()
            except NonFiniteError as exc:  # never saved: the folder keeps its last good generation
                warnings.warn(f"kvsearch: the changed encoders were not saved: {exc}", RuntimeWarning, stacklevel=3)
        if not self._retriever.needs_save:
            return
        with self._store.lock:
            try:
                self._store.write_lock.acquire(timeout=None if wait else 0.0)
            except DatabaseLockedError:
                if wait:
                    raise
                return
            try:
                if not self._store.is_stale():
                    self._retriever.save()
            finally:
                self._store.write_lock.release()

    def close(self) -> None:
        """Save what changed (see :meth:`save`) and close the store. Closing twice is harmless.

        A process that only read writes nothing and takes no lock; a read-only database writes nothing at all.

        Raises:
            DatabaseLockedError: an encoder changed and another writer held the lock past ``lock_timeout``.
            DiskFullError: no space to save the index or the encoders (the store is closed all the same).
            StoreChangedError: ``store.sqlite`` was deleted or replaced: nothing was saved (the store is closed).
        """
        if self._closed:
            return
        try:
            self._save(wait=False)
        finally:
            self._closed = True
            self._store.close()

    # ------------------------------------------------------------------ reading

    def get(self, id: int) -> Record:
        """The record with this id.

        Raises:
            KeyNotFoundError: no record has this id (an id outside int64 never has one).
            InvalidArgumentError: ``id`` is not an int.
        """
        if isinstance(id, bool) or not isinstance(id, (int, np.integer)):
            raise InvalidArgumentError(f"expected an int id, got {type(id).__name__}")
        with self._reading():
            record = self._store.fetch([int(id)]).get(int(id))
        if record is None:
            raise KeyNotFoundError(f"expected a stored id, got {int(id)}")
        return record

    def lookup(self, key: str | Tensor | np.ndarray, default: Any = _MISSING) -> str | Tensor | None:
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
        with self._reading():
            if q is None:
                id_ = self._store.id_of(key)
            else:
                first, counts = self._retriever.key_matches(q)  # (1,), (1,)
                id_, count = (int(first[0]) if int(counts[0]) == 1 else -1), int(counts[0])
            if id_ >= 0:
                return self._values_of([id_])[id_]
        if default is _MISSING:
            if count > 1:
                raise KeyNotFoundError(
                    f"no record has the key <embedding> unambiguously: expected one stored key with that embedding, "
                    f"got {count} stored keys with it"
                )
            shown = key if isinstance(key, str) else "<embedding>"
            raise KeyNotFoundError(f"no record has the key {shown!r}")
        return default

    def search(
        self, queries: Queries, k: int = 10, *, where: Mapping[str, Any] | None = None
    ) -> list[Hit] | list[list[Hit]]:
        """The k nearest records to each query, best first.

        Args:
            queries: a text, a list of texts, a query embedding (dim,) or a batch (batch, dim).
            k: how many; fewer come back when the database holds fewer.
            where: a metadata filter such as ``{"lang": "en", "year": {"$gte": 2000}}`` (operators
                ``$eq $ne $gt $gte $lt $lte $in $nin``, see :mod:`kvsearch.filters`): k matching records
                come back when k exist.

        Returns:
            A list of :class:`Hit` for one query, a list of lists for a batch; empty lists when the database is
            empty. Each hit carries its record's metadata, read in the same snapshot as the search.

        Raises:
            InvalidArgumentError, DimensionMismatchError, NonFiniteError, MissingEncoderError (text queries and no
            encoder for them).
        """
        self._check_open()
        k = check_k(k)
        if where is not None:
            check_where(where)
        q, _, single = self._prepare_queries(queries)
        with self._reading():
            if len(self._store) == 0:
                return [] if single else [[] for _ in range(q.shape[0])]
            cand = self._retriever.candidates(q, k, where=where)
            scores = compute_scores(q.to(self.device).unsqueeze(1), cand.keys, self.score).squeeze(1)  # (b, k)
            scores = torch.where(cand.mask, scores, -math.inf)  # (b, k)
            order = torch.argsort(scores, dim=-1, descending=True, stable=True)  # (b, k)
            ids = cand.ids.gather(1, order).cpu()  # (b, k)
            found = [i for row in ids.tolist() for i in row if i >= 0]
            values = self._values_of(found, gathered=cand)
            metadata = self._store.metadata_texts(found)
            hits = make_hits(ids, scores.gather(1, order).cpu(), self._store.key_of_id, values, metadata)
        return hits[0] if single else hits

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
        self._check_open()
        k = check_k(k, allow_all=True)
        if score is not None:
            check_score(score)
        if pooling not in POOLINGS:
            raise UnknownOptionError(f"expected pooling among {POOLINGS}, got {pooling!r}")
        temperature = check_temperature(temperature)
        if where is not None:
            check_where(where)
        q, texts, single = self._prepare_queries(queries)
        out_device = q.device
        q = q.to(self.device)  # (b, dim)
        with self._reading():
            self._check_not_empty()
            targets = None
            if pooling == "exact":  # text equality for text queries, else equal embeddings
                if texts is None:
                    targets = self._retriever.exact_targets(q)  # (b,)
                else:
                    targets = torch.tensor([self._store.id_of(t) for t in texts], dtype=torch.long)
            cand = self._retriever.candidates(q, k, targets=targets, where=where)
            output, weights = attend_candidates(
                q,
                cand,
                every=k == "all",
                score=self.score if score is None else score,
                pooling=pooling,
                temperature=temperature,
            )  # (b, value_dim), (b, t)
            answer = make_answer(
                output,
                weights,
                cand.ids,
                k=None if k == "all" else k,
                key_of_id=self._store.key_of_id,
                values_of=self._values_of if k == "all" else lambda ids: self._values_of(ids, gathered=cand),
                device=out_device,
                metadata_of=None if k == "all" else self._store.metadata_texts,  # in this snapshot
            )
        return answer.row(0) if single else answer

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
            :class:`~kvsearch.nn.attention.Candidates`: ids (batch, t), keys (batch, t, dim), values
            (batch, t, value_dim), mask (batch, t), t = min(k, records); for ``k="all"`` (m,)-shaped ones.

        Raises:
            InvalidArgumentError, DimensionMismatchError, NonFiniteError, MemoryLimitError.
            EmptyDatabaseError: the database holds no records (as :meth:`query`).
        """
        self._check_open()
        queries, targets = query_batch(queries, self.dim, targets)
        with self._reading():
            self._check_not_empty()
            return self._retriever.candidates(queries, k, targets=targets, where=where)

    def exact_targets(self, queries: Tensor) -> Tensor:
        """For each query embedding, the id of the one record whose key embedding equals it, else -1.

        The rule of ``pooling="exact"`` for embeddings: several stored keys with that very embedding are ambiguous,
        hence -1 (not found), as none is. :class:`~kvsearch.KVAttention` with exact pooling uses it.

        Args:
            queries: (batch, dim).

        Returns:
            (batch,) int64 ids on the CPU.

        Raises:
            InvalidArgumentError: not a floating-point tensor.
            DimensionMismatchError: queries are not (batch, dim).
            NonFiniteError: NaN or Inf in the queries.
        """
        queries, _ = query_batch(queries, self.dim)  # (batch, dim) floating point, finite
        with self._reading():
            return self._retriever.exact_targets(queries)

    # ------------------------------------------------------------------ reads by id (for training and tools)

    def ids(self) -> Tensor:
        """Every stored id, sorted: (m,) int64 on the CPU."""
        with self._reading():
            return self._store.ids.clone()

    def ids_of_keys(self, texts: Sequence[str]) -> Tensor:
        """The id of each key text (compared after normalisation, see :meth:`lookup`): (n,) int64 on the CPU, -1
        where the key is not stored.

        Raises:
            InvalidArgumentError: not a list of str, or text that is not valid Unicode.
        """
        texts = text_list(texts, "key texts")
        with self._reading():
            return torch.tensor([self._store.id_of(t) for t in texts], dtype=torch.long)

    def values_present(self, texts: Sequence[str]) -> Tensor:
        """Whether some stored record has each value text: (n,) bool on the CPU.

        Raises:
            InvalidArgumentError: not a list of str, or text that is not valid Unicode.
        """
        texts = text_list(texts, "value texts")
        with self._reading():
            return self._store.values_present(texts)

    def key_texts(self, ids: Tensor | Sequence[int], *, encoded_only: bool = False) -> list[str | None]:
        """The key text of each id, in order: None where the record has no key text or is not stored.

        Args:
            ids: record ids.
            encoded_only: None also for key texts that came with their own embedding (``key_embeddings=``): the
                texts whose key embedding is the key encoder's, which a trainer may re-encode.

        Raises:
            InvalidArgumentError: ``ids`` are not integers (see :func:`kvsearch.inputs.id_tensor`).
        """
        flat = id_tensor(ids).reshape(-1).tolist()
        with self._reading():
            key_of, given = self._store.key_of_id, self._store.given_keys if encoded_only else ()
            return [None if i in given else key_of.get(i) for i in flat]

    def value_texts(self, ids: Tensor | Sequence[int]) -> dict[int, str | None]:
        """id -> the value text (None for a value given as an embedding), for the stored ones among ``ids``.

        Raises:
            InvalidArgumentError: ``ids`` are not integers.
        """
        ids = id_tensor(ids).reshape(-1).tolist()
        with self._reading():
            return self._store.value_texts(ids)

    def embeddings(self, ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings gathered by id (any shape, -1 allowed), on :attr:`device`.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) — zeros where an id is -1 or not stored —
            and the mask (*ids.shape) of the stored ones.

        Raises:
            InvalidArgumentError: ``ids`` are not integers.
        """
        ids = id_tensor(ids)
        with self._reading():
            return self._store.gather(ids)

    # ------------------------------------------------------------------ helpers

    def _check_not_empty(self) -> None:
        if len(self._store) == 0:
            raise EmptyDatabaseError("expected a database with records to search, got an empty one")

    def values_of(self, ids: Sequence[int]) -> dict[int, str | Tensor | None]:
        """id -> the value as answers show it: its text, or its embedding (CPU tensor) when it has no text.

        Raises:
            InvalidArgumentError: ``ids`` are not integers.
        """
        ids = id_tensor(ids).reshape(-1).tolist()
        with self._reading():
            return self._values_of(ids)

    def metadata_of(self, ids: Tensor | Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> the record's metadata dict ({} when it has none), for the stored ones among ``ids``.

        Raises:
            InvalidArgumentError: ``ids`` are not integers (see :func:`kvsearch.inputs.id_tensor`).
        """
        wanted = [i for i in id_tensor(ids).reshape(-1).tolist() if i >= 0]
        with self._reading():
            texts = self._store.metadata_texts(wanted)
            return {i: json.loads(texts[i]) if i in texts else {} for i in wanted if self._store.contains_id(i)}

    def _values_of(self, ids: Sequence[int], *, gathered: Candidates | None = None) -> dict[int, str | Tensor | None]:
        """id -> the value as answers show it (see :meth:`Store.answer_values`).

        Args:
            ids: stored ids.
            gathered: top-k candidates gathered in this snapshot that hold these ids: where no value has text,
                each value is its embedding, taken from them instead of being looked up by id again.
        """
        # without a value encoder, only values given with their embeddings have text
        texts = self.value_encoder is not None or bool(self._store.given_values)
        if texts or gathered is None:
            return self._store.answer_values(ids, texts=texts)
        out: dict[int, str | Tensor | None] = dict.fromkeys(ids)
        rows = gathered.values.detach().reshape(-1, gathered.values.shape[-1]).cpu().numpy()  # (b * t, value_dim)
        for n, (id_, here) in enumerate(zip(gathered.ids.reshape(-1).tolist(), gathered.mask.reshape(-1).tolist())):
            if here and id_ in out and out[id_] is None:
                out[id_] = torch.from_numpy(rows[n].copy())  # (value_dim,) its own storage, not a view of the batch
        return out

    def _prepare_queries(self, queries: Queries) -> tuple[Tensor, list[str] | None, bool]:
        """Queries as (batch, dim) on their own device (text: the encoder's), texts, and whether single."""
        texts = query_texts(queries)
        if texts is None:
            q, single = query_tensor(queries, self.dim)
            return q, None, single
        with self._store.lock:  # encode with the encoders another process may have fine-tuned since
            self._check_open()
            self._sync()
        encoder = self._encoders.for_queries
        if encoder is None:
            raise MissingEncoderError(
                "this database has no encoder for query texts; pass query embeddings (batch, "
                f"{self.dim}) or set db.query_encoder"
            )
        q = encoder.encode(texts)  # (b, dim)
        check_finite(q, "query embeddings")
        return q, texts, isinstance(queries, str)
