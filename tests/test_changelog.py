"""The change log and the reader's catch-up (issue 15, item 1).

A second handle on the same folder (or another process) catches up on a small foreign write row by row — no
full reload, observed through ``db.store.full_loads`` / ``db.store.catch_ups`` — and answers exactly as the
writer does; a compacted log, or a change of every row (``refresh()``), falls back to a full reload that is just
as correct; what a caught-up reader saves on close (the index, the embeddings side files) is that version's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvsearch
import kvsearch.storage.store
from kvsearch import Database

DIM, VALUE_DIM = 8, 4
SPECS = ["Flat", "HNSW8", "IVF4,Flat", "torch"]


def _records(n: int, seed: int) -> tuple[list[str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [f"k{seed}-{i}" for i in range(n)], torch.randn(n, VALUE_DIM, generator=g)


@pytest.fixture
def encoder():
    return kvsearch.NgramEncoder(dim=DIM, num_buckets=64, seed=0)


def _agree(reader: Database, writer: Database) -> None:
    """The reader answers as the writer: ids, index ids, embeddings, lookups, exact search results."""
    ids = writer.ids()
    assert torch.equal(reader.ids(), ids)
    assert torch.equal(reader.index.ids(), ids)
    rk, rv, _ = reader.embeddings(ids)
    wk, wv, _ = writer.embeddings(ids)
    assert torch.equal(rk, wk) and torch.equal(rv, wv)
    texts = writer.key_texts(ids)
    assert reader.key_texts(ids) == texts
    for text in texts[:50]:
        assert torch.equal(reader.lookup(text), writer.lookup(text))
    queries = wk[:5] + 0.01
    if not writer.index.is_fallback and writer.index_spec.startswith(("HNSW", "IVF")):
        return  # approximate: the same ids are indexed (above), the graph / lists may differ
    assert [[h.id for h in hits] for hits in reader.search(queries, k=5)] == [
        [h.id for h in hits] for hits in writer.search(queries, k=5)
    ]


@pytest.mark.parametrize("spec", SPECS)
def test_a_small_foreign_write_is_caught_up_without_a_full_reload(tmp_path, encoder, spec):
    writer = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM, index=spec)
    keys, values = _records(300, 0)
    writer.add(keys, values)
    reader = Database(tmp_path / "db")
    assert reader.store.full_loads == 1  # the open
    for step, write in enumerate(
        [
            lambda: writer.add(*_records(1, 1)),
            lambda: writer.upsert(["k0-3", "k0-4", "new"], torch.randn(3, VALUE_DIM)),
            lambda: writer.delete(["k0-5", "k1-0"]),
            lambda: (writer.add(*_records(2, 2)), writer.delete("k2-0"), writer.upsert(["k2-1"], torch.ones(1, 4))),
        ]
    ):
        write()
        _agree(reader, writer)
        assert reader.store.full_loads == 1, f"step {step}: a full reload"
        assert reader.store.catch_ups == step + 1
    # the reader writes too: the writer catches up on it the same way
    reader.add(*_records(4, 3))
    _agree(writer, reader)
    assert writer.store.full_loads == 1 and writer.store.catch_ups == 1
    reader.close()
    writer.close()


def test_a_compacted_log_falls_back_to_a_full_reload(tmp_path, encoder):
    writer = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM, index="HNSW8")
    writer.add(*_records(200, 0))
    reader = Database(tmp_path / "db")
    writer.store.changelog_keep = 2  # the log keeps the last two versions
    for seed in (1, 2):
        writer.add(*_records(3, seed))
    _agree(reader, writer)  # two versions behind: still in the log
    assert (reader.store.full_loads, reader.store.catch_ups) == (1, 1)
    for seed in (3, 4, 5):
        writer.add(*_records(3, seed))
    writer.delete(["k3-0", "k0-7"])
    _agree(reader, writer)  # four versions behind, the log keeps two: a full reload, just as correct
    assert (reader.store.full_loads, reader.store.catch_ups) == (2, 1)
    writer.add(*_records(1, 6))
    _agree(reader, writer)
    assert (reader.store.full_loads, reader.store.catch_ups) == (2, 2)
    reader.close()
    writer.close()


def test_a_new_generation_is_a_full_reload(tmp_path, encoder):
    writer = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM)
    writer.add(*_records(50, 0))
    reader = Database(tmp_path / "db")
    writer.add(*_records(2, 1))
    writer.refresh()  # a change of every row, logged as "full"
    writer.add(*_records(2, 2))
    _agree(reader, writer)
    assert (reader.store.full_loads, reader.store.catch_ups) == (2, 0)
    assert reader.generation == writer.generation
    reader.close()
    writer.close()


def test_what_a_caught_up_reader_saves_is_that_versions(tmp_path, encoder):
    writer = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM, index="HNSW8")
    writer.add(*_records(100, 0))
    writer.close()
    writer = Database(tmp_path / "db")
    reader = Database(tmp_path / "db")
    writer.add(*_records(3, 1))
    writer.delete(["k0-1"])
    writer.upsert(["k0-2"], torch.zeros(1, VALUE_DIM))
    assert len(reader) == 102 and reader.store.catch_ups == 1
    reader.close()  # saves its caught-up index, tagged with the version it reflects
    third = Database(tmp_path / "db")
    assert not third.retriever.dirty  # the reader's saved index was served, not rebuilt
    _agree(third, writer)
    assert torch.equal(third.lookup("k0-2"), torch.zeros(VALUE_DIM))
    third.close()
    writer.close()


def test_a_writer_in_another_process_is_caught_up(tmp_path, encoder):
    writer = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM, index="HNSW8")
    writer.add(*_records(100, 0))
    reader = Database(tmp_path / "db")
    assert len(reader) == 100
    script = textwrap.dedent(
        f"""
        import torch, kvsearch
        db = kvsearch.Database({str(tmp_path / "db")!r})
        db.add(["other"], torch.ones(1, {VALUE_DIM}))
        db.delete("k0-9")
        db.close()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    assert torch.equal(reader.lookup("other"), torch.ones(VALUE_DIM))
    assert "k0-9" not in reader and len(reader) == 100
    assert (reader.store.full_loads, reader.store.catch_ups) == (1, 1)
    _agree(reader, writer)
    reader.close()
    writer.close()


def test_a_caught_up_reader_keeps_texts_given_with_their_own_embeddings(tmp_path, encoder):
    writer = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM)
    keys, values = _records(50, 3)
    writer.add(keys, values)
    reader = Database(tmp_path / "db", encoder=encoder, value_dim=VALUE_DIM)
    assert len(reader) == 50
    own = torch.randn(1, DIM, generator=torch.Generator().manual_seed(4))  # (1, DIM): not the encoder's
    (id_,) = writer.add(["doc-17"], values[:1], key_embeddings=own)
    loads = reader.store.full_loads
    assert len(reader) == 51 and reader.store.full_loads == loads  # caught up row by row
    assert reader.key_texts([id_], encoded_only=True) == [None]  # known as given: a trainer leaves it alone
    reader.refresh()  # re-encodes every key from its text, but never a text that came with its own embedding
    assert torch.equal(reader.embeddings(torch.tensor([id_]))[0].cpu(), own)
    reader.close()
    writer.close()
