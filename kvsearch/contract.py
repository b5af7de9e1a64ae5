"""What every database offers, one process or many: the contract :class:`~kvsearch.Database` and
:class:`~kvsearch.distributed.sharded_database.ShardedDatabase` both meet.

Code above the facades (training, the command line, the integrations) is written against
:class:`DatabaseProtocol`, never against ``isinstance`` of one facade: a function that takes a database works for a
plain and a sharded one alike. The protocol is structural (``typing.Protocol``): a facade meets it by having the
members, without inheriting from it; ``isinstance(db, DatabaseProtocol)`` checks that every member is there (not
their signatures: ``tests/test_contract.py`` compares those for both facades).

What only one facade has (a plain database's ``index`` and ``atomic()``; a sharded one's ``shards`` and ``team``)
is not in the contract: code that needs it asks for it by name (:func:`parts_of`). :class:`SelectionProtocol` is
what both facades' ``where()`` returns (:class:`~kvsearch.selection.Selection` and
:class:`~kvsearch.distributed.selection.ShardedSelection`).

This module knows nothing of how either facade does its work: it imports neither (only the sentinel a missing
``lookup`` default is, shared by both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from kvsearch.reads import MISSING

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from kvsearch.encoders.base import Encoder
    from kvsearch.nn.attend import Candidates
    from kvsearch.results import Answer, Hit
    from kvsearch.storage.store import Record

__all__ = ["DatabaseProtocol", "SelectionProtocol", "parts_of"]


@runtime_checkable
class SelectionProtocol(Protocol):
    """The records a filter selects, as both facades' ``where()`` return them: read, counted, aggregated, deleted or
    updated without a query (see :class:`~kvsearch.selection.Selection`). On a sharded database each operation is
    collective and answers for every shard."""

    where: Mapping[str, Any]

    def count(self) -> int: ...

    def ids(self, *, limit: int | None = None, offset: int = 0) -> Tensor: ...

    def records(self, *, limit: int | None = None, offset: int = 0) -> list[Record]: ...

    def distinct(self, field: str) -> list[tuple[Any, int]]: ...

    def min_max(self, field: str) -> tuple[Any, Any] | None: ...

    def fields(self) -> dict[str, list[str]]: ...

    def delete(self) -> list[int]: ...

    def update(self, metadata: Mapping[str, Any], *, merge: bool = True) -> list[int]: ...


@runtime_checkable
class DatabaseProtocol(Protocol):
    """The members a plain :class:`~kvsearch.Database` and a ``ShardedDatabase`` both have, with one meaning.

    Reads: ``search`` (hits), ``query`` (a differentiable answer), ``candidates`` (the retriever's tensors),
    ``lookup`` / ``get`` (one record), ``where`` (a :class:`~kvsearch.selection.Selection` by filter), ``len`` and
    ``in``. Writes: ``add``, ``upsert``, ``delete``. The generation (encoders and embeddings as one):
    ``begin_generation`` (a draft a fine-tuning run works in), ``refresh``, ``generation``. What a trainer reads by
    id: ``embeddings``, ``ids_of_keys``, ``key_texts``, ``value_texts``, ``values_present``, ``exact_targets``.
    """

    #: The key and value dimensions, the database's score and the device its tensors (and answers) live on.
    dim: int
    value_dim: int
    score: str
    device: torch.device

    # ---------------------------------------------------------------- the encoders and the generation
    @property
    def encoder(self) -> Encoder | None: ...

    @property
    def query_encoder(self) -> Encoder | None: ...

    @property
    def value_encoder(self) -> Encoder | None: ...

    @property
    def generation(self) -> int: ...

    def begin_generation(self) -> Any: ...

    def refresh(self) -> None: ...

    # ---------------------------------------------------------------- reads
    def search(
        self, queries: Any, k: int = 10, *, where: Mapping[str, Any] | None = None, rerank: Any = None
    ) -> list[Hit] | list[list[Hit]]: ...

    def query(
        self,
        queries: Any,
        k: int | Literal["all"] = 10,
        *,
        score: Any = None,
        pooling: str = "softmax",
        temperature: float = 1.0,
        where: Mapping[str, Any] | None = None,
    ) -> Answer: ...

    def candidates(
        self,
        queries: Tensor,
        k: int | Literal["all"],
        *,
        targets: Tensor | None = None,
        where: Mapping[str, Any] | None = None,
    ) -> Candidates: ...

    def exact_targets(self, queries: Tensor) -> Tensor: ...

    def lookup(self, key: Any, default: Any = MISSING) -> Any: ...

    def get(self, id: int) -> Record: ...  # noqa: A002 - the facades' own name

    def where(self, filter: Mapping[str, Any] | None = None, *, ids: Any = None) -> SelectionProtocol: ...  # noqa: A002

    def embeddings(self, ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor, Tensor]: ...

    def ids_of_keys(self, texts: Sequence[str]) -> Tensor: ...

    def key_texts(self, ids: Tensor | Sequence[int], *, encoded_only: bool = False) -> list[str | None]: ...

    def value_texts(self, ids: Tensor | Sequence[int]) -> dict[int, str | None]: ...

    def values_present(self, texts: Sequence[str]) -> Tensor: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    # ---------------------------------------------------------------- writes
    def add(
        self,
        keys: Any,
        values: Any,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        key_embeddings: Tensor | None = None,
        value_embeddings: Tensor | None = None,
    ) -> list[int]: ...

    def upsert(
        self,
        keys: Any,
        values: Any,
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        key_embeddings: Tensor | None = None,
        value_embeddings: Tensor | None = None,
    ) -> list[int]: ...

    def delete(self, key_or_keys: Any, *, missing: Literal["raise", "ignore"] = "raise") -> list[int]: ...

    def close(self) -> None: ...


def parts_of(db: DatabaseProtocol) -> list[Any]:
    """The plain databases a database is made of: its shards in shard order, or the database itself.

    Args:
        db: a plain or sharded database.

    Returns:
        The shards of a sharded database (``db.shards``, sorted by shard number), else ``[db]``.
    """
    shards = getattr(db, "shards", None)
    return [shards[s] for s in sorted(shards)] if isinstance(shards, Mapping) else [db]
