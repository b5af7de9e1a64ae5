"""The text wing: what is done to strings alone — noise models that misspell them, and the edit similarity that
re-orders hits by spelling.

It owns the noise models (typos, respellings, case, transliteration) and the generated (noisy query, key) pairs
(``noise``), and ``search(rerank=)``'s re-ordering of hits by an edit similarity (``rerank``). It knows nothing of
embeddings, storage, indexes or training: strings in, strings (or re-ordered hits) out.
"""
