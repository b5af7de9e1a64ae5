"""The database folder: its file names, the index manifest, and the rollback of the files a failed creation made.

A database folder holds:

- ``store.sqlite`` (+ SQLite's ``-wal``, ``-shm``, ``-journal``) — the records, the single source of truth
  (:mod:`kvsearch.storage.store`), and beside it the embeddings' file set ``store.sqlite.v<seq>.ids / .keys /
  .values`` that SQLite names (:mod:`kvsearch.storage.vector_file`; ``store.sqlite.emb*``: an earlier version's);
- ``write.lock`` — the inter-process write lock (:mod:`kvsearch.storage.locking`);
- ``generations/<G>/`` — the encoder files of generation G (the current one and the previous one, kept once for
  a rollback): for each encoder prefix (``encoder``, ``value_encoder``, ``query_encoder``) ``{prefix}.json``, and
  ``{prefix}.safetensors`` (a trained n-gram encoder) or the folder ``{prefix}_model`` (a fine-tuned sentence
  encoder); ``previous_values.safetensors`` when the generation replaced value embeddings. A database written
  before generations holds its encoder files at the top of the folder instead (generation 0). What they hold, and
  how they are written and checked, is :mod:`kvsearch.storage.encoder_files`'s;
- ``index.npz`` and ``manifest.json`` — a saved index and what it is the index of (:func:`write_index`,
  :func:`saved_index_path`); beside them the graph file ``index.npz.<random>.graph`` that a saved HNSW index names,
  with its size and CRC-32, and that readers map (written and read by the index: ``kvsearch.index.graph_file``).

A folder holds one kind of database or none (:func:`kind_of`): a plain one (``store.sqlite``) or a sharded one
(``shards.json`` and ``shard-0000/`` ..., :mod:`kvsearch.distributed.layout`). A new database is made only in an
absent or empty folder, never in a folder of someone else's files nor inside another database's folder
(:func:`check_new_folder`); opening a folder as the other kind is refused (:func:`check_kind`).

This module knows nothing of search, autograd or encoders: it names the folder's files, lists and removes them, and
moves an index's bytes between the folder and the index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Literal, Protocol

from kvsearch.errors import ForeignFolderError, MissingFileError, WrongKindError
from kvsearch.storage import fileio
from kvsearch.storage.locking import LOCK_FILE

__all__ = [
    "STORE_FILE",
    "LOCK_FILE",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "ENCODER_PREFIXES",
    "GENERATIONS_DIR",
    "MODEL_DIR",
    "STAGING",
    "SHARDS_FILE",
    "IGNORED_FILES",
    "is_database",
    "kind_of",
    "check_kind",
    "check_new_folder",
    "files_of_database",
    "check_store_present",
    "Creation",
    "remove_path",
    "sha256_file",
    "write_index",
    "saved_index_path",
]

#: The SQLite store: the file that makes a folder a database.
STORE_FILE = "store.sqlite"
#: The layout of a sharded database: the file that makes a folder a sharded database's root.
SHARDS_FILE = "shards.json"
#: What a folder may hold and still count as empty: the marks file managers and version control leave.
IGNORED_FILES = frozenset({".DS_Store", "Thumbs.db", "desktop.ini", ".gitkeep", ".keep"})
_SHARD_ENTRY = re.compile(r"shard-\d{4,}|\.shards\.json\..+\.tmp")  # a shard folder, a layout being written
#: The saved index (written only for index types that are slower to rebuild than to read).
INDEX_FILE = "index.npz"
#: What the saved index is the index of: ``{"version", "spec", "ntotal", "sha256"}``.
MANIFEST_FILE = "manifest.json"
#: The file name stems of a database's encoders: the key encoder, a value encoder of its own, a query encoder.
ENCODER_PREFIXES = ("encoder", "value_encoder", "query_encoder")
#: The folder of the encoder generations: ``generations/<G>/encoder.json``, ...
GENERATIONS_DIR = "generations"

#: The prefix and suffix of the staging folders of an encoder save (a generation's, or an older version's).
STAGING = (".encoders.", ".staging")
#: The model folder of a saved sentence encoder.
MODEL_DIR = "{prefix}_model"

_SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")  # what SQLite writes beside the store


# --------------------------------------------------------------------------- the folder and its files


def is_database(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a database folder: it holds a :data:`STORE_FILE`.

    Args:
        path: a folder (it need not exist).

    Returns:
        True if ``path / STORE_FILE`` is a file.
    """
    return (Path(path) / STORE_FILE).is_file()


Kind = Literal["absent", "empty", "plain", "sharded", "unfinished", "foreign"]


def kind_of(path: str | os.PathLike[str]) -> Kind:
    """What the folder ``path`` holds.

    Args:
        path: a folder (it need not exist).

    Returns:
        ``"absent"`` (nothing there), ``"plain"`` (a database: :data:`STORE_FILE`), ``"sharded"`` (a sharded
        database's root: :data:`SHARDS_FILE`), ``"unfinished"`` (shard folders without the layout: a sharded
        creation that stopped), ``"foreign"`` (files that are not kvsearch's, or a file in place of the folder),
        or ``"empty"`` (nothing but :data:`IGNORED_FILES`, or only the files kvsearch leaves, such as a lock file).
    """
    folder = Path(path)
    if not folder.exists():
        return "absent"
    if not folder.is_dir():
        return "foreign"
    if (folder / SHARDS_FILE).is_file():
        return "sharded"
    if is_database(folder):
        return "plain"
    if _foreign_entries(folder):
        return "foreign"
    if any(_SHARD_ENTRY.fullmatch(entry.name) for entry in folder.iterdir()):
        return "unfinished"
    return "empty"


def _foreign_entries(folder: Path) -> list[str]:
    """The names in ``folder`` that kvsearch did not write, sorted (a user's own files)."""
    ours = {p.name for p in files_of_database(folder)}
    names = (entry.name for entry in folder.iterdir())
    return sorted(n for n in names if n not in ours and n not in IGNORED_FILES and not _SHARD_ENTRY.fullmatch(n))


def _shard_count(folder: Path) -> str:
    """``"4 shards"`` as the folder's layout says, or ``"shards"`` where it cannot be read."""
    try:
        return f"{int(json.loads((folder / SHARDS_FILE).read_text(encoding='utf-8'))['num_shards'])} shards"
    except (OSError, ValueError, TypeError, KeyError):
        return "shards"


def check_kind(path: str | os.PathLike[str], want: Literal["plain", "sharded"]) -> None:
    """Refuse a folder that holds the other kind of database than the one asked for (before anything is written).

    Args:
        path: the folder given to ``Database`` (``want="plain"``) or ``ShardedDatabase`` (``want="sharded"``).
        want: the kind asked for.

    Raises:
        WrongKindError: the folder holds a sharded database (or the shard folders of an unfinished one) and a plain
            one was asked for, or it holds a plain database and a sharded one was asked for. The message names
            what is there and how to open it.
    """
    folder = Path(path)
    found = kind_of(folder)
    if want == "plain" and found in ("sharded", "unfinished"):
        what = (
            f"a sharded database ({_shard_count(folder)}, {SHARDS_FILE})"
            if found == "sharded"
            else "the shard folders of a sharded database whose creation did not finish"
        )
        raise WrongKindError(
            f"expected a plain database folder, got {folder} holding {what}: open it with "
            f"kvsearch.distributed.ShardedDatabase({str(folder)!r}) or `kvsearch info {folder}`; to make one plain "
            f"database of it, `kvsearch reshard {folder} NEW_FOLDER --shards 1`. Nothing was written"
        )
    if want == "sharded" and found == "plain":
        raise WrongKindError(
            f"expected a sharded database folder, got {folder} holding a plain database ({STORE_FILE}): open it "
            f"with kvsearch.Database({str(folder)!r}); to split it into shards, `kvsearch reshard {folder} "
            "NEW_FOLDER --shards N`. Nothing was written"
        )


def check_new_folder(path: str | os.PathLike[str], *, inside_ok: bool = False) -> None:
    """Refuse to make a new database in ``path`` unless it is absent or empty, and outside any other database.

    Args:
        path: the folder a new database (plain or sharded) is about to be made in; it holds no database.
        inside_ok: whether it may lie inside another database's folder (a shard, inside its sharded root).

    Raises:
        MissingFileError: it holds what is left of a database whose store is gone (:func:`check_store_present`).
        ForeignFolderError: it holds files that are not kvsearch's (the message names some of them).
        WrongKindError: it lies inside the folder of another database (plain or sharded).
    """
    folder = Path(path)
    check_store_present(folder)
    if folder.exists() and not folder.is_dir():
        raise ForeignFolderError(f"expected a folder for the database, got a file: {folder}")
    foreign = _foreign_entries(folder) if folder.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5:,} more" if len(foreign) > 5 else "")
        raise ForeignFolderError(
            f"expected an empty folder (or a kvsearch database) to make a new database in, got {folder} holding "
            f"other files: {shown}. kvsearch never writes among someone else's files: choose a new folder such as "
            f"{folder / 'kvsearch'}. Nothing was written"
        )
    if inside_ok:
        return
    for parent in folder.absolute().parents:
        if is_database(parent) or (parent / SHARDS_FILE).is_file():
            kind = "sharded database" if (parent / SHARDS_FILE).is_file() else "database"
            raise WrongKindError(
                f"expected a folder outside other databases for a new database, got {folder}, inside the {kind} at "
                f"{parent}: a database is never made inside another one. Choose a folder beside it. Nothing was "
                "written"
            )


def _patterns() -> list[str]:
    """Glob patterns of every file and folder kvsearch writes into a database folder, leftovers included."""
    patterns = [
        STORE_FILE,
        *(STORE_FILE + s for s in _SQLITE_SIDE_FILES),
        f"{STORE_FILE}.emb*",
        f"{STORE_FILE}.v*",
        LOCK_FILE,
    ]
    patterns += [INDEX_FILE, f"{INDEX_FILE}.*", MANIFEST_FILE, f"{MANIFEST_FILE}.*.tmp", f"{STAGING[0]}*{STAGING[1]}"]
    patterns += [f".{INDEX_FILE}.*.tmp", f".{MANIFEST_FILE}.*.tmp"]
    patterns += [GENERATIONS_DIR]
    for prefix in ENCODER_PREFIXES:
        model_dir = MODEL_DIR.format(prefix=prefix)
        patterns += [f"{prefix}.json", f"{prefix}.safetensors", model_dir]
        patterns += [f".{prefix}.json.*.tmp", f".{prefix}.safetensors.*.tmp", f".{model_dir}.*"]
    return patterns


def files_of_database(path: str | os.PathLike[str]) -> list[Path]:
    """The kvsearch files and folders present in the folder ``path``, sorted by name.

    The store (with SQLite's ``-wal`` / ``-shm`` / ``-journal`` and the store's embeddings side files), the write
    lock, every encoder's json, weights and model folder, the index and its manifest, and what an interrupted
    write of one of them leaves (temporary files, staging folders). Nothing else: a user's own files in the
    folder are never listed.

    Args:
        path: a folder; one that does not exist (or is not a folder) holds nothing.

    Returns:
        The paths (files and folders, not what is inside the folders).
    """
    folder = Path(path)
    if not folder.is_dir():
        return []
    found = {p for pattern in _patterns() for p in folder.glob(pattern)}
    return sorted(found, key=lambda p: p.name)


#: Files that may be left in a folder without its store and say nothing of a database having been there.
_HARMLESS = {LOCK_FILE, STORE_FILE + "-shm", STORE_FILE + "-journal"}


def check_store_present(path: str | os.PathLike[str]) -> None:
    """Refuse a folder that holds kvsearch files but no :data:`STORE_FILE`: its store was deleted or moved.

    A new database must never be created beside what is left of an old one (its encoders, its index): the store
    was the single source of truth, and a fresh empty one would hide that it is gone.

    Args:
        path: a folder without a store (one that does not exist holds nothing).

    Raises:
        MissingFileError: the folder holds kvsearch files (other than a lock file or SQLite's shared memory).
    """
    folder = Path(path)
    if is_database(folder):
        return
    left = [p.name for p in files_of_database(folder) if p.name not in _HARMLESS]
    if left:
        raise MissingFileError(
            f"{folder / STORE_FILE} is missing, but the folder holds other kvsearch files ({', '.join(left)}): the "
            "store (the records, the single source of truth) was deleted or moved. Restore it from a backup, or "
            "remove those files to make a new database in this folder"
        )


def remove_path(path: Path) -> None:
    """Remove a file, or a folder with what it holds; never raises for a path that is gone or cannot go."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass


class Creation:
    """What a database creation is about to make in ``path``, so that a creation that fails can remove it again.

    Constructed before the folder is made: it notes which of the folder and its parents do not exist yet, and
    which kvsearch files (see :func:`files_of_database`) the folder already holds. A folder that already holds a
    store is an existing database: nothing is noted and :meth:`rollback` removes nothing.

    Args:
        path: the database folder, or None for a database in memory (then everything is a no-op).
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self._folder: Path | None = None  # the folder whose creation is watched; None: nothing to undo
        self._new_folders: list[Path] = []  # outermost first
        self._before: set[Path] = set()
        if self.path is not None and not (self.path / STORE_FILE).exists():
            self._folder = self.path
            self._new_folders = [d for d in (self.path, *self.path.parents) if not d.exists()][::-1]
            self._before = set(files_of_database(self.path))

    def rollback(self) -> None:
        """Remove what the creation made: the kvsearch files and folders that were not there, then the folders
        it made (innermost first, and only if empty). Never anything that existed before; never raises for a
        file that cannot be removed; a second call finds nothing left to do.
        """
        if self._folder is None:
            return
        try:
            made = [p for p in files_of_database(self._folder) if p not in self._before]
        except OSError:  # the folder cannot be listed (no file descriptor left): only its own removal is tried
            made = []
        for path in sorted(made, key=lambda p: p.is_dir()):  # files, then model and staging folders
            remove_path(path)
        for folder in reversed(self._new_folders):
            try:
                folder.rmdir()  # only if empty
            except OSError:
                pass


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read a MiB at a time.

    Args:
        path: a file.

    Returns:
        The hex digest.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- the saved index


class SavableIndex(Protocol):
    """What :func:`write_index` needs of an index."""

    spec: str

    @property
    def ntotal(self) -> int: ...

    def save(self, path: str | os.PathLike[str]) -> None: ...


def write_index(folder: str | os.PathLike[str], index: SavableIndex, *, version: int) -> None:
    """Save ``index`` as :data:`INDEX_FILE` and tag it with a manifest: the store version it reflects.

    The manifest ``{"version", "spec", "ntotal", "sha256"}`` is written after the index, to a temporary file
    moved into place: a stop in between leaves a manifest whose digest no longer matches (the next open
    rebuilds the index from the store).

    Args:
        folder: the database folder.
        index: an index with ``spec``, ``ntotal`` and ``save(path)``.
        version: the store version the index reflects.

    Raises:
        DiskFullError, ReadOnlyDatabaseError: a file cannot be written (no temporary file is left; the store is
            intact and the index is rebuilt from it at the next open).
        OSError: another failure to write.
    """
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    then = "the store is intact and the index is rebuilt from it at the next open"
    with fileio.storage_errors(index_path, "saving the index", then):
        index.save(index_path)
        manifest = {"version": version, "spec": index.spec, "ntotal": index.ntotal, "sha256": sha256_file(index_path)}
        blob = json.dumps(manifest).encode()
        fileio.write_atomic(folder / MANIFEST_FILE, lambda f: f.write(blob), sync=False)


def saved_index_path(folder: str | os.PathLike[str], *, version: int, spec: str, ntotal: int) -> Path | None:
    """The saved index file if it is exactly the index asked for, else None.

    Served only when both :data:`INDEX_FILE` and :data:`MANIFEST_FILE` exist and the manifest says the index is
    of this store version, this spec and this size, and the file holds the very bytes the manifest was written
    for (a torn, truncated or swapped file fails the hash before FAISS reads it). A damaged or foreign manifest
    (not JSON, not an object, unreadable) gives None: the store is the truth, the caller rebuilds from it.

    Args:
        folder: the database folder.
        version: the store version the index must reflect.
        spec: the index spec it must have.
        ntotal: how many vectors it must hold.

    Returns:
        The path of the index file, or None.
    """
    folder = Path(folder)
    index_path, manifest_path = folder / INDEX_FILE, folder / MANIFEST_FILE
    try:
        if not (manifest_path.is_file() and index_path.is_file()):
            return None
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            return None
        if (
            manifest.get("version") == version
            and manifest.get("spec") == spec
            and manifest.get("ntotal") == ntotal
            and manifest.get("sha256") == sha256_file(index_path)
        ):
            return index_path
    except (OSError, ValueError, TypeError):  # ValueError: bad JSON or UTF-8
        pass
    return None
