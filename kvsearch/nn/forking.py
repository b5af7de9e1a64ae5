"""The CPU's OpenMP threads across ``fork()``: a child of ``fork()`` runs torch and FAISS work instead of hanging.

GNU OpenMP (libgomp: torch's Linux CPU wheels bundle one, FAISS's wheels another) keeps, for each thread that ran a
parallel region, a pool of worker threads that wait between regions. ``fork()`` copies the pool's bookkeeping into
the child but not its threads, so the child's first parallel region (a large matmul or top-k, a FAISS search) waits
forever for workers that do not exist: a futex that never wakes. LLVM's and Intel's OpenMP runtimes start afresh in a
child; libgomp does not (GCC bug 60035). Any ``add`` with a text encoder, or one large search, starts torch's pool,
and a pre-forking server (gunicorn with ``--preload``, a ``multiprocessing`` pool started with ``fork``) forks after
exactly that.

Importing kvsearch registers two ``os.register_at_fork`` handlers:

- before ``fork()``, in the parent: :func:`release_openmp_threads` -- ``omp_pause_resource_all`` on every libgomp the
  process has loaded, which stops the forking thread's workers (they exit and are joined) and frees its pool. The
  child then starts a fresh pool at its first parallel region, with the parent's thread count, or any count it sets
  with ``torch.set_num_threads`` (safe: the pool it starts is its own). The parent starts a fresh pool of its own at
  its next parallel region. The cost is the parent's: its workers stopped (joined) and started again once per
  ``fork()`` -- 6 ms for torch's and FAISS's pools on the loaded 2-core development machine, most of it waiting for
  the workers to be scheduled; a burst of forks stops them once (the next finds none).
- after ``fork()``, in the child, only where that stop failed (a libgomp too old to have it, GCC < 9; a fork from
  inside a parallel region): :func:`single_threaded` -- ``torch.set_num_threads(1)`` and ``omp_set_num_threads(1)``
  in every libgomp, so that no parallel region enters the dead pool, as torch's DataLoader does in its workers. Such
  a child must not raise its thread count again (its next parallel region would hang).

A process that never forks pays nothing: the handlers run only in ``fork()``. ``subprocess`` does not run them
(without ``preexec_fn`` it forks in C and execs at once).

It knows nothing of databases, FAISS or SQLite: it finds the runtimes by the shared libraries the process mapped
(``/proc/self/maps``, Linux). Elsewhere there is nothing to do: macOS wheels use LLVM's runtime and Windows has no
``fork()``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

import torch

__all__ = ["openmp_runtimes", "release_openmp_threads", "single_threaded"]

_OMP_PAUSE_SOFT = 1  # omp_pause_soft: the threads go, the settings (ICVs) stay; libgomp treats hard the same
_runtimes: dict[str, ctypes.CDLL | None] = {}  # path -> the loaded libgomp (None: not reachable), opened once
_released = True  # what the last before-fork stop reported: a child reads its parent's copy


def openmp_runtimes() -> list[ctypes.CDLL]:
    """The GNU OpenMP runtimes (libgomp) this process has loaded, each once (torch's, FAISS's, ...); none off Linux.

    A runtime is reached through the already loaded library (``RTLD_NOLOAD``): nothing new is loaded.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            fields = (line.split(None, 5) for line in maps if "libgomp" in line)  # address perms offset dev inode path
            paths = {parts[5].strip() for parts in fields if len(parts) == 6}
    except OSError:  # not Linux
        return []
    for path in paths:
        if path not in _runtimes and os.path.basename(path).startswith("libgomp"):
            try:
                _runtimes[path] = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_NOLOAD)
            except OSError:  # unmapped since, or not a library
                _runtimes[path] = None
    return [lib for path, lib in _runtimes.items() if lib is not None and path in paths]


def release_openmp_threads() -> bool:
    """Stop the calling thread's OpenMP worker threads in every libgomp loaded (``omp_pause_resource_all``).

    The next parallel region starts fresh workers; a child forked in between starts its own. Other threads' pools
    are not touched (each thread that ran a parallel region has its own; a child of ``fork()`` has only the forking
    thread).

    Returns:
        True where every runtime stopped its workers or had none, False where one could not (it lacks
        ``omp_pause_resource_all``, or the caller is inside a parallel region).
    """
    released = True
    for lib in openmp_runtimes():
        pause = getattr(lib, "omp_pause_resource_all", None)
        if pause is None:
            released = False
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released = pause(_OMP_PAUSE_SOFT) == 0 and released
    return released


def single_threaded() -> None:
    """One thread for torch and for every libgomp loaded: no parallel region starts a pool (the fallback in a child
    whose parent could not stop its workers)."""
    torch.set_num_threads(1)
    for lib in openmp_runtimes():
        set_threads: Callable[[int], None] | None = getattr(lib, "omp_set_num_threads", None)
        if set_threads is not None:
            set_threads(1)


def _before_fork() -> None:
    global _released
    try:
        _released = release_openmp_threads()
    except Exception:  # a fork handler must not fail the fork: the child falls back to one thread
        _released = False


def _after_fork_in_child() -> None:
    if not _released:
        try:
            single_threaded()
        except Exception as exc:  # a fork handler must not raise
            print(f"kvsearch: could not make torch single-threaded after fork(): {exc!r}", file=sys.stderr)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
