"""Adapters to other libraries, each an optional extra imported only when its module is imported.

- :mod:`kvsearch.integrations.langchain`: ``KVSearchVectorStore``, a LangChain vector store and retriever over a
  kvsearch database (``pip install 'kvsearch[langchain]'``).

Importing :mod:`kvsearch` never imports these modules or their libraries.
"""

from __future__ import annotations
