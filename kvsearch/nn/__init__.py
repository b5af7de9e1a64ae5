"""The nn wing: pure torch attention over candidates, as functions and modules.

It owns the score functions (``scores``: the one registry of built-in scores, ``SCORE_KINDS`` — dot, scaled dot,
cosine, gaussian and the learned additive, each with what it has of an index metric, streaming form and relevance
— the learned score modules, and ``DB_SCORES``, those a database can search by), pooling (``pooling``:
softmax, normalize, nonnegative, hard, exact, average, with masks), :func:`~kvsearch.nn.attend.attend` and
:class:`~kvsearch.nn.attend.Candidates` (``attend``), the :class:`~kvsearch.nn.kv_attention.KVAttention` layer
(``kv_attention``), the :class:`~kvsearch.nn.product_keys.ProductKeyMemory` memory layer (``product_keys``: exact
top-k over n^2 learned slots through product keys) and its slots as records (``product_slots``: reads, edits,
freezing, metadata by the filter language, usage), dense streaming attention over every record (``streaming``),
the precision, ``torch.compile`` and ``torch.func.vmap`` rules (``precision``), and the fork handlers that keep the
CPU's OpenMP threads usable in a child of ``fork()`` (``forking``, registered when kvsearch is imported).

It knows nothing of FAISS, SQLite, text or files: it takes already-gathered tensors (a layer takes an object with a
``candidates`` method; a product-key memory holds its own keys and values) and gives back tensors that gradients flow
through.
"""
