"""Query a sharded kvsearch database from several processes with torch.distributed.

Run it with torchrun (2 processes on this machine; gloo on the CPU, NCCL for the default group when every
rank has a GPU of its own — the database itself talks over a gloo group of its own either way):

    torchrun --standalone --nproc-per-node=2 examples/distributed_query.py --path indexes/people
    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/distributed_query.py --path DIR

The first run builds a sharded database of six records in ``--path`` (4 shards: rank r opens the shards s with
``s % 2 == r``); later runs reopen it. Every rank then asks its own questions *collectively* — every rank calls
``search`` and ``query`` together, each with its own texts (rank 1 with an empty batch for the exact lookups) —
checks its answers against a single-process :class:`kvsearch.Database` holding the same
records: the same keys in the same order, the same weights. Rank 0 prints every rank's answers, in rank order;
the exit status is 1 on any rank's mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import kvsearch
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.layout import is_sharded

RECORDS = {"Zhang": "Aston", "Lipton": "Zachary", "Li": "Mu", "Smola": "Alex", "Hu": "Rachel", "Werness": "Brent"}
#: What each rank asks (by rank; a world of more than 2 ranks reuses them): search and softmax queries ...
QUESTIONS = [["Li", "Lipto"], ["Smolla", "Zang", "Hoo"]]
#: ... and exact lookups: rank 1 has none, yet takes part in the collective call with an empty batch.
LOOKUPS = [["Li", "Nobody"], []]


def main(argv: list[str] | None = None) -> int:
    """Build (if missing) and query the sharded database; 0 when every rank's answers match the reference."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="the sharded database folder (built on the first run)")
    parser.add_argument("--k", type=int, default=3, help="candidates per query (default 3)")
    args = parser.parse_args(argv)

    nccl = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("WORLD_SIZE", "1"))
    if nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        new = not is_sharded(args.path)
        dist.barrier()  # every rank has looked before rank 0 writes shards.json
        with ShardedDatabase(args.path, num_shards=4 if new else None, encoder=kvsearch.NgramEncoder()) as sdb:
            if new:  # collective: rank 0 brings the records, the others an empty batch
                mine = RECORDS if rank == 0 else {}
                sdb.add(keys=list(mine), values=list(mine.values()))
            mismatches = ask(sdb, rank, args.k)
        failed = torch.tensor([mismatches], device="cuda" if nccl else "cpu")
        dist.all_reduce(failed)  # every rank exits with the same status
        if rank == 0:
            print("all ranks match the single-process database" if not failed.item() else "MISMATCH", flush=True)
        return 1 if failed.item() else 0
    finally:
        dist.destroy_process_group()


def ask(sdb: ShardedDatabase, rank: int, k: int) -> int:
    """This rank's search, softmax query and exact lookups (collective calls); the number of mismatches."""
    texts, lookups = QUESTIONS[rank % len(QUESTIONS)], LOOKUPS[rank % len(LOOKUPS)]
    hits = sdb.search(texts, k=k)  # list of lists of Hit, best first, over every shard
    answer = sdb.query(texts, k=k, temperature=0.5)  # output (batch, value_dim), weights (batch, k)
    exact = sdb.query(lookups, k=k, pooling="exact")  # an empty batch on rank 1

    reference = kvsearch.Database(None, encoder=kvsearch.NgramEncoder())  # in memory, every record, one process
    reference.add(keys=list(RECORDS), values=list(RECORDS.values()))
    ref_hits = reference.search(texts, k=k)
    ref_answer = reference.query(texts, k=k, temperature=0.5)
    ref_exact = reference.query(lookups, k=k, pooling="exact") if lookups else None

    mismatches = 0
    lines: list[str] = []  # printed by rank 0, every rank's in rank order (ranks writing at once interleave)
    for b, text in enumerate(texts):
        keys = [h.key for h in hits[b]]
        weights = answer.weights[b].tolist()  # (k,)
        shown = ", ".join(f"{key}={w:.3f}" for key, w in zip(answer.keys[b], weights))
        lines.append(f"rank {rank} search {text!r}: {keys}")
        lines.append(f"rank {rank} query {text!r}: answer {answer.value[b]!r} ({shown})")
        same = keys == [h.key for h in ref_hits[b]] and answer.keys[b] == ref_answer.keys[b]
        same = same and answer.value[b] == ref_answer.value[b]
        same = same and torch.allclose(answer.weights[b].cpu(), ref_answer.weights[b].cpu(), atol=1e-5)
        mismatches += not same
    for b, text in enumerate(lookups):
        lines.append(f"rank {rank} exact {text!r}: {exact.value[b]!r} (found={exact.found[b]})")
        mismatches += (exact.value[b], exact.found[b]) != (ref_exact.value[b], ref_exact.found[b])
    if not lookups:
        lines.append(f"rank {rank} exact: no lookups (an empty batch, {tuple(exact.output.shape)} output)")
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, lines)
    if rank == 0:
        print("\n".join(line for part in every for line in part or []), flush=True)
    if mismatches:
        print(f"rank {rank}: {mismatches} answers differ from the single-process database", file=sys.stderr)
    reference.close()
    return mismatches


if __name__ == "__main__":
    raise SystemExit(main())
