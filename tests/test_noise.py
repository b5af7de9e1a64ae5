"""The noise models and the pairs generated from stored keys (:mod:`kvsearch.text.noise`): seeded, reproducible, and
each model does what it says, checked against brute-force references (an edit distance, a folding of case,
accents and spaces, the scripts' alphabets)."""

from __future__ import annotations

import random
import unicodedata

import pytest

from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.text.noise import (
    NOISE_MODELS,
    case_and_spacing,
    check_noise,
    generate_pairs,
    noisy_key,
    phonetic_respelling,
    transliterate,
    typing_slips,
)

NAMES = ["Smith", "Johnson", "Li", "Lipton", "Müller", "Van der Berg", "O'Neil", "Schwarzenegger", "Xu", "Kowalczyk"]


def damerau(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (unrestricted: an edit may follow a transposition), by dynamic programming."""
    inf = len(a) + len(b)
    last: dict[str, int] = {}
    d = [[inf] * (len(b) + 2) for _ in range(len(a) + 2)]
    for i in range(len(a) + 1):
        d[i + 1][0], d[i + 1][1] = inf, i
    for j in range(len(b) + 1):
        d[0][j + 1], d[1][j + 1] = inf, j
    for i in range(1, len(a) + 1):
        match = 0
        for j in range(1, len(b) + 1):
            i1, j1 = last.get(b[j - 1], 0), match
            cost = 0 if a[i - 1] == b[j - 1] else 1
            if not cost:
                match = j
            d[i + 1][j + 1] = min(
                d[i][j] + cost, d[i + 1][j] + 1, d[i][j + 1] + 1, d[i1][j1] + (i - i1 - 1) + 1 + (j - j1 - 1)
            )
        last[a[i - 1]] = i
    return d[len(a) + 1][len(b) + 1]


def fold(text: str) -> str:
    """Case, accents, spaces and hyphens removed: what case_and_spacing may change."""
    plain = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return "".join(c for c in plain.casefold() if c not in " -\t\n")


def test_the_reference_distance() -> None:
    assert damerau("ab", "ba") == 1 and damerau("li", "idl") == 2 and damerau("ca", "abc") == 2
    assert damerau("smith", "smith") == 0 and damerau("", "abc") == 3


@pytest.mark.parametrize("name", NAMES)
def test_typing_slips_are_one_or_two_edits(name: str) -> None:
    rng = random.Random(0)
    outs = [typing_slips(name, rng) for _ in range(200)]
    made = [o for o in outs if o is not None]
    assert len(made) > 120  # most draws change the key (fewer for a two-letter key)
    for out in made:
        assert 1 <= damerau(out.lower(), name.lower()) <= 2, out
    assert any(damerau(o.lower(), name.lower()) == 2 for o in made)  # two slips happen too


def test_typing_slips_use_keyboard_neighbours() -> None:
    # a substitution by a QWERTY neighbour is the most frequent slip: "s" becomes one of its neighbours more often
    # than a letter far away on the keyboard
    rng = random.Random(1)
    subs: dict[str, int] = {}
    for _ in range(3000):
        out = typing_slips("sss", rng)
        if out is not None and len(out) == 3:
            for c in out:
                if c != "s":
                    subs[c] = subs.get(c, 0) + 1
    near = sum(subs.get(c, 0) for c in "adewqzxc")
    assert near > 5 * sum(subs.get(c, 0) for c in "pmlkoi")


@pytest.mark.parametrize("name", NAMES)
def test_case_and_spacing_changes_only_case_accents_and_spaces(name: str) -> None:
    rng = random.Random(2)
    made = [o for o in (case_and_spacing(name, rng) for _ in range(100)) if o is not None]
    assert made
    for out in made:
        assert out != name
        assert fold(out) == fold(name), (out, name)


def test_case_and_spacing_adds_and_removes_accents() -> None:
    rng = random.Random(3)
    outs = {case_and_spacing("Müller", rng) for _ in range(300)}
    assert "Muller" in outs
    assert any(o and any(unicodedata.combining(c) for c in unicodedata.normalize("NFD", o)) for o in outs)


@pytest.mark.parametrize(("script", "alphabet"), [("cyrillic", (0x0400, 0x04FF)), ("greek", (0x0370, 0x03FF))])
def test_transliteration_leaves_no_latin_letter(script: str, alphabet: tuple[int, int]) -> None:
    rng = random.Random(4)
    for name in ["Smith", "Johnson", "Lipton", "Schwarzenegger", "Kowalczyk", "Yuri", "Xu"]:
        for out in [transliterate(name, script), transliterate(name, script, rng)]:
            assert out and all(alphabet[0] <= ord(c) <= alphabet[1] for c in out), (name, out)
    assert transliterate("Smith", "cyrillic") == "Смит"
    assert transliterate("Smith", "cyrillic") == transliterate("Smith", "cyrillic")  # no rng: the usual letters
    variants = {transliterate("Yankovic", "cyrillic", rng) for _ in range(200)}
    assert len(variants) > 3  # the rng draws alternatives
    with pytest.raises(UnknownOptionError, match="script"):
        transliterate("Smith", "klingon")


def test_phonetic_respelling_fits_or_says_none() -> None:
    rng = random.Random(5)
    assert phonetic_respelling("Philips", rng) is not None
    out = {phonetic_respelling("Philips", rng) for _ in range(100)}
    assert "Filips" in out or "Fillips" in out or "Philipz" in out
    assert all(o is None or o != "Philips" for o in out)


def test_noisy_key_is_seeded_and_independent_of_other_keys() -> None:
    a = noisy_key("Johnson", ("typos", "phonetic"), seed=3, draw=1)
    assert a == noisy_key("Johnson", ("typos", "phonetic"), seed=3, draw=1)
    draws = {noisy_key("Johnson", "typos", seed=s) for s in range(20)}
    assert len(draws) > 10
    # a key's spelling depends on (key, seed, draw) only: the same inside any list of keys
    pairs = generate_pairs(["Johnson", "Smith", "Lipton"], "typos", seed=3)
    assert ("Johnson" in dict((t, q) for q, t in pairs)) and dict((t, q) for q, t in pairs)["Johnson"] == noisy_key(
        "Johnson", "typos", seed=3, draw=0
    )


def test_noisy_key_avoids_other_keys() -> None:
    # "Li" has few spellings; none of the stored ones may come out
    avoid = {"Lu", "La", "Le", "Lo", "Ki", "Oi", "Pi", "Lii", "Lli", "Il", "L", "I"}
    for seed in range(50):
        out = noisy_key("Li", "typos", seed=seed, avoid=avoid)
        assert out is None or (out not in avoid and out != "Li")


def test_generate_pairs_reproducible_counted_and_prefix_stable() -> None:
    keys = [f"{a}{b}son" for a in "BCDFGHKLMN" for b in "aeiou"]  # 50 keys
    stored = set(keys)
    pairs = generate_pairs(keys, ("typos", "phonetic"), count=120, seed=7, avoid=stored)
    assert len(pairs) == 120  # more than one round over the 50 keys
    assert pairs == generate_pairs(keys, ("typos", "phonetic"), count=120, seed=7, avoid=stored)
    assert pairs[:30] == generate_pairs(keys, ("typos", "phonetic"), count=30, seed=7, avoid=stored)
    assert pairs != generate_pairs(keys, ("typos", "phonetic"), count=120, seed=8, avoid=stored)
    assert len(set(pairs)) == len(pairs)  # no repeated pair
    for query, key in pairs:
        assert key in stored and query not in stored and query != key
    assert {key for _, key in pairs[:50]} == stored  # one round covers every key before the next begins
    assert len(generate_pairs(keys, "typos", seed=0)) == 50  # count=None: one per key


def test_generate_pairs_stops_when_nothing_new_comes() -> None:
    # a model that always gives the same spelling: one round, then nothing new
    pairs = generate_pairs(["Smith", "Jones"], lambda key, rng: key + "x", count=100)
    assert sorted(pairs) == [("Jonesx", "Jones"), ("Smithx", "Smith")]
    assert generate_pairs(["Smith"], lambda key, rng: None, count=5) == []


def test_a_callable_model_and_a_mix() -> None:
    upper = lambda key, rng: key.upper()  # noqa: E731
    pairs = generate_pairs(["Smith", "Jones"], [upper, "typos"], count=40, seed=1)
    assert any(q == k.upper() for q, k in pairs) and any(q != k.upper() for q, k in pairs)


@pytest.mark.parametrize(
    ("noise", "error"),
    [
        ("typo", UnknownOptionError),
        (["typos", "klingon"], UnknownOptionError),
        ([], InvalidArgumentError),
        (3, InvalidArgumentError),
        (["typos", 3], InvalidArgumentError),
        (b"typos", InvalidArgumentError),
    ],
)
def test_bad_noise_is_refused(noise: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="noise"):
        check_noise(noise)  # type: ignore[arg-type]
    with pytest.raises(error):
        generate_pairs(["Smith"], noise)  # type: ignore[arg-type]


def test_check_noise_accepts_every_model() -> None:
    assert check_noise(None) == ()
    assert check_noise("typos") == ("typos",)
    assert check_noise(NOISE_MODELS) == NOISE_MODELS
    for name in NOISE_MODELS:
        assert noisy_key("Johnson", name) is not None


def test_a_model_returning_a_non_string_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="str or None"):
        generate_pairs(["Smith"], lambda key, rng: 3)  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgumentError, match="count"):
        generate_pairs(["Smith"], "typos", count=-1)
