"""Encoders by name: the kinds a saved encoder names, and :func:`encoder_from_name` for the command line.

It knows nothing of files, storage or search.
"""

from __future__ import annotations

import os

import torch

from kvsearch.encoders.base import Encoder
from kvsearch.encoders.ngram import NgramEncoder
from kvsearch.encoders.sentence import SentenceEncoder
from kvsearch.errors import InvalidArgumentError, UnknownOptionError

__all__ = ["ENCODER_KINDS", "encoder_from_name"]

_SENTENCE_ALIASES = ("minilm", "sentence")

ENCODER_KINDS: dict[str, type[Encoder]] = {"ngram": NgramEncoder, "sentence": SentenceEncoder}


def encoder_from_name(name: str, device: str | torch.device | None = None) -> Encoder:
    """Build an encoder from a short name or a model folder.

    Args:
        name: ``"ngram"`` -> ``NgramEncoder()``; ``"minilm"`` or ``"sentence"`` ->
            ``SentenceEncoder()`` (all-MiniLM-L6-v2, offline); the path of an existing folder ->
            ``SentenceEncoder(path)``. Names are matched case-insensitively.
        device: Where to put the encoder; None -> CUDA when present, else the CPU.

    Returns:
        A fresh encoder with default settings.

    Raises:
        InvalidArgumentError: If ``name`` is not a str.
        UnknownOptionError: If ``name`` is neither a known name nor an existing folder.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise InvalidArgumentError(f"encoder name must be a str, got {type(name).__name__}")
    key = os.fspath(name).strip().lower()
    if key == "ngram":
        return NgramEncoder(device=device)
    if key in _SENTENCE_ALIASES:
        return SentenceEncoder(device=device)
    if os.path.isdir(name):
        return SentenceEncoder(os.fspath(name), device=device)
    raise UnknownOptionError(
        f"unknown encoder {name!r}: expected 'ngram', one of {list(_SENTENCE_ALIASES)}, "
        "or the path of a sentence-transformers model folder"
    )
