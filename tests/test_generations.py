"""Generations: encoders and the embeddings computed with them switch as one; drafts change nothing until commit."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvsearch import Database, NgramEncoder
from kvsearch.errors import InconsistentDatabaseError, NonFiniteError, NothingToRollBackError
from kvsearch.storage.encoder_files import current_generation_dir

KEYS = ["Zhang", "Lipton", "Li", "Smola", "Hu", "Werness", "Lippmann", "Smolensky"]
VALUES = ["Aston", "Zachary", "Mu", "Alex", "Rachel", "Brent", "Walter", "Paul"]


def small_encoder() -> NgramEncoder:
    return NgramEncoder(dim=32, num_buckets=1024, seed=3, device="cpu")


@pytest.fixture
def db(tmp_path):
    db = Database(tmp_path / "db", encoder=small_encoder(), device="cpu")
    db.add(KEYS, VALUES)
    yield db
    db.close()


def digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under the folder (the database must be closed)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def keys_match_encoder(db: Database) -> bool:
    """The stored key embeddings equal the loaded key encoder applied to every key text."""
    ids = db.ids()
    keys, _, _ = db.embeddings(ids)  # (m, dim)
    with torch.no_grad():
        fresh = db.encoder.encode(db.key_texts(ids))  # (m, dim)
    return torch.allclose(keys, fresh, atol=1e-6)


def perturb(encoder: NgramEncoder, scale: float) -> None:
    with torch.no_grad():
        for p in encoder.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))


def test_a_new_database_is_generation_one_with_nothing_to_roll_back(db):
    assert db.generation == 1 and db.previous_generation is None
    assert (current_generation_dir(db.path) / "encoder.json").is_file()
    with pytest.raises(NothingToRollBackError):
        db.rollback_encoders()


def test_refresh_switches_encoder_and_keys_together_and_rolls_back_once(db, tmp_path):
    before = [h.key for h in db.search("Lipp", k=3)]
    perturb(db.encoder, 0.5)
    db.refresh()
    assert db.generation == 2 and db.previous_generation == 1 and keys_match_encoder(db)
    db.close()
    reopened = Database(tmp_path / "db")
    assert reopened.generation == 2 and keys_match_encoder(reopened)
    assert reopened.rollback_encoders() == 1 and keys_match_encoder(reopened)
    assert [h.key for h in reopened.search("Lipp", k=3)] == before
    with pytest.raises(NothingToRollBackError):
        reopened.rollback_encoders()  # once
    reopened.close()
    again = Database(tmp_path / "db")
    assert again.generation == 1 and [h.key for h in again.search("Lipp", k=3)] == before
    again.close()


def test_only_the_current_and_the_previous_generation_are_kept(db):
    for step in range(4):
        perturb(db.encoder, 0.1 * (step + 1))
        db.refresh()
    assert db.generation == 5
    assert sorted(p.name for p in (db.path / "generations").iterdir()) == ["4", "5"]


def test_a_discarded_draft_changes_no_file_and_no_answer(db, tmp_path):
    folder = tmp_path / "db"
    answers = [h.id for h in db.search("Smol", k=4)]
    db.close()
    files = digests(folder)
    db = Database(folder)
    draft = db.begin_generation()
    perturb(db.encoder, 1.0)
    draft.refresh()
    assert draft.candidates(db.encoder.encode(["Smol"]), 2).ids.shape == (1, 2)
    draft.discard()
    assert [h.id for h in db.search("Smol", k=4)] == answers and db.generation == 1
    db.close()
    assert digests(folder) == files


def test_a_draft_that_raises_inside_a_with_block_is_discarded(db):
    weights = {n: t.clone() for n, t in db.encoder.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), db.begin_generation():
        perturb(db.encoder, 1.0)
        raise RuntimeError("boom")
    assert all(torch.equal(t, weights[n]) for n, t in db.encoder.state_dict().items())


def test_a_committed_draft_is_the_new_generation(db, tmp_path):
    draft = db.begin_generation()
    perturb(db.encoder, 0.3)
    assert draft.commit(summary={"metric": "recall@1", "before": 0.5, "after": 0.75}) == 2
    assert keys_match_encoder(db) and db.encoders_info()["last_run"]["after"] == 0.75
    db.close()
    reopened = Database(tmp_path / "db")
    assert reopened.generation == 2 and keys_match_encoder(reopened)
    assert reopened.encoders_info()["last_run"] == {"metric": "recall@1", "before": 0.5, "after": 0.75}
    reopened.close()


def test_non_finite_weights_are_never_saved(db, tmp_path):
    folder = tmp_path / "db"
    db.close()
    files = digests(folder)
    db = Database(folder)
    draft = db.begin_generation()
    with torch.no_grad():
        next(db.encoder.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="not saved"):
        draft.commit()
    assert draft.state == "discarded" and keys_match_encoder(db)  # the weights are back
    with torch.no_grad():
        next(db.encoder.parameters())[0, 0] = float("nan")  # changed outside any draft: close must not save it
    with pytest.warns(RuntimeWarning, match="not saved"):
        db.close()
    assert digests(folder) == files
    with Database(folder) as reopened:
        assert reopened.lookup("Li") == "Mu" and reopened.search("Li", k=1)[0].key == "Li"


def test_trained_values_are_switched_with_the_generation_and_restored_by_rollback(tmp_path):
    db = Database(tmp_path / "db", dim=4, value_dim=2, score="dot", device="cpu")
    ids = db.add(torch.eye(4), torch.zeros(4, 2))
    draft = db.begin_generation()
    draft.commit(values=(torch.tensor(ids[:2]), torch.ones(2, 2)))
    _, values, _ = db.embeddings(torch.tensor(ids))
    assert values.sum().item() == 4.0 and db.generation == 2
    db.rollback_encoders()
    _, values, _ = db.embeddings(torch.tensor(ids))
    assert values.abs().sum().item() == 0.0
    db.close()


def test_an_inconsistent_database_is_re_encoded_on_open(db, tmp_path):
    # What an older version could leave: key embeddings of a trained encoder, the untrained encoder saved.
    stale = db.encoder.encode(KEYS) * 0.5  # (n, dim) not the encoder's
    db.store.replace_embeddings(keys=stale)
    db.close()
    with pytest.warns(RuntimeWarning, match="re-encoded"):
        reopened = Database(tmp_path / "db")
    assert keys_match_encoder(reopened) and reopened.generation == 2
    reopened.close()


def test_an_inconsistent_database_that_cannot_be_repaired_says_so(db, tmp_path):
    db.store.replace_embeddings(keys=db.encoder.encode(KEYS) * 0.5)
    db.close()
    holder = subprocess.Popen(  # another process holds the write lock
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "db" / "write.lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InconsistentDatabaseError, match="could not be re-encoded"):
            Database(tmp_path / "db", lock_timeout=0.2)
    finally:
        holder.kill()
        holder.wait()


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_another_process_sees_the_new_generation(db, tmp_path):
    reader = Database(tmp_path / "db")
    perturb(db.encoder, 0.4)
    db.refresh()
    assert reader.generation == 2 and keys_match_encoder(reader)
    assert [h.id for h in reader.search("Lipto", k=3)] == [h.id for h in db.search("Lipto", k=3)]
    reader.close()


def test_in_memory_databases_have_generations_but_nothing_to_roll_back():
    db = Database(None, encoder=small_encoder(), device="cpu")
    db.add(KEYS, VALUES)
    perturb(db.encoder, 0.2)
    db.refresh()
    assert db.generation == 2 and keys_match_encoder(db)
    with pytest.raises(NothingToRollBackError):
        db.rollback_encoders()
