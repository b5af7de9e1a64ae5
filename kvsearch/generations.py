"""Generations: a database's encoders and the embeddings computed with them, switched as one, never torn.

The key, value and query-side encoders, and the key / value embeddings they produced, form one *generation*.
Whatever changes them — a fine-tuning run, ``refresh()``, trained values, ``rollback_encoders()`` — writes the
new generation beside the old one and switches to it in one store transaction:

1. :func:`write_files`: the new encoders go into ``generations/<G+1>/`` (whole or not at all, see
   :func:`kvsearch.storage.encoder_files.write_generation`); until step 2 commits, that folder is not part of the
   database;
2. the keys (and, where their encoder changed, the values) are re-encoded in memory, and the weights and
   embeddings checked finite — a non-finite generation is refused here, before anything is recorded;
3. :func:`switch`: ONE SQLite transaction replaces the key / value embeddings and records the new generation
   (its digests, the configuration, the previous generation for a rollback, the run's summary);
4. :func:`remove_old`: the generation before the previous one is removed (the previous one is kept, once).

A process killed anywhere leaves the old generation whole (before 3 commits) or the new one whole (after): the
stored key embeddings always equal the loaded key encoder applied to the stored keys. :func:`key_mismatch`
checks that on open, for databases written before generations existed.

A fine-tuning run works in a :class:`Draft`: it trains the encoders in memory, searches a working index over
keys re-encoded in memory (:meth:`Draft.refresh`), and ends with one :meth:`Draft.commit` (the switch
:meth:`~kvsearch.Database.commit_generation` runs too) or :meth:`Draft.discard` (nothing on disk changed; the encoders
are put back).

This module knows nothing of training loops, search internals or file formats (those are
:mod:`kvsearch.storage.encoder_files`), nor of the facade: a draft is handed the database's view (what it uses of it:
:class:`DraftView`) and the read path's ``candidates``; its commit runs the switch through the view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from kvsearch.checks import all_finite, check_finite
from kvsearch.encoders.base import Encoder
from kvsearch.encoders.encoder_set import EncoderSet
from kvsearch.errors import InvalidArgumentError, NonFiniteError, NothingToRollBackError
from kvsearch.inputs import generation_args
from kvsearch.nn.attend import Candidates
from kvsearch.retrieval import Retriever
from kvsearch.storage import encoder_files
from kvsearch.storage.store import Store
from kvsearch.storage.table import VectorTable

__all__ = [
    "write_files",
    "switch",
    "remove_old",
    "encode_keys",
    "encode_values",
    "key_mismatch",
    "commit",
    "rollback",
    "describe",
    "Draft",
    "DraftView",
    "PREVIOUS_VALUES",
    "KEY_TOLERANCE",
]

#: The file stem, in a generation's folder, of the value embeddings it replaced (what a rollback restores).
PREVIOUS_VALUES = "previous_values"
#: Largest difference between a stored key embedding and the key encoder's output that counts as equal.
KEY_TOLERANCE = 1e-4
#: Keys re-encoded at once.
ENCODE_BATCH = 4096


# ---------------------------------------------------------------------- the steps (crash points of the tests)


def write_files(
    folder: Path,
    generation: int,
    encoders: Mapping[str, Encoder],
    *,
    tensors: Mapping[str, Mapping[str, Tensor]] | None,
) -> dict[str, str]:
    """Step 1: write generation ``generation``'s encoder files; returns file name -> SHA-256."""
    return encoder_files.write_generation(folder, generation, encoders, tensors=tensors)


def switch(store: Store, *, keys: Tensor | None, values: Tensor | None, meta: Mapping[str, Any]) -> None:
    """Step 3: replace the embeddings and record the generation (``meta`` entries), in ONE store transaction."""
    store.replace_embeddings(keys=keys, values=values, meta=meta)


def remove_old(folder: Path, keep: set[int]) -> None:
    """Step 4: remove the generation folders not in ``keep`` (the current and the previous one)."""
    encoder_files.remove_generations(folder, keep)


# ---------------------------------------------------------------------- encoding the stored texts


@torch.no_grad()
def _encode(encoder: Encoder, texts: list[str]) -> Tensor:
    """``encoder.encode`` in eval mode, restoring the train mode after. (n, dim) float32."""
    was_training = encoder.training
    encoder.eval()
    try:
        parts = [encoder.encode(texts[i : i + ENCODE_BATCH]).float() for i in range(0, len(texts), ENCODE_BATCH)]
    finally:
        encoder.train(was_training)
    return torch.cat(parts) if parts else torch.empty(0, encoder.dim)


def encode_keys(store: Store, encoder: Encoder | None) -> Tensor:
    """Every stored key re-encoded from its text (keys stored as, or with, embeddings keep theirs). (m, dim).

    Raises:
        NonFiniteError: the encoder produced NaN or Inf.
    """
    keys = store.table.keys.clone()  # (m, dim)
    ids = store.table.ids.tolist()
    rows = [row for row, id_ in enumerate(ids) if id_ in store.texts.key_of_id and id_ not in store.texts.given_keys]
    if rows and encoder is not None:
        fresh = _encode(encoder, [store.texts.key_of_id[ids[row]] for row in rows])  # (r, dim)
        check_finite(fresh, "key embeddings from the key encoder")
        keys[torch.tensor(rows, dtype=torch.long, device=keys.device)] = fresh.to(keys.device)
    return keys


def encode_values(store: Store, encoder: Encoder | None) -> Tensor:
    """Every stored value with a text re-encoded (values stored as, or with, embeddings keep theirs). (m, value_dim).

    Raises:
        NonFiniteError: the encoder produced NaN or Inf.
    """
    values = store.table.values.clone()  # (m, value_dim)
    ids = store.table.ids.tolist()
    texts = store.value_texts(ids) if encoder is not None else {}
    rows = [row for row, id_ in enumerate(ids) if texts.get(id_) is not None and id_ not in store.texts.given_values]
    if rows:
        fresh = _encode(encoder, [texts[ids[row]] for row in rows])  # (r, value_dim)
        check_finite(fresh, "value embeddings from the value encoder")
        values[torch.tensor(rows, dtype=torch.long, device=values.device)] = fresh.to(values.device)
    return values


def key_mismatch(store: Store, encoder: Encoder | None, sample: int = 64) -> float:
    """The largest difference between stored key embeddings and the key encoder applied to their texts.

    Checks up to ``sample`` keys encoded from their text (not those given with their embeddings), evenly spread
    over the ids. 0.0 when there is nothing to check.
    """
    encoded = store.texts.key_of_id  # the keys with text, less those that came with their embedding
    if store.texts.given_keys:
        encoded = {id_: key for id_, key in encoded.items() if id_ not in store.texts.given_keys}
    if encoder is None or not encoded:
        return 0.0
    m = len(store.table.ids)
    spread = torch.linspace(0, m - 1, min(4 * sample, m)).round().long().unique().tolist()  # rows, evenly spread
    with_text = [row for row in spread if int(store.table.ids[row]) in encoded]
    if not with_text:  # the spread hit only keys stored as embeddings: look at every row once
        with_text = [row for row, id_ in enumerate(store.table.ids.tolist()) if id_ in encoded]
    picked = with_text[:: max(1, len(with_text) // sample)][:sample]
    ids = store.table.ids
    fresh = _encode(encoder, [store.texts.key_of_id[int(ids[row])] for row in picked])  # (s, dim)
    stored = store.table.keys[torch.tensor(picked, dtype=torch.long, device=store.table.keys.device)]  # (s, dim)
    if not all_finite(fresh):
        return float("inf")
    return float((fresh.to(stored.device) - stored).abs().max())


# ---------------------------------------------------------------------- commit and rollback


def _check_weights(encoders: Iterable[Encoder | None]) -> None:
    for encoder in encoders:
        if encoder is None:
            continue
        for name, tensor in encoder.state_dict().items():
            if tensor.is_floating_point() and not all_finite(tensor):
                raise NonFiniteError(
                    f"expected finite encoder weights, got NaN or Inf in {type(encoder).__name__}.{name}: "
                    "this generation is not saved (the database keeps the previous one)"
                )


def commit(
    store: Store,
    files: encoder_files.EncoderFiles,
    encoders: EncoderSet,
    config: dict[str, Any],
    *,
    force: set[str] | None = None,
    values: tuple[Tensor, Tensor] | None = None,
    summary: Mapping[str, Any] | None = None,
    encoded: VectorTable | None = None,
) -> dict[str, Any]:
    """Write the encoders as they are now as a new generation and switch to it (steps 1-4). Caller holds the locks.

    Args:
        store: the store, up to date (the caller synced under the write lock).
        files: the folder's encoder files.
        encoders: the encoders to record.
        config: the database configuration; the new one is returned.
        force: ``"keys"`` and / or ``"values"``: re-encode those from their texts whatever changed. Keys are
            re-encoded anyway when the key encoder changed since it was loaded or saved, values when theirs did.
        values: (ids (n,), embeddings (n, value_dim)): value embeddings to write for those ids (ids no longer
            stored are skipped).
        summary: a JSON-able description of the run, recorded as the database's last run.
        encoded: the keys already encoded by the key encoder as it is now (a draft's last refresh), used instead of
            encoding them again when they are of the store's version and ids (else ignored).

    Returns:
        The configuration as recorded (its ``"generation"`` is the new generation).

    Raises:
        NonFiniteError: a weight, a re-encoded key or value, or a given value is not finite (nothing is written).
    """
    _check_weights(encoders.by_prefix().values())
    parts, shared = encoders.changed_parts(), encoders.value is encoders.key
    reencode = set(force or ())
    reencode |= {"keys"} if "encoder" in parts else set()
    reencode |= {"values"} if ("encoder" if shared else "value_encoder") in parts else set()
    keys = None  # (m, dim) the new key embeddings, when they change
    if "keys" in reencode:
        fresh = (
            encoded is not None and encoded.version == store.table.version and torch.equal(encoded.ids, store.table.ids)
        )
        keys = encoded.keys.clone() if fresh and encoded is not None else encode_keys(store, encoders.key)
    new_values = encode_values(store, encoders.value) if "values" in reencode else None  # (m, value_dim)
    if values is not None:
        ids, embs = values
        check_finite(embs, "trained value embeddings")
        new_values = store.table.values.clone() if new_values is None else new_values  # (m, value_dim)
        rows = store.table.rows_of(torch.as_tensor(ids, dtype=torch.long)).to(new_values.device)  # (n,)
        keep = rows >= 0
        new_values[rows[keep]] = embs.detach().to(new_values.device, torch.float32)[keep]
    record = files.record()
    old = int(record.get("generation") or 0)
    new = max(old, int(config.get("generation") or 0)) + 1
    flags = encoders.flags()
    digests: dict[str, str] = {}
    if files.folder is not None:
        remove_old(files.folder, {old, *_previous(record)})  # leftovers of a writer that stopped
        before = (
            None
            if new_values is None or not len(store.table)
            else {PREVIOUS_VALUES: {"ids": store.table.ids, "values": store.table.values}}
        )
        present = {p: e for p, e in encoders.by_prefix().items() if e is not None}
        digests = write_files(files.folder, new, present, tensors=before)
    previous = None  # a new database has nothing to return to; one written before generations has generation 0
    if old > 0 or files.has_files():
        previous = {"generation": old, "current": files.current_digests(), "flags": _flags_of(config)}
    new_config = {**config, **flags, "generation": new, "encoders_version": int(config.get("encoders_version", 0)) + 1}
    meta = {
        "config": new_config,
        encoder_files.ENCODER_FILES_META: {
            "generation": new,
            "current": digests,
            "previous": previous,
            "pending": None,
        },
        "last_run": dict(summary) if summary is not None else None,
    }
    switch(store, keys=keys, values=new_values, meta=meta)
    if files.folder is not None:
        remove_old(files.folder, {new, old})
    encoders.mark()
    return new_config


def rollback(
    store: Store, files: encoder_files.EncoderFiles, encoders: EncoderSet, config: dict[str, Any]
) -> dict[str, Any]:
    """Switch back to the previous generation (once): its encoders, keys re-encoded with them, values restored.

    Raises:
        NothingToRollBackError: there is no previous generation (none yet, already rolled back, or in memory).
        CorruptDatabaseError: a file of the previous generation is missing or damaged.
    """
    record = files.record()
    previous = record.get("previous")
    if files.folder is None or not isinstance(previous, dict):
        raise NothingToRollBackError(
            f"expected a previous generation to return to, got none (generation {record.get('generation', 0)} "
            "is the first kept, or was already rolled back)"
        )
    old, flags = int(previous["generation"]), previous.get("flags") or {}
    wanted = {"encoder": bool(flags.get("encoder")), "value_encoder": flags.get("value_encoder") == "own"}
    wanted["query_encoder"] = bool(flags.get("query_encoder"))
    loaded = {
        prefix: files.load_generation(old, previous.get("current") or {}, prefix, encoders.device) if want else None
        for prefix, want in wanted.items()
    }
    restored = _previous_values(files.current_dir(record) / f"{PREVIOUS_VALUES}.safetensors", store)
    snapshot = encoders.snapshot()
    encoders.install(loaded, flags)
    try:
        keys = encode_keys(store, encoders.key)  # (m, dim)
    except BaseException:
        encoders.restore(snapshot)
        raise
    new_config = {**config, **encoders.flags(), "generation": old}
    new_config["encoders_version"] = int(config.get("encoders_version", 0)) + 1
    meta = {
        "config": new_config,
        encoder_files.ENCODER_FILES_META: {
            "generation": old,
            "current": previous.get("current") or {},
            "previous": None,
        },
        "last_run": None,
    }
    switch(store, keys=keys, values=restored, meta=meta)
    remove_old(files.folder, {old})
    encoders.mark()
    return new_config


def describe(files: encoder_files.EncoderFiles, encoders: EncoderSet, config: Mapping[str, Any]) -> dict[str, Any]:
    """What a database's generation is: ``{"generation", "previous", "encoder", "value_encoder", "query_encoder",
    "last_run"}`` — an encoder's configuration, ``"key"`` for a value encoder that is the key encoder, None where
    there is none; ``previous`` the generation a rollback returns to (or None); ``last_run`` the summary of the
    last fine-tuning run: the one that made this generation, or a later one that committed nothing (its
    ``"committed"`` False), or None."""
    previous = files.record().get("previous")
    value = None if encoders.value is None else ("key" if encoders.value is encoders.key else encoders.value.config())
    return {
        "generation": int(config.get("generation") or 0),
        "previous": int(previous["generation"]) if isinstance(previous, dict) and files.folder is not None else None,
        "encoder": None if encoders.key is None else encoders.key.config(),
        "value_encoder": value,
        "query_encoder": None if encoders.query is None else encoders.query.config(),
        "last_run": files.store.get_meta("last_run"),
    }


def _previous(record: Mapping[str, Any]) -> set[int]:
    previous = record.get("previous")
    return {int(previous["generation"])} if isinstance(previous, dict) else set()


def _flags_of(config: Mapping[str, Any]) -> dict[str, Any]:
    return {name: config.get(name) for name in ("encoder", "value_encoder", "query_encoder")}


def _previous_values(path: Path, store: Store) -> Tensor | None:
    """The value embeddings a generation replaced, for the ids still stored: (m, value_dim), or None if none saved."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    saved = load_file(str(path))
    values = store.table.values.clone()  # (m, value_dim)
    rows = store.table.rows_of(saved["ids"]).to(values.device)  # (n,)
    keep = rows >= 0
    values[rows[keep]] = saved["values"].to(values.device, torch.float32)[keep]
    return values


# ---------------------------------------------------------------------- the working view of a fine-tuning run


class FrozenRecords:
    """The records of a store as they were at one moment, with key embeddings of a draft generation.

    What a :class:`~kvsearch.retrieval.Retriever` reads from a store, held in memory: a draft's working index
    searches these keys while the store keeps the current generation's.

    Args:
        store: the store (its ids, values and metadata filters are used; the ids and values are copied).
        keys: (m, dim) the draft's key embeddings, one per stored id in order.
    """

    def __init__(self, store: Store, keys: Tensor) -> None:
        self.live = store
        live = store.table
        #: the frozen ids (m,), the draft's keys (m, dim) and the values (m, value_dim), copied; an index's key source
        self.table = VectorTable.of(live.ids.clone(), keys, live.values.clone(), live.version)
        self.device = store.device

    def ids_where(self, where: dict[str, Any]) -> Tensor:
        """The ids matching a metadata filter (read from the live store), among these records. (m,) sorted."""
        ids = self.live.ids_where(where)  # (m,)
        return ids[torch.isin(ids, self.table.ids)]


class DraftView(Protocol):
    """What a :class:`Draft` uses of one process's view of its database (met by :class:`kvsearch.view.View`, which
    ranks above this module): a draft is handed the view and what searches it, not the facade."""

    store: Store
    encoders: EncoderSet
    retriever: Retriever  # the database's: a draft's working retriever is made with its settings

    def reading(self) -> AbstractContextManager[None]:
        """One store snapshot, the view brought up to date with it first (DatabaseClosedError once closed)."""
        ...

    value_dim: int

    def record_run(self, summary: Mapping[str, Any]) -> None:
        """Record a run that committed nothing as the database's last run."""
        ...

    def switch(self, what: str, switch: Callable[..., dict[str, Any]], **options: Any) -> dict[str, Any]:
        """Run a generation switch (:func:`commit`) under the write lock; the configuration it records."""
        ...


class Draft:
    """A generation being prepared in memory by a fine-tuning run; nothing on disk changes until :meth:`commit`.

    Made by :meth:`kvsearch.Database.begin_generation`; it snapshots the view's encoders (which objects, and their
    weights) at once. The run trains them (or a copy it installs as ``db.query_encoder``); :meth:`refresh`
    re-encodes every key with the training key encoder into a working index; :meth:`candidates` searches it.
    The run ends with exactly one :meth:`commit` or :meth:`discard`. Used as a context manager, an exception
    discards.

    Args:
        view: the database's view: its store, encoders and retriever, its reads, its generation switch and its
            record of a run.
        candidates: the database's read path ``candidates(queries, k, *, targets, where)`` (:meth:`kvsearch.reads.
            Reads.candidates`): what the draft searches until :meth:`refresh` made its working index.
    """

    def __init__(self, view: DraftView, *, candidates: Callable[..., Candidates]) -> None:
        self._view = view
        self._current = candidates
        self._snapshot = view.encoders.snapshot()
        self._retriever: Retriever | None = None
        self._records: FrozenRecords | None = None  # the working keys of the last refresh
        #: ``"open"``, ``"committed"`` or ``"discarded"``.
        self.state: Literal["open", "committed", "discarded"] = "open"
        #: The generation committed (None until then).
        self.generation: int | None = None

    def refresh(self) -> None:
        """Re-encode every stored key with the (training) key encoder into a working index (memory only).

        Raises:
            NonFiniteError: the key encoder produced NaN or Inf.
            InvalidArgumentError: the draft was already committed or discarded.
        """
        self._check_open()
        view, current = self._view, self._view.retriever
        with view.store.lock:
            with view.reading():
                pass  # brings this process's view up to date first
            records = FrozenRecords(view.store, encode_keys(view.store, view.encoders.key))
        retriever = Retriever(records, dim=current.dim, spec=current.spec, score=current.score, params=current.params)
        retriever.rebuild()
        self._retriever, self._records = retriever, records

    def candidates(
        self, queries: Tensor, k: int | Literal["all"], *, targets: Tensor | None = None, where: Any = None
    ) -> Candidates:
        """As :meth:`kvsearch.Database.candidates`, over the working keys once :meth:`refresh` ran."""
        self._check_open()
        if self._retriever is None:
            return self._current(queries, k, targets=targets, where=where)
        with self._view.store.lock:
            return self._retriever.candidates(queries, k, targets=targets, where=where)

    def commit(
        self,
        *,
        values: tuple[Tensor, Tensor] | None = None,
        summary: Mapping[str, Any] | None = None,
        refreshed: bool = False,
    ) -> int:
        """Record the database's encoders as they are now as the new generation (see :func:`commit`).

        Args:
            values: (ids (n,), value embeddings (n, value_dim)) trained by the run.
            summary: a JSON-able description of the run (shown by ``kvsearch info``).
            refreshed: the caller's word that the key encoder has not changed since the last :meth:`refresh`: its
                working keys are written as they are (when the store has not changed since) instead of encoding
                every key once more.

        Returns:
            The new generation.

        Raises:
            NonFiniteError: weights or embeddings are not finite: nothing is written and the draft is discarded.
            InvalidArgumentError: the draft was already committed or discarded.
        """
        self._check_open()
        try:
            values, summary, _ = generation_args(values, summary, None, self._view.value_dim)
            encoded = self._records.table if refreshed and self._records is not None else None
            options = {"force": None, "values": values, "summary": summary, "encoded": encoded}
            self.generation = int(self._view.switch("a new generation", commit, **options)["generation"])
        except BaseException:
            self.discard()
            raise
        self.state = "committed"
        self._retriever, self._records = None, None
        return self.generation

    def discard(self, *, summary: Mapping[str, Any] | None = None) -> None:
        """Put the encoders back as they were at the start; nothing on disk changed. Harmless after commit.

        Args:
            summary: a JSON-able description of a run that ended without committing (no epoch beat the start):
                recorded as the database's last run (``encoders_info()["last_run"]``, shown by ``kvsearch info``),
                the generation unchanged. None (a run that raised, or no run): nothing is recorded.
        """
        if self.state != "open":
            return
        self._view.encoders.restore(self._snapshot)
        self._retriever, self._records = None, None
        self.state = "discarded"
        if summary is not None:
            self._view.record_run(summary)

    def _check_open(self) -> None:
        if self.state != "open":
            raise InvalidArgumentError(f"expected an open draft, got one that was {self.state}")

    def __enter__(self) -> Draft:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.state == "open":
            self.discard()

    def __repr__(self) -> str:
        return f"Draft({self.state}, refreshed={self._retriever is not None}, generation={self.generation})"
