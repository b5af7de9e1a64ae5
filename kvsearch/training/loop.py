"""End-to-end fine-tuning of the retriever: the loop, its options, the draft generation it works in.

    history = finetune(db, train_pairs, eval_pairs=eval_pairs, loss="retrieval", k=32, epochs=3)
    history.metrics[-1]        # {"epoch": 3, "step": ..., "recall@1": ..., "recall@k": ..., "mrr": ...}
    history.summary()          # "recall@1 0.754 -> best 0.761 at epoch 2 (kept, generation 5)"
    db.search("Smyth")         # now answered with the kept encoders, committed as the database's new generation

    config = FinetuneConfig(loss="retrieval", k=32, epochs=3)   # the same options, as one checked value
    history = finetune(db, train_pairs, config=config, seed=1)  # keyword options override the config's

One step: the query texts go through the (trainable) query encoder with grad; the index picks ``k``
candidates for the detached queries (``Database.candidates``; for the retrieval loss the target record is
forced in when the index missed it, RAG/REALM style); ``attend`` scores and pools them in torch; the loss
(:mod:`kvsearch.training.losses`) is taken on the scores or on the pooled answer, and the gradient flows back into the
query encoder (and, with ``train="query+keys"``, through the re-encoded candidate keys into the key encoder;
with ``train_values=True`` into the value embeddings).

All or nothing. A run works inside a draft generation (``db.begin_generation()``): refreshes re-encode the
keys into the draft's working key table and index (memory only), candidates and evaluations search the draft,
and the database changes in exactly one place, ``draft.commit``, which writes the kept encoders (and trained
values) as a new generation in one store transaction. Anything that goes wrong — a non-finite loss, query or
weight (:class:`~kvsearch.errors.NonFiniteError`), an exception in a loss, a KeyboardInterrupt — discards the
draft: the database's files, embeddings, index and answers are exactly as before, and the error is re-raised.

Keep the best. With ``keep="best"`` (the default), the metric (``metric=``) is measured before training and after
each epoch; the best epoch's weights are kept in memory and committed at the end — only if that epoch is strictly
better than the start. If no epoch beats it, the draft is discarded and the database keeps its retriever. The
metric is measured on the eval pairs, else on the monitor of held-out keys (:mod:`kvsearch.training.pairs`), else —
nothing to hold out: no pairs generated, or too few pairs and keys — on the training pairs themselves
(``History.judged_on == "train_pairs"``, which the summary says), after the start and the last epoch only (they
cannot rank the epochs between, and each measure costs a refresh of every key): never is a run committed that was
not judged.
``keep="last"`` commits the last epoch, even when it is worse (judging nothing without eval pairs or a monitor).

Targets. A pair is ``(query text, target text)``; ``targets="key"`` reads the target as the key of the right
record, ``targets="value"`` as the value text of the answer (no label of which record is right: several
records may share it). The default follows the loss: ``"key"`` for ``"retrieval"``, ``"value"`` for the
answer losses. ``train_pairs`` may also be ``(queries, values)``, two tensors (n, dim) and (n, value_dim), for
databases without text (kernel regression, see :class:`~kvsearch.nn.scores.GaussianKernel`). Target texts
that match nothing (no stored key, no stored value text) are refused before any step; the message says when
the other ``targets=`` would match them.

Pairs. The stored keys written wrong (:mod:`kvsearch.text.noise`) are mixed into the user's pairs, fresh ones each
epoch, or trained on alone; the monitor's keys are never trained on (:mod:`kvsearch.training.pairs`).

Precision. ``precision="bf16"`` runs each step's forward (the encoders, the attention) under ``torch.autocast``
with bfloat16 (CPU or CUDA), ``"fp16"`` under float16 with a gradient scaler (CUDA only); the loss is taken in
float32, evaluations run in float32, the weights stay float32, and the guarantees above hold unchanged
(:mod:`kvsearch.training.precision`).

The loop. ``finetune`` is a loop over named steps (:mod:`kvsearch.training.run`): plan (the options, the pairs and
their targets checked against the store, all before anything begins), then, in the draft, for each epoch the train
steps and a refresh, an evaluation and keep-best, and at the end one commit or discard; any exception on the way
discards the draft and is re-raised.

This module owns the public entry point, :func:`finetune`: it checks that ``db`` is a database
(:class:`~kvsearch.contract.DatabaseProtocol`) and runs the steps in order. The steps and the run's state are in
:mod:`kvsearch.training.run`, what trains and one batch's loss in :mod:`kvsearch.training.trainables`, the options
(:class:`FinetuneConfig`, :class:`History`) in :mod:`kvsearch.training.config`, the losses in
:mod:`kvsearch.training.losses`, the metrics in :mod:`kvsearch.training.metrics`. The wing talks to the database
through the facade's public methods only (``begin_generation`` and the draft's ``refresh`` / ``candidates`` /
``commit`` / ``discard``, ``ids``, ``embeddings``, ``key_texts``, ``ids_of_keys``, ``values_present``,
``generation``, the encoders): it knows nothing of the store, the index or the file formats.
"""

from __future__ import annotations

import time
from typing import Any

from kvsearch.contract import DatabaseProtocol
from kvsearch.errors import InvalidArgumentError
from kvsearch.nn.scores import GaussianKernel
from kvsearch.training.config import (
    KEEPS,
    OPTIMIZERS,
    TRAIN_MODES,
    FinetuneConfig,
    History,
    KeepName,
    TrainMode,
)
from kvsearch.training.losses import (
    LOSSES,
    Batch,
    LossFn,
    LossName,
    answer_loss,
    answer_mse_loss,
    retrieval_loss,
)
from kvsearch.training.metrics import METRICS, MetricName, Pairs, TargetKind, evaluate
from kvsearch.training.precision import PRECISIONS, PrecisionName
from kvsearch.training.run import Run, make_plan

__all__ = [
    "TrainMode",
    "TargetKind",
    "TRAIN_MODES",
    "KeepName",
    "KEEPS",
    "MetricName",
    "METRICS",
    "OPTIMIZERS",
    "PrecisionName",
    "PRECISIONS",
    "FinetuneConfig",
    "History",
    "finetune",
    # re-exported from their own modules, for code that imported them from here
    "LossName",
    "LossFn",
    "LOSSES",
    "Batch",
    "retrieval_loss",
    "answer_loss",
    "answer_mse_loss",
    "evaluate",
    "GaussianKernel",
]


def finetune(
    db: DatabaseProtocol,
    train_pairs: Pairs | None = None,
    *,
    eval_pairs: Pairs | None = None,
    config: FinetuneConfig | None = None,
    **options: Any,
) -> History:
    """Fine-tune the retriever of a database end to end on (query, target) pairs, all or nothing.

    The run works in a draft generation (``db.begin_generation()``): the database changes only at the end, in
    one ``draft.commit`` that writes the kept encoders (and trained values) and re-encodes every key. With
    ``keep="best"``, the best epoch by ``metric`` is committed if it beats the start, else nothing is; it is judged
    on the eval pairs, else on held-out keys, else on the training pairs (``History.judged_on``).

    Args:
        db: the database (its records stay; what changes are the encoders and, optionally, the embeddings).
        train_pairs: ``[(query text, target text), ...]`` or ``(queries (n, dim), values (n, value_dim))``, or
            None: train on ``(misspelt key, key)`` pairs generated from the stored keys alone (``noise``,
            ``generated``; see :mod:`kvsearch.training.pairs`), which are mixed into the user's pairs too.
        eval_pairs: pairs of the same form, evaluated before training and after each epoch (on the draft).
        config: the options as a :class:`FinetuneConfig`; default ``FinetuneConfig()``.
        **options: any field of :class:`FinetuneConfig` (``loss``, ``targets``, ``k``, ``epochs``,
            ``refresh_every``, ``train``, ``train_values``, ``score``, ``pooling``, ``optimizer``, ``lr``,
            ``batch_size``, ``temperature``, ``seed``, ``verbose``, ``keep``, ``metric``, ``precision``,
            ``lr_decay``, ``noise``, ``generated``); given with ``config``, they override it.

    Returns:
        A :class:`History` (``committed``, ``kept_epoch``, ``generation``, ``judged_on``, ``summary()``). After a
        commit the database answers with the kept encoders, saved with it: reopening the folder gives the same
        answers. Without a commit it answers exactly as before.

    Raises:
        InvalidArgumentError: ``db`` is not a kvsearch database, bad pairs or options, a metric that does not fit
            the eval pairs, an unknown option name, or nothing to train (all before any step).
        UnknownOptionError: an unknown loss, train mode, targets, score, pooling, optimizer, keep, metric or
            precision.
        NotSupportedError: ``precision="fp16"`` on a device other than CUDA, or pairs to generate on a sharded
            database (before any step).
        UnknownTargetError: a target matches no stored record — no stored key, or with value targets no stored
            value text — (before any step; a KeyNotFoundError and an InvalidArgumentError, its ``positions`` say
            which pairs).
        DimensionMismatchError: tensor pairs of the wrong shape.
        EmptyDatabaseError: the database is empty.
        NonFiniteError: the loss, a query embedding, a trained weight or the eval loss became NaN or Inf (the
            message names the step and epoch); nothing was written.
        Anything raised inside the run (a loss callable's exception, KeyboardInterrupt) is re-raised after the
        draft was discarded: the database is exactly as before.
    """
    started = time.perf_counter()
    _check_database(db)
    plan = make_plan(db, train_pairs, eval_pairs, config, options)  # everything checked; nothing begun yet
    run = Run(db, plan, started)  # the draft begun: every way out below ends in exactly one commit or discard
    try:
        run.start()  # what trains, its optimizer
        run.evaluate(0)  # the start, measured on the draft ...
        run.keep_best(0)  # ... is the mark every epoch must beat
        for epoch in range(1, plan.config.epochs + 1):
            run.epoch(epoch)  # the train steps, then the draft's keys and index refreshed
            run.evaluate(epoch)
            run.keep_best(epoch)
        run.commit()  # the kept epoch as a new generation, or the draft discarded when none beat the start
    except BaseException:
        run.abort()  # the draft discarded (if it had not ended): the database is exactly as before
        raise
    finally:
        run.close()
    return run.result()


def _check_database(db: object) -> None:
    """Refuse anything that is not a database: what :class:`~kvsearch.contract.DatabaseProtocol` names.

    Raises:
        InvalidArgumentError: ``db`` lacks a member of the protocol (the message names the first few it lacks).
    """
    if isinstance(db, DatabaseProtocol):
        return
    lacks = [name for name in dir(DatabaseProtocol) if not name.startswith("_") and not hasattr(db, name)]
    listed = ", ".join(lacks[:5]) + (", ..." if len(lacks) > 5 else "")
    raise InvalidArgumentError(
        "expected a kvsearch database (a Database or ShardedDatabase: what kvsearch.contract.DatabaseProtocol "
        f"names), got {type(db).__name__}" + (f", which lacks {listed}" if lacks else "")
    )
