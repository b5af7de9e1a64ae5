"""A :class:`~kvsearch.nn.product_keys.ProductKeyMemory`'s folder: the memory saved as generations, each switched to
whole, the one before kept for a rollback.

    memory = ProductKeyMemory(512, num_keys=128, folder="runs/memory")   # the saved memory, or a new folder
    memory.save()        # -> 1: generation 1 written, then switched to
    memory.save()        # -> 2 (1 kept for a rollback)
    memory.rollback()    # -> 1, loaded into the memory (2 is removed)

The folder holds:

- ``memory.json``, the manifest: what the folder is (``"kind": "kvsearch.ProductKeyMemory"``, ``"format": 1``), the
  memory's ``config``, the current ``generation``, the ``previous`` one (a rollback's target, or null), the
  ``latest`` number ever written, and the size and SHA-256 of each kept generation's file. Replacing it (a temporary
  file synced, renamed over it, the folder synced) is the switch.
- ``memory.<G>.safetensors``: generation G, the memory's whole ``state_dict()`` (the query map, the norm, the
  sub-keys, the values, and the slots' ``frozen`` / ``hits`` / ``written`` / ``step``), with G and the config in the
  file's metadata. Written whole (a temporary name, synced, renamed, the folder synced) before any manifest names
  it, and never changed after. Nothing is pickled.
- ``write.lock``: the folder's write lock (:class:`~kvsearch.storage.locking.WriteLock`): one save or rollback at a
  time, across processes.

A save runs three steps, each a public function here (the kill test stops a process right after each):
:func:`write_state` (generation G+1's file, whole), :func:`switch` (the manifest names G+1, G kept as the previous),
:func:`remove_unkept` (G-1's file goes). A process killed at any instant leaves a manifest that names whole files:
the folder opens at G or at G+1, never in between. What a killed save leaves (a file no manifest names, temporary
files) is never read, and the next save removes it. A rollback checks the previous generation's file, switches the
manifest to it (with no previous: a second rollback raises), loads it into the memory and removes the newer file.

Generation numbers only grow: a save after a rollback takes the number after the latest ever written, so a number
names one saved state for good (the file of a number never changes).

**Readers.** Opening reads the manifest, then the file it names, checked against its size and SHA-256 (a damaged
file raises :class:`~kvsearch.errors.CorruptDatabaseError`); it takes no lock and writes nothing, so a read-only
folder opens. When the file went meanwhile (two saves of another process removed it), the manifest is read again:
a reader never sees a half-written generation. **Writers.** A save or rollback holds the write lock and first
checks that the folder is still at the generation this handle holds: when another handle saved or rolled back
since, it raises :class:`~kvsearch.errors.StoreChangedError` and writes nothing (writing on would drop the other's
work without a word); open the folder again to go on from what it holds.

Why this module is in the storage wing: ``nn/`` (where the memory is) is below ``storage/`` and imports nothing of
it, so ``ProductKeyMemory(folder=...)`` opens its folder through the opener this module registers with
:func:`kvsearch.nn.product_keys.register_folder_opener` when it is imported (``kvsearch/__init__.py`` imports it);
the memory then holds the :class:`MemoryFolder` and hands itself to its ``save`` / ``rollback``. The files are
written with :mod:`kvsearch.storage.fileio`'s atomic writes, under :mod:`kvsearch.storage.locking`'s lock; a
database folder is recognised by :func:`kvsearch.storage.folder.kind_of` and refused.

It knows nothing of a database's store, indexes, encoders, attention or training: it moves a memory's ``config``
and ``state_dict()`` between the memory and the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from kvsearch.checks import check_finite, check_path
from kvsearch.errors import (
    ConfigMismatchError,
    CorruptDatabaseError,
    ForeignFolderError,
    MissingFileError,
    NothingToRollBackError,
    NotSupportedError,
    StoreChangedError,
    WrongKindError,
)
from kvsearch.nn.product_keys import register_folder_opener
from kvsearch.storage import fileio
from kvsearch.storage.folder import IGNORED_FILES, kind_of, remove_path, sha256_file
from kvsearch.storage.locking import DEFAULT_LOCK_TIMEOUT, LOCK_FILE, WriteLock

__all__ = [
    "MemoryFolder",
    "StatefulMemory",
    "MANIFEST_FILE",
    "KIND",
    "FORMAT",
    "file_name",
    "saved_config",
    "write_state",
    "switch",
    "remove_unkept",
]

#: The manifest: the file that makes a folder a memory's folder, and whose replacement is the switch.
MANIFEST_FILE = "memory.json"
#: What the manifest says the folder is.
KIND = "kvsearch.ProductKeyMemory"
#: The manifest's format (a newer one is refused, not guessed at).
FORMAT = 1
#: Times an opening reads the manifest again when the file it named went meanwhile (another process's saves).
READ_TRIES = 8
_GENERATION_FILE = re.compile(r"memory\.(\d+)\.safetensors")
_TEMP_FILE = re.compile(r"\.memory\.(json|\d+\.safetensors)\.[0-9a-f]+\.tmp")  # fileio.temp_file's names


class StatefulMemory(Protocol):
    """What the folder reads and writes of a memory (a :class:`~kvsearch.nn.product_keys.ProductKeyMemory`)."""

    @property
    def config(self) -> dict[str, Any]: ...

    def state_dict(self, *, keep_vars: bool = False) -> Mapping[str, Tensor]: ...

    def load_state_dict(self, state: Mapping[str, Tensor]) -> Any: ...


def file_name(generation: int) -> str:
    """The file of generation G: ``memory.<G>.safetensors``."""
    return f"memory.{int(generation)}.safetensors"


# --------------------------------------------------------------------------- the steps of a save


def write_state(folder: Path, generation: int, state: Mapping[str, Tensor], config: Mapping[str, Any]) -> dict:
    """Step 1 of a save: generation G's file, whole or not at all (a temporary name, synced, renamed, the folder
    synced). Until :func:`switch` names it, no reader looks at it.

    Returns:
        The manifest's entry of the file: ``{"bytes": size, "sha256": hex}``.

    Raises:
        OSError: what the file system raised (the caller types it).
    """
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    metadata = {"kind": KIND, "generation": str(int(generation)), "config": json.dumps(dict(config), sort_keys=True)}
    path = folder / file_name(generation)

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata=metadata)
        _sync(tmp)

    fileio.write_atomic_path(path, write)
    _sync(folder, folder=True)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def switch(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Step 2: the manifest replaced (synced, renamed over the old one, the folder synced). From here on the folder
    is at ``manifest["generation"]``.

    Raises:
        OSError: what the file system raised (the old manifest is then as it was).
    """
    blob = (json.dumps(dict(manifest), indent=2, sort_keys=True) + "\n").encode("utf-8")
    fileio.write_atomic(folder / MANIFEST_FILE, lambda f: f.write(blob))
    _sync(folder, folder=True)


def remove_unkept(folder: Path, keep: set[int]) -> list[str]:
    """Step 3: the generation files not in ``keep``, and the temporary files of writes that stopped. The caller holds
    the write lock (so no temporary file is another writer's). Never raises for a file that cannot go.

    Returns:
        The names removed, sorted.
    """
    removed = []
    for entry in folder.iterdir():
        match = _GENERATION_FILE.fullmatch(entry.name)
        if (match is not None and int(match[1]) not in keep) or _TEMP_FILE.fullmatch(entry.name):
            remove_path(entry)
            removed.append(entry.name)
    return sorted(removed)


def _sync(path: Path, folder: bool = False) -> None:
    """fsync a file (raises OSError) or a folder's entries (where the OS allows it: errors ignored)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not folder:
            raise
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the manifest and the files


def _is_ours(name: str) -> bool:
    """Whether a name in a memory's folder is one this module writes (or a mark that any folder may hold)."""
    ours = name in (MANIFEST_FILE, LOCK_FILE) or _GENERATION_FILE.fullmatch(name) or _TEMP_FILE.fullmatch(name)
    return bool(ours) or name in IGNORED_FILES


def _check_folder(path: Path) -> bool:
    """Whether ``path`` holds a saved memory (False: absent, empty, or only what a first save that stopped left).

    Raises:
        WrongKindError: it holds a kvsearch database (plain or sharded).
        ForeignFolderError: it is a file, or holds files that are not a memory's.
    """
    if not path.exists():
        return False
    if not path.is_dir():
        raise ForeignFolderError(f"expected a folder for the memory, got a file: {path}. Nothing was written")
    if (path / MANIFEST_FILE).is_file():
        return True
    if kind_of(path) in ("plain", "sharded", "unfinished"):
        raise WrongKindError(
            f"expected a memory's folder ({MANIFEST_FILE}) or an empty folder, got {path} holding a kvsearch "
            f"database: open it with kvsearch.Database({str(path)!r}); a memory needs a folder of its own. Nothing "
            "was written"
        )
    foreign = sorted(entry.name for entry in path.iterdir() if not _is_ours(entry.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5:,} more" if len(foreign) > 5 else "")
        raise ForeignFolderError(
            f"expected an empty folder (or a memory's folder, {MANIFEST_FILE}) for the memory, got {path} holding "
            f"other files: {shown}. kvsearch never writes among someone else's files: choose a new folder such as "
            f"{path / 'memory'}. Nothing was written"
        )
    return False


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The folder's manifest, checked; None where there is none.

    Raises:
        ForeignFolderError: a ``memory.json`` that is not a kvsearch memory's.
        NotSupportedError: one written in a newer format.
        CorruptDatabaseError: one that cannot be read or lacks what it must hold.
    """
    file = path / MANIFEST_FILE
    try:
        data = json.loads(file.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, not UTF-8; RecursionError: too deep
        raise CorruptDatabaseError(f"{file} cannot be read as a memory's manifest: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ForeignFolderError(
            f"expected {file} to be a kvsearch memory's manifest (kind {KIND!r}), got "
            f"{'kind ' + repr(data.get('kind')) if isinstance(data, dict) else type(data).__name__}: it is not "
            "kvsearch's. Nothing was written"
        )
    if data.get("format") != FORMAT:
        raise NotSupportedError(f"{file} has format {data.get('format')!r}; this kvsearch reads format {FORMAT}")
    try:
        generation, latest, previous = int(data["generation"]), int(data["latest"]), data["previous"]
        kept = [generation] + ([] if previous is None else [int(previous)])
        entries = [data["files"][str(g)] for g in kept]
        ok = isinstance(data["config"], dict) and 1 <= generation <= latest
        ok = ok and all(isinstance(e["bytes"], int) and isinstance(e["sha256"], str) for e in entries)
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: an infinite number
        ok = False
    if not ok:
        raise CorruptDatabaseError(f"{file} lacks what a memory's manifest holds (generation, latest, files): damaged")
    return data


def saved_config(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The config of the memory saved in the folder ``path`` (what ``ProductKeyMemory.open(path)`` opens it with),
    or None where none is saved.

    Raises:
        InvalidArgumentError: not a path. WrongKindError, ForeignFolderError: not a memory's folder.
        CorruptDatabaseError, NotSupportedError: a manifest that cannot be read.
    """
    check_path(path, optional=False)
    folder = Path(path)
    if not _check_folder(folder):
        return None
    manifest = read_manifest(folder)
    return None if manifest is None else dict(manifest["config"])


def _identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """What of a config the saved memory must match: everything but ``sparse`` (the gradients' layout: a memory
    saved with sparse gradients may be trained on with dense ones)."""
    return {name: value for name, value in config.items() if name != "sparse"}


def _check_config(path: Path, saved: Mapping[str, Any], given: Mapping[str, Any]) -> None:
    """Raises ConfigMismatchError naming the options that differ."""
    saved, given = _identity(saved), _identity(given)
    if saved == given:
        return
    differ = [n for n in dict.fromkeys([*saved, *given]) if saved.get(n) != given.get(n)]
    raise ConfigMismatchError(
        f"expected the options of the memory saved in {path} ({', '.join(f'{n}={saved.get(n)!r}' for n in differ)}), "
        f"got {', '.join(f'{n}={given.get(n)!r}' for n in differ)}: open it with the saved options "
        f"(kvsearch.storage.memory_folder.saved_config({str(path)!r})), or give another folder. Nothing was written"
    )


def read_state(path: Path, manifest: Mapping[str, Any], generation: int) -> dict[str, Tensor]:
    """Generation G's tensors, checked against the manifest's size and SHA-256.

    Raises:
        MissingFileError: the file is not there (or went while it was read).
        CorruptDatabaseError: its bytes are not those saved.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    entry = manifest["files"][str(generation)]
    file = path / file_name(generation)
    try:
        identity = fileio.file_identity(file)
        if identity is None:
            raise FileNotFoundError(file)
        size, digest = file.stat().st_size, sha256_file(file)
        if size != entry["bytes"] or digest != entry["sha256"]:
            raise CorruptDatabaseError(
                f"{file} was changed or damaged since it was saved: expected {entry['bytes']:,} bytes of SHA-256 "
                f"{entry['sha256']}, found {size:,} bytes of {digest}. Restore the folder from a backup"
            )
        tensors = load_file(str(file))
        if fileio.file_identity(file) != identity:
            raise FileNotFoundError(file)
    except FileNotFoundError:
        raise MissingFileError(f"{file}, generation {generation} of the memory in {path}, is missing") from None
    except (OSError, SafetensorError) as exc:
        raise CorruptDatabaseError(f"{file} cannot be read: {exc}") from None
    return tensors


def _check_state(path: Path, memory: StatefulMemory, tensors: Mapping[str, Tensor]) -> None:
    """Raises CorruptDatabaseError unless ``tensors`` are the memory's state by name and shape."""
    own = memory.state_dict()
    wrong = sorted(set(own) ^ set(tensors)) or [n for n in own if tuple(own[n].shape) != tuple(tensors[n].shape)]
    if wrong:
        raise CorruptDatabaseError(
            f"expected the tensors of a memory of these options in {path}, got a generation file whose tensors "
            f"differ ({', '.join(wrong[:5])}): damaged"
        )


@torch.no_grad()
def _load_into(memory: StatefulMemory, tensors: Mapping[str, Tensor]) -> None:
    """The memory becomes the saved one: its tensors take the saved dtypes (their devices stay), then the values."""
    own = memory.state_dict(keep_vars=True)  # the parameters and buffers themselves
    for name, tensor in own.items():
        if tensor.dtype != tensors[name].dtype:
            tensor.data = tensor.data.to(tensors[name].dtype)
    memory.load_state_dict(tensors)


# --------------------------------------------------------------------------- the folder


class MemoryFolder:
    """A memory's folder, as a memory made with ``folder=`` holds it (``memory.folder``).

    ``generation`` is the generation this handle holds (0: nothing saved yet), ``previous`` the one a rollback returns
    to (None: none). A deep copy of the memory shares the handle (a folder is a resource, as a ``KVAttention``
    shares its database); pickling keeps the path and the generation, and reopens nothing.

    Args:
        path: the folder.
        lock_timeout: seconds a save waits for another writer's save before DatabaseLockedError.
    """

    def __init__(self, path: str | os.PathLike[str], *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
        check_path(path, optional=False)
        self.path = Path(path)
        self.generation = 0
        self.previous: int | None = None
        self.lock = WriteLock(self.path / LOCK_FILE, lock_timeout)

    @classmethod
    def open(cls, path: str | os.PathLike[str], memory: StatefulMemory) -> MemoryFolder:
        """What ``ProductKeyMemory(..., folder=path)`` runs: load the saved memory into ``memory``, or make the folder.

        Args:
            path: the folder: absent or empty (made; nothing saved until ``save()``), or a memory's folder.
            memory: the new memory, of the options given.

        Returns:
            The handle the memory keeps.

        Raises:
            ConfigMismatchError: the folder holds a memory of other options (as ``config``, ``sparse`` aside).
            WrongKindError: the folder holds a kvsearch database. ForeignFolderError: a file, or other files.
            CorruptDatabaseError: a manifest or generation file that is damaged (MissingFileError: gone).
            DiskFullError, ReadOnlyDatabaseError: an absent folder that cannot be made.
        """
        handle = cls(path)
        if not _check_folder(handle.path):
            with fileio.storage_errors(handle.path, "making the memory's folder", "nothing was written"):
                handle.path.mkdir(parents=True, exist_ok=True)
            return handle
        for _ in range(READ_TRIES):
            manifest = read_manifest(handle.path)
            if manifest is None:  # removed meanwhile: nothing saved
                return handle
            _check_config(handle.path, manifest["config"], memory.config)
            try:
                tensors = read_state(handle.path, manifest, manifest["generation"])
            except MissingFileError:
                if read_manifest(handle.path) == manifest:
                    raise
                continue  # another process saved twice while this one read: read what it names now
            _check_state(handle.path, memory, tensors)
            _load_into(memory, tensors)
            handle.generation, handle.previous = int(manifest["generation"]), manifest["previous"]
            return handle
        raise CorruptDatabaseError(f"{handle.path} kept changing while its memory was read ({READ_TRIES} tries)")

    def save(self, memory: StatefulMemory) -> int:
        """Save the memory as the next generation and switch to it; the previous one is kept for a rollback.

        Returns:
            The new generation's number.

        Raises:
            NonFiniteError: a tensor of the memory holds NaN or Inf (nothing is written).
            StoreChangedError: another handle saved or rolled back since this one opened or saved (nothing written).
            ConfigMismatchError: the memory's options are not those saved in the folder.
            DatabaseLockedError: another process's save held the lock past ``lock_timeout``.
            DiskFullError, ReadOnlyDatabaseError: the folder cannot be written (it stays at its generation).
        """
        state = memory.state_dict()
        for name, tensor in state.items():
            if tensor.is_floating_point():
                check_finite(tensor, f"the memory's {name}")
        config = dict(memory.config)
        with self._writing("saving the memory"):
            manifest = self._check_current()
            if manifest is not None:
                _check_config(self.path, manifest["config"], config)
            old = self.generation
            new = (int(manifest["latest"]) if manifest is not None else 0) + 1
            files = {} if manifest is None else {str(old): manifest["files"][str(old)]}
            kept = {old} if manifest is None or manifest["previous"] is None else {old, int(manifest["previous"])}
            remove_unkept(self.path, kept)  # what a save that stopped left
            files[str(new)] = write_state(self.path, new, state, config)
            previous = old if old else None
            switch(self.path, _manifest(config, new, previous, new, files))
            self.generation, self.previous = new, previous
            remove_unkept(self.path, {new, old})
        return new

    def rollback(self, memory: StatefulMemory) -> int:
        """Return the folder and the memory to the previous generation (once: it then has no previous one).

        Returns:
            The generation now current.

        Raises:
            NothingToRollBackError: there is no previous generation (none saved yet, one only, or rolled back).
            StoreChangedError: another handle saved or rolled back since (nothing written).
            CorruptDatabaseError: the previous generation's file is damaged (MissingFileError: gone); nothing changes.
            DatabaseLockedError, DiskFullError, ReadOnlyDatabaseError: as :meth:`save`.
        """
        with self._writing("rolling the memory back"):
            manifest = self._check_current()
            if manifest is None or manifest["previous"] is None:
                raise NothingToRollBackError(
                    f"expected a previous generation to return to in {self.path}, got none (generation "
                    f"{self.generation} is the first kept, or was already rolled back)"
                )
            back = int(manifest["previous"])
            tensors = read_state(self.path, manifest, back)
            _check_state(self.path, memory, tensors)
            files = {str(back): manifest["files"][str(back)]}
            switch(self.path, _manifest(manifest["config"], back, None, int(manifest["latest"]), files))
            self.generation, self.previous = back, None
            _load_into(memory, tensors)
            remove_unkept(self.path, {back})
        return back

    def _check_current(self) -> dict[str, Any] | None:
        """The manifest, under the lock; raises StoreChangedError where it is not at this handle's generation."""
        manifest = read_manifest(self.path)
        found = 0 if manifest is None else int(manifest["generation"])
        if found != self.generation:
            what = "its manifest was deleted" if manifest is None else f"it is at generation {found}"
            raise StoreChangedError(
                f"expected the memory's folder {self.path} at generation {self.generation} (what this memory holds), "
                f"but {what}: another handle saved or rolled back since. Nothing was written; open the folder again "
                "(ProductKeyMemory(..., folder=...)) to go on from what it holds"
            )
        return manifest

    @contextlib.contextmanager
    def _writing(self, doing: str) -> Iterator[None]:
        """The write lock held, the file system's refusals typed."""
        with fileio.storage_errors(self.path, doing, f"the folder stays at generation {self.generation}"):
            if not self.path.is_dir():
                if self.generation:
                    raise StoreChangedError(f"the memory's folder {self.path} was deleted while the memory was open")
                self.path.mkdir(parents=True, exist_ok=True)
            with self.lock:
                yield

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "generation": self.generation, "previous": self.previous, "t": self.lock.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.generation, self.previous = state["path"], state["generation"], state["previous"]
        self.lock = WriteLock(self.path / LOCK_FILE, state["t"])

    def __deepcopy__(self, memo: dict[int, Any]) -> MemoryFolder:
        return self  # a resource: shared by the copies of the memory

    def __repr__(self) -> str:
        return f"MemoryFolder({str(self.path)!r}, generation={self.generation}, previous={self.previous})"


def _manifest(config: Mapping[str, Any], generation: int, previous: int | None, latest: int, files: dict) -> dict:
    return {
        "kind": KIND,
        "format": FORMAT,
        "config": dict(config),
        "generation": generation,
        "previous": previous,
        "latest": latest,
        "files": files,
    }


register_folder_opener(MemoryFolder.open, saved_config)
