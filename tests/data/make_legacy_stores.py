"""Write the stores of the earlier format (embeddings in the records rows) that tests/test_legacy_format.py opens.

Run with kvsearch at commit 44f6e89 (the last version of that format) on the path, from the repository root:

    git worktree add --detach /tmp/legacy 44f6e89
    PYTHONPATH=/tmp/legacy python tests/data/make_legacy_stores.py

Each folder under tests/data/legacy/ is a database as that version left it, with ``expected.json``: every
record as that version read it back (id, key, value, metadata, and both embeddings as float32 hex).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import unicodedata
from pathlib import Path

import torch

import kvsearch

OUT = Path(__file__).resolve().parent / "legacy"


def dump(db: kvsearch.Database, folder: Path) -> None:
    records = []
    for id_ in db.store.ids.tolist():
        r = db.get(id_)
        records.append(
            {
                "id": id_,
                "key": r.key,
                "value": r.value,
                "metadata": r.metadata,
                "key_embedding": r.key_embedding.numpy().tobytes().hex(),
                "value_embedding": r.value_embedding.numpy().tobytes().hex(),
            }
        )
    (folder / "expected.json").write_text(json.dumps({"records": records}, indent=1, ensure_ascii=False) + "\n")


def texts(folder: Path) -> None:
    """Text records (ngram encoder), metadata, a deleted and a replaced record, a key given with its embedding."""
    db = kvsearch.Database(folder, encoder=kvsearch.NgramEncoder(dim=16, num_buckets=256), device="cpu")
    metadata = [{"lang": "zh"}, {}, {}, {}]
    db.add(["Li", "Lipton", "Smola", "Zhang"], ["Mu", "Zachary", "Alex", "Aston"], metadata=metadata)
    db.delete(["Smola"])
    db.upsert(["Zhang"], ["Aston (replaced)"], metadata=[{"year": 2020}])
    db.add(["given"], ["its own embedding"], key_embeddings=torch.full((1, 16), 0.25))
    dump(db, folder)
    db.close()


def embeddings(folder: Path) -> None:
    """300 records given as embeddings only (no encoder), a few deleted: several chunks once moved."""
    gen = torch.Generator().manual_seed(0)
    db = kvsearch.Database(folder, dim=8, value_dim=3, score="dot")
    db.add(torch.randn(300, 8, generator=gen), torch.randn(300, 3, generator=gen))
    db.delete([2, 100, 299])
    dump(db, folder)
    db.close()


def unnormalised_keys(folder: Path) -> None:
    """Keys stored as given (surrounding whitespace, NFD) by a version before key normalisation."""
    nfc = unicodedata.normalize("NFC", "M\u00fcller")
    nfd = unicodedata.normalize("NFD", nfc)
    db = kvsearch.Database(folder, encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512), device="cpu")
    ids = db.add(["Zhang", "padded", nfc, "42", "x"], ["Aston", "x", "Hans", "forty-two", "clash"])
    legacy = {ids[1]: " padded ", ids[2]: nfd, ids[4]: " 42"}  # " 42" and the stored "42" normalise alike
    embedded = {id_: db.encoder.encode([text])[0].numpy().tobytes() for id_, text in legacy.items()}
    db.close()
    with sqlite3.connect(folder / "store.sqlite") as conn:
        for id_, text in legacy.items():
            conn.execute("UPDATE records SET key = ?, key_emb = ? WHERE id = ?", (text, embedded[id_], id_))
    conn.close()
    db = kvsearch.Database(folder)
    dump(db, folder)
    db.close()


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    for make in (texts, embeddings, unnormalised_keys):
        make(OUT / make.__name__)
        for leftover in (OUT / make.__name__).glob("*.lock"):
            leftover.unlink()
    print("written:", sorted(p.name for p in OUT.iterdir()))
