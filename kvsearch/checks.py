"""What is refused up front: the argument checks every module shares, their constants, and the resource limits.

One function per rule, so a rule reads the same everywhere it applies: ``k``, finiteness, the device,
the temperature, batch sizes, positive integers, folder paths, tensor layouts (:func:`check_dense`), query
embeddings (:func:`query_tensor`: checked into one (batch, dim) float32 shape at the door, trusted below). Each raises
a typed error from :mod:`kvsearch.errors` that says what was expected and what came, before any work is done.

## Resource limits

Caps (documented in ``docs/RELIABILITY.md``):

- ``MAX_BATCH`` records or queries per call and ``MAX_K`` candidates per query (above);
- the memory an operation may use: :data:`MEMORY_FRACTION` of the memory the system reports available
  (``MemAvailable`` in ``/proc/meminfo``, or psutil where installed), or ``KVSEARCH_MEMORY_LIMIT`` bytes
  when that environment variable is set.

An operation whose estimated size exceeds that budget raises :class:`~kvsearch.errors.MemoryLimitError`
before it writes anything.

Open files: an open database holds at most :data:`FILES_PER_DATABASE` file descriptors, a closed one none. Opening
many at once (the shards of a sharded database) is checked against the process's open-file limit up front
(:func:`check_open_files`): the soft limit is raised toward the hard one when that is enough, as Go's runtime does at
start, else :class:`~kvsearch.errors.FileLimitError` names the limit and the count before anything is opened.

This module knows nothing of FAISS, SQLite, text or training.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from numbers import Real
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from kvsearch.errors import (
    DimensionMismatchError,
    FileLimitError,
    InvalidArgumentError,
    MemoryLimitError,
    NonFiniteError,
)

__all__ = [
    "MAX_K",
    "MAX_BATCH",
    "MAX_DIM",
    "MAX_NAME_BYTES",
    "COSINE_EPS",
    "CHUNK_ELEMENTS",
    "check_k",
    "all_finite",
    "check_finite",
    "check_device",
    "check_temperature",
    "check_batch",
    "check_int",
    "check_dim",
    "check_seconds",
    "check_dense",
    "check_real_tensor",
    "check_path",
    "check_unicode",
    "array_tensor",
    "query_tensor",
    "MEMORY_FRACTION",
    "available_memory",
    "memory_budget",
    "check_fits",
    "index_bytes",
    "FILES_PER_DATABASE",
    "FILES_RESERVED",
    "open_files",
    "file_limits",
    "check_open_files",
]

#: The largest ``k`` a search accepts. FAISS allocates ``batch x k`` results up front, so an unbounded
#: ``k`` is a memory hazard; 65,536 candidates per query is far past any useful attention width.
MAX_K = 65_536
#: The most records one add / upsert call, or queries one search / query call, may carry.
MAX_BATCH = 1_000_000
#: The largest embedding dimension (keys, values, encoders, indexes, score modules). FAISS takes a C int and
#: crashes on a dim past it; 65,536 is far past any embedding model's (384-4,096).
MAX_DIM = 65_536
#: The floor on a norm before dividing by it (as ``F.normalize``): a zero vector has cosine 0 with everything.
COSINE_EPS = 1e-12
#: Score elements (batch x chunk) a chunked scan computes at once: 2^22 float32 = 16 MiB per buffer.
CHUNK_ELEMENTS = 1 << 22

#: The longest file or folder name most file systems take (NAME_MAX on Linux, macOS and Windows).
MAX_NAME_BYTES = 255

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_k(k: object, *, allow_all: bool = False) -> int | Literal["all"]:
    """``k`` as an int in [1, MAX_K] (or ``"all"`` where allowed).

    Raises:
        InvalidArgumentError: anything else (bools included).
    """
    if allow_all and isinstance(k, str) and k == "all":
        return "all"
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
        allowed = f"an integer in [1, {MAX_K}]" + (' or "all"' if allow_all else "")
        raise InvalidArgumentError(f"expected k as {allowed}, got {k!r}")
    return int(k)


def all_finite(x: Tensor) -> bool:
    """Whether ``x`` holds no NaN and no Inf.

    One reduction and one number read: a NaN or an infinity makes the sum non-finite, and finite numbers have a
    finite sum unless it overflows, so only a non-finite sum is looked at again with ``torch.aminmax`` (which
    propagates NaN and returns an infinity if there is one). On the CPU the sum is ~6x faster than aminmax on a
    single query (~2 us: this runs several times per search) and no slower on large tensors; both are far faster
    than ``torch.isfinite(x).all()``, which first writes a boolean tensor the size of ``x``.
    """
    if x.numel() == 0:
        return True
    x = x.detach()
    if x.is_floating_point() and math.isfinite(x.sum().item()):
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_finite(x: Tensor, name: str = "queries") -> None:
    """Raise :class:`NonFiniteError` if ``x`` holds NaN or Inf, saying how many and where.

    Raises:
        NonFiniteError: ``x`` holds NaN or Inf.
    """
    if not all_finite(x):
        bad = int((~torch.isfinite(x.detach())).sum())
        raise NonFiniteError(
            f"{name} must be finite: expected no NaN or Inf, got {bad} non-finite entries "
            f"in {name} of shape {tuple(x.shape)}"
        )


def check_device(device: object) -> torch.device:
    """The torch device to use: the given one if this machine has it, else CUDA when present, else the CPU.

    Raises:
        InvalidArgumentError: not a device name, or a device this machine does not have.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:  # torch.device(2**70): ValueError
        got = f"{device!r} ({exc})"
        raise InvalidArgumentError(f"expected a torch device such as 'cpu' or 'cuda:0', got {got}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"expected device 'cpu' or 'cuda[:n]', got {device!r}")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise InvalidArgumentError(f"expected an available device, got {device!r}: no such CUDA device here")
    return dev


def check_temperature(temperature: object) -> float:
    """``temperature`` as a float if it is a finite number > 0 (not a bool).

    Raises:
        InvalidArgumentError: anything else (0, a negative number, NaN, inf, a bool, a str).
    """
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, Real)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise InvalidArgumentError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_batch(n: int, name: str) -> None:
    """Refuse more than :data:`MAX_BATCH` records or queries in one call.

    Raises:
        InvalidArgumentError: ``n > MAX_BATCH``.
    """
    if n > MAX_BATCH:
        raise InvalidArgumentError(f"expected at most {MAX_BATCH:,} {name} per call (MAX_BATCH), got {n:,}")


def check_int(value: object, name: str, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int if it is an integer >= ``low`` (and <= ``high`` when given), not a bool.

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(f"expected {name} as an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise InvalidArgumentError(f"expected {name} as an integer in [{low}, {high:,}], got {value!r}")
    return int(value)


def check_dim(value: object, name: str = "dim") -> int:
    """``value`` as an int if it is an embedding dimension: an integer in [1, :data:`MAX_DIM`] (not a bool).

    Raises:
        InvalidArgumentError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= MAX_DIM:
        raise InvalidArgumentError(f"expected {name} as an integer in [1, {MAX_DIM:,}] (MAX_DIM), got {value!r}")
    return int(value)


def check_seconds(value: object, name: str) -> float:
    """``value`` as a float if it is a number of seconds a thread may wait: in [0, ``threading.TIMEOUT_MAX``].

    Raises:
        InvalidArgumentError: anything else (a bool, NaN, inf, a negative number, a str).
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not 0 <= value <= threading.TIMEOUT_MAX  # NaN fails both comparisons
    ):
        top = f"{threading.TIMEOUT_MAX:.3g}"
        raise InvalidArgumentError(f"expected {name} as a number of seconds in [0, {top}], got {value!r}")
    return float(value)


def check_dense(x: Tensor, name: str) -> None:
    """Refuse a tensor whose numbers cannot be read in place as a dense array: a sparse layout (COO, CSR, CSC,
    BSR, BSC), a nested tensor (ragged rows), a quantized tensor, or one on the ``meta`` device (a shape, no data).

    Every tensor argument of kvsearch (queries, keys, values, ids, targets, masks) passes here first. A strided
    tensor passes whether contiguous or not (transposed, sliced, expanded with stride 0): torch reads it by its
    strides and the index copies it once. Only attributes are read: no copy, no GPU sync, and no graph break
    under ``torch.compile``.

    Args:
        x: the tensor.
        name: what it is, for the message (``"queries"``, ``"keys"``...).

    Raises:
        InvalidArgumentError: ``x`` is of another layout or on the meta device; the message names the layout
            and the conversion (``.to_dense()``, ``.dequantize()``...).
    """
    # is_meta is 6x faster than device.type, but torch.compile traces it into the graph (a break): asked outside it
    meta = not torch.compiler.is_compiling() and x.is_meta
    if x.layout == torch.strided and not x.is_nested and not x.is_quantized and not meta:
        return
    if x.is_nested:
        got = "a nested tensor (rows of different lengths): pad it (torch.nested.to_padded_tensor) or stack it"
    elif x.layout != torch.strided:
        got = f"a {str(x.layout).removeprefix('torch.')} tensor: call .to_dense() first"
    elif x.is_quantized:
        got = f"a quantized tensor of {x.dtype}: call .dequantize() first"
    else:
        got = "a tensor on the meta device (a shape without data): create it on the cpu or cuda"
    raise InvalidArgumentError(f"expected {name} as a dense (strided) tensor on the cpu or cuda, got {got}")


def check_real_tensor(x: Tensor, name: str) -> None:
    """Refuse a tensor whose numbers are not real: complex (the imaginary part would be dropped) or bool, or
    one of a layout that cannot be read as a dense array (:func:`check_dense`).

    Raises:
        InvalidArgumentError: ``x`` is complex or bool, sparse, nested, quantized or on the meta device.
    """
    check_dense(x, name)
    if x.is_complex() or x.dtype == torch.bool:
        raise InvalidArgumentError(f"expected {name} as a float (or integer) tensor, got a tensor of {x.dtype}")


def check_path(path: object, *, optional: bool = True) -> None:
    """A database path: None (when ``optional``: a database in memory), str or PathLike, non-empty, without NUL
    (which the OS would cut or refuse), that the file system can encode, with no name longer than
    :data:`MAX_NAME_BYTES` (the OS would raise ENAMETOOLONG).

    Raises:
        InvalidArgumentError: anything else.
    """
    if path is None and optional:
        return
    if path is None:
        raise InvalidArgumentError("expected a folder path (str or PathLike), got None")
    if not isinstance(path, (str, os.PathLike)):
        none = " or None" if optional else ""
        raise InvalidArgumentError(f"expected a folder path (str or PathLike){none}, got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or "\x00" in text or not text.strip():
        raise InvalidArgumentError(f"expected a non-empty folder path without NUL characters, got {text!r}")
    try:
        raw = os.fsencode(text)  # surrogate-escaped bytes are fine, a lone surrogate of another range is not
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(f"expected a path the file system can encode, got {text[:80]!r}: {exc}") from None
    longest = max(len(name) for name in raw.split(os.sep.encode()))
    if longest > MAX_NAME_BYTES:
        raise InvalidArgumentError(
            f"expected a path whose names are at most {MAX_NAME_BYTES} bytes (NAME_MAX), got a name of "
            f"{longest:,} bytes in {text[:80]!r}..."
        )


def check_unicode(text: str, what: str) -> None:
    """Refuse a str that is not valid Unicode: one holding a lone surrogate (U+D800 to U+DFFF).

    Python strs may hold them (``os.fsdecode`` makes them of undecodable bytes, ``"\\ud800"`` writes one), but
    they cannot be encoded as UTF-8, so SQLite, JSON files and terminals would refuse them later.

    Args:
        text: the text to check.
        what: what the text is, for the message (e.g. ``"keys at position 3"``).

    Raises:
        InvalidArgumentError: ``text`` holds a surrogate code point.
    """
    if text.isascii():
        return
    found = _SURROGATE.search(text)
    if found is not None:
        raise InvalidArgumentError(
            f"expected {what} as valid Unicode text (encodable as UTF-8), got a lone surrogate "
            f"U+{ord(found.group()):04X} at character {found.start()}"
        )


# --------------------------------------------------------------------------- query embeddings


def array_tensor(array: np.ndarray, name: str) -> Tensor:
    """A numeric numpy array as a float32 CPU tensor: any strides (transposed, sliced, reversed, broadcast with
    stride 0, Fortran order) copied once into a contiguous array.

    Args:
        array: the array (any shape; the caller checks it).
        name: what it is, for the message.

    Returns:
        The float32 tensor, sharing nothing with ``array``'s strides.

    Raises:
        InvalidArgumentError: an array of bool or complex numbers (as for tensors: an imaginary part would be
            dropped), or of anything else that is not a float or an integer.
    """
    if array.dtype.kind not in "fiu":
        raise InvalidArgumentError(f"expected {name} as a float (or integer) array, got an array of {array.dtype}")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def query_tensor(queries: Tensor | np.ndarray, dim: int) -> tuple[Tensor, bool]:
    """Query embeddings as a float32 (batch, dim) tensor on their own device, and whether one came unbatched.

    Args:
        queries: (dim,) or (batch, dim), a tensor (its graph kept) or a numpy array.
        dim: the database's key dimension.

    Returns:
        queries (batch, dim) float32, and True for a single (dim,) query.

    Raises:
        InvalidArgumentError: not a tensor or array, a complex or bool tensor or array, a sparse, nested,
            quantized or meta tensor (:func:`~kvsearch.checks.check_dense`), an empty batch, too many queries.
        DimensionMismatchError: the wrong shape.
        NonFiniteError: NaN or Inf.
    """
    if isinstance(queries, np.ndarray):
        queries = array_tensor(queries, "queries")
    if not isinstance(queries, Tensor):
        raise InvalidArgumentError(f"expected a query text, a list of texts or a tensor, got {type(queries).__name__}")
    check_real_tensor(queries, "queries")
    single = queries.dim() == 1
    q = queries.unsqueeze(0) if single else queries  # (b, dim)
    if q.dim() != 2 or q.shape[1] != dim:
        raise DimensionMismatchError(
            f"expected queries of shape (dim={dim},) or (batch, {dim}), got {tuple(queries.shape)}"
        )
    if q.shape[0] == 0:
        raise InvalidArgumentError("expected at least one query, got an empty batch")
    if q.shape[0] > MAX_BATCH:
        check_batch(q.shape[0], "queries")  # raises
    q = q.float() if q.dtype != torch.float32 else q  # (b, dim)
    check_finite(q, "queries")
    return q, single


# --------------------------------------------------------------------------- resource limits
#: The share of the available memory one operation may plan to use.
MEMORY_FRACTION = 0.8
#: Without KVSEARCH_MEMORY_LIMIT, operations planning less than this are not checked (reading the system's
#: available memory costs ~0.5 ms, more than a small query itself).
SMALL_BYTES = 64 << 20


def available_memory() -> int | None:
    """Bytes of memory the system reports available now, or None when it cannot tell."""
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_budget() -> int | None:
    """Bytes one operation may plan to use: ``KVSEARCH_MEMORY_LIMIT`` if set, else a share of what is available."""
    limit = os.environ.get("KVSEARCH_MEMORY_LIMIT")
    if limit:
        return int(limit)
    available = available_memory()
    return None if available is None else int(available * MEMORY_FRACTION)


def check_fits(nbytes: int, what: str | Callable[[], str]) -> None:
    """Refuse an operation whose estimated size exceeds :func:`memory_budget`.

    Args:
        nbytes: the estimated extra memory the operation needs.
        what: the operation, for the message (or a function making it, called only when refusing).

    Raises:
        MemoryLimitError: it does not fit.
    """
    if nbytes < SMALL_BYTES and not os.environ.get("KVSEARCH_MEMORY_LIMIT"):
        return
    budget = memory_budget()
    if budget is not None and nbytes > budget:
        what = what() if callable(what) else what
        raise MemoryLimitError(
            f"{what} needs about {nbytes / 2**20:,.0f} MiB, expected at most {budget / 2**20:,.0f} MiB "
            f"(the memory this process may use; set KVSEARCH_MEMORY_LIMIT to change it); nothing was written"
        )


def index_bytes(spec: str, n: int, dim: int) -> int:
    """Estimated memory of a FAISS index of ``spec`` holding ``n`` vectors of ``dim`` floats.

    Args:
        spec: an ``index_factory`` string.
        n: number of vectors. dim: their dimension.

    Returns:
        Bytes: codes (4·dim per vector for flat storage, m per vector for PQm, dim for SQ8) plus
        graph links (HNSW M: ~8·M per vector) and ids (8 per vector).
    """
    upper = spec.upper()
    per = 4 * dim
    pq = re.search(r"PQ(\d+)", upper)
    if pq:
        per = int(pq.group(1))
    elif "SQ8" in upper:
        per = dim
    elif "SQ4" in upper:
        per = (dim + 1) // 2
    hnsw = re.search(r"HNSW(\d+)", upper)
    if hnsw:
        per += 8 * int(hnsw.group(1)) + 8
    return n * (per + 8)


# --------------------------------------------------------------------------- open files

#: File descriptors an open :class:`~kvsearch.Database` holds at most: the SQLite store, its WAL and shared memory,
#: the write lock and the three mapped vector columns (ids, keys, values) — 7 — and, for a moment while a write
#: replaces a file set or saves an index, up to 3 more. A closed database holds none. Measured in
#: ``tests/test_limits.py`` for every index kind.
FILES_PER_DATABASE = 10
#: Descriptors left free for everything else a process opens (torch.distributed's sockets, model files, pipes).
FILES_RESERVED = 64


def open_files() -> int:
    """How many file descriptors this process holds now (0 where the system cannot tell)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def file_limits() -> tuple[int, int] | None:
    """The process's open-file limits ``(soft, hard)`` (``ulimit -n`` / ``ulimit -Hn``), or None where unknown.

    An unlimited hard limit reads as a very large number.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Unix
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    return (soft if soft != infinity else 1 << 62), (hard if hard != infinity else 1 << 62)


def check_open_files(databases: int, what: str) -> None:
    """Make room for ``databases`` more open databases in the open-file limit, or refuse before opening any.

    The need is ``databases`` x :data:`FILES_PER_DATABASE` on top of the descriptors open now, plus
    :data:`FILES_RESERVED`. Past the soft limit (a shell's ``ulimit -n``, often 1,024), the soft limit is raised to
    the need when the hard limit allows it (a process may raise its own soft limit; Go's runtime raises it to the
    hard limit at start); past the hard limit, the open is refused.

    Args:
        databases: how many databases (shards) are about to be opened.
        what: the operation, for the message (e.g. ``"opening 256 shards of indexes/people"``).

    Raises:
        FileLimitError: they would not fit under the hard limit; nothing was opened.
    """
    limits = file_limits()
    if limits is None:
        return
    soft, hard = limits
    need = open_files() + databases * FILES_PER_DATABASE + FILES_RESERVED
    if need <= soft:
        return
    if need <= hard:
        import resource

        try:  # the hard limit as the system has it (RLIM_INFINITY stays so)
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            return
        except (ValueError, OSError):
            pass
    raise FileLimitError(
        f"{what} needs about {need:,} open files ({databases:,} x {FILES_PER_DATABASE} per database, plus those open "
        f"now and {FILES_RESERVED} to spare), expected at most the process's hard limit {hard:,} (ulimit -Hn; soft: "
        f"{soft:,}); nothing was opened. Raise the limit (ulimit -n as root, or LimitNOFILE= in a systemd unit), or "
        "serve the shards from more ranks (each opens num_shards / world_size)"
    )
