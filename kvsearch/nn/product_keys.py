"""The :class:`ProductKeyMemory` layer: a memory of n^2 learned (key, value) slots read through product keys.

    memory = ProductKeyMemory(512, num_keys=128, heads=4, k=32)   # 16,384 slots
    output = memory(x)                     # (..., 512) -> (..., value_dim); memory.last_ids, memory.last_weights
    memory.slots.freeze(ids)               # the slots as records: see kvsearch.nn.product_slots
    memory = ProductKeyMemory(512, num_keys=128, folder="runs/memory")   # saved there as generations:
    memory.save(); memory.rollback()       # see kvsearch.storage.memory_folder

Lample et al. 2019 ("Large Memory Layers with Product Keys"; facebookresearch/XLM ``HashingMemory``), as in
lucidrains' ``product-key-memory``: per head a query (a linear map of the input, then normalised) is split in two
halves, each scored against its own n sub-keys; the top-k of each half give k^2 candidate slots whose score is the
sum of their halves' scores; the top-k of those are exactly the top-k of all n^2 concatenated keys
(:func:`product_topk`), at O(n + k^2) scores per query instead of O(n^2). Softmax weights read the values with
``torch.nn.functional.embedding_bag`` (``sparse=True``: sparse gradients for the values), summed over the heads.

It owns the layer (its parameters, the per-slot state as buffers, the forward and its torch conventions), the exact
product top-k, and the parameter groups that train the values at their own learning rate. What the slots are as
records (reads by id, edits, freezing, metadata, usage) is :mod:`kvsearch.nn.product_slots`; this module hands it the
layer. It knows nothing of FAISS, SQLite, text or files: everything that defines a memory is its ``config`` and its
``state_dict()`` (parameters and buffers), which a folder can save. ``folder=`` is opened by the opener that
:mod:`kvsearch.storage.memory_folder` registers with :func:`register_folder_opener` when kvsearch is imported (``nn/``
is below ``storage/`` and imports nothing of it); the memory keeps the handle it returns (typed here by
:class:`SavedMemoryFolder`) and hands itself to its ``save`` / ``rollback``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsearch.checks import check_dim, check_finite, check_fits, check_int, check_k, check_path
from kvsearch.errors import (
    DatabaseNotFoundError,
    DimensionMismatchError,
    InvalidArgumentError,
    NothingToRollBackError,
    NotSupportedError,
)
from kvsearch.nn.precision import autocast_dtype, compute_dtype, full_precision, host_reads, output_dtype
from kvsearch.nn.product_slots import ProductSlots
from kvsearch.nn.scores import check_float_tensor, check_option, describe

__all__ = [
    "ProductKeyMemory",
    "product_topk",
    "memory_param_groups",
    "register_folder_opener",
    "SavedMemoryFolder",
    "QUERY_NORMS",
]

QueryNorm = Literal["layernorm", "batchnorm"] | None
#: The query normalisations: LayerNorm over each half of each head's query (lucidrains' default: per input, so it
#: keeps a causal model causal and a batch of one answers as in a batch), BatchNorm over every head's query (the PKM
#: paper's, which reports that it raises the slots' usage; it mixes the inputs of a training batch), or none.
QUERY_NORMS = ("layernorm", "batchnorm", "none")
#: The most slots a memory may have (n^2 < 2^31 keeps every id an int32 too; far past the papers' 1M-4M).
MAX_SLOTS = 2**31 - 1


class SavedMemoryFolder(Protocol):
    """What a memory made with ``folder=`` keeps of its folder (``kvsearch.storage.memory_folder.MemoryFolder``)."""

    generation: int  # the generation the memory holds (0: none saved yet)

    def save(self, memory: Any) -> int: ...

    def rollback(self, memory: Any) -> int: ...


#: ``opener(path, memory) -> folder``: loads what the folder holds into the new memory (or makes the folder).
FolderOpener = Callable[[str | os.PathLike[str], Any], SavedMemoryFolder]
#: ``read_config(path) -> config``: the options of the memory saved in a folder, None where none is saved.
ConfigReader = Callable[[str | os.PathLike[str]], "dict[str, Any] | None"]
_openers: list[tuple[FolderOpener, ConfigReader]] = []  # the registered opener (the last one counts)


def register_folder_opener(opener: FolderOpener, read_config: ConfigReader) -> None:
    """Set how ``ProductKeyMemory(folder=...)`` and :meth:`ProductKeyMemory.open` open a folder:
    ``kvsearch.storage.memory_folder`` registers ``MemoryFolder.open`` and ``saved_config`` when kvsearch is imported
    (this module cannot import it: ``nn/`` is below ``storage/``).

    Args:
        opener: ``opener(path, memory)`` -> the folder's handle, after loading the saved memory into ``memory``.
        read_config: ``read_config(path)`` -> the saved memory's options (None: none saved there).
    """
    _openers.append((opener, read_config))


def _registered() -> tuple[FolderOpener, ConfigReader]:
    if not _openers:
        raise NotSupportedError("a ProductKeyMemory folder needs kvsearch imported: it registers the opener")
    return _openers[-1]


def product_topk(queries: Tensor, subkeys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The exact top-k of every head's query over the n^2 product keys: scores and slot ids, best first.

    Slot ``a * n + b`` has the key ``cat(subkeys[h, 0, a], subkeys[h, 1, b])`` for head h, so its score is
    ``q1 . subkeys[h, 0, a] + q2 . subkeys[h, 1, b]`` (q1, q2 the halves of the head's query). A slot in the top-k
    has its first half among its half's top-k (else k better first halves, each with the same second half, would beat
    it) and its second half likewise: the top-k of the k^2 sums of the halves' top-k are the top-k of all n^2 scores
    (ties between equal scores aside, broken as ``torch.topk`` breaks them).

    Args:
        queries: (m, heads, key_dim), key_dim even.
        subkeys: (heads, 2, n, key_dim // 2).
        k: at most n.

    Returns:
        scores (m, heads, k) (differentiable in the queries and the sub-keys) and ids (m, heads, k), int64 in
        [0, n^2).
    """
    m, heads, key_dim = queries.shape
    n = subkeys.shape[2]
    halves = queries.reshape(m, heads, 2, key_dim // 2)  # (m, heads, 2, key_dim / 2)
    half_scores = torch.einsum("mhpd,hpnd->mhpn", halves, subkeys)  # (m, heads, 2, n)
    best, best_ids = half_scores.topk(k, dim=-1)  # (m, heads, 2, k) each
    first, second = best.unbind(2)  # (m, heads, k) each: one stack in the backward, not two zero-filled selects
    first_ids, second_ids = best_ids.unbind(2)  # (m, heads, k) each
    sums = first[..., :, None] + second[..., None, :]  # (m, heads, k, k)
    pair_ids = first_ids[..., :, None] * n + second_ids[..., None, :]  # (m, heads, k, k)
    scores, which = sums.reshape(m, heads, k * k).topk(k, dim=-1)  # (m, heads, k) each
    ids = pair_ids.reshape(m, heads, k * k).gather(-1, which)  # (m, heads, k)
    return scores, ids


class ProductKeyMemory(nn.Module):
    """A memory layer of ``num_keys ** 2`` learned slots: inputs (..., dim) -> output (..., value_dim).

    Per head, ``query_map`` (a linear map without bias: the norm after it has its own shift) makes a query of
    ``key_dim`` numbers, normalised by ``query_norm`` ("layernorm", the default: one ``nn.LayerNorm(key_dim / 2)``
    over each half of each head's query, as lucidrains' default; "batchnorm": ``nn.BatchNorm1d`` over all heads'
    queries, as the PKM paper and XLM; None: none). :func:`product_topk` finds its exact top-k slots; their softmax
    weights read the values with ``embedding_bag`` and the heads' reads are summed.
    The heads share one value table (as the paper, XLM and lucidrains): a slot id names one value whichever head
    reaches it, and each head has its own sub-keys, so a slot has one key per head.

    Parameters and buffers (all in ``state_dict()``):

    - ``query_map.weight`` (heads * key_dim, dim): ``nn.Linear``'s default init; the norm's affine parameters.
    - ``subkeys`` (heads, 2, n, key_dim / 2): uniform in +-1 / sqrt(key_dim / 2), as XLM's ``get_uniform_keys``.
    - ``values`` (n^2, value_dim): normal with std value_dim^-1/2, as XLM and lucidrains.
    - ``frozen`` (n^2,) bool: slots whose values get no gradient (:attr:`slots`' ``freeze``).
    - ``hits`` (n^2,) int64: how often each slot was among a query's top-k for one head, in training forwards.
    - ``written`` (n^2,) int64: the ``step`` at which each slot's value was last written (-1: never): by a training
      forward that reached it and it not frozen (its value got a gradient), or by ``slots.update_values``.
    - ``step`` () int64: the training forwards so far (a forward in training mode with grad enabled adds one).

    A training forward (``self.training`` and grad enabled) adds to ``hits`` and ``written`` and one to ``step``
    (a forward that activation checkpointing runs again counts again); any other forward changes no state (beyond a
    BatchNorm's running statistics in training mode).
    ``last_ids`` / ``last_weights`` (detached, (..., heads, k)) hold the last forward's slots and softmax weights.

    Under ``torch.autocast`` (CPU bfloat16, CUDA float16 / bfloat16) the query map runs in the autocast dtype; the
    norm, the scores, the top-k, the softmax and the weighted sum of the values run in float32 with autocast off (as
    fused ``scaled_dot_product_attention`` does), the output comes out in the autocast dtype and ``last_weights`` in
    float32. Without autocast everything runs in the module's dtype, which the inputs must have.

    On the CPU in eager mode the inputs are checked for NaN / Inf (:class:`~kvsearch.errors.NonFiniteError`); on a
    GPU and under ``torch.compile`` nothing is read back to the host (a NaN input gives a NaN output). The forward
    compiles with ``fullgraph=True`` (no graph break), except with ``sparse=True``: torch cannot trace
    ``embedding_bag``'s sparse backward, so the read of the values runs eagerly there (one graph break, as
    ``torch.compiler.disable``; the selection around it compiles). ``copy.deepcopy``,
    pickling (``torch.save(module)``) and DDP treat it as any module: its state is its parameters and buffers. DDP's
    default ``broadcast_buffers=True`` copies rank 0's ``hits`` / ``written`` / ``step`` / ``frozen`` to every rank
    at each forward: freeze and edit slots on every rank alike.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_keys: int,
        heads: int = 4,
        k: int = 32,
        key_dim: int = 256,
        value_dim: int | None = None,
        query_norm: QueryNorm = "layernorm",
        sparse: bool = False,
        folder: str | os.PathLike[str] | None = None,
    ) -> None:
        """Check the options and create the parameters (drawn from torch's global generator, as ``nn.Linear``).

        With ``folder=``, the memory is saved there as generations (:meth:`save`, :meth:`rollback`; the files and
        their crash safety: :mod:`kvsearch.storage.memory_folder`). A folder that holds a saved memory is loaded:
        the memory is the saved one bit for bit (parameters, buffers, their dtypes), at its :attr:`generation`;
        its options must be the ones given (``sparse`` aside). An absent or empty folder is made, and nothing is
        saved in it until :meth:`save` (generation 0 until then).

        Args:
            dim: the inputs' last dimension.
            num_keys: n, the sub-keys per half and head; the memory has n^2 slots.
            heads: the query heads (each with its own sub-keys; the values are shared).
            k: the slots each head reads per input (at most n).
            key_dim: each head's query (an even number: two halves of key_dim / 2); 256 as XLM and lucidrains.
            value_dim: the values' and the output's dimension (default ``dim``).
            query_norm: "layernorm", "batchnorm" or None (see :data:`QUERY_NORMS`).
            sparse: sparse gradients for the values (``embedding_bag(sparse=True)``: for an optimizer that takes
                them, ``torch.optim.SparseAdam`` or SGD).
            folder: a folder to save the memory in and load it from (None: none).

        Raises:
            InvalidArgumentError: a dim, num_keys, heads, k, key_dim or value_dim that is not a positive integer in
                range, an odd key_dim, k > num_keys, n^2 past :data:`MAX_SLOTS`, a sparse that is not a bool.
            UnknownOptionError: an unknown query_norm.
            MemoryLimitError: the values do not fit in the memory this process may use.
            ConfigMismatchError: the folder holds a memory of other options (the message names them).
            WrongKindError, ForeignFolderError: the folder holds a database, or files that are not a memory's.
            CorruptDatabaseError: the folder's manifest or current generation is damaged.
            StorageError: an absent folder that cannot be made (DiskFullError, ReadOnlyDatabaseError).
        """
        super().__init__()
        check_path(folder)
        dim = check_dim(dim)
        n = check_int(num_keys, "num_keys", 1, math.isqrt(MAX_SLOTS))
        heads = check_int(heads, "heads", 1, 4096)
        k = check_k(k)
        if k > n:
            raise InvalidArgumentError(f"expected k <= num_keys ({n}): each half's top-k is of n sub-keys, got k={k}")
        key_dim = check_dim(key_dim, "key_dim")
        if key_dim % 2:
            raise InvalidArgumentError(f"expected an even key_dim (two halves), got {key_dim}")
        value_dim = dim if value_dim is None else check_dim(value_dim, "value_dim")
        norm = check_option("none" if query_norm is None else query_norm, QUERY_NORMS, "query_norm")
        if not isinstance(sparse, bool):
            raise InvalidArgumentError(f"expected sparse as a bool, got {describe(sparse)}")
        slots = n * n
        check_fits(slots * value_dim * 4 * 2, f"a ProductKeyMemory of {slots:,} slots x {value_dim} values")
        self.dim, self.num_keys, self.heads, self.k = dim, n, heads, k
        self.key_dim, self.value_dim, self.query_norm, self.sparse = key_dim, value_dim, query_norm, sparse

        self.query_map = nn.Linear(dim, heads * key_dim, bias=False)
        self.norm: nn.Module = (
            nn.BatchNorm1d(heads * key_dim)
            if norm == "batchnorm"
            else nn.LayerNorm(key_dim // 2)
            if norm == "layernorm"
            else nn.Identity()
        )
        half = key_dim // 2
        bound = 1.0 / math.sqrt(half)
        self.subkeys = nn.Parameter(torch.empty(heads, 2, n, half).uniform_(-bound, bound))
        self.values = nn.Parameter(torch.empty(slots, value_dim).normal_(0.0, value_dim**-0.5))
        self.register_buffer("frozen", torch.zeros(slots, dtype=torch.bool))
        self.register_buffer("hits", torch.zeros(slots, dtype=torch.long))
        self.register_buffer("written", torch.full((slots,), -1, dtype=torch.long))
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        # usage over a stream of observed batches (slots.observe / usage / reset_usage): a measurement, not state
        self.register_buffer("usage_weights", torch.zeros(slots, dtype=torch.float64), persistent=False)
        self.register_buffer("usage_reads", torch.zeros((), dtype=torch.long), persistent=False)
        #: How many slots ``frozen`` holds, kept on the host so that the forward never reads it back: recounted by
        #: :meth:`sync_frozen` (the slots' freeze / unfreeze, ``load_state_dict``).
        self.frozen_count = 0
        self.register_load_state_dict_post_hook(_recount_frozen)
        self.last_ids: Tensor | None = None
        self.last_weights: Tensor | None = None
        #: The folder the memory is saved in (None: none): a resource, not state (never in ``state_dict()``; a deep
        #: copy shares it).
        self.folder: SavedMemoryFolder | None = None
        if folder is not None:
            self.folder = _registered()[0](folder, self)

    @classmethod
    def open(cls, folder: str | os.PathLike[str]) -> ProductKeyMemory:
        """Reopen the memory saved in ``folder`` with the options it was saved with (its current generation).

        Args:
            folder: a folder a memory was saved in (:meth:`save`).

        Returns:
            The memory, bit for bit the saved one, holding the folder (``save`` / ``rollback`` go on from there).

        Raises:
            DatabaseNotFoundError: no memory is saved in ``folder`` (absent, empty, or nothing saved yet).
            WrongKindError, ForeignFolderError, CorruptDatabaseError: as ``ProductKeyMemory(folder=...)``.
        """
        check_path(folder, optional=False)
        config = _registered()[1](folder)
        if config is None:
            raise DatabaseNotFoundError(
                f"expected a folder holding a saved ProductKeyMemory, got {os.fspath(folder)!r} with none saved "
                "(make one with ProductKeyMemory(..., folder=PATH) and save())"
            )
        return cls(**config, folder=folder)

    @property
    def generation(self) -> int | None:
        """The folder's generation this memory holds (0: none saved yet), or None without a folder."""
        return None if self.folder is None else self.folder.generation

    def save(self) -> int:
        """Save the memory in its folder as a new generation and switch to it (the previous one kept for a rollback).

        Returns:
            The new generation.

        Raises:
            NotSupportedError: a memory made without ``folder=``.
            NonFiniteError: a parameter or buffer holds NaN or Inf (nothing is written).
            StoreChangedError: another handle saved or rolled back the folder since (nothing is written).
            DatabaseLockedError, DiskFullError, ReadOnlyDatabaseError: as a database's writes.
        """
        if self.folder is None:
            raise NotSupportedError(
                "expected a memory made with folder=... to save: this one has none (make it with "
                "ProductKeyMemory(..., folder=PATH), or save its state_dict() with torch.save)"
            )
        return self.folder.save(self)

    def rollback(self) -> int:
        """Return to the generation before the current one: the folder switches back and the memory loads it.

        Returns:
            The generation now current.

        Raises:
            NothingToRollBackError: no folder, or no previous generation (none, or already rolled back).
            StoreChangedError, CorruptDatabaseError, DatabaseLockedError, StorageError: as :meth:`save`; nothing
                changes.
        """
        if self.folder is None:
            raise NothingToRollBackError("expected a memory made with folder=... to roll back: this one has none")
        return self.folder.rollback(self)

    @property
    def num_slots(self) -> int:
        """n^2, the number of slots."""
        return self.num_keys * self.num_keys

    @property
    def config(self) -> dict[str, Any]:
        """The constructor's arguments: ``ProductKeyMemory(**memory.config)`` makes a memory of the same shapes, which
        ``load_state_dict(memory.state_dict())`` makes the same memory."""
        return {
            "dim": self.dim,
            "num_keys": self.num_keys,
            "heads": self.heads,
            "k": self.k,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "query_norm": self.query_norm,
            "sparse": self.sparse,
        }

    @property
    def slots(self) -> ProductSlots:
        """The n^2 slots as records: read by id, edit, freeze, metadata, usage (:class:`ProductSlots`)."""
        return ProductSlots(self)

    def sync_frozen(self) -> None:
        """Recount :attr:`frozen_count` from the ``frozen`` buffer (a host read): after editing the buffer by hand."""
        self.frozen_count = int(self.frozen.sum())

    def forward(self, inputs: Tensor) -> Tensor:
        """Read the memory: each input's heads find their top-k slots and blend their values.

        Args:
            inputs: (..., dim).

        Returns:
            Output (..., value_dim): in the autocast dtype under autocast, else the module's dtype.

        Raises:
            InvalidArgumentError: inputs that are not a dense floating-point tensor, or (without autocast) not of the
                module's dtype.
            DimensionMismatchError: the last dimension is not ``dim``.
            NonFiniteError: NaN or Inf in the inputs (where values are read back: on the CPU, in eager mode).
        """
        ids, weights = self.select(inputs)  # (..., heads, k) each
        lead = ids.shape[:-2]
        rows = ids.reshape(-1, self.heads * self.k)  # (m, heads * k): one bag per input, every head in it
        frozen = self.frozen if self.frozen_count else None
        amp = autocast_dtype(inputs.device)
        with full_precision(inputs.device, amp):
            read = _read_sparse if self.sparse else _read  # sparse: eager, a graph break under torch.compile
            output = read(rows, weights.reshape(rows.shape), self.values, frozen, self.sparse)  # (m, value_dim)
        output = output.to(output_dtype(output.dtype, amp))  # (m, value_dim)
        if self.training and torch.is_grad_enabled():
            self._count(rows)
        self.last_ids = ids.detach()  # (..., heads, k)
        self.last_weights = weights.detach()  # (..., heads, k)
        return output.reshape(*lead, self.value_dim)  # (..., value_dim)

    def select(self, inputs: Tensor) -> tuple[Tensor, Tensor]:
        """Each input's slots and weights, per head, without reading the values (and without counting hits).

        Args:
            inputs: (..., dim).

        Returns:
            ids (..., heads, k) int64 and softmax weights (..., heads, k), best first, differentiable in the inputs,
            the query map, the norm and the sub-keys (float32 under autocast, else the module's dtype).

        Raises:
            As :meth:`forward`.
        """
        self._check_inputs(inputs)
        lead = inputs.shape[:-1]
        flat = inputs.reshape(-1, self.dim)  # (m, dim)
        queries = self.query_map(flat)  # (m, heads * key_dim), in the autocast dtype under autocast
        amp = autocast_dtype(inputs.device)
        with full_precision(inputs.device, amp):
            queries = queries.to(compute_dtype(self.subkeys.dtype, amp))  # (m, heads * key_dim)
            if isinstance(self.norm, nn.LayerNorm):  # each half of each head's query
                queries = self.norm(queries.view(-1, self.heads, 2, self.key_dim // 2))  # (m, heads, 2, key_dim / 2)
            else:
                queries = self.norm(queries)  # (m, heads * key_dim)
            queries = queries.reshape(-1, self.heads, self.key_dim)  # (m, heads, key_dim)
            scores, ids = product_topk(queries, self.subkeys.to(queries.dtype), self.k)  # (m, heads, k) each
            weights = scores.softmax(dim=-1)  # (m, heads, k)
        return ids.view(*lead, self.heads, self.k), weights.view(*lead, self.heads, self.k)

    def param_groups(self, lr: float, value_lr: float, **options: float) -> list[dict[str, Any]]:
        """This memory's parameters in two groups: :func:`memory_param_groups` of the memory alone."""
        return memory_param_groups(self, lr=lr, value_lr=value_lr, **options)

    def _check_inputs(self, inputs: Tensor) -> None:
        check_float_tensor(inputs, "inputs")
        if inputs.dim() < 1 or inputs.shape[-1] != self.dim:
            raise DimensionMismatchError(f"expected inputs of shape (..., {self.dim}), got {tuple(inputs.shape)}")
        dtype = self.query_map.weight.dtype
        if inputs.dtype != dtype and autocast_dtype(inputs.device) is None:
            raise InvalidArgumentError(
                f"expected inputs of the memory's dtype {dtype} (or torch.autocast), got {describe(inputs)}"
            )
        if isinstance(self.norm, nn.BatchNorm1d) and self.training and inputs.numel() == self.dim:
            raise InvalidArgumentError(
                "query_norm='batchnorm' in training mode needs more than one input per call (batch statistics), "
                f"got inputs of shape {tuple(inputs.shape)}: use eval mode, a larger batch or query_norm='layernorm'"
            )
        if host_reads(inputs.device):
            check_finite(inputs, "inputs")

    @torch.no_grad()
    def _count(self, rows: Tensor) -> None:
        """A training forward's bookkeeping: the reached slots' hits and written step (the unfrozen ones), step+1."""
        # broadcast numbers, index_select and scatter_: no (m * heads * k,) tensor filled and no parallel region on
        # the CPU (each one a scheduling wait on a loaded machine); the frozen slots looked up only when there are any
        ids = rows.reshape(-1)  # (m * heads * k,)
        self.step.add_(1)
        self.hits.index_add_(0, ids, ids.new_ones(()).expand(ids.shape))
        written = self.step.expand(ids.shape)  # (m * heads * k,)
        if self.frozen_count:
            written = torch.where(self.frozen.index_select(0, ids), self.written.index_select(0, ids), written)
        self.written.scatter_(0, ids, written)

    def extra_repr(self) -> str:
        """The options, for ``repr``."""
        return ", ".join(f"{name}={value!r}" for name, value in self.config.items())


def _read(rows: Tensor, weights: Tensor, values: Tensor, frozen: Tensor | None, sparse: bool) -> Tensor:
    """The weighted sum of each bag's values, (m, heads * k) rows and weights -> (m, value_dim); the frozen slots'
    rows (when any are) get no gradient (:class:`_FrozenRows`)."""
    if frozen is not None:
        values = _FrozenRows.apply(values, frozen)  # (n^2, value_dim)
    return F.embedding_bag(rows, values, per_sample_weights=weights.to(values.dtype), mode="sum", sparse=sparse)


# sparse gradients do not trace (torch 2.13's embedding_bag backward fails on fake tensors): that read runs eagerly;
# torch.compiler.disable, imported at the first call (decorating at import would import torch._dynamo everywhere)
_read_sparse = torch._disable_dynamo(_read)


def _recount_frozen(module: nn.Module, incompatible_keys: Any) -> None:
    """``load_state_dict``'s post hook: the loaded ``frozen`` buffer recounted on the host."""
    module.sync_frozen()  # type: ignore[operator]


class _FrozenRows(torch.autograd.Function):
    """The values as they are, whose gradient loses the frozen slots' rows: a dense gradient gets zeros there, a
    sparse one (``sparse=True``) drops their entries, so that an optimizer of sparse gradients (SparseAdam) never
    touches those rows at all."""

    @staticmethod
    def forward(values: Tensor, frozen: Tensor) -> Tensor:
        return values.view_as(values)  # (n^2, value_dim)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (frozen,) = ctx.saved_tensors  # (n^2,)
        if grad.is_sparse:
            indices, rows = grad._indices(), grad._values()  # (1, nnz), (nnz, value_dim): uncoalesced
            keep = ~frozen[indices[0]]  # (nnz,)
            kept = torch.sparse_coo_tensor(indices[:, keep], rows[keep], grad.shape, check_invariants=False)
            return kept, None  # (n^2, value_dim), sparse
        return grad.masked_fill(frozen.unsqueeze(-1), 0), None  # (n^2, value_dim)


def memory_param_groups(
    model: nn.Module,
    *,
    lr: float,
    value_lr: float,
    weight_decay: float = 0.0,
    value_weight_decay: float = 0.0,
) -> list[dict[str, Any]]:
    """A model's parameters in two optimizer groups: every :class:`ProductKeyMemory`'s values, and the rest.

    The papers train the values at a higher learning rate than the rest of the model (lucidrains'
    ``fetch_optimizer_parameters`` does the same split). Weight decay on the values is 0 by default: a dense
    optimizer's decay shrinks every row at every step, read or not.

        optimizer = torch.optim.AdamW(memory_param_groups(model, lr=1e-3, value_lr=1e-2))

    Args:
        model: any module (a memory itself, or a model holding memories).
        lr, weight_decay: the other parameters'.
        value_lr, value_weight_decay: the values'.

    Returns:
        ``[{"params": others, "lr": lr, "weight_decay": ...}, {"params": values, "lr": value_lr, ...}]`` (the values'
        group is left out when the model holds no memory; the other group when it holds nothing else).

    Raises:
        InvalidArgumentError: a model that is not a module; a learning rate or weight decay that is not a finite
            number >= 0.
    """
    if not isinstance(model, nn.Module):
        raise InvalidArgumentError(f"expected model as a torch.nn.Module, got {type(model).__name__}")
    for name, number in (("lr", lr), ("value_lr", value_lr), ("weight_decay", weight_decay)):
        _check_rate(number, name)
    _check_rate(value_weight_decay, "value_weight_decay")
    values = [m.values for m in model.modules() if isinstance(m, ProductKeyMemory)]
    taken = {id(p) for p in values}
    others = [p for p in model.parameters() if id(p) not in taken]
    groups = []
    if others:
        groups.append({"params": others, "lr": float(lr), "weight_decay": float(weight_decay)})
    if values:
        groups.append({"params": values, "lr": float(value_lr), "weight_decay": float(value_weight_decay)})
    return groups


def _check_rate(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidArgumentError(f"expected {name} as a finite number >= 0, got {value!r}")
