"""The storage wing: what a database keeps on disk and in memory, and the folder it keeps it in.

It owns the records and their transactions (``store``, ``transaction``: SQLite, the single source of truth, and its
version), the key / value tensors gathered by id (``table``: knows nothing of the store; on the CPU, views of the
shared file mappings), reading them whole or as a delta from the change log (``catchup``), the key texts the store
reads lazily (``key_texts``), earlier versions' formats, moved or read at open (``migrate``), the SQLite file's
tables, summary triggers and connections (``schema``), the embeddings on disk in file sets every process maps
(``vector_file``) or in SQLite chunks in memory (``chunks``), behind one interface picked at open (``embeddings``),
the change log (``changelog``), row buffers with room to grow (``buffers``), files written
whole or not at all (``fileio``), the write lock (``locking``), the database folder with its index manifest
(``folder``), the encoders' files and generation folders (``encoder_files``), records carried into a new folder
under their ids by a reshard (``carry``), the stored configuration (``config``), and a ``ProductKeyMemory``'s folder
of generations (``memory_folder``: its config and state_dict, switched whole; the opener of ``folder=``).

It knows nothing of candidate indexes, attention, autograd, training or torch.distributed: it stores and hands
back tensors and texts by id.
"""
