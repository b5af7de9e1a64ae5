"""Real semantic retrieval tasks for the fine-tuning study of issue 36: a text that describes a thing -> its name.

Each task maps every key (a name) to its descriptions, the first one its *primary* description, every description
text held by one key only (a text two keys share is ambiguous and dropped from both) and never naming its key.
:func:`load_task` splits one into a database, training pairs and held-out evaluation pairs:

- ``keys``: every key of the task (``max_keys``: a seeded sample of that many), in sorted order; ``values``: the
  key itself (the tasks carry no second text that is not also a query, so item 3's pairs-from-records cannot be
  studied on them without leaking the eval queries);
- ``eval``: (primary description, key) for ``n_eval`` keys drawn first (seeded; the same for every ``n_train``);
- ``train``: (description, key) pairs of the *other* keys only, in a seeded order of keys: the primary
  descriptions first, then (when ``n_train`` asks for more pairs than there are keys) each key's second
  description, then its third... so no training pair names an eval target, no training query is an eval query,
  and the pairs of a smaller ``n_train`` are the first pairs of a larger one.

Tasks (built once, cached as JSON under ``benchmarks/.cache/semantic/``, git-ignored):

- ``gcide`` — a reverse dictionary: the definitions of Debian's ``dict-gcide`` (the GNU Collaborative International
  Dictionary of English, GPL; fetched with ``apt-get download dict-gcide`` into the cache when not installed) ->
  the headword. Headwords of 3-16 lowercase letters that the dictionary's own text uses at least 5 times (a
  frequency filter that drops the rarest words), whose primary definition has 4-25 words. A definition is the first
  sentence of a sense, from the 1913 Webster / its supplement / PJC only (never the senses GCIDE took from WordNet:
  the reviewer checks on WordNet), cleaned of markup, citations and ``; as, ...`` examples; dropped when it is a
  cross reference (``See ...``, ``Same as ...``) or when a word of it shares a prefix with the headword (its stem:
  ``min(len, max(5, ceil(0.6 len)))`` letters) or is a part of a compound headword (``fish`` for ``goldfish``): a
  definition that names its word is no test. 18,728 keys, 45,720 definitions (dict-gcide 0.48.5+nmu2).
- ``pydoc`` — the Python standard library's docstrings -> the qualified name (``os.path.getsize``, ``len``,
  ``collections.Counter.most_common``): public functions, classes and methods of every importable public stdlib
  module (walked in a child process ``python -S``, without site-packages, so that import side effects stay
  there); one name per object (not the platform module's: ``os.getcwd``, not ``posix.getcwd``; else the defining
  module's, else the shortest); the query is the docstring's first paragraph after leading signature lines,
  whitespace collapsed, reST markup dropped, 4-80 words; dropped when it names its key (the last part of the name
  as a whole word, in any case: ``Join two or more pathname components`` is no test of ``os.path.join``, nor
  ``Return a shallow copy`` of ``list.copy``). The key text is the bare qualified name (no signature: C functions
  often have none, and a parameter list would favour the ones that do).
  Depends on the interpreter's version (3,642 keys on CPython 3.11.7).
- ``debian`` — Debian package short descriptions -> the package name (``apt-cache dumpavail``: the machine's apt
  lists). Packages outside the library / debug / documentation / transitional sections and suffixes, whose short
  description has >= 4 words and shares no word (or stem) with the package or source name. One description per
  key, so ``n_train`` is at most the number of keys minus ``n_eval`` (9,099 keys from bookworm's main/amd64).

This module imports only the standard library; it knows nothing of kvsearch (``python
benchmarks/semantic_tasks.py`` prints each task's size, examples and a zero-shot check with kvsearch's
``SentenceEncoder``).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import inspect
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache" / "semantic"
TASKS = ("gcide", "pydoc", "debian")


@dataclass
class Task:
    """A retrieval task: a database of ``keys`` and the (query, key) pairs to train and to evaluate on."""

    name: str
    keys: list[str]
    values: list[str]
    train: list[tuple[str, str]]
    eval: list[tuple[str, str]]
    about: dict[str, int] = field(default_factory=dict)
    #: per key, a second text a record may carry (its second description, else the key itself): never a held-out
    #: query, which is always a key's first description (for ``finetune(pairs_from="value")``)
    second: list[str] = field(default_factory=list)


def load_task(name: str, n_train: int, n_eval: int = 1000, seed: int = 0, max_keys: int | None = None) -> Task:
    """A task split into a database, training pairs and held-out pairs (see the module docstring).

    Args:
        name: one of :data:`TASKS`.
        n_train: training pairs wanted (0 allowed).
        n_eval: held-out pairs (each a different key that no training pair names).
        seed: the seed of every draw (the key sample, the eval keys, the order of training keys).
        max_keys: keep a seeded sample of this many keys (the database, the eval and training keys all in it).

    Returns:
        The :class:`Task`; ``about`` counts the keys and descriptions available.

    Raises:
        ValueError: an unknown task, or more pairs asked than the task holds (the message says how many it has).
    """
    sources: dict[str, Callable[[], dict[str, list[str]]]] = {
        "gcide": gcide_entries,
        "pydoc": pydoc_entries,
        "debian": debian_entries,
    }
    if name not in sources:
        raise ValueError(f"expected a task among {TASKS}, got {name!r}")
    if n_train < 0 or n_eval < 1 or (max_keys is not None and max_keys < 2):
        raise ValueError(
            f"expected n_train >= 0, n_eval >= 1, max_keys >= 2 or None; got {n_train}, {n_eval}, {max_keys}"
        )
    return split(name, sources[name](), n_train, n_eval, seed, max_keys)


def split(name: str, entries: dict[str, list[str]], n_train: int, n_eval: int, seed: int, max_keys: int | None) -> Task:
    """Split ``entries`` (key -> its descriptions, primary first, each text held by one key) into a :class:`Task`."""
    rng = random.Random(f"{name}:{seed}")  # a str seed is hashed the same way in every process
    order = sorted(entries)
    rng.shuffle(order)
    if max_keys is not None:
        order = order[:max_keys]
    if n_eval >= len(order):
        raise ValueError(f"task {name!r} has {len(order)} keys: expected n_eval < that, got {n_eval}")
    held, rest = order[:n_eval], order[n_eval:]
    eval_pairs = [(entries[key][0], key) for key in held]
    train: list[tuple[str, str]] = []
    depth = max(len(entries[key]) for key in rest)
    for level in range(depth):  # primary descriptions first, then second ones, ...
        train += [(entries[key][level], key) for key in rest if len(entries[key]) > level]
    if n_train > len(train):
        raise ValueError(
            f"task {name!r} holds {len(train)} training pairs ({len(rest)} keys) beside {n_eval} eval pairs: "
            f"expected n_train <= that, got {n_train}"
        )
    keys = sorted(order)
    about = {"keys": len(keys), "train_available": len(train), "descriptions": sum(len(entries[k]) for k in keys)}
    second = [entries[key][1] if len(entries[key]) > 1 else key for key in keys]
    return Task(name, keys, list(keys), train[:n_train], eval_pairs, about, second)


# --------------------------------------------------------------------------------------------- cache


def _cached(file: str, build: Callable[[], dict[str, list[str]]]) -> dict[str, list[str]]:
    """``build()``'s entries, kept as JSON in the cache (written atomically)."""
    path = CACHE / file
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    entries = _unambiguous(build())
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, ensure_ascii=False, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return entries


def _unambiguous(entries: dict[str, list[str]]) -> dict[str, list[str]]:
    """Drop every description that two keys share (or a key twice), then the keys left with none."""
    owners = collections.Counter(text for texts in entries.values() for text in set(texts))
    out: dict[str, list[str]] = {}
    for key, texts in entries.items():
        kept = [text for text in dict.fromkeys(texts) if owners[text] == 1]
        if kept:
            out[key] = kept
    return out


def _shares_stem(word: str, text: str) -> bool:
    """Whether a word of ``text`` names ``word``: it shares its first ``min(len, max(5, ceil(0.6 len)))`` letters
    (its stem: exculpated / exculpable), or it is one part of a compound ``word`` (fish / goldfish)."""
    need = min(len(word), max(5, -(-3 * len(word) // 5)))
    for token in re.findall(r"[a-z]+", text.lower()):
        if token[:need] == word[:need]:
            return True
        if len(token) >= 4 and len(word) - len(token) >= 3 and token not in _SUFFIX_WORDS:
            if word.startswith(token) or word.endswith(token):
                return True
    return False


#: word endings that are also words: a definition may say "able" of "exculpable".
_SUFFIX_WORDS = frozenset("able less ness like ship ward wards wise some ment tion full hood dom".split())


# --------------------------------------------------------------------------------------------- gcide

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_SOURCE = re.compile(r"^\s*\[([^\]]*)\]\s*$")
_HEAD = re.compile(r"^\s*([\w'-]+(?: [\w'-]+)*) \\[^\\\n]*\\")
_VARIANT = re.compile(r"^(?:or |and )?[\w'-]+ \\[^\\]*\\")
_POS = re.compile(r"^(?:[a-z]{1,6}\.(?:\s*&)?\s*)+")
_SENSE = re.compile(r"^   \d+\. ")
_XREF = re.compile(
    r"^(See|Same as|Alt\.|Obs\.|Imp\.|Pl\.|Plural|An obsolete|Variant|Contraction|Abbreviation|A variant)"
)
_WEBSTER = ("Webster", "PJC")  # 1913 Webster, Webster 1913 Suppl., PJC (GCIDE's editor): not WordNet


def _gcide_files() -> tuple[Path, Path]:
    """The dictd index and data of dict-gcide: installed, cached, or fetched with ``apt-get download``."""
    for root in (Path("/"), CACHE / "dict-gcide"):
        index, data = root / "usr/share/dictd/gcide.index", root / "usr/share/dictd/gcide.dict.dz"
        if index.exists() and data.exists():
            return index, data
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run(["apt-get", "download", "dict-gcide"], cwd=tmp, check=True, capture_output=True)
        deb = next(Path(tmp).glob("dict-gcide_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE / "dict-gcide")], check=True)
    return _gcide_files()


def _b64(text: str) -> int:
    """dictd's base-64 number (most significant digit first)."""
    number = 0
    for char in text:
        number = number * 64 + _B64.index(char)
    return number


def _close(text: str, at: int) -> int:
    """The index after the bracket group that opens at ``text[at]`` (nested ``()[]{}``)."""
    closing = {"(": ")", "[": "]", "{": "}"}
    stack: list[str] = []
    for i in range(at, len(text)):
        if text[i] in closing:
            stack.append(closing[text[i]])
        elif stack and text[i] == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return len(text)


def _strip_head(text: str) -> str:
    """An entry's first block without its head: headword(s), pronunciation, part of speech, forms, etymology."""
    rest = text[_HEAD.match(text).end() :]  # type: ignore[union-attr]  # the caller matched it
    while True:
        rest = rest.lstrip(" ,;:&")
        if match := _VARIANT.match(rest):
            rest = rest[match.end() :]
        elif rest and rest[0] in "([{":
            rest = rest[_close(rest, 0) :]
        elif (match := _POS.match(rest)) and match.end():
            rest = rest[match.end() :]
        elif rest.startswith("Etym:"):
            rest = rest[5:]
        else:
            return rest


def _definition(sense: str) -> str | None:
    """The first sentence of a sense, cleaned of markup, labels, examples and citations (None if nothing left)."""
    text = re.sub(r"^\s*\d+\.\s*", "", sense)
    text = re.sub(r"^\([a-z]\)\s*", "", text)
    while text.startswith("("):  # field labels: (Zool.), (Naut.)
        text = text[_close(text, 0) :].lstrip()
    text = re.sub(r"\s*\[[^\]]*\]", "", text)  # labels [Obs.], accent codes t['e]
    text = text.replace("{", "").replace("}", "")
    text = re.split(r"\s\([b-z]\)\s", text)[0]  # sub-senses (b), (c): keep (a)'s
    text = re.split(r"[;:,]\s+as[,:]\s", text)[0]  # examples: "; as, the lucid orbs of heaven"
    for cut in (" -- ", " --", ' "', "Note:", " Syn:"):
        at = text.find(cut)
        if at > 0:
            text = text[:at]
    if match := re.search(r"(?<=[a-z)]{2})\. (?=[A-Z])", text):
        text = text[: match.start() + 1]
    text = re.sub(r"\s+", " ", text).strip(" ;,:")
    if not text or not text[0].isalpha() or "?" in text or "\\" in text or _XREF.match(text):
        return None
    text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _senses(entry: str) -> list[str]:
    """The definitions of one dictd entry, in order: the first block's (after the head) and each numbered
    sense's, from Webster / PJC sources only."""
    blocks: list[tuple[list[str], str]] = []
    lines: list[str] = []
    for line in entry.split("\n"):
        source = _SOURCE.match(line)
        if source and any(s in source.group(1) for s in (*_WEBSTER, "WordNet", "Century")):
            blocks.append((lines, source.group(1)))
            lines = []
        else:
            lines.append(line)
    out = []
    for i, (block, source) in enumerate(blocks):
        block = [line for line in block if line.strip()]
        if not block or "WordNet" in source or not any(s in source for s in _WEBSTER):
            continue
        if i == 0:
            text = _strip_head(" ".join(line.strip() for line in block))
        elif _SENSE.match(block[0]):
            text = " ".join(line.strip() for line in block)
        else:
            continue  # a quotation, a note, a phrase ({Apple of the eye}, ...)
        if (definition := _definition(text)) is not None:
            out.append(definition)
    return out


def _build_gcide() -> dict[str, list[str]]:
    index_file, data_file = _gcide_files()
    data = gzip.open(data_file).read()  # dictzip is gzip with random access: read it whole (40 MB)
    frequency = collections.Counter(re.findall(rb"[a-z]+", data.lower()))
    entries: dict[str, list[str]] = collections.defaultdict(list)
    offsets: dict[str, set[int]] = collections.defaultdict(set)
    for line in index_file.read_text(encoding="utf-8").splitlines():
        headword, offset, length = line.split("\t")
        word = headword.lower()
        if re.fullmatch(r"[a-z]{3,16}", word) and frequency[word.encode()] >= 5:
            offsets[word].add(_b64(offset) * 2**32 + _b64(length))
    for word in sorted(offsets):
        for packed in sorted(offsets[word]):  # the dictionary's own order of the word's entries
            start, length = divmod(packed, 2**32)
            entry = data[start : start + length].decode("utf-8", "replace")
            head = _HEAD.match(entry)
            if head is None or head.group(1).lower() != word:
                continue  # an inflected form pointing into its base word's entry
            entries[word] += [d for d in _senses(entry) if len(d.split()) >= 4 and not _shares_stem(word, d)]
    entries = _unambiguous(entries)
    return {w: texts for w, texts in entries.items() if len(texts[0].split()) <= 25}


def gcide_entries() -> dict[str, list[str]]:
    """headword -> its definitions (primary first), see the module docstring."""
    return _cached("gcide-v1.json", _build_gcide)


# --------------------------------------------------------------------------------------------- pydoc

#: stdlib modules never imported: GUI, side effects on import (printing, a browser), tests, deprecated shims.
_SKIP_MODULES = frozenset(
    "idlelib tkinter turtle turtledemo antigravity this test lib2to3 ensurepip venv pydoc_data readline "
    "xxlimited xxlimited_35 xxsubtype sre_compile sre_parse sre_constants distutils msilib winreg winsound".split()
)
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$|^[\w.]+ -> .*$|^--$")
_SIGNATURE_THEN_TEXT = re.compile(r"^[\w.]+\(.*?\)(?:\s*->\s*[^-]*?)?\s+--\s+(\S.*)$")  # S.pop() -> x -- remove ...
_PLATFORM_MODULES = frozenset({"posix", "posixpath", "genericpath", "ntpath"})  # what os and os.path re-export


def _public(dotted: str) -> bool:
    parts = dotted.split(".")
    return not any(p.startswith("_") or p in _SKIP_MODULES or p in ("test", "tests", "idle_test") for p in parts)


def _stdlib_modules() -> list[tuple[str, object]]:
    """(name, module) of every public stdlib module and submodule that imports, and ``os.path``."""
    import importlib
    import pkgutil

    modules = []
    for name in sorted(sys.stdlib_module_names):
        if not _public(name):
            continue
        try:
            module = importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - a module for another platform, a missing C library
            continue
        modules.append((name, module))
        path = getattr(module, "__path__", None)
        if path is None:
            continue
        for info in pkgutil.walk_packages(path, name + ".", onerror=lambda _: None):
            if not _public(info.name) or "__main__" in info.name:
                continue
            try:
                modules.append((info.name, importlib.import_module(info.name)))
            except BaseException:  # noqa: BLE001
                continue
    return [*modules, ("os.path", os.path)]


def _first_paragraph(doc: object) -> str | None:
    """A docstring's first paragraph after any signature lines, cleaned; None when it is not one."""
    if not isinstance(doc, str):
        return None
    doc = "\n".join(_SIGNATURE_THEN_TEXT.sub(r"\1", line.strip()) for line in inspect.cleandoc(doc).splitlines())
    paragraphs = [p for p in re.split(r"\n\s*\n", doc) if p.strip()]
    while paragraphs and all(_SIGNATURE.match(line.strip()) for line in paragraphs[0].splitlines()):
        paragraphs.pop(0)
    if not paragraphs:
        return None
    text = paragraphs[0]
    lines = text.splitlines()
    while lines and _SIGNATURE.match(lines[0].strip()):  # "f(x) -> y" on the line above the text
        lines.pop(0)
    text = " ".join(lines)
    text = re.sub(r":[\w:]+:`~?([^`]*)`", r"\1", text)  # :func:`x` -> x
    text = re.sub(r"`+([^`]*)`+", r"\1", text)
    text = re.sub(r"\*\*?([^*]+)\*\*?", r"\1", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text[0].upper() + text[1:] if 4 <= len(text.split()) <= 80 else None


def _walk_stdlib() -> dict[str, list[str]]:
    """qualified name -> [its docstring's first paragraph], every object under one name (run in a child)."""
    warnings.simplefilter("ignore")
    names: dict[int, list[str]] = collections.defaultdict(list)
    objects: dict[int, object] = {}
    for module_name, module in _stdlib_modules():
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            names[id(obj)].append(f"{module_name}.{attr}")
            objects[id(obj)] = obj

    def canonical(key: int) -> str:
        """The name users write: not the platform module's (os.getcwd, os.path.join, not posix.*, posixpath.*),
        else the defining module's, else the shortest."""
        obj = objects[key]
        home = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__name__', '')}"

        def rank(name: str) -> tuple[bool, bool, int, int, str]:
            return (name.split(".")[0] in _PLATFORM_MODULES, name != home, name.count("."), len(name), name)

        return min(names[key], key=rank).removeprefix("builtins.")

    entries: dict[str, list[str]] = collections.defaultdict(list)
    for key, obj in objects.items():
        qualified = canonical(key)
        members = [(qualified, obj)]
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if isinstance(member, (classmethod, staticmethod)):
                    member = member.__func__
                if not attr.startswith("_") and inspect.isroutine(member):
                    members.append((f"{qualified}.{attr}", member))
        for name, member in members:
            doc = member.__dict__.get("__doc__") if inspect.isclass(member) else getattr(member, "__doc__", None)
            text = _first_paragraph(doc)
            leaf = name.rsplit(".", 1)[-1]
            if text and not re.search(rf"\b{re.escape(leaf)}\b", text, re.IGNORECASE) and name not in entries:
                entries[name].append(text)
    return dict(entries)


def _build_pydoc() -> dict[str, list[str]]:
    """Walk the stdlib in a child ``python -S`` (no site-packages; import side effects stay there)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        out = Path(tmp) / "pydoc.json"
        command = [sys.executable, "-S", __file__, "--walk-stdlib", str(out)]
        subprocess.run(command, check=True, timeout=600, stdin=subprocess.DEVNULL, capture_output=True, cwd=tmp)
        return json.loads(out.read_text(encoding="utf-8"))


def pydoc_entries() -> dict[str, list[str]]:
    """qualified name -> [its docstring's first paragraph], for this interpreter's version."""
    version = f"{platform.python_implementation()}-{platform.python_version()}-{sys.platform}"
    return _cached(f"pydoc-{version}-v2.json", _build_pydoc)


# --------------------------------------------------------------------------------------------- debian

_DEBIAN_SECTIONS = frozenset({"libs", "libdevel", "oldlibs", "debug", "doc", "localization", "metapackages"})
_DEBIAN_SUFFIXES = ("-dev", "-doc", "-dbg", "-dbgsym", "-common", "-data", "-examples", "-l10n", "-locales")
_DEBIAN_WORDS = re.compile(r"transitional|dummy|metapackage|meta-package|debug symbols|documentation", re.I)


def _build_debian() -> dict[str, list[str]]:
    stanzas = subprocess.run(["apt-cache", "dumpavail"], check=True, capture_output=True, text=True).stdout
    entries: dict[str, list[str]] = {}
    for stanza in stanzas.split("\n\n"):
        fields = dict(re.findall(r"^([\w-]+): (.*)$", stanza, re.M))
        package, text = fields.get("Package"), fields.get("Description", "").strip()
        section = fields.get("Section", "").rsplit("/", 1)[-1]
        if not package or section in _DEBIAN_SECTIONS or package.endswith(_DEBIAN_SUFFIXES):
            continue
        if len(text.split()) < 4 or _DEBIAN_WORDS.search(text) or package in entries:
            continue
        source = fields.get("Source", package).split()[0]
        parts = {p for p in re.split(r"[^a-z]+", f"{package} {source}".lower()) if len(p) >= 3}
        if any(_shares_stem(part, text) for part in parts):
            continue  # "Python 3 bindings for foo": the description names its package
        entries[package] = [text[0].upper() + text[1:]]
    return entries


def debian_entries() -> dict[str, list[str]]:
    """package name -> [its short description], from this machine's apt lists."""
    return _cached("debian-v1.json", _build_debian)


# --------------------------------------------------------------------------------------------- a look


def zero_shot(task: Task, batch_size: int = 256) -> dict[str, float]:
    """acc@1, acc@10 and MRR@10 of the untrained ``SentenceEncoder()`` on ``task.eval`` against every key (exact
    cosine in torch)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvsearch import SentenceEncoder

    encoder = SentenceEncoder(device="cpu")
    with torch.no_grad():
        keys = encoder.encode(task.keys, batch_size=batch_size)  # (m, dim), unit rows
        queries = encoder.encode([q for q, _ in task.eval], batch_size=batch_size)  # (n, dim)
    top = (queries @ keys.T).topk(min(10, len(task.keys)), dim=1).indices  # (n, 10)
    return ranks_to_metrics([[task.keys[i] for i in row] for row in top.tolist()], [k for _, k in task.eval])


def ranks_to_metrics(found: list[list[str]], targets: list[str]) -> dict[str, float]:
    """acc@1, acc@10 and MRR@10 of ranked key lists against the targets."""
    acc1 = acc10 = mrr = 0.0
    for row, target in zip(found, targets, strict=True):
        if target in row[:10]:
            rank = row.index(target) + 1
            acc1 += rank == 1
            acc10 += 1
            mrr += 1 / rank
    n = max(1, len(targets))
    return {"acc@1": acc1 / n, "acc@10": acc10 / n, "mrr@10": mrr / n}


def main() -> None:
    parser = argparse.ArgumentParser(description="Print each task's size, example pairs and a zero-shot check.")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--max-keys", type=int, default=3000, help="keys in the zero-shot check (0: all)")
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--no-encoder", action="store_true", help="skip the zero-shot check")
    args = parser.parse_args()
    for name in args.tasks.split(","):
        started = time.perf_counter()
        full = load_task(name, 0, n_eval=args.n_eval)
        print(f"== {name}: {full.about} (loaded in {time.perf_counter() - started:.1f} s)")
        pairs = load_task(name, 5, n_eval=3)
        for query, key in pairs.train + pairs.eval:
            print(f"   {key!r:40} <- {query[:110]!r}")
        if args.no_encoder:
            continue
        task = load_task(name, 0, n_eval=args.n_eval, max_keys=args.max_keys or None)
        started = time.perf_counter()
        metrics = zero_shot(task)
        print(
            f"   zero-shot SentenceEncoder on {len(task.keys)} keys, {len(task.eval)} eval queries: "
            + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            + f" ({time.perf_counter() - started:.0f} s; load {os.getloadavg()[0]:.2f})"
        )


if __name__ == "__main__" and "--walk-stdlib" in sys.argv:
    _out = Path(sys.argv[sys.argv.index("--walk-stdlib") + 1])
    _out.write_text(json.dumps(_walk_stdlib(), ensure_ascii=False), encoding="utf-8")
    os._exit(0)  # no atexit handler, thread or finaliser of the imported modules runs


if __name__ == "__main__":
    main()
