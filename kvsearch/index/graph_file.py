"""An HNSW graph's own file, read back *mapped*: every reader process shares its neighbour lists through the page cache.

A saved graph (``IndexHNSWFlat`` without its vectors, :func:`~kvsearch.index.graph_storage.graph_blob`) is written
to a file of its own beside the index file, under a name no other save uses (:func:`write_graph`:
``index.npz.<random>.graph``), and read with FAISS's ``IO_FLAG_MMAP_IFC`` (:func:`map_graph`): the neighbour lists,
nearly all of a graph's bytes, are then a read-only view of the file's pages, which every process that reads the
same file shares; only the small per-vector arrays (levels, offsets) are copied. The index file records the graph
file's name, size and CRC-32, which :func:`map_graph` checks before FAISS reads a byte: a torn, truncated or
damaged graph file is refused with :class:`~kvsearch.errors.CorruptDatabaseError`.

A mapped file is never changed in place: a save writes a new file (a temporary one, renamed) and removes the old
ones after the index file names the new (:func:`remove_stale_graphs`); a process that mapped an old one keeps
reading it (a removed file lives on while mapped). A mapped graph never grows either: FAISS *aborts the process*
when a view is resized, so :func:`own_graph` copies the neighbour lists into memory of the graph's own before any
add (the caller calls it first, :meth:`~kvsearch.index.faiss_index.Index.add` and the delta's fold do).

:func:`write_index_file` and :func:`read_index_file` write and read the two together: the index file (an ``.npz``
of the arrays :class:`~kvsearch.index.faiss_index.Index` saves) and the graph file it names. It knows nothing of
what those arrays mean (ids, tombstones, vectors) nor of the store.
"""

from __future__ import annotations

import mmap
import os
import secrets
import zlib
from pathlib import Path

import faiss
import numpy as np

from kvsearch.errors import CorruptDatabaseError
from kvsearch.storage.fileio import write_atomic

__all__ = [
    "GRAPH_SUFFIX",
    "GraphFile",
    "write_index_file",
    "read_index_file",
    "write_graph",
    "map_graph",
    "is_mapped",
    "own_graph",
    "remove_stale_graphs",
]

#: How a graph file's name ends: ``{index file name}.{random}.graph``.
GRAPH_SUFFIX = ".graph"

#: What the index file records of its graph file: its name (in the index file's folder), size and CRC-32.
GraphFile = tuple[str, int, int]


def write_index_file(path: Path, arrays: dict[str, np.ndarray], graph: np.ndarray | None) -> None:
    """Write the index file ``path`` (an ``.npz`` of ``arrays``), and first the ``graph`` it names, if any.

    Each file is written whole or not at all (a temporary file, renamed); the graph file's name, size and CRC-32 go
    into the index file (``graph_file``, ``graph_bytes``, ``graph_crc``), and once it is in place the graph files
    it no longer names are removed.

    Args:
        path: the index file. arrays: what it holds. graph: the serialised graph (uint8) for a file of its own.

    Raises:
        OSError: a file cannot be written (the files this call made are removed; ``path`` is as it was).
    """
    name = None
    if graph is not None:
        name, size, crc = write_graph(path, graph)
        arrays = {**arrays, "graph_file": np.array(name), "graph_bytes": np.array(size), "graph_crc": np.array(crc)}
    try:
        write_atomic(path, lambda f: np.savez(f, **arrays), sync=False)  # derived data: a torn file fails its hash
    except BaseException:
        if name is not None:
            (path.parent / name).unlink(missing_ok=True)
        raise
    remove_stale_graphs(path, name)


def read_index_file(path: Path) -> tuple[dict[str, np.ndarray], faiss.Index]:
    """The arrays of the index file ``path`` and the FAISS index it holds: its graph file mapped where it names one
    (:func:`map_graph`), else the serialised index it holds (``faiss``) read into memory.

    Raises:
        CorruptDatabaseError: either file is missing, truncated, damaged or foreign, or lacks ``labels``, ``dead``
            or ``fallback``.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        if not {"labels", "dead", "fallback"} <= arrays.keys():
            raise CorruptDatabaseError(f"index file {path} lacks the labels, tombstones or fallback flag")
        if "graph_file" not in arrays:
            return arrays, faiss.deserialize_index(np.ascontiguousarray(arrays.pop("faiss"), dtype=np.uint8))
        name = str(arrays["graph_file"])
        if not (name.startswith(f"{path.name}.") and name.endswith(GRAPH_SUFFIX) and Path(name).name == name):
            raise CorruptDatabaseError(f"index file {path} names a foreign graph file {name!r}")
        return arrays, map_graph(path.parent / name, int(arrays["graph_bytes"]), int(arrays["graph_crc"]))
    except CorruptDatabaseError:
        raise
    except Exception as exc:  # numpy and FAISS raise many types on damaged input
        raise CorruptDatabaseError(f"index file {path} cannot be read: {exc}".splitlines()[0]) from None


def write_graph(index_path: Path, blob: np.ndarray) -> GraphFile:
    """Write the serialised graph ``blob`` (uint8) to a new file beside ``index_path`` (a temporary file, renamed).

    Args:
        index_path: the index file that will name it. blob: the graph's bytes (FAISS's serialisation).

    Returns:
        The graph file's name, size and CRC-32, for the index file.

    Raises:
        OSError: the file cannot be written (nothing is left).
    """
    name = f"{index_path.name}.{secrets.token_hex(8)}{GRAPH_SUFFIX}"
    data = memoryview(np.ascontiguousarray(blob, dtype=np.uint8))
    write_atomic(index_path.parent / name, lambda f: f.write(data), sync=False)  # derived: a torn file fails its CRC
    return name, len(data), zlib.crc32(data)


def map_graph(path: Path, size: int, crc: int) -> faiss.Index:
    """The graph in ``path``, its neighbour lists mapped from the file (read-only: see :func:`own_graph`).

    Args:
        path: the graph file. size, crc: what the index file recorded of it.

    Raises:
        CorruptDatabaseError: the file is missing, has another size or CRC-32, or FAISS cannot read it.
    """
    try:
        with open(path, "rb") as f:
            found = os.fstat(f.fileno()).st_size
            if found != size or size == 0:
                raise CorruptDatabaseError(f"graph file {path} holds {found} bytes, expected {size}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                if zlib.crc32(view) != crc:
                    raise CorruptDatabaseError(f"graph file {path} is damaged (its CRC-32 differs)")
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
    except CorruptDatabaseError:
        raise
    except (OSError, ValueError, RuntimeError) as exc:  # FAISS raises RuntimeError on a file it cannot parse
        raise CorruptDatabaseError(f"graph file {path} cannot be read: {exc}".splitlines()[0]) from None


def is_mapped(graph: faiss.Index) -> bool:
    """Whether ``graph``'s neighbour lists are a read-only view (a mapped file): it must not grow as it is."""
    return isinstance(graph, faiss.IndexHNSW) and not graph.hnsw.neighbors.is_owned


def own_graph(graph: faiss.Index) -> None:
    """Copy a mapped graph's neighbour lists into memory of its own, so that it may grow; nothing for another graph.

    The graph answers the same afterwards; the file's mapping is let go once nothing else holds it.
    """
    if not is_mapped(graph):
        return
    view = graph.hnsw.neighbors
    n = int(view.size())
    owned = faiss.MaybeOwnedVectorInt32()
    owned.resize(n)
    if n:
        np.copyto(faiss.rev_swig_ptr(owned.data(), n), faiss.rev_swig_ptr(view.data(), n))  # (n,) int32
    graph.hnsw.neighbors = owned  # copied into the graph (owned), the view and its mapping dropped


def remove_stale_graphs(index_path: Path, keep: str | None) -> None:
    """Remove the graph files beside ``index_path`` that it no longer names (all but ``keep``); never raises.

    Processes that mapped one keep reading it: a removed file lives on while it is mapped.
    """
    for path in index_path.parent.glob(f"{index_path.name}.*{GRAPH_SUFFIX}"):
        if path.name != keep:
            try:
                path.unlink()
            except OSError:
                pass
