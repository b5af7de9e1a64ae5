"""A real name directory and deterministic noisy queries for it.

The US census surname list shipped in the PyPI package ``names`` (MIT licence; ``names/dist.all.last``,
88,799 surnames, most frequent first) becomes a directory surname -> first name (first names from
``dist.male.first`` and ``dist.female.first``; the assignment is a seeded draw, so it is the same on every
machine). Queries are surnames written wrong, in three kinds (the first two are noise models of
:mod:`kvsearch.text.noise`):

1. ``"edit"``: one random single edit (substitute, delete, insert, or transpose two adjacent letters);
2. ``"phonetic"``: one or two respelling rules (ph<->f, c<->k, y<->i, ie<->ei, s<->z, doubled <-> single
   letters, ...) applied at a random place where they fit;
3. ``"cyrillic"``: the surname transliterated into Cyrillic letters by a fixed letter map (no randomness).
   The Latin keys and the Cyrillic queries share no character, so no lexical method can match them
   without learning.

Every random draw comes from a ``random.Random`` seeded by ``(seed, kind, name)``, so a name's query does
not depend on which other names are in the list. A query that spells another stored surname (``"Smith"``
-> ``"Smyth"``) has no single right answer; it is redrawn, and a name with no fitting query is skipped.

:func:`split_names` splits the *names* into train and held-out, so a result on held-out names measures
what an encoder learned, not what it memorised.

    keys, values = surname_directory()
    train, held_out = split_names(keys, held_out=0.2)
    pairs = noisy_queries(held_out, "phonetic", avoid=set(keys))   # [(query text, surname), ...]
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from importlib import resources
from typing import Literal, get_args

from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.text.noise import phonetic_respelling, single_edit

__all__ = [
    "NoiseKind",
    "NOISE_KINDS",
    "load_surnames",
    "load_first_names",
    "surname_directory",
    "split_names",
    "single_edit",
    "phonetic_respelling",
    "to_cyrillic",
    "noisy_query",
    "noisy_queries",
]

NoiseKind = Literal["edit", "phonetic", "cyrillic"]
NOISE_KINDS: tuple[str, ...] = get_args(NoiseKind)

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TRIES = 20  # draws before a name is given up (its queries all spell stored surnames)

# Latin -> Cyrillic, longest match first (a fixed, many-to-one map: c, k and q all become к).
_CYRILLIC_MULTI = (
    ("shch", "щ"),
    ("sch", "ш"),
    ("sh", "ш"),
    ("ch", "ч"),
    ("zh", "ж"),
    ("kh", "х"),
    ("ts", "ц"),
    ("tz", "ц"),
    ("ya", "я"),
    ("yu", "ю"),
    ("yo", "ё"),
    ("ph", "ф"),
    ("th", "т"),
    ("ck", "к"),
)
_CYRILLIC_SINGLE = dict(zip(_LETTERS, "а б к д е ф г х и дж к л м н о п к р с т у в в кс й з".split()))


def _package_file(name: str) -> list[str]:
    try:
        text = resources.files("names").joinpath(name).read_text(encoding="utf-8")
    except ModuleNotFoundError as exc:
        raise InvalidArgumentError(
            "expected the PyPI package 'names' (pip install names, or kvsearch[bench]) for the name lists, "
            "got none installed"
        ) from exc
    return [line.split()[0].capitalize() for line in text.splitlines() if line.strip()]


def load_surnames() -> list[str]:
    """The US census surnames of ``names/dist.all.last``, most frequent first, capitalised ("Smith").

    Returns:
        88,799 distinct surnames.

    Raises:
        InvalidArgumentError: the ``names`` package is not installed.
    """
    return list(dict.fromkeys(_package_file("dist.all.last")))


def load_first_names() -> list[str]:
    """The first names of ``dist.male.first`` then ``dist.female.first``, capitalised, without repeats.

    Returns:
        The first names (5,163 with names 0.3.0).

    Raises:
        InvalidArgumentError: the ``names`` package is not installed.
    """
    return list(dict.fromkeys(_package_file("dist.male.first") + _package_file("dist.female.first")))


def surname_directory(n: int | None = None, *, seed: int = 0) -> tuple[list[str], list[str]]:
    """A directory surname -> first name.

    Args:
        n: keep the ``n`` most frequent surnames (None: all 88,799).
        seed: the seed of the first-name assignment (a ``random.Random(seed)`` draw per surname, in order).

    Returns:
        ``(keys, values)``: the surnames and one first name per surname.

    Raises:
        InvalidArgumentError: ``n`` is not a positive integer; the ``names`` package is missing.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InvalidArgumentError(f"expected n as a positive integer or None, got {n!r}")
    keys = load_surnames()[:n]
    first = load_first_names()
    draw = random.Random(seed)
    values = [first[draw.randrange(len(first))] for _ in keys]
    return keys, values


def split_names(names: Sequence[str], held_out: float = 0.2, *, seed: int = 0) -> tuple[list[str], list[str]]:
    """Split names (not queries) into train and held-out, by a seeded shuffle.

    Args:
        names: the names.
        held_out: the held-out fraction, in (0, 1).
        seed: the shuffle seed.

    Returns:
        ``(train, held_out)``, each in the order of ``names``; together they are ``names``.

    Raises:
        InvalidArgumentError: ``held_out`` is not in (0, 1).
    """
    if isinstance(held_out, bool) or not isinstance(held_out, float | int) or not 0 < held_out < 1:
        raise InvalidArgumentError(f"expected held_out in (0, 1), got {held_out!r}")
    order = list(range(len(names)))
    random.Random(seed).shuffle(order)
    cut = round(len(names) * held_out)
    out = set(order[:cut])
    return [x for i, x in enumerate(names) if i not in out], [x for i, x in enumerate(names) if i in out]


def to_cyrillic(name: str) -> str:
    """Transliterate a Latin surname into Cyrillic letters with a fixed letter map (longest match first).

    Args:
        name: a surname in Latin letters.

    Returns:
        The Cyrillic spelling, capitalised like ``name`` (``"Smith"`` -> ``"Смит"``); characters outside
        a-z are kept.
    """
    s, out, i = name.lower(), [], 0
    while i < len(s):
        for latin, cyr in _CYRILLIC_MULTI:
            if s.startswith(latin, i):
                out.append(cyr)
                i += len(latin)
                break
        else:
            out.append(_CYRILLIC_SINGLE.get(s[i], s[i]))
            i += 1
    text = "".join(out)
    return text.capitalize() if name[:1].isupper() else text


_NOISERS: dict[str, Callable[[str, random.Random], str | None]] = {
    "edit": single_edit,
    "phonetic": phonetic_respelling,
    "cyrillic": lambda name, rng: to_cyrillic(name),
}


def noisy_query(name: str, kind: NoiseKind, *, seed: int = 0, avoid: Collection[str] = ()) -> str | None:
    """One noisy spelling of ``name``, the same for the same ``(name, kind, seed)`` on every machine.

    Args:
        name: the surname.
        kind: ``"edit"``, ``"phonetic"`` or ``"cyrillic"``.
        seed: the noise seed.
        avoid: spellings that must not come out (the stored keys): such a draw is redrawn.

    Returns:
        The query, or None when every draw equals ``name`` or a spelling in ``avoid`` (or no rule fits).

    Raises:
        UnknownOptionError: an unknown kind.
    """
    if kind not in _NOISERS:
        raise UnknownOptionError(f"expected a noise kind among {NOISE_KINDS}, got {kind!r}")
    rng = random.Random(f"{seed}:{kind}:{name}")
    for _ in range(_TRIES if kind != "cyrillic" else 1):
        query = _NOISERS[kind](name, rng)
        if query is not None and query != name and query not in avoid:
            return query
    return None


def noisy_queries(
    names: Sequence[str], kind: NoiseKind, *, seed: int = 0, avoid: Collection[str] = ()
) -> list[tuple[str, str]]:
    """``(query, name)`` pairs: one noisy query per name, names without a fitting query skipped.

    Args:
        names: the surnames.
        kind: ``"edit"``, ``"phonetic"`` or ``"cyrillic"``.
        seed: the noise seed.
        avoid: spellings that must not come out (pass ``set(keys)``).

    Returns:
        The pairs, in the order of ``names``.

    Raises:
        UnknownOptionError: an unknown kind.
    """
    avoid = avoid if isinstance(avoid, set | frozenset | dict) else set(avoid)
    pairs = []
    for name in names:
        query = noisy_query(name, kind, seed=seed, avoid=avoid)
        if query is not None:
            pairs.append((query, name))
    return pairs
