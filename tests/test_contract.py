"""One contract for both facades: ``Database`` and ``ShardedDatabase`` meet ``kvsearch.contract.DatabaseProtocol``,
their ``where()`` selections meet ``SelectionProtocol``, and every member of the protocols has the same signature on
both (parameter names, kinds and defaults: what a caller written against the protocol relies on; annotations may
name each facade's own types).

``isinstance`` against a runtime-checkable protocol only sees that the members are there, so the signatures are
compared here with ``inspect.signature``. The sharded facade is checked in one process (no process group) here, and
on 2 gloo ranks in ``tests/test_sharded_where.py``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import kvsearch
from kvsearch.contract import DatabaseProtocol, SelectionProtocol, parts_of
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.selection import ShardedSelection
from kvsearch.selection import Selection

#: A member whose signature differs on purpose between the facades, with why. None today: keep it that way, or name
#: the member here with its reason.
DELIBERATE_DIFFERENCES: dict[str, str] = {}


def members(protocol: type) -> list[str]:
    """The members a protocol names: its methods and properties (``__len__`` and ``__contains__`` included)."""
    own = [
        name
        for name, value in vars(protocol).items()
        if (not name.startswith("_") or name in ("__len__", "__contains__"))
        and (inspect.isfunction(value) or isinstance(value, property))
    ]
    return sorted(own)


def shape(cls: type, name: str) -> Any:
    """What a caller relies on: a property as such (and whether it can be set), a method's parameters as (name,
    kind, default) — the default compared by identity for a sentinel object."""
    static = inspect.getattr_static(cls, name)
    if isinstance(static, property):
        return "property"
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    return [
        (p.name, p.kind, p.default if isinstance(p.default, (type(None), int, float, str, bool)) else id(p.default))
        for p in params
    ]


@pytest.fixture()
def facades(tmp_path):
    enc = kvsearch.NgramEncoder(dim=32, num_buckets=512, device="cpu")
    db = kvsearch.Database(tmp_path / "plain", encoder=enc, device="cpu")
    sdb = ShardedDatabase(tmp_path / "sharded", num_shards=2, encoder=enc)
    for d in (db, sdb):
        d.add(["Smith", "Li"], ["John", "Wei"], [{"lang": "en"}, {"lang": "zh"}])
    yield db, sdb
    db.close()
    sdb.close()


def test_the_protocol_names_what_both_facades_share():
    names = members(DatabaseProtocol)
    assert {"search", "query", "candidates", "where", "add", "upsert", "delete", "close", "__len__"} <= set(names)
    for name in names:
        assert hasattr(kvsearch.Database, name), name
        assert hasattr(ShardedDatabase, name), name


def test_both_facades_meet_the_protocol(facades):
    db, sdb = facades
    assert isinstance(db, DatabaseProtocol)
    assert isinstance(sdb, DatabaseProtocol)
    assert isinstance(db.where({"lang": "en"}), SelectionProtocol)
    assert isinstance(sdb.where({"lang": "en"}), SelectionProtocol)
    assert db.where({"lang": "en"}).count() == sdb.where({"lang": "en"}).count() == 1


def test_what_is_not_a_database_does_not_meet_it():
    assert not isinstance(object(), DatabaseProtocol)
    assert not isinstance({"search": None}, DatabaseProtocol)
    assert not isinstance(object(), SelectionProtocol)


@pytest.mark.parametrize("name", members(DatabaseProtocol))
def test_every_member_has_one_signature_on_both_facades(name):
    if name in DELIBERATE_DIFFERENCES:
        pytest.skip(DELIBERATE_DIFFERENCES[name])
    want = shape(DatabaseProtocol, name)
    assert shape(kvsearch.Database, name) == want, f"Database.{name}"
    assert shape(ShardedDatabase, name) == want, f"ShardedDatabase.{name}"


@pytest.mark.parametrize("name", members(SelectionProtocol))
def test_every_selection_member_has_one_signature_on_both(name):
    want = shape(SelectionProtocol, name)
    assert shape(Selection, name) == want, f"Selection.{name}"
    assert shape(ShardedSelection, name) == want, f"ShardedSelection.{name}"


def test_parts_of_gives_the_shards_in_order_or_the_database(facades):
    db, sdb = facades
    assert parts_of(db) == [db]
    assert parts_of(sdb) == [sdb.shards[0], sdb.shards[1]]
    assert sum(len(part) for part in parts_of(sdb)) == len(sdb) == 2
