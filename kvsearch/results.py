"""What a search or a query returns: :class:`Hit`, :class:`Answer` and the lazily read keys and metadata of an answer.

These are plain result objects: they hold tensors, ids and texts, and know nothing of how they were computed
(the index, the store, attention) — the read path (:class:`~kvsearch.reads.Reads`) builds them with
:func:`make_hits` and :func:`make_answer`. A hit's metadata is held as the stored JSON text it was read as and
decoded (:mod:`kvsearch.metadata.codec`) when first read; an answer's keys and metadata are looked up when read.
Their reprs are short: shapes, not tensors.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.metadata.codec import decode as decode_metadata

__all__ = ["Hit", "Answer", "EmbeddedValue", "LazyKeys", "LazyMetadata", "make_hits", "hits_at", "make_answer"]

#: How many candidates (and queries of a batch) a repr shows.
REPR_TOP = 3
_short_repr = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_short_repr.maxstring, _short_repr.maxother, _short_repr.maxdict, _short_repr.maxlist = 60, 60, 6, 6


def _short(x: object) -> str:
    """A short repr: a tensor by its shape, long texts, lists and dicts cut."""
    if isinstance(x, Tensor):
        return f"tensor(shape={tuple(x.shape)})"
    return _short_repr.repr(x)


class _StoredMetadata:
    """A field descriptor: metadata given as a dict, or as its stored JSON text (or None) decoded at first access.

    A search reads the hits' metadata texts in its snapshot; decoding them is left to the reader who looks.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, hit: Hit | None, owner: type | None = None) -> Any:
        if hit is None:
            return None  # the dataclass's default: no metadata
        value = hit.__dict__[self.slot]
        if value is None or isinstance(value, str):
            value = decode_metadata(value)  # {} for None
            hit.__dict__[self.slot] = value
        return value

    def __set__(self, hit: Hit, value: dict[str, Any] | str | None) -> None:
        hit.__dict__[self.slot] = None if value is self else value  # the field's default is this descriptor


class EmbeddedValue(tuple):
    """A hit's value embedding not yet made a tensor: ``(block, n)``, row ``n`` of a search's gathered values (a
    (t, value_dim) float32 numpy block read in its snapshot). :class:`_StoredValue` makes it a tensor of its own
    storage when the hit's value is first read. A plain ``(block, n)`` tuple stands for one too (what
    :func:`hits_at` stores: no call per hit), as a tuple is never a value."""

    __slots__ = ()

    def __new__(cls, block: Any, n: int) -> EmbeddedValue:
        return super().__new__(cls, (block, n))


class _StoredValue:
    """A field descriptor: the value given as it is (text, tensor, None), or as an :class:`EmbeddedValue` made a
    (value_dim,) CPU tensor of its own storage (not a view of the search's batch) at first access."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, hit: Hit | None, owner: type | None = None) -> Any:
        if hit is None:
            return None
        value = hit.__dict__[self.slot]
        if isinstance(value, tuple):  # an EmbeddedValue, or the (block, n) pair hits_at stores
            block, n = value
            value = torch.from_numpy(block[n].copy())  # (value_dim,)
            hit.__dict__[self.slot] = value
        return value

    def __set__(self, hit: Hit, value: str | Tensor | EmbeddedValue | None) -> None:
        hit.__dict__[self.slot] = value


@dataclass(frozen=True, repr=False)
class Hit:
    """One search result.

    Attributes:
        id: the record's global id.
        key: the key text (None for a key given as an embedding).
        value: the value text, or the value embedding (CPU tensor) for a value given as an embedding.
        score: the score function of the database, recomputed in torch on the stored key.
        metadata: the record's metadata dict ({} when it has none), read in the same snapshot as the search
            (decoded from its stored form when first read).
    """

    id: int
    key: str | None
    value: str | Tensor | None  # made a tensor when first read: see _StoredValue, set on the class below
    score: float
    metadata: dict[str, Any] = field(default=_StoredMetadata(), hash=False)  # compared, not hashed (a dict)

    def __repr__(self) -> str:
        meta = f", metadata={_short(self.metadata)}" if self.metadata else ""
        return f"Hit(id={self.id}, key={_short(self.key)}, value={_short(self.value)}, score={self.score:.4g}{meta})"


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
        metadata: the candidates' metadata dicts ({} for a record without, None where there is no candidate),
            per query: a :class:`LazyMetadata` sequence read in the same snapshot as the query, parsed when read.
            ``[]`` for ``k="all"``, whose candidates are every record (``db.get(id).metadata`` reads one).
    """

    output: Tensor
    weights: Tensor
    ids: Tensor
    keys: LazyKeys | list[str | None] | list[list[str | None]]
    value: str | Tensor | None | list[str | Tensor | None]
    found: bool | list[bool]
    metadata: LazyMetadata | list[dict[str, Any] | None] | list[list[dict[str, Any] | None]] = field(
        default_factory=list
    )

    def row(self, i: int) -> Answer:
        """The answer of query ``i`` of a batched answer, unbatched (tensors (k,), one value, one found flag)."""
        return Answer(
            output=self.output[i],
            weights=self.weights[i],
            ids=self.ids[i],
            keys=self.keys[i],
            value=self.value[i],
            found=self.found[i],
            metadata=self.metadata[i] if len(self.metadata) else [],
        )

    def __repr__(self) -> str:
        shapes = f"output={tuple(self.output.shape)}, weights={tuple(self.weights.shape)}"
        if self.weights.dim() == 1:
            top = self._top(self.weights, self.ids, self.keys)
            return f"Answer(value={_short(self.value)}, found={self.found}, top={top}, {shapes})"
        b = self.weights.shape[0]
        more = ", ..." if b > REPR_TOP else ""
        values = ", ".join(_short(v) for v in self.value[:REPR_TOP]) + more
        found = ", ".join(str(f) for f in self.found[:REPR_TOP]) + more
        tops = ", ".join(self._top(self.weights[i], self.ids[i], self.keys[i]) for i in range(min(b, REPR_TOP)))
        return f"Answer(batch={b}, value=[{values}], found=[{found}], top=[{tops}{more}], {shapes})"

    @staticmethod
    def _top(weights: Tensor, ids: Tensor, keys: Sequence[str | None]) -> str:
        """The highest-weight candidates of one query: ``[(key text or id, weight), ...]``."""
        weights = weights.detach().float().cpu()  # (k,)
        order = torch.argsort(weights, descending=True, stable=True)[:REPR_TOP].tolist()
        shown = []
        for j in order:
            if float(weights[j]) > 0:
                key = keys[j]
                shown.append(f"({_short(key if key is not None else int(ids[j]))}, {float(weights[j]):.3g})")
        more = ", ..." if int((weights > 0).sum()) > len(shown) else ""
        return "[" + ", ".join(shown) + more + "]"

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


class _LazyRows(Sequence):
    """Something per candidate of an :class:`Answer`, read when accessed rather than built per row.

    Indexing a batch gives one query's row (itself lazy); indexing a row gives one candidate's item. Compares
    equal to the list it stands for. Subclasses say what an id's item is (:meth:`_item`).

    Args:
        ids: (k,) or (batch, k) int64 CPU ids, -1 where there is no candidate.
        source: id -> what the item is read from.
    """

    def __init__(self, ids: Tensor, source: Mapping[int, Any]) -> None:
        self._ids = ids
        self._source = source

    def _item(self, id_: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self._ids[index]
        if row.dim() == 0:
            return self._item(int(row))
        return type(self)(row, self._source)

    def __iter__(self) -> Iterator:
        if self._ids.dim() == 1:
            return iter([self._item(i) for i in self._ids.tolist()])
        return (type(self)(row, self._source) for row in self._ids)

    def tolist(self) -> list:
        """The plain list (a list of lists for a batch) of items."""
        return [x.tolist() if isinstance(x, _LazyRows) else x for x in self]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _LazyRows):
            other = other.tolist()
        return isinstance(other, list) and self.tolist() == other

    __hash__ = None  # compares by content, like a list

    def __repr__(self) -> str:
        return repr(self.tolist())


class LazyKeys(_LazyRows):
    """The candidates' key texts of an :class:`Answer`, looked up when read (None: no candidate or no text).

    Args:
        ids: (k,) or (batch, k) int64 CPU ids, -1 where there is no candidate.
        key_of_id: id -> key text.
    """

    def __init__(self, ids: Tensor, key_of_id: Mapping[int, str]) -> None:
        super().__init__(ids, key_of_id)

    def _item(self, id_: int) -> str | None:
        return self._source.get(id_)


class LazyMetadata(_LazyRows):
    """The candidates' metadata dicts of an :class:`Answer`: {} for a record without, None for no candidate.

    The stored JSON was read with the answer (in its snapshot); each dict is parsed when read, a fresh one on
    every access.

    Args:
        ids: (k,) or (batch, k) int64 CPU ids, -1 where there is no candidate.
        metadata_of_id: id -> the stored metadata JSON, for the candidates that have metadata.
    """

    def __init__(self, ids: Tensor, metadata_of_id: Mapping[int, str]) -> None:
        super().__init__(ids, metadata_of_id)

    def _item(self, id_: int) -> dict[str, Any] | None:
        if id_ < 0:
            return None
        return decode_metadata(self._source.get(id_))


# The value field's descriptor, set after the dataclass is made (a field default would give ``value`` a default,
# and every later field one): the generated __init__, __eq__ and replace() read and write it through the descriptor.
_value_field = _StoredValue()
_value_field.__set_name__(Hit, "value")
Hit.value = _value_field  # type: ignore[assignment]


def make_hits(
    ids: Tensor | Sequence[Sequence[int]],
    scores: Tensor | Sequence[Sequence[float]],
    key_of_id: Mapping[int, str],
    values: Mapping[int, str | Tensor | EmbeddedValue | None],
    metadata: Mapping[int, str] | None = None,
) -> list[list[Hit]]:
    """One list of :class:`Hit` per query, best first, from ranked ids and scores.

    Args:
        ids: (batch, k) int64 ids (a tensor or lists of rows), best first, -1 where there is no candidate (skipped).
        scores: (batch, k) float scores (a tensor or lists of rows).
        key_of_id: id -> key text. values: id -> value (text or CPU tensor).
        metadata: id -> the stored metadata JSON (ids without metadata absent).
    """
    metadata = metadata or {}
    ids = ids.tolist() if isinstance(ids, Tensor) else ids
    scores = scores.tolist() if isinstance(scores, Tensor) else scores
    key, value, meta = key_of_id.get, values.get, metadata.get
    return [
        [_hit(i, key(i), value(i), s, meta(i)) for i, s in zip(row, row_s) if i >= 0]  # metadata decoded lazily
        for row, row_s in zip(ids, scores)
    ]


def hits_at(
    ids: list[list[int]],
    scores: list[list[float]],
    key_of_id: Mapping[int, str],
    texts: Mapping[int, str],
    block: Any,
    metadata: Mapping[int, str],
) -> list[list[Hit]]:
    """:func:`make_hits` for a search's ranked rows, built without a call per field: one list of :class:`Hit` per
    query, best first, ids -1 skipped.

    Args:
        ids: (batch, t) lists of ids. scores: (batch, t) lists of floats.
        key_of_id: id -> key text. texts: id -> value text, for the values that have one.
        block: (batch * t, value_dim) numpy float32, the value embeddings at each position (row-major): a hit whose
            value has no text gets its row, made a tensor of its own storage when first read; None when every value
            has text.
        metadata: id -> the stored metadata JSON (decoded when first read).
    """
    new, set_dict = object.__new__, object.__setattr__
    key, text, meta = key_of_id.get, texts.get, metadata.get  # C methods: cheaper than any test around them
    embedded = block is not None
    out: list[list[Hit]] = []
    start = 0
    for row, row_s in zip(ids, scores):
        # one Hit per found id, its __dict__ set in one call (h is a fresh Hit; set_dict returns None)
        out.append(
            [
                set_dict(h := new(Hit), "__dict__", {
                    "id": i,
                    "key": key(i),
                    "_value": v if (v := text(i)) is not None else (block, n) if embedded else None,
                    "score": s,
                    "_metadata": meta(i),
                }) or h
                for n, i, s in zip(range(start, start + len(row)), row, row_s)
                if i >= 0
            ]
        )  # fmt: skip
        start += len(row)
    return out


def _hit(
    id_: int, key: str | None, value: str | Tensor | EmbeddedValue | None, score: float, metadata: str | None
) -> Hit:
    """``Hit(id, key, value, score, metadata)`` with its fields set in its ``__dict__`` directly: the frozen
    dataclass's ``__init__`` sets each through ``object.__setattr__`` (~2 us a hit, a tenth of a search's own
    Python work). ``value`` may be an :class:`EmbeddedValue` and ``metadata`` the stored JSON text (or None):
    each is made what it stands for when first read."""
    hit = object.__new__(Hit)
    hit.__dict__.update(id=id_, key=key, _value=value, score=score, _metadata=metadata)
    return hit


def make_answer(
    output: Tensor,
    weights: Tensor,
    ids: Tensor,
    *,
    k: int | None,
    key_of_id: Mapping[int, str],
    values_of: Callable[[list[int]], Mapping[int, str | Tensor | None]],
    device: torch.device,
    metadata_of: Callable[[list[int]], Mapping[int, str]] | None = None,
) -> Answer:
    """A batched :class:`Answer` from pooled attention over candidates.

    Args:
        output: (batch, value_dim). weights: (batch, t). ids: (batch, t) or (t,) shared by every query.
        k: pad to k candidates ("no candidate": weight 0, id -1) when fewer came; None for every record.
        key_of_id: id -> key text, read lazily. values_of: ids -> their values, for the best candidates.
        device: where the tensors of the answer go (the queries' device).
        metadata_of: ids -> their stored metadata JSON, called once here with every candidate id (so that it
            reads in the caller's snapshot); None: not read (``Answer.metadata`` is then ``[]``).
    """
    ids = ids if ids.dim() == 2 else ids.unsqueeze(0).expand(weights.shape[0], -1)  # (batch, t)
    if k is not None and weights.shape[1] < k:
        weights = F.pad(weights, (0, k - weights.shape[1]))  # (batch, k) zeros
        ids = F.pad(ids, (0, k - ids.shape[1]), value=-1)  # (batch, k)
    found = weights.detach().sum(-1) > 0  # (batch,)
    if weights.shape[1] == 0:  # no candidate at all (k="all" with a filter that matched nothing): not found
        best = torch.full((weights.shape[0],), -1, dtype=torch.long)  # (batch,)
    else:
        best = ids.gather(1, weights.detach().argmax(-1, keepdim=True)).squeeze(1)  # (batch,)
    best = torch.where(found, best.to(found.device), -1).cpu()  # (batch,)
    values = values_of(best[best >= 0].tolist())
    ids_cpu = ids.cpu()  # (batch, k)
    metadata = None if metadata_of is None else metadata_of(ids_cpu.unique().tolist())
    return Answer(
        output=output.to(device),
        weights=weights.to(device),
        ids=ids.to(device),
        keys=LazyKeys(ids_cpu, key_of_id),  # texts looked up on access, not per row here
        value=[values.get(i) if i >= 0 else None for i in best.tolist()],
        found=found.cpu().tolist(),
        metadata=[] if metadata is None else LazyMetadata(ids_cpu, metadata),  # parsed on access
    )
