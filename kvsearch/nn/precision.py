"""Mixed precision, ``torch.compile`` and ``torch.func.vmap`` for the attention math: which dtype it runs in and comes
out in, and whether the checks that read numbers back to the host run.

    amp = autocast_dtype(queries.device)          # torch.bfloat16 inside torch.autocast("cpu"), else None
    with full_precision(queries.device, amp):     # autocast off: scores, pooling and the blend in float32
        ...
    output = output.to(output_dtype(dtype, amp))  # the autocast dtype, as matmul-like ops give under autocast

The rule is fused ``scaled_dot_product_attention``'s: under autocast the scores, the pooling and the weighted sum
run in float32 (float64 inputs stay float64, which autocast never casts), and the output comes out in the autocast
dtype; weights stay in the computing dtype. Without autocast nothing changes: the inputs' promoted dtype.

It also owns the rule of when code may read a tensor's values back to the host (:func:`host_reads`): on the CPU,
where nothing waits; never under ``torch.compile``, nor inside ``torch.func.vmap`` (:func:`vmapping`: a batched
tensor has no one value to read); never on an accelerator, where ``bool(t)`` or ``t.item()`` waits for the device to
finish its queue (a host-device sync in each step of a model) -- the hot paths (``KVAttention`` forward + backward,
the candidates a database gathers, the exact index's scan) take a form that reads nothing back there; and nowhere
inside :func:`sync_free`, which runs that form on the CPU too (the tests that check it, on machines without a GPU).

It knows nothing of scores, pooling, candidates, FAISS, SQLite or text.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = [
    "autocast_dtype",
    "compute_dtype",
    "output_dtype",
    "full_precision",
    "autocast_off",
    "eager_checks",
    "host_reads",
    "sync_free",
    "functorch_transformed",
    "vmapping",
]

_SYNC_FREE: contextvars.ContextVar[bool] = contextvars.ContextVar("kvsearch_sync_free", default=False)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives matmul-like ops on ``device``'s type, or None where autocast is off there."""
    kind = device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except RuntimeError:  # a device type autocast does not know ("meta")
        return None
    return torch.get_autocast_dtype(kind) if enabled else None


def compute_dtype(dtype: torch.dtype, amp: torch.dtype | None) -> torch.dtype:
    """The dtype the attention math runs in: the inputs' promoted ``dtype``, at least float32 under autocast."""
    return dtype if amp is None else torch.promote_types(dtype, torch.float32)


def output_dtype(dtype: torch.dtype, amp: torch.dtype | None) -> torch.dtype:
    """The output's dtype: the autocast dtype under autocast (float64 math stays float64), else ``dtype``."""
    return dtype if amp is None or dtype == torch.float64 else amp


def full_precision(device: torch.device, amp: torch.dtype | None) -> contextlib.AbstractContextManager:
    """A context with autocast off for ``device``'s type where it is on (``amp`` not None); else does nothing."""
    return contextlib.nullcontext() if amp is None else torch.autocast(device.type, enabled=False)


def autocast_off(*devices: torch.device) -> contextlib.ExitStack:
    """A context with autocast off for each of these devices' types where it is on: an exact search scores in the
    dtype it chose, not in autocast's (eager code only; :func:`full_precision` is the one ``torch.compile`` traces).
    """
    stack = contextlib.ExitStack()
    for kind in dict.fromkeys(device.type for device in devices):
        if autocast_dtype(torch.device(kind)) is not None:
            stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


def functorch_transformed() -> bool:
    """Whether this runs inside any ``torch.func`` transform (``vmap``, ``grad``, ``jvp``, ``jacrev``, ...); False
    while ``torch.compile`` traces (it traces the transforms itself)."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def vmapping() -> bool:
    """Whether this runs inside ``torch.func.vmap`` (or a transform built on it: ``jacrev``'s backward, ``jacfwd``,
    ``hessian``), at any level: there a tensor's values cannot be read on the host (``.item()`` raises). False
    while ``torch.compile`` traces (it reads nothing back either; a vmap it cannot trace runs eagerly)."""
    return not torch.compiler.is_compiling() and _in_vmap()


_transforms_active = torch._C._are_functorch_transforms_active  # a C function: False where no torch.func runs


def _in_vmap() -> bool:
    """:func:`vmapping` for a caller that knows it is not compiling: ~40 ns where no transform runs."""
    if not _transforms_active():  # the common case: no transform at all
        return False
    stack = torch._C._functorch.get_interpreter_stack() or ()
    return any(level.key() == torch._C._functorch.TransformType.Vmap for level in stack)


def eager_checks() -> bool:
    """Whether the checks that read tensor values on the host (NaN, Inf, overflow) run: not under ``torch.compile``,
    not under ``torch.func.vmap``.

    A compiled graph does not stop to look at its numbers, as torch's own ops do not: a compiled model is not
    checked for non-finite inputs or overflow (the database still checks the queries it searches with). Under vmap a
    number cannot be read at all: a vmapped ``attend`` is not checked either (its options and shapes are).
    """
    return not torch.compiler.is_compiling() and not (_transforms_active() and _in_vmap())


def host_reads(device: torch.device) -> bool:
    """Whether code may read tensor values on ``device`` back to the host (``bool(t)``, ``t.item()``, ``t.cpu()``)
    to check or branch on them: on the CPU, in eager mode, outside :func:`sync_free` and :func:`vmapping`; never on an
    accelerator.

    On a GPU a read waits for every kernel queued before it (a host-device synchronisation): in a model's step the
    host would stop feeding the device. There the layer's hot path reads nothing back: NaN / Inf queries and
    overflowing scores are not looked for (torch's own ops do not look either; the output holds NaN), the exact
    index orders ties by id among a fixed number of extra candidates, candidates stay on the device.
    """
    if torch.compiler.is_compiling() or device.type != "cpu" or _SYNC_FREE.get():
        return False
    return not (_transforms_active() and _in_vmap())  # no frame of ours where no torch.func transform runs


@contextlib.contextmanager
def sync_free() -> Iterator[None]:
    """A context in which :func:`host_reads` is False on every device: the CPU runs the form of the hot paths that an
    accelerator runs (nothing read back to the host), so that a machine without a GPU can check that form."""
    token = _SYNC_FREE.set(True)
    try:
        yield
    finally:
        _SYNC_FREE.reset(token)
