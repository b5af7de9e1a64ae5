"""The Database facade: the issue's user story, persistence, exactness, errors — against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import AUTHORS, random_db

import kvsearch
from kvsearch import (
    ConfigMismatchError,
    Database,
    DatabaseClosedError,
    DimensionMismatchError,
    DuplicateKeyError,
    EmptyDatabaseError,
    EmptyKeyError,
    InvalidArgumentError,
    KeyNotFoundError,
    KVSearchError,
    NgramEncoder,
    NonFiniteError,
    UnknownOptionError,
)

# ---------------------------------------------------------------------- the user story


def test_authors_story(names_db):
    db = names_db
    assert len(db) == 6 and "Li" in db and "Nobody" not in db
    assert db.lookup("Li") == "Mu"
    db.delete("Li")
    with pytest.raises(KeyNotFoundError) as err:
        db.lookup("Li")
    assert isinstance(err.value, KeyError) and "Li" in str(err.value)
    assert db.lookup("Li", default=None) is None
    hits = db.search("Li", k=3)
    assert [h.key for h in hits][0] == "Lipton" and hits[0].value == "Zachary"
    assert hits[0].score >= hits[1].score >= hits[2].score
    ans = db.query("Lipto", k=4, pooling="softmax", temperature=0.1)
    assert ans.value == "Zachary" and ans.found
    assert ans.output.shape == (db.value_dim,) and ans.weights.shape == (4,) and ans.ids.shape == (4,)
    assert len(ans.keys) == 4 and ans.keys[int(ans.weights.argmax())] == "Lipton"
    torch.testing.assert_close(ans.weights.sum(), torch.tensor(1.0))


def test_exact_query_reports_missing_never_wrong(names_db):
    db = names_db
    found = db.query("Li", k=3, pooling="exact")
    assert found.found and found.value == "Mu"
    assert found.weights.tolist().count(1.0) == 1 and found.weights.sum() == 1
    torch.testing.assert_close(found.output, db.value_encoder.encode(["Mu"])[0])
    db.delete("Li")
    missing = db.query("Li", k=3, pooling="exact")
    assert not missing.found and missing.value is None
    assert (missing.weights == 0).all() and (missing.output == 0).all()


def test_exact_query_finds_key_the_index_did_not_rank(tmp_path, rng):
    """Exact pooling is a database lookup: correct even when k=1 and the key is not the nearest."""
    db = Database(None, encoder=NgramEncoder())
    db.add(keys=["aaaa", "aaab", "zzzz"], values=["1", "2", "3"])
    ans = db.query(["aaab", "zzzz", "nope"], k=1, pooling="exact")
    assert ans.value == ["2", "3", None] and ans.found == [True, True, False]


def test_batched_query(names_db):
    ans = names_db.query(["Li", "Smola"], k=4)
    assert ans.output.shape == (2, names_db.value_dim)
    assert ans.weights.shape == (2, 4) and ans.ids.shape == (2, 4)
    assert isinstance(ans.value, list) and len(ans.keys) == 2
    torch.testing.assert_close(ans.weights.sum(-1), torch.ones(2))


def test_average_over_all_is_the_mean_value(names_db):
    ans = names_db.query("Li", k="all", pooling="average")
    expect = names_db.value_encoder.encode(list(AUTHORS.values())).mean(0)
    torch.testing.assert_close(ans.output, expect, atol=1e-6, rtol=1e-5)
    assert ans.weights.shape == (6,)


# ---------------------------------------------------------------------- against brute force


@pytest.mark.parametrize("score", ["dot", "cosine", "gaussian", "scaled_dot"])
@pytest.mark.parametrize("k", [1, 7, 250])
def test_query_matches_dense_reference(tmp_path, rng, score, k):
    """Top-k softmax over the index's candidates == softmax over the torch.topk of all scores."""
    db, ids, keys, values = random_db(None, rng, n=200, score=score)
    q = torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32))
    ans = db.query(q, k=k, pooling="softmax")
    K, V = torch.from_numpy(keys), torch.from_numpy(values)
    if score == "dot":
        s = q @ K.T
    elif score == "scaled_dot":
        s = q @ K.T / 4.0
    elif score == "cosine":
        s = F.normalize(q, dim=-1) @ F.normalize(K, dim=-1).T
    else:
        s = -0.5 * torch.cdist(q, K) ** 2
    kk = min(k, 200)
    top, pos = torch.topk(s, kk, dim=-1)
    w = torch.softmax(top, -1)
    expect = torch.einsum("bk,bkv->bv", w, V[pos])
    torch.testing.assert_close(ans.output, expect, atol=1e-4, rtol=1e-4)
    assert set(ans.ids[0, :kk].tolist()) == set(ids[pos[0].numpy()].tolist())
    assert (ans.ids[:, kk:] == -1).all() and (ans.weights[:, kk:] == 0).all()
    assert torch.isfinite(ans.weights).all()


def test_search_matches_topk(rng):
    db, ids, keys, _ = random_db(None, rng, n=300, score="dot")
    q = rng.standard_normal((3, 16)).astype(np.float32)
    hits = db.search(q, k=5)
    expect = ids[np.argsort(-(q @ keys.T), axis=1)[:, :5]]
    assert [[h.id for h in row] for row in hits] == expect.tolist()
    np.testing.assert_allclose([h.score for h in hits[0]], np.sort(q[0] @ keys.T)[::-1][:5], rtol=1e-5)


def test_k_larger_than_database(names_db):
    hits = names_db.search("Li", k=50)
    assert len(hits) == 6
    ans = names_db.query("Li", k=50)
    assert ans.ids.shape == (50,) and (ans.ids[6:] == -1).all() and (ans.weights[6:] == 0).all()


@pytest.mark.parametrize("spec", ["HNSW16", "IVF4,Flat"])
def test_deleted_records_never_appear(tmp_path, rng, spec):
    db, ids, keys, _ = random_db(tmp_path / "db", rng, n=400, index=spec, score="gaussian")
    db.delete([int(i) for i in ids[:200]])
    q = torch.from_numpy(keys[:50])
    ans = db.query(q, k=10)
    assert not np.isin(ans.ids.numpy(), ids[:200]).any()
    db.close()
    db = Database(tmp_path / "db")
    ans = db.query(q, k=10)
    assert not np.isin(ans.ids.numpy(), ids[:200]).any()
    assert len(db) == 200


# ---------------------------------------------------------------------- gradients


def test_gradient_reaches_query_tensor(rng):
    db, _, keys, values = random_db(None, rng, n=50, score="dot")
    q = torch.randn(3, 16, requires_grad=True)
    ans = db.query(q, k=8)
    ans.output.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0


def test_kvattention_layer(names_db):
    layer = kvsearch.KVAttention(names_db, k=4, score="scaled_dot", pooling="softmax")
    q = names_db.encoder.encode(["Li", "Smola"]).clone().requires_grad_(True)
    out = layer(q)
    assert out.shape == (2, names_db.value_dim)
    out.square().sum().backward()
    assert q.grad.abs().sum() > 0
    ref = names_db.query(q.detach(), k=4, score="scaled_dot")
    torch.testing.assert_close(out.detach(), ref.output)


def test_embedding_records_regression(rng):
    """Keys and values given as numbers (Nadaraya-Watson data), no text payload."""
    x = torch.sort(torch.rand(50) * 5).values
    y = 2 * torch.sin(x) + x**0.8
    db = Database(None, dim=1, value_dim=1, score="gaussian")
    ids = db.add(keys=x[:, None], values=y)
    assert len(ids) == 50 and db.get(ids[0]).key is None
    ans = db.query(torch.tensor([[2.5]]), k="all", pooling="softmax")
    w = torch.softmax(-0.5 * (2.5 - x) ** 2, 0)
    torch.testing.assert_close(ans.output[0, 0], (w * y).sum(), atol=1e-5, rtol=1e-5)
    assert db.lookup(x[3:4]).item() == pytest.approx(y[3].item())
    assert db.query(x[None, 7:8], k=3, pooling="exact").found == [True]
    assert db.query(torch.tensor([[9.0]]), k=3, pooling="exact").found == [False]


# ---------------------------------------------------------------------- persistence


@pytest.mark.parametrize("spec", ["Flat", "HNSW16"])
def test_reopen_gives_same_answers(tmp_path, spec):
    path = tmp_path / "names"
    with Database(path, encoder=NgramEncoder(seed=3), index=spec) as db:
        ids = db.add(keys=list(AUTHORS), values=list(AUTHORS.values()), metadata=[{"n": i} for i in range(6)])
        db.delete("Hu")
        before = db.query(["Li", "Smol"], k=4)
        search_before = db.search("Wern", k=3)
    with Database(path) as db:
        assert db.encoder.config() == NgramEncoder(seed=3).config()
        assert len(db) == 5 and "Hu" not in db and db.get(ids[0]).metadata == {"n": 0}
        after = db.query(["Li", "Smol"], k=4)
        torch.testing.assert_close(after.output, before.output)
        assert after.ids.tolist() == before.ids.tolist()
        assert db.search("Wern", k=3) == search_before
        assert db.add(keys=["New"], values=["One"]) == [7]  # ids are never reused


def test_stale_index_is_rebuilt_not_served(tmp_path, rng):
    db, ids, keys, _ = random_db(tmp_path / "db", rng, n=300, index="HNSW16", score="dot")
    db.close()
    files = ("index.npz", "manifest.json")
    stale = {name: (tmp_path / "db" / name).read_bytes() for name in files}
    db = Database(tmp_path / "db")
    new = db.add(keys=keys[:1] * 10, values=np.ones((1, 8), np.float32))
    db.close()
    for name in files:  # the index save after the store commit "never happened"
        (tmp_path / "db" / name).write_bytes(stale[name])
    db = Database(tmp_path / "db")
    assert db.index.ntotal == 301
    assert db.search(keys[0] * 10, k=1)[0].id == new[0]


def test_damaged_index_file_is_rebuilt(tmp_path, rng):
    db, ids, keys, _ = random_db(tmp_path / "db", rng, n=100, index="HNSW16")
    db.close()
    (tmp_path / "db" / "index.npz").write_bytes(b"\x00" * 64)
    db = Database(tmp_path / "db")
    assert len(db) == 100 and db.index.ntotal == 100


def test_reopen_with_other_options_is_refused(tmp_path, rng):
    db, *_ = random_db(tmp_path / "db", rng, n=10, score="dot")
    db.close()
    with pytest.raises(ConfigMismatchError, match="score='dot'"):
        Database(tmp_path / "db", score="cosine")
    with pytest.raises(ConfigMismatchError, match="dim=16"):
        Database(tmp_path / "db", dim=3)
    Database(tmp_path / "db", score="dot").close()  # the same options are fine


def test_in_memory_and_closed(tmp_path):
    db = Database(None, encoder=NgramEncoder())
    db.add(keys=["a"], values=["b"])
    assert db.path is None and len(db) == 1
    db.close()
    db.close()  # twice is harmless
    with pytest.raises(DatabaseClosedError):
        db.lookup("a")


# ---------------------------------------------------------------------- errors leave the database as it was


def snapshot(db):
    return len(db), db.store.version, db.search("Li", k=6)


BAD_WRITES = [
    (dict(keys=["Li"], values=["X"]), DuplicateKeyError, "already stored"),
    (dict(keys=["A", "A"], values=["1", "2"]), DuplicateKeyError, "positions 0 and 1"),
    (dict(keys=["", "B"], values=["1", "2"]), EmptyKeyError, "non-empty key"),
    (dict(keys=["   "], values=["1"]), EmptyKeyError, "non-empty"),
    (dict(keys=["A", 3], values=["1", "2"]), InvalidArgumentError, "got int at position 1"),
    (dict(keys=["A", "B"], values=["1"]), DimensionMismatchError, "one value per key"),
    (dict(keys=torch.zeros(2, 5), values=["1", "2"]), DimensionMismatchError, "got \\(2, 5\\)"),
    (dict(keys=torch.full((1, 256), float("nan")), values=["1"]), NonFiniteError, "NaN or Inf"),
    (dict(keys=["A"], values=torch.full((1, 256), float("inf"))), NonFiniteError, "NaN or Inf"),
    (dict(keys=["A"], values=["1"], metadata=[{"x": float("nan")}]), NonFiniteError, "metadata"),
    (dict(keys=["A"], values=["1"], metadata=[{"x": object()}]), InvalidArgumentError, "JSON"),
    (dict(keys=["A\x00"], values=["1"]), InvalidArgumentError, "NUL"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_WRITES)
def test_bad_writes_change_nothing(names_db, kwargs, error, message):
    before = snapshot(names_db)
    with pytest.raises(error, match=message) as err:
        names_db.add(**kwargs)
    assert isinstance(err.value, KVSearchError)
    assert snapshot(names_db) == before


def test_bad_deletes_change_nothing(names_db):
    before = snapshot(names_db)
    with pytest.raises(KeyNotFoundError, match="Nobody"):
        names_db.delete(["Li", "Nobody"])
    with pytest.raises(KeyNotFoundError, match="999"):
        names_db.delete(999)
    with pytest.raises(InvalidArgumentError):
        names_db.delete([1.5])
    assert snapshot(names_db) == before


BAD_QUERIES = [
    (dict(k=0), InvalidArgumentError, "k as an integer"),
    (dict(k=-3), InvalidArgumentError, "got -3"),
    (dict(k=10**9), InvalidArgumentError, "65536"),
    (dict(k="many"), InvalidArgumentError, "k as"),
    (dict(pooling="max"), UnknownOptionError, "pooling"),
    (dict(score="manhattan"), UnknownOptionError, "score"),
    (dict(score="additive"), InvalidArgumentError, "AdditiveScore"),
    (dict(temperature=0.0), InvalidArgumentError, "temperature"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_QUERIES)
def test_bad_queries(names_db, kwargs, error, message):
    with pytest.raises(error, match=message):
        names_db.query("Li", **kwargs)


def test_bad_query_inputs(names_db):
    with pytest.raises(DimensionMismatchError, match="dim=256"):
        names_db.query(torch.zeros(3, 7))
    with pytest.raises(NonFiniteError):
        names_db.query(torch.full((256,), float("nan")))
    with pytest.raises(InvalidArgumentError, match="empty"):
        names_db.query([])
    with pytest.raises(InvalidArgumentError, match="position 1"):
        names_db.search(["a", 1])


def test_empty_database_query(tmp_path):
    db = Database(None, encoder=NgramEncoder())
    with pytest.raises(EmptyDatabaseError, match="empty"):
        db.query("Li")  # a query pools something: nothing to pool is an error
    assert db.search("Li") == []  # a search lists what it found: nothing
    assert db.search(["Li", "Hu"], k=3) == [[], []]
    assert db.search(torch.ones(3, db.dim), where={"lang": "en"}) == [[], [], []]
    with pytest.raises(InvalidArgumentError, match="non-empty query"):
        db.search("")  # still checked


def test_bad_construction(tmp_path):
    with pytest.raises(InvalidArgumentError, match="encoder or an explicit dim"):
        Database(None)
    with pytest.raises(InvalidArgumentError, match="value_dim"):
        Database(None, dim=4)
    with pytest.raises(UnknownOptionError, match="score"):
        Database(None, dim=4, value_dim=4, score="euclid")
    with pytest.raises(UnknownOptionError, match="Bogus"):
        Database(None, dim=4, value_dim=4, index="Bogus")
    with pytest.raises(DimensionMismatchError):
        Database(None, encoder=NgramEncoder(), dim=3)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="folder"):
        Database(tmp_path / "file", dim=2, value_dim=2)


def test_text_without_encoder(rng):
    db, *_ = random_db(None, rng, n=5)
    with pytest.raises(InvalidArgumentError, match="no encoder"):
        db.add(keys=["a"], values=["b"])
    with pytest.raises(InvalidArgumentError, match="no encoder"):
        db.query("a")


def test_upsert_replaces_in_place(names_db):
    old = names_db.store.texts.id_of_key["Li"]
    ids = names_db.upsert(keys=["Li", "Ng"], values=["Mu Li", "Andrew"])
    assert ids[0] == old and len(names_db) == 7
    assert names_db.lookup("Li") == "Mu Li" and names_db.lookup("Ng") == "Andrew"
    assert names_db.search("Ng", k=1)[0].value == "Andrew"


def test_get(names_db):
    rec = names_db.get(1)
    assert rec.key == "Zhang" and rec.value == "Aston" and rec.key_embedding.shape == (256,)
    with pytest.raises(KeyNotFoundError):
        names_db.get(1000)


# ---------------------------------------------------------------------- devices


def test_import_order_faiss_first():
    import subprocess
    import sys

    code = "import faiss, torch; import kvsearch; print(torch.ones(2) @ torch.ones(2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.gpu
def test_cuda_device(rng):
    db, _, keys, _ = random_db(None, rng, n=50)
    db = Database(None, dim=16, value_dim=8, device="cuda")
    db.add(keys=keys, values=np.ones((50, 8), np.float32))
    q = torch.from_numpy(keys[:2]).cuda().requires_grad_(True)
    ans = db.query(q, k=4)
    assert ans.output.is_cuda and db.store.table.keys.is_cuda
    ans.output.sum().backward()
    assert q.grad is not None


# ---------------------------------------------------------------------- fitting other libraries (issue 14)


class _NoCalls(NgramEncoder):
    """An n-gram encoder that fails the test when it is asked to encode."""

    def forward(self, texts):
        raise AssertionError(f"the encoder was called with {texts!r}")


def test_text_records_with_their_own_embeddings(tmp_path):
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)  # (3, dim), (3, value_dim)
    db = Database(None, dim=8, value_dim=8)  # no encoder at all
    ids = db.add(["a", "b", "c"], ["A", "B", "C"], key_embeddings=keys, value_embeddings=values)
    stored_keys, stored_values, _ = db.embeddings(torch.tensor(ids))
    assert torch.equal(stored_keys, keys) and torch.equal(stored_values, values)
    assert db.lookup("b") == "B" and "c" in db
    hit = db.search(keys[2], k=1)[0]
    assert (hit.key, hit.value) == ("c", "C")  # value texts are shown though there is no value encoder
    with pytest.raises(kvsearch.MissingEncoderError, match="no encoder for query texts; pass query embeddings"):
        db.search("a")
    with pytest.raises(kvsearch.MissingEncoderError, match="key_embeddings="):
        db.add(["d"], ["D"], value_embeddings=values[:1])  # key texts alone need an encoder
    db.query_encoder = NgramEncoder(dim=8, num_buckets=64)
    assert len(db.search("a", k=3)) == 3  # text queries once there is a query encoder
    assert db.upsert(["b"], ["B2"], key_embeddings=keys[:1], value_embeddings=values[:1]) == [ids[1]]
    assert db.lookup("b") == "B2" and torch.equal(db.embeddings(torch.tensor(ids[1:2]))[0], keys[:1])


def test_given_key_embeddings_are_kept_by_reopen_and_refresh(tmp_path):
    encoder = NgramEncoder(dim=16, num_buckets=256)
    db = Database(tmp_path / "db", encoder=encoder)
    db.add(["Li", "Hu"], ["Mu", "Rachel"])
    doc = torch.randn(1, 16, generator=torch.Generator().manual_seed(1))  # (1, dim): not the encoder's "doc-1"
    real = db.encoder.encode(["Lipton"])  # (1, dim)
    db.encoder.forward = _NoCalls.forward.__get__(db.encoder)  # the encoder must not be asked
    [i] = db.add(["doc-1"], ["Zachary"], key_embeddings=doc, value_embeddings=real)
    del db.encoder.forward
    db.close()
    again = Database(tmp_path / "db", encoder=NgramEncoder(dim=16, num_buckets=256))  # no repair of "doc-1"
    again.refresh()  # re-encodes the keys from their texts: not those that came with an embedding
    assert torch.equal(again.embeddings(torch.tensor([i]))[0], doc)
    pairs = [("Lee", "Li"), ("Hoo", "Hu")]
    kvsearch.finetune(again, pairs, targets="key", train="query+keys", keep="last", epochs=1, verbose=False)
    assert again.generation == 3 and again.key_texts([i], encoded_only=True) == [None]
    assert torch.equal(again.embeddings(torch.tensor([i]))[0], doc)  # a new key encoder, the given key kept
    assert again.search(doc[0], k=1)[0].key == "doc-1"
    again.close()


def test_upsert_of_embedding_keys_never_duplicates(rng):
    db, ids, keys, _ = random_db(None, rng, n=4, dim=8, value_dim=2)
    new_values = np.full((4, 2), 7.0, np.float32)
    assert db.upsert(keys, new_values) == ids.tolist() and len(db) == 4  # the same 4 records, replaced in place
    assert torch.equal(db.embeddings(torch.from_numpy(ids))[1].cpu(), torch.from_numpy(new_values))
    fresh = rng.standard_normal((1, 8)).astype(np.float32)
    both = db.upsert(np.concatenate([keys[:1], fresh]), np.zeros((2, 2), np.float32))
    assert both[0] == ids[0] and both[1] not in ids and len(db) == 5
    db.add(keys[:1], np.ones((1, 2), np.float32))  # add does not match keys: now two records have this key
    with pytest.raises(DuplicateKeyError, match=rf"delete\({ids[0]}\) then add"):
        db.upsert(keys[:1], np.ones((1, 2), np.float32))
    assert len(db) == 6


def test_hits_and_answers_carry_metadata_read_with_the_search(names_db):
    db = names_db
    db.upsert(["Li", "Lipton"], ["Mu", "Zachary"], [{"lang": "zh", "n": 1}, {"lang": "en"}])
    hits = db.search("Li", k=3)
    assert hits[0].metadata == {"lang": "zh", "n": 1} and hits[1].metadata == {"lang": "en"}
    assert hits[2].metadata == {}  # a record without metadata
    answer = db.query(["Li", "Lipton"], k=4)
    by_id = dict(zip(answer.ids[0].tolist(), answer.metadata[0]))
    assert by_id[db.store.texts.id_of_key["Li"]] == {"lang": "zh", "n": 1}
    one = db.query("Lipton", k=2)
    assert one.metadata.tolist() == [{"lang": "en"}, {"lang": "zh", "n": 1}]
    db.delete(["Li", "Lipton"])  # after the query: its metadata was read in the query's snapshot
    assert answer.metadata.tolist()[0][: len(by_id)] == list(by_id.values())
    assert one.metadata[0] == {"lang": "en"} and answer.row(1).metadata[0] == {"lang": "en"}
    small = Database(None, encoder=NgramEncoder())
    small.add(["x"], ["y"])
    assert small.query("x", k=3).metadata.tolist() == [{}, None, None]  # None: no candidate


def test_delete_missing_ignore(names_db):
    db = names_db
    li, hu = db.store.texts.id_of_key["Li"], db.store.texts.id_of_key["Hu"]
    with pytest.raises(KeyNotFoundError, match="nobody"):
        db.delete(["Li", "nobody"])  # the default: raise, and delete nothing
    assert len(db) == 6
    assert db.delete(["Li", "nobody", 10_000, hu, "Li"], missing="ignore") == [li, hu]
    assert len(db) == 4 and "Li" not in db
    assert db.delete(["nobody"], missing="ignore") == []


def test_reprs_are_short(rng):
    db, *_ = random_db(None, rng, n=20, dim=8, value_dim=256)
    answer = db.query(torch.randn(8), k=4)
    hits = db.search(torch.randn(8), k=2)
    for text in (repr(answer), repr(hits[0]), repr(db.query(torch.randn(5, 8), k=4))):
        assert len(text) < 400 and "tensor([" not in text and "(256,)" in text
    assert repr(answer).startswith("Answer(value=tensor(shape=(256,)), found=True, top=[(")
    assert "output=(256,), weights=(4,)" in repr(answer)
    names = Database(None, encoder=NgramEncoder())
    names.add(list(AUTHORS), list(AUTHORS.values()), [{"n": i} for i in range(6)])
    shown = repr(names.query("Lipto", k=4, temperature=0.1))
    assert shown.startswith("Answer(value='Zachary', found=True, top=[('Lipton', ") and "output=(256,)" in shown
    assert repr(names.search("Li", k=1)[0]).startswith("Hit(id=3, key='Li', value='Mu', score=")
    assert repr(names.search("Li", k=1)[0]).endswith("metadata={'n': 2})")


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("on_disk", [False, True])
def test_a_dropped_database_is_freed_at_once(tmp_path, on_disk, sharded):
    """No reference cycle between the facade and its parts: a database dropped without close() is freed (and its
    store file closed) when its last reference goes, not at some later garbage collection."""
    import gc
    import weakref

    from kvsearch.distributed import ShardedDatabase

    path = tmp_path / "db" if on_disk or sharded else None
    gc.collect()
    gc.disable()
    try:
        if sharded:
            db = ShardedDatabase(path, num_shards=2, dim=4, value_dim=4)
            stores = [shard.store for shard in db.shards.values()]
        else:
            db = Database(path, dim=4, value_dim=4)
            stores = [db.store]
        db.add(torch.randn(5, 4), torch.randn(5, 4))
        assert len(db.search(torch.randn(4), k=2)) == 2
        refs = [weakref.ref(db), *map(weakref.ref, stores)]
        del db, stores
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()
