"""Hypothesis strategies of metadata and filters, shared by the filter-language and filter-only-operation tests."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta, timezone

from hypothesis import strategies as st

PLUS2 = timezone(timedelta(hours=2))
NOON = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)
INSTANTS = [
    NOON,
    NOON.astimezone(PLUS2),  # the same instant, another offset
    datetime(2024, 3, 1, 12, 0),  # naive: UTC, the same instant again
    datetime(2024, 3, 1, 12, 0, 0, 1, tzinfo=UTC),  # one microsecond later
    date(2024, 3, 1),  # midnight UTC
    datetime(1969, 12, 31, 23, 59, tzinfo=UTC),  # before the epoch
]
SCALARS = [None, True, False, -3, 0, 1, 2, 1.0, 0.5, -1.5, 2**62, -(2**62), "", "a", "ab", "B", "é", "x' OR '1'='1"]
VALUES = st.sampled_from(SCALARS + INSTANTS)
FIELDS = ["a", "b", "tags", "author.country", "author.age", "when", "missing", "author.missing", "a.b"]


@st.composite
def metadata(draw):
    m = {}
    for name in ("a", "b", "when"):
        if draw(st.booleans()):
            m[name] = draw(VALUES)
    if draw(st.booleans()):
        m["tags"] = draw(st.one_of(st.lists(st.sampled_from(SCALARS), max_size=3), VALUES))
    if draw(st.booleans()):
        author = {k: draw(VALUES) for k in ("country", "age") if draw(st.booleans())}
        m["author"] = author if draw(st.integers(0, 4)) else draw(VALUES)  # sometimes not a dict at all
    return m


def _operand(draw, op: str, field: str):
    if op == "$exists":
        return draw(st.booleans())
    if field == "$id":
        ints = st.integers(-2, 140)
        return draw(st.lists(ints, max_size=4) if op in ("$in", "$nin") else ints)
    if field in ("$key", "$value"):
        texts = st.sampled_from(["k1", "k10", "v3", "k", "3", "zz"])
        if op in ("$in", "$nin"):
            return draw(st.lists(st.one_of(st.none(), texts), max_size=3))
        return draw(texts if op in ("$gt", "$gte", "$lt", "$lte", "$contains") else st.one_of(st.none(), texts))
    if op in ("$in", "$nin"):
        return draw(st.lists(VALUES, max_size=4))
    if op in ("$gt", "$gte", "$lt", "$lte"):
        return draw(st.sampled_from([-3, 0, 1, 0.5, 2**62, "a", "b", "é", *INSTANTS]))
    if op == "$contains":
        return draw(st.sampled_from([None, True, 1, 0.5, "", "a", "b", "é"]))
    return draw(VALUES)


@st.composite
def conditions(draw):
    field = draw(st.sampled_from([*FIELDS, "$id", "$key", "$value"]))
    ops = ["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists", "$contains"]
    if field == "$id":
        ops.remove("$contains")
    op = draw(st.sampled_from(ops))
    operand = _operand(draw, op, field)
    if op == "$eq" and draw(st.booleans()):
        return {field: operand}
    cond = {op: operand}
    if draw(st.integers(0, 5)) == 0:
        cond = {"$not": cond}
    return {field: cond}


def _combine(children):
    return st.one_of(
        st.builds(lambda fs: {"$and": fs}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda fs: {"$or": fs}, st.lists(children, min_size=1, max_size=3)),
        st.builds(lambda fs: {"$nor": fs}, st.lists(children, min_size=1, max_size=2)),
        st.builds(lambda f: {"$not": f}, children),
        st.builds(lambda f, g: {**g, **f}, children, children),  # two clauses in one dict: AND
    )


FILTERS = st.recursive(conditions(), _combine, max_leaves=6)


# ---------------------------------------------------------------------------------------------- odd text, no NUL

#: Text SQLite must keep whole (NUL aside, which is refused): control characters, separators, a BOM, a zero-width
#: space, an emoji, combining marks alone and after a letter (not NFC), their composed form.
ODD_TEXTS = ["", "a", "b", "\x01", "\x1f", "\x7f", "\t", " ", "\u2028", "\u2029", "\ufeff", "\u200b", "\u00e9",
             "e\u0301", "\u0301", "\U0001f600", "a\x01b", "\x1fa"]  # fmt: skip
#: Field names of odd text (a filter refuses control characters below U+0020 in a name: none here).
ODD_FIELDS = ["s", "n.s", "tags", "t\u2028", "\U0001f600", "e\u0301", "\x7f", "\ufeffb"]
ODD_STRINGS = st.lists(st.sampled_from(ODD_TEXTS), max_size=3).map("".join)


def odd_metadata(rng) -> dict:
    """One record's metadata of odd text (``rng``: a seeded numpy Generator): strings, nested, in lists."""

    def text() -> str:
        return "".join(ODD_TEXTS[int(i)] for i in rng.integers(len(ODD_TEXTS), size=int(rng.integers(0, 4))))

    m: dict = {}
    for name in ("s", "t\u2028", "\U0001f600", "e\u0301", "\x7f", "\ufeffb"):
        if rng.random() < 0.6:
            m[name] = text() if rng.random() < 0.9 else int(rng.integers(-2, 3))
    if rng.random() < 0.5:
        m["n"] = {"s": text()}
    if rng.random() < 0.5:
        m["tags"] = [text() for _ in range(int(rng.integers(0, 3)))]
    return m


@st.composite
def _odd_condition(draw):
    field = draw(st.sampled_from([*ODD_FIELDS, "$key", "$value"]))
    op = draw(st.sampled_from(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$contains"]))
    operand = draw(st.lists(ODD_STRINGS, max_size=3) if op in ("$in", "$nin") else ODD_STRINGS)
    return {field: operand} if op == "$eq" and draw(st.booleans()) else {field: {op: operand}}


def odd_filters():
    """Filters over :func:`odd_metadata`'s fields (and the key and value texts) with operands of odd text."""
    return st.recursive(
        _odd_condition(),
        lambda children: st.one_of(
            st.builds(lambda fs: {"$and": fs}, st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda fs: {"$or": fs}, st.lists(children, min_size=1, max_size=3)),
            st.builds(lambda f: {"$not": f}, children),
        ),
        max_leaves=4,
    )
