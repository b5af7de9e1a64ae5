"""Tests of kvsearch.encoders: the n-gram encoder (fast) and the MiniLM sentence encoder (loaded once), and their
files (kvsearch.storage.encoder_files.save_encoder / load_encoder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsearch.encoders.base import Encoder
from kvsearch.encoders.ngram import NgramEncoder
from kvsearch.encoders.registry import ENCODER_KINDS, encoder_from_name
from kvsearch.encoders.sentence import SentenceEncoder, length_batches
from kvsearch.errors import CorruptDatabaseError, InvalidArgumentError, UnknownOptionError
from kvsearch.storage.encoder_files import load_encoder, save_encoder

NAMES = ["Zhang", "Lipton", "Smola", "Hu", "Werness"]
REPO_ROOT = Path(__file__).resolve().parents[1]


def nearest(encoder: Encoder, query: str, candidates: list[str]) -> str:
    queries = encoder.encode([query])  # (1, dim)
    keys = encoder.encode(candidates)  # (c, dim)
    scores = torch.nn.functional.cosine_similarity(queries, keys)  # (c,)
    return candidates[int(scores.argmax())]


def cosine(encoder: Encoder, a: str, b: str) -> float:
    embeddings = encoder.encode([a, b])  # (2, dim)
    return float(torch.nn.functional.cosine_similarity(embeddings[:1], embeddings[1:]))


@pytest.fixture(scope="module")
def ngram() -> NgramEncoder:
    """The default n-gram encoder on the CPU (never trained in place: tests that train make their own)."""
    return NgramEncoder(device="cpu")


@pytest.fixture
def small() -> NgramEncoder:
    """A small fresh n-gram encoder, cheap to train and save."""
    torch.manual_seed(0)
    return NgramEncoder(dim=16, num_buckets=512, seed=3, device="cpu")


def train_one_step(encoder: Encoder, texts: list[str]) -> None:
    encoder.train()
    optimizer = torch.optim.Adam(encoder.parameters(), lr=0.05)
    embeddings = encoder(texts)  # (n, dim)
    loss = -(embeddings[0] @ embeddings[1])  # pull the first two texts together
    loss.backward()
    optimizer.step()
    encoder.eval()


# --------------------------------------------------------------------------- n-gram: shapes and values


def test_ngrams_wrap_text_in_boundary_markers(ngram: NgramEncoder) -> None:
    assert ngram.ngrams("Li") == ["l", "i", "<l", "li", "i>", "<li", "li>", "<li>"]
    assert ngram.ngrams("") == ["<>"]
    assert NgramEncoder(dim=4, num_buckets=8, ngram_range=(2, 3), lowercase=False).ngrams("Ab") == [
        "<A",
        "Ab",
        "b>",
        "<Ab",
        "Ab>",
    ]


@pytest.mark.parametrize("texts", [["Li"], NAMES, ["", "a", "x" * 500, "Li Mu", "  "]])
def test_encode_shape_dtype_device_and_unit_norm(ngram: NgramEncoder, texts: list[str]) -> None:
    embeddings = ngram.encode(texts)
    assert embeddings.shape == (len(texts), 256)
    assert embeddings.dtype == torch.float32
    assert embeddings.device == ngram.device == torch.device("cpu")
    assert not embeddings.requires_grad
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(len(texts)))


def test_empty_list_gives_zero_rows(ngram: NgramEncoder) -> None:
    assert ngram.encode([]).shape == (0, 256)
    assert ngram([]).shape == (0, 256)
    assert ngram.encode(()).dtype == torch.float32


def test_text_without_ngrams_embeds_to_finite_zero() -> None:
    encoder = NgramEncoder(dim=8, num_buckets=64, ngram_range=(1, 1), device="cpu")
    embeddings = encoder.encode(["", "ab"])  # "" has only the lone markers, which are skipped
    assert torch.isfinite(embeddings).all()
    assert float(embeddings[0].abs().sum()) == 0.0
    assert float(embeddings[1].norm()) == pytest.approx(1.0)


@pytest.mark.parametrize(("query", "expected"), [("Li", "Lipton"), ("Lipto", "Lipton"), ("Smol", "Smola")])
def test_spelling_close_keys_are_nearest(ngram: NgramEncoder, query: str, expected: str) -> None:
    assert nearest(ngram, query, NAMES) == expected


def test_same_seed_same_output_different_seed_differs() -> None:
    a = NgramEncoder(dim=32, num_buckets=1024, seed=7, device="cpu")
    b = NgramEncoder(dim=32, num_buckets=1024, seed=7, device="cpu")
    c = NgramEncoder(dim=32, num_buckets=1024, seed=8, device="cpu")
    assert torch.equal(a.encode(NAMES), b.encode(NAMES))
    assert not torch.allclose(a.encode(NAMES), c.encode(NAMES))


def test_construction_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    NgramEncoder(dim=8, num_buckets=64, seed=1)
    assert torch.equal(state, torch.random.get_rng_state())


def test_hash_is_stable_across_processes(ngram: NgramEncoder) -> None:
    """Python's hash() is salted per process; the n-gram buckets must not be."""
    code = (
        "from kvsearch.encoders import NgramEncoder;"
        "print(NgramEncoder(device='cpu').encode(['Lipton', 'Пушкин']).sum(dim=1).tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    other = torch.tensor(json.loads(out.stdout))
    torch.testing.assert_close(other, ngram.encode(["Lipton", "Пушкин"]).sum(dim=1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_batch_size_does_not_change_the_result(ngram: NgramEncoder, batch_size: int) -> None:
    texts = [*NAMES, "", "Пушкин", "Li"]
    torch.testing.assert_close(ngram.encode(texts, batch_size=batch_size), ngram.encode(texts, batch_size=256))


def test_show_progress_gives_same_result(ngram: NgramEncoder) -> None:
    torch.testing.assert_close(ngram.encode(NAMES, show_progress=True, batch_size=2), ngram.encode(NAMES))


def test_unicode_and_cyrillic() -> None:
    encoder = NgramEncoder(device="cpu")
    texts = ["Пушкин", "Пушкина", "Толстой", "ПУШКИН", "東京", "🙂 émoji", "\x00"]
    embeddings = encoder.encode(texts)  # (7, 256)
    assert torch.isfinite(embeddings).all()
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(len(texts)))
    torch.testing.assert_close(embeddings[0], embeddings[3])  # lower-cased: case does not matter
    assert nearest(encoder, "Пушкин", ["Толстой", "Пушкина", "Чехов"]) == "Пушкина"
    cased = NgramEncoder(lowercase=False, device="cpu").encode(["Пушкин", "ПУШКИН"])  # (2, 256)
    assert not torch.allclose(cased[0], cased[1])


_HYPOTHESIS_ENCODER = NgramEncoder(dim=16, num_buckets=256, seed=0, device="cpu")


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=6))
def test_any_text_list_gives_finite_unit_rows(texts: list[str]) -> None:
    encoder = _HYPOTHESIS_ENCODER
    embeddings = encoder.encode(texts, batch_size=4)  # (n, 16)
    assert embeddings.shape == (len(texts), 16)
    assert torch.isfinite(embeddings).all()
    norms = embeddings.norm(dim=1)  # (n,)
    assert torch.all((norms - 1).abs() < 1e-5)  # default range (1, 4): every text has "<>"-style n-grams
    torch.testing.assert_close(encoder(texts).detach(), embeddings)


# --------------------------------------------------------------------------- n-gram: argument checks


def test_bare_string_is_refused_with_a_hint(ngram: NgramEncoder) -> None:
    with pytest.raises(InvalidArgumentError, match="pass a list"):
        ngram.encode("Lipton")
    with pytest.raises(InvalidArgumentError, match="pass a list"):
        ngram("Lipton")


def test_non_string_item_is_named_by_index_and_type(ngram: NgramEncoder) -> None:
    with pytest.raises(InvalidArgumentError, match=r"texts\[1\] must be a str, got int"):
        ngram.encode(["Li", 3])
    with pytest.raises(InvalidArgumentError, match=r"texts\[2\].*NoneType"):
        ngram(["a", "b", None])
    with pytest.raises(InvalidArgumentError, match="list or tuple"):
        ngram.encode({"Li"})


@pytest.mark.parametrize("batch_size", [0, -1, 1.5, True])
def test_bad_batch_size_is_refused(ngram: NgramEncoder, batch_size: object) -> None:
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        ngram.encode(NAMES, batch_size=batch_size)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"dim": 0},
        {"num_buckets": -1},
        {"ngram_range": (0, 2)},
        {"ngram_range": (3, 2)},
        {"ngram_range": (1, 2, 3)},
        {"seed": -1},
        {"seed": 1.5},
        {"lowercase": "yes"},
        {"device": "no-such-device"},
    ],
)
def test_bad_constructor_arguments_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        NgramEncoder(**{"dim": 4, "num_buckets": 8, **kwargs})


# --------------------------------------------------------------------------- n-gram: training


def test_forward_has_grad_to_the_embedding_table(small: NgramEncoder) -> None:
    embeddings = small(["Li", "Lipton"])  # (2, 16)
    assert embeddings.requires_grad
    embeddings.sum().backward()
    grad = small.embedding.weight.grad  # (512, 16)
    assert grad is not None and not grad.is_sparse
    touched = grad.abs().sum(dim=1) > 0  # (512,)
    assert 0 < int(touched.sum()) <= len(small.ngrams("Li")) + len(small.ngrams("Lipton"))


def test_encode_restores_train_mode_and_has_no_grad(small: NgramEncoder) -> None:
    small.train()
    assert not small.encode(NAMES).requires_grad
    assert small.training
    small.eval()
    small.encode(NAMES)
    assert not small.training


def test_sparse_gradients_on_request() -> None:
    encoder = NgramEncoder(dim=8, num_buckets=64, sparse=True, device="cpu")
    encoder(["Li"]).sum().backward()
    assert encoder.embedding.weight.grad.is_sparse
    assert encoder.config()["sparse"] is True


def test_adam_step_changes_weights_and_pulls_texts_together(small: NgramEncoder) -> None:
    before = cosine(small, "Li", "Werness")
    assert not small.weights_changed()
    for _ in range(5):
        train_one_step(small, ["Li", "Werness"])
    assert small.weights_changed()
    assert cosine(small, "Li", "Werness") > before


# --------------------------------------------------------------------------- n-gram: persistence


def test_untrained_ngram_saves_config_only_and_round_trips(small: NgramEncoder, tmp_path: Path) -> None:
    save_encoder(small, tmp_path, "keys")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json"]
    saved = json.loads((tmp_path / "keys.json").read_text())
    assert saved == {**small.config(), "weights": None}
    assert saved == {
        "kind": "ngram",
        "dim": 16,
        "ngram_range": [1, 4],
        "num_buckets": 512,
        "seed": 3,
        "lowercase": True,
        "sparse": False,
        "weights": None,
    }
    loaded = load_encoder(tmp_path, "keys", device="cpu")
    assert isinstance(loaded, NgramEncoder)
    assert loaded.config() == small.config()
    assert not loaded.trained
    assert torch.equal(loaded.encode(NAMES), small.encode(NAMES))


def test_trained_ngram_saves_weights_and_round_trips_exactly(small: NgramEncoder, tmp_path: Path) -> None:
    assert not small.needs_weights()
    train_one_step(small, ["Li", "Werness"])
    assert small.needs_weights()
    save_encoder(small, tmp_path, "keys")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.json", "keys.safetensors"]
    assert json.loads((tmp_path / "keys.json").read_text())["weights"] == "keys.safetensors"
    loaded = load_encoder(tmp_path, "keys", device="cpu")
    assert loaded.trained
    assert torch.equal(loaded.embedding.weight, small.embedding.weight)
    assert torch.equal(loaded.encode(NAMES), small.encode(NAMES))
    # saving an untrained encoder under the same prefix removes the stale weights
    save_encoder(NgramEncoder(dim=16, num_buckets=512, seed=3, device="cpu"), tmp_path, "keys")
    assert not (tmp_path / "keys.safetensors").exists()
    assert not load_encoder(tmp_path, "keys", device="cpu").weights_changed()


def test_save_leaves_no_temporary_files(small: NgramEncoder, tmp_path: Path) -> None:
    train_one_step(small, ["a", "b"])
    for _ in range(2):
        save_encoder(small, tmp_path / "db", "q")
    assert sorted(p.name for p in (tmp_path / "db").iterdir()) == ["q.json", "q.safetensors"]


@pytest.mark.parametrize("prefix", ["", "a/b", "..", 3])
def test_bad_prefix_is_refused(small: NgramEncoder, tmp_path: Path, prefix: object) -> None:
    with pytest.raises(InvalidArgumentError, match="prefix"):
        save_encoder(small, tmp_path, prefix)
    with pytest.raises(InvalidArgumentError, match="prefix"):
        load_encoder(tmp_path, prefix)
    assert list(tmp_path.iterdir()) == []


def test_save_encoder_refuses_what_is_not_an_encoder(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="Encoder"):
        save_encoder(torch.nn.Linear(2, 2), tmp_path, "keys")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def saved_trained(small: NgramEncoder, tmp_path: Path) -> Path:
    train_one_step(small, ["Li", "Werness"])
    save_encoder(small, tmp_path, "keys")
    return tmp_path


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"dim": 16}', "kind"),
        ('{"kind": "ngram", "dim": 16, "colour": "red"}', "does not describe"),
        ('{"kind": "ngram", "dim": -4}', "does not describe"),
        ('{"kind": "ngram", "weights": "../x.safetensors"}', "weights"),
    ],
)
def test_garbled_json_is_corrupt(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "keys.json").write_text(text)
    with pytest.raises(CorruptDatabaseError, match=match):
        load_encoder(tmp_path, "keys")


def test_missing_json_is_corrupt_and_named(tmp_path: Path) -> None:
    with pytest.raises(CorruptDatabaseError, match=r"keys\.json is missing"):
        load_encoder(tmp_path, "keys")


def test_unknown_kind_is_an_unknown_option(tmp_path: Path) -> None:
    (tmp_path / "keys.json").write_text('{"kind": "tfidf"}')
    with pytest.raises(UnknownOptionError, match="tfidf"):
        load_encoder(tmp_path, "keys")


def test_truncated_safetensors_is_corrupt(saved_trained: Path) -> None:
    path = saved_trained / "keys.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptDatabaseError, match=r"keys\.safetensors"):
        load_encoder(saved_trained, "keys", device="cpu")


def test_missing_safetensors_is_corrupt(saved_trained: Path) -> None:
    (saved_trained / "keys.safetensors").unlink()
    with pytest.raises(CorruptDatabaseError, match=r"keys\.safetensors are missing"):
        load_encoder(saved_trained, "keys", device="cpu")


def test_weights_that_do_not_fit_the_config_are_corrupt(saved_trained: Path) -> None:
    config = json.loads((saved_trained / "keys.json").read_text())
    (saved_trained / "keys.json").write_text(json.dumps({**config, "dim": 32}))
    with pytest.raises(CorruptDatabaseError, match="do not fit"):
        load_encoder(saved_trained, "keys", device="cpu")


# --------------------------------------------------------------------------- registry


def test_encoder_from_name_ngram_and_unknown() -> None:
    encoder = encoder_from_name("NGram", device="cpu")
    assert isinstance(encoder, NgramEncoder) and encoder.kind == "ngram" and encoder.dim == 256
    assert set(ENCODER_KINDS) == {"ngram", "sentence"}
    with pytest.raises(UnknownOptionError, match="bm25"):
        encoder_from_name("bm25")
    with pytest.raises(InvalidArgumentError):
        encoder_from_name(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- sentence encoder (one MiniLM load)


@pytest.fixture(scope="module")
def sentence() -> SentenceEncoder:
    return SentenceEncoder(device="cpu")


class TestSentenceEncoder:
    """all-MiniLM-L6-v2, loaded once for the module (~8 s); deselect with -k "not TestSentenceEncoder"."""

    def test_default_sentence_encoder_loads_offline(self, sentence: SentenceEncoder) -> None:
        assert os.environ.get("HF_HUB_OFFLINE") == "1"
        assert sentence.kind == "sentence" and sentence.dim == 384
        assert sentence.device == torch.device("cpu")
        assert not sentence.training and not sentence.trained
        assert sentence.config() == {
            "kind": "sentence",
            "model": None,
            "normalize": True,
            "max_seq_length": None,
        }
        embeddings = sentence.encode(NAMES)
        assert embeddings.shape == (5, 384) and embeddings.dtype == torch.float32
        assert not embeddings.is_inference() and not embeddings.requires_grad
        torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(5))
        assert sentence.encode([]).shape == (0, 384)
        torch.testing.assert_close(sentence.encode(NAMES, batch_size=1), embeddings, rtol=0, atol=1e-5)
        with pytest.raises(InvalidArgumentError, match="pass a list"):
            sentence.encode("Lipton")

    def test_texts_of_mixed_lengths_encode_as_the_model_does_in_their_order(self, sentence: SentenceEncoder) -> None:
        """On the CPU encode batches texts by length (words 256 at a time, passages a few at a time): each text's
        embedding is the model's own ``encode`` of the list, row for row, whatever the mix and the batch size."""
        words = ["Li", "Lipton", "Smola", "Пушкин", "", "x"]
        sentences = ["a longer sentence about attention pooling", "the capital of France", "  spaces  around  "]
        passage = " ".join(sentences * 12)  # ~900 characters: a batch of its own kind
        texts = [passage, *words, sentences[0], passage + " again", *sentences, *words]  # shuffled kinds, repeats
        reference = sentence.model.encode(texts, convert_to_tensor=True, normalize_embeddings=True)  # (n, 384)
        for batch_size in (1, 3, 256):
            got = sentence.encode(texts, batch_size=batch_size)  # (n, 384)
            torch.testing.assert_close(got, reference.clone(), rtol=0, atol=1e-5)
        torch.testing.assert_close(got[1], got[len(texts) - len(words)], rtol=0, atol=1e-5)  # "Li" both times

    @pytest.mark.parametrize("lengths", [[7] * 600, [70] * 100 + [5] * 300, [900, 3, 40, 40, 1200, 0], [1]])
    @pytest.mark.parametrize("batch_size", [1, 3, 32, 256])
    def test_length_batches_cover_every_row_once_within_the_budget(self, lengths: list[int], batch_size: int) -> None:
        batches = length_batches(lengths, batch_size, budget=2048)
        assert sorted(i for rows in batches for i in rows) == list(range(len(lengths)))
        flat = [lengths[i] for rows in batches for i in rows]
        assert flat == sorted(lengths, reverse=True)  # longest first
        for rows in batches:
            longest = lengths[rows[0]]
            assert 1 <= len(rows) <= batch_size and longest == max(lengths[i] for i in rows)
            assert len(rows) * longest <= 2048 or len(rows) <= min(batch_size, 4)  # within the budget, or the floor

    def test_length_batches_take_many_short_texts_and_few_long_ones(self) -> None:
        assert [len(rows) for rows in length_batches([7] * 600, 256)] == [256, 256, 88]  # words: the batch size
        assert [len(rows) for rows in length_batches([70] * 100, 256, budget=2048)] == [29, 29, 29, 13]  # sentences
        assert [len(rows) for rows in length_batches([900] * 9 + [10] * 3, 256, budget=2048)] == [4, 4, 4]  # the floor

    def test_sentence_forward_matches_encode_and_has_grad(self, sentence: SentenceEncoder) -> None:
        texts = ["Li", "Lipton", "a longer sentence about attention pooling", "Пушкин"]
        embeddings = sentence(texts)  # (4, 384), eval mode: no dropout
        torch.testing.assert_close(embeddings.detach(), sentence.encode(texts), rtol=0, atol=1e-5)
        assert embeddings.requires_grad
        embeddings.sum().backward()
        grads = [p.grad for p in sentence.parameters() if p.grad is not None]
        assert grads and any(float(g.abs().sum()) > 0 for g in grads)
        sentence.zero_grad(set_to_none=True)

    def test_minilm_is_semantic_not_lexical(self, sentence: SentenceEncoder, ngram: NgramEncoder) -> None:
        # MiniLM ranks "Hu" first for "Li" (cosine ~0.35 vs ~0.26 for "Lipton"): short names look alike to it
        assert nearest(sentence, "Li", NAMES) != "Lipton"
        assert nearest(ngram, "Li", NAMES) == "Lipton"

    def test_untrained_sentence_config_round_trips_as_json_only(
        self, sentence: SentenceEncoder, tmp_path: Path
    ) -> None:
        save_encoder(sentence, tmp_path, "queries")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["queries.json"]
        loaded = load_encoder(tmp_path, "queries", device="cpu")
        assert isinstance(loaded, SentenceEncoder) and loaded.config() == sentence.config()
        assert not loaded.trained
        torch.testing.assert_close(loaded.encode(NAMES), sentence.encode(NAMES))

    def test_trained_sentence_encoder_saves_its_model_folder(self, sentence: SentenceEncoder, tmp_path: Path) -> None:
        wrapped = SentenceEncoder(sentence.model, normalize=False)  # same weights, no second load
        assert wrapped.config()["model"] is None  # an instance cannot be named: its weights must be saved
        assert wrapped.needs_weights() and not sentence.needs_weights()
        wrapped.trained = True
        save_encoder(wrapped, tmp_path, "queries")
        saved = json.loads((tmp_path / "queries.json").read_text())
        assert saved["model"] == saved["weights"] == "queries_model"
        assert list((tmp_path / "queries_model").rglob("*.safetensors"))
        assert not list((tmp_path / "queries_model").rglob("*.bin"))
        loaded = load_encoder(tmp_path, "queries", device="cpu")
        assert loaded.trained and not loaded.normalize
        torch.testing.assert_close(loaded.encode(NAMES), wrapped.encode(NAMES), rtol=0, atol=1e-5)
        (tmp_path / "queries_model" / "modules.json").unlink()
        (tmp_path / "queries_model" / "config.json").unlink()
        with pytest.raises(CorruptDatabaseError, match="queries_model"):
            load_encoder(tmp_path, "queries", device="cpu")
