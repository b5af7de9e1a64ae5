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

Keep the best. With eval pairs and ``keep="best"`` (the default), the metric (``metric=``) is measured before
training and after each epoch; the best epoch's weights are kept in memory and committed at the end — only if
that epoch is strictly better than the start. If no epoch beats it, the draft is discarded and the database
keeps its retriever. ``keep="last"`` commits the last epoch, even when it is worse; without eval pairs the last
epoch is committed.

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

This module owns the loop (its options, :class:`FinetuneConfig` and :class:`History`, are in
:mod:`kvsearch.training.config`). The losses live in :mod:`kvsearch.training.losses`, the metrics in
:mod:`kvsearch.training.metrics`. It talks to the database through the facade's public methods only
(``begin_generation`` and the draft's ``refresh`` / ``candidates`` / ``commit`` / ``discard``, ``ids``,
``embeddings``, ``key_texts``, ``ids_of_keys``, ``values_present``, ``generation``, the
encoders): it knows nothing of the store, the index or the file formats.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from kvsearch.checks import all_finite
from kvsearch.database import Database
from kvsearch.encoders.base import Encoder
from kvsearch.errors import EmptyDatabaseError, InvalidArgumentError, NonFiniteError, NotSupportedError
from kvsearch.inputs import normalize_key
from kvsearch.nn.attend import attend
from kvsearch.nn.scores import GaussianKernel, ScoreFn, compute_scores
from kvsearch.training.config import (
    KEEPS,
    OPTIMIZERS,
    TRAIN_MODES,
    FinetuneConfig,
    History,
    KeepName,
    OptimizerSpec,
    TrainMode,
    make_config,
)
from kvsearch.training.defaults import DEFAULT_LR, default_lr, lr_schedule, resolve_defaults
from kvsearch.training.losses import (
    ANSWER_LOSSES,
    LOSSES,
    Batch,
    LossFn,
    LossName,
    answer_loss,
    answer_mse_loss,
    get_loss,
    retrieval_loss,
)
from kvsearch.training.metrics import (
    METRICS,
    MetricName,
    Pairs,
    TargetKind,
    check_metric,
    check_targets,
    evaluate,
    higher_is_better,
    is_tensor_pairs,
)
from kvsearch.training.pairs import plan_run
from kvsearch.training.precision import PRECISIONS, MixedPrecision, PrecisionName
from kvsearch.training.team import SOLO, average_gradients, batches, team_of

if TYPE_CHECKING:
    from kvsearch.generations import Draft

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

_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


# ----------------------------------------------------------------------------- set-up


def _value_embeddings(db: Database, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """The value encoder's embeddings of the distinct value texts (u, value_dim) on the database's device, and
    each text's row among them (n,)."""
    if db.value_encoder is None:
        raise InvalidArgumentError('expected a database with a value encoder for targets="value", got none')
    unique = list(dict.fromkeys(texts))
    embs = db.value_encoder.encode(unique).float().to(db.device)  # (u, value_dim)
    pos = {t: i for i, t in enumerate(unique)}
    return embs, torch.tensor([pos[t] for t in texts], dtype=torch.long)  # (u, value_dim), (n,)


def _make_optimizer(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if callable(spec):
        opt = spec(groups)
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidArgumentError(f"expected the optimizer callable to return a torch Optimizer, got {opt!r:.60}")
        return opt
    cls = _OPTIMIZER_CLASSES[spec]  # the name was checked by FinetuneConfig
    try:
        # the fused kernels (CPU and CUDA): one pass over a 2**16 x 256 n-gram table takes ~30 ms, not ~180 ms;
        # the loop bumps the weights' version counters after each step (the fused kernels do not)
        return cls(groups, fused=True)
    except (RuntimeError, TypeError, ValueError):  # a device or dtype the fused kernels do not take
        return cls(groups)


class _Run:
    """The state of one fine-tuning run (encoders, trainable tensors), read and written through the facade."""

    def __init__(self, db: Database, train: str, train_values: bool, score: str | ScoreFn, text: bool) -> None:
        self.db = db
        self.train = train
        self.score = score
        self.query_copy = False
        self.key_encoder: Encoder | None = None
        self.query_encoder: Encoder | None = None
        if text:  # tensor queries need no query encoder
            if train == "query":
                if db.query_encoder is not None:
                    self.query_encoder = db.query_encoder
                else:
                    self.query_encoder = copy.deepcopy(db.encoder)  # a query-side copy; stored keys stay fixed
                    self.query_copy = True
            else:
                if db.encoder is None:
                    raise InvalidArgumentError('train="query+keys" needs a key encoder; this database has none')
                self.key_encoder = db.encoder
                self.query_encoder = db.encoder if db.query_encoder is None else db.query_encoder
                if db.value_encoder is db.encoder:
                    # the values were encoded with the untrained encoder: keep that one as the value encoder
                    db.value_encoder = copy.deepcopy(db.encoder)
        self.ids: Tensor | None = None  # (m,) sorted: the rows of the trainable value table
        self.values: nn.Parameter | None = None
        if train_values:
            self.ids = db.ids()  # (m,)
            _, values, _ = db.embeddings(self.ids)  # (m, value_dim)
            self.values = nn.Parameter(values.detach().clone())  # (m, value_dim)

    def modules(self) -> list[nn.Module]:
        mods = [m for m in (self.query_encoder, self.key_encoder) if m is not None]
        if isinstance(self.score, nn.Module):
            mods.append(self.score)
        return list({id(m): m for m in mods}.values())

    def param_groups(self, lr: float | None, generated: int) -> list[dict[str, Any]]:
        groups = []
        for module in self.modules():
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": default_lr(module, generated) if lr is None else lr})
        if self.values is not None:
            groups.append({"params": [self.values], "lr": DEFAULT_LR["other"] if lr is None else lr})
        if not groups:
            raise InvalidArgumentError(
                "expected something to train (a text encoder, a score module or train_values=True), got nothing"
            )
        return groups

    def candidate_keys(self, ids: Tensor, stored: Tensor, mask: Tensor) -> Tensor:
        """Keys (b, k, dim): the stored ones, or re-encoded with grad when the key encoder trains."""
        if self.key_encoder is None:
            return stored  # (b, k, dim)
        uniq, inverse = torch.unique(ids.cpu(), return_inverse=True)  # (u,), (b, k)
        texts = self.db.key_texts(uniq, encoded_only=True)  # u texts, None for -1 and keys as / with embeddings
        rows = [r for r, text in enumerate(texts) if text is not None]
        table, _, _ = self.db.embeddings(uniq)  # (u, dim)
        table = table.clone()  # (u, dim)
        if rows:
            fresh = self.key_encoder([texts[r] for r in rows]).to(table.dtype)  # (r, dim)
            table[torch.tensor(rows, device=table.device)] = fresh.to(table.device)
        keys = table[inverse.to(table.device)]  # (b, k, dim)
        return keys * mask.unsqueeze(-1)  # (b, k, dim)

    def candidate_values(self, ids: Tensor, stored: Tensor, mask: Tensor) -> Tensor:
        """Values (b, k, value_dim): the stored ones, or gathered by id from the trainable table."""
        if self.values is None or self.ids is None:
            return stored  # (b, k, value_dim)
        flat = ids.cpu()  # (b, k)
        rows = torch.searchsorted(self.ids, flat).clamp(max=len(self.ids) - 1)  # (b, k)
        keep = (self.ids[rows] == flat) & (flat >= 0)  # (b, k) False on -1 and on ids not in the table
        keep = keep.to(mask.device) & mask  # (b, k)
        rows = torch.where(keep.cpu(), rows, 0).to(self.values.device)  # (b, k)
        return self.values[rows] * keep.unsqueeze(-1).to(self.values.device)  # (b, k, value_dim)


# ----------------------------------------------------------------------------- the loop


def finetune(
    db: Database,
    train_pairs: Pairs | None = None,
    *,
    eval_pairs: Pairs | None = None,
    config: FinetuneConfig | None = None,
    **options: Any,
) -> History:
    """Fine-tune the retriever of a database end to end on (query, target) pairs, all or nothing.

    The run works in a draft generation (``db.begin_generation()``): the database changes only at the end, in
    one ``draft.commit`` that writes the kept encoders (and trained values) and re-encodes every key. With eval
    pairs and ``keep="best"``, the best epoch by ``metric`` is committed if it beats the start, else nothing is.

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
        A :class:`History` (``committed``, ``kept_epoch``, ``generation``, ``summary()``). After a commit the
        database answers with the kept encoders, saved with it: reopening the folder gives the same answers.
        Without a commit it answers exactly as before.

    Raises:
        InvalidArgumentError: bad pairs or options, a metric that does not fit the eval pairs, an unknown option
            name, or nothing to train (all before any step).
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
    from tqdm.auto import tqdm

    started = time.perf_counter()
    from kvsearch.distributed import ShardedDatabase

    if not isinstance(db, (Database, ShardedDatabase)):
        raise InvalidArgumentError(f"expected a kvsearch Database or ShardedDatabase, got {type(db).__name__}")
    team = team_of(db)  # a sharded database's ranks: every check below is agreed, every loop has one length
    config = team.agree(lambda: make_config(config, options))
    if len(db) == 0:
        raise EmptyDatabaseError("expected a database with records to fine-tune on, got an empty one")
    plan = team.agree(lambda: plan_run(db, train_pairs, eval_pairs, config))  # the pairs checked and planned
    train_pairs, eval_pairs = plan.train, plan.eval
    config = resolve_defaults(config, db, plan.generated)  # train=None, batch_size=None: by the database and plan

    def check_options() -> str:
        MixedPrecision(config.precision, db.device)  # NotSupportedError: fp16 off CUDA
        if team is not SOLO and config.train_values:
            raise NotSupportedError("train_values=True is not supported across shards yet")
        if is_tensor_pairs(train_pairs) and config.loss == "retrieval":
            raise InvalidArgumentError("the retrieval loss needs (query text, target key) pairs, got tensors")
        if config.target_kind == "value" and not is_tensor_pairs(train_pairs) and db.value_encoder is None:
            raise InvalidArgumentError('expected a database with a value encoder for targets="value", got none')
        return check_metric(config.metric, train_pairs if eval_pairs is None else eval_pairs)

    metric = team.agree(check_options)
    targets = config.target_kind
    tensor_pairs = is_tensor_pairs(train_pairs)
    k, batch_size, temperature, pooling = config.k, config.batch_size, config.temperature, config.pooling
    score = db.score if config.score is None else config.score
    loss_fn = get_loss(config.loss)
    device = db.device
    mixed = MixedPrecision(config.precision, device)

    # what each training pair asks for, and the targets of the eval pairs: checked before the draft begins
    # the target values are held once per distinct target: target_values (u, value_dim), row of pair i target_row[i]
    if tensor_pairs:
        query_items: Any = train_pairs[0].float().to(device)  # (n, dim)
        target_values = train_pairs[1].float().to(device)  # (n, value_dim)
        target_row = torch.arange(len(target_values))  # (n,)
        wanted = None
    else:
        query_items = [normalize_key(q) for q, _ in train_pairs]  # as Database.query encodes text queries
        texts = [t for _, t in train_pairs]
        # (n,) ids for key targets, else None (collective lookups, then an agreed error)
        wanted = team.agree(lambda: check_targets(db, texts, targets, "train_pairs"))
        if wanted is not None:
            distinct, target_row = torch.unique(wanted, return_inverse=True)  # (u,), (n,)
            _, values, _ = db.embeddings(distinct)  # (u, value_dim)
            target_values = values.to(device).detach().clone()  # (u, value_dim)
        else:
            target_values, target_row = _value_embeddings(db, texts)  # (u, value_dim), (n,)
    if eval_pairs is not None and not is_tensor_pairs(eval_pairs):
        team.agree(lambda: check_targets(db, [t for _, t in eval_pairs], targets, "eval_pairs"))

    def check_finite_targets() -> None:
        if not all_finite(target_values):
            raise NonFiniteError("expected finite target values, got NaN or Inf in the training targets")

    team.agree(check_finite_targets)
    force = wanted is not None and config.loss not in ANSWER_LOSSES
    n = plan.per_epoch  # pairs per epoch: the user's and this epoch's share of the generated ones
    steps_per_epoch = team.max(math.ceil(n / batch_size))
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)

    history = History(
        k=k, metric=metric, keep=config.keep, generation=db.generation, generated=plan.generated, monitor=plan.monitor
    )
    draft = db.begin_generation()  # from here on, every way out ends in exactly one commit or discard
    ended = False
    run: _Run | None = None
    outsiders: list[tuple[nn.Module, dict[str, Tensor]]] = []  # trained modules the draft does not restore
    modes: list[tuple[nn.Module, bool]] = []
    flags: list[tuple[Encoder, bool]] = []
    bar = None
    try:
        bar = tqdm(total=config.epochs * steps_per_epoch, desc="finetune", unit="step", disable=not config.verbose)
        run = _Run(db, config.train, config.train_values, score, text=not tensor_pairs)
        groups = run.param_groups(config.lr, plan.generated)
        params = [p for group in groups for p in group["params"]]  # in the same order on every rank
        opt = _make_optimizer(config.optimizer, groups)
        schedule = lr_schedule(opt, config.lr_decay, config.epochs * steps_per_epoch)
        modules = run.modules()
        modes = [(m, m.training) for m in modules]
        if isinstance(score, nn.Module):
            outsiders = [(score, _state_of(score))]

        def measure(epoch: int, step: int) -> None:
            if eval_pairs is None:
                return
            for m in modules:
                m.eval()
            try:
                if is_tensor_pairs(eval_pairs):
                    value = _eval_loss(draft, db, run, eval_pairs, k, pooling, temperature, loss_fn, batch_size)
                    if not math.isfinite(value):
                        raise NonFiniteError(f"the eval loss is {value} after epoch {epoch} (step {step})")
                    metrics = {"loss": value}
                else:
                    metrics = evaluate(
                        db,
                        eval_pairs,
                        k=k,
                        targets=targets,
                        query_encoder=run.query_encoder,
                        score=score,
                        batch_size=max(batch_size, 256),
                        retriever=draft,
                    )
            finally:
                for m in modules:
                    m.train()
            history.metrics.append({"epoch": float(epoch), "step": float(step), **metrics})

        refreshed_at = 0

        def refresh(step: int) -> None:
            nonlocal refreshed_at
            if run.key_encoder is not None and refreshed_at != step:
                draft.refresh()  # re-encodes the keys in eval mode into the draft's working keys and index
                history.refreshes += 1
                refreshed_at = step

        better = higher_is_better(metric)
        measure(0, 0)
        best_value = history.value(0)
        best_epoch, best_state = 0, None
        for m in modules:
            m.train()
        step = 0
        for epoch in range(1, config.epochs + 1):
            rows_of_epoch = plan.rows(epoch)  # (n,) the pairs of this epoch (fresh generated ones)
            order = rows_of_epoch[torch.randperm(n, generator=generator)]  # (n,)
            epoch_losses = []
            for rows in batches(team, n, batch_size):  # as many on every rank (empty ones at the end)
                batch = order[rows]  # (b,)
                if tensor_pairs:
                    q = query_items[batch.to(device)]  # (b, dim)
                elif len(batch):
                    with mixed.autocast():
                        q = run.query_encoder([query_items[i] for i in batch.tolist()])  # (b, dim)
                    q = q.float()  # (b, dim) the index searches float32 queries
                else:
                    q = torch.zeros(0, db.dim, device=device)  # (0, dim): this rank has no batch left
                if team.max(int(not all_finite(q))):
                    raise NonFiniteError(
                        f"the query embeddings are NaN or Inf at step {step + 1} (epoch {epoch}): the query "
                        "encoder's weights diverged (lower lr?); nothing was written"
                    )
                tid = None if wanted is None else wanted[batch]  # (b,)
                value_t = target_values[target_row[batch].to(device)]  # (b, value_dim)
                loss_value = _step_loss(draft, db, run, q, tid, value_t, k, force, pooling, temperature, loss_fn, mixed)
                opt.zero_grad(set_to_none=True)
                if len(batch):
                    mixed.backward(loss_value)  # scaled first under fp16
                loss_float = average_gradients(team, params, float(loss_value.detach()), len(batch))
                if not math.isfinite(loss_float):
                    raise NonFiniteError(
                        f"the training loss is {loss_float} at step {step + 1} (epoch {epoch}); nothing was written"
                    )
                step += 1
                mixed.step(opt, step, epoch)  # NonFiniteError when a weight is no longer finite
                if opt.defaults.get("fused"):  # fused kernels write in place without bumping the version counters
                    torch.autograd.graph.increment_version(params)  # that tell the encoders' saved marks apart
                schedule.step()
                epoch_losses.append(loss_float)
                if step % config.refresh_every == 0:
                    refresh(step)
                bar.update(1)
                bar.set_postfix(_postfix(loss_float, history), refresh=False)
            history.losses.extend(epoch_losses)
            history.epoch_losses.append(sum(epoch_losses) / len(epoch_losses))
            refresh(step)  # the draft's index must match the key encoder before it is measured (and at the end)
            measure(epoch, step)
            bar.set_postfix(_postfix(epoch_losses[-1], history), refresh=True)
            value = history.value(epoch)
            if config.keep == "best" and value is not None and best_value is not None:
                if (value > best_value) if better else (value < best_value):
                    best_value, best_epoch, best_state = value, epoch, _snapshot(run)

        # which epoch to commit, if any
        if eval_pairs is None:
            history.kept_epoch = None
        elif config.keep == "last":
            history.kept_epoch = config.epochs
        else:
            history.kept_epoch = best_epoch
            if best_state is not None:
                _restore(run, best_state)
        if history.kept_epoch == 0:  # no epoch beat the start: the database keeps its retriever, records the attempt
            ended = True
            history.seconds = time.perf_counter() - started
            draft.discard(summary=_summary(history, config, step))
            for module, state in outsiders:
                module.load_state_dict(state)
        else:
            team.agree(lambda: _probe(run, query_items, batch_size, tensor_pairs))
            flags = _install(db, run)
            history.seconds = time.perf_counter() - started
            summary = _summary(history, config, step)
            values = None if run.values is None or run.ids is None else (run.ids, run.values.detach())
            history.generation = draft.commit(values=values, summary=summary)  # (m,), (m, value_dim)
            ended = True
            history.committed = True
    except BaseException:
        if not ended:
            ended = True
            draft.discard()  # the encoders' weights and identities as they were; nothing was written
        for module, state in outsiders:
            module.load_state_dict(state)
        for encoder, flag in flags:
            encoder.trained = flag
        raise
    finally:
        if bar is not None:
            bar.close()
        for m, mode in modes:
            m.train(mode)
    if history.committed and run is not None:
        for encoder in (run.query_encoder, run.key_encoder):
            if encoder is not None:
                encoder.eval()
    history.generation = db.generation
    history.seconds = time.perf_counter() - started
    return history


def _postfix(loss: float, history: History) -> dict[str, str]:
    out = {"loss": f"{loss:.4f}"}
    if history.metrics and history.metric in history.metrics[-1]:
        out["eval " + history.metric] = f"{history.metrics[-1][history.metric]:.4f}"
    return out


def _state_of(module: nn.Module) -> dict[str, Tensor]:
    """A CPU copy of a module's state_dict (what a later ``load_state_dict`` puts back)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}


def _snapshot(run: _Run) -> dict[str, Any]:
    """The trained state of a run: a CPU copy of every trained module's weights and of the value table."""
    return {
        "modules": [_state_of(m) for m in run.modules()],
        "values": None if run.values is None else run.values.detach().to("cpu", copy=True),  # (m, value_dim)
    }


def _restore(run: _Run, state: dict[str, Any]) -> None:
    """Load a :func:`_snapshot` back into the run's modules and value table."""
    for module, weights in zip(run.modules(), state["modules"]):
        module.load_state_dict(weights)
    if run.values is not None and state["values"] is not None:
        with torch.no_grad():
            run.values.copy_(state["values"].to(run.values.device))  # (m, value_dim)


@torch.no_grad()
def _probe(run: _Run, query_items: Any, batch_size: int, tensor_pairs: bool) -> None:
    """Check the kept query encoder on a batch of training queries before committing it.

    Finite weights can still give non-finite embeddings (a huge lr leaves weights near the float32 limit, whose
    sums overflow); the commit checks the weights and the re-encoded keys, this the query side.

    Raises:
        NonFiniteError: the query encoder gives NaN or Inf.
    """
    if tensor_pairs or run.query_encoder is None:
        return
    q = run.query_encoder.encode(list(query_items[:batch_size])).float()  # (b, dim)
    if not all_finite(q):
        raise NonFiniteError("the trained query encoder gives NaN or Inf embeddings; nothing was written")


def _install(db: Database, run: _Run) -> list[tuple[Encoder, bool]]:
    """Mark the trained encoders and install a query-side copy in the database, before the commit.

    Returns:
        The encoders' previous ``trained`` flags, for a commit that fails.
    """
    flags = []
    for encoder in (run.query_encoder, run.key_encoder):
        if encoder is not None and all(encoder is not e for e, _ in flags):
            flags.append((encoder, encoder.trained))
            encoder.trained = True
            encoder.eval()
    if run.query_copy:
        db.query_encoder = run.query_encoder  # the draft restores the identities if the commit fails
    return flags


def _summary(history: History, config: FinetuneConfig, steps: int) -> dict[str, Any]:
    """The run as the database records it (JSON-able): shown by ``kvsearch info``."""
    kept = history.kept_epoch if history.kept_epoch is not None else len(history.metrics) - 1
    loss = config.loss if isinstance(config.loss, str) else getattr(config.loss, "__name__", type(config.loss).__name__)
    return {
        "metric": history.metric if history.metrics else None,
        "before": history.value(0),
        "after": history.value(kept) if history.metrics else None,
        "kept_epoch": history.kept_epoch,
        "committed": history.kept_epoch != 0,  # kept epoch 0: no epoch beat the start, nothing was committed
        "keep": history.keep,
        "epochs": config.epochs,
        "steps": steps,
        "seconds": round(history.seconds, 3),
        "train": config.train,
        "train_values": config.train_values,
        "precision": config.precision,
        "loss": str(loss),
        "final_loss": history.epoch_losses[-1] if history.epoch_losses else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _step_loss(
    retriever: Draft,
    db: Database,
    run: _Run,
    q: Tensor,
    targets: Tensor | None,
    target_values: Tensor,
    k: int,
    force: bool,
    pooling: str,
    temperature: float,
    loss_fn: LossFn,
    mixed: MixedPrecision | None = None,
) -> Tensor:
    """One batch through candidates (from the draft), attention and the loss. Returns a 0-dim tensor.

    The key encoder and the attention run under ``mixed``'s autocast (none by default); the scores the loss sees
    and the loss itself are float32, outside it.
    """
    # ids (b, k), keys, values, mask (b, k): chosen in float32 (the index sees the detached queries, outside autocast)
    cand = retriever.candidates(q, k, targets=targets if force else None)
    with contextlib.nullcontext() if mixed is None else mixed.autocast():
        keys = run.candidate_keys(cand.ids, cand.keys, cand.mask)  # (b, k, dim) float32
        values = run.candidate_values(cand.ids, cand.values, cand.mask)  # (b, k, value_dim)
        if q.shape[0] == 0:  # a rank with no batch left took part in the collectives above; it has no loss
            return torch.zeros((), device=db.device)
        q = q.to(db.device)  # (b, dim)
        output, weights = attend(
            q, keys, values, score=run.score, pooling=pooling, mask=cand.mask, temperature=temperature
        )  # (b, value_dim), (b, k) in autocast's dtype where it lowered them
    output, weights = output.float(), weights.float()  # (b, value_dim), (b, k): the loss is taken in float32
    scores = compute_scores(q.unsqueeze(1), keys, run.score).squeeze(1)  # (b, k) float32, outside autocast
    match = None
    if targets is not None:
        match = (cand.ids == targets.to(cand.ids.device).unsqueeze(1)) & cand.mask  # (b, k)
    batch = Batch(
        queries=q,
        scores=scores,
        weights=weights,
        output=output,
        ids=cand.ids,
        mask=cand.mask,
        match=match,
        target_values=target_values,
        temperature=temperature,
    )
    value = loss_fn(batch)
    if not isinstance(value, Tensor) or value.dim() != 0:
        raise InvalidArgumentError(f"expected the loss to return a 0-dim tensor, got {value!r:.60}")
    return value


@torch.no_grad()
def _eval_loss(
    retriever: Draft,
    db: Database,
    run: _Run,
    pairs: tuple[Tensor, Tensor],
    k: int,
    pooling: str,
    temperature: float,
    loss_fn: LossFn,
    batch_size: int,
) -> float:
    """The loss on tensor eval pairs, averaged over the pairs."""
    queries, values = pairs[0].float().to(db.device), pairs[1].float().to(db.device)  # (n, dim), (n, value_dim)
    team = team_of(db)
    total = torch.zeros(2, dtype=torch.float64)  # loss * rows, rows
    for rows in batches(team, len(queries), batch_size):
        q, v = queries[rows], values[rows]  # (b, dim), (b, value_dim)
        loss = _step_loss(retriever, db, run, q, None, v, k, False, pooling, temperature, loss_fn)
        total += torch.tensor([float(loss) * len(q), len(q)], dtype=torch.float64)
    total = team.sum(total)
    return float(total[0] / total[1])
