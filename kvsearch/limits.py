"""Resource limits: refuse up front what cannot fit, rather than be killed halfway through a write.

Caps (documented in ``docs/RELIABILITY.md``):

- ``MAX_BATCH`` records or queries per call and ``MAX_K`` candidates per query live in :mod:`kvsearch.checks`;
- the memory an operation may use: :data:`MEMORY_FRACTION` of the memory the system reports available
  (``MemAvailable`` in ``/proc/meminfo``, or psutil where installed), or ``KVSEARCH_MEMORY_LIMIT`` bytes
  when that environment variable is set.

An operation whose estimated size exceeds that budget raises :class:`~kvsearch.errors.MemoryLimitError`
before it writes anything.

Open files: an open database holds at most :data:`FILES_PER_DATABASE` file descriptors, a closed one none. Opening
many at once (the shards of a sharded database) is checked against the process's open-file limit up front
(:func:`check_open_files`): the soft limit is raised toward the hard one when that is enough, as Go's runtime does at
start, else :class:`~kvsearch.errors.FileLimitError` names the limit and the count before anything is opened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from kvsearch.errors import FileLimitError, MemoryLimitError

__all__ = [
    "MEMORY_FRACTION",
    "available_memory",
    "memory_budget",
    "check_fits",
    "index_bytes",
    "FILES_PER_DATABASE",
    "FILES_RESERVED",
    "open_files",
    "file_limits",
    "check_open_files",
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


# --------------------------------------------------------------------------- open files

#: File descriptors an open :class:`~kvsearch.Database` holds at most: the SQLite store, its WAL and shared memory,
#: the write lock and the three mapped vector columns (ids, keys, values) — 7 — and, for a moment while a write
#: replaces a file set or saves an index, up to 3 more. A closed database holds none. Measured in
#: ``tests/test_limits.py`` for every index kind.
FILES_PER_DATABASE = 10
#: Descriptors left free for everything else a process opens (torch.distributed's sockets, model files, pipes).
FILES_RESERVED = 64


def open_files() -> int:
    """How many file descriptors this process holds now (0 where the system cannot tell)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def file_limits() -> tuple[int, int] | None:
    """The process's open-file limits ``(soft, hard)`` (``ulimit -n`` / ``ulimit -Hn``), or None where unknown.

    An unlimited hard limit reads as a very large number.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Unix
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    return (soft if soft != infinity else 1 << 62), (hard if hard != infinity else 1 << 62)


def check_open_files(databases: int, what: str) -> None:
    """Make room for ``databases`` more open databases in the open-file limit, or refuse before opening any.

    The need is ``databases`` x :data:`FILES_PER_DATABASE` on top of the descriptors open now, plus
    :data:`FILES_RESERVED`. Past the soft limit (a shell's ``ulimit -n``, often 1,024), the soft limit is raised to
    the need when the hard limit allows it (a process may raise its own soft limit; Go's runtime raises it to the
    hard limit at start); past the hard limit, the open is refused.

    Args:
        databases: how many databases (shards) are about to be opened.
        what: the operation, for the message (e.g. ``"opening 256 shards of indexes/people"``).

    Raises:
        FileLimitError: they would not fit under the hard limit; nothing was opened.
    """
    limits = file_limits()
    if limits is None:
        return
    soft, hard = limits
    need = open_files() + databases * FILES_PER_DATABASE + FILES_RESERVED
    if need <= soft:
        return
    if need <= hard:
        import resource

        try:  # the hard limit as the system has it (RLIM_INFINITY stays so)
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            return
        except (ValueError, OSError):
            pass
    raise FileLimitError(
        f"{what} needs about {need:,} open files ({databases:,} x {FILES_PER_DATABASE} per database, plus those open "
        f"now and {FILES_RESERVED} to spare), expected at most the process's hard limit {hard:,} (ulimit -Hn; soft: "
        f"{soft:,}); nothing was opened. Raise the limit (ulimit -n as root, or LimitNOFILE= in a systemd unit), or "
        "serve the shards from more ranks (each opens num_shards / world_size)"
    )
