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
