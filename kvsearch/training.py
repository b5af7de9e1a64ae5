"""End-to-end fine-tuning of the retriever: losses, the loop, index refresh, retrieval metrics.

    history = finetune(db, train_pairs, eval_pairs=eval_pairs, loss="retrieval", k=32, epochs=3)
    history.metrics[-1]        # {"epoch": 3, "step": ..., "recall@1": ..., "recall@k": ..., "mrr": ...}
    db.search("Smyth")         # now answered with the fine-tuned query encoder, saved with the database

One step: the query texts go through the (trainable) query encoder with grad; the index picks ``k``
candidates for the detached queries (``Database.candidates``; for the retrieval loss the target record is
forced in when the index missed it, RAG/REALM style); the candidates' keys and values are gathered by id;
``attend`` scores and pools them in torch; the loss is taken on the scores or on the pooled answer, and
the gradient flows back into the query encoder (and, with ``train="query+keys"``, through the re-encoded
candidate keys into the key encoder; with ``train_values=True`` into the value embeddings).

Targets. A pair is ``(query text, target text)``; ``targets="key"`` reads the target as the key of the right
record, ``targets="value"`` as the value text of the answer (no label of which record is right: several
records may share it). The default follows the loss: ``"key"`` for ``"retrieval"``, ``"value"`` for the
answer losses. ``train_pairs`` may also be ``(queries, values)``, two tensors (n, dim) and (n, value_dim), for
databases without text (kernel regression, see :class:`GaussianKernel`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsearch.attention import ScoreFn, attend, compute_scores
from kvsearch.database import Database
from kvsearch.encoders import Encoder, NgramEncoder, SentenceEncoder
from kvsearch.errors import (
    DimensionMismatchError,
    InvalidArgumentError,
    KeyNotFoundError,
    UnknownOptionError,
)

__all__ = [
    "LossName",
    "TrainMode",
    "TargetKind",
    "LOSSES",
    "Batch",
    "History",
    "GaussianKernel",
    "retrieval_loss",
    "answer_loss",
    "answer_mse_loss",
    "evaluate",
    "finetune",
]

LossName = Literal["retrieval", "answer", "answer_mse"]
TrainMode = Literal["query", "query+keys"]
TargetKind = Literal["key", "value"]
LOSSES: tuple[str, ...] = get_args(LossName)
TRAIN_MODES: tuple[str, ...] = get_args(TrainMode)
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)

Pairs = Sequence[tuple[str, str]] | tuple[Tensor, Tensor]
OptimizerSpec = str | Callable[[list[dict[str, Any]]], torch.optim.Optimizer]

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}
_DEFAULT_LR = {"ngram": 1e-2, "sentence": 2e-5, "other": 1e-2}  # per parameter group when lr is None


@dataclass
class Batch:
    """What a loss sees for one batch of b queries and their k candidates.

    Attributes:
        queries: (b, dim) query embeddings, with grad when the query encoder trains.
        scores: (b, k) raw scores of the candidates (before the temperature); -inf never appears.
        weights: (b, k) attention weights (0 on missing candidates).
        output: (b, value_dim) the pooled answer ``weights @ values``.
        ids: (b, k) candidate ids, -1 where none.
        mask: (b, k) True where the candidate exists.
        match: (b, k) True on the target record (key targets), else None.
        target_values: (b, value_dim) the embedding of the right answer.
        temperature: the softmax temperature of the run.
    """

    queries: Tensor
    scores: Tensor
    weights: Tensor
    output: Tensor
    ids: Tensor
    mask: Tensor
    match: Tensor | None
    target_values: Tensor
    temperature: float


LossFn = Callable[[Batch], Tensor]


def retrieval_loss(batch: Batch) -> Tensor:
    """Cross-entropy over the candidates' scores / temperature, the target record being the class.

    Args:
        batch: a :class:`Batch` with ``match`` (key targets; the trainer forces the target among the candidates).

    Returns:
        The mean loss over the queries whose target is among the candidates (a 0-dim tensor).

    Raises:
        InvalidArgumentError: ``batch.match`` is None (targets given as values).
    """
    if batch.match is None:
        raise InvalidArgumentError('the retrieval loss needs key targets (targets="key"), got value targets')
    logits = (batch.scores / batch.temperature).masked_fill(~batch.mask, -math.inf)  # (b, k)
    has = batch.match.any(-1)  # (b,)
    target = batch.match.float().argmax(-1)  # (b,)
    if not bool(has.any()):
        return batch.scores.sum() * 0.0  # () no target in this batch: a zero that keeps the graph
    return F.cross_entropy(logits[has], target[has])  # ()


def answer_loss(batch: Batch) -> Tensor:
    """One minus the cosine between the pooled answer and the target value's embedding, averaged.

    Args:
        batch: a :class:`Batch`.

    Returns:
        A 0-dim tensor in [0, 2].
    """
    return (1 - F.cosine_similarity(batch.output, batch.target_values, dim=-1, eps=1e-8)).mean()  # ()


def answer_mse_loss(batch: Batch) -> Tensor:
    """The mean squared error between the pooled answer and the target value's embedding.

    Args:
        batch: a :class:`Batch`.

    Returns:
        A 0-dim tensor.
    """
    return F.mse_loss(batch.output, batch.target_values)  # ()


_LOSS_FNS: dict[str, LossFn] = {"retrieval": retrieval_loss, "answer": answer_loss, "answer_mse": answer_mse_loss}


class GaussianKernel(nn.Module):
    """The Gaussian (Nadaraya-Watson) score with a learnable bandwidth: ``-((q - k) * w)^2 / 2`` summed over dim.

    A score callable for ``attend``, ``Database.query(score=...)`` and :func:`finetune` (which trains ``w``).
    Memory is O(n m dim): it is meant for low-dimensional keys (kernel regression), not text embeddings.

    Args:
        bandwidth: the initial ``w`` (finite).

    Raises:
        InvalidArgumentError: ``bandwidth`` is not a finite number.
    """

    def __init__(self, bandwidth: float = 1.0) -> None:
        super().__init__()
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, int | float) or not math.isfinite(bandwidth):
            raise InvalidArgumentError(f"expected a finite number as bandwidth, got {bandwidth!r}")
        self.w = nn.Parameter(torch.tensor(float(bandwidth)))

    def forward(self, queries: Tensor, keys: Tensor) -> Tensor:
        """Score every query against every key.

        Args:
            queries: (..., n, dim).
            keys: (..., m, dim), leading dims broadcasting with the queries'.

        Returns:
            Scores (..., n, m).

        Raises:
            DimensionMismatchError: the dims differ.
        """
        if queries.shape[-1] != keys.shape[-1]:
            raise DimensionMismatchError(f"expected keys of dim {queries.shape[-1]}, got {keys.shape[-1]}")
        diff = queries.unsqueeze(-2) - keys.unsqueeze(-3)  # (..., n, m, dim)
        return -0.5 * (diff * self.w).pow(2).sum(-1)  # (..., n, m)


@dataclass
class History:
    """What :func:`finetune` measured.

    Attributes:
        k: the number of candidates (``recall@k`` is recall at this k).
        metrics: one dict per evaluation (before training, then after each epoch), with ``epoch``, ``step``
            and, on text pairs, ``recall@1``, ``recall@k``, ``mrr`` (over the top k), or on tensor pairs
            ``loss`` (the training loss on the eval pairs). Empty without eval pairs.
        losses: the training loss of every step.
        epoch_losses: the mean training loss of every epoch.
        refreshes: how many times the index was rebuilt from re-encoded keys.
        seconds: the wall time of the run.
    """

    k: int
    metrics: list[dict[str, float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    epoch_losses: list[float] = field(default_factory=list)
    refreshes: int = 0
    seconds: float = 0.0


# ----------------------------------------------------------------------------- checks and set-up


def _is_tensor_pairs(pairs: object) -> bool:
    return isinstance(pairs, tuple) and len(pairs) == 2 and all(isinstance(p, Tensor) for p in pairs)


def _check_pairs(pairs: object, name: str, db: Database) -> None:
    if _is_tensor_pairs(pairs):
        queries, values = pairs
        if queries.dim() != 2 or queries.shape[1] != db.dim:
            raise DimensionMismatchError(f"expected {name} queries of shape (n, {db.dim}), got {tuple(queries.shape)}")
        if values.dim() != 2 or values.shape != (queries.shape[0], db.value_dim):
            raise DimensionMismatchError(
                f"expected {name} values of shape ({queries.shape[0]}, {db.value_dim}), got {tuple(values.shape)}"
            )
        if queries.shape[0] == 0:
            raise InvalidArgumentError(f"expected at least one {name} pair, got none")
        return
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Sequence):
        raise InvalidArgumentError(
            f"expected {name} as a list of (query text, target text) or a (queries, values) tensor pair, "
            f"got {type(pairs).__name__}"
        )
    if not pairs:
        raise InvalidArgumentError(f"expected at least one {name} pair, got none")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise InvalidArgumentError(f"expected {name}[{i}] as (query text, target text), got {pair!r:.80}")
    if db.encoder is None and db.query_encoder is None:
        raise InvalidArgumentError(f"expected {name} as tensors: this database has no encoder for query text")


def _target_ids(db: Database, targets: Sequence[str]) -> Tensor:
    id_of_key = db.store.id_of_key
    missing = [t for t in targets if t not in id_of_key]
    if missing:
        raise KeyNotFoundError(f"expected target keys stored in the database, got {len(missing)} that are not: "
                               f"{missing[:5]!r}")  # fmt: skip
    return torch.tensor([id_of_key[t] for t in targets], dtype=torch.long)  # (n,)


def _value_embeddings(db: Database, texts: Sequence[str]) -> Tensor:
    if db.value_encoder is None:
        raise InvalidArgumentError('expected a database with a value encoder for targets="value", got none')
    unique = list(dict.fromkeys(texts))
    embs = db.value_encoder.encode(unique).float().to(db.device)  # (u, value_dim)
    pos = {t: i for i, t in enumerate(unique)}
    return embs[torch.tensor([pos[t] for t in texts], device=db.device)]  # (n, value_dim)


def _kind(module: nn.Module) -> str:
    if isinstance(module, NgramEncoder):
        return "ngram"
    if isinstance(module, SentenceEncoder):
        return "sentence"
    return "other"


def _make_optimizer(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if callable(spec):
        opt = spec(groups)
        if not isinstance(opt, torch.optim.Optimizer):
            raise InvalidArgumentError(f"expected the optimizer callable to return a torch Optimizer, got {opt!r:.60}")
        return opt
    if spec not in _OPTIMIZERS:
        raise UnknownOptionError(f"expected optimizer among {tuple(_OPTIMIZERS)} or a callable, got {spec!r}")
    return _OPTIMIZERS[spec](groups)


# ----------------------------------------------------------------------------- metrics


def _hit_matrix(db: Database, ids: Tensor, target_ids: Tensor | None, target_texts: Sequence[str] | None) -> Tensor:
    """(b, k) True where the candidate is a right answer: the target record, or a record with the target value."""
    if target_ids is not None:
        return (ids == target_ids.to(ids.device).unsqueeze(1)) & (ids >= 0)  # (b, k)
    flat = ids.reshape(-1).cpu().tolist()
    texts = db.store.value_texts([i for i in flat if i >= 0])
    hits = [texts.get(i) == target_texts[row // ids.shape[1]] if i >= 0 else False for row, i in enumerate(flat)]
    return torch.tensor(hits, dtype=torch.bool, device=ids.device).reshape(ids.shape)  # (b, k)


def _ranked(db: Database, q: Tensor, k: int, score: str | ScoreFn) -> Tensor:
    """The k candidate ids per query, best first by ``score`` recomputed in torch. (b, k)."""
    cand = db.candidates(q, k)
    scores = compute_scores(q.to(db.device).unsqueeze(1), cand.keys, score).squeeze(1)  # (b, k)
    scores = scores.masked_fill(~cand.mask, -math.inf)  # (b, k)
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)  # (b, k)
    return cand.ids.gather(1, order)  # (b, k)


@torch.no_grad()
def evaluate(
    db: Database,
    pairs: Sequence[tuple[str, str]],
    *,
    k: int = 10,
    targets: TargetKind = "key",
    query_encoder: Encoder | None = None,
    score: str | ScoreFn | None = None,
    batch_size: int = 512,
) -> dict[str, float]:
    """Retrieval metrics of a database on (query text, target) pairs: recall@1, recall@k and MRR over the top k.

    A query counts as answered at rank r when the r-th best candidate (by ``score``, among the ``k`` the index
    picks) is the target record (``targets="key"``) or holds the target value text (``targets="value"``).

    Args:
        db: the database.
        pairs: ``(query text, target key)`` or ``(query text, target value text)`` pairs.
        k: candidates per query.
        targets: how the target is given, ``"key"`` or ``"value"``.
        query_encoder: encodes the queries; default ``db.query_encoder``, else ``db.encoder``.
        score: re-ranks the candidates; default the database's score.
        batch_size: queries per index search.

    Returns:
        ``{"recall@1": ..., "recall@k": ..., "mrr": ...}``, fractions in [0, 1].

    Raises:
        InvalidArgumentError: bad pairs, k or batch size; KeyNotFoundError: a target key is not stored.
        UnknownOptionError: an unknown ``targets``.
    """
    _check_pairs(pairs, "pairs", db)
    if _is_tensor_pairs(pairs):
        raise InvalidArgumentError("expected (query text, target) pairs for retrieval metrics, got tensors")
    if targets not in TARGET_KINDS:
        raise UnknownOptionError(f"expected targets among {TARGET_KINDS}, got {targets!r}")
    k = _check_int(k, "k")
    batch_size = _check_int(batch_size, "batch_size")
    encoder = next((e for e in (query_encoder, db.query_encoder, db.encoder) if e is not None), None)
    queries = [q for q, _ in pairs]
    target_ids = _target_ids(db, [t for _, t in pairs]) if targets == "key" else None
    first = []
    for start in range(0, len(pairs), batch_size):
        q = encoder.encode(queries[start : start + batch_size]).float()  # (b, dim)
        ids = _ranked(db, q, k, db.score if score is None else score)  # (b, k)
        tid = None if target_ids is None else target_ids[start : start + batch_size]
        texts = None if target_ids is not None else [t for _, t in pairs[start : start + batch_size]]
        hits = _hit_matrix(db, ids, tid, texts)  # (b, k)
        rank = torch.where(hits.any(-1), hits.float().argmax(-1), -1)  # (b,) 0-based, -1 = missed
        first.append(rank.cpu())
    rank = torch.cat(first)  # (n,)
    found = rank >= 0
    return {
        "recall@1": float((rank == 0).float().mean()),
        "recall@k": float(found.float().mean()),
        "mrr": float(torch.where(found, 1.0 / (rank + 1).clamp(min=1), 0.0).mean()),
    }


def _check_int(value: object, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidArgumentError(f"expected {name} as an integer >= {low}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- the loop


class _Run:
    """The state of one fine-tuning run (encoders, trainable tensors, targets)."""

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
        self.values: nn.Parameter | None = None
        if train_values:
            self.values = nn.Parameter(db.store.values.detach().clone())  # (m, value_dim)

    def modules(self) -> list[nn.Module]:
        mods = [m for m in (self.query_encoder, self.key_encoder) if m is not None]
        if isinstance(self.score, nn.Module):
            mods.append(self.score)
        return list({id(m): m for m in mods}.values())

    def param_groups(self, lr: float | None) -> list[dict[str, Any]]:
        groups = []
        for module in self.modules():
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": _DEFAULT_LR[_kind(module)] if lr is None else lr})
        if self.values is not None:
            groups.append({"params": [self.values], "lr": _DEFAULT_LR["other"] if lr is None else lr})
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
        key_of = self.db.store.key_of_id
        rows = [r for r, i in enumerate(uniq.tolist()) if i in key_of]
        table, _, _ = self.db.store.gather(uniq)  # (u, dim)
        table = table.clone()
        if rows:
            fresh = self.key_encoder([key_of[int(uniq[r])] for r in rows]).to(table.dtype)  # (r, dim)
            table[torch.tensor(rows, device=table.device)] = fresh.to(table.device)
        keys = table[inverse.to(table.device)]  # (b, k, dim)
        return keys * mask.unsqueeze(-1)  # (b, k, dim)

    def candidate_values(self, ids: Tensor, stored: Tensor, mask: Tensor) -> Tensor:
        """Values (b, k, value_dim): the stored ones, or gathered from the trainable table."""
        if self.values is None:
            return stored  # (b, k, value_dim)
        rows = self.db.store.rows_of(ids).to(self.values.device)  # (b, k)
        return self.values[rows.clamp(min=0)] * mask.unsqueeze(-1)  # (b, k, value_dim)


def finetune(
    db: Database,
    train_pairs: Pairs,
    *,
    eval_pairs: Pairs | None = None,
    loss: LossName | LossFn = "answer",
    targets: TargetKind | None = None,
    k: int = 32,
    epochs: int = 3,
    refresh_every: int = 200,
    train: TrainMode = "query",
    train_values: bool = False,
    score: str | ScoreFn | None = None,
    pooling: str = "softmax",
    optimizer: OptimizerSpec = "adam",
    lr: float | None = None,
    batch_size: int = 64,
    temperature: float = 0.05,
    seed: int = 0,
    verbose: bool = True,
) -> History:
    """Fine-tune the retriever of a database end to end on (query, target) pairs.

    Args:
        db: the database (its records stay; what changes are the encoders and, optionally, the embeddings).
        train_pairs: ``[(query text, target text), ...]`` or ``(queries (n, dim), values (n, value_dim))``.
        eval_pairs: pairs of the same form, evaluated before training and after each epoch.
        loss: ``"retrieval"`` (cross-entropy over the candidates' scores, the target record forced among
            the candidates), ``"answer"`` (1 - cosine between the pooled answer and the target value's
            embedding; the gradient reaches the query only through the attention weights), ``"answer_mse"``
            (mean squared error instead), or a callable ``(Batch) -> 0-dim tensor``.
        targets: ``"key"`` (the target text is the right record's key) or ``"value"`` (the target text is
            the answer's value text, encoded with the value encoder); default ``"key"`` for the retrieval
            loss and callables, ``"value"`` for the answer losses. Ignored for tensor pairs (values).
        k: candidates per query (the index's top k).
        epochs: passes over ``train_pairs``.
        refresh_every: with ``train="query+keys"``, re-encode the keys and rebuild the index every this many
            steps (and after each epoch, and at the end).
        train: ``"query"``: a query-side copy of the encoder learns (``db.query_encoder``; the stored keys
            and the index never change). ``"query+keys"``: the shared encoder learns, the index is refreshed;
            a value encoder that was the key encoder is kept, untrained, as the value encoder.
        train_values: make the value embeddings trainable; they are written to the store at the end.
        score: the score function, default the database's; an ``nn.Module`` (e.g. :class:`GaussianKernel`)
            trains along.
        pooling: the pooling of the answer losses (see ``kvsearch.attention.pool``).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` or a callable ``(param groups) -> Optimizer``.
        lr: the learning rate; default per part: 1e-2 for n-gram encoders, score modules and values,
            2e-5 for sentence encoders.
        batch_size: pairs per step.
        temperature: the softmax temperature of the scores (0.05 suits cosine scores in [-1, 1]).
        seed: seeds the shuffling and torch (dropout).
        verbose: show a tqdm bar with the step, the loss and the latest recall@1 (or eval loss).

    Returns:
        A :class:`History`. The database then answers with the fine-tuned encoders, which are saved with it
        (``db.save_encoders()``), so reopening the folder gives the same answers.

    Raises:
        InvalidArgumentError: bad pairs or arguments, or nothing to train.
        UnknownOptionError: an unknown loss, train mode, targets or optimizer.
        KeyNotFoundError: a target key is not stored.
        DimensionMismatchError: tensor pairs of the wrong shape.
        EmptyDatabaseError: the database is empty.
    """
    from tqdm.auto import tqdm

    started = time.perf_counter()
    if not isinstance(db, Database):
        raise InvalidArgumentError(f"expected a kvsearch Database, got {type(db).__name__}")
    if len(db) == 0:
        from kvsearch.errors import EmptyDatabaseError

        raise EmptyDatabaseError("expected a database with records to fine-tune on, got an empty one")
    if not callable(loss) and loss not in LOSSES:
        raise UnknownOptionError(f"expected loss among {LOSSES} or a callable, got {loss!r}")
    if train not in TRAIN_MODES:
        raise UnknownOptionError(f"expected train among {TRAIN_MODES}, got {train!r}")
    if targets is None:
        targets = "value" if loss in ("answer", "answer_mse") else "key"
    if targets not in TARGET_KINDS:
        raise UnknownOptionError(f"expected targets among {TARGET_KINDS}, got {targets!r}")
    if loss == "retrieval" and targets != "key":
        raise InvalidArgumentError('the retrieval loss needs targets="key" (which record is right), got "value"')
    k, epochs = _check_int(k, "k"), _check_int(epochs, "epochs")
    refresh_every, batch_size = _check_int(refresh_every, "refresh_every"), _check_int(batch_size, "batch_size")
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not temperature > 0:
        raise InvalidArgumentError(f"expected a temperature > 0, got {temperature!r}")
    if isinstance(lr, bool) or not (lr is None or (isinstance(lr, int | float) and lr > 0)):
        raise InvalidArgumentError(f"expected lr > 0 or None, got {lr!r}")
    _check_pairs(train_pairs, "train_pairs", db)
    if eval_pairs is not None:
        _check_pairs(eval_pairs, "eval_pairs", db)
    tensor_pairs = _is_tensor_pairs(train_pairs)
    if tensor_pairs and loss == "retrieval":
        raise InvalidArgumentError("the retrieval loss needs (query text, target key) pairs, got tensors")
    score = db.score if score is None else score
    loss_fn = loss if callable(loss) else _LOSS_FNS[loss]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)

    if not callable(optimizer) and optimizer not in _OPTIMIZERS:
        raise UnknownOptionError(f"expected optimizer among {tuple(_OPTIMIZERS)} or a callable, got {optimizer!r}")
    run = _Run(db, train, bool(train_values), score, text=not tensor_pairs)
    opt = _make_optimizer(optimizer, run.param_groups(lr))
    device = db.device

    # what each training pair asks for
    if tensor_pairs:
        query_items: Any = train_pairs[0].float().to(device)  # (n, dim)
        target_values = train_pairs[1].float().to(device)  # (n, value_dim)
        target_ids = None
    else:
        query_items = [q for q, _ in train_pairs]
        texts = [t for _, t in train_pairs]
        if targets == "key":
            target_ids = _target_ids(db, texts)  # (n,)
            rows = db.store.rows_of(target_ids).to(device)  # (n,)
            target_values = db.store.values[rows].detach().clone()  # (n, value_dim)
        else:
            target_ids = None
            target_values = _value_embeddings(db, texts)  # (n, value_dim)
    force = target_ids is not None and loss not in ("answer", "answer_mse")
    n = len(query_items)
    steps_per_epoch = math.ceil(n / batch_size)

    history = History(k=k)
    modules = run.modules()
    modes = [m.training for m in modules]

    def measure(epoch: int, step: int) -> None:
        if eval_pairs is None:
            return
        for m in modules:
            m.eval()
        try:
            if _is_tensor_pairs(eval_pairs):
                metrics = {"loss": _eval_loss(db, run, eval_pairs, k, pooling, temperature, loss_fn, batch_size)}
            else:
                metrics = evaluate(
                    db,
                    eval_pairs,
                    k=k,
                    targets=targets,
                    query_encoder=run.query_encoder,
                    score=score,
                    batch_size=max(batch_size, 256),
                )
        finally:
            for m in modules:
                m.train()
        history.metrics.append({"epoch": float(epoch), "step": float(step), **metrics})

    refreshed_at = 0

    def refresh(step: int) -> None:
        nonlocal refreshed_at
        if run.key_encoder is not None and refreshed_at != step:
            db.refresh()  # encodes in eval mode and restores the train mode
            history.refreshes += 1
            refreshed_at = step

    bar = tqdm(total=epochs * steps_per_epoch, desc="finetune", unit="step", disable=not verbose)
    try:
        measure(0, 0)
        for m in modules:
            m.train()
        step = 0
        for epoch in range(1, epochs + 1):
            order = torch.randperm(n, generator=generator)  # (n,)
            epoch_losses = []
            for start in range(0, n, batch_size):
                batch = order[start : start + batch_size]  # (b,)
                if tensor_pairs:
                    q = query_items[batch.to(device)]  # (b, dim)
                else:
                    q = run.query_encoder([query_items[i] for i in batch.tolist()]).float()  # (b, dim)
                tid = None if target_ids is None else target_ids[batch]  # (b,)
                value_t = target_values[batch.to(device)]  # (b, value_dim)
                loss_value = _step_loss(db, run, q, tid, value_t, k, force, pooling, temperature, loss_fn)
                opt.zero_grad(set_to_none=True)
                loss_value.backward()
                opt.step()
                step += 1
                epoch_losses.append(float(loss_value.detach()))
                if step % refresh_every == 0:
                    refresh(step)
                bar.update(1)
                bar.set_postfix(_postfix(epoch_losses[-1], history), refresh=False)
            history.losses.extend(epoch_losses)
            history.epoch_losses.append(sum(epoch_losses) / len(epoch_losses))
            refresh(step)  # the index must match the key encoder before it is measured (and at the end)
            measure(epoch, step)
            bar.set_postfix(_postfix(epoch_losses[-1], history), refresh=True)
    finally:
        bar.close()
        for m, mode in zip(modules, modes):
            m.train(mode)
    _finish(db, run)
    history.seconds = time.perf_counter() - started
    return history


def _postfix(loss: float, history: History) -> dict[str, str]:
    out = {"loss": f"{loss:.4f}"}
    if history.metrics:
        name = "recall@1" if "recall@1" in history.metrics[-1] else "loss"
        out["eval " + name] = f"{history.metrics[-1][name]:.4f}"
    return out


def _step_loss(
    db: Database,
    run: _Run,
    q: Tensor,
    target_ids: Tensor | None,
    target_values: Tensor,
    k: int,
    force: bool,
    pooling: str,
    temperature: float,
    loss_fn: LossFn,
) -> Tensor:
    """One batch through candidates, attention and the loss. Returns a 0-dim tensor."""
    cand = db.candidates(q, k, targets=target_ids if force else None)
    keys = run.candidate_keys(cand.ids, cand.keys, cand.mask)  # (b, k, dim)
    values = run.candidate_values(cand.ids, cand.values, cand.mask)  # (b, k, value_dim)
    q = q.to(db.device)  # (b, dim)
    output, weights = attend(
        q, keys, values, score=run.score, pooling=pooling, mask=cand.mask, temperature=temperature
    )  # (b, value_dim), (b, k)
    scores = compute_scores(q.unsqueeze(1), keys, run.score).squeeze(1)  # (b, k)
    match = None
    if target_ids is not None:
        match = (cand.ids == target_ids.to(cand.ids.device).unsqueeze(1)) & cand.mask  # (b, k)
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
    db: Database,
    run: _Run,
    pairs: tuple[Tensor, Tensor],
    k: int,
    pooling: str,
    temperature: float,
    loss_fn: LossFn,
    batch_size: int,
) -> float:
    queries, values = pairs[0].float().to(db.device), pairs[1].float().to(db.device)
    total = 0.0
    for start in range(0, len(queries), batch_size):
        q, v = queries[start : start + batch_size], values[start : start + batch_size]  # (b, dim), (b, value_dim)
        total += float(_step_loss(db, run, q, None, v, k, False, pooling, temperature, loss_fn)) * len(q)
    return total / len(queries)


def _finish(db: Database, run: _Run) -> None:
    """Install the trained parts in the database and save them with it."""
    for encoder in (run.query_encoder, run.key_encoder):
        if encoder is not None:
            encoder.trained = True
            encoder.eval()
    if run.query_copy:
        db.query_encoder = run.query_encoder
    if run.values is not None:
        db.store.replace_embeddings(values=run.values.detach())
    db.save_encoders()
