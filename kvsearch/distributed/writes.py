"""The writes of a sharded database, each record routed to its owner shard.

:class:`ShardWrites` is what :class:`~kvsearch.distributed.ShardedDatabase` delegates ``add``, ``upsert`` and
``delete`` to. A key text goes to the shard of its hash, a key given as an embedding round-robin, an id to its
owner (:func:`~kvsearch.distributed.reads.owner_shards`: the shard in its high bits, or the one holding it in a
resharded database). The ranks gather every rank's records, check them on
the owner shards before any write (an error is raised on every rank), then each shard commits its part in one
transaction of its own: a batch spanning shards is atomic per shard, and retrying it with ``upsert`` is safe.

It knows nothing of search, candidates or reads by id, nor of the facade (it holds this rank's
:class:`~kvsearch.distributed.local.LocalShards`), nor of a shard's internals: it uses each shard's public
:class:`~kvsearch.database.Database` methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from kvsearch import errors
from kvsearch.distributed.layout import shard_of_key
from kvsearch.distributed.reads import owner_shards
from kvsearch.errors import KeyNotFoundError, NotSupportedError, UnknownOptionError
from kvsearch.inputs import KeysIn, check_metadata, delete_items, record_side

if TYPE_CHECKING:
    from kvsearch.database import Database
    from kvsearch.distributed.local import LocalShards

__all__ = ["ShardWrites"]

#: One routed record: (owner shard, key text or None, key embedding or None, value text or None, value embedding
#: or None, metadata).
_Routed = tuple[int, Any, Any, Any, Any, Any]


class ShardWrites:
    """The collective writes of a :class:`~kvsearch.distributed.ShardedDatabase`, routed to their owner shards.

    Each method is collective (every rank calls it, with its own records) and assumes the database is open.

    Args:
        local: this rank's shards, their layout and the ranks' collectives (not the facade: references point down).
    """

    def __init__(self, local: LocalShards) -> None:
        self.local = local

    def write(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None,
        key_embeddings: Tensor | None,
        value_embeddings: Tensor | None,
        *,
        upsert: bool,
    ) -> list[int]:
        """Add (or upsert) this rank's records on their owner shards. Collective.

        Args:
            keys, values, metadata, key_embeddings, value_embeddings: this rank's records, as
                :meth:`kvsearch.Database.add` takes them.
            upsert: replace the records whose key text is stored (else a stored or repeated key is an error).

        Returns:
            The global ids of this rank's records, in input order.

        Raises:
            As :meth:`kvsearch.Database.add` / ``upsert``, on every rank, before any shard writes.
            NotSupportedError: an upsert of keys given as embeddings.
        """
        comm = self.local.comm
        batches = comm.gather_objects(
            comm.agree(lambda: self._route(keys, values, metadata, key_embeddings, value_embeddings, upsert))
        )  # every rank's records
        if not upsert:
            comm.agree(lambda: self._check_new(batches))
        results: dict[tuple[int, int], int] = {}
        for part in comm.gather_objects(comm.agree(lambda: self._commit(batches, upsert))):
            results.update(part)
        return [results[(self.local.rank, i)] for i in range(len(batches[self.local.rank]))]

    def _route(
        self,
        keys: KeysIn,
        values: KeysIn,
        metadata: Sequence[Mapping[str, Any] | None] | None,
        key_embeddings: Tensor | None,
        value_embeddings: Tensor | None,
        upsert: bool,
    ) -> list[_Routed]:
        """This rank's records, checked, each with its owner shard (a key text by its hash, else round-robin)."""
        local = self.local
        key_texts, key_embs = record_side(keys, "keys", local.encoder, local.dim, key_embeddings)
        value_texts, value_embs = record_side(values, "values", local.value_encoder, local.value_dim, value_embeddings)
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
            owner = shard_of_key(key, local.num_shards) if key is not None else (local.rank + i) % local.num_shards
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

    def _check_new(self, batches: list[list[_Routed]]) -> None:
        """For ``add``: no key stored or given twice, checked on every local owner shard before any write.

        Raises:
            DuplicateKeyError: a key given by two ranks (or twice), or already stored.
        """
        shards = self.local.shards
        given: dict[str, int] = {}
        mine: dict[int, list[str]] = {s: [] for s in shards}  # the keys each local shard would take
        for source, records in enumerate(batches):
            for owner, key, *_ in records:
                if key is None or owner not in shards:
                    continue
                if key in given:
                    raise errors.DuplicateKeyError(
                        f"expected unique keys, got {key!r} from rank {given[key]} and rank {source}; nothing was added"
                    )
                given[key] = source
                mine[owner].append(key)
        for s, keys in mine.items():  # one lookup per shard
            stored = [key for key, id_ in zip(keys, shards[s].ids_of_keys(keys).tolist()) if id_ >= 0]
            if stored:
                raise errors.DuplicateKeyError(
                    f"expected new keys, got {stored[0]!r}, which is stored; nothing was added "
                    "(upsert replaces a stored key)"
                )

    def _commit(self, batches: list[list[_Routed]], upsert: bool) -> dict[tuple[int, int], int]:
        """Write every rank's records owned by this rank's shards, one transaction per shard and source rank.

        Returns:
            (source rank, row in its batch) -> the new global id.
        """
        done: dict[tuple[int, int], int] = {}
        for source, records in enumerate(batches):
            for s, db in self.local.shards.items():
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
                done.update({(source, i): id_ for i, id_ in zip(rows, ids)})
        return done

    def delete(self, key_or_keys: str | int | Sequence[str | int], missing: Literal["raise", "ignore"]) -> list[int]:
        """Delete this rank's keys or ids on their owner shards (checked on every shard first with
        ``missing="raise"``); the deleted ids, in input order."""
        local, comm = self.local, self.local.comm

        def items_of() -> list[str | int]:
            if missing not in ("raise", "ignore"):
                raise UnknownOptionError(f"expected missing='raise' or 'ignore', got {missing!r}")
            return delete_items(key_or_keys)

        items = comm.agree(items_of)
        requests = comm.gather_objects(items)
        asked = sorted({int(i) for wanted in requests for i in wanted if not isinstance(i, str) and 0 <= i < 2**63})
        owners = dict(
            zip(asked, comm.agree(lambda: owner_shards(local.shards, asked, banded=local.banded_ids).tolist()))
        )
        # a resharded database: an id is stored where some rank's shard holds it (else no rank would say it is not)
        held = (
            set()
            if local.banded_ids
            else {i for part in comm.gather_objects(owners) for i, s in part.items() if s >= 0}
        )

        def owner(item: str | int) -> int:
            return shard_of_key(item, local.num_shards) if isinstance(item, str) else owners.get(int(item), -1)

        def check() -> None:  # every named record is stored before any shard deletes anything
            if missing == "ignore":
                return
            for wanted in requests:
                for item in wanted:
                    s = owner(item)
                    if isinstance(item, str) or local.banded_ids:
                        gone = s in local.shards and not _stored(local.shards[s], item)
                    else:
                        gone = int(item) not in held
                    if gone:
                        what = "key" if isinstance(item, str) else "id"
                        raise KeyNotFoundError(f"expected a stored {what}, got {item!r}; nothing was deleted")

        comm.agree(check)

        def run() -> dict[tuple[int, int], int]:
            done: dict[tuple[int, int], int] = {}
            for source, wanted in enumerate(requests):
                for s, db in local.shards.items():
                    rows = [i for i, item in enumerate(wanted) if owner(item) == s]
                    if missing == "ignore":
                        rows = [i for i in rows if _stored(db, wanted[i])]
                    if rows:
                        for i, id_ in zip(rows, db.delete([wanted[i] for i in rows])):
                            done[(source, i)] = id_
            return done

        results: dict[tuple[int, int], int] = {}
        for part in comm.gather_objects(comm.agree(run)):
            results.update(part)
        return list(dict.fromkeys(results[(local.rank, i)] for i in range(len(items)) if (local.rank, i) in results))


def _stored(db: Database, item: str | int) -> bool:
    """Whether a shard holds this key text or id."""
    if isinstance(item, str):
        return item in db
    try:
        db.get(int(item))
    except KeyNotFoundError:
        return False
    return True
