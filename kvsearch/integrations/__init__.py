"""Adapters to other libraries, each an optional extra imported only when its module is imported.

- :mod:`kvsearch.integrations.langchain`: ``KVSearchVectorStore``, a LangChain vector store and retriever over a
  kvsearch database (``pip install 'kvsearch[langchain]'``).
- :mod:`kvsearch.integrations.haystack`: ``KVSearchDocumentStore``, ``KVSearchEmbeddingRetriever`` and
  ``KVSearchTextEmbedder``, a Haystack document store and components over a kvsearch database
  (``pip install 'kvsearch[haystack]'``).

Importing :mod:`kvsearch` never imports these modules or their libraries. An adapter uses the facade's public
methods only and knows nothing of the store, the index or the encoders' internals.
"""

from __future__ import annotations
