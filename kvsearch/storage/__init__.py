"""The storage wing: what a database keeps on disk and in memory, and the folder it keeps it in.

It owns the records and their transactions (``store``, ``transaction``: SQLite, the single source of truth, and its
version), the key / value tensors gathered by id and their catch-up from the change log (``mirror``: on the CPU,
views of the shared file mappings), the key texts it reads lazily (``key_texts``), the move of an earlier version's
store (``legacy``), the SQLite file's tables, summary triggers and connections (``schema``), the embeddings on disk
in file sets every process maps (``vector_file``) or in SQLite chunks in memory (``chunks``), the choice between the
two (``embeddings``), the change log (``changelog``), row buffers with room to grow (``buffers``), files written
whole or not at all (``fileio``), the write lock (``locking``), the database folder with its index manifest
(``folder``), the encoders' files and generation folders (``encoder_files``) and the stored configuration
(``config``).

It knows nothing of candidate indexes, attention, autograd, training or torch.distributed: it stores and hands
back tensors and texts by id.
"""
