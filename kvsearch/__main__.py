"""``python -m kvsearch``: the ``kvsearch`` command (as ``python -m kvsearch.cli``), where its console script is not
on the PATH."""

from __future__ import annotations

from kvsearch.cli.program import main

raise SystemExit(main())
