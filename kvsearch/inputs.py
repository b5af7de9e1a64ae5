"""What a user passes in, checked and put in one shape: query texts or tensors, record keys and values, metadata.

Every function raises a typed error that says what was expected and what came, before anything is encoded,
searched or written. This module knows nothing of storage, search or autograd: the facade
(:class:`~kvsearch.Database`) calls it first and hands the checked texts and tensors on.

Key texts and text queries are compared after Unicode NFC normalisation and stripping surrounding whitespace
(:func:`normalize_key`, the one place that rule lives); values are stored as given.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import check_batch, check_finite
from kvsearch.encoders import Encoder
from kvsearch.errors import (
    DimensionMismatchError,
    DuplicateKeyError,
    EmptyKeyError,
    InvalidArgumentError,
    MissingEncoderError,
    NonFiniteError,
)

__all__ = [
    "Queries",
    "KeysIn",
    "normalize_key",
    "query_texts",
    "query_tensor",
    "record_side",
    "encode_side",
    "check_metadata",
    "delete_items",
]

Queries = str | Sequence[str] | Tensor | np.ndarray
KeysIn = str | Sequence[str] | Tensor | np.ndarray


def normalize_key(text: str) -> str:
    """A key text or a text query as kvsearch compares it: Unicode NFC, surrounding whitespace stripped.

    "Müller" typed as ``u`` + a combining diaeresis (NFD) and as ``ü`` (NFC) are one key, and so are " 42 " and
    "42" (``str.strip``: spaces, tabs, newlines, no-break and ideographic spaces). Case and inner whitespace
    are kept. Values are never normalised.

    Args:
        text: a key or query text.

    Returns:
        The normalised text (idempotent: normalising it again changes nothing).
    """
    return unicodedata.normalize("NFC", text).strip()


def query_texts(queries: Queries) -> list[str] | None:
    """The query texts of ``queries`` (a str or a list of str), normalised, or None when queries are not text.

    Returns:
        Each text as :func:`normalize_key` makes it, or None.

    Raises:
        InvalidArgumentError: an empty list, a non-str item, an empty or blank text, too many queries.
    """
    if not (isinstance(queries, str) or (isinstance(queries, Sequence) and not isinstance(queries, str))):
        return None
    texts = [queries] if isinstance(queries, str) else list(queries)
    if not texts:
        raise InvalidArgumentError("expected at least one query, got an empty list")
    check_batch(len(texts), "queries")
    out = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidArgumentError(f"expected query texts, got {type(t).__name__} at position {i}")
        text = normalize_key(t)
        if not text:
            raise InvalidArgumentError(f"expected non-empty query texts, got {t!r} at position {i}")
        out.append(text)
    return out


def query_tensor(queries: Tensor | np.ndarray, dim: int) -> tuple[Tensor, bool]:
    """Query embeddings as a float32 (batch, dim) tensor on their own device, and whether one came unbatched.

    Args:
        queries: (dim,) or (batch, dim), a tensor (its graph kept) or a numpy array.
        dim: the database's key dimension.

    Returns:
        queries (batch, dim) float32, and True for a single (dim,) query.

    Raises:
        InvalidArgumentError: not a tensor or array, an empty batch, too many queries.
        DimensionMismatchError: the wrong shape.
        NonFiniteError: NaN or Inf.
    """
    if isinstance(queries, np.ndarray):
        queries = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    if not isinstance(queries, Tensor):
        raise InvalidArgumentError(f"expected a query text, a list of texts or a tensor, got {type(queries).__name__}")
    single = queries.dim() == 1
    q = queries.unsqueeze(0) if single else queries  # (b, dim)
    if q.dim() != 2 or q.shape[1] != dim:
        raise DimensionMismatchError(
            f"expected queries of shape (dim={dim},) or (batch, {dim}), got {tuple(queries.shape)}"
        )
    if q.shape[0] == 0:
        raise InvalidArgumentError("expected at least one query, got an empty batch")
    check_batch(q.shape[0], "queries")
    q = q.float() if q.dtype != torch.float32 else q  # (b, dim)
    check_finite(q, "queries")
    return q, single


def record_side(
    items: KeysIn, name: str, encoder: Encoder | None, dim: int, embeddings: Tensor | np.ndarray | None = None
) -> tuple[list[str | None], Tensor | None]:
    """Check the keys or the values of a write: (texts, None), ([None] * n, embeddings) or (texts, embeddings).

    Texts alone are encoded later; tensors are embeddings without text; texts with ``embeddings`` keep both.

    Nothing is encoded here (that happens under the write lock, see :func:`encode_side`).

    Args:
        items: texts (a str is one record), or embeddings (n, dim) (or (n,) when dim is 1).
        name: ``"keys"`` or ``"values"`` — keys are normalised (:func:`normalize_key`) and checked for
            emptiness and duplicates after it; values are kept as given.
        encoder: the encoder of this side (texts need one, unless their embeddings are given).
        dim: the embedding dimension of this side.
        embeddings: the texts' own embeddings (n, dim), computed elsewhere: the encoder is then not used.

    Returns:
        The texts (or Nones) and the (n, dim) float32 embeddings (or None).

    Raises:
        DimensionMismatchError, NonFiniteError, EmptyKeyError, DuplicateKeyError, InvalidArgumentError,
        MissingEncoderError (texts without embeddings on a side with no encoder).
    """
    if isinstance(items, str):
        items = [items]
    if isinstance(items, np.ndarray) and items.dtype.kind in "fiu":
        items = torch.from_numpy(np.ascontiguousarray(items, dtype=np.float32))
    if isinstance(items, Tensor):
        if embeddings is not None:
            raise InvalidArgumentError(
                f"expected {name} as texts when {name[:-1]}_embeddings= is given, got {name} as a tensor "
                f"(embeddings already): pass them as {name} alone"
            )
        embs = _embeddings(items, name, dim)  # (n, dim)
        return [None] * embs.shape[0], embs
    if not isinstance(items, Sequence):
        raise InvalidArgumentError(f"expected {name} as a list of str or a tensor, got {type(items).__name__}")
    texts = list(items)
    seen: dict[str, int] = {}
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidArgumentError(f"expected {name} as str, got {type(t).__name__} at position {i}")
        if name == "keys":
            key = normalize_key(t)
            if not key:
                raise EmptyKeyError(f"expected a non-empty key, got {t!r} at position {i}")
            if key in seen:
                raise DuplicateKeyError(
                    f"expected unique keys (compared after NFC and stripping surrounding whitespace), "
                    f"got {key!r} at positions {seen[key]} and {i}"
                )
            seen[key] = i
            texts[i] = t = key
        if "\x00" in t:
            raise InvalidArgumentError(f"expected {name} without NUL characters, got one at position {i}")
    if embeddings is not None:
        embs = _embeddings(embeddings, f"{name[:-1]}_embeddings", dim)  # (n, dim)
        if embs.shape[0] != len(texts):
            raise DimensionMismatchError(
                f"expected one row of {name[:-1]}_embeddings per {name[:-1]} ({len(texts)}), got {embs.shape[0]}"
            )
        return texts, embs
    if texts and encoder is None:
        raise MissingEncoderError(
            f"expected {name} as embeddings (n, {dim}), or {name} texts with {name[:-1]}_embeddings=: "
            f"this database has no encoder for {name} text"
        )
    return texts, None


def _embeddings(items: Tensor | np.ndarray, name: str, dim: int) -> Tensor:
    """Given embeddings as a detached float32 (n, dim) tensor: shape and finiteness checked.

    Raises:
        InvalidArgumentError: not a tensor or a numeric array.
        DimensionMismatchError: not (n, dim) (or (n,) when dim is 1).
        NonFiniteError: NaN or Inf.
    """
    if isinstance(items, np.ndarray) and items.dtype.kind in "fiu":
        items = torch.from_numpy(np.ascontiguousarray(items, dtype=np.float32))
    if not isinstance(items, Tensor):
        raise InvalidArgumentError(f"expected {name} as a tensor (n, {dim}), got {type(items).__name__}")
    embs = items.detach().float()
    if embs.dim() == 1 and dim == 1:
        embs = embs.unsqueeze(1)  # (n,) -> (n, 1): scalar values such as regression targets
    if embs.dim() != 2 or embs.shape[1] != dim:
        raise DimensionMismatchError(f"expected {name} of shape (n, {dim}), got {tuple(items.shape)}")
    check_finite(embs, name)
    return embs  # (n, dim)


def encode_side(
    texts: Sequence[str | None], embs: Tensor | None, encoder: Encoder | None, dim: int, name: str
) -> Tensor:
    """The embeddings of one side of a write: the given ones, or the encoder's of the texts. (n, dim) float32.

    Raises:
        NonFiniteError: the encoder produced NaN or Inf.
        DimensionMismatchError: the embeddings are not of dim ``dim``.
    """
    if embs is None:
        embs = encoder.encode(list(texts)).float()  # (n, dim)
        check_finite(embs, f"{name} embeddings from the encoder")
    if embs.shape[1] != dim:
        raise DimensionMismatchError(f"expected {name} embeddings of dim {dim}, got {embs.shape[1]}")
    return embs


def check_metadata(metadata: object, n: int) -> list[dict[str, Any] | None]:
    """One JSON-serialisable dict (or None) per record.

    Raises:
        InvalidArgumentError: not a list of n dicts with str keys, or not JSON-serialisable.
        NonFiniteError: a NaN or infinite number.
    """
    if metadata is None:
        return [None] * n
    if isinstance(metadata, Mapping) and n == 1:
        metadata = [metadata]
    if not isinstance(metadata, Sequence) or len(metadata) != n:
        raise InvalidArgumentError(f"expected a list of {n} metadata dicts, got {type(metadata).__name__}")
    out: list[dict[str, Any] | None] = []
    for i, m in enumerate(metadata):
        if m is None:
            out.append(None)
            continue
        if not isinstance(m, Mapping) or not all(isinstance(key, str) for key in m):
            raise InvalidArgumentError(f"expected metadata as a dict with str keys, got {m!r} at position {i}")
        for key, value in m.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise NonFiniteError(f"expected finite numbers in metadata, got {key}={value} at position {i}")
        try:
            json.dumps(m, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"expected JSON-serialisable metadata at position {i}: {exc}") from None
        out.append(dict(m))
    return out


def delete_items(key_or_keys: object) -> list[str | int]:
    """What a delete names: key texts (normalised, :func:`normalize_key`) and int ids, from one item, a list,
    or an integer tensor / array.

    Raises:
        InvalidArgumentError: an array of non-integers, or an item that is neither str nor int.
    """
    if isinstance(key_or_keys, (Tensor, np.ndarray)):  # ids as an integer tensor or array
        array = key_or_keys.detach().cpu().numpy() if isinstance(key_or_keys, Tensor) else key_or_keys
        if array.dtype.kind not in "iu":
            raise InvalidArgumentError(f"expected integer ids, got an array of {array.dtype}")
        return [int(i) for i in array.reshape(-1).tolist()]
    items = [key_or_keys] if isinstance(key_or_keys, (str, int, np.integer)) else list(key_or_keys)
    out: list[str | int] = []
    for item in items:
        if isinstance(item, str):
            out.append(normalize_key(item))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            out.append(int(item))
        else:
            raise InvalidArgumentError(f"expected key texts or int ids, got {type(item).__name__}")
    return out
