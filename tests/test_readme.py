"""README.md's and docs/LAYER.md's Python examples run as written.

Every ```python block of the README is executed in order in one namespace, as a reader pasting them one
after the other into one interpreter would, in a fresh working directory and offline. A block that raises
fails the test with its number and its first line. The whole sequence then runs a second time in the same
namespace: pasting the examples twice works too (they write into a fresh folder of their own, never into
the demo's ``indexes/names``).
"""

from __future__ import annotations

import re
import tempfile
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
LAYER_DOC = README.with_name("docs") / "LAYER.md"
PYTHON_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def python_blocks(text: str) -> list[str]:
    """The source of every ```python block of ``text``, in order."""
    return [match.group(1) for match in PYTHON_BLOCK.finditer(text)]


def first_line(source: str) -> str:
    """The first non-empty line of a block: how a failure names it."""
    return next((line.strip() for line in source.splitlines() if line.strip()), "<empty block>")


def run_blocks(blocks: list[str], namespace: dict[str, object], round_: str, doc: str = "README.md") -> None:
    """Execute ``blocks`` in order in ``namespace``; fail naming the block that raised."""
    for number, source in enumerate(blocks, start=1):
        code = compile(source, f"{doc} python block {number}", "exec")
        try:
            exec(code, namespace)
        except Exception as exc:
            pytest.fail(
                f"{doc} python block {number} of {len(blocks)} ({first_line(source)!r}) raised on the "
                f"{round_} run: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                pytrace=False,
            )


def test_the_readme_has_the_examples_this_test_runs():
    """The examples are there, and the (query text, target key) pairs train with finetune's defaults (no loss=)."""
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3, "expected the Use, torch layer and fine-tuning examples as ```python blocks"
    assert any("finetune(" in block and "rollback_encoders()" in block for block in blocks)
    (key_pairs,) = [block for block in blocks if "# pairs: (query text, target key)" in block]
    assert "finetune(db, train_pairs" in key_pairs and "loss=" not in key_pairs and "targets=" not in key_pairs
    assert python_blocks("text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = 2\n```\n") == [
        "a = 1\n",
        "b = 2\n",
    ]


def test_every_python_block_of_the_readme_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' mkdtemp() folders land here
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    namespace: dict[str, object] = {"__name__": "__readme__"}
    try:
        run_blocks(blocks, namespace, "first")
        run_blocks(blocks, namespace, "second")  # pasted twice
    finally:
        db = namespace.get("db")
        close = getattr(db, "close", None)
        if callable(close):
            close()
    assert not (tmp_path / "indexes" / "names").exists()  # the demo's folder is left alone


def test_every_python_block_of_the_layer_doc_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    blocks = python_blocks(LAYER_DOC.read_text(encoding="utf-8"))
    assert any("ProductKeyMemory" in block for block in blocks)
    namespace: dict[str, object] = {"__name__": "__layer_doc__"}
    run_blocks(blocks, namespace, "first", doc="docs/LAYER.md")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", "docs/RELIABILITY.md", "docs/ARCHITECTURE.md", "docs/LAYER.md"])
def test_every_link_lands(doc: str) -> None:
    """A link to a section names a heading of the page; a link to a file names a file of the repository; a
    'see <Section>' names a heading (the README's 'see Scale-out' pointed to none)."""
    path = README.parent / doc
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    anchors = {github_anchor(h) for h in headings}
    assert github_anchor("Scale-out: a sharded database") == "scale-out-a-sharded-database"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        if file:
            assert (path.parent / file).exists(), f"{doc} links to {file}, which does not exist"
        elif anchor:
            assert anchor in anchors, f"{doc} links to #{anchor}, not a heading of it: {sorted(anchors)}"
    for name in re.findall(r"\(see ([A-Z][\w-]*(?: [\w-]+)*)\)", text):
        name = re.sub(r" (below|above)$", "", name).lower()
        assert any(name in h.lower() for h in headings), f"{doc} says 'see {name}': no such section"
