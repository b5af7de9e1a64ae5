"""The ``kvsearch`` command line, run as a subprocess as a user would.

Every command — build, query, info, delete, finetune, demo and ``--help`` — runs at least once as a subprocess
(the ``kvsearch`` console script), checked on its exit status, its stdout and its stderr: empty on success
(progress bars aside, where they are on), exactly one line on an error. Each run pays the torch import (a
second or two), so variations — every command's help, argument errors, the text form of ``info`` — are
checked in-process through ``main()``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvsearch
from kvsearch.cli import build_parser, main
from kvsearch.demo import AUTHORS

SCRIPT = Path(sys.executable).with_name("kvsearch")  # the console script pip installs next to python
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "kvsearch.cli"]
SUBCOMMANDS = ["build", "query", "info", "delete", "finetune", "demo"]


# a tqdm line: "desc:  42%|####      | 5/12 [00:01<00:02, 3.9it/s]" or "desc: 4rec [00:00, 6660.27rec/s]"
PROGRESS_BAR = re.compile(r"^[^\[]*\[\d+:\d\d(:\d\d)?[<,]")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def error_lines(stderr: str) -> list[str]:
    """stderr without tqdm's progress bar lines (tqdm redraws a line with a carriage return)."""
    return [line for line in stderr.splitlines() if line.strip() and not PROGRESS_BAR.match(line)]


def copy_of(built: Path, tmp_path: Path) -> Path:
    db = tmp_path / "names"
    shutil.copytree(built, db)
    return db


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The authors database built once by ``kvsearch build`` from a CSV file (tests copy it before writing)."""
    folder = tmp_path_factory.mktemp("cli")
    source = folder / "authors.csv"
    source.write_text("last,first\n" + "".join(f"{k},{v}\n" for k, v in AUTHORS.items()))
    result = run("build", str(folder / "names"), "--from", str(source), "--key", "last", "--value", "first")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"added 6 records from {source} to {folder / 'names'} (6 records in all)"
    assert "encoding + indexing" in result.stderr  # the progress bar
    return folder / "names"


def test_query_table_matches_the_engine(built):
    result = run("query", str(built), "Li", "Lipto", "--k", "3", "--temperature", "0.5")
    assert result.returncode == 0, result.stderr
    with kvsearch.Database(built) as db:
        expected = db.query(["Li", "Lipto"], k=3, temperature=0.5)
    blocks = result.stdout.strip().split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == [
        "query 'Li' (softmax): answer 'Mu'",
        "query 'Lipto' (softmax): answer 'Zachary'",
    ]
    for b, block in enumerate(blocks):
        rows = [line.split() for line in block.splitlines()[3:]]  # after the title, header and rule
        order = torch.argsort(expected.weights[b], descending=True)
        assert [r[0] for r in rows] == [expected.keys[b][i] for i in order.tolist()]
        assert [r[1] for r in rows] == [AUTHORS[r[0]] for r in rows]
        torch.testing.assert_close(
            torch.tensor([float(r[2]) for r in rows]), expected.weights[b][order], atol=1e-4, rtol=0
        )


def test_exact_query_json_and_not_found(built):
    result = run("query", str(built), "Li", "Lix", "--pooling", "exact", "--json")
    assert result.returncode == 1
    answers = json.loads(result.stdout)
    assert [(a["query"], a["found"], a["value"]) for a in answers] == [("Li", True, "Mu"), ("Lix", False, None)]
    assert answers[0]["candidates"] == [
        {"id": answers[0]["candidates"][0]["id"], "key": "Li", "value": "Mu", "weight": 1.0}
    ]
    assert answers[1]["candidates"] == []
    assert error_lines(result.stderr) == ["kvsearch query: not found: no record has the key 'Lix'"]


def test_info_as_a_user_runs_it(built):
    result = run("info", str(built), "--json")
    assert result.returncode == 0 and result.stderr == ""
    info = json.loads(result.stdout)
    size = sum(f.stat().st_size for f in built.rglob("*") if f.is_file())
    assert info["records"] == 6 and info["indexed"] == 6
    assert (info["dim"], info["value_dim"], info["index"], info["score"]) == (256, 256, "Flat", "cosine")
    assert info["encoder"]["kind"] == "ngram" and info["value_encoder"] == "the key encoder"
    assert info["size_bytes"] == size


def test_info_as_text(built, capsys):
    assert main(["info", str(built)]) == 0  # in-process: the same code without another torch import
    text = capsys.readouterr().out
    assert "records        6" in text and "encoder        kind=ngram" in text


def test_delete_as_a_user_runs_it_then_exact_query_is_not_found(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    refused = run("delete", str(db), "Li", "Nobody")
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == "kvsearch delete: error: expected a stored key, got 'Nobody'; nothing was deleted\n"
    deleted = run("delete", str(db), "Li")
    assert (deleted.returncode, deleted.stdout, deleted.stderr) == (0, f"deleted 1 record from {db} (5 left)\n", "")
    assert main(["query", str(db), "Li", "--pooling", "exact"]) == 1  # in-process: one torch import less
    captured = capsys.readouterr()
    assert captured.out.strip() == "query 'Li' (exact): not found"
    assert captured.err == "kvsearch query: not found: no record has the key 'Li'\n"
    with kvsearch.Database(db) as reopened:
        assert len(reopened) == 5 and "Li" not in reopened
        assert reopened.search("Li", k=1)[0].key == "Lipton"


def test_bad_file_is_one_line_and_leaves_nothing(tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text('{"key": "a", "value": "1"}\n{"key": "", "value": "2"}\n{oops\n{"key": "a", "value": "3"}\n')
    result = run("build", str(tmp_path / "db"), "--from", str(source))
    assert result.returncode == 1
    (line,) = error_lines(result.stderr)
    assert line.startswith(f"kvsearch build: error: '{source}' has 3 bad rows, nothing was written: line 2: empty key")
    assert "line 3: bad JSON" in line and "line 4: duplicate key 'a' (first on line 1)" in line
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "db").exists()  # a database that the failed build created is removed again
    with pytest.raises(kvsearch.BadFileError):  # --debug lets the exception (and its traceback) through
        main(["--debug", "build", str(tmp_path / "db"), "--from", str(source), "--quiet"])
    assert not (tmp_path / "db").exists()


def test_demo_as_a_user_runs_it(tmp_path):
    result = run("demo", "--path", str(tmp_path / "names"), cwd=tmp_path)  # .ci/run runs `kvsearch demo` too
    assert result.returncode == 0
    assert error_lines(result.stderr) == []  # only the sentence model's loading bar, no warning or error
    out = result.stdout
    assert "exact lookup \"Li\"            -> 'Mu'" in out
    assert "found=False" in out and "Lipton->Zachary" in out
    assert re.search(r"NgramEncoder  : Lipton \(", out)  # the lexical encoder finds Lipton first for "Li"
    assert (tmp_path / "names" / "store.sqlite").is_file()


def test_finetune_as_a_user_runs_it(built, tmp_path):
    db = copy_of(built, tmp_path)
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("query\ttarget\nLipto\tLipton\nSmolla\tSmola\nZang\tZhang\nWernes\tWerness\n")
    result = run(
        "finetune", str(db), "--pairs", str(pairs), "--eval", str(pairs), "--epochs", "1", "--k", "4", "--quiet"
    )
    assert (result.returncode, result.stderr) == (0, "")  # --quiet: no progress bar
    lines = result.stdout.splitlines()
    assert lines[0].startswith("epoch=0  step=0  recall@1=") and len(lines) == 3  # before, after epoch 0, summary
    assert lines[-1].startswith(f"fine-tuned {db} on 4 pairs for 1 epochs in ")
    assert not (built / "query_encoder.safetensors").exists()
    assert (db / "query_encoder.safetensors").is_file()  # the trained query encoder is saved with the database
    with kvsearch.Database(db) as reopened:
        assert reopened.search("Zang", k=1)[0].key == "Zhang"


def test_finetune_bad_pairs_is_one_line(built, tmp_path, capsys):
    db = copy_of(built, tmp_path)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("query,target\nLipto,Lipton\n,Smola\n")
    assert main(["finetune", str(db), "--pairs", str(pairs), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"kvsearch finetune: error: '{pairs}' has 1 bad rows, nothing was trained: line 3: empty query or target\n"
    )


def test_top_level_help_as_a_user_runs_it():
    result = run("--help")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("usage: kvsearch [-h]")
    assert all(f"    {name}" in result.stdout for name in SUBCOMMANDS)


def test_build_minilm_quiet_prints_only_its_result(tmp_path, capfd):
    """``--quiet`` silences every bar, the sentence model's "Loading weights" bar too; query, info and delete
    never show it."""
    source = tmp_path / "authors.csv"
    source.write_text("last,first\n" + "".join(f"{k},{v}\n" for k, v in AUTHORS.items()))
    # Without --quiet (in-process, to save a model load in another process): both bars are there to silence.
    assert main(["build", str(tmp_path / "loud"), "--from", str(source), "--key", "last", "--value", "first",
                 "--encoder", "minilm"]) == 0  # fmt: skip
    err = capfd.readouterr().err
    assert "Loading weights" in err and "encoding + indexing" in err
    result = run("build", str(tmp_path / "db"), "--from", str(source), "--key", "last", "--value", "first",
                 "--encoder", "minilm", "--quiet")  # fmt: skip
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"added 6 records from {source} to {tmp_path / 'db'} (6 records in all)\n"
    assert main(["query", str(tmp_path / "db"), "Li", "--json"]) == 0
    captured = capfd.readouterr()
    assert captured.err == "" and json.loads(captured.out)[0]["value"] == "Mu"


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvsearch {name}")


@pytest.mark.parametrize(
    "argv",
    [
        ["query", "db"],
        ["query", "db", "Li", "--k", "0"],
        ["build", "db"],
        ["frobnicate"],
        ["query", "db", "x", "--pooling", "max"],
    ],
)
def test_usage_errors_are_one_line_with_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and lines[0].endswith("--help)")


def test_commands_on_a_missing_database_do_not_create_one(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nothing")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"kvsearch info: error: no kvsearch database at '{tmp_path / 'nothing'}' (expected a folder with store.sqlite)"
    )
    assert not (tmp_path / "nothing").exists()


def test_a_build_that_fails_before_ingest_leaves_no_folder(tmp_path, capsys):
    source = tmp_path / "a.csv"
    source.write_text("key,value\nLi,Mu\n")
    assert main(["build", str(tmp_path / "db"), "--from", str(source), "--index", "Bogus", "--quiet"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kvsearch build: error: FAISS cannot build an index from the spec 'Bogus'")
    assert not (tmp_path / "db").exists()
