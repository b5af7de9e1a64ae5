"""Fine-tuning on pairs generated from the stored keys (issue 22): with or without the user's pairs, the monitor's
keys never trained on, fresh spellings each epoch, seeded, refused typed before anything is written, the same from
the CLI, and the defaults that depend on the database."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kvsearch import Database, FinetuneConfig, NgramEncoder, finetune
from kvsearch.cli import main
from kvsearch.errors import InvalidArgumentError, NotSupportedError, UnknownOptionError
from kvsearch.text.noise import generate_pairs
from kvsearch.training.defaults import (
    AUTO_GENERATED,
    AUTO_PER_KEY,
    auto_batch_size,
    auto_generated,
    auto_train,
    lr_schedule,
)
from kvsearch.training.pairs import MONITOR_KEYS, plan_pairs

names = pytest.importorskip("names")

from kvsearch.datasets import noisy_queries, surname_directory  # noqa: E402

KEYS, VALUES = surname_directory(800)


def small_db(path: Path | None = None) -> Database:
    db = Database(path, encoder=NgramEncoder(dim=32, num_buckets=4096, device="cpu"), device="cpu")
    db.add(keys=KEYS, values=VALUES)
    return db


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "lock"
    }


def answers(db: Database, queries: list[str]) -> list[list[int]]:
    return [[hit.id for hit in hits] for hits in db.search(queries, k=5)]


# ----------------------------------------------------------------------------- the plan


def test_without_eval_pairs_held_out_keys_monitor_and_are_never_trained_on():
    db = small_db()
    plan = plan_pairs(db, None, None, noise=("typos", "phonetic"), generated=500, epochs=3, seed=0, key_targets=True)
    trained = {key for _, key in plan.train}
    monitored = {key for _, key in plan.eval}
    assert plan.monitor == len(plan.eval) > 0 and len(monitored) <= min(MONITOR_KEYS, len(KEYS) // 10)
    assert not trained & monitored
    assert plan.user == 0 and plan.generated == 500 and len(plan.train) == 1500  # fresh ones for 3 epochs
    epochs = [plan.rows(e).tolist() for e in (1, 2, 3)]
    assert [len(rows) for rows in epochs] == [500, 500, 500]
    assert not set(epochs[0]) & set(epochs[1])  # each epoch its own spellings
    assert (
        plan.train
        == plan_pairs(
            db, None, None, noise=("typos", "phonetic"), generated=500, epochs=3, seed=0, key_targets=True
        ).train
    )  # seeded


def test_user_pairs_come_first_and_the_eval_pairs_keys_are_not_drawn():
    db = small_db()
    user = noisy_queries(KEYS[:100], "edit", avoid=set(KEYS))
    held = noisy_queries(KEYS[100:160], "edit", avoid=set(KEYS))
    plan = plan_pairs(db, user, held, noise="typos", generated=300, epochs=2, seed=1, key_targets=True)
    assert plan.train[: len(user)] == user and plan.user == len(user)
    assert plan.eval == held and plan.monitor == 0
    assert not {key for _, key in plan.train[len(user) :]} & {key for _, key in held}
    rows = plan.rows(2).tolist()
    assert rows[: len(user)] == list(range(len(user)))  # every epoch trains on every user pair
    # no generation: the user's pairs as given
    same = plan_pairs(db, user, held, noise=None, generated=300, epochs=2, seed=1, key_targets=True)
    assert (same.train, same.generated) == (user, 0)


def test_without_eval_pairs_a_share_of_the_users_keys_moves_to_the_monitor():
    db = small_db()
    user = noisy_queries(KEYS[:300], "cyrillic", avoid=set(KEYS))  # the user's task is not what is generated
    plan = plan_pairs(db, user, None, noise="typos", generated=200, epochs=1, seed=2, key_targets=True)
    mine = {key for _, key in user}
    monitored_user = [pair for pair in plan.eval if pair in user]
    assert len({key for _, key in monitored_user}) == int(len(mine) * 0.1)  # MONITOR_SHARE of the user's keys
    trained_user = plan.train[: plan.user]
    assert len(trained_user) + len(monitored_user) == len(user)
    assert not {key for _, key in trained_user} & {key for _, key in monitored_user}  # split by key
    assert not {key for _, key in plan.train} & {key for _, key in plan.eval}  # nothing monitored is trained on
    assert plan.monitor == len(plan.eval) > len(monitored_user)  # and generated queries of other held-out keys


def test_epochs_wrap_around_when_the_keys_give_fewer_spellings():
    db = Database(None, encoder=NgramEncoder(dim=16, num_buckets=512, device="cpu"), device="cpu")
    db.add(keys=["Li", "Xu", "Ng", "Smith", "Jones"], values=["a", "b", "c", "d", "e"])
    plan = plan_pairs(db, None, None, noise=lambda key, rng: key + "x", generated=4, epochs=3, seed=0, key_targets=True)
    assert len(plan.train) == 5 and plan.generated == 4  # one spelling per key, no held-out key in so few (10 %)
    assert plan.rows(2).tolist() == [4, 0, 1, 2]


# ----------------------------------------------------------------------------- finetune


def test_finetune_without_pairs_trains_on_generated_pairs_and_is_seeded(tmp_path):
    runs = []
    for name in ("a", "b"):
        db = small_db(tmp_path / name)
        history = finetune(db, epochs=2, seed=3, verbose=False)
        assert history.generated == min(AUTO_GENERATED, AUTO_PER_KEY * len(KEYS))
        assert history.monitor > 0 and len(history.metrics) == 3
        runs.append((history.metrics, db.encoder.embedding.weight.detach().clone(), history.committed))
        db.close()
    assert runs[0][0] == runs[1][0]  # the same seed, the same run (the weights up to the order of float sums)
    assert (runs[0][1] - runs[1][1]).abs().max() < 1e-4, (runs[0][1] - runs[1][1]).abs().max()
    assert runs[0][2]  # the generated typos taught this small encoder something (recall@1 rose on held-out keys)


def test_nothing_to_train_on_is_refused_before_anything_is_written(tmp_path):
    small_db(tmp_path / "db").close()
    before = digest(tmp_path / "db")
    db = Database(tmp_path / "db")
    generation = db.generation
    probe = ["Smyth", "Jonson", "Wiliams"]
    results = answers(db, probe)
    with pytest.raises(InvalidArgumentError, match="expected train_pairs"):
        finetune(db, generated=0, verbose=False)
    with pytest.raises(InvalidArgumentError, match="expected train_pairs"):
        finetune(db, noise=None, verbose=False)
    with pytest.raises(UnknownOptionError, match="noise"):
        finetune(db, noise="klingon", verbose=False)
    for bad in ("lots", -1, True, 2.5):
        with pytest.raises(InvalidArgumentError, match="generated"):
            finetune(db, generated=bad, verbose=False)
    with pytest.raises(UnknownOptionError, match="lr_decay"):
        finetune(db, lr_decay="exponential", verbose=False)
    assert db.generation == generation and answers(db, probe) == results
    db.close()
    assert digest(tmp_path / "db") == before


def test_tensor_pairs_and_value_targets_generate_nothing():
    db = small_db()
    assert auto_generated(db, (torch.zeros(3, 32), torch.zeros(3, 32))) == 0
    plan = plan_pairs(db, [("Smyth", "Mary")], None, noise="typos", generated=50, epochs=1, seed=0, key_targets=False)
    assert plan.generated == 0 and plan.train == [("Smyth", "Mary")]
    tensors = Database(None, dim=8, value_dim=2, device="cpu")
    tensors.add(keys=torch.randn(20, 8), values=torch.randn(20, 2))
    assert auto_generated(tensors, None) == 0 and auto_train(tensors) == "query"
    assert auto_train(db) == "query+keys"


def test_a_sharded_database_generates_only_when_asked_and_then_says_not_yet(tmp_path):
    from kvsearch.distributed import ShardedDatabase

    with ShardedDatabase(
        tmp_path / "s", num_shards=2, encoder=NgramEncoder(dim=16, num_buckets=512, device="cpu"), device="cpu"
    ) as sdb:
        sdb.add(keys=KEYS[:50], values=VALUES[:50])
        assert auto_generated(sdb, None) == 0
        with pytest.raises(InvalidArgumentError, match="expected train_pairs"):
            finetune(sdb, verbose=False)
        with pytest.raises(NotSupportedError, match="generated=0"):
            finetune(sdb, generated=100, verbose=False)


def test_the_config_takes_and_checks_the_new_options():
    config = FinetuneConfig(noise=["typos", "case"], generated=10, lr_decay="cosine")
    assert config.noise == ("typos", "case") and config.generated == 10
    assert FinetuneConfig(noise=None).noise is None and FinetuneConfig().generated == "auto"
    assert FinetuneConfig().loss == "retrieval" and FinetuneConfig().train is None  # the defaults of the study
    assert FinetuneConfig().batch_size is None and auto_batch_size(0) == 64 and auto_batch_size(100) == 256


@pytest.mark.parametrize("decay", ["none", "linear", "cosine"])
def test_lr_schedule_against_its_formula(decay):
    import math

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.5)
    schedule = lr_schedule(opt, decay, 10)
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    expected = {
        "none": [0.5] * 10,
        "linear": [0.5 * (1 - s / 10) for s in range(10)],
        "cosine": [0.5 * 0.5 * (1 + math.cos(math.pi * s / 10)) for s in range(10)],
    }[decay]
    assert seen == pytest.approx(expected)


# ----------------------------------------------------------------------------- the CLI


def test_cli_finetune_without_pairs(tmp_path, capsys):
    folder = tmp_path / "db"
    small_db(folder).close()
    assert main(["finetune", str(folder), "--epochs", "1", "--generated", "400", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "on 400 pairs generated from the stored keys per epoch for 1 epoch" in out
    assert "queries of held-out keys" in out
    assert main(["finetune", str(folder), "--noise", "none", "--quiet"]) == 1
    assert "expected train_pairs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["finetune", str(folder), "--noise", "typos,klingon"])
    assert exit_info.value.code == 2
    assert "expected noise models among" in capsys.readouterr().err


def test_generated_pairs_name_stored_keys_only():
    stored = set(KEYS)
    for query, key in generate_pairs(KEYS, ("typos", "phonetic", "case"), count=2000, seed=5, avoid=stored):
        assert key in stored and query not in stored
