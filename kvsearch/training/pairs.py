"""What a fine-tuning run trains and monitors on: the user's pairs, pairs generated from the stored keys, the split.

    plan = plan_pairs(db, train_pairs, eval_pairs, noise=("typos", "phonetic"), generated=20_000, seed=0)
    plan.train     # the user's pairs + (noisy key, key) pairs generated from the stored keys (kvsearch.text.noise)
    plan.eval      # the user's eval pairs, or generated pairs of held-out keys (the keep-best monitor)
    plan.judged_on # "eval_pairs", "monitor", "train_pairs" (nothing to hold out: the training pairs) or "nothing"

The stored keys are training data: a key written wrong (by a noise model of :mod:`kvsearch.text.noise`) paired with the
key. Keys that the monitor measures are never trained on, so keep-best compares epochs on keys the run has not seen:
the user's eval pairs' target keys or, without eval pairs, keys split off by a seeded draw — a share
(:data:`MONITOR_SHARE`, at most :data:`MONITOR_KEYS`) of the keys the user's pairs name, whose pairs move from
training to the monitor, and as many of the other keys, judged on generated queries. Keys given as embeddings (no
text) are not drawn from.

Nothing to hold out. Without eval pairs and without held-out keys (no pairs are generated — ``generated=0``, a
sentence encoder's default, tensor or value pairs — or too few keys and pairs for a share of them to be one), a run
with ``keep="best"`` is judged on its training pairs themselves (:func:`judge_on_training`): the user's, or without
them the first epoch's generated ones. The start is measured on them too, so the run is committed only if it does
strictly better on them than the database did: a run never leaves the database worse on what it was judged on,
though pairs it trained on cannot tell whether it learned more than those pairs, nor which epoch generalizes best
(the loop measures the start and the last epoch only: :meth:`kvsearch.training.run.Plan.judges`). ``keep="last"``
judges nothing.

This module knows nothing of the loop, the losses or the index: it reads key texts through the facade.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from kvsearch.errors import InvalidArgumentError, NotSupportedError
from kvsearch.text.noise import Noise, check_noise, generate_pairs
from kvsearch.training.config import FinetuneConfig
from kvsearch.training.defaults import auto_generated
from kvsearch.training.metrics import Pairs, check_pairs, check_targets, is_tensor_pairs

__all__ = [
    "MAX_JUDGED",
    "MAX_RECORD_PAIRS",
    "MONITOR_KEYS",
    "MONITOR_SHARE",
    "JudgedOn",
    "PairPlan",
    "judge_on_training",
    "plan_pairs",
    "plan_run",
    "record_pairs",
]

#: What a run's epochs are judged on: the user's eval pairs, the held-out monitor, the training pairs themselves
#: (nothing to hold out), or nothing (``keep="last"`` without eval pairs or a monitor).
JudgedOn = Literal["eval_pairs", "monitor", "train_pairs", "nothing"]

#: Without eval pairs, at most this many keys are held out for the keep-best monitor (of the keys the user's pairs
#: name, and as many of the other stored keys),
MONITOR_KEYS = 500
#: ... and at most this share of them (so that a small database or a few pairs keep most of their keys to train on).
MONITOR_SHARE = 0.1
#: With nothing held out, a run is judged on at most this many of its training pairs (:func:`judge_on_training`).
MAX_JUDGED = 500
#: ``pairs_from`` makes pairs of at most this many records (a seeded sample of a bigger database).
MAX_RECORD_PAIRS = 50_000
#: The most pairs one run draws (over all its epochs; later epochs wrap around to the first ones).
MAX_DRAWN = 1_000_000


@dataclass(frozen=True)
class PairPlan:
    """The pairs of a run.

    Attributes:
        train: the training pairs: the user's, then the generated ones of every epoch (or the user's tensor pair).
        eval: the monitor's pairs: the user's eval pairs, generated pairs of held-out keys, or None.
        user: how many of ``train`` are the user's (the first ones).
        generated: how many generated pairs each epoch trains on (fresh spellings each epoch while there are).
        monitor: how many pairs the split-off monitor ``eval`` holds (the user's pairs of held-out keys and generated
            queries of held-out keys; 0 when the user gave eval pairs).
        judged_on: what ``eval`` is (:data:`JudgedOn`): ``"eval_pairs"``, ``"monitor"``, ``"train_pairs"`` (some
            of ``train``, see :func:`judge_on_training`) or ``"nothing"`` (``eval`` is None).
    """

    train: Any
    eval: Any
    user: int
    generated: int
    monitor: int
    judged_on: JudgedOn

    @property
    def judged(self) -> int:
        """How many pairs the run is judged on (0: nothing)."""
        if self.eval is None:
            return 0
        return len(self.eval[0]) if is_tensor_pairs(self.eval) else len(self.eval)

    @property
    def per_epoch(self) -> int:
        """How many pairs each epoch trains on: every user pair and ``generated`` generated ones."""
        return self.user + self.generated

    def rows(self, epoch: int) -> Tensor:
        """The rows of ``train`` that epoch ``epoch`` (1, 2, ...) trains on. Returns (per_epoch,) int64.

        Epoch e takes the e-th slice of ``generated`` generated pairs, wrapping around to the first ones when the
        keys gave fewer spellings than the epochs ask for.
        """
        user = torch.arange(self.user)  # (user,)
        made = len(self.train) - self.user
        if not self.generated or not made:
            return user
        start = (epoch - 1) * self.generated
        return torch.cat([user, self.user + (start + torch.arange(self.generated)) % made])  # (per_epoch,)


def plan_pairs(
    db: Any,
    train_pairs: Pairs | None,
    eval_pairs: Pairs | None,
    *,
    noise: Noise | None,
    generated: int,
    epochs: int,
    seed: int,
    key_targets: bool,
) -> PairPlan:
    """The training and monitor pairs of a run: the user's, with generated ones mixed in.

    Args:
        db: the database (its key texts are read when pairs are generated).
        train_pairs: the user's training pairs, or None (generated pairs only).
        eval_pairs: the user's eval pairs, or None (then, when pairs are generated, generated pairs of held-out
            keys monitor the run).
        noise: the noise models (see :func:`kvsearch.text.noise.check_noise`).
        generated: how many generated pairs each epoch mixes in (0: none).
        epochs: the run's epochs (each gets fresh spellings: ``generated * epochs`` are drawn).
        seed: the seed of the generation and of the held-out draw.
        key_targets: whether the targets are keys (generated pairs name keys; with value targets none are made).

    Returns:
        A :class:`PairPlan`.

    Raises:
        InvalidArgumentError: no training pairs and nothing to generate (``generated=0``, no noise model, no key
            text stored, or value targets).
        NotSupportedError: pairs to generate on a sharded database.
    """
    models = check_noise(noise)
    tensors = train_pairs is not None and is_tensor_pairs(train_pairs)
    if not generated or not models or tensors or not key_targets:
        if train_pairs is None:
            raise InvalidArgumentError(
                "expected train_pairs, or pairs generated from the stored keys (a noise model and generated > 0, "
                f"key targets), got none (noise={noise!r:.60}, generated={generated}, "
                f"targets={'key' if key_targets else 'value'})"
            )
        user = len(train_pairs[0]) if tensors else len(train_pairs)  # type: ignore[arg-type]
        judged: JudgedOn = "nothing" if eval_pairs is None else "eval_pairs"
        return PairPlan(train=train_pairs, eval=eval_pairs, user=user, generated=0, monitor=0, judged_on=judged)
    if not hasattr(db, "ids"):
        raise NotSupportedError(
            f"generating training pairs from the keys of a {type(db).__name__} is not supported yet; pass "
            "generated=0 and your own pairs"
        )
    keys = [text for text in db.key_texts(db.ids(), encoded_only=True) if text is not None]
    user = list(train_pairs or ())
    held: list[str] = []
    held_user: list[tuple[str, str]] = []
    if eval_pairs is not None:
        # the monitor's keys are not trained on
        reserved = set() if is_tensor_pairs(eval_pairs) else {target for _, target in eval_pairs}
    else:
        draw = random.Random(f"{seed}:monitor")
        targeted = list(dict.fromkeys(target for _, target in user))
        out = set(draw.sample(targeted, min(MONITOR_KEYS, int(len(targeted) * MONITOR_SHARE))))
        held_user = [pair for pair in user if pair[1] in out]  # the user's pairs of held-out keys judge the run
        user = [pair for pair in user if pair[1] not in out]
        free = [key for key in keys if key not in targeted]
        held = draw.sample(free, min(MONITOR_KEYS, int(len(keys) * MONITOR_SHARE), len(free)))
        reserved = out | set(held)
    stored = set(keys)
    pool = [key for key in keys if key not in reserved]
    made = generate_pairs(pool, models, count=min(generated * epochs, MAX_DRAWN), seed=seed, avoid=stored)
    monitor = held_user + generate_pairs(held, models, seed=seed + 1, avoid=stored)
    if not user and not made:
        raise InvalidArgumentError(
            f"expected training pairs: no noise model gave a wrong spelling of the {len(pool)} stored keys it could "
            "draw from; pass your own pairs"
        )
    train: Sequence[tuple[str, str]] = user + made
    per_epoch = min(generated, len(made))
    judged = "monitor" if monitor else "nothing" if eval_pairs is None else "eval_pairs"
    return PairPlan(
        train=train,
        eval=monitor or eval_pairs,
        user=len(user),
        generated=per_epoch,
        monitor=len(monitor),
        judged_on=judged,
    )


def judge_on_training(plan: PairPlan, seed: int = 0) -> PairPlan:
    """The plan judged on its training pairs, for a run with nothing held out (``plan.eval`` is None).

    The judged pairs are the user's training pairs, or, when the user gave none, the first epoch's generated pairs;
    at most :data:`MAX_JUDGED` of them (a seeded sample, in their order, as many as the monitor of held-out keys
    holds), so that judging costs a few hundred queries per epoch whatever the run trains on. keep-best measures the
    start on them too, so what it commits is never worse on them.

    Args:
        plan: a plan without eval pairs or monitor.
        seed: the run's seed (which pairs the sample takes).

    Returns:
        The plan with ``eval`` the judged pairs and ``judged_on="train_pairs"``.
    """
    tensors = is_tensor_pairs(plan.train)
    rows = torch.arange(len(plan.train[0])) if tensors else plan.rows(1) if not plan.user else torch.arange(plan.user)
    if len(rows) > MAX_JUDGED:
        picked = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:MAX_JUDGED]
        rows = rows[picked.sort().values]  # (MAX_JUDGED,)
    if tensors:
        judged: Any = (plan.train[0][rows], plan.train[1][rows])
    else:
        judged = [plan.train[i] for i in rows.tolist()]
    return dataclasses.replace(plan, eval=judged, judged_on="train_pairs")


def record_pairs(db: Any, source: str, seed: int = 0) -> list[tuple[str, str]]:
    """Pairs made from the records themselves: ``(the record's text named by source, its key)``.

    Args:
        db: a plain database (its ids, key texts, value texts, metadata are read through the facade).
        source: ``"value"`` (the value text) or ``"metadata.FIELD"`` (a string field of the metadata; dots name a
            nested field).
        seed: which records a database with more than :data:`MAX_RECORD_PAIRS` takes (a seeded sample).

    Returns:
        The pairs, in id order, of the records with a key text (not a key given as an embedding) and a non-empty
        string at ``source`` that differs from the key.

    Raises:
        NotSupportedError: a sharded database.
        InvalidArgumentError: no record has such a text.
    """
    if not hasattr(db, "ids"):
        raise NotSupportedError(f"pairs_from on a {type(db).__name__} is not supported yet; pass your own pairs")
    ids = db.ids()  # (m,)
    if len(ids) > MAX_RECORD_PAIRS:
        picked = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))[:MAX_RECORD_PAIRS]
        ids = ids[picked.sort().values]  # (MAX_RECORD_PAIRS,)
    keys = db.key_texts(ids, encoded_only=True)
    if source == "value":
        found = db.value_texts(ids)
        texts = [found.get(i) for i in ids.tolist()]
    else:
        path = source[len("metadata.") :].split(".")
        metadata = db.metadata_of(ids)
        texts = [_field(metadata.get(i, {}), path) for i in ids.tolist()]
    pairs = [(text, key) for key, text in zip(keys, texts) if key is not None and isinstance(text, str)]
    pairs = [(text, key) for text, key in pairs if text.strip() and text != key]
    if not pairs:
        raise InvalidArgumentError(
            f"expected records with a key text and a text at pairs_from={source!r} to train on, got none of "
            f"{len(ids)} records"
        )
    return pairs


def _field(metadata: Any, path: list[str]) -> Any:
    """The value at a dot path of a metadata dict, None where a step is missing."""
    for name in path:
        if not isinstance(metadata, dict) or name not in metadata:
            return None
        metadata = metadata[name]
    return metadata


def plan_run(db: Any, train_pairs: Pairs | None, eval_pairs: Pairs | None, config: FinetuneConfig) -> PairPlan:
    """The pairs of a :func:`~kvsearch.finetune` run: its pairs checked, ``generated="auto"`` resolved, planned.

    Returns:
        The :class:`PairPlan`; with ``keep="best"`` and nothing held out (no eval pairs, no monitor), judged on its
        training pairs (:func:`judge_on_training`).

    Raises:
        InvalidArgumentError: bad pairs; see :func:`plan_pairs` for the rest.
        UnknownTargetError: user targets that match no stored record (counted among the user's pairs, their
            positions those of ``train_pairs``, before any pair is generated).
    """
    if train_pairs is not None:
        check_pairs(train_pairs, "train_pairs", db)
    if config.pairs_from is not None:
        if train_pairs is not None and is_tensor_pairs(train_pairs):
            raise InvalidArgumentError("pairs_from makes (text, key) pairs: it cannot join tensor train_pairs")
        if config.target_kind != "key":
            raise InvalidArgumentError(f"pairs_from makes (text, key) pairs for key targets, got {config.target_kind}")
        train_pairs = list(train_pairs or ()) + record_pairs(db, config.pairs_from, config.seed)
    if eval_pairs is not None:
        check_pairs(eval_pairs, "eval_pairs", db)
    generated = auto_generated(db, train_pairs) if config.generated == "auto" else config.generated
    key_targets = config.target_kind == "key"
    if generated and train_pairs is not None and not is_tensor_pairs(train_pairs):
        check_targets(db, [t for _, t in train_pairs], config.target_kind, "train_pairs")  # errors count the user's
    plan = plan_pairs(
        db,
        train_pairs,
        eval_pairs,
        noise=config.noise,
        generated=generated,
        epochs=config.epochs,
        seed=config.seed,
        key_targets=key_targets,
    )
    if plan.eval is None and config.keep == "best":
        return judge_on_training(plan, config.seed)  # nothing held out: judged on what it trains on, never unjudged
    return plan
