"""The quickstart: build the authors database in ``indexes/names`` and answer the example queries.

    python -m kvsearch.cli.demo [--path indexes/names]

Runs offline with the default encoders: a character n-gram encoder for the names, and the packaged
all-MiniLM-L6-v2 sentence encoder to show why spelling needs a lexical encoder.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from kvsearch.database import Database
from kvsearch.encoders.ngram import NgramEncoder
from kvsearch.encoders.sentence import SentenceEncoder
from kvsearch.errors import KeyNotFoundError

__all__ = ["AUTHORS", "build_names", "main"]

#: The running example: last name -> first name.
AUTHORS = {
    "Zhang": "Aston",
    "Lipton": "Zachary",
    "Li": "Mu",
    "Smola": "Alex",
    "Hu": "Rachel",
    "Werness": "Brent",
}


def build_names(path: str | Path | None = "indexes/names", encoder: NgramEncoder | None = None) -> Database:
    """Create (or reopen) the authors database and make sure every author is stored.

    Args:
        path: the database folder, or None for memory only.
        encoder: the key/value encoder; a default :class:`NgramEncoder` if None.

    Returns:
        The open database.
    """
    db = Database(path, encoder=encoder or NgramEncoder())
    db.upsert(keys=list(AUTHORS), values=list(AUTHORS.values()))
    return db


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Run the quickstart and print what each step answers. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m kvsearch.cli.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="indexes/names", help="database folder (default: indexes/names)")
    args = parser.parse_args(argv)

    with build_names(args.path) as db:
        out(f"{db}")
        out(f'exact lookup "Li"            -> {db.lookup("Li")!r}')
        db.delete("Li")
        try:
            db.lookup("Li")
        except KeyNotFoundError as exc:
            out(f'after delete, lookup "Li"    -> KeyNotFoundError: {exc}')
        exact = db.query("Li", k=3, pooling="exact")
        out(f'exact query "Li"             -> found={exact.found}, value={exact.value!r}')
        hits = db.search("Li", k=3)
        out('approximate search "Li"      -> ' + ", ".join(f"{h.key}->{h.value} ({h.score:.3f})" for h in hits))
        ans = db.query("Lipto", k=4, pooling="softmax", temperature=0.1)
        weights = ", ".join(f"{key}:{w:.3f}" for key, w in zip(ans.keys, ans.weights.tolist()))
        out(f'softmax query "Lipto" (T=0.1) -> {ans.value!r}  weights {weights}')
        batch = db.query(["Smola", "Zhan"], k=4)
        out(f'batched query ["Smola", "Zhan"] -> {batch.value}, output {tuple(batch.output.shape)}')
        avg = db.query("Li", k="all", pooling="average")
        mean = db.store.table.values.mean(0)
        out(f"average pooling over all      -> equals the mean value embedding: {torch.allclose(avg.output, mean)}")
        db.upsert(keys=["Li"], values=["Mu"])  # leave the demo database whole for the next run

    out("")
    out('Why a character n-gram encoder: nearest keys to "Li" under each encoder')
    semantic = Database(None, encoder=SentenceEncoder())
    semantic.add(keys=[k for k in AUTHORS if k != "Li"], values=[v for k, v in AUTHORS.items() if k != "Li"])
    lexical = build_names(None)
    lexical.delete("Li")
    for name, db in (("NgramEncoder  ", lexical), ("SentenceEncoder", semantic)):
        hits = db.search("Li", k=3)
        out(f"  {name}: " + ", ".join(f"{h.key} ({h.score:.3f})" for h in hits))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
