"""Fine-tuning pays with the data a user has (issue 22), in small: ``finetune`` with its defaults, on a few hundred
typo pairs or on none, raises held-out recall@1 over the start, measured after reopening the folder.

The user's pairs and the held-out queries are uniform random single edits (``kvsearch.datasets``' ``edit`` kind), not
the keyboard slips of the generated pairs; the held-out queries are on names that no user pair names. The study in
``benchmarks/RESULTS.md`` measured +8.3 points on these 10,000 surnames; the full-size checks (35,000 surnames,
2,000 pairs: +8 points at least) are there too.
"""

from __future__ import annotations

import pytest

from kvsearch import Database, NgramEncoder, evaluate, finetune

pytestmark = pytest.mark.slow
names = pytest.importorskip("names")

from kvsearch.datasets import noisy_queries, split_names, surname_directory  # noqa: E402


@pytest.fixture(scope="module")
def data():
    keys, values = surname_directory(10_000)
    train, held_out = split_names(keys, held_out=0.2, seed=0)
    stored = set(keys)
    held = noisy_queries(held_out, "edit", seed=0, avoid=stored)[:300]
    user = noisy_queries(train, "edit", seed=1, avoid=stored)[:500]
    return keys, values, user, held


def _run(tmp_path, data, with_pairs: bool) -> tuple[float, float]:
    keys, values, user, held = data
    db = Database(tmp_path / "db", encoder=NgramEncoder(), device="cpu")
    db.add(keys=keys, values=values)
    before = evaluate(db, held)["recall@1"]
    history = finetune(db, user if with_pairs else None, eval_pairs=held, verbose=False)
    assert history.committed and history.generated > 0
    db.close()
    with Database(tmp_path / "db") as reopened:
        after = evaluate(reopened, held)["recall@1"]
    return before, after


def test_the_defaults_pay_with_a_few_hundred_typo_pairs(tmp_path, data):
    before, after = _run(tmp_path, data, with_pairs=True)
    assert after >= before + 0.04, (before, after)


def test_the_defaults_pay_without_any_pair(tmp_path, data):
    before, after = _run(tmp_path, data, with_pairs=False)
    assert after >= before + 0.04, (before, after)
