"""Reads by global id or exact key across the shards of a sharded database, each answered by the owner shard.

:class:`ShardReads` is what :class:`~kvsearch.distributed.ShardedDatabase` delegates its reads by id or key to:
``get``, the ids of exact keys (``exact_ids``: a key text on its owner shard, an equal key embedding on any), the
key texts, values and metadata of ids (``texts``), ``values_present`` and ``embeddings``. Every method is
collective: the ranks gather what each asked, each rank answers from its own shards, then every rank gathers the
answers and keeps its own part.

It knows nothing of search, candidates or writes, nor of the facade (it holds this rank's
:class:`~kvsearch.distributed.local.LocalShards`), nor of a shard's internals: it uses each shard's public
:class:`~kvsearch.database.Database` methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import query_tensor
from kvsearch.distributed.layout import ID_SHIFT
from kvsearch.errors import InvalidArgumentError, KeyNotFoundError
from kvsearch.inputs import id_tensor
from kvsearch.metadata.codec import encode as encode_metadata

if TYPE_CHECKING:
    from kvsearch.database import Database
    from kvsearch.distributed.local import LocalShards
    from kvsearch.storage.store import Record

__all__ = ["ShardReads", "owner_shards", "texts_list"]

_INT64_END = 2**63


def owner_shards(shards: Mapping[int, Database], ids: Tensor | Sequence[int], *, banded: bool) -> Tensor:
    """The shard among ``shards`` (this rank's) that owns each global id, -1 where none of them does.

    Args:
        shards: shard number -> its open database.
        ids: global ids (any shape; -1 and ids no shard holds are fine).
        banded: whether the layout's ids are banded (``ShardLayout.banded_ids``): the owner of an id is then the shard
            of its high bits, when that shard is among ``shards`` (whether it still holds the record is its to say).
            Otherwise (a resharded database: ids carried over) the owner is the shard that holds the id, asked of
            each shard (a lookup in its in-memory ids).

    Returns:
        (n,) int64 on the CPU, the ids flattened.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()  # (n,)
    owner = torch.full_like(ids, -1)  # (n,)
    if banded:
        band = torch.where(ids >= 0, ids >> ID_SHIFT, -1)  # (n,)
        for s in shards:
            owner[band == s] = s
        return owner
    for s, db in shards.items():
        if len(db) and bool((owner < 0).any()):
            held = torch.isin(ids, db.ids())  # (n,) the ids this shard stores (its sorted ids, no embedding read)
            owner[held & (owner < 0)] = s
    return owner


class ShardReads:
    """The collective reads by global id or exact key of a :class:`~kvsearch.distributed.ShardedDatabase`.

    Each method is collective (every rank calls it, with its own arguments) and assumes the database is open.

    Args:
        local: this rank's shards, their layout and the ranks' collectives (not the facade: references point down).
    """

    def __init__(self, local: LocalShards) -> None:
        self.local = local

    def get(self, id: int) -> Record:
        """The record with this global id, read on its owner; KeyNotFoundError where none has it."""
        here, comm = self.local, self.local.comm

        def check() -> int:
            if isinstance(id, bool) or not isinstance(id, (int, np.integer)):
                raise InvalidArgumentError(f"expected an int id, got {type(id).__name__}")
            return int(id)

        wanted = comm.gather_objects(comm.agree(check))  # every rank's id

        def local() -> dict[int, Record]:
            found: dict[int, Record] = {}
            asked = sorted(i for i in set(wanted) if 0 <= i < _INT64_END)  # no record has an id outside int64
            for i, s in zip(asked, owner_shards(here.shards, asked, banded=here.banded_ids).tolist()):
                if s >= 0:
                    try:
                        found[i] = here.shards[s].get(i)
                    except KeyNotFoundError:
                        pass
            return found

        mine = wanted[here.rank]
        for part in comm.gather_objects(comm.agree(local)):
            if mine in part:
                return part[mine]
        raise KeyNotFoundError(f"expected a stored id, got {mine}")

    def one_key(self, key: object) -> tuple[list[str] | None, Tensor]:
        """A single key as ([text], (1, dim) placeholder) or (None, (1, dim) embedding). Not collective."""
        dim = self.local.dim
        if isinstance(key, str):
            return [key], torch.zeros(1, dim)
        if isinstance(key, (Tensor, np.ndarray)):
            q, _ = query_tensor(key, dim)
            if q.shape[0] != 1:
                raise InvalidArgumentError(f"expected one key embedding (dim,), got shape {tuple(q.shape)}")
            return None, q
        raise InvalidArgumentError(f"expected a key text or a key embedding, got {type(key).__name__}")

    def exact_ids(self, texts: list[str] | None, q: Tensor) -> Tensor:
        """The global id of the record whose key equals each query — text equality for texts, else an equal
        embedding —, -1 where none. An embedding that several stored keys share (on one shard or on several) is
        ambiguous: -1, as in a single :class:`~kvsearch.Database`. Collective.

        Args:
            texts: this rank's query texts, or None to match the embeddings.
            q: (b, dim) this rank's query embeddings.

        Returns:
            (b,) int64 CPU ids.
        """
        here, comm = self.local, self.local.comm
        asked = comm.gather_objects(texts if texts is not None else q.detach().to("cpu", torch.float32))

        def local() -> list[tuple[Tensor, Tensor]]:
            found = []
            for wanted in asked:
                ids = torch.full((len(wanted),), -1, dtype=torch.long)  # (n,) one matching id
                count = torch.zeros(len(wanted), dtype=torch.long)  # (n,) how many keys match
                for db in here.shards.values():
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

        mine = torch.full((len(asked[here.rank]),), -1, dtype=torch.long)  # (b,)
        count = torch.zeros(len(asked[here.rank]), dtype=torch.long)  # (b,)
        for part in comm.gather_objects(comm.agree(local)):
            hit, hits = part[here.rank]
            mine, count = torch.where(hit >= 0, hit, mine), count + hits
        return torch.where(count == 1, mine, -1)

    def texts(
        self, ids: Sequence[int], *, encoded_only: bool = False
    ) -> tuple[dict[int, str | None], dict[int, Any], dict[int, str]]:
        """Key texts, values (text, or a CPU tensor) and metadata (JSON) of global ids, from their owners.

        Collective.
        """
        here, comm = self.local, self.local.comm
        wanted = comm.gather_objects(sorted({int(i) for i in ids if i >= 0}))

        def local() -> tuple[dict[int, str | None], dict[int, Any], dict[int, str]]:
            keys: dict[int, str | None] = {}
            values: dict[int, Any] = {}
            metadata: dict[int, str] = {}
            everything = sorted({i for w in wanted for i in w if i < _INT64_END})
            owners = owner_shards(here.shards, everything, banded=here.banded_ids).tolist()
            for s, db in here.shards.items():
                own = [i for i, owner in zip(everything, owners) if owner == s]
                if own:
                    keys.update(zip(own, db.key_texts(own, encoded_only=encoded_only)))
                    values.update(db.values_of(own))  # text, or the embedding for a value given as one
                    metadata.update((i, encode_metadata(m)) for i, m in db.metadata_of(own).items() if m)
            return keys, values, metadata

        keys: dict[int, str | None] = {}
        values: dict[int, Any] = {}
        metadata: dict[int, str] = {}
        for part_keys, part_values, part_metadata in comm.gather_objects(comm.agree(local)):
            keys.update(part_keys)
            values.update(part_values)
            metadata.update(part_metadata)
        return keys, values, metadata

    def values_present(self, texts: Sequence[str]) -> Tensor:
        """(n,) bool: whether some record of some shard holds each value text. Collective."""
        here, comm = self.local, self.local.comm
        asked = comm.gather_objects(comm.agree(lambda: texts_list(texts)))

        def local() -> list[Tensor]:
            return [
                torch.stack([db.values_present(wanted) for db in here.shards.values()]).any(0)
                if wanted
                else torch.zeros(0, dtype=torch.bool)
                for wanted in asked
            ]

        present = torch.zeros(len(asked[here.rank]), dtype=torch.bool)  # (n,)
        for part in comm.gather_objects(comm.agree(local)):
            present |= part[here.rank]
        return present

    def embeddings(self, ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """Key and value embeddings gathered by global id (any shape, -1 allowed), from their owners. Collective.

        Returns:
            keys (*ids.shape, dim), values (*ids.shape, value_dim) — zeros where an id is -1 or not stored — and
            the mask (*ids.shape) of the stored ones, on the database's device.
        """
        here, comm = self.local, self.local.comm
        dim, value_dim = here.dim, here.value_dim
        ids = id_tensor(ids)  # int64 on the CPU, any shape
        asked = comm.gather_objects(ids.reshape(-1))

        def local() -> list[tuple[Tensor, Tensor, Tensor]]:
            out = []
            for wanted in asked:  # (n,)
                keys, values = torch.zeros(len(wanted), dim), torch.zeros(len(wanted), value_dim)
                mask = torch.zeros(len(wanted), dtype=torch.bool)
                owners = owner_shards(here.shards, wanted, banded=here.banded_ids)  # (n,)
                for s, db in here.shards.items():
                    own = owners == s  # (n,)
                    if own.any():
                        k, v, m = db.embeddings(wanted[own])
                        keys[own], values[own], mask[own] = k.cpu().float(), v.cpu().float(), m.cpu()
                out.append((keys, values, mask))
            return out

        keys, values = torch.zeros(ids.numel(), dim), torch.zeros(ids.numel(), value_dim)
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        for part in comm.gather_objects(comm.agree(local)):
            k, v, m = part[here.rank]
            keys[m], values[m] = k[m], v[m]
            mask |= m
        device = here.device
        return (
            keys.reshape(*ids.shape, dim).to(device),
            values.reshape(*ids.shape, value_dim).to(device),
            mask.reshape(ids.shape).to(device),
        )


def texts_list(texts: Sequence[str]) -> list[str]:
    """A sequence of key or value texts, checked (InvalidArgumentError for a lone string or a non-text)."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise InvalidArgumentError(f"expected a list of texts, got {type(texts).__name__}")
    return list(texts)
