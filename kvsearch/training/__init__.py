"""The training wing: fine-tuning a database's retriever end to end.

It owns :func:`finetune` (``loop``: the entry point, a loop over the steps of ``run`` — plan, epoch, evaluate,
keep-best, commit or discard — in a draft generation), what a run trains and one batch's loss (``trainables``), its
options and what it measured (``config``: :class:`FinetuneConfig`, :class:`History`; ``defaults``: the defaults
that depend on the database), the pairs it trains and monitors on (``pairs``), the losses (``losses``), the metrics
and :func:`evaluate` (``metrics``), the precision of the forward passes (``precision``) and the ranks a loop works
with (``team``).

It is written against :class:`~kvsearch.contract.DatabaseProtocol`, a plain or a sharded database alike, and uses
the databases' public methods only (the facade's and its draft's): it knows nothing of the store, the index or the
folder's files.
"""

from __future__ import annotations

from kvsearch.training.config import FinetuneConfig, History
from kvsearch.training.loop import finetune
from kvsearch.training.metrics import evaluate

__all__ = ["FinetuneConfig", "History", "evaluate", "finetune"]
