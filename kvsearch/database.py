"""The facade users hold: a store, an index, encoders and attention behind one object.

    db = Database("indexes/names", encoder=NgramEncoder())
    db.add(keys=["Li", "Lipton"], values=["Mu", "Zachary"])
    db.lookup("Li")                                  # "Mu": an exact database lookup
    db.query("Lipto", k=4, pooling="softmax")        # Answer: a differentiable blend of candidate values

Folder layout: ``store.sqlite`` (records, the single source of truth, and the configuration),
``encoder.json`` / ``encoder.safetensors`` (and ``value_encoder.*`` when values have their own encoder),
``index.npz`` + ``manifest.json`` (the FAISS index of a trained or graph type and the store version it
was built at). Flat indexes are rebuilt from the store on open rather than saved.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch import encoder_files
from kvsearch.attention import (
    POOLINGS,
    SCORES,
    Candidates,
    ScoreFn,
    attend,
    compute_scores,
)
from kvsearch.encoder_files import sha256_file
from kvsearch.encoders import Encoder, load_encoder
from kvsearch.errors import (
    ConfigMismatchError,
    CorruptDatabaseError,
    DatabaseClosedError,
    DatabaseLockedError,
    DimensionMismatchError,
    DuplicateKeyError,
    EmptyDatabaseError,
    EmptyKeyError,
    InvalidArgumentError,
    KeyNotFoundError,
    NonFiniteError,
    UnknownOptionError,
)
from kvsearch.filters import check_where
from kvsearch.index import MAX_K, Index
from kvsearch.checks import MAX_BATCH, all_finite, check_temperature
from kvsearch.limits import check_fits, index_bytes
from kvsearch.locking import DEFAULT_LOCK_TIMEOUT
from kvsearch.store import STORE_FILE, Record, Store
from kvsearch.streaming import STREAMING_SCORES, streaming_attention
from kvsearch.torch_index import TorchIndex, parse_torch_spec

__all__ = ["Database", "Hit", "Answer", "LazyKeys", "DB_SCORES"]

#: Score functions a database can use as its default (they decide the index metric).
DB_SCORES = ("dot", "scaled_dot", "cosine", "gaussian")
FORMAT = 1
INDEX_FILE = "index.npz"
#: A filtered search scans the matching records exactly when at most this many match (else FAISS selects).
FILTER_SCAN_MAX = 4096
MANIFEST_FILE = "manifest.json"
#: The store meta entry with the SHA-256 of every encoder file: ``{"current": {name: hex}, "pending": ... | None}``
#: (see :mod:`kvsearch.encoder_files`).
ENCODER_FILES_META = "encoder_files"
_MISSING: Any = object()

Queries = str | Sequence[str] | Tensor | np.ndarray
KeysIn = str | Sequence[str] | Tensor | np.ndarray


@dataclass(frozen=True)
class Hit:
    """One search result.

    Attributes:
        id: the record's global id.
        key: the key text (None for a key given as an embedding).
        value: the value text, or the value embedding (CPU tensor) for a value given as an embedding.
        score: the score function of the database, recomputed in torch on the stored key.
    """

    id: int
    key: str | None
    value: str | Tensor | None
    score: float


@dataclass
class Answer:
    """The result of :meth:`Database.query`: one query unbatched, a list or 2-D tensor batched.

    Attributes:
        output: (value_dim,) or (batch, value_dim): ``sum_i weights_i * values_i``, differentiable.
        weights: (k,) or (batch, k): the attention weights, 0 on missing candidates.
        ids: (k,) or (batch, k): candidate ids, -1 where there was no candidate.
        keys: the candidates' key texts (None where there is no candidate or no text), per query: a
            :class:`LazyKeys` sequence that looks the texts up when read (``.tolist()`` for plain lists).
        value: the value of the highest-weight candidate (text, or a CPU tensor for embedding values);
            None where nothing was found.
        found: whether the query found anything (for ``pooling="exact"``: whether the key is stored).
    """

    output: Tensor
    weights: Tensor
    ids: Tensor
    keys: LazyKeys | list[str | None] | list[list[str | None]]
    value: str | Tensor | None | list[str | Tensor | None]
    found: bool | list[bool]

    def plot(self, *, top: int | None = None, figsize: tuple[float, float] | None = None) -> Any:
        """Draw this answer's candidates and their attention weights (see :func:`kvsearch.plot.plot_answer`).

        Args:
            top: show at most this many candidates per query; default all.
            figsize: the figure size in inches.

        Returns:
            The matplotlib Figure.

        Raises:
            MissingDependencyError: matplotlib is not installed (``pip install kvsearch[plot]``).
        """
        from kvsearch.plot import plot_answer  # matplotlib stays optional: imported only when plotting

        return plot_answer(self, top=top, figsize=figsize)


class LazyKeys(Sequence):
    """The candidates' key texts of an :class:`Answer`, looked up when read rather than built per row.

    Indexing a batch gives one query's row (itself lazy); indexing a row gives a key text (None where the
    candidate is missing or has no text). Compares equal to the list it stands for.

    Args:
        ids: (k,) or (batch, k) int64 CPU ids, -1 where there is no candidate.
        key_of_id: id -> key text.
    """

    def __init__(self, ids: Tensor, key_of_id: Mapping[int, str]) -> None:
        self._ids = ids
        self._key_of_id = key_of_id

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __getitem__(self, index: int | slice) -> str | None | LazyKeys | list:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self._ids[index]
        if row.dim() == 0:
            return self._key_of_id.get(int(row))
        return LazyKeys(row, self._key_of_id)

    def __iter__(self) -> Iterator:
        if self._ids.dim() == 1:
            get = self._key_of_id.get
            return iter([get(i) for i in self._ids.tolist()])
        return (LazyKeys(row, self._key_of_id) for row in self._ids)

    def tolist(self) -> list:
        """The plain list (a list of lists for a batch) of key texts."""
        return [x.tolist() if isinstance(x, LazyKeys) else x for x in self]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyKeys):
            other = other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None  # compares by content, like a list

    def __repr__(self) -> str:
        return repr(self.tolist())


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

    Raises:
        InvalidArgumentError: no encoder and no dim, or a bad argument.
        UnknownOptionError: an unknown score or index spec.
        ConfigMismatchError: reopening with a dim, index, score or encoder that differs from the stored one.
        CorruptDatabaseError: a file of the database is damaged beyond rebuilding.
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
    ) -> None:
        self.device = _check_device(device)
        _check_path(path)
        if isinstance(lock_timeout, bool) or not isinstance(lock_timeout, (int, float)) or not lock_timeout >= 0:
            raise InvalidArgumentError(f"expected lock_timeout as a number of seconds >= 0, got {lock_timeout!r}")
        self.path = None if path is None else Path(path)
        self._closed = False
        made: list[Path] = []  # what a failed creation leaves behind is removed again
        if self.path is not None:
            if self.path.exists() and not self.path.is_dir():
                raise InvalidArgumentError(f"expected a folder for the database, got a file: {self.path}")
            if not (self.path / STORE_FILE).exists():
                made = [d for d in (self.path, *self.path.parents) if not d.exists()][::-1] or [self.path]
                made = [*made, *(self.path / name for name in _CREATED_FILES)]
            self.path.mkdir(parents=True, exist_ok=True)
        self._store = Store(None if self.path is None else self.path / STORE_FILE, self.device)
        self._store.write_lock.timeout = float(lock_timeout)
        self._index_dirty = False  # the index differs from the saved one (written by save / close)
        self._encoder_marks: tuple = ()  # the encoders' state when last loaded or saved (see _encoder_state)
        try:
            saved = self._store.get_meta("config")
            if saved is None:
                self._create(encoder, value_encoder, dim, value_dim, index, score, search_params)
            else:
                self._reopen(saved, encoder, value_encoder, dim, value_dim, index, score, search_params)
        except BaseException:
            self._store.close()
            _remove_created(made)
            raise

    # ------------------------------------------------------------------ opening

    def _create(self, encoder, value_encoder, dim, value_dim, index, score, search_params) -> None:
        score = "cosine" if score is None else score
        index = "Flat" if index is None else index
        _check_db_score(score)
        if encoder is not None and not isinstance(encoder, Encoder):
            raise InvalidArgumentError(f"expected a kvsearch Encoder as encoder, got {type(encoder).__name__}")
        if value_encoder is not None and not isinstance(value_encoder, Encoder):
            raise InvalidArgumentError(
                f"expected a kvsearch Encoder as value_encoder, got {type(value_encoder).__name__}"
            )
        if encoder is not None and dim is not None and dim != encoder.dim:
            raise DimensionMismatchError(f"expected dim {encoder.dim} (the encoder's), got dim={dim}")
        dim = encoder.dim if encoder is not None else dim
        if dim is None:
            raise InvalidArgumentError("expected an encoder or an explicit dim, got neither")
        if value_encoder is None and encoder is not None and value_dim in (None, encoder.dim):
            value_encoder = encoder
        if value_encoder is not None and value_dim is not None and value_dim != value_encoder.dim:
            raise DimensionMismatchError(
                f"expected value_dim {value_encoder.dim} (the value encoder's), got value_dim={value_dim}"
            )
        value_dim = value_encoder.dim if value_encoder is not None else value_dim
        if value_dim is None:
            raise InvalidArgumentError("expected a value_encoder, an encoder or an explicit value_dim, got none")
        for name, d in (("dim", dim), ("value_dim", value_dim)):
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise InvalidArgumentError(f"expected a positive integer {name}, got {d!r}")
        self.dim, self.value_dim, self.score, self.index_spec = dim, value_dim, score, index
        self._index = self._new_index(dict(search_params or {}))
        self.encoder = None if encoder is None else encoder.to(self.device)
        self.value_encoder = None if value_encoder is None else value_encoder.to(self.device)
        self._query_encoder: Encoder | None = None
        self._config = {
            "format": FORMAT,
            "dim": dim,
            "value_dim": value_dim,
            "score": score,
            "index": index,
            "search_params": dict(search_params or {}),
            "encoder": encoder is not None,
            "value_encoder": _value_encoder_kind(value_encoder, encoder),
            "query_encoder": False,
        }
        self._store.set_meta("config", self._config)
        self.save_encoders()
        self._store.load(dim, value_dim)

    def _reopen(self, saved, encoder, value_encoder, dim, value_dim, index, score, search_params) -> None:
        if saved.get("format") != FORMAT:
            raise ConfigMismatchError(f"expected database format {FORMAT}, got {saved.get('format')!r}")
        for name, given in (("dim", dim), ("value_dim", value_dim), ("index", index), ("score", score)):
            if given is not None and given != saved[name]:
                raise ConfigMismatchError(
                    f"{self.path} was created with {name}={saved[name]!r}; got {name}={given!r}. "
                    f"Open it without {name}, or use another folder."
                )
        self._config = dict(saved)
        if search_params:
            self._config["search_params"] = {**saved.get("search_params", {}), **search_params}
        self.dim, self.value_dim = saved["dim"], saved["value_dim"]
        self.score, self.index_spec = saved["score"], saved["index"]
        self.encoder = self._reopen_encoder("encoder", saved["encoder"], encoder)
        if saved["value_encoder"] == "key":
            if value_encoder is not None and value_encoder is not encoder:
                raise ConfigMismatchError(f"{self.path} encodes values with the key encoder; got a value_encoder")
            self.value_encoder = self.encoder
        else:
            self.value_encoder = self._reopen_encoder("value_encoder", saved["value_encoder"] == "own", value_encoder)
        # databases made before query encoders existed have no "query_encoder" entry: they have none
        self._query_encoder = self._reopen_encoder("query_encoder", bool(saved.get("query_encoder", False)), None)
        self._encoder_marks = self._encoder_state()
        self._settle_encoder_digests()
        self._store.load(self.dim, self.value_dim)
        self._index = self._load_or_rebuild_index()

    def _reopen_encoder(self, prefix: str, stored: bool, given: Encoder | None) -> Encoder | None:
        if not stored:
            if given is not None:
                raise ConfigMismatchError(f"{self.path} was created without {prefix}; got one")
            return None
        loaded = self._load_verified(prefix)
        if given is None:
            return loaded
        if given.config() != loaded.config():
            raise ConfigMismatchError(f"{self.path} was created with {prefix} {loaded.config()}; got {given.config()}")
        given.load_state_dict(loaded.state_dict())  # the stored (possibly fine-tuned) weights win
        return given.to(self.device)

    def _load_verified(self, prefix: str) -> Encoder:
        """Load the encoder ``prefix`` from the folder after checking its files against their recorded SHA-256.

        A file is good if it matches the current or the pending digest (a save that stopped between writing
        the files and recording them leaves either). Databases made before digests were recorded have none:
        their files load unchecked. On a mismatch the digests are read once more from a fresh connection
        (another process may have saved newer encoders after this view's snapshot) before giving up.

        Raises:
            CorruptDatabaseError: a file differs from what was saved (naming it, the expected and the found
                digest), or cannot be read.
        """
        try:
            encoder_files.verify(self.path, prefix, self._store.get_meta(ENCODER_FILES_META))
        except CorruptDatabaseError:
            encoder_files.verify(self.path, prefix, self._latest_meta(ENCODER_FILES_META))
        return load_encoder(self.path, prefix, device=self.device)

    def _latest_meta(self, name: str) -> Any:
        """A meta value as last committed, read on a fresh connection (outside this view's read snapshot)."""
        try:
            with closing(sqlite3.connect(str(self.path / STORE_FILE), timeout=10.0)) as conn:
                row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        except sqlite3.Error as exc:
            raise CorruptDatabaseError(f"{self.path / STORE_FILE}: cannot read {name!r}: {exc}") from None
        return None if row is None else json.loads(row[0])

    def _settle_encoder_digests(self) -> None:
        """Finish the digest record of a save that stopped between writing the encoder files and recording them.

        Only when pending digests exist and the write lock is free at once: if every recorded file matches the
        pending digests they become current, if every one matches the current digests pending is dropped;
        otherwise (or when another writer holds the lock) the record is left as it is (still accepted on load).
        """
        record = self._store.get_meta(ENCODER_FILES_META)
        if self.path is None or not isinstance(record, dict) or not record.get("pending"):
            return
        try:
            self._store.write_lock.acquire(timeout=0.0)
        except DatabaseLockedError:
            return
        try:
            record = self._store.get_meta(ENCODER_FILES_META) or {}
            pending, current = record.get("pending"), record.get("current") or {}
            if not pending:
                return
            if encoder_files.files_match(self.path, pending):
                self._store.set_meta(ENCODER_FILES_META, {"current": pending, "pending": None})
            elif encoder_files.files_match(self.path, current):
                self._store.set_meta(ENCODER_FILES_META, {"current": current, "pending": None})
        finally:
            self._store.write_lock.release()

    def _load_or_rebuild_index(self) -> Index:
        params = self._config.get("search_params") or {}
        metric = _metric(self.score)
        if self.path is not None and self._index_is_saved():
            manifest_path, index_path = self.path / MANIFEST_FILE, self.path / INDEX_FILE
            try:
                manifest = json.loads(manifest_path.read_text())
                # Served only if it is exactly the index of this store version: same version, spec and
                # size, the very bytes the manifest was written for (a torn, truncated or swapped file
                # fails the hash before FAISS reads it), and the very ids the store holds.
                if (
                    manifest.get("version") == self._store.loaded_version
                    and manifest.get("spec") == self.index_spec
                    and manifest.get("ntotal") == len(self._store)
                    and manifest.get("sha256") == sha256_file(index_path)
                ):
                    index = Index.load(index_path, self.dim, self.index_spec, metric, params)
                    if index.ntotal == len(self._store) and np.array_equal(index.ids(), self._store.ids.numpy()):
                        self._index_dirty = False
                        return index
            except (CorruptDatabaseError, ValueError, OSError, KeyError, AttributeError, TypeError):
                pass  # a damaged or foreign side file: the store is the truth, rebuild from it
        index = self._new_index(params)
        self._rebuild_into(index)
        self._index_dirty = True  # differs from what is saved (if anything is): close() writes it if it can
        return index

    def _new_index(self, params: dict[str, float]) -> Index | TorchIndex:
        """An empty index of ``self.index_spec``: FAISS, or for ``"torch[:dtype]"`` exact torch search.

        A torch index reads the store's key tensor itself (no second copy; only a (n,) norm vector for
        cosine or L2, or a half-precision copy for ``"torch:float16"`` / ``"torch:bfloat16"``).
        """
        dtype = parse_torch_spec(self.index_spec)
        if dtype is None:
            return Index(self.dim, self.index_spec, _metric(self.score), params=params)
        index = TorchIndex(
            self.dim, _metric(self.score), source=self._store, normalize=self.score == "cosine", dtype=dtype
        )
        index.set_params(**params)
        return index

    def _index_is_saved(self) -> bool:
        return (self.path / MANIFEST_FILE).exists() and (self.path / INDEX_FILE).exists()

    def _index_is_persisted(self) -> bool:
        """Whether this index type is written to disk: Flat and torch indexes are rebuilt as fast as read."""
        return self.index_spec != "Flat" and not isinstance(self._index, TorchIndex)

    def _rebuild_into(self, index: Index | TorchIndex) -> None:
        if isinstance(index, TorchIndex):
            index.refresh()  # it searches the store's keys directly: nothing to copy
            return
        check_fits(index_bytes(self.index_spec, len(self._store), self.dim), f"building the {self.index_spec} index")
        index.build(self._store.ids.numpy(), self._index_vectors(self._store.keys))

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold this folder's write lock (bounded wait) and bring a stale view up to date first.

        Raises:
            DatabaseLockedError: another writer held the lock for longer than ``lock_timeout``.
        """
        with self._store.lock, self._store.write_lock:
            self._sync()
            yield

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

        One small SQL read of the store version. When it moved, the in-memory tensors and key maps are
        reloaded, the encoders too if another process saved new ones (their weights are loaded into this
        process's encoder objects), and the index is loaded if a saved one is that version's, else rebuilt.
        """
        if self.path is None or not self._store.is_stale():
            return
        config = self._store.get_meta("config") or self._config
        encoders_moved = config.get("encoders_version", 0) != self._config.get("encoders_version", 0)
        self._config = dict(config)
        if encoders_moved:
            for prefix, encoder in self._encoders().items():
                if encoder is not None and (self.path / f"{prefix}.json").exists():
                    encoder.load_state_dict(self._load_verified(prefix).state_dict())
            if self._config.get("query_encoder") and self._query_encoder is None:
                self._query_encoder = self._load_verified("query_encoder")
            self._encoder_marks = self._encoder_state()
        self._store.load(self.dim, self.value_dim)
        self._index = self._load_or_rebuild_index()

    def _encoders(self) -> dict[str, Encoder | None]:
        """The encoders by file prefix (a value encoder that is the key encoder is listed once)."""
        own_values = self.value_encoder is not None and self.value_encoder is not self.encoder
        return {
            "encoder": self.encoder,
            "value_encoder": self.value_encoder if own_values else None,
            "query_encoder": self._query_encoder,
        }

    def _encoder_state(self) -> tuple:
        """A cheap mark of the encoders' weights: each tensor's storage and its in-place-write counter.

        Every optimizer step, ``load_state_dict`` or in-place change bumps a tensor's ``_version``; a new tensor
        has a new storage. Comparing marks tells whether an encoder changed since it was loaded or saved,
        without hashing its weights.
        """
        marks = []
        for prefix, encoder in self._encoders().items():
            if encoder is None:
                continue
            tensors = encoder.state_dict(keep_vars=True)
            marks.append((prefix, id(encoder), tuple((n, t.data_ptr(), t._version) for n, t in tensors.items())))
        return tuple(marks)

    # ------------------------------------------------------------------ small things

    def __len__(self) -> int:
        with self._reading():
            return len(self._store)

    def __contains__(self, key: object) -> bool:
        with self._reading():
            if isinstance(key, str):
                return key in self._store.id_of_key
            if isinstance(key, (Tensor, np.ndarray)):
                return bool((self._exact_targets(self._as_query_tensor(key)[0]) >= 0).all())
            return False

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
    def index(self) -> Index:
        """The FAISS candidate index (derived from the store)."""
        return self._index

    @property
    def store(self) -> Store:
        """The record store (the single source of truth)."""
        return self._store

    def _check_open(self) -> None:
        if self._closed:
            raise DatabaseClosedError("this database was closed; open the folder again to use it")

    # ------------------------------------------------------------------ writing

    def add(
        self, keys: KeysIn, values: KeysIn, metadata: Sequence[Mapping[str, Any] | None] | None = None
    ) -> list[int]:
        """Add records. Keys must be new.

        Args:
            keys: key texts (a list of str; a single str adds one record), or key embeddings (n, dim).
            values: value texts, or value embeddings (n, value_dim) (or (n,) when value_dim is 1).
            metadata: one JSON-serialisable dict (or None) per record.

        Returns:
            The new ids, in order.

        Raises:
            EmptyKeyError, DuplicateKeyError, DimensionMismatchError, NonFiniteError, InvalidArgumentError:
                raised before anything is written.
        """
        return self._write(keys, values, metadata, upsert=False)

    def upsert(
        self, keys: KeysIn, values: KeysIn, metadata: Sequence[Mapping[str, Any] | None] | None = None
    ) -> list[int]:
        """Add records, replacing (in place, same id) those whose key text is already stored.

        Args and Raises: as :meth:`add`, except that stored keys are allowed.

        Returns:
            The ids, in order: the existing id for a replaced key, a new id otherwise.
        """
        return self._write(keys, values, metadata, upsert=True)

    def _write(self, keys, values, metadata, *, upsert: bool) -> list[int]:
        self._check_open()
        key_texts, key_embs = self._prepare_side(keys, "keys", self.encoder, self.dim)
        n = len(key_texts)
        value_texts, value_embs = self._prepare_side(values, "values", self.value_encoder, self.value_dim)
        if len(value_texts) != n:
            raise DimensionMismatchError(f"expected one value per key ({n}), got {len(value_texts)} values")
        _check_batch(n, "records")
        metadata = _check_metadata(metadata, n)
        # Refused up front if the grown mirror (copied once by torch.cat) and the index additions cannot fit.
        need = (len(self._store) + 2 * n) * (self.dim + self.value_dim) * 4 + index_bytes(self.index_spec, n, self.dim)
        check_fits(need, f"adding {n:,} records")
        with self._writing():
            existing: list[int | None] = [None] * n
            for i, key in enumerate(key_texts):
                if key is not None and key in self._store.id_of_key:
                    if not upsert:
                        raise DuplicateKeyError(
                            f"expected new keys, got {key!r} (record {i}) which is already stored; use upsert"
                        )
                    existing[i] = self._store.id_of_key[key]
            if n == 0:
                return []
            key_embs = self._encode(key_texts, key_embs, self.encoder, self.dim, "keys")  # (n, dim)
            value_embs = self._encode(value_texts, value_embs, self.value_encoder, self.value_dim, "values")
            ids = self._store.write(key_texts, value_texts, metadata, key_embs, value_embs, existing)
            self._sync_index(removed=[i for i in existing if i is not None], added=ids, key_embs=key_embs)
        return ids

    def delete(self, key_or_keys: str | int | Sequence[str | int]) -> list[int]:
        """Delete records by key text or by id.

        Args:
            key_or_keys: a key, an id, or a list of them.

        Returns:
            The deleted ids.

        Raises:
            KeyNotFoundError: a key or id is not stored (then nothing is deleted).
            InvalidArgumentError: an item is neither str nor int.
        """
        self._check_open()
        if isinstance(key_or_keys, (Tensor, np.ndarray)):  # ids as an integer tensor or array
            array = key_or_keys.detach().cpu().numpy() if isinstance(key_or_keys, Tensor) else key_or_keys
            if array.dtype.kind not in "iu":
                raise InvalidArgumentError(f"expected integer ids, got an array of {array.dtype}")
            key_or_keys = [int(i) for i in array.reshape(-1).tolist()]
        items = [key_or_keys] if isinstance(key_or_keys, (str, int, np.integer)) else list(key_or_keys)
        with self._writing():
            ids: list[int] = []
            for item in items:
                if isinstance(item, str):
                    if item not in self._store.id_of_key:
                        raise KeyNotFoundError(f"expected a stored key, got {item!r}; nothing was deleted")
                    ids.append(self._store.id_of_key[item])
                elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
                    if not self._store.contains_id(int(item)):
                        raise KeyNotFoundError(f"expected a stored id, got {int(item)}; nothing was deleted")
                    ids.append(int(item))
                else:
                    raise InvalidArgumentError(f"expected key texts or int ids, got {type(item).__name__}")
            ids = list(dict.fromkeys(ids))
            if ids:
                self._store.delete(ids)
                self._sync_index(removed=ids, added=[], key_embs=None)
        return ids

    def _sync_index(self, removed: list[int], added: list[int], key_embs: Tensor | None) -> None:
        """Mirror a committed store write in the index; rebuild from the store when the index asks.

        The store has committed: should the index fail to follow, it is rebuilt from the store (the truth)
        rather than left behind it.
        """
        self._index_dirty = True
        try:
            self._index.remove(np.asarray(removed, dtype=np.int64))
            if added:
                # a torch index reads the store's keys itself: nothing to convert for it
                vectors = key_embs if isinstance(self._index, TorchIndex) else self._index_vectors(key_embs)
                self._index.add(np.asarray(added, dtype=np.int64), vectors)
        except (RuntimeError, ValueError):
            self._index = self._new_index(dict(self._config.get("search_params") or {}))
            self._rebuild_into(self._index)
            return
        if self._index.needs_rebuild:
            self._rebuild_into(self._index)

    def set_search_params(self, **params: float) -> None:
        """Set FAISS search parameters (``nprobe``, ``efSearch``...) and remember them with the database.

        Raises:
            UnknownOptionError: a parameter that does not apply to this index type.
        """
        self._check_open()
        with self._writing():
            self._index.set_params(**params)
            self._config["search_params"] = {**self._config.get("search_params", {}), **params}
            self._store.set_meta("config", self._config)

    def save_encoders(self) -> None:
        """Write the encoders' configuration (and trained weights) into the database folder.

        The key encoder goes under the prefix ``encoder``, a value encoder of its own under ``value_encoder``
        and a query encoder (see :attr:`query_encoder`) under ``query_encoder``; the configuration records
        which of them exist (and a counter other processes watch to reload them), so reopening the folder
        rebuilds the same encoders. :meth:`close` calls it when an encoder changed since it was loaded.

        The store records the SHA-256 of every file written (model folders excepted), which every load checks.
        Crash-safe in three steps: the encoders are written to a staging folder and their digests recorded as
        *pending* (one transaction); the files are moved into place (``os.replace``, the json last); the
        digests become *current* with the new configuration (one transaction). A stop anywhere leaves files
        that match the current or the pending digests.

        Raises:
            DatabaseLockedError: another writer held the write lock for longer than ``lock_timeout``.
        """
        if self.path is None:
            return
        with self._store.lock, self._store.write_lock:
            encoders = {prefix: e for prefix, e in self._encoders().items() if e is not None}

            def record_pending(digests: dict[str, str]) -> None:
                current = (self._store.get_meta(ENCODER_FILES_META) or {}).get("current") or {}
                self._store.set_meta(ENCODER_FILES_META, {"current": current, "pending": digests})

            digests = encoder_files.install(self.path, encoders, record_pending)
            flags = {
                "value_encoder": _value_encoder_kind(self.value_encoder, self.encoder),
                "query_encoder": self._query_encoder is not None,
            }
            latest = self._store.get_meta("config") or {}
            counter = max(int(latest.get("encoders_version", 0)), int(self._config.get("encoders_version", 0))) + 1
            self._config.update(flags, encoders_version=counter)
            with self._store.transaction():
                self._store.set_meta("config", self._config)
                self._store.set_meta(ENCODER_FILES_META, {"current": digests, "pending": None})
            self._encoder_marks = self._encoder_state()

    def refresh(self) -> None:
        """Re-encode every key from its text with the key encoder and rebuild the index.

        Call it after the key encoder changed (fine-tuning does, every ``refresh_every`` steps): the stored
        key embeddings and the index are then those of the current encoder. Keys stored as embeddings (no
        text) keep their embedding.

        Raises:
            DatabaseClosedError: the database was closed.
        """
        self._check_open()
        with self._writing():
            if len(self._store) == 0:
                return
            keys = self._store.keys.clone()  # (n, dim)
            ids = self._store.ids.tolist()
            rows = [row for row, id_ in enumerate(ids) if id_ in self._store.key_of_id]
            if rows and self.encoder is not None:
                texts = [self._store.key_of_id[ids[row]] for row in rows]
                fresh = self._encode(texts, None, self.encoder, self.dim, "keys")  # (r, dim)
                keys[torch.tensor(rows, dtype=torch.long, device=keys.device)] = fresh.to(keys.device)
            self._store.replace_embeddings(keys=keys)
            self._rebuild_into(self._index)
            self._index_dirty = True

    @property
    def query_encoder(self) -> Encoder | None:
        """The encoder of text queries when it differs from the key encoder (a fine-tuned query side), else None.

        Text queries are encoded with it when it is set, with :attr:`encoder` otherwise. It is saved with the
        database (prefix ``query_encoder``) by :meth:`save_encoders` and :meth:`close`.

        Raises:
            InvalidArgumentError: (on assignment) not an Encoder or None.
            DimensionMismatchError: (on assignment) its dim differs from the database's.
        """
        return self._query_encoder

    @query_encoder.setter
    def query_encoder(self, encoder: Encoder | None) -> None:
        if encoder is not None and not isinstance(encoder, Encoder):
            got = type(encoder).__name__
            raise InvalidArgumentError(f"expected a kvsearch Encoder or None as query_encoder, got {got}")
        if encoder is not None and encoder.dim != self.dim:
            raise DimensionMismatchError(f"expected a query encoder of dim {self.dim}, got dim {encoder.dim}")
        self._query_encoder = None if encoder is None else encoder.to(self.device)

    def save(self) -> None:
        """Write what changed since it was loaded or saved: the encoders, and a trained / graph index.

        Flat and torch indexes are not written: rebuilding them from the store is as fast as reading them.
        The manifest tags the index with the store version it reflects and the SHA-256 of its bytes; an index
        that another process's writes made stale is not written (the next open rebuilds it).

        Raises:
            DatabaseLockedError: another writer held the write lock for longer than ``lock_timeout``.
        """
        self._check_open()
        self._save(wait=True)

    def _save(self, *, wait: bool) -> None:
        """Write the changed encoders (waiting for the lock) and the changed index (waiting only if ``wait``).

        Nothing changed, nothing is written and no lock is taken: a process that only read never blocks on,
        or overwrites, what another process wrote. The index is derived data: ``close`` writes it only if the
        lock is free at once (else the next open rebuilds it from the store).
        """
        if self.path is None:
            return
        if self._encoder_state() != self._encoder_marks:
            self.save_encoders()
        if not (self._index_dirty and self._index_is_persisted()):
            return
        with self._store.lock:
            try:
                self._store.write_lock.acquire(timeout=None if wait else 0.0)
            except DatabaseLockedError:
                if wait:
                    raise
                return
            try:
                if self._store.is_stale():
                    return
                self._index.save(self.path / INDEX_FILE)
                manifest = {
                    "version": self._store.loaded_version,
                    "spec": self.index_spec,
                    "ntotal": self._index.ntotal,
                    "sha256": sha256_file(self.path / INDEX_FILE),
                }
                tmp = self.path / (MANIFEST_FILE + f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(manifest))
                os.replace(tmp, self.path / MANIFEST_FILE)
                self._index_dirty = False
            finally:
                self._store.write_lock.release()

    def close(self) -> None:
        """Save what changed (see :meth:`save`) and close the store. Closing twice is harmless.

        A process that only read writes nothing and takes no lock.

        Raises:
            DatabaseLockedError: an encoder changed and another writer held the lock past ``lock_timeout``.
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
            KeyNotFoundError: no record has this id.
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
            key: a key text, or a key embedding (dim,) matched by equality.
            default: returned when the key is not stored; without it, a miss raises.

        Returns:
            The value text, or the value embedding (CPU tensor) for a value given as an embedding.

        Raises:
            KeyNotFoundError: the key is not stored and no default was given.
        """
        q = None
        if isinstance(key, (Tensor, np.ndarray)):
            q, _ = self._as_query_tensor(key)
            if q.shape[0] != 1:
                raise InvalidArgumentError(f"expected one key embedding (dim,), got shape {tuple(q.shape)}")
        elif not isinstance(key, str):
            raise InvalidArgumentError(f"expected a key text or a key embedding, got {type(key).__name__}")
        with self._reading():
            id_ = self._store.id_of_key.get(key, -1) if q is None else int(self._exact_targets(q)[0])
            if id_ >= 0:
                return self._values_of([id_])[id_]
        if default is _MISSING:
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
            A list of :class:`Hit` for one query, a list of lists for a batch.

        Raises:
            EmptyDatabaseError, InvalidArgumentError, DimensionMismatchError, NonFiniteError.
        """
        self._check_open()
        k = _check_k(k, allow_all=False)
        if where is not None:
            check_where(where)
        q, texts, single = self._prepare_queries(queries)
        with self._reading():
            self._check_not_empty()
            cand = self.candidates(q, k, where=where)
            scores = compute_scores(q.to(self.device).unsqueeze(1), cand.keys, self.score).squeeze(1)  # (b, k)
            scores = scores.masked_fill(~cand.mask, -math.inf)
            order = torch.argsort(scores, dim=-1, descending=True, stable=True)  # (b, k)
            ids = cand.ids.gather(1, order).cpu()  # (b, k)
            scores = scores.gather(1, order).cpu()  # (b, k)
            values = self._values_of(ids[ids >= 0].tolist())
            hits = [
                [
                    Hit(id=i, key=self._store.key_of_id.get(i), value=values.get(i), score=s)
                    for i, s in zip(row_ids, row_scores)
                    if i >= 0
                ]
                for row_ids, row_scores in zip(ids.tolist(), scores.tolist())
            ]
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
                index picks candidates with the database's metric; this only rescores them.
            pooling: ``softmax``, ``normalize``, ``nonnegative``, ``hard``, ``exact`` or ``average``.
                ``exact`` is a database lookup: one-hot on the record whose key equals the query (text
                equality, or equal embedding), else "not found" (zero output, value None, found False).
            temperature: softmax temperature (softmax and hard), > 0.
            where: a metadata filter (as in :meth:`search`): only matching records are candidates.

        Returns:
            An :class:`Answer`, unbatched for one query.

        Raises:
            EmptyDatabaseError, InvalidArgumentError, UnknownOptionError, DimensionMismatchError,
            NonFiniteError.
        """
        self._check_open()
        k = _check_k(k, allow_all=True)
        _check_query_score(score)
        if pooling not in POOLINGS:
            raise UnknownOptionError(f"expected pooling among {POOLINGS}, got {pooling!r}")
        temperature = check_temperature(temperature)
        if where is not None:
            check_where(where)
        q, texts, single = self._prepare_queries(queries)
        out_device = q.device
        with self._reading():
            self._check_not_empty()
            targets = None
            if pooling == "exact":
                targets = self._exact_targets(q, texts)  # (b,)
            cand = self.candidates(q, k, targets=targets, where=where)
            score_fn = self.score if score is None else score
            if (
                k == "all"
                and pooling == "softmax"
                and isinstance(score_fn, str)
                and score_fn in STREAMING_SCORES
                and cand.mask is None
                and len(cand.keys) > 0
            ):  # every record: chunked, memory O(b x chunk) instead of O(b x m) for the autograd graph
                output, weights = self._attend_all_streaming(
                    q.to(self.device), cand.keys, cand.values, score_fn, float(temperature)
                )  # (b, value_dim), (b, m)
            else:
                if k == "all":  # dense over every record: scores, weights and their gradients, (b, m) each
                    check_fits(
                        q.shape[0] * len(cand.keys) * 16, f"attention of {q.shape[0]:,} queries over every record"
                    )
                output, weights = attend(
                    q.to(self.device),
                    cand.keys,
                    cand.values,
                    score=score_fn,
                    pooling=pooling,
                    mask=cand.mask,
                    match=cand.match,
                    temperature=float(temperature),
                )  # (b, value_dim), (b, k)
            ids = cand.ids if cand.ids.dim() == 2 else cand.ids.unsqueeze(0).expand(weights.shape[0], -1)  # (b, t)
            if k != "all" and weights.shape[1] < k:  # fewer records than k: pad as "no candidate"
                weights = F.pad(weights, (0, k - weights.shape[1]))  # (b, k) zeros
                ids = F.pad(ids, (0, k - ids.shape[1]), value=-1)  # (b, k)
            found = weights.detach().sum(-1) > 0  # (b,)
            best = ids.gather(1, weights.detach().argmax(-1, keepdim=True)).squeeze(1)  # (b,)
            best = torch.where(found, best.to(found.device), -1).cpu()
            values = self._values_of(best[best >= 0].tolist())
            keys = LazyKeys(ids.cpu(), self._store.key_of_id)  # texts looked up on access, not per row here
        answer = Answer(
            output=output.to(out_device),
            weights=weights.to(out_device),
            ids=ids.to(out_device),
            keys=keys,
            value=[values.get(i) if i >= 0 else None for i in best.tolist()],
            found=found.cpu().tolist(),
        )
        if single:
            answer = Answer(
                output=answer.output[0],
                weights=answer.weights[0],
                ids=answer.ids[0],
                keys=answer.keys[0],
                value=answer.value[0],
                found=answer.found[0],
            )
        return answer

    def _attend_all_streaming(
        self, q: Tensor, keys: Tensor, values: Tensor, score: str, temperature: float
    ) -> tuple[Tensor, Tensor]:
        """Softmax attention over every record with :func:`~kvsearch.streaming.streaming_attention`.

        Args:
            q: (b, dim). keys: (m, dim). values: (m, value_dim). score: one of ``STREAMING_SCORES``.

        Returns:
            output (b, value_dim), differentiable, whose autograd graph holds O(b x chunk) memory;
            weights (b, m), detached — the answer's own size, filled a chunk at a time.
        """
        output, lse, _ = streaming_attention(
            q, keys, values, score=score, temperature=temperature, return_stats=True
        )  # (b, value_dim), (b,)
        weights = torch.empty(q.shape[0], keys.shape[0], dtype=output.dtype, device=q.device)  # (b, m)
        step = max(1024, (1 << 22) // q.shape[0])
        with torch.no_grad():
            for start in range(0, keys.shape[0], step):
                scores = compute_scores(q.detach(), keys[start : start + step], score) / temperature  # (b, c)
                weights[:, start : start + step] = torch.exp(scores - lse.unsqueeze(1))  # (b, c)
        return output, weights

    def candidates(
        self,
        queries: Tensor,
        k: int | Literal["all"],
        *,
        targets: Tensor | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> Candidates:
        """The candidates for a batch of query embeddings, gathered by id from the store.

        This is the seam :class:`~kvsearch.KVAttention` and the trainer use: FAISS picks ids without
        gradient; keys and values are gathered from the store (the differentiable path is recomputed
        from them).

        Args:
            queries: (batch, dim); detached for the index search.
            k: candidates per query, or ``"all"``.
            targets: (batch,) ids that must be among the candidates (-1 for none); the worst candidate
                makes room. ``match`` is then ``ids == targets``.
            where: a metadata filter (see :mod:`kvsearch.filters`): only matching records are candidates.

        Returns:
            :class:`Candidates` with ids (batch, t), keys (batch, t, dim), values (batch, t, value_dim),
            mask (batch, t), where t = min(k, records) (no more candidates than records are gathered); for
            ``k="all"`` ids (m,), keys (m, dim), values (m, value_dim), mask None.

        Raises:
            MemoryLimitError: the gathered candidates would not fit in memory (refused before any work).
        """
        k = _check_k(k, allow_all=True)
        if queries.dim() != 2 or queries.shape[1] != self.dim:
            raise DimensionMismatchError(f"expected queries (batch, {self.dim}), got {tuple(queries.shape)}")
        with self._reading():
            allowed = None if where is None else self._store.ids_where(where)  # (m,) sorted ids
            if allowed is not None and targets is not None:
                targets = torch.where(torch.isin(targets.cpu(), torch.from_numpy(allowed)), targets.cpu(), -1)
            if k == "all" and allowed is not None:
                rows = self._store.rows_of(torch.from_numpy(allowed)).to(self.device)  # (m,)
                ids = torch.from_numpy(allowed).to(self.device)  # (m,)
                match = None if targets is None else ids.unsqueeze(0) == targets.to(self.device).unsqueeze(1)
                keys, values = self._store.keys[rows], self._store.values[rows]  # (m, dim), (m, value_dim)
                return Candidates(ids=ids, keys=keys, values=values, mask=None, match=match)
            if k == "all":
                ids = self._store.ids.to(self.device)  # (m,)
                match = None if targets is None else ids.unsqueeze(0) == targets.to(self.device).unsqueeze(1)
                return Candidates(ids=ids, keys=self._store.keys, values=self._store.values, mask=None, match=match)
            # never gather more candidates than there are records (k may be far larger than the database)
            take = max(1, min(int(k), len(self._store) if allowed is None else len(allowed)))
            per_candidate = (self.dim + self.value_dim) * 4 * 3 + 24  # gathered, scored, their gradients; ids
            check_fits(
                queries.shape[0] * take * per_candidate, lambda: f"gathering {len(queries):,} x {take:,} candidates"
            )
            search = self._index_vectors(queries.detach())
            if allowed is None:
                _, found = self._index.search(search, take)
            else:
                found = self._filtered_search(search, take, allowed)
            ids = torch.from_numpy(found)  # (b, take)
            if targets is not None:
                targets = targets.cpu()
                missing = (targets >= 0) & ~(ids == targets.unsqueeze(1)).any(1)  # (b,)
                ids[missing, -1] = targets[missing]
            keys, values, mask = self._store.gather(ids)  # (b, take, dim), (b, take, value_dim), (b, take)
            ids = ids.to(self.device)
            match = None if targets is None else (ids == targets.to(self.device).unsqueeze(1)) & (ids >= 0)
            return Candidates(ids=ids, keys=keys, values=values, mask=mask, match=match)

    # ------------------------------------------------------------------ helpers

    def _filtered_search(self, search: np.ndarray, k: int, allowed: np.ndarray) -> np.ndarray:
        """Top-k ids among ``allowed`` only: min(k, len(allowed)) of them for every query.

        Few matches: an exact scan of the matching rows. Many: the index searches with a FAISS
        ``IDSelector`` admitting only them; a query that got fewer than min(k, matches) back (a graph index
        can, under a selective filter) is redone exactly over the matching rows.

        Args:
            search: (b, dim) index-space queries. k: candidates per query. allowed: (m,) sorted ids.

        Returns:
            ids (b, k) int64, best first, -1 padded.
        """
        b, want = search.shape[0], min(k, len(allowed))
        out = np.full((b, k), -1, dtype=np.int64)
        if want == 0:
            return out
        redo = np.ones(b, dtype=bool)
        if len(allowed) > max(8 * k, FILTER_SCAN_MAX):
            _, found = self._index.search(search, k, allowed=allowed)
            out[:] = found
            redo = (found >= 0).sum(1) < want  # (b,)
        if redo.any():
            rows = self._store.rows_of(torch.from_numpy(allowed))  # (m,)
            vectors = torch.from_numpy(self._index_vectors(self._store.keys[rows.to(self.device)]))  # (m, dim)
            q = torch.from_numpy(search[redo])  # (r, dim)
            if _metric(self.score) == "l2":
                scores = -torch.cdist(q, vectors).square()  # (r, m)
            else:
                scores = q @ vectors.T  # (r, m)
            top = torch.topk(scores, want, dim=1).indices  # (r, want)
            out[redo, :want] = allowed[top.numpy()]
        return out

    def _check_not_empty(self) -> None:
        if len(self._store) == 0:
            raise EmptyDatabaseError("expected a database with records to search, got an empty one")

    def _index_vectors(self, keys: Tensor) -> np.ndarray:
        """What the index holds for keys (or queries): normalised for cosine. (n, dim) float32 numpy."""
        keys = keys.detach().float()
        if self.score == "cosine":
            keys = F.normalize(keys, dim=-1, eps=1e-12)
        return keys.cpu().numpy()

    def _values_of(self, ids: Sequence[int]) -> dict[int, str | Tensor | None]:
        """id -> the value text, or the value embedding (CPU tensor) for a value stored as an embedding.

        A database without a value encoder holds no value text: its values are read from memory, not SQLite.
        """
        out: dict[int, str | Tensor | None] = (
            dict.fromkeys(ids) if self.value_encoder is None else self._store.value_texts(ids)
        )
        need_emb = [i for i, text in out.items() if text is None]
        if need_emb:
            rows = self._store.rows_of(torch.tensor(need_emb))  # (r,) -1 for an id no longer stored
            values = self._store.values[rows.clamp(min=0).to(self.device)].cpu()  # (r, value_dim)
            for i, row, present in zip(need_emb, values, (rows >= 0).tolist()):
                out[i] = row if present else None
        return out

    def _exact_targets(self, q: Tensor, texts: list[str] | None = None) -> Tensor:
        """For each query, the id of the record whose key equals it (text equality, else equal embedding)."""
        if texts is not None:
            return torch.tensor([self._store.id_of_key.get(t, -1) for t in texts], dtype=torch.long)
        keys = self._store.keys  # (m, dim)
        q = q.detach().to(self.device)
        targets = torch.full((q.shape[0],), -1, dtype=torch.long)
        for start in range(0, len(keys), 65536):
            chunk = keys[start : start + 65536]  # (c, dim)
            eq = (chunk.unsqueeze(0) == q.unsqueeze(1)).all(-1)  # (b, c)
            hit = eq.any(-1).cpu() & (targets < 0)  # (b,)
            first = eq.float().argmax(-1).cpu() + start  # (b,)
            targets = torch.where(hit, self._store.ids[first.clamp(max=len(self._store.ids) - 1)], targets)
        return targets

    def _prepare_queries(self, queries: Queries) -> tuple[Tensor, list[str] | None, bool]:
        """Queries as (batch, dim) on their own device (text: the encoder's), texts, and whether single."""
        if isinstance(queries, str) or (isinstance(queries, Sequence) and not isinstance(queries, str)):
            texts = [queries] if isinstance(queries, str) else list(queries)
            if not texts:
                raise InvalidArgumentError("expected at least one query, got an empty list")
            _check_batch(len(texts), "queries")
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise InvalidArgumentError(f"expected query texts, got {type(t).__name__} at position {i}")
                if not t.strip():
                    raise InvalidArgumentError(f"expected non-empty query texts, got {t!r} at position {i}")
            with self._store.lock:  # encode with the encoders another process may have fine-tuned since
                self._check_open()
                self._sync()
            encoder = self.encoder if self._query_encoder is None else self._query_encoder
            if encoder is None:
                raise InvalidArgumentError("expected query embeddings: this database has no encoder for text")
            q = encoder.encode(texts)  # (b, dim)
            _check_finite(q, "query embeddings")
            return q, texts, isinstance(queries, str)
        q, single = self._as_query_tensor(queries)
        return q, None, single

    def _as_query_tensor(self, queries: Tensor | np.ndarray) -> tuple[Tensor, bool]:
        if isinstance(queries, np.ndarray):
            queries = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        if not isinstance(queries, Tensor):
            raise InvalidArgumentError(
                f"expected a query text, a list of texts or a tensor, got {type(queries).__name__}"
            )
        if not queries.is_floating_point():
            queries = queries.float()
        single = queries.dim() == 1
        q = queries.unsqueeze(0) if single else queries  # (b, dim)
        if q.dim() != 2 or q.shape[1] != self.dim:
            raise DimensionMismatchError(
                f"expected queries of shape (dim={self.dim},) or (batch, {self.dim}), got {tuple(queries.shape)}"
            )
        if q.shape[0] == 0:
            raise InvalidArgumentError("expected at least one query, got an empty batch")
        _check_batch(q.shape[0], "queries")
        _check_finite(q, "queries")
        return q.float() if q.dtype != torch.float32 else q, single

    def _prepare_side(
        self, items: KeysIn, name: str, encoder: Encoder | None, dim: int
    ) -> tuple[list[str | None], Tensor | None]:
        """Validate keys or values: (texts or [None]*n, embeddings or None). Nothing is encoded yet."""
        if isinstance(items, str):
            items = [items]
        if isinstance(items, np.ndarray) and items.dtype.kind in "fiu":
            items = torch.from_numpy(np.ascontiguousarray(items, dtype=np.float32))
        if isinstance(items, Tensor):
            embs = items.detach().float()
            if embs.dim() == 1 and dim == 1:
                embs = embs.unsqueeze(1)  # (n,) -> (n, 1): scalar values such as regression targets
            if embs.dim() != 2 or embs.shape[1] != dim:
                raise DimensionMismatchError(f"expected {name} of shape (n, {dim}), got {tuple(items.shape)}")
            _check_finite(embs, name)
            return [None] * embs.shape[0], embs
        if not isinstance(items, Sequence):
            raise InvalidArgumentError(f"expected {name} as a list of str or a tensor, got {type(items).__name__}")
        texts = list(items)
        seen: dict[str, int] = {}
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise InvalidArgumentError(f"expected {name} as str, got {type(t).__name__} at position {i}")
            if name == "keys":
                if not t.strip():
                    raise EmptyKeyError(f"expected a non-empty key, got {t!r} at position {i}")
                if t in seen:
                    raise DuplicateKeyError(f"expected unique keys, got {t!r} at positions {seen[t]} and {i}")
                seen[t] = i
            if "\x00" in t:
                raise InvalidArgumentError(f"expected {name} without NUL characters, got one at position {i}")
        if texts and encoder is None:
            raise InvalidArgumentError(
                f"expected {name} as embeddings (n, {dim}): this database has no encoder for {name} text"
            )
        return texts, None

    def _encode(self, texts: list[str | None], embs: Tensor | None, encoder, dim: int, name: str) -> Tensor:
        if embs is None:
            embs = encoder.encode(texts).float()  # (n, dim)
            _check_finite(embs, f"{name} embeddings from the encoder")
        if embs.shape[1] != dim:
            raise DimensionMismatchError(f"expected {name} embeddings of dim {dim}, got {embs.shape[1]}")
        return embs


# ---------------------------------------------------------------------- checks


def _metric(score: str) -> Literal["ip", "l2"]:
    return "l2" if score == "gaussian" else "ip"


def _check_db_score(score: object) -> None:
    if score not in DB_SCORES:
        raise UnknownOptionError(f"expected a database score among {DB_SCORES}, got {score!r}")


def _check_query_score(score: object) -> None:
    if score is None or callable(score):
        return
    if score not in SCORES:
        raise UnknownOptionError(f"expected score among {SCORES} or a callable, got {score!r}")
    if score == "additive":
        raise InvalidArgumentError(
            "the additive score has learned weights: pass an AdditiveScore(dim, dim, hidden) module as score, "
            "or use KVAttention(db, score='additive')"
        )


def _check_k(k: object, *, allow_all: bool) -> int | Literal["all"]:
    if allow_all and k == "all":
        return "all"
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
        allowed = f"an integer in [1, {MAX_K}]" + (' or "all"' if allow_all else "")
        raise InvalidArgumentError(f"expected k as {allowed}, got {k!r}")
    return int(k)


#: Files a database folder may hold; a creation that fails removes those it made (and folders it made).
_CREATED_FILES = (
    STORE_FILE,
    STORE_FILE + "-wal",
    STORE_FILE + "-shm",
    STORE_FILE + "-journal",
    "write.lock",
    "encoder.json",
    "encoder.safetensors",
    "value_encoder.json",
    "value_encoder.safetensors",
)


def _remove_created(made: list[Path]) -> None:
    """Remove the files, then the (then empty) folders, that a failed creation made."""
    for path in reversed(made):
        try:
            if path.is_dir():
                path.rmdir()  # only if empty: never anything that was there before
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass


def _check_device(device: object) -> torch.device:
    """The torch device to use: the given one if it exists here, else CUDA when present, else the CPU.

    Raises:
        InvalidArgumentError: not a device name, or a device this machine does not have.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        got = f"{device!r} ({exc})"
        raise InvalidArgumentError(f"expected a torch device such as 'cpu' or 'cuda:0', got {got}") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise InvalidArgumentError(f"expected an available device, got {device!r}: no such CUDA device here")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"expected device 'cpu' or 'cuda[:n]', got {device!r}")
    return dev


def _check_path(path: object) -> None:
    """A database path: None, str or PathLike, without NUL (which the OS would cut or refuse)."""
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgumentError(f"expected a folder path (str or PathLike) or None, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or "\x00" in text or not text.strip():
        raise InvalidArgumentError(f"expected a non-empty folder path without NUL characters, got {text!r}")


def _check_batch(n: int, name: str) -> None:
    if n > MAX_BATCH:
        raise InvalidArgumentError(f"expected at most {MAX_BATCH:,} {name} per call (MAX_BATCH), got {n:,}")


def _value_encoder_kind(value_encoder: Encoder | None, encoder: Encoder | None) -> str | None:
    """How a configuration records the value encoder: None, ``"key"`` (the key encoder) or ``"own"``."""
    return None if value_encoder is None else ("key" if value_encoder is encoder else "own")


def _check_finite(t: Tensor, name: str) -> None:
    if not all_finite(t):
        raise NonFiniteError(f"expected finite {name}, got NaN or Inf")


def _check_metadata(metadata, n: int) -> list[dict[str, Any] | None]:
    if metadata is None:
        return [None] * n
    if isinstance(metadata, Mapping) and n == 1:
        metadata = [metadata]
    if not isinstance(metadata, Sequence) or len(metadata) != n:
        raise InvalidArgumentError(f"expected a list of {n} metadata dicts, got {type(metadata).__name__}")
    out: list[dict[str, Any] | None] = []
    for i, m in enumerate(metadata):
        if m is None:
            out.append(None)
            continue
        if not isinstance(m, Mapping) or not all(isinstance(key, str) for key in m):
            raise InvalidArgumentError(f"expected metadata as a dict with str keys, got {m!r} at position {i}")
        for key, value in m.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise NonFiniteError(f"expected finite numbers in metadata, got {key}={value} at position {i}")
        try:
            json.dumps(m, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"expected JSON-serialisable metadata at position {i}: {exc}") from None
        out.append(dict(m))
    return out
