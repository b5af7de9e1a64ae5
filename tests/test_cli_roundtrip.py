"""The command line's round trip as a user runs it, each step a subprocess: ``build --metadata`` -> ``query
--where`` -> a build killed with SIGKILL midway -> ``build --upsert``, which converges to the file's content (every
key once, with the file's value and metadata) and prints how many records it added, replaced and left alone.

The n-gram encoder (the default of ``build``) keeps each step at a torch import plus well under a second of work.
The build is killed once its progress bar shows a quarter of the records written: the bar counts a batch once it
is committed, so the store then holds whole batches, at least a quarter of the file and not all of it.
"""

from __future__ import annotations

import csv
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvsearch
from kvsearch.cli.demo import AUTHORS
from kvsearch.cli.program import main
from kvsearch.metadata.filters import matches

SCRIPT = Path(sys.executable).with_name("kvsearch")  # the console script pip installs next to python
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kvsearch.cli"]
YEARS = {"Zhang": 2015, "Lipton": 2014, "Li": 2013, "Smola": 1999, "Hu": 2020, "Werness": 2019}
LANGS = {"Zhang": "zh", "Lipton": "en", "Li": "zh", "Smola": "de", "Hu": "en", "Werness": "en"}
PROGRESS = re.compile(rb"encoding \+ indexing:[^\r\n]*?(\d+)/(\d+)")
PROGRESS_BAR = re.compile(r"^[^\[]*\[\d+:\d\d(:\d\d)?[<,]")  # a tqdm line, as in test_cli.py


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, env=env, timeout=300)


def error_lines(stderr: str) -> list[str]:
    """stderr without tqdm's progress bar lines."""
    return [line for line in stderr.splitlines() if line.strip() and not PROGRESS_BAR.match(line)]


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_build_with_metadata_then_query_where(tmp_path, capsys):
    source = tmp_path / "authors.csv"
    write_csv(
        source,
        [{"last": k, "first": v, "year": str(YEARS[k]), "lang": LANGS[k], "note": "x"} for k, v in AUTHORS.items()],
    )
    db = tmp_path / "authors"
    built = run("build", str(db), "--from", str(source), "--key", "last", "--value", "first",
                "--metadata", "year", "lang", "--quiet")  # fmt: skip
    assert (built.returncode, built.stderr) == (0, "")
    assert built.stdout == f"added 6 records from {source} to {db} (6 records in all)\n"

    where = {"year": {"$gte": 2014}, "lang": {"$ne": "zh"}}
    result = run("query", str(db), "Li", "--k", "6", "--where", json.dumps(where), "--json")
    assert (result.returncode, result.stderr) == (0, "")
    (answer,) = json.loads(result.stdout)
    assert sorted(c["key"] for c in answer["candidates"]) == ["Hu", "Lipton", "Werness"]  # every match, no other
    for c in answer["candidates"]:  # the CSV's numbers are stored as numbers; "note" was not asked for
        assert c["metadata"] == {"year": YEARS[c["key"]], "lang": LANGS[c["key"]]} and matches(c["metadata"], where)
    assert answer["value"] in {"Zachary", "Rachel", "Brent"}

    with pytest.raises(SystemExit) as exit_:  # in-process (a usage error: argparse exits)
        main(["query", str(db), "Li", "--where", '{"year": {"$gte": 2014}'])  # unbalanced: not JSON
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvsearch query: error: argument --where: expected a JSON object such as")


def big_rows(n: int, *, start: int = 0) -> list[dict[str, str]]:
    """n records name00000 ... with a value, a year (a number in the CSV) and a language."""
    langs = ("en", "de", "zh")
    return [
        {"key": f"name{i:05d}", "value": f"value {i}", "year": str(1950 + i % 70), "lang": langs[i % 3]}
        for i in range(start, start + n)
    ]


def build_killed_midway(db: Path, source: Path, *, batch_size: int, total: int, upsert: bool = False) -> float:
    """Run ``kvsearch build`` (``--upsert``) as a subprocess and SIGKILL it once its bar shows a quarter of
    ``total`` written.

    Returns:
        The seconds from the start to the kill.
    """
    started = time.monotonic()
    argv = ["build", str(db), "--from", str(source), "--metadata", "all", "--batch-size", str(batch_size)]
    argv += ["--upsert"] if upsert else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([*COMMAND, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    seen = b""
    try:
        while True:
            ready, _, _ = select.select([proc.stderr], [], [], 60)
            chunk = os.read(proc.stderr.fileno(), 65536) if ready else b""
            if not chunk:
                pytest.fail(f"the build ended (or hung) before a quarter was written: {seen[-500:]!r}")
            seen += chunk
            written = [int(m.group(1)) for m in PROGRESS.finditer(seen[-4096:])]
            if written and total // 4 <= written[-1] < total:
                proc.send_signal(signal.SIGKILL)
                break
        return time.monotonic() - started
    finally:
        proc.kill()  # a no-op after the SIGKILL above
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
        assert proc.returncode == -signal.SIGKILL


def test_a_killed_build_leaves_nothing_and_a_killed_upsert_is_finished_by_build_upsert(tmp_path, capsys):
    total, batch = 3000, 50
    rows = big_rows(total)
    source = tmp_path / "names.csv"
    write_csv(source, rows)
    db = tmp_path / "names"

    # a plain build is one transaction: killed midway, it leaves nothing of the file
    build_killed_midway(db, source, batch_size=batch, total=total)
    with kvsearch.Database(db) as opened:
        assert len(opened) == 0

    # an upsert commits batch by batch: killed midway, it keeps whole batches, in file order
    killed_after = build_killed_midway(db, source, batch_size=batch, total=total, upsert=True)
    with kvsearch.Database(db) as opened:
        stored = len(opened)
        ids = opened.ids_of_keys([r["key"] for r in rows])
    assert total // 4 <= stored < total and stored % batch == 0, (stored, killed_after)
    assert (ids >= 0).tolist() == [i < stored for i in range(total)]

    # a re-run without --upsert refuses the whole file, and says how to finish the job
    assert main(["build", str(db), "--from", str(source), "--metadata", "all", "--quiet"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvsearch build: error: '{source}' has {stored} bad rows, nothing was written ")
    assert "upsert with 'kvsearch build --upsert'" in line

    # meanwhile the file changed: 7 stored values, 5 stored languages, 9 new records at its end
    for i in range(7):
        rows[i]["value"] += " (new)"
    for i in range(10, 15):
        rows[i]["lang"] = "fr"
    rows += big_rows(9, start=total)
    write_csv(source, rows)

    started = time.monotonic()
    result = run("build", str(db), "--from", str(source), "--metadata", "all", "--upsert", "--batch-size", "500")
    upsert_seconds = time.monotonic() - started
    assert result.returncode == 0 and error_lines(result.stderr) == [], result.stderr
    added, replaced = total - stored + 9, 7 + 5
    assert result.stdout == (
        f"upserted {source} into {db}: {added} added, {replaced} replaced, {stored - replaced} unchanged "
        f"({total + 9} records in all)\n"
    )

    with kvsearch.Database(db) as opened:  # every key once, with the file's value and metadata
        assert len(opened) == len(rows) == total + 9
        ids = opened.ids_of_keys([r["key"] for r in rows]).tolist()
        assert len(set(ids)) == len(rows) and min(ids) >= 1
        for row, id_ in zip(rows, ids):
            record = opened.get(id_)
            assert (record.key, record.value) == (row["key"], row["value"])
            assert record.metadata == {"year": int(row["year"]), "lang": row["lang"]}
        assert opened.search("name00012", k=1, where={"lang": "fr"})[0].key == "name00012"

    # once converged, an upsert writes nothing
    assert main(["build", str(db), "--from", str(source), "--metadata", "all", "--upsert", "--quiet"]) == 0
    assert capsys.readouterr().out == (
        f"upserted {source} into {db}: 0 added, 0 replaced, {total + 9} unchanged ({total + 9} records in all)\n"
    )
    print(f"killed after {killed_after:.1f} s with {stored} of {total} records; build --upsert {upsert_seconds:.1f} s")
