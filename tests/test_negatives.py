"""What a training query competes with (``negatives=``), the warm-up, and pairs made from the records.

One step of ``finetune`` with plain SGD is compared with the same step taken by hand: the encoder's weights after
``negatives="in-batch"`` equal those of a dense cross-entropy over the batch's distinct target keys (as
sentence-transformers' MultipleNegativesRankingLoss), and after ``negatives="both"`` over those keys and the brute
force top k of the stored keys (detached) that are not in the batch nor scoring near the target (false negatives).
The warm-up is compared with transformers' schedules, ``pairs_from`` with the records read back by hand.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import kvsearch
from kvsearch import FinetuneConfig, finetune
from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.training.defaults import auto_negatives, auto_warmup, lr_schedule
from kvsearch.training.trainables import HARD_NEGATIVE_MARGIN

SURNAMES = ["Li", "Lipton", "Smola", "Zhang", "Mu", "Chen", "Garcia", "Nguyen", "Kowalski", "Okafor", "Silva", "Ivanov"]
WORDS = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "papaya", "peach", "pear", "plum", "melon"]
PAIRS = {
    "surnames": [("Lipten", "Lipton"), ("Smolla", "Smola"), ("Zang", "Zhang"), ("Chenn", "Chen"), ("Lipon", "Lipton")],
    "words": [("aple", "apple"), ("banan", "banana"), ("chery", "cherry"), ("grap", "grape"), ("aplle", "apple")],
}
#: Pairs no training pair names: what an eval set holds out.
HELD_OUT = {
    "surnames": [("Kowalsky", "Kowalski"), ("Nguyn", "Nguyen")],
    "words": [("mangoo", "mango"), ("lemmon", "lemon")],
}
KEYS = {"surnames": SURNAMES, "words": WORDS}
T = 0.05
LR = 0.5


def _db(tmp_path, kind: str) -> kvsearch.Database:
    db = kvsearch.Database(tmp_path / kind, encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512, seed=3))
    db.add(keys=KEYS[kind], values=[k.upper() for k in KEYS[kind]])
    return db


def _one_step(db: kvsearch.Database, pairs, negatives: str, k: int = 3) -> None:
    history = finetune(
        db,
        pairs,
        train="query+keys",
        negatives=negatives,
        k=k,
        epochs=1,
        batch_size=len(pairs),
        optimizer="sgd",
        lr=LR,
        lr_decay="none",
        warmup=0.0,
        keep="last",
        generated=0,
        temperature=T,
        verbose=False,
    )
    assert history.committed


def _by_hand(
    encoder, stored: torch.Tensor, keys: list[str], pairs, negatives: str, k: int = 3, margin=HARD_NEGATIVE_MARGIN
) -> dict:
    """The same SGD step taken by hand on a copy of the encoder: dense cross-entropy over the batch's targets."""
    encoder = copy.deepcopy(encoder).train()
    targets = list(dict.fromkeys(sorted((t for _, t in pairs), key=keys.index)))  # distinct, in id order
    q = F.normalize(encoder([q for q, _ in pairs]), dim=-1)  # (b, dim)
    p = F.normalize(encoder(targets), dim=-1)  # (u, dim)
    logits = q @ p.T  # (b, u)
    labels = torch.tensor([targets.index(t) for _, t in pairs])  # (b,)
    if negatives == "both":
        scores = F.normalize(q.detach(), dim=-1) @ F.normalize(stored, dim=-1).T  # (b, m) brute force
        top = scores.topk(k, dim=-1).indices  # (b, k)
        hard = (q.unsqueeze(1) @ F.normalize(stored[top], dim=-1).transpose(1, 2)).squeeze(1)  # (b, k)
        in_batch = torch.tensor([[keys[j] in targets for j in row] for row in top.tolist()])  # (b, k)
        positive = logits.gather(1, labels.unsqueeze(1)).detach()  # (b, 1) each query's target score
        close = hard.detach() > positive - (1 - margin) * positive.abs()  # (b, k) likely false negatives, dropped
        logits = torch.cat([logits, hard.masked_fill(in_batch | close, -math.inf)], 1)  # (b, u + k)
    F.cross_entropy(logits / T, labels).backward()
    with torch.no_grad():
        for param in encoder.parameters():
            if param.grad is not None:
                param -= LR * param.grad
    return {name: t.detach().clone() for name, t in encoder.state_dict().items()}


@pytest.mark.parametrize("kind", ["surnames", "words"])
@pytest.mark.parametrize("negatives", ["in-batch", "both"])
def test_one_step_equals_dense_cross_entropy_by_hand(tmp_path, kind, negatives):
    torch.manual_seed(0)
    db = _db(tmp_path, kind)
    stored, _, _ = db.embeddings(db.ids())  # (m, dim) the keys the index holds before the step
    expected = _by_hand(db.encoder, stored, KEYS[kind], PAIRS[kind], negatives)
    _one_step(db, PAIRS[kind], negatives)
    got = db.encoder.state_dict()
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "kind, pairs",
    [
        ("words", [("pear", "peach"), ("aple", "apple"), ("lemonn", "lemon")]),
        ("surnames", [("Lipton", "Li"), ("Smolla", "Smola")]),
    ],
)
def test_a_hard_negative_scoring_near_the_target_is_dropped(tmp_path, kind, pairs):
    """A query that is itself another stored key ("pear" for "peach"): that key outscores the target, is taken for a
    false negative and leaves the softmax; the step equals the filtered one by hand, not the unfiltered one."""
    torch.manual_seed(0)
    db = _db(tmp_path, kind)
    stored, _, _ = db.embeddings(db.ids())  # (m, dim)
    kept = _by_hand(db.encoder, stored, KEYS[kind], pairs, "both")
    unfiltered = _by_hand(db.encoder, stored, KEYS[kind], pairs, "both", margin=math.inf)
    _one_step(db, pairs, "both")
    got = db.encoder.state_dict()
    for name in got:
        torch.testing.assert_close(got[name], kept[name], rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(got[n], unfiltered[n], rtol=1e-4, atol=1e-6) for n in got)


@pytest.mark.parametrize("kind", ["surnames", "words"])
def test_the_kinds_of_negatives_give_different_steps(tmp_path, kind):
    weights = {}
    for negatives in ("candidates", "in-batch", "both"):
        db = _db(tmp_path / negatives, kind)
        start = copy.deepcopy(db.encoder.state_dict())
        _one_step(db, PAIRS[kind], negatives)
        weights[negatives] = db.encoder.state_dict()
        assert any(not torch.equal(start[n], weights[negatives][n]) for n in start)  # each step moved them
        db.close()
    names = list(weights["both"])
    assert any(not torch.equal(weights["in-batch"][n], weights["both"][n]) for n in names)
    assert any(not torch.equal(weights["in-batch"][n], weights["candidates"][n]) for n in names)


def test_negatives_are_refused_where_they_cannot_work(tmp_path):
    db = _db(tmp_path, "words")
    with pytest.raises(UnknownOptionError, match="negatives"):
        FinetuneConfig(negatives="hard")
    with pytest.raises(InvalidArgumentError, match="value targets"):
        finetune(db, [("aple", "APPLE")], loss="answer", negatives="in-batch", verbose=False)
    queries, values = torch.randn(4, db.dim), torch.randn(4, db.value_dim)
    with pytest.raises(InvalidArgumentError, match="tensors"):
        finetune(db, (queries, values), loss="answer_mse", negatives="both", verbose=False)
    assert db.generation == 0 or db.encoders_info()["last_run"] is None


def test_defaults_by_encoder(tmp_path):
    from kvsearch.training.defaults import DEFAULT_LR, auto_batch_size, auto_train

    db = _db(tmp_path, "words")
    assert auto_negatives(db, key_pairs=True, solo=True) == "candidates"  # the n-gram study's choice
    assert (auto_warmup(db), auto_train(db), auto_batch_size(0, db)) == (0.0, "query+keys", 64)
    sentences = kvsearch.Database(encoder=kvsearch.SentenceEncoder())  # the semantic study's choices
    sentences.add(keys=["a red fruit", "a yellow fruit", "a large animal", "a small bird"], values=["1", "2", "3", "4"])
    assert auto_negatives(sentences, key_pairs=True, solo=True) == "in-batch"
    assert auto_negatives(sentences, key_pairs=False, solo=True) == "candidates"  # value targets, tensor pairs
    assert auto_negatives(sentences, key_pairs=True, solo=False) == "candidates"  # a sharded database
    assert (auto_warmup(sentences), auto_train(sentences), auto_batch_size(0, sentences)) == (0.1, "query+keys", 32)
    finetune(sentences, [("an apple", "a red fruit"), ("a sparrow", "a small bird")], epochs=1, verbose=False)
    run = sentences.encoders_info()["last_run"]
    assert (run["train"], run["negatives"], run["warmup"]) == ("query+keys", "in-batch", 0.1)
    assert DEFAULT_LR["sentence"] == 1e-4


@pytest.mark.parametrize("warmup", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_warmup_equals_transformers_schedules(warmup, decay):
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    steps = 20
    made = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}[decay]
    ours, theirs = [], []
    for make, seen in (
        (lambda o: lr_schedule(o, decay, steps, warmup), ours),
        (lambda o: made(o, int(warmup * steps), steps), theirs),
    ):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        schedule = make(opt)
        for _ in range(steps):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            schedule.step()
    assert ours == pytest.approx(theirs, abs=1e-12)


@pytest.mark.parametrize("bad", [1.0, -0.1, True, "0.1", math.nan])
def test_warmup_is_checked(bad):
    with pytest.raises(InvalidArgumentError, match="warmup"):
        FinetuneConfig(warmup=bad)


def test_pairs_from_values_and_metadata(tmp_path):
    from kvsearch.training.pairs import record_pairs

    db = kvsearch.Database(tmp_path / "db", encoder=kvsearch.NgramEncoder(dim=32, num_buckets=512))
    meta = [{"info": {"title": f"the {w} fruit"}} if i % 2 else {"other": 1} for i, w in enumerate(WORDS)]
    db.add(keys=WORDS, values=[w.upper() if i % 3 else w for i, w in enumerate(WORDS)], metadata=meta)
    expected_values = [(w.upper(), w) for i, w in enumerate(WORDS) if i % 3]  # a value equal to its key is no pair
    assert record_pairs(db, "value") == expected_values
    assert record_pairs(db, "metadata.info.title") == [(f"the {w} fruit", w) for i, w in enumerate(WORDS) if i % 2]
    with pytest.raises(InvalidArgumentError, match="pairs_from"):
        record_pairs(db, "metadata.nothing")
    for bad in ("values", "metadata.", "", 3):
        with pytest.raises(InvalidArgumentError, match="pairs_from"):
            FinetuneConfig(pairs_from=bad)
    history = finetune(db, None, pairs_from="metadata.info.title", generated=0, epochs=1, verbose=False)
    assert history.judged_on == "train_pairs" and history.judged == len(WORDS) // 2


HARD = {
    "surnames": [("Lptn", "Lipton"), ("Zng", "Zhang"), ("Kwlsk", "Kowalski"), ("Ngyn", "Nguyen"), ("Smla", "Smola")],
    "words": [("apl", "apple"), ("bnn", "banana"), ("chry", "cherry"), ("mng", "mango"), ("ppy", "papaya")],
}


def _good_then_bad(batch):
    """The retrieval loss for epoch 1's steps, its negative after: epoch 1 learns, later epochs unlearn."""
    from kvsearch.training.losses import retrieval_loss

    _good_then_bad.calls += 1
    return retrieval_loss(batch) * (1 if _good_then_bad.calls <= _good_then_bad.steps else -5)


@pytest.mark.parametrize("kind", ["surnames", "words"])
@pytest.mark.parametrize("keep", ["last", "best"])
def test_committed_keys_are_what_the_kept_encoder_gives(tmp_path, kind, keep):
    """The commit writes the draft's last refresh when it is the kept encoder's (the last epoch), else encodes again
    (keep="best" keeping epoch 1 of 3 here): either way the stored keys are the committed encoder's encoding of the
    key texts, and reopening answers the same."""
    db = _db(tmp_path, kind)
    pairs = PAIRS[kind] + HARD[kind]  # epoch 1 learns the pairs it is judged on
    _good_then_bad.calls, _good_then_bad.steps = 0, len(pairs) // 2
    options = {"loss": _good_then_bad} if keep == "best" else {}
    history = finetune(
        db, pairs, eval_pairs=HARD[kind], epochs=3, keep=keep, generated=0, batch_size=2, verbose=False, **options
    )
    assert history.committed and history.kept_epoch == (1 if keep == "best" else 3)
    ids = db.ids()
    stored, _, _ = db.embeddings(ids)  # (m, dim)
    db.encoder.eval()
    with torch.no_grad():
        fresh = db.encoder.encode(db.key_texts(ids)).float()  # (m, dim)
    torch.testing.assert_close(stored, fresh, rtol=0, atol=1e-6)
    query = HARD[kind][0][0]
    hits = [h.key for h in db.search(query, k=3)]
    db.close()
    with kvsearch.Database(tmp_path / kind) as again:
        assert [h.key for h in again.search(query, k=3)] == hits


@pytest.mark.parametrize("kind", ["surnames", "words"])
def test_in_batch_steps_do_not_refresh_the_index_they_never_read(tmp_path, kind):
    """In-batch negatives alone read no index in a step: the keys are re-encoded only for a measure and the commit,
    whatever ``refresh_every`` says, and the weights are those of a run that refreshes rarely; candidates still
    refresh after every step."""
    runs = {}
    for name, negatives, every in (("inb-1", "in-batch", 1), ("inb-99", "in-batch", 99), ("cand-1", "candidates", 1)):
        db = _db(tmp_path / name, kind)
        torch.manual_seed(0)
        history = finetune(
            db, PAIRS[kind], train="query+keys", negatives=negatives, k=3, epochs=2, batch_size=2,
            refresh_every=every, keep="last", generated=0, verbose=False,
        )  # fmt: skip
        runs[name] = (history.refreshes, db.encoder.state_dict())
        db.close()
    steps = 2 * math.ceil(len(PAIRS[kind]) / 2)
    assert runs["inb-1"][0] == runs["inb-99"][0] == 1  # nothing measured: once, for the commit
    assert runs["cand-1"][0] == steps  # after every step
    for name, tensor in runs["inb-1"][1].items():
        torch.testing.assert_close(tensor, runs["inb-99"][1][name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["surnames", "words"])
def test_an_in_batch_run_refreshes_the_keys_for_each_epoch_it_measures(tmp_path, kind):
    """Held-out eval pairs measure every epoch (each after a refresh of the keys); the training pairs themselves,
    which cannot tell which epoch generalizes best, measure the start and the last epoch only (one refresh); what
    the steps do is the same, measured or not."""
    epochs, runs = 3, {}
    for judge, options in (
        ("eval_pairs", {"eval_pairs": HELD_OUT[kind], "keep": "last"}),
        ("train_pairs", {"keep": "best"}),
        ("nothing", {"keep": "last"}),
    ):
        db = _db(tmp_path / judge, kind)
        torch.manual_seed(0)
        history = finetune(
            db, PAIRS[kind], train="query+keys", negatives="in-batch", epochs=epochs, batch_size=2, generated=0,
            verbose=False, **options,
        )  # fmt: skip
        assert history.judged_on == judge
        runs[judge] = (history, db.encoder.state_dict())
        db.close()
    measured = {judge: [int(m["epoch"]) for m in history.metrics] for judge, (history, _) in runs.items()}
    assert measured == {"eval_pairs": [0, 1, 2, 3], "train_pairs": [0, epochs], "nothing": []}
    assert [runs[judge][0].refreshes for judge in ("eval_pairs", "train_pairs", "nothing")] == [epochs, 1, 1]
    assert runs["train_pairs"][0].kept_epoch in (0, epochs)  # the last epoch, if it beats the start
    for name, tensor in runs["eval_pairs"][1].items():  # measuring does not change the steps
        torch.testing.assert_close(tensor, runs["nothing"][1][name], rtol=0, atol=0)
