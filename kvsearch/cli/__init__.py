"""The cli wing: the ``kvsearch`` command.

It owns the program (``program``: parse, run, one-line errors and exit statuses), the argument parser
(``parser``), the commands (``commands``), what they print (``printing``), streaming CSV / TSV / JSONL ingest
(``ingest``: :func:`~kvsearch.cli.ingest.ingest_file`, :func:`~kvsearch.cli.ingest.upsert_file`), datetimes and
dates in its JSON (``datetimes``: the tagged form ``--where``, JSONL and ``--json`` share) and the quickstart
(``demo``).

It opens the facades (:class:`~kvsearch.database.Database`, :class:`~kvsearch.distributed.ShardedDatabase`) and
drives them through :class:`~kvsearch.contract.DatabaseProtocol`; it knows nothing of how they store or search, and
nothing in the package imports it.
"""

from __future__ import annotations

from kvsearch.cli.program import main

__all__ = ["main"]
