"""Writing files whole or not at all, with the process umask, and the file system's refusals as typed errors.

    with storage_errors(folder, "adding records"):        # ENOSPC / SQLITE_FULL -> DiskFullError, EROFS -> ...
        ...
    write_atomic(folder / "manifest.json", lambda f: f.write(data))   # a temporary name, then os.replace

- :func:`storage_error` / :func:`storage_errors`: an ``OSError``, a SQLite error (or any error whose message says
  so) of a full disk or of a folder that cannot be written, as :class:`~kvsearch.errors.DiskFullError` or
  :class:`~kvsearch.errors.ReadOnlyDatabaseError` naming the path, what was being done and what it means.
- :func:`temp_file`, :func:`temp_dir`, :func:`create_new`: fresh files and folders made with the mode every other
  file gets (``0o666`` / ``0o777`` less the umask) — not ``tempfile``'s private ``0o600`` / ``0o700``, which would
  hide a shared database from the other users who may read it.
- :func:`write_atomic`: a file written to a temporary name in its folder, synced, moved into place; the temporary
  file is removed when anything fails.
- :func:`file_identity`, :func:`unwritable_reason`: which file a name points at; why a folder cannot be written.

It knows nothing of databases, encoders or indexes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from kvsearch.checks import file_limits
from kvsearch.errors import (
    CorruptDatabaseError,
    DiskFullError,
    FileLimitError,
    KVSearchError,
    ReadOnlyDatabaseError,
    StorageError,
    StoreChangedError,
)

__all__ = [
    "check_same_file",
    "sqlite_code",
    "is_disk_full",
    "is_read_only",
    "storage_error",
    "storage_errors",
    "temp_file",
    "temp_dir",
    "create_new",
    "write_atomic",
    "write_atomic_path",
    "file_identity",
    "unwritable_reason",
]

_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_FILES_ERRNOS = {errno.EMFILE, errno.ENFILE}
_SQLITE_FULL, _SQLITE_READONLY = 13, 8  # SQLite's primary result codes
_FULL_TEXTS = ("database or disk is full", "no space left on device", "disk quota exceeded")
_READ_ONLY_TEXTS = ("read-only file system", "readonly database", "permission denied")


def sqlite_code(exc: BaseException) -> int | None:
    """SQLite's primary result code of an error (``SQLITE_FULL`` = 13, ...), or None for another error."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF  # the primary code of an extended one


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the device is full: ``ENOSPC`` / ``EDQUOT``, ``SQLITE_FULL``, or a message saying so."""
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return True
    if sqlite_code(exc) == _SQLITE_FULL:
        return True
    text = str(exc).lower()
    return any(t in text for t in _FULL_TEXTS)


def cannot_open_more() -> bool:
    """Whether this process can open no more files now (``EMFILE``: its limit; ``ENFILE``: the system's)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as exc:
        return exc.errno in _FILES_ERRNOS
    return False


def is_out_of_files(exc: BaseException) -> bool:
    """Whether ``exc`` came of the open-file limit: ``EMFILE`` / ``ENFILE``, or a library's error (SQLite's "unable
    to open database file", FAISS's) raised while this process can open no more files."""
    if isinstance(exc, OSError) and exc.errno in _FILES_ERRNOS:
        return True
    if isinstance(exc, KVSearchError) and not isinstance(exc, CorruptDatabaseError):
        return False
    return "too many open files" in str(exc).lower() or cannot_open_more()


def is_read_only(exc: BaseException) -> bool:
    """Whether ``exc`` says the file or folder cannot be written: ``EROFS`` / ``EACCES`` / ``EPERM``,
    ``SQLITE_READONLY``, or a message saying so."""
    if isinstance(exc, OSError) and exc.errno in _READ_ONLY_ERRNOS:
        return True
    if sqlite_code(exc) == _SQLITE_READONLY:
        return True
    text = str(exc).lower()
    return any(t in text for t in _READ_ONLY_TEXTS)


def storage_error(exc: BaseException, path: object, doing: str, then: str = "") -> StorageError | None:
    """The typed error for a full disk or an unwritable folder, or None for any other error.

    Args:
        exc: what the file system, SQLite or a library raised.
        path: the file or folder being written (the error's own file name is named instead when it has one).
        doing: what was being done, e.g. ``"adding records"``.
        then: what it means for the data, e.g. ``"nothing of this write was kept"``.

    Returns:
        :class:`DiskFullError`, :class:`ReadOnlyDatabaseError`, :class:`FileLimitError` (the process may open no
        more files), or None.
    """
    if isinstance(exc, KVSearchError):
        return None
    where = getattr(exc, "filename", None) or path
    detail = " ".join(str(exc).split()) or type(exc).__name__
    tail = f"; {then}" if then else ""
    if is_out_of_files(exc):
        return file_limit_error(exc, where, doing, then)
    if is_disk_full(exc):
        return DiskFullError(f"no space left on the device of {where} while {doing} ({detail}){tail}; free some space")
    if is_read_only(exc):
        return ReadOnlyDatabaseError(f"cannot write {where} while {doing}: it is read-only ({detail}){tail}")
    return None


def file_limit_error(exc: BaseException, path: object, doing: str, then: str = "") -> FileLimitError:
    """The typed error of an open that failed for the open-file limit: what it is, never corruption."""
    limits = file_limits()
    limit = "ulimit -n" if limits is None else f"ulimit -n: {limits[0]:,}, hard {limits[1]:,}"
    detail = " ".join(str(exc).split()) or type(exc).__name__
    tail = f"; {then}" if then else ""
    return FileLimitError(
        f"too many open files while {doing} at {path} ({detail}): this process may open no more ({limit}); nothing "
        f"is damaged{tail}. Close databases that are not in use or raise the limit (ulimit -n)"
    )


@contextlib.contextmanager
def storage_errors(path: object, doing: str, then: str = "") -> Iterator[None]:
    """``with storage_errors(path, doing):`` — a full disk or an unwritable folder inside raises the typed error
    (:func:`storage_error`), without the chain of the library's own tracebacks; anything else passes unchanged.

    Raises:
        DiskFullError, ReadOnlyDatabaseError: what the block raised, typed.
    """
    try:
        yield
    except Exception as exc:
        typed = storage_error(exc, path, doing, then)
        if typed is None:
            raise
        raise typed from None


def create_new(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` as an empty file with the umask's mode; False (and nothing done) if it already exists.

    Raises:
        OSError: the folder cannot be written.
    """
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except FileExistsError:
        return False
    return True


def temp_file(folder: str | os.PathLike[str], name: str) -> Path:
    """A new empty file ``.{name}.<random>.tmp`` in ``folder`` (same file system as ``name``: renames are atomic).

    Raises:
        OSError: the folder cannot be written.
    """
    for _ in range(100):
        candidate = Path(folder) / f".{name}.{secrets.token_hex(6)}.tmp"
        if create_new(candidate):
            return candidate
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(Path(folder) / f".{name}.*.tmp"))


def temp_dir(folder: str | os.PathLike[str], prefix: str, suffix: str = "") -> Path:
    """A new empty folder ``{prefix}<random>{suffix}`` in ``folder``, with the umask's mode.

    Raises:
        OSError: the folder cannot be written.
    """
    for _ in range(100):
        candidate = Path(folder) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            os.mkdir(candidate, 0o777)
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(Path(folder) / f"{prefix}*{suffix}"))


def write_atomic(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, sync: bool = True) -> None:
    """Write ``path`` whole or not at all: ``write(f)`` fills a temporary file in the same folder, which is synced
    and moved into place. When anything fails the temporary file is removed and ``path`` is as it was.

    Args:
        path: the file to write.
        write: writes the bytes to the open binary file it is given.
        sync: fsync the file before the rename.

    Raises:
        OSError: what the file system raised (see :func:`storage_errors` for the typed version).
    """
    path = Path(path)
    tmp = temp_file(path.parent, path.name)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def write_atomic_path(path: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
    """As :func:`write_atomic`, for a library that opens the file itself: ``write(tmp)`` writes the temporary file
    by its path. Its mode is set back to the umask's afterwards (safetensors, for one, makes its files ``0o600``).

    Raises:
        OSError: what the file system raised.
    """
    path = Path(path)
    tmp = temp_file(path.parent, path.name)
    try:
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # 0o666 less the umask
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def file_identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file ``path`` names now, or None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def check_same_file(path: Path, identity: tuple[int, int]) -> None:
    """Check that ``path`` still names the file of ``identity`` (``(st_dev, st_ino)`` when it was opened).

    Raises:
        StoreChangedError: the file was deleted, or replaced by another file, since.
    """
    try:  # file_identity, inline: every read and write of a store asks
        st = os.stat(path)
        now: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except FileNotFoundError:
        now = None
    if now == identity:
        return
    what = "deleted" if now is None else "replaced by another file"
    raise StoreChangedError(
        f"{path} was {what} while this database was open (expected the file of device {identity[0]} inode "
        f"{identity[1]}, found {'none' if now is None else f'inode {now[1]}'}): nothing more is written, it would be "
        "acknowledged into a file no longer in the folder. Restore the store from a backup if it was lost, then open "
        "the folder again"
    )


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why the file or folder ``path`` cannot be written (a read-only file system, no write permission), or None.

    Root may write where the permissions say no: then this says None, as the kernel would let it write.
    """
    path = Path(path)
    try:
        read_only_fs = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # AttributeError: no statvfs on this platform
        read_only_fs = False
    if read_only_fs:
        return f"{path} is on a read-only file system"
    if not os.access(path, os.W_OK):
        return f"{path} cannot be written (no write permission)"
    return None
