"""The encoders of one database — key, value, query-side — as one object: opened, reloaded, marked and saved.

    encoders = EncoderSet.create(files, device, key=NgramEncoder(), value=None, value_dim=256)
    encoders.query                      # the query-side encoder after fine-tuning, else None
    encoders.changed()                  # whether any weight changed since they were loaded or saved
    encoders.save(config)               # crash-safe, with digests (see kvsearch.folder.EncoderFiles)

It knows which encoders a configuration records (``"encoder"``, ``"value_encoder"``: None / ``"key"`` /
``"own"``, ``"query_encoder"``), checks encoders a user passes on reopen against the stored ones, and notices
changes without hashing weights. It knows nothing of the store's records, search or attention.
"""

from __future__ import annotations

from typing import Any

import torch

from kvsearch.encoders import Encoder
from kvsearch.errors import ConfigMismatchError, DimensionMismatchError, InvalidArgumentError
from kvsearch.folder import EncoderFiles

__all__ = ["EncoderSet", "value_encoder_kind"]


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

    def __init__(self, files: EncoderFiles, device: torch.device) -> None:
        self.files = files
        self.device = device
        self.key: Encoder | None = None
        self.value: Encoder | None = None
        self.query: Encoder | None = None
        self._marks: tuple = ()

    @classmethod
    def create(
        cls, files: EncoderFiles, device: torch.device, *, key: Encoder | None, value: Encoder | None
    ) -> EncoderSet:
        """The encoders of a new database (moved to ``device``; the value encoder may be the key encoder)."""
        encoders = cls(files, device)
        encoders.key = None if key is None else key.to(device)
        encoders.value = None if value is None else (encoders.key if value is key else value.to(device))
        return encoders

    @classmethod
    def reopen(
        cls,
        files: EncoderFiles,
        device: torch.device,
        config: dict[str, Any],
        *,
        key: Encoder | None,
        value: Encoder | None,
        where: object,
    ) -> EncoderSet:
        """The encoders a stored configuration records, loaded (and checked) from the folder.

        An encoder passed in must have the stored configuration; it gets the stored (possibly fine-tuned)
        weights.

        Raises:
            ConfigMismatchError: a given encoder differs from the stored one, or is given where none is stored.
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
        loaded = self.files.load(prefix, self.device)
        if given is None:
            return loaded
        if given.config() != loaded.config():
            raise ConfigMismatchError(f"{where} was created with {prefix} {loaded.config()}; got {given.config()}")
        given.load_state_dict(loaded.state_dict())  # the stored (possibly fine-tuned) weights win
        return given.to(self.device)

    def set_query(self, encoder: Encoder | None, dim: int) -> None:
        """Install (or with None remove) the query-side encoder.

        Raises:
            InvalidArgumentError: not an Encoder or None.
            DimensionMismatchError: its dim is not ``dim``.
        """
        if encoder is not None and not isinstance(encoder, Encoder):
            got = type(encoder).__name__
            raise InvalidArgumentError(f"expected a kvsearch Encoder or None as query_encoder, got {got}")
        if encoder is not None and encoder.dim != dim:
            raise DimensionMismatchError(f"expected a query encoder of dim {dim}, got dim {encoder.dim}")
        self.query = None if encoder is None else encoder.to(self.device)

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

    def _state(self) -> tuple:
        """A cheap mark of the weights: each tensor's storage and its in-place-write counter.

        Every optimizer step, ``load_state_dict`` or in-place change bumps a tensor's version counter; a new
        tensor has a new storage.
        """
        marks = []
        for prefix, encoder in self.by_prefix().items():
            if encoder is not None:
                tensors = encoder.state_dict(keep_vars=True)
                marks.append((prefix, id(encoder), tuple((n, t.data_ptr(), t._version) for n, t in tensors.items())))
        return tuple(marks)

    def mark(self) -> None:
        """Remember the current weights as the saved ones."""
        self._marks = self._state()

    def changed(self) -> bool:
        """Whether an encoder changed (trained, replaced, added) since the last load or save."""
        return self._state() != self._marks

    def reload(self, config: dict[str, Any]) -> None:
        """Load the weights another process saved into these encoder objects (and a new query encoder)."""
        for prefix, encoder in self.by_prefix().items():
            if encoder is not None and self.files.has(prefix):
                encoder.load_state_dict(self.files.load(prefix, self.device).state_dict())
        if config.get("query_encoder") and self.query is None:
            self.query = self.files.load("query_encoder", self.device)
        self.mark()

    def save(self, config: dict[str, Any]) -> dict[str, Any]:
        """Write every encoder with its digests and ``config`` updated with :meth:`flags`; the caller holds the locks.

        Returns:
            The configuration as stored.
        """
        config = {**config, **self.flags()}
        self.files.save({prefix: e for prefix, e in self.by_prefix().items() if e is not None}, config)
        self.mark()
        return config
