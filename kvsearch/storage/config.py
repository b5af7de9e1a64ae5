"""A database's stored configuration: what a new one is created with, and what a reopen must agree with.

The configuration lives in the store (meta entry ``"config"``): format, dims, score, index spec, search
parameters and which encoders exist. This module checks the options of ``Database(...)`` against it; it knows
nothing of records, files or search.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvsearch.checks import check_dim
from kvsearch.encoders.base import Encoder
from kvsearch.errors import ConfigMismatchError, DimensionMismatchError, InvalidArgumentError
from kvsearch.nn.scores import check_db_score

__all__ = ["FORMAT", "new_config", "check_reopen"]

#: The version of the folder format this code writes and reads.
FORMAT = 1


def new_config(
    encoder: Encoder | None,
    value_encoder: Encoder | None,
    dim: int | None,
    value_dim: int | None,
    index: str | None,
    score: str | None,
    search_params: Mapping[str, float] | None,
) -> tuple[dict[str, Any], Encoder | None]:
    """The configuration of a new database, and its value encoder (the key encoder when its dim fits).

    Defaults: index ``"Flat"``, score ``"cosine"``, dims from the encoders.

    Raises:
        InvalidArgumentError: an encoder that is not an Encoder, no dim and no encoder, a non-positive dim.
        DimensionMismatchError: a dim that differs from its encoder's.
        UnknownOptionError: an unknown score.
    """
    score = check_db_score("cosine" if score is None else score)
    for name, given in (("encoder", encoder), ("value_encoder", value_encoder)):
        if given is not None and not isinstance(given, Encoder):
            raise InvalidArgumentError(f"expected a kvsearch Encoder as {name}, got {type(given).__name__}")
    if encoder is not None and dim is not None and dim != encoder.dim:
        raise DimensionMismatchError(f"expected dim {encoder.dim} (the encoder's), got dim={dim}")
    dim = encoder.dim if encoder is not None else dim
    if dim is None:
        raise InvalidArgumentError("expected an encoder or an explicit dim, got neither")
    if value_encoder is None and encoder is not None and value_dim in (None, encoder.dim):
        value_encoder = encoder
    if value_encoder is not None and value_dim is not None and value_dim != value_encoder.dim:
        raise DimensionMismatchError(
            f"expected value_dim {value_encoder.dim} (the value encoder's), got value_dim={value_dim}"
        )
    value_dim = value_encoder.dim if value_encoder is not None else value_dim
    if value_dim is None:
        raise InvalidArgumentError("expected a value_encoder, an encoder or an explicit value_dim, got none")
    dim, value_dim = check_dim(dim, "dim"), check_dim(value_dim, "value_dim")
    config = {
        "format": FORMAT,
        "dim": dim,
        "value_dim": value_dim,
        "score": score,
        "index": "Flat" if index is None else index,
        "search_params": dict(search_params or {}),
    }
    return config, value_encoder


#: How to change what a reopen may not: said in the message.
_HOW_TO_CHANGE = {
    "index": (
        ". The index is fixed when a database is created; to change it, copy the records into a new folder with "
        "another: `kvsearch reshard SRC DST --shards 1 --index SPEC` (Python: "
        "kvsearch.reshard(src, dst, num_shards=1, index=SPEC)), then open DST"
    ),
    "score": ". The score is fixed when a database is created (it decides the index's metric); query(score=...) "
    "weighs one call's candidates with another",
}


def check_reopen(
    saved: Mapping[str, Any], where: object, search_params: Mapping[str, float] | None, **given: Any
) -> dict[str, Any]:
    """The configuration to reopen with: the saved one, with ``search_params`` merged in.

    Args:
        saved: the stored configuration.
        where: the folder, for messages.
        search_params: parameters to set on top of the saved ones.
        given: ``dim``, ``value_dim``, ``index``, ``score`` as passed (None: not given).

    Raises:
        ConfigMismatchError: another format, or a given option that differs from the saved one.
    """
    if saved.get("format") != FORMAT:
        raise ConfigMismatchError(f"expected database format {FORMAT}, got {saved.get('format')!r}")
    for name, value in given.items():
        if value is not None and value != saved[name]:
            raise ConfigMismatchError(
                f"{where} was created with {name}={saved[name]!r}; got {name}={value!r}. "
                f"Open it without {name}, or use another folder{_HOW_TO_CHANGE.get(name, '')}."
            )
    config = dict(saved)
    if search_params:
        config["search_params"] = {**saved.get("search_params", {}), **search_params}
    return config
