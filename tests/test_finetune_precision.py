"""``finetune(..., precision=)``: training under autocast (bf16 on the CPU, fp16 / bf16 on CUDA), against float32.

The encoder of most tests is an n-gram encoder followed by a linear layer (:class:`Projected`), so that autocast has
an op to lower (an ``EmbeddingBag`` stays float32 under CPU autocast; a ``Linear`` runs in bfloat16), and it records
the dtype each forward produced. The guarantees of the float32 loop are checked again under ``"bf16"``: keep-best
keeps the start bit for bit when training only makes things worse, the committed weights are float32 and reopen to
the same answers, and a bad precision is refused before anything is written.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvsearch import (
    Database,
    Encoder,
    FinetuneConfig,
    NgramEncoder,
    NotSupportedError,
    UnknownOptionError,
    evaluate,
    finetune,
)
from kvsearch.cli import main
from kvsearch.training.losses import Batch
from kvsearch.training.precision import FP16_INIT_SCALE, optimizer_step

names = pytest.importorskip("names")

from kvsearch.datasets import noisy_queries, split_names, surname_directory  # noqa: E402

METRIC_NAMES = ("recall@1", "recall@k", "mrr")


class Projected(Encoder):
    """Hashed n-grams, then a linear layer (identity at the start), unit-norm rows; it records its output dtypes."""

    kind = "projected"

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.dim = 32
        self.ngram = NgramEncoder(dim=32, num_buckets=4096, device=device)
        self.proj = torch.nn.Linear(32, 32, device=device)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(32))
            self.proj.bias.zero_()
        self.dtypes: list[torch.dtype] = []

    def forward(self, texts):
        hidden = self.proj(self.ngram(texts))  # (n, 32) in autocast's dtype under autocast
        self.dtypes.append(hidden.dtype)
        return F.normalize(hidden.float(), dim=-1)  # (n, 32)

    def config(self):
        return {"kind": self.kind}

    def needs_weights(self):
        return True


@pytest.fixture(scope="module")
def directory():
    """300 surnames -> first names; Cyrillic (learnable) and one-edit queries for a train / held-out split."""
    keys, values = surname_directory(300)
    train, held = split_names(keys, 0.25, seed=0)
    stored = set(keys)
    return {
        "keys": keys,
        "values": values,
        "train": noisy_queries(train, "cyrillic", avoid=stored),
        "held": noisy_queries(held, "cyrillic", avoid=stored),
        "train_edit": noisy_queries(train, "edit", avoid=stored),
        "held_edit": noisy_queries(held, "edit", avoid=stored),
    }


def memory_db(directory, device: str = "cpu") -> Database:
    """The directory in memory; its query encoder (what ``train="query"`` trains) a :class:`Projected` of its own."""
    db = Database(None, encoder=Projected(device), device=device)
    db.add(keys=directory["keys"], values=directory["values"])
    db.query_encoder = Projected(device)  # the same embeddings as the key encoder's until it trains
    return db


def folder_db(path: Path, directory) -> Database:
    db = Database(path, encoder=NgramEncoder(dim=32, num_buckets=4096, device="cpu"), device="cpu")
    db.add(keys=directory["keys"], values=directory["values"])
    return db


def folder_digests(path: Path) -> dict[str, str]:
    """The SHA-256 of every file under a (closed) database folder, by relative path."""
    return {
        str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.rglob("*"))
        if f.is_file()
    }


def top_ids(db: Database, queries: list[str], k: int = 5) -> list[list[int]]:
    return [[hit.id for hit in hits] for hits in db.search(queries, k=k)]


# the options of before issue 22 (no generated pairs, lr 1e-2 held constant): the task these tests were written for
RUN = {
    "targets": "key",
    "k": 8,
    "epochs": 2,
    "batch_size": 32,
    "lr": 1e-2,
    "lr_decay": "none",
    "generated": 0,
    "verbose": False,
}


# ----------------------------------------------------------------------------- bf16 against fp32


@pytest.mark.parametrize("loss", ["retrieval", "answer"])
def test_bf16_trains_under_autocast_and_tracks_fp32(directory, loss):
    runs = {}
    for precision in ("fp32", "bf16"):
        db = memory_db(directory)
        history = finetune(db, directory["train"], eval_pairs=directory["held"], loss=loss, precision=precision, **RUN)
        runs[precision] = (db, history)
    (db32, fp32), (db16, bf16) = runs["fp32"], runs["bf16"]
    # autocast lowered the linear layer in the training steps of the bf16 run only
    assert set(db16.query_encoder.dtypes) == {torch.float32, torch.bfloat16}  # evaluations: float32
    assert set(db32.query_encoder.dtypes) == {torch.float32}
    assert all(math.isfinite(x) for x in bf16.losses)
    assert bf16.epoch_losses == pytest.approx(fp32.epoch_losses, rel=0.05)
    for m16, m32 in zip(bf16.metrics, fp32.metrics, strict=True):
        assert {n: m16[n] for n in METRIC_NAMES} == pytest.approx({n: m32[n] for n in METRIC_NAMES}, abs=0.05)
    assert bf16.metrics[0] == fp32.metrics[0]  # the start is measured before any step, in float32 both times
    assert bf16.committed == fp32.committed == (loss == "retrieval")  # the answer loss moves no recall here
    if loss == "retrieval":
        assert bf16.metrics[-1]["recall@1"] > bf16.metrics[0]["recall@1"] + 0.05  # it learned, as fp32 did
        # the evaluations run in float32, as the database answers: the kept epoch's metrics are what it now gives
        kept = bf16.kept_epoch if bf16.kept_epoch is not None else -1
        assert evaluate(db16, directory["held"], k=8) == {n: bf16.metrics[kept][n] for n in METRIC_NAMES}
        assert {p.dtype for p in db16.query_encoder.parameters()} == {torch.float32}


def test_fp32_is_the_default_and_unchanged(directory):
    """precision="fp32" is the default, and gives bit for bit the run without the option."""
    assert FinetuneConfig().precision == "fp32"
    plain, explicit = memory_db(directory), memory_db(directory)
    a = finetune(plain, directory["train"][:64], eval_pairs=directory["held"][:40], loss="retrieval", **RUN)
    b = finetune(
        explicit, directory["train"][:64], eval_pairs=directory["held"][:40], loss="retrieval", precision="fp32", **RUN
    )
    assert a.losses == b.losses and a.metrics == b.metrics
    assert torch.bfloat16 not in explicit.query_encoder.dtypes


# ----------------------------------------------------------------------------- the guarantees under bf16


DIRECTION = F.normalize(torch.randn(32, generator=torch.Generator().manual_seed(0)), dim=0)


def collapse_loss(batch: Batch) -> torch.Tensor:
    """Pulls every query towards one fixed direction: every epoch makes retrieval worse."""
    assert batch.scores.dtype == batch.output.dtype == batch.weights.dtype == torch.float32  # the loss is float32
    return -(batch.queries @ DIRECTION).mean()  # ()


@pytest.mark.parametrize("train", ["query", "query+keys"])
def test_bf16_keeps_the_start_when_training_makes_things_worse(directory, tmp_path, train):
    path = tmp_path / "db"
    folder_db(path, directory).close()
    digests = folder_digests(path)
    db = Database(path)
    held = directory["held_edit"][:60]
    before = evaluate(db, held, k=8)
    generation, encoder = db.generation, db.encoder
    history = finetune(
        db, directory["train_edit"][:100], eval_pairs=held, loss=collapse_loss, train=train,
        precision="bf16", **{**RUN, "batch_size": 25, "lr": 0.05},
    )  # fmt: skip
    start = history.metrics[0]["recall@1"]
    assert start == before["recall@1"]
    assert all(m["recall@1"] < start for m in history.metrics[1:])  # every epoch was worse
    assert history.committed is False and history.kept_epoch == 0
    assert history.generation == db.generation == generation
    assert evaluate(db, held, k=8) == before  # bit for bit
    assert db.encoder is encoder and db.query_encoder is None
    assert db.encoders_info()["last_run"]["committed"] is False  # the attempt is recorded (kvsearch info shows it)
    db.close()
    changed = {name for name, digest in folder_digests(path).items() if digests.get(name) != digest}
    assert changed <= {"store.sqlite"} and folder_digests(path).keys() == digests.keys()  # its meta table only


@pytest.mark.parametrize("train", ["query", "query+keys"])
def test_a_bf16_commit_writes_float32_weights_that_reopen_to_the_same_answers(directory, tmp_path, train):
    path = tmp_path / "db"
    db = folder_db(path, directory)
    generation = db.generation
    held = directory["held"][:60]
    pairs = directory["train"][:128]
    history = finetune(db, pairs, eval_pairs=held, loss="retrieval", train=train, precision="bf16", **RUN)
    assert history.committed and history.generation == generation + 1
    trained = db.query_encoder if train == "query" else db.encoder
    assert {t.dtype for t in trained.state_dict().values() if t.is_floating_point()} == {torch.float32}
    assert db.encoders_info()["last_run"]["precision"] == "bf16"
    queries = [q for q, _ in held]
    ids, metrics = top_ids(db, queries), evaluate(db, held, k=8)
    db.close()
    reopened = Database(path)
    encoder = reopened.query_encoder if train == "query" else reopened.encoder
    assert {t.dtype for t in encoder.state_dict().values() if t.is_floating_point()} == {torch.float32}
    assert top_ids(reopened, queries) == ids and evaluate(reopened, held, k=8) == metrics
    reopened.close()


# ----------------------------------------------------------------------------- refusals


BAD_PRECISIONS = ["bf32", "BF16", "float16", "", None, 16, torch.bfloat16]


@pytest.mark.parametrize("precision", BAD_PRECISIONS, ids=repr)
def test_an_unknown_precision_is_refused_by_the_config(precision):
    with pytest.raises(UnknownOptionError, match=r"expected precision among \('fp32', 'bf16', 'fp16'\), got"):
        FinetuneConfig(precision=precision)


def test_an_unknown_precision_is_refused_before_anything_is_written(directory, tmp_path):
    path = tmp_path / "db"
    folder_db(path, directory).close()
    digests = folder_digests(path)
    db = Database(path)
    generation, ids = db.generation, top_ids(db, [q for q, _ in directory["held"][:10]])
    for precision in BAD_PRECISIONS:
        with pytest.raises(UnknownOptionError, match="precision"):
            finetune(db, directory["train"][:20], loss="retrieval", precision=precision, verbose=False)
    assert db.generation == generation and db.query_encoder is None
    assert top_ids(db, [q for q, _ in directory["held"][:10]]) == ids
    db.close()
    assert folder_digests(path) == digests


def test_fp16_on_the_cpu_is_refused_before_anything_is_written(directory, tmp_path):
    path = tmp_path / "db"
    folder_db(path, directory).close()
    digests = folder_digests(path)
    db = Database(path)
    with pytest.raises(NotSupportedError, match=r'precision="fp16" on a CUDA device.*got device cpu.*"bf16"'):
        finetune(db, directory["train"][:20], loss="retrieval", precision="fp16", verbose=False)
    assert db.query_encoder is None
    db.close()
    assert folder_digests(path) == digests


def test_the_cli_passes_precision_on(directory, tmp_path, capsys):
    path = tmp_path / "db"
    folder_db(path, directory).close()
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("query\ttarget\n" + "".join(f"{q}\t{t}\n" for q, t in directory["train"][:64]))
    argv = ["finetune", str(path), "--pairs", str(pairs), "--k", "8", "--epochs", "1", "--generated", "0", "--quiet"]
    assert main([*argv, "--precision", "fp16"]) == 1  # no CUDA here: refused on one line, nothing trained
    err = capsys.readouterr().err
    assert err.startswith("kvsearch finetune: error: ") and 'precision="fp16" on a CUDA device' in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as usage:
        main([*argv, "--precision", "half"])
    assert usage.value.code == 2
    capsys.readouterr()
    assert main([*argv, "--precision", "bf16"]) == 0
    with Database(path) as db:
        assert db.encoders_info()["last_run"]["precision"] == "bf16"


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_on_cuda_trains_and_tracks_fp32(directory, precision):
    """fp16 (with its gradient scaler) and bf16 on CUDA: finite, float32 weights, a history close to fp32's."""
    runs = {}
    for name in ("fp32", precision):
        db = memory_db(directory, device="cuda")
        history = finetune(
            db, directory["train"], eval_pairs=directory["held"], loss="retrieval", precision=name, **RUN
        )
        runs[name] = (db, history)
    (_, fp32), (db, low) = runs["fp32"], runs[precision]
    low_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert set(db.query_encoder.dtypes) == {torch.float32, low_dtype}
    assert all(math.isfinite(x) for x in low.losses)
    assert low.epoch_losses == pytest.approx(fp32.epoch_losses, rel=0.05)
    for a, b in zip(low.metrics, fp32.metrics, strict=True):
        assert {n: a[n] for n in METRIC_NAMES} == pytest.approx({n: b[n] for n in METRIC_NAMES}, abs=0.05)
    assert low.committed and low.metrics[-1]["recall@1"] > low.metrics[0]["recall@1"] + 0.05
    assert {(p.dtype, p.device.type) for p in db.query_encoder.parameters()} == {(torch.float32, "cuda")}


def test_the_fp16_optimizer_step_unscales_and_skips_an_overflowed_step():
    """The scaler path of a step, on the CPU (the fp16 runs themselves need CUDA): unscale, skip on Inf, shrink."""
    weight = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([weight], lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE)
    scaler.scale((weight * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()  # grad (1, 2, 3), scaled
    optimizer_step(opt, 1, 1, scaler)
    assert torch.equal(weight.detach(), torch.tensor([0.5, 0.0, -0.5]))  # the unscaled gradient was applied
    opt.zero_grad()
    scaler.scale((weight * torch.tensor([1.0, math.inf, 1.0])).sum()).backward()
    optimizer_step(opt, 2, 1, scaler)  # Inf in the gradients: the step is skipped, not a NonFiniteError
    assert torch.equal(weight.detach(), torch.tensor([0.5, 0.0, -0.5]))
    assert scaler.get_scale() == FP16_INIT_SCALE / 2
