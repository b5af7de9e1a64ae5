"""What a fine-tuning run trains, and one batch through it to the loss.

:class:`Trainables` holds what the run trains: the query encoder (the database's, or a query-side copy), the key
encoder with ``train="query+keys"``, a score module, and with ``train_values=True`` a trainable copy of the value
table; it gives their parameter groups and the candidates' keys and values with grad. :func:`step_loss` takes one
batch of query embeddings through the draft's candidates, ``attend`` and the loss; :func:`eval_loss` averages it
over tensor eval pairs. :func:`snapshot` / :func:`restore` are the copies keep-best holds, :func:`probe` and
:func:`install` what the commit checks and marks first.

This module knows nothing of epochs, keep-best or the commit (the steps of a run, :mod:`kvsearch.training.run`,
call it), nor of the store, the index or the file formats: it reads the database through the facade's public
methods (``embeddings``, ``key_texts``, ``ids``, the encoders) and candidates through the draft.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from kvsearch.checks import all_finite
from kvsearch.contract import DatabaseProtocol
from kvsearch.encoders.base import Encoder
from kvsearch.errors import InvalidArgumentError, NonFiniteError
from kvsearch.nn.attend import Candidates, attend
from kvsearch.nn.scores import ScoreFn, compute_scores
from kvsearch.training.config import OptimizerSpec
from kvsearch.training.defaults import DEFAULT_LR, default_lr
from kvsearch.training.losses import Batch, LossFn
from kvsearch.training.precision import MixedPrecision
from kvsearch.training.team import batches, team_of

if TYPE_CHECKING:
    from kvsearch.generations import Draft

__all__ = [
    "Trainables",
    "eval_loss",
    "install",
    "make_optimizer",
    "probe",
    "restore",
    "snapshot",
    "state_of",
    "step_loss",
    "value_embeddings",
]

_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


def value_embeddings(db: DatabaseProtocol, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
    """The value encoder's embeddings of the distinct value texts (u, value_dim) on the database's device, and
    each text's row among them (n,)."""
    if db.value_encoder is None:
        raise InvalidArgumentError('expected a database with a value encoder for targets="value", got none')
    unique = list(dict.fromkeys(texts))
    embs = db.value_encoder.encode(unique).float().to(db.device)  # (u, value_dim)
    pos = {t: i for i, t in enumerate(unique)}
    return embs, torch.tensor([pos[t] for t in texts], dtype=torch.long)  # (u, value_dim), (n,)


def make_optimizer(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The optimizer over ``groups``: a named one (fused where the device takes it), or the user's callable's.

    Raises:
        InvalidArgumentError: the callable returned no torch Optimizer.
    """
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


class Trainables:
    """What one fine-tuning run trains (encoders, a score module, the value table), read through the facade.

    Attributes:
        query_encoder: the encoder the training queries go through (None for tensor pairs).
        key_encoder: the key encoder, trained with ``train="query+keys"`` (else None: the stored keys stay fixed).
        query_copy: whether ``query_encoder`` is a query-side copy of the key encoder, installed at the commit.
        score: the score (a name, or a module that trains).
        ids: (m,) sorted, the rows of the trainable value table (``train_values=True``), else None.
        values: (m, value_dim) the trainable value table, else None.

    Raises:
        InvalidArgumentError: ``train="query+keys"`` on a database without a key encoder.
    """

    def __init__(self, db: DatabaseProtocol, train: str, train_values: bool, score: str | ScoreFn, text: bool) -> None:
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
        """The trained modules, each once (one encoder may be both the query and the key encoder)."""
        mods = [m for m in (self.query_encoder, self.key_encoder) if m is not None]
        if isinstance(self.score, nn.Module):
            mods.append(self.score)
        return list({id(m): m for m in mods}.values())

    def param_groups(self, lr: float | None, generated: int) -> list[dict[str, Any]]:
        """The optimizer's parameter groups: each module's trainable weights at its lr (``lr``, or its default).

        Raises:
            InvalidArgumentError: nothing to train.
        """
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
        table = self._encoded_keys(uniq, self.db.embeddings(uniq)[0])  # (u, dim)
        keys = table[inverse.to(table.device)]  # (b, k, dim)
        return keys * mask.unsqueeze(-1)  # (b, k, dim)

    def batch_candidates(self, targets: Tensor, b: int) -> Candidates:
        """The batch's distinct target records as every query's candidates (in-batch negatives).

        Args:
            targets: (b,) the target record of each query of the batch.
            b: the batch size (the candidates are shared: expanded, not copied).

        Returns:
            :class:`~kvsearch.nn.attend.Candidates` with ids, mask (b, u), keys (b, u, dim) — re-encoded with grad
            when the key encoder trains, else the stored ones — and values (b, u, value_dim).
        """
        uniq = torch.unique(targets.cpu())  # (u,) sorted
        keys, values, _ = self.db.embeddings(uniq)  # (u, dim), (u, value_dim): one read
        if self.key_encoder is not None:
            keys = self._encoded_keys(uniq, keys)  # (u, dim) with grad
        ids = uniq.to(keys.device).expand(b, -1)  # (b, u)
        mask = torch.ones(b, len(uniq), dtype=torch.bool, device=keys.device)  # (b, u)
        return Candidates(ids=ids, keys=keys.expand(b, -1, -1), values=values.expand(b, -1, -1), mask=mask)

    def _encoded_keys(self, uniq: Tensor, stored: Tensor) -> Tensor:
        """The keys (u, dim) of records ``uniq`` (u,): re-encoded from their texts with grad by the key encoder,
        ``stored`` (u, dim) where a record has no text to encode (-1, a key given as an embedding)."""
        assert self.key_encoder is not None
        texts = self.db.key_texts(uniq, encoded_only=True)  # u texts, None for -1 and keys as / with embeddings
        rows = [r for r, text in enumerate(texts) if text is not None]
        table = stored.clone()  # (u, dim)
        if rows:
            fresh = self.key_encoder([texts[r] for r in rows]).to(table.dtype)  # (r, dim)
            table[torch.tensor(rows, device=table.device)] = fresh.to(table.device)
        return table  # (u, dim)

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


def state_of(module: nn.Module) -> dict[str, Tensor]:
    """A CPU copy of a module's state_dict (what a later ``load_state_dict`` puts back)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}


def snapshot(trained: Trainables) -> dict[str, Any]:
    """The trained state: a CPU copy of every trained module's weights and of the value table."""
    return {
        "modules": [state_of(m) for m in trained.modules()],
        "values": None if trained.values is None else trained.values.detach().to("cpu", copy=True),  # (m, value_dim)
    }


def restore(trained: Trainables, state: dict[str, Any]) -> None:
    """Load a :func:`snapshot` back into the trained modules and value table."""
    for module, weights in zip(trained.modules(), state["modules"]):
        module.load_state_dict(weights)
    if trained.values is not None and state["values"] is not None:
        with torch.no_grad():
            trained.values.copy_(state["values"].to(trained.values.device))  # (m, value_dim)


@torch.no_grad()
def probe(trained: Trainables, query_items: Any, batch_size: int, tensor_pairs: bool) -> None:
    """Check the kept query encoder on a batch of training queries before committing it.

    Finite weights can still give non-finite embeddings (a huge lr leaves weights near the float32 limit, whose
    sums overflow); the commit checks the weights and the re-encoded keys, this the query side.

    Raises:
        NonFiniteError: the query encoder gives NaN or Inf.
    """
    if tensor_pairs or trained.query_encoder is None:
        return
    q = trained.query_encoder.encode(list(query_items[:batch_size])).float()  # (b, dim)
    if not all_finite(q):
        raise NonFiniteError("the trained query encoder gives NaN or Inf embeddings; nothing was written")


def install(db: DatabaseProtocol, trained: Trainables) -> list[tuple[Encoder, bool]]:
    """Mark the trained encoders and install a query-side copy in the database, before the commit.

    Returns:
        The encoders' previous ``trained`` flags, for a commit that fails.
    """
    flags = []
    for encoder in (trained.query_encoder, trained.key_encoder):
        if encoder is not None and all(encoder is not e for e, _ in flags):
            flags.append((encoder, encoder.trained))
            encoder.trained = True
            encoder.eval()
    if trained.query_copy:
        db.query_encoder = trained.query_encoder  # the draft restores the identities if the commit fails
    return flags


def step_loss(
    retriever: Draft,
    db: DatabaseProtocol,
    trained: Trainables,
    q: Tensor,
    targets: Tensor | None,
    target_values: Tensor,
    k: int,
    force: bool,
    pooling: str,
    temperature: float,
    loss_fn: LossFn,
    mixed: MixedPrecision | None = None,
    negatives: str = "candidates",
) -> Tensor:
    """One batch through candidates, attention and the loss. Returns a 0-dim tensor.

    The candidates (``negatives``): the index's top ``k`` from the draft, the target forced in with ``force``
    (``"candidates"``; their keys re-encoded with grad when the key encoder trains); the batch's distinct targets,
    shared by every query (``"in-batch"``, key targets only); or both, the index's candidates then kept as they
    are in the draft (detached hard negatives: re-encoding ``b * k`` keys with grad is what a sentence encoder
    cannot afford). The key encoder and the attention run under ``mixed``'s autocast (none by default); the scores
    the loss sees and the loss itself are float32, outside it.
    """
    in_batch = negatives != "candidates" and targets is not None
    # ids (b, k), keys, values, mask (b, k): chosen in float32 (the index sees the detached queries, outside autocast)
    searched = None  # the index's candidates; with in-batch ones, the target is already among them
    if not in_batch:
        searched = retriever.candidates(q, k, targets=targets if force else None)
    elif negatives == "both":
        searched = retriever.candidates(q, k)
    with contextlib.nullcontext() if mixed is None else mixed.autocast():
        if in_batch:
            assert targets is not None
            cand = trained.batch_candidates(targets, q.shape[0])  # (b, u): the batch's targets, keys with grad
            if searched is not None:
                cand = _with_hard_negatives(cand, searched, q.to(db.device), targets, trained.score)  # (b, u + k)
            keys = cand.keys  # (b, c, dim)
        else:
            assert searched is not None
            cand = searched
            keys = trained.candidate_keys(cand.ids, cand.keys, cand.mask)  # (b, k, dim) float32
        values = trained.candidate_values(cand.ids, cand.values, cand.mask)  # (b, c, value_dim)
        if q.shape[0] == 0:  # a rank with no batch left took part in the collectives above; it has no loss
            return torch.zeros((), device=db.device)
        q = q.to(db.device)  # (b, dim)
        output, weights = attend(
            q, keys, values, score=trained.score, pooling=pooling, mask=cand.mask, temperature=temperature
        )  # (b, value_dim), (b, k) in autocast's dtype where it lowered them
    output, weights = output.float(), weights.float()  # (b, value_dim), (b, k): the loss is taken in float32
    scores = compute_scores(q.unsqueeze(1), keys, trained.score).squeeze(1)  # (b, k) float32, outside autocast
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


#: A hard negative that scores above this fraction of its query's target score is dropped as a likely false negative
#: (a synonym of the target, another word its definition fits): NV-Retriever's "TopK-PercPos" filter (Moreira et al.,
#: 2024), which found 0.95 best. For a target score s < 0 (a gaussian score) the bar is s - 0.05 |s| alike.
HARD_NEGATIVE_MARGIN = 0.95


def _with_hard_negatives(
    batch: Candidates, hard: Candidates, q: Tensor, targets: Tensor, score: str | ScoreFn
) -> Candidates:
    """In-batch candidates (b, u) followed by the index's (b, k) as detached hard negatives. Masked out: an index
    candidate that is also in the batch (it must not count twice in the softmax), and one that scores above
    :data:`HARD_NEGATIVE_MARGIN` of the query's target (likely a false negative). Returns (b, u + k) candidates."""
    assert batch.mask is not None and hard.mask is not None
    seen = (hard.ids.unsqueeze(-1) == batch.ids[:1].unsqueeze(1)).any(-1)  # (b, k) already an in-batch candidate
    hard_keys = hard.keys.detach().to(batch.keys.device, batch.keys.dtype)  # (b, k, dim)
    with torch.no_grad():
        column = torch.searchsorted(batch.ids[0], targets.to(batch.ids.device))  # (b,) in the sorted distinct targets
        positive = batch.keys[torch.arange(len(q), device=q.device), column]  # (b, dim)
        both = torch.cat([positive.unsqueeze(1), hard_keys], 1).float()  # (b, 1 + k, dim): the target, then the hard
        scores = compute_scores(q.detach().float().unsqueeze(1), both, score).squeeze(1)  # (b, 1 + k)
        target, rest = scores[:, :1], scores[:, 1:]  # (b, 1), (b, k)
        close = rest > target - (1 - HARD_NEGATIVE_MARGIN) * target.abs()  # (b, k) for a score of either sign
    return Candidates(
        ids=torch.cat([batch.ids, hard.ids.to(batch.ids.device)], 1),  # (b, u + k)
        keys=torch.cat([batch.keys, hard_keys], 1),  # (b, u + k, dim)
        values=torch.cat([batch.values, hard.values.to(batch.values.device, batch.values.dtype)], 1),
        mask=torch.cat([batch.mask, (hard.mask & ~seen).to(batch.mask.device) & ~close], 1),  # (b, u + k)
    )


@torch.no_grad()
def eval_loss(
    retriever: Draft,
    db: DatabaseProtocol,
    trained: Trainables,
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
        loss = step_loss(retriever, db, trained, q, None, v, k, False, pooling, temperature, loss_fn)
        total += torch.tensor([float(loss) * len(q), len(q)], dtype=torch.float64)
    total = team.sum(total)
    return float(total[0] / total[1])
