"""The encoders' files in a database folder: one encoder's config and weights, the generation folders, and the
SHA-256 of each file that the store records.

- :func:`save_encoder`, :func:`load_encoder`: ``{prefix}.json`` (the encoder's config and the name of its weights)
  and ``{prefix}.safetensors`` (a trained n-gram encoder) or the folder ``{prefix}_model`` (a fine-tuned sentence
  encoder). Nothing is ever pickled.
- :func:`write_generation`, :func:`generation_dir`, :func:`current_generation_dir`, :func:`remove_generations`:
  ``generations/<G>/``, written whole or not at all (a staging folder, then a rename) before the store records it;
  generation 0 is a database written before generations, its files at the top of the folder.
- :class:`EncoderFiles`: a database's encoder files checked against the store's meta entry
  :data:`ENCODER_FILES_META`, which names the current generation and the SHA-256 of each of its files.

:mod:`kvsearch.generations` orders the steps of a switch; the folder's file names are :mod:`kvsearch.storage.folder`'s.

This module knows nothing of search, autograd or the records: it moves bytes between the folder, the encoders and the
store's meta table.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvsearch.checks import check_path
from kvsearch.encoders.base import Encoder
from kvsearch.encoders.registry import ENCODER_KINDS
from kvsearch.encoders.sentence import SentenceEncoder
from kvsearch.errors import (
    CorruptDatabaseError,
    DatabaseLockedError,
    InvalidArgumentError,
    MissingFileError,
    UnknownOptionError,
)
from kvsearch.storage import fileio
from kvsearch.storage.folder import (
    ENCODER_PREFIXES,
    GENERATIONS_DIR,
    MODEL_DIR,
    STAGING,
    STORE_FILE,
    remove_path,
    sha256_file,
)
from kvsearch.storage.schema import connect_read_only

if TYPE_CHECKING:
    from kvsearch.storage.store import Store

__all__ = [
    "ENCODER_FILES_META",
    "save_encoder",
    "load_encoder",
    "EncoderFiles",
    "generation_dir",
    "current_generation_dir",
    "write_generation",
    "remove_generations",
]

#: The store meta entry naming the current generation of encoders and the SHA-256 of each of its files:
#: ``{"generation": G, "current": {name: hex}, "previous": {"generation", "current", "flags"} | None,
#: "pending": None}`` (a database written before generations has no ``"generation"``: its files are generation 0,
#: at the top of the folder, and may have ``"pending"`` digests of an interrupted save).
ENCODER_FILES_META = "encoder_files"

_MAX_PREFIX_BYTES = 200  # room for the suffixes and the temporary names in a 255-byte file name


# --------------------------------------------------------------------------- atomic writes


def _json_bytes(data: Mapping[str, Any]) -> bytes:
    """The bytes of an encoder's json, exactly as :func:`save_encoder` writes them (digests compare these)."""
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _config_data(encoder: Encoder, weights: str | None) -> dict[str, Any]:
    """What ``{prefix}.json`` holds for ``encoder`` whose weights are in the file or folder ``weights`` (or none)."""
    data = {**encoder.config(), "weights": weights}
    if isinstance(encoder, SentenceEncoder) and weights is not None:
        data["model"] = weights
    return data


def _write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    blob = _json_bytes(data)
    fileio.write_atomic(path, lambda f: f.write(blob))


def _write_safetensors_atomic(path: Path, state: Mapping[str, Tensor]) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    fileio.write_atomic_path(path, lambda tmp: save_file(tensors, str(tmp)))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished folder ``src`` to ``dst``, replacing an older ``dst`` (rename, then delete)."""
    old = None
    if dst.exists():
        old = fileio.temp_dir(dst.parent, f".{dst.name}.old.")
        os.replace(dst, old / dst.name)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- one encoder's files


def _check_prefix(prefix: object) -> str:
    if isinstance(prefix, str) and len(prefix.encode("utf-8", "surrogatepass")) > _MAX_PREFIX_BYTES:
        raise InvalidArgumentError(
            f"prefix must be a file name stem of at most {_MAX_PREFIX_BYTES} bytes, got {prefix[:40]!r}..."
        )
    if not isinstance(prefix, str) or not prefix or prefix in (".", "..") or any(s in prefix for s in "/\\\x00"):
        raise InvalidArgumentError(
            f"prefix must be a non-empty file name without a path separator or NUL, got {prefix!r}"
        )
    return prefix


def save_encoder(encoder: Encoder, folder: str | os.PathLike[str], prefix: str) -> None:
    """Write ``{prefix}.json`` and, where the config cannot rebuild them, the encoder's weights into ``folder``.

    The json holds :meth:`Encoder.config` plus ``"weights"``: the name of what holds the weights, or ``null``.
    The weights are written only when :meth:`Encoder.needs_weights` says so: an n-gram encoder whose table
    differs from its seeded initialisation writes ``{prefix}.safetensors`` (a stale one is removed when it does
    not); a sentence encoder that was trained, or given as a model instance, writes the model folder
    ``{prefix}_model`` (safetensors), which the json's ``"model"`` then names relative to ``folder``. Each file is
    written to a temporary name and moved into place; the json goes last, so it is the commit point.

    Args:
        encoder: the encoder to save.
        folder: the folder to write into (created if missing).
        prefix: the file name stem, without a path separator.

    Raises:
        InvalidArgumentError: ``prefix`` is empty or holds a path separator or NUL, or ``encoder`` is not an
            Encoder.
    """
    prefix = _check_prefix(prefix)
    if not isinstance(encoder, Encoder):
        raise InvalidArgumentError(f"expected a kvsearch Encoder, got {type(encoder).__name__}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    needs_weights = encoder.needs_weights()
    if isinstance(encoder, SentenceEncoder):
        weights = None
        if needs_weights:
            model_dir = folder / MODEL_DIR.format(prefix=prefix)
            tmp_dir = fileio.temp_dir(folder, f".{model_dir.name}.")
            try:
                encoder.save_model(tmp_dir)  # safetensors, no model card, no progress bar
                _replace_dir(tmp_dir, model_dir)
            finally:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            weights = model_dir.name
        _write_json_atomic(folder / f"{prefix}.json", _config_data(encoder, weights))
        return
    weights_path = folder / f"{prefix}.safetensors"
    if needs_weights:
        _write_safetensors_atomic(weights_path, encoder.state_dict())
    _write_json_atomic(folder / f"{prefix}.json", _config_data(encoder, weights_path.name if needs_weights else None))
    if not needs_weights:
        weights_path.unlink(missing_ok=True)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CorruptDatabaseError(f"encoder config {path} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptDatabaseError(f"encoder config {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptDatabaseError(f"encoder config {path} must hold a JSON object, got {type(data).__name__}")
    if not isinstance(data.get("kind"), str):
        raise CorruptDatabaseError(f"encoder config {path} has no string 'kind' entry")
    weights = data.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights or any(s in weights for s in "/\\")):
        raise CorruptDatabaseError(f"encoder config {path}: 'weights' must be a file name or null, got {weights!r}")
    return data


def _load_safetensors_into(encoder: Encoder, path: Path) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CorruptDatabaseError(f"encoder weights {path} are missing")
    try:
        state = load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError, and OSError
        raise CorruptDatabaseError(
            f"encoder weights {path} cannot be read (truncated or not safetensors): {exc}"
        ) from exc
    bad = {name: t.dtype for name, t in state.items() if t.dtype != torch.float32}
    if bad:
        raise CorruptDatabaseError(f"encoder weights {path}: expected float32 tensors, got {bad}")
    try:
        encoder.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CorruptDatabaseError(f"encoder weights {path} do not fit the encoder config: {exc}") from exc


def load_encoder(folder: str | os.PathLike[str], prefix: str, device: str | torch.device | None = None) -> Encoder:
    """Rebuild an encoder that :func:`save_encoder` wrote.

    Reads ``{prefix}.json``, builds the encoder named by its ``"kind"``, and loads the weights the json names
    (``{prefix}.safetensors`` for an n-gram encoder, strictly; the ``{prefix}_model`` folder, resolved relative
    to ``folder``, for a sentence encoder). The files are not checked against digests here (see
    :meth:`EncoderFiles.load`).

    Args:
        folder: the folder the encoder was saved in.
        prefix: the file name stem given to :func:`save_encoder`.
        device: where to put the encoder; None -> CUDA when present, else the CPU.

    Returns:
        The encoder, in eval mode; ``trained`` is True if saved weights were loaded.

    Raises:
        CorruptDatabaseError: the json or the weights it names are missing, garbled, or do not fit the config.
        UnknownOptionError: the json's kind is not a known encoder kind.
        InvalidArgumentError: ``prefix`` is empty, longer than 200 bytes or holds a path separator or NUL; ``folder``
            is not a path (see :func:`kvsearch.checks.check_path`).
    """
    prefix = _check_prefix(prefix)
    if folder is None:
        raise InvalidArgumentError("expected the folder an encoder was saved in, got None")
    check_path(folder)
    folder = Path(folder)
    json_path = folder / f"{prefix}.json"
    data = _read_config(json_path)
    kind = data.pop("kind")
    weights = data.pop("weights", None)
    if kind not in ENCODER_KINDS:
        raise UnknownOptionError(
            f"encoder config {json_path}: unknown encoder kind {kind!r}, expected one of {sorted(ENCODER_KINDS)}"
        )
    if kind == "sentence" and weights is not None:
        model_dir = folder / weights
        if not (model_dir / "modules.json").is_file() and not (model_dir / "config.json").is_file():
            raise CorruptDatabaseError(f"encoder model folder {model_dir} (named by {json_path}) is missing or empty")
        data["model"] = str(model_dir)
    if kind == "ngram" and "ngram_range" in data and isinstance(data["ngram_range"], list):
        data["ngram_range"] = tuple(data["ngram_range"])
    try:
        encoder = ENCODER_KINDS[kind](**data, device=device)
    except (TypeError, InvalidArgumentError) as exc:
        raise CorruptDatabaseError(f"encoder config {json_path} does not describe a {kind} encoder: {exc}") from exc
    if kind == "ngram" and weights is not None:
        _load_safetensors_into(encoder, folder / weights)
    encoder.trained = weights is not None
    return encoder


# --------------------------------------------------------------------------- a database's encoder files


def _check_encoder_files(folder: Path, prefix: str, record: Any) -> None:
    """Check ``{prefix}.json`` and ``{prefix}.safetensors`` against the record's current or pending SHA-256.

    No record (a database made before digests were kept) checks nothing; a file with no recorded digest (a
    leftover the json does not name) or missing (:func:`load_encoder` reports that) is skipped.

    Args:
        folder: the database folder.
        prefix: the encoder's file name stem.
        record: the meta entry ``{"current": {name: hex}, "pending": {name: hex} | None}``, or None.

    Raises:
        CorruptDatabaseError: a file matches neither digest (naming the file, the expected and the found one),
            or cannot be read.
    """
    if not isinstance(record, dict):
        return
    known = [d for d in (record.get("current"), record.get("pending")) if isinstance(d, dict)]
    for name in (f"{prefix}.json", f"{prefix}.safetensors"):
        expected = sorted({d[name] for d in known if name in d})
        path = Path(folder) / name
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


def _files_match(folder: Path, digests: Mapping[str, str]) -> bool:
    """Whether every file named in ``digests`` exists in ``folder`` with that SHA-256 (False if one cannot be read)."""
    try:
        return all(
            (Path(folder) / name).is_file() and sha256_file(Path(folder) / name) == hex_
            for name, hex_ in digests.items()
        )
    except OSError:
        return False


def generation_dir(folder: str | os.PathLike[str], generation: int) -> Path:
    """The folder of one generation's encoder files: ``generations/<G>``, or the database folder for generation 0.

    Generation 0 is what a database written before generations holds: its encoder files at the top.
    """
    folder = Path(folder)
    return folder if int(generation) == 0 else folder / GENERATIONS_DIR / str(int(generation))


def write_generation(
    folder: str | os.PathLike[str],
    generation: int,
    encoders: Mapping[str, Encoder],
    *,
    tensors: Mapping[str, Mapping[str, Tensor]] | None = None,
) -> dict[str, str]:
    """Write a new generation's encoder files into ``generations/<G>``, whole or not at all.

    The files go into a staging folder that is renamed to ``generations/<G>`` once complete (a stale folder of
    that number, left by a writer that stopped before recording it, is replaced). The caller holds the write lock
    and records the digests in the store afterwards: until then the new folder is not part of the database.

    Args:
        folder: the database folder.
        generation: G >= 1.
        encoders: prefix -> encoder.
        tensors: extra files, name stem -> tensors, saved as ``<stem>.safetensors`` (e.g. the value embeddings
            a rollback would restore).

    Returns:
        file name -> SHA-256 of every file written (model folders excepted).
    """
    if int(generation) < 1:
        raise InvalidArgumentError(f"expected a generation >= 1 to write, got {generation!r}")
    target = generation_dir(folder, generation)
    doing, then = f"writing the encoders of generation {generation}", "the database keeps its current generation"
    with fileio.storage_errors(target, doing, then):
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = fileio.temp_dir(target.parent, f".{target.name}.", STAGING[1])
    try:
        with fileio.storage_errors(target, doing, then):
            for prefix, encoder in encoders.items():
                save_encoder(encoder, staging, prefix)
            for stem, state in (tensors or {}).items():
                _write_safetensors_atomic(staging / f"{stem}.safetensors", state)
            digests = {p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
            _fsync_dir(staging)
            if target.exists():
                remove_path(target)
            os.replace(staging, target)
            _fsync_dir(target.parent)
    finally:
        remove_path(staging)
    return digests


def current_generation_dir(path: str | os.PathLike[str]) -> Path:
    """The folder holding the current generation's encoder files of the database at ``path``, read from its store.

    Raises:
        CorruptDatabaseError: the store cannot be read.
    """
    store = Path(path) / STORE_FILE
    try:
        with contextlib.closing(connect_read_only(store)) as conn:
            row = conn.execute("SELECT value FROM meta WHERE name = ?", (ENCODER_FILES_META,)).fetchone()
    except sqlite3.Error as exc:
        raise CorruptDatabaseError(f"{store}: cannot read {ENCODER_FILES_META!r}: {exc}") from None
    record = json.loads(row[0]) if row else {}
    return generation_dir(path, int((record or {}).get("generation") or 0))


def remove_generations(folder: str | os.PathLike[str], keep: set[int]) -> None:
    """Remove every generation folder (and staging leftover) not in ``keep``; generation 0's top-level encoder files too
    unless 0 is kept. The caller holds the write lock and has recorded what is current."""
    folder = Path(folder)
    root = folder / GENERATIONS_DIR
    if root.is_dir():
        for child in root.iterdir():
            if not (child.name.isdigit() and int(child.name) in keep):
                remove_path(child)
    if 0 not in keep:
        for prefix in ENCODER_PREFIXES:
            for name in (f"{prefix}.json", f"{prefix}.safetensors", MODEL_DIR.format(prefix=prefix)):
                remove_path(folder / name)


def _fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class EncoderFiles:
    """The encoder files of one database folder, checked against the digests its store records.

    The meta entry :data:`ENCODER_FILES_META` names the current generation and the SHA-256 of each of its files;
    :mod:`kvsearch.generations` writes new generations and switches to them.

    Args:
        folder: the database folder, or None for a database in memory (then there is nothing to load).
        store: the database's store (its meta table keeps the record).
    """

    def __init__(self, folder: str | os.PathLike[str] | None, store: Store) -> None:
        self.folder = None if folder is None else Path(folder)
        self.store = store

    def record(self) -> dict[str, Any]:
        """The meta entry as this view reads it (``{}`` for a database without one)."""
        record = self.store.get_meta(ENCODER_FILES_META)
        return record if isinstance(record, dict) else {}

    def current_dir(self, record: Mapping[str, Any] | None = None) -> Path:
        """The folder of the current generation's files (the database folder for generation 0)."""
        if self.folder is None:
            raise InvalidArgumentError("expected a database folder, got one in memory")
        record = self.record() if record is None else record
        return generation_dir(self.folder, int(record.get("generation") or 0))

    def has(self, prefix: str) -> bool:
        """Whether the current generation has ``{prefix}.json`` (always False in memory)."""
        return self.folder is not None and (self.current_dir() / f"{_check_prefix(prefix)}.json").exists()

    def load(self, prefix: str, device: str | torch.device | None = None) -> Encoder:
        """Load the encoder ``prefix`` of the current generation after checking its files against their SHA-256.

        Generation 0 (a database written before generations) may also match *pending* digests (a save of that
        version that stopped between writing and recording); it may have none at all (older still): its files
        load unchecked. On a mismatch the record is read once more on a fresh SQLite connection (another process
        may have switched generations after this view's read snapshot) before giving up.

        Args:
            prefix: the encoder's file name stem (one of :data:`ENCODER_PREFIXES`).
            device: where to put the encoder; None -> CUDA when present, else the CPU.

        Returns:
            The encoder, in eval mode.

        Raises:
            MissingFileError: ``{prefix}.json`` is missing (the message says how to restore it).
            CorruptDatabaseError: a file differs from what was saved (naming it, the expected and the found
                digest), cannot be read, or does not describe an encoder.
            InvalidArgumentError: a database in memory has no encoder files; a bad prefix.
        """
        record = self.record()
        if not (self.current_dir(record) / f"{_check_prefix(prefix)}.json").is_file():
            record = self._latest_record()  # another process may have switched generations since
            if not (self.current_dir(record) / f"{prefix}.json").is_file():
                raise MissingFileError(self._missing(prefix, record))
        try:
            _check_encoder_files(self.current_dir(record), prefix, record or None)
            return load_encoder(self.current_dir(record), prefix, device=device)
        except CorruptDatabaseError:  # changed, or gone: another process may have switched generations since
            record = self._latest_record()
            _check_encoder_files(self.current_dir(record), prefix, record or None)
            return load_encoder(self.current_dir(record), prefix, device=device)

    def restore_config(self, prefix: str, encoder: Encoder) -> None:
        """Rewrite the current generation's missing ``{prefix}.json`` from ``encoder``, if it is the recorded one.

        The json holds the encoder's configuration and the name of its weights; its SHA-256 is recorded in the store.
        The bytes :func:`save_encoder` would write for ``encoder`` (with the weights file or model folder of the
        generation where there is one) are compared with that digest: equal, they are written back (a warning says
        so); else nothing is written.

        Args:
            prefix: the encoder's file name stem.
            encoder: the encoder the database was created with (its weights may be untrained: the stored ones load).

        Raises:
            MissingFileError: no digest is recorded, ``encoder`` does not give it, or the folder is read-only.
        """
        record = self.record()
        directory = self.current_dir(record)
        path = directory / f"{_check_prefix(prefix)}.json"
        expected = self._expected(path.name, record)
        names = (f"{prefix}.safetensors", MODEL_DIR.format(prefix=prefix))
        options = [None, *(name for name in names if (directory / name).exists())]
        blobs = [_json_bytes(_config_data(encoder, weights)) for weights in options]
        blob = next((b for b in blobs if hashlib.sha256(b).hexdigest() in expected), None)
        if blob is None:
            found = hashlib.sha256(blobs[0]).hexdigest()
            raise MissingFileError(self._missing(prefix, record, given=f"its configuration gives SHA-256 {found}"))
        if self.store.read_only is not None:
            raise MissingFileError(f"{path} is missing and cannot be rewritten: {self.store.read_only}")
        with fileio.storage_errors(path, "rewriting a missing encoder config", "nothing was written"):
            fileio.write_atomic(path, lambda f: f.write(blob))
        warnings.warn(
            f"kvsearch: {path} was missing; it was rewritten from the encoder passed in, whose configuration has the "
            "SHA-256 the store records",
            RuntimeWarning,
            stacklevel=4,
        )

    def _expected(self, name: str, record: Mapping[str, Any]) -> set[str]:
        """The recorded digests of a file of the current generation (current and, for generation 0, pending)."""
        known = [d for d in (record.get("current"), record.get("pending")) if isinstance(d, dict)]
        return {d[name] for d in known if isinstance(d.get(name), str)}

    def _missing(self, prefix: str, record: Mapping[str, Any], given: str | None = None) -> str:
        """What to say of a missing ``{prefix}.json``: which file, and how to restore it."""
        path = self.current_dir(record) / f"{prefix}.json"
        expected = sorted(self._expected(path.name, record))
        text = f"{path} is missing (deleted from outside?)"
        if not expected:
            return f"{text}; no digest of it is recorded to check an encoder against: restore it from a backup"
        text += f"; the store records its SHA-256 {' or '.join(expected)}"
        if given is not None:
            text += f"; the {prefix} passed in does not match it ({given})"
        if prefix == "query_encoder":  # a fine-tuned query side: it cannot be passed in
            return f"{text}. Restore it from a backup"
        return (
            f"{text}. Open the database with the encoder it was created with — Database({str(self.folder)!r}, "
            f"{prefix}=...) — and the file is rewritten from it; or restore it from a backup"
        )

    def load_generation(
        self, generation: int, digests: Mapping[str, str], prefix: str, device: str | torch.device | None = None
    ) -> Encoder:
        """Load the encoder ``prefix`` of another generation (the previous one, for a rollback), checked.

        Raises:
            CorruptDatabaseError: a file differs from its digest, is missing or cannot be read.
        """
        if self.folder is None:
            raise InvalidArgumentError("expected a database folder, got one in memory")
        path = generation_dir(self.folder, generation)
        _check_encoder_files(path, prefix, {"current": dict(digests)})
        return load_encoder(path, prefix, device=device)

    def current_digests(self) -> dict[str, str]:
        """The digests of the current generation's files; for generation 0 the pending ones when the files on
        disk are those of a save that stopped before recording them as current."""
        record = self.record()
        pending = record.get("pending")
        if not record.get("generation") and pending and self.folder is not None and _files_match(self.folder, pending):
            return dict(pending)
        return dict(record.get("current") or {})

    def has_files(self) -> bool:
        """Whether the current generation has any encoder file (a database written before digests has no record)."""
        return self.folder is not None and any(self.has(prefix) for prefix in ENCODER_PREFIXES)

    def _latest_record(self) -> dict[str, Any]:
        """The record as last committed, read on a fresh connection (outside this view's read snapshot)."""
        path = self.folder / STORE_FILE
        try:
            with contextlib.closing(connect_read_only(path)) as conn:
                row = conn.execute("SELECT value FROM meta WHERE name = ?", (ENCODER_FILES_META,)).fetchone()
        except sqlite3.Error as exc:
            raise CorruptDatabaseError(f"{path}: cannot read {ENCODER_FILES_META!r}: {exc}") from None
        record = None if row is None else json.loads(row[0])
        return record if isinstance(record, dict) else {}

    def settle(self) -> None:
        """Finish the record of a generation-0 save (an older version's) that stopped between writing and recording.

        Only when pending digests exist and the write lock is free at once: if every recorded file matches the
        pending digests they become current, if every one matches the current digests pending is dropped;
        otherwise (or when another writer holds the lock) the record is left as it is (still accepted on load).
        """
        record = self.record()
        if self.folder is None or not record.get("pending") or record.get("generation") or self.store.read_only:
            return
        try:
            self.store.write_lock.acquire(timeout=0.0)
        except DatabaseLockedError:
            return
        try:
            record = self.record()
            pending, current = record.get("pending"), record.get("current") or {}
            if not pending:
                return
            if _files_match(self.folder, pending):
                self.store.set_meta(ENCODER_FILES_META, {"current": pending, "pending": None})
            elif _files_match(self.folder, current):
                self.store.set_meta(ENCODER_FILES_META, {"current": current, "pending": None})
        finally:
            self.store.write_lock.release()
