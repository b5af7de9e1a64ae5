"""Ranks that call different ShardedDatabase methods raise DistributedError naming both calls at once (not after
the timeout), and ranks started by hand share the machine's cores.

Two gloo ranks on 127.0.0.1 are spawned once (``tests/_distributed_ranks.py``, scenario ``mismatch``, started
without the one-thread setting the other scenarios make, as a user's own ranks would be) with a 60 s timeout:

- rank 0 ``search`` / rank 1 ``query``; ``len`` / ``candidates`` (first collectives of different kinds);
  ``add`` / ``delete``; ``search`` with k=1 / k=3; ``query`` with exact pooling on one rank only: every rank
  raises DistributedError naming every rank's call (and the argument that must agree) in a few seconds, nothing
  is written, and the next call works;
- the torch threads of a rank after opening: ``cores // 2`` (at most what it had), with one warning; a count set
  with OMP_NUM_THREADS left alone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvsearch.distributed.threads import available_cores

sys.path.insert(0, str(Path(__file__).parent))
import _distributed_ranks as ranks  # noqa: E402

DEADLINE_S = 240.0
FAST_S = 10.0  # a mismatch is an error within seconds: the timeout is ranks.TIMEOUT (60 s)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("mismatch")
    procs = ranks.start_ranks(2, root, "mismatch")
    codes, results = ranks.join_ranks(procs, root, "mismatch", DEADLINE_S)
    for rank, res in enumerate(results):
        if "mismatch" not in res or "omp_set" not in res["mismatch"]["threads"]:
            pytest.fail(f"rank {rank} did not finish (exit codes {codes}):\n{res.get('crash', '(no traceback)')}")
    return [res["mismatch"] for res in results]


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("search-vs-query", ["rank 0 called search(queries=(2, 64), k=2", "rank 1 called query(queries=(1, 64), k=2"]),
        ("len-vs-candidates", ["rank 0 called len()", "rank 1 called candidates(queries=(2, 64), k=2)"]),
        ("add-vs-delete", ["rank 0 called add(keys=[1 text], values=[1 text])", "rank 1 called delete("]),
        ("k-differs", ["call search with the same k", "k=1", "k=3"]),
        ("exact-on-one-rank", ["call query with the same pooling", "pooling='exact'", "pooling='softmax'"]),
        ("draft-refresh-vs-candidates", ["rank 0 called refresh()", "rank 1 called candidates(queries=(2, 64), k=2)"]),
    ],
)
def test_ranks_that_call_different_methods_raise_at_once_naming_both(results, case, named):
    for rank, res in enumerate(results):
        outcome, seconds, after = res[case]
        assert outcome[:2] == ("err", "DistributedError"), f"rank {rank}: {outcome}"
        assert all(text in outcome[2] for text in named), f"rank {rank}: {outcome[2]}"
        assert seconds < FAST_S < res["timeout"], f"rank {rank} raised after {seconds:.1f} s"
        assert after == ("ok", ["Smith"]), f"rank {rank}: the next call gave {after}"


def test_a_refused_call_wrote_nothing(results):
    assert [res["len"] for res in results] == [("ok", 4), ("ok", 4)]


def test_ranks_started_by_hand_share_the_cores(results):
    share = max(1, available_cores() // 2)
    for rank, res in enumerate(results):
        threads = res["threads"]
        assert threads["after"] == min(threads["before"], share), threads
        assert len(threads["warnings"]) == (1 if threads["before"] > share else 0), threads["warnings"]
        assert threads["omp_set"] == (2, []), f"rank {rank}: OMP_NUM_THREADS=2 was not left alone: {threads}"
