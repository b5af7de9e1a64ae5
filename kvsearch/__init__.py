"""kvsearch: a differentiable key-value search engine.

A candidate index picks the top-k keys for a query (exact in torch by default, ``"Flat"``; FAISS for the other
specs); attention pooling in torch blends their values into an answer that gradients flow through:
``answer(q) = sum_i alpha(q, k_i) v_i``.
"""

from __future__ import annotations

from kvsearch.database import Answer, Database, Hit
from kvsearch.distributed.reshard import reshard
from kvsearch.encoders.base import Encoder
from kvsearch.encoders.ngram import NgramEncoder
from kvsearch.encoders.sentence import SentenceEncoder
from kvsearch.errors import (
    BadFileError,
    ConfigMismatchError,
    CorruptDatabaseError,
    DatabaseClosedError,
    DatabaseExistsError,
    DatabaseLockedError,
    DatabaseNotFoundError,
    DimensionMismatchError,
    DiskFullError,
    DistributedError,
    DuplicateKeyError,
    EmptyDatabaseError,
    EmptyKeyError,
    FileLimitError,
    ForeignFolderError,
    InconsistentDatabaseError,
    InvalidArgumentError,
    KeyNotFoundError,
    KVSearchError,
    MemoryLimitError,
    MissingDependencyError,
    MissingEncoderError,
    MissingFileError,
    NonFiniteError,
    NothingToRollBackError,
    NotPicklableError,
    NotSupportedError,
    ReadOnlyDatabaseError,
    StorageError,
    StoreChangedError,
    UnknownOptionError,
    UnknownTargetError,
    WrongKindError,
)
from kvsearch.index.faiss_index import Index
from kvsearch.index.torch_index import TorchIndex
from kvsearch.nn import forking as _forking  # noqa: F401  (registers the fork handlers: a child of fork() can search)
from kvsearch.nn.attend import Candidates, attend
from kvsearch.nn.kv_attention import KVAttention
from kvsearch.nn.pooling import pool
from kvsearch.nn.product_keys import ProductKeyMemory, memory_param_groups
from kvsearch.nn.scores import AdditiveScore, compute_scores
from kvsearch.nn.streaming import streaming_attention
from kvsearch.storage import memory_folder as _memory_folder  # noqa: F401  (the opener of ProductKeyMemory(folder=))
from kvsearch.storage.encoder_files import load_encoder
from kvsearch.storage.store import Record
from kvsearch.training.loop import FinetuneConfig, GaussianKernel, History, finetune
from kvsearch.training.metrics import evaluate

__version__ = "0.1.0"

__all__ = [
    "AdditiveScore",
    "Answer",
    "BadFileError",
    "Candidates",
    "ConfigMismatchError",
    "CorruptDatabaseError",
    "Database",
    "DatabaseClosedError",
    "DatabaseExistsError",
    "DatabaseNotFoundError",
    "DatabaseLockedError",
    "DimensionMismatchError",
    "DiskFullError",
    "DistributedError",
    "DuplicateKeyError",
    "EmptyDatabaseError",
    "EmptyKeyError",
    "FileLimitError",
    "ForeignFolderError",
    "InconsistentDatabaseError",
    "Encoder",
    "FinetuneConfig",
    "GaussianKernel",
    "History",
    "Hit",
    "Index",
    "InvalidArgumentError",
    "KVAttention",
    "KVSearchError",
    "KeyNotFoundError",
    "MemoryLimitError",
    "MissingDependencyError",
    "MissingFileError",
    "MissingEncoderError",
    "NgramEncoder",
    "NonFiniteError",
    "NotSupportedError",
    "NothingToRollBackError",
    "NotPicklableError",
    "ProductKeyMemory",
    "ReadOnlyDatabaseError",
    "Record",
    "SentenceEncoder",
    "StorageError",
    "StoreChangedError",
    "TorchIndex",
    "UnknownOptionError",
    "UnknownTargetError",
    "WrongKindError",
    "attend",
    "streaming_attention",
    "compute_scores",
    "evaluate",
    "finetune",
    "load_encoder",
    "memory_param_groups",
    "pool",
    "reshard",
]
