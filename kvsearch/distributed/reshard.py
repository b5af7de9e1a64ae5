"""Resharding: a database copied into a new folder with another shard count, its records keeping their ids.

    reshard("indexes/people", "indexes/people-8", num_shards=8)     # a plain database -> 8 shards, or N -> 8
    reshard("indexes/people-8", "indexes/people-1", num_shards=1)   # shards -> one plain database
    reshard("indexes/people", "indexes/people-hnsw", num_shards=1, index="HNSW32")  # another index, same records

What is carried: every record (key and value texts, metadata) under its id; the key and value embeddings as stored
(never re-encoded: keys and values given as embeddings stay as given); the current generation of encoders (their files
copied, their SHA-256 checked on open) and its number; the options (dims, score, index spec, search parameters),
unless ``index=`` names another spec (then its search parameters are ``search_params`` or none): the one way to change
a database's index, which is fixed when it is created.
Not carried: the previous generation (a rollback has nothing to return to) and the saved index (each new shard's is
built from its records). ``num_shards=1`` makes a plain :class:`~kvsearch.Database` folder (one shard is one
database); more makes a sharded database (:class:`~kvsearch.distributed.ShardedDatabase`) whose layout says
``banded_ids=False``.

Ids: a key text goes to ``shard_of_key(key, num_shards)``, a key given as an embedding (no text) round-robin in id
order (as :meth:`ShardedDatabase.add` deals a batch of them out); both keep their ids, so the owner of an id is found
by asking the shards (:func:`~kvsearch.distributed.reads.owner_shards`). New ids never repeat one the source ever
handed out, deleted ones included: shard s of the result hands out ids of its band ``(s << ID_SHIFT) + 1 ...`` after
every id of that band the source and its own sources handed out (their AUTOINCREMENT sequences, carried as the stores'
id marks, :mod:`kvsearch.storage.carry`); a plain result after every one of them.

The source is never written, nor opened by SQLite (a reader leaves side files): its files are copied, byte for byte,
beside the result (room for one copy of the source is needed while it runs), and the copy is read; a source written
to while it is copied is detected (a file's size or time moved) and nothing is kept. The result is built in a
staging folder beside the destination (``.NAME.reshard-PID``, marked by :data:`MARKER` so that a later run removes
one a killed run left), synced, then renamed into place in one ``os.rename``: a crash at any point leaves the
destination absent or whole.

This module knows nothing of search or of a store's internals: it reads the copy of the source through read-only
databases and writes through :mod:`kvsearch.storage.carry`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsearch.checks import check_open_files, check_path
from kvsearch.database import Database
from kvsearch.distributed.layout import (
    ID_SHIFT,
    ShardLayout,
    is_sharded,
    shard_dir,
    shard_of_key,
)
from kvsearch.distributed.opening import check_num_shards
from kvsearch.errors import (
    DatabaseExistsError,
    ForeignFolderError,
    InconsistentDatabaseError,
    InvalidArgumentError,
)
from kvsearch.retrieval import Retriever
from kvsearch.storage import carry
from kvsearch.storage import folder as folder_checks
from kvsearch.storage.fileio import storage_errors
from kvsearch.storage.folder import LOCK_FILE, STORE_FILE, is_database
from kvsearch.storage.store import Store

__all__ = ["MARKER", "BATCH", "ReshardReport", "reshard"]

#: The file that marks a staging folder as a reshard's own (a later run removes it once its process is gone); removed
#: from the result just after the rename (a crash in between leaves it there, harmless).
MARKER = ".kvsearch-reshard"
#: Records carried in one transaction.
BATCH = 4096
#: The folder, inside the staging folder, of the copy of the source that is read (removed before the rename).
SOURCES = ".sources"


@dataclass(frozen=True)
class ReshardReport:
    """What :func:`reshard` did.

    Attributes:
        source, target: the folders. source_shards: the source's shard count (0: a plain database).
        num_shards: the result's (1: a plain database). records: records carried. generation: the generation
        carried. seconds: how long it took.
    """

    source: Path
    target: Path
    source_shards: int
    num_shards: int
    records: int
    generation: int
    seconds: float


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    num_shards: int,
    index: str | None = None,
    search_params: Mapping[str, float] | None = None,
) -> ReshardReport:
    """Copy the database ``src`` (plain or sharded) into the new folder ``dst`` with ``num_shards`` shards.

    Args:
        src: a database folder, plain or sharded; only read (copied), left untouched.
        dst: the new folder: absent or empty (its parent is created if missing).
        num_shards: the shard count of the result; 1 makes a plain database folder.
        index: the index spec of the result (as ``Database(index=)``); None: the source's.
        search_params: the result's search parameters (None: the source's, or none with another ``index``).

    Returns:
        A :class:`ReshardReport`.

    Raises:
        InvalidArgumentError: a bad shard count; ``src`` is not a database; ``dst`` is ``src``, inside it or holds
            it, or is a file. DatabaseExistsError: ``dst`` holds a kvsearch database. ForeignFolderError: ``dst``
            holds other files. (All before anything is written.)
        UnknownOptionError, InvalidArgumentError: an ``index`` or ``search_params`` that makes no index of the
            source's dim and score (checked on the copy of the source, before the result is written; dst untouched).
        InconsistentDatabaseError: the source's shards are at different generations (open it as a ShardedDatabase
            once to finish an interrupted switch), or the source was written to during the copy (nothing is kept).
        CorruptDatabaseError: the source is damaged. DiskFullError, ReadOnlyDatabaseError: the result could not be
            written (nothing is kept).
    """
    started = time.perf_counter()
    check_num_shards(num_shards, optional=False)
    check_path(src, optional=False)
    check_path(dst, optional=False)
    options = _check_options(index, search_params)
    source, target = Path(src), Path(dst)
    folders = _source_folders(source)
    _check_target(source, target)
    check_open_files(num_shards + 1, f"resharding into {num_shards:,} shards")  # every new store is open at once
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(target)
    staging = target.parent / f".{target.name}.reshard-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # an earlier run of this process id (ours now)
    staging.mkdir()
    try:
        with storage_errors(staging, f"resharding {source} into {target}", "nothing was kept"):
            (staging / MARKER).write_text(f"{os.getpid()}\n{source}\n{target}\n", encoding="utf-8")
            records, generation = _build(source, folders, staging, num_shards, options)
            _verify(staging, num_shards)
            _sync_tree(staging)
        try:
            os.rename(staging, target)  # onto an absent or empty folder: the commit point
        except OSError as exc:
            raise ForeignFolderError(
                f"expected {target} absent or empty to rename the result onto, got {exc}"
            ) from None
    except BaseException:
        with contextlib.suppress(OSError):
            _remove_staging(staging)
        raise
    _sync_dir(target.parent)
    (target / MARKER).unlink()  # the staging folder kept it to the end, so that a killed run's is always known
    _sync_dir(target)
    seconds = time.perf_counter() - started
    return ReshardReport(
        source, target, len(folders) if is_sharded(source) else 0, num_shards, records, generation, seconds
    )


# ---------------------------------------------------------------------- checks (before anything is written)


def _source_folders(source: Path) -> list[Path]:
    """The database folders of the source: its shards in order, or itself."""
    if is_sharded(source):
        return [shard_dir(source, s) for s in range(ShardLayout.read(source).num_shards)]
    if is_database(source):
        return [source]
    raise InvalidArgumentError(
        f"expected a kvsearch database (plain or sharded) to reshard at {source}, got none there"
    )


def _check_target(source: Path, target: Path) -> None:
    """Refuse a destination that is the source, inside it or holding it, a file, a database or someone's folder."""
    src, dst = source.resolve(), target.resolve()
    if src == dst or src in dst.parents or dst in src.parents:
        raise InvalidArgumentError(
            f"expected a destination outside the source {source} (and not holding it), got {target}"
        )
    if not target.exists():
        folder_checks.check_new_folder(target)  # WrongKindError: inside another database's folder
        return
    if not target.is_dir():
        raise InvalidArgumentError(f"expected an absent or empty folder as the destination, got a file: {target}")
    if folder_checks.kind_of(target) in ("plain", "sharded", "unfinished"):
        kind = "a sharded" if is_sharded(target) else "a"
        raise DatabaseExistsError(
            f"{target} already holds {kind} kvsearch database: nothing was written; choose a new folder"
        )
    folder_checks.check_new_folder(target)  # ForeignFolderError naming the files; WrongKindError: inside a database
    entries = sorted(p.name for p in target.iterdir())
    if entries:  # (even .gitkeep: the result is renamed onto the folder, which must be empty)
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ForeignFolderError(
            f"expected an absent or empty folder as the destination, got {target} holding {len(entries)} entries "
            f"({shown}): nothing was written"
        )


def remove_stale(target: Path) -> list[Path]:
    """Remove the staging folders of earlier reshards into ``target`` whose process is gone (killed); those removed.

    Only folders named ``.NAME.reshard-PID`` beside ``target`` that hold :data:`MARKER` (or nothing at all: a run
    killed before it marked its folder) are touched.
    """
    removed = []
    for path in target.parent.glob(f".{target.name}.reshard-*"):
        pid = path.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or not path.is_dir() or _alive(int(pid)):
            continue
        if (path / MARKER).is_file():
            _remove_staging(path)
        else:  # killed between making the folder and marking it, or removing it: empty (rmdir removes nothing else)
            with contextlib.suppress(OSError):
                path.rmdir()
        if not path.exists():
            removed.append(path)
    return removed


def _remove_staging(path: Path) -> None:
    """Remove a staging folder, its marker last: a removal killed halfway leaves a folder still marked (or empty)."""
    if path.is_dir():
        for child in path.iterdir():
            if child.name != MARKER:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    with contextlib.suppress(OSError):
        (path / MARKER).unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a folder of this very process is an earlier run's of a reused pid, or ours: remade anyway
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------- the copy


@contextlib.contextmanager
def _opened(folder: Path, *, read_only: bool = True) -> Iterator[Database]:
    db = Database(folder, read_only=read_only, device="cpu")
    try:
        yield db
    finally:
        db.close()


def _snapshot(folders: list[Path], into: Path) -> list[Path]:
    """Copies of the source's database folders in ``into`` (what the reshard reads: the source itself is only read
    byte for byte, never opened by SQLite, which would leave its side files there).

    Raises:
        InconsistentDatabaseError: a file of the source changed while it was copied (a writer).
    """
    before = _signature(folders)
    copies = []
    for n, folder in enumerate(folders):
        copy = into / f"source-{n:04d}"
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(LOCK_FILE, f"{STORE_FILE}-shm"))
        copies.append(copy)
    if _signature(folders) != before:
        raise InconsistentDatabaseError(
            f"{folders[0].parent if len(folders) > 1 else folders[0]} was written to while it was resharded: nothing "
            "was kept; reshard it when no one writes to it"
        )
    return copies


def _signature(folders: list[Path]) -> list[tuple[str, int, int]]:
    """(path, size, modification time) of every file under the folders: what a writer changes."""
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.name not in (LOCK_FILE, f"{STORE_FILE}-shm"):
                stat = path.stat()
                found.append((str(path), stat.st_size, stat.st_mtime_ns))
    return found


def _check_options(index: object, search_params: object) -> dict[str, Any]:
    """The options the result changes (``index``, ``search_params``), checked for their kinds."""
    if index is not None and (not isinstance(index, str) or not index):
        raise InvalidArgumentError(f"expected index as an index spec such as 'HNSW32', got {index!r}")
    if search_params is not None and not isinstance(search_params, Mapping):
        raise InvalidArgumentError(
            f"expected search_params as a dict such as {{'efSearch': 64}}, got {search_params!r}"
        )
    options: dict[str, Any] = {}
    if index is not None:
        options.update(index=index, search_params={})
    if search_params is not None:
        options["search_params"] = dict(search_params)
    return options


def _new_config(config: dict[str, Any], options: dict[str, Any], store: Store) -> dict[str, Any]:
    """The result's configuration: the source's with ``options`` on top, checked by making an empty index of it.

    Raises:
        UnknownOptionError, InvalidArgumentError: the spec or a parameter makes no index of this dim and score.
    """
    if not options or all(config.get(name) == value for name, value in options.items()):
        return config
    config = {**config, **options}
    params = config["search_params"]
    Retriever(store, dim=int(config["dim"]), spec=config["index"], score=config["score"], params=params)
    return config


def _build(
    source: Path, folders: list[Path], staging: Path, num_shards: int, options: dict[str, Any]
) -> tuple[int, int]:
    """Write the result into ``staging``; (records carried, generation)."""
    layout = ShardLayout.read(source) if is_sharded(source) else None
    copies = _snapshot(folders, staging / SOURCES)
    # pass 1, one source at a time: where each record goes, the sources' generations and id marks
    plan: list[tuple[list[int], list[int]]] = []  # per source: its ids, and the target of each (-1: round-robin)
    generations, marks = set(), set()
    config: dict[str, Any] = {}
    for folder in copies:
        with _opened(folder) as db:
            store = db.store
            config = config or _new_config(store.get_meta("config"), options, store)  # checked before any write
            generations.add(db.generation)
            marks.update(carry.id_marks(store))
            ids = store.table.ids.tolist()
            keys = store.texts.key_of_id
            plan.append((ids, [-1 if i not in keys else shard_of_key(keys[i], num_shards) for i in ids]))
    generation = _one_generation(source, layout, generations)
    loose = sorted(i for ids, targets in plan for i, t in zip(ids, targets) if t < 0)  # keys given as embeddings
    dealt = {id_: n % num_shards for n, id_ in enumerate(loose)}
    plan = [(ids, [dealt[i] if t < 0 else t for i, t in zip(ids, targets)]) for ids, targets in plan]
    carried = [i for ids, _ in plan for i in ids]
    plain = num_shards == 1
    folders_out = [staging] if plain else [shard_dir(staging, s) for s in range(num_shards)]
    # pass 2: every target open, the sources one at a time, carried in batches
    stores: list[Store] = []
    try:
        for n, folder in enumerate(copies):
            with _opened(folder) as db:
                if not stores:
                    for out in folders_out:
                        out.mkdir(exist_ok=True)
                        stores.append(carry.start(out, db.store, folder))
                        stores[-1].set_meta("config", config)
                ids, targets = plan[n]
                per_target: list[list[int]] = [[] for _ in stores]
                for i, to in zip(ids, targets):
                    per_target[0 if plain else to].append(i)
                for store, mine in zip(stores, per_target):
                    for start in range(0, len(mine), BATCH):
                        carry.carry(store, [(db.store, mine[start : start + BATCH])])
        tops = _per_band(marks | set(carried))  # band -> the highest id of it ever handed out
        for t, store in enumerate(stores):
            carry.seal(store, _next_after(None if plain else t, tops), sorted(tops.values()))
    finally:
        for store in stores:
            store.close()
    shutil.rmtree(staging / SOURCES)
    if not plain:
        first = layout or _options_of(staging)
        ShardLayout(
            num_shards,
            first.dim,
            first.value_dim,
            first.score,
            config["index"],
            generation=generation,
            banded_ids=False,
        ).write(staging)
    return len(carried), generation


def _options_of(staging: Path) -> ShardLayout:
    """The options of the first new shard, as a layout (for a plain source, which has none)."""
    with _opened(shard_dir(staging, 0)) as db:
        return ShardLayout(1, db.dim, db.value_dim, db.score, db.index_spec)


def _one_generation(source: Path, layout: ShardLayout | None, generations: set[int]) -> int:
    """The generation every source shard is at (and its layout records)."""
    recorded = None if layout is None else layout.generation
    if len(generations) != 1 or (recorded is not None and recorded not in generations):
        raise InconsistentDatabaseError(
            f"expected every shard of {source} at one generation (shards.json: {recorded}), got {sorted(generations)}: "
            "open it once as a ShardedDatabase (it finishes an interrupted switch), then reshard"
        )
    return next(iter(generations))


def _per_band(ids: set[int]) -> dict[int, int]:
    """Band -> the highest of ``ids`` in it (what a store's id marks and its next id need)."""
    top: dict[int, int] = {}
    for i in ids:
        top[i >> ID_SHIFT] = max(top.get(i >> ID_SHIFT, 0), i)
    return top


def _next_after(shard: int | None, tops: dict[int, int]) -> int:
    """The id a new store's own ids start after: in shard ``shard``'s band, after every id of the band ever handed
    out (``tops``: :func:`_per_band` of the marks and the carried ids); for a plain result (None), after every id."""
    if shard is None:
        return max(tops.values(), default=0)
    return max(shard << ID_SHIFT, tops.get(shard, 0))


def _verify(staging: Path, num_shards: int) -> None:
    """Open each new database folder as a user would (configuration and encoder digests checked, a trained index
    built and saved), then close it; a sharded result's layout must name every shard's generation.

    Raises:
        InconsistentDatabaseError: a shard is at another generation than the layout records.
    """
    if num_shards == 1:
        Database(staging, device="cpu").close()
        return
    layout = ShardLayout.read(staging)
    for s in range(num_shards):
        with _opened(shard_dir(staging, s), read_only=False) as db:  # writable: a trained index is saved
            if db.generation != layout.generation:
                raise InconsistentDatabaseError(
                    f"expected shard {s} of the result at generation {layout.generation}, got {db.generation}"
                )


# ---------------------------------------------------------------------- durability


def _sync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (and itself), so that the rename publishes durable bytes."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(folder))


def _sync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
