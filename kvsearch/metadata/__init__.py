"""The metadata wing: what a record's metadata may hold and how it is filtered.

It owns metadata as stored (``codec``: checked — no NUL, no cycle, at most ``MAX_DEPTH`` deep —, JSON with tagged
datetimes / dates and numpy scalars as Python's, decoded back) and the filter language over it (``filters``: checked
into a tree, compiled to bound SQL, matched in Python). It knows nothing of embeddings, storage, indexes or the
facade: dicts and filters in, SQL text and booleans out.
"""
