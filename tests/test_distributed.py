"""The sharded database on torch.distributed (gloo on localhost), against one plain Database.

The ranks are spawned once per world size (2 by default; 3 and 4 with ``-m slow``) and run every phase in
``tests/_distributed_ranks.py``; meanwhile this process builds the reference: one :class:`kvsearch.Database`
from the same records, asked the same questions. Then:

1. Equivalence: with queries split unevenly across ranks (one rank with none), ``search`` gives the same keys in
   the same order, and ``query`` (every score with every pooling), ``candidates`` and ``KVAttention`` the same
   weights, outputs, ``found`` / ``value`` and query gradients (within 1e-6), with ``where=`` filters, and after
   deletes and upserts, a refresh and a reopen. Ids differ between the two (a sharded id holds its shard):
   candidates are compared by record, and ``shard_of_id(id) == shard_of_key(key)`` is checked.
2. IVF / HNSW shards: recall@10 against the exact answer >= 0.95.
3. Writes from every rank at once land exactly once on their owner shard (each shard folder opened afterwards
   as a plain Database); a database written by one process is read by the world, and one written by the world
   is read by one process, with the same answers.
4. A rank that exits hard: the others get DistributedError (not a hang) within the timeout; a restart loses
   nothing committed.
5. Bad input on one rank: every rank raises the same typed error, nothing is written, the next call works.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvsearch
from kvsearch.distributed import ShardedDatabase
from kvsearch.distributed.layout import ID_SHIFT, SHARDS_FILE, shard_dir, shard_of_id, shard_of_key

sys.path.insert(0, str(Path(__file__).parent))
import _distributed_ranks as ranks  # noqa: E402

TOL = 1e-6
DEADLINE_S = 420.0  # every rank is killed after this long: a hang fails the tests, it never blocks the suite

WORLDS = [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]


@dataclass
class Run:
    """One spawn of the ranks and the reference built meanwhile."""

    world: int
    shards: int
    root: Path
    codes: list[int | None]
    results: list[dict[str, Any]]
    ref: dict[str, Any]
    seconds: float

    def phase(self, name: str) -> list[Any]:
        """Every rank's results of a phase; a rank that crashed before it fails the test with its traceback."""
        failed = {
            r: res["phase_errors"][name] for r, res in enumerate(self.results) if name in res.get("phase_errors", {})
        }
        if failed:
            shown = "\n".join(f"rank {r}: {trace}" for r, trace in failed.items())
            pytest.fail(f"the {name!r} phase raised:\n{shown}")
        missing = [r for r, res in enumerate(self.results) if name not in res]
        if missing:
            crashes = "\n".join(f"rank {r}: {self.results[r].get('crash', '(no traceback)')}" for r in missing)
            pytest.fail(f"ranks {missing} recorded no {name!r} phase (exit codes {self.codes}):\n{crashes}")
        return [res[name] for res in self.results]


def make_reopen_db(root: Path, shards: int) -> dict[int, int]:
    """A sharded database created and filled by this process alone (every shard); its id -> record number."""
    keys, values, meta = ranks.text_records()
    n = ranks.N_RECORDS
    sdb = ShardedDatabase(root / "reopen", num_shards=shards, encoder=ranks.encoder(), index="Flat", score="dot")
    try:
        assert (sdb.rank, sdb.world_size, sorted(sdb.shards)) == (0, 1, list(range(shards)))
        ids = sdb.add(keys[:n], values[:n], meta[:n])
    finally:
        sdb.close()
    return dict(zip(ids, range(n)))


def references(root: Path, shards: int) -> dict[str, Any]:
    """The single-database answers to every case (all queries at once), and the exact top-10 of the IVF data."""
    keys, values, meta = ranks.text_records()
    n = ranks.N_RECORDS
    text = ranks.text_queries()
    every = list(range(len(text.texts)))
    ref: dict[str, Any] = {"text": {}, "emb": {}}
    db = kvsearch.Database(root / "single-text", encoder=ranks.encoder(), index="Flat", score="dot", device="cpu")
    ids = db.add(keys[:n], values[:n], meta[:n])
    ranks.run_cases(db, text, every, ranks.text_cases("initial"), ("initial",), ref["text"])
    mutations = ranks.mutate(db, None, 1, {})
    assert mutations["deleted"][0] == "ok" and mutations["upserted"][0] == "ok", mutations
    ref["text_nums"] = {**dict(zip(ids, range(n))), **dict(zip(mutations["upserted"][1], mutations["upsert_nums"]))}
    ref["text_len_after"] = len(db)
    ranks.run_cases(db, text, every, ranks.text_cases("after"), ("after",), ref["text"])
    db.close()

    ekeys, evalues, emeta = ranks.embedding_records()
    emb = ranks.embedding_queries()
    edb = kvsearch.Database(
        root / "single-emb", dim=ranks.E_DIM, value_dim=ranks.E_VALUE_DIM, index="Flat", score="dot", device="cpu"
    )
    ref["emb_nums"] = dict(zip(edb.add(ekeys, evalues, emeta), range(ranks.E_N)))
    ranks.run_cases(edb, emb, list(range(len(emb.q))), ranks.embedding_cases(), ("initial",), ref["emb"])
    edb.close()

    akeys, _, aqueries = ranks.approx_data(shards)
    ref["approx_exact"] = torch.topk(aqueries @ akeys.T, 10, dim=1).indices.tolist()  # (A_QUERIES, 10)
    return ref


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def run(request, tmp_path_factory) -> Run:
    world = request.param
    root = tmp_path_factory.mktemp(f"world{world}")
    shards = ranks.num_shards(world)
    reopen_nums = make_reopen_db(root, shards)
    start = time.perf_counter()
    procs = ranks.start_ranks(world, root, "main")
    try:
        ref = references(root, shards)  # while the ranks run
    finally:
        codes, results = ranks.join_ranks(procs, root, "main", DEADLINE_S)
    ref["reopen_nums"] = reopen_nums
    return Run(world, shards, root, codes, results, ref, time.perf_counter() - start)


# ----------------------------------------------------------------------------- comparing


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), atol=TOL, rtol=TOL))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _close(a, b)
    return a == b


def _describe(outcome: tuple) -> str:
    return "an answer" if outcome[0] == "ok" else f"{outcome[1]}: {outcome[2]}"


def compare(
    label: str,
    got: tuple,
    want: tuple,
    rows: list[int],
    nums_got: dict[int, int],
    nums_want: dict[int, int],
    shards: int | None,
) -> list[str]:
    """What differs between a rank's answer for the queries ``rows`` and the reference's rows (empty: nothing).

    Ids are compared through the record numbers they stand for; with ``shards`` (text keys) every returned id
    must belong to its key's shard.
    """
    if want[0] == "err":
        if got[0] == "err" and got[1] == want[1]:
            return []
        return [f"{label}: the single database raised {want[1]}, the sharded one gave {_describe(got)}"]
    if got[0] != "ok":
        return [f"{label}: the single database answered, the sharded one raised {got[1]}: {got[2]}"]
    g, w = got[1], want[1]
    rows_t = torch.tensor(rows, dtype=torch.long)
    problems: list[str] = []

    def num(nums: dict[int, int], i: int) -> Any:
        return -1 if i < 0 else nums.get(i, f"unknown id {i}")

    def owner_check(pairs: list[tuple[int, str | None]]) -> None:
        if shards is None:
            return
        wrong = [(i, k) for i, k in pairs if i >= 0 and k is not None and shard_of_id(i) != shard_of_key(k, shards)]
        if wrong:
            problems.append(f"{label}: ids outside their key's shard: {wrong[:3]}")

    if "hits" in g:
        if len(g["hits"]) != len(rows):
            return [f"{label}: {len(g['hits'])} rows of hits for {len(rows)} queries"]
        for j, row in enumerate(rows):
            gh, wh = g["hits"][j], w["hits"][row]
            gk = [(num(nums_got, h[0]), h[1]) for h in gh]
            wk = [(num(nums_want, h[0]), h[1]) for h in wh]
            if gk != wk:
                problems.append(f"{label} query {row}: (record, key) {gk} != single {wk}")
            elif not all(_same_value(a[2], b[2]) for a, b in zip(gh, wh)):
                problems.append(f"{label} query {row}: values differ")
            elif not all(math.isclose(a[3], b[3], rel_tol=TOL, abs_tol=TOL) for a, b in zip(gh, wh)):
                problems.append(f"{label} query {row}: scores {[h[3] for h in gh]} != {[h[3] for h in wh]}")
            owner_check([(h[0], h[1]) for h in gh])
        return problems
    for field in ("output", "weights", "grad", "values", "mask"):
        if field in g and not _close(g[field], w[field][rows_t]):
            diff = (
                (g[field].float() - w[field][rows_t].float()).abs().max()
                if g[field].shape == w[field][rows_t].shape
                else None
            )
            problems.append(
                f"{label}: {field} differs (shape {tuple(g[field].shape)} vs {tuple(w[field][rows_t].shape)}, "
                f"max abs diff {diff})"
            )
    if "ids" in g:
        gids = [[num(nums_got, i) for i in row] for row in g["ids"].tolist()]
        wids = [[num(nums_want, i) for i in row] for row in w["ids"][rows_t].tolist()]
        if gids != wids:
            problems.append(f"{label}: candidate records {gids} != single {wids}")
    if isinstance(g.get("keys"), torch.Tensor):  # candidates: key embeddings
        if not _close(g["keys"], w["keys"][rows_t]):
            problems.append(f"{label}: candidate key embeddings differ")
    elif "keys" in g:
        wkeys = [w["keys"][r] for r in rows]
        if g["keys"] != wkeys:
            problems.append(f"{label}: keys {g['keys']} != single {wkeys}")
        owner_check([(i, k) for ids, ks in zip(g["ids"].tolist(), g["keys"]) for i, k in zip(ids, ks)])
    if "found" in g and g["found"] != [w["found"][r] for r in rows]:
        problems.append(f"{label}: found {g['found']} != single {[w['found'][r] for r in rows]}")
    if "value" in g and not all(_same_value(a, w["value"][r]) for a, r in zip(g["value"], rows)):
        problems.append(f"{label}: value {g['value']} != single {[w['value'][r] for r in rows]}")
    return problems


def rank_nums(results: list[dict[str, Any]]) -> dict[int, int]:
    """id -> record number over every rank's adds (and upserts) of the text phase."""
    nums: dict[int, int] = {}
    for res in results:
        nums.update({i: n for n, i in res["added"]})
        if res["mutations"]["upserted"][0] == "ok":
            nums.update(zip(res["mutations"]["upserted"][1], res["mutations"]["upsert_nums"]))
    return nums


def assert_no_problems(problems: list[str]) -> None:
    if problems:
        shown = "\n".join(problems[:25])
        pytest.fail(f"{len(problems)} differences from the single database:\n{shown}")


# ----------------------------------------------------------------------------- 1. equivalence


def test_layout_and_shard_assignment(run):
    for rank, (layout, text) in enumerate(zip(run.phase("layout"), run.phase("text"))):
        assert layout["bad_count"][:2] == ("err", "InvalidArgumentError"), (
            f"rank {rank}: num_shards={run.world + 1} with {run.world} ranks gave {layout['bad_count']}"
        )
        mine = [s for s in range(run.shards) if s % run.world == rank]
        assert text["who"] == (rank, run.world, run.shards, mine)
    assert (run.root / "text" / SHARDS_FILE).is_file()
    assert all(shard_dir(run.root / "text", s).is_dir() for s in range(run.shards))


def test_text_database_matches_single_database(run):
    results = run.phase("text")
    keys, values, _ = ranks.text_records()
    nums = rank_nums(results)
    problems: list[str] = []
    for rank, res in enumerate(results):
        for num, id_ in res["added"]:  # routed by key hash; the id says where
            if shard_of_id(id_) != shard_of_key(keys[num], run.shards):
                problems.append(f"rank {rank}: {keys[num]!r} got id {id_} on shard {shard_of_id(id_)}")
        assert res["len"] == ranks.N_RECORDS
        other = ranks.other_rank_record(rank, run.world, run.shards)
        odd = rank % 2 == 1
        want = (("ok", True), ("ok", odd))
        if res["contains"] != want:
            problems.append(f"rank {rank}: `in` gave {res['contains']}, expected {want}")
        want = (("ok", values[other]), ("ok", values[other] if odd else None))
        if res["lookup"] != want:
            problems.append(f"rank {rank}: lookup gave {res['lookup']}, expected {want}")
        if res["get"][0] != "ok":
            problems.append(f"rank {rank}: get of its own record raised {res['get']}")
        else:
            rid, rkey, rvalue, rmeta = res["get"][1]
            if nums.get(rid) not in [n for n, i in res["added"] if i == rid]:
                problems.append(f"rank {rank}: get asked for its own record, got {res['get']}")
            elif (rkey, rvalue, rmeta["group"]) != (keys[nums[rid]], values[nums[rid]], nums[rid] % 3):
                problems.append(f"rank {rank}: get({rid}) gave {res['get']}")
        assert res["get_missing"][:2] == ("err", "KeyNotFoundError")
        for (phase, how, name), (rows, got) in sorted(res["cases"].items()):
            want = run.ref["text"][("initial" if phase == "initial" else "after", name)][1]
            label = f"rank {rank} {phase}/{how}/{name}"
            problems += compare(label, got, want, rows, nums, run.ref["text_nums"], run.shards)
    assert_no_problems(problems)
    assert sorted(n for res in results for n, _ in res["added"]) == list(range(ranks.N_RECORDS))


def test_deletes_and_upserts_match(run):
    results = run.phase("text")
    keys, _, _ = ranks.text_records()
    added = {n: i for res in results for n, i in res["added"]}
    for rank, res in enumerate(results):
        m = res["mutations"]
        assert m["deleted"][0] == "ok", f"rank {rank}: delete raised {m['deleted']}"
        assert m["upserted"][0] == "ok", f"rank {rank}: upsert raised {m['upserted']}"
        expected = [added[keys.index(item)] if isinstance(item, str) else item for item in m["items"]]
        assert sorted(m["deleted"][1]) == sorted(expected)
        for num, id_ in zip(m["upsert_nums"], m["upserted"][1]):
            if num in ranks.UPSERT_OLD:
                assert id_ == added[num], f"upsert of stored {keys[num]!r} changed its id"
            assert shard_of_id(id_) == shard_of_key(keys[num], run.shards)
        assert res["len_after"] == run.ref["text_len_after"]
        assert res["refresh"][0] == "ok", f"rank {rank}: refresh raised {res['refresh']}"


def test_embedding_database_matches_single_database(run):
    """Keys given as embeddings (round-robin), of varied norms: every score and pooling, as the single database."""
    results = run.phase("embeddings")
    nums = {i: n for res in results for n, i in res["added"]}
    assert sorted(nums.values()) == list(range(ranks.E_N))
    problems: list[str] = []
    for rank, res in enumerate(results):
        for (phase, how, name), (rows, got) in sorted(res["cases"].items()):
            want = run.ref["emb"][(phase, name)][1]
            problems += compare(f"rank {rank} {how}/{name}", got, want, rows, nums, run.ref["emb_nums"], None)
    assert_no_problems(problems)


# ----------------------------------------------------------------------------- 2. approximate shards


@pytest.mark.parametrize("spec", ranks.A_SPECS)
def test_approximate_shards_recall(run, spec):
    exact = run.ref["approx_exact"]
    recalls = []
    for res in run.phase("approx"):
        found = res[spec]["found"]
        assert all(res[spec]["trained"]), f"{spec}: a shard is still served by its exact fallback"
        assert len(found) == len(res["idx"])
        recalls += [len(set(f) & set(exact[q])) / 10 for q, f in zip(res["idx"], found)]
    assert len(recalls) == ranks.A_QUERIES
    assert sum(recalls) / len(recalls) >= 0.95


# ----------------------------------------------------------------------------- 3. writes and world sizes


def _shard_contents(path: Path, shards: int) -> dict[int, tuple[list[int], list[str | None], torch.Tensor]]:
    """Each shard folder opened as a plain Database: its ids, key texts and value embeddings."""
    out = {}
    for s in range(shards):
        db = kvsearch.Database(shard_dir(path, s), device="cpu")
        try:
            ids = db.ids()
            out[s] = (ids.tolist(), db.key_texts(ids), db.embeddings(ids)[1])
        finally:
            db.close()
    return out


def test_concurrent_writes_land_once_on_their_owner_shard(run):
    results = run.phase("writes")
    from kvsearch.datasets import load_surnames

    names = load_surnames()[1000 : 1000 + ranks.WRITE_KEYS]
    returned = {i: n for res in results for n, i in res["added"]}
    assert sorted(returned.values()) == list(range(ranks.WRITE_KEYS))
    stored: Counter[str] = Counter()
    stored_ids = set()
    for s, (ids, keys, _) in _shard_contents(run.root / "writes", run.shards).items():
        assert all(shard_of_id(i) == s for i in ids), f"shard {s} holds ids of other shards"
        assert all(shard_of_key(k, run.shards) == s for k in keys), f"shard {s} holds keys of other shards"
        stored.update(keys)
        stored_ids.update(ids)
    assert stored == Counter(names), "a key is missing or stored twice"
    assert stored_ids == set(returned)
    for id_, n in returned.items():
        assert shard_of_key(names[n], run.shards) == shard_of_id(id_)

    # keys given as embeddings: round-robin, each record once, every shard used
    rr_returned = {i: n for res in results for n, i in res["rr_added"]}
    seen: Counter[int] = Counter()
    for s, (ids, _, vals) in _shard_contents(run.root / "rr", run.shards).items():
        assert ids, f"round-robin left shard {s} empty"
        assert all(shard_of_id(i) == s for i in ids)
        for id_, v in zip(ids, vals[:, 0].tolist()):
            assert rr_returned.get(id_) == int(v), (
                f"id {id_} holds record {v}, add returned it for {rr_returned.get(id_)}"
            )
            seen[int(v)] += 1
    assert seen == Counter(rr_returned.values())


def test_reopen_with_other_world_sizes(run):
    # written by one process (every shard), read by the world
    problems: list[str] = []
    for rank, res in enumerate(run.phase("reopen")):
        assert res["who"] == (rank, run.world, [s for s in range(run.shards) if s % run.world == rank])
        assert res["len"] == ranks.N_RECORDS
        for (phase, how, name), (rows, got) in sorted(res["cases"].items()):
            want = run.ref["text"][(phase, name)][1]
            problems += compare(
                f"rank {rank} {how}/{name}", got, want, rows, run.ref["reopen_nums"], run.ref["text_nums"], run.shards
            )
    assert_no_problems(problems)

    # written (and mutated) by the world, read by one process: the answers after the mutations
    nums = rank_nums(run.phase("text"))
    data = ranks.text_queries()
    got: dict[Any, Any] = {}
    sdb = ShardedDatabase(run.root / "text", device="cpu")
    try:
        assert (sdb.rank, sdb.world_size, sorted(sdb.shards)) == (0, 1, list(range(run.shards)))
        assert len(sdb) == run.ref["text_len_after"]
        ranks.run_cases(sdb, data, list(range(len(data.texts))), ranks.text_cases("after"), ("after",), got)
    finally:
        sdb.close()
    for key, (rows, outcome) in sorted(got.items()):
        problems += compare(
            f"one process {key[1]}", outcome, run.ref["text"][key][1], rows, nums, run.ref["text_nums"], run.shards
        )
    assert_no_problems(problems)


# ----------------------------------------------------------------------------- 4. a dead rank


def test_killed_rank_raises_distributed_error_and_loses_nothing(run):
    results = run.phase("kill")
    assert run.codes == [0] * run.world, f"exit codes {run.codes}; crashes: {[r.get('crash') for r in results]}"
    for rank, res in enumerate(results[:-1]):  # the last rank exited hard after the committed add
        for call in ("add", "search"):
            kind, seconds, message = res[call]
            assert kind == "DistributedError", f"rank {rank}: {call} after the peer died gave {kind}: {message}"
            assert seconds < ranks.TIMEOUT + 30, f"rank {rank}: {call} took {seconds:.1f} s to fail"
    # a restart (one process, every shard) finds every committed record
    from kvsearch.datasets import load_surnames

    names = load_surnames()[2000:2060]
    committed = {n: i for res in results for n, i in res["committed"]}
    assert sorted(committed) == list(range(40))
    contents = _shard_contents(run.root / "kill", run.shards)
    stored = Counter(k for _, keys, _ in contents.values() for k in keys)
    assert all(c == 1 for c in stored.values()), f"stored twice: {[k for k, c in stored.items() if c > 1]}"
    sdb = ShardedDatabase(run.root / "kill", device="cpu")
    try:
        for n, id_ in committed.items():
            assert sdb.lookup(names[n]) == f"k{n}", f"committed record {names[n]!r} lost"
            assert sdb.get(id_).key == names[n]
        assert len(sdb) == sum(stored.values()) >= 40
    finally:
        sdb.close()


@pytest.mark.slow
def test_silent_peer_raises_distributed_error_within_timeout(tmp_path):
    procs = ranks.start_ranks(2, tmp_path, "silent")
    codes, results = ranks.join_ranks(procs, tmp_path, "silent", DEADLINE_S)
    res = results[0].get("silent", {})
    assert "search" in res, f"exit codes {codes}; rank 0: {results[0].get('crash')}"
    kind, seconds, message = res["search"]
    assert kind == "DistributedError", f"{kind}: {message}"
    assert seconds < res["timeout"] + 30


# ----------------------------------------------------------------------------- 5. bad input on one rank


EXPECTED_ERRORS = {
    "nan-search": "NonFiniteError",
    "nan-query": "NonFiniteError",
    "wrong-dim": "DimensionMismatchError",
    "bad-k": "InvalidArgumentError",
    "duplicate-key": "DuplicateKeyError",
    "missing-key": "KeyNotFoundError",
    "k-all": "NotSupportedError",
    "finetune-values": "NotSupportedError",
}


def test_bad_input_on_one_rank_raises_everywhere(run):
    results = run.phase("errors")
    problems = []
    for rank, res in enumerate(results):
        assert res["baseline"][0] == "ok"
        before = ("ok", res["len"])
        for name, expected in EXPECTED_ERRORS.items():
            outcome, after, length = res["cases"][name]
            if outcome[:2] != ("err", expected):
                problems.append(f"rank {rank} {name}: expected {expected}, got {_describe(outcome)}")
            elif expected == "NotSupportedError" and "not supported" not in outcome[2]:
                problems.append(f"rank {rank} {name}: message {outcome[2]!r}")
            if after != res["baseline"]:
                problems.append(f"rank {rank} {name}: the next search gave {after}, before {res['baseline']}")
            if length != before:
                problems.append(f"rank {rank} {name}: len went from {before} to {length}")
            before = length
        if res["stray_written"] != ("ok", False):
            problems.append(f"rank {rank}: the valid half of the failed add was written: {res['stray_written']}")
    assert not problems, "\n".join(problems)


def test_ids_hold_their_shard():
    assert shard_of_id((3 << ID_SHIFT) + 1) == 3
    assert shard_of_key("Smith", 4) == shard_of_key("Smith", 4) in range(4)


def test_an_embedding_stored_on_two_shards_is_ambiguous_like_in_one_database(tmp_path):
    keys = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))  # (6, 8)
    keys[1] = keys[0]  # the same key embedding twice: round-robin puts them on different shards
    values = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # (6, 2)
    single = kvsearch.Database(None, dim=8, value_dim=2, device="cpu")
    single.add(keys, values)
    with ShardedDatabase(tmp_path / "s", num_shards=3, dim=8, value_dim=2, device="cpu") as sdb:
        ids = sdb.add(keys, values)
        assert shard_of_id(ids[0]) != shard_of_id(ids[1])
        for db in (single, sdb):
            answer = db.query(keys[[0, 2]], k=3, pooling="exact")
            assert answer.found == [False, True]
            assert db.exact_targets(keys[[0, 2]]).tolist()[0] == -1
            assert keys[0] not in db and keys[2] in db


def test_sharded_database_takes_the_same_write_and_read_options(tmp_path):
    """One process holding every shard: the options Database.add / upsert / delete / search gained (issue 14)."""
    gen = torch.Generator().manual_seed(0)
    embs = torch.randn(4, 16, generator=gen)  # (4, dim)
    with ShardedDatabase(tmp_path / "s", num_shards=2, dim=16, value_dim=16) as sdb:
        assert sdb.search(embs[0], k=2) == [] and sdb.search(embs[:2], k=2) == [[], []]
        keys = ["a", "b", "c", "d"]
        ids = sdb.add(
            keys, ["A", "B", "C", "D"], [{"n": i} for i in range(4)], key_embeddings=embs, value_embeddings=embs
        )
        hit = sdb.search(embs[2], k=1)[0]
        assert (hit.id, hit.key, hit.value, hit.metadata) == (ids[2], "c", "C", {"n": 2})
        assert sdb.query(embs[:2], k=2).metadata[0][0] == {"n": 0}
        assert sdb.upsert(["a"], ["A2"], key_embeddings=embs[:1], value_embeddings=embs[:1]) == ids[:1]
        with pytest.raises(kvsearch.NotSupportedError, match=r"delete\(id\) then add"):
            sdb.upsert(embs[:1], embs[:1])
        with pytest.raises(kvsearch.KeyNotFoundError):
            sdb.delete(["a", "nobody"])
        assert sorted(sdb.delete(["a", "nobody", ids[1]], missing="ignore")) == sorted(ids[:2]) and len(sdb) == 2
