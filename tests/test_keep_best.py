"""``keep="best"`` with nothing held out (issue 35): a run is never committed unjudged.

Without eval pairs and with too few pairs and keys for a monitor (two pairs and ``generated=0``; a sentence-encoder
database, which generates no pairs, with four; a database of eight keys), keep-best used to find its monitor empty,
judge nothing and commit the last epoch: recall@1 on the user's own typos could fall. Now the run is judged on its
training pairs: the start and the last epoch are measured on them, and the last epoch is committed only if it beats
the start there (they cannot tell which epoch in between generalizes best: issue 36 stopped measuring those). The
reference is the database before the run: recall@1 on the user's pairs after >= before, and a run that commits
nothing leaves the database answering exactly as before.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvsearch import Database, FinetuneConfig, History, NgramEncoder, SentenceEncoder, evaluate, finetune
from kvsearch.training.losses import Batch

names = pytest.importorskip("names")

from kvsearch.datasets import noisy_queries, surname_directory  # noqa: E402
from kvsearch.text.noise import generate_pairs  # noqa: E402

K = 8
SURNAMES, FIRST_NAMES = surname_directory(200)
#: English words: keys that are not names, queried with keyboard typos.
WORDS = (
    "apple balance cabinet daughter elephant fashion garden harbour island jacket kitchen ladder machine "
    "needle orange pocket quarter rabbit saddle ticket umbrella village window yellow zipper anchor bottle "
    "candle desert engine feather guitar hammer insect jungle kettle lemon mirror napkin oyster pencil "
    "pillow rocket silver tunnel velvet walnut button carpet dragon forest helmet marble parrot"
).split()
JUDGED = "judged on its {n} training pairs (no eval_pairs, nothing held out)"


def ngram_db(keys: list[str], values: list[str]) -> Database:
    db = Database(None, encoder=NgramEncoder(dim=32, num_buckets=4096, device="cpu"), device="cpu")
    db.add(keys=keys, values=values)
    return db


def user_pairs(kind: str, seed: int, n: int = 2) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The keys and values of a database, and ``n`` of the user's (typo, key) pairs, seeded."""
    if kind == "surnames":
        keys, values = SURNAMES, FIRST_NAMES
        chosen = random.Random(seed).sample(keys, 4 * n)
        return keys, values, noisy_queries(chosen, "edit", seed=seed, avoid=set(keys))[:n]
    keys, values = WORDS, [word.upper() for word in WORDS]
    return keys, values, generate_pairs(keys, "typos", count=n, seed=seed, avoid=set(keys))


def answers(db: Database, queries: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """The top ids and the pooled answers: what the database says, to compare with the database before the run."""
    return [[hit.id for hit in hits] for hits in db.search(queries, k=K)], db.query(queries, k=K).output


def assert_never_worse_on_the_pairs(db: Database, pairs: list[tuple[str, str]], run, k: int = K) -> History:
    """Run ``run()`` (a finetune without eval pairs), check the promise against the database before it, and return
    the run's history."""
    queries = [q for q, _ in pairs] + ["Smith", "garden", "Lipton"]
    before, said, generation = evaluate(db, pairs, k=k), answers(db, queries), db.generation
    history = run()
    after = evaluate(db, pairs, k=k)
    assert after["recall@1"] >= before["recall@1"], (history.summary(), before, after)
    assert (history.judged_on, history.judged, history.monitor) == ("train_pairs", len(pairs), 0)
    measured = {int(m["epoch"]): m for m in history.metrics}
    last = len(history.epoch_losses)
    assert sorted(measured) == [0, last]  # the start and the last epoch: the pairs cannot pick an epoch between
    assert {name: measured[0][name] for name in before} == before  # the start was measured on the pairs
    assert history.summary().endswith("; " + JUDGED.format(n=len(pairs)))
    if history.committed:
        kept = history.kept_epoch
        assert kept == history.best_epoch() == last and after["recall@1"] > before["recall@1"]
        assert after == {name: measured[kept][name] for name in after}  # what it judged is what it answers
        assert db.generation == generation + 1
    else:
        assert history.kept_epoch == 0 and db.generation == generation
        assert "kept the start" in history.summary()
        ids, output = answers(db, queries)
        assert ids == said[0] and torch.equal(output, said[1])  # exactly the database before the run
    return history


@pytest.mark.parametrize("kind", ["surnames", "words"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_two_pairs_and_generated_0_are_judged_on_the_pairs(kind, seed):
    keys, values, pairs = user_pairs(kind, seed)
    db = ngram_db(keys, values)
    assert_never_worse_on_the_pairs(
        db, pairs, lambda: finetune(db, pairs, generated=0, keep="best", k=K, seed=seed, verbose=False)
    )


DIRECTION = torch.nn.functional.normalize(torch.randn(32, generator=torch.Generator().manual_seed(0)), dim=0)


def collapse_loss(batch: Batch) -> torch.Tensor:
    """Pulls every query towards one fixed direction: each epoch makes retrieval worse."""
    return -(batch.queries @ DIRECTION).mean()  # ()


@pytest.mark.parametrize("kind", ["surnames", "words"])
def test_a_run_that_makes_the_pairs_worse_commits_nothing(kind):
    """The case the old rule committed: every epoch worse on the user's pairs, no eval pairs, nothing held out."""
    keys, values, pairs = user_pairs(kind, 0, n=6)
    db = ngram_db(keys, values)
    options = {"loss": collapse_loss, "generated": 0, "train": "query", "lr": 0.5, "k": K, "epochs": 2}
    history = assert_never_worse_on_the_pairs(db, pairs, lambda: finetune(db, pairs, **options, verbose=False))
    assert max(m["recall@1"] for m in history.metrics[1:]) < history.metrics[0]["recall@1"]  # every epoch worse
    assert not history.committed  # (the rule before issue 35 committed the last: recall@1 0.833 -> 0.000)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_tiny_database_with_generated_pairs_is_judged_on_the_user_pairs(seed):
    """Eight keys: a tenth of them is no key, so nothing is held out even though pairs are generated."""
    keys, values = SURNAMES[:8], FIRST_NAMES[:8]
    pairs = noisy_queries(keys[:2], "edit", seed=seed, avoid=set(keys))
    db = ngram_db(keys, values)
    assert_never_worse_on_the_pairs(db, pairs, lambda: finetune(db, pairs, k=4, seed=seed, verbose=False), k=4)


def test_no_pairs_and_nothing_held_out_is_judged_on_the_first_epochs_generated_pairs():
    db = ngram_db(SURNAMES[:8], FIRST_NAMES[:8])
    history = finetune(db, k=4, seed=0, verbose=False)
    assert history.generated > 0 and (history.judged_on, history.judged) == ("train_pairs", history.generated)
    assert history.summary().endswith("; " + JUDGED.format(n=history.generated))


def test_keep_last_still_commits_the_last_epoch_and_says_nothing_was_judged():
    keys, values, pairs = user_pairs("surnames", 0)
    db = ngram_db(keys, values)
    generation = db.generation
    history = finetune(db, pairs, generated=0, keep="last", k=K, verbose=False)
    assert history.committed and db.generation == generation + 1 and history.kept_epoch is None
    assert (history.judged_on, history.judged, history.metrics) == ("nothing", 0, [])
    assert "(last epoch kept, " in history.summary()


def test_eval_pairs_and_the_monitor_are_named_as_before():
    keys, values, pairs = user_pairs("surnames", 0, n=4)
    db = ngram_db(keys, values)
    judged = finetune(db, pairs, eval_pairs=pairs[:2], generated=0, epochs=1, k=K, verbose=False)
    assert (judged.judged_on, judged.judged) == ("eval_pairs", 2) and "judged on" not in judged.summary()
    monitored = finetune(db, epochs=1, k=K, verbose=False)  # 200 keys: 20 held out
    assert (monitored.judged_on, monitored.judged) == ("monitor", monitored.monitor) and monitored.monitor > 0


# ----------------------------------------------------------------------------- a sentence-encoder database


@pytest.fixture(scope="module")
def sentence() -> SentenceEncoder:
    return SentenceEncoder(device="cpu")


AUTHORS = {"Li": "Mu", "Lipton": "Zachary", "Smola": "Alexander", "Zhang": "Aston", "Werness": "Brent", "Hu": "Rachel"}
TYPOS = [("Lipto", "Lipton"), ("Smolla", "Smola"), ("Zang", "Zhang"), ("Wernes", "Werness"), ("Hoo", "Hu")]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_sentence_encoder_database_with_four_pairs_is_judged_on_them(sentence, seed):
    """A sentence encoder generates no pairs (``generated="auto"`` is 0): four pairs were judged on nothing."""
    db = Database(None, encoder=sentence, device="cpu")
    db.add(keys=list(AUTHORS), values=list(AUTHORS.values()))
    pairs = random.Random(seed).sample(TYPOS, 4)
    assert_never_worse_on_the_pairs(
        db, pairs, lambda: finetune(db, pairs, k=4, epochs=2, seed=seed, verbose=False), k=4
    )


def test_many_training_pairs_are_judged_on_a_seeded_sample(monkeypatch):
    """Judging costs at most MAX_JUDGED queries per epoch whatever the run trains on: a seeded sample of the user's
    pairs (the same for the same seed), and the promise holds on it."""
    import kvsearch.training.pairs as pairs_module

    monkeypatch.setattr(pairs_module, "MAX_JUDGED", 5)
    keys, values, pairs = user_pairs("surnames", seed=3, n=12)
    plans = []
    for seed in (0, 0, 1):
        db = ngram_db(keys, values)
        history = finetune(db, pairs, generated=0, epochs=1, keep="best", seed=seed, verbose=False)
        assert (history.judged_on, history.judged) == ("train_pairs", 5)
        assert history.summary().endswith("; " + JUDGED.format(n=5))
        config = FinetuneConfig(generated=0, epochs=1, keep="best", seed=seed)
        plans.append(pairs_module.plan_run(db, pairs, None, config).eval)
        db.close()
    assert plans[0] == plans[1] != plans[2] and all(set(p) <= set(pairs) and len(p) == 5 for p in plans)
