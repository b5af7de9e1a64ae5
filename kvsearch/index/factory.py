"""The index kinds, in one registry: :data:`INDEX_KINDS`, and :func:`make_index` / :func:`load_index`, which read it.

A spec string names the kind of index a database uses (``Database(..., index=spec)``, ``kvsearch build --index``):

- ``"Flat"`` (the default, :data:`DEFAULT_INDEX`) makes the exact :class:`~kvsearch.index.torch_index.TorchIndex`,
  whose path (float32 or half-precision scan) is picked per call (:mod:`kvsearch.index.exact_path`);
- ``"torch"``, ``"torch:float16"``, ``"torch:bfloat16"`` make a :class:`~kvsearch.index.torch_index.TorchIndex` on a
  fixed path;
- any other spec is an ``index_factory`` string for FAISS's :class:`~kvsearch.index.faiss_index.Index`
  (``"HNSW32"``, ``"IVF256,Flat"``...).

Each kind is one :class:`IndexKind` entry: which specs it takes, how to make one, how to read a saved one back, and
how to name it in help texts. Adding an index kind is adding an entry (before the FAISS one, which takes every spec
left): a class with the methods of :class:`~kvsearch.index.base.CandidateIndex` in a module of its own, and its
entry here. Nothing outside this module dispatches on spec strings; the CLI's help reads :func:`describe_specs`.
Every kind gives a :class:`~kvsearch.index.base.CandidateIndex`. It knows nothing of SQLite, text or autograd.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.index.base import CandidateIndex
from kvsearch.index.faiss_index import Index
from kvsearch.index.topk import KeySource, Metric
from kvsearch.index.torch_index import TORCH_DTYPES, TorchIndex

__all__ = [
    "parse_torch_spec",
    "DEFAULT_INDEX",
    "INDEX_KINDS",
    "IndexKind",
    "index_kind",
    "describe_specs",
    "make_index",
    "load_index",
]

#: The spec of a new database's index when none is given (the stored configuration records it).
DEFAULT_INDEX = "Flat"


def parse_torch_spec(spec: str) -> torch.dtype | None:
    """The key dtype of a ``"torch"`` index spec, or None when ``spec`` is not one.

    ``"torch"`` searches the float32 keys; ``"torch:bfloat16"`` and ``"torch:float16"`` scan a half-precision
    copy and rescore exactly (see the module docstring).

    Raises:
        UnknownOptionError: ``spec`` starts with ``"torch"`` but names no known dtype.
    """
    if not isinstance(spec, str) or not spec.startswith("torch"):
        return None
    if spec == "torch":
        return torch.float32
    name = spec[len("torch:") :] if spec.startswith("torch:") else None
    if name not in TORCH_DTYPES:
        raise UnknownOptionError(
            f"expected a torch index spec 'torch', 'torch:float16' or 'torch:bfloat16', got {spec!r}"
        )
    return TORCH_DTYPES[name]


@dataclass(frozen=True)
class IndexKind:
    """One kind of index: the specs it takes, how one is made and read back, and how help texts name it.

    Attributes:
        name: the kind's name, its key in :data:`INDEX_KINDS`.
        takes: which specs are this kind's: ``"name"`` the name itself, ``"prefix"`` every spec that starts with
            the name (``"torch:bfloat16"``), ``"any"`` every spec (the last entry: FAISS).
        make: ``make(spec, dim, metric=, normalize=, source=, params=)``: an empty index of ``spec`` (a source-bound
            exact index already sees the source's keys). Raises UnknownOptionError / InvalidArgumentError on a bad
            spec, option or parameter.
        load: ``load(path, spec, dim, metric=, normalize=, source=, params=)``: the index that
            :meth:`~kvsearch.index.base.CandidateIndex.save` wrote; a kind that is never saved (made again from its
            source as fast as a file could be read) refuses with InvalidArgumentError.
        specs: the spec strings shown to users (examples, where the kind takes many).
        summary: what the kind is, in a few words, for help texts.
    """

    name: str
    takes: Literal["name", "prefix", "any"]
    make: Callable[..., CandidateIndex]
    load: Callable[..., CandidateIndex]
    specs: tuple[str, ...]
    summary: str


def _torch_index(
    dim: int,
    dtype: object,
    *,
    metric: Metric,
    normalize: bool,
    source: KeySource | None,
    params: dict[str, float] | None,
) -> TorchIndex:
    """A :class:`TorchIndex` of key dtype ``dtype`` (``"auto"``: the path picked per call); ``params`` refused."""
    index = TorchIndex(dim, metric, source=source, normalize=normalize, dtype=dtype)
    index.set_params(**(params or {}))
    return index


def _make_flat(spec: str, dim: int, **options: object) -> CandidateIndex:
    """``"Flat"``: the exact torch index, its path picked per call."""
    return _torch_index(dim, "auto", **options)


def _make_torch(spec: str, dim: int, **options: object) -> CandidateIndex:
    """``"torch[:dtype]"``: the exact torch index on the dtype's fixed path."""
    return _torch_index(dim, parse_torch_spec(spec), **options)


def _load_torch(path: str | os.PathLike[str], spec: str, dim: int, **options: object) -> CandidateIndex:
    """A torch index is never saved: refused (an unknown dtype says so first).

    Raises:
        UnknownOptionError: ``spec`` names no known dtype.
        InvalidArgumentError: always else.
    """
    parse_torch_spec(spec)
    raise InvalidArgumentError(
        f"expected a FAISS spec to load, got {spec!r}: a torch index is not saved, make it with make_index()"
    )


def _make_faiss(
    spec: str,
    dim: int,
    *,
    metric: Metric,
    normalize: bool,
    source: KeySource | None,
    params: dict[str, float] | None,
) -> CandidateIndex:
    """An ``index_factory`` string: FAISS's :class:`Index`."""
    return Index(dim, spec, metric, normalize=normalize, source=source, params=params)


def _load_faiss(
    path: str | os.PathLike[str],
    spec: str,
    dim: int,
    *,
    metric: Metric,
    normalize: bool,
    source: KeySource | None,
    params: dict[str, float] | None,
) -> CandidateIndex:
    """A FAISS :class:`Index` file (also what an earlier version saved for ``"Flat"``, then a FAISS flat index)."""
    return Index.load(path, dim, spec, metric, params, normalize=normalize, source=source)


#: Every index kind, by name, in the order a spec is matched: the first that takes it makes it. The FAISS entry
#: takes every spec and stays last.
INDEX_KINDS: dict[str, IndexKind] = {
    kind.name: kind
    for kind in (
        IndexKind(
            name="Flat",
            takes="name",
            make=_make_flat,
            load=_load_faiss,
            specs=("Flat",),
            summary="exact, in torch, its path picked per call; the default",
        ),
        IndexKind(
            name="torch",
            takes="prefix",
            make=_make_torch,
            load=_load_torch,
            specs=("torch", *(f"torch:{name}" for name in TORCH_DTYPES if name != "float32")),
            summary="exact, in torch, on a fixed path",
        ),
        IndexKind(
            name="faiss",
            takes="any",
            make=_make_faiss,
            load=_load_faiss,
            specs=("HNSW32", "IVF256,Flat", "IVF256,PQ16"),
            summary="a FAISS index_factory string: any other spec",
        ),
    )
}


def index_kind(spec: str) -> IndexKind:
    """The kind of index ``spec`` makes: the first entry of :data:`INDEX_KINDS` that takes it."""
    for kind in INDEX_KINDS.values():
        if kind.takes == "any" or spec == kind.name:
            return kind
        if kind.takes == "prefix" and isinstance(spec, str) and spec.startswith(kind.name):
            return kind
    raise AssertionError("the last index kind takes every spec")  # pragma: no cover - INDEX_KINDS ends with one


def describe_specs() -> str:
    """The index specs in one line, for help texts: each kind's specs and what it is, from :data:`INDEX_KINDS`."""
    parts = []
    for kind in INDEX_KINDS.values():
        specs = ", ".join(f'"{spec}"' for spec in kind.specs)
        parts.append(f"{specs} ({kind.summary})")
    return "; ".join(parts)


def make_index(
    spec: str,
    dim: int,
    *,
    metric: Metric = "ip",
    normalize: bool = False,
    source: KeySource | None = None,
    params: dict[str, float] | None = None,
) -> CandidateIndex:
    """An empty index of ``spec``, made by the kind that takes it (:func:`index_kind`).

    Args:
        spec: ``"Flat"`` (the default: an exact :class:`~kvsearch.index.torch_index.TorchIndex`, the path chosen per
            call by :mod:`kvsearch.index.exact_path`), ``"torch"``, ``"torch:float16"`` or ``"torch:bfloat16"``
            (a :class:`~kvsearch.index.torch_index.TorchIndex` on a fixed path), anything else an ``index_factory``
            string for FAISS's :class:`~kvsearch.index.faiss_index.Index` (``"HNSW32"``, ``"IVF256,Flat"``...;
            ``Index(dim, "Flat")`` is FAISS's flat index).
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
    options = {"metric": metric, "normalize": normalize, "source": source, "params": params}
    return index_kind(spec).make(spec, dim, **options)


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
        The index as saved (a FAISS :class:`~kvsearch.index.faiss_index.Index`: the kind that is saved).

    Raises:
        CorruptDatabaseError: the file is missing, truncated, foreign or of another dim / metric.
        InvalidArgumentError: the spec of a kind that is never saved (a torch index reads its source).
        UnknownOptionError: an unknown spec or metric.
    """
    options = {"metric": metric, "normalize": normalize, "source": source, "params": params}
    return index_kind(spec).load(path, spec, dim, **options)
