"""One writer at a time per database folder: an inter-process write lock on ``write.lock``.

Readers never take it (SQLite's WAL lets them read while a writer commits). A writer takes it for each
write — validate against the store, commit, update the index — and for each save of the derived files,
waiting at most ``timeout`` seconds before :class:`~kvsearch.errors.DatabaseLockedError`.

The lock is ``fcntl.flock`` on a file in the folder: the kernel drops it when its holder dies (even by
SIGKILL), so a crashed writer never leaves a stale lock behind. It is reentrant within one thread of one
process, and fork-aware: a child process never shares its parent's lock (it opens its own file description).

A database open read-only has a lock that is never taken: it refuses at once, and never creates its file.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvsearch.errors import DatabaseLockedError, ReadOnlyDatabaseError
from kvsearch.storage.fileio import storage_errors

try:  # POSIX only; elsewhere the lock degrades to SQLite's own write lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["WriteLock", "LOCK_FILE", "DEFAULT_LOCK_TIMEOUT"]

LOCK_FILE = "write.lock"
#: Seconds a writer waits for another process's write before giving up with DatabaseLockedError.
DEFAULT_LOCK_TIMEOUT = 10.0


class WriteLock:
    """A reentrant, bounded-wait, fork-aware inter-process lock (``with lock: ...``).

    Args:
        path: the lock file, or None for a database in memory (the lock then only orders threads).
        timeout: seconds to wait for another holder, >= 0.
        read_only: why the database is read-only (then the lock is never taken and its file never made), or None.

    Raises:
        DatabaseLockedError: (on enter) another process held the lock for longer than ``timeout``.
        ReadOnlyDatabaseError: (on enter) the database is read-only, or the lock file cannot be made.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        timeout: float = DEFAULT_LOCK_TIMEOUT,
        read_only: str | None = None,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.timeout = float(timeout)
        self.read_only = read_only
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._fd: int | None = None
        self._pid = os.getpid()

    def _file(self) -> int:
        if self._pid != os.getpid():
            # After fork(): the inherited descriptor shares the parent's lock; never use or unlock it.
            # Closing our copy is safe (the parent's descriptor keeps its lock alive).
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
            self._fd, self._depth, self._pid = None, 0, os.getpid()
            self._thread_lock = threading.RLock()
        if self._fd is None:
            with storage_errors(self.path, "taking the write lock", "nothing was written"):
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for every file
        return self._fd

    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (default: the lock's own ``timeout``).

        Raises:
            DatabaseLockedError: another process holds it after ``timeout`` seconds.
            ReadOnlyDatabaseError: the database is read-only (nothing is created), or the lock file cannot be made.
        """
        if self.read_only is not None:
            where = "the database" if self.path is None else self.path.parent
            raise ReadOnlyDatabaseError(f"{where} is open read-only ({self.read_only}): nothing can be written")
        wait = self.timeout if timeout is None else float(timeout)
        if self._pid != os.getpid() and self.path is not None:
            self._file()  # reset the fork-inherited state before touching the thread lock
        if not self._thread_lock.acquire(timeout=max(wait, 0.0)):
            raise DatabaseLockedError(f"expected the write lock within {wait}s; another thread holds it")
        if self._depth > 0 or self.path is None or fcntl is None:
            self._depth += 1
            return
        try:
            fd = self._file()
            deadline = time.monotonic() + wait
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = self._holder()
                        raise DatabaseLockedError(
                            f"expected to take the write lock of {self.path.parent} within {wait}s, "
                            f"but another writer{holder} holds it; retry later or raise lock_timeout"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            self._thread_lock.release()
            raise
        self._depth = 1

    def release(self) -> None:
        """Give the lock back (the file lock is dropped when the outermost holder releases)."""
        self._depth -= 1
        if self._depth == 0 and self._fd is not None and fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def _holder(self) -> str:
        try:
            pid = os.pread(self._fd, 32, 0).decode().strip()  # type: ignore[arg-type]
        except (OSError, UnicodeDecodeError):
            return ""
        return f" (pid {pid})" if pid.isdigit() else ""

    def close(self) -> None:
        """Close the lock file (the lock must not be held)."""
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def __enter__(self) -> WriteLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
