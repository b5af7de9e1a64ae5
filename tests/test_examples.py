"""The examples in ``examples/`` run as their docstrings say.

``examples/distributed_query.py`` runs under torchrun (its module form, ``python -m torch.distributed.run``) with
2 gloo ranks on this machine; its printed answers are checked against a single-process
:class:`kvsearch.Database` built here from the same records. Spawning the ranks and importing torch takes a few
seconds per run.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import kvsearch
from kvsearch.distributed import ShardedDatabase

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed_query.py"
FINETUNE_EXAMPLE = ROOT / "examples" / "distributed_finetune.py"
RANKS = 2
SEARCH = re.compile(r"^rank (\d) search '([^']*)': (\[.*\])$")
QUERY = re.compile(r"^rank (\d) query '([^']*)': answer '([^']*)' \((.*)\)$")
EXACT = re.compile(r"^rank (\d) exact '([^']*)': (.*) \(found=(True|False)\)$")


def load_example() -> ModuleType:
    """The example as a module (importing it runs nothing): its records and each rank's questions."""
    spec = importlib.util.spec_from_file_location("distributed_query", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torchrun(path: Path, example: Path = EXAMPLE) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=2 examples/<example> --path``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}"]
    command += [str(example.relative_to(ROOT)), "--path", str(path)]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example()


def test_distributed_query_example_matches_a_single_process_database(example, tmp_path):
    result = torchrun(tmp_path / "people")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "all ranks match the single-process database" in lines
    with ShardedDatabase(tmp_path / "people") as sdb:  # built by the example: 4 shards, every record
        assert (sdb.num_shards, len(sdb)) == (4, len(example.RECORDS))

    searched, queried, looked_up = {}, {}, {}
    for line in lines:
        if m := SEARCH.match(line):
            searched[int(m[1]), m[2]] = ast.literal_eval(m[3])
        elif m := QUERY.match(line):
            pairs = [item.rsplit("=", 1) for item in m[4].split(", ")]
            queried[int(m[1]), m[2]] = (m[3], [key for key, _ in pairs], [float(w) for _, w in pairs])
        elif m := EXACT.match(line):
            looked_up[int(m[1]), m[2]] = (ast.literal_eval(m[3]), m[4] == "True")
    assert "rank 1 exact: no lookups (an empty batch, (0, 256) output)" in lines

    reference = kvsearch.Database(None, encoder=kvsearch.NgramEncoder())
    reference.add(keys=list(example.RECORDS), values=list(example.RECORDS.values()))
    expected_search, expected_query, expected_exact = {}, {}, {}
    for rank in range(RANKS):
        texts, lookups = example.QUESTIONS[rank], example.LOOKUPS[rank]
        for text, hits in zip(texts, reference.search(texts, k=3)):
            expected_search[rank, text] = [h.key for h in hits]
        answer = reference.query(texts, k=3, temperature=0.5)
        for b, text in enumerate(texts):
            weights = [round(w, 3) for w in answer.weights[b].tolist()]
            expected_query[rank, text] = (answer.value[b], answer.keys[b], weights)
        if lookups:
            exact = reference.query(lookups, k=3, pooling="exact")
            for b, text in enumerate(lookups):
                expected_exact[rank, text] = (exact.value[b], exact.found[b])
    reference.close()
    assert searched == expected_search
    assert queried == expected_query
    assert looked_up == expected_exact == {(0, "Li"): ("Mu", True), (0, "Nobody"): (None, False)}


def test_distributed_query_example_exits_non_zero_on_a_mismatch(example, tmp_path):
    records = dict(example.RECORDS, Li="Wrong")  # a database that does not hold the example's records
    with ShardedDatabase(tmp_path / "people", num_shards=4, encoder=kvsearch.NgramEncoder()) as sdb:
        sdb.add(keys=list(records), values=list(records.values()))
    result = torchrun(tmp_path / "people")  # reopened, not rebuilt
    assert result.returncode != 0
    assert "MISMATCH" in result.stdout.splitlines()
    assert "rank 0 exact 'Li': 'Wrong' (found=True)" in result.stdout.splitlines()
    assert "rank 0: 2 answers differ from the single-process database" in result.stderr


FINETUNED = re.compile(r"^finetune: recall@1 ([0-9.]+) -> best ([0-9.]+) at epoch (\d+) \(kept, generation (\d+)\)$")


def test_distributed_finetune_example_improves_and_switches_every_shard(tmp_path):
    result = torchrun(tmp_path / "people", FINETUNE_EXAMPLE)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "ranks: 2, records: 1000, training pairs: 800" in lines
    runs = [m for m in map(FINETUNED.match, lines) if m]
    assert len(runs) == 1, result.stdout
    before, after, _, generation = runs[0].groups()
    assert float(after) > float(before) + 0.2  # Cyrillic queries: ~0 before, ~0.5 after 2 epochs when written
    with ShardedDatabase(tmp_path / "people") as sdb:  # one process, every shard: the run's generation
        assert sdb.generation == int(generation)
        assert {db.generation for db in sdb.shards.values()} == {int(generation)}
        # the default for an NgramEncoder, train="query+keys": the shared encoder learned, saved in every shard
        assert sdb.query_encoder is None and sdb.encoder.weights_changed()
