"""The demo notebook: it is in sync with its generator, and it still runs top to bottom without an error.

nbformat and nbclient are imported directly (not skipped when missing): the dev extra, which the tests need,
installs them.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "name_lookup.ipynb"
GENERATOR = ROOT / "notebooks" / "make_name_lookup.py"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_name_lookup", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stdout_of(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_committed_notebook_matches_its_generator_and_has_outputs():
    committed = nbformat.read(NOTEBOOK, as_version=4)
    generated = load_generator().build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in generated.cells]
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)  # committed executed, so it reads without running
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for c in code for o in c.outputs) >= 6  # the figures


def test_notebook_runs(tmp_path, record_property):
    """Execute a copy with the working directory in tmp_path, so it writes tmp_path/indexes/names."""
    copy = tmp_path / "name_lookup.ipynb"
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    started = time.perf_counter()
    nbclient.NotebookClient(  # raises CellExecutionError, naming the cell, when a cell fails
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    seconds = time.perf_counter() - started
    record_property("notebook_seconds", round(seconds, 1))
    print(f"notebook executed in {seconds:.1f} s")
    assert (tmp_path / "indexes" / "names" / "store.sqlite").is_file()
    out = stdout_of(nb)
    assert "lookup(\"Li\") -> 'Mu'" in out
    assert "exact query: found=False, value=None" in out
    assert "softmax answer: 'Zachary'" in out
    before, after = map(float, re.search(r"recall@1\s+([\d.]+)\s+([\d.]+)", out).groups())
    assert after > before + 0.3  # fine-tuning learned the transliteration on held-out names
    autograd, finite = map(float, re.search(r"autograd ([-\d.]+), finite difference ([-\d.]+)", out).groups())
    assert autograd == pytest.approx(finite, rel=0.05)
