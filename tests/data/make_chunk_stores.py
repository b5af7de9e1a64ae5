"""Write the stores of the chunk format (embeddings in SQLite chunk blobs) that tests/test_chunk_format.py opens.

Run with kvsearch at commit 2b84048 (the last version of that format) on the path, from the repository root:

    git worktree add --detach /tmp/chunkfmt 2b84048
    PYTHONPATH=/tmp/chunkfmt python tests/data/make_chunk_stores.py

Each folder under tests/data/chunk_format/ is a database as that version left it, with ``expected.json``: every
record as that version read it back (id, key, value, metadata, and both embeddings as float32 hex).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from make_legacy_stores import dump  # the same record dump (run from the repository root: this folder is on the path)

import kvsearch

OUT = Path(__file__).resolve().parent / "chunk_format"


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    gen = torch.Generator().manual_seed(0)
    # texts: an n-gram encoded database with metadata, a deleted record and a replaced one (a chunk with a hole)
    folder = OUT / "texts"
    db = kvsearch.Database(folder, encoder=kvsearch.NgramEncoder(dim=16, num_buckets=256), score="cosine")
    names = ["Zhang", "Lipton", "Li", "Smola", "Hu", "Werness", "Mueller", "Garcia"]
    db.add(names, [f"first of {n}" for n in names], metadata=[{"i": i} for i in range(len(names))])
    db.delete(["Hu"])
    db.upsert(["Li"], ["Mu"], metadata=[{"i": 2, "again": True}])
    db.close()
    dump(kvsearch.Database(folder), folder)
    # embeddings: 200 records given as embeddings, more than one chunk (64 slots), a run deleted in the middle
    folder = OUT / "embeddings"
    db = kvsearch.Database(folder, dim=8, value_dim=3, score="dot")
    db.add(torch.randn(200, 8, generator=gen), torch.randn(200, 3, generator=gen))
    db.delete(list(range(70, 90)))
    db.close()
    dump(kvsearch.Database(folder), folder)
    for path in OUT.rglob("*"):
        if path.name in ("write.lock", "index.npz", "manifest.json") or path.name.startswith("store.sqlite-"):
            path.unlink()


if __name__ == "__main__":
    main()
