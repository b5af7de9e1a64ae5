"""The encoders of one database — key, value, query-side — as one object: opened, reloaded, marked and saved.

    encoders = EncoderSet.create(files, device, key=NgramEncoder(), value=None)
    encoders.query                      # the query-side encoder after fine-tuning, else None
    encoders.changed_parts()            # which encoders changed since they were loaded or saved
    snap = encoders.snapshot(); ...; encoders.restore(snap)   # a fine-tuning run that is not kept

It knows which encoders a configuration records (``"encoder"``, ``"value_encoder"``: None / ``"key"`` /
``"own"``, ``"query_encoder"``), checks encoders a user passes on reopen against the stored ones, and notices
changes without hashing weights; new generations are written by :mod:`kvsearch.generations`. It knows nothing
of the store's records, search or attention, nor of the files' formats: it is handed the folder's encoder files
(:class:`EncoderFolder`, what it reads of :class:`kvsearch.storage.encoder_files.EncoderFiles`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from kvsearch.encoders.base import Encoder
from kvsearch.errors import ConfigMismatchError, DimensionMismatchError, InvalidArgumentError

__all__ = ["EncoderSet", "EncoderFolder", "value_encoder_kind"]


class EncoderFolder(Protocol):
    """What the encoders read of a database folder's encoder files: handed in by the view, which opens
    :class:`kvsearch.storage.encoder_files.EncoderFiles` (the encoders wing knows nothing of the files themselves)."""

    folder: Path | None  # the database folder, None in memory

    def has(self, prefix: str) -> bool:
        """Whether the current generation has the encoder ``prefix``'s files."""
        ...

    def load(self, prefix: str, device: str | torch.device | None = None) -> Encoder:
        """The encoder ``prefix`` of the current generation, checked against its recorded digests."""
        ...

    def restore_config(self, prefix: str, encoder: Encoder) -> None:
        """Rewrite the current generation's missing ``{prefix}.json`` from ``encoder``, if it is the recorded one."""
        ...


def value_encoder_kind(value: Encoder | None, key: Encoder | None) -> str | None:
    """How a configuration records the value encoder: None, ``"key"`` (the key encoder) or ``"own"``."""
    return None if value is None else ("key" if value is key else "own")


class EncoderSet:
    """The key, value and query-side encoders of a database, on its device.

    Args:
        files: the folder's encoder files (loads are checked against their recorded digests).
        device: where the encoders live.

    Attributes:
        key: encodes key texts (and query texts when there is no query encoder), or None.
        value: encodes value texts (may be the key encoder itself), or None.
        query: a query-side encoder of its own (fine-tuned with ``train="query"``), or None.
    """

    def __init__(self, files: EncoderFolder, device: torch.device) -> None:
        self.files = files
        self.device = device
        self.key: Encoder | None = None
        self.value: Encoder | None = None
        self.query: Encoder | None = None
        self._marks: dict[str, tuple] = {}

    @classmethod
    def create(
        cls, files: EncoderFolder, device: torch.device, *, key: Encoder | None, value: Encoder | None
    ) -> EncoderSet:
        """The encoders of a new database (moved to ``device``; the value encoder may be the key encoder)."""
        encoders = cls(files, device)
        encoders.key = None if key is None else key.to(device)
        encoders.value = None if value is None else (encoders.key if value is key else value.to(device))
        return encoders

    @classmethod
    def reopen(
        cls,
        files: EncoderFolder,
        device: torch.device,
        config: dict[str, Any],
        *,
        key: Encoder | None,
        value: Encoder | None,
        where: object,
    ) -> EncoderSet:
        """The encoders a stored configuration records, loaded (and checked) from the folder.

        An encoder passed in must have the stored configuration; it gets the stored (possibly fine-tuned)
        weights. When the current generation's ``{prefix}.json`` is missing, the one passed in rewrites it if its
        configuration has the recorded digest (see :meth:`~kvsearch.storage.encoder_files.EncoderFiles.restore_config`).

        Raises:
            ConfigMismatchError: a given encoder differs from the stored one, or is given where none is stored.
            MissingFileError: an encoder's json is missing and no encoder with the recorded digest was passed.
            CorruptDatabaseError: an encoder file is damaged or does not match its recorded digest.
        """
        encoders = cls(files, device)
        encoders.key = encoders._open("encoder", bool(config["encoder"]), key, where)
        if config["value_encoder"] == "key":
            if value is not None and value is not key:
                raise ConfigMismatchError(f"{where} encodes values with the key encoder; got a value_encoder")
            encoders.value = encoders.key
        else:
            encoders.value = encoders._open("value_encoder", config["value_encoder"] == "own", value, where)
        # databases made before query encoders existed have no "query_encoder" entry: they have none
        encoders.query = encoders._open("query_encoder", bool(config.get("query_encoder", False)), None, where)
        encoders.mark()
        return encoders

    def _open(self, prefix: str, stored: bool, given: Encoder | None, where: object) -> Encoder | None:
        if not stored:
            if given is not None:
                raise ConfigMismatchError(f"{where} was created without {prefix}; got one")
            return None
        if given is not None and self.files.folder is not None and not self.files.has(prefix):
            self.files.restore_config(prefix, given)  # the json was deleted: rewritten if ``given`` is the recorded one
        loaded = self.files.load(prefix, self.device)
        if given is None:
            return loaded
        if given.config() != loaded.config():
            raise ConfigMismatchError(f"{where} was created with {prefix} {loaded.config()}; got {given.config()}")
        if not same_weights(given, loaded):
            # the stored (possibly fine-tuned) weights win; an encoder that holds them already is left untouched
            # (several shards of a sharded database share one encoder object: none must see it change)
            given.load_state_dict(loaded.state_dict())
        return given.to(self.device)

    def set_query(self, encoder: Encoder | None, dim: int) -> None:
        """Install (or with None remove) the query-side encoder.

        Raises:
            InvalidArgumentError: not an Encoder or None.
            DimensionMismatchError: its dim is not ``dim``.
        """
        _check_side(encoder, dim, "query")
        unchanged = "query_encoder" not in self.changed_parts()
        same = encoder is not None and self.query is not None and same_weights(encoder, self.query)
        self.query = None if encoder is None else encoder.to(self.device)
        if unchanged and same:  # another object with the very same weights (shards sharing one copy): nothing to save
            self._marks["query_encoder"] = self._state()["query_encoder"]

    def set_value(self, encoder: Encoder | None, value_dim: int) -> None:
        """Install (or with None remove) the value encoder, as given (it may be the key encoder itself).

        Raises:
            InvalidArgumentError: not an Encoder or None.
            DimensionMismatchError: its dim is not ``value_dim``.
        """
        _check_side(encoder, value_dim, "value")
        self.value = encoder

    @property
    def for_queries(self) -> Encoder | None:
        """The encoder of query texts: the query-side one when set, else the key encoder."""
        return self.key if self.query is None else self.query

    def by_prefix(self) -> dict[str, Encoder | None]:
        """The encoders by file prefix (a value encoder that is the key encoder is listed once)."""
        own_values = self.value is not None and self.value is not self.key
        return {"encoder": self.key, "value_encoder": self.value if own_values else None, "query_encoder": self.query}

    def flags(self) -> dict[str, Any]:
        """What a configuration records of these encoders."""
        return {
            "encoder": self.key is not None,
            "value_encoder": value_encoder_kind(self.value, self.key),
            "query_encoder": self.query is not None,
        }

    def _state(self) -> dict[str, tuple]:
        """A cheap mark of each encoder's weights: its identity, each tensor's storage and in-place-write counter.

        Every optimizer step, ``load_state_dict`` or in-place change bumps a tensor's version counter; a new
        tensor has a new storage. ``"value_encoder"`` is marked by identity only when it is the key encoder.
        """
        marks: dict[str, tuple] = {}
        for prefix, encoder in (("encoder", self.key), ("value_encoder", self.value), ("query_encoder", self.query)):
            if encoder is None:
                marks[prefix] = ()
            elif prefix == "value_encoder" and encoder is self.key:
                marks[prefix] = ("key", id(encoder))
            else:
                tensors = encoder.state_dict(keep_vars=True)
                marks[prefix] = (id(encoder), tuple((n, t.data_ptr(), t._version) for n, t in tensors.items()))
        return marks

    def mark(self) -> None:
        """Remember the current weights as the saved ones."""
        self._marks = self._state()

    def changed_parts(self) -> set[str]:
        """The prefixes whose encoder changed (trained, replaced, added, removed) since the last load or save."""
        now = self._state()
        return {prefix for prefix, mark in now.items() if self._marks.get(prefix) != mark}

    def changed(self) -> bool:
        """Whether any encoder changed since the last load or save."""
        return bool(self.changed_parts())

    def snapshot(self) -> dict[str, Any]:
        """The encoders as they are now — which objects, and a copy of their weights — for :meth:`restore`."""
        objects = {id(e): e for e in (self.key, self.value, self.query) if e is not None}
        states = {i: {n: t.detach().clone() for n, t in e.state_dict().items()} for i, e in objects.items()}
        return {
            "key": self.key,
            "value": self.value,
            "query": self.query,
            "states": states,
            "marked": not self.changed(),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Put the encoders back as :meth:`snapshot` found them (objects and weights)."""
        self.key, self.value, self.query = snapshot["key"], snapshot["value"], snapshot["query"]
        for encoder in {id(e): e for e in (self.key, self.value, self.query) if e is not None}.values():
            encoder.load_state_dict(snapshot["states"][id(encoder)])
        if snapshot["marked"]:
            self.mark()

    def install(self, loaded: dict[str, Encoder | None], flags: dict[str, Any]) -> None:
        """Take the encoders of another generation: weights loaded into the objects held where they fit.

        Args:
            loaded: prefix -> the loaded encoder (or None) for ``"encoder"``, ``"value_encoder"``, ``"query_encoder"``.
            flags: that generation's :meth:`flags` (``"value_encoder"``: None, ``"key"`` or ``"own"``).
        """

        def adopt(held: Encoder | None, new: Encoder | None) -> Encoder | None:
            if new is None:
                return None
            if held is not None and held.config() == new.config():
                held.load_state_dict(new.state_dict())
                return held
            return new.to(self.device)

        value_held = None if self.value is self.key else self.value
        self.key = adopt(self.key, loaded.get("encoder"))
        kind = flags.get("value_encoder")
        self.value = self.key if kind == "key" else adopt(value_held, loaded.get("value_encoder") if kind else None)
        self.query = adopt(self.query, loaded.get("query_encoder"))
        self.mark()

    def reload(self, config: dict[str, Any]) -> None:
        """Take the encoders another process switched to (the current generation's, per ``config``'s flags)."""
        loaded = {
            prefix: self.files.load(prefix, self.device) if self.files.has(prefix) else None
            for prefix in ("encoder", "value_encoder", "query_encoder")
        }
        self.install(loaded, config)


def same_weights(a: Encoder, b: Encoder) -> bool:
    """Whether two encoders are the same encoder: equal configuration and equal weights (on any device)."""
    if a is b:
        return True
    if type(a) is not type(b) or a.config() != b.config():
        return False
    mine, theirs = a.state_dict(), b.state_dict()
    return mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n].to(mine[n].device)) for n in mine)


def _check_side(encoder: object, dim: int, side: str) -> None:
    """An encoder set on one side (``"query"``, ``"value"``) is an Encoder of that side's dim, or None.

    Raises:
        InvalidArgumentError: not an Encoder or None. DimensionMismatchError: its dim is not ``dim``.
    """
    if encoder is None:
        return
    if not isinstance(encoder, Encoder):
        raise InvalidArgumentError(
            f"expected a kvsearch Encoder or None as {side}_encoder, got {type(encoder).__name__}"
        )
    if encoder.dim != dim:
        raise DimensionMismatchError(f"expected a {side} encoder of dim {dim}, got dim {encoder.dim}")
