"""Where indexes are made: :func:`make_index` / :func:`load_index`, the one place a spec string becomes an index.

``"Flat"`` (the default) and ``"torch[:dtype]"`` make an exact :class:`~kvsearch.index.torch_index.TorchIndex`;
anything else is an ``index_factory`` string for FAISS's :class:`~kvsearch.index.faiss_index.Index`. Nothing
outside the index modules dispatches on index types. Both give a
:class:`~kvsearch.index.base.CandidateIndex`. It knows nothing of SQLite, text or autograd.

Where to add an index type: a class with the methods of :class:`~kvsearch.index.base.CandidateIndex` in a module
of its own, and a branch for its spec in :func:`make_index` (and :func:`load_index` if it is saved).
"""

from __future__ import annotations

import os

import torch

from kvsearch.errors import InvalidArgumentError
from kvsearch.index.base import CandidateIndex
from kvsearch.index.faiss_index import Index
from kvsearch.index.topk import KeySource, Metric
from kvsearch.index.torch_index import TorchIndex, parse_torch_spec

__all__ = ["make_index", "load_index"]


def make_index(
    spec: str,
    dim: int,
    *,
    metric: Metric = "ip",
    normalize: bool = False,
    source: KeySource | None = None,
    params: dict[str, float] | None = None,
) -> CandidateIndex:
    """An empty index of ``spec``: the one place that maps a spec string to an index class.

    Args:
        spec: ``"Flat"`` (the default: exact, the path chosen per call by :mod:`kvsearch.index.exact_path`),
            ``"torch"``, ``"torch:float16"`` or ``"torch:bfloat16"`` for exact search in torch on a fixed path
            (all :class:`~kvsearch.index.torch_index.TorchIndex`), anything else an ``index_factory`` string for
            :class:`~kvsearch.index.faiss_index.Index` (``"HNSW32"``, ``"IVF256,Flat"``...; ``Index(dim, "Flat")``
            is FAISS's flat index).
        dim: key dimension.
        metric: ``"ip"`` or ``"l2"``.
        normalize: score unit vectors (cosine); needs metric ``"ip"``.
        source: the store to read keys from (a torch index searches its key tensor directly).
        params: search parameters (a torch index takes none), and the build parameters ``efConstruction``
            (HNSW) and ``train_size`` (IVF / PQ: vectors sampled to train on), see
            :class:`~kvsearch.index.faiss_index.Index`.

    Returns:
        The index, empty (a source-bound torch index already sees the source's keys).

    Raises:
        UnknownOptionError: an unknown spec, metric or search parameter.
        InvalidArgumentError: a bad dim or parameter value, or ``normalize`` with metric ``"l2"``.
    """
    dtype: torch.dtype | str | None = "auto" if spec == "Flat" else parse_torch_spec(spec)
    if dtype is None:
        return Index(dim, spec, metric, normalize=normalize, source=source, params=params)
    index = TorchIndex(dim, metric, source=source, normalize=normalize, dtype=dtype)
    index.set_params(**(params or {}))
    return index


def load_index(
    path: str | os.PathLike[str],
    spec: str,
    dim: int,
    *,
    metric: Metric,
    normalize: bool = False,
    source: KeySource | None = None,
    params: dict[str, float] | None = None,
) -> CandidateIndex:
    """Read an index that :meth:`~kvsearch.index.base.CandidateIndex.save` wrote, with the options it is used under.

    Args:
        path: the file. spec, dim, metric, normalize, source, params: as for :func:`make_index`; the search
            parameters in effect are ``params`` (and the type's defaults), not the file's.

    Returns:
        The index as saved.

    Raises:
        CorruptDatabaseError: the file is missing, truncated, foreign or of another dim / metric.
        InvalidArgumentError: a torch spec (a torch index is never saved: it reads its source).
        UnknownOptionError: an unknown spec or metric.
    """
    if parse_torch_spec(spec) is not None:
        raise InvalidArgumentError(
            f"expected a FAISS spec to load, got {spec!r}: a torch index is not saved, make it with make_index()"
        )
    return Index.load(path, dim, spec, metric, params, normalize=normalize, source=source)
