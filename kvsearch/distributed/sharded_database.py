"""A database split into shards, served by one process or by several on torch.distributed.

    sdb = ShardedDatabase("indexes/people", num_shards=4, encoder=NgramEncoder())   # one process, every shard
    sdb.add(keys=[...], values=[...]); sdb.search("Li", k=3); sdb.query(["Li", "Smola"], k=8)

    # under torchrun, after torch.distributed.init_process_group("gloo" or "nccl"):
    sdb = ShardedDatabase("indexes/people")          # rank r opens the shards s with s % world_size == r
    answer = sdb.query(my_queries, k=32)             # collective: every rank calls, with its own queries

Each shard is an ordinary kvsearch database folder (:mod:`kvsearch.distributed.layout` has the layout, the ids and
the key routing), so it keeps the store, the write lock, crash safety and the index checks. With a process group every
public method is *collective*: every rank calls it, with its own arguments (an empty batch is fine).

A query (:meth:`ShardedDatabase.candidates`): the ranks agree on batch sizes and gather the detached queries
(padded: gloo refuses uneven gathers); each rank searches its own shards, with the filters applied there, and
keeps each query's top k by the score recomputed in torch; ``all_to_all_single`` sends every query's candidates
(ids, key and value embeddings) back to its rank, which merges the ``world x k`` of them by score (then id) and
pools locally — the gradient to a query never leaves its rank. Texts are fetched for the final candidates only.

Writes route each record to its owner shard (a key by its hash, a key given as an embedding round-robin, an id by
its high bits; :mod:`kvsearch.distributed.writes`); each shard commits its part in one transaction of its own — a
batch spanning shards is atomic per shard, and retrying it with ``upsert`` is safe. Reads by id or exact key go to
the owner shards (:mod:`kvsearch.distributed.reads`). Errors on one rank (bad input) are agreed on collectively and
raised on every rank, so nobody hangs; a dead or silent peer raises :class:`~kvsearch.errors.DistributedError`
within ``timeout`` seconds.

Fine-tuning (:func:`kvsearch.finetune` on a sharded database, every rank with its own pairs) loops with the ranks
(:attr:`ShardedDatabase.team`, :mod:`kvsearch.training.team`) in a
:class:`~kvsearch.distributed.generations.ShardedDraft`, and the kept encoders become every shard's generation at
once (:meth:`ShardedDatabase.switch_generation`). Not supported across shards yet (a typed
:class:`~kvsearch.errors.NotSupportedError`): ``k="all"`` attention and ``train_values=True``.

Selections by filter (:meth:`ShardedDatabase.where`: count, ids, records, distinct, min / max, fields, delete,
update) run collectively too, each rank answering for its own shards (:mod:`kvsearch.distributed.selection`).

This module owns the facade (opening, agreement, the generation switch, search and query) and delegates the
candidates merge to :func:`~kvsearch.distributed.search.sharded_candidates`, writes and reads by id to
:class:`~kvsearch.distributed.writes.ShardWrites` and :class:`~kvsearch.distributed.reads.ShardReads`, and
selections to :class:`~kvsearch.distributed.selection.ShardedSelection`; each is handed this rank's
:class:`~kvsearch.distributed.local.LocalShards`, never the facade (references point down). It knows nothing of a
shard's internals (each shard's public :class:`~kvsearch.Database` methods only) nor of the training loop that uses
its :attr:`~ShardedDatabase.team`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from torch import Tensor

from kvsearch import errors
from kvsearch.checks import (
    check_dense,
    check_device,
    check_finite,
    check_k,
    check_path,
    check_temperature,
    query_tensor,
)
from kvsearch.database import Database
from kvsearch.distributed.collectives import DEFAULT_TIMEOUT, Comm, collective
from kvsearch.distributed.generations import ShardedDraft, ShardTeam, switch_every_shard
from kvsearch.distributed.layout import ShardLayout
from kvsearch.distributed.local import LocalShards
from kvsearch.distributed.opening import check_num_shards, open_shards
from kvsearch.distributed.reads import ShardReads, texts_list
from kvsearch.distributed.search import sharded_candidates
from kvsearch.distributed.selection import ShardedSelection, same_on_every_rank
from kvsearch.distributed.threads import share_cores
from kvsearch.distributed.writes import ShardWrites
from kvsearch.errors import (
    InvalidArgumentError,
    KeyNotFoundError,
    NotPicklableError,
    UnknownOptionError,
)
from kvsearch.inputs import KeysIn, Queries, id_tensor, query_batch, query_texts
from kvsearch.nn.attend import Candidates, attend
from kvsearch.nn.pooling import POOLINGS
from kvsearch.nn.scores import ScoreFn, check_score, compute_scores
from kvsearch.reads import MISSING
from kvsearch.results import Answer, Hit, make_answer, make_hits
from kvsearch.selection import selection_filter
from kvsearch.text.rerank import Rerank, Similarity, check_rerank, require_texts, rerank_depth, rerank_hits
from kvsearch.view import same_object

if TYPE_CHECKING:
    from kvsearch.encoders.base import Encoder
    from kvsearch.storage.store import Record

__all__ = ["ShardedDatabase"]

T = TypeVar("T")


class ShardedDatabase:
    """A database split into ``num_shards`` shards, served by this process alone or by the ranks of a process group.

    A resource like :class:`~kvsearch.Database`: ``copy.copy`` / ``copy.deepcopy`` return it itself, so copies of a
    model share it; it is bound to its ranks' process group, so pickling it raises
    :class:`~kvsearch.errors.NotPicklableError` (reopen it on the loading side and pass it to the rebuilt model).

    Args:
        path: the root folder (``shards.json`` and ``shard-0000/`` ...).
        num_shards: creates a new sharded database with this many shards (fixed for its life); None reopens.
        encoder, value_encoder, dim, value_dim, index, score, device, search_params: as for
            :class:`~kvsearch.Database` (every shard gets the same; on reopen they must match what is stored).
        group: the process group of the ranks serving it (default: the default group when torch.distributed is
            initialised, else this process alone).
        timeout: seconds a collective may wait for a peer before :class:`~kvsearch.errors.DistributedError`.

    Raises:
        InvalidArgumentError: the shard count is not in [1, :data:`~kvsearch.distributed.layout.MAX_SHARDS`] or not
            a multiple of the world size, or a bad argument.
        WrongKindError: the folder holds a plain database (open it with :class:`~kvsearch.Database`, or reshard
            it), or a new sharded database would lie inside another database. ForeignFolderError: a new one in a
            folder of someone else's files.
        FileLimitError: this rank's shards would not fit in the process's open-file limit (checked up front).
        ConfigMismatchError, CorruptDatabaseError, MissingFileError: as for :class:`~kvsearch.Database`; a shard
            folder of an existing database is missing.
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
        check_path(path, optional=False)
        self.path = Path(path)
        self.device = check_device(device)
        self._comm = Comm(group, float(timeout))
        share_cores(self._comm.local_world)  # ranks started without torchrun: no oversubscribed cores
        self.rank, self.world_size = self._comm.rank, self._comm.world
        self._closed = False
        options = {"dim": dim, "value_dim": value_dim, "index": index, "score": score, "device": self.device}
        self.shards: dict[int, Database] = self._agree(
            lambda: open_shards(
                self.path, check_num_shards(num_shards), encoder, value_encoder, options, self.rank, self.world_size
            )
        )
        layout = ShardLayout.read(self.path)
        self.num_shards, self.dim, self.value_dim = layout.num_shards, layout.dim, layout.value_dim
        self.score, self.index_spec = layout.score, layout.index
        self.banded_ids = layout.banded_ids  # False after a reshard: ids carried over (see reads.owner_shards)
        # what the helpers hold instead of this facade (references point down): this rank's shards, the layout, the
        # collectives
        self._local = local = LocalShards(
            self.path, self._comm, self.shards, self.num_shards, self.dim, self.value_dim, self.score,
            self.banded_ids, self.device,
        )  # fmt: skip
        self._reads, self._writes = ShardReads(local), ShardWrites(local)
        if search_params:
            for shard in self.shards.values():
                shard.set_search_params(**search_params)

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

    @collective()
    def __len__(self) -> int:
        local = self._agree(lambda: sum(len(db) for db in self.shards.values()))
        return self._comm.all_sum(local)

    @collective()
    def __contains__(self, key: object) -> bool:
        """Whether a record has this key text or key embedding (equal embedding). Collective."""
        self._check_open()
        texts, q = self._agree(lambda: self._reads.one_key(key))
        return bool(self._reads.exact_ids(texts, q)[0] >= 0) if q.shape[0] else False

    def __enter__(self) -> ShardedDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ShardedDatabase({str(self.path)!r}, {self.num_shards} shards, rank {self.rank} of {self.world_size} "
            f"holding {sorted(self.shards)}, dim={self.dim}, index={self.index_spec!r}, score={self.score!r})"
        )

    __copy__ = __deepcopy__ = same_object  # a resource: model copies share it (deepcopy, AveragedModel)

    def __reduce__(self) -> tuple[Any, ...]:
        """Refused: a sharded database is bound to its process group.

        Raises:
            NotPicklableError: always; the message says to reopen it on the loading side.
        """
        raise NotPicklableError(
            f"a ShardedDatabase cannot be pickled: it is bound to its ranks' process group. Save the model's "
            f"state_dict() instead (it never holds the database), and on the loading side reopen "
            f"ShardedDatabase({str(self.path)!r}) on its ranks and pass it to the rebuilt model"
        )

    @property
    def encoder(self) -> Encoder | None:
        """The key encoder (one object shared by this rank's shards), or None."""
        return self._local.encoder

    @property
    def value_encoder(self) -> Encoder | None:
        """The value encoder (shared by this rank's shards), or None."""
        return self._local.value_encoder

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
    def team(self) -> ShardTeam:
        """The ranks serving this database, as a fine-tuning run loops with them: a ``kvsearch.training.team.Team``
        (the training wing's protocol, which this wing does not import)."""
        return ShardTeam(self._comm)

    @property
    def generation(self) -> int:
        """The generation of encoders every shard is at (``shards.json``'s commit point)."""
        return self._local.generation()

    def close(self) -> None:
        """Close this rank's shards (saving what changed). Not collective; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        for db in self.shards.values():
            db.close()

    @collective()
    def refresh(self) -> None:
        """Re-encode every key of every shard with the key encoder: a new generation on every shard. Collective.

        Raises:
            NonFiniteError: the encoder produced NaN or Inf on some shard (no shard changed generation).
        """
        self._check_open()
        self.switch_generation(lambda s, db: db.refresh())

    @collective()
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
        return switch_every_shard(self._local, step)

    @collective()
    def begin_generation(self) -> ShardedDraft:
        """Start a fine-tuning run's draft generation on every shard (see :class:`ShardedDraft`). Collective."""
        self._check_open()
        return ShardedDraft(
            self._local, self._agree(lambda: {s: db.begin_generation() for s, db in self.shards.items()})
        )

    # ------------------------------------------------------------------ writing

    @collective()
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
        self._check_open()
        return self._writes.write(keys, values, metadata, key_embeddings, value_embeddings, upsert=False)

    @collective()
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
        self._check_open()
        return self._writes.write(keys, values, metadata, key_embeddings, value_embeddings, upsert=True)

    @collective()
    def delete(
        self, key_or_keys: str | int | Sequence[str | int], *, missing: Literal["raise", "ignore"] = "raise"
    ) -> list[int]:
        """Delete records by key text or global id, on their owner shards (see :meth:`kvsearch.Database.delete`).

        Collective. With ``missing="raise"``, a key or id that is not stored raises
        :class:`~kvsearch.KeyNotFoundError` on every rank and nothing is deleted (checked on every shard first; the
        deletes themselves are atomic per shard); with ``missing="ignore"`` the stored ones are deleted.
        """
        self._check_open()

        return self._writes.delete(key_or_keys, missing)

    # ------------------------------------------------------------------ reading by filter

    @collective()
    def where(self, filter: Mapping[str, Any] | None = None, *, ids: Any = None) -> ShardedSelection:  # noqa: A002
        """The records a filter selects over every shard, to count, read, aggregate, delete or update without a
        query (see :meth:`kvsearch.Database.where`). Collective, as is every operation of the selection: every rank
        passes the same filter and ids, and gets the same answers.

        ``sdb.where({"lang": "en"}).count()``, ``.ids()``, ``.records(limit=, offset=)`` (id order),
        ``.distinct(field)``, ``.min_max(field)``, ``.fields()``, ``.delete()``, ``.update(metadata, merge=True)``: see
        :class:`~kvsearch.distributed.selection.ShardedSelection`.

        Args:
            filter: a filter (:mod:`kvsearch.metadata.filters`); None selects every record.
            ids: only these global ids as well (None: no such limit).

        Returns:
            The selection.

        Raises:
            InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter or ids (on every rank).
            DistributedError: the ranks passed different filters or ids.
        """
        self._check_open()
        chosen = self._agree(lambda: selection_filter(filter, ids))
        same_on_every_rank(self._comm, chosen, "where", "filter and ids")
        return ShardedSelection(self._local, chosen)

    # ------------------------------------------------------------------ reading by id or key

    @collective()
    def get(self, id: int) -> Record:
        """The record with this global id (see :meth:`kvsearch.Database.get`). Collective: each rank its own id.

        Raises:
            KeyNotFoundError: no record has this id.
        """
        self._check_open()
        return self._reads.get(id)

    @collective()
    def lookup(self, key: str | Tensor, default: Any = MISSING) -> str | Tensor | None:
        """Exact lookup of a key text or key embedding (see :meth:`kvsearch.Database.lookup`). Collective: each
        rank its own key.

        Raises:
            KeyNotFoundError: the key is not stored and no default was given.
        """
        self._check_open()
        texts, q = self._agree(lambda: self._reads.one_key(key))
        id_ = int(self._reads.exact_ids(texts, q)[0])
        _, values, _ = self._reads.texts([id_] if id_ >= 0 else [])
        if id_ >= 0:
            return values[id_]
        if default is MISSING:
            shown = key if isinstance(key, str) else "<embedding>"
            raise KeyNotFoundError(f"no record has the key {shown!r}")
        return default

    @collective()
    def exact_targets(self, queries: Tensor) -> Tensor:
        """For each query embedding, the global id of the one record whose key embedding equals it, else -1 (see
        :meth:`kvsearch.Database.exact_targets`). Collective.

        Raises:
            DimensionMismatchError: queries are not (batch, dim).
        """
        self._check_open()

        def check() -> Tensor:
            return query_batch(queries, self.dim)[0]  # a dense floating-point (batch, dim), finite

        return self._reads.exact_ids(None, self._agree(check))

    @collective()
    def ids_of_keys(self, texts: Sequence[str]) -> Tensor:
        """The global id of each key text: (n,) int64 on the CPU, -1 where the key is not stored. Collective."""
        self._check_open()
        return self._reads.exact_ids(self._agree(lambda: texts_list(texts)), torch.zeros(len(texts), self.dim))

    @collective("encoded_only")
    def key_texts(self, ids: Tensor | Sequence[int], *, encoded_only: bool = False) -> list[str | None]:
        """The key text of each global id, in order: None where it has none or is not stored. Collective.

        ``encoded_only``: None also for key texts that came with their own embedding (see
        :meth:`kvsearch.Database.key_texts`).
        """
        wanted = id_tensor(ids).reshape(-1).tolist()
        keys, _, _ = self._reads.texts(wanted, encoded_only=encoded_only)
        return [keys.get(i) for i in wanted]

    @collective()
    def values_present(self, texts: Sequence[str]) -> Tensor:
        """(n,) bool: whether some record of some shard holds each value text. Collective."""
        self._check_open()
        return self._reads.values_present(texts)

    @collective()
    def embeddings(self, ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings gathered by global id (any shape, -1 allowed), from their owners. Collective.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) — zeros where an id is -1 or not stored — and
            the mask (*ids.shape) of the stored ones, on :attr:`device`.
        """
        self._check_open()
        return self._reads.embeddings(ids)

    # ------------------------------------------------------------------ search and query

    @collective("k")
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
            :class:`~kvsearch.nn.attend.Candidates`: ids (batch, t), keys (batch, t, dim), values
            (batch, t, value_dim), mask, match — t = min(k, records), best first by the database's score
            recomputed in torch, ties by id.

        Raises:
            NotSupportedError: ``k="all"``.
            InvalidArgumentError, DimensionMismatchError: bad arguments (on every rank).
        """
        return self.candidates_from(self.shards, queries, k, targets=targets, where=where)

    @collective("k")
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
        return sharded_candidates(self._local, sources, queries, k, targets=targets, where=where)

    @collective()
    def value_texts(self, ids: Tensor | Sequence[int]) -> dict[int, str | None]:
        """id -> the value text (None for a value given as an embedding), read from each id's owner. Collective."""
        _, values, _ = self._reads.texts(id_tensor(ids).reshape(-1).tolist())
        return {i: v if isinstance(v, str) else None for i, v in values.items()}

    def _queries(self, queries: Queries) -> tuple[Tensor, list[str] | None, bool]:
        """This rank's queries as (batch, dim) — possibly (0, dim) —, their texts, and whether one came unbatched."""
        if isinstance(queries, (list, tuple)) and len(queries) == 0:
            return torch.zeros(0, self.dim), [], False
        if isinstance(queries, Tensor):
            check_dense(queries, "queries")  # before reading its shape
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

    @collective("k", rerank=lambda rerank: rerank is not None)
    def search(
        self, queries: Queries, k: int = 10, *, where: Mapping[str, Any] | None = None, rerank: Rerank | None = None
    ) -> list[Hit] | list[list[Hit]]:
        """The k nearest records to each of this rank's queries, over every shard (see :meth:`Database.search`).

        Collective; a rank with no queries passes an empty list (or a (0, dim) tensor). An empty database gives
        empty lists. ``rerank`` re-orders each query's global top ``max(k, 32)`` on its rank by the similarity of
        key and query text, as :meth:`Database.search` does (:mod:`kvsearch.text.rerank`; outside the differentiable
        path: :meth:`query` is unaffected); a tensor query with it raises InvalidArgumentError on every rank.
        """
        self._check_open()

        def check() -> tuple[Tensor, list[str] | None, bool, Similarity | None, Any]:
            similarity = None if rerank is None else check_rerank(rerank)
            q, texts, single = self._queries(queries)
            if similarity is None:
                return q, texts, single, None, check_k(k, allow_all=True)  # "all": candidates() refuses it
            return q, require_texts(texts, q.shape[0]), single, similarity, rerank_depth(int(check_k(k)))

        q, texts, single, similarity, depth = self._agree(check)
        if len(self) == 0:
            return [] if single else [[] for _ in range(q.shape[0])]
        cand = self.candidates(q, depth, where=where)
        scores = compute_scores(q.to(self.device).unsqueeze(1), cand.keys, self.score).squeeze(1)  # (b, t)
        scores = scores.masked_fill(~cand.mask, -math.inf).cpu()  # (b, t): already ranked
        keys, values, metadata = self._reads.texts(cand.ids[cand.ids >= 0].tolist())
        hits = make_hits(cand.ids.cpu(), scores, keys, values, metadata)
        if similarity is not None:  # a bad similarity is raised on every rank
            hits = self._agree(lambda: rerank_hits(similarity, texts, hits, int(k)))
        return hits[0] if single else hits

    @collective("k", pooling=lambda pooling: pooling == "exact")
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
            check_k(k, allow_all=True)  # a bad k is raised here, before the ranks compare their k
            return (*self._queries(queries), check_temperature(temperature))

        q, texts, single, temp = self._agree(check)
        self._check_not_empty()
        targets = None
        if pooling == "exact":  # text equality for text queries, else equal embeddings
            targets = self._reads.exact_ids(texts, q)
        cand = self.candidates(q, k, targets=targets, where=where)
        out_device = q.device
        output, weights = attend(
            q.to(self.device), cand.keys, cand.values, score=self.score if score is None else score,
            pooling=pooling, mask=cand.mask, match=cand.match, temperature=temp,
        )  # (b, value_dim), (b, t)  # fmt: skip
        keys, values, metadata = self._reads.texts(cand.ids[cand.ids >= 0].tolist())
        answer = make_answer(
            output, weights, cand.ids, k=int(k), key_of_id=keys, values_of=lambda ids: values, device=out_device,
            metadata_of=lambda ids: metadata,
        )  # fmt: skip
        return answer.row(0) if single else answer
