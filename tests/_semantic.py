"""The fine-tuning study's semantic tasks (``benchmarks/semantic_tasks.py``), loaded from their file for the tests.

Loaded by path, not by putting ``benchmarks/`` on ``sys.path``: its ``common.py`` and ``plots.py`` would shadow other
imports in the same pytest run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "semantic_tasks", Path(__file__).resolve().parent.parent / "benchmarks" / "semantic_tasks.py"
)
semantic_tasks = importlib.util.module_from_spec(_SPEC)
sys.modules["semantic_tasks"] = semantic_tasks  # dataclasses look their module up by name
_SPEC.loader.exec_module(semantic_tasks)

__all__ = ["semantic_tasks"]
