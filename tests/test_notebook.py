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


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> tuple[nbformat.NotebookNode, Path, float]:
    """The committed notebook executed afresh (its outputs cleared first) with the working directory in a temporary
    folder, so it writes there/indexes/names: the notebook, the folder and the seconds it took."""
    folder = tmp_path_factory.mktemp("notebook")
    copy = folder / "name_lookup.ipynb"
    shutil.copy(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    started = time.perf_counter()
    nbclient.NotebookClient(  # raises CellExecutionError, naming the cell, when a cell fails
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    ).execute()
    return nb, folder, time.perf_counter() - started


def test_notebook_runs(executed, record_property):
    nb, folder, seconds = executed
    record_property("notebook_seconds", round(seconds, 1))
    print(f"notebook executed in {seconds:.1f} s")
    assert (folder / "indexes" / "names" / "store.sqlite").is_file()
    out = stdout_of(nb)
    assert "lookup(\"Li\") -> 'Mu'" in out
    assert "exact query: found=False, value=None" in out
    assert "softmax answer: 'Zachary'" in out
    before, after = map(float, re.search(r"recall@1\s+([\d.]+)\s+([\d.]+)", out).groups())
    assert after > before + 0.3  # fine-tuning learned the transliteration on held-out names
    autograd, finite = map(float, re.search(r"autograd ([-\d.]+), finite difference ([-\d.]+)", out).groups())
    assert autograd == pytest.approx(finite, rel=0.05)


#: What changes from run to run and is not compared: run times ("in 16 s") and object addresses.
VOLATILE = [(re.compile(r"\b\d+(\.\d+)? s\b"), "<seconds> s"), (re.compile(r"0x[0-9a-fA-F]+"), "0x<address>")]
#: A number (an integer or a decimal, signed): compared within a tolerance, the words around it exactly.
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def outputs_of(cell: nbformat.NotebookNode) -> list[tuple[str, str]]:
    """A code cell's outputs as (kind, text): consecutive chunks of one stream joined (how a stream is cut into
    chunks depends on timing), a display by its MIME types and its text form, volatile text masked."""
    out: list[tuple[str, str]] = []
    for output in cell.outputs:
        if output.output_type == "stream":
            kind, text = f"stream {output.name}", output.text
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
                continue
        elif output.output_type in ("display_data", "execute_result"):
            kind, text = f"{output.output_type} {' '.join(sorted(output.data))}", output.data.get("text/plain", "")
        else:
            kind, text = output.output_type, output.get("ename", "")
        out.append((kind, text))
    for pattern, mask in VOLATILE:
        out = [(kind, pattern.sub(mask, text)) for kind, text in out]
    return out


def same_text(committed: str, fresh: str) -> bool:
    """Equal words; numbers equal within 0.02 (absolute) or 2 % (a trained model's last digits may differ with
    the machine's thread count)."""
    if NUMBER.split(committed) != NUMBER.split(fresh):
        return False
    pairs = zip(map(float, NUMBER.findall(committed)), map(float, NUMBER.findall(fresh)))
    return all(a == pytest.approx(b, abs=0.02, rel=0.02) for a, b in pairs)


def test_same_text_masks_what_varies_and_compares_the_rest():
    assert same_text("fine-tuned in <seconds> s, 51 steps", "fine-tuned in <seconds> s, 51 steps")
    assert same_text("recall@1 0.587 after Davis ok", "recall@1 0.590 after Davis ok")
    assert not same_text("recall@1 0.587", "recall@1 0.700")  # a number that moved
    assert not same_text("after Davis ok", "after Lowry wrong")  # a word that changed
    assert not same_text("files: ['encoder.json']", "files: ['store.sqlite', 'encoder.json']")
    stream = nbformat.v4.new_output("stream", name="stdout", text="ran in 15 s\n")
    cell = nbformat.v4.new_code_cell(outputs=[stream, nbformat.v4.new_output("stream", name="stdout", text="ok\n")])
    assert outputs_of(cell) == [("stream stdout", "ran in <seconds> s\nok\n")]


def test_committed_outputs_match_a_fresh_run(executed):
    """The committed notebook shows what running it gives today: as many cells, each with the same kinds of output
    (streams, figures), the same printed text (run times and addresses aside, numbers within a tolerance)."""
    committed = nbformat.read(NOTEBOOK, as_version=4)
    fresh = executed[0]
    assert [c.cell_type for c in committed.cells] == [c.cell_type for c in fresh.cells]
    for number, (old, new) in enumerate(zip(committed.cells, fresh.cells)):
        if old.cell_type != "code":
            continue
        was, now = outputs_of(old), outputs_of(new)
        assert [kind for kind, _ in was] == [kind for kind, _ in now], f"cell {number}: other kinds of output"
        for (kind, text), (_, fresh_text) in zip(was, now):
            assert same_text(text, fresh_text), (
                f"cell {number} ({kind}):\n{text}\n-- a fresh run prints --\n{fresh_text}"
            )
