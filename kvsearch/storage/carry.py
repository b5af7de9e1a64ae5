"""Records carried from one database folder into a new one, ids and all: what a reshard writes for each destination.

- :func:`start`: a new store in an empty folder that takes over a source store's configuration, its current
  generation of encoders (their files copied byte for byte, their recorded SHA-256 kept: the new store checks them on
  open) and the last fine-tuning run. The previous generation is not carried (nothing to roll back to).
- :func:`carry`: records copied by id — key and value texts, metadata, the embeddings as stored (never re-encoded),
  the flags of texts that came with their own embedding — under their own ids.
- :func:`id_marks`, :func:`seal`: ids are never reused across a reshard. A store's *marks* are the highest ids it ever
  handed out: its AUTOINCREMENT sequence, plus the marks a reshard recorded in it (meta :data:`ID_MARKS_META`); the
  caller seals each new store with the id its own new ids start after and the marks of its sources.

It knows nothing of shards (which records go where, and which ids a store may hand out, are the caller's) nor of
search.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from kvsearch.storage.encoder_files import ENCODER_FILES_META, EncoderFiles, generation_dir
from kvsearch.storage.folder import ENCODER_PREFIXES, MODEL_DIR, STORE_FILE
from kvsearch.storage.schema import GIVEN_KEY, GIVEN_VALUE
from kvsearch.storage.store import Store

__all__ = ["ID_MARKS_META", "start", "carry", "id_marks", "seal"]

#: The store meta entry listing the highest ids of the databases a reshard carried records from (JSON list of ints).
ID_MARKS_META = "id_marks"
#: The meta entries a new store takes over from its source as they are.
_CARRIED_META = ("config", "last_run")


def start(folder: Path, source: Store, source_folder: Path) -> Store:
    """A new store in the empty folder ``folder`` with ``source``'s configuration, current generation of encoders and
    last run; its table loaded (no records), ready for :func:`carry`.

    Args:
        folder: the new database folder (created; it must hold nothing).
        source: the store of the source database (read only).
        source_folder: the source database folder.

    Returns:
        The new store, open for writing.
    """
    record = source.get_meta(ENCODER_FILES_META)
    record = record if isinstance(record, dict) else {}
    generation = int(record.get("generation") or 0)
    copied = _copy_encoder_files(generation_dir(source_folder, generation), generation_dir(folder, generation))
    digests = EncoderFiles(source_folder, source).current_digests()
    store = Store(folder / STORE_FILE)
    try:
        for name in _CARRIED_META:
            store.set_meta(name, source.get_meta(name))
        current = {name: digest for name, digest in digests.items() if name in copied}
        store.set_meta(
            ENCODER_FILES_META, {"generation": generation, "current": current, "previous": None, "pending": None}
        )
        config = store.get_meta("config")
        store.load(int(config["dim"]), int(config["value_dim"]))
    except BaseException:
        store.close()
        raise
    return store


def _copy_encoder_files(source: Path, target: Path) -> set[str]:
    """Copy the encoder files of one generation folder (the json, weights and model folder of each encoder prefix;
    not the previous values a rollback would restore); the names copied."""
    target.mkdir(parents=True, exist_ok=True)
    copied = set()
    for prefix in ENCODER_PREFIXES:
        for name in (f"{prefix}.json", f"{prefix}.safetensors"):
            if (source / name).is_file():
                shutil.copyfile(source / name, target / name)
                copied.add(name)
        model = MODEL_DIR.format(prefix=prefix)
        if (source / model).is_dir():
            shutil.copytree(source / model, target / model)
            copied.add(model)
    return copied


def carry(target: Store, parts: Sequence[tuple[Store, Sequence[int]]]) -> None:
    """Copy records into ``target`` under their own ids, in one transaction.

    Args:
        target: the store written.
        parts: (source store, ids stored in it) pairs; the sources' tables loaded and up to date; no id stored in
            ``target`` yet.

    Raises:
        KeyError: an id is not stored in its source.
    """
    rows, given = [], []
    for source, ids in parts:
        records, texts = source.fetch(ids), source.texts
        for i in ids:
            rows.append(records[int(i)])
            given.append(
                (GIVEN_KEY if int(i) in texts.given_keys else 0) | (GIVEN_VALUE if int(i) in texts.given_values else 0)
            )
    if not rows:
        return
    target.write(
        [r.key for r in rows],
        [r.value for r in rows],
        [r.metadata or None for r in rows],
        torch.stack([r.key_embedding for r in rows]),  # (n, dim) as stored
        torch.stack([r.value_embedding for r in rows]),  # (n, value_dim)
        given=given,
        new_ids=[r.id for r in rows],
    )


def id_marks(store: Store) -> list[int]:
    """The highest ids the store, and the databases a reshard carried its records from, ever handed out."""
    marks = store.get_meta(ID_MARKS_META)
    return sorted({store.last_id(), *(int(m) for m in (marks if isinstance(marks, list) else []))} - {0})


def seal(store: Store, next_after: int, marks: Sequence[int]) -> None:
    """Make ``next_after + 1`` the next id the store hands out — exactly: carried ids above it (another shard's
    band) do not move it — and record ``marks`` (see :func:`id_marks`). One transaction.

    The caller chooses ``next_after`` above every id ever handed out in the range the store's new ids come from.
    """
    with store.lock, store.transaction():
        store.start_ids_after(next_after, exactly=True)  # (nested: savepoints of this one transaction)
        store.set_meta(ID_MARKS_META, sorted({int(m) for m in marks}))
