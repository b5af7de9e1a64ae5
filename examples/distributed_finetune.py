"""Fine-tune the retriever of a sharded kvsearch database on several processes with torch.distributed.

Run it with torchrun (gloo on the CPU; the database talks over a gloo group of its own in any case):

    torchrun --standalone --nproc-per-node=2 examples/distributed_finetune.py --path indexes/people-sharded
    python -m torch.distributed.run --standalone --nproc-per-node=2 examples/distributed_finetune.py --path DIR

The first run builds a sharded database of surnames -> first names in ``--path`` (4 shards; rank r serves the
shards s with ``s % world_size == r``). The task is the demo's hard case: queries written in Cyrillic script
("Смит" for "Smith") share no character n-gram with the stored Latin keys, so the untrained n-gram encoder
finds almost none of them. Every rank takes its own share of the training and held-out pairs and calls
``finetune`` (collectively): each step's gradients are averaged over the ranks (the full batch's gradient), the
metrics are computed over every rank's held-out pairs, each rank re-encodes its own shards' keys, and the best
epoch becomes the new generation of every shard at once. Rank 0 prints the run's summary; a rerun reopens the
database and trains from where the last run left it (keeping the start when no epoch beats it).
"""

from __future__ import annotations

import argparse
import datetime

import torch.distributed as dist

import kvsearch
from kvsearch.datasets import noisy_queries, split_names, surname_directory
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.layout import is_sharded


def main(argv: list[str] | None = None) -> int:
    """Build (if missing) and fine-tune the sharded database; 0 when the run ended (committed or not)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True, help="the sharded database folder (built on the first run)")
    parser.add_argument("--names", type=int, default=1000, help="surnames stored (default 1000)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default 2)")
    args = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        keys, values = surname_directory(args.names)
        train, held = split_names(keys, 0.2, seed=0)  # held-out surnames are never trained on
        stored = set(keys)
        train_pairs = noisy_queries(train, "cyrillic", avoid=stored)  # [(query, the key it means), ...]
        held_pairs = noisy_queries(held, "cyrillic", avoid=stored)
        new = not is_sharded(args.path)
        dist.barrier()  # every rank has looked before rank 0 writes shards.json
        encoder = kvsearch.NgramEncoder(dim=64, num_buckets=2**13)
        with ShardedDatabase(args.path, num_shards=4 if new else None, encoder=encoder if new else None) as sdb:
            if new:  # collective: rank 0 brings the records, the others an empty batch
                sdb.add(keys=keys if rank == 0 else [], values=values if rank == 0 else [])
            history = kvsearch.finetune(
                sdb,
                train_pairs[rank::world],  # this rank's share
                eval_pairs=held_pairs[rank::world],
                loss="retrieval",
                k=16,
                epochs=args.epochs,
                verbose=False,
            )
            answers = sdb.search([held_pairs[0][0]], k=1)  # collective: every rank asks one held-out query
            if rank == 0:
                print(f"ranks: {world}, records: {len(keys)}, training pairs: {len(train_pairs)}", flush=True)
                print(f"finetune: {history.summary()}", flush=True)
                query, key = held_pairs[0]
                print(f"held-out query {query!r} -> {answers[0][0].key!r} (meant {key!r})", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
