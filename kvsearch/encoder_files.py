"""The encoder files of a database folder: written crash-safely, and checked against their SHA-256 on load.

A database folder holds ``{prefix}.json`` (+ ``{prefix}.safetensors`` once trained, or a ``{prefix}_model``
folder for a fine-tuned sentence encoder) for each of its encoders. The store records the SHA-256 of each file
as a *record* ``{"current": {name: hex}, "pending": {name: hex} | None}``; this module writes the files and
checks them, the caller (:class:`~kvsearch.Database`) keeps the record in the store. Writing is crash-safe in
three steps: :func:`install` saves the encoders into a staging folder, hands their digests to the caller to
record as *pending*, and moves the files into place (the json last); the caller then records them as
*current*. A stop anywhere leaves files that match the current or the pending digests.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvsearch.encoders import Encoder, _replace_dir
from kvsearch.errors import CorruptDatabaseError

__all__ = ["sha256_file", "install", "verify", "files_match"]

_STAGING = (".encoders.", ".staging")  # prefix, suffix of the staging folders in a database folder


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def install(
    folder: Path, encoders: Mapping[str, Encoder], record_pending: Callable[[dict[str, str]], None]
) -> dict[str, str]:
    """Write ``encoders`` (prefix -> encoder) into ``folder``; return the digests of the files written.

    Staging folders left by a writer that stopped are removed first (the caller holds the write lock).
    ``record_pending(digests)`` is called after the files are staged and before any is moved into place. A
    ``{prefix}.safetensors`` left from an earlier save is removed when the new save has none (its weights are
    rebuilt from the seed). Model folders are moved into place but not hashed.
    """
    for old in folder.glob(f"{_STAGING[0]}*{_STAGING[1]}"):
        shutil.rmtree(old, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=_STAGING[0], suffix=_STAGING[1]))
    try:
        for prefix, encoder in encoders.items():
            encoder.save(staging, prefix)
        written = sorted(staging.iterdir(), key=lambda p: (p.suffix == ".json", p.name))  # json last
        digests = {p.name: sha256_file(p) for p in written if p.is_file()}
        record_pending(digests)
        for path in written:
            if path.is_dir():
                _replace_dir(path, folder / path.name)
            else:
                os.replace(path, folder / path.name)
        for prefix in encoders:
            if f"{prefix}.safetensors" not in digests:
                (folder / f"{prefix}.safetensors").unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return digests


def verify(folder: Path, prefix: str, record: Any) -> None:
    """Check ``{prefix}.json`` and ``{prefix}.safetensors`` against the record's current or pending SHA-256.

    No record (a database made before digests were kept) checks nothing; a file with no recorded digest (a
    leftover the json does not name) or missing (``load_encoder`` reports that) is skipped.

    Raises:
        CorruptDatabaseError: a file matches neither digest (naming the file, the expected and the found one).
    """
    if not isinstance(record, dict):
        return
    known = [d for d in (record.get("current"), record.get("pending")) if isinstance(d, dict)]
    for name in (f"{prefix}.json", f"{prefix}.safetensors"):
        expected = sorted({d[name] for d in known if name in d})
        path = folder / name
        if not expected or not path.is_file():
            continue
        try:
            found = sha256_file(path)
        except OSError as exc:
            raise CorruptDatabaseError(f"encoder file {path} cannot be read: {exc}") from None
        if found not in expected:
            raise CorruptDatabaseError(
                f"encoder file {path} was changed or damaged since it was saved: expected SHA-256 "
                f"{' or '.join(expected)}, found {found}"
            )


def files_match(folder: Path, digests: Mapping[str, str]) -> bool:
    """Whether every file named in ``digests`` exists in ``folder`` with that SHA-256."""
    try:
        return all((folder / name).is_file() and sha256_file(folder / name) == hex_ for name, hex_ in digests.items())
    except OSError:
        return False
