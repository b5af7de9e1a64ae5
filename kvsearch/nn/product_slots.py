"""The slots of a :class:`~kvsearch.nn.product_keys.ProductKeyMemory` as records: ``memory.slots``.

    slots = memory.slots                      # a view over the memory's parameters and buffers (holds nothing)
    slots.read([7, 8]).values                 # a slot by id: its key per head, its value, frozen, hits, written
    slots.update_values(ids, new_values)      # edit slots; slots.freeze(ids): no gradient, and with
    handle = slots.protect(optimizer)         # ... no optimizer step either (momentum, weight decay)
    slots.where({"hits": {"$gte": 10}, "frozen": False})   # ids, by the project's filter language
    slots.observe(); slots.usage()            # fraction of slots used and KL from uniform, over a stream

A slot id ``i`` in [0, n^2) names the pair of sub-keys ``(i // n, i % n)``: for head h its key is
``cat(subkeys[h, 0, i // n], subkeys[h, 1, i % n])`` (each head has its own sub-keys), and its value is
``values[i]`` (one value table, shared by the heads). A slot's metadata is ``{"hits": int, "written": int | None,
"frozen": bool}`` (``written`` None: never written); :meth:`ProductSlots.where` evaluates a filter on it with
:func:`kvsearch.metadata.filters.matches`, the filter language's rule in Python (``$id`` is the slot id; ``$key`` and
``$value`` are None: a slot's key and value are vectors, not texts).

**Freezing.** A frozen slot's value gets no gradient: the memory's forward zeroes its row of a dense gradient and
drops it from a sparse one. A zero gradient leaves the row bitwise as it is where nothing else moves it: plain SGD,
Adam (or AdamW with ``weight_decay=0``) on a row whose moments are still zero, SparseAdam (which never sees a dropped
row). Momentum left from before the freeze (SGD's buffer, Adam's moments) and weight decay (SGD's, and AdamW's
decoupled decay, on by default) still move it. :meth:`ProductSlots.protect` makes the promise for any optimizer: its
step hooks put the frozen rows back, bitwise, after each step. The optimizer's own state for those rows (momentum,
Adam's moments) goes on evolving meanwhile, and applies again after ``unfreeze``.

It owns the slots' reads, edits, freezing, metadata queries and usage; the layer, the product top-k and the state's
buffers are :mod:`kvsearch.nn.product_keys`'s, which hands this module the layer (typed here by :class:`SlotMemory`).
It knows nothing of FAISS, SQLite, text or files.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import check_dense, check_finite
from kvsearch.errors import DimensionMismatchError, InvalidArgumentError, KeyNotFoundError
from kvsearch.metadata.filters import check_where, matches

__all__ = ["ProductSlots", "SlotMemory", "SlotRecords", "Reached", "Usage", "METADATA_FIELDS"]

#: The fields of a slot's metadata, which :meth:`ProductSlots.where` filters on (besides ``$id``).
METADATA_FIELDS = ("hits", "written", "frozen")


class SlotMemory(Protocol):
    """What the slots read and write of their memory (a :class:`~kvsearch.nn.product_keys.ProductKeyMemory`)."""

    num_keys: int
    heads: int
    k: int
    key_dim: int
    value_dim: int
    subkeys: Tensor  # (heads, 2, n, key_dim / 2)
    values: Tensor  # (n^2, value_dim)
    frozen: Tensor  # (n^2,) bool
    hits: Tensor  # (n^2,) int64
    written: Tensor  # (n^2,) int64, -1: never
    step: Tensor  # () int64
    usage_weights: Tensor  # (n^2,) float64
    usage_reads: Tensor  # () int64
    last_ids: Tensor | None
    last_weights: Tensor | None
    frozen_count: int

    def sync_frozen(self) -> None: ...

    def select(self, inputs: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class SlotRecords:
    """Slots read by id (detached copies, in the order of ``ids``)."""

    ids: Tensor  # (m,) int64
    keys: Tensor  # (m, heads, key_dim): each head's key, its two sub-keys concatenated
    values: Tensor  # (m, value_dim)
    frozen: Tensor  # (m,) bool
    hits: Tensor  # (m,) int64
    written: Tensor  # (m,) int64, -1: never


@dataclass(frozen=True)
class Reached:
    """The slots a batch reaches: each once, by id, with the weight it gets summed over inputs and heads."""

    ids: Tensor  # (r,) int64, ascending
    weights: Tensor  # (r,) float64: the sum of its softmax weights
    reads: Tensor  # (r,) int64: how many (input, head) top-k lists hold it


@dataclass(frozen=True)
class Usage:
    """How the observed reads spread over the slots, as the PKM paper reports it (Lample et al. 2019, 4.3).

    ``fraction``: the fraction of the n^2 slots with a nonzero summed weight; ``kl``: the KL divergence (nats) of
    the summed weights, normalised, from the uniform distribution over the slots (0: every slot equally used; log n^2:
    one slot); None when nothing was observed; ``reads``: the (input, head, slot) weights observed.
    """

    fraction: float
    kl: float | None
    reads: int


class ProductSlots:
    """The n^2 slots of a memory as records: reads by id, edits, freezing, metadata, usage.

    A view: it holds the memory and nothing else (``memory.slots`` makes a new one each time, for free); every read
    and write goes to the memory's parameters and buffers, which ``state_dict()`` carries. Ids are an int, a sequence
    of ints or an integer tensor (any shape, flattened), each in [0, n^2). Edits run under ``torch.no_grad()``.
    """

    def __init__(self, memory: SlotMemory) -> None:
        self.memory = memory

    def __len__(self) -> int:
        """n^2."""
        return self.memory.num_keys**2

    def __repr__(self) -> str:
        return f"ProductSlots({len(self):,} slots, {self.memory.frozen_count:,} frozen)"

    # ------------------------------------------------------------------------------------------- reads

    def keys(self, ids: object) -> Tensor:
        """Each slot's key per head: ``cat(subkeys[h, 0, id // n], subkeys[h, 1, id % n])``.

        Returns:
            (m, heads, key_dim), detached.

        Raises:
            InvalidArgumentError: ids that are not integers. KeyNotFoundError: an id outside [0, n^2).
        """
        ids = self._ids(ids)  # (m,)
        subkeys = self.memory.subkeys.detach()  # (heads, 2, n, key_dim / 2)
        ids = ids.to(subkeys.device)
        n = self.memory.num_keys
        first = subkeys[:, 0, ids // n]  # (heads, m, key_dim / 2)
        second = subkeys[:, 1, ids % n]  # (heads, m, key_dim / 2)
        return torch.cat([first, second], dim=-1).transpose(0, 1).contiguous()  # (m, heads, key_dim)

    def read(self, ids: object) -> SlotRecords:
        """Slots by id: keys, values and state (detached copies).

        Raises:
            InvalidArgumentError: ids that are not integers. KeyNotFoundError: an id outside [0, n^2).
        """
        ids = self._ids(ids)  # (m,)
        m = self.memory
        on = ids.to(m.values.device)
        return SlotRecords(
            ids=ids,
            keys=self.keys(ids),
            values=m.values.detach()[on].clone(),
            frozen=m.frozen[on].clone(),
            hits=m.hits[on].clone(),
            written=m.written[on].clone(),
        )

    def reached(self, inputs: Tensor) -> Reached:
        """The slots a batch of inputs reaches and with what weight (no gradient, no hits counted).

        It runs the memory's selection (:meth:`ProductKeyMemory.select`) in the memory's mode: a BatchNorm query
        norm in training mode uses the batch's statistics (and updates its running ones, as any forward).

        Args:
            inputs: (..., dim).

        Returns:
            :class:`Reached`.

        Raises:
            As the memory's forward.
        """
        with torch.no_grad():
            ids, weights = self.memory.select(inputs)  # (..., heads, k) each
        return _aggregate(ids.reshape(-1), weights.reshape(-1))

    # ------------------------------------------------------------------------------------------- edits

    def update_values(self, ids: object, values: Tensor) -> None:
        """Set the values of the given slots; their ``written`` becomes the memory's ``step``.

        A frozen slot can be edited (freezing stops training, not edits).

        Args:
            ids: m distinct slot ids.
            values: (m, value_dim) floats (a single id may take (value_dim,)).

        Raises:
            InvalidArgumentError: ids that are not integers or repeat an id, values that are not a float tensor.
            KeyNotFoundError: an id outside [0, n^2).
            DimensionMismatchError: values not (m, value_dim).
            NonFiniteError: NaN or Inf in the values.
        """
        ids = self._ids(ids)  # (m,)
        if len(torch.unique(ids)) != len(ids):
            raise InvalidArgumentError(f"expected distinct slot ids, got {len(ids) - len(torch.unique(ids))} repeats")
        m = self.memory
        if not isinstance(values, Tensor):
            raise InvalidArgumentError(f"expected values as a float torch.Tensor, got {type(values).__name__}")
        check_dense(values, "values")
        if not values.is_floating_point():
            raise InvalidArgumentError(f"expected values as a float tensor, got a tensor of {values.dtype}")
        if values.dim() == 1 and len(ids) == 1:
            values = values.unsqueeze(0)  # (1, value_dim)
        if values.shape != (len(ids), m.value_dim):
            raise DimensionMismatchError(
                f"expected values of shape ({len(ids)}, {m.value_dim}) for {len(ids)} ids, got {tuple(values.shape)}"
            )
        check_finite(values, "values")
        on = ids.to(m.values.device)
        with torch.no_grad():
            m.values[on] = values.to(m.values.device, m.values.dtype)
            m.written[on] = m.step

    def freeze(self, ids: object) -> None:
        """Freeze slots: their values get no gradient (see the module's docstring for the optimizer's step).

        Raises:
            InvalidArgumentError: ids that are not integers. KeyNotFoundError: an id outside [0, n^2).
        """
        self._set_frozen(ids, True)

    def unfreeze(self, ids: object) -> None:
        """Unfreeze slots (a slot that was not frozen stays so).

        Raises:
            InvalidArgumentError: ids that are not integers. KeyNotFoundError: an id outside [0, n^2).
        """
        self._set_frozen(ids, False)

    @property
    def frozen(self) -> Tensor:
        """The frozen slots' ids, ascending: (f,) int64 on the CPU."""
        return self.memory.frozen.nonzero().reshape(-1).cpu()

    def protect(self, optimizer: torch.optim.Optimizer) -> _Handles:
        """Keep the frozen slots' values bitwise as they are across ``optimizer.step()``, whatever the optimizer.

        A step pre-hook copies the rows frozen at that moment and a post-hook writes them back, so momentum and
        weight decay cannot move them (the gradient is already zero). The hooks hold this memory; ``remove()`` on
        the returned handle takes them off.

        Args:
            optimizer: an optimizer holding the memory's ``values`` parameter.

        Returns:
            A handle with ``remove()``.

        Raises:
            InvalidArgumentError: not an optimizer, or one that does not hold the values.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        values = self.memory.values
        held = any(p is values for group in optimizer.param_groups for p in group["params"])
        if not held:
            raise InvalidArgumentError("expected an optimizer holding this memory's values parameter, got one without")
        memory, saved = self.memory, {}

        def before(opt: Any, args: Any, kwargs: Any) -> None:
            rows = memory.frozen.nonzero().reshape(-1)  # (f,)
            saved["rows"], saved["values"] = rows, memory.values.detach()[rows].clone()  # (f,), (f, value_dim)

        def after(opt: Any, args: Any, kwargs: Any) -> None:
            with torch.no_grad():
                memory.values[saved["rows"]] = saved.pop("values")

        return _Handles(optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after))

    # ------------------------------------------------------------------------------------------- metadata

    def metadata(self, ids: object) -> list[dict[str, Any]]:
        """Each slot's metadata: ``{"hits": int, "written": int | None, "frozen": bool}``.

        Raises:
            InvalidArgumentError: ids that are not integers. KeyNotFoundError: an id outside [0, n^2).
        """
        ids = self._ids(ids)  # (m,)
        rows = self._columns()[ids].tolist()  # m x [hits, written, frozen]
        return [_metadata(*row) for row in rows]

    def where(self, where: dict[str, Any]) -> Tensor:
        """The ids of the slots whose metadata satisfies a filter, in the project's filter language.

        ``{"hits": {"$gte": 10}}``, ``{"frozen": True}``, ``{"written": None}`` (never written),
        ``{"$or": [{"$id": {"$lt": 100}}, {"written": {"$gt": 5}}]}``. The rule is
        :func:`kvsearch.metadata.filters.matches`', evaluated once per distinct metadata (once per slot when the filter
        names ``$id``).

        Returns:
            (r,) int64 on the CPU, ascending.

        Raises:
            InvalidArgumentError, UnknownOptionError, NonFiniteError: a bad filter (as ``Database.where``).
        """
        tree = check_where(where)
        columns = self._columns()  # (n^2, 3)
        if _names_id(tree):
            keep = [matches(_metadata(*row), where, id=i) for i, row in enumerate(columns.tolist())]
            return torch.tensor(keep, dtype=torch.bool).nonzero().reshape(-1)
        distinct, inverse = torch.unique(columns, dim=0, return_inverse=True)  # (d, 3), (n^2,)
        ok = torch.tensor([matches(_metadata(*row), where) for row in distinct.tolist()], dtype=torch.bool)  # (d,)
        return ok[inverse].nonzero().reshape(-1)

    # ------------------------------------------------------------------------------------------- usage

    def observe(self, ids: Tensor | None = None, weights: Tensor | None = None) -> None:
        """Add a batch's reads to the usage: the memory's last forward's by default (``last_ids``, ``last_weights``).

        Args:
            ids, weights: (..., heads, k) each, as the memory's ``select`` gives; both or neither.

        Raises:
            InvalidArgumentError: nothing given and no forward yet; one given without the other; ids that are not
                integers. KeyNotFoundError: an id outside [0, n^2). DimensionMismatchError: shapes that differ.
        """
        if (ids is None) != (weights is None):
            raise InvalidArgumentError("expected both ids and weights, or neither (the memory's last forward's)")
        if ids is None or weights is None:
            ids, weights = self.memory.last_ids, self.memory.last_weights
            if ids is None or weights is None:
                raise InvalidArgumentError("nothing to observe: the memory has run no forward yet")
        if not isinstance(weights, Tensor) or not weights.is_floating_point():
            raise InvalidArgumentError(f"expected weights as a float tensor, got {type(weights).__name__}")
        flat = self._ids(ids)  # (r,)
        if weights.numel() != len(flat) or (isinstance(ids, Tensor) and weights.shape != ids.shape):
            raise DimensionMismatchError(f"expected one weight per id, got {tuple(weights.shape)} for {len(flat)} ids")
        m = self.memory
        m.usage_weights.index_add_(0, flat.to(m.usage_weights.device), weights.detach().reshape(-1).to(m.usage_weights))
        m.usage_reads.add_(len(flat))

    def usage(self) -> Usage:
        """The fraction of slots used and the KL divergence of their use from uniform, over what was observed."""
        m = self.memory
        total = m.usage_weights.sum()
        reads = int(m.usage_reads)
        used = m.usage_weights > 0  # (n^2,)
        fraction = float(used.sum()) / len(self)
        if reads == 0 or float(total) <= 0:
            return Usage(fraction=fraction, kl=None, reads=reads)
        p = m.usage_weights[used] / total  # (u,)
        kl = float((p * torch.log(p * len(self))).sum())
        return Usage(fraction=fraction, kl=max(kl, 0.0), reads=reads)

    def reset_usage(self) -> None:
        """Forget what was observed."""
        self.memory.usage_weights.zero_()
        self.memory.usage_reads.zero_()

    # ------------------------------------------------------------------------------------------- helpers

    def _ids(self, ids: object) -> Tensor:
        """Slot ids as (m,) int64 on the CPU, each checked in [0, n^2)."""
        if isinstance(ids, Tensor):
            check_dense(ids, "ids")
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise InvalidArgumentError(f"expected slot ids as integers, got a tensor of {ids.dtype}")
            flat = ids.detach().reshape(-1).to("cpu", torch.long)  # (m,)
        elif isinstance(ids, (int, np.integer)) or (isinstance(ids, Sequence) and not isinstance(ids, (str, bytes))):
            items = [ids] if isinstance(ids, (int, np.integer)) else list(ids)
            if not all(isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)) for i in items):
                raise InvalidArgumentError(f"expected slot ids as ints, got {ids!r:.80}")
            size = len(self)
            bad = [int(i) for i in items if not 0 <= i < size]  # before a tensor: an int past int64 overflows it
            if bad:
                raise KeyNotFoundError(f"expected slot ids in [0, {size:,}), got {bad[:5]}")
            flat = torch.tensor([int(i) for i in items], dtype=torch.long)  # (m,)
        else:
            raise InvalidArgumentError(f"expected slot ids as an int, ints or an integer tensor, got {ids!r:.80}")
        size = len(self)
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= size):
            bad = flat[(flat < 0) | (flat >= size)]
            raise KeyNotFoundError(f"expected slot ids in [0, {size:,}), got {bad[:5].tolist()}")
        return flat

    def _set_frozen(self, ids: object, value: bool) -> None:
        ids = self._ids(ids)  # (m,)
        self.memory.frozen[ids.to(self.memory.frozen.device)] = value
        self.memory.sync_frozen()

    def _columns(self) -> Tensor:
        """Every slot's metadata as numbers: (n^2, 3) int64 columns hits, written, frozen, on the CPU."""
        m = self.memory
        return torch.stack([m.hits, m.written, m.frozen.long()], dim=1).cpu()  # (n^2, 3)


class _Handles:
    """The step hooks of :meth:`ProductSlots.protect`: ``remove()`` takes both off."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _metadata(hits: int, written: int, frozen: int) -> dict[str, Any]:
    return {"hits": hits, "written": None if written < 0 else written, "frozen": bool(frozen)}


def _names_id(node: tuple) -> bool:
    """Whether a checked filter tree (:func:`check_where`'s) has a condition on ``$id``."""
    if node[0] == "cond":
        return node[1].part == "id"
    if node[0] == "not":
        return _names_id(node[1])
    return any(_names_id(sub) for sub in node[1])


def _aggregate(ids: Tensor, weights: Tensor) -> Reached:
    """Reads (r,) ids with their weights summed per distinct id."""
    distinct, inverse = torch.unique(ids, return_inverse=True)  # (d,), (r,)
    summed = torch.zeros(len(distinct), dtype=torch.float64, device=ids.device)
    summed.index_add_(0, inverse, weights.double())  # (d,)
    reads = torch.bincount(inverse, minlength=len(distinct))  # (d,)
    return Reached(ids=distinct.cpu(), weights=summed.cpu(), reads=reads.cpu())
