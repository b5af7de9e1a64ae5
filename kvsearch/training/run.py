"""The steps of one fine-tuning run, in the order :func:`~kvsearch.finetune` takes them.

    plan = make_plan(db, train_pairs, eval_pairs, config, options)  # checked; nothing begun yet
    run = Run(db, plan, started)    # the draft begun: from here on, one commit or one discard
    run.start()                     # what trains, its optimizer
    run.evaluate(0)                 # the start, measured on the draft ...
    run.keep_best(0)                # ... is the mark every epoch must beat
    for epoch in range(1, epochs + 1):
        run.epoch(epoch)            # the train steps, then the draft's keys and index refreshed (when needed)
        run.evaluate(epoch)         # the metric on the draft (every epoch; on the training pairs, the last only)
        run.keep_best(epoch)        # a CPU copy of the weights when the epoch is strictly better
    run.commit()                    # the kept epoch as a new generation, or the draft discarded
    # on any exception: run.abort() (the draft discarded, once); always: run.close()

:func:`make_plan` does the checks that need no draft (the options, the pairs, the targets against the store, finite
target values), agreed across a sharded database's ranks; what trains (a key encoder to train, something to train,
the optimizer) is set up by :meth:`Run.start` inside the draft, so that its errors discard it. :class:`Run` holds
the run's state — the draft, what trains (:class:`~kvsearch.training.trainables.Trainables`), the optimizer, the
step count, the best epoch so far, the :class:`~kvsearch.training.config.History` — with one method per step.

This module knows nothing of the store, the index or the file formats (it works through the facade and its
draft), nor of how a batch becomes a loss (:mod:`kvsearch.training.trainables`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kvsearch.checks import all_finite
from kvsearch.contract import DatabaseProtocol
from kvsearch.encoders.base import Encoder
from kvsearch.errors import EmptyDatabaseError, InvalidArgumentError, NonFiniteError, NotSupportedError
from kvsearch.inputs import normalize_key
from kvsearch.nn.scores import ScoreFn
from kvsearch.training.config import FinetuneConfig, History, make_config
from kvsearch.training.defaults import lr_schedule, resolve_defaults
from kvsearch.training.losses import ANSWER_LOSSES, LossFn, get_loss
from kvsearch.training.metrics import check_metric, check_targets, evaluate, higher_is_better, is_tensor_pairs
from kvsearch.training.pairs import PairPlan, plan_run
from kvsearch.training.precision import MixedPrecision
from kvsearch.training.team import SOLO, Team, average_gradients, batches, team_of
from kvsearch.training.trainables import (
    Trainables,
    eval_loss,
    install,
    make_optimizer,
    probe,
    restore,
    snapshot,
    state_of,
    step_loss,
    value_embeddings,
)

__all__ = ["Plan", "Run", "Targets", "make_plan"]


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Targets:
    """What each training pair asks for, checked against the store before the draft begins.

    Attributes:
        queries: the training queries: (n, dim) float32 on the database's device, or n normalized query texts.
        values: (u, value_dim) the target values, once per distinct target.
        rows: (n,) pair i's row in ``values``.
        ids: (n,) the target record of each pair (key targets), else None.
    """

    queries: Any
    values: Tensor
    rows: Tensor
    ids: Tensor | None


@dataclass(frozen=True)
class Plan:
    """A run's checked options and pairs: everything :class:`Run` needs, decided before the draft begins.

    Attributes:
        config: the options, defaults resolved (``train``, ``batch_size``).
        team: the ranks that run together (:data:`~kvsearch.training.team.SOLO` for a plain database).
        pairs: the training and monitor pairs (:class:`~kvsearch.training.pairs.PairPlan`).
        metric: the metric that chooses the epoch to keep.
        targets: the training targets.
        score: the score the attention uses (the option's, else the database's).
        loss_fn: the loss.
        mixed: the precision of the forward passes.
        force: whether the index's candidates get each target forced in (the retrieval loss on key targets).
        steps_per_epoch: the steps of one epoch (the most of any rank).
    """

    config: FinetuneConfig
    team: Team
    pairs: PairPlan
    metric: str
    targets: Targets
    score: str | ScoreFn
    loss_fn: LossFn
    mixed: MixedPrecision
    force: bool
    steps_per_epoch: int

    @property
    def tensor_pairs(self) -> bool:
        """Whether the training pairs are ``(queries, values)`` tensors rather than texts."""
        return is_tensor_pairs(self.pairs.train)

    @property
    def searches(self) -> bool:
        """Whether a train step reads the draft's index (its candidates); in-batch negatives alone do not, so the
        keys are refreshed only for a measure (:meth:`judges`) and the commit, not every ``refresh_every`` steps."""
        return not (self.config.negatives == "in-batch" and self.targets.ids is not None)

    def judges(self, epoch: int) -> bool:
        """Whether the draft is measured after ``epoch`` (0: the start): after every epoch on held-out pairs (eval
        pairs, the monitor); on the training pairs themselves (``judged_on="train_pairs"``) after the start and the
        last epoch only. Those cannot tell which epoch generalizes best (a later epoch fits them better whether or
        not it learned more), only whether the run made things worse; an epoch in between would cost a refresh of
        every key (when the steps read no index) and a measure, for nothing."""
        if self.pairs.eval is None:
            return False
        return self.pairs.judged_on != "train_pairs" or epoch in (0, self.config.epochs)

    def refreshes_after(self, epoch: int) -> bool:
        """Whether the draft's keys and index are re-encoded after ``epoch``: when the next steps read the index
        (:attr:`searches`), the epoch is measured (:meth:`judges`), or it is the last (the commit writes them)."""
        return self.searches or self.judges(epoch) or epoch == self.config.epochs


def make_plan(
    db: DatabaseProtocol, train_pairs: Any, eval_pairs: Any, config: FinetuneConfig | None, options: dict[str, Any]
) -> Plan:
    """Check a run's options and pairs and plan it, before any step; every check is agreed across the ranks.

    Args:
        db: the database.
        train_pairs: the user's training pairs, or None (see :func:`~kvsearch.finetune`).
        eval_pairs: the user's eval pairs, or None.
        config: the options as a config, or None.
        options: the keyword options (they override ``config``'s).

    Returns:
        The :class:`Plan`.

    Raises:
        EmptyDatabaseError: the database is empty.
        KVSearchError: a bad option or pair, a target that matches nothing, non-finite target values (see
            :func:`~kvsearch.finetune`).
    """
    team = team_of(db)  # a sharded database's ranks: every check below is agreed, every loop has one length
    config = team.agree(lambda: make_config(config, options))
    if len(db) == 0:
        raise EmptyDatabaseError("expected a database with records to fine-tune on, got an empty one")
    pairs = team.agree(lambda: plan_run(db, train_pairs, eval_pairs, config))  # checked and planned
    key_pairs = not is_tensor_pairs(pairs.train) and config.target_kind == "key"
    config = resolve_defaults(config, db, pairs.generated, key_pairs, team is SOLO)  # by the database and the plan
    metric = team.agree(lambda: _check_options(db, team, config, pairs))
    score = db.score if config.score is None else config.score
    loss_fn = get_loss(config.loss)
    mixed = MixedPrecision(config.precision, db.device)
    targets = _targets(db, team, config, pairs)
    force = targets.ids is not None and config.loss not in ANSWER_LOSSES
    steps_per_epoch = team.max(math.ceil(pairs.per_epoch / config.batch_size))
    return Plan(config, team, pairs, metric, targets, score, loss_fn, mixed, force, steps_per_epoch)


def _check_options(db: DatabaseProtocol, team: Team, config: FinetuneConfig, pairs: PairPlan) -> str:
    """The options that depend on the database and the pairs. Returns the metric to keep by."""
    MixedPrecision(config.precision, db.device)  # NotSupportedError: fp16 off CUDA
    if team is not SOLO and config.train_values:
        raise NotSupportedError("train_values=True is not supported across shards yet")
    if is_tensor_pairs(pairs.train) and config.loss == "retrieval":
        raise InvalidArgumentError("the retrieval loss needs (query text, target key) pairs, got tensors")
    if config.negatives != "candidates":
        if team is not SOLO:
            raise NotSupportedError(f'negatives="{config.negatives}" is not supported across shards yet')
        if is_tensor_pairs(pairs.train) or config.target_kind != "key":
            raise InvalidArgumentError(
                f'negatives="{config.negatives}" needs (query text, target key) pairs (the batch\'s targets are '
                "its negatives), got " + ("tensors" if is_tensor_pairs(pairs.train) else "value targets")
            )
    if config.target_kind == "value" and not is_tensor_pairs(pairs.train) and db.value_encoder is None:
        raise InvalidArgumentError('expected a database with a value encoder for targets="value", got none')
    return check_metric(config.metric, pairs.train if pairs.eval is None else pairs.eval)


def _targets(db: DatabaseProtocol, team: Team, config: FinetuneConfig, pairs: PairPlan) -> Targets:
    """What each training pair asks for, and the eval pairs' targets checked, all before the draft begins."""
    device, kind = db.device, config.target_kind
    if is_tensor_pairs(pairs.train):
        queries: Any = pairs.train[0].float().to(device)  # (n, dim)
        values = pairs.train[1].float().to(device)  # (n, value_dim)
        rows, ids = torch.arange(len(values)), None  # (n,)
    else:
        queries = [normalize_key(q) for q, _ in pairs.train]  # as Database.query encodes text queries
        texts = [t for _, t in pairs.train]
        # (n,) ids for key targets, else None (collective lookups, then an agreed error)
        ids = team.agree(lambda: check_targets(db, texts, kind, "train_pairs"))
        if ids is not None:
            distinct, rows = torch.unique(ids, return_inverse=True)  # (u,), (n,)
            _, stored, _ = db.embeddings(distinct)  # (u, value_dim)
            values = stored.to(device).detach().clone()  # (u, value_dim)
        else:
            values, rows = value_embeddings(db, texts)  # (u, value_dim), (n,)
    if pairs.eval is not None and pairs.judged_on != "train_pairs" and not is_tensor_pairs(pairs.eval):
        team.agree(lambda: check_targets(db, [t for _, t in pairs.eval], kind, "eval_pairs"))

    def check_finite() -> None:
        if not all_finite(values):
            raise NonFiniteError("expected finite target values, got NaN or Inf in the training targets")

    team.agree(check_finite)
    return Targets(queries=queries, values=values, rows=rows, ids=ids)


# ----------------------------------------------------------------------------- the run


@dataclass
class _Best:
    """The best epoch so far: its metric, its number (0: the start) and its weights (None: the start's)."""

    value: float | None
    epoch: int
    state: dict[str, Any] | None


class Run:
    """One fine-tuning run from its draft to its commit or discard; one method per step (see the module docstring).

    Creating it seeds torch and begins the draft generation: from then on every way out must end in
    :meth:`commit` or :meth:`abort` (either ends the draft exactly once), then :meth:`close`.

    Attributes:
        history: what the run measured (returned by :meth:`result`).
        draft: the draft generation the run works in.
        step: the train steps taken.
    """

    # set by start()
    trainables: Trainables
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    schedule: Any
    modules: list[nn.Module]

    def __init__(self, db: DatabaseProtocol, plan: Plan, started: float) -> None:
        config = plan.config
        self.db, self.plan, self.started = db, plan, started
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.history = History(
            k=config.k,
            metric=plan.metric,
            keep=config.keep,
            generation=db.generation,
            generated=plan.pairs.generated,
            monitor=plan.pairs.monitor,
            judged_on=plan.pairs.judged_on,
            judged=plan.pairs.judged,
        )
        self.step = 0
        self.refreshed_at = 0
        self.best = _Best(None, 0, None)
        self.ended = False  # the draft was committed or discarded
        self.outsiders: list[tuple[nn.Module, dict[str, Tensor]]] = []  # trained modules the draft does not restore
        self.modes: list[tuple[nn.Module, bool]] = []
        self.flags: list[tuple[Encoder, bool]] = []
        self.bar: Any = None
        self.draft = db.begin_generation()  # from here on, every way out ends in exactly one commit or discard

    # ------------------------------------------------------------------------- the steps

    def start(self) -> None:
        """Set up what trains (in the draft): the progress bar, the trainables, the optimizer and its schedule.

        Raises:
            InvalidArgumentError: nothing to train, no key encoder for ``train="query+keys"``, a bad optimizer.
        """
        from tqdm.auto import tqdm

        config, plan = self.plan.config, self.plan
        total = config.epochs * plan.steps_per_epoch
        self.bar = tqdm(total=total, desc="finetune", unit="step", disable=not config.verbose)
        self.trainables = Trainables(self.db, config.train, config.train_values, plan.score, text=not plan.tensor_pairs)
        groups = self.trainables.param_groups(config.lr, plan.pairs.generated)
        self.params = [p for group in groups for p in group["params"]]  # in the same order on every rank
        self.opt = make_optimizer(config.optimizer, groups)
        self.schedule = lr_schedule(self.opt, config.lr_decay, total, config.warmup or 0.0)
        self.modules = self.trainables.modules()
        self.modes = [(m, m.training) for m in self.modules]
        if isinstance(plan.score, nn.Module):
            self.outsiders = [(plan.score, state_of(plan.score))]

    def epoch(self, epoch: int) -> None:
        """Train one epoch (1, 2, ...): its pairs in a seeded order, in batches; then refresh the draft's keys.

        Raises:
            NonFiniteError: a query embedding, the loss or a weight became NaN or Inf.
        """
        pairs = self.plan.pairs
        order = pairs.rows(epoch)[torch.randperm(pairs.per_epoch, generator=self.generator)]  # (n,) fresh generated
        for m in self.modules:
            m.train()
        losses = [
            self._train_step(order[rows], epoch)  # (b,) rows of the training pairs
            for rows in batches(self.plan.team, pairs.per_epoch, self.plan.config.batch_size)  # as many on every rank
        ]
        self.history.losses.extend(losses)
        self.history.epoch_losses.append(sum(losses) / len(losses))
        if self.plan.refreshes_after(epoch):
            self._refresh()  # the draft's index must match the key encoder before a step, a measure or the commit

    def evaluate(self, epoch: int) -> None:
        """Measure the metric on the draft after ``epoch`` (0: the start), when the run judges that epoch (eval
        pairs, the monitor, or its training pairs: see :func:`~kvsearch.training.pairs.plan_run` and
        :meth:`Plan.judges`).

        Raises:
            NonFiniteError: the eval loss (tensor pairs) is NaN or Inf.
        """
        if self.plan.judges(epoch):
            for m in self.modules:
                m.eval()
            try:
                metrics = self._measure(epoch)
            finally:
                for m in self.modules:
                    m.train()
            self.history.metrics.append({"epoch": float(epoch), "step": float(self.step), **metrics})
        if epoch:
            self.bar.set_postfix(_postfix(self.history.losses[-1], self.history), refresh=True)

    def keep_best(self, epoch: int) -> None:
        """Hold a CPU copy of the weights after ``epoch`` if it is strictly better than the best so far
        (``keep="best"``); epoch 0, the start, is the mark to beat; an epoch the run does not judge is skipped."""
        if not self.plan.judges(epoch):
            return
        value = self.history.value(epoch)
        if epoch == 0:
            self.best = _Best(value, 0, None)
            return
        if self.plan.config.keep != "best" or value is None or self.best.value is None:
            return
        if (value > self.best.value) if higher_is_better(self.plan.metric) else (value < self.best.value):
            self.best = _Best(value, epoch, snapshot(self.trainables))

    def commit(self) -> None:
        """Commit the kept epoch as the database's new generation, or discard the draft when no epoch beat the
        start (the database keeps its retriever and records the attempt).

        Raises:
            NonFiniteError: the kept query encoder gives NaN or Inf, or the commit found a non-finite weight or key.
        """
        self.history.kept_epoch = self._kept_epoch()
        if self.history.kept_epoch == 0:
            self.ended = True
            self.history.seconds = time.perf_counter() - self.started
            self.draft.discard(summary=_summary(self.history, self.plan.config, self.step))
            self._put_back_outsiders()
            return
        trained, plan = self.trainables, self.plan
        plan.team.agree(lambda: probe(trained, plan.targets.queries, plan.config.batch_size, plan.tensor_pairs))
        self.flags = install(self.db, trained)
        self.history.seconds = time.perf_counter() - self.started
        summary = _summary(self.history, plan.config, self.step)
        values = None if trained.values is None or trained.ids is None else (trained.ids, trained.values.detach())
        # the keys of the draft's last refresh are the kept encoder's when it refreshed after the last step and the
        # kept epoch is the last one: the commit writes them instead of encoding every key once more
        last = self.history.kept_epoch in (None, plan.config.epochs)
        refreshed = last and self.trainables.key_encoder is not None and self.refreshed_at == self.step
        self.history.generation = self.draft.commit(values=values, summary=summary, refreshed=refreshed)
        self.ended = True
        self.history.committed = True

    def abort(self) -> None:
        """After an exception: discard the draft (unless it ended) and put back what the draft does not restore."""
        if not self.ended:
            self.ended = True
            self.draft.discard()  # the encoders' weights and identities as they were; nothing was written
        self._put_back_outsiders()
        for encoder, flag in self.flags:
            encoder.trained = flag

    def close(self) -> None:
        """Close the progress bar and put the trained modules back in their train / eval modes (always)."""
        if self.bar is not None:
            self.bar.close()
        for m, mode in self.modes:
            m.train(mode)

    def result(self) -> History:
        """The run's :class:`History`, with the database's generation and the wall time (after :meth:`close`)."""
        if self.history.committed:
            for encoder in (self.trainables.query_encoder, self.trainables.key_encoder):
                if encoder is not None:
                    encoder.eval()
        self.history.generation = self.db.generation
        self.history.seconds = time.perf_counter() - self.started
        return self.history

    # ------------------------------------------------------------------------- inside the steps

    def _train_step(self, batch: Tensor, epoch: int) -> float:
        """One optimizer step on the training pairs ``batch`` (b,) (may be empty on a rank). Returns the loss."""
        plan, config, targets = self.plan, self.plan.config, self.plan.targets
        q = self._queries(batch)  # (b, dim)
        if plan.team.max(int(not all_finite(q))):
            raise NonFiniteError(
                f"the query embeddings are NaN or Inf at step {self.step + 1} (epoch {epoch}): the query "
                "encoder's weights diverged (lower lr?); nothing was written"
            )
        ids = None if targets.ids is None else targets.ids[batch]  # (b,)
        wanted = targets.values[targets.rows[batch].to(self.db.device)]  # (b, value_dim)
        loss = step_loss(
            self.draft,
            self.db,
            self.trainables,
            q,
            ids,
            wanted,
            config.k,
            plan.force,
            config.pooling,
            config.temperature,
            plan.loss_fn,
            plan.mixed,
            config.negatives or "candidates",
        )
        self.opt.zero_grad(set_to_none=True)
        if len(batch):
            plan.mixed.backward(loss)  # scaled first under fp16
        loss_float = average_gradients(plan.team, self.params, float(loss.detach()), len(batch))
        if not math.isfinite(loss_float):
            raise NonFiniteError(
                f"the training loss is {loss_float} at step {self.step + 1} (epoch {epoch}); nothing was written"
            )
        self.step += 1
        plan.mixed.step(self.opt, self.step, epoch)  # NonFiniteError when a weight is no longer finite
        if self.opt.defaults.get("fused"):  # fused kernels write in place without bumping the version counters
            torch.autograd.graph.increment_version(self.params)  # that tell the encoders' saved marks apart
        self.schedule.step()
        if plan.searches and self.step % config.refresh_every == 0:
            self._refresh()
        self.bar.update(1)
        self.bar.set_postfix(_postfix(loss_float, self.history), refresh=False)
        return loss_float

    def _queries(self, batch: Tensor) -> Tensor:
        """The query embeddings (b, dim) float32 of the training pairs ``batch`` (b,), with grad through the encoder."""
        queries, device = self.plan.targets.queries, self.db.device
        if self.plan.tensor_pairs:
            return queries[batch.to(device)]  # (b, dim)
        if not len(batch):
            return torch.zeros(0, self.db.dim, device=device)  # (0, dim): this rank has no batch left
        with self.plan.mixed.autocast():
            q = self.trainables.query_encoder([queries[i] for i in batch.tolist()])  # (b, dim)
        return q.float()  # (b, dim) the index searches float32 queries

    def _refresh(self) -> None:
        """Re-encode the keys into the draft's working keys and index, when the key encoder trains (once a step)."""
        if self.trainables.key_encoder is not None and self.refreshed_at != self.step:
            self.draft.refresh()  # re-encodes the keys in eval mode into the draft's working keys and index
            self.history.refreshes += 1
            self.refreshed_at = self.step

    def _measure(self, epoch: int) -> dict[str, float]:
        """The eval pairs' metrics on the draft (the modules in eval mode)."""
        plan, config, pairs = self.plan, self.plan.config, self.plan.pairs.eval
        if is_tensor_pairs(pairs):
            value = eval_loss(
                self.draft,
                self.db,
                self.trainables,
                pairs,
                config.k,
                config.pooling,
                config.temperature,
                plan.loss_fn,
                config.batch_size,
            )
            if not math.isfinite(value):
                raise NonFiniteError(f"the eval loss is {value} after epoch {epoch} (step {self.step})")
            return {"loss": value}
        return evaluate(
            self.db,
            pairs,
            k=config.k,
            targets=config.target_kind,
            query_encoder=self.trainables.query_encoder,
            score=plan.score,
            batch_size=max(config.batch_size, 256),
            retriever=self.draft,
        )

    def _kept_epoch(self) -> int | None:
        """The epoch to commit (0: none beat the start; None: nothing judged, the last), its weights restored."""
        if self.plan.pairs.eval is None:
            return None
        if self.plan.config.keep == "last":
            return self.plan.config.epochs
        if self.best.state is not None:
            restore(self.trainables, self.best.state)
        return self.best.epoch

    def _put_back_outsiders(self) -> None:
        """Put back the weights of the trained modules the draft does not restore (a score module)."""
        for module, state in self.outsiders:
            module.load_state_dict(state)


def _postfix(loss: float, history: History) -> dict[str, str]:
    """The progress bar's postfix: the last loss and the last eval metric."""
    out = {"loss": f"{loss:.4f}"}
    if history.metrics and history.metric in history.metrics[-1]:
        out["eval " + history.metric] = f"{history.metrics[-1][history.metric]:.4f}"
    return out


def _summary(history: History, config: FinetuneConfig, steps: int) -> dict[str, Any]:
    """The run as the database records it (JSON-able): shown by ``kvsearch info``."""
    kept = history.kept_epoch if history.kept_epoch is not None else config.epochs
    loss = config.loss if isinstance(config.loss, str) else getattr(config.loss, "__name__", type(config.loss).__name__)
    return {
        "metric": history.metric if history.metrics else None,
        "before": history.value(0),
        "after": history.value(kept),
        "kept_epoch": history.kept_epoch,
        "committed": history.kept_epoch != 0,  # kept epoch 0: no epoch beat the start, nothing was committed
        "keep": history.keep,
        "judged_on": history.judged_on,
        "judged": history.judged,
        "epochs": config.epochs,
        "steps": steps,
        "seconds": round(history.seconds, 3),
        "train": config.train,
        "train_values": config.train_values,
        "negatives": config.negatives,
        "warmup": config.warmup,
        "precision": config.precision,
        "loss": str(loss),
        "final_loss": history.epoch_losses[-1] if history.epoch_losses else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
