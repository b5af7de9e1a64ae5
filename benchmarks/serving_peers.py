"""The stores that bench_serving.py times, each behind one small adapter, and the reader process it starts.

Every adapter builds its store from the same unit float32 vectors (row ``i`` has id ``i``: kvsearch's ids start at
1, so its hits are shifted back), opens it in a fresh process, and answers k=10 queries in its own native form
(queries converted once, beforehand). kvsearch is used through its public API only, so the same code times whatever
kvsearch is importable.

    python benchmarks/serving_peers.py --reader STORE FOLDER M   # what bench_serving.py starts, not for hand use

A reader imports its store's library (timed), opens the store and answers one query (timed: "open + first
answer"), then 32 single queries and one batch of 256, reads its own ``/proc/self/smaps_rollup``, prints one JSON
line and waits for a line on stdin before it exits (the barrier that keeps 4 readers alive together).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

K = 10
#: kvsearch's value per record: a small embedding (the key's first VALUE_DIM coordinates).
VALUE_DIM = 8
#: HNSW parameters shared by the graph stores (kvsearch, FAISS: M; usearch: connectivity).
HNSW_M = 32


class Store:
    """One store: how it is built, opened and queried. Subclasses fill in the hooks; ``setting`` is a search knob
    (efSearch and its kin; None: the store's default)."""

    name = "?"
    settings: Sequence[Any] = (None,)

    def imports(self) -> None:
        """Import the store's library (timed apart from the open)."""

    def build(self, folder: Path, data: np.ndarray) -> None:
        """Write the store for ``data`` (n, dim) into the empty ``folder``."""
        raise NotImplementedError

    def open(self, folder: Path) -> Any:
        """The opened store (a handle the other hooks take)."""
        raise NotImplementedError

    def prepare(self, queries: np.ndarray) -> list[Any]:
        """The queries (nq, dim) one per call, in the form the store takes."""
        return list(queries)

    def call(self, handle: Any, query: Any) -> Any:
        """One k=10 search: the timed call."""
        raise NotImplementedError

    def ids(self, result: Any) -> list[int] | None:
        """Row ids of one call's result, best first (None: the store's result does not say them)."""
        raise NotImplementedError

    def batch(self, handle: Any, queries: np.ndarray) -> Any:
        """One call for many queries where the store has one, else one call each."""
        return [self.call(handle, q) for q in self.prepare(queries)]

    def set(self, handle: Any, setting: Any) -> None:
        """Apply a search setting (None: leave the default)."""

    def describe(self, setting: Any) -> str:
        return self.name if setting is None else f"{self.name}, {setting}"


class KVSearch(Store):
    """kvsearch ``Database`` on disk: keys given as tensors in batches, value an 8-d embedding."""

    def __init__(self, index: str = "Flat", ef_construction: int | None = None, efs: Sequence[int] = ()) -> None:
        self.index, self.ef_construction = index, ef_construction
        self.settings = tuple(efs) or (None,)
        efc = "" if ef_construction is None else f", efConstruction={ef_construction}"
        self.name = f"kvsearch {index}{efc}"

    def imports(self) -> None:
        import kvsearch  # noqa: F401  (torch and faiss with it)

    def build(self, folder: Path, data: np.ndarray) -> None:
        import torch

        from kvsearch import Database

        params = None if self.ef_construction is None else {"efConstruction": self.ef_construction}
        db = Database(folder / "db", dim=data.shape[1], value_dim=VALUE_DIM, index=self.index, search_params=params)
        for lo in range(0, len(data), 50_000):
            keys = torch.from_numpy(np.ascontiguousarray(data[lo : lo + 50_000]))  # (batch, dim)
            db.add(keys, keys[:, :VALUE_DIM].clone())  # values (batch, VALUE_DIM)
        db.close()

    def open(self, folder: Path) -> Any:
        from kvsearch import Database

        return Database(folder / "db")

    def prepare(self, queries: np.ndarray) -> list[Any]:
        import torch

        return list(torch.from_numpy(np.ascontiguousarray(queries)))  # (dim,) each

    def call(self, handle: Any, query: Any) -> Any:
        return handle.search(query, k=K)

    def ids(self, result: Any) -> list[int]:
        return [hit.id - 1 for hit in result]

    def batch(self, handle: Any, queries: np.ndarray) -> Any:
        import torch

        return handle.search(torch.from_numpy(np.ascontiguousarray(queries)), k=K)

    def set(self, handle: Any, setting: Any) -> None:
        if setting is not None:
            handle.set_search_params(efSearch=setting)

    def describe(self, setting: Any) -> str:
        return self.name if setting is None else f"{self.name}, efSearch={setting}"


class KVSearchBare(KVSearch):
    """The FAISS index inside a kvsearch HNSW database (``db.index.faiss_index``), unit queries given as FAISS takes
    them: what ``Database.search`` adds per call is its time minus this one's."""

    def __init__(self, ef_construction: int | None = None, efs: Sequence[int] = ()) -> None:
        super().__init__("HNSW32", ef_construction, efs)
        self.name = f"{self.name}: its bare index (db.index.faiss_index)"

    def open(self, folder: Path) -> Any:
        from kvsearch import Database

        db = Database(folder / "db")
        return db, db.index.faiss_index

    def prepare(self, queries: np.ndarray) -> list[Any]:
        return [np.ascontiguousarray(q[None]) for q in queries]  # (1, dim) each, unit rows

    def call(self, handle: Any, query: Any) -> Any:
        return handle[1].search(query, K)

    def ids(self, result: Any) -> list[int] | None:
        return None  # the index's own positions, not ids (kvsearch maps them): its recall is Database.search's

    def batch(self, handle: Any, queries: np.ndarray) -> Any:
        return [self.call(handle, q) for q in self.prepare(queries)]

    def set(self, handle: Any, setting: Any) -> None:
        if setting is not None:
            handle[0].set_search_params(efSearch=setting)
            if handle[1].hnsw.efSearch != setting:
                raise RuntimeError(f"efSearch {setting} not applied to the bare index ({handle[1].hnsw.efSearch})")


class Faiss(Store):
    """A bare FAISS index (inner product) written once, read with ``IO_FLAG_MMAP_IFC``: the vectors are mapped."""

    def __init__(self, index: str = "Flat", ef_construction: int = 40, efs: Sequence[int] = ()) -> None:
        self.index, self.ef_construction = index, ef_construction
        self.settings = tuple(efs) or (None,)
        efc = f", efConstruction={ef_construction}" if index != "Flat" else ""
        self.name = f"FAISS {index}{efc} (mmap)"

    def imports(self) -> None:
        import faiss  # noqa: F401

    def build(self, folder: Path, data: np.ndarray) -> None:
        import faiss

        dim = data.shape[1]
        if self.index == "Flat":
            index = faiss.IndexFlatIP(dim)
        else:
            index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = self.ef_construction
        for lo in range(0, len(data), 50_000):
            index.add(np.ascontiguousarray(data[lo : lo + 50_000]))
        faiss.write_index(index, str(folder / "index.faiss"))

    def open(self, folder: Path) -> Any:
        import faiss

        return faiss.read_index(str(folder / "index.faiss"), faiss.IO_FLAG_MMAP_IFC)

    def prepare(self, queries: np.ndarray) -> list[Any]:
        return [np.ascontiguousarray(q[None]) for q in queries]  # (1, dim) each

    def call(self, handle: Any, query: Any) -> Any:
        return handle.search(query, K)

    def ids(self, result: Any) -> list[int]:
        return [int(i) for i in result[1][0] if i >= 0]

    def batch(self, handle: Any, queries: np.ndarray) -> Any:
        return handle.search(np.ascontiguousarray(queries), K)

    def set(self, handle: Any, setting: Any) -> None:
        if setting is not None:
            handle.hnsw.efSearch = setting

    def describe(self, setting: Any) -> str:
        return self.name if setting is None else f"{self.name}, efSearch={setting}"


class Lance(Store):
    """LanceDB (embedded, a table of ``id`` + ``vector``), cosine distance; no index (a scan) or one of its vector
    indexes (``IVF_HNSW_SQ`` and kin, LanceDB's defaults otherwise), searched at several ``ef``."""

    def __init__(self, index: str | None = None, efs: Sequence[int] = ()) -> None:
        self.index, self.ef = index, None
        self.settings = tuple(efs) or (None,)
        self.name = f"LanceDB {index or 'no index (scan)'}"

    def imports(self) -> None:
        import lancedb  # noqa: F401

    def build(self, folder: Path, data: np.ndarray) -> None:
        import lancedb
        import pyarrow as pa

        table = None
        for lo in range(0, len(data), 100_000):
            rows = np.ascontiguousarray(data[lo : lo + 100_000])
            arrow = pa.table(
                {
                    "id": pa.array(np.arange(lo, lo + len(rows))),
                    "vector": pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), rows.shape[1]),
                }
            )
            if table is None:
                table = lancedb.connect(str(folder / "lance")).create_table("vectors", data=arrow)
            else:
                table.add(arrow)
        if self.index is not None:
            from lancedb import index as indexes

            config = {"IVF_HNSW_SQ": indexes.HnswSq, "IVF_PQ": indexes.IvfPq}[self.index](distance_type="cosine")
            table.create_index("vector", config=config)
        table.optimize()

    def open(self, folder: Path) -> Any:
        import lancedb

        return lancedb.connect(str(folder / "lance")).open_table("vectors")

    def call(self, handle: Any, query: Any) -> Any:
        search = handle.search(query).distance_type("cosine").limit(K).select(["id", "_distance"])
        if self.ef is not None:
            search = search.ef(self.ef)
        return search.to_arrow()

    def ids(self, result: Any) -> list[int]:
        return result["id"].to_pylist()

    def batch(self, handle: Any, queries: np.ndarray) -> Any:
        search = handle.search(list(queries)).distance_type("cosine").limit(K).select(["id", "_distance"])
        return search.to_arrow()  # one row per hit, its query in the column query_index

    def set(self, handle: Any, setting: Any) -> None:
        self.ef = setting

    def describe(self, setting: Any) -> str:
        return self.name if setting is None else f"{self.name}, ef={setting}"


class USearch(Store):
    """usearch ``Index(metric="cos")`` saved once and loaded whole (``Index.restore``); ``dtype`` None is its default
    (bf16 vectors for the cos metric in usearch 2.26), "f32" keeps the vectors as the other stores do."""

    def __init__(
        self, connectivity: int = 16, expansion_add: int = 128, dtype: str | None = None, efs: Sequence[int] = ()
    ) -> None:
        self.connectivity, self.expansion_add, self.dtype = connectivity, expansion_add, dtype
        self.settings = tuple(efs) or (None,)
        kind = "its default (bf16 for cos)" if dtype is None else dtype
        self.name = f"usearch connectivity={connectivity}, expansion_add={expansion_add}, vectors {kind}"

    def imports(self) -> None:
        import usearch.index  # noqa: F401

    def build(self, folder: Path, data: np.ndarray) -> None:
        from usearch.index import Index

        index = Index(
            ndim=data.shape[1],
            metric="cos",
            dtype=self.dtype,
            connectivity=self.connectivity,
            expansion_add=self.expansion_add,
        )
        index.add(np.arange(len(data)), np.ascontiguousarray(data))
        index.save(str(folder / "index.usearch"))

    def open(self, folder: Path) -> Any:
        from usearch.index import Index

        return Index.restore(str(folder / "index.usearch"))

    def call(self, handle: Any, query: Any) -> Any:
        return handle.search(query, K)

    def ids(self, result: Any) -> list[int]:
        return [int(i) for i in result.keys]

    def batch(self, handle: Any, queries: np.ndarray) -> Any:
        return handle.search(np.ascontiguousarray(queries), K)

    def set(self, handle: Any, setting: Any) -> None:
        if setting is not None:
            handle.expansion_search = setting

    def describe(self, setting: Any) -> str:
        return self.name if setting is None else f"{self.name}, expansion_search={setting}"


class Chroma(Store):
    """Chroma ``PersistentClient`` (HNSW, cosine space) at its defaults (M=16, ef_construction=100, ef_search=100);
    ids and distances returned. Its ``ef_search`` is not swept: chromadb 1.5's ``collection.modify`` of it left
    the recall of an index already loaded in the process unchanged."""

    name = "Chroma PersistentClient (defaults)"

    def imports(self) -> None:
        import chromadb  # noqa: F401

    def build(self, folder: Path, data: np.ndarray) -> None:
        import chromadb

        client = chromadb.PersistentClient(path=str(folder / "chroma"))
        collection = client.create_collection("vectors", metadata={"hnsw:space": "cosine"})
        step = min(5_000, client.get_max_batch_size())
        for lo in range(0, len(data), step):
            rows = np.ascontiguousarray(data[lo : lo + step])
            collection.add(ids=[str(i) for i in range(lo, lo + len(rows))], embeddings=rows)

    def open(self, folder: Path) -> Any:
        import chromadb

        return chromadb.PersistentClient(path=str(folder / "chroma")).get_collection("vectors")

    def prepare(self, queries: np.ndarray) -> list[Any]:
        return [np.ascontiguousarray(q[None]) for q in queries]  # (1, dim) each

    def call(self, handle: Any, query: Any) -> Any:
        return handle.query(query_embeddings=query, n_results=K, include=["distances"])

    def ids(self, result: Any) -> list[int]:
        return [int(i) for i in result["ids"][0]]


def make_store(spec: dict[str, Any]) -> Store:
    """The store of ``{"kind": ..., **options}`` (a JSON-able spec, so a child process can make it too)."""
    kinds: dict[str, Callable[..., Store]] = {
        "kvsearch": KVSearch,
        "kvsearch-bare": KVSearchBare,
        "faiss": Faiss,
        "lance": Lance,
        "usearch": USearch,
        "chroma": Chroma,
    }
    options = {key: value for key, value in spec.items() if key != "kind"}
    return kinds[spec["kind"]](**options)


def build(spec: dict[str, Any], folder: str, data_name: str, m: int) -> dict[str, Any]:
    """Build one store into ``folder`` (made anew) from a cached data set; its build seconds and bytes on disk."""
    path = Path(folder)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    data = load_data(data_name, m)
    start = time.perf_counter()
    make_store(spec).build(path, data)
    seconds = time.perf_counter() - start
    return {"build_s": seconds, "bytes": folder_bytes(path)}


def load_data(data_name: str, m: int) -> np.ndarray:
    """``random``: m random unit vectors (memory-mapped); ``names``: the first m MiniLM name embeddings, unit rows."""
    if data_name == "random":
        return common.random_vectors(m)
    _, data, _ = common.name_embeddings(1024)
    data = np.array(data[:m], dtype=np.float32)
    return data / np.linalg.norm(data, axis=1, keepdims=True)


def folder_bytes(folder: Path) -> int:
    """Sum of the sizes of the files under ``folder`` (what ``du --apparent-size`` counts)."""
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def smaps() -> dict[str, int]:
    """This process's memory from ``/proc/self/smaps_rollup`` in bytes: Rss, Pss, Private (clean + dirty)."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return {
        "rss": fields["Rss"],
        "pss": fields["Pss"],
        "private": fields["Private_Clean"] + fields["Private_Dirty"],
        "anonymous": fields.get("Anonymous", 0),
    }


def reader(spec: dict[str, Any], folder: str, m: int) -> None:
    """The reader process: see the module docstring. Prints one JSON line, then waits for stdin."""
    store = make_store(spec)
    queries = common.random_queries(256, seed=7)  # (256, dim)
    start = time.perf_counter()
    store.imports()
    import_s = time.perf_counter() - start
    before = smaps()
    start = time.perf_counter()
    handle = store.open(Path(folder))
    first = store.call(handle, store.prepare(queries[:1])[0])
    open_first_s = time.perf_counter() - start
    found = store.ids(first)
    for query in store.prepare(queries[:32]):
        store.call(handle, query)
    store.batch(handle, queries)
    after = smaps()
    out = {"import_s": import_s, "open_first_s": open_first_s, "hits": len(found), "before": before, "after": after}
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # every reader has reported: measured again, all alive and done (one moment's sharing)
    print(json.dumps({"together": smaps()}), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reader"]:
        reader(json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    elif not common.worker_main({"build": build}):
        raise SystemExit(__doc__)
