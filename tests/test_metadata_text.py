"""Metadata that SQLite would misread, that cannot be walked, or that comes as numpy (issue 35, items 1, 5 and 9).

- **NUL.** SQLite compares text only up to a NUL character, so a metadata string holding one was read back intact
  but cut by every filter (a ``where(...).delete()`` removed the wrong records). A NUL in metadata — a string or a
  field name, at any depth — is now refused typed before anything is written, by every write (``add``, ``upsert``,
  ``where().update``, ``kvsearch build``, the LangChain and Haystack stores), as keys and values are; so is a NUL in a
  filter's text (no stored text can hold one) and in a query text (no key can). Generated metadata with a NUL in
  each text slot in turn, and generated filters with one: a typed refusal and the database unchanged.
- **Other odd text is kept whole:** control characters, line separators, emoji, combining marks in metadata strings
  and field names, key and value texts: the SQL selects what the plain-Python rule selects, and searches agree.
- **Cycles and depth:** metadata that contains itself, or nested deeper than ``MAX_DEPTH``, is refused typed naming
  where (it was a bare ``RecursionError``); exactly ``MAX_DEPTH`` levels are stored, read back and filtered.
- **numpy scalars** (and 0-d arrays) of bool, integer, floating and str dtypes are stored as the Python value they
  hold, at any depth, and are taken as such in filters; arrays and other dtypes are refused typed.
- **``$key`` ``$contains``** looks for the NFC form of its substring, as keys are stored; ``$value`` is not normalised.
- **Dots in field names:** stored and read back, but a filter's dot path names nested fields, never such a name.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
import torch
from _filter_strategies import FILTERS, ODD_TEXTS, odd_filters, odd_metadata
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsearch
from kvsearch.cli.program import main
from kvsearch.errors import InvalidArgumentError, KVSearchError, NonFiniteError, UnknownOptionError
from kvsearch.metadata.codec import MAX_DEPTH, check
from kvsearch.metadata.filters import matches

DIM = 8
#: Any text but NUL and lone surrogates (which are refused for a reason of their own).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6)
NAMES = TEXT.filter(lambda name: not name.startswith("$"))
LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-2, 2) | TEXT
TREES = st.recursive(
    LEAVES, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(NAMES, kids, max_size=3), max_leaves=10
)
METADATA = st.dictionaries(NAMES, TREES, min_size=1, max_size=4)


def texts_in(tree: object) -> int:
    """How many texts a JSON-like tree holds: its strings and its dicts' field names."""
    if isinstance(tree, str):
        return 1
    if isinstance(tree, list):
        return sum(texts_in(item) for item in tree)
    if isinstance(tree, dict):
        return sum(1 + texts_in(item) for item in tree.values())
    return 0


def with_nul(tree: object, target: int, at: int, skip=lambda text: False) -> object:
    """``tree`` with a NUL put into its ``target``-th text (field names and strings, in walk order), at character
    ``at`` (or its end); texts ``skip`` says are not texts (a filter's operators) are left alone and not counted."""
    count = itertools.count()

    def put(text: str) -> str:
        if skip(text) or next(count) != target:
            return text
        return text[:at] + "\x00" + text[at:]

    def walk(node: object) -> object:
        if isinstance(node, str):
            return put(node)
        if isinstance(node, list):
            return [walk(item) for item in node]
        if isinstance(node, dict):
            return {put(key): walk(item) for key, item in node.items()}
        return node

    return walk(tree)


def make_db() -> kvsearch.Database:
    db = kvsearch.Database(None, encoder=kvsearch.NgramEncoder(dim=DIM, num_buckets=64), value_dim=DIM, score="dot")
    db.add(["Li", "Hu", "Wu", "Smola"], ["Mu", "Rachel", "Jo", "Alex"], [{"s": "a"}, {"s": "ab"}, {}, {"t": [1]}])
    return db


def state(db: kvsearch.Database) -> tuple:
    """What a refused call must leave alone: len, every record, and a search's hits."""
    records = [(r.id, r.key, r.value, r.metadata) for r in db.where().records()]
    hits = [(h.id, h.score) for h in db.search("Lu", k=4)]
    return len(db), records, hits


WRITES = {
    "add": lambda db, m: db.add(["new"], ["v"], [m]),
    "add in a batch": lambda db, m: db.add(["new", "other"], ["v", "w"], [{"ok": 1}, m]),
    "upsert": lambda db, m: db.upsert(["Li"], ["Mu"], [m]),
    "update": lambda db, m: db.where({"s": "a"}).update(m, merge=False),
    "update merge": lambda db, m: db.where().update(m, merge=True),
}


# ---------------------------------------------------------------------------------------------- NUL in metadata


@settings(max_examples=80, deadline=None, derandomize=True)
@given(meta=METADATA, data=st.data())
def test_a_nul_in_any_metadata_text_is_refused_and_nothing_is_written(meta, data):
    check(meta)  # without the NUL it is good metadata
    target = data.draw(st.integers(0, texts_in(meta) - 1), label="text")
    bad = with_nul(meta, target, data.draw(st.integers(0, 6), label="at"))
    with pytest.raises(InvalidArgumentError, match="NUL"):
        check(bad)
    db = make_db()
    before = state(db)
    for name, write in WRITES.items():
        with pytest.raises(InvalidArgumentError, match="without NUL characters") as error:
            write(db, bad)
        assert "SQLite compares text only up to a NUL" in str(error.value), name
        assert state(db) == before, name
    db.close()


@pytest.mark.parametrize(
    "meta, says",
    [
        ({"s": "a\x00b"}, r"in the string at metadata at position 0\.s: 'a\\x00b'"),
        ({"a\x00b": 1}, r"the field name 'a\\x00b' at metadata at position 0"),
        ({"n": {"tags": ["x", "y\x00"]}}, r"string at metadata at position 0\.n\.tags\[1\]"),
        ({"n": [{"k\x00": None}]}, r"field name 'k\\x00' at metadata at position 0\.n\[0\]"),
        ({"n": np.str_("np\x00")}, r"string at metadata at position 0\.n"),
    ],
)
def test_the_refusal_names_the_field_path(meta, says):
    db = make_db()
    with pytest.raises(InvalidArgumentError, match=says):
        db.add(["new"], ["v"], [meta])
    db.close()


def test_a_backslash_and_u0000_is_text_not_a_nul():
    """JSON writes a NUL as the six characters ``\\u0000``: the same characters typed by a user are kept."""
    db = make_db()
    meta = {"s": "\\u0000", "\\u0000": ["\\\\u0000"]}
    (new,) = db.add(["new"], ["v"], [meta])
    assert db.get(new).metadata == meta
    assert db.where({"s": "\\u0000"}).ids().tolist() == [new]
    db.close()


#: Filters with a NUL in their text: operands of every kind, record fields, field names.
NUL_FILTERS = [
    {"s": "a\x00b"},
    {"s": "a\x00"},
    {"s": {"$eq": "\x00"}},
    {"s": {"$ne": "a\x00"}},
    {"s": {"$contains": "\x00"}},
    {"s": {"$gt": "a\x00"}},
    {"s": {"$in": ["a", "a\x00b"]}},
    {"s": {"$nin": ["\x00"]}},
    {"s": {"$not": {"$eq": "a\x00"}}},
    {"t": {"$contains": "\x00"}},
    {"$key": "Li\x00"},
    {"$key": {"$in": ["Li", "Hu\x00"]}},
    {"$key": {"$contains": "\x00"}},
    {"$value": {"$contains": "M\x00"}},
    {"$or": [{"s": "a"}, {"s": "a\x00b"}]},
    {"s\x00": "a"},
    {"n.s\x00": 1},
]


def _refused_everywhere(db: kvsearch.Database, where: dict) -> None:
    """Every read and write that takes ``where`` refuses it typed; the Python rule refuses it too."""
    before = state(db)
    q = torch.ones(DIM)
    for call in (
        lambda: db.where(where).ids(),
        lambda: db.where(where).count(),
        lambda: db.search("Li", k=2, where=where),
        lambda: db.query("Li", k=2, where=where),
        lambda: db.candidates(q.unsqueeze(0), 2, where=where),
        lambda: db.where(where).delete(),
        lambda: db.where(where).update({"x": 1}),
        lambda: matches({"s": "a"}, where, key="Li", value="Mu"),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    assert state(db) == before


@pytest.mark.parametrize("where", NUL_FILTERS, ids=repr)
def test_a_filter_with_a_nul_is_refused_everywhere(where):
    db = make_db()
    _refused_everywhere(db, where)
    db.close()


def test_a_filter_value_with_a_nul_says_why():
    db = make_db()
    with pytest.raises(InvalidArgumentError, match=r"without NUL characters at where\.s\.\$in\[1\]"):
        db.where({"s": {"$in": ["a", "a\x00b"]}})
    for field in ("distinct", "min_max"):
        with pytest.raises(InvalidArgumentError, match="control characters"):
            getattr(db.where(), field)("s\x00")
    db.close()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(where=FILTERS, data=st.data())
def test_generated_filters_with_a_nul_are_refused(where, data):
    """A NUL put into any text of a generated filter (a field name or a text operand; operators stay)."""
    is_operator = lambda text: text.startswith("$")  # noqa: E731 - operators and record fields: not user text
    n = texts_in(where) - sum(1 for _ in _operators(where))
    if n == 0:  # no text to put it in: a clause with one
        where, n = {"$and": [where, {"s": ""}]}, 2
    bad = with_nul(where, data.draw(st.integers(0, n - 1), label="text"), data.draw(st.integers(0, 3)), is_operator)
    assert bad != where
    db = make_db()
    _refused_everywhere(db, bad)
    db.close()


def _operators(node: object):
    """The texts of a filter that are operators or record fields (they start with ``$``)."""
    if isinstance(node, str) and node.startswith("$"):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from _operators(item)
    elif isinstance(node, dict):
        for key, item in node.items():
            yield from _operators(key)
            yield from _operators(item)


@pytest.mark.parametrize("queries", ["Li\x00", "\x00", ["Li", "H\x00u"]], ids=repr)
def test_a_query_text_with_a_nul_is_refused(queries):
    """A query is compared with keys, and no key holds a NUL: refused, as a key would be."""
    db = make_db()
    for call in (db.search, db.query):
        with pytest.raises(InvalidArgumentError, match="query texts without NUL"):
            call(queries)
    assert db.lookup("Li\x00", default=None) is None and "Li\x00" not in db  # a lookup: simply not stored
    db.close()


def test_kvsearch_build_refuses_nul_metadata_and_writes_nothing(tmp_path, capsys):
    """``kvsearch build`` from JSONL: the database's own check, nothing written (a new folder stays empty, an
    upsert onto a stored one changes nothing)."""
    good = [{"key": "Li", "value": "Mu", "s": "a"}, {"key": "Hu", "value": "Rachel", "s": "b"}]
    for bad in ({"key": "Wu", "value": "Jo", "s": "a\x00b"}, {"key": "Wu", "value": "Jo", "s\x00": 1}):
        source = tmp_path / "rows.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in [*good, bad]))
        assert "\\u0000" in source.read_text()
        folder = tmp_path / f"db{len(list(tmp_path.iterdir()))}"
        argv = ["build", str(folder), "--from", str(source), "--metadata", "all", "--encoder", "ngram", "--quiet"]
        assert main(argv) != 0
        assert "NUL" in capsys.readouterr().err
        if folder.exists():
            with kvsearch.Database(folder) as db:
                assert len(db) == 0
        ok = tmp_path / "ok.jsonl"
        ok.write_text("".join(json.dumps(row) + "\n" for row in good))
        assert (
            main(["build", str(folder), "--from", str(ok), "--metadata", "all", "--encoder", "ngram", "--quiet"]) == 0
        )
        with kvsearch.Database(folder) as db:
            before = state(db)
        for extra in ([], ["--batch-size", "1"]):  # a batch before the bad row is not written either
            changed = [{**row, "s": "new"} for row in good]
            source.write_text("".join(json.dumps(row) + "\n" for row in [*changed, bad]))
            assert main([*argv, "--upsert", *extra]) != 0
            err = capsys.readouterr().err
            assert "NUL" in err and "line 3" in err  # found by the first pass, named by its line
            with kvsearch.Database(folder) as db:
                assert state(db) == before


def test_langchain_store_refuses_nul_metadata():
    pytest.importorskip("langchain_core")
    from langchain_core.embeddings import DeterministicFakeEmbedding

    from kvsearch.integrations.langchain import KVSearchVectorStore

    store = KVSearchVectorStore(DeterministicFakeEmbedding(size=DIM))
    store.add_texts(["Li Mu"], [{"s": "a"}], ids=["1"])
    before = state_of(store.database)
    for texts, metadatas in ((["Hu"], [{"s": "a\x00b"}]), (["Hu"], [{"a\x00": 1}]), (["H\x00u"], None)):
        with pytest.raises(InvalidArgumentError, match="NUL"):
            store.add_texts(texts, metadatas, ids=["2"])
        with pytest.raises(InvalidArgumentError, match="NUL"):
            store.add_texts(texts, metadatas, ids=["1"])  # a replacement
    assert state_of(store.database) == before
    store.close()


def test_haystack_store_refuses_nul_metadata():
    pytest.importorskip("haystack")
    from haystack import Document

    from kvsearch.integrations.haystack import KVSearchDocumentStore

    store = KVSearchDocumentStore()
    store.write_documents([Document(id="1", content="Li Mu", meta={"s": "a"}, embedding=[1.0] * DIM)])
    before = state_of(store.database)
    for meta in ({"s": "a\x00b"}, {"a\x00": 1}, {"n": {"deep": ["\x00"]}}):
        with pytest.raises(InvalidArgumentError, match="NUL"):
            store.write_documents([Document(id="2", content="Hu", meta=meta, embedding=[0.5] * DIM)])
    assert state_of(store.database) == before
    store.close()


def state_of(db: kvsearch.Database) -> tuple:
    return len(db), [(r.id, r.key, r.value, r.metadata) for r in db.where().records()]


# ---------------------------------------------------------------------------------------------- other odd text


@pytest.fixture(scope="module")
def odd_db():
    """Records whose metadata strings, field names, keys and values hold control characters, line separators, emoji
    and combining marks (no NUL); keys and values as texts, embeddings given."""
    rng = np.random.default_rng(35)
    metas = [odd_metadata(rng) for _ in range(120)]
    texts = [ODD_TEXTS[int(i)] for i in rng.integers(len(ODD_TEXTS), size=120)]
    db = kvsearch.Database(None, dim=DIM, value_dim=2, score="dot")
    ones = np.ones((120, 2), np.float32)
    keys = rng.standard_normal((120, DIM)).astype(np.float32)
    db.add([f"k{i}:{t}:" for i, t in enumerate(texts)], [f"{t}v{i}" for i, t in enumerate(texts)], metas,
           key_embeddings=keys, value_embeddings=ones)  # fmt: skip
    yield db, metas
    db.close()


def test_odd_text_reads_back_whole(odd_db):
    db, metas = odd_db
    assert [r.metadata for r in db.where().records()] == metas
    for field in ("s", "n.s"):
        expected = Counter()
        for m in metas:
            value = m.get("n", {}).get("s") if field == "n.s" else m.get("s")
            if isinstance(value, str):
                expected[value] += 1
        got = {value: count for value, count in db.where().distinct(field) if isinstance(value, str)}
        assert got == dict(expected)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(where=odd_filters())
def test_odd_text_is_filtered_as_the_python_rule_says(odd_db, where):
    """Nothing but NUL cuts text: the SQL (``where``, ``search(where=)``) selects what the Python rule selects."""
    db, _ = odd_db
    records = db.where().records()
    expected = [r.id for r in records if matches(r.metadata, where, id=r.id, key=r.key, value=r.value)]
    assert db.where(where).ids().tolist() == expected
    hits = db.search(torch.ones(DIM), k=len(db), where=where) if expected else []
    assert sorted(h.id for h in hits) == expected


# ---------------------------------------------------------------------------------------------- cycles and depth


def nested_dicts(levels: int) -> dict:
    """A dict ``levels`` levels deep (itself level 1): ``{"a": {"a": ... {"x": 1}}}``."""
    node: dict = {"x": 1}
    for _ in range(levels - 1):
        node = {"a": node}
    return node


def nested_lists(levels: int) -> dict:
    """A dict holding lists, ``levels`` levels deep in all: ``{"l": [[... [1]]]}``."""
    node: list = [1]
    for _ in range(levels - 2):
        node = [node]
    return {"l": node}


def cycle_in_dict() -> dict:
    m: dict = {"n": 1}
    m["self"] = m
    return m


def cycle_in_list() -> dict:
    m: dict = {"items": [1, {}]}
    m["items"][1]["back"] = m["items"]
    return m


def cycle_in_tuple() -> dict:
    inner: list = []
    m = {"t": (inner,)}
    inner.append(m["t"])
    return m


@pytest.mark.parametrize(
    "make, says",
    [
        (cycle_in_dict, r"contains itself: metadata at position 0\.self is metadata at position 0, a dict"),
        (cycle_in_list, r"contains itself: metadata at position 0\.items\[1\]\.back is metadata at position 0\.items,"),
        (cycle_in_tuple, r"contains itself: metadata at position 0\.t\[0\]\[0\] is metadata at position 0\.t, a tuple"),
        (lambda: nested_dicts(1000), rf"nested at most {MAX_DEPTH} levels deep .* at metadata at position 0\.a\.a"),
        (lambda: nested_lists(1000), rf"nested at most {MAX_DEPTH} levels deep .* at metadata at position 0\.l\[0\]"),
        (lambda: nested_dicts(MAX_DEPTH + 1), rf"nested at most {MAX_DEPTH} levels"),
        (lambda: nested_lists(MAX_DEPTH + 1), rf"nested at most {MAX_DEPTH} levels"),
    ],
    ids=["dict", "list", "tuple", "1000 dicts", "1000 lists", "101 dicts", "101 lists"],
)
def test_cyclic_or_too_deep_metadata_is_refused_typed(make, says):
    db = make_db()
    before = state(db)
    for name, write in WRITES.items():
        where = "metadata at position 1" if name == "add in a batch" else "metadata at position 0"
        with pytest.raises(InvalidArgumentError, match=says.replace("metadata at position 0", where)) as error:
            write(db, make())
        assert not isinstance(error.value.__context__, RecursionError), name
        assert state(db) == before, name
    db.close()


def test_max_depth_is_stored_read_back_and_filtered():
    db = make_db()
    deep, lists = nested_dicts(MAX_DEPTH), nested_lists(MAX_DEPTH)
    ids = db.add(["deep", "lists"], ["v", "w"], [deep, lists])
    assert db.get(ids[0]).metadata == deep and db.get(ids[1]).metadata == lists
    assert db.where({"a." * (MAX_DEPTH - 1) + "x": 1}).ids().tolist() == [ids[0]]
    shared = {"x": [1, 2]}
    (again,) = db.add(["shared"], ["v"], [{"a": shared, "b": shared, "c": [shared, shared]}])  # no cycle: fine
    assert db.get(again).metadata == {"a": {"x": [1, 2]}, "b": {"x": [1, 2]}, "c": [{"x": [1, 2]}] * 2}
    db.close()


# ---------------------------------------------------------------------------------------------- numpy


NUMPY = [
    (np.int64(3), 3),
    (np.int32(-2), -2),
    (np.uint8(7), 7),
    (np.uint64(2**63 - 1), 2**63 - 1),
    (np.float32(0.5), 0.5),
    (np.float64(1.25), 1.25),
    (np.float16(-2.0), -2.0),
    (np.bool_(True), True),
    (np.bool_(False), False),
    (np.str_("x"), "x"),
    (np.array(5), 5),
    (np.array(2.5, dtype=np.float32), 2.5),
    (np.array(True), True),
    (np.array("s"), "s"),
]


@pytest.mark.parametrize("value, plain", NUMPY, ids=lambda v: repr(v) if not isinstance(v, (int, float, str)) else "")
def test_numpy_scalars_are_stored_as_their_python_value(value, plain):
    db = make_db()
    meta = {"n": value, "list": [value, {"deep": value}]}
    (new,) = db.add(["new"], ["v"], [meta])
    back = db.get(new).metadata
    assert back == {"n": plain, "list": [plain, {"deep": plain}]}
    assert type(back["n"]) is type(plain) and type(back["list"][1]["deep"]) is type(plain)
    assert check(meta) == check({"n": plain, "list": [plain, {"deep": plain}]})  # the same stored text
    for where in ({"n": plain}, {"n": value}, {"n": {"$in": [value]}}, {"list": {"$contains": value}}):
        assert new in db.where(where).ids().tolist(), where
    db.upsert(["Li"], ["Mu"], [{"n": value}])
    db.where({"$key": "Hu"}).update({"n": value})
    assert [r.metadata["n"] for r in db.where({"$key": {"$in": ["Li", "Hu"]}}).records()] == [plain, plain]
    db.close()


@pytest.mark.parametrize(
    "value, error, says",
    [
        (np.float32("nan"), NonFiniteError, "finite"),
        (np.float64("inf"), NonFiniteError, "finite"),
        (np.array(np.nan), NonFiniteError, "finite"),
        (np.uint64(2**64 - 1), InvalidArgumentError, "within 64 bits"),
        (np.array([1, 2]), InvalidArgumentError, r"numpy array of shape \(2,\): store its \.tolist\(\)"),
        (np.complex64(1), InvalidArgumentError, "got numpy complex64"),
        (np.datetime64("2024-01-01"), InvalidArgumentError, r"got numpy datetime64\[D\]"),
        (np.bytes_(b"x"), InvalidArgumentError, "got numpy"),
    ],
    ids=repr,
)
def test_other_numpy_values_are_refused_typed(value, error, says):
    db = make_db()
    before = state(db)
    with pytest.raises(error, match=says):
        db.add(["new"], ["v"], [{"deep": [{"n": value}]}])
    assert state(db) == before
    db.close()


# ---------------------------------------------------------------------------------------------- $key, dots


def test_key_contains_is_nfc_normalised_as_key_equality_is():
    """Keys are stored NFC: a ``$contains`` substring is looked for in that form (composed or decomposed alike);
    values are stored as given and never normalised."""
    db = kvsearch.Database(None, dim=2, value_dim=2)
    ones = np.ones((3, 2), np.float32)
    ids = db.add(["Mu\u0308ller", "Muller", " Mo "], ["Mu\u0308ller", "M\u00fcller", "x"], key_embeddings=ones,
                 value_embeddings=ones)  # fmt: skip
    records = db.where().records()
    assert records[0].key == "M\u00fcller"
    cases = [
        ({"$key": "Mu\u0308ller"}, [ids[0]]),
        ({"$key": "M\u00fcller"}, [ids[0]]),
        ({"$key": {"$contains": "u\u0308"}}, [ids[0]]),
        ({"$key": {"$contains": "\u00fc"}}, [ids[0]]),
        ({"$key": {"$contains": "Mu\u0308l"}}, [ids[0]]),
        ({"$key": {"$contains": "ul"}}, [ids[1]]),
        ({"$key": {"$contains": "o "}}, []),  # a substring is not stripped (the key " Mo " is stored "Mo")
        ({"$value": {"$contains": "u\u0308"}}, [ids[0]]),  # values: as given
        ({"$value": {"$contains": "\u00fc"}}, [ids[1]]),
    ]
    for where, expected in cases:
        assert db.where(where).ids().tolist() == expected, where
        rule = [r.id for r in records if matches(r.metadata, where, id=r.id, key=r.key, value=r.value)]
        assert rule == expected, where
    db.close()


def test_a_field_name_may_hold_a_dot_but_a_dot_path_names_nested_fields():
    """The rule: a field name is any text but NUL (not starting with ``$``); a filter's ``"a.b"`` is the field ``b``
    of the dict ``a``, so a top-level name holding ``.`` is stored and read back but no filter can name it."""
    db = kvsearch.Database(None, dim=2, value_dim=2)
    ones = np.ones((3, 2), np.float32)
    metas = [{"a.b": 1}, {"a": {"b": 1}}, {"a": {"b.c": 2}}]
    ids = db.add(ones, ones, metas)
    assert [r.metadata for r in db.where().records()] == metas
    assert db.where({"a.b": 1}).ids().tolist() == [ids[1]]
    assert db.where({"a.b.c": 2}).ids().tolist() == []
    assert db.where({"a.b": {"$exists": True}}).ids().tolist() == [ids[1]]
    assert db.where().distinct("a.b") == [(1, 1)]
    assert "a.b" in db.where().fields()  # listed as a top-level field, though a filter cannot name it
    with pytest.raises(UnknownOptionError, match=r"where\.a\.b"):
        db.where({"a": {"b": 1}})  # a dict condition is operators, not a nested document
    with pytest.raises(InvalidArgumentError, match="dot path"):
        db.where({"a..b": 1})
    db.close()


def test_every_metadata_error_is_a_kvsearch_error():
    for bad in ({"s": "\x00"}, cycle_in_dict(), nested_dicts(MAX_DEPTH + 1), {"n": np.array([1])}):
        with pytest.raises(KVSearchError):
            check(bad)
