"""Requirement 5, fork(): a child forked after the parent used torch's and FAISS's OpenMP threads at the default
count searches and writes (GNU OpenMP's worker pool does not survive fork(); :mod:`kvsearch.nn.forking` stops the
forking thread's workers before each fork).

The parent runs in a process of its own (``tests/_fork_child.py``), so that neither this process's torch state nor
pytest's matters, and pytest itself never forks with a live pool. Each child has a deadline: a hang fails the test
within a minute instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvsearch.nn.forking import release_openmp_threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "_fork_child.py")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"), reason="Linux fork")


def _run_parent(folder: str) -> dict:
    env = {name: value for name, value in os.environ.items() if name not in THREAD_VARIABLES}  # the default count
    env["PYTHONPATH"] = REPO
    done = subprocess.run(
        [sys.executable, SCRIPT, folder], capture_output=True, text=True, env=env, timeout=400, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_child_forked_after_the_default_thread_count_searches_and_writes(tmp_path):
    """The parent adds texts with an n-gram encoder and searches large batches at the default thread count (torch's
    and FAISS's worker pools live when it forks); each child searches a Flat and an HNSW database, runs a matmul and
    writes, within the deadline, and the parent sees the children's records."""
    result = _run_parent(str(tmp_path))
    threads = result["parent_threads"]
    if threads < 2:
        pytest.skip("one core: torch starts no worker threads, there is no pool to lose")
    # the parent really had worker threads when it forked: torch's and FAISS's, threads - 1 each
    assert result["parent_tasks_before_fork"] >= 1 + 2 * (threads - 1), result
    children = result["children"]
    for mode, report in children.items():
        assert "hung" not in report and "not_run" not in report, (mode, children)
        assert "error" not in report and report["exit_status"] == 0, (mode, report)
        assert report["flat_hits"] == [5, 5, 5] and report["flat_top"] == "name00007", (mode, report)
        assert report["hnsw_hits"] == [5, 5, 5] and report["matmul_ok"], (mode, report)
        assert report["tasks_at_start"] == 1, (mode, report)  # fork() copied the forking thread alone
    # stopped before the fork, the pools start afresh in the child: its thread count is the parent's, or any it sets
    assert children["default"]["threads"] == threads
    assert children["default"]["tasks_after_work"] > 1  # the child ran parallel regions with workers of its own
    assert children["more_threads"]["threads"] == 3 and children["more_threads"]["tasks_after_work"] > 1
    # where the workers could not be stopped, the child runs single-threaded rather than enter the dead pool
    assert children["fallback"]["threads"] == 1 and children["fallback"]["tasks_after_work"] == 1
    # every child's writes went through and the parent sees them (the children ran one after another)
    assert [children[m]["flat_len"] for m in ("default", "more_threads", "fallback")] == [1001, 1002, 1003]
    assert [children[m]["hnsw_len"] for m in ("default", "more_threads", "fallback")] == [1001, 1002, 1003]
    assert result["flat_len"] == 1003 and result["hnsw_len"] == 1003


def test_release_openmp_threads_then_parallel_work_goes_on():
    """Stopping this thread's workers is safe in a process that goes on: the next parallel region starts new ones
    and computes what it computed before."""
    x = torch.randn(400, 400, generator=torch.Generator().manual_seed(0))
    before = x @ x  # (400, 400): a parallel region at the default count
    assert release_openmp_threads() is True
    assert torch.equal(x @ x, before)
    assert release_openmp_threads() is True  # nothing to stop: still True
