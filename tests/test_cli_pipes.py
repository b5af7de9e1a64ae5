"""The command line in a pipe whose reader goes away (``kvsearch query ... | head -1``): the command ends quietly
with status 141 (128 + SIGPIPE, :data:`kvsearch.cli.program.CLOSED_OUTPUT_STATUS`), as ``git`` and ``grep`` do,
nothing on stderr, and a ``build --upsert`` whose report finds its pipe closed has committed every record.

Each case runs the command as a subprocess with a real pipe on stdout. ``query`` and ``list`` print far more than a
pipe buffer holds (64 KiB on Linux), so reading one line and closing the pipe is what ``| head -1`` does: the
command is still writing when the reader leaves. ``info`` and ``build`` print a few lines at the end, which a pipe
buffer would swallow whole; their reader closes the pipe before they write, so their write certainly fails.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvsearch
from kvsearch.cli.program import CLOSED_OUTPUT_STATUS, main

ROOT = str(Path(kvsearch.__file__).resolve().parent.parent)  # this checkout, for the subprocesses
SCRIPT = Path(sys.executable).with_name("kvsearch")  # the console script pip installs next to python
CONSOLE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kvsearch.cli"]
MODULE = [sys.executable, "-m", "kvsearch"]
RECORDS = 2000  # list and query --json print well past a 64 KiB pipe buffer


def closed_pipe_run(command: list[str], *args: str, lines: int) -> tuple[list[bytes], int, str]:
    """Run a command with stdout into a pipe, read ``lines`` lines (0: none), close the pipe, wait.

    Returns:
        The lines read, the exit status and stderr.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    proc = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    read = [proc.stdout.readline() for _ in range(lines)]
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=300)
    return read, proc.returncode, stderr.decode()


def write_csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "value"])
        writer.writerows(rows)
    return path


def records_of(path: Path) -> list[tuple[int, str, object, dict]]:
    with kvsearch.Database(path) as db:
        return [(r.id, r.key, r.value, r.metadata) for r in db.where({}).records()]


@pytest.fixture(scope="module")
def big_db(tmp_path_factory) -> Path:
    """A database of :data:`RECORDS` text records (n-gram encoder), built in this process."""
    folder = tmp_path_factory.mktemp("pipes")
    rows = [(f"key{i:05d}", f"value number {i} " + "x" * 40) for i in range(RECORDS)]
    source = write_csv(folder / "records.csv", rows)
    options = ["--from", str(source), "--key", "key", "--value", "value", "--quiet"]
    assert main(["build", str(folder / "db"), *options]) == 0
    return folder / "db"


@pytest.mark.parametrize(
    ("command", "args", "lines"),
    [
        (CONSOLE, ["query", "{db}", "key00001", "key00002", "--k", "all", "--json"], 1),
        (CONSOLE, ["list", "{db}"], 1),
        (MODULE, ["info", "{db}"], 0),
    ],
    ids=["query", "list", "info-module"],
)
def test_a_closed_pipe_ends_the_command_quietly(big_db, command, args, lines):
    read, status, stderr = closed_pipe_run(command, *(a.format(db=big_db) for a in args), lines=lines)
    assert all(line.strip() for line in read)  # the command had begun to print
    assert stderr == ""  # no traceback, no "error: BrokenPipeError", no "Exception ignored"
    assert status == CLOSED_OUTPUT_STATUS == 141


def test_an_upsert_whose_report_finds_its_pipe_closed_has_committed_everything(big_db, tmp_path):
    changed = [(f"key{i:05d}", f"changed {i}") for i in range(0, RECORDS, 7)]
    added = [(f"new{i:05d}", f"new value {i}") for i in range(500)]
    source = write_csv(tmp_path / "upsert.csv", changed + added)
    piped, reference = tmp_path / "piped", tmp_path / "reference"
    shutil.copytree(big_db, piped)
    shutil.copytree(big_db, reference)
    options = ["--from", str(source), "--key", "key", "--value", "value", "--upsert", "--quiet"]

    read, status, stderr = closed_pipe_run(CONSOLE, "build", str(piped), *options, lines=0)
    assert main(["build", str(reference), *options]) == 0  # the same upsert with nobody closing its output

    assert (read, stderr, status) == ([], "", CLOSED_OUTPUT_STATUS)
    assert records_of(piped) == records_of(reference)
    assert len(records_of(piped)) == RECORDS + len(added)
