"""What a user passes in, checked and put in one shape: query texts or tensors, record keys and values, metadata.

Every function raises a typed error that says what was expected and what came, before anything is encoded,
searched or written. This module knows nothing of storage, search or autograd: the facade
(:class:`~kvsearch.Database`) and its read and write paths (:class:`~kvsearch.reads.Reads`,
:class:`~kvsearch.writes.Writes`, :class:`~kvsearch.selection.Selection`) call it first and hand the checked texts
and tensors on. A query embedding's own check is :func:`kvsearch.checks.query_tensor` (one rule, shared below).

Key texts and text queries are compared after Unicode NFC normalisation and stripping surrounding whitespace
(:func:`normalize_key`, the one place that rule lives); values are stored as given.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvsearch.checks import (
    array_tensor,
    check_batch,
    check_dense,
    check_finite,
    check_real_tensor,
    check_unicode,
)
from kvsearch.encoders.base import Encoder
from kvsearch.errors import (
    DimensionMismatchError,
    DuplicateKeyError,
    EmptyKeyError,
    InvalidArgumentError,
    MissingEncoderError,
)
from kvsearch.metadata.codec import Checked, checked
from kvsearch.nn.precision import host_reads

__all__ = [
    "Queries",
    "KeysIn",
    "normalize_key",
    "query_texts",
    "query_batch",
    "record_side",
    "encode_side",
    "check_metadata",
    "delete_items",
    "text_list",
    "text_items",
    "NUMBER_KINDS",
    "id_tensor",
    "generation_args",
]

Queries = str | Sequence[str] | Tensor | np.ndarray
KeysIn = str | Sequence[str] | Tensor | np.ndarray  # also a pandas Series (or any ``.to_numpy()`` holder) of str


def text_items(items: object, name: str) -> object:
    """A numpy array of str (dtype ``<U`` or object) or a pandas Series / Index of str as a list of str; anything
    else as it came (a numeric array stays an array: embeddings, or ids).

    A holder with a ``to_numpy()`` method (pandas, polars) is read through it, so a Series of numbers becomes a
    numeric array. Items of an object array are checked by the caller as any list item is.

    Args:
        items: what the user passed.
        name: what it is, for the error message (``"keys"``, ``"queries"``...).

    Returns:
        A list (its numpy str items as plain ``str``), or ``items`` unchanged.

    Raises:
        InvalidArgumentError: an array of str that is not one-dimensional, or an array of bytes.
    """
    if not isinstance(items, (np.ndarray, Tensor, str, bytes)) and callable(getattr(items, "to_numpy", None)):
        items = np.asarray(items.to_numpy())
        items = items if items.flags.writeable else items.copy()  # torch shares no read-only memory (pandas 3)
    if not isinstance(items, np.ndarray) or items.dtype.kind not in "UOS":
        return items
    if items.dtype.kind == "S":
        raise InvalidArgumentError(f"expected {name} as str, got a numpy array of bytes ({items.dtype}): decode it")
    if items.ndim != 1:
        raise InvalidArgumentError(f"expected {name} as a one-dimensional array of str, got shape {items.shape}")
    return [str(t) if isinstance(t, str) else t for t in items.tolist()]  # np.str_ -> str


#: The numpy kinds read as numbers (float, signed and unsigned int) and those refused typed (bool, complex).
NUMBER_KINDS = "fiubc"


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
        InvalidArgumentError: an empty list, a non-str item, an empty or blank text, a text holding a NUL character
            (no key holds one: a query is compared with keys), too many queries.
    """
    queries = text_items(queries, "query texts")
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
        check_unicode(t, f"queries at position {i}")
        text = normalize_key(t)
        if not text:
            raise InvalidArgumentError(f"expected non-empty query texts, got {t!r} at position {i}")
        if "\x00" in text:
            raise InvalidArgumentError(
                f"expected query texts without NUL characters (keys cannot hold one), got one at position {i}"
            )
        out.append(text)
    return out


def query_batch(queries: object, dim: int, targets: object = None) -> tuple[Tensor, Tensor | None]:
    """A batch of query embeddings for candidate gathering, as given (its graph kept), and its target ids.

    Unlike :func:`query_tensor` an empty batch (0, dim) is allowed: it has no candidates.

    Args:
        queries: a floating-point tensor (batch, dim).
        dim: the database's key dimension.
        targets: None, or an integer tensor (batch,) of ids (-1 for none).

    Returns:
        The queries and the targets (int64, or None).

    Raises:
        InvalidArgumentError: not a dense floating-point tensor, targets that are not a dense integer tensor
            (:func:`~kvsearch.checks.check_dense`), too many queries.
        DimensionMismatchError: queries not (batch, dim), targets not (batch,).
        NonFiniteError: NaN or Inf in the queries (not looked for on a GPU).
    """
    if isinstance(queries, Tensor):
        check_dense(queries, "queries")
    if not isinstance(queries, Tensor) or not queries.is_floating_point():
        got = f"a {queries.dtype} tensor" if isinstance(queries, Tensor) else type(queries).__name__
        raise InvalidArgumentError(f"expected queries as a floating-point tensor (batch, {dim}), got {got}")
    if queries.dim() != 2 or queries.shape[1] != dim:
        raise DimensionMismatchError(f"expected queries of shape (batch, {dim}), got {tuple(queries.shape)}")
    check_batch(queries.shape[0], "queries")
    if host_reads(queries.device):  # a GPU's candidates read nothing back to the host (nn.precision.host_reads)
        check_finite(queries, "queries")
    if targets is None:
        return queries, None
    if isinstance(targets, Tensor):
        check_dense(targets, "targets")
    if (
        not isinstance(targets, Tensor)
        or targets.dtype == torch.bool
        or targets.is_floating_point()
        or targets.is_complex()
    ):
        got = f"a {targets.dtype} tensor" if isinstance(targets, Tensor) else type(targets).__name__
        raise InvalidArgumentError(f"expected targets as an integer tensor of ids (batch,), got {got}")
    if tuple(targets.shape) != (queries.shape[0],):
        raise DimensionMismatchError(f"expected targets of shape ({queries.shape[0]},), got {tuple(targets.shape)}")
    return queries, targets.long()


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
    items = text_items(items, name)
    if isinstance(items, np.ndarray) and items.dtype.kind in NUMBER_KINDS:
        items = array_tensor(items, name)
    if isinstance(items, Tensor):
        if embeddings is not None:
            raise InvalidArgumentError(
                f"expected {name} as texts when {name[:-1]}_embeddings= is given, got {name} as a tensor "
                f"(embeddings already): pass them as {name} alone"
            )
        embs = _embeddings(items, name, dim)  # (n, dim)
        return [None] * embs.shape[0], embs
    if not isinstance(items, Sequence):
        got = f"an array of {items.dtype}" if isinstance(items, np.ndarray) else type(items).__name__
        raise InvalidArgumentError(f"expected {name} as a list of str or a tensor, got {got}")
    texts = list(items)
    seen: dict[str, int] = {}
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidArgumentError(f"expected {name} as str, got {type(t).__name__} at position {i}")
        check_unicode(t, f"{name} at position {i}")
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
    if isinstance(items, np.ndarray) and items.dtype.kind in NUMBER_KINDS:
        items = array_tensor(items, name)
    if not isinstance(items, Tensor):
        raise InvalidArgumentError(f"expected {name} as a tensor (n, {dim}), got {type(items).__name__}")
    check_real_tensor(items, name)
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
    """One JSON-serialisable dict (or None) per record, each checked once here: a
    :class:`~kvsearch.metadata.codec.Checked` dict that carries the JSON text it is stored as (one already checked
    passes as it is).

    Raises:
        InvalidArgumentError: not a list of n dicts with str keys, or metadata that cannot be stored (see
            :func:`kvsearch.metadata.codec.check`: a NUL character, nesting past its ``MAX_DEPTH``, a cycle...).
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
        if not isinstance(m, Mapping):
            raise InvalidArgumentError(f"expected metadata as a dict with str keys, got {m!r} at position {i}")
        out.append(m if type(m) is Checked else checked(m, f"metadata at position {i}"))
    return out


def delete_items(key_or_keys: object) -> list[str | int]:
    """What a delete names: key texts (normalised, :func:`normalize_key`) and int ids, from one item, a list,
    or an integer tensor / array.

    An int id may be any size: one outside int64 is simply not stored (the delete then raises
    :class:`~kvsearch.KeyNotFoundError`, as for any id that is not stored).

    Raises:
        InvalidArgumentError: an array of non-integers, an item that is neither str nor int, text that is not
            valid Unicode, or something that is neither an item nor a list / tuple of them (a dict, a set, a
            generator, bytes, None, a float).
    """
    key_or_keys = text_items(key_or_keys, "keys to delete")
    if isinstance(key_or_keys, Tensor):  # ids as an integer tensor: dense, of an integer dtype
        return id_tensor(key_or_keys).reshape(-1).tolist()
    if isinstance(key_or_keys, np.ndarray):  # or array
        if key_or_keys.dtype.kind not in "iu":
            raise InvalidArgumentError(f"expected integer ids, got an array of {key_or_keys.dtype}")
        return [int(i) for i in key_or_keys.reshape(-1).tolist()]
    if isinstance(key_or_keys, (str, int, np.integer)):
        items: Sequence[object] = [key_or_keys]
    elif isinstance(key_or_keys, Sequence) and not isinstance(key_or_keys, (bytes, bytearray)):
        items = key_or_keys
    else:
        raise InvalidArgumentError(
            f"expected a key text, an int id, a list of them or an integer tensor, got {type(key_or_keys).__name__}"
        )
    out: list[str | int] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            check_unicode(item, f"keys to delete at position {i}")
            out.append(normalize_key(item))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            out.append(int(item))
        else:
            raise InvalidArgumentError(f"expected key texts or int ids, got {type(item).__name__} at position {i}")
    return out


def text_list(texts: object, name: str) -> list[str]:
    """Texts to look up (keys, values): a list or tuple of valid Unicode strs (or a numpy array / pandas Series of
    str, :func:`text_items`), possibly empty.

    Raises:
        InvalidArgumentError: a single str (a list is expected), not a list or tuple, a non-str item, or text that
            is not valid Unicode.
    """
    texts = text_items(texts, name)
    if isinstance(texts, (str, bytes, bytearray)) or not isinstance(texts, Sequence):
        raise InvalidArgumentError(f"expected {name} as a list of str, got {type(texts).__name__}")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise InvalidArgumentError(f"expected {name} as str, got {type(t).__name__} at position {i}")
        check_unicode(t, f"{name} at position {i}")
    return out


_INT64 = (-(2**63), 2**63 - 1)


def id_tensor(ids: object) -> Tensor:
    """Ids to read by: an int64 CPU tensor, from an integer tensor or array (any shape) or a list / tuple of ints.

    An int outside int64 cannot be a stored id: it becomes -1 (no record), so reads by it find nothing, as for
    any id that is not stored.

    Raises:
        InvalidArgumentError: floats, bools, complex numbers or anything else that is not an integer id; a sparse,
            nested, quantized or meta tensor (:func:`~kvsearch.checks.check_dense`).
    """
    if isinstance(ids, Tensor):
        check_dense(ids, "ids")
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise InvalidArgumentError(f"expected integer ids, got a tensor of {ids.dtype}")
        return ids.detach().to("cpu", torch.long)
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"expected integer ids, got an array of {ids.dtype}")
        wide = np.asarray(ids, dtype=np.int64)  # a uint64 above int64 wraps around: made -1 below
        if ids.dtype.kind == "u":
            wide = np.where(ids > _INT64[1], -1, wide)
        return torch.from_numpy(np.ascontiguousarray(wide))
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):
        raise InvalidArgumentError(f"expected ids as a list of int or an integer tensor, got {type(ids).__name__}")
    out: list[int] = []
    for i, item in enumerate(ids):
        if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
            raise InvalidArgumentError(f"expected int ids, got {type(item).__name__} at position {i}")
        out.append(int(item) if _INT64[0] <= int(item) <= _INT64[1] else -1)
    return torch.tensor(out, dtype=torch.long)


def generation_args(
    values: object, summary: object, reencode: object, value_dim: int
) -> tuple[tuple[Tensor, Tensor] | None, dict[str, Any] | None, set[str] | None]:
    """The options of a new generation (``Database.commit_generation``), checked.

    Args:
        values: None, or (ids (n,) integer tensor, value embeddings (n, value_dim) float tensor).
        summary: None, or a JSON-serialisable dict with str keys.
        reencode: None, or a set (list, tuple) among ``"keys"`` and ``"values"``.
        value_dim: the database's value dimension.

    Returns:
        The three, normalised (the ids int64, the summary a dict, reencode a set).

    Raises:
        InvalidArgumentError: anything of another kind.
        DimensionMismatchError: ids and embeddings that do not line up, or embeddings not of ``value_dim``.
        NonFiniteError: NaN or Inf in the embeddings.
    """
    if values is not None:
        if not isinstance(values, (tuple, list)) or len(values) != 2:
            raise InvalidArgumentError(f"expected values as (ids, embeddings), got {type(values).__name__}")
        ids, embs = id_tensor(values[0]), values[1]
        if isinstance(embs, Tensor):
            check_dense(embs, "value embeddings")
        if not isinstance(embs, Tensor) or not embs.is_floating_point():
            got = f"a tensor of {embs.dtype}" if isinstance(embs, Tensor) else type(embs).__name__
            raise InvalidArgumentError(f"expected value embeddings as a float tensor, got {got}")
        if ids.dim() != 1 or embs.shape != (len(ids), value_dim):
            raise DimensionMismatchError(
                f"expected ids (n,) and value embeddings (n, {value_dim}), "
                f"got {tuple(ids.shape)} and {tuple(embs.shape)}"
            )
        check_finite(embs, "value embeddings")
        values = (ids, embs)
    if summary is not None:
        if not isinstance(summary, Mapping) or not all(isinstance(key, str) for key in summary):
            raise InvalidArgumentError(f"expected summary as a dict with str keys, got {type(summary).__name__}")
        try:  # stored as JSON, in UTF-8
            json.dumps(summary, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"expected a JSON-serialisable summary: {exc}") from None
        summary = dict(summary)
    if reencode is not None:
        parts = {"keys", "values"}
        if not isinstance(reencode, (set, frozenset, list, tuple)) or not all(
            isinstance(p, str) and p in parts for p in reencode
        ):
            raise InvalidArgumentError(f'expected reencode as a set among {{"keys", "values"}}, got {reencode!r}')
        reencode = set(reencode)
    return values, summary, reencode
