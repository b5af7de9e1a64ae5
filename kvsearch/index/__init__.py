"""The index wing: candidate search behind one protocol that speaks torch.

It owns :class:`~kvsearch.index.base.CandidateIndex`, the registry of index kinds
:data:`~kvsearch.index.factory.INDEX_KINDS` with :func:`~kvsearch.index.factory.make_index` /
:func:`~kvsearch.index.factory.load_index` (the one place a spec string becomes an index class: ``"Flat"`` and
``"torch[:dtype]"`` the exact torch index, any other spec a FAISS one), the FAISS index (``faiss_index``, its specs
and search parameters in ``faiss_spec``), the exact torch index (``torch_index``), which exact path a call takes
(``exact_path``), the half-precision scan (``half_scan``) and the one chunked top-k with the id tie-break every
exact path ends with (``topk``). Ids and keys come in
as tensors; a :class:`~kvsearch.index.topk.SearchResult` (scores, ids, and the source rows where the index scanned
them) goes back on the queries' device.

It knows nothing of SQLite, records, text, encoders or autograd: an index only chooses ids.
"""
