"""Row buffers for the store's in-memory tensors, with room to grow: a large one grows without being copied.

The in-memory keys and values are views of the first n rows of a buffer with more rows (:func:`row_buffer`), so
that an append writes the new rows only. A plain tensor with an eighth more rows must be copied whole when it
fills up: for a moment both copies are in memory (twice the store). A buffer of :data:`RESERVE_FROM_BYTES` or
more on the CPU is therefore anonymous memory reserved for as many rows as the machine's memory could hold
(``mmap`` with ``MAP_NORESERVE``): the kernel gives it pages only as rows are written, so it grows to any size
the machine can hold without a copy, and costs address space, not memory. Where such a reservation is refused
(another OS, strict overcommit) the buffer is a plain tensor, as for a GPU or a small store.
"""

from __future__ import annotations

import mmap
import os
import platform
import sys

import torch
from torch import Tensor

__all__ = ["RESERVE_FROM_BYTES", "row_buffer"]

#: Buffers of at least this many bytes on the CPU are reserved, not allocated (see the module docstring). A
#: reservation costs address space only (as much as the machine's memory), so all but small stores take one: a
#: reader catching up on a writer's appends then never copies its mirror to grow (50k x 384: ~2 ms a catch-up).
RESERVE_FROM_BYTES = 16 << 20


def _memory_bytes() -> int:
    """The machine's physical memory in bytes (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _no_reserve_flag() -> int | None:
    """``MAP_NORESERVE``: from mmap (Python 3.13+), else Linux's value on x86-64 and arm64; None elsewhere."""
    if hasattr(mmap, "MAP_NORESERVE"):
        return mmap.MAP_NORESERVE
    if sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        return 0x4000  # <asm-generic/mman-common.h>
    return None


def _reserved(rows: int, width: int, dtype: torch.dtype) -> Tensor | None:
    """A (rows, width) tensor on reserved anonymous memory, or None where the OS refuses it."""
    no_reserve = _no_reserve_flag()
    if no_reserve is None or not hasattr(mmap, "MAP_ANONYMOUS") or rows * width == 0:
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | no_reserve
    itemsize = torch.empty(0, dtype=dtype).element_size()
    try:
        memory = mmap.mmap(-1, rows * width * itemsize, flags=flags)
    except (OSError, ValueError, OverflowError):
        return None
    return torch.frombuffer(memory, dtype=dtype).view(rows, width)  # keeps the mapping alive while used


def row_buffer(rows: int, width: int, *, like: Tensor) -> Tensor:
    """An uninitialised buffer of at least ``rows`` rows of ``width`` values, with room to grow.

    Args:
        rows: the rows needed now, room included (the caller adds an eighth or so for a plain buffer).
        width: values per row.
        like: a tensor whose dtype and device the buffer takes.

    Returns:
        (capacity, width) with capacity >= rows: as many rows as the machine's memory holds when reserved
        (a CPU buffer of :data:`RESERVE_FROM_BYTES` or more), else exactly ``rows``.
    """
    nbytes = rows * width * like.element_size()
    if like.device.type == "cpu" and nbytes >= RESERVE_FROM_BYTES:
        capacity = max(rows, _memory_bytes() // max(1, width * like.element_size()))
        reserved = _reserved(capacity, width, like.dtype)
        if reserved is not None:
            return reserved
    return like.new_empty((rows, width))
