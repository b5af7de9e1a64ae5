"""The encoder interface: text -> float32 ``(n, dim)`` embeddings on the encoder's device.

:class:`Encoder` is what every encoder of a database implements (:class:`~kvsearch.encoders.ngram.NgramEncoder`,
:class:`~kvsearch.encoders.sentence.SentenceEncoder`). ``forward`` is the gradient-enabled path (training);
``encode`` is the batched inference path (no grad, eval mode).

Saving and loading live in :mod:`kvsearch.storage.encoder_files` (``save_encoder``, ``load_encoder``); an encoder
only says what it needs saved: :meth:`Encoder.config` rebuilds it, and :meth:`Encoder.needs_weights` says whether
its weights must be written beside the config.

This module knows nothing of the database folder, storage or search.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from kvsearch.checks import check_unicode
from kvsearch.errors import InvalidArgumentError

__all__ = ["Encoder", "NORM_EPS", "check_texts", "check_positive_int"]

NORM_EPS = 1e-12  # F.normalize eps: an all-zero row stays all zero (finite), never NaN

# --------------------------------------------------------------------------- helpers


def check_texts(texts: object) -> list[str]:
    """Check that ``texts`` is a list or tuple of str and return it as a list."""
    if isinstance(texts, str):
        raise InvalidArgumentError(
            f"texts must be a list of str, got a bare str {texts[:40]!r}: pass a list, e.g. [{texts[:40]!r}]"
        )
    if not isinstance(texts, (list, tuple)):
        raise InvalidArgumentError(f"texts must be a list or tuple of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidArgumentError(f"texts[{i}] must be a str, got {type(text).__name__}: {text!r:.60}")
        check_unicode(text, f"texts[{i}]")
    return list(texts)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {value!r}")
    return value


# --------------------------------------------------------------------------- base class


class Encoder(nn.Module, abc.ABC):
    """Abstract text encoder: a list of texts -> an ``(n, dim)`` float32 tensor.

    Subclasses implement :meth:`forward` (with grad), :meth:`config` and :meth:`needs_weights`,
    and set ``dim``. Encoders are built in eval mode; a trainer calls ``.train()`` itself.

    Attributes:
        dim: The output dimension.
        kind: The registry name (``"ngram"`` or ``"sentence"``), stored in the config.
        trained: Set to True by the trainer after fine-tuning. A :class:`SentenceEncoder`
            needs its weights saved only when it is set (or its model was given as an instance);
            an :class:`NgramEncoder` decides by comparing its weights with the seeded
            initialisation and ignores it.
    """

    kind: ClassVar[str] = ""
    dim: int
    trained: bool

    def __init__(self) -> None:
        super().__init__()
        self.trained = False

    @abc.abstractmethod
    def forward(self, texts: Sequence[str]) -> Tensor:
        """Embed texts on the gradient-enabled (trainable) path.

        Args:
            texts: A list or tuple of str.

        Returns:
            A float32 tensor of shape ``(len(texts), dim)`` on :attr:`device`.

        Raises:
            InvalidArgumentError: If ``texts`` is not a list/tuple of str.
        """

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """The JSON-serialisable ``{"kind": ..., **constructor args}`` that rebuilds this encoder."""

    @abc.abstractmethod
    def needs_weights(self) -> bool:
        """Whether the weights must be saved beside :meth:`config`: the config alone does not rebuild them."""

    @property
    def device(self) -> torch.device:
        """The device where the encoder's parameters live."""
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Eval mode and no grad for the duration; the previous train/eval mode is restored."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.train(was_training)

    def _empty(self) -> Tensor:
        return torch.zeros(0, self.dim, dtype=torch.float32, device=self.device)  # (0, dim)

    def encode(self, texts: Sequence[str], *, batch_size: int = 256, show_progress: bool = False) -> Tensor:
        """Embed texts for inference: no grad, eval mode for the duration, in batches.

        Args:
            texts: A list or tuple of str (a bare str is refused: wrap it in a list).
            batch_size: How many texts go through the encoder at once (>= 1). The result does
                not depend on it.
            show_progress: Show a tqdm progress bar over the batches.

        Returns:
            A float32 tensor of shape ``(len(texts), dim)`` on :attr:`device`, without grad.
            An empty list gives a ``(0, dim)`` tensor.

        Raises:
            InvalidArgumentError: If ``texts`` is not a list/tuple of str (the message names the
                index and type of the first bad item), or ``batch_size`` is not an int >= 1.
        """
        texts = check_texts(texts)
        batch_size = check_positive_int("batch_size", batch_size)
        if not texts:
            return self._empty()
        starts = range(0, len(texts), batch_size)
        if show_progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="Encoding", unit="batch")
        with self._eval_mode():
            chunks = [self.forward(texts[start : start + batch_size]) for start in starts]  # [(b, dim)]
        return torch.cat(chunks, dim=0)  # (n, dim)
