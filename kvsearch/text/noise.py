"""Noise models: how people write a key wrong, and (noisy key, key) pairs generated from stored keys.

Fine-tuning needs (query, right key) pairs. A database's own keys are such data: a key written wrong the way
people write it wrong, paired with the key. A noise model turns a key into one wrong spelling:

- ``"typos"``: typing slips, one (70 %) or two: a neighbouring key on a QWERTY keyboard instead of the right one,
  a doubled letter, a dropped letter, two adjacent letters swapped, a letter inserted or replaced at random.
- ``"phonetic"``: one or two respelling rules at a random place where they fit (ph <-> f, c <-> k, y <-> i,
  ie <-> ei, s <-> z, doubled <-> single consonants, a final e dropped or added, ...).
- ``"case"``: case, diacritics and whitespace: lower / upper / swapped case, a diacritic added to a letter or
  every one removed (é <-> e), a space or hyphen removed, added, doubled or swapped, stray whitespace.
- ``"cyrillic"``, ``"greek"``: transliteration into that script, the way people do it by ear: each Latin letter
  or group maps to its usual letter, or (less often) to an alternative (``y`` -> й, и or ы). Name a script only
  when queries come in it.

A noise model may also be a callable ``(key, rng: random.Random) -> str | None`` (None: no wrong spelling fits).
Every draw comes from a ``random.Random`` seeded by ``(seed, draw, key)``, so a key's noisy spellings do not depend
on which other keys there are, and the same call gives the same pairs on every machine.

    pairs = generate_pairs(keys, ("typos", "phonetic"), count=20_000, seed=0, avoid=set(keys))
    # [("Smitth", "Smith"), ("Filips", "Philips"), ...]; never a spelling in ``avoid`` (another stored key)

This module knows nothing of databases, encoders or training; :func:`kvsearch.finetune` uses it.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Callable, Collection, Sequence
from typing import Literal, get_args

from kvsearch.errors import InvalidArgumentError, UnknownOptionError

__all__ = [
    "NoiseName",
    "NoiseFn",
    "Noise",
    "NOISE_MODELS",
    "DEFAULT_NOISE",
    "typing_slips",
    "single_edit",
    "phonetic_respelling",
    "case_and_spacing",
    "transliterate",
    "check_noise",
    "noisy_key",
    "generate_pairs",
]

NoiseName = Literal["typos", "phonetic", "case", "cyrillic", "greek"]
#: The built-in noise models (see the module docstring).
NOISE_MODELS: tuple[str, ...] = get_args(NoiseName)
#: A noise model of your own: a key and a random source in, one wrong spelling (or None) out.
NoiseFn = Callable[[str, random.Random], str | None]
#: What ``noise=`` takes: a name, a callable, or a sequence of them (each draw picks one at random).
Noise = NoiseName | NoiseFn | Sequence[NoiseName | NoiseFn]
#: The models fine-tuning draws from by default: the slips and respellings of any Latin-script key.
DEFAULT_NOISE: tuple[str, ...] = ("typos", "phonetic")

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TRIES = 20  # draws before a key is given up (every draw spelled it right or spelled another stored key)
_QWERTY = ("qwertyuiop", "asdfghjkl", "zxcvbnm")


def _neighbours() -> dict[str, str]:
    """Each letter's neighbours on a QWERTY keyboard (same row and the rows above and below)."""
    near: dict[str, str] = {}
    for r, row in enumerate(_QWERTY):
        for i, c in enumerate(row):
            around = {
                _QWERTY[rr][j]
                for rr in (r - 1, r, r + 1)
                if 0 <= rr < len(_QWERTY)
                for j in (i - 1, i, i + 1)
                if 0 <= j < len(_QWERTY[rr])
            }
            near[c] = "".join(sorted(around - {c}))
    return near


_NEAR = _neighbours()


def _restore_case(noisy: str, original: str) -> str:
    return noisy.capitalize() if original[:1].isupper() else noisy


# ----------------------------------------------------------------------------- typing slips


def single_edit(name: str, rng: random.Random) -> str:
    """One random edit: substitute, delete, insert a letter, or transpose two adjacent different letters.

    Args:
        name: a key (at least 2 letters for a deletion; shorter keys get the other edits).
        rng: the random source.

    Returns:
        The edited key (lower case, then capitalised like ``name``); always different from ``name``.
    """
    s = name.lower()
    ops = ["substitute", "insert"]
    if len(s) >= 2:
        ops.append("delete")
    if any(a != b for a, b in zip(s, s[1:])):
        ops.append("transpose")
    op = rng.choice(ops)
    if op == "substitute":
        i = rng.randrange(len(s))
        s = s[:i] + rng.choice(_LETTERS.replace(s[i], "")) + s[i + 1 :]
    elif op == "insert":
        i = rng.randrange(len(s) + 1)
        s = s[:i] + rng.choice(_LETTERS) + s[i:]
    elif op == "delete":
        i = rng.randrange(len(s))
        s = s[:i] + s[i + 1 :]
    else:
        spots = [i for i in range(len(s) - 1) if s[i] != s[i + 1]]
        i = rng.choice(spots)
        s = s[:i] + s[i + 1] + s[i] + s[i + 2 :]
    return _restore_case(s, name)


def _slip(s: str, rng: random.Random) -> str:
    """One typing slip on lower-case ``s`` (may return ``s`` unchanged when the slip does not fit)."""
    i = rng.randrange(len(s))
    kind = rng.random()
    if kind < 0.30:  # a neighbouring key
        near = _NEAR.get(s[i])
        if near:
            return s[:i] + rng.choice(near) + s[i + 1 :]
        kind = 0.95  # not a QWERTY letter: a letter of the key itself instead (its own script)
    if kind < 0.50:  # a dropped letter
        return s[:i] + s[i + 1 :] if len(s) > 2 else s
    if kind < 0.65:  # a doubled letter
        return s[:i] + s[i] + s[i:]
    if kind < 0.85:  # two adjacent letters swapped
        return s[:i] + s[i + 1] + s[i] + s[i + 2 :] if i + 1 < len(s) else s
    pool = _LETTERS if s.isascii() else "".join(sorted(set(s) - {" "})) or _LETTERS
    if kind < 0.925:  # a letter inserted
        return s[:i] + rng.choice(pool) + s[i:]
    return s[:i] + rng.choice(pool) + s[i + 1 :]  # a letter replaced


def typing_slips(name: str, rng: random.Random) -> str | None:
    """One typing slip (70 %) or two: a QWERTY neighbour, a dropped, doubled, swapped, inserted or replaced letter.

    Args:
        name: a key.
        rng: the random source.

    Returns:
        The mistyped key (capitalised like ``name``), or None when the slips left it unchanged.
    """
    s = name.lower()
    if not s:
        return None
    for _ in range(1 if rng.random() < 0.7 else 2):
        s = _slip(s, rng)
    return _restore_case(s, name) if s != name.lower() else None


# ----------------------------------------------------------------------------- phonetic respellings

# (pattern, replacement), each applied at one random match.
_PHONETIC_RULES: tuple[tuple[str, str], ...] = (
    ("ph", "f"),
    ("f", "ph"),
    ("c(?=[aou])", "k"),
    ("k", "c"),
    ("ck", "k"),
    ("(?<=[a-z])y", "i"),
    ("(?<=[a-z])i", "y"),
    ("ie", "ei"),
    ("ei", "ie"),
    ("s", "z"),
    ("z", "s"),
    ("x", "ks"),
    ("ks", "x"),
    ("qu", "kw"),
    ("ee", "ea"),
    ("ea", "ee"),
    ("oo", "u"),
    ("ou", "ow"),
    ("w", "v"),
    ("v", "w"),
    ("th", "t"),
    ("sch", "sh"),
    ("(?<=[a-z]{3})e$", ""),  # drop a final e (not from a name of 3 letters or fewer)
    ("(?<=[^aeiouy])$", "e"),
    (r"([b-df-hj-np-tv-z])\1", r"\1"),  # doubled consonant -> single
    (r"(?<=[aeiouy])([bdgklmnprst])(?=[aeiouy])", r"\1\1"),  # single consonant between vowels -> doubled
)
_COMPILED = tuple((re.compile(pattern), repl) for pattern, repl in _PHONETIC_RULES)


def phonetic_respelling(name: str, rng: random.Random) -> str | None:
    """Apply one or two phonetic respelling rules, each at a random place where it fits.

    Args:
        name: a key.
        rng: the random source.

    Returns:
        The respelled key (capitalised like ``name``), or None when no rule fits.
    """
    s = name.lower()
    applied = 0
    for _ in range(1 if rng.random() < 0.5 else 2):
        fits = [(repl, list(pattern.finditer(s))) for pattern, repl in _COMPILED]
        fits = [(repl, found) for repl, found in fits if found]
        rng.shuffle(fits)
        for repl, found in fits:
            m = rng.choice(found)
            new = s[: m.start()] + m.expand(repl) + s[m.end() :]
            if new and new != s:
                s, applied = new, applied + 1
                break
    return _restore_case(s, name) if applied and s != name.lower() else None  # two rules may undo each other


# ----------------------------------------------------------------------------- case, diacritics, whitespace

_ACCENTS = {"a": "áàâäã", "e": "éèêë", "i": "íìîï", "o": "óòôöõ", "u": "úùûü", "n": "ñ", "c": "ç", "s": "š", "z": "ž"}


def _strip_accents(s: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKD", s) if not unicodedata.combining(c))


def case_and_spacing(name: str, rng: random.Random) -> str | None:
    """One change of case, diacritics or whitespace.

    Lower, upper or swapped case; a diacritic added to a letter (e -> é) or every one removed (é -> e); a space or
    hyphen removed, turned into the other, or doubled; a space inserted; whitespace around the key.

    Args:
        name: a key.
        rng: the random source.

    Returns:
        The changed key, or None when the drawn change does not fit (e.g. no diacritic to remove).
    """
    kind = rng.randrange(6)
    if kind == 0:
        out = rng.choice((name.lower(), name.upper(), name.swapcase()))
    elif kind == 1:
        out = _strip_accents(name)
    elif kind == 2:
        spots = [i for i, c in enumerate(name) if c.lower() in _ACCENTS]
        if not spots:
            return None
        i = rng.choice(spots)
        accented = rng.choice(_ACCENTS[name[i].lower()])
        out = name[:i] + (accented.upper() if name[i].isupper() else accented) + name[i + 1 :]
    elif kind == 3:
        gaps = [i for i, c in enumerate(name) if c in " -"]
        if not gaps:
            return None
        i = rng.choice(gaps)
        out = name[:i] + rng.choice(("", "-" if name[i] == " " else " ", name[i] * 2)) + name[i + 1 :]
    elif kind == 4:
        i = rng.randrange(1, len(name)) if len(name) > 1 else 1
        out = name[:i] + " " + name[i:]
    else:
        out = rng.choice((" ", "  ", "\t")) + name if rng.random() < 0.5 else name + rng.choice((" ", "  ", "\n"))
    return out if out != name else None


# ----------------------------------------------------------------------------- transliteration

# Latin letters and groups -> (the usual letter, alternatives...). Longest group first.
_SCRIPTS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "cyrillic": (
        ("shch", ("щ", "шч")),
        ("sch", ("ш", "щ", "сч")),
        ("sh", ("ш",)),
        ("ch", ("ч", "х")),
        ("zh", ("ж",)),
        ("kh", ("х",)),
        ("ts", ("ц", "тс")),
        ("tz", ("ц",)),
        ("ya", ("я", "иа")),
        ("yu", ("ю",)),
        ("yo", ("ё", "йо")),
        ("ph", ("ф",)),
        ("th", ("т", "с")),
        ("ck", ("к",)),
        ("ee", ("и", "ее")),
        ("oo", ("у", "оо")),
        ("a", ("а",)),
        ("b", ("б",)),
        ("c", ("к", "ц", "с")),
        ("d", ("д",)),
        ("e", ("е", "э")),
        ("f", ("ф",)),
        ("g", ("г", "ж")),
        ("h", ("х", "г")),
        ("i", ("и", "ай", "й")),
        ("j", ("дж", "й", "ж")),
        ("k", ("к",)),
        ("l", ("л", "ль")),
        ("m", ("м",)),
        ("n", ("н",)),
        ("o", ("о",)),
        ("p", ("п",)),
        ("q", ("к",)),
        ("r", ("р",)),
        ("s", ("с", "з")),
        ("t", ("т",)),
        ("u", ("у", "ю", "а")),
        ("v", ("в",)),
        ("w", ("в", "у")),
        ("x", ("кс",)),
        ("y", ("й", "и", "ы")),
        ("z", ("з", "ц")),
    ),
    "greek": (
        ("th", ("θ", "τ")),
        ("ph", ("φ",)),
        ("ch", ("χ", "τσ")),
        ("ps", ("ψ",)),
        ("ks", ("ξ",)),
        ("ou", ("ου",)),
        ("a", ("α",)),
        ("b", ("μπ", "β")),
        ("c", ("κ", "σ")),
        ("d", ("ντ", "δ")),
        ("e", ("ε", "η")),
        ("f", ("φ",)),
        ("g", ("γκ", "γ")),
        ("h", ("χ", "")),
        ("i", ("ι", "η")),
        ("j", ("τζ",)),
        ("k", ("κ",)),
        ("l", ("λ",)),
        ("m", ("μ",)),
        ("n", ("ν",)),
        ("o", ("ο", "ω")),
        ("p", ("π",)),
        ("q", ("κ",)),
        ("r", ("ρ",)),
        ("s", ("σ",)),
        ("t", ("τ",)),
        ("u", ("ου", "υ")),
        ("v", ("β",)),
        ("w", ("ου", "β")),
        ("x", ("ξ",)),
        ("y", ("ι", "υ")),
        ("z", ("ζ",)),
    ),
}
_USUAL = 0.75  # the chance of the usual letter where there are alternatives


def transliterate(name: str, script: str, rng: random.Random | None = None) -> str:
    """Write a Latin-script key in another script, letter group by letter group (longest group first).

    Args:
        name: a key in Latin letters.
        script: ``"cyrillic"`` or ``"greek"``.
        rng: draws the alternatives (``"y"`` -> й, и or ы); None: always the usual letter.

    Returns:
        The transliteration, capitalised like ``name``; characters outside a-z are kept.

    Raises:
        UnknownOptionError: an unknown script.
    """
    if script not in _SCRIPTS:
        raise UnknownOptionError(f"expected a script among {tuple(_SCRIPTS)}, got {script!r}")
    table = _SCRIPTS[script]
    s, out, i = name.lower(), [], 0
    while i < len(s):
        for latin, letters in table:
            if s.startswith(latin, i):
                pick = letters[0] if rng is None or len(letters) == 1 or rng.random() < _USUAL else None
                out.append(pick if pick is not None else rng.choice(letters[1:]))  # type: ignore[union-attr]
                i += len(latin)
                break
        else:
            out.append(s[i])
            i += 1
    text = "".join(out)
    if script == "greek":
        text = re.sub(r"σ\b", "ς", text)  # the final sigma
    return _restore_case(text, name)


# ----------------------------------------------------------------------------- generating pairs

_MODELS: dict[str, NoiseFn] = {
    "typos": typing_slips,
    "phonetic": phonetic_respelling,
    "case": case_and_spacing,
    "cyrillic": lambda name, rng: transliterate(name, "cyrillic", rng),
    "greek": lambda name, rng: transliterate(name, "greek", rng),
}


def check_noise(noise: Noise | None) -> tuple[NoiseName | NoiseFn, ...]:
    """The noise models of a ``noise=`` argument, checked.

    Args:
        noise: a model name from :data:`NOISE_MODELS`, a callable ``(key, rng) -> str | None``, a sequence of
            those, or None (no model).

    Returns:
        The models as a tuple (empty for None).

    Raises:
        UnknownOptionError: an unknown name.
        InvalidArgumentError: anything else (an empty sequence, a number, ...).
    """
    if noise is None:
        return ()
    items = (noise,) if isinstance(noise, str) or callable(noise) else noise
    if not isinstance(items, Sequence) or isinstance(items, bytes) or not items:
        raise InvalidArgumentError(
            f"expected noise as a name among {NOISE_MODELS}, a callable (key, rng) -> str | None, a non-empty "
            f"sequence of them, or None, got {noise!r:.80}"
        )
    for item in items:
        if isinstance(item, str):
            if item not in _MODELS:
                raise UnknownOptionError(f"expected noise models among {NOISE_MODELS}, got {item!r}")
        elif not callable(item):
            raise InvalidArgumentError(f"expected a noise model name or callable, got {item!r:.80}")
    return tuple(items)


def noisy_key(
    key: str, noise: Noise = DEFAULT_NOISE, *, seed: int = 0, draw: int = 0, avoid: Collection[str] = ()
) -> str | None:
    """One wrong spelling of ``key``: the same for the same ``(key, noise, seed, draw)`` on every machine.

    Each try picks one of the noise models at random and applies it; a spelling equal to ``key``, empty, or in
    ``avoid`` is drawn again (up to 20 tries).

    Args:
        key: the key.
        noise: the models (see :func:`check_noise`).
        seed: the noise seed.
        draw: which of the key's spellings (0, 1, 2, ...).
        avoid: spellings that must not come out (the other stored keys: such a query has no single right key).

    Returns:
        The noisy spelling, or None when no try gave one.

    Raises:
        UnknownOptionError, InvalidArgumentError: a bad ``noise``; InvalidArgumentError: a callable model that
            returns something other than a str or None.
    """
    models = check_noise(noise)
    return _noisy(key, models, random.Random(f"{seed}:{draw}:{key}"), avoid)


def _noisy(key: str, models: tuple[NoiseName | NoiseFn, ...], rng: random.Random, avoid: Collection[str]) -> str | None:
    for _ in range(_TRIES):
        model = models[rng.randrange(len(models))]
        fn = _MODELS[model] if isinstance(model, str) else model
        out = fn(key, rng)
        if out is not None and not isinstance(out, str):
            raise InvalidArgumentError(f"expected the noise model to return a str or None, got {out!r:.60}")
        if out and out.strip() and out != key and out not in avoid:
            return out
    return None


def generate_pairs(
    keys: Sequence[str],
    noise: Noise = DEFAULT_NOISE,
    *,
    count: int | None = None,
    seed: int = 0,
    avoid: Collection[str] = (),
) -> list[tuple[str, str]]:
    """``(noisy key, key)`` pairs: the keys in a seeded order, one spelling each, then a second round, ...

    Args:
        keys: the keys (repeats are dropped).
        noise: the models (see :func:`check_noise`).
        count: how many pairs; None: one per key. Keys that no model fits are skipped; rounds stop when one adds
            nothing, so fewer pairs may come back.
        seed: the seed of the order and of the noise.
        avoid: spellings that must not come out (pass the stored keys as a set).

    Returns:
        The pairs, in the seeded order (the first ``count`` of a longer call are the same pairs).

    Raises:
        UnknownOptionError, InvalidArgumentError: a bad ``noise``; InvalidArgumentError: ``count`` < 0.
    """
    models = check_noise(noise)
    if not models:
        return []
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise InvalidArgumentError(f"expected count as an integer >= 0 or None, got {count!r}")
    order = list(dict.fromkeys(keys))
    random.Random(f"{seed}:order").shuffle(order)
    want = len(order) if count is None else count
    avoid = avoid if isinstance(avoid, set | frozenset | dict) else set(avoid)
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    draw = 0
    while len(pairs) < want and order:
        added = 0
        for key in order:
            query = _noisy(key, models, random.Random(f"{seed}:{draw}:{key}"), avoid)
            if query is not None and (query, key) not in seen:
                seen.add((query, key))
                pairs.append((query, key))
                added += 1
                if len(pairs) == want:
                    break
        if not added:
            break
        draw += 1
    return pairs
