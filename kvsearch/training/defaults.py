"""The defaults of :func:`kvsearch.finetune` that depend on the database: chosen by a study, not by guess.

``benchmarks/bench_finetune.py --study`` fine-tunes a database of surnames (the default :class:`~kvsearch.NgramEncoder`)
on typo, phonetic and transliteration queries with 0, 500, 2,000 and 10,000 user pairs, changing one option at a time
around these defaults; its table is in ``benchmarks/RESULTS.md``. What it found for the n-gram encoder:

- pairs generated from the stored keys (:mod:`kvsearch.text.noise`) are what makes a run pay with little data: with
  2,000 user pairs alone the best options gained a few points, with generated pairs mixed in many more;
- the shared encoder must learn (``train="query+keys"``): a query-side copy alone drifts away from the keys;
- with generated pairs, batches of 256 at a learning rate of 3e-3 (Adam) learn as much as batches of 64 in a
  quarter of the steps; with the user's pairs alone (a few hundred: ``generated=0``, a sentence encoder, a sharded
  database), batches of 64 at 1e-2 (this issue's defaults before it) keep enough steps and step size: with 500
  Cyrillic pairs, 68 % held-out recall@1 against 21 % at 3e-3 and 6 % in batches of 256.

``benchmarks/bench_semantic.py`` fine-tunes ``SentenceEncoder()`` (all-MiniLM-L6-v2) on three semantic tasks
(dictionary definitions -> the word, stdlib docstrings -> the function, Debian package descriptions -> the package)
beside sentence-transformers' own trainer on the same pairs; its tables are in ``benchmarks/RESULTS.md``. What it
found for sentence encoders, which these defaults follow (:data:`SENTENCE_NEGATIVES`, :data:`SENTENCE_BATCH`,
:data:`SENTENCE_WARMUP`, ``DEFAULT_LR["sentence"]``):

- the shared encoder learns (``train="query+keys"``), as the peer's trainer does: a query-side copy alone, even with
  the whole database as negatives, gained less on held-out targets;
- the batch's other targets are the negatives (``negatives="in-batch"``, MultipleNegativesRankingLoss): re-encoding
  ``k`` candidates per query with grad through a transformer costs ``k`` times the step; the index's candidates as
  detached hard negatives (``"both"``) raised acc@1 and MRR a little on some tasks and lowered acc@10 on others;
- batches of 32 with a 10 % warm-up at 1e-4 (twice the peer's 5e-5: kvsearch's three epochs at 5e-5 learned less per
  epoch), three epochs, the best judged epoch kept;
- no generated pairs (the noise models write keys wrong letter by letter: not what a semantic query is).

This module knows nothing of the loop: it maps a database (its key encoder) to option values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from kvsearch.encoders.ngram import NgramEncoder
from kvsearch.encoders.sentence import SentenceEncoder
from kvsearch.training.config import FinetuneConfig
from kvsearch.training.metrics import Pairs, is_tensor_pairs

__all__ = [
    "AUTO_PER_KEY",
    "AUTO_GENERATED",
    "DEFAULT_LR",
    "SENTENCE_BATCH",
    "SENTENCE_NEGATIVES",
    "SENTENCE_WARMUP",
    "auto_batch_size",
    "auto_generated",
    "auto_negatives",
    "auto_warmup",
    "auto_train",
    "default_lr",
    "lr_schedule",
    "resolve_defaults",
]

#: ``generated="auto"`` on a database whose key encoder is an NgramEncoder: this many generated pairs per stored key,
AUTO_PER_KEY = 2
#: and at most this many in all.
AUTO_GENERATED = 50_000
#: ``warmup=None`` with a sentence encoder: this fraction of the steps warms up (sentence-transformers' docs' 10 %).
SENTENCE_WARMUP = 0.1
#: ``batch_size=None`` with a sentence encoder.
SENTENCE_BATCH = 32
#: ``negatives=None`` with a sentence encoder (key targets, a plain database).
SENTENCE_NEGATIVES = "in-batch"
#: The learning rate of a parameter group when ``lr`` is None, by the kind of module it belongs to.
DEFAULT_LR: dict[str, float] = {"ngram": 3e-3, "ngram_alone": 1e-2, "sentence": 1e-4, "other": 1e-2}


def _lexical(db: Any) -> bool:
    return isinstance(getattr(db, "encoder", None), NgramEncoder)


def auto_generated(db: Any, train_pairs: Pairs | None) -> int:
    """How many pairs ``generated="auto"`` generates for this database.

    :data:`AUTO_PER_KEY` per stored key, at most :data:`AUTO_GENERATED`, when the key encoder is an
    :class:`~kvsearch.NgramEncoder` (the lexical lookups the study measured), the pairs are text and the database is
    a plain one; 0 otherwise — a sentence encoder (keys searched by meaning; slow to train), tensor pairs, or a
    sharded database.

    Args:
        db: the database.
        train_pairs: the user's pairs, or None.

    Returns:
        A count >= 0.
    """
    if not hasattr(db, "ids") or not _lexical(db):
        return 0
    if train_pairs is not None and is_tensor_pairs(train_pairs):
        return 0
    return min(AUTO_GENERATED, AUTO_PER_KEY * len(db))


def resolve_defaults(config: FinetuneConfig, db: Any, generated: int, key_pairs: bool, solo: bool) -> FinetuneConfig:
    """``config`` with its database-dependent defaults filled in: ``train=None`` by :func:`auto_train`,
    ``batch_size=None`` by :func:`auto_batch_size` (``generated``: the run's generated pairs per epoch),
    ``warmup=None`` by :func:`auto_warmup`, ``negatives=None`` by :func:`auto_negatives` (``key_pairs``: text pairs
    with key targets; ``solo``: a plain database, not a sharded one)."""
    train = auto_train(db) if config.train is None else config.train
    batch_size = auto_batch_size(generated, db) if config.batch_size is None else config.batch_size
    warmup = auto_warmup(db) if config.warmup is None else config.warmup
    negatives = auto_negatives(db, key_pairs, solo) if config.negatives is None else config.negatives
    return dataclasses.replace(config, train=train, batch_size=batch_size, warmup=warmup, negatives=negatives)


def _semantic(db: Any) -> bool:
    return isinstance(getattr(db, "encoder", None), SentenceEncoder)


def auto_warmup(db: Any) -> float:
    """What ``warmup=None`` is: :data:`SENTENCE_WARMUP` of the steps for a sentence encoder, else 0."""
    return SENTENCE_WARMUP if _semantic(db) else 0.0


def auto_negatives(db: Any, key_pairs: bool, solo: bool) -> str:
    """What ``negatives=None`` is: :data:`SENTENCE_NEGATIVES` for a plain database with a sentence encoder trained on
    text pairs with key targets, else ``"candidates"`` (the only kind tensor pairs, value targets and sharded
    databases take; what the n-gram study measured)."""
    return SENTENCE_NEGATIVES if _semantic(db) and key_pairs and solo else "candidates"


def auto_batch_size(generated: int, db: Any = None) -> int:
    """What ``batch_size=None`` is: 256 when a run mixes in ``generated`` > 0 generated pairs per epoch (tens of
    thousands: big batches learn as much in fewer, cheaper steps), :data:`SENTENCE_BATCH` for a sentence encoder
    (sentence-transformers' docs' batch: the in-batch negatives and the steps of a few thousand pairs), else 64 (the
    user's pairs alone, often a few hundred: a batch of 256 would leave a handful of steps)."""
    if generated:
        return 256
    return SENTENCE_BATCH if _semantic(db) else 64


def auto_train(db: Any) -> str:
    """What ``train=None`` trains: ``"query+keys"`` (the shared encoder, the index refreshed) for an NgramEncoder or a
    SentenceEncoder key encoder, else ``"query"`` (a query-side copy)."""
    return "query+keys" if _lexical(db) or _semantic(db) else "query"


def default_lr(module: nn.Module, generated: int) -> float:
    """The learning rate of a module's parameters when ``lr`` is None (see :data:`DEFAULT_LR`).

    An n-gram table learns at 3e-3 beside ``generated`` > 0 generated pairs per epoch, at 1e-2 (``"ngram_alone"``)
    from the user's pairs alone: few pairs in few steps must move new n-grams (a Cyrillic spelling's) far.
    """
    if isinstance(module, NgramEncoder):
        return DEFAULT_LR["ngram" if generated else "ngram_alone"]
    if isinstance(module, SentenceEncoder):
        return DEFAULT_LR["sentence"]
    return DEFAULT_LR["other"]


def lr_schedule(
    optimizer: torch.optim.Optimizer, decay: str, steps: int, warmup: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate over a run: up from 0 along a line over the first ``warmup`` of the steps, then constant
    (``"none"``) or decayed to 0 at the last step (``"linear"``, ``"cosine"``), as a torch scheduler to ``step()``
    after each optimizer step (as transformers' ``get_linear_schedule_with_warmup``).

    Args:
        optimizer: the run's optimizer (its groups' learning rates are the peaks).
        decay: ``"none"``, ``"linear"`` or ``"cosine"``.
        steps: the run's number of steps (epochs x steps per epoch).
        warmup: the fraction of the steps that warm up, in [0, 1).

    Returns:
        A ``LambdaLR`` over ``optimizer``.
    """
    total = max(steps, 1)
    warm = int(warmup * total)
    span = max(total - warm, 1)

    def factor(step: int) -> float:
        if step < warm:
            return step / warm
        done = min(step - warm, span) / span  # the part of the decay behind us, in [0, 1]
        if decay == "linear":
            return max(0.0, 1.0 - done)
        if decay == "cosine":
            return 0.5 * (1 + math.cos(math.pi * done))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
