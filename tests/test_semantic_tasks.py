"""The split rules of the fine-tuning study's semantic tasks (benchmarks/semantic_tasks.py), on the stdlib task.

The ``pydoc`` task needs nothing but this interpreter (its stdlib is walked in a child ``python -S``), so it runs
offline; the walk is cached in a temporary folder here, never in the benchmarks' cache.
"""

from __future__ import annotations

import re

import pytest
from _semantic import semantic_tasks


@pytest.fixture(scope="module")
def entries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    cache = tmp_path_factory.mktemp("semantic")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(semantic_tasks, "CACHE", cache)
        return semantic_tasks.pydoc_entries()


def _task(entries: dict[str, list[str]], n_train: int, seed: int = 0, max_keys: int = 300) -> semantic_tasks.Task:
    return semantic_tasks.split("pydoc", entries, n_train, 50, seed, max_keys)


def test_stdlib_entries_are_unambiguous_and_never_name_their_key(entries: dict[str, list[str]]) -> None:
    assert len(entries) > 1000  # several thousand on CPython 3.11
    texts = [text for descriptions in entries.values() for text in descriptions]
    assert len(texts) == len(set(texts))  # a docstring two names share was dropped
    assert {"len", "os.getcwd"} <= set(entries)  # builtins bare, os under its public name (not posix)
    for key, descriptions in entries.items():
        assert not key.startswith(("posix.", "posixpath.")) and "._" not in key
        leaf = key.rsplit(".", 1)[-1]
        for text in descriptions:
            assert len(text.split()) >= 4
            assert re.search(rf"\b{re.escape(leaf)}\b", text, re.IGNORECASE) is None, (key, text)


def test_split_holds_out_targets_and_queries(entries: dict[str, list[str]]) -> None:
    task = _task(entries, 200)
    assert len(task.keys) == 300 and len(set(task.keys)) == 300 and task.keys == sorted(task.keys)
    assert task.values == task.keys
    assert len(task.train) == 200 and len(task.eval) == 50
    stored = set(task.keys)
    train_keys = {key for _, key in task.train}
    eval_keys = [key for _, key in task.eval]
    assert set(eval_keys) <= stored and train_keys <= stored  # the database holds every target
    assert len(set(eval_keys)) == 50 and not set(eval_keys) & train_keys  # held-out targets
    assert not {q for q, _ in task.eval} & {q for q, _ in task.train}  # held-out queries
    for query, key in task.train + task.eval:
        assert query in entries[key]
    assert all(query == entries[key][0] for query, key in task.eval)  # a held-out key's primary description


def test_split_is_seeded_and_nested(entries: dict[str, list[str]]) -> None:
    small, large = _task(entries, 100), _task(entries, 250)
    assert small == _task(entries, 100)  # the same seed, the same task
    assert large.eval == small.eval and large.keys == small.keys  # the pair count changes only the training pairs
    assert large.train[:100] == small.train
    other = _task(entries, 100, seed=1)
    assert other.keys != small.keys and other.eval != small.eval


def test_split_says_how_many_pairs_it_holds(entries: dict[str, list[str]]) -> None:
    with pytest.raises(ValueError, match="holds 250 training pairs"):
        _task(entries, 251)
    with pytest.raises(ValueError, match="expected a task among"):
        semantic_tasks.load_task("wordnet", 10)
