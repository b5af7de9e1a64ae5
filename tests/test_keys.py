"""Keys and records: upsert keeps metadata it is not given, keys are compared after NFC and stripping, and an
exact query by embedding that matches several stored keys is not found."""

from __future__ import annotations

import shutil
import unicodedata
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch.cli.ingest import ingest_file
from kvsearch.errors import DuplicateKeyError, EmptyKeyError, KeyNotFoundError

NFC = unicodedata.normalize("NFC", "Müller")
NFD = unicodedata.normalize("NFD", "Müller")
LEGACY = Path(__file__).resolve().parent / "data" / "legacy"


def names_db(path=None) -> kvsearch.Database:
    return kvsearch.Database(path, encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512), device="cpu")


# ----------------------------------------------------------------------------- upsert and metadata


def test_upsert_without_metadata_keeps_what_is_stored_and_an_empty_dict_clears_it(tmp_path):
    db = names_db(tmp_path / "db")
    ids = db.add(["a", "b", "c", "e"], ["1", "2", "3", "5"], metadata=[{"keep": 1}, {"keep": 2}, {"keep": 3}, None])
    assert db.upsert(["a"], ["one"]) == [ids[0]]  # metadata=None: kept
    db.upsert(["b"], ["two"], metadata=[{}])  # {}: cleared
    db.upsert(["c", "d"], ["three", "four"], metadata=[None, {"new": 4}])  # None in a list: kept for that record
    db.upsert("e", "five", metadata={"set": 5})  # one dict for one record: replaced
    expected = {"a": {"keep": 1}, "b": {}, "c": {"keep": 3}, "d": {"new": 4}, "e": {"set": 5}}
    values = {"a": "one", "b": "two", "c": "three", "d": "four", "e": "five"}
    db.close()
    db = names_db(tmp_path / "db")  # what was kept is on disk
    for key, metadata in expected.items():
        (id_,) = db.ids_of_keys([key]).tolist()
        record = db.get(id_)
        assert (record.metadata, record.value) == (metadata, values[key])
    assert [h.key for h in db.search("a", k=5, where={"keep": {"$gte": 1}})] == ["a", "c"]  # filters see it too
    db.close()


# ----------------------------------------------------------------------------- text keys: NFC and stripping


def test_normalize_key_is_nfc_and_strips_surrounding_whitespace():
    from kvsearch.inputs import normalize_key

    assert NFC != NFD and normalize_key(NFD) == normalize_key(NFC) == NFC
    assert normalize_key("  42\t\n") == "42" and normalize_key("\u00a0Li\u3000") == "Li"
    assert normalize_key("a  b") == "a  b"  # inner whitespace is part of the key


def test_nfc_and_nfd_are_one_key_on_every_path():
    db = names_db()
    (id_,) = db.add([NFD], ["Hans"])
    assert db.get(id_).key == NFC  # stored normalised
    with pytest.raises(DuplicateKeyError):
        db.add([NFC], ["Other"])
    assert db.lookup(NFC) == db.lookup(NFD) == "Hans"
    assert NFC in db and NFD in db and db.ids_of_keys([NFC, NFD]).tolist() == [id_, id_]
    for form in (NFC, NFD):
        answer = db.query(form, k=3, pooling="exact")
        assert answer.found and answer.value == "Hans"
    assert db.upsert([NFC], ["Hans-Peter"]) == [id_] and len(db) == 1
    assert db.delete(NFD) == [id_] and len(db) == 0


def test_surrounding_whitespace_is_not_part_of_a_key():
    db = names_db()
    (id_,) = db.add([" 42 "], [" value kept as given "])
    assert db.get(id_).key == "42"
    assert db.lookup("42") == db.lookup(" 42") == db.lookup("42\n") == " value kept as given "  # values unchanged
    with pytest.raises(DuplicateKeyError):
        db.add(["42"], ["again"])
    assert db.query("42 ", k=1, pooling="exact").found
    assert [h.score for h in db.search("  42", k=1)] == [h.score for h in db.search("42", k=1)]  # queries too
    for blank in ["", "   ", "\t\n", "\u00a0\u3000"]:
        with pytest.raises(EmptyKeyError):
            db.add(["ok", blank], ["1", "2"])
    assert len(db) == 1 and "ok" not in db  # nothing of a refused batch was written
    db.delete(" 42")
    assert len(db) == 0


def test_keys_stored_by_an_earlier_version_are_found_by_their_normalised_text(tmp_path):
    # A store written by a version before key normalisation (and before kvsearch.storage.chunks): see tests/data.
    shutil.copytree(LEGACY / "unnormalised_keys", tmp_path / "db")
    ids = [1, 2, 3, 4, 5]  # "Zhang", " padded ", NFD, "42", " 42"
    with pytest.warns(RuntimeWarning, match=rf"'42': ids \[{ids[3]}, {ids[4]}\]"):
        db = names_db(tmp_path / "db")
    assert db.generation == 1  # consistent as written: nothing re-encoded at open
    assert db.get(ids[1]).key == " padded " and db.get(ids[2]).key == NFD  # kept as stored
    assert db.lookup("padded") == db.lookup(" padded ") == "x" and db.lookup(NFC) == db.lookup(NFD) == "Hans"
    assert db.lookup("42") == "forty-two"  # the smaller id of the two; the other is reachable by id
    with pytest.raises(DuplicateKeyError):
        db.add(["padded"], ["again"])
    assert db.upsert(["padded"], ["y"]) == [ids[1]] and db.get(ids[1]).key == "padded"  # normalised now
    assert db.delete([NFC]) == [ids[2]]
    assert db.delete(ids[4]) == [ids[4]] and db.lookup("42") == "forty-two" and len(db) == 3
    db.close()


def test_ingest_and_the_cli_normalise_keys(tmp_path, capsys):
    from kvsearch.cli.program import main

    path = tmp_path / "a.csv"
    path.write_text(f"key,value\n{NFD},Hans\n 42 ,x\n{NFC},Again\n", encoding="utf-8")
    db = names_db()
    with pytest.raises(kvsearch.BadFileError) as info:
        ingest_file(db, path, progress=False)
    assert info.value.problems == [(4, f"duplicate key {NFC!r} (first on line 2)")]
    path.write_text(f"key,value\n{NFD},Hans\n 42 ,x\n", encoding="utf-8")
    assert ingest_file(db, path, progress=False) == 2 and db.lookup(NFC) == "Hans" and db.lookup("42") == "x"
    assert main(["build", str(tmp_path / "db"), "--from", str(path), "--quiet"]) == 0
    assert main(["query", str(tmp_path / "db"), NFC, "42", "--pooling", "exact", "--json"]) == 0
    assert "Hans" in capsys.readouterr().out


def test_a_sharded_database_routes_keys_by_their_normalised_text(tmp_path):
    from kvsearch.distributed import ShardedDatabase

    with ShardedDatabase(tmp_path / "s", num_shards=4, encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512)) as sdb:
        sdb.add(keys=[NFD, " 42 "] + [f"k{i}" for i in range(10)], values=["Hans", "x"] + ["v"] * 10)
        assert sdb.lookup(NFC) == "Hans" and sdb.lookup("42") == "x" and NFC in sdb
        assert sdb.query([NFC, "42"], k=3, pooling="exact").found == [True, True]
        assert len(sdb.delete([NFC, "42"])) == 2 and len(sdb) == 10


# ----------------------------------------------------------------------------- exact queries by embedding


def test_an_exact_query_by_an_embedding_stored_twice_is_not_found():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(5, 4, generator=gen)
    keys[3] = keys[1]  # duplicate key embeddings are accepted
    values = torch.randn(5, 2, generator=gen)
    db = kvsearch.Database(None, dim=4, value_dim=2, device="cpu")
    ids = db.add(keys=keys, values=values)
    answer = db.query(keys[[0, 1, 2]], k=3, pooling="exact")
    assert answer.found == [True, False, True] and answer.value[1] is None
    assert torch.equal(answer.output[1], torch.zeros(2)) and torch.equal(answer.output[0], values[0])
    assert answer.ids[0, answer.weights[0].argmax()] == ids[0]
    with pytest.raises(KeyNotFoundError, match="2 stored keys"):
        db.lookup(keys[1])
    assert db.lookup(keys[1], default=None) is None and torch.equal(db.lookup(keys[2]), values[2])
    assert keys[2] in db and keys[1] not in db
    layer = kvsearch.KVAttention(db, k=1, pooling="exact")  # k=1: the index shows one copy only
    output = layer(keys[[1, 2]])
    assert torch.equal(output[0], torch.zeros(2)) and torch.equal(output[1], values[2])


def test_an_exact_query_by_embedding_with_the_ngram_encoder_that_lowercases():
    db = names_db()
    db.add(["Li", "li", "Lipton"], ["Mu", "other", "Zachary"])
    assert db.lookup("Li") == "Mu" and db.lookup("li") == "other"  # by text: text equality
    assert db.query("Li", k=3, pooling="exact").value == "Mu"
    embedding = db.encoder.encode(["Li"])[0]  # equal to the embedding of "li"
    assert torch.equal(embedding, db.encoder.encode(["li"])[0])
    assert not db.query(embedding, k=3, pooling="exact").found
    with pytest.raises(KeyNotFoundError, match="2 stored keys"):
        db.lookup(embedding)
    assert db.query(db.encoder.encode(["Lipton"])[0], k=3, pooling="exact").value == "Zachary"


def test_training_and_evaluation_queries_are_normalised_too():
    from kvsearch.training.metrics import evaluate

    def run(pairs):
        db = names_db()
        db.add([NFC, "Muller", "Mueller"], ["a", "b", "c"])
        before = evaluate(db, pairs, k=3)
        history = kvsearch.finetune(db, pairs, loss="retrieval", k=3, epochs=1, keep="last", verbose=False)
        return before, history.losses, db.encoder.encode(["Muller"])

    as_typed = run([(NFD, NFC), (" Mueller\t", "Mueller")])
    normalised = run([(NFC, NFC), ("Mueller", "Mueller")])
    assert as_typed[0] == normalised[0] == {"recall@1": 1.0, "recall@k": 1.0, "mrr": 1.0}
    assert as_typed[1] == normalised[1] and torch.equal(as_typed[2], normalised[2])  # the same training run


# ----------------------------------------------------------------------------- keys and values as any sequence of str

KEYS, VALUES = ["Zhang", "Lipton", NFD, "Smola"], ["Aston", "Zachary", "Mu", "Alex"]


def records_of(db: kvsearch.Database) -> list[tuple[int, str | None, object, dict]]:
    return [(r.id, r.key, r.value, r.metadata) for r in (db.get(i) for i in db.ids().tolist())]


@pytest.mark.parametrize("kind", ["numpy <U", "numpy object", "pandas"])
def test_numpy_and_pandas_string_arrays_are_taken_as_lists_of_str(kind):
    import numpy as np

    def wrap(texts):
        if kind == "pandas":
            pd = pytest.importorskip("pandas")
            return pd.Series(texts)
        return np.array(texts) if kind == "numpy <U" else np.array(texts, dtype=object)

    reference, db = names_db(), names_db()  # the same writes and reads, as lists and as arrays
    assert db.add(wrap(KEYS), wrap(VALUES)) == reference.add(KEYS, VALUES)
    assert db.upsert(wrap(["Lipton", "Hu"]), wrap(["Z.", "Rachel"])) == reference.upsert(
        ["Lipton", "Hu"], ["Z.", "Rachel"]
    )
    for record in records_of(db):
        assert type(record[1]) is str and type(record[2]) is str  # plain str stored, not numpy.str_
    assert records_of(db) == records_of(reference)
    assert torch.equal(db.ids_of_keys(wrap([NFC, "nobody", "Hu"])), reference.ids_of_keys([NFC, "nobody", "Hu"]))
    assert torch.equal(db.values_present(wrap(["Rachel", "Li"])), reference.values_present(["Rachel", "Li"]))
    assert [h.key for h in db.search(wrap(["Smola", "Zhang"]), k=2)[1]] == [
        h.key for h in reference.search(["Smola", "Zhang"], k=2)[1]
    ]
    assert db.delete(wrap(["Smola", " Hu "])) == reference.delete(["Smola", " Hu "])
    assert records_of(db) == records_of(reference)


def test_a_numeric_array_is_still_embeddings_and_a_bad_string_array_is_refused():
    import numpy as np

    from kvsearch.errors import InvalidArgumentError

    rng = np.random.default_rng(0)
    keys, values = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((3, 2))
    db = kvsearch.Database(dim=4, value_dim=2, device="cpu")
    ids = db.add(keys, values)
    assert torch.equal(db.embeddings(ids)[0], torch.from_numpy(keys))  # numbers: embeddings, as before
    assert db.delete(np.array(ids[:1])) == ids[:1]  # an integer array: ids, as before
    texts = names_db()
    with pytest.raises(InvalidArgumentError, match=r"one-dimensional array of str, got shape \(1, 2\)"):
        texts.add(np.array([["a", "b"]]), ["1", "2"])
    with pytest.raises(InvalidArgumentError, match="numpy array of bytes"):
        texts.add(np.array([b"a"]), ["1"])
    with pytest.raises(InvalidArgumentError, match="expected keys as str, got int at position 1"):
        texts.add(np.array(["a", 1], dtype=object), ["1", "2"])
    assert len(texts) == 0  # nothing written
    pd = pytest.importorskip("pandas")
    more = pd.DataFrame(rng.standard_normal((2, 4)).astype(np.float32))  # a frame of numbers: embeddings
    more_ids = db.add(more, pd.DataFrame(rng.standard_normal((2, 2))))
    assert torch.equal(db.embeddings(more_ids)[0], torch.tensor(more.to_numpy()))
