"""Filter-only operations (``db.where(...)``): read in id order with paging, count, distinct, min / max, fields, delete
and update by filter or by ids — each against a plain-Python reference over the same records (generated filters and
records), after reopen, and while another process writes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _filter_strategies import FILTERS, SCALARS, metadata  # noqa: E402
from hypothesis import given, settings
from hypothesis import strategies as st

import kvsearch
from kvsearch.errors import InvalidArgumentError, ReadOnlyDatabaseError
from kvsearch.metadata.codec import epoch_us
from kvsearch.metadata.filters import matches

DIM = 4
REPO = str(Path(__file__).resolve().parent.parent)
_ABSENT = object()


def _db(metas: list[dict], path: Path | None = None) -> kvsearch.Database:
    rng = np.random.default_rng(len(metas))
    n = len(metas)
    db = kvsearch.Database(path, dim=DIM, value_dim=2, score="dot")
    db.add([f"k{i}" for i in range(n)], [f"v{i % 3}" for i in range(n)], metas,
           key_embeddings=rng.standard_normal((n, DIM)).astype(np.float32),
           value_embeddings=rng.standard_normal((n, 2)).astype(np.float32))  # fmt: skip
    return db


def _matching(records, where):
    return [r for r in records if matches(r.metadata, where, id=r.id, key=r.key, value=r.value)]


def _get(record, field: str):
    if field.startswith("$"):
        return getattr(record, field[1:])
    value = record.metadata
    for name in field.split("."):
        if not isinstance(value, dict) or name not in value:
            return _ABSENT
        value = value[name]
    return value


def _group(value):
    """A value's group as distinct() counts it: typed (True is not 1), datetimes by instant."""
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, (int, float)):
        return ("number", value)
    if hasattr(value, "isoformat"):
        return ("datetime", epoch_us(value))
    return (type(value).__name__, repr(value))


DISTINCT_FIELDS = ["a", "b", "tags", "author.country", "when", "$key", "$value", "$id"]


@settings(max_examples=120, deadline=None, derandomize=True)
@given(metas=st.lists(metadata(), min_size=1, max_size=15), where=FILTERS, field=st.sampled_from(DISTINCT_FIELDS),
       limit=st.one_of(st.none(), st.integers(0, 6)), offset=st.integers(0, 8))  # fmt: skip
def test_reads_and_aggregates_match_the_reference(metas, where, field, limit, offset):
    db = _db(metas)
    everything = db.where().records()
    ref = _matching(everything, where)
    sel = db.where(where)
    assert sel.count() == len(ref)
    page = ref[offset:] if limit is None else ref[offset : offset + limit]
    got = sel.records(limit=limit, offset=offset)
    assert [(r.id, r.key, r.value, r.metadata) for r in got] == [(r.id, r.key, r.value, r.metadata) for r in page]
    assert sel.ids(limit=limit, offset=offset).tolist() == [r.id for r in page]

    values = [_get(r, field) for r in ref]
    values = [v for v in values if v is not _ABSENT]
    members = [m for v in values for m in (v if isinstance(v, list) else [v])]
    counts = Counter(_group(m) for m in members)
    distinct = sel.distinct(field)
    assert Counter({_group(v): n for v, n in distinct}) == counts
    assert [n for _, n in distinct] == sorted((n for _, n in distinct), reverse=True)

    expected = None
    for kind in ("number", "datetime", "text"):
        of_kind = [v for v in values if _group(v)[0] == kind or (kind == "text" and isinstance(v, str))]
        if of_kind:
            key = (lambda v: epoch_us(v)) if kind == "datetime" else (lambda v: v)
            expected = (min(of_kind, key=key), max(of_kind, key=key))
            break
    got_mm = sel.min_max(field)
    if expected is None:
        assert got_mm is None
    else:
        assert [_group(v) for v in got_mm] == [_group(v) for v in expected]

    kinds: dict[str, set] = {}
    for r in ref:
        for name, v in r.metadata.items():
            kind = {"bool": "bool", "number": "number", "datetime": "datetime"}.get(_group(v)[0])
            kind = kind or {"NoneType": "null", "str": "text", "list": "array", "dict": "object"}[type(v).__name__]
            kinds.setdefault(name, set()).add(kind)
    assert sel.fields() == {name: sorted(k) for name, k in sorted(kinds.items())}
    db.close()


@settings(max_examples=80, deadline=None, derandomize=True)
@given(metas=st.lists(metadata(), min_size=1, max_size=15), where=FILTERS,
       patch=st.dictionaries(st.sampled_from(["a", "new", "tags"]), st.sampled_from(SCALARS), max_size=2),
       merge=st.booleans())  # fmt: skip
def test_delete_and_update_by_filter_match_the_reference(metas, where, patch, merge):
    db = _db(metas)
    before = db.where().records()
    ref = [r.id for r in _matching(before, where)]
    assert db.where(where).update(patch, merge=merge) == ref
    after = {r.id: r for r in db.where().records()}
    for r in before:
        want = ({**r.metadata, **patch} if merge else patch) if r.id in ref else r.metadata
        assert after[r.id].metadata == want
        assert np.array_equal(after[r.id].key_embedding.numpy(), r.key_embedding.numpy())  # nothing re-encoded
    again = _matching(list(after.values()), where)
    assert db.where(where).delete() == [r.id for r in again]
    left = [r.id for r in before if r.id not in {r.id for r in again}]
    assert db.ids().tolist() == left
    if left:  # the index forgot the deleted ones too
        hits = db.search(np.ones(DIM, dtype=np.float32), k=len(before))
        assert sorted(h.id for h in hits) == left
    db.close()


def test_by_ids_and_after_reopen(tmp_path):
    db = _db([{"n": i, "lang": ["en", "fr"][i % 2]} for i in range(10)], tmp_path / "db")
    assert db.where({"lang": "fr"}, ids=[1, 2, 3, 4, 99]).ids().tolist() == [2, 4]
    assert db.where(ids=np.array([3, 1])).update({"seen": True}) == [1, 3]
    assert db.where({"lang": "en"}).delete() == [1, 3, 5, 7, 9]
    db.close()
    db = kvsearch.Database(tmp_path / "db")
    assert db.where().ids().tolist() == [2, 4, 6, 8, 10]
    assert db.get(2).metadata == {"n": 1, "lang": "fr"}
    assert db.where({"seen": True}).count() == 0  # the updated ones were deleted with the English ones
    assert db.where().distinct("lang") == [("fr", 5)]
    assert db.where().min_max("n") == (1, 9)
    assert db.where({"n": {"$gt": 100}}).min_max("n") is None
    db.close()
    reader = kvsearch.Database(tmp_path / "db", read_only=True)
    assert reader.where({"lang": "fr"}).count() == 5
    with pytest.raises(ReadOnlyDatabaseError):
        reader.where().delete()
    with pytest.raises(ReadOnlyDatabaseError):
        reader.where().update({"x": 1})
    reader.close()


@pytest.mark.parametrize(
    "call",
    [
        lambda db: db.where().records(limit=-1),
        lambda db: db.where().records(offset=-1),
        lambda db: db.where().records(limit=1.5),
        lambda db: db.where(ids=[1.5]),
        lambda db: db.where().distinct("a..b"),
        lambda db: db.where().min_max(3),
        lambda db: db.where().update(["not", "a", "dict"]),
        lambda db: db.where().update({"a": 1}, merge="yes"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(call):
    db = _db([{"a": 1}, {"a": 2}])
    with pytest.raises(InvalidArgumentError):
        call(db)
    assert [r.metadata for r in db.where().records()] == [{"a": 1}, {"a": 2}]
    db.close()


WRITER = """
import sys, numpy as np, kvsearch
db = kvsearch.Database(sys.argv[1])
rng = np.random.default_rng(1)
for b in range(int(sys.argv[2])):
    n = 10
    db.add([f"b{b}-{i}" for i in range(n)], [f"v{i}" for i in range(n)],
           [{"batch": b, "parity": b % 2, "i": i} for i in range(n)],
           key_embeddings=rng.standard_normal((n, 4)).astype(np.float32),
           value_embeddings=rng.standard_normal((n, 2)).astype(np.float32))
    if b % 3 == 2:
        db.where({"batch": b - 1}).update({"checked": True})
db.close()
print("done", flush=True)
"""


def test_filter_only_operations_under_a_concurrent_writer_process(tmp_path):
    """Each read sees whole batches (one transaction each), and a delete by filter in this process loses nothing
    that the writer adds at the same time."""
    path = tmp_path / "db"
    _db([{"seed": True}], path).close()
    batches = 40
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(path), str(batches)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO},
    )  # fmt: skip
    db = kvsearch.Database(path)
    deleted: list[int] = []
    reads = 0
    while writer.poll() is None or reads < 3:
        assert db.where({"parity": 0}).count() % 10 == 0
        records = db.where({"batch": {"$exists": True}}).records()
        sizes = Counter(r.metadata["batch"] for r in records)
        assert set(sizes.values()) <= {10}, sizes  # never a torn batch
        for batch, n in db.where({"checked": True}).distinct("batch"):
            # a later snapshot than records(): the writer may have added (and checked) newer batches in between
            assert n == 10 and (batch in sizes or batch > max(sizes, default=-1))
        if reads % 5 == 4:
            deleted += db.where({"parity": 1}).delete()
        reads += 1
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err[-2000:]
    assert reads >= 3
    deleted += db.where({"parity": 1}).delete()
    assert len(deleted) == len(set(deleted)) == batches // 2 * 10
    assert db.where({"parity": 0}).count() == batches // 2 * 10
    assert len(db) == 1 + batches // 2 * 10
    db.close()


def test_delete_and_update_by_filter_join_an_atomic_block():
    db = _db([{"n": 1}, {"n": 2}, {"n": 3}])
    with pytest.raises(RuntimeError):
        with db.atomic():
            db.where({"n": 1}).update({"m": 5})
            db.where({"n": {"$gte": 2}}).delete()
            raise RuntimeError("rolled back: nothing of the block is kept")
    assert [(r.id, r.metadata) for r in db.where().records()] == [(1, {"n": 1}), (2, {"n": 2}), (3, {"n": 3})]
    assert len(db.search(np.ones(DIM, dtype=np.float32), k=3)) == 3  # the index rolled back too
    with db.atomic():
        db.where({"n": 1}).update({"m": 5})
        db.where({"n": {"$gte": 2}}).delete()
    assert [(r.id, r.metadata) for r in db.where().records()] == [(1, {"n": 1, "m": 5})]
    assert [h.id for h in db.search(np.ones(DIM, dtype=np.float32), k=3)] == [1]
    db.close()
