"""The training wing: fine-tuning a database's retriever end to end.

It owns :func:`finetune` (``loop``: the run in a draft generation, keep-best, one commit or discard), its options
and what it measured (``config``: :class:`FinetuneConfig`, :class:`History`), the losses (``losses``), the metrics
and :func:`evaluate` (``metrics``) and the ranks a loop works with (``team``).

It uses the databases' public methods only (the facade's and its draft's): it knows nothing of the store, the
index or the folder's files.
"""

from __future__ import annotations

from kvsearch.training.config import FinetuneConfig, History
from kvsearch.training.loop import finetune
from kvsearch.training.metrics import evaluate

__all__ = ["FinetuneConfig", "History", "evaluate", "finetune"]
