"""The lexical encoder: hashed character n-grams, summed and L2-normalised.

:class:`NgramEncoder` (``kind="ngram"``) hashes the character n-grams of a text into the rows of an
``nn.EmbeddingBag`` and sums them. Keys that are spelled alike are close ("Li" is nearest to "Lipton"). Its weights
are rebuilt from a seed, so it is cheap to store, and it is trainable end to end.

It knows nothing of files, storage or search.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvsearch.checks import check_device, check_dim, check_fits
from kvsearch.encoders.base import NORM_EPS, Encoder, check_positive_int, check_texts
from kvsearch.errors import InvalidArgumentError

__all__ = ["NgramEncoder"]


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
    config alone rebuilds the encoder exactly (:func:`kvsearch.storage.encoder_files.save_encoder` then writes
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
        self.dim = check_dim(check_positive_int("dim", dim))
        self.num_buckets = check_positive_int("num_buckets", num_buckets)
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
        texts = check_texts(texts)
        if not texts:
            return self._empty()
        ids_per_text = [_bucket_ids(t, *self.ngram_range, self.lowercase, self.num_buckets) for t in texts]
        lengths = [len(ids) for ids in ids_per_text]
        flat = [i for ids in ids_per_text for i in ids]
        device = self.device
        indices = torch.tensor(flat, dtype=torch.long, device=device)  # (total_ngrams,)
        offsets = torch.tensor([0, *lengths[:-1]], dtype=torch.long, device=device).cumsum(0)  # (n,)
        summed = self.embedding(indices, offsets)  # (n, dim); empty bags give zero rows
        return F.normalize(summed, p=2, dim=-1, eps=NORM_EPS)  # (n, dim)

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
