"""What a fine-tuning run is asked to do and what it reports: :class:`FinetuneConfig` and :class:`History`.

    config = FinetuneConfig(loss="retrieval", k=32, epochs=3, keep="best")   # checked once, when made
    history = finetune(db, pairs, eval_pairs=held_out, config=config)
    history.kept_epoch, history.committed, history.summary()

Every option is checked here, with a typed error, before a run touches anything. This module knows nothing of
the database, the loop or the losses' internals.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal, get_args

import numpy as np
import torch

from kvsearch.checks import check_int, check_k, check_temperature
from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.nn.pooling import POOLINGS, PoolingName
from kvsearch.nn.scores import ScoreFn, check_score
from kvsearch.text.noise import DEFAULT_NOISE, Noise, check_noise
from kvsearch.training.losses import ANSWER_LOSSES, LossFn, LossName, get_loss
from kvsearch.training.metrics import METRICS, TARGET_KINDS, MetricName, TargetKind, higher_is_better
from kvsearch.training.precision import PRECISIONS, PrecisionName

__all__ = [
    "TrainMode",
    "TRAIN_MODES",
    "MAX_EPOCHS",
    "MAX_GENERATED",
    "LrDecay",
    "LR_DECAYS",
    "Negatives",
    "NEGATIVES",
    "KeepName",
    "KEEPS",
    "OPTIMIZERS",
    "OptimizerSpec",
    "FinetuneConfig",
    "History",
    "make_config",
]

TrainMode = Literal["query", "query+keys"]
#: What learns: a query-side encoder only, or the shared key encoder too (the index is then refreshed).
TRAIN_MODES: tuple[str, ...] = get_args(TrainMode)

Negatives = Literal["candidates", "in-batch", "both"]
#: What each training query is scored against: the index's candidates, the batch's targets, or both.
NEGATIVES: tuple[str, ...] = get_args(Negatives)

LrDecay = Literal["linear", "cosine", "none"]
#: How the learning rate goes over a run: down to 0 at the last step along a line or a half cosine, or constant.
LR_DECAYS: tuple[str, ...] = get_args(LrDecay)

KeepName = Literal["best", "last"]
#: Which epoch a run with eval pairs commits: the best one (if it beats the start), or the last one.
KEEPS: tuple[str, ...] = get_args(KeepName)

OptimizerSpec = str | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
#: The optimizers named by a string.
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd")
#: The most epochs one run may ask for: a bound, so that a hostile ``epochs=2**70`` is refused, not a run forever.
MAX_EPOCHS = 100_000
#: The most generated pairs one run may ask for (they are held in memory as text).
MAX_GENERATED = 10_000_000
# ----------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class FinetuneConfig:
    """Every option of :func:`finetune`, checked once, when it is made.

    Attributes:
        loss: ``"retrieval"`` (the default: cross-entropy over the candidates' scores, the target record forced
            among the candidates; for (query, key) pairs), ``"answer"`` (1 - cosine between the pooled answer
            and the target value's embedding; the gradient reaches the query only through the attention
            weights; for (query, value text) pairs), ``"answer_mse"``
            (mean squared error instead), or a callable ``(Batch) -> 0-dim tensor`` (see
            :mod:`kvsearch.training.losses`).
        targets: ``"key"`` (the target text is the right record's key) or ``"value"`` (the target text is
            the answer's value text, encoded with the value encoder); None follows the loss (see
            :attr:`target_kind`). Ignored for tensor pairs (values).
        k: candidates per query (the index's top k), in [1, MAX_K].
        epochs: passes over the training pairs, at most :data:`MAX_EPOCHS`.
        refresh_every: with ``train="query+keys"``, re-encode the keys and rebuild the index every this many
            steps when a step reads its candidates from the index (not with ``negatives="in-batch"``), and after
            each epoch, and at the end.
        train: ``"query"``: a query-side copy of the encoder learns (``db.query_encoder``; the stored keys
            and the index never change). ``"query+keys"``: the shared encoder learns, the index is refreshed;
            a value encoder that was the key encoder is kept, untrained, as the value encoder. None (the
            default): ``"query+keys"`` for an :class:`~kvsearch.NgramEncoder` or a
            :class:`~kvsearch.SentenceEncoder`, else ``"query"`` (see :mod:`kvsearch.training.defaults`).
        train_values: make the value embeddings trainable; they are written to the database at the end.
        score: the score function, default (None) the database's; an ``nn.Module`` (e.g.
            :class:`~kvsearch.nn.scores.GaussianKernel`) trains along: it ends with the kept epoch's weights,
            or its weights at the start when nothing is committed.
        pooling: the pooling of the answer (see ``kvsearch.nn.pooling.pool``); not ``"exact"``, which has no
            gradient.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` or a callable ``(param groups) -> Optimizer``.
        lr: the learning rate; default (None) per part: 3e-3 for n-gram encoders (1e-2 without generated
            pairs), 1e-4 for sentence encoders, 1e-2 for score modules and values
            (:data:`kvsearch.training.defaults.DEFAULT_LR`).
        lr_decay: ``"linear"`` (the default: the learning rate falls along a line to 0 at the last step),
            ``"cosine"`` (along a half cosine) or ``"none"`` (constant).
        warmup: the fraction of the run's steps, in [0, 1), over which the learning rate rises linearly from 0 to
            its peak before it decays; None (the default): 0.1 for a sentence encoder (the transformer's usual
            warm-up), else 0 (see :func:`kvsearch.training.defaults.auto_warmup`).
        negatives: what each training query's target competes with, for key targets: ``"candidates"`` (the index's
            top ``k``, the target forced in; with ``train="query+keys"`` all of them re-encoded with grad),
            ``"in-batch"`` (the other targets of the batch, as sentence-transformers'
            MultipleNegativesRankingLoss: no index search in the step) or ``"both"`` (the batch's targets, then the
            index's top ``k`` as hard negatives kept as the draft holds them, without grad; one scoring above
            :data:`~kvsearch.training.trainables.HARD_NEGATIVE_MARGIN` of the target's score is dropped as a likely
            false negative). None (the default):
            ``"candidates"`` for an :class:`~kvsearch.NgramEncoder`, tensor pairs, value targets and sharded
            databases, else what :func:`kvsearch.training.defaults.auto_negatives` says.
        pairs_from: train on pairs made from the records themselves, ``(a second text of the record, its key)``,
            mixed into the user's pairs (or alone): ``"value"`` (the value text) or ``"metadata.FIELD"`` (a string
            metadata field; a dot path names a nested one), for records that have that text; at most
            :data:`~kvsearch.training.pairs.MAX_RECORD_PAIRS`, a seeded sample (see
            :func:`kvsearch.training.pairs.record_pairs`). None (the default): none.
        batch_size: pairs per step; None (the default): 256 when generated pairs are mixed in, 32 for a sentence
            encoder, else 64 (few pairs need more steps; see :func:`kvsearch.training.defaults.auto_batch_size`).
        temperature: the softmax temperature of the scores, finite and > 0 (0.05 suits cosine scores).
        seed: seeds the shuffling and torch (dropout); an integer >= 0.
        verbose: show a tqdm bar with the step, the loss and the latest value of the metric.
        keep: which epoch is committed: ``"best"`` (the best by ``metric``, and only if it is strictly better than
            the start; otherwise nothing is committed) or ``"last"`` (the last epoch, even when it is worse than
            the start). ``"best"`` judges on the eval pairs, else on the monitor of held-out keys, else — nothing
            to hold out — on the training pairs themselves (``History.judged_on``); ``"last"`` without eval pairs
            or a monitor judges nothing.
        metric: what "best" means: ``"recall@1"``, ``"recall@k"`` or ``"mrr"`` on text eval pairs (higher is
            better), ``"loss"`` on tensor eval pairs (lower is better). None (the default): ``"recall@1"`` on
            text pairs, ``"loss"`` on tensor pairs.
        precision: ``"fp32"`` (the default: float32 throughout), ``"bf16"`` (the forward — encoders, attention —
            under ``torch.autocast`` with bfloat16, on the CPU or CUDA) or ``"fp16"`` (float16 autocast with a
            gradient scaler, CUDA only). The loss is computed in float32, the weights stay float32 (autocast does
            not change them), evaluations run in float32 (as the database answers after the commit), and what is
            committed is float32 as before (see :mod:`kvsearch.training.precision`).
        noise: the noise models of the pairs generated from the stored keys (see :mod:`kvsearch.text.noise`): a name
            among ``"typos"``, ``"phonetic"``, ``"case"``, ``"cyrillic"``, ``"greek"``, a callable
            ``(key, rng) -> str | None``, a sequence of them, or None (generate nothing).
        generated: how many ``(noisy key, key)`` pairs generated from the stored keys each epoch mixes into the
            user's pairs (fresh spellings each epoch; all the pairs without user pairs); ``"auto"`` (the default):
            2 per stored key, at most 50,000, for an NgramEncoder, else 0 (see
            :func:`kvsearch.training.defaults.auto_generated`). Keys the monitor measures are never drawn (see
            :mod:`kvsearch.training.pairs`).

    Raises:
        InvalidArgumentError: a value of the wrong type or out of range (``k=0``, ``epochs=True``,
            ``temperature=inf``, ``lr=-1``, ``seed="x"``, ...), the retrieval loss with value targets, or
            ``pooling="exact"``.
        UnknownOptionError: an unknown loss, targets, train mode, score, pooling, optimizer, keep, metric,
            precision or negatives name.
    """

    loss: LossName | LossFn = "retrieval"
    targets: TargetKind | None = None
    k: int = 32
    epochs: int = 3
    refresh_every: int = 200
    train: TrainMode | None = None
    train_values: bool = False
    score: str | ScoreFn | None = None
    pooling: PoolingName = "softmax"
    optimizer: OptimizerSpec = "adam"
    lr: float | None = None
    batch_size: int | None = None
    temperature: float = 0.05
    seed: int = 0
    verbose: bool = True
    keep: KeepName = "best"
    metric: MetricName | None = None
    precision: PrecisionName = "fp32"
    lr_decay: LrDecay = "linear"
    noise: Noise | None = DEFAULT_NOISE
    generated: int | Literal["auto"] = "auto"
    warmup: float | None = None
    negatives: Negatives | None = None
    pairs_from: str | None = None

    def __post_init__(self) -> None:
        get_loss(self.loss)  # UnknownOptionError unless a registered name or a callable
        if self.train is not None:
            _check_name(self.train, TRAIN_MODES, "train")
        if self.targets is not None:
            _check_name(self.targets, TARGET_KINDS, "targets")
        if self.loss == "retrieval" and self.targets == "value":
            raise InvalidArgumentError('the retrieval loss needs targets="key" (which record is right), got "value"')
        self._set("k", check_k(self.k))
        self._set("epochs", check_int(self.epochs, "epochs", high=MAX_EPOCHS))
        self._set("refresh_every", check_int(self.refresh_every, "refresh_every"))
        if self.batch_size is not None:
            self._set("batch_size", check_int(self.batch_size, "batch_size"))
        self._set("seed", check_int(self.seed, "seed", low=0, high=2**63 - 1))  # torch seeds are 64-bit
        self._set("temperature", check_temperature(self.temperature))
        if self.lr is not None:
            lr = self.lr
            if isinstance(lr, bool) or not isinstance(lr, Real) or not math.isfinite(lr) or lr <= 0:
                raise InvalidArgumentError(f"expected lr as a finite number > 0, or None, got {lr!r}")
            self._set("lr", float(lr))
        self._set("train_values", _check_flag(self.train_values, "train_values"))
        self._set("verbose", _check_flag(self.verbose, "verbose"))
        if self.score is not None:
            check_score(self.score)  # a name from SCORES (not "additive") or a callable
        _check_name(self.pooling, POOLINGS, "pooling")
        if self.pooling == "exact":
            usable = ", ".join(p for p in POOLINGS if p != "exact")
            raise InvalidArgumentError(
                f'expected a pooling with a gradient ({usable}), got "exact": a one-hot on the exact key match '
                "gives the query encoder no gradient to learn from"
            )
        if not callable(self.optimizer):
            _check_name(self.optimizer, OPTIMIZERS, "optimizer")
        _check_name(self.keep, KEEPS, "keep")
        if self.metric is not None:
            _check_name(self.metric, METRICS, "metric")
        _check_name(self.precision, PRECISIONS, "precision")
        _check_name(self.lr_decay, LR_DECAYS, "lr_decay")
        self._set("noise", check_noise(self.noise) or None)
        if self.warmup is not None:
            warmup = self.warmup
            if isinstance(warmup, bool) or not isinstance(warmup, Real) or not 0 <= warmup < 1:
                raise InvalidArgumentError(f"expected warmup as a fraction in [0, 1) or None, got {warmup!r}")
            self._set("warmup", float(warmup))
        if self.negatives is not None:
            _check_name(self.negatives, NEGATIVES, "negatives")
        if self.pairs_from is not None:
            source = self.pairs_from
            if not isinstance(source, str) or not (source == "value" or source.startswith("metadata.") and source[9:]):
                raise InvalidArgumentError(
                    f'expected pairs_from as "value", "metadata.FIELD" or None, got {source!r:.60}'
                )
        if isinstance(self.generated, str) and self.generated != "auto":
            raise InvalidArgumentError(f'expected generated as "auto" or an integer >= 0, got {self.generated!r}')
        if self.generated != "auto":
            self._set("generated", check_int(self.generated, "generated", low=0, high=MAX_GENERATED))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # a checked value in its canonical type (np.int64 -> int, ...)

    @property
    def target_kind(self) -> TargetKind:
        """``targets``, or its default for the loss: ``"value"`` for the answer losses, else ``"key"``."""
        if self.targets is not None:
            return self.targets
        return "value" if self.loss in ANSWER_LOSSES else "key"


def _check_name(value: object, valid: tuple[str, ...], what: str) -> None:
    if not isinstance(value, str) or value not in valid:
        raise UnknownOptionError(f"expected {what} among {valid}, got {value!r}")


def _check_flag(value: object, what: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise InvalidArgumentError(f"expected {what} as True or False, got {value!r}")
    return bool(value)


_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(FinetuneConfig))


def make_config(config: FinetuneConfig | None, options: dict[str, Any]) -> FinetuneConfig:
    """The run's options: ``config`` (or the defaults) with the keyword ``options`` over it."""
    if config is not None and not isinstance(config, FinetuneConfig):
        raise InvalidArgumentError(f"expected config as a FinetuneConfig or None, got {type(config).__name__}")
    unknown = [name for name in options if name not in _OPTION_NAMES]
    if unknown:
        raise InvalidArgumentError(
            f"expected finetune options among {_OPTION_NAMES}, got unknown option(s) {', '.join(unknown)}"
        )
    return FinetuneConfig(**options) if config is None else dataclasses.replace(config, **options)


# ----------------------------------------------------------------------------- what a run reports


@dataclass
class History:
    """What :func:`finetune` measured, and what it committed.

    Attributes:
        k: the number of candidates (``recall@k`` is recall at this k).
        metrics: one dict per evaluation (epoch 0 = before training, then after each epoch; judged on the training
            pairs, after the last epoch only: see :attr:`judged_on`), with ``epoch``,
            ``step`` and, on text pairs, ``recall@1``, ``recall@k``, ``mrr`` (over the top k), or on tensor pairs
            ``loss`` (the training loss on the eval pairs); measured on what ``judged_on`` names. Empty when
            nothing was judged.
        losses: the training loss of every step.
        epoch_losses: the mean training loss of every epoch.
        refreshes: how many times the draft's working keys and index were rebuilt from re-encoded keys.
        seconds: the wall time of the run.
        metric: the metric that chose the epoch to keep (``"recall@1"``, ``"recall@k"``, ``"mrr"`` or ``"loss"``).
        keep: ``"best"`` or ``"last"``.
        kept_epoch: the epoch committed; 0 when no epoch beat the start (nothing was committed); None when
            nothing was judged (``keep="last"`` without eval pairs or a monitor: the last epoch was committed).
        committed: whether a new generation was committed.
        generation: the database's generation after the run (unchanged when nothing was committed).
        generated: how many training pairs were generated from the stored keys (see ``FinetuneConfig.generated``).
        monitor: how many eval pairs were split off as the monitor (0 when eval pairs were given).
        judged_on: what the epochs were judged on: ``"eval_pairs"`` (the user's), ``"monitor"`` (held-out keys),
            ``"train_pairs"`` (nothing to hold out: the training pairs themselves — the user's, or without them
            the first epoch's generated ones; what is committed is never worse on them, but they cannot show
            whether the run learned more than them, nor which epoch generalizes best, so only the start and the
            last epoch are measured: the last is committed if it beats the start) or ``"nothing"``
            (``keep="last"`` without eval pairs or a monitor).
        judged: how many pairs the epochs were judged on (0: nothing; this rank's, when several ranks run).
    """

    k: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    refreshes: int = 0
    seconds: float = 0.0
    metric: str = "recall@1"
    keep: str = "best"
    kept_epoch: int | None = None
    committed: bool = False
    generation: int = 0
    generated: int = 0
    monitor: int = 0
    judged_on: str = "nothing"
    judged: int = 0

    def value(self, epoch: int) -> float | None:
        """The metric measured after ``epoch`` (0: before training), or None when that epoch was not judged."""
        for measured in self.metrics:
            if measured["epoch"] == epoch:
                return measured.get(self.metric)
        return None

    def best_epoch(self) -> int | None:
        """The judged epoch >= 1 with the best metric (the first of equals), or None: nothing judged, or no epoch
        ran."""
        judged = [m for m in self.metrics if m["epoch"] >= 1]
        if not judged:
            return None
        sign = 1.0 if higher_is_better(self.metric) else -1.0
        return int(max(judged, key=lambda m: (sign * m[self.metric], -m["epoch"]))["epoch"])

    def summary(self) -> str:
        """One human line: the metric before, the epoch kept, and the generation.

        Returns:
            e.g. ``"recall@1 0.754 -> best 0.761 at epoch 2 (kept, generation 5)"`` or ``"recall@1 0.754; no
            epoch beat it (best 0.612 at epoch 1): kept the start, generation 4 unchanged"``; judged on the
            training pairs, it ends ``"; judged on its 4 training pairs (no eval_pairs, nothing held out)"``.
        """
        line = self._outcome()
        if self.judged_on == "train_pairs":
            pairs = f"{self.judged} training pair{'' if self.judged == 1 else 's'}"
            line += f"; judged on its {pairs} (no eval_pairs, nothing held out)"
        return line

    def _outcome(self) -> str:
        """The summary's line without what the run was judged on."""
        start = self.value(0)
        if start is None:  # nothing judged (keep="last" without eval pairs or monitor): the last epoch
            losses = self.epoch_losses
            trend = f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no step"
            done = f"generation {self.generation}" if self.committed else f"generation {self.generation} unchanged"
            epochs = f"{len(losses)} epoch{'' if len(losses) == 1 else 's'}"
            return f"{epochs}, {trend} (last epoch kept, {done})"
        head = f"{self.metric} {start:.3f}"
        best = self.best_epoch()
        if not self.committed:
            if best is None:
                return f"{head}; no epoch ran: kept the start, generation {self.generation} unchanged"
            return (
                f"{head}; no epoch beat it (best {self.value(best):.3f} at epoch {best}): "
                f"kept the start, generation {self.generation} unchanged"
            )
        kept = self.kept_epoch if self.kept_epoch is not None else int(self.metrics[-1]["epoch"])
        after = self.value(kept)
        if self.keep == "best":
            return f"{head} -> best {after:.3f} at epoch {kept} (kept, generation {self.generation})"
        return f"{head} -> {after:.3f} at epoch {kept} (last epoch kept, generation {self.generation})"
