"""The name directory and its deterministic noise generators."""

from __future__ import annotations

import random

import pytest

from kvsearch.datasets import (
    NOISE_KINDS,
    load_first_names,
    load_surnames,
    noisy_queries,
    noisy_query,
    phonetic_respelling,
    single_edit,
    split_names,
    surname_directory,
    to_cyrillic,
)
from kvsearch.errors import InvalidArgumentError, UnknownOptionError

pytest.importorskip("names")


def osa_distance(a: str, b: str) -> int:
    """Brute-force optimal string alignment distance (Levenshtein plus adjacent transpositions)."""
    d = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) + 1):
        d[i][0] = i
    for j in range(len(b) + 1):
        d[0][j] = j
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


@pytest.fixture(scope="module")
def surnames() -> list[str]:
    return load_surnames()


def test_surnames_are_the_census_list(surnames):
    assert len(surnames) == 88799
    assert len(set(surnames)) == len(surnames)
    assert surnames[:3] == ["Smith", "Johnson", "Williams"]
    first = load_first_names()
    assert len(first) == len(set(first)) > 5000
    assert "Mary" in first and "James" in first


def test_directory_is_deterministic_and_uses_first_names():
    keys, values = surname_directory(500, seed=3)
    again_keys, again_values = surname_directory(500, seed=3)
    assert (keys, values) == (again_keys, again_values)
    assert keys == load_surnames()[:500]
    assert set(values) <= set(load_first_names())
    assert surname_directory(500, seed=4)[1] != values
    with pytest.raises(InvalidArgumentError):
        surname_directory(0)


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.5])
def test_split_is_a_partition_of_the_names(fraction):
    names = [f"n{i}" for i in range(1000)]
    train, held = split_names(names, fraction, seed=1)
    assert len(held) == round(1000 * fraction)
    assert not set(train) & set(held)
    assert sorted(train + held) == sorted(names)
    assert split_names(names, fraction, seed=1) == (train, held)
    assert split_names(names, fraction, seed=2) != (train, held)
    assert train == [n for n in names if n in set(train)]  # order of the input kept


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True])
def test_split_rejects_bad_fractions(bad):
    with pytest.raises(InvalidArgumentError):
        split_names(["a", "b"], bad)


def test_single_edit_is_one_edit_away(surnames):
    rng = random.Random(0)
    for name in surnames[:2000:7]:
        edited = single_edit(name, rng)
        assert edited != name
        assert osa_distance(edited.lower(), name.lower()) == 1
        assert edited[0].isupper()


def test_phonetic_respelling_changes_the_name(surnames):
    rng = random.Random(0)
    changed = 0
    for name in surnames[:1000:5]:
        out = phonetic_respelling(name, rng)
        if out is not None:
            changed += 1
            assert out != name and len(out) >= 2
            assert 1 <= osa_distance(out.lower(), name.lower()) <= 4
    assert changed >= 150  # most surnames have a rule that fits (166 of these 200 with seed 0)
    outs = {phonetic_respelling("Phillipson", random.Random(seed)) for seed in range(20)}
    assert len(outs) > 3  # the rule and the place are drawn


def test_cyrillic_is_a_fixed_letter_map(surnames):
    assert to_cyrillic("Smith") == "Смит"
    assert to_cyrillic("Shcherbakov") == "Щербаков"
    assert to_cyrillic("Xu") == "Ксу"
    for name in surnames[:3000:3]:
        out = to_cyrillic(name)
        assert all("\u0400" <= ch <= "\u04ff" for ch in out), (name, out)
        assert out == to_cyrillic(name)


@pytest.mark.parametrize("kind", NOISE_KINDS)
def test_queries_avoid_stored_keys_and_do_not_depend_on_the_list(kind, surnames):
    names = surnames[:800]
    stored = set(surnames)
    pairs = noisy_queries(names, kind, seed=5, avoid=stored)
    assert len(pairs) >= 0.9 * len(names)
    assert all(q not in stored for q, _ in pairs)
    assert [t for _, t in pairs] == [n for n in names if n in {t for _, t in pairs}]
    name = names[600]
    alone = noisy_query(name, kind, seed=5, avoid=stored)
    assert alone == dict((t, q) for q, t in pairs).get(name)
    if kind != "cyrillic":
        other = noisy_queries(names[:200], kind, seed=6, avoid=stored)
        assert other != noisy_queries(names[:200], kind, seed=5, avoid=stored)


def test_unknown_kind_is_refused():
    with pytest.raises(UnknownOptionError, match="noise kind"):
        noisy_query("Smith", "typo")
