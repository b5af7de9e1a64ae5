"""Threads per rank: ranks on one machine share its cores instead of each taking all of them.

torch and FAISS each start as many threads as the machine has cores. One process uses them well; W ranks on one
machine start W times as many, which then wait for each other (OpenMP threads spin before they sleep), and a
call gets slower, not faster. ``torchrun`` prevents it by setting ``OMP_NUM_THREADS=1`` for each rank when it
starts more than one per machine. Ranks started another way (by hand, by a job script, by
``torch.multiprocessing``) get no such setting, so :class:`~kvsearch.distributed.ShardedDatabase` does the same
when it opens: if ``OMP_NUM_THREADS`` is not set and several ranks of its group run on this machine, each rank's
torch and FAISS threads are lowered to ``cores // local ranks`` (at least 1), with one warning per process. A
thread count the user chose through ``OMP_NUM_THREADS`` is never touched, nor one already at or below the share.

It knows nothing of shards or of the collectives (the count of local ranks comes from
:attr:`~kvsearch.distributed.collectives.Comm.local_world`).
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = ["available_cores", "share_cores"]

_warned = False  # one warning per process, however many databases it opens


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def share_cores(local_ranks: int) -> int | None:
    """Lower this rank's torch and FAISS threads to its share of the cores when nobody chose a count.

    Args:
        local_ranks: how many ranks of the group run on this machine (this one included).

    Returns:
        The thread count set, or None when nothing changed (one local rank, ``OMP_NUM_THREADS`` set, or threads
        already at or below the share).
    """
    global _warned
    if local_ranks <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = available_cores()
    share = max(1, cores // local_ranks)
    if torch.get_num_threads() <= share:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(share)
    import faiss

    faiss.omp_set_num_threads(share)
    if not _warned:
        _warned = True
        warnings.warn(
            f"kvsearch: {local_ranks} ranks of this ShardedDatabase run on this machine ({cores} cores) and "
            f"OMP_NUM_THREADS is not set: torch and FAISS threads per rank lowered from {before} to {share}, so that "
            "the ranks do not oversubscribe the cores (torchrun sets OMP_NUM_THREADS=1 for the same reason); set "
            "OMP_NUM_THREADS to choose the count yourself",
            RuntimeWarning,
            stacklevel=3,
        )
    return share
