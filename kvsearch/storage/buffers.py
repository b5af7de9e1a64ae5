"""Row buffers for the store's in-memory tensors, with room to grow: a large one grows without being copied.

The in-memory ids, keys and values are views of n rows of a buffer with more rows (:func:`row_buffer`), so that an
append writes the new rows only. :class:`RowWindow` keeps such a view: it appends at its end, drops its oldest rows by
moving its start (a memory with a capacity), and copies the live rows only when the buffer is full or the dropped
rows outnumber them. A plain tensor with an eighth more rows must be copied whole when it fills up: for a moment
both copies are in memory (twice the store). A buffer of :data:`RESERVE_FROM_BYTES` or
more on the CPU is therefore anonymous memory reserved for as many rows as the machine's memory could hold
(``mmap`` with ``MAP_NORESERVE``): the kernel gives it pages only as rows are written, so it grows to any size
the machine can hold without a copy, and costs address space, not memory. Where such a reservation is refused
(another OS, strict overcommit) the buffer is a plain tensor, as for a GPU or a small store.
"""

from __future__ import annotations

import math
import mmap
import os
import platform
import sys

import torch
from torch import Tensor

__all__ = ["RESERVE_FROM_BYTES", "MIN_ROOM", "row_buffer", "RowWindow"]

#: Buffers of at least this many bytes on the CPU are reserved, not allocated (see the module docstring). A
#: reservation costs address space only (as much as the machine's memory), so all but small stores take one: a
#: reader catching up on a writer's appends then never copies its table to grow (50k x 384: ~2 ms a catch-up).
RESERVE_FROM_BYTES = 16 << 20
#: The fewest spare rows a new buffer gets (and the fewest dropped rows a window copies its live rows for).
MIN_ROOM = 64


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


def _reserved(rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """A (rows, *shape) tensor on reserved anonymous memory, or None where the OS refuses it."""
    no_reserve = _no_reserve_flag()
    width = math.prod(shape)
    if no_reserve is None or not hasattr(mmap, "MAP_ANONYMOUS") or rows * width == 0:
        return None
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | no_reserve
    itemsize = torch.empty(0, dtype=dtype).element_size()
    try:
        memory = mmap.mmap(-1, rows * width * itemsize, flags=flags)
    except (OSError, ValueError, OverflowError):
        return None
    return torch.frombuffer(memory, dtype=dtype).view(rows, *shape)  # keeps the mapping alive while used


def row_buffer(rows: int, width: int | tuple[int, ...], *, like: Tensor) -> Tensor:
    """An uninitialised buffer of at least ``rows`` rows of ``width`` values, with room to grow.

    Args:
        rows: the rows needed now, room included (the caller adds an eighth or so for a plain buffer).
        width: values per row, or the shape of one row (``()``: one value a row, a buffer of shape (capacity,)).
        like: a tensor whose dtype and device the buffer takes.

    Returns:
        (capacity, width) (or (capacity, *width)) with capacity >= rows: as many rows as the machine's memory holds
        when reserved (a CPU buffer of :data:`RESERVE_FROM_BYTES` or more), else exactly ``rows``.
    """
    shape = (width,) if isinstance(width, int) else tuple(width)
    row_bytes = max(1, math.prod(shape) * like.element_size())
    if like.device.type == "cpu" and rows * row_bytes >= RESERVE_FROM_BYTES:
        capacity = max(rows, _memory_bytes() // row_bytes)
        reserved = _reserved(capacity, shape, like.dtype)
        if reserved is not None:
            return reserved
    return like.new_empty((rows, *shape))


class RowWindow:
    """Rows kept as a view ``buffer[start:stop]`` of a buffer with room: the newest appended after ``stop``, the
    oldest dropped by moving ``start``.

    An append writes the new rows only while the buffer has room; a drop of the oldest rows copies nothing. The
    live rows are copied (into a new buffer) only when the buffer is full, or when the dropped rows in front of them
    outnumber them (and :data:`MIN_ROOM`): so a window that keeps its newest ``c`` rows copies each row about once,
    holds at most about ``2 c`` rows, and every operation costs O(rows added or dropped), amortised. A new buffer
    has room for an eighth more rows, or twice as many as were dropped since the last copy (at most as many as it
    holds), or, while the doubled buffer stays under :data:`RESERVE_FROM_BYTES`, as many rows as it holds (a small
    growing memory copies each row about once, as a doubling buffer in bare torch does, instead of about eight
    times); a large CPU one is reserved (:func:`row_buffer`: it grows without a copy).

    A tensor handed out before stays valid (a later append writes past its end, a copy goes to a new buffer), but it
    no longer is the window's view: only :meth:`holds` tells whether a tensor still is.
    """

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.start = 0
        self.stop = 0

    def holds(self, rows: Tensor | None) -> bool:
        """Whether ``rows`` is this window's view now: the same memory, shape, dtype and device."""
        if rows is None or self.buffer is None:
            return False
        same = rows.dtype == self.buffer.dtype and rows.device == self.buffer.device
        same = same and rows.shape[1:] == self.buffer.shape[1:] and len(rows) == self.stop - self.start
        return same and (len(rows) == 0 or rows.data_ptr() == self.buffer[self.start].data_ptr())

    def adopt(self, buffer: Tensor, rows: int) -> Tensor:
        """Take ``buffer`` whose first ``rows`` rows are live (read into it in place); returns them (a view)."""
        self.buffer, self.start, self.stop = buffer, 0, rows
        return buffer[:rows]

    def extend(self, rows: Tensor, new: Tensor, *, drop: int = 0) -> Tensor:
        """``rows`` without its first ``drop`` rows, then ``new`` appended: the window's new view.

        Args:
            rows: (n, *shape) the rows now: this window's view (nothing is copied but ``new``), or any tensor (it is
                copied into a new buffer once, and held from then on).
            new: (a, *shape) rows to append (the dtype and device of ``rows``).
            drop: how many of the oldest rows to drop, 0 <= drop <= n.

        Returns:
            (n - drop + a, *shape): a view of the window's buffer (a tensor of its own, never ``new`` itself).
        """
        if self.holds(rows):
            self.start += drop  # the oldest rows leave the view; nothing moves
        else:
            self.buffer, self.start, self.stop = None, 0, 0  # copied into a buffer of its own below
        rows = rows[drop:]  # (live, *shape)
        live, a = len(rows), len(new)
        fits = self.buffer is not None and self.stop + a <= len(self.buffer)
        if not fits or self.start > max(live, MIN_ROOM):
            need = live + a
            row_bytes = max(1, math.prod(rows.shape[1:]) * rows.element_size())
            small = max(0, min(need, RESERVE_FROM_BYTES // row_bytes - need))  # doubled while under 16 MiB
            room = max(MIN_ROOM, need // 8, min(2 * self.start, need), small)
            buffer = row_buffer(need + room, tuple(rows.shape[1:]), like=rows)  # (capacity, *shape)
            buffer[:live] = rows
            self.buffer, self.start, self.stop = buffer, 0, live
        if a:
            self.buffer[self.stop : self.stop + a] = new
            self.stop += a
        return self.buffer[self.start : self.stop]
