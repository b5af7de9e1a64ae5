"""A database split into shards, served by one process or by several on torch.distributed.

    sdb = ShardedDatabase("indexes/people", num_shards=4, encoder=NgramEncoder())   # one process, every shard
    sdb.add(keys=[...], values=[...]); sdb.search("Li", k=3); sdb.query(["Li", "Smola"], k=8)

    # under torchrun, after torch.distributed.init_process_group("gloo" or "nccl"):
    sdb = ShardedDatabase("indexes/people")          # rank r opens the shards s with s % world_size == r
    answer = sdb.query(my_queries, k=32)             # collective: every rank calls, with its own queries

Each shard is an ordinary kvsearch database folder (:mod:`kvsearch.distributed.layout` has the layout, the ids and the key
routing), so it keeps the store, the write lock, crash safety and the index checks. With a process group every
public method is *collective*: every rank calls it, with its own arguments (an empty batch is fine).

A query (:meth:`ShardedDatabase.candidates`): the ranks agree on batch sizes and gather the detached queries
(padded: gloo refuses uneven gathers); each rank searches its own shards, with the filters applied there, and
keeps each query's top k by the score recomputed in torch; ``all_to_all_single`` sends every query's candidates
(ids, key and value embeddings) back to its rank, which merges the ``world x k`` of them by score (then id) and
pools locally — the gradient to a query never leaves its rank. Texts are fetched for the final candidates only.

Writes route each record to its owner shard (a key by its hash, a key given as an embedding round-robin, an id by
its high bits); each shard commits its part in one transaction of its own — a batch spanning shards is atomic per
shard, and retrying it with ``upsert`` is safe. Errors on one rank (bad input) are agreed on collectively and
raised on every rank, so nobody hangs; a dead or silent peer raises :class:`~kvsearch.errors.DistributedError`
within ``timeout`` seconds.

Fine-tuning (:func:`kvsearch.finetune` on a sharded database, every rank with its own pairs) loops with the ranks
(:attr:`ShardedDatabase.team`, :mod:`kvsearch.training.team`) in a :class:`~kvsearch.distributed.generations.ShardedDraft`, and
the kept encoders become every shard's generation at once (:meth:`ShardedDatabase.switch_generation`). Not
supported across shards yet (a typed :class:`~kvsearch.errors.NotSupportedError`): ``k="all"`` attention and
``train_values=True``.

This module knows nothing of a shard's internals: it uses each shard's public :class:`~kvsearch.Database` methods.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch import Tensor

from kvsearch import errors
from kvsearch.checks import check_device, check_finite, check_k, check_temperature
from kvsearch.database import Database
from kvsearch.distributed.collectives import DEFAULT_TIMEOUT, Comm
from kvsearch.distributed.generations import ShardedDraft, ShardTeam, one_generation
from kvsearch.distributed.layout import (
    ID_SHIFT,
    ShardLayout,
    is_sharded,
    shard_dir,
    shard_of_id,
    shard_of_key,
    shards_of_rank,
)
from kvsearch.encoders.base import Encoder
from kvsearch.errors import (
    InvalidArgumentError,
    KeyNotFoundError,
    NotSupportedError,
    UnknownOptionError,
)
from kvsearch.filters import check_where
from kvsearch.index.topk import merge_candidates
from kvsearch.inputs import KeysIn, Queries, check_metadata, delete_items, query_tensor, query_texts, record_side
from kvsearch.nn.attention import POOLINGS, Candidates, ScoreFn, attend, check_score, compute_scores
from kvsearch.results import Answer, Hit, make_answer, make_hits
from kvsearch.storage.store import Record
from kvsearch.training.team import Team

__all__ = ["ShardedDatabase"]

T = TypeVar("T")
_MISSING: Any = object()
#: Seconds a collective may wait for a peer before :class:`DistributedError` (torch's own default is 30 minutes).


class ShardedDatabase:
    """A database split into ``num_shards`` shards, served by this process alone or by the ranks of a process group.

    Args:
        path: the root folder (``shards.json`` and ``shard-0000/`` ...).
        num_shards: creates a new sharded database with this many shards (fixed for its life); None reopens.
        encoder, value_encoder, dim, value_dim, index, score, device, search_params: as for
            :class:`~kvsearch.Database` (every shard gets the same; on reopen they must match what is stored).
        group: the process group of the ranks serving it (default: the default group when torch.distributed is
            initialised, else this process alone).
        timeout: seconds a collective may wait for a peer before :class:`~kvsearch.errors.DistributedError`.

    Raises:
        InvalidArgumentError: the shard count is not a multiple of the world size, or a bad argument.
        ConfigMismatchError, CorruptDatabaseError: as for :class:`~kvsearch.Database`.
        DistributedError: a peer failed while opening.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        num_shards: int | None = None,
        encoder: Encoder | None = None,
        value_encoder: Encoder | None = None,
        dim: int | None = None,
        value_dim: int | None = None,
        index: str | None = None,
        score: str | None = None,
        device: str | torch.device | None = None,
        search_params: Mapping[str, float] | None = None,
        group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise InvalidArgumentError(f"expected timeout as a number of seconds > 0, got {timeout!r}")
        self.path = Path(path)
        self.device = check_device(device)
        self._comm = Comm(group, float(timeout))
        self.rank, self.world_size = self._comm.rank, self._comm.world
        self._closed = False
        options = {"dim": dim, "value_dim": value_dim, "index": index, "score": score, "device": self.device}
        self.shards: dict[int, Database] = self._agree(lambda: self._open(num_shards, encoder, value_encoder, options))
        layout = ShardLayout.read(self.path)
        self.num_shards, self.dim, self.value_dim = layout.num_shards, layout.dim, layout.value_dim
        self.score, self.index_spec = layout.score, layout.index
        if search_params:
            for shard in self.shards.values():
                shard.set_search_params(**search_params)

    def _open(self, num_shards, encoder, value_encoder, options) -> dict[int, Database]:
        """Create (rank 0 writes the layout, the others wait) or reopen, then open this rank's shards."""
        creating = num_shards is not None and not is_sharded(self.path)
        if num_shards is not None and is_sharded(self.path):
            existing = ShardLayout.read(self.path).num_shards
            if existing != num_shards:
                raise errors.ConfigMismatchError(
                    f"{self.path} was created with num_shards={existing}; got num_shards={num_shards}"
                )
        if not creating and not is_sharded(self.path):
            raise InvalidArgumentError(f"expected a sharded database at {self.path} (or num_shards to create one)")
        mine = shards_of_rank(num_shards if creating else ShardLayout.read(self.path).num_shards, *self._where())
        shards: dict[int, Database] = {}
        try:
            for s in mine:
                new = not (shard_dir(self.path, s) / "store.sqlite").exists()
                db = Database(
                    shard_dir(self.path, s),
                    encoder=encoder,
                    value_encoder=value_encoder,
                    **options,
                )
                if new:
                    db.store.start_ids_after(s << 40)
                shards[s] = db
                encoder, value_encoder = db.encoder, (db.value_encoder if db.value_encoder is not db.encoder else None)
            if creating and self.rank == 0:
                first = next(iter(shards.values()))
                layout = ShardLayout(num_shards, first.dim, first.value_dim, first.score, first.index_spec)
                replace(layout, generation=first.generation).write(self.path)
            if not creating:
                self._check_generations(ShardLayout.read(self.path), shards)
            query = next((db.query_encoder for db in shards.values() if db.query_encoder is not None), None)
            for db in shards.values():  # one query-side encoder object for every local shard
                if query is not None and db.query_encoder is not query:
                    db.query_encoder = query
        except BaseException:
            for db in shards.values():
                db.close()
            raise
        return shards

    def _where(self) -> tuple[int, int]:
        return self.rank, self.world_size

    # ------------------------------------------------------------------ agreement

    def _agree(self, local: Callable[[], T]) -> T:
        return self._comm.agree(local)

    def _check_not_empty(self) -> None:
        """Raise :class:`~kvsearch.EmptyDatabaseError` on every rank when no shard holds a record. Collective."""
        if self._comm.all_sum(sum(len(db) for db in self.shards.values())) == 0:
            raise errors.EmptyDatabaseError("expected a database with records to search, got an empty one")

    def _check_open(self) -> None:
        if self._closed:
            raise errors.DatabaseClosedError("this sharded database was closed; open the folder again to use it")

    # ------------------------------------------------------------------ small things

    def __len__(self) -> int:
        local = self._agree(lambda: sum(len(db) for db in self.shards.values()))
        return self._comm.all_sum(local)

    def __contains__(self, key: object) -> bool:
        """Whether a record has this key text or key embedding (equal embedding). Collective."""
        self._check_open()
        texts, q = self._agree(lambda: self._one_key(key))
        return bool(self._exact_ids(texts, q)[0] >= 0) if q.shape[0] else False

    def __enter__(self) -> ShardedDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ShardedDatabase({str(self.path)!r}, {self.num_shards} shards, rank {self.rank} of {self.world_size} "
            f"holding {sorted(self.shards)}, dim={self.dim}, index={self.index_spec!r}, score={self.score!r})"
        )

    @property
    def encoder(self) -> Encoder | None:
        """The key encoder (one object shared by this rank's shards), or None."""
        return next(iter(self.shards.values())).encoder

    @property
    def value_encoder(self) -> Encoder | None:
        """The value encoder (shared by this rank's shards), or None."""
        return next(iter(self.shards.values())).value_encoder

    @value_encoder.setter
    def value_encoder(self, encoder: Encoder | None) -> None:
        for db in self.shards.values():
            db.value_encoder = encoder

    @property
    def query_encoder(self) -> Encoder | None:
        """The query-side encoder (shared by this rank's shards), or None."""
        return next(iter(self.shards.values())).query_encoder

    @query_encoder.setter
    def query_encoder(self, encoder: Encoder | None) -> None:
        for db in self.shards.values():
            db.query_encoder = encoder

    @property
    def comm(self) -> Comm:
        """The collectives of this database's ranks (see :class:`~kvsearch.distributed.collectives.Comm`)."""
        return self._comm

    @property
    def team(self) -> Team:
        """The ranks serving this database, as a fine-tuning run loops with them (see :mod:`kvsearch.training.team`)."""
        return ShardTeam(self._comm)

    @property
    def generation(self) -> int:
        """The generation of encoders every shard is at (``shards.json``'s commit point)."""
        recorded = ShardLayout.read(self.path).generation
        return next(iter(self.shards.values())).generation if recorded is None else recorded

    def close(self) -> None:
        """Close this rank's shards (saving what changed). Not collective; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        for db in self.shards.values():
            db.close()

    def refresh(self) -> None:
        """Re-encode every key of every shard with the key encoder: a new generation on every shard. Collective.

        Raises:
            NonFiniteError: the encoder produced NaN or Inf on some shard (no shard changed generation).
        """
        self._check_open()
        self.switch_generation(lambda s, db: db.refresh())

    def switch_generation(self, step: Callable[[int, Database], Any]) -> int:
        """Move every shard to a new generation together (two phases). Collective.

        Phase one runs ``step`` on each of this rank's shards (each commits a generation in its own store
        transaction); if it fails on any rank, the shards that moved are rolled back and the error is raised on
        every rank. Phase two is the commit point: rank 0 records the new generation in ``shards.json``, then a
        barrier. A crash between the phases leaves shards one generation ahead of ``shards.json``; opening the
        database rolls them back.

        Args:
            step: ``step(shard, db)`` commits one shard's new generation (``Database.refresh``, or a draft's
                ``commit``).

        Returns:
            The new generation.
        """
        before = self.generation
        moved: list[Database] = []

        def phase_one() -> None:
            for s, db in self.shards.items():
                step(s, db)
                moved.append(db)

        try:
            self._agree(phase_one)
        except BaseException:
            for db in moved:
                db.rollback_encoders()
            raise
        after = {db.generation for db in self.shards.values()}
        new = self._agree(lambda: one_generation(self._comm.gather_objects(sorted(after)), before))
        if self.rank == 0:
            replace(ShardLayout.read(self.path), generation=new).write(self.path)
        self._comm.barrier()
        return new

    @staticmethod
    def _check_generations(layout: ShardLayout, shards: dict[int, Database]) -> None:
        """Roll back shards a crashed switch left one generation ahead of ``shards.json`` (with a warning)."""
        if layout.generation is None:
            return
        for s, db in shards.items():
            if db.generation == layout.generation + 1:
                warnings.warn(
                    f"shard {s} is at generation {db.generation}, shards.json at {layout.generation} (a switch "
                    "was interrupted): rolling the shard back",
                    RuntimeWarning,
                    stacklevel=3,
                )
                db.rollback_encoders()
            if db.generation != layout.generation:
                raise errors.InconsistentDatabaseError(
                    f"expected shard {s} at generation {layout.generation} (shards.json), got {db.generation}"
                )

    def begin_generation(self) -> ShardedDraft:
        """Start a fine-tuning run's draft generation on every shard (see :class:`ShardedDraft`). Collective."""
        self._check_open()
        return ShardedDraft(self, self._agree(lambda: {s: db.begin_generation() for s, db in self.shards.items()}))

    # ------------------------------------------------------------------ writing

    def add(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        key_embeddings: Tensor | None = None,
        value_embeddings: Tensor | None = None,
    ) -> list[int]:
        """Add records, each to its owner shard (see :meth:`kvsearch.Database.add`). Collective.

        Returns:
            The new global ids, in input order.

        Raises:
            As :meth:`kvsearch.Database.add`, on every rank; a batch spanning shards is atomic per shard.
        """
        return self._write(keys, values, metadata, key_embeddings, value_embeddings, upsert=False)

    def upsert(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        key_embeddings: Tensor | None = None,
        value_embeddings: Tensor | None = None,
    ) -> list[int]:
        """Add records, replacing those whose key text is stored (see :meth:`kvsearch.Database.upsert`). Collective.

        Raises:
            NotSupportedError: keys given as embeddings (no text): a key embedding does not name its shard, so an
                equal stored key could not be found; replace such a record by id (``delete(id)`` then ``add``).
        """
        return self._write(keys, values, metadata, key_embeddings, value_embeddings, upsert=True)

    def _write(self, keys, values, metadata, key_embeddings, value_embeddings, *, upsert: bool) -> list[int]:
        self._check_open()

        def prepare() -> list[tuple[int, Any, Any, Any, Any, Any]]:
            key_texts, key_embs = record_side(keys, "keys", self.encoder, self.dim, key_embeddings)
            value_texts, value_embs = record_side(
                values, "values", self.value_encoder, self.value_dim, value_embeddings
            )
            if upsert and key_texts and key_texts[0] is None:
                raise NotSupportedError(
                    "upsert of keys given as embeddings (no text) is not supported across shards: replace such a "
                    "record by id (delete(id) then add)"
                )
            if len(value_texts) != len(key_texts):
                raise errors.DimensionMismatchError(
                    f"expected one value per key ({len(key_texts)}), got {len(value_texts)} values"
                )
            meta = check_metadata(metadata, len(key_texts))
            records = []
            for i, key in enumerate(key_texts):
                owner = shard_of_key(key, self.num_shards) if key is not None else (self.rank + i) % self.num_shards
                records.append(
                    (
                        owner,
                        key,
                        None if key_embs is None else key_embs[i].cpu().clone(),  # a pickled view sends the batch
                        value_texts[i],
                        None if value_embs is None else value_embs[i].cpu().clone(),
                        meta[i],
                    )
                )
            return records

        batches = self._comm.gather_objects(self._agree(prepare))  # every rank's records

        def check_new() -> None:  # add: no key stored or given twice, checked on every owner before any write
            given: dict[str, int] = {}
            mine: dict[int, list[str]] = {s: [] for s in self.shards}  # the keys each local shard would take
            for source, records in enumerate(batches):
                for owner, key, *_ in records:
                    if key is None or owner not in self.shards:
                        continue
                    if key in given:
                        raise errors.DuplicateKeyError(
                            f"expected unique keys, got {key!r} from rank {given[key]} and rank {source}; "
                            "nothing was added"
                        )
                    given[key] = source
                    mine[owner].append(key)
            for s, keys in mine.items():  # one lookup per shard
                stored = [key for key, id_ in zip(keys, self.shards[s].ids_of_keys(keys).tolist()) if id_ >= 0]
                if stored:
                    raise errors.DuplicateKeyError(
                        f"expected new keys, got {stored[0]!r}, which is stored; nothing was added "
                        "(upsert replaces a stored key)"
                    )

        if not upsert:
            self._agree(check_new)

        def commit() -> dict[tuple[int, int], list[int]]:
            done: dict[tuple[int, int], list[int]] = {}
            for source, records in enumerate(batches):
                for s, db in self.shards.items():
                    rows = [i for i, r in enumerate(records) if r[0] == s]
                    if not rows:
                        continue
                    part = [records[i] for i in rows]
                    key_embs = None if part[0][2] is None else torch.stack([r[2] for r in part])  # (r, dim)
                    value_embs = None if part[0][4] is None else torch.stack([r[4] for r in part])  # (r, value_dim)
                    texts = part[0][1] is not None, part[0][3] is not None  # keys, values as texts
                    ks = [r[1] for r in part] if texts[0] else key_embs
                    vs = [r[3] for r in part] if texts[1] else value_embs
                    ids = (db.upsert if upsert else db.add)(
                        ks,
                        vs,
                        [r[5] for r in part],
                        key_embeddings=key_embs if texts[0] else None,  # texts that came with their embeddings
                        value_embeddings=value_embs if texts[1] else None,
                    )
                    done.update({(source, i): [id_] for i, id_ in zip(rows, ids)})
            return done

        results: dict[tuple[int, int], list[int]] = {}
        for part in self._comm.gather_objects(self._agree(commit)):
            results.update(part)
        return [results[(self.rank, i)][0] for i in range(len(batches[self.rank]))]

    def delete(
        self, key_or_keys: str | int | Sequence[str | int], *, missing: Literal["raise", "ignore"] = "raise"
    ) -> list[int]:
        """Delete records by key text or global id, on their owner shards (see :meth:`kvsearch.Database.delete`).

        Collective. With ``missing="raise"``, a key or id that is not stored raises
        :class:`~kvsearch.KeyNotFoundError` on every rank and nothing is deleted (checked on every shard first; the
        deletes themselves are atomic per shard); with ``missing="ignore"`` the stored ones are deleted.
        """
        self._check_open()

        def items_of() -> list[str | int]:
            if missing not in ("raise", "ignore"):
                raise UnknownOptionError(f"expected missing='raise' or 'ignore', got {missing!r}")
            return delete_items(key_or_keys)

        items = self._agree(items_of)
        requests = self._comm.gather_objects(items)

        def owner(item: str | int) -> int:
            return shard_of_key(item, self.num_shards) if isinstance(item, str) else shard_of_id(item)

        def check() -> None:  # every named record is stored before any shard deletes anything
            if missing == "ignore":
                return
            for wanted in requests:
                for item in wanted:
                    s = owner(item)
                    if s in self.shards and not _stored(self.shards[s], item):
                        what = "key" if isinstance(item, str) else "id"
                        raise KeyNotFoundError(f"expected a stored {what}, got {item!r}; nothing was deleted")

        self._agree(check)

        def run() -> dict[tuple[int, int], int]:
            done: dict[tuple[int, int], int] = {}
            for source, wanted in enumerate(requests):
                for s, db in self.shards.items():
                    rows = [i for i, item in enumerate(wanted) if owner(item) == s]
                    if missing == "ignore":
                        rows = [i for i in rows if _stored(db, wanted[i])]
                    if rows:
                        for i, id_ in zip(rows, db.delete([wanted[i] for i in rows])):
                            done[(source, i)] = id_
            return done

        results: dict[tuple[int, int], int] = {}
        for part in self._comm.gather_objects(self._agree(run)):
            results.update(part)
        return list(dict.fromkeys(results[(self.rank, i)] for i in range(len(items)) if (self.rank, i) in results))

    # ------------------------------------------------------------------ reading by id or key

    def get(self, id: int) -> Record:
        """The record with this global id (see :meth:`kvsearch.Database.get`). Collective: each rank its own id.

        Raises:
            KeyNotFoundError: no record has this id.
        """
        self._check_open()

        def check() -> int:
            if isinstance(id, bool) or not isinstance(id, (int, np.integer)):
                raise InvalidArgumentError(f"expected an int id, got {type(id).__name__}")
            return int(id)

        wanted = self._comm.gather_objects(self._agree(check))  # every rank's id

        def local() -> dict[int, Record]:
            found: dict[int, Record] = {}
            for i in set(wanted):
                s = shard_of_id(i) if i >= 0 else -1
                if s in self.shards:
                    try:
                        found[i] = self.shards[s].get(i)
                    except KeyNotFoundError:
                        pass
            return found

        mine = wanted[self.rank]
        for part in self._comm.gather_objects(self._agree(local)):
            if mine in part:
                return part[mine]
        raise KeyNotFoundError(f"expected a stored id, got {mine}")

    def lookup(self, key: str | Tensor, default: Any = _MISSING) -> str | Tensor | None:
        """Exact lookup of a key text or key embedding (see :meth:`kvsearch.Database.lookup`). Collective: each
        rank its own key.

        Raises:
            KeyNotFoundError: the key is not stored and no default was given.
        """
        self._check_open()
        texts, q = self._agree(lambda: self._one_key(key))
        id_ = int(self._exact_ids(texts, q)[0])
        _, values, _ = self._texts([id_] if id_ >= 0 else [])
        if id_ >= 0:
            return values[id_]
        if default is _MISSING:
            shown = key if isinstance(key, str) else "<embedding>"
            raise KeyNotFoundError(f"no record has the key {shown!r}")
        return default

    def _one_key(self, key: object) -> tuple[list[str] | None, Tensor]:
        """A single key as ([text], (1, dim) placeholder) or (None, (1, dim) embedding)."""
        if isinstance(key, str):
            return [key], torch.zeros(1, self.dim)
        if isinstance(key, (Tensor, np.ndarray)):
            q, _ = query_tensor(key, self.dim)
            if q.shape[0] != 1:
                raise InvalidArgumentError(f"expected one key embedding (dim,), got shape {tuple(q.shape)}")
            return None, q
        raise InvalidArgumentError(f"expected a key text or a key embedding, got {type(key).__name__}")

    def _exact_ids(self, texts: list[str] | None, q: Tensor) -> Tensor:
        """The global id of the record whose key equals each query — text equality for texts, else an equal
        embedding —, -1 where none. An embedding that several stored keys share (on one shard or on several) is
        ambiguous: -1, as in a single :class:`~kvsearch.Database`. Collective.

        Args:
            texts: this rank's query texts, or None to match the embeddings.
            q: (b, dim) this rank's query embeddings.

        Returns:
            (b,) int64 CPU ids.
        """
        asked = self._comm.gather_objects(texts if texts is not None else q.detach().to("cpu", torch.float32))

        def local() -> list[tuple[Tensor, Tensor]]:
            found = []
            for wanted in asked:
                ids = torch.full((len(wanted),), -1, dtype=torch.long)  # (n,) one matching id
                count = torch.zeros(len(wanted), dtype=torch.long)  # (n,) how many keys match
                for db in self.shards.values():
                    if not len(wanted):
                        break
                    if isinstance(wanted, list):  # only the owner shard can hold a key text
                        hit = db.ids_of_keys(wanted)
                        hits = (hit >= 0).long()
                    elif len(db):
                        hit, hits = db.retriever.key_matches(wanted)
                    else:
                        continue
                    ids, count = torch.where(hit >= 0, hit, ids), count + hits
                found.append((ids, count))
            return found

        mine = torch.full((len(asked[self.rank]),), -1, dtype=torch.long)  # (b,)
        count = torch.zeros(len(asked[self.rank]), dtype=torch.long)  # (b,)
        for part in self._comm.gather_objects(self._agree(local)):
            hit, hits = part[self.rank]
            mine, count = torch.where(hit >= 0, hit, mine), count + hits
        return torch.where(count == 1, mine, -1)

    def exact_targets(self, queries: Tensor) -> Tensor:
        """For each query embedding, the global id of the one record whose key embedding equals it, else -1 (see
        :meth:`kvsearch.Database.exact_targets`). Collective.

        Raises:
            DimensionMismatchError: queries are not (batch, dim).
        """
        self._check_open()

        def check() -> Tensor:
            if not isinstance(queries, Tensor) or queries.dim() != 2 or queries.shape[1] != self.dim:
                got = tuple(queries.shape) if isinstance(queries, Tensor) else type(queries).__name__
                raise errors.DimensionMismatchError(f"expected queries (batch, {self.dim}), got {got}")
            return queries

        return self._exact_ids(None, self._agree(check))

    def ids_of_keys(self, texts: Sequence[str]) -> Tensor:
        """The global id of each key text: (n,) int64 on the CPU, -1 where the key is not stored. Collective."""
        self._check_open()
        return self._exact_ids(self._agree(lambda: _texts_list(texts)), torch.zeros(len(texts), self.dim))

    def key_texts(self, ids: Tensor | Sequence[int], *, encoded_only: bool = False) -> list[str | None]:
        """The key text of each global id, in order: None where it has none or is not stored. Collective.

        ``encoded_only``: None also for key texts that came with their own embedding (see
        :meth:`kvsearch.Database.key_texts`).
        """
        wanted = [int(i) for i in torch.as_tensor(ids, dtype=torch.long).reshape(-1).tolist()]
        keys, _, _ = self._texts(wanted, encoded_only=encoded_only)
        return [keys.get(i) for i in wanted]

    def values_present(self, texts: Sequence[str]) -> Tensor:
        """(n,) bool: whether some record of some shard holds each value text. Collective."""
        self._check_open()
        asked = self._comm.gather_objects(self._agree(lambda: _texts_list(texts)))

        def local() -> list[Tensor]:
            return [
                torch.stack([db.values_present(wanted) for db in self.shards.values()]).any(0)
                if wanted
                else torch.zeros(0, dtype=torch.bool)
                for wanted in asked
            ]

        present = torch.zeros(len(asked[self.rank]), dtype=torch.bool)  # (n,)
        for part in self._comm.gather_objects(self._agree(local)):
            present |= part[self.rank]
        return present

    def embeddings(self, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings gathered by global id (any shape, -1 allowed), from their owners. Collective.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) — zeros where an id is -1 or not stored — and
            the mask (*ids.shape) of the stored ones, on :attr:`device`.
        """
        self._check_open()
        ids = torch.as_tensor(ids, dtype=torch.long).cpu()
        asked = self._comm.gather_objects(ids.reshape(-1))

        def local() -> list[tuple[Tensor, Tensor, Tensor]]:
            out = []
            for wanted in asked:  # (n,)
                keys, values = torch.zeros(len(wanted), self.dim), torch.zeros(len(wanted), self.value_dim)
                mask = torch.zeros(len(wanted), dtype=torch.bool)
                for s, db in self.shards.items():
                    own = (wanted >= 0) & ((wanted >> ID_SHIFT) == s)  # (n,)
                    if own.any():
                        k, v, m = db.embeddings(wanted[own])
                        keys[own], values[own], mask[own] = k.cpu().float(), v.cpu().float(), m.cpu()
                out.append((keys, values, mask))
            return out

        keys, values = torch.zeros(ids.numel(), self.dim), torch.zeros(ids.numel(), self.value_dim)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        for part in self._comm.gather_objects(self._agree(local)):
            k, v, m = part[self.rank]
            keys[m], values[m] = k[m], v[m]
            mask |= m
        device = self.device
        return (
            keys.reshape(*ids.shape, self.dim).to(device),
            values.reshape(*ids.shape, self.value_dim).to(device),
            mask.reshape(ids.shape).to(device),
        )

    # ------------------------------------------------------------------ search and query

    def candidates(
        self,
        queries: Tensor,
        k: int | Literal["all"],
        *,
        targets: Tensor | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> Candidates:
        """The global top-k candidates of this rank's queries, merged from every shard. Collective.

        Args:
            queries: (batch, dim), possibly (0, dim); detached for the search.
            k: candidates per query (``"all"`` is not supported across shards).
            targets: (batch,) global ids that must be among the candidates (-1 for none).
            where: a metadata filter, applied on the shards.

        Returns:
            :class:`~kvsearch.nn.attention.Candidates`: ids (batch, t), keys (batch, t, dim), values
            (batch, t, value_dim), mask, match — t = min(k, records), best first by the database's score
            recomputed in torch, ties by id.

        Raises:
            NotSupportedError: ``k="all"``.
            InvalidArgumentError, DimensionMismatchError: bad arguments (on every rank).
        """
        return self.candidates_from(self.shards, queries, k, targets=targets, where=where)

    def candidates_from(
        self,
        sources: Mapping[int, Any],
        queries: Tensor,
        k: int | Literal["all"],
        *,
        targets: Tensor | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> Candidates:
        """:meth:`candidates`, each shard's part picked by ``sources[shard].candidates`` — the shard, or a draft
        generation of it (:class:`~kvsearch.distributed.generations.ShardedDraft`). Collective."""
        self._check_open()

        def check() -> int:
            if k == "all":
                raise NotSupportedError('k="all" (attention over every record) is not supported across shards yet')
            kk = check_k(k)
            if queries.dim() != 2 or queries.shape[1] != self.dim:
                raise errors.DimensionMismatchError(f"expected queries (batch, {self.dim}), got {tuple(queries.shape)}")
            if where is not None:
                check_where(where)
            return int(kk)

        k = self._agree(check)
        total = self._comm.all_sum(sum(len(db) for db in self.shards.values()))
        take = max(1, min(k, total))
        q = queries.detach().to("cpu", torch.float32)  # (b, dim)
        t = torch.full((q.shape[0],), -1, dtype=torch.long) if targets is None else targets.detach().cpu().long()
        all_q, counts = self._comm.gather_rows(q)  # (B, dim)
        all_t, _ = self._comm.gather_rows(t)  # (B,)
        filters = self._comm.gather_objects(None if where is None else dict(where))
        ids, keys, values = self._agree(lambda: self._local_top(sources, all_q, all_t, counts, filters, take))
        mine = counts[self.rank]
        send = counts  # the rows of each source rank go back to it
        recv = [mine] * self.world_size
        got_ids = self._comm.exchange(ids, send, recv).reshape(self.world_size, mine, take)  # (W, b, take)
        got_keys = self._comm.exchange(keys, send, recv).reshape(self.world_size, mine, take, self.dim)
        got_values = self._comm.exchange(values, send, recv).reshape(self.world_size, mine, take, self.value_dim)
        width = self.world_size * take
        ids = got_ids.permute(1, 0, 2).reshape(mine, width)  # (b, W take)
        keys = got_keys.permute(1, 0, 2, 3).reshape(mine, width, self.dim)  # (b, W take, dim)
        values = got_values.permute(1, 0, 2, 3).reshape(mine, width, self.value_dim)  # (b, W take, value_dim)
        ids, keys, values = merge_candidates(q, ids, keys, values, t, take, self.score)  # (b, take) ...
        mask = ids >= 0  # (b, take)
        match = None if targets is None else (ids == t.unsqueeze(1)) & mask  # (b, take)
        device = self.device
        return Candidates(
            ids=ids.to(device), keys=keys.to(device), values=values.to(device), mask=mask.to(device),
            match=None if match is None else match.to(device),
        )  # fmt: skip

    def _local_top(
        self,
        sources: Mapping[int, Any],
        queries: Tensor,
        targets: Tensor,
        counts: list[int],
        filters: list[Any],
        take: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's best ``take`` candidates for every gathered query: ids (B, take), keys, values (on the CPU)."""
        parts: list[tuple[Tensor, Tensor, Tensor]] = []
        start = 0
        for source, n in enumerate(counts):
            q, t = queries[start : start + n], targets[start : start + n]  # (n, dim), (n,)
            start += n
            found = []
            for s, db in self.shards.items():
                if n == 0 or len(db) == 0:
                    continue
                own = torch.where((t >= 0) & ((t >> ID_SHIFT) == s), t, -1)  # (n,) targets on shard s
                cand = sources[s].candidates(q, take, targets=own, where=filters[source])
                found.append((cand.ids.cpu(), cand.keys.cpu(), cand.values.cpu()))
            if found:
                ids = torch.cat([f[0] for f in found], 1)
                keys = torch.cat([f[1] for f in found], 1)
                values = torch.cat([f[2] for f in found], 1)
            else:
                ids = torch.full((n, 0), -1, dtype=torch.long)
                keys, values = torch.zeros(n, 0, self.dim), torch.zeros(n, 0, self.value_dim)
            parts.append(merge_candidates(q, ids, keys, values, t, take, self.score))
        return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]

    def _texts(
        self, ids: Sequence[int], *, encoded_only: bool = False
    ) -> tuple[dict[int, str | None], dict[int, Any], dict[int, str]]:
        """Key texts, values (text, or a CPU tensor) and metadata (JSON) of global ids, from their owners.

        Collective.
        """
        wanted = self._comm.gather_objects(sorted({int(i) for i in ids if i >= 0}))

        def local() -> tuple[dict[int, str | None], dict[int, Any], dict[int, str]]:
            keys: dict[int, str | None] = {}
            values: dict[int, Any] = {}
            metadata: dict[int, str] = {}
            everything = sorted({i for w in wanted for i in w})
            for s, db in self.shards.items():
                own = [i for i in everything if shard_of_id(i) == s]
                if own:
                    keys.update(zip(own, db.key_texts(own, encoded_only=encoded_only)))
                    values.update(db.values_of(own))  # text, or the embedding for a value given as one
                    metadata.update((i, json.dumps(m)) for i, m in db.metadata_of(own).items() if m)
            return keys, values, metadata

        keys: dict[int, str | None] = {}
        values: dict[int, Any] = {}
        metadata: dict[int, str] = {}
        for part_keys, part_values, part_metadata in self._comm.gather_objects(self._agree(local)):
            keys.update(part_keys)
            values.update(part_values)
            metadata.update(part_metadata)
        return keys, values, metadata

    def value_texts(self, ids: Sequence[int]) -> dict[int, str | None]:
        """id -> the value text (None for a value given as an embedding), read from each id's owner. Collective."""
        _, values, _ = self._texts(list(ids))
        return {i: v if isinstance(v, str) else None for i, v in values.items()}

    def _queries(self, queries: Queries) -> tuple[Tensor, list[str] | None, bool]:
        """This rank's queries as (batch, dim) — possibly (0, dim) —, their texts, and whether one came unbatched."""
        if isinstance(queries, (list, tuple)) and len(queries) == 0:
            return torch.zeros(0, self.dim), [], False
        if isinstance(queries, Tensor) and queries.dim() == 2 and queries.shape[0] == 0:
            return queries.float(), None, False
        texts = query_texts(queries)
        if texts is None:
            q, single = query_tensor(queries, self.dim)
            return q, None, single
        encoder = self.query_encoder or self.encoder
        if encoder is None:
            raise errors.MissingEncoderError(
                f"this database has no encoder for query texts; pass query embeddings (batch, {self.dim}) or set "
                "db.query_encoder"
            )
        q = encoder.encode(texts)  # (b, dim)
        check_finite(q, "query embeddings")
        return q, texts, isinstance(queries, str)

    def search(
        self, queries: Queries, k: int = 10, *, where: Mapping[str, Any] | None = None
    ) -> list[Hit] | list[list[Hit]]:
        """The k nearest records to each of this rank's queries, over every shard (see :meth:`Database.search`).

        Collective; a rank with no queries passes an empty list (or a (0, dim) tensor). An empty database gives
        empty lists.
        """
        self._check_open()
        q, _, single = self._agree(lambda: self._queries(queries))
        if len(self) == 0:
            return [] if single else [[] for _ in range(q.shape[0])]
        cand = self.candidates(q, k, where=where)
        scores = compute_scores(q.to(self.device).unsqueeze(1), cand.keys, self.score).squeeze(1)  # (b, t)
        scores = scores.masked_fill(~cand.mask, -math.inf).cpu()  # (b, t): already ranked
        keys, values, metadata = self._texts(cand.ids[cand.ids >= 0].tolist())
        hits = make_hits(cand.ids.cpu(), scores, keys, values, metadata)
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
        """Attention over each query's global top-k (see :meth:`kvsearch.Database.query`). Collective.

        The candidates come back to the query's rank, which scores and pools them: a query tensor that requires
        grad gets its gradient there. ``k="all"`` is not supported across shards yet.
        """
        self._check_open()

        def check() -> tuple[Tensor, list[str] | None, bool, float]:
            if score is not None:
                check_score(score)
            if pooling not in POOLINGS:
                raise UnknownOptionError(f"expected pooling among {POOLINGS}, got {pooling!r}")
            return (*self._queries(queries), check_temperature(temperature))

        q, texts, single, temp = self._agree(check)
        self._check_not_empty()
        targets = None
        if pooling == "exact":  # text equality for text queries, else equal embeddings
            targets = self._exact_ids(texts, q)
        cand = self.candidates(q, k, targets=targets, where=where)
        out_device = q.device
        output, weights = attend(
            q.to(self.device), cand.keys, cand.values, score=self.score if score is None else score,
            pooling=pooling, mask=cand.mask, match=cand.match, temperature=temp,
        )  # (b, value_dim), (b, t)  # fmt: skip
        keys, values, metadata = self._texts(cand.ids[cand.ids >= 0].tolist())
        answer = make_answer(
            output, weights, cand.ids, k=int(k), key_of_id=keys, values_of=lambda ids: values, device=out_device,
            metadata_of=lambda ids: metadata,
        )  # fmt: skip
        return answer.row(0) if single else answer


def _stored(db: Database, item: str | int) -> bool:
    """Whether a shard holds this key text or id."""
    if isinstance(item, str):
        return item in db
    try:
        db.get(int(item))
    except KeyNotFoundError:
        return False
    return True


def _texts_list(texts: Sequence[str]) -> list[str]:
    """A sequence of key or value texts, checked."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise InvalidArgumentError(f"expected a list of texts, got {type(texts).__name__}")
    return list(texts)
