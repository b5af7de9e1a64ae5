"""The encoders wing: text -> embeddings.

It owns the :class:`Encoder` base (``base``), the character n-gram encoder (``ngram``), the sentence-transformers
encoder (``sentence``), the encoder kinds by name (``registry``: ``ENCODER_KINDS``, :func:`encoder_from_name`),
a database's encoders (key, value, query-side) as one object (``encoder_set``), and the switches that keep a model's
loading and saving quiet (``quiet``: transformers' and huggingface_hub's progress bars, for the block only).

It knows nothing of records, candidate search or attention; an encoder set is handed the files object it reads
and writes (``kvsearch.storage.encoder_files``), and knows nothing of their format.
"""

from __future__ import annotations

from kvsearch.encoders.base import Encoder
from kvsearch.encoders.ngram import NgramEncoder
from kvsearch.encoders.registry import encoder_from_name
from kvsearch.encoders.sentence import SentenceEncoder

__all__ = ["Encoder", "NgramEncoder", "SentenceEncoder", "encoder_from_name"]
