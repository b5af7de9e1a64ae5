"""Resource limits: refuse up front what cannot fit, rather than be killed halfway through a write.

Caps (documented in ``docs/RELIABILITY.md``):

- ``MAX_BATCH`` records or queries per call and ``MAX_K`` candidates per query live in :mod:`kvsearch.checks`;
- the memory an operation may use: :data:`MEMORY_FRACTION` of the memory the system reports available
  (``MemAvailable`` in ``/proc/meminfo``, or psutil where installed), or ``KVSEARCH_MEMORY_LIMIT`` bytes
  when that environment variable is set.

An operation whose estimated size exceeds that budget raises :class:`~kvsearch.errors.MemoryLimitError`
before it writes anything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from kvsearch.errors import MemoryLimitError

__all__ = [
    "MEMORY_FRACTION",
    "available_memory",
    "memory_budget",
    "check_fits",
    "index_bytes",
]

#: The share of the available memory one operation may plan to use.
MEMORY_FRACTION = 0.8
#: Without KVSEARCH_MEMORY_LIMIT, operations planning less than this are not checked (reading the system's
#: available memory costs ~0.5 ms, more than a small query itself).
SMALL_BYTES = 64 << 20


def available_memory() -> int | None:
    """Bytes of memory the system reports available now, or None when it cannot tell."""
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_budget() -> int | None:
    """Bytes one operation may plan to use: ``KVSEARCH_MEMORY_LIMIT`` if set, else a share of what is available."""
    limit = os.environ.get("KVSEARCH_MEMORY_LIMIT")
    if limit:
        return int(limit)
    available = available_memory()
    return None if available is None else int(available * MEMORY_FRACTION)


def check_fits(nbytes: int, what: str | Callable[[], str]) -> None:
    """Refuse an operation whose estimated size exceeds :func:`memory_budget`.

    Args:
        nbytes: the estimated extra memory the operation needs.
        what: the operation, for the message (or a function making it, called only when refusing).

    Raises:
        MemoryLimitError: it does not fit.
    """
    if nbytes < SMALL_BYTES and not os.environ.get("KVSEARCH_MEMORY_LIMIT"):
        return
    budget = memory_budget()
    if budget is not None and nbytes > budget:
        what = what() if callable(what) else what
        raise MemoryLimitError(
            f"{what} needs about {nbytes / 2**20:,.0f} MiB, expected at most {budget / 2**20:,.0f} MiB "
            f"(the memory this process may use; set KVSEARCH_MEMORY_LIMIT to change it); nothing was written"
        )


def index_bytes(spec: str, n: int, dim: int) -> int:
    """Estimated memory of a FAISS index of ``spec`` holding ``n`` vectors of ``dim`` floats.

    Args:
        spec: an ``index_factory`` string.
        n: number of vectors. dim: their dimension.

    Returns:
        Bytes: codes (4·dim per vector for flat storage, m per vector for PQm, dim for SQ8) plus
        graph links (HNSW M: ~8·M per vector) and ids (8 per vector).
    """
    upper = spec.upper()
    per = 4 * dim
    pq = re.search(r"PQ(\d+)", upper)
    if pq:
        per = int(pq.group(1))
    elif "SQ8" in upper:
        per = dim
    elif "SQ4" in upper:
        per = (dim + 1) // 2
    hnsw = re.search(r"HNSW(\d+)", upper)
    if hnsw:
        per += 8 * int(hnsw.group(1)) + 8
    return n * (per + 8)
