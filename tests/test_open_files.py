"""Open files (reliability round 3, issue 25): bounded, checked up front, and ``EMFILE`` reported as what it is.

- An open database holds at most :data:`kvsearch.checks.FILES_PER_DATABASE` file descriptors, whatever its index,
  through adds, deletes, searches, saves and reopens; a closed one holds none (counted in ``/proc/self/fd``).
- Opening more shards than the process's open-file limit allows is refused up front with
  :class:`kvsearch.FileLimitError` naming the limit and the shard count (nothing is created); under a low soft limit
  and a higher hard one, the soft limit is raised and the shards open.
- A process that can open no more files gets ``FileLimitError`` from every open, never ``CorruptDatabaseError``,
  and nothing is left of a database it could not create.

The limits are set in child processes (``resource.setrlimit``), never in the test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch.checks import FILES_PER_DATABASE, open_files
from kvsearch.distributed import ShardedDatabase

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")

SPECS = ["Flat", "HNSW16", "IVF4,Flat", "torch", "HNSW16,SQ8"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_database_holds_a_bounded_number_of_files_and_none_once_closed(tmp_path, spec):
    torch.manual_seed(0)
    base = open_files()
    peak = 0
    db = kvsearch.Database(tmp_path / "db", dim=8, value_dim=8, index=spec)
    for _ in range(4):
        db.add(keys=torch.randn(200, 8), values=torch.randn(200, 8))
        peak = max(peak, open_files() - base)
        db.search(torch.randn(3, 8), k=4)
        peak = max(peak, open_files() - base)
        db.delete(db.ids()[:20].tolist())
        peak = max(peak, open_files() - base)
    db.save()
    peak = max(peak, open_files() - base)
    db.close()
    assert open_files() == base  # a closed database holds no descriptor (its file mappings let go)
    with kvsearch.Database(tmp_path / "db") as again:
        again.query(torch.randn(2, 8), k=3)
        peak = max(peak, open_files() - base)
    assert open_files() == base
    assert 4 <= peak <= FILES_PER_DATABASE, f"{spec}: {peak} descriptors at the peak"


def test_a_sharded_database_holds_a_bounded_number_per_shard(tmp_path):
    torch.manual_seed(0)
    base = open_files()
    with ShardedDatabase(tmp_path / "s", num_shards=8, dim=8, value_dim=8) as db:
        db.add(keys=torch.randn(400, 8), values=torch.randn(400, 8))
        db.search(torch.randn(4, 8), k=5)
        held = open_files() - base
    assert held <= 8 * FILES_PER_DATABASE
    assert open_files() == base


def run_child(code: str, *, soft: int, hard: int | None = None) -> dict:
    """Run ``code`` in a fresh interpreter under RLIMIT_NOFILE (soft, hard); it prints one JSON line last."""
    prelude = textwrap.dedent(
        f"""
        import json, os, resource, sys
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if {hard!r} is None else {hard!r}
        resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, hard))
        import torch, kvsearch
        from kvsearch.distributed import ShardedDatabase
        def outcome(fn):
            try:
                fn()
                return "ok"
            except Exception as exc:
                return f"{{type(exc).__name__}}: {{exc}}"
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_more_shards_than_the_hard_limit_allows_are_refused_up_front(tmp_path):
    root = tmp_path / "many"
    got = run_child(
        f"""
        made = outcome(lambda: ShardedDatabase({str(root)!r}, num_shards=64, dim=8, value_dim=8))
        print(json.dumps({{"made": made}}))
        """,
        soft=200,
        hard=200,
    )
    assert got["made"].startswith("FileLimitError: opening 64 shards"), got
    assert "hard limit 200" in got["made"] and "ulimit" in got["made"]
    assert not root.exists()  # refused before anything was created


def test_a_low_soft_limit_is_raised_to_fit_the_shards(tmp_path):
    root = tmp_path / "raised"
    got = run_child(
        f"""
        db = ShardedDatabase({str(root)!r}, num_shards=64, dim=8, value_dim=8)
        db.add(keys=torch.randn(256, 8), values=torch.randn(256, 8))
        hits = db.search(torch.randn(8), k=3)
        print(json.dumps({{"records": len(db), "hits": len(hits),
                           "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}}))
        """,
        soft=256,
    )
    assert (got["records"], got["hits"]) == (256, 3)
    assert got["soft"] >= 64 * FILES_PER_DATABASE


def test_running_out_of_files_is_a_file_limit_error_never_corruption(tmp_path):
    plain, sharded, new = tmp_path / "plain", tmp_path / "sharded", tmp_path / "new"
    with kvsearch.Database(plain, dim=8, value_dim=8) as db:
        db.add(keys=torch.randn(50, 8), values=torch.randn(50, 8))
    with ShardedDatabase(sharded, num_shards=4, dim=8, value_dim=8) as db:
        db.add(keys=torch.randn(50, 8), values=torch.randn(50, 8))
    got = run_child(
        f"""
        held = kvsearch.Database({str(plain)!r})  # open before the limit is reached: it goes on answering
        held.search(torch.randn(8), k=2)
        filler = []
        while True:  # take every descriptor left
            try:
                filler.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        tries = {{
            "reopen": outcome(lambda: kvsearch.Database({str(plain)!r})),
            "create": outcome(lambda: kvsearch.Database({str(new)!r}, dim=8, value_dim=8)),
            "sharded": outcome(lambda: ShardedDatabase({str(sharded)!r})),
            "search": outcome(lambda: held.search(torch.randn(8), k=2)),
        }}
        for fd in filler:
            os.close(fd)
        tries["after"] = outcome(lambda: kvsearch.Database({str(plain)!r}).close())
        tries["new_left"] = os.path.exists({str(new / "store.sqlite")!r})
        print(json.dumps(tries))
        """,
        soft=256,
        hard=256,
    )
    for what in ("reopen", "create", "sharded"):
        assert got[what].startswith("FileLimitError: "), (what, got[what])
        assert "Corrupt" not in got[what]
    assert got["search"] == "ok" and got["after"] == "ok"
    assert got["new_left"] is False
